"""bitsandbytes' optimizers: their CPU kernels run on the fake tensors; their paged state on CUDA.

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
(``paged_state``): the report's own row, outside the caching allocator.
"""

from __future__ import annotations

import torch
from bitsandbytes.backends.cpu import ops as cpu_ops

from estimator.corrections.registry import managed_state, substitute
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
