"""Normalization corrections (CPU kernels)."""

from __future__ import annotations

import torch

from estimator.categories import Target
from estimator.corrections.registry import NO_FIX, Fix, bind, correction
from estimator.symbolic import as_expr

aten = torch.ops.aten


@correction(aten.native_batch_norm.default, targets=Target.CPU)
def native_batch_norm(args, kwargs, out) -> Fix:
    """``batch_norm_cpu`` (aten/src/ATen/native/Normalization.cpp) computes per-channel mean and
    inverse std into two temporaries of C floats (``batch_norm_cpu_update_stats_template`` in
    training, ``batch_norm_cpu_transform_input_template``'s alpha/beta in eval) that the fake
    kernel does not show.  Measured (fp32 input, C = 32, (4, 32, 8, 8)): eval allocations
    ``[out, 128, 128, -128, -128]``; train ``[out, 128, 128, 128, 128, -128, -128, ...]``: both
    2 * C * 4 B on top of the outputs.
    """
    a = bind(aten.native_batch_norm.default, args, kwargs)
    x = a["input"]
    if x.dtype != torch.float32 or x.dim() < 2:
        return NO_FIX  # measured for fp32 only
    return Fix(scratch=(2 * as_expr(x.shape[1]) * 4,))
