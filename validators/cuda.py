"""Measure the real memory of training on a CUDA device (run where a GPU is available).

Two protocols, both read what users compare with (``max_memory_allocated``,
``max_memory_reserved``, the device's used memory as nvidia-smi shows it):

- one steady step (``measure_cuda``, ``measure_cuda_user_step``; ``CudaMemory.step_allocated``
  / ``step_reserved``): the same step as the estimator and the CPU measurement
  (``estimator.capture.steps.run``, or a user's own step), one warm-up step (optimizer state, cuBLAS
  handle and workspace), ``empty_cache()``, ``reset_peak_memory_stats()``, then one measured
  step;
- a run from a cold start (``measure_run``, ``measure_user_step_run``; ``CudaMemory.allocated``
  / ``reserved`` / ``device``): in a process whose CUDA is not initialised yet, the model built
  on the CPU is moved with ``model.to("cuda")``, its optimizer (or a user step's state) built,
  then ``steps`` iterations of the loop users write, each moving the batch to the GPU, no
  ``empty_cache()``; the peaks over all of it and NVML's used memory at the end.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from estimator.capture import steps as step
from estimator.devices.cuda_run import MAX_STEPS
from estimator.vocab.categories import Mode
from validators import steady
from validators.steady import warm_up

# Iterations of a measured run: the estimator's replay runs until the allocator's state repeats,
# at most MAX_STEPS steps (CudaMemory.steps), and its figures are the peaks over those; a run of
# MAX_STEPS covers every prediction's (BERT base needs 11, most 3-6), where 5 would stop short.
RUN_STEPS = MAX_STEPS


@dataclass(frozen=True)
class CudaMeasurement:
    max_allocated: int  # torch.cuda.max_memory_allocated() over the measured step
    max_reserved: int  # torch.cuda.max_memory_reserved()
    allocated_before: int  # memory_allocated() when the measured step starts
    device_used: int | None  # device-level used memory after the step (nvidia-smi's figure)
    stats: dict[str, int] = field(default_factory=dict, repr=False)  # memory_stats() after the step


@dataclass(frozen=True)
class RunMeasurement:
    """A run from a cold start (``measure_run``): the allocator's peaks over all of it and the
    device's used memory at its end."""

    max_allocated: int  # torch.cuda.max_memory_allocated() after the run
    max_reserved: int  # torch.cuda.max_memory_reserved()
    steps: int  # the loop's iterations
    device_used: int | None  # the device's used memory at the end (NVML, every process on it)
    device_before: int | None  # the same before this process's CUDA context (None: not read)

    @property
    def device(self) -> int | None:
        """This process's share, nvidia-smi's figure for it: used at the end less used before
        its CUDA context was made (the whole device's figure when that could not be read)."""
        return None if self.device_used is None else self.device_used - (self.device_before or 0)


def measure_cuda(
    model: torch.nn.Module,
    sample: Any,
    mode: Mode | str = Mode.TRAIN,
    optimizer: str | step.OptimizerFactory | None = "adamw",
    loss_fn: step.LossFn | None = None,
    device: str | torch.device = "cuda",
    amp: str | None = None,
    grad_scaler: bool | None = None,
) -> CudaMeasurement:
    """Move ``model`` and ``sample`` to ``device`` and measure one steady-state step, with the
    precision of ``estimator.report(amp=, grad_scaler=)`` (``torch.autocast("cuda")``)."""
    precision = step.Precision.of(amp, grad_scaler, Mode(mode))
    if not torch.cuda.is_available():
        raise RuntimeError("measure_cuda needs a CUDA device; none is available")
    device = torch.device(device)
    model = model.to(device)
    sample = _moved(sample, device)
    mode, opt, loss_fn, scaler = warm_up(model, sample, mode, optimizer, loss_fn, precision)
    before = _clean_peak(device)
    result = step.run(model, sample, mode, opt, loss_fn, precision=precision, scaler=scaler)
    torch.cuda.synchronize(device)
    del result
    return _measured(device, before)


def measure_cuda_user_step(
    model: torch.nn.Module,
    sample: Any,
    fn: step.StepFn,
    optimizer: str | step.StateFactory | None = "adamw",
    mode: Mode | str = Mode.TRAIN,
    device: str | torch.device = "cuda",
) -> CudaMeasurement:
    """A user's own step (``estimator.report(step=fn, device="cuda")``) measured as
    ``measure_cuda`` measures the built-in one: ``model`` and ``sample`` moved to ``device``, the
    state built from the moved model (``step.state_factory(optimizer)``: optimizers, an EMA copy,
    a ``GradScaler`` for the parameters' device), one unmeasured step (the state it creates and
    the tensors it leaves alive), ``empty_cache()``, ``reset_peak_memory_stats()``, the measured
    step.  A ``GradScaler`` of the state that skipped ``optimizer.step()`` (inf/nan gradients)
    in either step raises: the estimate assumes finite gradients."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_cuda_user_step needs a CUDA device; none is available")
    mode = Mode(mode)
    device = torch.device(device)
    model = model.to(device)
    sample = _moved(sample, device)
    state = step.user_state(model, mode, step.state_factory(optimizer) if mode is Mode.TRAIN else None)
    scalers, scales = steady.scales(state)
    result = fn(model, sample, state)
    del result
    scales = steady.check_scales("warm-up", scalers, scales)
    gc.collect()
    before = _clean_peak(device)
    result = fn(model, sample, state)
    torch.cuda.synchronize(device)
    del result
    measured = _measured(device, before)
    steady.check_scales("measured", scalers, scales)
    return measured


def measure_run(
    model: torch.nn.Module,
    sample: Any,
    mode: Mode | str = Mode.TRAIN,
    optimizer: str | step.OptimizerFactory | None = "adamw",
    loss_fn: step.LossFn | None = None,
    steps: int = RUN_STEPS,
    device: str | torch.device = "cuda",
) -> RunMeasurement:
    """A run of the built-in step from a cold start, as users write it (``model`` and ``sample``
    as built, on the CPU)::

        model.to("cuda")                                 # Module._apply's order
        opt = torch.optim.AdamW(model.parameters())      # its state comes with the first opt.step()
        for x in batches:           # the loop variable takes the CPU batch: the previous GPU one is freed
            x = x.to("cuda")
            out = model(x)          # the previous out is freed here, the previous loss on the next line
            loss = loss_fn(out, x)
            loss.backward(); opt.step(); opt.zero_grad()

    (inference: ``out = model(x)`` under ``torch.no_grad()``).  The first call in a process
    whose CUDA is not initialised (else the cache and the peaks of earlier work would count):
    ``validators.gpu`` runs each case in a fresh process.  ``device``: a non-CUDA device runs the
    same loop as a stand-in (``_stand_in``) that tests the plumbing without a GPU."""
    mode = Mode(mode)
    device = torch.device(device)
    loss_fn = loss_fn or step.default_loss

    def run() -> tuple:
        model.to(device)
        factory = step.optimizer_factory(optimizer) if mode is Mode.TRAIN else None
        opt = step.prepare(model, mode, factory).optimizer
        out = loss = None
        for x in [sample] * steps:  # rebinding x to the CPU batch frees the previous GPU one first
            x = _moved(x, device)
            if mode is Mode.TRAIN:
                out = step.call_model(model, x)
                loss = loss_fn(out, x)
                loss.backward()
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
            else:
                with torch.no_grad():
                    out = step.call_model(model, x)
        return opt, (x, out, loss)

    return _run_measured(run, model, steps, device)


def measure_user_step_run(
    model: torch.nn.Module,
    sample: Any,
    fn: step.StepFn,
    optimizer: str | step.StateFactory | None = "adamw",
    mode: Mode | str = Mode.TRAIN,
    steps: int = RUN_STEPS,
    device: str | torch.device = "cuda",
) -> RunMeasurement:
    """A run of a user's own step from a cold start (``measure_run``'s protocol)::

        model.to("cuda")
        state = step.user_state(model, mode, step.state_factory(optimizer))
        for x in batches:
            x = x.to("cuda")
            fn(model, x, state)      # what it returns is dropped at once

    A ``GradScaler`` of the state that skipped ``optimizer.step()`` (inf/nan gradients) in any
    step raises, as in ``measure_cuda_user_step``."""
    mode = Mode(mode)
    device = torch.device(device)

    def run() -> tuple:
        model.to(device)
        state = step.user_state(model, mode, step.state_factory(optimizer))
        scalers, scales = steady.scales(state)
        x = None
        for i, x in enumerate([sample] * steps):  # the previous GPU batch freed first, as above
            x = _moved(x, device)
            fn(model, x, state)
            scales = steady.check_scales(f"run's #{i + 1}", scalers, scales)
        return state, x

    return _run_measured(run, model, steps, device)


def _moved(sample: Any, device: torch.device) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(device), sample)


def _run_measured(run: Callable[[], tuple], model, steps: int, device: torch.device) -> RunMeasurement:
    """``run()`` from a cold start on ``device``, measured (``run`` returns the state and the
    tensors the loop holds at its end, dropped here)."""
    if device.type != "cuda":
        return _stand_in(run, model, steps)
    if not torch.cuda.is_available():
        raise RuntimeError("a run on CUDA needs a CUDA device; none is available")
    index = 0 if device.index is None else device.index
    warm = torch.cuda.is_initialized()
    if warm and torch.cuda.max_memory_reserved(device):
        raise RuntimeError("a run from a cold start needs a process that has not used CUDA yet "
                           "(validators.gpu runs each in a fresh process)")
    before = None if warm else nvml_used(index)  # NVML only: no CUDA context of this process yet
    run()
    torch.cuda.synchronize(device)
    used = nvml_used(index)
    if used is None:  # no NVML: the driver's figure for the whole device
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    return RunMeasurement(torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device), steps,
                          used, before)


def _stand_in(run: Callable[[], tuple], model, steps: int) -> RunMeasurement:
    """The run on a CPU, for testing ``validators.gpu``'s processes without a GPU, not a peak:
    the bytes of the storages it holds at its end (``step.user_state_tensors``: the model's
    parameters, buffers and gradients, the optimizer's or the user step's state, and the last
    batch, output and loss) as both figures; no device figure."""
    state, held = run()
    tensors = [t for named in step.user_state_tensors(model, state, held).values() for t in named.values()]
    total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    return RunMeasurement(total, total, steps, None, None)


def nvml_used(index: int = 0) -> int | None:
    """The used memory of CUDA device ``index`` as nvidia-smi shows it (NVML, every process on
    the device), read without initialising CUDA in this process; None without NVML
    (``nvidia-ml-py`` not installed, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        nvml_index = getattr(torch.cuda, "_get_nvml_device_index", lambda i: i)(index)  # CUDA_VISIBLE_DEVICES
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(nvml_index)).used)
    except Exception:  # noqa: BLE001 - NVML missing: the figure is optional
        return None


def _clean_peak(device: torch.device) -> int:
    """After the warm-up: the cache emptied, the peaks reset; returns ``memory_allocated()``."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _measured(device: torch.device, before: int) -> CudaMeasurement:
    """The allocator's peaks since ``_clean_peak`` and the device's used memory now."""
    used = None
    if hasattr(torch.cuda, "device_memory_used"):
        try:
            used = int(torch.cuda.device_memory_used(device))
        except Exception:  # noqa: BLE001 - NVML missing: the figure is optional
            used = None
    return CudaMeasurement(
        max_allocated=torch.cuda.max_memory_allocated(device),
        max_reserved=torch.cuda.max_memory_reserved(device),
        allocated_before=before,
        device_used=used,
        stats={k: int(v) for k, v in torch.cuda.memory_stats(device).items()},
    )


def replay_on_device(events, device: str | torch.device = "cuda") -> tuple[int, int]:
    """Run an allocation sequence (``("alloc", key, nbytes)`` / ``("free", key, 0)``) through the
    real caching allocator from a clean state; returns (max allocated, max reserved) — the
    ground truth for ``estimator.devices.cuda_allocator.replay``."""
    device = torch.device(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base_allocated = torch.cuda.memory_allocated(device)
    base_reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    alive = {}
    for kind, key, nbytes in events:
        if kind == "alloc":
            alive[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        else:
            del alive[key]
    peak_allocated = torch.cuda.max_memory_allocated(device) - base_allocated
    peak_reserved = torch.cuda.max_memory_reserved(device) - base_reserved
    alive.clear()
    torch.cuda.empty_cache()
    return peak_allocated, peak_reserved
