"""Loss-function corrections (CPU kernels).

Numbers measured with the profiler's allocator events inside each op (fp32, input (32, 64)),
checked by ``tests/test_corrections.py``.
"""

from __future__ import annotations

import torch

from estimator.categories import Target
from estimator.corrections.registry import NO_FIX, Fix, bind, correction, nbytes

aten = torch.ops.aten
_NONE = 0  # at::Reduction::None


def _full_buffer(func, args, kwargs, out, scratch: int) -> Fix:
    a = bind(func, args, kwargs)
    if a["reduction"] == _NONE:
        return NO_FIX
    n = nbytes(a["self"])
    return Fix(output_bytes={0: n - out.element_size()}, scratch=(scratch(n),))


@correction(aten.mse_loss.default, targets=Target.CPU)
def mse_loss(args, kwargs, out) -> Fix:
    """``TORCH_META_FUNC(mse_loss)`` builds a binary TensorIterator, so the structured output
    is allocated at the input's size; ``TORCH_IMPL_FUNC(mse_loss_out)``
    (aten/src/ATen/native/Loss.cpp) computes the unreduced loss into a second temporary of
    that size, then ``at::mean_out``/``sum_out`` resize the output to a scalar, which keeps
    its storage.  Measured (fp32, N input bytes): allocations ``[N, N, 8, 4, -4, -8, -N]``:
    the scalar holds N bytes, and N + 12 more are alive inside the op.
    """
    return _full_buffer(aten.mse_loss.default, args, kwargs, out, lambda n: n + 12)


@correction(aten.smooth_l1_loss.default, targets=Target.CPU)
def smooth_l1_loss(args, kwargs, out) -> Fix:
    """Same structure as ``mse_loss`` (``TORCH_IMPL_FUNC(smooth_l1_loss_out)``, Loss.cpp);
    measured allocations identical."""
    return _full_buffer(aten.smooth_l1_loss.default, args, kwargs, out, lambda n: n + 12)


@correction(aten.binary_cross_entropy.default, targets=Target.CPU)
def binary_cross_entropy(args, kwargs, out) -> Fix:
    """``binary_cross_entropy_out_cpu`` (aten/src/ATen/native/Loss.cpp) writes the unreduced
    loss into the output and reduces it in place.  Measured (fp32):
    ``[N, 4, 8, 4, -4, -8, -4]``: the scalar holds N bytes, 16 more inside the op."""
    return _full_buffer(aten.binary_cross_entropy.default, args, kwargs, out, lambda n: 16)


@correction(aten.soft_margin_loss.default, targets=Target.CPU)
def soft_margin_loss(args, kwargs, out) -> Fix:
    """``soft_margin_loss_out`` (Loss.cpp) as ``binary_cross_entropy``; measured identical."""
    return _full_buffer(aten.soft_margin_loss.default, args, kwargs, out, lambda n: 16)


@correction(aten.huber_loss.default, targets=Target.CPU)
def huber(args, kwargs, out) -> Fix:
    """``huber_loss`` (Loss.cpp) computes the unreduced loss into a temporary of the input's
    size and reduces it into a fresh scalar.  Measured (fp32): ``[N, 4, 8, 4, -4, -8, -N]``.
    """
    a = bind(aten.huber_loss.default, args, kwargs)
    if a["reduction"] == _NONE:
        return NO_FIX
    return Fix(scratch=(nbytes(a["self"]) + 12,))
