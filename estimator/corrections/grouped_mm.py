"""``torch._grouped_mm`` (``F.grouped_mm``): the matmul of mixture-of-experts layers
(transformers 5's default experts implementation, torchtitan).

Its meta kernel (torch/_meta_registrations.py ``_meta_grouped_mm_common``) copies the checks of
the CUDA kernel (``_grouped_mm_cuda``, aten/src/ATen/native/cuda/Blas.cpp), so fake fp32 inputs
fail ("Expected inputs of BF16 type") where the real CPU kernel (``_grouped_mm_fallback``,
aten/src/ATen/native/GroupedMMUtils.h: one ``mm_out`` per group into slices of the output) and
CUDA's fallback for other dtypes accept them.  These fake kernels give the same output without
the dtype check: one output allocation, of the shape ``_create_grouped_mm_output_tensor`` gives.
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import fake_kernel
from estimator.vocab.categories import Target

aten = torch.ops.aten


def _out_size(a: torch.Tensor, b: torch.Tensor, offs):
    if a.dim() == 2 and b.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise RuntimeError(f"Multiplicands must be 2D or 3D but got mat_a.dim()={a.dim()} and mat_b.dim()={b.dim()}")
    if a.dtype != b.dtype:
        raise RuntimeError(f"grouped_mm: mat_a and mat_b must have the same dtype, got {a.dtype} and {b.dtype}")


@fake_kernel(aten._grouped_mm.default, targets=Target.CPU)
def grouped_mm_cpu(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """CPU: a contiguous output (``at::empty`` in ``_grouped_mm``'s CPU path); the groups'
    ``mm_out`` write into it, nothing else is allocated."""
    _check(mat_a, mat_b)
    return mat_a.new_empty(_out_size(mat_a, mat_b, offs), dtype=out_dtype or mat_a.dtype)


@fake_kernel(aten._grouped_mm.default, targets=Target.CUDA)
def grouped_mm_cuda(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """CUDA: ``create_grouped_gemm_output_tensor`` (aten/src/ATen/native/GroupedMMUtils.h) pads
    the output's rows to 16 bytes (``alignment = 16 / itemsize``), as the meta kernel does on a
    CUDA build."""
    _check(mat_a, mat_b)
    dtype = out_dtype or mat_a.dtype
    size = _out_size(mat_a, mat_b, offs)
    align = 16 // dtype.itemsize
    padded = (size[-1] + align - 1) // align * align
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)
