"""Work in a forked child (``estimator.vocab.forked``): its result comes back pickled; where the
child fails, the work runs here and raises as it would have."""

from __future__ import annotations

import os

import pytest

from estimator.vocab import forked


def test_the_work_runs_in_a_child():
    here = []

    def work():
        here.append(os.getpid())  # the child's copy of the list
        return os.getpid(), [1, 2, 3]

    wait = forked.started(work)
    pid, value = wait()
    assert value == [1, 2, 3]
    if forked.can_fork():
        assert pid != os.getpid() and here == []
    else:  # run here when asked for
        assert pid == os.getpid() and here == [pid]


def test_a_failure_in_the_child_is_raised_here():
    ran = []

    def work():
        ran.append(os.getpid())
        raise ValueError("no room")

    wait = forked.started(work)
    with pytest.raises(ValueError, match="no room"):
        wait()
    assert ran == [os.getpid()]  # run again here: the child's exception does not cross


def test_a_result_that_does_not_pickle_is_made_here():
    def work():
        return lambda: os.getpid()  # a closure: pickle refuses it

    assert forked.started(work)()() == os.getpid()


def test_a_cancelled_child_is_stopped_and_reaped():
    def work():
        import time

        time.sleep(60)  # never finishes on its own within the test
        return 1

    child = forked.started(work)
    pid = child.pid
    assert (pid is not None) == forked.can_fork()
    child.cancel()  # at once: killed and waited for (no zombie), the pipe closed
    child.cancel()  # twice: nothing left to do
    assert child.pid is None
    if pid is not None:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped already
