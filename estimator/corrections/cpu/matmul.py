"""Matrix products on the CPU: the copies BLAS needs, and reduced precision measured on the host.

fp32 ``mm`` / ``addmm`` / ``bmm`` run MKL's sgemm, which allocates nothing through PyTorch's
allocator, when each matrix is row- or column-major; one that is neither (an expanded gradient
of stride 0, such as ``MeanBackward``'s or ``SumBackward``'s reaching a linear layer's backward;
a slice) is first cloned contiguous (``addmm_impl_cpu_`` in
aten/src/ATen/native/LinearAlgebra.cpp: ``m1.clone(at::MemoryFormat::Contiguous)`` when
neither stride is 1 with a valid leading dimension; measured: 64 B for the (4, 4) gradient of
``Linear(16, 4)(x).sum()``, 48 B over the fake's peak with SGD), which the meta kernel does not
do: those clones are computed from the strides (``_copies``).  bf16 and fp16 products run
oneDNN's matmul
(aten/src/ATen/native/mkldnn/Matmul.cpp ``mkldnn_matmul``; ``use_mkldnn_matmul`` in
aten/src/ATen/native/LinearAlgebra.cpp), whose brgemm implementations book a scratchpad
(packed blocks, per-thread accumulators) that depends on the ISA (AVX512_BF16, AMX, or AVX2
emulation), the shapes and the thread count: 11 to 43 KB per call measured on small shapes on
an AVX-512 host, which was −1.7 to −2.3 % of checkpointed bf16 steps.  They are measured
(``estimator.corrections.cpu.host``), within the per-call compute limit there.
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import (
    MEASURE,
    NO_FIX,
    Fix,
    correction,
    fake_kernel,
    in_reduced_precision,
    is_gemm_ready,
    is_contiguous,
    leading_dimension_ok,
)
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten


def _copies(m1: torch.Tensor, m2: torch.Tensor):
    """Bytes ``addmm_impl_cpu_`` (aten/src/ATen/native/LinearAlgebra.cpp) clones of ``m1`` and
    ``m2`` before calling BLAS, for a fresh contiguous result; None where a stride comparison
    cannot be decided on the sizes' expressions (a symbolic leading dimension).

    The result (rows, cols), strides (cols, 1), is column-major only when cols == 1; else the
    operands swap and ``transpose_c`` is set.  A matrix whose strides are neither ``(1, >= max(1,
    m))`` nor ``(>= max(1, k), 1)`` in the resulting roles is cloned contiguous: an expanded
    (stride 0) gradient always is."""
    rows, cols = as_expr(m1.shape[0]), as_expr(m2.shape[1])
    transpose_c = cols != 1
    if transpose_c:
        m1, m2 = m2, m1
    m, n = (cols, rows) if transpose_c else (rows, cols)
    k = as_expr(m1.shape[0 if transpose_c else 1])
    i, j = (1, 0) if transpose_c else (0, 1)
    total = 0
    for t, (lead_a, lead_b) in ((m1, (m, k)), (m2, (k, n))):
        strides = [as_expr(x) for x in t.stride()]
        usable = [strides[i] == 1 and leading_dimension_ok(strides[j], lead_a),
                  strides[j] == 1 and leading_dimension_ok(strides[i], lead_b)]
        if any(u is True for u in usable):
            continue
        if any(u is None for u in usable):
            return None
        total += as_expr(t.numel()) * t.element_size()
    return total


def _fix(args, kwargs, m1: torch.Tensor, m2: torch.Tensor, batched: bool) -> Fix:
    """A bf16/fp16 product (oneDNN) is measured; an fp32 one (MKL) allocates nothing unseen but
    the clones ``_copies`` finds (measured where they cannot be decided, and for ``bmm``, whose
    layout rules are its own, when a matrix is not row- or column-major)."""
    if in_reduced_precision(args, kwargs):
        return MEASURE
    if batched:
        return NO_FIX if is_gemm_ready(m1) and is_gemm_ready(m2) else MEASURE
    copies = _copies(m1, m2)
    if copies is None:
        return MEASURE
    return Fix(scratch=(copies,)) if copies else NO_FIX


@correction(aten.mm.default, aten.bmm.default, aten.mm.out, aten.bmm.out, targets=Target.CPU)
def matmul(args, kwargs, out) -> Fix:
    """``mm(self, mat2)``, ``bmm(self, mat2)``, and their ``out=`` forms (what a compiled region's
    Inductor program calls: ``extern_kernels.mm(a, b, out=buf)``, the same kernel): ``_fix``."""
    return _fix(args, kwargs, args[0], args[1], out.dim() == 3)


@correction(aten.addmm.default, aten.baddbmm.default, aten._addmm_activation.default, aten.addmm.out,
            aten.baddbmm.out, aten._addmm_activation.out, targets=Target.CPU)
def matmul_added(args, kwargs, out) -> Fix:
    """``addmm(self, mat1, mat2)`` and the like (and their ``out=`` forms): ``self`` is copied into
    the result, never handed to BLAS; ``_fix``."""
    return _fix(args, kwargs, args[1], args[2], out.dim() == 3)



@fake_kernel(aten._scaled_mm.out, targets=(Target.CPU, Target.CUDA))
def scaled_mm_into(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                   use_fast_accum=False, *, out):
    """``_scaled_mm.out`` (what Inductor's wrapper calls, ``extern_kernels._scaled_mm(..., out=)``)
    writes ``out``, of the product's shape; it has no fake kernel, and fake tensors would run the
    real kernel on zero-filled inputs of the real sizes (minutes for a Llama 8B block on the CPU)."""
    return out


@correction(aten._scaled_mm.default, aten._scaled_mm.out, targets=Target.CPU)
def scaled_mm(args, kwargs, out) -> Fix:
    """A CPU ``_scaled_mm`` (torchao's float8 matmuls; aten/src/ATen/native/Blas.cpp).
    ``_scaled_mm_out_cpu`` takes oneDNN's fp8 matmul on a host with AMX-INT8 (measured there),
    else ``_scaled_mm_out_cpu_emulated``, whose buffers are, for ``a`` (M, K) and ``b`` (K, N):
    ``a.contiguous()`` and ``b.contiguous()`` (copies where not contiguous, alive to the end),
    ``a.to(kFloat)`` then its scaled product ``fp32_a`` (4 MK each, the first freed once the
    second exists), the same for ``b`` (4 KN), the fp32 product ``out_tmp`` (4 MN), then its cast
    to the output's dtype beside it before the copy into ``out``.  With tensorwise scales each
    product is ``at::mul(t, scale.item<float>())``: the float is wrapped into a 0-dim tensor (8 B,
    and 4 B for its cast) alive during the product.  The local maxima: while ``fp32_a`` is made,
    while ``fp32_b`` is made, and at the cast."""
    a, b = args[0], args[1]
    if torch.cpu._is_amx_tile_supported():
        return MEASURE
    M, K, N = (as_expr(x) for x in (a.shape[0], a.shape[1], b.shape[1]))
    copies = sum(0 if is_contiguous(t) else as_expr(t.numel()) * t.element_size() for t in (a, b))
    fp32_a, fp32_b, product = 4 * M * K, 4 * K * N, 4 * M * N
    cast = M * N * out.element_size()
    wrapped = 8 + 4 if args[2].numel() == 1 else 0  # tensorwise: the scale as a wrapped number
    return Fix(scratch=(copies + 2 * fp32_a + wrapped, copies + fp32_a + 2 * fp32_b + wrapped,
                        copies + fp32_a + fp32_b + product + cast))


def scaled_mm_notes(ops, target: Target) -> tuple[str, ...]:
    """What a CPU step with float8 matmuls (``_scaled_mm``) is not validated for (``ops``: the
    captured ops)."""
    if target is not Target.CPU or not any(op.name == "aten._scaled_mm.default" for op in ops):
        return ()
    return ("float8 matmuls (torchao's float8 training) on the CPU target: each _scaled_mm's buffers match the "
            "CPU kernel measured alone (its fp32 emulation, Blas.cpp), and whole train steps of a small MLP with "
            "torchao's tensorwise and rowwise recipes are exact (b = 16, 64); larger float8 models are not "
            "validated yet",)
