"""Exact numbers from the CUDA caching-allocator model (estimator/devices/cuda_allocator.py).

Every expected value is derived by hand from c10/cuda/CUDACachingAllocator.cpp; the arithmetic
is in the comment beside it.  KiB/MiB are powers of two.
"""

from __future__ import annotations

import pytest

from estimator.devices.cuda_allocator import (
    AllocatorStats,
    CachingAllocatorModel,
    OutOfMemory,
    SegmentKind,
    get_allocation_size,
    replay,
    round_size,
)
from estimator.vocab.allocator_options import AllocatorConfig, AllocatorConfigError, UnsupportedAllocatorConfig
from estimator.vocab.errors import InputError

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


def test_reset_peak_stats():
    a = CachingAllocatorModel()
    x = a.malloc(12 * MiB)
    a.malloc(14 * MiB)
    a.free(x)
    a.empty_cache()  # the free 12 MiB segment released: reserved 14, peaks 26
    a.reset_peak_stats()  # resetPeakStats: every peak becomes its current value
    s = a.stats
    assert (s.peak_allocated, s.peak_reserved, s.peak_requested) == (14 * MiB, 14 * MiB, 14 * MiB)
    a.free(a.malloc(MiB))  # 1 MiB in a new 2 MiB small segment: peaks 15 and 16 MiB
    assert (a.stats.peak_allocated, a.stats.peak_reserved) == (15 * MiB, 16 * MiB)


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
    cfg = AllocatorConfig.parse("expandable_segments:True")
    assert cfg.expandable_segments and cfg == AllocatorConfig(expandable_segments=True)
    cfg = AllocatorConfig.parse("per_process_memory_fraction:0.8, garbage_collection_threshold:0.6")
    assert (cfg.per_process_memory_fraction, cfg.garbage_collection_threshold) == (0.8, 0.6)
    assert AllocatorConfig.parse("per_process_memory_fraction:1").per_process_memory_fraction == 1.0


@pytest.mark.parametrize("conf, option", [
    ("backend:cudaMallocAsync", "backend"),
    ("release_lock_on_cudamalloc:True", "release_lock_on_cudamalloc"),
    ("expandable_segments:True,large_segment_size_mb:40", "large_segment_size_mb"),
    ("throw_on_cudamalloc_oom:True", "throw_on_cudamalloc_oom"),
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
    ("garbage_collection_threshold:1.0", "(0.0, 1.0)"),  # the source requires (0, 1)
    ("garbage_collection_threshold:0", "(0.0, 1.0)"),
    ("garbage_collection_threshold:abc", "number"),
    ("per_process_memory_fraction:1.5", "[0.0, 1.0]"),
    ("per_process_memory_fraction:-0.1", "[0.0, 1.0]"),
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


# --- expandable_segments:True ------------------------------------------------------------------
EXP = AllocatorConfig.parse("expandable_segments:True")
GiB = 2**30
# A 1 GiB device: each expandable segment reserves 9/8 GiB = 1152 MiB of address space, in pages
# of 20 MiB (kLargeBuffer, large pool): ceil(1152 / 20) = 58 pages = 1160 MiB; or of 2 MiB
# (kSmallBuffer, small pool): 576 pages = 1152 MiB.
LARGE_VA, SMALL_VA = 1160 * MiB, 1152 * MiB


def test_expandable_segment_grows_instead_of_new_segments():
    native, exp = CachingAllocatorModel(), CachingAllocatorModel(EXP, device_total=GiB)
    for a in (native, exp):
        for _ in range(3):
            a.malloc(12 * MiB)
    # native: 12 MiB >= kMinLargeAlloc -> a 12 MiB segment each: 3 segments, 36 MiB
    assert (native.stats.reserved, native.stats.segments) == (36 * MiB, 3)
    # expandable, one segment mapped a 20 MiB page at a time: #1 maps page 0 (reserved 20),
    # takes 12, 8 free; #2: no free block >= 12 -> the free 8 before the unmapped rest plus one
    # more page (reserved 40) = 28 free, takes 12, 16 free; #3 takes 12 of the 16, 4 free.
    # map_block counts no segment (segment.all.current stays 0).
    s = exp.stats
    assert (s.allocated, s.reserved, s.segments) == (36 * MiB, 40 * MiB, 0)
    assert exp.snapshot() == ((SegmentKind.LARGE_EXPANDABLE, (
        (12 * MiB, True), (12 * MiB, True), (12 * MiB, True), (4 * MiB, False),
        (LARGE_VA - 40 * MiB, None))),)  # the unmapped rest of the virtual range
    # without a device size the virtual range is just bigger: same figures
    assert replay([("alloc", i, 12 * MiB) for i in range(3)], EXP).reserved == 40 * MiB


def test_expandable_frees_keep_pages_and_empty_cache_unmaps_them():
    a = CachingAllocatorModel(EXP, device_total=GiB)
    x, y, z = (a.malloc(12 * MiB) for _ in range(3))  # [x 12][y 12][z 12][4 free]: 40 MiB mapped
    a.free(x)
    a.free(y)  # [24 free][z 12][4 free]: freeing never unmaps
    assert (a.stats.allocated, a.stats.reserved) == (12 * MiB, 40 * MiB)
    a.empty_cache()
    # the free [0, 24) MiB holds page 0 = [0, 20) wholly: unmapped; [20, 24) stays mapped, free.
    # The free [36, 40) holds no whole page (page 1 is [20, 40)). Reserved 40 - 20 = 20 MiB.
    assert (a.stats.allocated, a.stats.reserved, a.stats.peak_reserved) == (
        12 * MiB, 20 * MiB, 40 * MiB)
    assert a.snapshot() == ((SegmentKind.LARGE_EXPANDABLE, (
        (20 * MiB, None), (4 * MiB, False), (12 * MiB, True), (4 * MiB, False),
        (LARGE_VA - 40 * MiB, None))),)
    w = a.malloc(16 * MiB)
    # no free block >= 16 MiB (4, 4): find_expandable_block takes the lowest unmapped range, the
    # 20 MiB gap at 0, maps its page (reserved 40) which merges with the free [20, 24) into 24;
    # 16 taken, 8 free
    assert (a.stats.allocated, a.stats.reserved) == (28 * MiB, 40 * MiB)
    assert a.snapshot()[0][1][:4] == (
        (16 * MiB, True), (8 * MiB, False), (12 * MiB, True), (4 * MiB, False))
    a.free(w)
    a.free(z)  # all merged: one free 40 MiB block
    a.empty_cache()  # both pages unmapped; the segment, all unmapped, is released
    assert (a.stats.reserved, a.stats.peak_reserved, a.snapshot()) == (0, 40 * MiB, ())


def test_expandable_small_and_large_pools():
    a = CachingAllocatorModel(EXP, device_total=GiB)
    a.malloc(1000)  # small pool (round 1024): a small segment maps one 2 MiB page
    a.malloc(3 * MiB)  # large pool: another segment, one 20 MiB page
    assert (a.stats.allocated, a.stats.reserved) == (3 * MiB + 1024, 22 * MiB)
    assert a.snapshot() == (
        (SegmentKind.SMALL_EXPANDABLE, (
            (1024, True), (2 * MiB - 1024, False), (SMALL_VA - 2 * MiB, None))),
        (SegmentKind.LARGE_EXPANDABLE, (
            (3 * MiB, True), (17 * MiB, False), (LARGE_VA - 20 * MiB, None))),
    )
    a.malloc(MiB)  # from the 2 MiB - 1024 free: rest 1 MiB - 1024 >= 512 -> split
    a.malloc(MiB)  # the 1 MiB - 1024 free is too small: it and a second 2 MiB page (reserved
    # 24) make 3 MiB - 1024 free; 1 MiB taken, 2 MiB - 1024 free
    assert (a.stats.allocated, a.stats.reserved) == (5 * MiB + 1024, 24 * MiB)
    assert a.snapshot()[0] == (SegmentKind.SMALL_EXPANDABLE, (
        (1024, True), (MiB, True), (MiB, True), (2 * MiB - 1024, False),
        (SMALL_VA - 4 * MiB, None)))


def test_expandable_splits_any_remainder_of_512_bytes():
    native, exp = CachingAllocatorModel(), CachingAllocatorModel(EXP, device_total=GiB)
    for a in (native, exp):
        a.malloc(19 * MiB + 512 * KiB)
    # native: a 20 MiB segment, rest 0.5 MiB <= kSmallSize: not split -> allocated 20 MiB.
    # should_split with expandable segments: rest >= 512 B in any pool -> allocated 19.5 MiB
    assert native.stats.allocated == 20 * MiB
    assert (exp.stats.allocated, exp.stats.reserved) == (19 * MiB + 512 * KiB, 20 * MiB)


def test_expandable_segments_avoid_a_fragmentation_out_of_memory():
    def step(a):
        x = a.malloc(16 * MiB)
        a.free(x)
        a.malloc(12 * MiB)
        c = a.malloc(16 * MiB)
        a.free(c)
        a.malloc(12 * MiB)
        a.malloc(16 * MiB)

    # native: x -> a 16 MiB segment; 12 MiB taken from it (rest 4 > 1 MiB: split); c -> a second
    # 16 MiB segment (reserved 32); 12 MiB from it (another 4 MiB sliver); the last 16 MiB fits
    # neither sliver, a third segment needs 48 > 40 and the split segments cannot be freed
    with pytest.raises(OutOfMemory) as exc:
        step(CachingAllocatorModel(capacity=40 * MiB))
    assert (exc.value.allocated, exc.value.reserved, exc.value.free) == (
        24 * MiB, 32 * MiB, 8 * MiB)
    # expandable: x maps a 20 MiB page, freed: 20 free; 12 taken, 8 free; c maps a second page
    # after the free 8 -> 28, takes 16, 12 free; freed: 28 free; 12 taken, 16 free; the last
    # 16 MiB takes it exactly: 40 MiB allocated in 40 MiB mapped
    a = CachingAllocatorModel(EXP, capacity=40 * MiB)
    step(a)
    assert (a.stats.allocated, a.stats.reserved) == (40 * MiB, 40 * MiB)


def test_expandable_out_of_memory_retry_unmaps_free_pages():
    a = CachingAllocatorModel(EXP, capacity=24 * MiB)
    a.free(a.malloc(12 * MiB))  # large segment: one 20 MiB page, all free
    for _ in range(4):
        a.malloc(MiB)  # small segment: two 2 MiB pages, 4 x 1 MiB: reserved 24 = capacity
    a.malloc(MiB)
    # a third small page: 24 + 2 > 24 fails; release_cached_blocks unmaps the free large page
    # (reserved 4; that segment, all unmapped, is released); the retry maps it: reserved 6
    s = a.stats
    assert (s.allocated, s.reserved, s.peak_reserved) == (5 * MiB, 6 * MiB, 24 * MiB)
    # device total = capacity = 24 MiB: small range 27 MiB -> 14 pages = 28 MiB, 22 unmapped
    assert a.snapshot() == ((SegmentKind.SMALL_EXPANDABLE, (
        (MiB, True),) * 5 + ((MiB, False), (22 * MiB, None))),)
    with pytest.raises(OutOfMemory) as exc:
        a.malloc(20 * MiB)  # needs 6 + 20 > 24, nothing free to unmap (the 1 MiB free is small)
    assert (exc.value.alloc_size, exc.value.free) == (20 * MiB, 18 * MiB)


# --- per_process_memory_fraction and garbage_collection_threshold ------------------------------
GC = "per_process_memory_fraction:0.5,garbage_collection_threshold:0.5"


def test_memory_fraction_caps_reserved():
    a = CachingAllocatorModel(AllocatorConfig.parse("per_process_memory_fraction:0.5"),
                              capacity=100 * MiB)
    a.malloc(30 * MiB)
    with pytest.raises(OutOfMemory) as exc:
        a.malloc(30 * MiB)  # allowed = int(0.5 x 100 MiB) = 50 MiB < 30 + 30; nothing cached
    e = exc.value
    assert (e.capacity, e.allowed, e.free, e.reserved) == (50 * MiB, 50 * MiB, 20 * MiB, 30 * MiB)
    assert "allowed" in str(e)
    with pytest.raises(InputError, match="capacity"):  # the cap needs the device's size
        CachingAllocatorModel(AllocatorConfig.parse("per_process_memory_fraction:0.5"))


def _gc_sequence(a):
    for mb in (12, 14, 16, 18):
        a.free(a.malloc(mb * MiB))  # none fits the next: 4 cached segments, 60 MiB
    a.malloc(80 * MiB)
    a.malloc(64 * MiB)
    return a.stats


def test_garbage_collection_frees_the_oldest_cached_segments_first():
    a = CachingAllocatorModel(AllocatorConfig.parse(GC), capacity=400 * MiB)
    # allowed = 0.5 x 400 = 200 MiB; collection when over 0.5 x 200 = 100 MiB reserved.
    # Each malloc ticks the large pool's clock once: the 12, 14, 16, 18 MiB blocks are cached at
    # ticks 1, 2, 3, 4; the 80 MiB (tick 5): 60 <= 100, no collection, reserved 140; the 64 MiB
    # (tick 6): nothing cached fits, 140 > 100: reclaim 40.  Ages 5, 4, 3, 2, average 3.5: the
    # 12 and 14 go (26 < 40); again with the average of 3 and 2 = 2.5: the 16 goes (42 >= 40);
    # the 18 stays.  Reserved 140 - 42 + 64 = 162 MiB in the 18, 80 and 64 MiB segments.
    s = _gc_sequence(a)
    assert (s.reserved, s.peak_reserved, s.segments) == (162 * MiB, 162 * MiB, 3)
    assert [blocks for _, blocks in a.snapshot()] == [
        ((18 * MiB, False),), ((80 * MiB, True),), ((64 * MiB, True),)]
    # device_total alone sizes the fraction the same way (no capacity limit)
    assert _gc_sequence(CachingAllocatorModel(
        AllocatorConfig.parse(GC), device_total=400 * MiB)).reserved == 162 * MiB


def test_garbage_collection_goes_by_age_not_size():
    a = CachingAllocatorModel(AllocatorConfig.parse("max_split_size_mb:20," + GC),
                              capacity=400 * MiB)
    a.free(a.malloc(60 * MiB))  # tick 1, cached at 1
    for mb in (12, 14, 16):  # ticks 2, 3, 4: the oversize 60 MiB block (>= max_split_size)
        a.free(a.malloc(mb * MiB))  # serves no request below 20 MiB: new segments, 102 MiB
    a.malloc(18 * MiB)
    # tick 5: nothing fits; 102 > 100: reclaim 2.  Ages: 12 -> 3, 14 -> 2, 16 -> 1, 60 -> 4,
    # average 2.5: one pass frees the 12 and the 60, the two oldest, not the smaller 14 and 16
    # (it does not stop at the target).  Reserved 102 - 72 + 18 = 48 MiB in 3 segments.
    assert (a.stats.reserved, a.stats.segments) == (48 * MiB, 3)


def test_garbage_collection_frees_blocks_exactly_as_old_as_the_average():
    a = CachingAllocatorModel(AllocatorConfig.parse(
        "per_process_memory_fraction:0.5,garbage_collection_threshold:0.4"), capacity=120 * MiB)
    # allowed = 0.5 x 120 = 60 MiB; collection over int(0.4 x 60 MiB) = 24 MiB reserved
    x, y = a.malloc(12 * MiB), a.malloc(14 * MiB)  # ticks 1, 2
    a.free(x)
    a.free(y)  # both cached at tick 2
    a.malloc(16 * MiB)
    # tick 3: nothing fits; 26 > 24: ages 1 and 1, average 1: both are >= it and go;
    # reserved 0 + 16 (a strict > would keep both: 26 + 16 = 42)
    assert (a.stats.reserved, a.stats.segments) == (16 * MiB, 1)


def test_garbage_collection_threshold_alone_does_nothing():
    # no fraction below 1: allowed_memory_maximum is unset, so get_free_block keeps no clock and
    # malloc never collects: reserved 60 + 80 + 64 = 204 MiB in 6 segments
    s = _gc_sequence(CachingAllocatorModel(
        AllocatorConfig.parse("garbage_collection_threshold:0.5"), capacity=400 * MiB))
    assert (s.reserved, s.segments) == (204 * MiB, 6)
    s = _gc_sequence(CachingAllocatorModel(AllocatorConfig.parse(
        "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0")))  # no device size
    assert (s.reserved, s.segments) == (204 * MiB, 6)


# --- streams -------------------------------------------------------------------------------------
# A freed block serves only its allocation stream (BlockComparatorSize orders by stream first;
# get_free_block fails on another stream's block).
def test_a_freed_block_serves_only_its_own_stream():
    a = CachingAllocatorModel()
    x = a.malloc(30 * MiB, stream=1)
    a.free(x)
    a.malloc(30 * MiB)  # stream 0: stream 1's cached 30 MiB segment does not serve it -> a new one
    assert (a.stats.reserved, a.stats.segments) == (60 * MiB, 2)
    a.malloc(30 * MiB, stream=1)  # stream 1's own cached block: no new segment
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (60 * MiB, 60 * MiB, 2)


def test_small_segments_belong_to_one_stream():
    a = CachingAllocatorModel()
    a.malloc(1000)
    a.malloc(1000, stream=2)  # the 2 MiB small segment of stream 0 has room, but it is stream 0's
    assert (a.stats.allocated, a.stats.reserved, a.stats.segments) == (2048, 4 * MiB, 2)
    assert [seg[2:] for seg in a.snapshot()] == [(), (2,)]  # the side stream's segment says so


def test_out_of_memory_retry_frees_every_streams_cache():
    a = CachingAllocatorModel(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB, stream=1))
    # stream 0: nothing cached for it, 30 + 30 MiB > 40 MiB -> release_cached_blocks frees stream
    # 1's whole free segment (every stream's) and the retry fits: reserved 30 MiB, never 60
    a.malloc(30 * MiB)
    assert (a.stats.reserved, a.stats.peak_reserved, a.stats.segments) == (30 * MiB, 30 * MiB, 1)


def test_release_available_cached_blocks_stays_within_the_stream():
    conf = AllocatorConfig.parse("max_split_size_mb:20")
    a = CachingAllocatorModel(conf, capacity=120 * MiB)
    a.free(a.malloc(40 * MiB, stream=1))  # an oversize (>= 20 MiB) cached segment of stream 1
    a.free(a.malloc(60 * MiB))  # and one of stream 0
    # 30 MiB on stream 0: its 60 MiB block is 20 MiB (max_non_split_rounding_size) or more too big
    # to serve it; 100 + 30 > 120 -> release_available_cached_blocks frees the smallest oversize
    # block of stream 0 that is large enough, its 60 MiB (stream 1's 40 MiB is smaller, and not
    # its) -> 40 + 30 = 70 MiB in two segments
    a.malloc(30 * MiB)
    assert (a.stats.reserved, a.stats.segments) == (70 * MiB, 2)
    b = CachingAllocatorModel(conf, capacity=80 * MiB)
    b.free(b.malloc(40 * MiB, stream=1))
    b.free(b.malloc(30 * MiB))
    # 40 MiB on stream 0: 70 + 40 > 80; stream 0 has no oversize block of 40 MiB, so it frees its
    # oversize blocks from the largest down, 30 MiB < 40 MiB: false (as in the source, although one
    # was freed); release_cached_blocks then frees stream 1's too -> 40 MiB in one segment
    b.malloc(40 * MiB)
    assert (b.stats.reserved, b.stats.segments) == (40 * MiB, 1)


def test_expandable_segments_are_per_stream():
    a = CachingAllocatorModel(EXP, device_total=GiB)
    x = a.malloc(30 * MiB)
    a.malloc(30 * MiB, stream=1)
    # one expandable segment per stream, each mapping ceil(30 / 20) = 2 pages of 20 MiB
    assert a.stats.reserved == 80 * MiB
    a.free(x)
    # stream 1 again: stream 0's freed 30 MiB is not its; stream 1's segment has 10 MiB free at the
    # end of its mapped range, followed by unmapped space: one more page maps -> 100 MiB
    a.malloc(30 * MiB, stream=1)
    assert (a.stats.allocated, a.stats.reserved) == (60 * MiB, 100 * MiB)
    assert [(seg[0], seg[2:]) for seg in a.snapshot()] == [
        (SegmentKind.LARGE_EXPANDABLE, ()), (SegmentKind.LARGE_EXPANDABLE, (1,))]


def test_replay_events_may_name_their_stream():
    events = [("alloc", "a", 30 * MiB, 1), ("free", "a", 0), ("alloc", "b", 30 * MiB), ("alloc", "c", 30 * MiB, 1)]
    assert (replay(events).reserved, replay(e[:3] for e in events).reserved) == (60 * MiB, 60 * MiB)
    with pytest.raises(InputError, match="stream"):
        CachingAllocatorModel().malloc(MiB, stream=-1)


# --- snapshot ----------------------------------------------------------------------------------
def test_snapshot_is_the_layout_up_to_addresses():
    def build(a):
        x = a.malloc(12 * MiB)
        a.malloc(14 * MiB)
        a.malloc(1000)
        a.free(x)

    a = CachingAllocatorModel()
    build(a)
    # segments in address order: [12 free], [14 allocated], small [1024 allocated][rest free]
    assert a.snapshot() == (
        (SegmentKind.LARGE, ((12 * MiB, False),)),
        (SegmentKind.LARGE, ((14 * MiB, True),)),
        (SegmentKind.SMALL, ((1024, True), (2 * MiB - 1024, False))),
    )
    b = CachingAllocatorModel()
    b.free(b.malloc(20 * MiB))
    b.empty_cache()  # b's segments now lie 20 MiB higher, and b has made more requests
    build(b)
    assert b.snapshot() == a.snapshot() and len({a.snapshot(), b.snapshot()}) == 1  # hashable
    c = CachingAllocatorModel()
    build(c)
    c.malloc(12 * MiB)  # the cached 12 MiB segment allocated again
    assert c.snapshot() != a.snapshot()
    d = CachingAllocatorModel()
    d.malloc(14 * MiB)
    x = d.malloc(12 * MiB)
    d.malloc(1000)
    d.free(x)  # the same blocks, the 12 MiB segment after the 14 MiB one
    assert d.snapshot() != a.snapshot()
    e = CachingAllocatorModel(EXP)
    build(e)  # the same requests in expandable segments: another layout
    assert [kind for kind, _ in e.snapshot()] == [
        SegmentKind.LARGE_EXPANDABLE, SegmentKind.SMALL_EXPANDABLE]


def test_snapshot_of_an_output_held_across_steps_repeats_every_second_step():
    # out = model(x) in a loop: the new output is allocated while the previous one is alive
    a = CachingAllocatorModel()
    prev = None
    snapshots = []
    for _ in range(5):
        out = a.malloc(12 * MiB)
        tmp = a.malloc(3000)
        a.free(tmp)
        if prev is not None:
            a.free(prev)
        prev = out
        snapshots.append(a.snapshot())
    # step 0: out in segment A (12 MiB); step 1: A is busy -> segment B, then A freed;
    # step 2: out takes the free A, B freed; step 3: B again ... the two 12 MiB segments
    # alternate, so the layout repeats with period 2 and never equals the step before
    small = (SegmentKind.SMALL, ((2 * MiB, False),))
    a_busy = ((SegmentKind.LARGE, ((12 * MiB, True),)), small,
              (SegmentKind.LARGE, ((12 * MiB, False),)))
    b_busy = ((SegmentKind.LARGE, ((12 * MiB, False),)), small,
              (SegmentKind.LARGE, ((12 * MiB, True),)))
    assert snapshots[1:] == [b_busy, a_busy, b_busy, a_busy]


@pytest.mark.parametrize("cfg", [AllocatorConfig(), EXP], ids=["native", "expandable"])
def test_a_copy_is_the_same_allocator_apart(cfg):
    """``copy()``: the same state (snapshot, stats, handles), then each its own: the same events on
    both give the same figures, events on one leave the other as it was.  Thousands of split
    blocks in one segment (a chain ``copy.deepcopy`` would recurse along)."""
    a = CachingAllocatorModel(cfg, device_total=GiB)
    big = a.malloc(400 * MiB)
    a.free(big)
    live = [a.malloc(4096 * (1 + i % 7)) for i in range(3000)]  # splits of the cached 400 MiB block
    for h in live[::2]:
        a.free(h)
    b = a.copy()
    assert (b.snapshot(), b.stats) == (a.snapshot(), a.stats)
    for x in (a, b):
        x.free(live[1])
        x.malloc(3 * MiB, stream=1)
    assert (b.snapshot(), b.stats) == (a.snapshot(), a.stats)
    before = (a.snapshot(), a.stats)
    b.empty_cache()
    b.malloc(100 * MiB)
    assert (a.snapshot(), a.stats) == before != (b.snapshot(), b.stats)
