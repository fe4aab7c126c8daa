"""Exact numbers from the CUDA caching-allocator model (estimator/target/cuda_allocator.py).

Every expected value is derived by hand from c10/cuda/CUDACachingAllocator.cpp; the arithmetic
is in the comment beside it.  KiB/MiB are powers of two.
"""

from __future__ import annotations

import pytest

from estimator.errors import InputError
from estimator.target.cuda_allocator import (
    AllocatorConfig,
    AllocatorConfigError,
    AllocatorStats,
    CachingAllocatorModel,
    OutOfMemory,
    UnsupportedAllocatorConfig,
    get_allocation_size,
    replay,
    round_size,
)

KiB, MiB = 2**10, 2**20


# --- rounding and segment sizes ------------------------------------------------------------
@pytest.mark.parametrize("nbytes, rounded", [
    (1, 512),  # below kMinBlockSize -> 512
    (512, 512),
    (513, 1024),  # ceil(513/512)*512
    (1000, 1024),
    (MiB, MiB),  # already a multiple of 512
    (MiB + 1, MiB + 512),
    (10 * MiB - 1, 10 * MiB),
])
def test_round_size_default(nbytes, rounded):
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize("size, segment", [
    (512, 2 * MiB),  # <= kSmallSize -> kSmallBuffer
    (MiB, 2 * MiB),  # exactly 1 MiB is still small
    (MiB + 512, 20 * MiB),  # (1, 10) MiB -> kLargeBuffer
    (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB),  # >= kMinLargeAlloc -> multiple of kRoundLarge
    (11 * MiB + 512, 12 * MiB),  # ceil(11.0005/2)*2 = 12
    (12 * MiB, 12 * MiB),
])
def test_get_allocation_size(size, segment):
    assert get_allocation_size(size) == segment


def test_one_mib_request_uses_the_small_pool():
    a = CachingAllocatorModel()
    a.malloc(MiB)
    # 1 MiB <= kSmallSize -> a 2 MiB small segment; 1 MiB left, >= 512 -> split
    assert a.stats == AllocatorStats(allocated=MiB, reserved=2 * MiB, peak_allocated=MiB,
                                     peak_reserved=2 * MiB, segments=1, requested=MiB,
                                     peak_requested=MiB)
    a.malloc(MiB)  # fits the 1 MiB remainder exactly: no new segment
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (2 * MiB, 2 * MiB, 1)


def test_small_requests_share_one_segment():
    a = CachingAllocatorModel()
    a.malloc(1000)
    a.malloc(1000)
    s = a.stats
    # 2 x round(1000)=1024 from one 2 MiB segment; requested counts the asked-for bytes
    assert (s.allocated, s.reserved, s.segments) == (2048, 2 * MiB, 1)
    assert (s.requested, s.peak_requested) == (2000, 2000)


@pytest.mark.parametrize("nbytes, allocated, reserved", [
    (MiB + 1, MiB + 512, 20 * MiB),  # 20 MiB segment, rest 19 MiB - 512 > 1 MiB -> split
    (10 * MiB - 512, 10 * MiB - 512, 20 * MiB),  # rest 10 MiB + 512 > 1 MiB -> split
    (12 * MiB, 12 * MiB, 12 * MiB),  # segment exactly 12 MiB
    (11 * MiB + 1, 12 * MiB, 12 * MiB),  # round 11 MiB+512, segment 12 MiB, rest 1 MiB-512
                                         # <= kSmallSize -> not split: whole 12 MiB allocated
    (19 * MiB + 512 * KiB, 20 * MiB, 20 * MiB),  # 19.5 MiB -> 20 MiB segment, rest 0.5 MiB
                                                 # not split: allocated counts the whole 20 MiB
])
def test_large_requests(nbytes, allocated, reserved):
    a = CachingAllocatorModel()
    a.malloc(nbytes)
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (allocated, reserved, 1)


def test_unsplit_tail_of_a_cached_large_block():
    a = CachingAllocatorModel()
    a.malloc(5 * MiB)  # 20 MiB segment: [5 MiB used][15 MiB free]
    a.malloc(14 * MiB + 512 * KiB)  # best fit: the 15 MiB block, rest 0.5 MiB -> not split
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (20 * MiB, 20 * MiB, 1)


# --- reuse, best fit, merging -----------------------------------------------------------------
def test_best_fit_picks_the_smaller_free_block():
    a = CachingAllocatorModel()
    a.free(a.malloc(12 * MiB))  # cached 12 MiB segment
    a.free(a.malloc(14 * MiB))  # cached 14 MiB segment
    a.malloc(11 * MiB)  # fits both; smallest is 12 MiB; rest 1 MiB is not > 1 MiB -> no split
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (12 * MiB, 26 * MiB, 2)
    a.malloc(13 * MiB)  # the 14 MiB block, rest 1 MiB -> no split
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (26 * MiB, 26 * MiB, 2)


def test_merged_neighbours_serve_a_bigger_request():
    a = CachingAllocatorModel()
    x, y = a.malloc(6 * MiB), a.malloc(6 * MiB)
    a.malloc(6 * MiB)  # one 20 MiB segment: [x 6][y 6][z 6][free 2]
    a.free(x)
    a.free(y)  # merges with x: a free 12 MiB block at the segment start
    a.malloc(9 * MiB)  # fits only the merged block; rest 3 MiB > 1 MiB -> split
    # allocated: z 6 + 9 = 15 MiB; still one 20 MiB segment
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (15 * MiB, 20 * MiB, 1)


def test_without_merge_a_new_segment_is_needed():
    a = CachingAllocatorModel()
    x = a.malloc(6 * MiB)
    a.malloc(6 * MiB)
    a.malloc(6 * MiB)  # [x 6][y 6][z 6][free 2]
    a.free(x)  # free blocks: 6 MiB and 2 MiB, neither fits 9 MiB
    a.malloc(9 * MiB)  # new 20 MiB segment: reserved 40 MiB, allocated 6+6+9 = 21 MiB
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (21 * MiB, 40 * MiB, 2)


def test_full_merge_then_empty_cache_releases_the_segment():
    a = CachingAllocatorModel()
    hs = [a.malloc(6 * MiB) for _ in range(3)]
    for h in reversed(hs):
        a.free(h)  # everything merges back into the whole 20 MiB segment
    assert (a.stats.allocated, a.stats.reserved) == (0, 20 * MiB)
    a.empty_cache()
    assert (a.stats.reserved, a.stats.segments, a.stats.peak_reserved) == (0, 0, 20 * MiB)


def test_peak_allocated_survives_frees():
    a = CachingAllocatorModel()
    x = a.malloc(12 * MiB)
    a.malloc(12 * MiB)
    a.free(x)
    s = a.stats
    # 12 MiB live, peak 24 MiB; both segments stay cached: reserved 24 MiB
    assert (s.allocated, s.peak_allocated, s.reserved, s.peak_reserved) == (
        12 * MiB, 24 * MiB, 24 * MiB, 24 * MiB)


# --- capacity: release and retry, out of memory ---------------------------------------------
def test_capacity_releases_cached_segments_and_retries():
    a = CachingAllocatorModel(capacity=24 * MiB)
    a.free(a.malloc(12 * MiB))  # cached 12 MiB segment
    a.malloc(14 * MiB)  # 12 + 14 = 26 > 24: release_cached_blocks frees 12, then 14 fits
    s = a.stats
    assert (s.allocated, s.reserved, s.peak_reserved, s.segments) == (
        14 * MiB, 14 * MiB, 14 * MiB, 1)


def test_out_of_memory_names_requested_and_free_bytes():
    a = CachingAllocatorModel(capacity=24 * MiB)
    a.malloc(12 * MiB)
    with pytest.raises(OutOfMemory) as exc:
        a.malloc(14 * MiB)  # 12 + 14 > 24 and nothing cached to release
    e = exc.value
    assert (e.requested, e.alloc_size, e.free, e.capacity) == (
        14 * MiB, 14 * MiB, 12 * MiB, 24 * MiB)
    assert str(14 * MiB) in str(e) and str(12 * MiB) in str(e)  # 14680064, 12582912


def test_split_cached_blocks_are_not_released():
    a = CachingAllocatorModel(capacity=20 * MiB)
    a.malloc(2 * MiB)  # 20 MiB segment, 18 MiB free tail cannot be cudaFree'd
    with pytest.raises(OutOfMemory) as exc:
        a.malloc(20 * MiB)  # 18 MiB block too small; new 20 MiB segment exceeds capacity
    assert (exc.value.free, exc.value.reserved, exc.value.allocated) == (0, 20 * MiB, 2 * MiB)


# --- max_split_size_mb / max_non_split_rounding_mb ------------------------------------------
@pytest.mark.parametrize("conf, allocated", [
    ("", 22 * MiB),  # default: 30 MiB block, rest 8 MiB > 1 MiB -> split
    ("max_split_size_mb:20", 30 * MiB),  # 22 MiB >= max_split -> never split: all 30 MiB
])
def test_oversize_requests_are_not_split(conf, allocated):
    a = CachingAllocatorModel(AllocatorConfig.parse(conf))
    a.free(a.malloc(30 * MiB))
    a.malloc(22 * MiB)  # 30 < 22 + 20 (max_non_split_rounding) -> the cached block is reused
    assert (a.stats.allocated, a.stats.reserved) == (allocated, 30 * MiB)


@pytest.mark.parametrize("conf, reserved", [
    ("", 30 * MiB),  # default: 12 MiB is cut from the cached 30 MiB block
    ("max_split_size_mb:20", 42 * MiB),  # oversize block refused for a 12 MiB request: new 12
])
def test_oversize_blocks_do_not_serve_small_requests(conf, reserved):
    a = CachingAllocatorModel(AllocatorConfig.parse(conf))
    a.free(a.malloc(30 * MiB))
    a.malloc(12 * MiB)
    assert (a.stats.allocated, a.stats.reserved) == (12 * MiB, reserved)


@pytest.mark.parametrize("conf, allocated, reserved", [
    # 50 >= 30 + 20: too much slack, new 30 MiB segment
    ("max_split_size_mb:20", 30 * MiB, 80 * MiB),
    # 50 < 30 + 40: the 50 MiB block is taken whole
    ("max_split_size_mb:20,max_non_split_rounding_mb:40", 50 * MiB, 50 * MiB),
])
def test_max_non_split_rounding(conf, allocated, reserved):
    a = CachingAllocatorModel(AllocatorConfig.parse(conf))
    a.free(a.malloc(50 * MiB))
    a.malloc(30 * MiB)
    assert (a.stats.allocated, a.stats.reserved) == (allocated, reserved)


def test_release_available_cached_blocks_frees_one_oversize_block():
    a = CachingAllocatorModel(AllocatorConfig.parse("max_split_size_mb:20"), capacity=100 * MiB)
    x, y = a.malloc(64 * MiB), a.malloc(24 * MiB)
    a.free(x)
    a.free(y)  # cached: 64 and 24 MiB oversize segments, reserved 88 MiB
    a.malloc(40 * MiB)
    # get_free_block: 64 >= 40 + 20 -> refused; 88 + 40 > 100 -> release_available_cached_blocks
    # frees the smallest block >= 40 (the 64), then 24 + 40 = 64 MiB fits; the 24 stays cached
    s = a.stats
    assert (s.allocated, s.reserved, s.peak_reserved, s.segments) == (
        40 * MiB, 64 * MiB, 88 * MiB, 2)


# --- roundup_power2_divisions ------------------------------------------------------------------
@pytest.mark.parametrize("conf, nbytes, rounded", [
    ("roundup_power2_divisions:4", 9 * MiB + 1, 10 * MiB),  # [8,16) MiB in steps of 2 MiB
    ("roundup_power2_divisions:4", MiB + 1, MiB + 256 * KiB),  # [1,2) MiB in steps of 256 KiB
    ("roundup_power2_divisions:4", 8 * MiB, 8 * MiB),  # powers of two are kept
    ("roundup_power2_divisions:4", 1200, 1536),  # 1200 <= 512*4: plain 512 rounding
    ("roundup_power2_divisions:4", 5000, 5120),  # [4096, 8192) in steps of 1024
    ("roundup_power2_divisions:2", 600 * KiB, 768 * KiB),  # [512, 1024) KiB in steps of 256
    ("roundup_power2_divisions:1", 9 * MiB + 1, 9 * MiB + 512),  # 1 division: plain rounding
    # list form: index 0 ([<=1,2) MiB) -> 2; indices 1..7 -> 0; ">" fills 8.. with 8
    ("roundup_power2_divisions:[1:2,256:4,>:8]", 600 * KiB, 768 * KiB),
    ("roundup_power2_divisions:[1:2,256:4,>:8]", 3 * MiB + 1, 3 * MiB + 512),
    ("roundup_power2_divisions:[1:2,256:4,>:8]", 300 * MiB + 1, 320 * MiB),  # steps of 32 MiB
])
def test_roundup_power2_divisions(conf, nbytes, rounded):
    assert round_size(nbytes, AllocatorConfig.parse(conf)) == rounded


def test_roundup_list_form_table():
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[1:2, 256:4, >:8]")
    # "256:4" sets index log2(256) = 8, then ">:8" fills from that index on (source order)
    assert cfg.roundup_power2_divisions == (2,) + (0,) * 7 + (8,) * 8
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[64:8,256:4]")
    # first entry also fills the lower intervals: 0..6 -> 8; others stay 0
    assert cfg.roundup_power2_divisions == (8,) * 7 + (0, 4) + (0,) * 7


@pytest.mark.parametrize("conf, allocated, reserved", [
    ("", 9 * MiB + 512, 20 * MiB),  # 9 MiB+512 < 10 MiB -> 20 MiB segment, split
    ("roundup_power2_divisions:4", 10 * MiB, 10 * MiB),  # 10 MiB -> own 10 MiB segment
])
def test_roundup_changes_the_segment(conf, allocated, reserved):
    a = CachingAllocatorModel(AllocatorConfig.parse(conf))
    a.malloc(9 * MiB + 1)
    assert (a.stats.allocated, a.stats.reserved) == (allocated, reserved)


# --- config parsing -----------------------------------------------------------------------------
def test_parse_values():
    assert AllocatorConfig.parse(None) == AllocatorConfig() == AllocatorConfig.parse("")
    cfg = AllocatorConfig.parse(" max_split_size_mb : 128 , roundup_power2_divisions:4")
    assert cfg.max_split_size == 128 * MiB
    assert cfg.roundup_power2_divisions == (4,) * 16
    assert AllocatorConfig.parse("expandable_segments:False,backend:native") == AllocatorConfig()


@pytest.mark.parametrize("conf, option", [
    ("expandable_segments:True", "expandable_segments"),
    ("max_split_size_mb:128,garbage_collection_threshold:0.6", "garbage_collection_threshold"),
    ("backend:cudaMallocAsync", "backend"),
    ("release_lock_on_cudamalloc:True", "release_lock_on_cudamalloc"),
    ("per_process_memory_fraction:0.5", "per_process_memory_fraction"),
])
def test_unsupported_options(conf, option):
    with pytest.raises(UnsupportedAllocatorConfig) as exc:
        AllocatorConfig.parse(conf)
    assert exc.value.option == option and option in str(exc.value)


@pytest.mark.parametrize("conf, fragment", [
    ("max_split_size_mb", "':'"),
    ("max_split_size_mb:", "expecting a value"),
    ("max_split_size_mb:abc", "integer"),
    ("max_split_size_mb:10", "too small"),
    ("max_split_size_mb:128;roundup_power2_divisions:4", "integer"),
    ("max_split_size_mb:128 roundup_power2_divisions:4", "integer"),  # spaces are dropped
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[256:3]", "power of 2"),
    ("roundup_power2_divisions:[100:4]", "power of 2"),
    ("roundup_power2_divisions:[256:4", "']'"),
    ("max_split_size:128", "Unrecognized"),
    ("backend:foo", "unknown allocator backend"),
    ("expandable_segments:yes", "True/False"),
])
def test_malformed_config(conf, fragment):
    with pytest.raises(AllocatorConfigError) as exc:
        AllocatorConfig.parse(conf)
    assert not isinstance(exc.value, UnsupportedAllocatorConfig)
    assert fragment in str(exc.value)


# --- replay ------------------------------------------------------------------------------------
def test_replay():
    events = [("alloc", "w", 12 * MiB), ("alloc", ("act", 0), 1000), ("alloc", "e", 0),
              ("free", ("act", 0), 0), ("alloc", 7, 1000), ("free", "w", 0), ("free", "e", 0)]
    s = replay(events)
    # w: 12 MiB segment; act 1024 B in a 2 MiB small segment, freed and reused by key 7;
    # the 0-byte allocation takes nothing
    assert s == AllocatorStats(allocated=1024, reserved=14 * MiB, peak_allocated=12 * MiB + 1024,
                               peak_reserved=14 * MiB, segments=2, requested=1000,
                               peak_requested=12 * MiB + 1000)


@pytest.mark.parametrize("events", [
    [("alloc", "a", 1), ("alloc", "a", 1)],
    [("free", "a", 0)],
    [("realloc", "a", 1)],
    [("alloc", "a", -1)],
    [("alloc", "a")],
])
def test_replay_rejects_bad_events(events):
    with pytest.raises(InputError):
        replay(events)
