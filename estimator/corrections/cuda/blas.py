"""cuBLAS products of matrices cuBLAS cannot read as they are: a contiguous clone first.

``addmm_out_cuda_impl`` (``mm``, ``addmm``; aten/src/ATen/native/cuda/Blas.cpp) hands each
matrix to ``prepare_matrix_for_cublas``: a non-overlapping and dense matrix (row- or
column-major) is used as it is; else one whose strides are ``(1, >= max(1, rows))`` or
``(>= max(1, cols), 1)`` is; else it is cloned contiguous (``tensor.clone(at::MemoryFormat::
Contiguous)``, through the caching allocator, alive during the op).  An expanded (stride 0)
gradient -- ``MeanBackward``'s or ``SumBackward``'s reaching a linear layer's backward -- is
cloned; the meta kernel clones nothing.  Where a stride comparison cannot be decided on the
sizes' expressions, the clone is assumed (an over-estimate of one matrix).  (The CPU's rules
differ: cpu/matmul.py.)
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import NO_FIX, Fix, correction, is_gemm_ready, leading_dimension_ok
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten


def clone_bytes(t: torch.Tensor):
    """Bytes ``prepare_matrix_for_cublas`` clones of the 2-D matrix ``t`` (0 when it uses it)."""
    if is_gemm_ready(t):
        return 0
    (rows, cols), (s0, s1) = (as_expr(x) for x in t.shape), (as_expr(x) for x in t.stride())
    if (s0 == 1 and leading_dimension_ok(s1, rows)) or (s1 == 1 and leading_dimension_ok(s0, cols)):
        return 0
    return as_expr(t.numel()) * t.element_size()


def _fix(m1: torch.Tensor, m2: torch.Tensor) -> Fix:
    copies = clone_bytes(m1) + clone_bytes(m2)
    return Fix(scratch=(copies,)) if copies else NO_FIX


@correction(aten.mm.default, targets=Target.CUDA)
def mm(args, kwargs, out) -> Fix:
    """``mm(self, mat2)``: the clones of ``prepare_matrix_for_cublas``."""
    return _fix(args[0], args[1])


@correction(aten.addmm.default, aten._addmm_activation.default, targets=Target.CUDA)
def addmm(args, kwargs, out) -> Fix:
    """``addmm(self, mat1, mat2)``: ``self`` is copied into the result; the clones of the two
    matrices."""
    return _fix(args[1], args[2])
