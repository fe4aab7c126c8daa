"""The ``fxmem`` command line (also ``python -m estimator``).

    fxmem report gpt --size gpt2-small --batch 8
    fxmem report resnet --size resnet50 --batch 64 --budget 80GiB --json

Exit codes: 0 success, 2 bad arguments or input (argparse's convention), 3 the model could
not be captured.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys

EXAMPLES = """examples:
  fxmem report gpt --size gpt2-small --batch 8
  fxmem report resnet --size resnet50 --batch 64 --mode inference
  fxmem report llama --size 7b --batch 1 --device-init meta --budget 80GiB
  fxmem report mlp --json
"""
EXIT_INPUT, EXIT_CAPTURE = 2, 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxmem",
        description="Static memory estimates of PyTorch training steps, as formulas in the batch size.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser(
        "report", help="peak memory of one step of a zoo model", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rep.add_argument("model", help="a models_zoo name (mlp, resnet, gpt, llama, …)")
    rep.add_argument("--size", default="debug", help="the zoo size (default: debug)")
    rep.add_argument("--batch", type=int, default=8, help="batch size to evaluate at (default: 8)")
    rep.add_argument("--mode", choices=("train", "inference"), default="train")
    rep.add_argument("--optimizer", default="adamw", help="sgd, sgd-momentum, adam, adamw, … or 'none'")
    rep.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32", help="parameter dtype")
    rep.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="target device to predict")
    rep.add_argument(
        "--device-init", choices=("meta", "cpu"), default="meta",
        help="where the model is built (default meta: no memory of model size is allocated)",
    )
    rep.add_argument("--budget", help="also print the largest batch that fits, e.g. 80GiB")
    rep.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


_DTYPES = {"fp32": None, "fp16": "float16", "bf16": "bfloat16"}


def _report(args) -> int:
    import torch

    import estimator
    import models_zoo

    if args.model not in models_zoo.names():
        close = difflib.get_close_matches(args.model, models_zoo.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise estimator.InputError(f"unknown model {args.model!r}{hint}; known: {', '.join(models_zoo.names())}")
    dtype = getattr(torch, _DTYPES[args.dtype]) if _DTYPES[args.dtype] else None
    try:
        model, make_sample, loss_fn = models_zoo.get(args.model, args.size, device=args.device_init, dtype=dtype)
    except ValueError as exc:
        raise estimator.InputError(str(exc)) from None
    sample = make_sample(args.batch) if isinstance(args.batch, int) and args.batch > 0 else make_sample(2)
    if dtype is not None:
        sample = _cast_floats(sample, dtype)
    optimizer = None if args.optimizer.lower() == "none" else args.optimizer
    rep = estimator.report(
        model, sample, batch=args.batch, mode=args.mode, optimizer=optimizer, loss_fn=loss_fn, device=args.device
    )
    fit = rep.max_batch(args.budget) if args.budget else None
    if args.json:
        data = rep.to_dict()
        if args.budget:
            data["budget"] = {"bytes": estimator.parse_bytes(args.budget), "max_batch": fit}
        print(json.dumps(data, indent=2))
    else:
        print(rep)
        if args.budget:
            print(f"\nlargest batch that fits in {args.budget}: {fit}")
    return 0


def _cast_floats(sample, dtype):
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, sample)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from estimator.errors import CaptureError, InputError

    try:
        return _report(args)
    except InputError as exc:
        print(f"fxmem: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except CaptureError as exc:
        print(f"fxmem: cannot capture the model: {exc}", file=sys.stderr)
        return EXIT_CAPTURE
    except KeyboardInterrupt:
        print("fxmem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
