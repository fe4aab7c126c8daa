"""What the prediction is for: the target device and, for CUDA, the GPU and its settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from estimator.vocab.allocator_options import AllocatorConfig
from estimator.vocab.categories import Target
from estimator.vocab.errors import InputError
from estimator.vocab.gpus import GpuSpec, resolve_gpu
from estimator.vocab.units import MiB, parse_bytes

# The GPU assumed when no gpu= is given (device="cuda" is report()'s default; the report's first
# line and a note say so).
DEFAULT_GPU = "H100"
# The CUDA context and the libraries' code loaded into device memory, outside the caching
# allocator (what nvidia-smi shows on top of max_memory_reserved).  Not derivable from source:
# it depends on the driver, the CUDA version and which kernels were loaded (lazy loading,
# CUDA_MODULE_LOADING=LAZY, is the default since CUDA 11.7).  An estimate until the GPU
# validator measures it (validators/gpu.py reports device_used - max_reserved).
DEFAULT_CONTEXT_BYTES = 512 * MiB


@dataclass(frozen=True)
class TargetSpec:
    device: Target = Target.CPU
    gpu: GpuSpec | None = None  # CUDA: architecture (backend choices) and capacity
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)  # PYTORCH_CUDA_ALLOC_CONF
    cublas_workspace_config: str | None = None  # CUBLAS_WORKSPACE_CONFIG
    context_bytes: int = DEFAULT_CONTEXT_BYTES
    # CUDA: no gpu= was given and ``gpu`` is DEFAULT_GPU (the report's first line says so).
    default_gpu: bool = field(default=False, compare=False)

    @property
    def is_cuda(self) -> bool:
        return self.device is Target.CUDA

    @property
    def capability(self) -> tuple[int, int]:
        """The GPU's compute capability (CUDA targets)."""
        if self.gpu is None or self.gpu.major is None:
            raise InputError("this needs the GPU's architecture: pass gpu='H100' or gpu='sm_90'")
        return self.gpu.major, self.gpu.minor


def target_spec(device: str, gpu=None, alloc_conf: str | None = None, context_bytes=None) -> tuple[TargetSpec, list[str]]:
    """The ``TargetSpec`` for ``report(device=, gpu=, alloc_conf=)`` and the notes to report.

    For CUDA, ``alloc_conf`` defaults to the environment's ``PYTORCH_CUDA_ALLOC_CONF`` and the
    cuBLAS workspace to ``CUBLAS_WORKSPACE_CONFIG``: what the job would run with.
    """
    target = Target(device)
    notes: list[str] = []
    if target is Target.CPU:
        if gpu is not None or alloc_conf is not None:
            given = [name for name, value in (("gpu=", gpu), ("alloc_conf=", alloc_conf)) if value is not None]
            raise InputError(f"{' and '.join(given)} describe{'s' * (len(given) == 1)} a CUDA target but device='cpu' "
                             f"asks for the CPU: drop device='cpu' (CUDA is the default) or drop {' and '.join(given)}")
        return TargetSpec(), notes
    default_gpu = gpu is None
    if default_gpu:
        gpu = DEFAULT_GPU
    spec_gpu = resolve_gpu(gpu)
    if default_gpu:
        notes.append(f"no gpu= given (CLI: --gpu): the prediction is for the default GPU, the {spec_gpu.name}: its "
                     "architecture decides kernel choices and workspaces, its memory is the default budget of "
                     "max_batch/fits; name yours (gpu='A100 80GB', 'RTX 4090', 'sm_86' or a memory size such as "
                     "'24GiB'), or device='cpu' for the CPU")
    if spec_gpu.major is None:  # a bare memory figure: capacity only
        arch = resolve_gpu(DEFAULT_GPU)
        notes.append(f"gpu={gpu!r} gives a capacity but no architecture: kernel choices are those of the {arch.name}")
        spec_gpu = GpuSpec(spec_gpu.name, arch.major, arch.minor, spec_gpu.total_memory, spec_gpu.exact)
    if alloc_conf is None:
        alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    context = DEFAULT_CONTEXT_BYTES if context_bytes is None else parse_bytes(context_bytes)
    return TargetSpec(
        Target.CUDA, spec_gpu, AllocatorConfig.parse(alloc_conf), os.environ.get("CUBLAS_WORKSPACE_CONFIG"), context,
        default_gpu,
    ), notes
