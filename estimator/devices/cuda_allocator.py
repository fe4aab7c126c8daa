"""A replay model of PyTorch's CUDA caching allocator (the native backend).

Given allocation requests and frees as a program makes them, each on its CUDA stream, this predicts
what ``torch.cuda.memory_allocated`` / ``memory_reserved`` and their ``max_*`` peaks report.
It follows ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch
2.11-2.13) and the option parsing of ``c10/core/AllocatorConfig.cpp``
(``AcceleratorAllocatorConfig::parseArgs``) and ``c10/cuda/CUDAAllocatorConfig.cpp``
(``per_process_memory_fraction``), function by function:

* ``malloc``: ``round_size`` -> ``get_pool`` -> ``get_allocation_size`` -> ``get_free_block``;
  when nothing is cached: ``garbage_collect_cached_blocks`` (with a garbage-collection
  threshold and a memory fraction), then ``alloc_block`` || (``release_available_cached_blocks``
  && ``alloc_block``) || (``release_cached_blocks`` && ``alloc_block``), else out of memory;
  then ``should_split`` and ``alloc_found_block``.
* ``alloc_block``: the memory-fraction cap (``allowed_memory_maximum``), then either a new
  cudaMalloc'ed segment of ``get_allocation_size`` bytes or, with ``expandable_segments:True``,
  ``try_allocate_expandable_block`` -> ``find_expandable_block`` -> ``map_block``.
* ``free``: ``free`` -> ``free_block`` -> ``try_merge_blocks`` with both neighbours.  Freeing
  never returns memory to the device, expandable or not.
* ``emptyCache`` (and the last out-of-memory retry): ``release_cached_blocks`` ->
  ``release_blocks``: cudaFree whole free segments; for expandable segments ``unmap_block``
  unmaps every wholly free page and ``release_expandable_segment`` drops a segment left with
  nothing mapped.

Expandable segments (``ExpandableSegment``, Note [Expandable Segments]): per stream and pool one
virtual range of 9/8 of the device's total memory, backed on demand by physical pages of 2 MiB
(kSmallBuffer, small pool) or 20 MiB (kLargeBuffer = ``large_segment_size``, large pool).  A
request no cached block fits maps ``ceil(size / page)`` pages (less what a free block at the end
of the mapped range already holds) at the lowest address with room -- normally the end of the
segment -- instead of cudaMalloc'ing a segment of ``get_allocation_size`` bytes, so no request
gets a segment of its own.  ``round_size`` is unchanged; ``should_split`` splits any remainder
of at least 512 B, in the large pool too.  ``reserved`` counts mapped pages.

Garbage collection (``garbage_collection_threshold``): only when a memory fraction below 1 is
set (``allowed_memory_maximum`` exists only then), and only when no cached block fits a request.
If more than threshold x allowed bytes are reserved, it cudaFrees the whole cached large-pool
segments whose age (``gc_count``: ``get_free_block`` calls on the large pool since the block was
cached) is at least their average age, all of them in one pass in (size, address) order; if that
did not reclaim the excess, it repeats with the average of those left, so the oldest go first.
With ``per_process_memory_fraction`` 1 (the default) the threshold has no effect, as in PyTorch
(whatever the capacity).

Stats follow ``increase_stat``/``decrease_stat``: ``allocated_bytes`` counts block sizes (rounded,
unsplit tails included), ``reserved_bytes`` counts segment sizes and mapped pages,
``requested_bytes`` counts the bytes the program asked for, ``segment`` counts cudaMalloc'ed
segments (expandable segments are not counted, as in ``map_block``).  Everything is an integer
number of bytes.

The options (``AllocatorConfig``) are parsed in ``estimator.vocab.allocator_options``.

The device: ``capacity`` is the physical memory the allocator can obtain (cudaMalloc and
cuMemCreate fail beyond it); ``device_total`` is ``totalGlobalMem`` (defaults to ``capacity``),
which sizes the memory fraction (``allowed_memory_maximum = fraction x device_total``) and the
address space of an expandable segment.

Streams: each allocation names the stream it is made on (0: the default stream).  As in the
source, a freed block goes back to its allocation stream's free list and only serves requests on
that stream (``BlockComparatorSize`` orders a pool's free blocks by stream, size, address;
``get_free_block``, ``release_available_cached_blocks`` and ``find_expandable_block`` stay within
the stream, and an expandable segment belongs to one stream); ``release_cached_blocks`` and the
garbage collection take every stream's.  Which stream the program allocates on comes from the
program (FSDP2's all-gather copy-in and reduce-scatter streams, ``estimator.capture.tracker``).

Not modelled (and why): ``record_stream`` and the cross-stream events (``process_events``,
``insert_events``), which hold a freed block back until the GPU has passed an event -- a matter
of timing, which a sequence of requests does not have: a block is reusable once freed; CUDA-graph and
user memory pools (``MemPool``, ``use_mem_pool``, ``try_mempool_fallback``); options changed at
run time (``torch.cuda.memory._set_allocator_settings``, so never a mix of expandable and plain
segments) and ``torch.cuda.set_per_process_memory_fraction`` (set the config's
``per_process_memory_fraction`` instead); ``large_segment_size_mb``, ``backend:cudaMallocAsync``
and the other options in ``_UNSUPPORTED_OPTIONS`` (rejected by the config parser); IPC and peer
access of expandable segments; free-memory callbacks (``trigger_free_memory_callbacks``, which
only frees CUDA-IPC memory).  Device addresses are synthetic: each new segment (or expandable
virtual range) gets a fresh, increasing address.  Real ``cudaMalloc`` may reuse addresses of
freed segments, which only changes which of two *equal-size* free blocks best fit picks
(``BlockComparatorSize`` orders by stream, size, then address; newer releases order equal sizes
by segment creation, which the synthetic addresses follow).
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import enum
import operator
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable

from estimator.vocab.allocator_options import K_LARGE_BUFFER, SIZE_MAX, AllocatorConfig, is_pow2
from estimator.vocab.errors import FxmemError, InputError

# --- constants, each from the source named beside it ---------------------------------------
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize, c10/cuda/CUDACachingAllocator.cpp (c10/core/AllocatorConfig.h)
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB, same files
K_SMALL_BUFFER = 2097152  # kSmallBuffer: small requests are packed in 2 MiB segments, same files;
                          # also the page of a small-pool expandable segment (find_expandable_block)
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: requests in (1, 10) MiB get a kLargeBuffer segment
K_ROUND_LARGE = 2097152  # kRoundLarge: larger requests round up to 2 MiB, same files
# The device size assumed for the address space of an expandable segment when neither capacity
# nor device_total is given: 1 PiB, so that no request ever exhausts the virtual range.
UNKNOWN_DEVICE_TOTAL = 2**50


class OutOfMemory(FxmemError, MemoryError):
    """The replayed sequence does not fit even after releasing cached segments.

    ``capacity`` is the limit that was hit: the memory fraction's ``allowed`` bytes when that is
    the tighter one, else the model's capacity (or the device total when only that is known).
    """

    def __init__(self, *, requested: int, alloc_size: int, capacity: int, free: int,
                 allocated: int, reserved: int, allowed: int | None = None) -> None:
        self.requested, self.alloc_size, self.capacity = requested, alloc_size, capacity
        self.free, self.allocated, self.reserved = free, allocated, reserved
        self.allowed = allowed
        fraction = (f" ({allowed} bytes allowed by per_process_memory_fraction)"
                    if allowed is not None else "")
        super().__init__(
            f"CUDA out of memory (modelled): a request of {requested} bytes needs a new segment "
            f"of {alloc_size} bytes, but of the capacity of {capacity} bytes{fraction} only "
            f"{free} bytes are free; {allocated} bytes are allocated and "
            f"{reserved - allocated} bytes are reserved but unallocated (fragmentation)")


class SegmentKind(str, enum.Enum):
    """The kind of a segment in :meth:`CachingAllocatorModel.snapshot`: its pool, and whether it
    is an expandable segment (one growing virtual range) or a cudaMalloc'ed one."""

    SMALL = "small"
    LARGE = "large"
    SMALL_EXPANDABLE = "small_expandable"
    LARGE_EXPANDABLE = "large_expandable"














def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round up to the next 1/divisions of a power of two."""
    if is_pow2(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


_NO_DIVISIONS = AllocatorConfig().roundup_power2_divisions  # the default (one tuple): 512 B multiples at every size


def round_size(size: int, cfg: AllocatorConfig = AllocatorConfig()) -> int:
    """``round_size``: at least kMinBlockSize, then power-of-2 divisions or a 512 B multiple."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = 0 if cfg.roundup_power2_divisions is _NO_DIVISIONS else cfg.divisions_for(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def get_allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment cudaMalloc'ed for a rounded request of ``size``."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclasses.dataclass(frozen=True)
class AllocatorStats:
    """Current values and peaks, as ``torch.cuda.memory_stats()`` "all" entries (bytes)."""

    allocated: int  # allocated_bytes.all.current  (torch.cuda.memory_allocated)
    reserved: int  # reserved_bytes.all.current   (torch.cuda.memory_reserved)
    peak_allocated: int  # allocated_bytes.all.peak  (torch.cuda.max_memory_allocated)
    peak_reserved: int  # reserved_bytes.all.peak    (torch.cuda.max_memory_reserved)
    segments: int  # segment.all.current (cudaMalloc'ed segments; expandable ones not counted)
    requested: int  # requested_bytes.all.current
    peak_requested: int  # requested_bytes.all.peak


class _ExpandableSegment:
    """``ExpandableSegment``: a reserved virtual range of ``max_handles`` pages of
    ``segment_size`` bytes at ``base``, of which ``mapped_size`` bytes are backed by memory."""

    __slots__ = ("base", "segment_size", "max_handles", "small", "mapped_size")

    def __init__(self, base: int, segment_size: int, device_total: int, small: bool) -> None:
        self.base, self.segment_size, self.small = base, segment_size, small
        # "we allocate enough address space for 1 1/8 the total memory on the GPU"
        self.max_handles = self._num_segments(device_total + device_total // 8)
        self.mapped_size = 0

    def size(self) -> int:
        return self.max_handles * self.segment_size

    def _num_segments(self, size: int) -> int:  # numSegments: pages covering size bytes
        return (size + self.segment_size - 1) // self.segment_size

    def map(self, ptr: int, size: int, room: int | None) -> tuple[int, int]:
        """``map``: back the pages covering [ptr, ptr + size) (``ptr`` page-aligned); returns the
        range mapped, of size 0 when cuMemCreate runs out of memory (``room`` free bytes; None:
        never) -- the pages of one call are created all or none."""
        begin = (ptr - self.base) // self.segment_size  # segmentLeft
        end = self._num_segments(ptr + size - self.base)  # segmentRight
        assert self.base + begin * self.segment_size == ptr, "unaligned map (model bug)"
        nbytes = (end - begin) * self.segment_size
        if nbytes == 0 or (room is not None and nbytes > room):
            return ptr, 0
        self.mapped_size += nbytes
        return ptr, nbytes

    def unmap(self, ptr: int, size: int) -> tuple[int, int]:
        """``unmap``: release the pages wholly inside [ptr, ptr + size); returns that range."""
        begin = self._num_segments(ptr - self.base)  # segmentRight
        end = (ptr + size - self.base) // self.segment_size  # segmentLeft
        if begin >= end:
            return ptr, 0
        nbytes = (end - begin) * self.segment_size
        self.mapped_size -= nbytes
        return self.base + begin * self.segment_size, nbytes


@dataclasses.dataclass(eq=False, slots=True)
class _Block:
    size: int
    addr: int
    small: bool  # owning pool: small_blocks or large_blocks
    stream: int = 0  # the allocation stream (0: the default stream)
    allocated: bool = False
    requested: int = 0
    prev: _Block | None = None
    next: _Block | None = None
    mapped: bool = True  # backed by memory; False only for address space of an expandable segment
    segment: _ExpandableSegment | None = None  # expandable_segment_
    gc_count_base: int = 0  # the pool's get_free_blocks_call_count when the block was cached

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        """``Block::splice``: link this block between ``before`` and ``after``."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


_SIZE_SHIFT, _STREAM_SHIFT = 64, 128  # a free block's key: (stream, size, address) as one int (below)


class _Pool:
    """``BlockPool``: free blocks ordered by (stream, size, address) (``BlockComparatorSize``),
    ``unmapped`` address space of expandable segments ordered by (stream, address)
    (``BlockComparatorAddress``), and the garbage-collection clock (one for all streams).

    A free block's key is ``stream << 128 | size << 64 | address``, which orders as the tuple
    does (sizes and addresses stay below 2**64): ints compare and hash faster than tuples, and the
    search for a size is the replay's most frequent step."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}
        self.unmapped_keys: list[tuple[int, int]] = []
        self.unmapped: dict[tuple[int, int], _Block] = {}
        self.get_free_blocks_call_count = 0

    def insert(self, b: _Block) -> None:
        """``insert_into_blocks``: cache a free block and note when (its age starts at 0)."""
        b.gc_count_base = self.get_free_blocks_call_count
        key = b.stream << _STREAM_SHIFT | b.size << _SIZE_SHIFT | b.addr
        insort(self.keys, key)
        self.blocks[key] = b

    def erase(self, b: _Block) -> None:
        key = b.stream << _STREAM_SHIFT | b.size << _SIZE_SHIFT | b.addr
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]

    def lower_bound(self, stream: int, size: int) -> int:
        """``blocks.lower_bound`` with the search key (``stream``, ``size``): where ``stream``'s
        first free block of at least ``size`` bytes is, if there is one (``block_of`` says)."""
        return bisect_left(self.keys, stream << _STREAM_SHIFT | size << _SIZE_SHIFT)

    def block_of(self, idx: int, stream: int) -> _Block | None:
        """The free block at ``idx`` if it is one of ``stream``'s."""
        if idx < 0 or idx >= len(self.keys) or self.keys[idx] >> _STREAM_SHIFT != stream:
            return None
        return self.blocks[self.keys[idx]]

    def unmapped_of(self, stream: int) -> list[_Block]:
        """``stream``'s unmapped blocks in address order."""
        start = bisect.bisect_left(self.unmapped_keys, (stream, -1))
        end = bisect.bisect_left(self.unmapped_keys, (stream + 1, -1))
        return [self.unmapped[key] for key in self.unmapped_keys[start:end]]

    def insert_unmapped(self, b: _Block) -> None:
        bisect.insort(self.unmapped_keys, (b.stream, b.addr))
        self.unmapped[b.stream, b.addr] = b

    def erase_unmapped(self, b: _Block) -> None:
        del self.unmapped_keys[bisect.bisect_left(self.unmapped_keys, (b.stream, b.addr))]
        del self.unmapped[b.stream, b.addr]

    def copy(self, blocks: dict[int, _Block]) -> _Pool:
        """This pool over the copies ``blocks`` (by the id of each original)."""
        other = copy.copy(self)
        other.keys, other.unmapped_keys = list(self.keys), list(self.unmapped_keys)
        other.blocks = {k: blocks[id(b)] for k, b in self.blocks.items()}
        other.unmapped = {k: blocks[id(b)] for k, b in self.unmapped.items()}
        return other

    def gc_count(self, b: _Block) -> int:
        """``Block::gc_count``: get_free_block calls on this pool since ``b`` was cached."""
        return self.get_free_blocks_call_count - b.gc_count_base


class _Stat:
    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def increase(self, amount: int) -> None:  # increase_stat
        self.current += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:  # decrease_stat
        self.current -= amount
        assert self.current >= 0, "negative allocator stat (model bug)"

    def reset_peak(self) -> None:  # reset_peak_stat
        self.peak = self.current


def _allocatable(b: _Block | None) -> bool:
    """``find_expandable_block``'s ``allocatable``: free (events and stream uses not modelled)."""
    return b is not None and not b.allocated


def _expandable_size(b: _Block) -> int:
    """``get_free_block``'s ``expandable_size``: a block followed by unmapped address space can
    grow into it."""
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)


def _as_bytes(value: int | None, what: str) -> int | None:
    """A non-negative integer number of bytes (any integer type, e.g. numpy's), or None."""
    if value is None:
        return None
    try:
        nbytes = operator.index(value)
    except TypeError:
        nbytes = -1
    if isinstance(value, bool) or nbytes < 0:
        raise InputError(f"{what} must be a non-negative number of bytes, got {value!r}")
    return nbytes


class CachingAllocatorModel:
    """One device's ``DeviceCachingAllocator`` on a single stream.

    ``capacity``: bytes the allocator may obtain from the device in total (its free memory:
    cudaMalloc and cuMemCreate fail beyond it); None means every request for memory succeeds.
    ``device_total``: the device's total memory (``totalGlobalMem``), default ``capacity``; it
    sizes ``per_process_memory_fraction`` (``setMemoryFraction``: allowed = fraction x total, the
    cap ``alloc_block`` checks) and the address space of an expandable segment.  A fraction below
    1 with neither given raises :class:`InputError`: the cap would be unknown.
    """

    def __init__(self, cfg: AllocatorConfig | None = None, capacity: int | None = None, *,
                 device_total: int | None = None) -> None:
        capacity = _as_bytes(capacity, "capacity")
        device_total = _as_bytes(device_total, "device_total")
        self.cfg = cfg if cfg is not None else AllocatorConfig()
        self.capacity = capacity
        self.device_total = device_total if device_total is not None else capacity
        # setMemoryFraction(per_process_memory_fraction()) in the constructor: a cap iff < 1
        self.allowed: int | None = None
        if self.cfg.per_process_memory_fraction < 1.0:
            if self.device_total is None:
                raise InputError(
                    f"per_process_memory_fraction:{self.cfg.per_process_memory_fraction} caps "
                    "the allocator at that fraction of the device's total memory: give the "
                    "model a capacity (or device_total) to size it")
            self.allowed = int(self.cfg.per_process_memory_fraction * float(self.device_total))
        # allowed_memory_maximum.has_value() && garbage_collection_threshold() > 0
        self._collects = self.allowed is not None and self.cfg.garbage_collection_threshold > 0.0
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[int, _Block | None] = {}
        self._next_handle = 0
        self._next_addr = 0
        self._allocated, self._reserved, self._requested = _Stat(), _Stat(), _Stat()
        self._segments = 0
        self._expandable_segments: list[_ExpandableSegment] = []

    # --- public API ---------------------------------------------------------------------
    def copy(self) -> CachingAllocatorModel:
        """An independent copy of this allocator's state (``copy.deepcopy`` would recurse along
        each segment's chain of blocks, thousands deep)."""
        other = copy.copy(self)
        segments = {id(e): copy.copy(e) for e in self._expandable_segments}
        other._expandable_segments = [segments[id(e)] for e in self._expandable_segments]
        blocks: dict[int, _Block] = {}
        chains = [*self._live.values(), *self._small.blocks.values(), *self._large.blocks.values(),
                  *self._small.unmapped.values(), *self._large.unmapped.values()]
        for start in chains:
            b = start
            while b is not None and b.prev is not None:  # every block of its segment, from the first
                b = b.prev
            while b is not None and id(b) not in blocks:
                blocks[id(b)] = dataclasses.replace(b, segment=segments.get(id(b.segment), b.segment))
                b = b.next
        for new in blocks.values():
            new.prev = None if new.prev is None else blocks[id(new.prev)]
            new.next = None if new.next is None else blocks[id(new.next)]
        other._live = {h: None if b is None else blocks[id(b)] for h, b in self._live.items()}
        other._small, other._large = self._small.copy(blocks), self._large.copy(blocks)
        other._allocated, other._reserved, other._requested = (
            copy.copy(self._allocated), copy.copy(self._reserved), copy.copy(self._requested))
        return other

    @property
    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated=self._allocated.current, reserved=self._reserved.current,
            peak_allocated=self._allocated.peak, peak_reserved=self._reserved.peak,
            segments=self._segments, requested=self._requested.current,
            peak_requested=self._requested.peak)

    @property
    def peak_allocated(self) -> int:
        """``allocated_bytes.all.peak`` (``stats.peak_allocated`` without building the stats)."""
        return self._allocated.peak

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """``malloc`` on ``stream`` (0: the default stream; others any non-negative int): returns
        a handle for :meth:`free`.  0 bytes allocate nothing (``NativeCachingAllocator::allocate``
        returns a null pointer)."""
        if type(nbytes) is not int and (isinstance(nbytes, bool) or not isinstance(nbytes, int)) or nbytes < 0:
            raise InputError(f"allocation size must be a non-negative int, got {nbytes!r}")
        if type(stream) is not int and (isinstance(stream, bool) or not isinstance(stream, int)) or stream < 0:
            raise InputError(f"a stream must be a non-negative int, got {stream!r}")
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = self._malloc(nbytes, stream) if nbytes else None
        return handle

    def free(self, handle: int) -> None:
        """``free`` -> ``free_block``."""
        try:
            block = self._live.pop(handle)
        except KeyError:
            raise InputError(f"free of unknown or already freed handle {handle!r}") from None
        if block is None:
            return
        block.allocated = False
        self._allocated.decrease(block.size)
        self._requested.decrease(block.requested)
        self._free_block(block)

    def reset_peak_stats(self) -> None:
        """``resetPeakStats`` (``torch.cuda.reset_peak_memory_stats``): every peak := current."""
        for stat in (self._allocated, self._reserved, self._requested):
            stat.reset_peak()

    def empty_cache(self) -> None:
        """``emptyCache`` -> ``release_cached_blocks``: cudaFree every wholly free segment and
        unmap every wholly free page of the expandable segments."""
        self._release_cached_blocks()

    def snapshot(self) -> tuple[tuple, ...]:
        """The segment layout, up to address renaming: for each segment in address order its
        :class:`SegmentKind`, its blocks in address order as ``(size, allocated)`` and, for a
        segment of a stream other than the default one, that stream; ``allocated`` is None for
        unmapped address space of an expandable segment (its trailing unmapped block is the rest
        of the virtual range).  Two models have equal snapshots iff their layouts are equal.
        O(blocks + segments log segments).

        Garbage-collection ages (``gc_count``) are not part of it: with a threshold active, two
        equal layouts may still differ in which cached segments the next collection frees.
        """
        blocks = [b for b in self._live.values() if b is not None]
        for pool in (self._small, self._large):
            blocks.extend(pool.blocks.values())
            blocks.extend(pool.unmapped.values())
        heads = sorted((b for b in blocks if b.prev is None), key=lambda b: b.addr)
        layout = []
        for head in heads:
            if head.segment is not None:
                kind = SegmentKind.SMALL_EXPANDABLE if head.small else SegmentKind.LARGE_EXPANDABLE
            else:
                kind = SegmentKind.SMALL if head.small else SegmentKind.LARGE
            seg: list[tuple[int, bool | None]] = []
            b: _Block | None = head
            while b is not None:
                seg.append((b.size, b.allocated if b.mapped else None))
                b = b.next
            layout.append((kind, tuple(seg)) if head.stream == 0 else (kind, tuple(seg), head.stream))
        return tuple(layout)

    # --- DeviceCachingAllocator internals ------------------------------------------------
    def _pool_of(self, block: _Block) -> _Pool:
        return self._small if block.small else self._large

    def _malloc(self, orig_size: int, stream: int) -> _Block:
        size = round_size(orig_size, self.cfg)
        pool = self._small if size <= K_SMALL_SIZE else self._large  # get_pool
        block = self._get_free_block(pool, size, stream)
        if block is None:
            alloc_size = get_allocation_size(size)
            if self._collects:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc_size, stream)
            if block is None:
                limits = [x for x in (self.capacity, self.allowed) if x is not None]
                # no limit at all: the request is larger than an expandable virtual range
                limit = min(limits) if limits else (self.device_total or UNKNOWN_DEVICE_TOTAL)
                raise OutOfMemory(
                    requested=orig_size, alloc_size=alloc_size, capacity=limit,
                    free=max(0, limit - self._reserved.current),
                    allocated=self._allocated.current, reserved=self._reserved.current,
                    allowed=self.allowed)
        return self._alloc_found_block(pool, block, size, orig_size,
                                       self._should_split(block, size))

    def _should_split(self, block: _Block, size: int) -> bool:
        """``should_split``: small pool or expandable segments active if the rest is >= 512 B;
        large pool if the request is below max_split_size and the rest is > kSmallSize."""
        remaining = block.size - size
        if block.small or self.cfg.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.cfg.max_split_size and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``get_free_block``: best fit among ``stream``'s free blocks (lower_bound on (stream,
        size, address)); among blocks of an
        expandable segment, a block that can grow into unmapped space counts with that space
        (``expandable_size``), so a later block that is smaller by that measure is preferred;
        an oversize block (>= max_split_size) only serves a request >= max_split_size that is
        less than max_non_split_rounding_size smaller than it.  Ticks the pool's
        garbage-collection clock when collection is active."""
        if self._collects:
            pool.get_free_blocks_call_count += 1
        keys = pool.keys
        idx = bisect_left(keys, stream << _STREAM_SHIFT | size << _SIZE_SHIFT)  # pool.lower_bound, pool.block_of
        if idx == len(keys) or keys[idx] >> _STREAM_SHIFT != stream:
            return None
        block = pool.blocks[keys[idx]]
        # Blocks of expandable segments exist only with expandable_segments:True here (the
        # option is fixed for a model), so the "turned off since" branch of the source is moot.
        while block.segment is not None:
            nxt = pool.block_of(idx + 1, stream)
            if nxt is None or _expandable_size(nxt) >= _expandable_size(block):
                break
            idx += 1
            block = nxt
        mss = self.cfg.max_split_size
        if size < mss and block.size >= mss:
            return None
        if size >= mss and block.size >= size + self.cfg.max_non_split_rounding_size:
            return None
        pool.erase(block)
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, stream: int) -> _Block | None:
        """``alloc_block``: refused when the memory fraction's cap would be exceeded by
        ``alloc_size`` -- also for an expandable segment, which maps whole pages instead, so
        there reserved may end up to a page short of 20 MiB above the cap, as in PyTorch; then
        either ``try_allocate_expandable_block`` for the rounded ``size`` or cudaMalloc a new
        segment of ``alloc_size`` bytes, which fails beyond the capacity."""
        if self.allowed is not None and self._reserved.current + alloc_size > self.allowed:
            return None
        if self.cfg.expandable_segments:
            return self._try_allocate_expandable_block(pool, size, stream)
        if self.capacity is not None and self._reserved.current + alloc_size > self.capacity:
            return None
        block = _Block(size=alloc_size, addr=self._next_addr, small=pool.small, stream=stream)
        self._next_addr += alloc_size
        assert self._next_addr >> _SIZE_SHIFT == 0, "addresses past 2**64: the pools' keys would collide"
        self._segments += 1
        self._reserved.increase(alloc_size)
        return block

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``find_expandable_block``: ``stream``'s lowest-address unmapped block (or the free
        block just before it) from which free and unmapped blocks span ``size`` bytes; else a new
        expandable segment of ``stream`` (its whole virtual range one unmapped block), or None
        when even that is smaller than ``size``."""

        def has_available_address_space(b: _Block | None) -> bool:
            nbytes = 0
            while nbytes < size and _allocatable(b):
                assert b is not None
                nbytes += b.size
                b = b.next
            return nbytes >= size

        for c in pool.unmapped_of(stream):
            if _allocatable(c.prev):
                assert c.prev is not None
                c = c.prev
            if has_available_address_space(c):
                return c
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        total = self.device_total if self.device_total is not None else UNKNOWN_DEVICE_TOTAL
        es = _ExpandableSegment(self._next_addr, page, total, pool.small)
        if es.size() < size:
            return None
        self._next_addr += es.size()
        assert self._next_addr >> _SIZE_SHIFT == 0, "addresses past 2**64: the pools' keys would collide"
        self._expandable_segments.append(es)
        candidate = _Block(size=es.size(), addr=es.base, small=pool.small, stream=stream, mapped=False,
                           segment=es)
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """``map_block``: map the pages covering the first ``size`` bytes of an unmapped block,
        split off the rest as unmapped, merge with free neighbours and cache the result;
        reserved grows by the mapped bytes.  False when the device has no room."""
        assert not to_map.mapped and size <= to_map.size and to_map.segment is not None
        room = None if self.capacity is None else self.capacity - self._reserved.current
        _, mapped = to_map.segment.map(to_map.addr, size, room)
        if mapped == 0:
            return False
        pool = self._pool_of(to_map)
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:  # to_map -> remaining -> to_map.next
            remaining = _Block(size=to_map.size - mapped, addr=to_map.addr + mapped, small=to_map.small,
                               stream=to_map.stream, mapped=False, segment=to_map.segment)
            remaining.splice(to_map, to_map.next)
            pool.insert_unmapped(remaining)
            to_map.size = mapped
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._reserved.increase(mapped)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        """``try_allocate_expandable_block``: map pages from the candidate on until one free
        block of at least ``size`` bytes exists; take it out of the pool.  A failed map leaves
        the pages already mapped in this call mapped (and cached)."""
        candidate = self._find_expandable_block(pool, size, stream)
        if candidate is None:
            return None
        # candidate: unmapped -> None | unmapped -> free -> ... | free -> unmapped -> ...
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            # free -> unmapped -> ...: map some of the unmapped block, which merges with candidate
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped, "expandable candidate (model bug)"
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        pool.erase(candidate)
        return candidate

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int, orig_size: int,
                           split_remainder: bool) -> _Block:
        """``alloc_found_block``: split off the front ``size`` bytes if asked, mark allocated."""
        if split_remainder:
            remaining = block
            # (size, addr, small, stream, allocated, requested, prev, next, mapped, segment)
            block = _Block(size, remaining.addr, remaining.small, remaining.stream, True, orig_size, remaining.prev,
                           remaining, True, remaining.segment)
            if block.prev is not None:
                block.prev.next = block
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
        else:
            block.allocated = True
            block.requested = orig_size
        self._allocated.increase(block.size)
        self._requested.increase(orig_size)
        return block

    def _free_block(self, block: _Block) -> None:
        """``free_block``: merge with free neighbours (``try_merge_blocks``), return to pool."""
        pool = self._small if block.small else self._large
        if block.prev is not None and not block.prev.allocated:
            self._try_merge_blocks(block, block.prev, pool)
        if block.next is not None and not block.next.allocated:
            self._try_merge_blocks(block, block.next, pool)
        pool.insert(block)

    @staticmethod
    def _try_merge_blocks(dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """``try_merge_blocks``: absorb the free neighbour ``src`` into ``dst`` when both are
        mapped or both unmapped."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _release_block(self, pool: _Pool, block: _Block) -> None:
        """``release_block``: cudaFree a wholly free (non-expandable) segment."""
        assert not block.is_split() and block.segment is None, \
            "only whole cudaMalloc'ed segments are released (model bug)"
        pool.erase(block)
        self._segments -= 1
        self._reserved.decrease(block.size)

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        """``unmap_block``: unmap the pages wholly inside a free block of an expandable segment;
        the partial pages before and after stay cached as free blocks, the unmapped range merges
        with unmapped neighbours; reserved shrinks by the unmapped bytes."""
        assert block.segment is not None
        ptr, unmapped = block.segment.unmap(block.addr, block.size)
        if unmapped == 0:
            return
        pool.erase(block)
        before_size = ptr - block.addr
        if before_size > 0:  # prev -> before_free -> block
            before_free = _Block(size=before_size, addr=block.addr, small=block.small, stream=block.stream,
                                 segment=block.segment)
            before_free.splice(block.prev, block)
            pool.insert(before_free)
        after_size = block.size - (before_size + unmapped)
        if after_size > 0:  # block -> after_free -> next
            after_free = _Block(size=after_size, addr=ptr + unmapped, small=block.small, stream=block.stream,
                                segment=block.segment)
            after_free.splice(block, block.next)
            pool.insert(after_free)
        block.addr, block.size, block.mapped = ptr, unmapped, False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self._reserved.decrease(unmapped)

    def _release_expandable_segment(self, pool: _Pool, block: _Block) -> None:
        """``release_expandable_segment``: drop a segment whose whole range is unmapped."""
        assert block.segment is not None and not block.mapped
        assert block.size == block.segment.size(), "block disagrees with segment (model bug)"
        self._expandable_segments.remove(block.segment)
        pool.erase_unmapped(block)

    def _release_blocks(self, pool: _Pool) -> None:
        """``release_blocks``: cudaFree every free block that is a whole segment (no prev/next);
        unmap the free blocks of expandable segments, then drop segments left all unmapped."""
        to_unmap = []
        for key in list(pool.keys):
            block = pool.blocks[key]
            if block.segment is not None:
                to_unmap.append(block)
            elif not block.is_split():
                self._release_block(pool, block)
        for block in to_unmap:
            self._unmap_block(pool, block)
            if not block.is_split():
                self._release_expandable_segment(pool, block)

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, cudaFree ``stream``'s
        smallest oversize block that is big enough, else its oversize blocks from the largest
        down (blocks of expandable segments are skipped)."""
        mss = self.cfg.max_split_size
        if mss == SIZE_MAX:
            return False
        key_size = max(size, mss)
        idx = pool.lower_bound(stream, key_size)
        found = pool.block_of(idx, stream)
        if found is not None and found.segment is None:
            self._release_block(pool, found)
            return True
        released = 0
        idx -= 1
        while released < key_size:
            block = pool.block_of(idx, stream)
            if block is None or block.size < mss:
                break
            idx -= 1
            if block.segment is None:
                released += block.size
                self._release_block(pool, block)
        return released >= key_size

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks`` -> ``release_blocks`` (large, then small)."""
        for pool in (self._large, self._small):
            self._release_blocks(pool)
        return True

    def _garbage_collect_cached_blocks(self) -> None:
        """``garbage_collect_cached_blocks``: when more than threshold x allowed bytes are
        reserved, cudaFree whole cached large-pool segments (not expandable ones) whose age is at
        least the average age of those segments, in (size, address) order, each pass freeing all
        such (not stopping at the target); repeat with the new average until the excess is
        reclaimed or a pass frees nothing."""
        assert self.allowed is not None
        gc_threshold = int(self.cfg.garbage_collection_threshold * float(self.allowed))
        if self._reserved.current <= gc_threshold:
            return
        target_size = self._reserved.current - gc_threshold
        pool = self._large
        freeable = [b for b in pool.blocks.values() if not b.is_split()]
        total_age = sum(pool.gc_count(b) for b in freeable)
        freeable_block_count = len(freeable)
        if freeable_block_count == 0:
            return
        gc_reclaimed = 0
        block_freed = True
        while gc_reclaimed < target_size and block_freed and freeable_block_count > 0:
            age_threshold = total_age / freeable_block_count
            block_freed = False
            for key in list(pool.keys):
                block = pool.blocks[key]
                if (not block.is_split() and block.segment is None
                        and pool.gc_count(block) >= age_threshold):
                    block_freed = True
                    gc_reclaimed += block.size
                    total_age -= pool.gc_count(block)
                    freeable_block_count -= 1
                    self._release_block(pool, block)


def replay(events: Iterable[tuple], cfg: AllocatorConfig | None = None,
           capacity: int | None = None, *, device_total: int | None = None) -> AllocatorStats:
    """Replay ``("alloc", key, nbytes)`` (or ``("alloc", key, nbytes, stream)``) / ``("free",
    key, 0)`` events; return the final stats (``peak_*`` are what ``torch.cuda.max_memory_*``
    report after the sequence)."""
    alloc = CachingAllocatorModel(cfg, capacity, device_total=device_total)
    handles: dict[Hashable, int] = {}
    for n, event in enumerate(events):
        try:
            op, key, nbytes, *stream = event
        except (TypeError, ValueError):
            raise InputError(f"event {n} must be (op, key, nbytes), got {event!r}") from None
        if op == "alloc":
            if key in handles:
                raise InputError(f"event {n}: key {key!r} is allocated twice without a free")
            handles[key] = alloc.malloc(nbytes, *stream[:1])
        elif op == "free":
            if key not in handles:
                raise InputError(f"event {n}: free of key {key!r} that is not allocated")
            alloc.free(handles.pop(key))
        else:
            raise InputError(f"event {n}: op must be 'alloc' or 'free', got {op!r}")
    return alloc.stats
