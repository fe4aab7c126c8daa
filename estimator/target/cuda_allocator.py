"""A replay model of PyTorch's CUDA caching allocator (the native backend).

Given allocation requests and frees as a program makes them on one CUDA stream, this predicts
what ``torch.cuda.memory_allocated`` / ``memory_reserved`` and their ``max_*`` peaks report.
It follows ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp`` and the option
parsing of ``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs``; older
releases: ``c10/cuda/CUDAAllocatorConfig.cpp``), function by function:

* ``malloc``: ``round_size`` -> ``get_pool`` -> ``get_allocation_size`` -> ``get_free_block``;
  when nothing is cached: ``alloc_block`` || (``release_available_cached_blocks`` &&
  ``alloc_block``) || (``release_cached_blocks`` && ``alloc_block``), else out of memory;
  then ``should_split`` and ``alloc_found_block``.
* ``free``: ``free`` -> ``free_block`` -> ``try_merge_blocks`` with both neighbours.

Stats follow ``increase_stat``/``decrease_stat``: ``allocated_bytes`` counts block sizes (rounded,
unsplit tails included), ``reserved_bytes`` counts segment sizes, ``requested_bytes`` counts the
bytes the program asked for.  Everything is an integer number of bytes.

Not modelled (and why): multiple streams, ``record_stream`` and the cross-stream events
(``process_events``, ``insert_events``) -- the input is one stream's sequence; CUDA-graph private
pools; ``expandable_segments:True`` and ``garbage_collection_threshold`` /
``per_process_memory_fraction`` (rejected by the config parser); free-memory callbacks
(``trigger_free_memory_callbacks``, which only frees CUDA-IPC memory).  Device addresses are
synthetic: each new segment gets a fresh, increasing address.  Real ``cudaMalloc`` may reuse
addresses of freed segments, which only changes which of two *equal-size* free blocks best fit
picks (``BlockComparatorSize`` orders by stream, size, then address).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Hashable, Iterable

from estimator.errors import FxmemError, InputError

# --- constants, each from the source named beside it ---------------------------------------
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize, c10/cuda/CUDACachingAllocator.cpp (c10/core/AllocatorConfig.h)
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB, same files
K_SMALL_BUFFER = 2097152  # kSmallBuffer: small requests are packed in 2 MiB segments, same files
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: requests in (1, 10) MiB get a kLargeBuffer segment
K_ROUND_LARGE = 2097152  # kRoundLarge: larger requests round up to 2 MiB, same files
K_LARGE_BUFFER = 20971520  # kLargeBuffer: 20 MiB segments, c10/cuda/CUDACachingAllocator.cpp
K_MB = 1024 * 1024  # kMB, c10/core/AllocatorConfig.cpp
K_ROUNDUP_POWER_OF_TWO_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals, c10/core/AllocatorConfig.cpp
K_ROUNDUP_POWER_OF_TWO_START_LOG2 = 20  # log2(kRoundUpPowerOfTwoStart = 1 MiB), same file
SIZE_MAX = 2**64 - 1  # std::numeric_limits<size_t>::max(): the default max_split_size

# Options PyTorch knows but this model does not implement: rejected, never silently defaulted.
_UNSUPPORTED_OPTIONS = frozenset({
    "expandable_segments",  # only the False value (the default) is accepted, see parse
    "garbage_collection_threshold",
    "per_process_memory_fraction",
    "large_segment_size_mb",
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
    "pinned_num_register_threads", "pinned_use_background_threads",
    "pinned_max_round_threshold", "pinned_max_cached_size", "pinned_reserve_segment_size_mb",
    "pinned_free_catch_all", "graph_capture_record_stream_reuse", "throw_on_cudamalloc_oom",
})


class AllocatorConfigError(InputError):
    """A ``PYTORCH_CUDA_ALLOC_CONF`` string is malformed or names an unknown option."""


class UnsupportedAllocatorConfig(AllocatorConfigError):
    """A valid allocator option that this model does not implement; ``option`` names it."""

    def __init__(self, option: str, detail: str = "") -> None:
        self.option = option
        super().__init__(
            f"allocator option {option!r} is not modelled by fxmem's CUDA caching-allocator "
            f"model{': ' + detail if detail else ''}; remove it from the config string to "
            "estimate with the default behaviour")


class OutOfMemory(FxmemError, MemoryError):
    """The replayed sequence does not fit in ``capacity`` even after releasing cached segments."""

    def __init__(self, *, requested: int, alloc_size: int, capacity: int, free: int,
                 allocated: int, reserved: int) -> None:
        self.requested, self.alloc_size, self.capacity = requested, alloc_size, capacity
        self.free, self.allocated, self.reserved = free, allocated, reserved
        super().__init__(
            f"CUDA out of memory (modelled): a request of {requested} bytes needs a new segment "
            f"of {alloc_size} bytes, but of the capacity of {capacity} bytes only {free} bytes "
            f"are free; {allocated} bytes are allocated and {reserved - allocated} bytes are "
            "reserved but unallocated (fragmentation)")


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _lex(conf: str) -> list[str]:
    """Tokens of a config string, as ``AllocatorConfig::lexArgs`` / ``ConfigTokenizer``."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in conf:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf.clear()
            tokens.append(ch)
        elif ch != " ":
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


def _uint(tok: str, what: str) -> int:
    if not tok.isdigit():
        raise AllocatorConfigError(f"expected a non-negative integer for {what}, got {tok!r}")
    return int(tok)


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The allocator options the model implements (defaults = no ``PYTORCH_CUDA_ALLOC_CONF``).

    ``max_split_size``: bytes; blocks at least this big are not split (``should_split``) and
    only serve requests at least this big (``get_free_block``).  ``max_non_split_rounding_size``:
    such a request may take a cached oversize block less than this much bigger.
    ``roundup_power2_divisions``: 16 division counts for the size intervals [1 MiB, 2 MiB),
    [2, 4) MiB, ... (the first also covers smaller sizes, the last larger ones); 0 = off.
    """

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * K_ROUNDUP_POWER_OF_TWO_INTERVALS

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != K_ROUNDUP_POWER_OF_TWO_INTERVALS:
            raise AllocatorConfigError(
                f"roundup_power2_divisions needs {K_ROUNDUP_POWER_OF_TWO_INTERVALS} entries")

    @classmethod
    def parse(cls, conf: str | None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string, as ``AllocatorConfig::parseArgs``.

        E.g. ``"max_split_size_mb:128,roundup_power2_divisions:[256:4,>:8]"``.  Known options the
        model does not implement raise :class:`UnsupportedAllocatorConfig`; unknown options and
        malformed strings raise :class:`AllocatorConfigError`.
        """
        max_split = SIZE_MAX
        max_non_split = K_LARGE_BUFFER
        divs = [0] * K_ROUNDUP_POWER_OF_TWO_INTERVALS
        if not conf:
            return cls()
        tok = _lex(conf)
        n = len(tok)

        def expect(i: int, c: str) -> None:  # consumeToken
            if i >= n or tok[i] != c:
                raise AllocatorConfigError(
                    f"error parsing allocator config {conf!r}: expected {c!r} at token {i}")

        def value(i: int, key: str) -> str:
            if i >= n or tok[i] in ",:[]":
                raise AllocatorConfigError(f"error parsing allocator config {conf!r}: "
                                           f"expecting a value for {key}")
            return tok[i]

        i = 0
        while i < n:
            key = tok[i]
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                # parseMaxSplitSize / parseMaxNonSplitRoundingSize
                expect(i + 1, ":")
                i += 2
                mb = _uint(value(i, key), key)
                if mb < K_LARGE_BUFFER // K_MB:
                    raise AllocatorConfigError(
                        f"CachingAllocator option {key} too small, must be >= "
                        f"{K_LARGE_BUFFER // K_MB}")
                nbytes = min(mb, SIZE_MAX // K_MB) * K_MB
                if key == "max_split_size_mb":
                    max_split = nbytes
                else:
                    max_non_split = nbytes
            elif key == "roundup_power2_divisions":  # parseRoundUpPower2Divisions
                expect(i + 1, ":")
                i += 2
                if i < n and tok[i] == "[":
                    last_index, first_value = 0, True
                    i += 1
                    while i < n and tok[i] != "]":
                        val1 = value(i, key)
                        expect(i + 1, ":")
                        i += 2
                        val2 = _uint(value(i, key), key)
                        if val2 != 0 and not _is_pow2(val2):
                            raise AllocatorConfigError(
                                "for roundups, the divisions have to be a power of 2 or 0")
                        if val1 == ">":
                            divs[last_index:] = [val2] * (len(divs) - last_index)
                        else:
                            interval = _uint(val1, key + " interval")
                            if not _is_pow2(interval):
                                raise AllocatorConfigError(
                                    "for roundups, the intervals have to be a power of 2 (MiB)")
                            index = min(interval.bit_length() - 1, len(divs) - 1)
                            if first_value:
                                divs[:index] = [val2] * index
                                first_value = False
                            divs[index] = val2
                            last_index = index
                        if i + 1 < n and tok[i + 1] != "]":
                            expect(i + 1, ",")
                            i += 1
                        i += 1
                    if i >= n:
                        raise AllocatorConfigError(
                            f"error parsing allocator config {conf!r}: missing ']'")
                else:  # single value for every interval (backwards-compatible form)
                    val = _uint(value(i, key), key)
                    if not _is_pow2(val):
                        raise AllocatorConfigError("for roundups, the divisions have to be a "
                                                   "power of 2")
                    divs = [val] * K_ROUNDUP_POWER_OF_TWO_INTERVALS
            elif key == "backend":  # parseAllocatorConfig
                expect(i + 1, ":")
                i += 2
                backend = value(i, key)
                if backend == "cudaMallocAsync":
                    raise UnsupportedAllocatorConfig("backend", "backend:cudaMallocAsync")
                if backend != "native":
                    raise AllocatorConfigError(
                        f"unknown allocator backend {backend!r}; options are native and "
                        "cudaMallocAsync")
            elif key == "expandable_segments":
                expect(i + 1, ":")
                i += 2
                flag = value(i, key)
                if flag not in ("True", "False"):
                    raise AllocatorConfigError(
                        "expected a single True/False argument for expandable_segments")
                if flag == "True":
                    raise UnsupportedAllocatorConfig("expandable_segments",
                                                     "expandable_segments:True")
            elif key in _UNSUPPORTED_OPTIONS:
                raise UnsupportedAllocatorConfig(key)
            else:
                raise AllocatorConfigError(f"Unrecognized CachingAllocator option: {key!r}")
            if i + 1 < n:
                expect(i + 1, ",")
                i += 1
            i += 1
        return cls(max_split, max_non_split, tuple(divs))

    def divisions_for(self, size: int) -> int:
        """``AllocatorConfig::roundup_power2_divisions(size)``: the interval of floor(log2 size)."""
        index = size.bit_length() - 1 - K_ROUNDUP_POWER_OF_TWO_START_LOG2
        index = max(0, min(index, K_ROUNDUP_POWER_OF_TWO_INTERVALS - 1))
        return self.roundup_power2_divisions[index]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: round up to the next 1/divisions of a power of two."""
    if _is_pow2(size):
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


def round_size(size: int, cfg: AllocatorConfig = AllocatorConfig()) -> int:
    """``round_size``: at least kMinBlockSize, then power-of-2 divisions or a 512 B multiple."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = cfg.divisions_for(size)
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
    segments: int  # segment.all.current
    requested: int  # requested_bytes.all.current
    peak_requested: int  # requested_bytes.all.peak


@dataclasses.dataclass(eq=False)
class _Block:
    size: int
    addr: int
    small: bool  # owning pool: small_blocks or large_blocks
    allocated: bool = False
    requested: int = 0
    prev: _Block | None = None
    next: _Block | None = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """``BlockPool.blocks``: free blocks ordered by (size, address) (one stream)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}

    def insert(self, b: _Block) -> None:
        key = (b.size, b.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b

    def erase(self, b: _Block) -> None:
        key = (b.size, b.addr)
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def lower_bound(self, size: int) -> int:
        return bisect.bisect_left(self.keys, (size, -1))


class _Stat:
    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def increase(self, amount: int) -> None:  # increase_stat
        self.current += amount
        self.peak = max(self.peak, self.current)

    def decrease(self, amount: int) -> None:  # decrease_stat
        self.current -= amount
        assert self.current >= 0, "negative allocator stat (model bug)"


class CachingAllocatorModel:
    """One device's ``DeviceCachingAllocator`` on a single stream.

    ``capacity``: bytes the allocator may cudaMalloc in total (the device's free memory); None
    means every cudaMalloc succeeds.
    """

    def __init__(self, cfg: AllocatorConfig | None = None,
                 capacity: int | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise InputError(f"capacity must be a non-negative number of bytes, got {capacity}")
        self.cfg = cfg if cfg is not None else AllocatorConfig()
        self.capacity = capacity
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[int, _Block | None] = {}
        self._next_handle = 0
        self._next_addr = 0
        self._allocated, self._reserved, self._requested = _Stat(), _Stat(), _Stat()
        self._segments = 0

    # --- public API ---------------------------------------------------------------------
    @property
    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated=self._allocated.current, reserved=self._reserved.current,
            peak_allocated=self._allocated.peak, peak_reserved=self._reserved.peak,
            segments=self._segments, requested=self._requested.current,
            peak_requested=self._requested.peak)

    def malloc(self, nbytes: int) -> int:
        """``malloc``: returns a handle for :meth:`free`.  0 bytes allocate nothing
        (``NativeCachingAllocator::allocate`` returns a null pointer)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InputError(f"allocation size must be a non-negative int, got {nbytes!r}")
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = self._malloc(nbytes) if nbytes else None
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

    def empty_cache(self) -> None:
        """``emptyCache`` -> ``release_cached_blocks``: cudaFree every wholly free segment."""
        self._release_cached_blocks()

    # --- DeviceCachingAllocator internals ------------------------------------------------
    def _malloc(self, orig_size: int) -> _Block:
        size = round_size(orig_size, self.cfg)
        pool = self._small if size <= K_SMALL_SIZE else self._large  # get_pool
        alloc_size = get_allocation_size(size)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, alloc_size)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, alloc_size)
            if block is None:
                assert self.capacity is not None
                raise OutOfMemory(
                    requested=orig_size, alloc_size=alloc_size, capacity=self.capacity,
                    free=self.capacity - self._reserved.current,
                    allocated=self._allocated.current, reserved=self._reserved.current)
        return self._alloc_found_block(pool, block, size, orig_size,
                                       self._should_split(block, size))

    def _should_split(self, block: _Block, size: int) -> bool:
        """``should_split``: small pool if the rest is >= 512 B; large pool if the request is
        below max_split_size and the rest is > kSmallSize."""
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.cfg.max_split_size and remaining > K_SMALL_SIZE

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit (lower_bound on (size, address)); an oversize block
        (>= max_split_size) only serves a request >= max_split_size that is less than
        max_non_split_rounding_size smaller than it."""
        idx = pool.lower_bound(size)
        if idx == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[idx]]
        mss = self.cfg.max_split_size
        if size < mss and block.size >= mss:
            return None
        if size >= mss and block.size >= size + self.cfg.max_non_split_rounding_size:
            return None
        pool.erase(block)
        return block

    def _alloc_block(self, pool: _Pool, alloc_size: int) -> _Block | None:
        """``alloc_block``: cudaMalloc a new segment; fails when it would exceed capacity."""
        if self.capacity is not None and self._reserved.current + alloc_size > self.capacity:
            return None
        block = _Block(size=alloc_size, addr=self._next_addr, small=pool.small)
        self._next_addr += alloc_size
        self._segments += 1
        self._reserved.increase(alloc_size)
        return block

    def _alloc_found_block(self, pool: _Pool, block: _Block, size: int, orig_size: int,
                           split_remainder: bool) -> _Block:
        """``alloc_found_block``: split off the front ``size`` bytes if asked, mark allocated."""
        if split_remainder:
            remaining = block
            block = _Block(size=size, addr=remaining.addr, small=remaining.small,
                           prev=remaining.prev, next=remaining)
            if block.prev is not None:
                block.prev.next = block
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
        block.allocated = True
        block.requested = orig_size
        self._allocated.increase(block.size)
        self._requested.increase(orig_size)
        return block

    def _free_block(self, block: _Block) -> None:
        """``free_block``: merge with free neighbours (``try_merge_blocks``), return to pool."""
        pool = self._small if block.small else self._large
        for candidate in (block.prev, block.next):
            self._try_merge_blocks(block, candidate, pool)
        pool.insert(block)

    @staticmethod
    def _try_merge_blocks(dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """``try_merge_blocks``: absorb the free neighbour ``src`` into ``dst``."""
        if src is None or src.allocated:
            return
        pool.erase(src)
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
        """``release_block``: cudaFree a wholly free segment."""
        assert not block.is_split(), "only whole segments are released (model bug)"
        pool.erase(block)
        self._segments -= 1
        self._reserved.decrease(block.size)

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, cudaFree the smallest
        oversize block that is big enough, else oversize blocks from the largest down."""
        mss = self.cfg.max_split_size
        if mss == SIZE_MAX:
            return False
        key_size = max(size, mss)
        idx = pool.lower_bound(key_size)
        if idx < len(pool.keys):
            self._release_block(pool, pool.blocks[pool.keys[idx]])
            return True
        released = 0
        idx -= 1
        while idx >= 0 and released < key_size:
            block = pool.blocks[pool.keys[idx]]
            if block.size < mss:
                break
            released += block.size
            self._release_block(pool, block)
            idx -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks`` -> ``release_blocks`` (large, then small): cudaFree every
        free block that is a whole segment (no prev/next)."""
        for pool in (self._large, self._small):
            for key in list(pool.keys):
                block = pool.blocks[key]
                if not block.is_split():
                    self._release_block(pool, block)
        return True


def replay(events: Iterable[tuple[str, Hashable, int]], cfg: AllocatorConfig | None = None,
           capacity: int | None = None) -> AllocatorStats:
    """Replay ``("alloc", key, nbytes)`` / ``("free", key, 0)`` events; return the final stats
    (``peak_*`` are what ``torch.cuda.max_memory_*`` report after the sequence)."""
    alloc = CachingAllocatorModel(cfg, capacity)
    handles: dict[Hashable, int] = {}
    for n, event in enumerate(events):
        try:
            op, key, nbytes = event
        except (TypeError, ValueError):
            raise InputError(f"event {n} must be (op, key, nbytes), got {event!r}") from None
        if op == "alloc":
            if key in handles:
                raise InputError(f"event {n}: key {key!r} is allocated twice without a free")
            handles[key] = alloc.malloc(nbytes)
        elif op == "free":
            if key not in handles:
                raise InputError(f"event {n}: free of key {key!r} that is not allocated")
            alloc.free(handles.pop(key))
        else:
            raise InputError(f"event {n}: op must be 'alloc' or 'free', got {op!r}")
    return alloc.stats
