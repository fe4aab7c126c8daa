"""``collector_paused()``: large bookkeeping built with Python's cyclic garbage collector paused.

The stages after a capture build records by the hundred thousand (the events of an extended
``generate()``, the bytes alive op by op).  Every object they make stays referenced and none
is cyclic garbage, yet CPython starts a collection after each 700 new objects and a full one
as they accumulate, each walking the millions of objects torch made: about two thirds of the
time of ``account`` and of ``capture.decode_steps.extend`` at 256 new tokens (1.0 s → 0.33 s
and 0.47 s → 0.16 s, measured).  Never around a capture: there frees that wait for the
collector (cyclic garbage holding tensors) are part of what is recorded.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Within it the cyclic collector does not run (it is restored as found, also on error)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
