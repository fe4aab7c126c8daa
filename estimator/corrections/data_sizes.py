"""The seam between corrections and the capture's data-dependent policy.

A fake tensor cannot know a mask's nonzeros, a nested tensor's tokens or a packed sequence's
lengths; ``estimator.capture.datadep`` decides them (the user's policy, the sample's shadows, the
probe's real run).  Corrections sit below the capture, so they reach that decision here: the
capture's ``DataDependent`` pushes itself on ``ACTIVE`` while a step runs, corrections ask
``active()`` / ``count``, and register with ``observes`` how the probe reads a size from a real
call.  Outside a capture ``active()`` is None and ``count`` gives the safe bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

ACTIVE: list[Any] = []  # the capture's DataDependent modes, innermost last
OBSERVERS: dict[Any, Callable] = {}  # op -> fn(args, kwargs, out) -> (n, upper), read by the probe
_IN_KERNEL: list[str] = []  # the corrections' kernels running now (``in_kernel``), innermost last


def active() -> Any | None:
    """The running capture's ``DataDependent`` (``estimator.capture.datadep``), or None."""
    return ACTIVE[-1] if ACTIVE else None


def count(op: str, upper, mask=None):
    """The size of a data-dependent call priced outside ``datadep`` (a native fast path over
    nested tensors): ``upper`` the safe bound; the capture's policy decides.  Outside a
    capture: ``upper``."""
    mode = active()
    return upper if mode is None else mode.size(op, upper, mask)


@contextlib.contextmanager
def in_kernel(name: str):
    """While a correction runs kernel ``name``'s code: the data-dependent sizes it asks (``count``, the
    masks of the torch ops it runs) size that kernel's own buffers, and no code of the model branches
    on them, so their bound holds whatever real run gave the capture its values (a narrow stand-in's,
    for ``generate()`` of a model on the meta device: ``capture.trace._stood_in``)."""
    _IN_KERNEL.append(name)
    try:
        yield
    finally:
        _IN_KERNEL.pop()


def inside_kernel() -> bool:
    return bool(_IN_KERNEL)


def observes(*ops):
    """Register ``fn(args, kwargs, out) -> (n, upper)``: how the probe reads a data-dependent
    size from a real call of ``op`` that ``count`` prices elsewhere."""

    def register(fn):
        for op in ops:
            if op in OBSERVERS:
                raise ValueError(f"a second observer for {op}")
            OBSERVERS[op] = fn
        return fn

    return register
