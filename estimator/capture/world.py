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
import dataclasses
import itertools
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence

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
        return (common + "; gloo's buffers around each collective are counted (ProcessGroupGloo.cpp); "
                + library_note(False),)
    return (common + "; on the CUDA target the caching allocator keeps a pool per stream, and the allocations "
            "your job makes on side streams (FSDP2's all-gather copy-in and reduce-scatter streams) are replayed on "
            "theirs; " + library_note(True),)


def library_note(cuda: bool) -> str:
    """What the collectives' library holds outside PyTorch's allocator (gloo on the CPU target, NCCL on the
    CUDA target), which no rank's figure counts: for the notes of every multi-device report."""
    if not cuda:
        return "memory gloo allocates outside PyTorch's CPU allocator is not counted"
    return ("the collectives are counted as the step's tensors only: NCCL's own buffers (outside the caching "
            "allocator: nvidia-smi shows them, max_memory_allocated does not) are NOT modelled, nor is a freed block "
            "that the GPU still uses on another stream waiting for it (recordStream's events: timing, which the "
            "replay does not have): treat the device figure as a lower bound.  NCCL's buffers, per process group "
            "(communicator): 9.19 MiB for each channel's connection to a peer with NCCL's defaults (4 MiB SIMPLE = "
            "NCCL_BUFFSIZE, 4.69 MiB LL128, 0.5 MiB LL), a ring's one per channel, a tree's up to three, up to 32 "
            "channels over NVLink and more with NVLS: hundreds of MiB to a few GiB per group, which depends on the "
            "topology NCCL finds (NVIDIA/nccl#864: about 1.6 GB for one all-reduce communicator); leave room for "
            "them in the budget")


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


def parallelize(fn: Callable, model: nn.Module, device_mesh):
    """``fn(model, device_mesh)`` on the fake copy; what it raises is named as its own (fxmem's
    own plans raise their errors as they are).  Returns the pipeline schedule the function returned
    (``capture.pipelines``), else None."""
    from estimator.capture import pipelines

    try:
        with _chunks_when_read():
            out = fn(model, device_mesh)
    except FxmemError:
        raise
    except Exception as exc:  # noqa: BLE001 (the user's code: any error is theirs, named)
        raise CaptureError(f"Strategy(parallelize={function_name(fn)}) raised on the fake copy of the model: "
                           f"{type(exc).__name__}: {exc}") from exc
    if pipelines.is_schedule(out):
        return out
    if out is not None and out is not model:
        raise InputError(f"Strategy(parallelize={function_name(fn)}) returned a new object ({type(out).__name__}); "
                         "fxmem estimates the model it hands the function, changed in place (as fully_shard and "
                         "parallelize_module change it): return None, the model, or the pipeline schedule of this "
                         "rank's stage")
    return None


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


@dataclasses.dataclass(frozen=True)
class Offload:
    """FSDP2's ``CPUOffloadPolicy`` in a job (``fully_shard(..., offload_policy=)``).

    FSDP2 keeps an offloaded parameter's shard in host memory (``_fsdp_param.py``
    ``_init_sharded_param``: ``padded_sharded_param.cpu()``, pinned with ``pin_memory=True``),
    copies it to the device before each all-gather (``all_gather_inputs``:
    ``.to(self.device, non_blocking=True)``, on the all-gather copy-in stream, then the cast to
    ``param_dtype``), copies each reduced gradient to the host (``_fsdp_collectives.py``
    ``foreach_reduce``: ``new_sharded_grad.to(torch.device("cpu"))``; the device's reduce-scatter
    output is freed once the group's copies are made), and the optimizer steps on the CPU, its
    state in host memory.  On the capture's CPU mesh those copies are no copies: on the CUDA
    target ``transfers`` makes them (``Tracker.copy``) and ``host_tensors`` names the state that
    lives on the host, which the device's figures leave out.  The CPU target needs neither: its
    device is the host."""

    params: tuple  # the offloaded FSDPParams
    modelled: bool  # False: counted on the device, said so (an FSDP2 extension's all-gather inputs)

    def host_tensors(self, optimizers: list) -> list[torch.Tensor]:
        """The shards, their gradients and the optimizer state of their parameters."""
        found = []
        for fsdp_param in self.params if self.modelled else ():
            param = fsdp_param.sharded_param
            found.append(fsdp_param._sharded_param_data)
            found.extend(local(t) for t in (param.grad, *(v for optimizer in optimizers
                                                          for v in optimizer.state.get(param, {}).values()))
                         if isinstance(t, torch.Tensor))
        return found

    @contextlib.contextmanager
    def transfers(self, tracker) -> Iterator[None]:
        """FSDP2's host-device copies of offloaded shards and gradients, as ``tracker`` copies."""
        if not self.modelled:
            yield
            return
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        gather_inputs = _fsdp_param.FSDPParam.all_gather_inputs.fget
        reduce = _fsdp_param_group.foreach_reduce
        to = torch.Tensor.to

        def all_gather_inputs(fsdp_param):
            if not fsdp_param.offload_to_cpu or fsdp_param.sharded_state != _fsdp_param.ShardedState.SHARDED:
                return gather_inputs(fsdp_param)
            shard = fsdp_param._sharded_param_data  # its own code, on the device copy its .to(device) makes
            fsdp_param._sharded_param_data, fsdp_param.offload_to_cpu = tracker.copy(shard, to_host=False), False
            try:
                return gather_inputs(fsdp_param)
            finally:
                fsdp_param._sharded_param_data, fsdp_param.offload_to_cpu = shard, True

        def to_host(t, *args, **kwargs):  # foreach_reduce's only move to the CPU: an offloaded gradient's
            device = kwargs.get("device", args[0] if args else None)
            if isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu" \
                    and not tracker.on_host(t):
                return tracker.copy(t, to_host=True)
            return to(t, *args, **kwargs)

        def foreach_reduce(*args, **kwargs):
            with patched(torch.Tensor, "to", to_host):
                return reduce(*args, **kwargs)

        with patched(_fsdp_param.FSDPParam, "all_gather_inputs", property(all_gather_inputs)), \
                patched(vars(_fsdp_param_group), "foreach_reduce", foreach_reduce):
            yield

    def notes(self) -> tuple[str, ...]:
        shards = [fsdp_param._sharded_param_data.untyped_storage().nbytes() for fsdp_param in self.params]
        pinned = "pinned" if any(fsdp_param.pin_memory for fsdp_param in self.params) else "pageable"
        if self.modelled:
            return (f"CPUOffloadPolicy, modelled from FSDP2's source (_fsdp_param.py, _fsdp_collectives.py): the "
                    f"offloaded parameter shards ({sum(shards):,} B on this rank), their gradients and their optimizer "
                    f"state are in host memory ({pinned}; not in the device figures), and the optimizer steps on the "
                    "CPU; counted on the device: each group's shards copied there before its all-gather (freed after "
                    "the copy-in) and each reduce-scatter output until its gradients are copied to the host; not "
                    "validated on a GPU",)
        return ("CPUOffloadPolicy is NOT modelled for parameters of an FSDP2 extension (fsdp_pre_all_gather: "
                f"their all-gather inputs are the extension's): the offloaded shards ({sum(shards):,} B on this rank), "
                "their gradients and their optimizer state are counted on the device, where your job keeps them in "
                "host memory: the device figure is an over-estimate",)


def offload(model: nn.Module, cuda: bool) -> Offload | None:
    """The job's ``CPUOffloadPolicy`` on the CUDA target (None: none, or the CPU target, where
    offloading moves nothing); an :class:`InputError` where the job itself cannot run."""
    from torch.distributed.fsdp import FSDPModule

    params = tuple(p for module in model.modules() if isinstance(module, FSDPModule)
                   for group in [module._get_fsdp_state()._fsdp_param_group] if group is not None
                   for p in group.fsdp_params if p.offload_to_cpu)
    if not params:
        return None
    if not cuda and any(p.pin_memory for p in params):
        raise InputError("CPUOffloadPolicy(pin_memory=True) pins host memory for a CUDA device: with "
                         "device='cpu' the job itself fails (FSDP2's pin_memory(): 'Cannot access accelerator device "
                         "when none is available'); estimate it with device='cuda', or use "
                         "CPUOffloadPolicy(pin_memory=False) on the CPU")
    if not cuda:
        return None
    return Offload(params, not any(hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather") for p in params))


def roles(model: nn.Module, mesh: tuple[tuple[str, int], ...], rank: int = 0,
          places: Sequence[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """The ranks grouped by the local shapes of the model's DTensor parameters and buffers
    (``_compute_local_shape_and_global_offset`` at each rank's coordinate on the tensor's own mesh:
    the job's, one of its sub-meshes, or another mesh over the same ranks, such as transformers'
    expert mesh), in rank order; one group when the model holds no DTensor.  ``places``: each
    rank's place in its pipeline (``pipelines.positions``); the model is ``rank``'s stage, so ranks
    at other places are grouped by their place alone (their own capture groups them further:
    ``parts``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    found = {(tuple(t.shape), tuple(t.placements), t.device_mesh)
             for t in itertools.chain(model.parameters(), model.buffers()) if isinstance(t, DTensor)}
    layouts = sorted(found, key=repr)
    world = math.prod(size for _, size in mesh)
    coordinates = {on: _mesh_coordinates(on, world) for _, _, on in layouts}
    groups: dict[tuple, list[int]] = {}
    for other in range(world):
        if places is not None and places[other] != places[rank]:
            groups.setdefault((places[other],), []).append(other)
            continue
        local = tuple(_compute_local_shape_and_global_offset(shape, tuple(on.shape), coordinates[on][other],
                                                             placements, skip_offset=True)[0]
                      for shape, placements, on in layouts)
        groups.setdefault((-1 if places is None else places[other], local), []).append(other)
    return tuple(tuple(ranks) for ranks in groups.values())


def parts(ranks: tuple[int, ...], found: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
    """``ranks`` (a role) split as the roles its first rank's capture ``found`` split them: a
    pipeline's ranks at another place in it were grouped by their place alone (``roles``)."""
    inside = [part for part in found if set(part) <= set(ranks)]
    return inside if sum(map(len, inside)) == len(ranks) else [ranks]


def split_roles(roles: tuple[tuple[int, ...], ...], groups: Mapping[tuple[int, ...], Mapping[int, tuple]],
                model: nn.Module, mesh: tuple[tuple[str, int], ...]) -> tuple[tuple[int, ...], ...]:
    """``roles`` split by what each rank received from the collectives whose values the step read:
    ``groups`` maps each such group (this rank's, as a tuple of global ranks) to the places in it
    whose values first differed from this rank's, with what they got then (``Shadows._diverged``);
    ranks at other places run what this rank runs.  A group is a dim of a mesh the model's DTensors
    are on (expert parallelism's ``ep``): every rank's place is its coordinate along that dim; for
    a group no such dim gives, a rank outside it is a role of its own."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    world = math.prod(size for _, size in mesh)
    meshes = {t.device_mesh for t in itertools.chain(model.parameters(), model.buffers()) if isinstance(t, DTensor)}
    dims = {tuple(dist.get_process_group_ranks(on.get_group(d))): (on, d)
            for on in sorted(meshes, key=repr) for d in range(on.ndim)}
    received: dict[int, list] = {rank: [] for ranks in roles for rank in ranks}
    for group, diverged in sorted(groups.items()):
        on, d = dims.get(group, (None, None))
        coordinates = None if on is None else _mesh_coordinates(on, world)
        for rank, got in received.items():
            place = coordinates[rank][d] if coordinates else group.index(rank) if rank in group else None
            got.append(-1 - rank if place is None else diverged.get(place))
    out: list[tuple[int, ...]] = []
    for ranks in roles:
        split: dict[tuple, list[int]] = {}
        for rank in ranks:
            split.setdefault(tuple(received[rank]), []).append(rank)
        out.extend(tuple(r) for r in split.values())
    return tuple(out)


def _mesh_coordinates(mesh, world: int) -> list[list[int]]:
    """Each rank's coordinate on ``mesh`` (its local rank along each dim), from the mesh's layout
    over the world's ranks (``DeviceMesh._layout``: per dim the sizes and strides of the ranks it
    spans, the first the most significant, as ``_flatten`` orders a flattened dim's ranks; the
    strides index ``_rank_map``, the world's ranks in ``init_device_mesh``'s order)."""
    position = {rank: i for i, rank in enumerate(mesh._rank_map.tolist())}
    axes = [(a.shape, a.stride) if isinstance(a.shape, tuple) else ((a.shape,), (a.stride,)) for a in mesh._layout]
    found = []
    for rank in range(world):
        coordinate = []
        for shape, stride in axes:
            index = 0
            for size, step in zip(shape, stride):
                index = index * size + position[rank] // step % size
            coordinate.append(index)
        found.append(coordinate)
    return found


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

