"""GPU target facts: a small table of NVIDIA GPUs, the cuBLAS workspace PyTorch allocates and the
CUDA context's size.

Memory figures
--------------
``GpuSpec.total_memory`` is either an *observed* ``cudaDeviceProp.totalGlobalMem`` (what
``torch.cuda.get_device_properties(i).total_memory`` returns; ``exact=True``) or the
*nominal* capacity in GiB (``exact=False``).  Even the observed figures are one sample: the
value drifts by a few tens of MiB with driver version and OS (three H100 80GB HBM3 deviceQuery
logs show 85,017,755,648 / 85,028,896,768 / 85,045,477,376 bytes), so treat every figure as
+-0.1 % and prefer a measured ``total_memory`` when you have the machine.

cuBLAS workspace
----------------
Source: ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (pytorch/pytorch).
``getCurrentCUDABlasHandle`` -> ``setWorkspaceForHandle`` allocates, through the CUDA caching
allocator, one workspace of ``getChosenWorkspaceSize()`` bytes per (cuBLAS handle, stream) pair
(``cublas_handle_stream_to_workspace``).  ``getChosenWorkspaceSize`` returns the override set by
``torch.backends.cuda.cublas_workspace_size(n)`` if any, else ``parseChosenWorkspaceSize()``::

    /* :4096:2:16:8 default, 32MiB for Hopper and Blackwell */
    const bool use32mb = properties != nullptr &&
        (properties->major == 9 || properties->major == 10 ||
         properties->major == 11 || properties->major == 12);
    const size_t default_size = use32mb ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8;

and ``CUBLAS_WORKSPACE_CONFIG`` is parsed with ``std::regex exp(":([0-9]+):([0-9]+)")``, summing
``curr_size * 1024 * count`` over all matches; no match -> TORCH_WARN and the default.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field

from estimator.vocab.errors import InputError
from estimator.vocab.units import GiB, MiB, format_bytes, parse_bytes

__all__ = [
    "CUBLASLT_DEFAULT_KIB",
    "DEFAULT_WORKSPACE_BYTES",
    "GPUS",
    "HOPPER_PLUS_WORKSPACE_BYTES",
    "GpuSpec",
    "cublas_workspace_bytes",
    "cublaslt_extra_bytes",
    "cublaslt_workspace_bytes",
    "estimated_notes",
    "resolve_gpu",
]

# parseChosenWorkspaceSize: `4096 * 1024 * 2 + 16 * 1024 * 8` = 8,388,608 + 131,072 = 8,519,680
DEFAULT_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
# parseChosenWorkspaceSize: `4096 * 8 * 1024` = 33,554,432 = 32 MiB (major 9, 10, 11, 12)
HOPPER_PLUS_WORKSPACE_BYTES = 4096 * 8 * 1024
# Majors that get 32 MiB in the newest stored CublasHandlePool.cpp.  Older revisions used
# `major == 9 && minor == 0` (sm_90 only), then `9 || 10 || 12`; sm_90 is 32 MiB in all of them.
_WORKSPACE_32MB_MAJORS = frozenset({9, 10, 11, 12})
# parseCUDABlasLtWorkspaceSize: `size_t workspace_size = 1024; /* default size in KiB ... #73328 */`
CUBLASLT_DEFAULT_KIB = 1024

_INT32_MAX = 2**31 - 1
_SIZE_T_MAX = 2**64 - 1


@dataclass(frozen=True)
class GpuSpec:
    """One GPU target.  ``major``/``minor`` is the compute capability; ``None`` when unknown
    (a bare memory figure).  ``total_memory`` is bytes, ``None`` when unknown (a bare arch)."""

    name: str
    major: int | None
    minor: int | None
    total_memory: int | None
    exact: bool = False  # True: an observed cudaDeviceProp.totalGlobalMem; False: nominal/approx.
    aliases: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # The bare family name the user typed when this variant was taken for it ("A100"); None when
    # the name said which GPU.  Not part of equality: the GPU is the same either way.
    taken_for: str | None = field(default=None, compare=False)

    @property
    def sm_count(self) -> int | None:
        """``cudaDeviceProp.multiProcessorCount`` from NVIDIA's specifications (None: unknown)."""
        return SM_COUNTS.get(self.name)

    @property
    def arch(self) -> str | None:
        """``"sm_90"`` style string, ``None`` when the compute capability is unknown."""
        if self.major is None or self.minor is None:
            return None
        return f"sm_{self.major}{self.minor}"

    def describe(self) -> str:
        """The GPU as a report's first line names it: a variant taken for a bare family name says
        so, and that the other variants' memory (the default budget of ``max_batch``/``fits``)
        differs."""
        if self.taken_for is None:
            return self.name
        others = "; ".join(f'say "{ask}" for the {name}' for name, ask in _FAMILIES[_norm(self.taken_for)][1])
        return (f'{self.name}, taken for "{self.taken_for}"; memory differs between variants: budgets use this '
                f"one's {format_bytes(self.total_memory)}, {others}")


# multiProcessorCount by GPU, from NVIDIA's published specifications (not measured here): the
# kernels' split heuristics (flash split-KV, norm-backward partial sums, embedding backward).
SM_COUNTS = {
    "NVIDIA H200": 132, "NVIDIA H100 80GB HBM3": 132, "NVIDIA H100 PCIe": 114,
    "NVIDIA A100-SXM4-40GB": 108, "NVIDIA A100-SXM4-80GB": 108, "NVIDIA A10": 72, "NVIDIA A10G": 80,
    "NVIDIA L4": 58, "NVIDIA L40S": 142, "Tesla T4": 40, "Tesla V100-SXM2-16GB": 80,
    "Tesla V100-SXM2-32GB": 80, "NVIDIA GeForce RTX 4090": 128, "NVIDIA GeForce RTX 3090": 82,
    "NVIDIA GeForce RTX 4070 Ti SUPER": 66,
}

GPUS: tuple[GpuSpec, ...] = (
    # torch repr `_CudaDeviceProperties(name='NVIDIA H200', ..., total_memory=143156MB)`:
    # 143156 * 2**20 = 150,109,945,856 B (~139.8 GiB); the repr floors to MiB -> approximate.
    GpuSpec("NVIDIA H200", 9, 0, 143156 * MiB, False,
            ("h200", "h200 141gb", "h200 sxm", "h200 141gb hbm3e")),
    # deviceQuery "81106 MBytes (85045477376 bytes)" (driver 12.7 / runtime 12.4): observed.
    GpuSpec("NVIDIA H100 80GB HBM3", 9, 0, 85_045_477_376, True,
            ("h100", "h100 sxm", "h100 sxm5", "h100 80gb", "h100 sxm 80gb", "h100 80gb hbm3",
             "h100 sxm5 80gb")),
    # nominal 80 GiB = 85,899,345,920 B; no observed figure found.
    GpuSpec("NVIDIA H100 PCIe", 9, 0, 80 * GiB, False,
            ("h100 pcie", "h100 pcie 80gb", "h100 80gb pcie")),
    # deviceQuery "40339 MBytes (42298834944 bytes)": observed.
    GpuSpec("NVIDIA A100-SXM4-40GB", 8, 0, 42_298_834_944, True,
            ("a100 40gb", "a100 sxm4 40gb", "a100 pcie 40gb", "a100 40gb pcie")),
    # deviceQuery "81158 MBytes (85100068864 bytes)" (another log: 84,987,740,160): observed.
    GpuSpec("NVIDIA A100-SXM4-80GB", 8, 0, 85_100_068_864, True,
            ("a100 80gb", "a100 sxm4 80gb", "a100 80gb pcie", "a100 pcie 80gb")),
    # nominal 24 GiB = 25,769,803,776 B.
    GpuSpec("NVIDIA A10", 8, 6, 24 * GiB, False, ("a10", "a10 24gb")),
    # nominal 24 GiB = 25,769,803,776 B (AWS g5).
    GpuSpec("NVIDIA A10G", 8, 6, 24 * GiB, False, ("a10g", "a10g 24gb")),
    # nominal 24 GiB = 25,769,803,776 B.
    GpuSpec("NVIDIA L4", 8, 9, 24 * GiB, False, ("l4", "l4 24gb")),
    # nominal 48 GiB = 51,539,607,552 B.
    GpuSpec("NVIDIA L40S", 8, 9, 48 * GiB, False, ("l40s", "l40s 48gb")),
    # deviceQuery "15110 MBytes (15843721216 bytes)" (driver 11.2): observed.
    GpuSpec("Tesla T4", 7, 5, 15_843_721_216, True, ("t4", "t4 16gb")),
    # nominal 16 GiB = 17,179,869,184 B.
    GpuSpec("Tesla V100-SXM2-16GB", 7, 0, 16 * GiB, False,
            ("v100 16gb", "v100 sxm2 16gb", "v100 pcie 16gb")),
    # nominal 32 GiB = 34,359,738,368 B.
    GpuSpec("Tesla V100-SXM2-32GB", 7, 0, 32 * GiB, False,
            ("v100 32gb", "v100 sxm2 32gb", "v100 pcie 32gb")),
    # deviceQuery on Linux "24081 MBytes (25250627584 bytes)" (driver 13.0): observed; Windows
    # reports much less (24,146,083,840 under WDDM).
    GpuSpec("NVIDIA GeForce RTX 4090", 8, 9, 25_250_627_584, True,
            ("rtx 4090", "4090", "rtx4090 24gb", "rtx 4090 24gb")),
    # nominal 24 GiB = 25,769,803,776 B.
    GpuSpec("NVIDIA GeForce RTX 3090", 8, 6, 24 * GiB, False,
            ("rtx 3090", "3090", "rtx 3090 24gb")),
    # nominal 16 GiB = 17,179,869,184 B (AD103, 66 SMs; torchao's optimizer benchmarks ran on one).
    GpuSpec("NVIDIA GeForce RTX 4070 Ti SUPER", 8, 9, 16 * GiB, False,
            ("rtx 4070 ti super", "4070 ti super", "rtx 4070 ti super 16gb")),
)

# Bare family names that match several rows: the variant taken, and the others (with a name
# that asks for each).  The architecture is the same across a family, the memory is not, so the
# choice only moves the default budget of max_batch/fits (the report's first line says which
# was taken).  Taken: the smaller-memory variant of each.  It is the common one -- the launch
# parts (A100 40GB SXM4 in 2020, V100 16GB in 2017) and the cloud defaults (AWS p4d.24xlarge,
# GCP a2-highgpu, Azure ND96asr_v4: A100 40GB; AWS p3.*, GCP nvidia-tesla-v100: V100 16GB; the
# 80GB / 32GB parts are the separate p4de / a2-ultragpu / NDm A100 v4 / p3dn instances) -- and
# the safe one: a batch budgeted for 40 GB (16 GB) also fits the 80 GB (32 GB) card, the
# reverse would overflow the smaller card by up to 2x.  "H100" needs no entry: its aliases
# name the SXM part (the PCIe part has the same 80 GB).
_A100 = ("NVIDIA A100-SXM4-40GB", (("NVIDIA A100-SXM4-80GB", "A100 80GB"),))
_V100 = ("Tesla V100-SXM2-16GB", (("Tesla V100-SXM2-32GB", "V100 32GB"),))
_FAMILIES: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "a100": _A100, "a100sxm4": _A100, "a100sxm": _A100, "a100pcie": _A100,
    "v100": _V100, "v100sxm2": _V100, "v100sxm": _V100, "v100pcie": _V100,
}

_DROP_WORDS = re.compile(r"\b(nvidia|geforce|tesla)\b")


def _norm(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h10080gbhbm3"``; ``"h100-80gb"`` -> ``"h10080gb"``."""
    text = _DROP_WORDS.sub(" ", text.lower())
    return re.sub(r"[^a-z0-9]", "", text)


_BY_KEY: dict[str, GpuSpec] = {}
for _spec in GPUS:
    for _key in (_spec.name, *_spec.aliases):
        _BY_KEY.setdefault(_norm(_key), _spec)

_ARCH = re.compile(r"^\s*(?:sm|compute)_?(\d+)(\d)a?\s*$", re.IGNORECASE)
_MEMORY = re.compile(r"^\s*[0-9]*\.?[0-9]+\s*[a-zA-Z]+\s*$")

_FORMS = ("accepted forms: a GPU name (e.g. 'H100', 'NVIDIA H100 80GB HBM3', 'a100-80gb', "
          "'rtx 4090'), an arch 'sm_90' / 'sm_80', or a memory size as bytes (int) or a string "
          "with a unit such as '80GiB' / '40 GB'")


def resolve_gpu(spec: str | int | GpuSpec) -> GpuSpec:
    """A :class:`GpuSpec` from a name, an arch string, or a memory figure.

    * name: case-insensitive; punctuation and the words NVIDIA/GeForce/Tesla are ignored, so
      ``"NVIDIA H100 80GB HBM3"``, ``"h100-80gb"`` and ``"H100"`` all give the H100 SXM row.
    * arch: ``"sm_90"``, ``"sm90"``, ``"sm_90a"`` -> compute capability, ``total_memory=None``.
    * memory: an int of bytes, or a string with a unit (``"80GiB"``) via
      :func:`estimator.vocab.units.parse_bytes` -> ``major=minor=None``.

    * a bare family name whose variants differ in memory (``"A100"``, ``"V100"``): the
      smaller-memory variant, with ``taken_for`` set to what was typed (``GpuSpec.describe``
      says so in the report).

    Unknown names raise :class:`InputError` with close matches; nothing else defaults.
    """
    if isinstance(spec, GpuSpec):
        return spec
    if isinstance(spec, bool):
        raise InputError(f"cannot use {spec!r} as a GPU; {_FORMS}")
    if isinstance(spec, int):
        size = parse_bytes(spec)
        return GpuSpec(f"{format_bytes(size)} GPU", None, None, size, True)
    if not isinstance(spec, str):
        raise InputError(f"cannot use a {type(spec).__name__} as a GPU; {_FORMS}")

    key = _norm(spec)
    if key in _BY_KEY:
        return _BY_KEY[key]
    if key in _FAMILIES:
        taken = next(s for s in GPUS if s.name == _FAMILIES[key][0])
        return dataclasses.replace(taken, taken_for=spec.strip())
    arch = _ARCH.match(spec)
    if arch:
        major, minor = int(arch.group(1)), int(arch.group(2))
        return GpuSpec(f"sm_{major}{minor}", major, minor, None, False)
    if _MEMORY.match(spec):
        size = parse_bytes(spec)  # raises InputError for an unknown unit
        return GpuSpec(f"{format_bytes(size)} GPU", None, None, size, True)

    names = list(dict.fromkeys([s.name for s in GPUS] + [a for s in GPUS for a in s.aliases]))
    close = difflib.get_close_matches(spec.lower(), [n.lower() for n in names], n=4, cutoff=0.5)
    if not close:  # also compare the normalized forms ("h1OO" style typos, punctuation)
        by_norm = {_norm(n): n for n in names}
        close = [by_norm[k] for k in difflib.get_close_matches(key, list(by_norm), n=4, cutoff=0.5)]
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    raise InputError(f"unknown GPU {spec!r}: {hint}{_FORMS}; known GPUs: "
                     f"{', '.join(s.name for s in GPUS)}")


# The CUDA context: the driver's per-process state and the kernels loaded into device memory,
# outside the caching allocator (nvidia-smi counts it, torch.cuda.max_memory_reserved does
# not).  Nothing in PyTorch's source sizes it; published measurements (pytorch/pytorch):
# - PR #85692 / #86509 (2022, the PR that makes PyTorch set CUDA_MODULE_LOADING=LAZY when it is
#   unset, from 1.13): cudaMemGetInfo total - free after one 6,400,000 B tensor is 287,047,680 B
#   with lazy loading, 666,632,192 B with CUDA_MODULE_LOADING=DEFAULT (eager under CUDA 11.x).
#   Less the allocator's one 20 MiB segment (a 1-10 MiB request gets kLargeBuffer): 266,076,160 B
#   (253.75 MiB) and 645,660,672 B (615.75 MiB) of context.
# - issue #107667 (ptrblck, 2023): "~300MB" with lazy loading (CUDA >= 11.7); before 11.7 all
#   kernels were loaded at start, ">1000MB".  Issue #109888 (ptrblck, 2023): "around 400MB"
#   with CUDA >= 11.7 and lazy loading.  Issue #55277: 1,687 MB (RTX 3090, CUDA 11.1, eager).
# Lazy loading is CUDA's default since 12.2 (Linux); it loads a kernel at its first launch, so
# the context grows as the step's kernels (cuDNN's, cuBLAS's) load: those figures are before.
CONTEXT_LAZY_RANGE = (266_076_160, 400 * MiB)  # bytes, bare context, lazy module loading ("400MB": read as MiB)
CONTEXT_EAGER_RANGE = (645_660_672, 1_687 * 10**6)  # bytes, every kernel loaded at start


def estimated_notes(context_bytes: int, module_loading: str | None = None) -> tuple[str, ...]:
    """The report's note on the CUDA context: how ``context_bytes`` was had and the range it can
    be in.  ``module_loading`` is ``CUDA_MODULE_LOADING`` (default: this process's environment,
    what the job would run with).  Lazy unless it says ``EAGER`` (PyTorch sets ``LAZY`` when it is
    unset; ``DEFAULT`` is lazy since CUDA 12.2)."""
    from estimator.vocab.target import DEFAULT_CONTEXT_BYTES  # spec imports this module

    if module_loading is None:
        module_loading = os.environ.get("CUDA_MODULE_LOADING", "")
    eager = module_loading.strip().upper() == "EAGER"
    how = ("fxmem's estimate" if context_bytes == DEFAULT_CONTEXT_BYTES else "as given")
    lo, hi = (_mib(n) for n in CONTEXT_LAZY_RANGE)
    elo, ehi = (_mib(n) for n in CONTEXT_EAGER_RANGE)
    loading = (f"CUDA_MODULE_LOADING=EAGER here: every kernel loads at start, typically {elo} to {ehi} (lazy: "
               f"{lo} to {hi})" if eager else
               f"typically {lo} to {hi} with lazy module loading (the default: PyTorch "
               "sets CUDA_MODULE_LOADING=LAZY when unset, CUDA >= 11.7), before the step's kernels load (cuDNN's "
               f"and cuBLAS's load at their first launch); {elo} to {ehi} with "
               "CUDA_MODULE_LOADING=EAGER or CUDA < 11.7")
    return (f"CUDA context: {format_bytes(context_bytes)} ({how}): the driver's state and loaded kernels, outside "
            "the caching allocator (in nvidia-smi's figure and subtracted from max_batch/fits budgets, not in "
            f"max_memory_reserved); not derivable from PyTorch's source, it depends on the driver, the CUDA version "
            f"and the kernels loaded: {loading} (measured in pytorch/pytorch#85692, #107667, #109888, #55277); "
            "measure it as nvidia-smi's used memory minus torch.cuda.max_memory_reserved()",)


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f} MiB"


def _capability(arch_or_spec) -> tuple[int | None, int | None]:
    if isinstance(arch_or_spec, tuple) and len(arch_or_spec) == 2:
        return int(arch_or_spec[0]), int(arch_or_spec[1])
    spec = resolve_gpu(arch_or_spec)
    return spec.major, spec.minor


def _default_workspace(arch_or_spec) -> int:
    major, _ = _capability(arch_or_spec)
    if major is None:
        raise InputError(
            f"the default cuBLAS workspace depends on the compute capability, which {arch_or_spec!r} "
            "does not give: pass a GPU name or an arch such as 'sm_90'")
    return HOPPER_PLUS_WORKSPACE_BYTES if major in _WORKSPACE_32MB_MAJORS else DEFAULT_WORKSPACE_BYTES


def cublas_workspace_bytes(arch_or_spec: str | int | GpuSpec | tuple[int, int],
                           env: str | None = None) -> int:
    """Bytes of one cuBLAS workspace, as ``getChosenWorkspaceSize()`` / ``parseChosenWorkspaceSize()``
    in ``aten/src/ATen/cuda/CublasHandlePool.cpp`` compute it.

    PyTorch allocates one of these through the caching allocator per (cuBLAS handle, stream)
    (``setWorkspaceForHandle``), i.e. usually one per thread and stream that runs a matmul.

    ``env`` is the value of ``CUBLAS_WORKSPACE_CONFIG`` (``None``: unset):

    * unset -> the default by compute capability: major 9/10/11/12 (Hopper, Blackwell)
      ``4096 * 8 * 1024`` = 33,554,432 B; otherwise ``4096 * 1024 * 2 + 16 * 1024 * 8`` =
      8,519,680 B (``:4096:2:16:8``).
    * set -> every ``:SIZE:COUNT`` match of ``:([0-9]+):([0-9]+)`` anywhere in the string
      contributes ``SIZE * 1024 * COUNT``; ``":4096:8"`` -> 33,554,432.
    * set but with no match (``""``, ``"4096:8"``, ``"garbage"``) -> the source warns
      ("Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size") and uses the
      default; so does this function.
    * a number past ``unsigned long long`` makes ``std::stoull`` throw in the source; here
      :class:`InputError`.  So does a total past ``size_t`` (the source would wrap silently).

    Not modelled: ``torch.backends.cuda.cublas_workspace_size(n)`` overrides all of this with
    ``n`` bytes; ROCm (``HIPBLAS_WORKSPACE_CONFIG``, 32/128 MiB defaults).
    """
    if env is None:
        return _default_workspace(arch_or_spec)
    matches = re.findall(r":([0-9]+):([0-9]+)", env)
    if not matches:
        return _default_workspace(arch_or_spec)
    total = 0
    for size_kib, count in matches:
        size_kib, count = int(size_kib), int(count)
        if size_kib > _SIZE_T_MAX or count > _SIZE_T_MAX:
            raise InputError(f"CUBLAS_WORKSPACE_CONFIG={env!r}: a number is out of range "
                             "(PyTorch's std::stoull throws); use ':SIZE_KiB:COUNT' with sane values")
        total += size_kib * 1024 * count
    if total > _SIZE_T_MAX:
        raise InputError(f"CUBLAS_WORKSPACE_CONFIG={env!r} asks for more than 2**64 bytes")
    return total


def _parse_lt_env(env: str) -> int | None:
    """KiB from ``CUBLASLT_WORKSPACE_SIZE`` the way ``std::stoi`` reads it; None -> use default."""
    match = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", env)
    if match is None:
        return None  # std::invalid_argument -> TORCH_WARN, default
    value = int(match.group(1))
    if not -_INT32_MAX - 1 <= value <= _INT32_MAX:
        return None  # std::out_of_range -> TORCH_WARN, default
    if value < 0:
        raise InputError(f"CUBLASLT_WORKSPACE_SIZE={env!r} is negative; PyTorch would wrap it to an "
                         "enormous size_t. Give a size in KiB, e.g. 1024")
    return value


def cublaslt_workspace_bytes(arch_or_spec: str | int | GpuSpec | tuple[int, int],
                             env: str | None = None, *, cublas_env: str | None = None,
                             unified: bool = True) -> int:
    """Bytes of the cuBLASLt workspace, as ``getCUDABlasLtWorkspaceSize()`` /
    ``parseCUDABlasLtWorkspaceSize()`` in ``CublasHandlePool.cpp`` compute it.

    ``env`` is ``CUBLASLT_WORKSPACE_SIZE`` in **KiB**, read with ``std::stoi`` (leading digits;
    trailing junk ignored).  Default ``1024`` KiB = 1,048,576 B ("default size in KiB according to
    #73328").  Not a number or out of ``int`` range -> the source warns and keeps the default;
    so does this function.  Negative -> :class:`InputError` (the source would wrap).

    ``unified`` is ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` (on by default in open-source CUDA
    builds: unset or ``1``): the Lt size is then capped at :func:`cublas_workspace_bytes`
    (computed with ``cublas_env``), and the Lt workspace *is* the cuBLAS workspace of the same
    (handle, stream) -- see :func:`cublaslt_extra_bytes` for what it adds to memory.
    """
    kib = CUBLASLT_DEFAULT_KIB
    if env is not None:
        parsed = _parse_lt_env(env)
        if parsed is not None:
            kib = parsed
    size = kib * 1024
    if unified:
        size = min(size, cublas_workspace_bytes(arch_or_spec, cublas_env))
    return size


def cublaslt_extra_bytes(arch_or_spec: str | int | GpuSpec | tuple[int, int],
                         env: str | None = None, *, cublas_env: str | None = None,
                         unified: bool = True) -> int:
    """Bytes the cuBLASLt workspace adds on top of the cuBLAS workspace, per (handle, stream).

    Unified (default): ``getCUDABlasLtWorkspace`` returns the entry of
    ``cublas_handle_stream_to_workspace`` for the same key -> 0 extra.  Not unified
    (``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``): a separate ``cublaslt_handle_stream_to_workspace``
    allocation of :func:`cublaslt_workspace_bytes`.
    """
    if unified:
        return 0
    return cublaslt_workspace_bytes(arch_or_spec, env, cublas_env=cublas_env, unified=False)
