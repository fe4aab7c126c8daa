"""Complex tensors whose real-valued result a kernel computes through a complex temporary.

``abs`` of a complex tensor (``torch.abs``, ``Tensor.abs``, ``absolute``): ``abs_out`` runs
``unary_op_impl_with_complex_to_float_out`` (aten/src/ATen/native/UnaryOps.cpp), which makes a
complex tensor of the input's size (``at::empty({0}, self.options())``, TensorIterator runs the
kernel complex to complex), then copies its real part into the real result.  The meta kernel
allocates the real result only: a complex-valued model was −4 … −9 % under in inference.  The
same code runs on every device.
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import NO_FIX, Fix, correction
from estimator.vocab.categories import Target
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten


@correction(aten.abs.default, targets=(Target.CPU, Target.CUDA))
def complex_abs(args, kwargs, out) -> Fix:
    """``abs`` of a complex tensor: the complex temporary, alive during the op."""
    x = args[0]
    if not x.is_complex():
        return NO_FIX
    return Fix(scratch=(as_expr(x.numel()) * x.element_size(),))
