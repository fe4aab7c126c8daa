"""Python's cyclic garbage collector around fxmem's work: paused for bookkeeping, started from a
clean slate for a capture.

``collector_paused()``: large bookkeeping built with the collector paused.

The stages after a capture build records by the hundred thousand (the events of an extended
``generate()``, the bytes alive op by op).  Every object they make stays referenced and none
is cyclic garbage, yet CPython starts a collection after each 700 new objects and a full one
as they accumulate, each walking the millions of objects torch made: about two thirds of the
time of ``account`` and of ``capture.decode_steps.extend`` at 256 new tokens (1.0 s → 0.33 s
and 0.47 s → 0.16 s, measured).  Never around a capture: there frees that wait for the
collector (cyclic garbage holding tensors) are part of what is recorded.

``collector_fresh()``: around a capture, where the collector runs as it does in a job, it starts
from a clean slate.  When CPython collects depends on the objects made since the last
collection and, for a full collection, on how many objects the process holds: frees that wait
for it (``generate()`` keeps its special-token tensors on a config object in a cycle) happened
at ops that followed what ran in the process before, and two reports of one step could differ.
Everything alive is collected, then frozen (``gc.freeze``: the permanent generation, not
counted), so the capture's collections follow from its own objects; it is unfrozen after.
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


@contextlib.contextmanager
def collector_fresh() -> Iterator[None]:
    """Within it the cyclic collector sees only what was made within it (see the module)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
