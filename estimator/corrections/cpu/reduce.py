"""Reductions and pooling on the CPU whose kernels allocate what the fake kernels do not show:
measured on the host.

``mean`` / ``sum`` of a bf16 or fp16 tensor accumulate in fp32: ``mean_kernel_impl`` /
``sum_kernel_impl`` (aten/src/ATen/native/ReduceOps.cpp, cpu/SumKernel.cpp) copy the input to
fp32 first (``at::_to_copy``: an input-sized fp32 buffer alive during the op), which the fake
kernels do not show (−5 % and more on bf16 models with a global average pool).  Adaptive
average pooling (aten/src/ATen/native/cpu/AdaptiveAvgPoolKernel.cpp) likewise accumulates in
fp32 scratch for reduced-precision inputs.  Which buffers appear depends on the kernel's
vectorization path, so the calls are measured (``estimator.corrections.cpu.host``).  ``sum`` of bools or
narrow integers casts to int64 the same way (``sum`` promotes them to int64).

Pooling kernels, forward and backward (aten/src/ATen/native/cpu/MaxPoolKernel.cpp,
AvgPoolKernel.cpp, AdaptiveAvgPoolKernel.cpp, AdaptiveMaxPoolKernel.cpp), first make their tensors
contiguous in the input's suggested memory format (``.contiguous(memory_format)``): a copy of
every tensor laid out otherwise -- the gradient of a ``sum`` is an expanded (stride-0) tensor, a
map may be transposed or channels-last with an ambiguous size-1 dim.  Measured against the CPU
allocator before: ``MaxPool2d(3, 1, 1)`` before a sum −18 % (b = 17), on a channels-last map −35 %;
``AdaptiveAvgPool1d(4)`` of a transposed grouped ``Conv1d`` output −26 %.  Such calls are measured
too; the contiguous ones allocate nothing but their outputs.
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import MEASURE, Fix, correction, in_reduced_precision, is_contiguous, measured
from estimator.vocab.categories import Target

aten = torch.ops.aten


_ADAPTIVE_AVG = (aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default,
                 aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default)
_POOLS = (
    aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
    aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default,
    aten.avg_pool2d.default, aten.avg_pool2d_backward.default, aten.avg_pool3d.default, aten.avg_pool3d_backward.default,
    aten.adaptive_max_pool2d.default, aten.adaptive_max_pool2d_backward.default,
    aten.adaptive_max_pool3d.default, aten.adaptive_max_pool3d_backward.default,
)


def _strided(args, kwargs) -> bool:
    """Whether a pooling call has a tensor argument that is not row-major contiguous (its kernel
    copies it)."""
    return any(isinstance(t, torch.Tensor) and not is_contiguous(t) for t in (*args, *kwargs.values()))


@measured(*_POOLS, *_ADAPTIVE_AVG, targets=Target.CPU)
def strided_pool(args, kwargs, out) -> bool:
    """A pooling call on a tensor laid out otherwise than row-major (the kernel's copy), or in
    reduced precision."""
    return _strided(args, kwargs) or in_reduced_precision(args, kwargs)


@measured(aten.sum.default, aten.sum.dim_IntList, targets=Target.CPU)
def reduced_precision_reduction(args, kwargs, out) -> bool:
    """A ``sum`` of a bf16/fp16 tensor (fp32 tensors: the fake is exact), or of a bool or integer
    tensor narrower than int64 (the result is int64: the kernel sums an int64 copy of every
    element, measured ``[8, 8000, -8000, -8]`` for 1,000 bools -- what ``mask.sum()`` costs;
    ``count_nonzero`` does not copy)."""
    x = args[0] if args else kwargs.get("self")
    widened = out.dtype == torch.int64 and x.dtype != torch.int64 and not x.is_floating_point()
    return in_reduced_precision(args, kwargs) or widened


@correction(aten.mean.default, aten.mean.dim, targets=Target.CPU)
def mean(args, kwargs, out) -> Fix:
    """A ``mean`` of a bf16/fp16 tensor is measured (above).  Any other: ``mean_out`` in
    aten/src/ATen/native/ReduceOps.cpp runs ``at::sum_out(result, ...).div_(dim_prod)`` on the
    CPU; ``div_`` of the int64 count wraps it in a CPU scalar tensor (8 B) and TensorIterator casts
    that to the result's dtype (its element size) -- both alive inside the op, the input's size
    irrelevant: measured ``[out, 8, 4, -4, -8]`` for fp32, ``[out, 8, 8, -8, -8]`` for fp64 and
    complex64 (a 12 B under-estimate where a mean is the step's peak)."""
    if in_reduced_precision(args, kwargs):
        return MEASURE
    return Fix(scratch=(8 + out.element_size(),))
