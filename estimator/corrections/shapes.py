"""Fake kernels that specialize a symbolic size the real kernel does not depend on, replaced by
symbolic-friendly equivalents (every target: the capture is the same fake run)."""

from __future__ import annotations

import torch
import torch._refs

from estimator.corrections.registry import fake_kernel
from estimator.vocab.categories import Target

aten = torch.ops.aten


@fake_kernel(aten.constant_pad_nd.default, targets=(Target.CPU, Target.CUDA))
def constant_pad_nd(self, pad, value=0):
    """``F.pad(x, ..., mode="constant")``: the C++ ``constant_pad_nd`` (aten/src/ATen/native/
    PadNd.cpp) reads ``self.sizes()`` as integers, so on fake tensors every symbolic dim becomes
    a constant (torch 2.13: ``Eq(b, hint)``, which turned Hugging Face causal-LM losses,
    ``F.pad(labels, (0, 1), value=-100)``, into concrete captures).  ``torch._refs.constant_pad_nd``
    computes the same output with symbolic sizes.  Memory is the same: both allocate the output
    once (``at::empty`` + fill + a narrowed copy; the ref: ``torch.full`` + a narrowed copy)."""
    return torch._refs.constant_pad_nd(self, pad, value)
