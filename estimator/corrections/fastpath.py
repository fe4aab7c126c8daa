"""Native fast paths of ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.TransformerEncoder``, taken where real tensors take them and priced as their kernels run
(both targets).

**The decision.**  In eval without grad, the forwards (torch/nn/modules/activation.py,
transformer.py of torch 2.13) call ``torch._native_multi_head_attention`` /
``torch._transformer_encoder_layer_fwd`` and, for an encoder given ``src_key_padding_mask``,
convert the input to a nested tensor (``torch._nested_tensor_from_mask``), run the layers on it
and pad it back (``to_padded_tensor``).  Each check refuses the fast path when
``torch.overrides.has_torch_function(tensor_args)``, which the capture's substitution mode made
true for every argument.  ``registry.fast_path`` lets those checks answer as for the real tensors
(FakeTensors disable ``__torch_function__``); every other condition (training, grad, dtypes,
``batch_first``, even heads, masks, hooks, autocast, ``enable_nested_tensor``, the left-aligned
mask check) is evaluated by torch's own code on the fake tensors.

**The price.**  The native ops' meta kernels give only their outputs.  The substitutes below
run, on the fake tensors, the aten ops the C++ kernels call, in their order, with the C++
locals' lifetimes (Python locals freed where the C++ destroys them):

- ``native_multi_head_attention_cpu`` (aten/src/ATen/native/transformers/attention.cpp):
  ``qkv_projection`` (``gemm_nt`` = ``matmul(query, w.t())``), ``_transform_bias_rescale_qkv``
  (one ``[3, B, H, T, dh]`` buffer; ``qkv`` freed), ``bmm_nt`` (``[B·H, T, T]``),
  ``masked_softmax`` (the mask ``.to(bool)`` and ``_masked_softmax``'s output; the scores freed),
  ``bmm_nn`` into ``q``'s storage, the weights dropped unless ``need_weights``,
  ``transform0213_gemm_nt_bias`` (``permute(0, 2, 1, 3).contiguous()`` and ``linear`` =
  ``addmm``), then ``sum(1) / num_head`` for averaged weights.  Read against the CPU allocator's
  events of the real kernel (profiler memory events under ``aten::_native_multi_head_attention``,
  torch 2.13): the same allocations in the same order; the predicted peaks equal the measured
  ones to the byte (tests/test_fastpath.py, the ``mha_padding`` / ``encoder_padding`` zoo rows).
- ``native_multi_head_attention_cuda`` (transformers/cuda/attention.cu): the same, except the
  fused branch (self-attention, ``dim_per_head % 8 == 0``, ``need_weights=False``, no mask, and
  ``_fused_sdp_choice`` picking flash or mem-efficient: ``linear`` -> ``chunk`` ->
  ``scaled_dot_product_attention`` (the CUDA substitute of ``cuda/attention_substitute.py``) ->
  ``transpose(1, 2).reshape`` -> ``linear``) and ``masked_softmax_cuda``'s fallback
  (``softmax(input.masked_fill(mask, -inf))`` beside the discarded ``empty_like`` output when a row
  has more than 1024 elements or more than 4096 bytes, or the mask is not contiguous).
- ``transformer_encoder_layer_forward`` (transformers/transformer.cpp): attention, ``add_``,
  ``layer_norm`` (output, mean, rstd; mean and rstd dropped), the FFN (``_addmm_activation`` and
  ``addmm``), ``add_``, ``layer_norm``; ``norm_first`` in its order; ``pre_ffn_res`` alive to the end.
- Nested tensors (aten/src/ATen/native/nested/: NestedTensorMath.cpp ``nested_tensor_from_mask``,
  NestedTensorUtils ``nested_from_padded_generic``, ``NestedTensor_to_padded_tensor_generic``,
  NestedTensorTransformerFunctions.cpp ``NestedTensor_matmul``,
  ``NestedTensor_times_Tensor_plus_Tensor_addmm``, ``NestedTensor_softmax_dropout``, the nested
  ``layer_norm``): a ``NestedTensorImpl`` holds a buffer of ``n·d`` elements and, on the host,
  ``nested_sizes`` ``[b, 2]``, ``nested_strides`` ``[b, 2]`` and ``storage_offsets`` ``[b]`` int64
  (``Nested`` below stands for it on fake tensors).  ``n`` (real tokens) and ``T'`` (the longest
  row, what ``to_padded_tensor`` pads to) depend on the data: they come from
  ``estimator.capture.datadep`` (sites ``<encoder>:_nested_tensor_from_mask#0`` and
  ``<encoder>:to_padded_tensor#0``; the upper bounds ``b·s`` and ``s`` by default, the sample's
  own values with ``data_dependent="sample"``), and so does the left-aligned mask check (site
  ``<encoder>:_nested_tensor_from_mask_left_aligned#0``, 0 or 1; default 1: the fast path).  The
  per-row loops of the generic kernels (a ``[len_i, d]`` bool mask padded per row, one softmax
  per row) are priced by their longest row, which is exact for the running peak (the loop's
  allocations are smaller than what follows it) -- except the per-row softmax: a row shorter than
  ``T'`` slices a non-contiguous block that ``softmax`` copies first, so when the rows differ in
  length (``n < b·T'``) the transient is priced for a row of ``T' - 1`` tokens, an upper bound.
- CPU kernels that switch to a parallel algorithm from ``GRAIN_SIZE`` (32,768) elements on more
  than one thread (``masked_select``'s int64 prefix sums, ``sum``'s per-thread partials) add a
  guard on the batch size: the formula holds on one side of the switch.

Not modelled on CUDA (no GPU was available to measure): the nested path's device metadata and
nested attention preprocessing (listed in ``cuda/attention_substitute.py``'s ``NOT_MODELLED``, so
in every CUDA report's notes).
"""

from __future__ import annotations

import math

import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from estimator.corrections import data_sizes
from estimator.corrections.registry import bind, fake_kernel, fast_path, parallel_on_cpu, substitute
from estimator.vocab.categories import Target
from estimator.vocab.errors import CaptureError
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten
_BOTH = (Target.CPU, Target.CUDA)
_LONG = torch.int64

_FORWARDS = (nn.MultiheadAttention.forward, nn.TransformerEncoderLayer.forward, nn.TransformerEncoder.forward)


def _cuda_autocast() -> bool:
    """Under CUDA autocast ``torch.is_autocast_enabled()`` (the CUDA state) is true and every
    check refuses ("autocast is enabled"); the capture emulates CUDA autocast on the CPU's
    autocast state (``cuda/autocast.py``), which that call does not read.  (On the CPU,
    ``torch.autocast("cpu")`` does not refuse: the same call reads the CUDA state there too.)"""
    return torch.is_autocast_enabled("cpu")


fast_path(*_FORWARDS, targets=Target.CPU)
fast_path(*_FORWARDS, targets=Target.CUDA, refuse=_cuda_autocast)


# ============================================================================================
# Ops without a fake kernel (their CPU kernels only run on real tensors)
# ============================================================================================


def _packed_qkv(qkv, qkv_bias, num_head, dtype):
    dim = qkv_bias.shape[0] // 3
    packed = qkv.new_empty((3, qkv.shape[0], num_head, qkv.shape[1], dim // num_head), dtype=dtype)
    return packed[0], packed[1], packed[2]


@fake_kernel(aten._transform_bias_rescale_qkv.default, targets=Target.CPU)
def transform_bias_rescale_qkv_cpu(qkv, qkv_bias, num_head):
    """``transform_bias_rescale_qkv_cpu`` (attention.cpp) on a dense ``[B, T, 3D]``: one
    ``empty({3, B, num_head, T, dim_per_head}, qkv.options())``, split into q, k, v views."""
    return _packed_qkv(qkv, qkv_bias, num_head, qkv.dtype)


@fake_kernel(aten._transform_bias_rescale_qkv.default, targets=Target.CUDA)
def transform_bias_rescale_qkv_cuda(qkv, qkv_bias, num_head):
    """``transform_bias_rescale_qkv_cuda`` (attention.cu): the same buffer in
    ``qkv_bias.options()``."""
    return _packed_qkv(qkv, qkv_bias, num_head, qkv_bias.dtype)


@fake_kernel(aten._masked_softmax.default, targets=_BOTH)
def masked_softmax_output(x, mask, dim=None, mask_type=None):
    """``masked_softmax_cpu`` (SoftMax.cpp) and the persistent ``masked_softmax_cuda``: the
    output ``empty_like(input)`` (contiguous), nothing else."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ============================================================================================
# Nested tensors on fake tensors
# ============================================================================================


class Nested:
    """A strided ``NestedTensorImpl`` of the fast path, on fake tensors: ``buffer`` (``[n, d]``:
    the 1-D buffer's bytes), ``sizes`` / ``strides`` / ``offsets`` (the host metadata; None on
    the CUDA target, where they are not device memory), ``rows`` (b, the leading dim of the
    metadata), ``longest`` (T'), ``width`` (d).  It answers what the fast-path checks ask of a
    nested tensor (``is_nested``, ``dim()``, ``dtype``, ``device``, ``requires_grad``) and
    ``to_padded_tensor``; any other torch function on it is refused with a clear error."""

    _fxmem_plain_tensor = True  # registry.fast_path: stands for a plain torch.Tensor
    is_nested = True
    requires_grad = False

    def __init__(self, spec, buffer, sizes, strides, offsets, rows, longest, width):
        self.spec, self.buffer, self.sizes, self.strides, self.offsets = spec, buffer, sizes, strides, offsets
        self.rows, self.longest, self.width = rows, longest, width

    @property
    def dtype(self):
        return self.buffer.dtype

    @property
    def device(self):
        return self.buffer.device

    @property
    def tokens(self):
        return self.buffer.shape[0]

    def dim(self) -> int:
        return 3

    def is_contiguous(self, memory_format=torch.contiguous_format) -> bool:
        return True

    def to_padded_tensor(self, padding, output_size=None):
        return to_padded_tensor(self, output_size)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        raise CaptureError(f"{name} on a nested tensor of the native TransformerEncoder fast path: fxmem prices "
                           "only the encoder's own layers and to_padded_tensor on it")


def _metadata(spec, sizes):
    """``construct_offsets`` (``empty({b}, kLong)``) then ``construct_nested_strides``
    (``sizes.new_empty(sizes.sizes())``) of a new ``NestedTensorImpl``; host memory on CUDA."""
    if sizes is None:
        return None, None
    offsets = sizes.new_empty((sizes.shape[0],))
    strides = sizes.new_empty(sizes.shape)
    return offsets, strides


def _wrap(like: Nested, buffer, sizes) -> Nested:
    offsets, strides = _metadata(like.spec, sizes)
    return Nested(like.spec, buffer, sizes, strides, offsets, like.rows, like.longest, buffer.shape[1])


def _new_sizes(like: Nested):
    """``nt.get_nested_sizes().clone()`` then ``index_put_({Slice(), -1}, d)``: the clone, and
    the 8-byte int64 tensor the Scalar is wrapped in while ``index_put_`` runs."""
    if like.sizes is None:
        return None
    sizes = like.sizes.clone()
    wrapped = sizes.new_empty(())
    del wrapped
    return sizes


def _nested_times_dense(nt: Nested, weight, bias=None, use_gelu=None) -> Nested:
    """``NestedTensor_matmul`` (no bias) / ``NestedTensor_times_Tensor_plus_Tensor_addmm``
    (NestedTensorTransformerFunctions.cpp): ``mm`` / ``addmm`` / ``_addmm_activation`` of the
    buffer viewed ``[n, d]`` with ``weight.t()``, the sizes cloned, a new ``NestedTensorImpl``."""
    if bias is None:
        out = torch.mm(nt.buffer, weight.t())
    elif use_gelu is None:
        out = torch.addmm(bias, nt.buffer, weight.t())
    else:
        out = torch._addmm_activation(bias, nt.buffer, weight.t(), use_gelu=use_gelu)
    return _wrap(nt, out, _new_sizes(nt))


def _row_masks(like, rows, longest, length, width):
    """``nested_from_padded_generic``'s per-row masks: ``new_full([len_i, d], true)`` padded to
    ``[length, d]`` (``pad_tensor_to_shape``: ``constant_pad_nd``, a clone when already that
    size), all alive until the function returns; the unpadded mask of the longest row is the
    loop's transient (shorter rows' are smaller)."""
    row = like.new_empty((longest, width), dtype=torch.bool)
    padded = like.new_empty((rows, length, width), dtype=torch.bool)
    del row
    return padded


def _masked_select_into(padded, final_mask, tokens, width):
    """``padded.masked_select(final_mask)`` on the CPU (``masked_select_out_cpu_impl``,
    TensorAdvancedIndexing.cpp): ``mask.sum()`` (an 8-byte int64 result, reduced from an int64
    copy of the whole mask; a parallel reduction adds ``two_pass_reduction``'s buffer of one int64
    per thread, TensorIteratorReduce.cpp), ``item()``, the ``n·d`` result; then, unless the serial
    kernel runs (fewer than ``GRAIN_SIZE`` elements or one thread), the int64 ``mask_long`` and
    ``mask_prefix_sum`` of every element.  Measured: (32, 32, 64) fp32, 2 threads:
    ``[8, 524288, 16, -16, -524288, -8, 196608, 524288, 524288, -524288, -524288]``."""
    numel = final_mask.numel()
    parallel = parallel_on_cpu(numel)
    total = final_mask.new_empty((), dtype=_LONG)
    cast = final_mask.new_empty(final_mask.shape, dtype=_LONG)
    if parallel:
        partial = final_mask.new_empty((torch.get_num_threads(),), dtype=_LONG)
        del partial
    del cast, total
    out = padded.new_empty((tokens, width))
    if parallel:
        mask_long = final_mask.new_empty(final_mask.shape, dtype=_LONG)
        prefix_sum = final_mask.new_empty(final_mask.shape, dtype=_LONG)
        del mask_long, prefix_sum
    return out


def _nested_from_padded(spec, padded, sizes, transform_0213: bool, rows, longest, tokens) -> Nested:
    """``_nested_from_padded(padded, sizes, do_transform_0213)``.

    CPU (``nested_from_padded_generic``, NestedTensorUtils/NestedTensorMath.cpp): for
    ``transform_0213`` the ``[B, H, T, dh]`` input is ``permute(0, 2, 1, 3).contiguous()``'d to
    ``[B, T, H·dh]``; the per-row masks, their ``stack``, ``masked_select`` (the new buffer), the
    ``NestedTensorImpl``; the masks and the permuted copy die on return.

    CUDA (``nested_from_padded_cuda``, nested/cuda/NestedTensorTransformerFunctions.cpp): fp32 and
    fp16 3-D (or 4-D with the transform) inputs take a kernel that writes the ``n·d`` buffer
    directly (its int32 metadata, a few bytes per row, is not priced); other dtypes the generic
    path."""
    if spec.is_cuda and padded.dtype in (torch.float32, torch.float16):
        width = padded.shape[1] * padded.shape[3] if transform_0213 else padded.shape[2]
        return Nested(spec, padded.new_empty((tokens, width)), sizes, None, None, rows, longest, width)
    if transform_0213:
        b, heads, length, head_dim = padded.shape
        padded = padded.permute(0, 2, 1, 3).contiguous().view(b, length, heads * head_dim)
    width, length = padded.shape[2], padded.shape[1]
    masks = _row_masks(padded, rows, longest, length, width)
    final_mask = masks.new_empty(masks.shape)  # at::stack(masks)
    buffer = _masked_select_into(padded, final_mask, tokens, width)
    offsets, strides = _metadata(spec, sizes)
    nested = Nested(spec, buffer, sizes, strides, offsets, rows, longest, width)
    del final_mask, masks, padded
    return nested


def to_padded_tensor(nt: Nested, output_size=None):
    """``NestedTensor_to_padded_tensor_generic`` (NestedTensorMath.cpp): each row reshaped and
    padded to the longest row (``pad_tensor_to_shape``: a ``[T', d]`` copy each, alive until the
    function returns), ``stack`` (``[b, T', d]``), then, with ``output_size``, one more
    ``constant_pad_nd`` to it (a clone when no padding is needed).  On CUDA
    (``NestedTensor_to_padded_tensor_cuda``) fp32/fp16 write the output directly."""
    buffer = nt.buffer
    if nt.spec.is_cuda and buffer.dtype in (torch.float32, torch.float16):
        shape = tuple(output_size) if output_size is not None else (nt.rows, nt.longest, nt.width)
        return buffer.new_empty(shape)
    rows = buffer.new_empty((nt.rows, nt.longest, nt.width))
    stacked = buffer.new_empty((nt.rows, nt.longest, nt.width))
    if output_size is None:
        del rows
        return stacked
    out = buffer.new_empty(tuple(output_size))
    del stacked, rows
    return out


# ============================================================================================
# native_multi_head_attention
# ============================================================================================


def _gemm_nt(x, weight):
    """``gemm_nt``: ``at::native::matmul(x, w.t())`` (dense) or ``NestedTensor_matmul``."""
    if isinstance(x, Nested):
        return _nested_times_dense(x, weight)
    return torch.matmul(x, weight.t())


def _qkv_projection(query, key, value, embed_dim, qkv_weight):
    """``qkv_projection`` (attention.cpp): one projection for self-attention; otherwise the
    weight split, two or three projections and ``cat`` on dim 2."""
    if key is value:
        if query is key:
            return _gemm_nt(query, qkv_weight)
        if isinstance(query, Nested) or isinstance(key, Nested):
            raise CaptureError("_native_multi_head_attention with nested tensors and separate query/key: "
                               "not supported by fxmem")
        q_w, kv_w = qkv_weight.split_with_sizes([embed_dim, 2 * embed_dim], 0)
        q = _gemm_nt(query, q_w)
        kv = _gemm_nt(key, kv_w)
        out = torch.cat([q, kv], 2)
        del q, kv
        return out
    if any(isinstance(t, Nested) for t in (query, key, value)):
        raise CaptureError("_native_multi_head_attention with nested tensors and separate query/key/value: "
                           "not supported by fxmem")
    q_w, k_w, v_w = qkv_weight.chunk(3, 0)
    q = _gemm_nt(query, q_w)
    k = _gemm_nt(key, k_w)
    v = _gemm_nt(value, v_w)
    out = torch.cat([q, k, v], 2)
    del q, k, v
    return out


def _round_up(x, m: int):
    """``T + (m - T % m) % m`` (an int or a SymInt)."""
    return x + (m - x % m) % m


def _transform_nested(spec, qkv: Nested, qkv_bias, num_head):
    """``_transform_bias_rescale_qkv`` of a nested ``qkv``.  CPU: ``qkv.to_padded_tensor(0)``
    (``[b, T', 3D]``, its per-row copies dying inside), the ``[3, b, H, T', dh]`` buffer, the
    padded copy freed.  CUDA: no padded copy (the add-padding kernel reads the buffer), ``T``
    rounded up to a multiple of 8, a small int32 metadata copy (not priced)."""
    dim = qkv_bias.shape[0] // 3
    length = qkv.longest
    if spec.is_cuda:
        length = _round_up(length, 8)
        packed = qkv_bias.new_empty((3, qkv.rows, num_head, length, dim // num_head))
        return packed[0], packed[1], packed[2]
    padded = to_padded_tensor(qkv)
    packed = padded.new_empty((3, qkv.rows, num_head, length, dim // num_head))
    del padded
    return packed[0], packed[1], packed[2]


def _masked_softmax(spec, scores, mask, query, mask_type):
    """``masked_softmax`` (attention.cpp): a nested query without mask -> the per-row softmax
    (``NestedTensor_softmax_dropout``: an ``empty_like`` output, then per row a softmax of its
    ``[H, len, len]`` block and the wrapped 0 of two ``index_put_`` calls; CUDA:
    ``NestedTensor_to_mask`` ``[b, T]`` bool moved to the device and ``_masked_softmax``); a
    non-bool mask ``.to(bool)``; ``_masked_softmax``; no mask: ``_softmax_out`` in place."""
    if isinstance(query, Nested) and mask is None:
        if spec.is_cuda:
            mask = scores.new_empty((scores.shape[0], scores.shape[2]), dtype=torch.bool)
            return _masked_softmax_kernel(spec, scores, mask, 1)
        out = torch.empty_like(scores, memory_format=torch.contiguous_format)
        heads, longest = scores.shape[1], scores.shape[2]
        if _rows_all_longest(query):
            row = scores.new_empty((heads, longest, longest))  # the softmax of a full row's block
        else:
            # A row shorter than T' slices a non-contiguous block: softmax_cpu_out copies it
            # (input.contiguous()) before writing its output; such a row has at most T' - 1 tokens.
            shorter = longest - 1
            if isinstance(longest, int) and 2 * shorter * shorter < longest * longest:
                shorter = longest
            copy = scores.new_empty((heads, shorter, shorter))
            row = scores.new_empty((heads, shorter, shorter))
            del copy
        wrapped = scores.new_empty(())  # index_put_(..., 0): the 0 as a tensor of the output's dtype
        del wrapped, row
        return out
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(torch.bool)
    if mask is None:
        return scores  # _softmax_out(scores, scores, ...): in place
    return _masked_softmax_kernel(spec, scores, mask, mask_type)


def _rows_all_longest(nt: Nested) -> bool:
    """Whether every row of ``nt`` has ``T'`` tokens (``n == b·T'``, decided on the expressions,
    without a guard)."""
    gap = sympy.expand(as_expr(nt.tokens) - as_expr(nt.rows) * as_expr(nt.longest))
    return gap == 0


def _masked_softmax_kernel(spec, scores, mask, mask_type):
    """``_masked_softmax``: the output only on the CPU and in CUDA's persistent kernel; CUDA's
    fallback (a row of more than 1024 elements or 4096 bytes, or a non-contiguous mask) computes
    ``softmax(input.masked_fill(mask, -inf))`` beside its discarded ``empty_like`` output."""
    length = scores.shape[-1]
    if spec.is_cuda and not _persistent(length, scores.element_size(), mask):
        discarded = torch.empty_like(scores)
        if mask.dim() == 2 and mask_type == 1:
            mask = mask.view(mask.shape[0], 1, 1, mask.shape[1])
        filled = scores.masked_fill(mask, -math.inf)
        out = torch.softmax(filled, -1)
        del filled, discarded
        return out
    return torch._masked_softmax(scores, mask, scores.dim() - 1, mask_type)


def _persistent(length, itemsize: int, mask) -> bool:
    static = length if isinstance(length, int) else None
    if static is None:
        hint = length.node.hint if hasattr(length, "node") else None
        static = int(hint) if hint is not None else 1 << 30
    return static <= 1024 and static * itemsize <= 4096 and mask.is_contiguous()


def _bmm_nt(a, b):
    """``bmm_nt``: ``bmm(a.view(B·H, T, dh), b.view(...).transpose(2, 1))`` viewed 4-D."""
    batch, heads, length, head_dim = a.shape
    out = torch.bmm(a.reshape(-1, length, head_dim), b.reshape(-1, b.shape[2], head_dim).transpose(2, 1))
    return out.view(batch, heads, length, b.shape[2])


def _transform0213_gemm_nt_bias(spec, ctx, weight, bias, query):
    """``transform0213_gemm_nt_bias``: nested -> ``_nested_from_padded(ctx, sizes, true)`` and the
    nested ``addmm``; dense -> ``permute(0, 2, 1, 3).contiguous()`` viewed ``[B·T, D]`` and
    ``at::native::linear`` (``addmm``)."""
    if isinstance(query, Nested):
        nested = _nested_from_padded(spec, ctx, query.sizes, True, query.rows, query.longest, query.tokens)
        out = _nested_times_dense(nested, weight, bias)
        del nested
        return out
    b, heads, length, head_dim = ctx.shape
    a = ctx.permute(0, 2, 1, 3).contiguous()
    out = torch.addmm(bias, a.view(-1, heads * head_dim), weight.t())
    del a
    return out.view(b, length, out.shape[1])


def native_multi_head_attention(spec, query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                proj_bias, mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    """``native_multi_head_attention_cpu`` / ``_cuda`` on fake tensors (see the module docstring);
    returns ``(output, weights or None)``."""
    if mask is not None and isinstance(query, Nested):
        raise CaptureError("NestedTensor with mask is not supported yet (_native_multi_head_attention)")
    dim_per_head = embed_dim // num_head
    if spec.is_cuda and query is key and key is value and dim_per_head % 8 == 0 and not need_weights \
            and mask is None:
        fused = _cuda_fused(spec, query, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias)
        if fused is not None:
            return fused, None
    qkv = _qkv_projection(query, key, value, embed_dim, qkv_weight)
    if isinstance(query, Nested):
        q, k, v = _transform_nested(spec, qkv, qkv_bias, num_head)
    else:
        q, k, v = torch._transform_bias_rescale_qkv(qkv, qkv_bias, num_head)
    del qkv
    scores = _bmm_nt(q, k)
    scores = _masked_softmax(spec, scores, mask, query, mask_type)
    torch.bmm(scores.reshape(-1, scores.shape[2], scores.shape[3]), v.reshape(-1, v.shape[2], v.shape[3]),
              out=q.view(-1, q.shape[2], q.shape[3]))  # bmm_nn into q's storage
    ctx = q
    if not need_weights:
        scores = None
    proj = _transform0213_gemm_nt_bias(spec, ctx, proj_weight, proj_bias, query)
    del ctx, q, k, v
    if need_weights and average_attn_weights:
        weights = scores.sum(1)
        del scores
        weights.div_(num_head)
        return proj, weights
    return proj, scores


def _cuda_fused(spec, query, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias):
    """attention.cu's fused branch when ``_fused_sdp_choice`` on the (unprojected) query's
    ``[B, H, T, dh]`` views picks flash or mem-efficient; None otherwise (cuDNN first, as the
    newest sdp_utils.cpp orders it on sm90+, leaves the bmm path).  A nested query is judged on
    its buffer viewed ``[1, H, n, dh]`` (the nested checks of sdp_utils are not modelled), and its
    fused path priced as ``nested_linear`` (``[n, 3D]``), the attention output (``[n, D]``), the
    ``transpose(1, 2).reshape`` copy and ``nested_linear`` (``[n, D]``): an estimate."""
    from estimator.corrections.cuda import attention_backends, attention_substitute

    dim_per_head = embed_dim // num_head
    source = query.buffer.unsqueeze(0) if isinstance(query, Nested) else query  # nested: [1, n, D] views
    view = source.view(source.shape[0], -1, num_head, dim_per_head).transpose(1, 2)
    backend = attention_backends.select_backend(spec, view, view, view, None, 0.0, False)
    if backend not in (attention_backends.Backend.FLASH, attention_backends.Backend.EFFICIENT):
        return None
    if isinstance(query, Nested):
        # nested_linear (buffer [n, 3D]), sdpa on the nested chunks (output [n, D]), the
        # transpose+reshape copy, nested_linear: buffers of n rows (host metadata not priced).
        x = torch.addmm(qkv_bias, query.buffer, qkv_weight.t())
        attn = x.new_empty((query.tokens, embed_dim))
        del x
        past = attn.clone()
        del attn
        out = torch.addmm(proj_bias, past, proj_weight.t())
        del past
        return _wrap(query, out, None)
    x = F.linear(query, qkv_weight, qkv_bias)
    batch = x.shape[0]
    chunks = [c.view(batch, -1, num_head, dim_per_head).transpose(1, 2) for c in x.chunk(3, -1)]
    y = attention_substitute.scaled_dot_product_attention(spec, F.scaled_dot_product_attention, tuple(chunks), {})
    del chunks, x
    past = y.transpose(1, 2).reshape(batch, -1, embed_dim)
    del y
    out = F.linear(past, proj_weight, proj_bias)
    del past
    return out


_MHA = aten._native_multi_head_attention.default
_MHA_ARGS = tuple(a.name for a in _MHA._schema.arguments)


_NO_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


class _KernelArguments(TorchDispatchMode):
    """Records the arguments ``op`` reaches its kernel with -- after the dispatcher's autocast
    wrapper cast them (weight-cast cache included; the casts are recorded as the ops they are) --
    and returns empty outputs in place of running it."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.arguments = op, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self.op:
            self.arguments = bind(func, args, kwargs)
            empty = args[0].new_empty((0,))
            return empty, empty
        return func(*args, **kwargs)


def _mha(spec, **a):
    """``at::_native_multi_head_attention`` as the dispatcher runs it.  The CPU autocast list has
    the op (autocast_mode.cpp, ``lower_precision_fp``): under CPU autocast its floating arguments
    are cast first -- query, key and value each, so the kernel sees three tensors and projects
    them separately -- and the kernel runs with autocast excluded.  Measured (torch 2.13, CPU,
    bf16): three ``to`` casts of ``[B, T, D]``, the mask's, then three ``mm`` and a ``cat``.  A
    nested query (the encoder's layers) does not run under autocast (``encoder_layer``)."""
    nested = any(isinstance(a[name], Nested) for name in ("query", "key", "value"))
    if spec.is_cuda or nested or not torch.is_autocast_enabled("cpu"):
        return native_multi_head_attention(spec, **a)
    recorder = _KernelArguments(_MHA)
    with recorder:
        _MHA(*(a[name] for name in _MHA_ARGS))
    with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST_CPU):
        return native_multi_head_attention(spec, **recorder.arguments)


@substitute(torch._native_multi_head_attention, targets=_BOTH)
def native_mha(spec, func, args, kwargs):
    """``torch._native_multi_head_attention`` (the ``nn.MultiheadAttention`` fast path)."""
    return _mha(spec, **bind(_MHA, args, kwargs))


# ============================================================================================
# transformer_encoder_layer_forward
# ============================================================================================


def _norm(x, embed_dim, eps, weight, bias):
    """``norm``: ``at::layer_norm`` (dense) / ``NestedTensor_layer_norm`` (the buffer's output,
    mean and rstd, then ``wrap_buffer`` with the input's sizes); mean and rstd die at once."""
    if isinstance(x, Nested):
        out, mean, rstd = torch.native_layer_norm(x.buffer, [embed_dim], weight, bias, eps)
        nested = _wrap(x, out, x.sizes)
        del mean, rstd
        return nested
    return torch.layer_norm(x, [embed_dim], weight, bias, eps)


def _add_in_place(x, other):
    """``add_in_place``: ``x.add_(src)`` (dense; under CPU autocast ``x`` is bf16/fp16 and the
    CPU kernel first casts the fp32 ``src`` to it, a copy the fake ``add_`` does not show) or
    ``NestedTensor_add_NestedTensor_in_place`` on the buffers."""
    if isinstance(x, Nested):
        x.buffer.add_(other.buffer)
    elif other.dtype != x.dtype:
        cast = other.to(x.dtype)
        x.add_(cast)
        del cast
    else:
        x.add_(other)


def _ffn(x, w1, b1, w2, b2, use_gelu):
    """``ffn``: ``linear_for_ffn`` twice (``_addmm_activation`` with the activation, then
    ``addmm``) on ``x`` viewed ``[B·T, D]`` (dense) or the nested buffer."""
    if isinstance(x, Nested):
        res = _nested_times_dense(x, w1, b1, use_gelu)
        out = _nested_times_dense(res, w2, b2)
        del res
        return out
    batch, length = x.shape[0], x.shape[1]
    res = torch._addmm_activation(b1, x.view(-1, x.shape[2]), w1.t(), use_gelu=use_gelu)
    out = torch.addmm(b2, res, w2.t())
    del res
    return out.view(batch, length, out.shape[1])


_LAYER_SCHEMA = aten._transformer_encoder_layer_fwd.default
_SCALAR_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Half"}


@substitute(torch._transformer_encoder_layer_fwd, targets=_BOTH)
def encoder_layer(spec, func, args, kwargs):
    """``transformer_encoder_layer_forward`` (transformer.cpp; the ``nn.TransformerEncoderLayer``
    fast path), dense or nested ``src``."""
    a = bind(_LAYER_SCHEMA, args, kwargs)
    src, embed_dim, eps = a["src"], a["embed_dim"], a["eps"]
    if isinstance(src, Nested) and torch.is_autocast_enabled("cpu"):
        # What torch 2.13 does on real tensors: the nested layer fails under CPU autocast.
        raise CaptureError("nn.TransformerEncoder's nested-tensor fast path fails under CPU autocast in torch "
                           f"{torch.__version__} (RuntimeError: expected scalar type Float but found "
                           f"{_SCALAR_NAMES.get(torch.get_autocast_dtype('cpu'), 'a lower precision')}): pass "
                           "enable_nested_tensor=False to the encoder, or estimate without amp")
    x = src
    if a["norm_first"]:
        x = _norm(x, embed_dim, eps, a["norm_weight_1"], a["norm_bias_1"])
    x = _mha(spec, query=x, key=x, value=x, embed_dim=embed_dim, num_head=a["num_heads"], qkv_weight=a["qkv_weight"],
             qkv_bias=a["qkv_bias"], proj_weight=a["proj_weight"], proj_bias=a["proj_bias"], mask=a["mask"],
             need_weights=False, average_attn_weights=True, mask_type=a["mask_type"])[0]
    _add_in_place(x, src)
    if not a["norm_first"]:
        x = _norm(x, embed_dim, eps, a["norm_weight_1"], a["norm_bias_1"])
    pre_ffn_res = x
    if a["norm_first"]:
        x = _norm(x, embed_dim, eps, a["norm_weight_2"], a["norm_bias_2"])
    x = _ffn(x, a["ffn_weight_1"], a["ffn_bias_1"], a["ffn_weight_2"], a["ffn_bias_2"], a["use_gelu"])
    _add_in_place(x, pre_ffn_res)
    if not a["norm_first"]:
        x = _norm(x, embed_dim, eps, a["norm_weight_2"], a["norm_bias_2"])
    del pre_ffn_res
    return x


# ============================================================================================
# TransformerEncoder: the nested tensor from the padding mask
# ============================================================================================


def _mask_prefix(mask):
    """The start of ``NestedTensor_nested_tensor_from_mask`` and of
    ``_nested_tensor_from_mask_left_aligned`` (NestedTensorMath.cpp): ``tmp_pad = zeros({N, 1})``
    (the mask's dtype), ``nums = cat({mask, tmp_pad}, 1).to(kInt).argmin(1)``, ``sizes =
    mask.cumsum(1)`` (int64; the CPU kernel casts the bool mask to an int64 copy first) and its
    last column.  Returns the locals alive to the function's end."""
    tmp_pad = mask.new_zeros((mask.shape[0], 1))
    joined = torch.cat([mask, tmp_pad], 1)
    as_int = joined.to(torch.int32)
    nums = as_int.argmin(1)
    del as_int, joined
    sums = torch.cumsum(mask, 1)
    cast = mask.new_empty(mask.shape, dtype=_LONG)
    del cast
    return tmp_pad, nums, sums


@substitute(torch._nested_tensor_from_mask_left_aligned, targets=_BOTH)
def left_aligned(spec, func, args, kwargs):
    """``_nested_tensor_from_mask_left_aligned(t, mask)``: the prefix above, then ``equal`` of
    the row lengths and the first padding positions -- a data-dependent bool, from
    ``datadep`` (site ``...:_nested_tensor_from_mask_left_aligned#0``, 0 or 1; the default 1
    keeps the fast path, the probe reads the sample's)."""
    mask = args[1] if len(args) > 1 else kwargs["mask"]
    tmp_pad, nums, sums = _mask_prefix(mask)
    aligned = data_sizes.count("_nested_tensor_from_mask_left_aligned", 1)
    del tmp_pad, nums, sums
    return bool(aligned)


@substitute(torch._nested_tensor_from_mask, targets=_BOTH)
def nested_from_mask(spec, func, args, kwargs):
    """``_nested_tensor_from_mask(t, mask, mask_check)`` (``NestedTensor_nested_tensor_from_mask``):
    the prefix, ``sizes = cat({sums[:, -1].reshape(N, 1), full_like(.., D)}, 1)`` (``[N, 2]``
    int64, the nested sizes), then ``_nested_from_padded(t, sizes, false)``.  ``n`` (the real
    tokens, ≤ ``N·L``) and ``T'`` (the longest row, ≤ ``L``) come from ``datadep``."""
    bound = dict(zip(("t", "mask", "mask_check"), args), **kwargs)
    t, mask = bound["t"], bound["mask"]
    rows, length, width = t.shape
    tmp_pad, nums, sums = _mask_prefix(mask)
    lengths = sums.select(1, length - 1).reshape(rows, 1)
    d = torch.full_like(lengths, width)
    sizes = torch.cat([lengths, d], 1)
    del sums, lengths
    tokens = data_sizes.count("_nested_tensor_from_mask", mask.numel())
    longest = data_sizes.count("to_padded_tensor", length)
    host = sizes if not spec.is_cuda else None
    nested = _nested_from_padded(spec, t, host, False, rows, longest, tokens)
    del tmp_pad, nums, d, sizes
    return nested


@data_sizes.observes(aten._nested_tensor_from_mask.default)
def _observe_tokens(args, kwargs, out):
    """The real tokens of the nested tensor (the sum of its rows' lengths) of ``b·s``."""
    t = args[0]
    return int(out._nested_tensor_size()[:, 0].sum()), int(t.shape[0] * t.shape[1])


@data_sizes.observes(aten.to_padded_tensor.default)
def _observe_longest(args, kwargs, out):
    """The longest row of the nested tensor ``to_padded_tensor`` pads (of the output's dim 1)."""
    nt = args[0]
    if not (nt.is_nested and nt.dim() == 3 and nt.layout == torch.strided):
        return 0, 0
    sizes = nt._nested_tensor_size()
    longest = int(sizes[:, 0].max()) if sizes.shape[0] else 0
    return longest, int(out.shape[1])


@data_sizes.observes(aten._nested_tensor_from_mask_left_aligned.default)
def _observe_left_aligned(args, kwargs, out):
    return int(bool(out)), 1
