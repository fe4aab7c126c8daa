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
Everything is collected, then frozen (``gc.freeze``: the permanent generation, never
examined): every generation's count starts at zero and the young collections follow from the
capture's own objects, each walking only them.  Full collections are held off (the third
generation's threshold raised, restored after), as in a job's process, where CPython runs one
only once the objects that survived grew by a quarter of the millions it holds.  The collection
first is needed: a cycle the warm-up step leaves keeps FSDP2's padded parameter shards of an
uneven rank alive, so the step's replacing them freed nothing (+189,756 B on the last rank of an
FSDP2 x4 job, against a real gloo job that matches the collected capture byte for byte).  It
walks every object the process does not keep frozen; after the capture they are unfrozen.

A process that keeps its long-lived objects frozen itself (``fxmem``'s command line after its
imports, the test suite between tests) says so with ``keep_frozen()``: captures then leave
everything frozen (no partial unfreeze exists; unfreezing would put the process's frozen
objects back in every later collection: with a capture's walk of them, 0.3 s a capture on
average and up to 0.8 s late in the test suite, which outran CI's time, measured), and their
collection walks only what the process made since it froze.
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


_keeps_frozen = False
_NEVER = 2**30  # a full collection's threshold no capture reaches


def keep_frozen() -> None:
    """This process keeps its objects frozen (``gc.freeze``): captures leave them frozen."""
    global _keeps_frozen
    _keeps_frozen = True


@contextlib.contextmanager
def collector_fresh() -> Iterator[None]:
    """Within it the cyclic collector sees only what was made within it (see the module)."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.set_threshold(young, middle, full)
        if not _keeps_frozen:
            gc.unfreeze()
