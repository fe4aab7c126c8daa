"""``F.scaled_dot_product_attention`` on CUDA: what it runs.

On the CPU target the capture runs the CPU composite (``_scaled_dot_product_flash_attention_for_cpu``
or the math path with the CPU dropout), which is not what a GPU runs.  For ``device="cuda"`` a
substitute (below) picks the backend exactly as ``sdp::select_sdp_backend`` would on the target
GPU (``attention_backends.py``) and calls that backend's aten ops on the fake tensors the way
``at::native::scaled_dot_product_attention`` does (padding, mask conversion, GQA); the fused ops'
meta kernels then give their outputs, and the corrections (``attention_workspaces.py``) add what
the CUDA kernels allocate besides.  ``NOT_MODELLED`` below lists the gaps of all three modules.

Sources read (pytorch/pytorch unless noted; "newest stored" = the newest revision the search index
holds, torch 2.13.0 is ``cf30153c``, not stored itself):

- ``aten/src/ATen/native/transformers/attention.cpp`` (2025 revision, ``guard_float("attention.cpp",
  735)``): ``scaled_dot_product_attention``, ``pad_last_dim<8>``, ``preprocess_mask`` /
  ``pad_bias<8>``, ``should_compute_logsumexp``, ``pre_process_group_query_attention_input``,
  ``_scaled_dot_product_attention_math``.  Checked against torch 2.13 itself by tracing the CPU math
  path on fake tensors: 2.13 converts a bool mask with ``where(mask, scalar_tensor(0),
  scalar_tensor(-inf))`` (no ``logical_not``), upcasts fp16/bf16 to fp32 unless
  ``allow_fp16_bf16_reduction_math_sdp``, uses ``_safe_softmax``, and casts ``attn`` back to the
  input dtype before the second matmul (the discarded second output).
- ``torch/_meta_registrations.py`` of the installed torch 2.13 (what the fake run allocates).

``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` (torch/nn/modules/activation.py,
transformer.py, torch/nn/functional.py ``multi_head_attention_forward`` of torch 2.13):

- Training always takes the Python path (``why_not_fast_path = "training is enabled"``).  With
  ``need_weights=True`` (the ``MultiheadAttention`` default) it is ``bmm``/``baddbmm`` +
  ``softmax`` + ``F.dropout``: the same aten ops on CUDA as on CPU (dropout is the fused kernel,
  handled by the ``F.dropout`` substitute, not here).  With ``need_weights=False`` (what
  ``TransformerEncoderLayer`` passes) it calls ``F.scaled_dot_product_attention``, which the
  substitute below handles -- but only because ``multi_head_attention_forward`` gets an entry of
  its own: it re-dispatches itself through ``__torch_function__`` and would otherwise run with the
  substitution mode popped (the CPU attention and CPU dropout were recorded for CUDA before).
- Eval (without grad) takes the C++ fast paths (``torch._native_multi_head_attention``,
  ``torch._transformer_encoder_layer_fwd``, nested tensors in ``nn.TransformerEncoder``) where a
  real GPU takes them, except under autocast ("autocast is enabled"): ``corrections/fastpath.py``
  makes the checks answer as for real tensors and prices ``native_multi_head_attention_cuda``
  (attention.cu): its fused branch (self-attention without a mask, ``need_weights=False``,
  ``dim_per_head % 8 == 0``, flash or mem-efficient chosen: ``linear`` -> ``chunk`` ->
  ``at::scaled_dot_product_attention``, through the substitute below -> ``linear``) or the bmm
  path (packed ``[3, B, H, T, dh]`` q/k/v, ``[B, H, T, T]`` scores, ``_masked_softmax``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from estimator.corrections.cuda import Gap
from estimator.corrections.cuda.attention_backends import HALF, Backend, hint, select_backend, static_int
from estimator.corrections.mode import run_inside
from estimator.corrections.registry import substitute
from estimator.vocab.categories import Target

aten = torch.ops.aten

# What cannot be known without the GPU or is deliberately left out (each item is short), and
# the ops each concerns.
_SDPA = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "_cudnn_attention")
_NESTED = ("nested", "_transformer_encoder_layer_fwd", "_native_multi_head_attention")
NOT_MODELLED = [
    Gap("cuDNN attention workspace (cudnn_frontend graph.get_workspace_size(), chosen when the graph is built)",
        ("_cudnn_attention",)),
    Gap("cuDNN / libraries version on the target machine: ASSUMED_CUDNN_VERSION decides the cuDNN-first order",
        _SDPA),
    Gap("FA3/FA4 flash implementations activated with torch.nn.attention.activate_flash_attention_impl", _SDPA),
    Gap("mem-efficient backward kernel choice limited by shared memory (sm86/89/12x may take smaller tiles)",
        ("_efficient_attention_backward",)),
    Gap("batch > 65535 chunking of the mem-efficient kernels", ("_efficient_attention",)),
    Gap("nested-tensor inputs (the CPU path runs)", _NESTED),
    Gap("CUDA-graph capture (seed/offset on device for mem-efficient)", ("_efficient_attention",)),
    Gap("return_debug_mask=True (testing only)", _SDPA),
    Gap("TORCH_CUDNN_SDPA_AVOID_RECOMPILE ragged offsets (small int tensors)", ("_cudnn_attention",)),
    Gap("nested-tensor fast path of nn.TransformerEncoder (corrections/fastpath.py): device copies of the nested "
        "metadata (int32, bytes per row) and the nested flash/mem-efficient preprocessing are estimates; bf16 "
        "nested_from_padded takes the CPU's generic buffers", _NESTED),
    Gap("flash split-KV / deterministic dq_accum splits on GPUs missing from SM_COUNTS (one split assumed)",
        ("_flash_attention",)),
]


# ============================================================================================
# The substitute: attention.cpp scaled_dot_product_attention with the CUDA backend
# ============================================================================================


def _convert_boolean_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask`` as torch 2.13 runs it (traced on CPU fake tensors):
    ``where(mask, scalar_tensor(0), scalar_tensor(-inf))`` with both scalars on the mask's device.
    A float mask passes through."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    neg_inf = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, neg_inf)


def _convert_boolean_mask_cudnn(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask_cudnn``: ``where(mask.logical_not(), -65504.0,
    at::scalar_tensor(0.0, dtype))`` -- the 0-dim tensor is on the CPU (no device memory), so it
    is written here as a fill of the result: device memory = the ``logical_not`` temporary and the
    result, as in the C++."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    inverted = mask.logical_not()
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    out.masked_fill_(inverted, -65504.0)
    return out


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """``pad_last_dim<alignment, false>``: ``at::pad`` (constant_pad_nd) to a multiple."""
    last = static_int(t.shape[-1], "the head dimension")
    if last % alignment == 0:
        return t
    return aten.constant_pad_nd.default(t, [0, alignment - last % alignment], 0.0)


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: ``pad_bias<8>`` (pad the last dim by ``8 - S % 8`` and slice back) unless
    every stride but the last is a multiple of 8 and the last is 1 (``aligned_tensor<8>``), then
    expand to (B, H, L, S)."""
    aligned = all(hint(mask.stride(i)) % 8 == 0 for i in range(mask.dim() - 1)) and hint(mask.stride(-1)) == 1
    if not aligned:
        last = mask.shape[-1]
        pad = 8 - static_int(last, "the attn_mask length") % 8
        mask = aten.constant_pad_nd.default(mask, [0, pad], 0.0)[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _gqa_expand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool):
    """``pre_process_group_query_attention_input``: ``repeat_interleave`` key/value heads up to the
    query heads when ``enable_gqa`` and they differ."""
    if not enable_gqa:
        return k, v
    hq, hk, hv = (static_int(t.shape[-3], "the number of heads") for t in (q, k, v))
    if hq == hk == hv:
        return k, v
    return k.repeat_interleave(hq // hk, -3), v.repeat_interleave(hq // hv, -3)


def _should_compute_logsumexp(q, k, v) -> bool:
    """``should_compute_logsumexp``: any input requires grad and grad mode is on."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _math(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """``_scaled_dot_product_attention_math`` as it runs on CUDA: the same composite as on CPU,
    except that ``at::dropout`` takes the fused kernel (``is_fused_kernel_acceptable``: a CUDA
    input and 0 < p < 1), ``native_dropout``, whose mask is bool (1 B/element) instead of the CPU's
    input-dtype ``bernoulli_`` noise, and that ``attn.add_(mask)`` is in place on real tensors
    (the fake run takes the out-of-place branch because fake tensors are subclass-like)."""
    origin = q.dtype
    upcast = not torch._C._get_math_sdp_allow_fp16_bf16_reduction()
    q_acc = q.to(torch.float32) if upcast and q.dtype in HALF else q
    k_acc = k.to(torch.float32) if upcast and k.dtype in HALF else k
    v_acc = v.to(torch.float32) if upcast and v.dtype in HALF else v
    negative = scale is not None and scale < 0.0
    base = abs(scale) if scale is not None else 1.0 / math.sqrt(hint(q_acc.shape[-1]))
    factor = math.sqrt(base)
    query = aten.mul.Scalar(q_acc, -factor if negative else factor)
    mask = attn_mask
    if is_causal:
        if mask is not None:
            raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
        causal = torch.ones(query.shape[-2], k_acc.shape[-2], dtype=torch.bool, device=query.device).tril()
        mask = _convert_boolean_mask(causal, query.dtype)
    k_exp, v_exp = _gqa_expand(query, k_acc, v_acc, enable_gqa)
    attn = torch.matmul(query, aten.mul.Scalar(k_exp.transpose(-2, -1), factor))
    if mask is not None:
        attn.add_(mask)
    attn = aten._safe_softmax.default(attn, -1)
    if dropout_p > 0.0:
        attn = aten.native_dropout.default(attn, dropout_p, True)[0]
    # make_tuple(matmul(attn, value).to(origin), attn.to(origin)): the second element is built
    # first (as traced) and lives until sdpa returns.
    attn_cast = attn.to(origin)
    out = torch.matmul(attn, v_exp).to(origin)
    del attn_cast
    return out


@substitute(F.scaled_dot_product_attention, targets=Target.CUDA)
def scaled_dot_product_attention(spec, func, args, kwargs):
    """``at::native::scaled_dot_product_attention`` on a CUDA device (attention.cpp): choose the
    backend (``_fused_sdp_choice_cuda`` -> ``select_sdp_backend``), convert the mask, then

    - flash: ``pad_last_dim<8>`` q/k/v, ``_scaled_dot_product_flash_attention`` with the scale of
      the original head dim, slice the output back (``post_process_flash_output``);
    - efficient: ``preprocess_mask`` (pad to 8, expand to (B, H, L, S)),
      ``_scaled_dot_product_efficient_attention(compute_log_sumexp=should_compute_logsumexp)``;
    - cuDNN: ``convert_boolean_attn_mask_cudnn`` and ``_scaled_dot_product_cudnn_attention``;
    - math: ``_math`` above.

    Nested tensors fall through to torch (the CPU path)."""
    a = _bind_sdpa(args, kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    tensors = [t for t in (q, k, v, mask) if t is not None]
    if not all(isinstance(t, torch.Tensor) for t in tensors) or any(t.is_nested for t in tensors):
        return NotImplemented
    if not (q.dtype == k.dtype == v.dtype) or q.dim() < 2:
        return NotImplemented  # validate_sdpa_input: let torch raise its own error
    dropout_p, is_causal, scale, gqa = float(a["dropout_p"]), bool(a["is_causal"]), a["scale"], bool(a["enable_gqa"])
    requires_grad = _should_compute_logsumexp(q, k, v)
    backend = select_backend(spec, q, k, v, mask, dropout_p, is_causal, gqa, requires_grad)
    if backend is Backend.CUDNN:
        mask = _convert_boolean_mask_cudnn(mask, q.dtype)
        return aten._scaled_dot_product_cudnn_attention.default(
            q, k, v, mask, requires_grad, dropout_p, is_causal, False, scale=scale)[0]
    mask = _convert_boolean_mask(mask, q.dtype)
    if backend is Backend.FLASH:
        og = static_int(q.shape[-1], "the head dimension")
        og_scale = scale if scale is not None else 1.0 / math.sqrt(og)
        out = aten._scaled_dot_product_flash_attention.default(
            _pad_last_dim(q, 8), _pad_last_dim(k, 8), _pad_last_dim(v, 8), dropout_p, is_causal, False,
            scale=og_scale)[0]
        return out if static_int(out.shape[-1], "the head dimension") == og else out[..., :og]
    if backend is Backend.EFFICIENT:
        # GQA: the newest sdp_utils.cpp lets mem-efficient take enable_gqa inputs while
        # _efficient_attention_forward checks equal heads, so the heads are expanded here as
        # pre_process_group_query_attention_input does (inferred; see attention_backends.py's docstring).
        k, v = _gqa_expand(q, k, v, gqa)
        if mask is not None:
            mask = _preprocess_mask(mask, q, k)
        return aten._scaled_dot_product_efficient_attention.default(
            q, k, v, mask, requires_grad, dropout_p, is_causal, scale=scale)[0]
    return _math(q, k, v, mask, dropout_p, is_causal, scale, gqa)


@substitute(F.multi_head_attention_forward, targets=Target.CUDA)
def multi_head_attention_forward(spec, func, args, kwargs):
    """``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` and
    ``nn.TransformerEncoderLayer`` run while capturing) re-dispatches to the substitution mode,
    which runs it with the mode popped: its ``F.scaled_dot_product_attention`` (and
    ``F.dropout``) would then take the CPU paths.  ``run_inside`` runs its body with the mode
    active, so that the nested calls get the CUDA substitutes."""
    return run_inside(spec, func, args, kwargs)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _bind_sdpa(args, kwargs) -> dict[str, Any]:
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound

