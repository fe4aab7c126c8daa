"""bitsandbytes per target: its CPU optimizer kernels run on fake tensors; CUDA paged state and 4-bit weights.

bitsandbytes' 8-bit and 32-bit optimizers (``Adam8bit``, ``AdamW8bit``, ``Lion8bit``,
``PagedAdamW`` …, and the fp32-state fallback of tensors under ``min_8bit_size``) update each
parameter with one op, ``bitsandbytes::optimizer_update_8bit_blockwise`` or
``bitsandbytes::optimizer_update_32bit`` (``bitsandbytes/_ops.py``).  Their fake kernels
(``register_fake`` there) allocate nothing: right for the CUDA kernels, which update in place,
but the CPU kernels are Python functions of torch ops (``bitsandbytes/backends/cpu/ops.py``,
``_optimizer_update_8bit_blockwise_cpu``: the two 8-bit states dequantized into fp32 copies,
the fp32 gradient, parameter and update temporaries, the states quantized back; ``_optimizer_
update_32bit_cpu``: its fp32 update temporaries), and those temporaries are the step's peak.
On the CPU target the op runs its CPU kernel as written, on the capture's fake tensors, so the
tracker sees each of its torch ops; the blockwise (de)quantizations inside it call native code
through ctypes and run as their fake kernels, whose outputs are what the CPU kernels allocate
(``torch.empty`` of ``out`` and ``absmax``; the native code allocates nothing of torch's).

On the CUDA target a paged optimizer's large state buffers live in CUDA managed memory
(``paged_state``): the report's own row, outside the caching allocator.  8-bit weights
(``Linear8bitLt``, ``BitsAndBytesConfig(load_in_8bit=True)``): a CUDA run multiplies with
``MatMul8bitLt`` in training too, where the CPU takes ``MatMul8bitFp`` (``cuda_int8_matmul``), and
its LLM.int8() ops (activations quantized per row, the outlier columns past the threshold kept in
16 bits, an int8 matmul dequantized) allocate as each target's kernels do (``_INT8``, below);
how many columns hold outliers depends on the values: the capture's ``data_dependent`` policy
decides (the bound: every column), the probe reads it from a real call.  4-bit weights
(``Linear4bit``, what ``BitsAndBytesConfig(load_in_4bit=True)`` builds): the CPU repacks them
for AVX512-BF16 at the first inference call, a CUDA run never does (``cuda_weights_not_repacked``);
their CUDA inference matmul, ``bitsandbytes::gemm_4bit``, is priced by ``cuda_gemm_4bit`` from
the CUDA backend's own dispatch.  Training dequantizes each weight with torch ops that run as
they are on either target.
"""

from __future__ import annotations

import torch
from bitsandbytes.autograd import _functions as autograd_functions
from bitsandbytes.backends.cpu import ops as cpu_ops
from torch.fx.experimental.symbolic_shapes import statically_known_true

from estimator.corrections.data_sizes import count, in_kernel, observes
from estimator.corrections.patches import patched
from estimator.corrections.registry import managed_state, model_rule, substitute, while_capturing
from estimator.vocab.categories import Target

int8 = torch.ops.bitsandbytes

_KERNELS = {
    "optimizer_update_8bit_blockwise": cpu_ops._optimizer_update_8bit_blockwise_cpu,
    "optimizer_update_32bit": cpu_ops._optimizer_update_32bit_cpu,
}


def _cpu_kernel(kernel):
    def run(spec, func, args, kwargs):
        return kernel(*args, **kwargs)

    return run


for _name, _kernel in _KERNELS.items():
    _packet = getattr(torch.ops.bitsandbytes, _name)
    substitute(_packet, _packet.default, targets=Target.CPU)(_cpu_kernel(_kernel))


@managed_state(targets=Target.CUDA)
def paged_state(optimizer, group: dict, key: str, value: torch.Tensor) -> bool:
    """A paged optimizer's (``PagedAdamW``, ``PagedAdamW8bit``, ``PagedLion8bit`` …) state buffers of
    100,000 elements or more (bitsandbytes/optim/optimizer.py ``get_state_buffer``: ``state1`` and
    ``state2`` of a CUDA parameter, from ``F.get_paged``: ``cudaMallocManaged``, outside PyTorch's
    caching allocator); smaller ones, and every state on the CPU, are ``torch.zeros_like``."""
    return bool(getattr(optimizer, "is_paged", False)) and key in ("state1", "state2") and value.numel() >= 100_000


@model_rule(targets=Target.CUDA)
def cuda_weights_not_repacked(spec, model) -> None:
    """``Linear4bit.forward`` (bitsandbytes/nn/modules.py) repacks its weight for the CPU's
    AVX512-BF16 kernel at the first inference call when ``x.device.type == "cpu" and
    self.support_avx512bf16_for_cpu``; the capture's fake tensors are CPU tensors, a CUDA run's
    are not: off for the CUDA target."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def _cuda_backend():
    """bitsandbytes' CUDA backend module (backends/cuda/ops.py), for its dispatch heuristic.  On a
    CPU-only torch its import reads ``torch._C._cuda_getCurrentRawStream``, which such a build
    lacks: a stand-in for the import (the kernels it registers for the CUDA key never run here)."""
    import importlib

    name = "bitsandbytes.backends.cuda.ops"
    if hasattr(torch._C, "_cuda_getCurrentRawStream"):
        return importlib.import_module(name)
    with patched(torch._C, "_cuda_getCurrentRawStream", lambda device_index: 0):
        return importlib.import_module(name)


@substitute(torch.ops.bitsandbytes.gemm_4bit.default, targets=Target.CUDA)
def cuda_gemm_4bit(spec, func, args, kwargs):
    """``bitsandbytes::gemm_4bit`` as its CUDA kernel runs (backends/cuda/ops.py): for
    ``M = A.numel() // K`` rows, the fused ``cgemm_4bit_*`` kernel (``_gemm_4bit_kernel_impl``:
    ``A.contiguous()``, the output, the nested absmax offset in fp32) where the backend's own
    heuristic ``_gemm_4bit_use_custom_fn(device, dtype, M, N, K)`` picks it for the target GPU
    (its SM count and compute capability answer ``_gpu_dispatch_props``), else
    ``_dequant_linear_fallback``: the nested absmax dequantized to fp32 and offset, the weight
    dequantized to ``A``'s dtype, ``F.linear``.  The kernels are no-ops on the fake tensors; their
    outputs are allocated as the backend allocates them."""
    import inspect

    bound = inspect.signature(_gemm_4bit_reference).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    A, shapeB, blocksize = a["A"], a["shapeB"], a["blocksize"]
    N = shapeB[0]
    custom = uses_fused_kernel(spec, A.dtype, A.numel() // A.shape[-1], N, A.shape[-1], blocksize)
    if custom:
        A = A.contiguous()
        out = torch.empty((*A.shape[:-1], N), dtype=A.dtype, device=A.device)
        offset = None if a["absmax_offset"] is None else a["absmax_offset"].to(dtype=torch.float32)  # noqa: F841
        return out
    absmax_dq = absmax = None  # each alive until the function returns, as in the backend's
    if a["absmax_8bit"] is not None:
        absmax_dq = torch.empty_like(a["absmax_8bit"], dtype=torch.float32)
        absmax = absmax_dq + a["absmax_offset"]
    weight = torch.empty(shapeB, dtype=A.dtype, device=A.device)
    out = torch.nn.functional.linear(A, weight, a["bias"])
    del absmax_dq, absmax, weight
    return out


def uses_fused_kernel(spec, dtype: torch.dtype, M, N: int, K: int, blocksize: int) -> bool:
    """Whether the CUDA backend's ``gemm_4bit`` takes its fused kernel for ``M`` rows of ``K`` times
    an ``(N, K)`` weight on the target GPU: its own rules (past ``_gemm_4bit_custom_max_m`` rows or
    with ``K`` not a multiple of the block size, never; else ``_gemm_4bit_use_custom_fn``, whose
    ``_gpu_dispatch_props`` answers the target's SM count and compute capability; an unknown GPU
    is taken for an H100, 132 SMs, sm_90)."""
    backend = _cuda_backend()
    if M > backend._gemm_4bit_custom_max_m or K % blocksize != 0:
        return False
    props = (spec.gpu.sm_count or 132, spec.gpu.major or 9, spec.gpu.minor or 0)
    with patched(vars(backend), "_gpu_dispatch_props", lambda device_index: props):
        return bool(backend._gemm_4bit_use_custom_fn.__wrapped__(0, dtype, M, N, K))


def _gemm_4bit_reference(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                         absmax_offset=None):
    """``bitsandbytes::gemm_4bit``'s signature (bitsandbytes/_ops.py), to bind a call's arguments."""


# -- 8-bit weights (LLM.int8(): bitsandbytes/autograd/_functions.py MatMul8bitLt) ----------------------------
# Its ops' fake kernels (bitsandbytes/_ops.py) ask a dynamic size for the outlier columns, and size
# ``int8_mixed_scaled_mm``'s saved input as a 1-D int64 tensor; the entries below allocate as each
# target's kernels do (backends/cuda/ops.py; backends/default/ops.py and backends/cpu/ops.py for the
# CPU), the number of outlier columns from the capture's policy (``count``).
@while_capturing(targets=Target.CUDA)
def cuda_int8_matmul(spec):
    """``bitsandbytes.matmul`` (autograd/_functions.py) trains with ``MatMul8bitFp`` (the weight
    dequantized, a floating-point matmul) where ``A.device.type in ("cpu", "xpu")``, else with
    ``MatMul8bitLt``, as it always infers: a CUDA tensor's branch is ``MatMul8bitLt``.  The fake
    tensors are CPU tensors, so the CUDA target's capture (and its probe) name ``MatMul8bitLt`` where
    ``matmul`` names ``MatMul8bitFp``."""
    return patched(autograd_functions, "MatMul8bitFp", autograd_functions.MatMul8bitLt)


def _outlier_columns(A: torch.Tensor, outliers: torch.Tensor, site: str) -> torch.Tensor:
    """``torch.argwhere(outliers.any(dim=0)).view(-1)`` where ``outliers.any()``, else an empty
    int64 tensor: the number of columns is data-dependent, ``site``'s size under the capture's
    policy (at most every column)."""
    outliers.any()  # the branch's 0-dim test
    n = count(site, A.shape[-1])
    if isinstance(n, int) and n == 0:
        return torch.empty(0, device=A.device, dtype=torch.int64)
    any_column = outliers.any(dim=0)  # noqa: F841  (alive until argwhere returns)
    return torch.empty((n, 1), device=A.device, dtype=torch.int64).view(-1)  # argwhere's output


def _vectorwise_quant(cpu: bool, A: torch.Tensor, threshold: float = 0.0, site: str = "int8_vectorwise_quant"):
    """``bitsandbytes::int8_vectorwise_quant``.  CUDA (backends/cuda/ops.py): the row stats and int8
    rows (``cint8_vector_quant`` writes them, nothing else), the outlier mask ``A.abs() >= threshold``
    alive until it returns, the outlier columns, those columns of the int8 rows zeroed where there
    are several rows.  CPU (backends/default/ops.py): the mask and columns, the outliers copied out
    (``A[outliers].clone()``) and zeroed in ``A``, the row absmax in fp32, the rows scaled, rounded
    and cast, the columns zeroed, the outliers put back."""
    rows = A.numel() // A.shape[-1]
    several = not statically_known_true(rows == 1)  # ``rows > 1`` without a guard on b
    if not cpu:
        row_stats = torch.empty(rows, device=A.device, dtype=torch.float32)
        out_row = torch.empty(A.shape, device=A.device, dtype=torch.int8)
    outlier_cols = outliers = restore = None
    if threshold > 0.0:
        outliers = A.abs() >= threshold
        outlier_cols = _outlier_columns(A, outliers, site)
        if cpu and outlier_cols.numel():
            restore = A[outliers].clone()
            A[outliers] = 0
    if cpu:
        row_stats = torch.max(A.abs(), dim=1).values.float()
        out_row = torch.round(A * (127.0 / row_stats.unsqueeze(-1))).to(torch.int8)
    if outlier_cols is not None and several:
        out_row[:, outlier_cols] = 0
    if restore is not None:
        A[outliers] = restore
    del outliers, restore
    return out_row, row_stats, outlier_cols


def _double_quant(A: torch.Tensor, threshold: float = 0.0):
    """``bitsandbytes::int8_double_quant``'s CUDA kernel (backends/cuda/ops.py; the CPU has none):
    ``int8_vectorwise_quant``'s rows and outlier columns, then ``_get_col_absmax`` (``A.abs()`` with
    the outliers masked in place, its column amax in fp32), ``A.masked_fill(outlier_mask, 0)`` and the
    int8 columns ``round(A.mul(127) / col_stats).to(int8)``."""
    quant_row, row_stats, outlier_cols = _vectorwise_quant(False, A, threshold, "int8_double_quant")
    absA = A.abs().view(-1, A.shape[-1])
    outlier_mask = None
    if threshold > 0.0:
        outlier_mask = absA >= threshold
        absA.masked_fill_(outlier_mask, 0.0)
    col_stats = absA.amax(dim=0, keepdim=False).float()
    del absA
    if outlier_mask is not None:
        A = A.masked_fill(outlier_mask, 0.0)
    del outlier_mask
    quant_col = torch.round(A.mul(127.0) / col_stats.unsqueeze(0)).to(torch.int8)
    return quant_row, quant_col, row_stats, col_stats.flatten().float(), outlier_cols


def _linear_matmul(cpu: bool, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``bitsandbytes::int8_linear_matmul``.  CUDA: the int32 output, written by cuBLASLt
    (``cigemmlt_32``); where the inner dimension is not a multiple of 4, the fp32 fallback
    ``torch.matmul(A.float(), B.float().t()).to(int32)`` copied into it.  CPU: ``torch._int_mm``
    where bitsandbytes registered it (torch >= 2.6 on an AVX-512 host: ``cpu_ops._has_avx512``,
    read on this host), else the default kernel's fp32 matmul cast to int32."""
    if cpu and cpu_ops._has_avx512 and torch.__version__ >= (2, 6):
        return torch._int_mm(A.reshape(-1, A.shape[-1]), B.t()).reshape(*A.shape[:-1], B.shape[0])
    if cpu:
        return torch.matmul(A.float(), B.float().t()).to(torch.int32)
    out = torch.empty((*A.shape[:-1], B.shape[0]), device=A.device, dtype=torch.int32)
    if A.shape[-1] % 4 != 0:
        out.copy_(torch.matmul(A.float(), B.float().t()).to(torch.int32))
    return out


def _mm_dequant(cpu: bool, A: torch.Tensor, row_stats, col_stats, dtype=None, bias=None) -> torch.Tensor:
    """``bitsandbytes::int8_mm_dequant``.  CUDA: an fp16 output (``cdequant_mm_int32_fp16``, a bias
    fused only in fp16, else added in place), cast to ``dtype``.  CPU (default kernel): the int32
    product times the outer product of the stats and the constant, the bias added, cast."""
    if cpu:
        out = A.view(-1, A.shape[-1]) * (row_stats.reshape(-1).unsqueeze(-1) * col_stats.reshape(-1).unsqueeze(0)) \
            * 6.200124e-05
        if bias is not None:
            out += bias
        return out.to(dtype or torch.float16)
    out = torch.empty_like(A, dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    return out.to(dtype or torch.float16)


def _scaled_mm(cpu: bool, A, B, row_stats, col_stats, bias=None, dtype=None) -> torch.Tensor:
    """``bitsandbytes::int8_scaled_mm`` (backends/default/ops.py, every device): the int32 matmul,
    then its dequantization."""
    return _mm_dequant(cpu, _linear_matmul(cpu, A, B), row_stats, col_stats, dtype=dtype or torch.float16, bias=bias)


def _mixed_scaled_mm(cpu: bool, A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):
    """``bitsandbytes::int8_mixed_scaled_mm`` (backends/default/ops.py, every device): the input's
    outlier columns copied out (``A[:, outlier_cols]``, kept by ``MatMul8bitLt`` for backward), the
    weight's dequantized (``int8_vectorwise_dequant``: fp32, then cast to ``A``'s dtype), the int8
    matmul, and the outliers' product added (``output.addmm``: a new tensor)."""
    subB = None
    if outlier_cols is not None and outlier_cols.numel():
        subA = A[:, outlier_cols].contiguous()
        subB = (CB[:, outlier_cols].contiguous() * SCB.view(-1, 1) * 7.874015718698502e-3).to(A.dtype).t()
    else:
        subA = torch.empty(0, device=A.device, dtype=A.dtype)
    output = _scaled_mm(cpu, CA, CB, SCA, SCB, bias=bias, dtype=A.dtype)
    if subB is not None:
        output = output.addmm(subA, subB)
    return output, subA


def _on_target(name: str, kernel):
    def run(spec, func, args, kwargs):
        with in_kernel(name):  # the outlier columns and values size the ops' buffers alone
            return kernel(spec.device is Target.CPU, *args, **kwargs)

    return run


_INT8 = {"int8_vectorwise_quant": _vectorwise_quant, "int8_linear_matmul": _linear_matmul,
         "int8_mm_dequant": _mm_dequant, "int8_scaled_mm": _scaled_mm, "int8_mixed_scaled_mm": _mixed_scaled_mm}
for _name, _kernel in _INT8.items():
    _packet = getattr(int8, _name)
    substitute(_packet, _packet.default, targets=(Target.CPU, Target.CUDA))(_on_target(_name, _kernel))
substitute(int8.int8_double_quant, int8.int8_double_quant.default, targets=Target.CUDA)(
    _on_target("int8_double_quant", lambda cpu, *args, **kwargs: _double_quant(*args, **kwargs)))


@observes(int8.int8_vectorwise_quant.default, int8.int8_double_quant.default)
def _outliers_seen(args, kwargs, out):
    """A real call's outlier columns (its last output), of the input's columns."""
    return (0 if out[-1] is None else int(out[-1].numel())), int(args[0].shape[-1])
