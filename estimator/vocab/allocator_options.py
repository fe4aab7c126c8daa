"""The CUDA caching allocator's options: ``PYTORCH_CUDA_ALLOC_CONF`` parsed as PyTorch parses it.

A description the target carries (``TargetSpec.allocator``); the allocator model that replays a
step under these options is ``estimator.devices.cuda_allocator``.  The parser follows
``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs``) and
``c10/cuda/CUDAAllocatorConfig.cpp`` (``per_process_memory_fraction``).
"""

from __future__ import annotations

import dataclasses

from estimator.vocab.errors import InputError

# --- constants, each from the source named beside it ---------------------------------------
K_LARGE_BUFFER = 20971520  # kLargeBuffer = AcceleratorAllocatorConfig::large_segment_size()
                           # default: 20 MiB segments, and the page of a large-pool expandable segment
K_MB = 1024 * 1024  # kMB, c10/core/AllocatorConfig.cpp
K_ROUNDUP_POWER_OF_TWO_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals, c10/core/AllocatorConfig.cpp
K_ROUNDUP_POWER_OF_TWO_START_LOG2 = 20  # log2(kRoundUpPowerOfTwoStart = 1 MiB), same file
SIZE_MAX = 2**64 - 1  # std::numeric_limits<size_t>::max(): the default max_split_size


def is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


# Options PyTorch knows but this model does not implement: rejected, never silently defaulted.
_UNSUPPORTED_OPTIONS = frozenset({
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


def _float(tok: str, what: str) -> float:
    """``ConfigTokenizer::toDouble`` (``std::stod``) for a plain decimal number."""
    try:
        return float(tok)
    except ValueError:
        raise AllocatorConfigError(f"expected a number for {what}, got {tok!r}") from None


def _check_gc_threshold(value: float) -> None:
    """``parseGarbageCollectionThreshold``: in (0, 1); 0 (the default) turns it off."""
    if not 0.0 <= value < 1.0:  # also rejects nan
        raise AllocatorConfigError(
            f"garbage_collection_threshold is invalid ({value!r}), set it in (0.0, 1.0)")


def _check_fraction(value: float) -> None:
    """``parsePerProcessMemoryFraction`` / ``setMemoryFraction``: in [0, 1]."""
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise AllocatorConfigError(
            f"per_process_memory_fraction is invalid ({value!r}), set it in [0.0, 1.0]")


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """The allocator options the model implements (defaults = no ``PYTORCH_CUDA_ALLOC_CONF``).

    ``max_split_size``: bytes; blocks at least this big are not split (``should_split``) and
    only serve requests at least this big (``get_free_block``).  ``max_non_split_rounding_size``:
    such a request may take a cached oversize block less than this much bigger.
    ``roundup_power2_divisions``: 16 division counts for the size intervals [1 MiB, 2 MiB),
    [2, 4) MiB, ... (the first also covers smaller sizes, the last larger ones); 0 = off.
    ``expandable_segments``: grow one virtual range per pool by mapping pages instead of
    cudaMalloc'ing segments.  ``garbage_collection_threshold``: in [0, 1), 0 = off; acts only
    with a ``per_process_memory_fraction`` below 1 (the fraction of the device's total memory
    the allocator may reserve; 1 = no cap).
    """

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * K_ROUNDUP_POWER_OF_TWO_INTERVALS
    expandable_segments: bool = False
    garbage_collection_threshold: float = 0.0
    per_process_memory_fraction: float = 1.0

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != K_ROUNDUP_POWER_OF_TWO_INTERVALS:
            raise AllocatorConfigError(
                f"roundup_power2_divisions needs {K_ROUNDUP_POWER_OF_TWO_INTERVALS} entries")
        _check_gc_threshold(self.garbage_collection_threshold)
        _check_fraction(self.per_process_memory_fraction)

    @classmethod
    def parse(cls, conf: str | None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string, as ``AllocatorConfig::parseArgs``.

        E.g. ``"max_split_size_mb:128,roundup_power2_divisions:[256:4,>:8]"`` or
        ``"expandable_segments:True"`` or
        ``"per_process_memory_fraction:0.8,garbage_collection_threshold:0.6"``.  Known options the
        model does not implement raise :class:`UnsupportedAllocatorConfig`; unknown options and
        malformed strings raise :class:`AllocatorConfigError`.
        """
        max_split = SIZE_MAX
        max_non_split = K_LARGE_BUFFER
        divs = [0] * K_ROUNDUP_POWER_OF_TWO_INTERVALS
        expandable = False
        gc_threshold = 0.0
        fraction = 1.0
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
                        if val2 != 0 and not is_pow2(val2):
                            raise AllocatorConfigError(
                                "for roundups, the divisions have to be a power of 2 or 0")
                        if val1 == ">":
                            divs[last_index:] = [val2] * (len(divs) - last_index)
                        else:
                            interval = _uint(val1, key + " interval")
                            if not is_pow2(interval):
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
                    if not is_pow2(val):
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
            elif key == "expandable_segments":  # parseExpandableSegments (toBool)
                expect(i + 1, ":")
                i += 2
                flag = value(i, key)
                if flag not in ("True", "False"):
                    raise AllocatorConfigError(
                        "expected a single True/False argument for expandable_segments")
                expandable = flag == "True"
            elif key == "garbage_collection_threshold":  # parseGarbageCollectionThreshold
                expect(i + 1, ":")
                i += 2
                gc_threshold = _float(value(i, key), key)
                if gc_threshold == 0.0:  # the source requires (0, 1): 0 is not a valid value
                    raise AllocatorConfigError(
                        "garbage_collection_threshold is invalid (0.0), set it in (0.0, 1.0)")
                _check_gc_threshold(gc_threshold)
            elif key == "per_process_memory_fraction":  # parsePerProcessMemoryFraction
                expect(i + 1, ":")
                i += 2
                fraction = _float(value(i, key), key)
                _check_fraction(fraction)
            elif key in _UNSUPPORTED_OPTIONS:
                raise UnsupportedAllocatorConfig(key)
            else:
                raise AllocatorConfigError(f"Unrecognized CachingAllocator option: {key!r}")
            if i + 1 < n:
                expect(i + 1, ",")
                i += 1
            i += 1
        return cls(max_split, max_non_split, tuple(divs), expandable, gc_threshold, fraction)

    def divisions_for(self, size: int) -> int:
        """``AllocatorConfig::roundup_power2_divisions(size)``: the interval of floor(log2 size)."""
        index = size.bit_length() - 1 - K_ROUNDUP_POWER_OF_TWO_START_LOG2
        index = max(0, min(index, K_ROUNDUP_POWER_OF_TWO_INTERVALS - 1))
        return self.roundup_power2_divisions[index]
