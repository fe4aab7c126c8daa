"""Packed sequences, for every target: ``nn.utils.rnn.pack_padded_sequence``, a
``PackedSequence`` through ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``, ``pad_packed_sequence``.

Sources (torch 2.13): aten/src/ATen/native/PackedSequence.cpp (``_pack_padded_sequence``,
``_pack_padded_sequence_backward_symint``, ``_pad_packed_sequence``), aten/src/ATen/native/RNN.cpp
(the ``.data`` overloads of ``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``: ``PackedLayer`` and
``ReversedPackedLayer`` run one cell per time step on the ``batch_sizes[t]`` sequences still
active), tools/autograd/derivatives.yaml (``_pack_padded_sequence``: ``input:
_pack_padded_sequence_backward_symint(grad, input.sym_sizes(), result1, batch_first)``).

The packed layout follows the lengths' values: ``batch_sizes[t]`` sequences are active at step
``t`` and the data holds ``sum(lengths)`` rows.  All three C++ functions read ``batch_sizes``
through ``data_ptr``, which a fake tensor does not have.  So while capturing:

- ``_pack_padded_sequence`` runs here as the kernel is written (its step blocks made contiguous,
  then one ``cat``), on lengths the capture's data-dependent policy gives
  (``DataDependent.sequence_lengths``: ``"max"``, the default, every sequence as long as the
  padding; ``"sample"``, the sample's own lengths).  Its ``batch_sizes`` is a fake tensor whose
  real values are its shadow (``shadows.py``: ``int(batch_sizes[0])`` in ``nn.LSTM`` reads them),
  and its backward is ``_pack_padded_sequence_backward`` as written (a zeroed input-sized
  gradient, one copy per step);
- the ``.data`` overloads (CompositeImplicitAutograd) run as written, given the real
  ``batch_sizes`` in place of the fake: RNN.cpp's loop issues on the fake data the ops it
  issues on real data;
- ``_pad_packed_sequence`` (CompositeImplicitAutograd, which writes its ``lengths`` output
  through ``data_ptr``) runs here as written.

The ops follow the lengths, not a formula in ``b``: a capture with a symbolic batch stops
(``SymbolicCaptureFailed``) and concrete captures at the requested batch take over.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from estimator.corrections import data_sizes
from estimator.corrections.composite import run_rnn
from estimator.corrections.registry import substitute
from estimator.vocab.categories import Target
from estimator.vocab.errors import CaptureError, InputError, SymbolicCaptureFailed

aten = torch.ops.aten
_BOTH = (Target.CPU, Target.CUDA)
RNNS = (torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu)


def _mode() -> Any:
    mode = data_sizes.active()
    if mode is None:
        raise CaptureError("a packed sequence outside the capture's data-dependent mode")
    return mode


def _concrete(*sizes) -> list[int]:
    if not all(isinstance(s, int) for s in sizes):
        raise SymbolicCaptureFailed("packed sequences: each time step's batch is a value of the lengths, not a "
                                    "formula in b (captured at the requested batch size)")
    return list(sizes)


def _batch_sizes(t: torch.Tensor) -> torch.Tensor:
    """The real values of a ``batch_sizes`` tensor this module made (its shadow)."""
    real = _mode().shadows.get(t)
    if real is None:
        raise CaptureError("a PackedSequence whose batch_sizes were not made by pack_padded_sequence in the step "
                           "(its values are unknown to the capture)")
    return real


def _values(t: torch.Tensor) -> list[int]:
    return _as_list(_batch_sizes(t))


def _as_list(real: torch.Tensor | None) -> list[int] | None:
    with _disable_current_modes():
        return None if real is None else real.tolist()


def _known(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of ``values``, made in the step (the kernel's ``at::empty`` + its
    writes), with its values as its shadow."""
    fake = torch.empty(len(values), dtype=torch.int64)
    with _disable_current_modes():
        _mode().shadows.seed(fake, torch.tensor(values, dtype=torch.int64))
    return fake


class _Pack(torch.autograd.Function):
    """``_pack_padded_sequence`` and its backward, op for op as PackedSequence.cpp writes them."""

    @staticmethod
    def forward(ctx, x, lengths: list[int], batch_first: bool):
        ctx.batch_first, ctx.sizes = batch_first, list(x.shape)
        time_major = x.transpose(0, 1) if batch_first else x
        batch = time_major.shape[1]
        step_shape = (-1, *time_major.shape[2:])
        sizes, blocks, prev = [], [], 0
        for i in range(batch):  # from the shortest sequence: a block each time the length grows
            length = lengths[batch - 1 - i]
            if length > prev:
                sizes += [batch - i] * (length - prev)
                blocks.append((prev, length, batch - i))
                prev = length
        batch_sizes = _known(sizes)  # allocated before the blocks, as the kernel does
        steps = [aten.slice.Tensor(aten.slice.Tensor(time_major, 0, start, end), 1, 0, rows).contiguous().view(step_shape)
                 for start, end, rows in blocks]
        ctx.batch_sizes = sizes
        ctx.mark_non_differentiable(batch_sizes)
        ctx.save_for_backward(batch_sizes)  # result1, saved by the real node
        return torch.cat(steps), batch_sizes

    @staticmethod
    def backward(ctx, grad, _):
        sizes = list(ctx.sizes)
        if ctx.batch_first:
            sizes[0], sizes[1] = sizes[1], sizes[0]
        grad_input = torch.zeros(sizes, dtype=grad.dtype, device=grad.device)
        offset = 0
        for i, size in enumerate(ctx.batch_sizes):
            aten.slice.Tensor(grad_input.select(0, i), 0, 0, size).copy_(aten.slice.Tensor(grad, 0, offset, offset + size))
            offset += size
        return (grad_input.transpose(0, 1) if ctx.batch_first else grad_input), None, None


@substitute(torch._VF._pack_padded_sequence, targets=_BOTH)
def pack_padded_sequence(spec, func, args, kwargs):
    """``_pack_padded_sequence(input, lengths, batch_first)`` on the lengths the policy gives,
    checked as the kernel checks them."""
    x, lengths, batch_first = (*args, *kwargs.values())
    time, batch = _concrete(*((x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])))
    if lengths.dim() != 1 or lengths.dtype != torch.int64 or lengths.device.type != "cpu":
        raise InputError(f"pack_padded_sequence: 'lengths' must be a 1D CPU int64 tensor, got {lengths.dim()}D "
                         f"{lengths.device} {lengths.dtype}")
    if lengths.shape[0] != batch:
        raise InputError(f"pack_padded_sequence: {lengths.shape[0]} lengths for a batch of {batch}")
    mode = _mode()
    given = _as_list(mode.shadows.get(lengths))  # the sample's own lengths, where they follow it
    if given is not None and (min(given) <= 0 or max(given) > time or given != sorted(given, reverse=True)):
        raise InputError(f"pack_padded_sequence: the lengths {given} must be positive, at most the padded length "
                         f"{time}, and sorted longest first (enforce_sorted=False sorts them)")
    used = mode.sequence_lengths(given, batch, time)
    return _Pack.apply(x, used, bool(batch_first))


def rnn(func, args, kwargs):
    """A ``.data`` overload of ``lstm`` / ``gru`` / ``rnn_*`` (``(data, batch_sizes, hx, params,
    ...)``): run as written, on the real ``batch_sizes``."""
    args = list(args)
    args[1] = _batch_sizes(args[1])
    return func(*args, **kwargs)


def is_packed(args) -> bool:
    """Whether an RNN call is the ``.data`` overload: ``(data, batch_sizes, hx, params, has_biases,
    ...)``, where ``.input`` has ``(input, hx, params, has_biases, ...)``."""
    return len(args) > 3 and isinstance(args[3], (list, tuple))


@substitute(*RNNS, targets=Target.CPU)  # the CUDA target's cuDNN substitute calls ``rnn`` for these
def packed_rnn(spec, func, args, kwargs):
    """A packed RNN (``rnn``); a padded one with its input projection as real tensors run it
    (``composite.run_rnn``)."""
    return rnn(func, args, kwargs) if is_packed(args) else run_rnn(func, args, kwargs)


@substitute(torch._VF._pad_packed_sequence, targets=_BOTH)
def pad_packed_sequence(spec, func, args, kwargs):
    """``_pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length)`` as
    PackedSequence.cpp writes it: the padded output, then ``lengths``, then one copy per run of
    equal batch sizes."""
    data, batch_sizes, batch_first, padding_value, total_length = (*args, *kwargs.values())
    sizes = _values(batch_sizes)
    longest = len(sizes)
    if total_length > 0:
        if total_length < longest:
            raise InputError(f"pad_packed_sequence: total_length={total_length} is shorter than the longest "
                             f"sequence ({longest})")
        longest_padded = total_length
    else:
        longest_padded = longest
    rest = tuple(data.shape[1:])
    output = torch.full((longest_padded, sizes[0], *rest), padding_value, dtype=data.dtype, device=data.device)
    lengths = [sum(1 for s in sizes if s > row) for row in range(sizes[0])]
    lengths_t = _known(lengths)
    offset, prev_size, prev_i = 0, sizes[0], 0
    for i in range(longest + 1):
        size = sizes[i] if i != longest else 0
        if size != prev_size:
            n = prev_size * (i - prev_i)
            block = aten.slice.Tensor(data, 0, offset, offset + n).view(i - prev_i, prev_size, *rest)
            aten.slice.Tensor(aten.slice.Tensor(output, 0, prev_i, i), 1, 0, prev_size).copy_(block)
            offset += n
            prev_i = i
        prev_size = size
    return (output.transpose(0, 1) if batch_first else output), lengths_t
