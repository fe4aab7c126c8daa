"""The model and sample in another float dtype, for ``report(dtype_symbols=True)``.

``cast`` makes what ``model.to(dtype)`` and ``x.to(dtype)`` make of the tensors that *follow*
the model's dtype -- the registered parameters and buffers, and the sample's float tensors, that
have the model's float dtype -- without touching the user's model: a deep copy (the capture
deep-copies the model anyway) whose other tensors (an fp32 buffer of a bf16 model, integer
buffers, plain tensor attributes, which ``Module.to`` does not cast either) are the user's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from estimator.vocab.errors import CaptureError, InputError

# The float dtypes a dtype formula is captured at, with their element width in bytes.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAMES: dict[torch.dtype, str] = {**{d: n for n, d in DTYPES.items()}, torch.float64: "fp64"}


def width(name: str) -> int:
    """Bytes per element of the dtype ``name`` (``"fp32"``: 4)."""
    return DTYPES[name].itemsize


def model_dtype(model: nn.Module) -> torch.dtype:
    """The float dtype of the model's parameters (of its buffers when it has no float
    parameter); ``InputError`` when there is none or several."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes:
        dtypes = {t.dtype for t in model.buffers() if t.is_floating_point()}
    if not dtypes:
        raise InputError("dtype_symbols=True writes the bytes in terms of the model's float dtype, but the model has "
                         "no floating-point parameter or buffer")
    if len(dtypes) > 1:
        names = ", ".join(sorted(NAMES.get(d, str(d)) for d in dtypes))
        raise InputError(f"dtype_symbols=True needs one float dtype for the model's parameters, got {names}: cast the "
                         "model first (model.to(torch.float32)), or estimate each dtype with its own report")
    return dtypes.pop()


def cast(model: nn.Module, sample: Any, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    """``model`` and ``sample`` with the tensors in the model's float dtype cast to ``dtype`` (the
    objects themselves when that is the model's dtype already).  Shared tensors stay shared."""
    source = model_dtype(model)
    if dtype == source:
        return model, sample
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo or t.dtype != source:
            continue
        with torch.no_grad():
            copied = t.detach().to(dtype)
        memo[id(t)] = nn.Parameter(copied, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copied
    try:
        model = copy.deepcopy(model, memo)
    except Exception as exc:
        raise CaptureError(f"dtype_symbols=True: could not copy the model to cast it to {NAMES[dtype]} "
                           f"({type(exc).__name__}: {exc})") from exc
    samples: dict[int, torch.Tensor] = {}

    def convert(t):
        if not isinstance(t, torch.Tensor) or t.dtype != source:
            return t
        if id(t) not in samples:
            samples[id(t)] = t.detach().to(dtype)
        return samples[id(t)]

    return model, tree_map(convert, sample)
