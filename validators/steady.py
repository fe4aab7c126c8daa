"""The steady state every measurement starts from: prepared model, one unmeasured steps."""

from __future__ import annotations

import gc
from typing import Any

import torch

from estimator.capture import steps
from estimator.vocab.categories import Mode

# GradScaler: warm-up steps allowed to find inf/nan gradients (each halves the scale) before
# one is taken; the steady state has the optimizer state a taken step creates.
MAX_SKIPPED_STEPS = 32


def warm_up(model: torch.nn.Module, sample: Any, mode: Mode | str, optimizer, loss_fn, precision=steps.FP32,
            strategy=None):
    """Put ``model`` in ``mode``, build its optimizer (and ``GradScaler``) and run one unmeasured
    step (optimizer and scaler state are created lazily).  Returns ``(mode, optimizer, loss_fn,
    scaler)`` for the measured steps.

    With a ``GradScaler``, a warm-up step whose gradients overflowed is skipped by the scaler
    (no optimizer state yet): the warm-up repeats until a step is taken.  ``strategy``
    (``estimator.vocab.strategy.Strategy``): the step's accumulation and checkpointing."""
    mode = Mode(mode)
    strategy = strategy or steps.DEFAULT
    opt, scaler = steps.prepare(model, mode, steps.optimizer_factory(optimizer) if mode is Mode.TRAIN else None, precision)
    loss_fn = loss_fn or steps.default_loss
    for _ in range(MAX_SKIPPED_STEPS):
        before = None if scaler is None else scaler.get_scale()  # the initial scale before the first step
        result = steps.run(model, sample, mode, opt, loss_fn, precision=precision, scaler=scaler, strategy=strategy)
        del result
        if not skipped(scaler, before, opt):
            break
    else:
        raise RuntimeError(f"every one of {MAX_SKIPPED_STEPS} warm-up steps found inf/nan gradients")
    gc.collect()
    return mode, opt, loss_fn, scaler


def skipped(scaler, scale_before: float | None, optimizer) -> bool:
    """Whether the step just run skipped ``optimizer.step()``: ``GradScaler.update`` lowers the
    scale exactly when a gradient was inf/nan."""
    return scaler is not None and optimizer is not None and scaler.get_scale() < scale_before


def scales(state) -> tuple[list[torch.amp.GradScaler], list[float]]:
    """The ``GradScaler``s of a user step's state (``steps.instances_in``) and their scales now."""
    scalers = steps.instances_in(state, torch.amp.GradScaler)
    return scalers, [scaler.get_scale() for scaler in scalers]


def check_scales(which: str, scalers: list[torch.amp.GradScaler], before: list[float]) -> list[float]:
    """The scales after a user's step; raises if one fell (``GradScaler.update`` lowers the scale
    exactly when it skipped ``optimizer.step()`` for inf/nan gradients: the estimate assumes
    finite ones)."""
    after = [scaler.get_scale() for scaler in scalers]
    if any(a < b for a, b in zip(after, before)):
        raise RuntimeError(f"the {which} step's GradScaler found inf/nan gradients and skipped optimizer.step()")
    return after
