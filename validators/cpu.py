"""Measure the real peak memory of a step on CPU with PyTorch's own allocator events.

``torch.profiler.profile(profile_memory=True)`` records every allocation and free of the CPU
allocator, kernel-internal scratch included.  Peak = bytes alive when the step starts (the
storages of parameters, buffers, inputs and optimizer state) + the largest running sum of
the allocation deltas during the steps.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from estimator.capture import steps
from estimator.capture.checkpointing import checkpointing
from estimator.vocab.categories import Mode
from validators import steady
from validators.steady import skipped, warm_up


@dataclass(frozen=True)
class Measurement:
    peak_bytes: int  # baseline + peak_delta
    baseline_bytes: int  # alive when the step starts
    peak_delta: int  # largest running sum of allocator deltas during the step
    events: int  # allocator events seen


@contextmanager
def threads(n: int):
    """``torch.set_num_threads(n)`` for a block: CPU kernels' scratch (and so the estimate, which
    measures them) depends on the thread count, so predict with the measured run's."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def recorded():
    """Build a model inside this block when its step may free what the build allocated before the
    step's peak (bitsandbytes' 4-bit weights, repacked for the CPU at the first inference call).

    The CPU allocator reports a free to the profiler only for allocations it made while memory
    profiling was on (c10/core/CPUAllocator.cpp ``ProfiledCPUMemoryReporter``: ``New`` records the
    size only then, ``Delete`` reports only what it finds): a storage built before profiling is
    freed silently, and the measurement keeps counting it.  Under this block (a profiling session
    that records nothing else) every allocation is recorded, so its later free is seen."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        yield


def baseline_bytes(model, optimizer, sample, scaler=None) -> int:
    storages: dict[int, int] = {}
    for tensors in steps.state_tensors(model, optimizer, sample, scaler).values():
        for t in tensors.values():
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _allocation_deltas(prof) -> list[tuple[int, int]]:
    from torch._C._profiler import _EventType

    deltas = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            deltas.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    deltas.sort(key=lambda d: d[0])
    return deltas


def measure_cpu(
    model: torch.nn.Module,
    sample: Any,
    mode: Mode | str = Mode.TRAIN,
    optimizer: str | steps.OptimizerFactory | None = "adamw",
    loss_fn: steps.LossFn | None = None,
    amp: str | None = None,
    grad_scaler: bool | None = None,
    strategy=None,
    before: Callable[[torch.nn.Module, Any], None] | None = None,
    keep_output: bool = True,
) -> Measurement:
    """Run one warm-up step and one measured step of ``model`` on real CPU tensors.

    The step is ``estimator.capture.steps.run``: the same code the estimator runs on fake tensors, with
    the same precision (``amp``, ``grad_scaler`` as in ``estimator.report``).  A measured step
    whose ``GradScaler`` found inf/nan gradients (and skipped ``optimizer.step()``) raises: the
    estimator predicts the step with finite gradients.  ``strategy``: an
    ``estimator.vocab.strategy.Strategy`` (gradient accumulation, activation checkpointing, autocast,
    fp32 master weights).  ``before(model, mode)`` runs after the warm-up, just before the measured
    step (``validators.zoo`` reads the data-dependent sizes of the measured step there).
    ``keep_output``: as in ``estimator.report``.
    """
    strategy = strategy or steps.DEFAULT
    if strategy.master_weights:
        optimizer = steps.master_weights(steps.optimizer_factory(optimizer))
    precision = steps.Precision.of(amp or strategy.amp, strategy.grad_scaler if grad_scaler is None else grad_scaler,
                                  Mode(mode))
    mode, opt, loss_fn, scaler = warm_up(model, sample, mode, optimizer, loss_fn, precision, strategy)
    if before is not None:
        before(model, mode)
    baseline = baseline_bytes(model, opt, sample, scaler)
    scale = None if scaler is None else scaler.get_scale()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = steps.run(model, sample, mode, opt, loss_fn, precision=precision, scaler=scaler, strategy=strategy,
                          keep_output=keep_output)
    del result
    if skipped(scaler, scale, opt):
        raise RuntimeError("the measured step's GradScaler found inf/nan gradients and skipped optimizer.step()")
    return _measurement(baseline, _allocation_deltas(prof))


def _measurement(baseline: int, deltas: list[tuple[int, int]]) -> Measurement:
    """``baseline`` plus the largest running sum of the step's allocator ``deltas``."""
    running = peak = 0
    for _, delta in deltas:
        running += delta
        peak = max(peak, running)
    return Measurement(baseline + peak, baseline, peak, len(deltas))


def measure_user_step(
    model: torch.nn.Module,
    sample: Any,
    fn: steps.StepFn,
    optimizer: str | steps.StateFactory | None = "adamw",
    mode: Mode | str = Mode.TRAIN,
    strategy=None,
) -> Measurement:
    """A user's own step (``report(step=fn)``) measured: the state built from the model
    (``steps.state_factory(optimizer)``), one unmeasured step, then the measured one.

    The bytes alive when the measured step starts are measured too, not listed: the model's
    parameters, buffers and held tensors and the sample, plus the net allocator delta of building
    the state and running the first step (whatever the step keeps: optimizer state, gradients it
    does not free, an EMA copy).  ``strategy``: ``Strategy(checkpoint=...)`` only.  A
    ``GradScaler`` of the state that skipped ``optimizer.step()`` in either step raises (as
    ``measure_cpu``): the estimate assumes finite gradients."""
    mode = Mode(mode)
    strategy = strategy or steps.DEFAULT
    factory = steps.state_factory(optimizer) if mode is Mode.TRAIN else None
    before = baseline_bytes(model, None, sample)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as setup:
        state = steps.user_state(model, mode, factory)
        scalers, scales = steady.scales(state)
        with checkpointing(model, strategy):
            result = fn(model, sample, state)
        del result
        gc.collect()
    scales = steady.check_scales("warm-up", scalers, scales)
    kept = sum(delta for _, delta in _allocation_deltas(setup))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with checkpointing(model, strategy):
            result = fn(model, sample, state)
        del result
    steady.check_scales("measured", scalers, scales)
    return _measurement(before + kept, _allocation_deltas(prof))
