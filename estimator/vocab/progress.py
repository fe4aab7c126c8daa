"""Progress of the work that takes more than a few seconds, reported through one seam.

The library never prints.  The stages whose work can take long report to ``task()``: a capture
(the ops it records), the CPU target's host-kernel measurements (the calls it runs),
``compare``/``plan`` (the steps they capture), and the accounting and the CUDA target's
allocator replay of a long run (the ops they walk: a ``generate()`` of hundreds of tokens).
``task()`` hands out a bar that does nothing unless a face installed a reporter for the current
context (``reporting``; the faces' one is ``estimator.progress()``: tqdm bars, on by itself for
the command line on a terminal).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Protocol


class Bar(Protocol):
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


# (what is being done, how many units in all or None, the unit's name) -> a bar
Reporter = Callable[[str, "int | None", str], Bar]


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


SILENT: Bar = _Silent()
_REPORTER: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar("fxmem_progress", default=None)


@contextlib.contextmanager
def task(description: str, total: int | None = None, unit: str = "it") -> Iterator[Bar]:
    """A bar for one piece of work (``SILENT`` where no reporter is installed), closed on exit."""
    reporter = _REPORTER.get()
    if reporter is None:
        yield SILENT
        return
    bar = reporter(description, total, unit)
    try:
        yield bar
    finally:
        bar.close()


@contextlib.contextmanager
def reporting(reporter: Reporter | None) -> Iterator[None]:
    """Within it, ``task()`` reports to ``reporter`` (None: silent)."""
    token = _REPORTER.set(reporter)
    try:
        yield
    finally:
        _REPORTER.reset(token)
