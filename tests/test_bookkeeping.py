"""The cyclic collector around a capture (estimator.vocab.bookkeeping.collector_fresh)."""

from __future__ import annotations

import gc
import weakref

from estimator.vocab import bookkeeping


class _Node:
    pass


def _cyclic_garbage() -> weakref.ref:
    node = _Node()
    node.self = node
    return weakref.ref(node)


def test_a_capture_starts_from_a_clean_slate_and_leaves_the_collector_as_found(monkeypatch):
    monkeypatch.setattr(bookkeeping, "_keeps_frozen", False)  # a user's process (tests/conftest.py keeps frozen)
    gc.unfreeze()
    earlier = _cyclic_garbage()
    thresholds = gc.get_threshold()
    with bookkeeping.collector_fresh():
        assert earlier() is None  # an earlier capture's garbage does not live on into this one
        assert gc.get_count()[1:] == (0, 0) and gc.get_count()[0] < 10 and gc.get_freeze_count() > 0  # counted afresh
        assert gc.get_threshold()[:2] == thresholds[:2] and gc.get_threshold()[2] >= 2**30  # no full collection
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds  # as found


def test_a_process_that_keeps_objects_frozen_keeps_them_frozen():
    assert bookkeeping._keeps_frozen  # tests/conftest.py
    later = _cyclic_garbage()  # made after the conftest's freeze
    alive = _Node()
    with bookkeeping.collector_fresh():
        assert later() is None and gc.get_count()[1:] == (0, 0)
    assert not any(o is alive for o in gc.get_objects())  # still frozen (get_objects lists generations 0-2)
