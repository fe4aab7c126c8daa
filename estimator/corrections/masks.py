"""Boolean masks and other data-dependent ops: what their kernels allocate besides the output.

The sizes themselves (``n`` nonzeros) are decided by ``estimator.capture.datadep``; these
entries add the buffers the kernels hold while they run, in terms of that ``n``.  Measured with
the CPU allocator's events (``validators.cpu._allocation_deltas``) on a (8, 16, 64) fp32 input,
torch 2.13.0: see each entry.
"""

from __future__ import annotations

import sympy
import torch

from estimator.corrections import data_sizes
from estimator.corrections.registry import NO_FIX, Fix, correction, is_contiguous, nbytes, numel, parallel_on_cpu
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten
_LONG = 8  # bytes of an int64 index


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _nnz(mask: torch.Tensor):
    mode = data_sizes.active()
    return as_expr(mask.numel()) if mode is None else as_expr(mode.nnz(mask))


@correction(aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
            targets=(Target.CPU, Target.CUDA))
def mask_indices(args, kwargs, out) -> Fix:
    """Advanced indexing with a boolean mask (``x[mask]``, ``x[mask] = v`` and ``index``'s
    backward): ``expandTensors`` (aten/src/ATen/native/IndexingUtils.h) replaces each mask by
    ``mask.nonzero()``, an ``(n, mask.dim())`` int64 tensor whose columns are the indices, alive
    until the op returns, the output (``index``) allocated meanwhile.  Measured ``x[mask]`` with
    n = 64 of a (8, 16) mask: ``[1024, 16384, -1024]`` (64 · 2 · 8 = 1,024 B, then the output);
    ``_index_put_impl_`` (accumulate or not): ``[1024, -1024]``.  The same code runs on CUDA."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    masks = [i for i in indices if _is_mask(i)]
    if not masks:
        return NO_FIX
    return Fix(scratch=(sum((_nnz(m) * m.dim() * _LONG for m in masks), sympy.Integer(0)),))


@correction(aten.masked_select.default, targets=Target.CPU)
def masked_select(args, kwargs, out) -> Fix:
    """``masked_select_out_cpu_impl`` (aten/src/ATen/native/TensorAdvancedIndexing.cpp):
    ``mask.sum()`` first -- an 8-byte int64 result reduced from an int64 copy of every element
    (plus one int64 per thread when the reduction runs in parallel), freed before the output is
    allocated; then, unless the serial kernel runs (input and mask contiguous and unbroadcast, and
    fewer than ``GRAIN_SIZE`` elements or one thread), the int64 ``mask_long`` and
    ``mask_prefix_sum`` of every element, after the output.  Measured, 2 threads:
    1,000 elements ``[8, 8000, -8000, -8, out]``; broadcast ``[8, 8000, -8000, -8, out, 8000,
    8000, ...]``; 40,000 elements ``[8, 320000, 16, -16, -320000, -8, out, 320000, 320000, ...]``."""
    x, mask = args[0], args[1]
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    full = mask.expand(shape)  # what the kernel sums and selects through
    elements = numel(full)
    threads = torch.get_num_threads() * _LONG if parallel_on_cpu(full.numel()) else 0
    before = sympy.Max(0, 8 + _LONG * elements + threads - nbytes(out))  # the output does not exist yet
    unbroadcast = tuple(x.shape) == tuple(mask.shape) == tuple(shape)
    if unbroadcast and is_contiguous(x) and is_contiguous(mask) and not parallel_on_cpu(x.numel()):
        return Fix(scratch=(before,))
    return Fix(scratch=(before, 2 * _LONG * elements))


@correction(aten.masked_select.default, targets=Target.CUDA)
def masked_select_cuda(args, kwargs, out) -> Fix:
    """``masked_select_out_cuda_impl`` (aten/src/ATen/native/cuda/IndexKernel.cpp) indexes the
    broadcast input with the broadcast mask (``at::index_out``): the mask's ``nonzero()``, an
    ``(n, dims)`` int64 tensor, is alive while the output is written."""
    mask = args[1]
    dims = len(torch.broadcast_shapes(args[0].shape, mask.shape))
    return Fix(scratch=(as_expr(out.numel()) * dims * _LONG,))


@correction(aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
            targets=(Target.CPU, Target.CUDA))
def unique(args, kwargs, out) -> Fix:
    """``unique`` sorts: a sorted copy of the input and int64 sort indices and inverse/count
    buffers of every element (aten/src/ATen/native/Unique.cpp ``unique_cpu_sorted_template``;
    CUDA: thrust/cub sort buffers).  Measured on CPU (100 int64 elements):
    ``[800, 800, 800, 800, -800, 80, 800, 80, 88, ...]``: at most four element-sized int64
    buffers besides the outputs -- an upper estimate for every dtype and device."""
    x = args[0]
    return Fix(scratch=(4 * _LONG * numel(x) + 88,))


@correction(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor, targets=(Target.CPU, Target.CUDA))
def ctc_loss_backward(args, kwargs, out) -> Fix:
    """``ctc_loss_backward_cpu_template`` (aten/src/ATen/native/LossCTC.cpp; the CUDA kernel
    alike) computes ``log_beta``, shaped like the forward's ``log_alpha`` (argument 6), alive
    while the gradient is written.  Measured (T, B, C, L = 16, 4, 8, 5): ``[2048, 2816, -2816]``:
    the gradient, then log_beta = 4 · 16 · 11 · 4 B."""
    return Fix(scratch=(nbytes(args[6]),))
