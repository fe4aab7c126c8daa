"""``estimator.progress()``: the progress of long work as bars on the terminal.

A capture that cannot be shortened, the CPU target's host-kernel measurements on an empty
cache, ``compare``/``plan`` and the accounting and allocator replay of a long ``generate()``
can take from seconds to minutes; the stages report to
``vocab.progress`` and this face draws what they report with tqdm.  The Python API stays quiet
unless asked (``with estimator.progress(): ...``); the command line shows bars when its
standard error is a terminal.  A bar appears only once its work has run for ``DELAY`` seconds.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

from estimator.vocab import progress as seam

DELAY = 2.0  # seconds: quick work draws nothing


@contextlib.contextmanager
def progress(show: bool | None = True, file: TextIO | None = None) -> Iterator[None]:
    """Within it, long work shows tqdm bars on ``file`` (default: standard error, through a copy
    of its descriptor, which the host-kernel measurements silence while they run); ``show=None``:
    only where that is a terminal, ``False``: never."""
    target = file if file is not None else sys.stderr
    if show is None:
        show = bool(getattr(target, "isatty", lambda: False)())
    if not show:
        with seam.reporting(None):
            yield
        return
    from tqdm.auto import tqdm

    with contextlib.ExitStack() as stack:
        if file is None:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                target = stack.enter_context(open(os.dup(sys.stderr.fileno()), "w", buffering=1))  # noqa: SIM115

        def bar(description: str, total: int | None, unit: str) -> seam.Bar:
            return tqdm(total=total, desc=f"fxmem: {description}", unit=unit, file=target, leave=False,
                        mininterval=0.25, delay=DELAY)

        with seam.reporting(bar):
            yield
