"""``account.allocation_events`` replays to exactly the report's peak (it feeds allocator models)."""

import pytest

import estimator
import models_zoo
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
    model, make_sample, loss_fn = models_zoo.get(name, "debug")
    rep = estimator.report(model, make_sample(8), batch=8, mode=mode, loss_fn=loss_fn)
    # Same as the report at b = 8 and, from the same capture, at b = 12 (inside the range).
    assert exact_peak(allocation_events(rep.timeline, 8)) == rep.peak_bytes
    assert exact_peak(allocation_events(rep.timeline, 12)) == rep.at(12)


def test_events_through_the_cuda_allocator_model():
    # Rounding to 512 B blocks and unsplit tails only add bytes; segments hold the blocks.
    from estimator.target.cuda_allocator import replay

    model, make_sample, loss_fn = models_zoo.get("gpt", "debug")
    rep = estimator.report(model, make_sample(8), batch=8, loss_fn=loss_fn)
    stats = replay(allocation_events(rep.timeline, 8))
    assert rep.peak_bytes <= stats.peak_allocated <= stats.peak_reserved
    assert stats.peak_requested == rep.peak_bytes
