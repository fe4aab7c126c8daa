"""Scaled dot-product attention on the CPU: measured on the host.

``F.scaled_dot_product_attention`` on CPU tensors runs ``_scaled_dot_product_flash_attention_for_cpu``
(aten/src/ATen/native/transformers/attention.cpp; kernel in native/cpu/FlashAttentionKernel.cpp)
where the inputs allow it.  The kernel's buffers are not in the meta kernel: per-thread blocks of
scores and accumulators in the forward (``buf`` sized by the thread count and the q/kv split
sizes the kernel picks), and in the backward an fp32 accumulator of ``grad_q`` (a q-sized
buffer for fp32 inputs: +6 MiB at b = 8, 12 heads, 256 tokens) plus per-thread blocks.  The
block sizes depend on the sequence length, and the buffers on the thread count, so the calls
are measured (``estimator.corrections.cpu.host``).
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import measured
from estimator.vocab.categories import Target

aten = torch.ops.aten


@measured(aten._scaled_dot_product_flash_attention_for_cpu.default,
          aten._scaled_dot_product_flash_attention_for_cpu_backward.default, targets=Target.CPU)
def flash_attention(args, kwargs, out) -> bool:
    """Every CPU flash-attention call, forward and backward."""
    return True
