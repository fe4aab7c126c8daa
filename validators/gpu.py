"""The GPU validation suite: fxmem's CUDA predictions against a real CUDA run.

Two halves, so that the GPU's time goes to measuring only:

- ``python -m validators.gpu predict`` (any machine, no GPU): predicts every case for the
  suite's GPU and writes ``validators/gpu_predictions.json`` (commit it);
- ``python -m validators.gpu measure`` (on the GPU): runs every case for real
  (``validators.cuda.measure_cuda``: warm-up step, ``empty_cache()``,
  ``reset_peak_memory_stats()``, the measured step), compares, and writes
  ``docs/validation-gpu.json`` and ``docs/validation-gpu.md``.

``python -m validators.gpu`` does both (predicting first if the predictions are missing or
were made for another GPU or torch version).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

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


def predict(cases=CASES, gpu: str = GPU) -> Iterator[Prediction]:
    import estimator
    import models_zoo

    for name, size, batches in cases:
        for mode in MODES:
            for dtype_name, dtype in DTYPES.items():
                model, make_sample, loss_fn = models_zoo.get(name, size, device="meta", dtype=dtype)
                start = time.perf_counter()
                rep = estimator.report(model, _sample(make_sample, batches[0], dtype, "meta"), batch=batches[0],
                                       mode=mode, optimizer=OPTIMIZER, loss_fn=loss_fn, device="cuda", gpu=gpu)
                seconds = time.perf_counter() - start
                for batch in batches:
                    memory = rep.on_device(batch) if batch >= rep.valid_from and (
                        rep.valid_to is None or batch <= rep.valid_to) else None
                    if memory is None:  # outside the formula's range: its own capture
                        memory = estimator.report(model, _sample(make_sample, batch, dtype, "meta"), batch=batch,
                                                  mode=mode, optimizer=OPTIMIZER, loss_fn=loss_fn, device="cuda",
                                                  gpu=gpu).cuda
                    yield Prediction(name, size, mode, dtype_name, batch, memory.allocated, memory.reserved,
                                     memory.device, seconds)


def measure(prediction: Prediction):
    """One real step on the current CUDA device for ``prediction``'s case, from a clean slate:
    the previous case's tensors collected, its cuBLAS workspaces dropped (PyTorch keeps them for
    the process's life; the warm-up step of this case allocates its own), the cache emptied."""
    import gc

    import models_zoo
    from validators.cuda import measure_cuda

    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    dtype = DTYPES[prediction.dtype]
    model, make_sample, loss_fn = models_zoo.get(prediction.model, prediction.size, device="cuda", dtype=dtype)
    sample = _sample(make_sample, prediction.batch, dtype, "cuda")
    return measure_cuda(model, sample, prediction.mode, OPTIMIZER, loss_fn)


def compare(predictions: list[Prediction], measure_fn: Callable = measure) -> Iterator[Row]:
    for p in predictions:
        m = measure_fn(p)
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


def to_markdown(rows: list[Row], header: dict[str, str]) -> str:
    stats = summary(rows)
    lines = [
        "# Validation on a GPU",
        "",
        (f"Predicted `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` (`estimator.report(..., "
         f"device='cuda', gpu='{header['gpu_arg']}')`, predicted on a machine without a GPU) against the same step "
         f"measured on {header['device']} (torch {header['torch']}, CUDA {header['cuda']}), optimizer `{OPTIMIZER}`."),
        "",
        "Reproduce: `python -m validators.gpu predict` anywhere, then `python -m validators.gpu measure` on the GPU.",
        "",
        (f"**{stats['cases']} cases: max_memory_allocated median |error| "
         f"{stats['allocated_median_abs_error_pct']:.2f} %, max {stats['allocated_max_abs_error_pct']:.2f} %; "
         f"max_memory_reserved median {stats['reserved_median_abs_error_pct']:.2f} %, "
         f"max {stats['reserved_max_abs_error_pct']:.2f} %.**"),
        "",
        ("| model | mode | dtype | batch | allocated predicted | measured | error | reserved predicted | measured "
         "| error | nvidia-smi predicted | measured |"),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r.prediction
        used = "—" if r.device_used is None else f"{r.device_used:,}"
        lines.append(
            f"| {p.model} ({p.size}) | {p.mode} | {p.dtype} | {p.batch} | {p.allocated:,} | {r.allocated:,} "
            f"| {r.allocated_error:+.2f} % | {p.reserved:,} | {r.reserved:,} | {r.reserved_error:+.2f} % "
            f"| {p.device:,} | {used} |"
        )
    return "\n".join(lines) + "\n"


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "gpu_arg": GPU}


def load_predictions(path: Path = PREDICTIONS) -> list[Prediction] | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("versions") != _versions():
        return None
    return [Prediction(**p) for p in data["predictions"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("all", "predict", "measure"), default="all")
    parser.add_argument("--models", nargs="*", help="zoo names (default: the whole suite)")
    parser.add_argument("--out", type=Path, default=Path("."), help="where docs/validation-gpu.* go")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.models or c[0] in args.models]

    predictions = load_predictions() if args.what != "predict" else None
    if predictions is None:
        predictions = []
        for p in predict(cases):
            print(f"predicted {p.model:16s} {p.mode:9s} {p.dtype} b={p.batch:<4d} allocated {p.allocated:>14,} "
                  f"reserved {p.reserved:>14,}", flush=True)
            predictions.append(p)
        PREDICTIONS.write_text(json.dumps(
            {"versions": _versions(), "predictions": [asdict(p) for p in predictions]}, indent=1) + "\n")
    if args.what == "predict":
        return 0
    if not torch.cuda.is_available():
        print("python -m validators.gpu measure: no CUDA device here", file=sys.stderr)
        return 2
    wanted = {c[0] for c in cases}
    rows = []
    for row in compare([p for p in predictions if p.model in wanted]):
        p = row.prediction
        print(f"{p.model:16s} {p.mode:9s} {p.dtype} b={p.batch:<4d} allocated {row.allocated_error:+.2f} % "
              f"reserved {row.reserved_error:+.2f} %", flush=True)
        rows.append(row)
    props = torch.cuda.get_device_properties(0)
    header = _versions() | {"device": props.name, "cuda": str(torch.version.cuda),
                            "total_memory": str(props.total_memory)}
    (args.out / RESULTS_JSON).parent.mkdir(parents=True, exist_ok=True)
    (args.out / RESULTS_JSON).write_text(json.dumps(
        {"header": header, "summary": summary(rows),
         "rows": [asdict(r) | {"allocated_error_pct": r.allocated_error, "reserved_error_pct": r.reserved_error}
                  for r in rows]}, indent=1) + "\n")
    (args.out / RESULTS_MD).write_text(to_markdown(rows, header))
    stats = summary(rows)
    print(f"allocated median {stats['allocated_median_abs_error_pct']:.2f} % max "
          f"{stats['allocated_max_abs_error_pct']:.2f} %; reserved median {stats['reserved_median_abs_error_pct']:.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
