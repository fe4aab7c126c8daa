"""CUDA target entries: the kernels other than attention (``attention_*.py``), RNNs (``rnn.py``)
and pooling (``pooling.py``).

Sources read (no GPU was available: every number below is derived from the source, not
measured; ``tests/test_cuda_kernels.py`` checks the arithmetic on tiny modules):

- ``aten/src/ATen/native/native_functions.yaml`` / ``tools/autograd/derivatives.yaml`` of the
  installed torch 2.13 (``torchgen/packaged``): which ops have CUDA kernels and autograd formulas.
- ``aten/src/ATen/native/Dropout.cpp`` and ``native/cuda/Dropout.cu`` (the newest stored
  versions, with ``is_fused_kernel_acceptable`` testing ``is_cuda() || is_xpu() || is_lazy() ||
  is_privateuseone()`` and ``native_dropout_cuda``'s ``train == false`` short-cut).
- ``aten/src/ATen/native/layer_norm.cpp`` (pytorch/pytorch 3de78edb, the ``rms_norm_symint``
  with the MPS branch) and ``native/cuda/layer_norm_kernel.cu`` (newest stored version: the
  rms_norm template parameter, ``_fused_rms_norm_cuda``, the ``M > 64 * 1024`` gamma/beta path).
- ``aten/src/ATen/native/Normalization.cpp`` (``_select_batch_norm_backend``,
  ``_batch_norm_impl_index``), ``native/cuda/Normalization.cu`` (``batch_norm_cuda``,
  ``_batch_norm_with_update_cuda``) and ``native/cudnn/BatchNorm.cpp`` (pytorch/pytorch
  d7572ba2).
- ``aten/src/ATen/native/cuda/Embedding.cu`` (pytorch/pytorch 1c94016e, and a 2025 copy with
  ``ATEN_CUB_CONSTANT_ITERATOR``: same allocations) and ``native/cuda/EmbeddingBackwardKernel.cu``
  (newest stored version: no host sync, ``max_segments = min(numel, num_weights)``, the fused
  atomic path with ``MAX_ATOMIC_ACCUM_BLOCKS_PER_SM = 4``), ``ATen/cuda/cub-RadixSortPairs.cuh``
  and CUB's ``dispatch_radix_sort.cuh`` (``InvokeOnesweep``'s ``allocation_sizes``).
- ``aten/src/ATen/native/Loss.cpp`` (structured ``mse_loss``/``smooth_l1_loss``, ``huber_loss``,
  ``soft_margin_loss``), ``native/ReduceOps.cpp`` (``TORCH_IMPL_FUNC(mean_out)``: sum + ``div_``
  on CPU, ``mean_stub`` elsewhere), ``native/cuda/Loss.cu`` (``binary_cross_entropy_cuda``, the
  nll_loss kernels) and ``native/cuda/SoftMax.cu`` (``host_softmax``).

What needs no entry (CUDA memory equals the fake CPU run's, by source):

- ``F.dropout1d/2d/3d``, ``F.feature_alpha_dropout`` -> ``_feature_dropout(_alpha)``;
  ``F.alpha_dropout`` -> ``_alpha_dropout``: ``_dropout_impl`` on every device (a noise tensor in
  the input dtype; feature variants (N, C, 1...) sized); only ``dropout`` itself is fused.
  ``F.dropout(inplace=True)`` -> ``dropout_`` -> ``_dropout<true>``: not fused either.
- LayerNorm forward outputs on CUDA are ``Y``, ``mean``, ``rstd`` as on CPU, but with fp32
  statistics for fp16/bf16 inputs (entry below); the backward allocates dX/dgamma/dbeta like the
  CPU kernel, plus the large-M partial sums (entry below).
- BatchNorm: ``batch_norm`` -> ``_batch_norm_impl_index`` (2.13 still takes this path; the
  ``_batch_norm_with_update`` stack is commented out).  cuDNN is used when the input is not
  bf16, a half input has fp32 weights, weight and bias are defined, dim >= 3, N <= 880801
  (training) / 65535 (eval), eps >= CUDNN_BN_MIN_EPSILON and numel < INT32_MAX.  Then
  ``cudnn_batch_norm`` returns (out, save_mean, save_var in the weight dtype (C), reserve); the
  fake run shows ``native_batch_norm`` with (out, C fp32, C fp32) and an ``empty(0)`` reserve:
  equal bytes for fp32 weights.  The cuDNN workspace and reserve sizes are cuDNN queries
  (``cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize`` / ``...ReserveSpaceSize``,
  mode SPATIAL for NCHW, SPATIAL_PERSISTENT for channels-last training): not knowable here
  (``NOT_MODELLED``).  Eval: ``cudnnBatchNormalizationForwardInference``, outputs only, and
  ``save_mean``/``save_var`` of size 0, as the fake run.  Otherwise (bf16, no affine)
  ``batch_norm_cuda``: out + two acc-type (fp32) C vectors, as the fake run; the CPU-only
  ``2 * C * 4`` temporaries (cpu/norm.py) do not exist on CUDA.  Only the statistics' dtype
  differs for fp16/bf16 inputs (entry ``batch_norm_stats_fp32``).
- ``_log_softmax`` / ``_log_softmax_backward_data`` (``host_softmax``): the output only (plus
  ``input.contiguous()``, a no-op for contiguous logits); ``nll_loss_forward`` /
  ``nll_loss_backward`` (Loss.cu): the structured outputs only (``output``, ``total_weight``;
  ``grad_input`` zero-filled), no temporaries.  cross_entropy = log_softmax + nll_loss.
- ``binary_cross_entropy_backward_cuda``: ``grad_input = empty_like(input)`` then in-place ops.
"""

from __future__ import annotations

import math

import sympy
import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from estimator.corrections.cuda import Gap
from estimator.corrections.registry import (
    NO_FIX,
    Fix,
    bind,
    correction,
    is_contiguous,
    nbytes,
    numel,
    substitute,
)
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten

# Short names of what the CUDA target does not model (details in the docstrings above/below).
NOT_MODELLED: list[Gap] = [
    Gap("cuDNN convolution workspace (chosen at run time: its bound per call in its own note, "
        "devices/cudnn.py)", ("convolution",)),
    Gap("cuDNN batch-norm workspace / reserve space (cuDNN size queries; channels-last training)", ("batch_norm",)),
    Gap("CUDA reduction staging buffer + semaphores (Reduce.cuh global reduce; loss reductions)",
        ("aten.sum", "aten.mean", "norm.", "nll_loss", "aten.amax", "aten.amin", "aten.max.", "aten.min.",
         "aten.prod", "aten.var", "aten.std", "aten.any", "aten.all")),
    Gap("CUB scan / unique_by_key / exclusive_sum temporaries (look-back tile state, small)",
        ("cumsum", "cumprod", "unique", "nonzero", "masked_select", "embedding_dense_backward")),
    Gap("CUB radix-sort histogram + look-back arrays (embedding backward: estimate is a lower bound)",
        ("sort", "embedding_dense_backward", "topk")),
    Gap("SM-count branches on GPUs missing from estimator.vocab.gpus.SM_COUNTS: 132 SMs assumed"),
    Gap("quack (cutlass-dsl) RMSNorm override, when installed: (sm_count, N) fp32 partial dw in backward",
        ("_fused_rms_norm",)),
    Gap("RMSNorm double backward (create_graph=True): composite backward, not _fused_rms_norm_backward",
        ("_fused_rms_norm",)),
    Gap("dropout on nested tensors (always native_dropout)", ("nested",)),
]

# cudaDeviceProp.multiProcessorCount when the GPU's is unknown (H100 SXM / H200).  See NOT_MODELLED.
DEFAULT_SM_COUNT = 132
_HALF = (torch.float16, torch.bfloat16)


def _args(names: tuple[str, ...], defaults: dict, args, kwargs) -> dict:
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


# -- 1. dropout -----------------------------------------------------------------------------
@substitute(F.dropout, torch.dropout, targets=Target.CUDA)
def fused_dropout(spec, func, args, kwargs):
    """``at::native::dropout`` (Dropout.cpp): ``if (input.is_nested() || (train &&
    is_fused_kernel_acceptable(input, p))) return std::get<0>(at::native_dropout(input, p,
    train));`` with ``is_fused_kernel_acceptable = input.is_cuda() && p > 0 && p < 1 &&
    input.symnumel() > 0``; else ``_dropout_impl``, which the CPU runs: ``noise =
    at::empty_like(input)`` (input dtype), ``bernoulli_``, ``div_``, ``input.mul(noise)`` (the mul
    saves ``noise`` for backward).  ``native_dropout_cuda`` -> ``dropout_cuda<bool>``: ``mask =
    empty_like(self, bool)`` then ``ret = empty_like(self)``; autograd saves ``result1`` (the mask)
    and the backward is ``native_dropout_backward`` (``empty_like(grad)`` + one kernel).

    Memory: the activation kept for backward is N bytes (bool) instead of N * itemsize; the
    forward allocates mask + out (N + N * itemsize) instead of noise + out (2 N * itemsize).
    ``F.dropout(inplace=True)`` calls ``dropout_`` (never fused), eval / p in {0, 1} / empty
    inputs keep ``_dropout_impl``: fall through.
    """
    if func is F.dropout:
        a = _args(("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}, args, kwargs)
        train = a["training"]
    else:
        a = _args(("input", "p", "train"), {}, args, kwargs)
        train, a["inplace"] = a["train"], False
    x, p = a["input"], a["p"]
    if a["inplace"] or not train or not isinstance(x, torch.Tensor) or not 0.0 < float(p) < 1.0:
        return NotImplemented
    if any(isinstance(s, int) and s == 0 for s in x.shape) or x.is_nested:
        return NotImplemented
    return torch.native_dropout(x, float(p), True)[0]


# -- 2. RMSNorm / LayerNorm ----------------------------------------------------------------
_BELOW_AUTOGRAD = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.CPU
)


class _FusedRmsNorm(torch.autograd.Function):
    """``_fused_rms_norm`` as one op with the CUDA kernel's autograd (derivatives.yaml: saves
    ``input``, ``weight`` and ``result1``; backward ``_fused_rms_norm_backward``).  On CPU the
    op is CompositeImplicitAutograd (``rms_norm_composite``): called normally it would
    decompose before the fake mode sees it, so it is redispatched below autograd, where the
    fake mode runs its decomposition internally and the tracker sees one op."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        out, rstd = aten._fused_rms_norm.default.redispatch(_BELOW_AUTOGRAD, x, normalized_shape, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        dx, dw = aten._fused_rms_norm_backward.default(grad, x, ctx.normalized_shape, rstd, weight, mask)
        return (dx if mask[0] else None), (dw if mask[1] else None), None, None


@substitute(F.rms_norm, torch.rms_norm, targets=Target.CUDA)
def fused_rms_norm(spec, func, args, kwargs):
    """``rms_norm_symint`` (layer_norm.cpp): the composite fallback for channels-last inputs
    (``suggest_memory_format``), complex inputs and a weight whose dtype differs from the
    input's (2.13's warning from layer_norm.cpp says the same: "Mismatch dtype between input and
    weight ... Cannot dispatch to fused implementation"); otherwise ``at::_fused_rms_norm`` (MPS
    aside).  On CUDA that is
    ``_fused_rms_norm_cuda`` (layer_norm_kernel.cu): ``Y = empty_like(X)`` and ``rstd =
    empty({M}, acc_type)`` (fp32 for fp16/bf16/fp32), viewed to the stat shape; the CPU build's
    ``_fused_rms_norm`` is ``rms_norm_composite`` (upcast copy, pow, mean, rsqrt, two muls, the
    cast back; autograd saves the fp32 intermediates).

    Memory per call, M rows of N, itemsize s: outputs N*M*s + 4*M; saved for backward:
    input, weight, rstd (4*M).  ``_fused_rms_norm_backward_cuda``: ``dX = empty_like(X)``,
    ``dgamma = empty_like(gamma)`` (+ the large-M partial sums, ``fused_rms_norm_backward``).
    """
    a = _args(("input", "normalized_shape", "weight", "eps"), {"weight": None, "eps": None}, args, kwargs)
    x, w = a["input"], a["weight"]
    if not isinstance(x, torch.Tensor) or x.is_complex() or x.is_nested:
        return NotImplemented
    if w is not None and w.dtype != x.dtype:
        return NotImplemented
    if x.dim() in (4, 5) and suggest_memory_format(x) in (torch.channels_last, torch.channels_last_3d):
        return NotImplemented
    shape = [int(s) for s in a["normalized_shape"]]
    if tuple(x.shape[x.dim() - len(shape):]) != tuple(shape) or (w is not None and list(w.shape) != shape):
        return NotImplemented  # let torch raise its own error
    return _FusedRmsNorm.apply(x, w, shape, a["eps"])


@correction(aten.native_layer_norm.default, targets=Target.CUDA)
def layer_norm_stats_fp32(args, kwargs, out) -> Fix:
    """``layer_norm_cuda`` (layer_norm_kernel.cu): ``acc_type = at::toAccumulateType(
    input.scalar_type(), /*is_cuda=*/true); mean = at::empty({M}, dtype(acc_type)); rstd =
    ...``: fp32 statistics for fp16/bf16 inputs.  The fake kernel (torch/_refs
    ``native_layer_norm``) casts them to the input dtype when ``input.device.type == "cpu"``.
    Each of ``mean`` and ``rstd`` holds ``M * (4 - itemsize)`` more bytes (M = 4096 rows of bf16:
    2 * 8 KiB).  fp32/fp64 inputs: equal."""
    x = args[0]
    if x.dtype not in _HALF:
        return NO_FIX
    extra = numel(out[1]) * (4 - x.element_size())
    return Fix(output_bytes={1: extra, 2: extra})


@correction(aten.native_batch_norm.default, targets=Target.CUDA)
def batch_norm_stats_fp32(args, kwargs, out) -> Fix:
    """``batch_norm_cuda`` (cuda/Normalization.cu): ``options = self.options().dtype(
    at::toAccumulateType(self.scalar_type(), /*is_cuda=*/true)); save_mean = at::empty({C},
    options); save_invstd = ...``: fp32 for fp16/bf16 inputs (the path bf16 inputs and fp16
    inputs with fp16 weights take); ``cudnn_batch_norm`` (fp16 input, fp32 weight) makes them in
    the weight's dtype: fp32 too.  The fake kernel gives them the input's dtype: each of the two
    holds ``C * (4 - itemsize)`` more bytes.  Eval: both are 0-element tensors on every path."""
    if len(out) < 3 or out[1].dtype not in _HALF:
        return NO_FIX
    extra = numel(out[1]) * (4 - out[1].element_size())
    return Fix(output_bytes={1: extra, 2: extra})


def _group_norm_acc(x: torch.Tensor) -> int:
    """``kAccType`` of cuda/group_norm_kernel.cu: fp32 for fp16/bf16 inputs, else the input's."""
    return 4 if x.dtype in _HALF else x.element_size()


@correction(aten.native_group_norm.default, targets=Target.CUDA)
def group_norm_fused_params(args, kwargs, out) -> Fix:
    """``native_group_norm`` (group_norm.cpp) on CUDA runs on ``X.contiguous()`` (a copy of an
    input laid out otherwise, channels-last included); ``GroupNormKernelImplInternal``
    (cuda/group_norm_kernel.cu), with an affine weight or bias and ``HxW > 1``, holds the fused
    scale and shift in ``a = at::empty({N, C}, kAccType)`` and ``b``; ``HxW == 1``
    (``GroupNorm1dForward``) and the non-affine path allocate nothing more.  All alive to the end
    of the op."""
    x, weight, bias, n, c, hxw = args[:6]
    scratch = 0 if is_contiguous(x) else nbytes(x)
    if (weight is not None or bias is not None) and as_expr(hxw) != 1:
        scratch += 2 * as_expr(n) * as_expr(c) * _group_norm_acc(x)
    return Fix(scratch=(scratch,)) if scratch else NO_FIX


@correction(aten.native_group_norm_backward.default, targets=Target.CUDA)
def group_norm_backward_buffers(args, kwargs, out) -> Fix:
    """``GroupNormBackwardKernelImplInternal`` (cuda/group_norm_kernel.cu): ``ds``, ``db`` =
    ``at::empty({N, C}, kAccType)`` always; for the input's gradient ``c2``, ``c3`` =
    ``at::empty({N, G}, kAccType)`` and, with a weight and ``HxW > 1``, ``c1`` (``empty({0})``
    resized by its TensorIterator to ``(N, G, D)``: ``N * C``); ``HxW == 1``
    (``GroupNorm1dBackward``) makes ``c2``, ``c3`` only; and ``native_group_norm_backward``
    (group_norm.cpp) reads ``dY.contiguous()`` and ``X.contiguous()``: copies of either laid out
    otherwise.  All alive to the end of the op."""
    grad, x, weight, n, c, hxw, group, mask = args[0], args[1], args[4], *args[5:10]
    n, c, group = as_expr(n), as_expr(c), as_expr(group)
    elements = 2 * n * c
    if mask[0]:
        elements += 2 * n * group + (n * c if weight is not None and as_expr(hxw) != 1 else 0)
    copies = sum(0 if is_contiguous(t) else nbytes(t) for t in (grad, x))
    return Fix(scratch=(elements * _group_norm_acc(x) + copies,))


def _sm_count(spec) -> int:
    return spec.gpu.sm_count or DEFAULT_SM_COUNT


def _gamma_beta_blocks(M, N: int, isz: int, n_buffers: int, sm_count: int):
    """``LaunchGammaBetaBackwardCUDAKernel`` (layer_norm_kernel.cu): ``if (M > 64 * 1024 && N /
    block_dim_x < sm_count / 2)`` (block_dim_x = 32): ``blocks.x = ceil(N / 32)``, ``blocks.y =
    min(32768 / blocks.x, ceil(M / 32))``, ``dgamma_blocks = empty({blocks.y, N}, dgamma
    options)`` (and ``dbeta_blocks``), then ``*dgamma = dgamma_blocks.sum(0)``: a new N-element
    result while the old ``dgamma`` is still referenced.  The in-kernel peak is the blocks plus one
    N * itemsize sum result; None when the path is not taken.  ``M > 65536`` is a comparison on
    the (possibly symbolic) row count: it adds a shape guard, so a symbolic capture's range
    records which side it is on."""
    if N // 32 >= sm_count // 2 or not bool(M > 64 * 1024):
        return None
    cap = 32768 // -(-N // 32)  # max_grid_size / blocks.x
    rows = (M + 31) // 32
    blocks_y = cap if bool(rows >= cap) else rows
    return n_buffers * as_expr(blocks_y) * N * isz + N * isz


def _norm_backward_rows(a: dict):
    """(M rows, N normalized elements, the ``dY.contiguous()`` copy) of a bound LayerNorm or
    RMSNorm backward (``LayerNormBackwardKernelImplInternal``'s common prologue)."""
    x, shape = a["input"], a["normalized_shape"]
    N = math.prod(int(s) for s in shape)
    M = 1
    for s in x.shape[: x.dim() - len(shape)]:
        M = M * s
    copy = 0 if a["grad_out"].is_contiguous() else nbytes(a["grad_out"])
    return M, N, copy


@correction(aten.native_layer_norm_backward.default, targets=Target.CUDA)
def layer_norm_backward_blocks(args, kwargs, out, spec) -> Fix:
    """``layer_norm_backward_cuda`` -> ``LayerNormBackwardKernelImplInternal``: ``dY.contiguous()``
    (a copy when the incoming gradient is not contiguous) and, for M > 65536 rows of N < 2112
    (132 SMs; the GPU's count), the per-block partial sums of dgamma and dbeta (``_gamma_beta_blocks``)."""
    a = bind(aten.native_layer_norm_backward.default, args, kwargs)
    x, mask = a["input"], a["output_mask"]
    M, N, copy = _norm_backward_rows(a)
    n_buffers = int(bool(mask[1]) and a["weight"] is not None) + int(bool(mask[2]) and a["bias"] is not None)
    isz = a["weight"].element_size() if a["weight"] is not None else x.element_size()
    blocks = _gamma_beta_blocks(M, N, isz, n_buffers, _sm_count(spec)) if n_buffers else None
    scratch = copy + (blocks or 0)
    return Fix(scratch=(scratch,)) if scratch else NO_FIX


@correction(aten._fused_rms_norm_backward.default, targets=Target.CUDA)
def fused_rms_norm_backward(args, kwargs, out, spec) -> Fix:
    """``_fused_rms_norm_backward_cuda`` -> ``RMSNormBackwardKernelImpl`` ->
    ``LayerNormBackwardKernelImplInternal<T, /*rms_norm=*/true>(dY.contiguous(), ...)``: as
    LayerNorm's backward with dgamma only (no ``dbeta_blocks`` for rms_norm)."""
    a = bind(aten._fused_rms_norm_backward.default, args, kwargs)
    mask = a["output_mask"]
    M, N, copy = _norm_backward_rows(a)
    w = a["weight"]
    blocks = _gamma_beta_blocks(M, N, w.element_size(), 1, _sm_count(spec)) if mask[1] and w is not None else None
    scratch = copy + (blocks or 0)
    return Fix(scratch=(scratch,)) if scratch else NO_FIX


# -- 4. embedding backward ------------------------------------------------------------------
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu
MAX_BLOCK_SIZE = 1024  # SortingCommon.cuh
ALIGN_CUB = 256  # CUB AliasTemporaries: each temporary rounded to 256 B, + 255 B of slack


def _rup(x, m):
    return (x + m - 1) // m * m if isinstance(x, int) else sympy.ceiling(sympy.sympify(x) / m) * m


def radix_sort_pairs_temp(n, key_size: int, value_size: int):
    """ESTIMATE (a lower bound) of ``cuda::cub::radix_sort_pairs``' temporary storage
    (cub-RadixSortPairs.cuh: ``CUB_WRAPPER(DeviceRadixSort::SortPairs, ...)`` allocates
    ``temp_storage_bytes`` through the caching allocator).  CUB's non-DoubleBuffer SortPairs
    (``is_overwrite_okay = false``) books, in ``InvokeOnesweep``'s ``allocation_sizes``: bins,
    lookback, ``num_items * KeySize`` (extra key buffer), ``num_items * value_size`` (extra value
    buffer), counters; each rounded up to 256 B, plus 255 B.  Only the two extra buffers (and the
    alignment) are counted: bins/counters are ``passes * 256 * 4..8`` B and the look-back array
    ``ceil(n / tile) * 1 KiB`` with a tile size that depends on the CUB tuning policy (see
    ``NOT_MODELLED``)."""
    return _rup(n * key_size, ALIGN_CUB) + _rup(n * value_size, ALIGN_CUB) + ALIGN_CUB - 1


@correction(aten.embedding_dense_backward.default, targets=Target.CUDA)
def embedding_dense_backward(args, kwargs, out, spec) -> Fix:
    """``embedding_dense_backward_cuda`` (Embedding.cu) and ``embedding_backward_cuda_kernel``
    (EmbeddingBackwardKernel.cu).  n = indices.numel(), i = index itemsize (8 for int64), W =
    num_weights, D = embedding dim, acc = 4 for fp16/bf16 gradients else the itemsize; the
    output ``grad_weight`` (W * D, zero-filled) is what the fake kernel shows.

    - ``n <= 3072 && !scale_grad_by_freq``: ``at::zeros({W, D})`` + one kernel: nothing more.
    - else: ``sorted_indices``, ``orig_indices`` (n * i each, alive to the end), ``range =
      arange(n)`` (n * i) and the CUB sort's temporary storage (estimate: 2 n * i, see
      ``radix_sort_pairs_temp``) during the sort; with ``scale_grad_by_freq`` a ``count`` (n * i).
      Peak 1 (before ``grad_weight`` exists): 3 n * i + sort temp (- the output, which is not
      alive yet).  Then in ``embedding_backward_cuda_kernel``: ``grad_weight``, ``segment_offsets``
      (n * i), ``num_of_segments_tensor`` (8 B), S = min(n, W): ``partials_per_segment`` and
      ``partials_per_segment_offset`` (S * i each), ``num_of_partial_segments_tensor`` (8 B), P =
      n / 10 + S (integer division): ``partial_segment_offset`` (P * i), and either the two-pass
      path's ``grad_weight_per_segment`` (P * D * acc) or, when ``!deterministic && S *
      stride_warped / block < 4 * SMs && P > 4 * that grid`` (stride_warped = ceil(D / 32) * 32,
      block = min(stride_warped, 1024)), the fused atomic path's ``partial_to_segment_idx`` (P * i)
      plus, for fp16/bf16, ``grad_weight_acc`` (W * D * 4, zeros) copied into ``grad_weight``.
      Peak 2: 2 n * i (+ count) + n * i + 16 + 2 S * i + P * i + the path's buffer.

    The sizes do not depend on the index values: since the host sync was removed the kernel
    sizes its buffers for the worst case (all indices distinct) itself.  Branches on n (3072,
    min(n, W), the fused-path test) are comparisons on the possibly symbolic n: shape guards.
    """
    a = bind(aten.embedding_dense_backward.default, args, kwargs)
    grad, indices = a["grad_output"], a["indices"]
    n_sym, W = indices.numel(), a["num_weights"]
    scale = bool(a["scale_grad_by_freq"])
    n, i = as_expr(n_sym), indices.element_size()
    # indices_.contiguous(), grad_.contiguous(): copies only for non-contiguous arguments
    pre = (0 if indices.is_contiguous() else n * i) + (0 if grad.is_contiguous() else nbytes(grad))
    if not scale and bool(n_sym <= 3072):
        return Fix(scratch=(pre,)) if pre else NO_FIX
    D = int(grad.shape[-1])
    acc = 4 if grad.dtype in _HALF else grad.element_size()
    out_bytes = nbytes(out)
    # peak 1: sorted + orig + range + CUB temp, grad_weight not yet allocated
    peak1 = pre + 3 * n * i + radix_sort_pairs_temp(n, i, i) - out_bytes
    S_sym = n_sym if bool(n_sym <= W) else W
    S = as_expr(S_sym)
    P_sym = n_sym // NROWS_PER_THREAD + S_sym
    P = as_expr(P_sym)
    stride_warped = -(-D // 32) * 32
    block = min(stride_warped, MAX_BLOCK_SIZE)
    grid = (S_sym * stride_warped + block - 1) // block
    fused = (
        not torch.are_deterministic_algorithms_enabled()
        and bool(grid < _sm_count(spec) * 4)
        and bool(P_sym > grid * 4)
    )
    if fused:
        path = P * i + (as_expr(W) * D * 4 if grad.dtype in _HALF else 0)
    else:
        path = P * D * acc
    count = n * i if scale else 0
    peak2 = pre + 2 * n * i + count + n * i + 16 + 2 * S * i + P * i + path
    return Fix(scratch=(peak1, peak2))


# -- 5. losses --------------------------------------------------------------------------------
_NONE = 0  # at::Reduction::None


def _loss_fix(op, args, kwargs, out, scratch, keeps_full_buffer: bool) -> Fix:
    a = bind(op, args, kwargs)
    if a["reduction"] == _NONE:
        return NO_FIX
    n = nbytes(a["self"])
    output_bytes = {0: n - out.element_size()} if keeps_full_buffer else {}
    return Fix(output_bytes=output_bytes, scratch=(scratch(n, out.element_size()),))


@correction(aten.mse_loss.default, targets=Target.CUDA)
def mse_loss(args, kwargs, out) -> Fix:
    """``TORCH_META_FUNC(mse_loss)`` (Loss.cpp, structured, shared by CPU and CUDA) allocates the
    output at the input's size; ``TORCH_IMPL_FUNC(mse_loss_out)`` computes the unreduced loss
    into a temporary ``loss`` (N bytes) and ``at::mean_out``/``sum_out`` it into the output,
    which is resized to a scalar and keeps its N-byte storage (as on CPU, loss.py).  On CUDA
    ``mean_out`` is one ``mean_stub`` reduction (ReduceOps.cpp: the sum + ``div_`` with a wrapped
    8-byte scalar is the CPU branch), so the in-op extra is the temporary alone: N (CPU: N + 12)."""
    return _loss_fix(aten.mse_loss.default, args, kwargs, out, lambda n, s: n, True)


@correction(aten.smooth_l1_loss.default, targets=Target.CUDA)
def smooth_l1_loss(args, kwargs, out) -> Fix:
    """``TORCH_IMPL_FUNC(smooth_l1_loss_out)`` (Loss.cpp): the structure of ``mse_loss``: the
    scalar keeps the N-byte storage, N more bytes inside the op."""
    return _loss_fix(aten.smooth_l1_loss.default, args, kwargs, out, lambda n, s: n, True)


@correction(aten.binary_cross_entropy.default, targets=Target.CUDA)
def binary_cross_entropy(args, kwargs, out) -> Fix:
    """``binary_cross_entropy_cuda`` (cuda/Loss.cu): ``loss = at::empty_like(input)``, one
    TensorIterator kernel, ``loss.mul_(weight)``, then ``loss_reduced = loss.mean()`` (or
    ``sum()``) and ``loss.resize_as_(loss_reduced).copy_(loss_reduced)``: the returned scalar
    keeps the N-byte storage (the fake kernel shows itemsize bytes) and ``loss_reduced`` (one
    element) is alive inside the op."""
    return _loss_fix(aten.binary_cross_entropy.default, args, kwargs, out, lambda n, s: s, True)


@correction(aten.soft_margin_loss.default, targets=Target.CUDA)
def soft_margin_loss(args, kwargs, out) -> Fix:
    """``soft_margin_loss`` (Loss.cpp, CompositeExplicitAutograd): ``output = empty({0})``,
    ``neg_out(output, input)`` (resized to the input: N bytes), in-place ops, ``tmp =
    apply_loss_reduction(output)`` (a one-element tensor), ``output.resize_({})``,
    ``copy_(tmp)``: N bytes under the scalar, one element more inside the op."""
    return _loss_fix(aten.soft_margin_loss.default, args, kwargs, out, lambda n, s: s, True)


@correction(aten.huber_loss.default, targets=Target.CUDA)
def huber_loss(args, kwargs, out) -> Fix:
    """``huber_loss`` (Loss.cpp, CPU and CUDA): ``loss = at::empty_like(input)`` (N bytes), one
    kernel, ``apply_loss_reduction`` -> ``loss.mean()`` / ``sum()``: a fresh scalar (the output)
    while ``loss`` is alive.  In-op extra: N (CPU: N + 12, the wrapped scalar of ``div_``)."""
    return _loss_fix(aten.huber_loss.default, args, kwargs, out, lambda n, s: n, False)
