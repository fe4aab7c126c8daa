"""The GPU validation suite: fxmem's CUDA predictions against a real CUDA run.

Two halves, so that the GPU's time goes to measuring only:

- ``python -m validators.gpu predict`` (any machine, no GPU): predicts the cases for the
  suite's GPU (all, or those ``--models`` names) and writes them into
  ``validators/gpu_predictions.json`` (commit it), keeping the other cases' predictions;
- ``python -m validators.gpu measure`` (on the GPU): runs every case for real
  (``validators.cuda.measure_cuda``: warm-up step, ``empty_cache()``,
  ``reset_peak_memory_stats()``, the measured step), compares, and writes
  ``docs/validation-gpu.json`` and ``docs/validation-gpu.md``.

The cases: zoo models (``CASES``: train and inference, fp32 and bf16 weights, the built-in
step) and users' own steps (``STEP_CASES``, ``--models steps``: patterns of
``models_zoo.steps`` predicted with ``report(step=fn)`` and measured by
``validators.cuda.measure_cuda_user_step``).

``python -m validators.gpu`` does both, predicting first the cases the predictions file lacks
(all of them if it was made for another GPU or torch version).  A case that fails on the GPU
is reported, not fatal: the others are still compared and written.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from models_zoo import steps

GPU = "H200"
OPTIMIZER = "adamw"
MODES = ("train", "inference")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (zoo name, size, batch sizes): sizes that fit one H200 in fp32 training and keep the suite
# under 8 minutes there (each case is built, warmed up and measured once per batch size).
CASES = (
    ("mlp", "small", (8, 32, 128)),
    ("resnet", "resnet50", (8, 16, 32)),
    ("unet", "small", (2, 8, 16)),
    ("vit", "vit-b16", (8, 16, 32)),
    ("gpt", "gpt2-small", (2, 4, 8)),
    ("bert", "base", (4, 8, 16)),
    ("rnn", "small", (8, 32, 64)),
    ("lora", "small", (4, 8, 16)),
    ("tied_autoencoder", "small", (8, 32, 128)),
    ("llama", "debug", (2, 8, 32)),
    ("lstm_lm", "small", (8, 32, 64)),
    ("custom_op", "small", (8, 32, 128)),
)


@dataclass(frozen=True)
class StepCase:
    """A user's own step, ``models_zoo.steps.CASES[name]`` (its step function, state factory and
    mode), on a model and samples sized for the GPU."""

    name: str
    make_model: Callable[[], nn.Module]
    make_sample: Callable[[int], Any]
    batches: tuple[int, ...]

    @property
    def case(self) -> steps.Case:
        return steps.CASES[self.name]


STEPS = "steps"  # Prediction.model of a user step (its size: the case's name)
# Net(1024, 4096): 21.0 M fp32 parameters (84 MB; with AdamW's state and the gradients 336 MB),
# well above the two 32 MiB cuBLAS workspaces; at b = 8192 each (b, 4096) activation is 128 MiB.
_NET = (functools.partial(steps.net, 1024, 4096), functools.partial(steps.data, d=1024), (512, 8192))
_GAN = (functools.partial(steps.gan, 128, 1024, 4096), functools.partial(steps.gan_data, d=1024, z=128), (512, 8192))
_GPT = (functools.partial(steps.gpt, "gpt2-small"), functools.partial(steps.gpt_data, size="gpt2-small"), (2, 8))
STEP_CASES = tuple(StepCase(name, *scale) for name, scale in (
    ("output dropped before backward", _NET),
    ("zero_grad(set_to_none=False)", _NET),
    ("clip_grad_norm_ + loss.item()", _NET),
    ("bf16 autocast + GradScaler + clipping", _NET),
    ("EMA (AveragedModel)", _NET),
    ("optimizer step fused into backward", _NET),
    ("test-time augmentation (inference)", _NET),
    ("GAN: two optimizers", _GAN),
    ("GPT: nanoGPT-style loop with EMA", _GPT),
))
PREDICTIONS = Path(__file__).with_name("gpu_predictions.json")
RESULTS_JSON = Path("docs/validation-gpu.json")
RESULTS_MD = Path("docs/validation-gpu.md")


@dataclass(frozen=True)
class Prediction:
    model: str
    size: str
    mode: str
    dtype: str
    batch: int
    allocated: int  # predicted max_memory_allocated
    reserved: int  # predicted max_memory_reserved
    device: int  # predicted nvidia-smi used (reserved + context estimate)
    estimate_seconds: float  # of the capture shared by the case's batch sizes


@dataclass(frozen=True)
class Row:
    prediction: Prediction
    allocated: int
    reserved: int
    device_used: int | None

    def error(self, predicted: int, measured: int | None) -> float | None:
        return None if not measured else 100.0 * (predicted - measured) / measured

    @property
    def allocated_error(self) -> float:
        return self.error(self.prediction.allocated, self.allocated)

    @property
    def reserved_error(self) -> float:
        return self.error(self.prediction.reserved, self.reserved)


def _sample(make_sample, batch: int, dtype: torch.dtype, device) -> Any:
    """The zoo's sample at ``batch``, floating tensors in ``dtype``, on ``device``."""
    sample = make_sample(batch)
    return tree_map_only(
        torch.Tensor, lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype), sample
    )


def _at_batches(capture: Callable[[int], Any], batches: tuple[int, ...]) -> Iterator[tuple[int, Any, float]]:
    """``(batch, CudaMemory, seconds)`` for each batch size: one capture at the first
    (``capture(batch) -> Report``, timed) evaluated at every batch its formula holds for, a
    capture of its own for the others."""
    start = time.perf_counter()
    rep = capture(batches[0])
    seconds = time.perf_counter() - start
    for batch in batches:
        inside = batch >= rep.valid_from and (rep.valid_to is None or batch <= rep.valid_to)
        yield batch, rep.on_device(batch) if inside else capture(batch).cuda, seconds


def predict(cases=CASES, gpu: str = GPU) -> Iterator[Prediction]:
    import estimator
    import models_zoo

    for name, size, batches in cases:
        for mode in MODES:
            for dtype_name, dtype in DTYPES.items():
                model, make_sample, loss_fn = models_zoo.get(name, size, device="meta", dtype=dtype)

                def capture(batch):
                    return estimator.report(model, _sample(make_sample, batch, dtype, "meta"), batch=batch, mode=mode,
                                            optimizer=OPTIMIZER, loss_fn=loss_fn, device="cuda", gpu=gpu)

                for batch, memory, seconds in _at_batches(capture, batches):
                    yield Prediction(name, size, mode, dtype_name, batch, memory.allocated, memory.reserved,
                                     memory.device, seconds)


def predict_steps(cases: tuple[StepCase, ...] = STEP_CASES, gpu: str = GPU) -> Iterator[Prediction]:
    """Users' own steps: ``estimator.report(model, sample, step=fn, optimizer=state_factory,
    mode=, device="cuda", gpu=gpu)`` on a CPU model (the capture fakes it; a ``.item()`` needs
    no weights).  ``Prediction.model`` is ``STEPS``, ``size`` the case's name, ``dtype`` the
    weights' (fp32; a step's autocast is its own)."""
    import estimator

    for sc in cases:
        case, model = sc.case, sc.make_model()

        def capture(batch):
            return estimator.report(model, sc.make_sample(batch), batch=batch, step=case.step,
                                    optimizer=case.optimizer, mode=case.mode, device="cuda", gpu=gpu)

        for batch, memory, seconds in _at_batches(capture, sc.batches):
            yield Prediction(STEPS, sc.name, case.mode, "fp32", batch, memory.allocated, memory.reserved,
                             memory.device, seconds)


def step_case(name: str) -> StepCase:
    return next(sc for sc in STEP_CASES if sc.name == name)


def _clean_slate() -> None:
    """Before a case: the previous case's tensors collected, its cuBLAS workspaces dropped
    (PyTorch keeps them for the process's life; the warm-up step of this case allocates its
    own), the cache emptied."""
    gc.collect()
    if torch.cuda.is_available():
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def measure(prediction: Prediction):
    """One real step on the current CUDA device for ``prediction``'s case, from a clean slate
    (``_clean_slate``): the zoo's built-in step (``measure_cuda``) or a user's own step
    (``measure_cuda_user_step``)."""
    import models_zoo
    from validators import cuda

    _clean_slate()
    if prediction.model == STEPS:
        sc = step_case(prediction.size)
        return cuda.measure_cuda_user_step(sc.make_model(), sc.make_sample(prediction.batch), sc.case.step,
                                           sc.case.optimizer, sc.case.mode)
    dtype = DTYPES[prediction.dtype]
    model, make_sample, loss_fn = models_zoo.get(prediction.model, prediction.size, device="cuda", dtype=dtype)
    sample = _sample(make_sample, prediction.batch, dtype, "cuda")
    return cuda.measure_cuda(model, sample, prediction.mode, OPTIMIZER, loss_fn)


def compare(predictions: list[Prediction], measure_fn: Callable = measure,
            failed: list[tuple[Prediction, str]] | None = None) -> Iterator[Row]:
    """A row per prediction, measured by ``measure_fn``.  With a ``failed`` list, a case whose
    measurement raises is appended to it (with the error) and skipped; without, it raises."""
    for p in predictions:
        try:
            m = measure_fn(p)
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the suite's run
            if failed is None:
                raise
            failed.append((p, _error(exc)))
            continue
        yield Row(p, m.max_allocated, m.max_reserved, m.device_used)


def summary(rows: list[Row]) -> dict[str, Any]:
    allocated = [abs(r.allocated_error) for r in rows]
    reserved = [abs(r.reserved_error) for r in rows]
    return {
        "cases": len(rows),
        "allocated_median_abs_error_pct": statistics.median(allocated),
        "allocated_max_abs_error_pct": max(allocated),
        "reserved_median_abs_error_pct": statistics.median(reserved),
        "reserved_max_abs_error_pct": max(reserved),
    }


def _summary_line(stats: dict[str, Any], what: str = "cases") -> str:
    return (f"**{stats['cases']} {what}: max_memory_allocated median |error| "
            f"{stats['allocated_median_abs_error_pct']:.2f} %, max {stats['allocated_max_abs_error_pct']:.2f} %; "
            f"max_memory_reserved median {stats['reserved_median_abs_error_pct']:.2f} %, "
            f"max {stats['reserved_max_abs_error_pct']:.2f} %.**")


def label(model: str, size: str) -> str:
    """A case's name in the table: ``model (size)``, or ``your step: <case>``."""
    return f"your step: {size}" if model == STEPS else f"{model} ({size})"


def _error(exc: BaseException) -> str:
    """An exception in one line (the table's list of failures)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def to_markdown(rows: list[Row], header: dict[str, str], failed: list[tuple[str, str]] = ()) -> str:
    user_steps = [r for r in rows if r.prediction.model == STEPS]
    lines = [
        "# Validation on a GPU",
        "",
        (f"Predicted `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` (`estimator.report(..., "
         f"device='cuda', gpu='{header['gpu_arg']}')`, predicted on a machine without a GPU) against the same step "
         f"measured on {header['device']} (torch {header['torch']}, CUDA {header['cuda']}): the zoo's models with "
         f"the built-in step, optimizer `{OPTIMIZER}`, and users' own steps (\"your step\": the patterns of "
         "`models_zoo/steps.py`, `report(step=fn)`, measured by `validators.cuda.measure_cuda_user_step`; "
         "`fp32` weights, a step's autocast is its own)."),
        "",
        "Reproduce: `python -m validators.gpu predict` anywhere, then `python -m validators.gpu measure` on the GPU.",
        "",
        _summary_line(summary(rows)),
    ]
    if user_steps:
        lines += ["", _summary_line(summary(user_steps), "of them users' own steps")]
    if failed:
        lines += ["", f"**{len(failed)} case(s) failed** (not in the table):", ""]
        lines += [f"- {name}: `{error}`" for name, error in failed]
    lines += [
        "",
        ("| model | mode | dtype | batch | allocated predicted | measured | error | reserved predicted | measured "
         "| error | nvidia-smi predicted | measured |"),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r.prediction
        used = "—" if r.device_used is None else f"{r.device_used:,}"
        lines.append(
            f"| {label(p.model, p.size)} | {p.mode} | {p.dtype} | {p.batch} | {p.allocated:,} | {r.allocated:,} "
            f"| {r.allocated_error:+.2f} % | {p.reserved:,} | {r.reserved:,} | {r.reserved_error:+.2f} % "
            f"| {p.device:,} | {used} |"
        )
    return "\n".join(lines) + "\n"


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "gpu_arg": GPU}


def load_predictions(path: Path = PREDICTIONS) -> list[Prediction] | None:
    """The stored predictions; None if there are none or they were made for another GPU or torch
    version (stale as a whole: the estimate depends on both)."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("versions") != _versions():
        return None
    return [Prediction(**p) for p in data["predictions"]]


def expected(cases=CASES, step_cases: tuple[StepCase, ...] = STEP_CASES) -> dict[tuple[str, str], set[tuple]]:
    """The predictions the suite needs: ``(model, size)`` of each case -> its ``(mode, dtype,
    batch)``, in the suite's order (the zoo's cases, then users' steps)."""
    need = {(name, size): {(m, d, b) for m in MODES for d in DTYPES for b in batches} for name, size, batches in cases}
    return need | {(STEPS, sc.name): {(sc.case.mode, "fp32", b) for b in sc.batches} for sc in step_cases}


def _predict_case(key: tuple[str, str], cases, step_cases) -> list[Prediction]:
    if key[0] == STEPS:
        return list(predict_steps(tuple(sc for sc in step_cases if sc.name == key[1])))
    return list(predict([c for c in cases if (c[0], c[1]) == key]))


def update_predictions(cases=CASES, step_cases: tuple[StepCase, ...] = STEP_CASES, redo: bool = False,
                       path: Path | None = None, failed: list[tuple[str, str]] | None = None,
                       progress: Callable[[Prediction], None] = lambda p: None) -> list[Prediction]:
    """The predictions of ``cases`` and ``step_cases``, in the suite's order, from ``path``
    (default ``PREDICTIONS``) where it has them all for a case, else predicted (every selected
    case with ``redo``) and written back, the other cases' stored predictions kept.  A case whose
    prediction raises is appended to ``failed`` (its name, the error) when given, else raises."""
    path = path or PREDICTIONS
    stored: dict[tuple[str, str], list[Prediction]] = {}
    for p in load_predictions(path) or []:
        stored.setdefault((p.model, p.size), []).append(p)
    need = expected(cases, step_cases)
    todo = [key for key, keys in need.items()
            if redo or not keys <= {(p.mode, p.dtype, p.batch) for p in stored.get(key, ())}]
    for key in todo:
        try:
            fresh = _predict_case(key, cases, step_cases)
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
            if failed is None:
                raise
            failed.append((f"{label(*key)} (its prediction)", _error(exc)))
            continue
        for p in fresh:
            progress(p)
        stored[key] = fresh
    if todo:
        path.write_text(json.dumps({"versions": _versions(), "predictions": [
            asdict(p) for predictions in stored.values() for p in predictions]}, indent=1) + "\n")
    return [p for key, keys in need.items() for p in stored.get(key, ()) if (p.mode, p.dtype, p.batch) in keys]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("all", "predict", "measure"), default="all",
                        help="predict: (re)predict the selected cases; measure/all: predict the missing ones, measure")
    parser.add_argument("--models", nargs="*",
                        help=f"zoo names, '{STEPS}' for users' own steps (default: the whole suite)")
    parser.add_argument("--out", type=Path, default=Path("."), help="where docs/validation-gpu.* go")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.models or c[0] in args.models]
    step_cases = STEP_CASES if not args.models or STEPS in args.models else ()

    def progress(p: Prediction) -> None:
        print(f"predicted {label(p.model, p.size)[:48]:48s} {p.mode:9s} {p.dtype} b={p.batch:<5d} "
              f"allocated {p.allocated:>14,} reserved {p.reserved:>14,}", flush=True)

    failed: list[tuple[str, str]] = []
    predictions = update_predictions(cases, step_cases, redo=args.what == "predict", failed=failed,
                                     progress=progress)
    for name, error in failed:
        print(f"FAILED {name}: {error}", file=sys.stderr, flush=True)
    if args.what == "predict":
        return 1 if failed else 0
    if not torch.cuda.is_available():
        print("python -m validators.gpu measure: no CUDA device here", file=sys.stderr)
        return 2
    rows, unmeasured = [], []
    for row in compare(predictions, failed=unmeasured):
        p = row.prediction
        print(f"{label(p.model, p.size)[:48]:48s} {p.mode:9s} {p.dtype} b={p.batch:<5d} "
              f"allocated {row.allocated_error:+.2f} % reserved {row.reserved_error:+.2f} %", flush=True)
        rows.append(row)
    for p, error in unmeasured:
        print(f"FAILED {label(p.model, p.size)} {p.mode} {p.dtype} b={p.batch}: {error}", file=sys.stderr, flush=True)
    failed += [(f"{label(p.model, p.size)}, {p.mode}, {p.dtype}, b = {p.batch}", error) for p, error in unmeasured]
    if not rows:
        return 1
    props = torch.cuda.get_device_properties(0)
    header = _versions() | {"device": props.name, "cuda": str(torch.version.cuda),
                            "total_memory": str(props.total_memory)}
    (args.out / RESULTS_JSON).parent.mkdir(parents=True, exist_ok=True)
    (args.out / RESULTS_JSON).write_text(json.dumps(
        {"header": header, "summary": summary(rows),
         "rows": [asdict(r) | {"allocated_error_pct": r.allocated_error, "reserved_error_pct": r.reserved_error}
                  for r in rows],
         "failed": [{"case": name, "error": error} for name, error in failed]}, indent=1) + "\n")
    (args.out / RESULTS_MD).write_text(to_markdown(rows, header, failed))
    stats = summary(rows)
    print(f"allocated median {stats['allocated_median_abs_error_pct']:.2f} % max "
          f"{stats['allocated_max_abs_error_pct']:.2f} %; reserved median "
          f"{stats['reserved_median_abs_error_pct']:.2f} %" + (f"; {len(failed)} case(s) failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
