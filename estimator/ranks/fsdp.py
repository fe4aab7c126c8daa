"""Fully sharded data parallel: FSDP2 ``fully_shard`` (ZeRO-2 / ZeRO-3) on each rank.

``fully_shard`` wraps the units -- ``Strategy(shard_modules=)`` or the model's ``blocks()`` --
and then the root (the parameters no unit holds).  Each rank runs the captured step at its
own batch ``b``; the rules (``torch/distributed/fsdp/_fully_shard/``; CPU, gloo):

- Sharded parameters (``_fsdp_param.py`` ``FSDPParam._init_sharded_param``): every rank keeps
  a dim-0 padded shard of each parameter, ``ceil(dim0 / N)`` rows, whatever its own chunk
  is (``torch.chunk``: ranks at the end may get fewer rows, or none).
- Optimizer state and the optimizer's temporaries follow the DTensor's local tensor, the
  unpadded chunk: rank-specific when dim 0 does not divide by ``N``.  (The single-tensor
  for-loop optimizers run on DTensors; each op dispatches to the local shard.)  Scalar state
  (Adam's ``step``) is unchanged.
- All-gather (``_fsdp_collectives.py`` ``foreach_all_gather`` / ``..._copy_out``): one flat
  output of ``N x`` the unit's padded shard bytes (the rank's input is a view into it); gloo
  flattens the output into a temporary of the same size while the collective runs
  (``ProcessGroupGloo`` allgather, measured: two in turn, never together); the copy-out then
  allocates each parameter's unsharded (padded) tensor.
- The all-gather output (``_fsdp_param_group.py`` ``wait_for_unshard``): in forward it is kept
  in ``all_gather_state`` and freed after the next unit's copy-out (the walrus-bound
  ``prev_all_gather_state`` lives to the end of ``wait_for_unshard``); in backward right
  after the unit's own copy-out.  The last forward unit's output: with ZeRO-2 the root's
  ``_post_forward`` drops it; with ZeRO-3 it was measured alive past the forward, freed (on a
  gloo thread) when the first backward all-gather starts -- modelled as measured.
- The device mesh (``device_mesh.py`` ``init_device_mesh``): its rank map, ``N`` int32.
- Unsharded parameters: freed after the unit's forward with ``reshard_after_forward=True``
  (ZeRO-3; the root too, as ``fully_shard(root, reshard_after_forward=True)`` is explicit),
  else after the unit's backward (ZeRO-2; reshard_after_backward).
- Backward, ZeRO-3: ``pre_backward`` all-gathers the unit (unless prefetched), then prefetches
  the previous unit in forward order (``_backward_prefetch``; the root, whose forward ends
  last, prefetches the last block).  ZeRO-2: the parameters are still unsharded: nothing.
- ``post_backward`` (after the unit's last backward op; the root's in the final callback at
  the end of backward): reshard, then free the previous unit's reduce-scatter input
  (``reduce_scatter_states``, at most one in flight), then ``foreach_reduce``: a padded
  reduce-scatter input (``N x`` shard bytes) into which the autograd gradients are copied and
  then dropped (``torch._chunk_cat`` first copies each gradient whose dim 0 does not
  divide by ``N`` into a zero-padded one, all alive until the copy ends), an output of the
  padded shard bytes and gloo's temporary of the input's size during the collective (+ 12 B
  of scalars, measured: gloo's AVG divides in place).  The unit's last gradient stays until
  ``foreach_reduce`` returns (its loop variable ``unsharded_grad`` holds it).  The output
  becomes the sharded ``.grad`` (views), kept until ``zero_grad``; a later micro-batch
  (``accumulate``) adds its output into it and frees it.
- Activation checkpointing: the recomputation runs inside the unit's backward, where its
  parameters are already unsharded (``FSDPState._pre_forward`` in PRE_BACKWARD does nothing
  else): the captured recomputation ops are kept as they are.

Validated (``validators.distributed.measure_ranks("fsdp2", ...)``, both reshard settings):
MLPs with even and padded shards over 2, 3 and 4 ranks, the zoo's GPT debug model (root
parameters, tied embedding), and checkpointing (blocks that call ``torch.utils.checkpoint``);
exact to the byte in the runs without a late gloo free (below).  ``accumulate`` cannot be
measured with the harness (one micro-batch per step): its rules are FSDP2's code, unmeasured.

NOT_MODELLED:
- memory gloo allocates outside the c10 allocator;
- the order in which a gloo worker thread drops references: now and then a rank's measured
  peak exceeds the modelled one by up to about one all-gather / reduce-scatter buffer
  (e.g. gloo's reduce-scatter temporary freed late, alive at the next prefetch).  That is a
  race, different from run to run and rank to rank; the model follows the order of most runs;
- mixed precision (``MixedPrecisionPolicy``), CPU offload, HSDP, explicit prefetching,
  ``reshard_after_forward`` as an int, ``set_requires_gradient_sync(False)`` (accumulation
  is modelled with a reduce-scatter every micro-batch, FSDP2's default), tied parameters
  shared between units (a shared parameter belongs to the first unit that holds it);
- the CUDA target is not validated: there the rules are those above without gloo's flat
  temporaries, the all-gather outputs on FSDP2's copy-in stream and the sharded gradients on
  its reduce-scatter stream (``_fsdp_collectives.py``; the caching allocator keeps each stream's
  blocks apart: the same streams a capture of the real code records, ``Tracker._stream``);
  NCCL's own buffers are not modelled;
- with checkpointing, the capture labels recomputed backward ops by module only roughly:
  a unit's backward span is taken as the ops labelled with it or producing its gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from estimator.ranks.rankstep import Block, Op, Rank, RankStep
from estimator.vocab.categories import Category, Phase
from estimator.vocab.errors import InputError
from estimator.vocab.strategy import Sharding, blocks, select
from estimator.vocab.symbolic import Poly

# gloo's ReduceOp.AVG divides the reduced chunk in place by the world size: a wrapped double
# scalar (8 B) and its fp32 copy (4 B) live on top of the collective's flat temporary
GLOO_AVG_SCALARS = 8 + 4
# FSDP2's all-gather copy-in and reduce-scatter streams, numbered as a capture of the real code numbers
# them (``Tracker._stream``: in the order met; the all-gather stream, 2, allocates nothing)
COPY_IN_STREAM, REDUCE_SCATTER_STREAM = 1, 3
MESH_RANK_MAP_BYTES = 4  # per rank: torch.int


@dataclass
class _Param:
    name: str
    full: int  # bytes of the whole parameter
    padded: int  # bytes of one rank's padded shard (ceil(dim0 / N) rows)
    local: tuple[int, ...]  # bytes of each rank's unpadded chunk
    trainable: bool = True  # requires_grad: reduce-scattered in backward


@dataclass
class _Unit:
    path: str  # "" for the root
    params: list[_Param] = field(default_factory=list)

    @property
    def shard(self) -> int:
        return sum(p.padded for p in self.params)

    def contains(self, module: str) -> bool:
        return bool(self.path) and (module == self.path or module.startswith(self.path + "."))


def shard_sizes(shape: tuple[int, ...], element_size: int, world: int) -> tuple[int, tuple[int, ...]]:
    """``(padded shard bytes, each rank's unpadded chunk bytes)`` of a parameter of ``shape``
    sharded on dim 0 over ``world`` ranks (``torch.chunk``: chunks of ``ceil(dim0 / world)``
    rows, the last ones shorter or empty)."""
    dim0 = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if shape else 1
    rows = -(-dim0 // world)
    local = tuple(max(0, min(rows, dim0 - r * rows)) * rest * element_size for r in range(world))
    return rows * rest * element_size, local


def units(model: nn.Module, strategy) -> list[_Unit]:
    """The ``fully_shard`` units (the selected modules, or the blocks) and the root, last."""
    if strategy.shard_modules is not None:
        chosen = select(model, strategy.shard_modules, "shard_modules")
    else:
        chosen = blocks(model)
    if any(path == "" for path, _ in chosen):
        chosen = [(p, m) for p, m in chosen if p]
    n = strategy.data_parallel
    owner: dict[int, _Unit] = {}
    result = [_Unit(path) for path, _ in chosen]
    for unit, (_, module) in zip(result, chosen):
        for p in module.parameters():
            owner.setdefault(id(p), unit)
    root = _Unit("")
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        padded, local = shard_sizes(tuple(p.shape), p.element_size(), n)
        owner.get(id(p), root).params.append(
            _Param(name, p.numel() * p.element_size(), padded, local, p.requires_grad))
    return [u for u in result if u.params] + ([root] if root.params else [])


def _const(p: Poly) -> int | None:
    return p.coeff(0) if p.degree <= 0 and not p.mixed else None


def _segments(ops: list[Op]) -> list[tuple[list[int], list[int]]]:
    """The (forward op indices, backward op indices) of each micro-step."""
    segs: list[tuple[list[int], list[int]]] = []
    prev = None
    for i, op in enumerate(ops):
        if op.phase is Phase.FORWARD:
            if prev is not Phase.FORWARD:
                segs.append(([], []))
            segs[-1][0].append(i)
        elif op.phase is Phase.BACKWARD and segs:
            segs[-1][1].append(i)
        prev = op.phase
    return segs


def ranks(timeline, model: nn.Module, strategy, target=None) -> list[Rank]:
    n = strategy.data_parallel
    zero3 = strategy.sharding is Sharding.ZERO3
    us = units(model, strategy)
    gloo = not getattr(target, "is_cuda", False)  # NCCL on CUDA: no flat copies of the buffers
    if not us:
        raise InputError("Strategy(sharding='zero2'/'zero3'): the model has no trainable parameters to shard")
    # ranks differ only by their unpadded chunks (torch.chunk: the last ones may be shorter)
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(n):
        groups.setdefault(tuple(p.local[rank] for u in us for p in u.params), []).append(rank)
    stage = "ZeRO-3" if zero3 else "ZeRO-2"

    def role(chunks: tuple[int, ...]) -> str:
        return f"shard ({stage})" if len(groups) == 1 else f"shard ({stage}, local chunks {sum(chunks):,} B)"

    return [Rank(role(chunks), tuple(r), _rank_step(timeline, us, n, r[0], zero3, gloo).timeline())
            for chunks, r in groups.items()]


def _rank_step(timeline, us: list[_Unit], n: int, rank: int, zero3: bool, gloo: bool = True) -> RankStep:
    step = RankStep.of(timeline)
    params = {p.name: p for u in us for p in u.params}
    unit_of = {p.name: u for u in us for p in u.params}

    # -- the state: padded parameter shards, unpadded optimizer state and temporaries
    original_free: dict[str, Op | None] = {}
    for b in step.blocks:
        p = params.get(b.owner)
        if p is None:
            continue
        if b.category is Category.PARAMETER and b.alloc is None:
            b.nbytes = Poly.const(p.padded)
        elif b.category is Category.OPTIMIZER_STATE or (
            b.category is Category.TEMPORARY and b.alloc is not None and b.alloc.phase is Phase.OPTIMIZER
        ):
            if _const(b.nbytes) == p.full:
                b.nbytes = Poly.const(p.local[rank])
        elif b.category is Category.GRADIENT and b.alloc is not None:
            original_free.setdefault(p.name, b.free)

    ops = list(step.ops)
    segs = _segments(ops)
    if not segs:
        return step
    # gradient blocks of each parameter per micro-step: the 1st backward's GRADIENT blocks, and
    # the later ones' temporaries allocated at the matching op (accumulated into .grad)
    first_bwd = segs[0][1]
    grad_at: dict[int, list[Block]] = {}
    for b in step.blocks:
        if b.category is Category.GRADIENT and b.owner in params and b.alloc is not None:
            grad_at.setdefault(id(b.alloc), []).append(b)
    by_alloc: dict[int, list[Block]] = {}
    for b in step.blocks:
        if b.alloc is not None:
            by_alloc.setdefault(id(b.alloc), []).append(b)
    grads: list[dict[str, list[Block]]] = []
    for k, (_, bwd) in enumerate(segs):
        found: dict[str, list[Block]] = {}
        if k == 0:
            for i in bwd:
                for b in grad_at.get(id(ops[i]), ()):
                    found.setdefault(b.owner, []).append(b)
        elif len(bwd) == len(first_bwd):
            for i0, i in zip(first_bwd, bwd):
                for g in grad_at.get(id(ops[i0]), ()):
                    match = [b for b in by_alloc.get(id(ops[i]), ()) if b.nbytes == g.nbytes
                             and b.category in (Category.TEMPORARY, Category.GRADIENT)]
                    if match:
                        found.setdefault(g.owner, []).append(match[0])
        grads.append(found)

    # the DeviceMesh's rank map (init_device_mesh: torch.arange(N, dtype=torch.int) on CPU)
    step.add(MESH_RANK_MAP_BYTES * n, Category.COMMUNICATION, None, None)
    edits = _Edits()
    edits.gloo = gloo
    for k, (fwd, bwd) in enumerate(segs):
        _forward(edits, ops, fwd, us, n, zero3)
        _backward(edits, step, ops, bwd, us, n, zero3, grads[k], k, original_free, unit_of)
    edits.apply(step)
    return step


class _Edits:
    """Ops to insert before / after existing ops (applied at the end, so indices hold)."""

    def __init__(self) -> None:
        self.before: dict[int, list[Op]] = {}
        self.after: dict[int, list[Op]] = {}
        self.blocks: list[Block] = []  # the blocks FSDP adds
        self.held: Block | None = None  # the forward's kept all-gather output (all_gather_state)
        self.held_after_forward = False  # ... and the forward is over: the next collective frees it
        self.unsharded: dict[str, Block] = {}  # unit path -> its unsharded parameters
        self.forward_order: list[_Unit] = []
        self.gloo = True  # gloo's flat temporaries during each collective (the CPU target)

    def add_before(self, op: Op, new: Op) -> Op:
        self.before.setdefault(id(op), []).append(new)
        return new

    def add_after(self, op: Op, new: Op) -> Op:
        self.after.setdefault(id(op), []).append(new)
        return new

    def apply(self, step: RankStep) -> None:
        out = []
        for op in step.ops:
            out += self.before.get(id(op), [])
            out.append(op)
            out += self.after.get(id(op), [])
        step.ops = out
        step.blocks += self.blocks


def _gather(edits: _Edits, place, unit: _Unit, n: int, phase: Phase, what: str) -> Block:
    """All-gather ``unit`` (ops made by ``place``): returns the output block; gloo's temporary
    of the output's size is scratch of a second op, the collective."""
    nbytes = n * unit.shard
    gather = place(Op(f"FSDP::all_gather{what} ({unit.path or 'root'})", None, phase, unit.path,
                      stream=COPY_IN_STREAM))
    place(Op(f"gloo:all_gather ({unit.path or 'root'})", None, phase, unit.path,
             scratch=(Poly.const(nbytes),) if edits.gloo else ()))
    out = Block(Poly.const(nbytes), Category.COMMUNICATION, gather, None)
    edits.blocks.append(out)
    if edits.held is not None and edits.held.free is None and edits.held_after_forward:
        edits.held.free = gather  # the last forward output goes when the next collective starts
        edits.held = None
        edits.held_after_forward = False
    return out


def _forward(edits: _Edits, ops: list[Op], fwd: list[int], us: list[_Unit], n: int, zero3: bool) -> None:
    spans: list[tuple[_Unit, int, int]] = []
    root = next((u for u in us if not u.path), None)
    for u in us:
        if not u.path:
            continue
        idx = [i for i in fwd if u.contains(ops[i].module)]
        if idx:
            spans.append((u, idx[0], idx[-1]))
    spans.sort(key=lambda s: s[1])
    if root is not None:
        named = [i for i in fwd if ops[i].module]
        spans.insert(0, (root, fwd[0], named[-1] if named else fwd[-1]))
    # post_forward order (backward prefetch walks it back): the root's forward ends last
    edits.forward_order = [u for u, _, _ in spans if u.path] + ([root] if root is not None else [])
    for u, first, last in spans:
        place = lambda op, at=ops[first]: edits.add_before(at, op)
        out = _gather(edits, place, u, n, Phase.FORWARD, "")
        copy = place(Op(f"FSDP::all_gather_copy_out ({u.path or 'root'})", None, Phase.FORWARD, u.path))
        unsharded = Block(Poly.const(n * u.shard), Category.PARAMETER, copy, ops[last] if zero3 else None)
        edits.blocks.append(unsharded)
        edits.unsharded[u.path] = unsharded
        if edits.held is not None and edits.held.free is None:
            edits.held.free = copy  # wait_for_unshard: the previous output goes after this copy-out
        edits.held = out
    if zero3:
        edits.held_after_forward = edits.held is not None
    elif edits.held is not None and spans:
        # the root's post_forward drops all_gather_state (measured: ZeRO-2 frees it there)
        named = [i for i in fwd if ops[i].module]
        edits.held.free = ops[named[-1] if named else fwd[-1]]
        edits.held = None


def _backward(edits: _Edits, step: RankStep, ops: list[Op], bwd: list[int], us: list[_Unit], n: int, zero3: bool,
              grads: dict[str, list[Block]], micro: int, original_free: dict[str, Op | None], unit_of) -> None:
    order = list(reversed(edits.forward_order))
    if not bwd:
        return
    producing: dict[int, str] = {}
    for name, blocks_ in grads.items():
        for b in blocks_:
            producing[id(b.alloc)] = unit_of[name].path
    spans: dict[str, tuple[int, int]] = {}
    for i in bwd:
        for u in order:
            if u.path and (u.contains(ops[i].module) or producing.get(id(ops[i])) == u.path):
                lo, hi = spans.get(u.path, (i, i))
                spans[u.path] = (min(lo, i), max(hi, i))
    named = [i for i in bwd if ops[i].module]
    root_start = named[0] if named else bwd[0]
    prefetched: dict[str, Block] = {}
    rs_in: list[Block] = []
    order = [u for u in order if not u.path or u.path in spans]
    # backward runs the units in reverse forward order: a recomputation labelled with a later
    # unit must not start its unit before the one before it (checkpointing)
    floor = root_start if any(not u.path for u in order) else bwd[0]
    for u in order:
        if u.path:
            lo, hi = spans[u.path]
            lo = max(lo, floor)
            spans[u.path] = (lo, max(hi, lo))
            floor = lo

    def post_backward(u: _Unit, at: Op, where) -> None:
        unsharded = edits.unsharded.get(u.path)
        if unsharded is not None and unsharded.free is None:
            unsharded.free = at  # reshard after backward
        wait = where(Op(f"FSDP::post_backward_rs_wait ({u.path or 'root'})", None, Phase.BACKWARD, u.path))
        while rs_in:
            rs_in.pop().free = wait
        reduced = [p for p in u.params if p.trainable]
        if not reduced:
            return
        shard = sum(p.padded for p in reduced)
        # torch._chunk_cat copies each gradient whose dim 0 does not divide into a padded one
        padded = sum(n * p.padded for p in reduced if n * p.padded != p.full)
        reduce = where(Op(f"FSDP::post_backward_reduce ({u.path or 'root'})", None, Phase.BACKWARD, u.path,
                          scratch=(Poly.const(padded),) if padded else ()))
        inp = Block(Poly.const(n * shard), Category.COMMUNICATION, reduce, None)
        edits.blocks.append(inp)
        rs_in.append(inp)
        if edits.held is not None and edits.held.free is None and edits.held_after_forward:
            edits.held.free = reduce
            edits.held, edits.held_after_forward = None, False
        scatter = where(Op(f"gloo:reduce_scatter ({u.path or 'root'})", None, Phase.BACKWARD, u.path,
                           scratch=(Poly.const(n * shard + GLOO_AVG_SCALARS),) if edits.gloo else (),
                           stream=REDUCE_SCATTER_STREAM))
        with_grad = [p for p in reduced if grads.get(p.name)]
        for p in with_grad:
            for g in grads[p.name]:
                # copied into the reduce-scatter input, then dropped (unsharded_grads.clear());
                # the last one stays referenced by foreach_reduce's loop variable until it returns
                g.free = scatter if p is with_grad[-1] else reduce
        # the sharded .grad (views of the output) until zero_grad; a later micro-batch adds into it
        first = next((p.name for p in reduced if p.name in original_free), reduced[0].name)
        keep = original_free.get(first) if micro == 0 else scatter
        edits.blocks.append(Block(Poly.const(shard), Category.GRADIENT, scatter, keep, first if micro == 0 else None))

    for k, u in enumerate(order):
        start = root_start if not u.path else spans[u.path][0]
        place = lambda op, at=ops[start]: edits.add_before(at, op)
        if zero3:
            out = prefetched.pop(u.path, None)
            if out is None:
                out = _gather(edits, place, u, n, Phase.BACKWARD, "")
            copy = place(Op(f"FSDP::all_gather_copy_out ({u.path or 'root'})", None, Phase.BACKWARD, u.path))
            out.free = copy
            unsharded = Block(Poly.const(n * u.shard), Category.PARAMETER, copy, None)
            edits.blocks.append(unsharded)
            edits.unsharded[u.path] = unsharded
            if k + 1 < len(order):
                v = order[k + 1]
                prefetched[v.path] = _gather(edits, place, v, n, Phase.BACKWARD, " (prefetch)")
        if u.path:
            end = ops[spans[u.path][1]]
            post_backward(u, end, lambda op, at=end: edits.add_after(at, op))
    root = next((u for u in order if not u.path), None)
    last = ops[bwd[-1]]
    if root is not None:  # the root's post_backward runs in the final callback
        post_backward(root, last, lambda op: edits.add_after(last, op))
    if rs_in:
        final = edits.add_after(last, Op("FSDP::root_post_backward_callback", None, Phase.BACKWARD, ""))
        while rs_in:
            rs_in.pop().free = final
