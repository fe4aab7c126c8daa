"""Checks that need a CUDA device (skipped without one): the allocator model against the real
caching allocator, on sequences whose expected numbers are derived in tests/test_cuda_allocator.py."""

import pytest

from estimator.devices.cuda_allocator import replay

MiB = 2**20

SEQUENCES = {
    # small pool: two requests in one 2 MiB segment
    "small": [("alloc", 1, 1000), ("alloc", 2, 3000)],
    # 1 MiB + 1 B -> a 20 MiB segment (kLargeBuffer)
    "large": [("alloc", 1, MiB + 1)],
    # 19.5 MiB in a 20 MiB segment: remainder 0.5 MiB <= 1 MiB is not split
    "unsplit_tail": [("alloc", 1, 19 * MiB + MiB // 2), ("free", 1, 0), ("alloc", 2, 19 * MiB)],
    # free and merge, then a bigger request served from the merged block
    "merge": [
        ("alloc", 1, 3 * MiB), ("alloc", 2, 3 * MiB), ("alloc", 3, 3 * MiB),
        ("free", 1, 0), ("free", 2, 0), ("alloc", 4, 6 * MiB),
    ],
    # above 10 MiB: rounded to 2 MiB
    "huge": [("alloc", 1, 11 * MiB + 1), ("alloc", 2, 12 * MiB)],
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_allocator_model_matches_the_device(name):
    from validators.cuda import replay_on_device

    events = SEQUENCES[name]
    stats = replay(events)
    assert replay_on_device(events) == (stats.peak_allocated, stats.peak_reserved)
