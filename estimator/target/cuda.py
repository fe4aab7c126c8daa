"""What a captured step takes on a CUDA device: the caching allocator's view and the fixed costs.

``predict(timeline, b, spec)`` replays the step's allocations at batch size ``b`` through the
model of ``c10/cuda/CUDACachingAllocator.cpp`` (``cuda_allocator``), with the cuBLAS
workspaces the step makes PyTorch hold, and returns what ``torch.cuda.max_memory_allocated``,
``max_memory_reserved`` and nvidia-smi would show.  The timeline must come from a capture
with the CUDA target (``estimator.corrections``: CUDA kernels and defaults).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from estimator.account import Timeline, allocation_events
from estimator.categories import Phase
from estimator.corrections.cuda import not_modelled
from estimator.target.cuda_allocator import replay
from estimator.target.gpus import cublas_workspace_bytes, cublaslt_extra_bytes
from estimator.target.spec import TargetSpec

# aten ops that run through cuBLAS / cuBLASLt on CUDA (aten/src/ATen/native/cuda/Blas.cpp:
# addmm_out_cuda_impl, baddbmm_out_cuda_impl, addmv, dot, vdot; linear and matmul decompose to them).
CUBLAS_OPS = frozenset({
    "mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
})


class Overhead(str, enum.Enum):
    """Memory on a CUDA device besides the tensors of the step."""

    CUBLAS_WORKSPACE = "cuBLAS workspace"  # held by PyTorch per (thread, stream); in max_memory_allocated
    ALLOCATOR_ROUNDING = "allocator rounding"  # blocks rounded to 512 B / 2 MiB; in max_memory_allocated
    ALLOCATOR_CACHE = "allocator cache"  # reserved segments not allocated at the peak
    CUDA_CONTEXT = "CUDA context"  # driver context and kernels; outside the allocator, seen by nvidia-smi


@dataclass(frozen=True)
class CudaMemory:
    """The predicted device memory of one step at one batch size (bytes)."""

    batch: int
    allocated: int  # torch.cuda.max_memory_allocated()
    reserved: int  # torch.cuda.max_memory_reserved()
    context: int  # the CUDA context and loaded kernels (outside the allocator)
    workspace: int  # cuBLAS workspaces held (part of ``allocated``)
    workspaces: int  # how many: one per thread that runs matmuls (forward: main, backward: autograd)
    segments: int  # allocator segments held at the end of the step

    @property
    def device(self) -> int:
        """nvidia-smi's "memory used" for the process: reserved + context."""
        return self.reserved + self.context


def cublas_workspaces(timeline: Timeline) -> int:
    """How many cuBLAS workspaces the step holds.

    ``getCurrentCUDABlasHandle`` (aten/src/ATen/cuda/CublasHandlePool.cpp) reserves a handle
    per *thread* (``thread_local myPoolWindow``) and ``setWorkspaceForHandle`` allocates one
    workspace per (handle, stream).  The forward and the optimizer step run on the Python
    thread; on CUDA the backward runs on the autograd engine's device thread
    (torch/csrc/autograd/engine.cpp, one thread per device): two workspaces when both run
    matmuls.
    """
    threads = set()
    for op in timeline.ops:
        namespace, _, rest = op.op.partition(".")
        if namespace == "aten" and rest.split(".")[0] in CUBLAS_OPS:
            threads.add(op.phase is Phase.BACKWARD)
    return len(threads)


def workspace_bytes(spec: TargetSpec) -> int:
    """One cuBLAS workspace (plus a separate cuBLASLt one when not unified), for the GPU."""
    return cublas_workspace_bytes(spec.gpu, spec.cublas_workspace_config) + cublaslt_extra_bytes(
        spec.gpu, cublas_env=spec.cublas_workspace_config
    )


def predict(timeline: Timeline, b: int, spec: TargetSpec, capacity: int | None = None) -> CudaMemory:
    """Replay the step at ``b`` through the caching-allocator model.

    The state alive before the step (parameters, buffers, optimizer state, inputs) is
    allocated first, then the workspaces (the warm-up step allocated them), then the step.
    ``capacity`` (bytes the allocator may reserve) raises ``OutOfMemory`` when exceeded.
    """
    count, size = cublas_workspaces(timeline), workspace_bytes(spec)
    workspaces = [(("cublas workspace", i), size) for i in range(count)]
    stats = replay(allocation_events(timeline, b, workspaces), spec.allocator, capacity)
    return CudaMemory(b, stats.peak_allocated, stats.peak_reserved, spec.context_bytes, count * size, count,
                      stats.segments)


def not_modelled_note() -> str:
    gaps = "; ".join(not_modelled())
    return (
        "CUDA target: kernels, optimizer defaults, cuBLAS workspaces and the caching allocator are modelled "
        "from PyTorch's source; the CUDA context is an estimate" + (f"; not modelled: {gaps}" if gaps else "")
    )
