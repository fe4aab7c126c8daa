"""Work done in a process forked from this one, so that a second core takes half of it.

Fork copies this process as it is (copy-on-write): the child finds every object the work needs
without pickling it, and sends back only the pickled result.  Linux only (fork is unsafe on
macOS, absent on Windows); elsewhere, or on one core, the work runs here when its result is
asked for.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import warnings
from collections.abc import Callable
from typing import Generic, TypeVar

from estimator.vocab import progress

T = TypeVar("T")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def can_fork() -> bool:
    """Whether a forked child would run beside this process: Linux, and a second usable core."""
    return sys.platform.startswith("linux") and usable_cores() > 1


class Started(Generic[T]):
    """Work started by ``started``: called, its result (waited for); ``cancel()``, where the
    result will not be asked for (the caller raises first), stops and reaps the child."""

    def __init__(self, work: Callable[[], T], pid: int | None = None, read: int | None = None) -> None:
        self._work, self._pid, self._read = work, pid, read

    @property
    def pid(self) -> int | None:
        """The child's process id until it is waited for (None: no child, or reaped)."""
        return self._pid

    def __call__(self) -> T:
        """The work's result: the child's, else (no child, a failed one, asked again) run here."""
        if self._pid is None:
            return self._work()
        with os.fdopen(self._read, "rb") as data:
            sent = data.read()
        _, status = os.waitpid(self._pid, 0)
        self._pid = None  # (asked again: run here)
        if status == 0 and sent:
            return pickle.loads(sent)
        return self._work()

    def cancel(self) -> None:
        """Kill the child and wait for it (nothing where there is none, or it was waited for)."""
        if self._pid is not None:
            os.kill(self._pid, signal.SIGKILL)
            os.waitpid(self._pid, 0)
            os.close(self._read)
            self._pid = None


def started(work: Callable[[], T]) -> Started[T]:
    """Start ``work()`` in a forked child; calling what is returned waits for it and returns its
    result.  Where the child fails (an exception, a result that does not pickle, a killed child)
    or cannot run, ``work()`` runs in this process when the result is asked for: it raises here
    as it would have.  ``work`` must leave this process's state alone (the child's changes are
    lost) and only compute: no threads, no torch kernels (fork copies neither the OpenMP threads
    nor held locks).  In the child no progress bar shows (``progress.task`` is silent there)."""
    if not can_fork():
        return Started(work)
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of fork in a threaded process: the child takes no lock
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: the work, its pickled result, and out without running any exit handler
        code = 1
        try:
            os.close(read)
            gc.disable()  # a collection would walk (and copy) every object the parent had
            with progress.reporting(None):  # the parent's bars are the parent's
                data = pickle.dumps(work(), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write, "wb") as out:
                out.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    return Started(work, pid, read)
