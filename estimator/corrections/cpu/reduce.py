"""Reductions and pooling in reduced precision on the CPU: measured on the host.

``mean`` / ``sum`` of a bf16 or fp16 tensor accumulate in fp32: ``mean_kernel_impl`` /
``sum_kernel_impl`` (aten/src/ATen/native/ReduceOps.cpp, cpu/SumKernel.cpp) copy the input to
fp32 first (``at::_to_copy``: an input-sized fp32 buffer alive during the op), which the fake
kernels do not show (−5 % and more on bf16 models with a global average pool).  Adaptive
average pooling (aten/src/ATen/native/cpu/AdaptiveAvgPoolKernel.cpp) likewise accumulates in
fp32 scratch for reduced-precision inputs.  Which buffers appear depends on the kernel's
vectorization path, so the calls are measured (``estimator.target.cpu``).  ``sum`` of bools or
narrow integers casts to int64 the same way (``sum`` promotes them to int64).
"""

from __future__ import annotations

import torch

from estimator.categories import Target
from estimator.corrections.registry import in_reduced_precision, measured

aten = torch.ops.aten


@measured(
    aten.mean.default, aten.mean.dim, aten.sum.default, aten.sum.dim_IntList,
    aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default,
    aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default,
    targets=Target.CPU,
)
def reduced_precision_reduction(args, kwargs, out) -> bool:
    """A reduction or adaptive pool of a bf16/fp16 tensor (fp32 tensors: the fake is exact), or
    the ``sum`` of a bool or integer tensor narrower than int64 (the result is int64: the kernel
    sums an int64 copy of every element, measured ``[8, 8000, -8000, -8]`` for 1,000 bools --
    what ``mask.sum()`` costs; ``count_nonzero`` does not copy)."""
    x = args[0] if args else kwargs.get("self")
    widened = out.dtype == torch.int64 and x.dtype != torch.int64 and not x.is_floating_point()
    return in_reduced_precision(args, kwargs) or widened
