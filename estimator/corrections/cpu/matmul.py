"""Matrix products in reduced precision on the CPU: measured on the host.

fp32 ``mm`` / ``addmm`` / ``bmm`` run MKL's sgemm, which allocates nothing through PyTorch's
allocator (the fake kernels are exact).  bf16 and fp16 products run oneDNN's matmul
(aten/src/ATen/native/mkldnn/Matmul.cpp ``mkldnn_matmul``; ``use_mkldnn_matmul`` in
aten/src/ATen/native/LinearAlgebra.cpp), whose brgemm implementations book a scratchpad
(packed blocks, per-thread accumulators) that depends on the ISA (AVX512_BF16, AMX, or AVX2
emulation), the shapes and the thread count: 11 to 43 KB per call measured on small shapes on
an AVX-512 host, which was −1.7 to −2.3 % of checkpointed bf16 steps.  They are measured
(``estimator.target.cpu``), within the per-call compute limit there.
"""

from __future__ import annotations

import torch

from estimator.categories import Target
from estimator.corrections.registry import in_reduced_precision, measured

aten = torch.ops.aten


@measured(aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
          aten._addmm_activation.default, targets=Target.CPU)
def reduced_precision_matmul(args, kwargs, out) -> bool:
    """A bf16/fp16 matrix product (oneDNN); fp32 (MKL) allocates nothing unseen."""
    return in_reduced_precision(args, kwargs)
