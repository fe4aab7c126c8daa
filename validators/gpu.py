"""The GPU validation suite: fxmem's CUDA predictions against real CUDA runs, in two protocols.

- **run** (``CudaMemory.allocated`` / ``reserved`` / ``device``, the report's headline): each
  case in a fresh process (``python -m validators.gpu run-case``: a new CUDA context, the
  allocator's peaks start from zero), the model built on the CPU, ``model.to("cuda")``, its
  optimizer (a user step's state), then ``RUN_STEPS`` iterations of the loop users write, the
  batch moved to the GPU inside it, no ``empty_cache()`` (``validators.cuda.measure_run``,
  ``measure_user_step_run``); ``max_memory_allocated()``, ``max_memory_reserved()`` and NVML's
  used memory at the end (less the same before the process's context);
- **step** (``CudaMemory.step_allocated`` / ``step_reserved``): one steady step in this process
  (``validators.cuda.measure_cuda``: warm-up step, ``empty_cache()``,
  ``reset_peak_memory_stats()``, the measured step; ``measure_cuda_user_step``), each case from
  a clean slate.

Two halves, so that the GPU's time goes to measuring:

- ``python -m validators.gpu predict`` (any machine, no GPU): predicts the cases for the
  suite's GPU (all, or those ``--models`` names) and writes them into
  ``validators/gpu_predictions.json`` (commit it), keeping the other cases' predictions;
- ``python -m validators.gpu measure`` (on the GPU): runs both protocols, compares, and writes
  ``docs/validation-gpu.json`` and ``docs/validation-gpu.md``.  The cases the predictions file
  lacks (all of them if it was made for another GPU, torch version or format) are predicted
  meanwhile by a process of their own that cannot see the GPU (``CUDA_VISIBLE_DEVICES=""``:
  predicted as on a machine without one, and no CUDA context of its own in the device's
  figures).  ``python -m validators.gpu`` is the same.

The cases: zoo models (``CASES``: train and inference, fp32 and bf16 weights, the built-in
step) and users' own steps (``STEP_CASES``, ``--models steps``: patterns of
``models_zoo.steps`` predicted with ``report(step=fn)``).  A case that fails on the GPU is
reported, not fatal: the others are still compared and written.  ``--device cpu`` runs the
same processes and files on a CPU stand-in (``validators.cuda._stand_in``, the CPU measurement
for the step protocol): the plumbing tested without a GPU, not a validation.

Time (one device call: at most 10 minutes, start-up included; nothing below has been timed on
an H200 yet: the per-process costs are estimates, the imports measured on a shared 2-core
machine).  The suite has 12 zoo cases x 2 modes x 2 dtypes x 3 batch sizes = 144 measurements
and 9 user steps x 2 batch sizes = 18: 162 per protocol.

- step protocol, one process: building on the GPU + 2 steps + the clean slate, 0.7-1.5 s a
  case: 162 x ~1 s = 2-4 min;
- run protocol, a process per case: the interpreter and the imports (torch, the zoo) ~2.5 s
  (2.7 s on the 2-core machine), the model built on the CPU 0.1-2 s (ViT-B/16, GPT-2 small,
  BERT base: 86-124 M parameters initialised), the ``torch._dynamo`` import that building an
  optimizer makes ~0.7 s, the CUDA context and NVML 0.5-1 s, ``.to()`` and ``RUN_STEPS`` (16 now)
  steps (each kernel's first use, then 20-120 ms a training step at these sizes) 0.3-2 s, the
  exit ~0.3 s: 5-8 s a process one after another, all 162: 162 x 6.5 s = 18 min, and even the
  largest batch size alone 57 x 6.5 s = 6.2 min, too much with the step protocol.  So (1) the
  next case's process is started while one measures: it imports, builds on the CPU and imports
  ``torch._dynamo``, then waits for "go" on its stdin before it touches CUDA; only the context,
  the steps and the exit are serial, 1.5-3.5 s.  All 162 would still take 162 x 2.5 s = 6.8
  min, 9-11 with the step protocol; so (2) the run protocol measures the largest batch size of
  each (case, mode, dtype) (``--run-batches largest``; the smaller are predicted the same way,
  not measured): 48 + 9 = 57 processes x 2.5 s = 2.4 min (x 3.5 s = 3.3 min at worst);
- predictions: the device has torch 2.11, the committed file another version, so all 57
  captures are redone there (~2.5 min of CPU, more with the run replay), in parallel with the
  measurements, off the critical path while shorter than them;

4.5-7.5 minutes in all.  ``--budget 540`` bounds it: the run protocol starts no case after
``RUN_SHARE`` = 60 % of it (324 s, the estimate's 2.4-3.3 min with room), so that the step
protocol has at least the rest; no case starts after the budget, the predictions process is
stopped there; cases not measured are listed, and the files are still written (a few seconds
past the budget: a step in progress ends first), well inside the call's 600 s.
"""

from __future__ import annotations

import argparse
import enum
import functools
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from models_zoo import steps
from validators.cuda import RUN_STEPS, CudaMeasurement, RunMeasurement

GPU = "H200"
OPTIMIZER = "adamw"
MODES = ("train", "inference")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (zoo name, size, batch sizes): sizes that fit one H200 in fp32 training and keep both
# protocols in one 10-minute device call (the module docstring's arithmetic).
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
FORMAT = 2  # of the predictions file: 2 has the run's and the step's figures
RESULTS_JSON = Path("docs/validation-gpu.json")
RESULTS_MD = Path("docs/validation-gpu.md")
ROOT = Path(__file__).resolve().parents[1]  # where `python -m validators.gpu` runs a case's process
CHILD_TIMEOUT = 180.0  # seconds a case's process may take (a run takes a few)
RUN_SHARE = 0.6  # of --budget, the most the run protocol may take: the step protocol gets the rest
GO = "go"  # the line a case's process waits for before it touches the device
RESULT = "FXMEM-RUN-RESULT "  # prefix of the line a case's process reports on


class Protocol(enum.Enum):
    RUN = "run"  # a run from a cold start: CudaMemory.allocated / reserved / device
    STEP = "step"  # one steady step after empty_cache(): CudaMemory.step_allocated / step_reserved

    @property
    def title(self) -> str:
        return "a run from a cold start" if self is Protocol.RUN else "one steady step"


@dataclass(frozen=True)
class Case:
    """One measurement of the suite: a zoo model (``model``, ``size``) or a user step
    (``STEPS``, its name), in ``mode``, with ``dtype`` weights, at ``batch``."""

    model: str
    size: str
    mode: str
    dtype: str
    batch: int

    @property
    def name(self) -> str:
        return f"{label(self.model, self.size)}, {self.mode}, {self.dtype}, b = {self.batch}"


@dataclass(frozen=True)
class Prediction:
    model: str
    size: str
    mode: str
    dtype: str
    batch: int
    allocated: int  # predicted max_memory_allocated over a run from a cold start
    reserved: int  # predicted max_memory_reserved over the run
    device: int  # predicted nvidia-smi used (the run's reserved + context estimate)
    step_allocated: int  # predicted max_memory_allocated of one steady step after empty_cache()
    step_reserved: int  # predicted max_memory_reserved of that step
    steps: int  # steps the run's replay took until the allocator's state repeated
    repeated: bool  # whether it repeated (else the figures are the max over those steps)
    estimate_seconds: float  # of the capture shared by the case's batch sizes

    @property
    def case(self) -> Case:
        return Case(self.model, self.size, self.mode, self.dtype, self.batch)


@dataclass(frozen=True)
class Row:
    """A case measured by one protocol, with its prediction."""

    protocol: Protocol
    prediction: Prediction
    allocated: int
    reserved: int
    device_used: int | None  # run: this process's nvidia-smi figure; step: the device's after the step
    steps: int | None = None  # run: the loop's iterations

    @staticmethod
    def error(predicted: int | None, measured: int | None) -> float | None:
        return None if not measured or predicted is None else 100.0 * (predicted - measured) / measured

    @property
    def predicted_allocated(self) -> int:
        p = self.prediction
        return p.allocated if self.protocol is Protocol.RUN else p.step_allocated

    @property
    def predicted_reserved(self) -> int:
        p = self.prediction
        return p.reserved if self.protocol is Protocol.RUN else p.step_reserved

    @property
    def predicted_device(self) -> int | None:
        return self.prediction.device if self.protocol is Protocol.RUN else None

    @property
    def allocated_error(self) -> float:
        return self.error(self.predicted_allocated, self.allocated)

    @property
    def reserved_error(self) -> float:
        return self.error(self.predicted_reserved, self.reserved)

    @property
    def device_error(self) -> float | None:
        return self.error(self.predicted_device, self.device_used)

    @property
    def context(self) -> int | None:
        """Run: the measured CUDA context and kernels (nvidia-smi's figure less the cache, which
        a run without ``empty_cache()`` keeps at its peak)."""
        if self.protocol is not Protocol.RUN or self.device_used is None:
            return None
        return self.device_used - self.reserved


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


def _prediction(model: str, size: str, mode: str, dtype: str, batch: int, memory, seconds: float) -> Prediction:
    """A case's prediction from its ``estimator.devices.cuda.CudaMemory``."""
    return Prediction(model, size, mode, dtype, batch, memory.allocated, memory.reserved, memory.device,
                      memory.step_allocated, memory.step_reserved, memory.steps, memory.repeated, seconds)


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
                    yield _prediction(name, size, mode, dtype_name, batch, memory, seconds)


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
            yield _prediction(STEPS, sc.name, case.mode, "fp32", batch, memory, seconds)


def step_case(name: str) -> StepCase:
    return next(sc for sc in STEP_CASES if sc.name == name)


def suite(cases=CASES, step_cases: tuple[StepCase, ...] = STEP_CASES) -> list[Case]:
    """The suite's measurements in its order: the zoo's cases (modes, dtypes, batch sizes), then
    users' steps."""
    zoo = [Case(name, size, m, d, b) for name, size, batches in cases for m in MODES for d in DTYPES for b in batches]
    return zoo + [Case(STEPS, sc.name, sc.case.mode, "fp32", b) for sc in step_cases for b in sc.batches]


def largest(cases: Iterable[Case]) -> list[Case]:
    """The case with the largest batch size of each (model, size, mode, dtype), in order."""
    top: dict[tuple, Case] = {}
    for c in cases:
        key = (c.model, c.size, c.mode, c.dtype)
        if key not in top or c.batch > top[key].batch:
            top[key] = c
    return list(top.values())


# -- the step protocol: one steady step, in this process ------------------------------------------
def _clean_slate() -> None:
    """Before a case: the previous case's tensors collected, its cuBLAS workspaces dropped
    (PyTorch keeps them for the process's life; the warm-up step of this case allocates its
    own), the cache emptied."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def measure(case: Case, device: str | torch.device = "cuda") -> CudaMeasurement:
    """One real steady step of ``case`` on ``device``, from a clean slate (``_clean_slate``): the
    zoo's built-in step (``measure_cuda``) or a user's own step (``measure_cuda_user_step``).
    A non-CUDA ``device`` measures the CPU step instead (``validators.cpu``: the stand-in
    ``--device cpu`` runs)."""
    import models_zoo
    from validators import cpu, cuda

    device = torch.device(device)
    _clean_slate()
    if case.model == STEPS:
        sc = step_case(case.size)
        model, sample = sc.make_model(), sc.make_sample(case.batch)
        if device.type != "cuda":
            return _stand_in(cpu.measure_user_step(model, sample, sc.case.step, sc.case.optimizer, sc.case.mode))
        return cuda.measure_cuda_user_step(model, sample, sc.case.step, sc.case.optimizer, sc.case.mode)
    dtype = DTYPES[case.dtype]
    model, make_sample, loss_fn = models_zoo.get(case.model, case.size, device=device, dtype=dtype)
    sample = _sample(make_sample, case.batch, dtype, device)
    if device.type != "cuda":
        return _stand_in(cpu.measure_cpu(model, sample, case.mode, OPTIMIZER, loss_fn))
    return cuda.measure_cuda(model, sample, case.mode, OPTIMIZER, loss_fn)


def _stand_in(m) -> CudaMeasurement:
    """A CPU measurement (``validators.cpu.Measurement``) in the CUDA one's shape: its peak as
    both figures."""
    return CudaMeasurement(m.peak_bytes, m.peak_bytes, m.baseline_bytes, None)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _fail(failed: list[tuple[str, str]] | None, name: str, error: str) -> None:
    if failed is None:
        raise RuntimeError(f"{name}: {error}")
    failed.append((name, error))


def _skipped(failed, protocol: Protocol, cases: list[Case]) -> None:
    """Cases the time budget left unmeasured, in one line."""
    if cases:
        _fail(failed, f"{len(cases)} case(s), {protocol.title} ({cases[0].name} and after)",
              "not measured: the time budget (--budget) ran out")


def measure_steps(cases: Iterable[Case], measure_fn: Callable[[Case], CudaMeasurement] = measure,
                  failed: list[tuple[str, str]] | None = None, deadline: float | None = None,
                  progress: Callable[[Case, CudaMeasurement], None] = lambda c, m: None) -> dict[Case, CudaMeasurement]:
    """The step protocol: each case measured by ``measure_fn`` in this process.  With a
    ``failed`` list a case whose measurement raises is appended to it (its name, the error) and
    skipped; without, it raises.  Cases left when ``time.monotonic()`` passes ``deadline`` are
    not measured (one entry in ``failed``)."""
    cases = list(cases)
    measured = {}
    for i, case in enumerate(cases):
        if _past(deadline):
            _skipped(failed, Protocol.STEP, cases[i:])
            break
        try:
            m = measure_fn(case)
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the suite's run
            _fail(failed, f"{case.name} ({Protocol.STEP.title})", _error(exc))
            continue
        measured[case] = m
        progress(case, m)
    return measured


# -- the run protocol: a fresh process per case ---------------------------------------------------
def prepare_run(case: Case, device: str | torch.device = "cuda", steps: int = RUN_STEPS
                ) -> Callable[[], RunMeasurement]:
    """``case``'s model and sample built on the CPU; returns the measurement of its run from a
    cold start on ``device`` (``validators.cuda.measure_run`` / ``measure_user_step_run``), to be
    called in a process that has not used CUDA yet."""
    import models_zoo
    from validators import cuda

    torch.manual_seed(0)
    if case.model == STEPS:
        sc = step_case(case.size)
        model, sample = sc.make_model(), sc.make_sample(case.batch)
        return functools.partial(cuda.measure_user_step_run, model, sample, sc.case.step, sc.case.optimizer,
                                 sc.case.mode, steps, device)
    dtype = DTYPES[case.dtype]
    model, make_sample, loss_fn = models_zoo.get(case.model, case.size, dtype=dtype)
    sample = _sample(make_sample, case.batch, dtype, "cpu")
    return functools.partial(cuda.measure_run, model, sample, case.mode, OPTIMIZER, loss_fn, steps, device)


def run_case(spec: str, device: str = "cuda", steps: int = RUN_STEPS) -> int:
    """A case's process (``python -m validators.gpu run-case --case SPEC``): builds the case on
    the CPU (``prepare_run``), waits for ``GO`` on stdin, measures, and prints one ``RESULT``
    line: ``{"measurement": ..., "pid": ..., "build_seconds": ..., "measure_seconds": ...}`` or
    ``{"error": ...}``."""
    start = time.perf_counter()
    try:
        measure_run = prepare_run(Case(**json.loads(spec)), device, steps)
    except Exception as exc:  # noqa: BLE001 - reported to the suite as the case's failure
        return _report({"error": _error(exc)})
    importlib.import_module("torch._dynamo")  # what building an optimizer imports (~1 s): before the serial part

    built = time.perf_counter()
    if sys.stdin.readline().strip() != GO:
        return _report({"error": "stopped before measuring"})
    went = time.perf_counter()
    try:
        m = measure_run()
    except Exception as exc:  # noqa: BLE001
        return _report({"error": _error(exc)})
    return _report({"measurement": asdict(m), "pid": os.getpid(), "build_seconds": built - start,
                    "measure_seconds": time.perf_counter() - went})


def _report(result: dict) -> int:
    print(RESULT + json.dumps(result), flush=True)
    return 1 if "error" in result else 0


class _Child:
    """A case's run in a process of its own, started early: it imports and builds on the CPU
    while the previous case measures, and touches the device once ``finish`` says go."""

    def __init__(self, case: Case, device: str, steps: int):
        self.case = case
        command = [sys.executable, "-m", "validators.gpu", "run-case", "--case", json.dumps(asdict(case)),
                   "--device", device, "--steps", str(steps)]
        self.proc = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def finish(self, timeout: float | None, why: str = "") -> tuple[dict | None, str | None]:
        """Go, wait for the end; ``(result, None)`` or ``(None, error)`` (``why``: of the timeout)."""
        try:
            out, err = self.proc.communicate(GO + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return None, f"TimeoutError: the run's process did not end within {timeout:.0f} s{why}"
        for line in reversed(out.splitlines()):
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT):])
                return (None, result["error"]) if "error" in result else (result, None)
        lines = err.strip().splitlines()
        return None, f"the run's process exited with {self.proc.returncode}: {lines[-1] if lines else ''}"[:400]

    def stop(self) -> None:
        """Killed if it still runs (what it printed discarded)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def measure_runs(cases: Iterable[Case], device: str = "cuda", steps: int = RUN_STEPS,
                 failed: list[tuple[str, str]] | None = None, deadline: float | None = None,
                 timeout: float = CHILD_TIMEOUT,
                 progress: Callable[[Case, RunMeasurement, dict], None] = lambda c, m, r: None
                 ) -> dict[Case, RunMeasurement]:
    """The run protocol: each case in a fresh process (``run_case``), one measuring at a time
    (the device's used memory is the whole device's), the next one started meanwhile.  Failures
    and the time budget as in ``measure_steps``; a process that takes longer than ``timeout``
    seconds is killed and its case failed.  ``progress(case, measurement, result)``: ``result``
    is the process's report (``run_case``)."""
    cases = list(cases)
    measured = {}
    child = following = _Child(cases[0], str(device), steps) if cases else None
    try:
        for i, case in enumerate(cases):
            if _past(deadline):
                _skipped(failed, Protocol.RUN, cases[i:])
                break
            following = _Child(cases[i + 1], str(device), steps) if i + 1 < len(cases) else None
            left = timeout if deadline is None else max(1.0, min(timeout, deadline - time.monotonic()))
            result, error = child.finish(left, "" if left == timeout else " (the time budget's rest)")
            child = following
            if error is not None:
                _fail(failed, f"{case.name} ({Protocol.RUN.title})", error)
                continue
            measured[case] = m = RunMeasurement(**result["measurement"])
            progress(case, m, result)
    finally:
        for left_over in {id(c): c for c in (child, following) if c is not None}.values():
            left_over.stop()
    return measured


# -- predictions and measurements joined -----------------------------------------------------------
def join(protocol: Protocol, predictions: dict[Case, Prediction], measured: dict[Case, Any]) -> list[Row]:
    """A row per measured case that has a prediction, in the measurements' order."""
    out = []
    for case, m in measured.items():
        if case not in predictions:
            continue
        if protocol is Protocol.RUN:
            out.append(Row(protocol, predictions[case], m.max_allocated, m.max_reserved, m.device, m.steps))
        else:
            out.append(Row(protocol, predictions[case], m.max_allocated, m.max_reserved, m.device_used))
    return out


def compare(predictions: list[Prediction], measure_fn: Callable[[Case], CudaMeasurement] = measure,
            failed: list[tuple[str, str]] | None = None) -> list[Row]:
    """The step protocol's rows of ``predictions``, measured now by ``measure_fn``."""
    by_case = {p.case: p for p in predictions}
    return join(Protocol.STEP, by_case, measure_steps(by_case, measure_fn, failed))


def summary(rows: list[Row]) -> dict[str, Any]:
    allocated = [abs(r.allocated_error) for r in rows]
    reserved = [abs(r.reserved_error) for r in rows]
    device = [abs(r.device_error) for r in rows if r.device_error is not None]
    stats = {
        "cases": len(rows),
        "allocated_median_abs_error_pct": statistics.median(allocated),
        "allocated_max_abs_error_pct": max(allocated),
        "reserved_median_abs_error_pct": statistics.median(reserved),
        "reserved_max_abs_error_pct": max(reserved),
    }
    if device:
        stats |= {"device_cases": len(device), "device_median_abs_error_pct": statistics.median(device),
                  "device_max_abs_error_pct": max(device)}
    return stats


def _summary_line(stats: dict[str, Any], what: str = "cases") -> str:
    line = (f"**{stats['cases']} {what}: max_memory_allocated median |error| "
            f"{stats['allocated_median_abs_error_pct']:.2f} %, max {stats['allocated_max_abs_error_pct']:.2f} %; "
            f"max_memory_reserved median {stats['reserved_median_abs_error_pct']:.2f} %, "
            f"max {stats['reserved_max_abs_error_pct']:.2f} %")
    if "device_cases" in stats:
        line += (f"; nvidia-smi ({stats['device_cases']}) median {stats['device_median_abs_error_pct']:.2f} %, "
                 f"max {stats['device_max_abs_error_pct']:.2f} %")
    return line + ".**"


def label(model: str, size: str) -> str:
    """A case's name in the table: ``model (size)``, or ``your step: <case>``."""
    return f"your step: {size}" if model == STEPS else f"{model} ({size})"


def _error(exc: BaseException) -> str:
    """An exception in one line (the table's list of failures)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def _bytes(n: int | None) -> str:
    return "—" if n is None else f"{n:,}"


def _pct(e: float | None) -> str:
    return "—" if e is None else f"{e:+.2f} %"


def _section(protocol: Protocol, rows: list[Row]) -> list[str]:
    lines = [_summary_line(summary(rows))]
    user_steps = [r for r in rows if r.prediction.model == STEPS]
    if user_steps:
        lines += ["", _summary_line(summary(user_steps), "of them users' own steps")]
    if protocol is Protocol.RUN:
        lines += ["", ("`steps`: those the prediction's replay ran until the allocator's state repeated (`+`: it "
                       "did not; the figures are the peaks over those steps, unchanged over the last few).")]
        longer = [r for r in rows if r.prediction.steps > r.steps]
        if longer:
            lines += ["", f"{len(longer)} case(s) predicted over more steps than the {longer[0].steps} run: their "
                          "run may stop short of the predicted peak."]
        lines += ["", ("| model | mode | dtype | batch | steps | allocated predicted | measured | error "
                       "| reserved predicted | measured | error | nvidia-smi predicted | measured | error "
                       "| context measured |"),
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            p = r.prediction
            lines.append(
                f"| {label(p.model, p.size)} | {p.mode} | {p.dtype} | {p.batch} | {p.steps}{'' if p.repeated else '+'} "
                f"| {r.predicted_allocated:,} | {r.allocated:,} | {_pct(r.allocated_error)} "
                f"| {r.predicted_reserved:,} | {r.reserved:,} | {_pct(r.reserved_error)} "
                f"| {p.device:,} | {_bytes(r.device_used)} | {_pct(r.device_error)} | {_bytes(r.context)} |")
    else:
        lines += ["", ("| model | mode | dtype | batch | allocated predicted | measured | error "
                       "| reserved predicted | measured | error |"),
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            p = r.prediction
            lines.append(
                f"| {label(p.model, p.size)} | {p.mode} | {p.dtype} | {p.batch} "
                f"| {r.predicted_allocated:,} | {r.allocated:,} | {_pct(r.allocated_error)} "
                f"| {r.predicted_reserved:,} | {r.reserved:,} | {_pct(r.reserved_error)} |")
    return lines


def to_markdown(rows: list[Row], header: dict[str, str], failed: Iterable[tuple[str, str]] = (),
                steps: int = RUN_STEPS, run_batches: str = "largest") -> str:
    failed = list(failed)
    run = [r for r in rows if r.protocol is Protocol.RUN]
    step = [r for r in rows if r.protocol is Protocol.STEP]
    batches = "the largest batch size of each case" if run_batches == "largest" else "every batch size"
    lines = [
        "# Validation on a GPU",
        "",
        (f"Predicted `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` and nvidia-smi's used "
         f"memory (`estimator.report(..., device='cuda', gpu='{header['gpu_arg']}')`, predicted on a machine "
         f"without a GPU) against the same training measured on {header['device']} (torch {header['torch']}, "
         f"CUDA {header['cuda']}): the zoo's models with the built-in step, optimizer `{OPTIMIZER}`, and users' "
         "own steps (\"your step\": the patterns of `models_zoo/steps.py`, `report(step=fn)`; `fp32` weights, a "
         "step's autocast is its own).  Two protocols:"),
        "",
        (f"- **{Protocol.RUN.title}** (`CudaMemory.allocated` / `reserved` / `device`: the report's "
         f"`peak_bytes`, `reserved_bytes`, `device_bytes`): each case in a fresh process, the model built on the "
         f"CPU, `model.to(\"cuda\")`, the optimizer (a user step's state), then {steps} iterations of the loop "
         "users write (the batch moved to the GPU in it, no `empty_cache()`), the peaks after them; nvidia-smi's "
         "figure is NVML's used memory at the end less the same before the process's CUDA context, "
         "\"context\" that less `max_memory_reserved`.  Measured at "
         f"{batches} (the smaller are predicted alike; one device call has time for these: "
         "`validators/gpu.py`'s docstring);"),
        (f"- **{Protocol.STEP.title}** (`CudaMemory.step_allocated` / `step_reserved`): in one process, each "
         "case from a clean slate, a warm-up step, `empty_cache()`, `reset_peak_memory_stats()`, the measured "
         "step (`validators.cuda.measure_cuda`, `measure_cuda_user_step`)."),
        "",
        ("Reproduce: `python -m validators.gpu predict` anywhere, then `python -m validators.gpu measure "
         "--budget 540` on the GPU."),
    ]
    if failed:
        lines += ["", f"**{len(failed)} failure(s)** (not in the tables):", ""]
        lines += [f"- {name}: `{error}`" for name, error in failed]
    for protocol, its_rows in ((Protocol.RUN, run), (Protocol.STEP, step)):
        lines += ["", f"## {protocol.title[0].upper()}{protocol.title[1:]}", ""]
        lines += _section(protocol, its_rows) if its_rows else ["Not measured."]
    return "\n".join(lines) + "\n"


# -- the predictions file --------------------------------------------------------------------------
def _versions() -> dict[str, Any]:
    return {"torch": torch.__version__, "gpu_arg": GPU, "format": FORMAT}


def load_predictions(path: Path = PREDICTIONS) -> list[Prediction] | None:
    """The stored predictions; None if there are none or they were made for another GPU, torch
    version or file format (stale as a whole: the estimate depends on all three)."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("versions") != _versions():
        return None
    return [Prediction(**p) for p in data["predictions"]]


def expected(cases=CASES, step_cases: tuple[StepCase, ...] = STEP_CASES) -> dict[tuple[str, str], set[tuple]]:
    """The predictions the suite needs: ``(model, size)`` of each case -> its ``(mode, dtype,
    batch)``, in the suite's order (the zoo's cases, then users' steps)."""
    need: dict[tuple[str, str], set[tuple]] = {}
    for c in suite(cases, step_cases):
        need.setdefault((c.model, c.size), set()).add((c.mode, c.dtype, c.batch))
    return need


def _predict_case(key: tuple[str, str], cases, step_cases) -> list[Prediction]:
    if key[0] == STEPS:
        return list(predict_steps(tuple(sc for sc in step_cases if sc.name == key[1])))
    return list(predict([c for c in cases if (c[0], c[1]) == key]))


def update_predictions(cases=CASES, step_cases: tuple[StepCase, ...] = STEP_CASES, redo: bool = False,
                       path: Path | None = None, failed: list[tuple[str, str]] | None = None,
                       progress: Callable[[Prediction], None] = lambda p: None) -> list[Prediction]:
    """The predictions of ``cases`` and ``step_cases``, in the suite's order, from ``path``
    (default ``PREDICTIONS``) where it has them all for a case, else predicted (every selected
    case with ``redo``) and written back after each case (a stopped process keeps what it did),
    the other cases' stored predictions kept.  A case whose prediction raises is appended to
    ``failed`` (its name, the error) when given, else raises."""
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
        path.write_text(json.dumps({"versions": _versions(), "predictions": [
            asdict(p) for predictions in stored.values() for p in predictions]}, indent=1) + "\n")
    return [p for key, keys in need.items() for p in stored.get(key, ()) if (p.mode, p.dtype, p.batch) in keys]


class _Predicting:
    """The predictions the suite lacks, made meanwhile by ``python -m validators.gpu predict
    --missing`` in a process of its own that cannot see the GPU."""

    def __init__(self, models: list[str] | None, path: Path):
        self.path = path
        fd, name = tempfile.mkstemp(prefix="fxmem-gpu-predict-", suffix=".json")
        os.close(fd)
        self.failures = Path(name)
        command = [sys.executable, "-m", "validators.gpu", "predict", "--missing", "--predictions", str(path),
                   "--failures", str(self.failures), *(["--models", *models] if models else [])]
        self.proc = subprocess.Popen(command, cwd=ROOT, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})

    def finish(self, deadline: float | None, failed: list[tuple[str, str]]) -> None:
        """Wait for it (until ``deadline``); its failures appended to ``failed``."""
        try:
            self.proc.wait(None if deadline is None else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            failed.append(("the predictions", "stopped: the time budget (--budget) ran out"))
        text = self.failures.read_text() if self.failures.exists() else ""
        self.failures.unlink(missing_ok=True)
        failed.extend(tuple(f) for f in (json.loads(text) if text else ()))


def _predictions_for(cases: list[Case], path: Path, failed: list[tuple[str, str]]) -> dict[Case, Prediction]:
    """The stored predictions of ``cases``; the (model, size) of those without one named in
    ``failed`` (once, unless its prediction's failure already is)."""
    wanted = set(cases)
    found = {p.case: p for p in load_predictions(path) or [] if p.case in wanted}
    named = {name for name, _ in failed}
    for model, size in dict.fromkeys((c.model, c.size) for c in cases if c not in found):
        if f"{label(model, size)} (its prediction)" not in named:
            failed.append((f"{label(model, size)} (its prediction)", f"no prediction in {path.name}"))
    return found


# -- the command -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("all", "predict", "measure", "run-case"), default="all",
                        help="predict: (re)predict the selected cases; measure/all: predict the missing ones "
                             "meanwhile, measure both protocols; run-case: one case's run process (internal)")
    parser.add_argument("--models", nargs="*",
                        help=f"zoo names, '{STEPS}' for users' own steps (default: the whole suite)")
    parser.add_argument("--out", type=Path, default=Path("."), help="where docs/validation-gpu.* go")
    parser.add_argument("--protocol", choices=("both", "run", "step"), default="both")
    parser.add_argument("--run-batches", choices=("largest", "all"), default="largest",
                        help="the batch sizes measured by the run protocol (default: the largest of each case)")
    parser.add_argument("--steps", type=int, default=RUN_STEPS, help="the run protocol's loop iterations")
    parser.add_argument("--budget", type=float,
                        help="seconds after which no case starts (reported as not measured; the files are written); "
                             f"the run protocol stops at {RUN_SHARE * 100:.0f} %% of it when both run")
    parser.add_argument("--device", default="cuda",
                        help="cuda; cpu: a stand-in that tests the processes and files without a GPU")
    parser.add_argument("--predictions", type=Path, default=None, help="the predictions file (default: the suite's)")
    parser.add_argument("--missing", action="store_true", help="predict: only the cases the file lacks")
    parser.add_argument("--failures", type=Path, help=argparse.SUPPRESS)  # predict: its failures, as JSON
    parser.add_argument("--case", help=argparse.SUPPRESS)  # run-case: the Case, as JSON
    args = parser.parse_args(argv)
    if args.what == "run-case":
        return run_case(args.case, args.device, args.steps)
    path = args.predictions or PREDICTIONS
    cases = [c for c in CASES if not args.models or c[0] in args.models]
    step_cases = STEP_CASES if not args.models or STEPS in args.models else ()

    if args.what == "predict":
        def progress(p: Prediction) -> None:
            print(f"predicted {label(p.model, p.size)[:48]:48s} {p.mode:9s} {p.dtype} b={p.batch:<5d} "
                  f"allocated {p.allocated:>14,} reserved {p.reserved:>14,} step {p.step_allocated:>14,}", flush=True)

        failed: list[tuple[str, str]] = []
        update_predictions(cases, step_cases, redo=not args.missing, path=path, failed=failed, progress=progress)
        for name, error in failed:
            print(f"FAILED {name}: {error}", file=sys.stderr, flush=True)
        if args.failures:
            args.failures.write_text(json.dumps(failed))
        return 1 if failed else 0
    return _measure(args, path, cases, step_cases)


def _measure(args, path: Path, cases, step_cases) -> int:
    start = time.monotonic()
    deadline = None if args.budget is None else start + args.budget
    run_deadline = None if args.budget is None else start + RUN_SHARE * args.budget
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():  # no CUDA context made
        print("python -m validators.gpu measure: no CUDA device here", file=sys.stderr)
        return 2
    measuring = suite(cases, step_cases)
    stored = {p.case for p in load_predictions(path) or []}
    predicting = None if set(measuring) <= stored else _Predicting(args.models, path)
    failed: list[tuple[str, str]] = []
    seconds: dict[str, float] = {}
    run_seconds: dict[str, float] = {}  # each run's process, from go to its report
    run: dict[Case, RunMeasurement] = {}
    step: dict[Case, CudaMeasurement] = {}
    try:
        if args.protocol in ("both", "run"):  # first: this process has no CUDA context while they run
            def ran(case: Case, m: RunMeasurement, result: dict) -> None:
                print(f"run  {case.name[:80]:80s} allocated {m.max_allocated:>14,} reserved {m.max_reserved:>14,} "
                      f"device {_bytes(m.device):>14s} ({result['measure_seconds']:.1f} s)", flush=True)
                run_seconds[case.name] = result["measure_seconds"]

            chosen = largest(measuring) if args.run_batches == "largest" else measuring
            run = measure_runs(chosen, args.device, args.steps, failed,
                               deadline if args.protocol == "run" else run_deadline, progress=ran)
            seconds["run"] = time.monotonic() - start
        if args.protocol in ("both", "step"):
            def stepped(case: Case, m: CudaMeasurement) -> None:
                print(f"step {case.name[:80]:80s} allocated {m.max_allocated:>14,} reserved {m.max_reserved:>14,}",
                      flush=True)

            began = time.monotonic()
            step = measure_steps(measuring, functools.partial(measure, device=device), failed, deadline, stepped)
            seconds["step"] = time.monotonic() - began
    finally:
        if predicting is not None:
            began = time.monotonic()
            predicting.finish(deadline, failed)
            seconds["waiting for the predictions"] = time.monotonic() - began
    predictions = _predictions_for([*run, *step], path, failed)
    found = join(Protocol.RUN, predictions, run) + join(Protocol.STEP, predictions, step)
    seconds["total"] = time.monotonic() - start
    for name, error in failed:
        print(f"FAILED {name}: {error}", file=sys.stderr, flush=True)
    header = _versions() | _device_header(device)
    (args.out / RESULTS_JSON).parent.mkdir(parents=True, exist_ok=True)
    (args.out / RESULTS_JSON).write_text(json.dumps(
        {"header": header, "settings": {"steps": args.steps, "run_batches": args.run_batches, "budget": args.budget},
         "summary": {p.value: summary(rs) for p in Protocol if (rs := [r for r in found if r.protocol is p])},
         "seconds": seconds, "run_seconds": run_seconds,
         "rows": [asdict(r) | {"protocol": r.protocol.value, "allocated_error_pct": r.allocated_error,
                               "reserved_error_pct": r.reserved_error, "device_error_pct": r.device_error,
                               "context": r.context} for r in found],
         # every measurement, with a prediction or not (one made later can still be compared)
         "measured": {"run": [asdict(c) | asdict(m) | {"device": m.device} for c, m in run.items()],
                      "step": [asdict(c) | {k: v for k, v in asdict(m).items() if k != "stats"}
                               for c, m in step.items()]},
         "failed": [{"case": name, "error": error} for name, error in failed]}, indent=1) + "\n")
    (args.out / RESULTS_MD).write_text(to_markdown(found, header, failed, args.steps, args.run_batches))
    for p in Protocol:
        if its := [r for r in found if r.protocol is p]:
            print(f"{p.title}: {_summary_line(summary(its)).strip('*')}")
    print(f"{seconds['total']:.0f} s" + (f"; {len(failed)} failure(s)" if failed else ""))
    return 1 if failed or not found else 0


def _device_header(device: torch.device) -> dict[str, str]:
    """The measuring device, read once the measurements are over (this process's CUDA context
    then no longer matters)."""
    if device.type != "cuda":
        return {"device": f"{device.type} (a stand-in: not a GPU measurement)", "cuda": "none"}
    props = torch.cuda.get_device_properties(device)
    return {"device": props.name, "cuda": str(torch.version.cuda), "total_memory": str(props.total_memory)}


if __name__ == "__main__":
    sys.exit(main())
