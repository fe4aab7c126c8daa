"""Matrix products on the CPU in reduced precision, or of matrices BLAS cannot read as they
are: measured on the host.

fp32 ``mm`` / ``addmm`` / ``bmm`` run MKL's sgemm, which allocates nothing through PyTorch's
allocator, when each matrix is row- or column-major; one that is neither (an expanded gradient
of stride 0, such as ``MeanBackward``'s or ``SumBackward``'s reaching a linear layer's backward;
a slice) is first cloned contiguous (``addmm_impl_cpu_`` in
aten/src/ATen/native/LinearAlgebra.cpp: ``m1.clone(at::MemoryFormat::Contiguous)`` when
neither stride is 1 with a valid leading dimension; measured: 64 B for the (4, 4) gradient of
``Linear(16, 4)(x).sum()``, 48 B over the fake's peak with SGD), which the meta kernel does not
do.  bf16 and fp16 products run oneDNN's matmul
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
from estimator.corrections.registry import in_reduced_precision, is_gemm_ready, measured

aten = torch.ops.aten


def _measured(args, kwargs, matrices: tuple[int, int]) -> bool:
    """A bf16/fp16 product (oneDNN), or one with a matrix BLAS cannot read as it is (cloned first);
    fp32 products of row- or column-major matrices (MKL) allocate nothing unseen."""
    return in_reduced_precision(args, kwargs) or not all(is_gemm_ready(args[i]) for i in matrices)


@measured(aten.mm.default, aten.bmm.default, targets=Target.CPU)
def matmul(args, kwargs, out) -> bool:
    """``mm(self, mat2)``, ``bmm(self, mat2)``: see ``_measured``."""
    return _measured(args, kwargs, (0, 1))


@measured(aten.addmm.default, aten.baddbmm.default, aten._addmm_activation.default, targets=Target.CPU)
def matmul_added(args, kwargs, out) -> bool:
    """``addmm(self, mat1, mat2)`` and the like: ``self`` is copied into the result, never handed to
    BLAS; see ``_measured``."""
    return _measured(args, kwargs, (1, 2))
