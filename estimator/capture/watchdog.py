"""No capture waits for ever: a step that stops dispatching ops becomes a ``CaptureError``.

The capture runs the user's code on fake tensors, and code that runs fine on real tensors can
loop or wait on fake ones (a loop whose exit reads a value fake tensors cannot know, a lock a
library takes around a tensor the capture reads).  The capture's ``RealTensors`` mode and the
probe's mode call ``beat`` for every op; ``Watchdog`` watches the beats from a thread of its own
and, when none came for ``timeout()`` seconds, raises ``Stalled`` in the capturing thread
(``PyThreadState_SetAsyncExc``), which leaves as a ``CaptureError`` naming the last op.

That reaches a thread running Python (a loop) or waiting in C++ with the GIL released.  A C++
wait that holds the GIL stops every Python thread, this one included: only another process can
end it.  ``guard_process`` is that process for the ``fxmem`` command: the command runs in a
child that writes a heartbeat while its GIL is free; the parent ends a child silent for
``timeout()`` seconds and exits 3 naming the last op.  (The Python API cannot end the caller's
process; there the thread is all there is.)

``FXMEM_CAPTURE_TIMEOUT`` (seconds, default 300; 0 turns the watchdog off): the longest time a
capture may go without dispatching an op.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time

from estimator.vocab.errors import CaptureError, InputError

_DEFAULT_SECONDS = 300.0
_POLL = 0.5  # seconds between two looks at the beats
_count = 0  # ops dispatched by the capture so far (any capture in this process)
_last = "the start of the step"  # the last op dispatched, for the message
_heart: int | None = None  # the pipe to the parent of guard_process, in the child
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def timeout() -> float:
    """``FXMEM_CAPTURE_TIMEOUT`` in seconds (0: no watchdog)."""
    value = os.environ.get("FXMEM_CAPTURE_TIMEOUT", "").strip()
    if not value:
        return _DEFAULT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise InputError(f"FXMEM_CAPTURE_TIMEOUT={value!r}: expected a number of seconds (0 turns it off)") from None
    if seconds < 0:
        raise InputError(f"FXMEM_CAPTURE_TIMEOUT={value!r}: expected seconds >= 0 (0 turns it off)")
    return seconds


def beat(func) -> None:
    """An op was dispatched (called by ``RealTensors`` and the probe's mode for every op)."""
    global _count, _last
    _count += 1
    _last = func


class Stalled(BaseException):
    """Raised asynchronously in a capture that stopped dispatching ops.  A ``BaseException``, so
    that user code's ``except Exception`` does not swallow it; ``Watchdog`` turns it into a
    ``CaptureError``."""


def _stall_message(seconds: float, last: str) -> str:
    return (f"the capture dispatched no op for {seconds:g} s after {last}: the step loops or waits on fake "
            "tensors (a loop whose exit reads a tensor's value, a lock); if it is only slow, raise "
            "FXMEM_CAPTURE_TIMEOUT (seconds; 0 turns this watchdog off)")


class Watchdog:
    """``with Watchdog():`` around code that runs the user's step on fake tensors (re-entrant:
    an inner one is a no-op)."""

    _active = threading.local()

    def __init__(self, seconds: float | None = None):
        self.seconds = timeout() if seconds is None else seconds
        self._done = threading.Event()
        self._fired = False

    def __enter__(self) -> Watchdog:
        self._outer = not getattr(self._active, "on", False) and self.seconds > 0
        if self._outer:
            self._active.on = True
            self._target = threading.get_ident()
            threading.Thread(target=self._watch, name="fxmem-watchdog", daemon=True).start()
        return self

    def _watch(self) -> None:
        seen, since = _count, time.monotonic()
        while not self._done.wait(_POLL):
            if _count != seen:
                seen, since = _count, time.monotonic()
            elif time.monotonic() - since >= self.seconds:
                self._fired = True  # raised again at each poll: user code may catch it once
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), ctypes.py_object(Stalled))

    def __exit__(self, kind, exc, tb) -> bool:
        if not self._outer:
            return False
        self._done.set()
        self._active.on = False
        if self._fired and kind is not Stalled:  # fired as the block ended: clear a pending one
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), None)
        if kind is Stalled or (kind is not None and isinstance(exc, CaptureError) and self._fired):
            raise CaptureError(_stall_message(self.seconds, str(_last))) from None
        return False


def guard_process(exit_code: int = 3) -> None:
    """Run the rest of this program in a child process that the parent ends, exiting
    ``exit_code``, when its heartbeat stops for ``timeout()`` seconds (a wait in C++ that holds
    the GIL, out of ``Watchdog``'s reach).  Returns in the child; the parent exits with the
    child's status.  Nothing happens where there is no ``fork`` or the watchdog is off."""
    global _heart
    seconds = timeout()
    if seconds <= 0 or not hasattr(os, "fork"):
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _heart = write
        # A group of its own: a terminal's Ctrl-C reaches the parent alone, which passes it on
        # once; and the child dies with the parent (Linux's PR_SET_PDEATHSIG).
        os.setpgid(0, 0)
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        threading.Thread(target=_heartbeat, name="fxmem-heartbeat", daemon=True).start()
        return
    os.close(write)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda number, _frame: os.kill(pid, number))
    sys.exit(_supervise(pid, read, seconds, exit_code))


def _heartbeat() -> None:
    """In the child: the last op dispatched, twice a second, while this thread can run."""
    while True:
        try:
            os.write(_heart, f"{_last}\n".encode()[-200:])
        except OSError:  # the parent is gone
            return
        time.sleep(_POLL)


def _supervise(pid: int, read: int, seconds: float, exit_code: int) -> int:
    """In the parent: wait for the child; kill it when it is silent for ``seconds``."""
    last, heard = _last, time.monotonic()
    with contextlib.suppress(OSError), os.fdopen(read, "rb", buffering=0) as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], _POLL)
            if ready:
                chunk = pipe.read(4096)
                if not chunk:  # the child closed it: it is exiting
                    break
                lines = chunk.decode(errors="replace").strip().splitlines()
                last, heard = (lines[-1] if lines else last), time.monotonic()
            elif time.monotonic() - heard >= seconds:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                sys.stderr.write(f"fxmem: error: {_stall_message(seconds, last)}; it was stuck in native code that "
                                 "holds the interpreter (no Python thread could run) and was stopped\n")
                return exit_code
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it
