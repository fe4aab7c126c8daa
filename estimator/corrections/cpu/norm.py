"""Batch and layer normalization on the CPU: measured on the host.

``batch_norm_cpu`` (aten/src/ATen/native/Normalization.cpp, kernels in
aten/src/ATen/native/cpu/batch_norm_kernel.cpp) allocates per-channel statistics and, for
channels-last or reduced-precision inputs, other temporaries; its backward allocates
``grad_input`` only when ``output_mask[0]`` asks for it, while the meta kernel always shows one
(an input-sized tensor too many in training when the input needs no gradient).  What the real
kernels allocate is measured per call (``estimator.target.cpu``).

``layer_norm_cpu`` (aten/src/ATen/native/layer_norm.cpp) normalizes ``input.contiguous()``: a
non-contiguous input (ConvNeXt's ``LayerNorm2d``: ``norm(x.permute(0, 2, 3, 1))``) is first
copied, an input-sized buffer the meta kernel does not show; those calls are measured too.
"""

from __future__ import annotations

import torch

from estimator.categories import Target
from estimator.corrections.registry import fake_kernel, is_contiguous, measured

aten = torch.ops.aten


@measured(
    aten.native_batch_norm,
    aten.native_batch_norm_backward,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_no_training,
    aten._batch_norm_with_update,
    aten._batch_norm_no_update,
    aten.batch_norm_backward,
    targets=Target.CPU,
)
def batch_norm(args, kwargs, out) -> bool:
    """Every CPU batch norm call, forward and backward."""
    return True


@measured(aten.native_layer_norm.default, targets=Target.CPU)
def layer_norm_of_a_strided_input(args, kwargs, out) -> bool:
    """A CPU layer norm whose input is not contiguous (contiguous: the fake kernel is exact)."""
    return not is_contiguous(args[0])


@measured(aten.native_layer_norm_backward.default, targets=Target.CPU)
def layer_norm_backward(args, kwargs, out) -> bool:
    """A CPU layer norm backward that computes the weight's or the bias's gradient, or whose
    ``grad_out`` or ``input`` is not contiguous.  The weight and bias gradients are reduced
    through a buffer of ``2 x threads x N`` elements (N: the normalized size;
    ``LayerNormBackwardKernelImplInternal`` in aten/src/ATen/native/cpu/layer_norm_kernel.cpp,
    ``buffer.resize_({2, num_threads, N})``), which depends on the host's threads and which the
    meta kernel does not show: LayerNorm over (C, H, W) of a ConvTranspose2d output, 2 threads,
    32 KB (−10 % at b = 3)."""
    grad_out, x = args[0], args[1]
    output_mask = args[7] if len(args) > 7 else kwargs["output_mask"]
    return bool(output_mask[1] or output_mask[2]) or not (is_contiguous(grad_out) and is_contiguous(x))


@fake_kernel(aten.native_layer_norm.default, targets=(Target.CPU, Target.CUDA))
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    """The real kernels (``layer_norm_cpu`` in aten/src/ATen/native/layer_norm.cpp,
    ``layer_norm_cuda`` in cuda/layer_norm_kernel.cu) normalize ``input.expect_contiguous()``
    into ``empty_like(X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``: a contiguous output, where the
    meta kernel keeps a strided input's strides.  The layout decides what later kernels copy
    (a channels-last gradient reaching a convolution's backward), so the fake run follows the
    real one; the copy itself is the measured call's (CPU)."""
    return aten.native_layer_norm.default(input.contiguous(), normalized_shape, weight, bias, eps)


@fake_kernel(aten.native_layer_norm_backward.default, targets=(Target.CPU, Target.CUDA))
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    """As the forward: ``layer_norm_backward_cpu`` / ``_cuda`` read ``grad_out`` and ``input``
    contiguous and allocate ``grad_input`` contiguous (LEGACY_CONTIGUOUS_MEMORY_FORMAT)."""
    return aten.native_layer_norm_backward.default(grad_out.contiguous(), input.contiguous(), normalized_shape, mean,
                                                   rstd, weight, bias, output_mask)
