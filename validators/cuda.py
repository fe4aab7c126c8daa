"""Measure the real peak memory of a step on a CUDA device (run where a GPU is available).

The same step as the estimator and the CPU measurement (``estimator.step.run``, or a user's own
step: ``measure_cuda_user_step``): one warm-up step (optimizer state, cuBLAS handle and
workspace), ``empty_cache()``, ``reset_peak_memory_stats()``, then one measured step.  Reads
what users compare with:
``max_memory_allocated``, ``max_memory_reserved``, the allocator's ``memory_stats()`` and the
device's used memory (NVML through ``torch.cuda.device_memory_used`` where available).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from estimator import step
from estimator.categories import Mode
from validators import steady
from validators.steady import warm_up


@dataclass(frozen=True)
class CudaMeasurement:
    max_allocated: int  # torch.cuda.max_memory_allocated() over the measured step
    max_reserved: int  # torch.cuda.max_memory_reserved()
    allocated_before: int  # memory_allocated() when the measured step starts
    device_used: int | None  # device-level used memory after the step (nvidia-smi's figure)
    stats: dict[str, int] = field(default_factory=dict, repr=False)  # memory_stats() after the step


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
    sample = tree_map_only(torch.Tensor, lambda t: t.to(device), sample)
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
    sample = tree_map_only(torch.Tensor, lambda t: t.to(device), sample)
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
    ground truth for ``estimator.target.cuda_allocator.replay``."""
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
