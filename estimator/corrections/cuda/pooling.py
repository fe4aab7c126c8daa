"""CUDA target entries: the pooling kernels' copies of inputs, gradients and indices laid out
otherwise than the kernel reads them, and their temporaries (``aten/src/ATen/native/cuda/``).

Sources read (no GPU was available: every number below is derived from the source, not measured;
``tests/test_cuda_kernels.py`` checks the arithmetic on tiny modules): ``DilatedMaxPool2d.cu``,
``AveragePool2d.cu``, ``AdaptiveAveragePooling.cu`` (the 2-D entries), and the newest stored
versions of ``DilatedMaxPool3d.cu``, ``AveragePool3d.cu`` (structured, ``std::optional``
divisor), ``AdaptiveMaxPooling2d.cu``, ``AdaptiveMaxPooling3d.cu`` and
``AdaptiveAveragePooling3d.cu`` (``istrideB``, ``empty_like`` grad input); the outputs' layouts
from the structured meta functions (``AveragePool3d.cpp``, ``AdaptiveMaxPooling2d.cpp``,
``AdaptiveMaxPooling3d.cpp``), which the fake run shares; ``suggest_memory_format`` from the
installed torch 2.13 headers (``ATen/core/TensorBase.h``, ``c10/core/TensorImpl.h``
``_refresh_contiguous``, ``c10/core/MemoryFormat.h``).

Every copy below is a ``.contiguous(...)`` of a tensor not already laid out so: 0 B for the usual
layouts, the tensor's bytes otherwise (a transposed map, a channels-last input on a kernel that has
no channels-last branch, the stride-0 gradient of a ``sum``).  ``zero_()`` of the grad input and
``resize_``/``resize_as_`` of an output to its own element count allocate nothing.

Checked, nothing to add (CUDA memory equals the fake run's):

- ``max_pool3d_with_indices`` on a channels-last-3d input: ``_input.contiguous(ChannelsLast3d)`` is
  the input itself; the outputs are made channels-last-3d, as the fake kernel makes them.
- ``max_pool3d_with_indices_backward``: ``gradInput = at::empty(input.sizes())`` then
  ``resize_as_(input, ChannelsLast3d)`` on the channels-last branch: a restride, no allocation; the
  input is never copied (only its sizes are read).
- ``avg_pool3d_backward``, ``adaptive_max_pool3d_backward``, ``_adaptive_avg_pool3d_backward``: the
  input is not read (sizes only), the grad input is the (contiguous) output.
- ``adaptive_max_pool3d_backward`` reads ``indices`` as they are (no ``contiguous()``).
- ``adaptive_max_pool3d`` / ``_adaptive_avg_pool3d`` on a 4-D (unbatched) input, and
  ``adaptive_max_pool2d`` on a 3-D one: read through the input's strides, no copy.
- ``adaptive_avg_pool3d`` with output size 1: ``input.mean({-1, -2, -3})`` (the composite, every
  device), not these kernels.

Not modelled: ``max_pool3d_with_indices`` on a 4-D (unbatched) input whose dims are laid out
channels-last (``input.unsqueeze(0)`` channels-last-3d contiguous, not contiguous; a permuted
(C, T, H, W)).  The real outputs are channels-last-3d, the fake ones contiguous, so later ops see
other strides; the backward's ``gradInput.resize_as_(input.unsqueeze(0), ChannelsLast3d)`` returns a
5-D gradient, which autograd reduces to the input's shape (``sum_to``: one more gradient-sized
tensor, outside the kernel).  The entries below price the kernel's own copies on that branch (none
for the indices, which the real forward made channels-last-3d); ``NOT_MODELLED`` says so in the
report of a step that runs ``max_pool3d``.
"""

from __future__ import annotations

import operator

import sympy
import torch

from estimator.corrections.cuda import Gap
from estimator.corrections.registry import NO_FIX, Fix, _row_major, correction, is_contiguous, nbytes
from estimator.vocab.categories import Target

aten = torch.ops.aten

NOT_MODELLED: list[Gap] = [
    Gap("max_pool3d of an unbatched (C, T, H, W) input laid out channels-last: the real outputs are "
        "channels-last-3d (the fake ones contiguous) and its backward returns a 5-D gradient that autograd "
        "reduces with one more input-sized tensor", ("max_pool3d_with_indices",)),
]

# Dimension orders in which a memory format is row-major (N, C, ... ) -> (N, ..., C).
_ORDER = {
    torch.channels_last: (0, 2, 3, 1),
    torch.channels_last_3d: (0, 2, 3, 4, 1),
}


def _laid_out(t: torch.Tensor, order) -> bool:
    """``t`` row-major in the dimension order ``order`` (no guard)."""
    return _row_major([t.shape[d] for d in order], [t.stride(d) for d in order])


def _copy_bytes(t: torch.Tensor, memory_format=torch.contiguous_format):
    """Bytes ``t.contiguous(memory_format)`` allocates: 0 when ``t`` is already laid out so."""
    if memory_format == torch.contiguous_format:
        laid_out = is_contiguous(t)
    else:
        laid_out = _laid_out(t, _ORDER[memory_format])
    return 0 if laid_out else nbytes(t)


def _suggested_channels_last(x: torch.Tensor) -> bool:
    """``input.suggest_memory_format() == ChannelsLast`` for a 4-D input, from its strides without
    a guard: row-major in (N, H, W, C) order and not in (N, C, H, W) order (a tensor both are, a
    size-1 channel or map, is taken as contiguous).  Narrower than ``is_channels_last_strides_2d_s4``
    (MemoryFormat.h), which also answers channels-last for a channels-last tensor that is not dense
    (sliced along W): the input's copy has the same bytes either way, but the backward then prices
    a copy of a channels-last gradient that the real channels-last branch reads as it is."""
    if x.dim() != 4 or is_contiguous(x):
        return False
    return _laid_out(x, _ORDER[torch.channels_last])


# -- suggest_memory_format of a 5-D tensor, without a guard -----------------------------------
def _value(size) -> tuple:
    """(expression, concrete value or None) of a size or stride: the value is a SymInt's hint
    (reading it adds no guard)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return size.node.expr, (int(hint) if hint is not None else None)
    return int(size), int(size)


_SYMPY = {"lt": sympy.Lt, "eq": sympy.Eq}
_PY = {"lt": operator.lt, "eq": operator.eq}


def _holds(relation: str, a: tuple, b: tuple) -> bool:
    """``a < b`` / ``a == b`` on (expression, value) pairs: on the expressions where sympy decides
    it (true at every size), else on the concrete values (the traced size); unknown either way
    counts as true, the direction in which the check below answers "contiguous" (torch's own
    ``are_strides_like_channels_last_or_false``: ``guard_or_true``)."""
    decided = _SYMPY[relation](sympy.sympify(a[0]), sympy.sympify(b[0]))
    if decided in (sympy.true, sympy.false):
        return bool(decided)
    if a[1] is None or b[1] is None:
        return True
    return _PY[relation](a[1], b[1])


def _suggested_channels_last_3d(x: torch.Tensor) -> bool:
    """``input.suggest_memory_format() == ChannelsLast3d`` (TensorBase.h).  For a 5-D tensor
    ``is_strides_like_channels_last()`` is false (``is_channels_last_strides_2d`` answers false
    for 5 dims), so the answer is ``is_channels_last_3d_`` = ``is_channels_last_strides_3d_s5``
    (MemoryFormat.h), ported line by line: strides non-decreasing in the order C, W, H, D, N, each
    at least the previous one times its size, the channel stride non-zero, and N's stride not
    equal to that bound when C's stride is (the "N1H1W1" ambiguity resolved as contiguous).
    ``min *= sizes[d]`` only where ``sizes[d] > 1`` equals multiplying always once size 0 has
    returned.  Comparisons as ``_holds`` decides them: no shape guard."""
    if x.dim() != 5:
        return False
    sizes = [_value(s) for s in x.shape]
    strides = [_value(s) for s in x.stride()]
    zero = (0, 0)
    if _holds("eq", strides[1], zero):
        return False
    low = zero
    for d in (1, 4, 3, 2, 0):
        if _holds("eq", sizes[d], zero):
            return False
        if _holds("lt", strides[d], low):
            return False
        if d == 0 and _holds("eq", low, strides[1]):
            return False
        value = None if strides[d][1] is None or sizes[d][1] is None else strides[d][1] * sizes[d][1]
        low = (strides[d][0] * sizes[d][0], value)
    return True


def _scratch(copy) -> Fix:
    return Fix(scratch=(copy,)) if copy else NO_FIX


# -- 2-D --------------------------------------------------------------------------------------
@correction(aten.max_pool2d_with_indices.default, aten.avg_pool2d.default, targets=Target.CUDA)
def pool2d_input_copy(args, kwargs, out) -> Fix:
    """``max_pool2d_with_indices_out_cuda`` (cuda/DilatedMaxPool2d.cu) and ``avg_pool2d_out_cuda``
    (cuda/AveragePool2d.cu): ``memory_format = input_.suggest_memory_format(); input =
    input_.contiguous(memory_format)``: a copy of an input laid out otherwise (a transposed map),
    alive during the op."""
    x = args[0]
    fmt = torch.channels_last if _suggested_channels_last(x) else torch.contiguous_format
    return _scratch(_copy_bytes(x, fmt))


@correction(aten.max_pool2d_with_indices_backward.default, aten.avg_pool2d_backward.default, targets=Target.CUDA)
def pool2d_backward_copies(args, kwargs, out) -> Fix:
    """The backward kernels of the same files: ``input = input_.contiguous(memory_format)`` and
    ``gradOutput = gradOutput_.contiguous(memory_format)`` (``memory_format`` the input's
    suggestion), both alive during the op: the gradient of a ``sum`` of the pool's output is an
    expanded (stride-0) tensor, a copy of the output's size."""
    grad, x = args[0], args[1]
    fmt = torch.channels_last if _suggested_channels_last(x) else torch.contiguous_format
    return _scratch(_copy_bytes(x, fmt) + _copy_bytes(grad, fmt))


@correction(aten._adaptive_avg_pool2d_backward.default, targets=Target.CUDA)
def adaptive_avg_pool2d_backward_copy(args, kwargs, out) -> Fix:
    """``adaptive_avg_pool2d_backward_out_cuda_template`` (cuda/AdaptiveAveragePooling.cu): on the
    ``Contiguous`` branch ``gradOutput = gradOutput_.contiguous()`` (the channels-last branch reads
    ``gradOutput_`` through its strides): a copy of a gradient laid out otherwise, e.g. a sum's."""
    grad, x = args[0], args[1]
    return _scratch(0 if _suggested_channels_last(x) else _copy_bytes(grad))


@correction(aten.adaptive_max_pool2d.default, targets=Target.CUDA)
def adaptive_max_pool2d_copies(args, kwargs, out) -> Fix:
    """``TORCH_IMPL_FUNC(adaptive_max_pool2d_out_cuda)`` (cuda/AdaptiveMaxPooling2d.cu):
    ``output_c = output.is_contiguous() ? output : at::empty(output.sizes(), ...)``, the same for
    ``indices_c`` (int64), then on a 4-D input ``input_ = input.contiguous()`` (a 3-D input is read
    through its strides); all alive until ``output.copy_(output_c)`` / ``indices.copy_(indices_c)``
    at the end.  The outputs are made in ``input.suggest_memory_format()``
    (``TORCH_META_FUNC(adaptive_max_pool2d)``, the fake kernel's too), so a channels-last input
    costs its own copy plus one output and one indices buffer; an output of 1 x 1 maps is both
    layouts at once (no buffers)."""
    x = args[0]
    output, indices = out
    copy = _copy_bytes(x) if x.dim() == 4 else 0
    copy += _copy_bytes(output) + _copy_bytes(indices)
    return _scratch(copy)


@correction(aten.adaptive_max_pool2d_backward.default, targets=Target.CUDA)
def adaptive_max_pool2d_backward_copies(args, kwargs, out) -> Fix:
    """``TORCH_IMPL_FUNC(adaptive_max_pool2d_backward_out_cuda)``: ``gradOutput_ =
    gradOutput.contiguous()``, ``indices_ = indices.contiguous()``, ``gradInput_c =
    gradInput.is_contiguous() ? gradInput : at::empty(gradInput.sizes(), ...)`` (the grad input is
    made in the input's suggested format by the meta function), all alive until
    ``gradInput.copy_(gradInput_c)``.  Channels-last: the (channels-last) indices, the gradient
    unless it is contiguous, and a grad-input-sized buffer; contiguous: the gradient only, when laid
    out otherwise (a sum's)."""
    grad, indices = args[0], args[2]
    return _scratch(_copy_bytes(grad) + _copy_bytes(indices) + _copy_bytes(out))


# -- 3-D --------------------------------------------------------------------------------------
def _max_pool3d_channels_last(x: torch.Tensor) -> bool:
    """The ``channels_last`` of ``max_pool3d_with_indices_(backward_)out_cuda_template``
    (cuda/DilatedMaxPool3d.cu): 5-D, ``input.suggest_memory_format() == ChannelsLast3d``; 4-D,
    ``!input.unsqueeze(0).is_contiguous() && input.unsqueeze(0).is_contiguous(ChannelsLast3d)``
    (the leading size-1 dim changes neither test: ``x`` not contiguous and row-major in (T, H, W, C)
    order)."""
    if x.dim() == 5:
        return _suggested_channels_last_3d(x)
    return x.dim() == 4 and not is_contiguous(x) and _laid_out(x, (1, 2, 3, 0))


@correction(aten.max_pool3d_with_indices.default, targets=Target.CUDA)
def max_pool3d_input_copy(args, kwargs, out) -> Fix:
    """``max_pool3d_with_indices_out_cuda_template`` (cuda/DilatedMaxPool3d.cu): ``work_input =
    input.contiguous()`` on the contiguous branch, ``_input.contiguous(ChannelsLast3d)`` on the
    channels-last one (``_max_pool3d_channels_last``): a copy of an input laid out otherwise than
    its branch reads it (a transposed map), alive during the op.  On the 4-D channels-last branch
    ``_input`` is channels-last-3d contiguous by the branch's own test: no copy."""
    x = args[0]
    if not _max_pool3d_channels_last(x):
        return _scratch(_copy_bytes(x))
    return _scratch(_copy_bytes(x, torch.channels_last_3d) if x.dim() == 5 else 0)


@correction(aten.max_pool3d_with_indices_backward.default, targets=Target.CUDA)
def max_pool3d_backward_copies(args, kwargs, out) -> Fix:
    """``max_pool3d_with_indices_backward_out_cuda_template``: ``work_grad_output =
    gradOutput.contiguous()`` and ``work_indices = indices.contiguous()`` on the contiguous branch,
    ``.contiguous(ChannelsLast3d)`` of both (of their ``unsqueeze(0)`` for a 4-D input) on the
    channels-last one; alive during the op.  The input is not copied (sizes only).  4-D
    channels-last: the real forward made the indices channels-last-3d (the fake ones are
    contiguous): no indices copy; the gradient by its fake layout (module docstring)."""
    grad, x, indices = args[0], args[1], args[7]
    if not _max_pool3d_channels_last(x):
        return _scratch(_copy_bytes(grad) + _copy_bytes(indices))
    if x.dim() == 5:
        return _scratch(_copy_bytes(grad, torch.channels_last_3d) + _copy_bytes(indices, torch.channels_last_3d))
    return _scratch(0 if _laid_out(grad, (1, 2, 3, 0)) else nbytes(grad))


@correction(aten.avg_pool3d.default, targets=Target.CUDA)
def avg_pool3d_input_copy(args, kwargs, out) -> Fix:
    """``TORCH_IMPL_FUNC(avg_pool3d_out_cuda)`` (cuda/AveragePool3d.cu): ``work_input =
    input.contiguous()``, whatever the layout (no channels-last branch; the output is contiguous,
    ``TORCH_META_FUNC(avg_pool3d)``): a channels-last-3d or transposed input is copied."""
    return _scratch(_copy_bytes(args[0]))


@correction(aten.avg_pool3d_backward.default, aten.adaptive_max_pool3d_backward.default,
            aten._adaptive_avg_pool3d_backward.default, targets=Target.CUDA)
def pool3d_backward_grad_copy(args, kwargs, out) -> Fix:
    """``gradOutput.contiguous()`` in ``TORCH_IMPL_FUNC(avg_pool3d_backward_out_cuda)``
    (cuda/AveragePool3d.cu), ``TORCH_IMPL_FUNC(adaptive_max_pool3d_backward_out_cuda)``
    (cuda/AdaptiveMaxPooling3d.cu) and ``adaptive_avg_pool3d_backward_out_cuda_template``
    (cuda/AdaptiveAveragePooling3d.cu): the only allocation besides the grad input, alive during
    the op; e.g. a sum's stride-0 gradient, a copy of the output's size."""
    return _scratch(_copy_bytes(args[0]))


@correction(aten.adaptive_max_pool3d.default, aten._adaptive_avg_pool3d.default, targets=Target.CUDA)
def adaptive_pool3d_input_copy(args, kwargs, out) -> Fix:
    """``TORCH_IMPL_FUNC(adaptive_max_pool3d_out_cuda)`` (cuda/AdaptiveMaxPooling3d.cu) and
    ``adaptive_avg_pool3d_out_cuda_template`` (cuda/AdaptiveAveragePooling3d.cu): ``input_ =
    input.ndimension() == 4 ? input : input.contiguous()``: a 5-D input laid out otherwise
    (channels-last-3d included: neither kernel has that branch) is copied, alive during the op; a
    4-D one is read through its strides."""
    x = args[0]
    return _scratch(_copy_bytes(x) if x.dim() == 5 else 0)
