"""Convolutions on the CPU: measured on the host, never modelled.

Which kernel runs is decided per call by ``ConvParams`` in aten/src/ATen/native/
Convolution.cpp (``use_mkldnn``, ``use_nnpack``, else THNN ``slow_conv2d`` / ``slow_conv3d``
/ ``slow_conv_transpose*`` with im2col buffers, depthwise ``_conv_depthwise2d``…), by dtype
(bf16/fp16 take other paths), by the batch size (``N >= 16`` decides oneDNN vs THNN for 1x1
convolutions on one thread) and by the thread count.  On the oneDNN path
(aten/src/ATen/native/mkldnn/Conv.cpp) ideep reorders inputs and weights into blocked layouts
and oneDNN books a scratchpad whose entries come from the implementation it picks for the
host's ISA (src/cpu/x64/jit_*conv*, brgemm convolutions on AVX-512/AMX): sizes fitted on an
AVX-512 host were −40 % … +76 % off on an AVX2 host.  So every CPU convolution, forward and
backward, any dimension, groups, dilation, stride or dtype, is run on the host
(``estimator.corrections.cpu.host``) and priced from the allocator's events.
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import fake_kernel, is_contiguous, measured
from estimator.vocab.categories import Target

aten = torch.ops.aten


@measured(aten.convolution, aten.convolution_backward, targets=Target.CPU)
def convolution(args, kwargs, out) -> bool:
    """Every convolution call: its kernel and scratch depend on the host."""
    return True


def _without_backend_guard(func):
    """The meta convolution (and its backward) asks which CPU backend would run
    (``_select_conv_backend`` through ``_conv_determine_backend_memory_format`` in
    torch/_meta_registrations.py), and the CPU choice reads ``input.size(0) >= 16``
    (``use_mkldnn``, ``use_nnpack``): a guard ``b < 16`` that cut every convolution model's
    formula at b = 15.  The choice only decides the outputs' memory format, which follows the
    input on every CPU backend when the tensors are contiguous (NCHW); so for those the guard
    is not recorded.  (What the kernel that really runs at each b allocates is measured:
    ``estimator.corrections.cpu.host``.)"""

    def kernel(*args, **kwargs):
        tensors = [a for a in args[:3] if isinstance(a, torch.Tensor)]
        shape_env = getattr(getattr(tensors[0], "fake_mode", None), "shape_env", None)
        if shape_env is None or not all(is_contiguous(t) for t in tensors):
            return func(*args, **kwargs)
        with shape_env.suppress_guards():
            return func(*args, **kwargs)

    kernel.__doc__ = _without_backend_guard.__doc__
    return kernel


for _op in (aten.convolution.default, aten.convolution_backward.default):
    fake_kernel(_op, targets=(Target.CPU, Target.CUDA))(_without_backend_guard(_op))
