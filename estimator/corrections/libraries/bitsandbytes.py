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
(``paged_state``): the report's own row, outside the caching allocator.  4-bit weights
(``Linear4bit``, what ``BitsAndBytesConfig(load_in_4bit=True)`` builds): the CPU repacks them
for AVX512-BF16 at the first inference call, a CUDA run never does (``cuda_weights_not_repacked``);
their CUDA inference matmul, ``bitsandbytes::gemm_4bit``, is priced by ``cuda_gemm_4bit`` from
the CUDA backend's own dispatch.  Training dequantizes each weight with torch ops that run as
they are on either target.
"""

from __future__ import annotations

import torch
from bitsandbytes.backends.cpu import ops as cpu_ops

from estimator.corrections.patches import patched
from estimator.corrections.registry import managed_state, model_rule, substitute
from estimator.vocab.categories import Target

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
