"""``F.scaled_dot_product_attention`` on CUDA: which backend runs.

``sdp::select_sdp_backend`` for the target GPU, on a CPU build: the context's priority order
(``priority_order``, with the cuDNN-first rule of ``check_prefer_cudnn_attention``), the runtime
flags (``torch.backends.cuda.enable_*_sdp``, ``sdpa_kernel``) and each fused backend's
``can_use_*`` checks (``why_not``), giving the backend that runs (``select_backend``).  The
substitute (``attention_substitute.py``) calls that backend's aten ops on the fake tensors;
``attention_workspaces.py`` adds what their CUDA kernels hold.  The size helpers below (static
ints where they are, hints without guards where they are symbolic) serve all three modules.

Sources read (pytorch/pytorch unless noted; "newest stored" = the newest revision the search index
holds, torch 2.13.0 is ``cf30153c``, not stored itself):

- ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` @ ``001f694a`` (late 2025/2026: sm121
  ranges, cuDNN-first order for cuDNN > 9.15 on sm90/sm10x, FA3 dtypes, cuDNN d256) -- the
  selection rules; every rule below cites the function it follows.
- ``aten/src/ATen/native/transformers/sdp_utils_cpp.h`` @ ``0119c205`` (shared checks: shapes,
  dtypes, mask shape, last-dim stride, GQA).  The newest ``sdp_utils.cpp`` instantiates
  ``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads, supports_mqa>``;
  that header revision is not stored, its semantics are inferred from the parameter names.
- ``aten/src/ATen/native/cudnn/MHA.cpp`` (2026 revision with ``check_cudnn_sdpa_decode``): the
  cuDNN decode rule.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass

import sympy
import torch

from estimator.vocab.errors import SymbolicCaptureFailed
from estimator.vocab.symbolic import as_expr

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
HALF = (torch.float16, torch.bfloat16)


# -- sizes: static ints where they are, hints (no guards) where they are symbolic ---------------
def hint(x) -> int:
    """The concrete value of a size (a SymInt's hint; no shape guard is added)."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    return int(x)


def min_value(x) -> int:
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
    return hint(a) == hint(b)


def contiguous_hint(t: torch.Tensor) -> bool:
    """``t.is_contiguous()`` decided on the size hints (no guards)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        size = hint(size)
        if size != 1 and hint(stride) != expected:
            return False
        expected *= size
    return True


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def static_int(x, what: str) -> int:
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
    hq, hk, hv = (hint(t.shape[-3]) for t in (p.q, p.k, p.v))
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
    if hint(p.q.shape[-2]) == 0 or hint(p.k.shape[-2]) == 0:
        return "zero sequence length"
    return None


def _check_last_dim_stride(p: _Params, ignore_singleton_dim: bool) -> str | None:
    # sdp_utils_cpp.h check_last_dim_stride_equals_1_dense<ignore_singleton_dim>
    ok = all(hint(t.stride(-1)) == 1 for t in (p.q, p.k, p.v))
    if ignore_singleton_dim:
        ok = ok or hint(p.q.shape[-1]) == 1
    if p.mask is not None and hint(p.mask.stride(-1)) != 1:
        ok = False
    return None if ok else "last dimension of q/k/v/mask must have stride 1"


def _check_attn_mask_shape(p: _Params) -> str | None:
    # sdp_utils_cpp.h check_attn_mask_shape: no grad; (L|1, S|1) 2-D, or 4-D with (B|1, H|1).
    m = p.mask
    if m is None:
        return None
    if m.requires_grad:
        return "attn_mask requires grad"
    L, S, B, H = (hint(x) for x in (p.q.shape[2], p.k.shape[2], p.q.shape[0], p.q.shape[1]))
    if hint(m.shape[-2]) not in (L, 1) or hint(m.shape[-1]) not in (S, 1):
        return "attn_mask last two dims must be (L or 1, S or 1)"
    if m.dim() == 2:
        return None
    if m.dim() == 4 and hint(m.shape[0]) in (1, B) and hint(m.shape[1]) in (1, H):
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
    d = [hint(t.shape[-1]) for t in (p.q, p.k, p.v)]
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
        allowed = HALF if p.major >= 8 else (torch.float16,)
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
    is_half = dtype in HALF
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
    dq, dk, dv = (hint(t.shape[-1]) for t in (p.q, p.k, p.v))
    if not (dq == dk and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return f"mem-efficient needs head dims divisible by {align}"
    # check_data_ptr_alignment_mem_efficient (sm80+): storage_offset * element_size a multiple of
    # minimum_gemm_alignment * element_size (the caching allocator aligns bases to 512 B);
    # a symbolic offset is assumed aligned (TORCH_GUARD_OR_TRUE).
    if p.major >= 8:
        align_bytes = align * p.q.element_size()
        for t in (p.q, p.k, p.v):
            offset = as_expr(t.storage_offset())
            if isinstance(offset, int) and hint(t.numel()) != 0 and (offset * t.element_size()) % align_bytes:
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
    if (r := _check_dtype(p, HALF if p.major >= 8 else (torch.float16,))) is not None:
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
    if hint(p.q.shape[0]) > 65535 or hint(p.q.shape[1]) > 65535:
        return "cuDNN: batch or heads > 65535"
    s_q, s_k = hint(p.q.shape[2]), hint(p.k.shape[2])
    d_qk, d_v = hint(p.q.shape[3]), hint(p.v.shape[3])
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
    d_qk, d_v = hint(p.q.shape[3]), hint(p.v.shape[3])
    if (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256)):
        return None
    return "cuDNN backward: unsupported head dims on sm90/sm10x"


def _cudnn_decode_reason(p: _Params) -> str | None:
    if hint(p.q.shape[2]) == 1 and cudnn_decode_disabled(p.major, p.cudnn):
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

