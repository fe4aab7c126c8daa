"""The steady state every measurement starts from: prepared model, one unmeasured step."""

from __future__ import annotations

import gc
from typing import Any

import torch

from estimator import step
from estimator.categories import Mode


def warm_up(model: torch.nn.Module, sample: Any, mode: Mode | str, optimizer, loss_fn):
    """Put ``model`` in ``mode``, build its optimizer and run one unmeasured step (optimizer
    state is created lazily).  Returns ``(mode, optimizer, loss_fn)`` for the measured step."""
    mode = Mode(mode)
    opt = step.prepare(model, mode, step.optimizer_factory(optimizer) if mode is Mode.TRAIN else None)
    loss_fn = loss_fn or step.default_loss
    result = step.run(model, sample, mode, opt, loss_fn)
    del result
    gc.collect()
    return mode, opt, loss_fn
