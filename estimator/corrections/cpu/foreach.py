"""Foreach ops with a Python number per tensor (CPU kernels).

On the CPU every ``_foreach_*`` op takes the slow path (``foreach_tensor_*_slow`` in
aten/src/ATen/native/ForeachOpsKernels.cpp: ``FOREACH_BINARY_OP_SCALAR`` /
``FOREACH_BINARY_OP_SCALARLIST`` call ``t.mul_(scalar)`` per tensor), and each such call wraps
its number into a 0-dim double tensor (8 B, ``wrapped_scalar_tensor``) that TensorIterator
copies to the tensor's dtype (itemsize B, none for double/int64), both freed before the next
tensor.  The fake run sees one ``_foreach_mul_.Scalar`` whose schema type is ``Scalar``, so the
registry's wrapped-number rule does not apply.  Measured (torch 2.13 CPU, 3 fp32 tensors):
``_foreach_mul_(ts, 0.5)``, ``_foreach_add_``, ``_foreach_sub_``, ``_foreach_div_`` with a
number or a list of numbers: allocations ``[8, 4, -4, -8]`` per tensor; bf16 ``[8, 2, -2, -8]``;
the out-of-place ``_foreach_mul(ts, 0.5)`` the same between its outputs.  ``addcmul``/``addcdiv``/
``lerp``/``clamp``/``maximum`` with numbers allocate nothing (their kernels take a Scalar).
A user forcing ``foreach=True`` on the CPU (optimizers default to the for-loop there) meets them;
gradient clipping's ``_foreach_mul_`` takes a tensor (no wrapped number).
"""

from __future__ import annotations

import torch

from estimator.corrections.registry import Fix, correction
from estimator.vocab.categories import Target

aten = torch.ops.aten
_WIDE = (torch.float64, torch.int64)

_OPS = [getattr(getattr(aten, f"_foreach_{name}{suffix}"), overload)
        for name in ("add", "sub", "mul", "div") for suffix in ("", "_") for overload in ("Scalar", "ScalarList")]


@correction(*_OPS, targets=Target.CPU)
def foreach_number(args, kwargs, out) -> Fix:
    """8 B for the wrapped number and its copy in the tensors' dtype, alive inside each per-tensor call."""
    tensors = args[0]
    if not tensors:
        return Fix()
    dtype = tensors[0].dtype
    return Fix(scratch=(8 + (0 if dtype in _WIDE else tensors[0].element_size()),))
