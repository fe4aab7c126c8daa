"""CUDA target: the foreach reduction ``_foreach_norm`` (``clip_grad_norm_``'s per-gradient norms,
``corrections/clip.py``).

Sources: ``aten/src/ATen/native/cuda/ForeachReduceOp.cu`` (``foreach_tensor_norm_cuda``, the
version without ``_foreach_global_norm``: torch 2.13 has no such op),
``native/cuda/MultiTensorApply.cuh`` (``kChunkSize = 65536``) and ``native/ForeachUtils.h``
(``can_use_fast_route``).  No GPU was available: derived from the source, not measured.

The other foreach ops of clipping and ``zero_grad`` (``_foreach_mul_.Tensor``,
``_foreach_clamp_min_/max_.Scalar``, ``_foreach_zero_``) work in place through
``multi_tensor_apply`` and allocate nothing on either route: no entry.
"""

from __future__ import annotations

import math

import sympy
import torch

from estimator.corrections.registry import NO_FIX, Fix, aten, bind, correction, is_contiguous, numel
from estimator.vocab.categories import Target

K_CHUNK_SIZE = 65536  # kChunkSize, MultiTensorApply.cuh: elements one block reduces
_FAST_ORDS = (1.0, 2.0, math.inf)  # use_slowpath: NormType::L1, L2, LInf


def _hint(value) -> int:
    """A size's value at the capture's hint (no guard)."""
    return int(value.node.hint) if isinstance(value, torch.SymInt) else int(value)


def _dense(t: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense()`` without a guard on symbolic sizes: contiguous, or
    (static sizes only) dense in another dim order (channels-last)."""
    if is_contiguous(t):
        return True
    static = all(isinstance(x, int) for x in (*t.shape, *t.stride()))
    return static and t.is_non_overlapping_and_dense()


def fast_route(tensors, ord) -> bool:
    """``!use_slowpath(tensors, p)``: every tensor strided, non-overlapping and dense, of the first
    one's dtype (``can_use_fast_route``), none integral, bool or complex, and ``ord`` 1, 2 or inf."""
    first = tensors[0].dtype
    return (
        float(ord) in _FAST_ORDS
        and all(t.layout is torch.strided and t.dtype == first and _dense(t) for t in tensors)
        and first.is_floating_point
    )


@correction(aten._foreach_norm.Scalar, targets=Target.CUDA)
def foreach_norm_partials(args, kwargs, out) -> Fix:
    """``foreach_tensor_norm_cuda``: on the fast route, one block reduces each ``kChunkSize``
    chunk of each tensor into ``output_per_tensor = at::zeros({ntensors * max_chunks_per_tensor},
    opmath(out dtype))``, which ``lpnorm_cleanup`` then sums into the n 0-dim outputs
    (``vec_res``, what the fake kernel shows).  ``max_chunks_per_tensor`` is the largest tensor's
    ``ceil(numel / 65536)``; the opmath type is fp32 for fp32, fp16 and bf16 outputs, fp64 for
    fp64.  The buffer is allocated before the outputs and freed when the op returns: scratch.

    The slow route (a tensor not dense or of another dtype, an integral or complex dtype, ``ord``
    not in {1, 2, inf}) is ``foreach_tensor_norm_slow``: one ``linalg_vector_norm`` per tensor,
    the outputs the fake kernel shows; the reductions' own staging buffers are not modelled
    (``kernels.NOT_MODELLED``).  Sizes: the largest tensor at the capture's hint picks the chunk
    count (exact for gradients, whose sizes are fixed)."""
    bound = bind(aten._foreach_norm.Scalar, args, kwargs)
    tensors = [t for t in bound["self"] if isinstance(t, torch.Tensor)]
    if not tensors or not fast_route(tensors, bound["ord"]):
        return NO_FIX
    dtype = bound["dtype"] or tensors[0].dtype
    opmath = 8 if dtype == torch.float64 else 4
    largest = max(tensors, key=lambda t: _hint(t.numel()))
    chunks = sympy.ceiling(sympy.sympify(numel(largest)) / K_CHUNK_SIZE)
    chunks = int(chunks) if chunks.is_Integer else chunks
    return Fix(scratch=(len(bound["self"]) * chunks * opmath,))
