"""What a captured step takes on a CUDA device: the caching allocator's view and the fixed costs.

``predict(timeline, b, spec)`` replays the step's allocations at batch size ``b`` through the
model of ``c10/cuda/CUDACachingAllocator.cpp`` (``cuda_allocator``), with the cuBLAS
workspaces the step makes PyTorch hold, and returns what ``torch.cuda.max_memory_allocated``,
``max_memory_reserved`` and nvidia-smi would show, twice: over a run from a cold start (the
model loaded, a first step that makes the optimizer state, steady steps without
``empty_cache()``: ``cuda_run``), which is what a user's job shows, and for one steady step
after ``empty_cache()`` with the state packed first (``step_*``).  The timeline must come from a
capture with the CUDA target (``estimator.corrections``: CUDA kernels and defaults).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from estimator.account import Timeline
from estimator.corrections.cuda import not_modelled
from estimator.devices.cuda_run import FORK_OPS, replay_both
from estimator.vocab import forked
from estimator.vocab.categories import Phase
from estimator.vocab.gpus import cublas_workspace_bytes, cublaslt_extra_bytes
from estimator.vocab.target import TargetSpec

# aten ops that run through cuBLAS / cuBLASLt on CUDA (aten/src/ATen/native/cuda/Blas.cpp:
# addmm_out_cuda_impl, baddbmm_out_cuda_impl, addmv, dot, vdot; linear and matmul decompose to them).
CUBLAS_OPS = frozenset({
    "mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
})


class Overhead(str, enum.Enum):
    """Memory on a CUDA device besides the tensors of the step."""

    CUBLAS_WORKSPACE = "cuBLAS workspace"  # held by PyTorch per (thread, stream); in max_memory_allocated
    PREVIOUS_OUTPUT = "previous step's output"  # a loop's `out`/`loss` alive until the next model call returns
    ALLOCATOR_ROUNDING = "allocator rounding"  # blocks rounded to 512 B / 2 MiB; in max_memory_allocated
    ALLOCATOR_CACHE = "allocator cache"  # reserved segments not allocated at the peak
    CUDA_CONTEXT = "CUDA context"  # driver context and kernels; outside the allocator, seen by nvidia-smi
    MANAGED = "CUDA managed memory"  # cudaMallocManaged buffers (paged optimizer state); outside the allocator


@dataclass(frozen=True)
class CudaMemory:
    """The predicted device memory of a run at one batch size (bytes)."""

    batch: int
    allocated: int  # torch.cuda.max_memory_allocated() after a run from a cold start
    reserved: int  # torch.cuda.max_memory_reserved() after that run: what the job holds
    context: int  # the CUDA context and loaded kernels (outside the allocator)
    workspace: int  # cuBLAS workspaces held (part of ``allocated``)
    workspaces: int  # how many: one per thread that runs matmuls (forward: main, backward: autograd)
    segments: int  # allocator segments held at the end of the run
    step_allocated: int = 0  # max_memory_allocated() of one step after a warm-up step and empty_cache()
    step_reserved: int = 0  # max_memory_reserved() of that step
    steps: int = 1  # steps the run replayed (until the allocator's state repeated)
    repeated: bool = True  # whether it repeated within cuda_run.MAX_STEPS (else: the max over those)
    carried: int = 0  # the previous step's output and loss alive at the run's allocated peak (a loop's `out`)
    managed: int = 0  # CUDA managed memory (bitsandbytes' paged optimizer state): outside the allocator

    @property
    def device(self) -> int:
        """nvidia-smi's "memory used" for the process: reserved + context + managed memory (while
        resident: the driver pages it out to host memory when the GPU runs out)."""
        return self.reserved + self.context + self.managed

    @property
    def outside_allocator(self) -> int:
        """Device memory the caching allocator does not hold: the CUDA context and managed memory."""
        return self.context + self.managed


def workspaces_held(timeline: Timeline, spec: TargetSpec) -> int:
    """Bytes the step's cuBLAS workspaces hold beside its tensors (``cublas_first_uses``, one
    ``workspace_bytes`` each); 0 on a CPU target.  What ``Report.peak`` adds to every op."""
    return len(cublas_first_uses(timeline)) * workspace_bytes(spec) if spec.is_cuda else 0


def cublas_first_uses(timeline: Timeline) -> list[int]:
    """The first op of each thread that runs cuBLAS matmuls: each holds a workspace from then on.

    ``getCurrentCUDABlasHandle`` (aten/src/ATen/cuda/CublasHandlePool.cpp) reserves a handle
    per *thread* (``thread_local myPoolWindow``) and ``setWorkspaceForHandle`` allocates one
    workspace per (handle, stream).  The forward and the optimizer step run on the Python
    thread; on CUDA the backward runs on the autograd engine's device thread
    (torch/csrc/autograd/engine.cpp, one thread per device): two workspaces when both run
    matmuls.
    """
    first: dict[bool, int] = {}
    cublas: dict[str, bool] = {}  # by overload (a long generate() has a million ops, of a few hundred overloads)
    for i, op in enumerate(timeline.ops):
        uses = cublas.get(op.op)
        if uses is None:
            namespace, _, rest = op.op.partition(".")
            uses = cublas[op.op] = namespace == "aten" and rest.split(".")[0] in CUBLAS_OPS
        if uses:
            first.setdefault(op.phase is Phase.BACKWARD, i)
    return sorted(first.values())


def workspace_bytes(spec: TargetSpec) -> int:
    """One cuBLAS workspace (plus a separate cuBLASLt one when not unified), for the GPU."""
    return cublas_workspace_bytes(spec.gpu, spec.cublas_workspace_config) + cublaslt_extra_bytes(
        spec.gpu, cublas_env=spec.cublas_workspace_config
    )


def predict(timeline: Timeline, b: int, spec: TargetSpec, capacity: int | None = None) -> CudaMemory:
    """Replay a run (``cuda_run.replay_run``) and one step after a warm-up step and
    ``empty_cache()`` (``cuda_run.replay_step``) at ``b`` through the caching-allocator model
    (``cuda_run.replay_both``: the first step's ops once).
    ``capacity`` (bytes the allocator may reserve) raises ``OutOfMemory`` when exceeded."""
    firsts, size = cublas_first_uses(timeline), workspace_bytes(spec)
    workspaces = [(i, size) for i in firsts]
    total = None if spec.gpu is None else spec.gpu.total_memory
    run, step = replay_both(timeline, b, spec.allocator, workspaces, capacity, total)
    stats = run.stats
    return CudaMemory(b, stats.peak_allocated, stats.peak_reserved, spec.context_bytes, len(firsts) * size,
                      len(firsts), stats.segments, step.peak_allocated, step.peak_reserved, run.steps, run.repeated,
                      run.carried, timeline.managed)


def predict_started(timeline: Callable[[], Timeline], ops: int, b: int, spec: TargetSpec) -> forked.Started[CudaMemory]:
    """``predict`` of ``timeline()`` (a timeline of ``ops`` ops, or one made in the process that
    replays it: ``account.skeleton``), started in a forked process where the timeline is long
    (``cuda_run.FORK_OPS`` ops: a long ``generate()``), so that what the caller computes before
    asking for its result runs beside it (``vocab.forked``); else run when asked."""
    def work() -> CudaMemory:
        return predict(timeline(), b, spec)

    return forked.started(work) if ops >= FORK_OPS else forked.Started(work)


def not_modelled_note(ran=None) -> str:
    """What the CUDA target does not model, of what applies to a step that ran the aten ops
    ``ran`` (None: all of it)."""
    gaps = "; ".join(not_modelled(ran))
    return (
        "CUDA target: kernels, optimizer defaults, cuBLAS workspaces and the caching allocator are modelled "
        "from PyTorch's source (the CUDA context is estimated: its own note)" + (f"; not modelled: {gaps}" if gaps else "")
    )


def managed_notes(managed: int) -> tuple[str, ...]:
    """What managed memory (``Timeline.managed``) is, where a step keeps any."""
    if not managed:
        return ()
    return (f"CUDA managed memory: {managed:,} B of paged optimizer state (bitsandbytes' paged optimizers keep "
            "state buffers of 100,000 elements or more in cudaMallocManaged memory): outside the caching allocator, "
            "so not in max_memory_allocated/reserved; in the device figure (nvidia-smi) and subtracted from "
            "max_batch/fits budgets while resident, which is a worst case: the driver pages it out to host memory "
            "when the GPU runs out, at the cost of speed",)


def run_note(memory: CudaMemory) -> str:
    """How the run's figures were found, and the single-step figures beside them."""
    how = (f"the allocator's state repeats from step {memory.steps}" if memory.repeated else
           f"the figures were unchanged over the last 4 of {memory.steps} steps; the allocator's layout had not "
           "repeated yet")
    carried = (f"; the previous step's output and loss, alive until the next model call returns (out = model(x) in a "
               f"loop), hold {memory.carried:,} B at the run's peak" if memory.carried else "")
    return (f"CUDA: max_memory_allocated/reserved are those of a run from a cold start (model.to('cuda'), the "
            f"optimizer state made by the first optimizer.step(), steps without empty_cache(): {how}){carried}; "
            f"one step after a warm-up step and empty_cache() (a benchmark's protocol): "
            f"{memory.step_allocated:,} B allocated, {memory.step_reserved:,} B reserved")
