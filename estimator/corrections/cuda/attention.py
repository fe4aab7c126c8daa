"""``F.scaled_dot_product_attention`` on CUDA: which backend runs, what it runs, what it holds.

On the CPU target the capture runs the CPU composite (``_scaled_dot_product_flash_attention_for_cpu``
or the math path with the CPU dropout), which is not what a GPU runs.  For ``device="cuda"`` a
substitute (below) picks the backend exactly as ``sdp::select_sdp_backend`` would on the target
GPU and calls that backend's aten ops on the fake tensors the way ``at::native::
scaled_dot_product_attention`` does (padding, mask conversion, GQA); the fused ops' meta kernels
then give their outputs, and the corrections add what the CUDA kernels allocate besides.

Sources read (pytorch/pytorch unless noted; "newest stored" = the newest revision the search index
holds, torch 2.13.0 is ``cf30153c``, not stored itself):

- ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` @ ``001f694a`` (late 2025/2026: sm121
  ranges, cuDNN-first order for cuDNN > 9.15 on sm90/sm10x, FA3 dtypes, cuDNN d256) -- the
  selection rules; every rule below cites the function it follows.
- ``aten/src/ATen/native/transformers/sdp_utils_cpp.h`` @ ``0119c205`` (shared checks: shapes,
  dtypes, mask shape, last-dim stride, GQA).  The newest ``sdp_utils.cpp`` instantiates
  ``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads, supports_mqa>``;
  that header revision is not stored, its semantics are inferred from the parameter names.
- ``aten/src/ATen/native/transformers/attention.cpp`` (2025 revision, ``guard_float("attention.cpp",
  735)``): ``scaled_dot_product_attention``, ``pad_last_dim<8>``, ``preprocess_mask`` /
  ``pad_bias<8>``, ``should_compute_logsumexp``, ``pre_process_group_query_attention_input``,
  ``_scaled_dot_product_attention_math``.  Checked against torch 2.13 itself by tracing the CPU math
  path on fake tensors: 2.13 converts a bool mask with ``where(mask, scalar_tensor(0),
  scalar_tensor(-inf))`` (no ``logical_not``), upcasts fp16/bf16 to fp32 unless
  ``allow_fp16_bf16_reduction_math_sdp``, uses ``_safe_softmax``, and casts ``attn`` back to the
  input dtype before the second matmul (the discarded second output).
- ``aten/src/ATen/native/transformers/cuda/attention.cu`` / ``attention_backward.cu`` (2025-2026:
  ``computeCapability == 121 -> 120``, batch chunking at 65535): ``_flash_attention_forward``,
  ``_efficient_attention_forward/backward``, ``_cudnn_attention_forward/backward``,
  ``_scaled_dot_product_*_attention(_backward)_cuda``.
- ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp`` (the softcap revision whose
  ``mha_fwd`` returns ``rng_state`` {2} uint64 + ``_unused`` {} uint64 on CUDA, matching the 2.13
  meta kernel): ``mha_fwd``, ``set_params_splitkv``, ``num_splits_heuristic``, ``mha_bwd``.
- ``mem_eff_attention/kernel_forward.h``, ``kernel_backward.h``, ``kernels/cutlassF.h``,
  ``kernels/cutlassB.h`` (kernel tables, ``kNeedsOutputAccumulatorBuffer``, ``workspace_size``).
- ``aten/src/ATen/native/cudnn/MHA.cpp`` (2026 revision with ``check_cudnn_sdpa_decode``):
  ``run_cudnn_SDP_fprop/bprop``.
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

import ctypes
import enum
import math
import os
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.nn.functional as F

from estimator.vocab.categories import Target
from estimator.corrections.cuda import Gap
from estimator.corrections.mode import run_inside
from estimator.corrections.registry import Fix, bind, correction, substitute
from estimator.vocab.errors import SymbolicCaptureFailed
from estimator.vocab.symbolic import as_expr

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

# torch 2.13 CUDA 13 wheels pin nvidia-cudnn-cu13 9.20.0.48 (public pip logs quote "torch 2.13.0+cu132
# asks for nvidia-cudnn-cu13==9.20.0.48"; an aarch64 build pins 9.21.1.3): cuDNN reports 92000
# (major*10000 + minor*100 + patch).  Any cuDNN > 9.15 gives the same choices here.
ASSUMED_CUDNN_VERSION = 92000
ASSUMED_CUDA_VERSION = 13000  # CUDA_VERSION of the wheel (check_prefer_cudnn_attention's minor rule)
# kCuDNNFrontendSupportsD256: CUDNN_FRONTEND_VERSION >= 12400 for the bundled cudnn_frontend.
CUDNN_FRONTEND_SUPPORTS_D256 = True



class Backend(enum.IntEnum):
    """``at::SDPBackend`` (the values are torch's: ``torch._C._get_sdp_priority_order()``)."""

    MATH = 0
    FLASH = 1
    EFFICIENT = 2
    CUDNN = 3
    OVERRIDEABLE = 4


# The context's default order as torch 2.13 reports it (torch._C._get_sdp_priority_order()):
# flash, efficient, math, cudnn, overrideable.
_DEFAULT_ORDER = (1, 2, 0, 3, 4)
_CUDNN_ORDER = (Backend.CUDNN, Backend.FLASH, Backend.EFFICIENT, Backend.MATH)
_HALF = (torch.float16, torch.bfloat16)


# -- sizes: static ints where they are, hints (no guards) where they are symbolic ---------------
def _hint(x) -> int:
    """The concrete value of a size (a SymInt's hint; no shape guard is added)."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    return int(x)


def _min_value(x) -> int:
    """A size at the smallest batch (every symbol at 2, the capture's lower bound)."""
    e = as_expr(x)
    if isinstance(e, int):
        return e
    return int(e.subs({s: 2 for s in e.free_symbols}))


def _eq(a, b) -> bool:
    """``TORCH_GUARD_OR_FALSE(a == b)``: equal expressions, else equal hints."""
    ea, eb = as_expr(a), as_expr(b)
    if isinstance(ea, int) and isinstance(eb, int):
        return ea == eb
    if sympy.simplify(sympy.sympify(ea) - sympy.sympify(eb)) == 0:
        return True
    return _hint(a) == _hint(b)


def _contiguous_hint(t: torch.Tensor) -> bool:
    """``t.is_contiguous()`` decided on the size hints (no guards)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        size = _hint(size)
        if size != 1 and _hint(stride) != expected:
            return False
        expected *= size
    return True


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _static_int(x, what: str) -> int:
    """A size the rule needs as an integer (rounding, block counts): fine when it does not depend
    on the batch; the concrete fallback handles the rest."""
    e = as_expr(x)
    if isinstance(e, int):
        return e
    if getattr(e, "is_Integer", False):
        return int(e)
    raise SymbolicCaptureFailed(f"CUDA attention: {what} depends on the batch size")


def _env_true(name: str) -> bool:
    """``c10::utils::check_env(name) == true``."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on", "y")


# ============================================================================================
# Backend selection: sdp_utils.cpp select_sdp_backend
# ============================================================================================


@dataclass(frozen=True)
class _Params:
    """``sdp::sdp_params`` plus the device facts the checks read."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    dropout: float
    is_causal: bool
    enable_gqa: bool
    requires_grad: bool  # input_requires_grad: any of q/k/v requires grad and GradMode is on
    major: int
    minor: int
    cudnn: int


def _flags() -> dict[Backend, bool]:
    """``at::globalContext().userEnabled*SDP()``: what ``torch.backends.cuda.enable_*_sdp`` and
    ``torch.nn.attention.sdpa_kernel`` set; readable on a CPU build."""
    return {
        Backend.FLASH: torch._C._get_flash_sdp_enabled(),
        Backend.EFFICIENT: torch._C._get_mem_efficient_sdp_enabled(),
        Backend.MATH: torch._C._get_math_sdp_enabled(),
        Backend.CUDNN: torch._C._get_cudnn_sdp_enabled(),
        Backend.OVERRIDEABLE: torch._C._get_overrideable_sdp_enabled(),
    }


def prefer_cudnn(major: int, minor: int, cudnn_version: int = ASSUMED_CUDNN_VERSION,
                 cuda_version: int = ASSUMED_CUDA_VERSION) -> bool:
    """``check_prefer_cudnn_attention``: unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set, cuDNN
    goes first when ``cudnn_version > 91500`` ("cuDNN 9.15.1 required for seq_len not divisible by
    128 fix") on major 9 or 10; wheels built with CUDA < 13 also require minor 0 or 3."""
    if _env_true("TORCH_CUDNN_SDPA_DEPRIORITIZED"):
        return False
    if cuda_version < 13000:
        return cudnn_version > 91500 and major in (9, 10) and minor in (0, 3)
    return cudnn_version > 91500 and major in (9, 10)


def priority_order(major: int, minor: int, cudnn_version: int = ASSUMED_CUDNN_VERSION) -> list[Backend]:
    """``priority_order``: the context's order; the first CUDA call replaces torch's default with
    cuDNN, flash, efficient, math when ``check_prefer_cudnn_attention``.  An order set with
    ``sdpa_kernel(..., set_priority=True)`` (``torch._C._set_sdp_priority_order``) is kept."""
    current = tuple(torch._C._get_sdp_priority_order())
    if current == _DEFAULT_ORDER and prefer_cudnn(major, minor, cudnn_version):
        return list(_CUDNN_ORDER)
    return [Backend(b) for b in current]


def _in_sm_range(major: int, minor: int, lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    """``check_sm_version<lo, hi>``: inclusive."""
    return lo <= (major, minor) <= hi


def _check_tensor_shapes(p: _Params) -> str | None:
    # sdp_utils_cpp.h check_tensor_shapes: q, k, v all 4-D.
    if not (p.q.dim() == p.k.dim() == p.v.dim() == 4):
        return "query, key and value must be 4-D"
    return None


def _check_dtype(p: _Params, allowed) -> str | None:
    # sdp_utils_cpp.h check_tensor_dtype: same dtype for q, k, v, and in the allowed list.
    if not (p.q.dtype == p.k.dtype == p.v.dtype and p.q.dtype in allowed):
        return f"dtype {p.q.dtype} not in {tuple(allowed)}"
    return None


def _check_batch_and_heads(p: _Params, requires_same_num_heads: bool) -> str | None:
    """sdp_utils_cpp.h ``check_batch_size_and_num_heads_dense<supports_gqa=true, ..,
    supports_mqa=true>`` (CUDA): same batch size; with ``enable_gqa`` (or, for cuDNN,
    ``requires_same_num_heads=false``) ``check_grouped_query_attention``: key and value heads
    equal and dividing the query heads; otherwise equal heads, or a single key/value head (MQA)."""
    if not (_eq(p.q.shape[0], p.k.shape[0]) and _eq(p.q.shape[0], p.v.shape[0])):
        return "query, key and value batch sizes differ"
    hq, hk, hv = (_hint(t.shape[-3]) for t in (p.q, p.k, p.v))
    if hq == hk == hv:
        return None
    if p.enable_gqa or not requires_same_num_heads:
        if hk != hv or hq % hk:
            return "key/value heads must be equal and divide the query heads"
        return None
    if hk == hv == 1:
        return None
    return "query, key and value num_heads differ (pass enable_gqa=True)"


def _check_nonzero_seqlens(p: _Params) -> str | None:
    # sdp_utils_cpp.h check_nonzero_sequence_lengths_dense
    if _hint(p.q.shape[-2]) == 0 or _hint(p.k.shape[-2]) == 0:
        return "zero sequence length"
    return None


def _check_last_dim_stride(p: _Params, ignore_singleton_dim: bool) -> str | None:
    # sdp_utils_cpp.h check_last_dim_stride_equals_1_dense<ignore_singleton_dim>
    ok = all(_hint(t.stride(-1)) == 1 for t in (p.q, p.k, p.v))
    if ignore_singleton_dim:
        ok = ok or _hint(p.q.shape[-1]) == 1
    if p.mask is not None and _hint(p.mask.stride(-1)) != 1:
        ok = False
    return None if ok else "last dimension of q/k/v/mask must have stride 1"


def _check_attn_mask_shape(p: _Params) -> str | None:
    # sdp_utils_cpp.h check_attn_mask_shape: no grad; (L|1, S|1) 2-D, or 4-D with (B|1, H|1).
    m = p.mask
    if m is None:
        return None
    if m.requires_grad:
        return "attn_mask requires grad"
    L, S, B, H = (_hint(x) for x in (p.q.shape[2], p.k.shape[2], p.q.shape[0], p.q.shape[1]))
    if _hint(m.shape[-2]) not in (L, 1) or _hint(m.shape[-1]) not in (S, 1):
        return "attn_mask last two dims must be (L or 1, S or 1)"
    if m.dim() == 2:
        return None
    if m.dim() == 4 and _hint(m.shape[0]) in (1, B) and _hint(m.shape[1]) in (1, H):
        return None
    return "attn_mask must be 2-D or 4-D (B|1, H|1, L|1, S|1)"


# -- flash: can_use_flash_attention --------------------------------------------------------
def _flash_reason(p: _Params) -> str | None:
    if (r := _check_tensor_shapes(p)) is not None:  # check_tensor_shapes
        return r
    # check_for_attn_mask: flash takes no attn_mask.
    if p.mask is not None:
        return "flash attention does not take an attn_mask"
    # check_head_dim_size_flash<false>: all head dims equal and <= 256 (padded to 8 later).
    d = [_hint(t.shape[-1]) for t in (p.q, p.k, p.v)]
    if not (d[0] == d[1] == d[2] and d[0] <= 256):
        return "flash needs equal head dims <= 256"
    # check_flash_attention_hardware_support: sm80..sm121.
    if not _in_sm_range(p.major, p.minor, (8, 0), (12, 1)):
        return "flash needs sm80..sm121"
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training on sm86-89
    # or sm120-121 needs head_dim <= 192, or > 224 without dropout.
    small_smem = _in_sm_range(p.major, p.minor, (8, 6), (8, 9)) or _in_sm_range(p.major, p.minor, (12, 0), (12, 1))
    if p.requires_grad and small_smem and not (d[0] <= 192 or (p.dropout <= 0.0 and d[0] > 224)):
        return "flash backward: head_dim in (192, 224] (or > 224 with dropout) unsupported here"
    # check_flash_causal_non_square_seqlens: is_causal needs seqlen_q == seqlen_k.
    if p.is_causal and not _eq(p.q.shape[-2], p.k.shape[-2]):
        return "flash: is_causal with seqlen_q != seqlen_k"
    # check_dtypes_flash_attention: sm90+ with FA3 enabled adds fp8; else check_dtypes_low_precision
    # (sm80+: fp16/bf16; older: fp16).
    if p.major >= 9 and torch._C._get_fa3_sdp_enabled():
        allowed = (torch.float8_e4m3fn, torch.float16, torch.bfloat16)
    else:
        allowed = _HALF if p.major >= 8 else (torch.float16,)
    if (r := _check_dtype(p, allowed)) is not None:
        return r
    # dense: check_batch_size_and_num_heads_dense<true, true, true>,
    # check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense<true>.
    for r in (_check_batch_and_heads(p, True), _check_nonzero_seqlens(p), _check_last_dim_stride(p, True)):
        if r is not None:
            return r
    return None


# -- mem-efficient: can_use_mem_efficient_attention -----------------------------------------
def minimum_gemm_alignment(dtype: torch.dtype, major: int) -> int:
    """``minimum_gemm_alignment``: tensor cores on sm80+ (any dtype) and on sm7x for fp16/bf16;
    4 from sm80 on, raised to 128 bits / element size when tensor cores are used."""
    is_half = dtype in _HALF
    use_tc = major >= 8 or (major >= 7 and is_half)
    mn = 4 if major >= 8 else 1
    if use_tc:
        mn = max(mn, 128 // (16 if is_half else 32))
    return mn


def _efficient_reason(p: _Params) -> str | None:
    # check_mem_efficient_hardware_support: sm50..sm121.
    if not _in_sm_range(p.major, p.minor, (5, 0), (12, 1)):
        return "mem-efficient needs sm50..sm121"
    if (r := _check_tensor_shapes(p)) is not None:  # check_tensor_shapes
        return r
    # check_head_dim_size_mem_efficient (CUDA): q and k head dims equal, q and v head dims
    # multiples of minimum_gemm_alignment and > 0.
    align = minimum_gemm_alignment(p.q.dtype, p.major)
    dq, dk, dv = (_hint(t.shape[-1]) for t in (p.q, p.k, p.v))
    if not (dq == dk and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return f"mem-efficient needs head dims divisible by {align}"
    # check_data_ptr_alignment_mem_efficient (sm80+): storage_offset * element_size a multiple of
    # minimum_gemm_alignment * element_size (the caching allocator aligns bases to 512 B);
    # a symbolic offset is assumed aligned (TORCH_GUARD_OR_TRUE).
    if p.major >= 8:
        align_bytes = align * p.q.element_size()
        for t in (p.q, p.k, p.v):
            offset = as_expr(t.storage_offset())
            if isinstance(offset, int) and _hint(t.numel()) != 0 and (offset * t.element_size()) % align_bytes:
                return "mem-efficient: storage offset not aligned"
    # dense: check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense<false>,
    # check_batch_size_and_num_heads_dense<true, true, true> (CUDA: supports_gqa/mqa).
    for r in (_check_nonzero_seqlens(p), _check_last_dim_stride(p, False), _check_batch_and_heads(p, True)):
        if r is not None:
            return r
    # dtype: sm80+ fp16/fp32/bf16, else fp16/fp32.
    allowed = (torch.float16, torch.float32, torch.bfloat16) if p.major >= 8 else (torch.float16, torch.float32)
    return _check_dtype(p, allowed)


# -- cuDNN: can_use_cudnn_attention -----------------------------------------------------------
def cudnn_decode_disabled(major: int, cudnn_version: int) -> bool:
    """MHA.cpp ``check_cudnn_sdpa_decode``: "cuDNN SDPA decode is disabled for cuDNN versions
    9.19-9.25.0 (except 9.24.1) on SM 10.x and 11.x" (``sdp::is_cudnn_attention_decode_disabled``)."""
    return major in (10, 11) and 91900 <= cudnn_version <= 92500 and cudnn_version != 92401


def _cudnn_reason(p: _Params) -> str | None:
    # cuDNN dropout is broken in 9.11-9.13 (can_use_cudnn_attention, before the constraints).
    if p.dropout > 0.0 and 91100 < p.cudnn < 91400:
        return "cuDNN 9.11-9.13 does not support dropout in SDPA"
    # check_tensor_shapes
    if (r := _check_tensor_shapes(p)) is not None:
        return r
    # check_cudnn_deterministic: deterministic algorithms (not warn-only) exclude cuDNN.
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return "cuDNN SDPA is not deterministic"
    # check_dtypes_low_precision: sm80+ fp16/bf16, else fp16.
    if (r := _check_dtype(p, _HALF if p.major >= 8 else (torch.float16,))) is not None:
        return r
    # check_attn_mask_shape
    if (r := _check_attn_mask_shape(p)) is not None:
        return r
    # check_cudnn_hardware_support: sm80..sm121.
    if not _in_sm_range(p.major, p.minor, (8, 0), (12, 1)):
        return "cuDNN SDPA needs sm80..sm121"
    # check_cudnn_dropout: dropout a multiple of 1/16.
    if p.dropout * 16.0 != math.floor(p.dropout * 16.0):
        return "cuDNN dropout must be a multiple of 1/16"
    # dense: check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense<true>,
    # check_batch_size_and_num_heads_dense<true, false, true>, check_cudnn_tensor_shapes,
    # check_cudnn_d256_bprop_head_dim.
    for r in (_check_nonzero_seqlens(p), _check_last_dim_stride(p, True), _check_batch_and_heads(p, False)):
        if r is not None:
            return r
    return _cudnn_tensor_shapes_reason(p) or _cudnn_d256_bprop_reason(p) or _cudnn_decode_reason(p)


def _sm90_or_sm10x(p: _Params) -> bool:
    return (p.major == 9 and p.minor == 0) or p.major == 10


def _supports_d256(p: _Params) -> bool:
    unsupported_sm107 = p.major == 10 and p.minor == 7 and p.cudnn <= 92500
    return _sm90_or_sm10x(p) and not unsupported_sm107 and p.cudnn > 92200 and CUDNN_FRONTEND_SUPPORTS_D256


def _cudnn_tensor_shapes_reason(p: _Params) -> str | None:
    """``check_cudnn_tensor_shapes``."""
    # batch size and num_heads <= 65535 (decided on the hint for a symbolic batch).
    if _hint(p.q.shape[0]) > 65535 or _hint(p.q.shape[1]) > 65535:
        return "cuDNN: batch or heads > 65535"
    s_q, s_k = _hint(p.q.shape[2]), _hint(p.k.shape[2])
    d_qk, d_v = _hint(p.q.shape[3]), _hint(p.v.shape[3])
    if p.cudnn < 8903:
        return "cuDNN < 8.9.3"
    if p.cudnn < 8906 and p.dropout != 0.0:
        return "cuDNN < 8.9.6 with dropout"
    # head_dim_limit: 256 on sm90/sm10x with cuDNN > 9.22 and a d256-capable frontend; 192 for
    # (d_qk, d_v) == (192, 128) there with cuDNN >= 9.11; else 128.
    limit = 128
    if _supports_d256(p):
        limit = 256
    elif _sm90_or_sm10x(p) and p.cudnn >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit:
        return f"cuDNN: head_dim > {limit}"
    if d_qk % 8 or d_v % 8:
        return "cuDNN: head_dim not a multiple of 8"
    if p.cudnn < 8906 and s_k % 64:
        return "cuDNN < 8.9.6: seq_kv not a multiple of 64"
    if p.cudnn < 90000:
        if s_q < 64:
            return "cuDNN < 9: s_q < 64"
        if p.dropout != 0.0 and (s_q % 64 or s_k % 64):
            return "cuDNN < 9: dropout with s_q/s_k not multiples of 64"
    if s_k == 1:
        return "cuDNN: key/value sequence length 1"
    if p.dropout != 0.0 and s_q == 1:
        return "cuDNN: query sequence length 1 with dropout"
    return None


def _cudnn_d256_bprop_reason(p: _Params) -> str | None:
    """``check_cudnn_d256_bprop_head_dim``: where d256 is supported, backward only for
    (<=128, <=128), (192, 128) or (256, 256)."""
    if not p.requires_grad or not _supports_d256(p):
        return None
    d_qk, d_v = _hint(p.q.shape[3]), _hint(p.v.shape[3])
    if (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256)):
        return None
    return "cuDNN backward: unsupported head dims on sm90/sm10x"


def _cudnn_decode_reason(p: _Params) -> str | None:
    if _hint(p.q.shape[2]) == 1 and cudnn_decode_disabled(p.major, p.cudnn):
        return "cuDNN SDPA decode (s_q == 1) disabled for this cuDNN on SM 10.x/11.x"
    return None


_REASONS = {Backend.FLASH: _flash_reason, Backend.EFFICIENT: _efficient_reason, Backend.CUDNN: _cudnn_reason}


def _params(spec, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, requires_grad, cudnn_version) -> _Params:
    major, minor = spec.capability
    return _Params(q, k, v, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa), bool(requires_grad),
                   major, minor, ASSUMED_CUDNN_VERSION if cudnn_version is None else int(cudnn_version))


def why_not(spec, backend: Backend, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False,
            requires_grad=False, cudnn_version: int | None = None) -> str | None:
    """Why ``backend`` cannot run these inputs on ``spec``'s GPU (None: it can).  The runtime
    flags are not part of the answer (``select_backend`` reads them)."""
    if backend is Backend.MATH:
        return None
    p = _params(spec, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, requires_grad, cudnn_version)
    return _REASONS[backend](p)


def select_backend(spec, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False,
                   requires_grad=False, cudnn_version: int | None = None) -> Backend:
    """``sdp::select_sdp_backend`` for ``spec``'s GPU: the first backend of ``priority_order``
    that is enabled (``torch.backends.cuda.*_sdp_enabled()``, ``sdpa_kernel``) and whose
    ``can_use_*`` accepts the inputs.  ``requires_grad`` is ``input_requires_grad``: any of
    q/k/v requires grad and grad mode is on.  Raises like torch when no backend is left."""
    flags = _flags()
    # select_sdp_backend: all four disabled -> SDPBackend::error.
    if not any(flags[b] for b in (Backend.MATH, Backend.FLASH, Backend.EFFICIENT, Backend.CUDNN)):
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found: all SDPA backends are disabled.")
    p = _params(spec, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, requires_grad, cudnn_version)
    for backend in priority_order(p.major, p.minor, p.cudnn):
        if backend is Backend.MATH:
            if flags[Backend.MATH]:
                return Backend.MATH
        elif backend is Backend.OVERRIDEABLE:
            # case overrideable: TORCH_CHECK(false, "Invalid backend") when enabled.
            if flags[Backend.OVERRIDEABLE]:
                raise RuntimeError("Invalid backend (the overrideable SDPA backend was reached on CUDA)")
        elif flags[backend] and _REASONS[backend](p) is None:
            # check_runtime_disabled_{flash,mem_efficient,cudnn} first, then the constraints.
            return backend
    raise RuntimeError("No available kernel. Aborting execution. (scaled_dot_product_attention on "
                       f"sm_{p.major}{p.minor}: flash: {_flash_reason(p)}; efficient: {_efficient_reason(p)}; "
                       f"cudnn: {_cudnn_reason(p)})")


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
    last = _static_int(t.shape[-1], "the head dimension")
    if last % alignment == 0:
        return t
    return aten.constant_pad_nd.default(t, [0, alignment - last % alignment], 0.0)


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: ``pad_bias<8>`` (pad the last dim by ``8 - S % 8`` and slice back) unless
    every stride but the last is a multiple of 8 and the last is 1 (``aligned_tensor<8>``), then
    expand to (B, H, L, S)."""
    aligned = all(_hint(mask.stride(i)) % 8 == 0 for i in range(mask.dim() - 1)) and _hint(mask.stride(-1)) == 1
    if not aligned:
        last = mask.shape[-1]
        pad = 8 - _static_int(last, "the attn_mask length") % 8
        mask = aten.constant_pad_nd.default(mask, [0, pad], 0.0)[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _gqa_expand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool):
    """``pre_process_group_query_attention_input``: ``repeat_interleave`` key/value heads up to the
    query heads when ``enable_gqa`` and they differ."""
    if not enable_gqa:
        return k, v
    hq, hk, hv = (_static_int(t.shape[-3], "the number of heads") for t in (q, k, v))
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
    q_acc = q.to(torch.float32) if upcast and q.dtype in _HALF else q
    k_acc = k.to(torch.float32) if upcast and k.dtype in _HALF else k
    v_acc = v.to(torch.float32) if upcast and v.dtype in _HALF else v
    negative = scale is not None and scale < 0.0
    base = abs(scale) if scale is not None else 1.0 / math.sqrt(_hint(q_acc.shape[-1]))
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
        og = _static_int(q.shape[-1], "the head dimension")
        og_scale = scale if scale is not None else 1.0 / math.sqrt(og)
        out = aten._scaled_dot_product_flash_attention.default(
            _pad_last_dim(q, 8), _pad_last_dim(k, 8), _pad_last_dim(v, 8), dropout_p, is_causal, False,
            scale=og_scale)[0]
        return out if _static_int(out.shape[-1], "the head dimension") == og else out[..., :og]
    if backend is Backend.EFFICIENT:
        # GQA: the newest sdp_utils.cpp lets mem-efficient take enable_gqa inputs while
        # _efficient_attention_forward checks equal heads, so the heads are expanded here as
        # pre_process_group_query_attention_input does (inferred; see the module docstring).
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


# ============================================================================================
# Corrections: what the CUDA kernels allocate besides the meta kernels' outputs
# ============================================================================================


def _numel(*dims):
    out = 1
    for d in dims:
        out = out * as_expr(d)
    return out


def _split_kv_count(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """flash_api.cpp ``num_splits_heuristic`` (float arithmetic as in C++)."""
    f32 = lambda x: ctypes.c_float(x).value
    if batch_nheads_mblocks >= f32(0.8 * num_sms):
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    ceildiv = lambda a, b: (a + b - 1) // b

    def eligible(n: int) -> bool:
        return n == 1 or ceildiv(num_n_blocks, n) != ceildiv(num_n_blocks, n - 1)

    efficiency, best = [], 0.0
    for n in range(1, max_splits + 1):
        if not eligible(n):
            efficiency.append(0.0)
            continue
        waves = f32(f32(batch_nheads_mblocks * n) / num_sms)
        eff = f32(waves / math.ceil(waves))
        best = max(best, eff)
        efficiency.append(eff)
    for n in range(1, max_splits + 1):
        if eligible(n) and efficiency[n - 1] >= 0.85 * best:
            return n
    return 1


def flash_split_kv(batch, heads: int, heads_k: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                   dropout_p: float, num_sms: int | None):
    """(num_splits, seqlen_q, heads) of ``mha_fwd`` -> ``set_params_splitkv(num_splits=0)``:
    split-KV only without dropout; ``seqlenq_ngroups_swapped`` (one query, GQA, no dropout) turns
    the groups into query rows.  ``batch`` may be symbolic: the count must not depend on it."""
    if seqlen_q == 1 and heads > heads_k and dropout_p == 0.0:
        seqlen_q, heads = heads // heads_k, heads_k
    if dropout_p != 0.0 or num_sms is None:
        return 1, seqlen_q, heads
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    n_blocks = (seqlen_k + block_n - 1) // block_n
    m_blocks = (seqlen_q + 63) // 64
    count = lambda b: _split_kv_count(b * heads * m_blocks, num_sms * 2, n_blocks, 128)
    e = as_expr(batch)
    if isinstance(e, int):
        return count(e), seqlen_q, heads
    # The count falls to 1 once B * H * m_blocks >= 0.8 * 2 * SMs and stays there as b grows.
    if count(_min_value(batch)) == 1 and (n_blocks == 1 or _min_value(batch) * heads * m_blocks >= 1.6 * num_sms):
        return 1, seqlen_q, heads
    raise SymbolicCaptureFailed("flash attention's split-KV count depends on the batch size")


@correction(aten._scaled_dot_product_flash_attention.default, targets=Target.CUDA)
def flash_forward(args, kwargs, out, spec) -> Fix:
    """``_scaled_dot_product_flash_attention_cuda`` -> ``_flash_attention_forward`` -> ``mha_fwd``
    (flash_api.cpp).  Outputs as the meta kernel: ``out`` like q, ``softmax_lse`` fp32 (B, H, L),
    ``rng_state`` {2} uint64 (16 B) and ``_unused`` {} uint64 (8 B) both on CUDA -- the meta's
    seed/offset sizes.  In-kernel, on top of them:

    - with dropout ``rng_state`` is allocated a second time before the first is released: +16 B;
    - without dropout ``set_params_splitkv`` may split the keys (``num_splits_heuristic`` on
      ``2 * multiProcessorCount``): ``softmax_lse_accum`` fp32 (splits, B, H, L) and ``out_accum``
      fp32 (splits, B, H, L, d_rounded), ``d_rounded`` = the head dim rounded to 32 (<= 128) or 64:
      ``splits * B*H*L * 4 * (1 + d_rounded)`` bytes (freed when ``mha_fwd`` returns).
    """
    a = bind(aten._scaled_dot_product_flash_attention.default, args, kwargs)
    q, k = a["query"], a["key"]
    dropout_p = float(a["dropout_p"])
    if dropout_p > 0.0:
        return Fix(scratch=(16,))
    B = q.shape[0]
    H, L, d = (_static_int(x, "flash attention sizes") for x in (q.shape[1], q.shape[2], q.shape[3]))
    Hk, S = (_static_int(x, "flash attention sizes") for x in (k.shape[1], k.shape[2]))
    splits, L2, H2 = flash_split_kv(B, H, Hk, L, S, d, dropout_p, spec.gpu.sm_count)
    if splits <= 1:
        return Fix()
    d_rounded = _round_up(d, 32 if d <= 128 else 64)
    return Fix(scratch=(splits * as_expr(B) * H2 * L2 * 4 * (1 + d_rounded),))


def _bmhk_copy_bytes(t: torch.Tensor):
    """Bytes of ``t.transpose(1, 2).contiguous()`` when it copies (a BHMK view of BMHK memory
    does not)."""
    return 0 if _contiguous_hint(t.transpose(1, 2)) else _numel(*t.shape) * t.element_size()


@correction(aten._scaled_dot_product_flash_attention_backward.default, targets=Target.CUDA)
def flash_backward(args, kwargs, out, spec) -> Fix:
    """``_scaled_dot_product_flash_attention_backward_cuda`` -> ``_flash_attention_backward``
    (attention_backward.cu) -> ``mha_bwd`` (flash_api.cpp).  dq/dk/dv are the meta's outputs.
    Alive together while the kernel runs:

    - ``grad_out.contiguous()`` and ``out.contiguous()`` in BMHK (copies only if not already);
    - ``softmax_d`` fp32 (B, H, round128(L)): ``B*H*round128(L)*4``;
    - ``dq_accum`` fp32 (B, round128(L), H, d_rounded): ``B*round128(L)*H*d_rounded*4``; with
      deterministic algorithms ``zeros`` (nsplits, ...) with ``nsplits = ceil(SMs / (B*H))``;
    - GQA (H_k < H): ``dk_expanded``, ``dv_expanded`` (B, S, H, d) in the input dtype, summed into
      dk/dv afterwards.
    """
    a = bind(aten._scaled_dot_product_flash_attention_backward.default, args, kwargs)
    grad, q, k, o = a["grad_out"], a["query"], a["key"], a["out"]
    B = as_expr(q.shape[0])
    H, L, d = (_static_int(x, "flash attention sizes") for x in (q.shape[1], q.shape[2], q.shape[3]))
    Hk, S = (_static_int(x, "flash attention sizes") for x in (k.shape[1], k.shape[2]))
    d_rounded = _round_up(d, 32 if d <= 128 else 64)
    L128 = _round_up(L, 128)
    dq_accum = B * L128 * H * d_rounded * 4
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        sms = spec.gpu.sm_count
        if sms is None or _min_value(q.shape[0]) * H >= sms:
            nsplits = 1
        elif isinstance(B, int):
            nsplits = (sms + B * H - 1) // (B * H)
        else:
            raise SymbolicCaptureFailed("deterministic flash backward: dq_accum splits depend on the batch size")
        dq_accum = dq_accum * nsplits
    expanded = 2 * B * S * H * d * q.element_size() if Hk != H else 0
    scratch = _bmhk_copy_bytes(grad) + _bmhk_copy_bytes(o) + B * H * L128 * 4 + dq_accum + expanded
    return Fix(scratch=(scratch,))


@correction(aten._scaled_dot_product_efficient_attention.default, targets=Target.CUDA)
def efficient_forward(args, kwargs, out) -> Fix:
    """``_scaled_dot_product_efficient_attention_cuda`` -> ``_efficient_attention_forward``
    (attention.cu).  ``res`` (B, M, H, Kv) and ``logsumexp`` fp32 (B, H, round32(M) when
    ``compute_log_sumexp``, ``kAlignLSE = 32``) are the meta's outputs.  Differences:

    - seed and offset: Note [Seed and Offset Device] -- outside CUDA-graph capture they are
      ``at::scalar_tensor(.., kLong)`` on the CPU (or ``at::empty({}, kLong)`` on the CPU without
      dropout): no device memory, so the meta's 8 + 8 B are removed;
    - ``output_accum`` fp32 (B, M, H, Kv) while the kernel runs when the kernel chosen by
      ``dispatch_cutlassF`` needs it (``kNeedsOutputAccumulatorBuffer = !kSingleValueIteration &&
      output_t != float``): fp16/bf16 with max(K, Kv) > 128, where only the
      ``kMaxK = 65536`` (gmem) kernels apply (cutlassF.h: 64x64 k64, 64x128 k128 / 32x128 k128,
      32x128 k65536): ``B*M*H*Kv*4`` bytes.
    """
    a = bind(aten._scaled_dot_product_efficient_attention.default, args, kwargs)
    q, v = a["query"], a["value"]
    scratch = ()
    max_k = max(_hint(q.shape[-1]), _hint(v.shape[-1]))
    if q.dtype in _HALF and max_k > 128:
        scratch = (_numel(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]) * 4,)
    return Fix(output_bytes={2: -8, 3: -8}, scratch=scratch)


def efficient_backward_kernel(dtype: torch.dtype, cc: int, max_k: int, dropout: bool) -> tuple[int, int, int]:
    """(kBlockSizeI, kBlockSizeJ, kMaxK) of the first kernel ``dispatch_cutlassB`` accepts
    (cutlassB.h): kMaxK >= max(K, Kv) and dropout support; shared memory assumed sufficient
    (A100/H100/B200 class).  fp16/bf16 sm80+: 64x64 k32, 64x64 k64, [sm86/89: 128x64 k96],
    128x128 k128, 64x64 k128, 128x64 k65536; fp32 sm80+ and fp16 sm7x: 64x64 k32, 64x64 k64,
    128x64 k128, 64x64 k128, 128x64 k65536; fp32 sm7x and older: 64x64."""
    half = dtype in _HALF
    if half and cc >= 80:
        table = [(64, 64, 32), (64, 64, 64)]
        if cc in (86, 89) and not dropout:
            table.append((128, 64, 96))
        table += [(128, 128, 128), (64, 64, 128), (128, 64, 65536)]
    elif (half and cc >= 70) or (not half and cc >= 80):
        table = [(64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 128), (128, 64, 65536)]
    else:
        table = [(64, 64, 32), (64, 64, 64), (64, 64, 128), (64, 64, 65536)]
    for kernel in table:
        if kernel[2] >= max_k:
            return kernel
    return table[-1]


def efficient_backward_workspace(dtype, cc: int, B, H: int, M: int, N: int, K: int, Kv: int, dropout: bool,
                                 deterministic: bool):
    """``p.workspace_size()`` of the chosen ``AttentionBackwardKernel`` (kernel_backward.h):
    ``B*H*align4(gk + gv + gq)*4`` with

    - ``gq = ceil(M/BI) * ceil(K/BJ) * sizeof(GradQTempStorage)/4`` when ``kNeedsAccumGradQ``
      (``kEnableSplitKeys`` = sm70+, or fp16/bf16); ``GradQTempStorage`` = 16 B of lock/counter/pad +
      the BI x BJ fp32 tile, so ``4 + BI*BJ`` floats;
    - ``gk = splits * BJ * align(K, BI)``, ``gv = splits * BJ * align(Kv, BI)`` when
      ``kNeedsAccumGradK/V`` = fp16/bf16 and not ``kOutputInRF`` (``kMaxK <= BI``);
    - ``splits`` (``num_splits_key``, attention_backward.cu): ``ceil(N/BJ)``, 1 if B*H >= 256
      and N <= 2*BJ, at most ``200 // (B*H)`` when gK/gV need staging, at least 1, 1 when
      deterministic.
    """
    BI, BJ, max_k = efficient_backward_kernel(dtype, cc, max(K, Kv), dropout)
    half = dtype in _HALF
    out_in_rf = half and max_k <= BI
    needs_q = cc >= 70 or half
    needs_kv = half and not out_in_rf
    gq = ((M + BI - 1) // BI) * ((K + BJ - 1) // BJ) * (4 + BI * BJ) if needs_q else 0
    gk = gv = 0
    if needs_kv:
        e = as_expr(B)
        if isinstance(e, int):
            bh = e * H
        elif _min_value(B) * H > 200:
            bh = _min_value(B) * H  # 200 // (B*H) == 0 for every b: one split
        else:
            raise SymbolicCaptureFailed("mem-efficient backward: the key split count depends on the batch size")
        splits = (N + BJ - 1) // BJ
        if bh >= 256 and N <= 2 * BJ:
            splits = 1
        splits = min(splits, 200 // bh)
        if splits < 1 or cc < 70 or deterministic:
            splits = 1
        gk = splits * BJ * _round_up(K, BI)
        gv = splits * BJ * _round_up(Kv, BI)
    stride_bh = _round_up(gk + gv + gq, 4)
    return as_expr(B) * H * stride_bh * 4


@correction(aten._scaled_dot_product_efficient_attention_backward.default, targets=Target.CUDA)
def efficient_backward(args, kwargs, out, spec) -> Fix:
    """``_scaled_dot_product_efficient_attention_backward_cuda`` -> ``_efficient_attention_backward``
    (attention_backward.cu).  grad_q/k/v are allocated BMHK (``at::empty(query.sizes())`` of the
    transposed inputs) = the meta's ``empty_permuted``; ``grad_bias`` padded to 16 as the meta.
    Two in-op peaks on top of them:

    1. ``grad_out.contiguous()`` (copy G when the BMHK view is not contiguous), and ``delta``:
       fp16/bf16 kernels compute it (``kKernelComputesDelta``): ``at::empty`` fp32 (B, H, M), D =
       ``B*H*M*4``; otherwise (fp32) ``(grad_out.to(float) * out.to(float)).sum(-1).transpose(-2,
       -1).contiguous()``, whose temporaries live to the end of the statement: the product P =
       ``B*M*H*Kv*4``, the sum S = ``B*M*H*4`` and D.  Peak G + P + S + D (+ two fp32 copies
       for fp16 on sm70).
    2. The kernel: G + D + workspace W (``efficient_backward_workspace``).
    """
    a = bind(aten._scaled_dot_product_efficient_attention_backward.default, args, kwargs)
    grad, q, k, v = a["grad_out_"], a["query"], a["key"], a["value"]
    B = as_expr(q.shape[0])
    H, M, K = (_static_int(x, "attention sizes") for x in (q.shape[1], q.shape[2], q.shape[3]))
    N, Kv = (_static_int(x, "attention sizes") for x in (k.shape[2], v.shape[3]))
    major, minor = spec.capability
    cc = major * 10 + minor
    cc = 120 if cc == 121 else cc
    dropout = float(a["dropout_p"]) != 0.0
    deterministic = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    G = _bmhk_copy_bytes(grad)
    D = B * H * M * 4
    half = q.dtype in _HALF
    BI, _, max_k = efficient_backward_kernel(q.dtype, cc, max(K, Kv), dropout)
    out_in_rf = half and max_k <= BI
    computes_delta = half and (out_in_rf or not 70 <= cc < 75)
    W = efficient_backward_workspace(q.dtype, cc, B, H, M, N, K, Kv, dropout, deterministic)
    if computes_delta:
        first = G + D
    else:
        P = B * M * H * Kv * 4
        copies = 2 * P if q.dtype != torch.float32 else 0
        first = G + copies + P + B * M * H * 4 + D
    return Fix(scratch=(first, G + D + W))


@correction(aten._scaled_dot_product_cudnn_attention.default, targets=Target.CUDA)
def cudnn_forward(args, kwargs, out) -> Fix:
    """``_scaled_dot_product_cudnn_attention_cuda`` -> ``_cudnn_attention_forward`` (attention.cu)
    -> ``run_cudnn_SDP_fprop`` (MHA.cpp).  ``o`` (``alloc_with_matching_layout``) and the seed and
    offset (``at::empty({}, kLong)`` on CUDA, 8 + 8 B) match the meta; ``softmaxstats`` fp32
    (B, H, L, 1) is allocated only ``if (return_softmaxstats)``, while the meta always allocates
    it: ``-B*H*L*4`` without ``compute_log_sumexp``.  The cuDNN workspace
    (``mha_graph.get_workspace_size()``, allocated through the caching allocator for the
    execution) is chosen by cuDNN at runtime: not modelled (``NOT_MODELLED``)."""
    a = bind(aten._scaled_dot_product_cudnn_attention.default, args, kwargs)
    if a["compute_log_sumexp"]:
        return Fix()
    q = a["query"]
    return Fix(output_bytes={1: -(_numel(q.shape[0], q.shape[1], q.shape[2]) * 4)})


@correction(aten._scaled_dot_product_cudnn_attention_backward.default, targets=Target.CUDA)
def cudnn_backward(args, kwargs, out) -> Fix:
    """``_cudnn_attention_backward`` (attention_backward.cu) -> ``run_cudnn_SDP_bprop`` (MHA.cpp):
    dq/dk/dv ``empty_like`` as the meta.  With cuDNN >= 9.5.1 ``dO`` is re-laid out like ``o``
    (``permute_to_matching_layout``, one output-sized copy) only when its last stride is not 1.
    The workspace is cuDNN's choice: not modelled."""
    a = bind(aten._scaled_dot_product_cudnn_attention_backward.default, args, kwargs)
    grad = a["grad_out"]
    if _hint(grad.stride(-1)) == 1:
        return Fix()
    return Fix(scratch=(_numel(*grad.shape) * grad.element_size(),))
