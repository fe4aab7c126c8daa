"""Errors raised by fxmem. Every message names the problem and what to do about it."""


class FxmemError(Exception):
    """Base class of every error fxmem raises on purpose."""


class InputError(FxmemError, ValueError):
    """The arguments given to fxmem are wrong (model, sample, batch, budget, optimizer…)."""


class CaptureError(FxmemError, RuntimeError):
    """The model could not be run on fake tensors; the message names the op or line."""


class SymbolicCaptureFailed(CaptureError):
    """The symbolic-batch capture failed; the concrete fallback may still succeed.
    ``data_dependent``: the policy the failed capture had to take on the way (a router's picks at
    their bound, ``capture/trace._routed``), for the captures that follow to start with; None
    where it ran with the one asked."""

    data_dependent = None


class SequenceNotSymbolic(SymbolicCaptureFailed):
    """The sequence length could not stay a symbol (the model fixes it, or memory is not
    polynomial in it); a capture with only the batch symbolic may still succeed."""
