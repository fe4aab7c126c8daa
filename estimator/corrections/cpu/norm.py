"""Batch, layer and group normalization on the CPU: measured on the host.

``batch_norm_cpu`` (aten/src/ATen/native/Normalization.cpp, kernels in
aten/src/ATen/native/cpu/batch_norm_kernel.cpp) allocates per-channel statistics and, for
channels-last or reduced-precision inputs, other temporaries; its backward allocates
``grad_input`` only when ``output_mask[0]`` asks for it, while the meta kernel always shows one
(an input-sized tensor too many in training when the input needs no gradient).  What the real
kernels allocate is measured per call (``estimator.corrections.cpu.host``).

``layer_norm_cpu`` (aten/src/ATen/native/layer_norm.cpp) normalizes ``input.contiguous()``: a
non-contiguous input (ConvNeXt's ``LayerNorm2d``: ``norm(x.permute(0, 2, 3, 1))``) is first
copied, an input-sized buffer the meta kernel does not show; those calls are measured too.  Its
backward reduces the weight's and bias's gradients through a per-thread buffer, computed from
the source and the threads this process runs with (``layer_norm_backward``).

``GroupNormKernelImpl`` / ``GroupNormBackwardKernelImpl`` (aten/src/ATen/native/cpu/
group_norm_kernel.cpp) allocate besides their outputs: the backward ``ds`` and ``db``
(``at::empty({N, C})`` in the accumulation type), the channels-last forward and backward per-thread
buffers (sized by the thread count); measured ``[.., 32, 32, -32, -32]`` for the backward at N = 1,
C = 8: a 32 B under-estimate at b = 1 where it was the step's peak.  Every call is measured.
"""

from __future__ import annotations

import math

import torch
from torch._prims_common import suggest_memory_format

from estimator.corrections.registry import MEASURE, NO_FIX, Fix, correction, fake_kernel, is_contiguous, measured
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

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


@fake_kernel(aten.native_batch_norm_backward.default, targets=Target.CPU)
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
                               eps, output_mask):
    """``batch_norm_backward_cpu_template`` (aten/src/ATen/native/cpu/batch_norm_kernel.cpp's
    caller, Normalization.cpp) allocates ``grad_input = at::empty_like(input,
    input.suggest_memory_format())``: the input's layout, where the meta kernel follows
    ``grad_out``'s.  A channels-last gradient (a ``LayerNorm2d``'s permute) reaching a
    BatchNorm2d of a contiguous map came out channels-last in the fake run only, and the pooling
    backward after it was priced (measured) for a copy the real run never made: +32.7 % at b = 17
    where that kernel was the peak (validators.random_models, convs seed 5, on AVX2)."""
    grad_input, grad_weight, grad_bias = aten.native_batch_norm_backward.default(
        grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask)
    if grad_input is not None:
        grad_input = torch.empty_like(input, memory_format=suggest_memory_format(input))
    return grad_input, grad_weight, grad_bias


@measured(aten.native_group_norm.default, aten.native_group_norm_backward.default, targets=Target.CPU)
def group_norm(args, kwargs, out) -> bool:
    """Every group norm call, forward and backward: the kernel's buffers depend on the layout,
    the dtype and the thread count."""
    return True


@measured(aten.native_layer_norm.default, targets=Target.CPU)
def layer_norm_of_a_strided_input(args, kwargs, out) -> bool:
    """A CPU layer norm whose input is not contiguous (contiguous: the fake kernel is exact)."""
    return not is_contiguous(args[0])


@correction(aten.native_layer_norm_backward.default, targets=Target.CPU)
def layer_norm_backward(args, kwargs, out) -> Fix:
    """A CPU layer norm backward: measured where ``grad_out`` or ``input`` is not contiguous;
    else, when it computes the weight's or the bias's gradient, the buffer they are reduced
    through: ``2 x threads x N`` elements of the input's dtype (N: the normalized size), alive
    during the op (``LayerNormBackwardKernelImplInternal`` in
    aten/src/ATen/native/cpu/layer_norm_kernel.cpp: ``buffer.resize_({2, num_threads, N})``),
    the threads this process runs with -- which the meta kernel does not show (LayerNorm over
    (C, H, W) of a ConvTranspose2d output, 2 threads, N = 2,048: 32 KiB, -10 % at b = 3)."""
    grad_out, x, normalized_shape = args[0], args[1], args[2]
    if not (is_contiguous(grad_out) and is_contiguous(x)):
        return MEASURE
    output_mask = args[7] if len(args) > 7 else kwargs["output_mask"]
    if not (output_mask[1] or output_mask[2]):
        return NO_FIX
    n = math.prod(as_expr(d) for d in normalized_shape)
    return Fix(scratch=(2 * torch.get_num_threads() * n * x.element_size(),))


def _group_norm_layout(cpu: bool):
    """``native_group_norm`` / ``native_group_norm_backward`` (aten/src/ATen/native/group_norm.cpp)
    as the real kernels lay their tensors out: ``memory_format = X.device().is_cpu() ?
    X.suggest_memory_format() : Contiguous; X_ = X.contiguous(memory_format)`` (``dY`` too), the
    output (``dX``) ``at::empty_like(X_)``.  The meta kernels give a size-1 batch's channels-last
    output a batch stride of C where ``empty_like`` keeps X's C·H·W, which the next convolution
    reads as contiguous (oneDNN's other path: 2,304 B under at b = 1).  The copies ``contiguous``
    makes are the kernels' scratch: measured on the CPU, priced on CUDA
    (``corrections/cuda/kernels.py``)."""

    def layout(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=suggest_memory_format(x) if cpu else torch.contiguous_format)

    def forward(input, weight, bias, N, C, HxW, group, eps):
        x = layout(input)
        _, mean, rstd = aten.native_group_norm.default(x, weight, bias, N, C, HxW, group, eps)
        return torch.empty_like(x), mean, rstd

    def backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
        x = layout(input)
        _, dgamma, dbeta = aten.native_group_norm_backward.default(layout(grad_out), x, mean, rstd, weight, N, C, HxW,
                                                                   group, output_mask)
        return torch.empty_like(x) if output_mask[0] else None, dgamma, dbeta

    return forward, backward


for _target, _cpu in ((Target.CPU, True), (Target.CUDA, False)):
    _forward, _backward = _group_norm_layout(_cpu)
    fake_kernel(aten.native_group_norm.default, targets=_target)(_forward)
    fake_kernel(aten.native_group_norm_backward.default, targets=_target)(_backward)


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
