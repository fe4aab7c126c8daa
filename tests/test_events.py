"""``account.allocation_events`` replays to exactly the report's peak (it feeds allocator models)."""

import pytest
from session_cache import zoo_report  # the reports tests/test_symbolic.py checks too, captured once

from estimator.account import allocation_events


def exact_peak(events) -> int:
    """The peak of live bytes with no allocator rounding at all."""
    alive, live, peak = {}, 0, 0
    for kind, key, nbytes in events:
        if kind == "alloc":
            alive[key] = nbytes
            live += nbytes
        else:
            live -= alive.pop(key)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "rnn"])
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_events_replay_to_the_peak(name, mode):
    rep = zoo_report(name, mode, 8)  # debug size, sample of 8, AdamW, the model's loss
    # Same as the report at b = 8 and, from the same capture, at b = 12 (inside the range).
    assert exact_peak(allocation_events(rep.timeline, 8)) == rep.peak_bytes
    assert exact_peak(allocation_events(rep.timeline, 12)) == rep.at(12)


def test_events_through_the_cuda_allocator_model():
    # Rounding to 512 B blocks and unsplit tails only add bytes; segments hold the blocks.
    from estimator.devices.cuda_allocator import replay

    rep = zoo_report("gpt", "train", 8)
    stats = replay(allocation_events(rep.timeline, 8))
    assert rep.peak_bytes <= stats.peak_allocated <= stats.peak_reserved
    assert stats.peak_requested == rep.peak_bytes
