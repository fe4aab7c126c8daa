"""Fake copies of the user's model and sample: same shapes, dtypes and aliasing, no data.

The model is deep-copied with every parameter, buffer and tensor attribute replaced by a fake
CPU tensor (the user's model is not touched, and nothing of model size is allocated; models
built on the ``meta`` device work the same way).  Every sample tensor's dim 0 becomes the one
symbol of the batch size, or a concrete size for the fallback path.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
from torch.utils._pytree import tree_map_only

from estimator import step
from estimator.categories import Category
from estimator.errors import CaptureError

CPU = torch.device("cpu")


def _fake(t: torch.Tensor, mode: FakeTensorMode, symbolic_context=None) -> torch.Tensor:
    """A fake CPU tensor like ``t``: static shape unless ``symbolic_context`` says otherwise."""
    if t.device.type not in ("cpu", "meta"):  # e.g. CUDA: the capture always runs on fake CPU tensors
        t = t.to("meta")
    if symbolic_context is None:
        fake = mode.from_tensor(t, static_shapes=True)
    else:
        fake = mode.from_tensor(t, symbolic_context=symbolic_context)
    if fake.device != CPU:
        with mode:
            fake = fake.to(CPU)
    return fake


def fake_model(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A deep copy of ``model`` whose tensors are fake CPU tensors (shared tensors stay shared)."""
    memo: dict[int, Any] = {}
    state = step.state_tensors(model, None, ())
    for value in [*state[Category.PARAMETER].values(), *state[Category.BUFFER].values()]:
        if id(value) not in memo:
            fake = _fake(value.detach(), mode)
            if isinstance(value, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=value.requires_grad)
            memo[id(value)] = fake
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise CaptureError(
            f"could not copy the model ({type(exc).__name__}: {exc}); fxmem deep-copies the module "
            "structure with fake tensors: objects that cannot be deep-copied must not be module attributes"
        ) from exc


def fake_sample(sample: Any, mode: FakeTensorMode, batch: int, symbolic: bool,
                seq_dims: dict[int, tuple[int, ...]] | None = None) -> Any:
    """Fake copy of ``sample`` with dim 0 of every tensor set to ``batch``.

    ``symbolic=True`` makes that dim the one symbol of the batch size, with ``batch`` as its
    hint (duck sizing gives every tensor the same symbol).  ``seq_dims`` (``id(tensor) ->
    dims``) makes those dims of those tensors the one symbol of the sequence length, hinted
    by their size in the sample (which must differ from ``batch``: duck sizing would merge
    the two symbols).  The same tensor object under two names stays one tensor.

    Known limitations: sample tensors become contiguous, and distinct sample tensors that
    share a storage (one a view of another) become separate storages.
    """
    converted: dict[int, torch.Tensor] = {}

    seq_dims = seq_dims or {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in converted:
            meta = torch.empty((batch, *t.shape[1:]), dtype=t.dtype, device="meta")
            ctx = None
            if symbolic:
                dynamic = [DimDynamic.DUCK] + [DimDynamic.STATIC] * (t.dim() - 1)
                for d in seq_dims.get(id(t), ()):
                    dynamic[d] = DimDynamic.DUCK
                ctx = StatelessSymbolicContext(dynamic_sizes=dynamic)
            converted[id(t)] = _fake(meta, mode, ctx)
        return converted[id(t)]

    return tree_map_only(torch.Tensor, convert, sample)
