"""A job's ranks without processes: the user's parallelize function on a fake process group.

``Strategy(mesh={"dp_shard": 4, "tp": 2}, parallelize=fn)``: the capture of rank ``r`` joins a
fake process group of the mesh's world size as ``r`` (``torch.distributed``'s ``"fake"``
backend: collectives return at once and write nothing, whatever the world size), builds the
``DeviceMesh`` the job builds (``init_device_mesh``, with the user's dim names), and calls
``fn(model, mesh)`` on the fake copy of the model before its state is made.  The step then runs
as written: DTensor ops dispatch to their local shards, FSDP2 all-gathers and reduce-scatters,
and the capture records what each rank allocates (the collectives' outputs are the caller's
tensors; what a backend allocates besides is a correction per op, e.g.
``corrections/cpu/collectives.py`` for gloo).

Ranks whose parameters and buffers have the same local shapes run the same program (FSDP2's
shards of a dim that does not divide evenly are smaller on the last ranks; so are tensor
parallelism's): ``roles`` groups them, and one rank of each group is captured.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from estimator.corrections.patches import patched
from estimator.vocab.errors import CaptureError, FxmemError, InputError
from estimator.vocab.strategy import function_name


@contextlib.contextmanager
def joined(mesh: tuple[tuple[str, int], ...], rank: int) -> Iterator:
    """This process as rank ``rank`` of a fake process group of the mesh's size; yields the
    ``DeviceMesh`` (``mesh``: ``(dim name, size)`` pairs, outermost first).  Its device is the
    CPU, where the capture's fake tensors live on either target (the CUDA target follows CUDA's
    kernels on them; ``torch.cpu``'s streams stand for CUDA's, ``Tracker._stream``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise InputError("a torch.distributed process group is already initialized in this process: fxmem's capture "
                         "of Strategy(mesh=) runs your parallelize function on a fake process group of its own; "
                         "estimate before init_process_group(), or in a process of its own")
    world = math.prod(size for _, size in mesh)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", tuple(size for _, size in mesh),
                               mesh_dim_names=tuple(name for name, _ in mesh))
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans.  They are keyed by
    specs that compare meshes by value, so the next capture's equal mesh would get back specs
    holding this one's (found: a second FSDP x TP capture in one process counted the first
    one's rank map too, +16 B)."""
    import torch.distributed.tensor._redistribute as redistribute
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    for clear in (getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
                  getattr(redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", None)):
        if clear is not None:
            clear()


def notes(mesh: tuple[tuple[str, int], ...], cuda: bool) -> tuple[str, ...]:
    """What a mesh's capture leaves out, for the report's notes."""
    world = math.prod(size for _, size in mesh)
    common = (f"each rank's step is your parallelize function's, captured on a fake process group of {world} ranks "
              "(one capture per group of ranks whose shards have the same shapes)")
    if not cuda:
        return (common + "; gloo's buffers around each collective are counted (ProcessGroupGloo.cpp), memory gloo "
                "allocates outside PyTorch's CPU allocator is not",)
    return (common + "; on the CUDA target the caching allocator keeps a pool per stream, and the allocations "
            "your job makes on side streams (FSDP2's all-gather copy-in and reduce-scatter streams) are replayed on "
            "theirs; the collectives are counted as the step's tensors only: NCCL's own buffers (outside the caching "
            "allocator, per communicator: NCCL_BUFFSIZE, 4 MiB by default, per channel and peer; nvidia-smi shows "
            "them, max_memory_allocated does not) are NOT modelled, nor is a freed block that the GPU still uses on "
            "another stream waiting for it (recordStream's events: timing, which the replay does not have): treat "
            "the device figure as a lower bound",)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a DTensor's local shard: the tensor that holds a rank's memory."""
    return t._local_tensor if type(t).__name__ == "DTensor" else t


def rank_maps(model: nn.Module) -> dict[str, torch.Tensor]:
    """The rank maps of the meshes the model's DTensors are placed on, by name: each a tensor of
    the world's ranks (``init_device_mesh``: ``torch.arange(world, dtype=torch.int)`` on the CPU,
    shared by its sub-meshes), alive as long as a DTensor's spec holds its mesh: memory of the
    job on the host.  (A mesh that no DTensor uses is freed with the job's last reference to it.)"""
    from torch.distributed.tensor import DTensor

    found = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if isinstance(t, DTensor):
            ranks = getattr(t.device_mesh, "_rank_map", None)
            ranks = t.device_mesh.mesh if ranks is None else ranks
            found.setdefault(ranks.untyped_storage()._cdata, ranks)
    return {f"device mesh {i}": ranks for i, ranks in enumerate(found.values())}


def parallelize(fn: Callable, model: nn.Module, device_mesh) -> None:
    """``fn(model, device_mesh)`` on the fake copy; what it raises is named as its own (fxmem's
    own plans raise their errors as they are)."""
    try:
        with _chunks_when_read():
            out = fn(model, device_mesh)
    except FxmemError:
        raise
    except Exception as exc:  # noqa: BLE001 (the user's code: any error is theirs, named)
        raise CaptureError(f"Strategy(parallelize={function_name(fn)}) raised on the fake copy of the model: "
                           f"{type(exc).__name__}: {exc}") from exc
    if out is not None and out is not model:
        raise InputError(f"Strategy(parallelize={function_name(fn)}) returned a new object ({type(out).__name__}); "
                         "fxmem estimates the model it hands the function, changed in place (as fully_shard and "
                         "parallelize_module change it): return None or the model")


class Chunks(Sequence):
    """``torch.chunk(tensor, num_chunks, dim)`` padded with empty tensors to ``num_chunks``
    (FSDP2's ``_chunk_with_empty``, ``_fsdp_common.py``), each chunk made when it is read: the same
    views (``aten::chunk``: ``split`` by ``ceil(size / num_chunks)``, the last one shorter; the
    padding ``chunks[0].new_empty(0)``), without the others."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self._tensor, self._dim, self._n = tensor, dim, num_chunks
        self._size = tensor.size(dim)
        self._step = -(-self._size // num_chunks)
        self._made = num_chunks if self._step == 0 else -(-self._size // self._step)  # chunk's own pieces

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = operator.index(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"chunk {i} of {self._n}")
        if i >= self._made:
            return self[0].new_empty(0)
        start = i * self._step
        return self._tensor.narrow(self._dim, start, min(self._step, self._size - start))


@contextlib.contextmanager
def _chunks_when_read() -> Iterator[None]:
    """FSDP2 shards each parameter with ``_chunk_with_empty(param, world_size, dim)`` and reads its
    own rank's chunk and the first (``_fsdp_param.py``, ``_init_sharded_param`` and
    ``_init_sharded_post_forward_param_metadata``); on fake tensors each of the ``world_size``
    views is a dispatch through the fake mode (0.1 s per parameter at 1,024 ranks, about half of a
    capture).  While the job's parallelize function runs, ``_fsdp_param``'s name gives ``Chunks``:
    the chunks it reads, the same views."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    with patched(vars(_fsdp_param), "_chunk_with_empty", Chunks):
        yield


def offload_notes(model: nn.Module, cuda: bool) -> tuple[str, ...]:
    """What ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` leaves out, for the report's
    notes; an :class:`InputError` where the job itself cannot run.  FSDP2 keeps an offloaded
    parameter's shard in host memory (``_fsdp_param.py``: ``padded_sharded_param.cpu()``, pinned
    with ``pin_memory=True``), copies it to the device before each all-gather (``all_gather_inputs``:
    ``.to(self.device, non_blocking=True)``), moves each reduced gradient back to the host
    (``_fsdp_collectives.py``, ``foreach_reduce``) and the optimizer steps on the CPU.  On the
    capture's CPU mesh those copies are no-ops, so the CUDA target counts the shards, their
    gradients and their optimizer state as device memory: an over-estimate, said with its size."""
    from torch.distributed.fsdp import FSDPModule

    groups = []  # per FSDP parameter group: the offloaded shards (bytes) and whether they are pinned
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        params = [p for p in (group.fsdp_params if group is not None else ()) if p.offload_to_cpu]
        if params:
            groups.append((sum(p._sharded_param_data.untyped_storage().nbytes() for p in params),
                           any(p.pin_memory for p in params)))
    if not groups:
        return ()
    if not cuda and any(pinned for _, pinned in groups):
        raise InputError("CPUOffloadPolicy(pin_memory=True) pins host memory for a CUDA device: with "
                         "device='cpu' the job itself fails (FSDP2's pin_memory(): 'Cannot access accelerator device "
                         "when none is available'); estimate it with device='cuda', or use "
                         "CPUOffloadPolicy(pin_memory=False) on the CPU")
    if not cuda:  # the CPU is the device: offloading moves nothing
        return ()
    shards = sum(nbytes for nbytes, _ in groups)
    return (f"CPUOffloadPolicy is NOT modelled on the CUDA target: in your job the offloaded parameter shards "
            f"({shards:,} B on this rank), their gradients and their optimizer state live in host memory and the "
            "optimizer steps on the CPU; fxmem's capture (on a CPU mesh, where FSDP2's host-device copies do "
            "nothing) counts all of it on the device, and leaves out the device copy FSDP2 makes of one group's "
            f"shards before its all-gather (at most {max(nbytes for nbytes, _ in groups):,} B at a time, less than "
            "the shards counted): the device figure is an over-estimate",)


def roles(model: nn.Module, mesh: tuple[tuple[str, int], ...]) -> tuple[tuple[int, ...], ...]:
    """The ranks grouped by the local shapes of the model's DTensor parameters and buffers
    (``_compute_local_shape_and_global_offset`` at each rank's mesh coordinate), in rank order;
    one group when the model holds no DTensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sizes = tuple(size for _, size in mesh)
    layouts = {(tuple(t.shape), tuple(t.placements))
               for t in itertools.chain(model.parameters(), model.buffers()) if isinstance(t, DTensor)}
    groups: dict[tuple, list[int]] = {}
    for rank in range(math.prod(sizes)):
        coordinate = list(_coordinate(rank, sizes))
        local = tuple(_compute_local_shape_and_global_offset(shape, sizes, coordinate, placements, skip_offset=True)[0]
                      for shape, placements in sorted(layouts, key=repr))
        groups.setdefault(local, []).append(rank)
    return tuple(tuple(ranks) for ranks in groups.values())


def role_name(mesh: tuple[tuple[str, int], ...], ranks: tuple[int, ...]) -> str:
    """Where a group of ranks sits on the mesh: ``"dp_shard 0-2 of 4"``, ``"dp_shard 3 of 4, tp 1
    of 2"`` (dims it spans whole left out), ``"every rank"``; its ranks where they are no block
    of the mesh."""
    sizes = [size for _, size in mesh]
    coordinates = [_coordinate(rank, sizes) for rank in ranks]
    values = [sorted({c[d] for c in coordinates}) for d in range(len(mesh))]
    if math.prod(len(v) for v in values) != len(ranks):
        return f"ranks {_span(list(ranks))}"
    return ", ".join(f"{name} {_span(v)} of {size}" for (name, size), v in zip(mesh, values)
                     if len(v) < size) or "every rank"


def _coordinate(rank: int, sizes: list[int]) -> tuple[int, ...]:
    """``rank``'s index along each mesh dim (row-major, as ``init_device_mesh`` lays ranks out)."""
    out = []
    for size in reversed(sizes):
        rank, index = divmod(rank, size)
        out.append(index)
    return tuple(reversed(out))


def _span(values: list[int]) -> str:
    if len(values) > 1 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values[:8])) + (f" and {len(values) - 8} more" if len(values) > 8 else "")

