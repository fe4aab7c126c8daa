"""Reductions and pooling in reduced precision on the CPU: measured on the host.

``mean`` / ``sum`` of a bf16 or fp16 tensor accumulate in fp32: ``mean_kernel_impl`` /
``sum_kernel_impl`` (aten/src/ATen/native/ReduceOps.cpp, cpu/SumKernel.cpp) copy the input to
fp32 first (``at::_to_copy``: an input-sized fp32 buffer alive during the op), which the fake
kernels do not show (−5 % and more on bf16 models with a global average pool).  Adaptive
average pooling (aten/src/ATen/native/cpu/AdaptiveAvgPoolKernel.cpp) likewise accumulates in
fp32 scratch for reduced-precision inputs.  Which buffers appear depends on the kernel's
vectorization path, so the calls are measured (``estimator.target.cpu``).
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
    """A reduction or adaptive pool of a bf16/fp16 tensor (fp32 tensors: the fake is exact)."""
    return in_reduced_precision(args, kwargs)
