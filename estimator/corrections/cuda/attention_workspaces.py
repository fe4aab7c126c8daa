"""``F.scaled_dot_product_attention`` on CUDA: what the kernels hold.

The substitute (``attention_substitute.py``) runs the chosen backend's aten ops on fake tensors,
whose meta kernels give the outputs; the corrections here add what the CUDA kernels allocate
besides (flash split-KV accumulators and ``dq_accum``/``softmax_d``, the mem-efficient output
accumulator and backward workspace, the second ``rng_state``, BMHK copies) and remove what the
meta kernels allocate and the CUDA kernels do not (mem-efficient seed/offset on the host, cuDNN
``softmaxstats`` without ``compute_log_sumexp``).  cuDNN's own workspace is not modelled
(``attention_substitute.NOT_MODELLED``).

Sources read (pytorch/pytorch unless noted; "newest stored" = the newest revision the search index
holds, torch 2.13.0 is ``cf30153c``, not stored itself):

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
"""

from __future__ import annotations

import ctypes
import math

import torch

from estimator.corrections.cuda.attention_backends import (
    HALF,
    contiguous_hint,
    hint,
    min_value,
    round_up,
    static_int,
)
from estimator.corrections.registry import Fix, bind, correction
from estimator.vocab.categories import Target
from estimator.vocab.errors import SymbolicCaptureFailed
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten

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
    if count(min_value(batch)) == 1 and (n_blocks == 1 or min_value(batch) * heads * m_blocks >= 1.6 * num_sms):
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
    H, L, d = (static_int(x, "flash attention sizes") for x in (q.shape[1], q.shape[2], q.shape[3]))
    Hk, S = (static_int(x, "flash attention sizes") for x in (k.shape[1], k.shape[2]))
    splits, L2, H2 = flash_split_kv(B, H, Hk, L, S, d, dropout_p, spec.gpu.sm_count)
    if splits <= 1:
        return Fix()
    d_rounded = round_up(d, 32 if d <= 128 else 64)
    return Fix(scratch=(splits * as_expr(B) * H2 * L2 * 4 * (1 + d_rounded),))


def _bmhk_copy_bytes(t: torch.Tensor):
    """Bytes of ``t.transpose(1, 2).contiguous()`` when it copies (a BHMK view of BMHK memory
    does not)."""
    return 0 if contiguous_hint(t.transpose(1, 2)) else _numel(*t.shape) * t.element_size()


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
    H, L, d = (static_int(x, "flash attention sizes") for x in (q.shape[1], q.shape[2], q.shape[3]))
    Hk, S = (static_int(x, "flash attention sizes") for x in (k.shape[1], k.shape[2]))
    d_rounded = round_up(d, 32 if d <= 128 else 64)
    L128 = round_up(L, 128)
    dq_accum = B * L128 * H * d_rounded * 4
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        sms = spec.gpu.sm_count
        if sms is None or min_value(q.shape[0]) * H >= sms:
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
    max_k = max(hint(q.shape[-1]), hint(v.shape[-1]))
    if q.dtype in HALF and max_k > 128:
        scratch = (_numel(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]) * 4,)
    return Fix(output_bytes={2: -8, 3: -8}, scratch=scratch)


def efficient_backward_kernel(dtype: torch.dtype, cc: int, max_k: int, dropout: bool) -> tuple[int, int, int]:
    """(kBlockSizeI, kBlockSizeJ, kMaxK) of the first kernel ``dispatch_cutlassB`` accepts
    (cutlassB.h): kMaxK >= max(K, Kv) and dropout support; shared memory assumed sufficient
    (A100/H100/B200 class).  fp16/bf16 sm80+: 64x64 k32, 64x64 k64, [sm86/89: 128x64 k96],
    128x128 k128, 64x64 k128, 128x64 k65536; fp32 sm80+ and fp16 sm7x: 64x64 k32, 64x64 k64,
    128x64 k128, 64x64 k128, 128x64 k65536; fp32 sm7x and older: 64x64."""
    half = dtype in HALF
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
    half = dtype in HALF
    out_in_rf = half and max_k <= BI
    needs_q = cc >= 70 or half
    needs_kv = half and not out_in_rf
    gq = ((M + BI - 1) // BI) * ((K + BJ - 1) // BJ) * (4 + BI * BJ) if needs_q else 0
    gk = gv = 0
    if needs_kv:
        e = as_expr(B)
        if isinstance(e, int):
            bh = e * H
        elif min_value(B) * H > 200:
            bh = min_value(B) * H  # 200 // (B*H) == 0 for every b: one split
        else:
            raise SymbolicCaptureFailed("mem-efficient backward: the key split count depends on the batch size")
        splits = (N + BJ - 1) // BJ
        if bh >= 256 and N <= 2 * BJ:
            splits = 1
        splits = min(splits, 200 // bh)
        if splits < 1 or cc < 70 or deterministic:
            splits = 1
        gk = splits * BJ * round_up(K, BI)
        gv = splits * BJ * round_up(Kv, BI)
    stride_bh = round_up(gk + gv + gq, 4)
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
    H, M, K = (static_int(x, "attention sizes") for x in (q.shape[1], q.shape[2], q.shape[3]))
    N, Kv = (static_int(x, "attention sizes") for x in (k.shape[2], v.shape[3]))
    major, minor = spec.capability
    cc = major * 10 + minor
    cc = 120 if cc == 121 else cc
    dropout = float(a["dropout_p"]) != 0.0
    deterministic = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    G = _bmhk_copy_bytes(grad)
    D = B * H * M * 4
    half = q.dtype in HALF
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
    execution) is chosen by cuDNN at runtime: not modelled
    (``attention_substitute.NOT_MODELLED``)."""
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
    if hint(grad.stride(-1)) == 1:
        return Fix()
    return Fix(scratch=(_numel(*grad.shape) * grad.element_size(),))
