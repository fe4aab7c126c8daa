"""Activation checkpointing while the step runs: ``Strategy(checkpoint=...)``'s modules run their
forward under ``torch.utils.checkpoint.checkpoint`` (in the capture, the probe and the validators'
real runs alike)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from estimator.vocab.strategy import Strategy


@contextlib.contextmanager
def checkpointing(model: nn.Module, strategy: Strategy) -> Iterator[None]:
    """Run the selected modules' forward under ``torch.utils.checkpoint.checkpoint`` (an
    instance attribute ``forward`` shadowing the class's, removed on exit)."""
    selected = strategy.checkpointed(model)
    saved = []
    for _, module in selected:
        had = "forward" in vars(module)
        saved.append((module, had, vars(module).get("forward")))
        module.forward = functools.partial(_checkpointed, module.forward, strategy.checkpoint_reentrant)
    try:
        yield
    finally:
        for module, had, forward in saved:
            if had:
                module.forward = forward
            else:
                del module.forward


def _checkpointed(forward, reentrant: bool, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if reentrant:  # the reentrant variant takes no keyword arguments
        return torch.utils.checkpoint.checkpoint(
            functools.partial(forward, **kwargs) if kwargs else forward, *args, use_reentrant=True
        )
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
