"""Pipeline parallelism: ``torch.distributed.pipelining`` ``ScheduleGPipe`` and
``Schedule1F1B``, one ``PipelineStage`` per rank.

The capture is one micro-batch's step (forward, loss, backward, optimizer over every
parameter) at ``b / m``; ``stages`` cuts it into the ``S`` stages and replays each stage's
part once per micro-batch in its schedule's order.  The rules, from
``torch/distributed/pipelining/stage.py`` and ``schedules.py``:

Which stage runs what.  The model's blocks (``spec.blocks``) are cut into contiguous runs:
stage ``k`` runs the forward ops from its first block up to the next stage's first block --
modules outside the blocks go with the block before them (the ones before the first block,
the root's own ops included, to stage 0; the head and the loss to the last stage).  A
backward op belongs to the stage of the module it differentiates (root-level backward ops:
to the stage whose ops surround them); an optimizer op to the stage of the parameter it
updates.  Each stage keeps its own parameters, gradients and optimizer state
(``RankStep.keep_params``); its optimizer updates them in the model's order.

Order.  ``ScheduleGPipe._step_microbatches``: every micro-batch's forward, then every
backward (in micro-batch order), so all ``m`` micro-batches are in flight.
``Schedule1F1B._step_microbatches``: ``min(m, S - k)`` warm-up forwards on stage ``k``, then
one backward, one forward, ..., then the remaining backwards: at most ``min(m, S - k)`` in
flight.  Then the harness's ``optimizer.step()`` and ``zero_grad(set_to_none=True)``.

Per micro-batch.  What a stage's forward allocates lives as in the capture while its frees
stay inside the stage.  ``forward_one_chunk`` keeps the stage's outputs in ``fwd_cache``
until ``backward_one_chunk`` of that micro-batch pops them, so a tensor the single-device
step freed in a later stage lives until the end of this stage's backward of it (the last
stage keeps its outputs in ``output_chunks`` to the end of the step, and the losses too).
The first backward creates the gradients; the later ones compute each weight gradient into a
temporary that ``AccumulateGrad`` adds in place and frees.  The sends hold what they send
(gloo's work keeps the tensor): the gradient of a stage's input (``stage_backward``: the
``.grad`` of the receive buffer, taken out and sent) lives until ``ScheduleGPipe``'s backward
loop ends (``bwd_sends_to_wait``), or in ``Schedule1F1B`` until the next backward is done
(``bwd_sends`` / ``send_work`` are rebound then).  A stage's output lives until
``ScheduleGPipe``'s backward loop ends (``fwd_sends_to_wait``); in ``Schedule1F1B`` to its
backward, except the last warm-up send's (micro-batch ``min(m, S - k) - 2``, in
``send_work`` until the cool-down starts) and the last micro-batch's (``fwd_sends``, to the
end).  Activation checkpointing (``Strategy(checkpoint=)``) needs nothing more: the
recomputation is part of the stage's backward ops.

The runtime's own buffers (``_setup_forward_recv_info`` / ``_create_grad_recv_info``:
``torch.empty`` per micro-batch, made in the first step and kept): a stage other than the
first holds ``m`` receive buffers of its input, a stage other than the last ``m`` receive
buffers of its output's gradient (``Category.COMMUNICATION``).  The stage's output is taken
to be what its last allocating forward op allocates (its input is the previous stage's
output).  The whole batch's sample: the first tensor of the sample (the model input) stays on
stage 0, the others (the targets) on the last stage.  The last stage's ``step()`` returns
``merge_chunks(output_chunks)``, a ``torch.cat`` of its ``m`` outputs alive through the
optimizer step, and still holds the previous step's ``output_chunks`` until
``clear_runtime_states()`` at the start of the step.  Module buffers stay with their module.

Default split (``split_points=None``): the contiguous cut of the blocks minimising the
largest stage cost, where a stage costs its parameters, gradients and optimizer state plus
its blocks' activations of one micro-batch times the micro-batches it holds in flight (at
the report's batch), and for the last stage its ``m`` outputs and their concatenation, found
by dynamic programming over the cut positions; what lies outside the blocks counts with the
first block when its forward runs before it (embeddings), else with the last (head, loss).
A cost model, not the stages' peaks: the per-stage reports show what the cut gives, and
``split_points`` sets it.

Data parallel stages (``Strategy(pipeline=S, data_parallel=D)``: ``S * D`` ranks, rank
``k * D + d`` running stage ``k`` of pipeline ``d``, as torchtitan's ``("pp", "dp")`` mesh lays
them out): each stage's module wrapped in ``DistributedDataParallel`` over its ``D`` replicas.
``PipelineStage`` runs every forward and every backward but the last under ``no_sync()``
(``stage.py`` ``forward_maybe_with_nosync`` / ``backward_maybe_with_nosync``); the last
backward's hooks copy each gradient into its bucket and all-reduce it.  What that adds to a
stage: the reducer's buckets of its parameters (``ddp.bucket_bytes``: the first synced backward
records the ready order, the next forward rebuilds the buckets in it), alive throughout.  No
buffer broadcast in the steady state: DDP's ``_post_forward`` sets ``require_forward_param_sync``
false after a forward under ``no_sync()``, and every forward is one.  With
``gradient_as_bucket_view`` the hook of the last backward points ``.grad`` at its bucket view:
the gradient the first backward made is freed there.  The real job's stage needs its shapes
given (``PipelineStage(input_args=, output_args=, ...)``, static mode): the dynamic mode's
metadata inference runs a backward through DDP outside ``no_sync()``, and the next step's bucket
rebuild then fails (torch 2.13, ``reducer.cpp``: "rebuilt parameter indices size is not same as
original model parameters size").

Not modelled: memory gloo / NCCL allocate themselves (outside the PyTorch allocator); the
first step's metadata inference (``_forward_metadata_inference`` runs a micro-batch's forward
and backward once; the steady state is modelled); parameters shared by two stages (tied
embeddings are counted on the first stage that uses them); model outputs other than one
tensor per stage; a sample whose single tensor is both the input and the target (it is kept
on stage 0 only).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from estimator.ranks import ddp
from estimator.ranks.rankstep import Block, Op, Rank, RankStep
from estimator.vocab.categories import Category, Phase
from estimator.vocab.errors import InputError
from estimator.vocab.strategy import Schedule, blocks
from estimator.vocab.symbolic import ZERO, Poly

__all__ = ["in_flight", "order", "split", "stages"]


# ----------------------------------------------------------------------------------------
# schedules


def order(schedule: Schedule | str, stages_: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The actions of ``stage`` (0-based) in one step: ``("F", i)`` / ``("B", i)``."""
    schedule = Schedule(schedule)
    m = microbatches
    if schedule is Schedule.GPIPE:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, stages_ - stage)
    actions = [("F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:  # Schedule1F1B: 1B1F until the forwards run out, then the cool-down
        actions.append(("B", bwd))
        bwd += 1
        if fwd == m:
            break
        actions.append(("F", fwd))
        fwd += 1
    actions += [("B", i) for i in range(bwd, m)]
    return actions


def in_flight(schedule: Schedule | str, stages_: int, stage: int, microbatches: int) -> int:
    """The most micro-batches whose forward ran and backward has not, on ``stage``."""
    live = most = 0
    for kind, _ in order(schedule, stages_, stage, microbatches):
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


# ----------------------------------------------------------------------------------------
# which stage runs what


@dataclasses.dataclass
class _Layout:
    """The stage of every op and parameter of the captured step."""

    op_stage: dict[int, int | None]  # id(Op) -> stage (None: optimizer op of every stage)
    param_stage: dict[str, int]
    buffer_stage: dict[str, int]
    block_stage: list[int]  # per block index


def _layout(step: RankStep, model: nn.Module, starts: list[int]) -> _Layout:
    paths = [p for p, _ in blocks(model)]
    block_stage = []
    for i in range(len(paths)):
        block_stage.append(sum(1 for s in starts if s <= i) - 1)

    def in_block(module: str) -> int | None:
        for i, p in enumerate(paths):
            if module == p or module.startswith(p + "."):
                return block_stage[i]
        return None

    last = len(starts) - 1
    op_stage: dict[int, int | None] = {}
    module_stage: dict[str, int] = {}
    current = 0
    for op in step.ops:
        if op.phase is Phase.FORWARD:
            k = in_block(op.module)
            if k is None:  # outside the blocks: with the block before it
                k = module_stage.get(op.module, current) if op.module else current
            if op.module:
                module_stage.setdefault(op.module, k)
            current = k
            op_stage[id(op)] = k
    current = last
    for op in step.ops:
        if op.phase is Phase.BACKWARD:
            k = in_block(op.module)
            if k is None:  # a module outside the blocks: where its forward ran; the root: in place
                k = module_stage.get(op.module, current) if op.module else current
            current = k
            op_stage[id(op)] = k

    def module_of(name: str) -> int:
        module = name.rpartition(".")[0]
        k = in_block(module)
        if k is None:
            while module not in module_stage and module:
                module = module.rpartition(".")[0]
            k = module_stage.get(module, 0) if module else 0
        return k

    param_stage = {name: module_of(name) for name, _ in model.named_parameters()}
    buffer_stage = {name: module_of(name) for name, _ in model.named_buffers()}
    for op in step.ops:
        if op.phase is Phase.OPTIMIZER:
            op_stage[id(op)] = param_stage.get(op.owner) if op.owner is not None else None
    return _Layout(op_stage, param_stage, buffer_stage, block_stage)


def split(model: nn.Module, strategy, timeline=None, at=None) -> list[int]:
    """The block indices where each stage starts (``[0, ...]``): ``strategy.split_points``
    checked, or the balanced cut (module docstring; ``at(poly)``: bytes at the report's batch)."""
    found = blocks(model)
    paths = [p for p, _ in found]
    S = strategy.pipeline
    if len(paths) < S:
        raise InputError(
            f"Strategy(pipeline={S}) needs at least {S} blocks to cut into stages; the model has "
            f"{len(paths)} ({', '.join(paths) or 'no nn.Sequential / nn.ModuleList with parameters'})")
    if strategy.split_points is not None:
        starts = [0]
        for point in strategy.split_points:
            if point not in paths:
                raise InputError(
                    f"Strategy(split_points=): {point!r} is not one of the model's blocks "
                    f"({paths[0]} ... {paths[-1]}; the children with parameters of its first "
                    "nn.Sequential / nn.ModuleList)")
            index = paths.index(point)
            if index <= starts[-1]:
                raise InputError(
                    f"Strategy(split_points=): {point!r} must come after the start of the previous stage "
                    f"({paths[starts[-1]]!r}): give the block paths in model order, the first block excluded")
            starts.append(index)
        return starts
    return _balanced(model, strategy, timeline, paths, at)


def _balanced(model: nn.Module, strategy, timeline, paths: list[str], at=None) -> list[int]:
    n, S, m = len(paths), strategy.pipeline, strategy.microbatches
    state = [0] * n
    acts = [0] * n
    index = {p: i for i, p in enumerate(paths)}

    def block_of(module: str) -> int | None:
        for p, i in index.items():
            if module == p or module.startswith(p + "."):
                return i
        return None

    if timeline is not None:
        step = RankStep.of(timeline)
        value = at or (lambda poly: poly(m))  # bytes at the report's batch, else at one sample per micro-batch
        # what lies outside the blocks goes with the first block if its forward runs before the
        # first block's (embeddings), else with the last (head, loss)
        first_block_op = next((i for i, op in enumerate(step.ops) if block_of(op.module) is not None), 0)
        first_op: dict[str, int] = {}
        for i, op in enumerate(step.ops):
            if op.phase is Phase.FORWARD:
                first_op.setdefault(op.module, i)

        def where(module: str) -> int:
            i = block_of(module)
            if i is not None:
                return i
            while module and module not in first_op:
                module = module.rpartition(".")[0]
            return 0 if first_op.get(module, 0) < first_block_op else n - 1

        for b in step.blocks:
            if b.category in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE) and b.owner:
                state[where(b.owner.rpartition(".")[0])] += value(b.nbytes)
            elif b.alloc is not None and b.alloc.phase is Phase.FORWARD and (
                    b.free is None or b.free.phase is not Phase.FORWARD):
                acts[where(b.alloc.module)] += value(b.nbytes)
        # the last stage keeps its m outputs (output_chunks) and their concatenation
        head = next((op for op in reversed(step.ops) if op.phase is Phase.FORWARD and op.module
                     and any(b.alloc is op for b in step.blocks)), None)
        state[n - 1] += 2 * m * sum(value(b.nbytes) for b in step.blocks if head is not None and b.alloc is head)
    else:
        for i, (_, module) in enumerate(blocks(model)):
            state[i] = sum(p.numel() * p.element_size() for p in module.parameters())

    def cost(k: int, lo: int, hi: int) -> int:
        return sum(state[lo:hi]) + in_flight(strategy.schedule, S, k, m) * sum(acts[lo:hi])

    # best[k][j]: the smallest largest cost of stages 0..k covering blocks [0, j)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(S)]
    cut = [[0] * (n + 1) for _ in range(S)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for k in range(1, S):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                value = max(best[k - 1][i], cost(k, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(S - 1, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return [0, *reversed(starts)]


# ----------------------------------------------------------------------------------------
# each stage's step


def stages(timeline, model: nn.Module, strategy, target=None, at=None) -> list[Rank]:
    starts = split(model, strategy, timeline, at)
    S, m = strategy.pipeline, strategy.microbatches
    if Schedule(strategy.schedule) is Schedule.ONE_F_ONE_B and m < S:
        raise InputError(f"Strategy(schedule='1f1b') needs microbatches >= pipeline stages "
                         f"(Schedule1F1B refuses fewer), got microbatches={m} for pipeline={S}")
    base = RankStep.of(timeline)
    layout = _layout(base, model, starts)
    n = len(layout.block_stage)
    outputs = [_output_bytes(base, layout, k, k == S - 1) for k in range(S)]
    ranks = []
    D = strategy.data_parallel  # ranks as torchtitan's ("pp", "dp") mesh lays them out
    for k in range(S):
        step = _stage_step(base, model, strategy, layout, k, outputs)
        lo, hi = starts[k], (starts[k + 1] if k + 1 < S else n)
        ranks.append(Rank(f"stage {k}/{S} (blocks {lo}:{hi})", tuple(range(k * D, (k + 1) * D)), step.timeline()))
    return ranks


def _output_op(step: RankStep, layout: _Layout, k: int, last: bool) -> Op | None:
    """The op computing stage ``k``'s output: its last forward op that allocates (the last
    stage: its last one inside a module, before the loss)."""
    allocating = {id(b.alloc) for b in step.blocks if b.alloc is not None}
    for op in reversed(step.ops):
        if op.phase is Phase.FORWARD and layout.op_stage.get(id(op)) == k and id(op) in allocating:
            if last and not op.module:
                continue
            return op
    return None


def _output_bytes(step: RankStep, layout: _Layout, k: int, last: bool) -> Poly:
    """Bytes of stage ``k``'s output for one micro-batch: what ``_output_op`` allocates."""
    op = _output_op(step, layout, k, last)
    return sum((b.nbytes for b in step.blocks if op is not None and b.alloc is op), ZERO)


def _stage_step(base: RankStep, model: nn.Module, strategy, layout: _Layout, k: int,
                outputs: list[Poly]) -> RankStep:
    S, m = strategy.pipeline, strategy.microbatches
    first, last = k == 0, k == S - 1
    gpipe = Schedule(strategy.schedule) is Schedule.GPIPE
    as_views = strategy.data_parallel > 1 and strategy.gradient_as_bucket_view
    step = base.copy()
    stage_of = {id(step.ops[i]): layout.op_stage.get(id(o)) for i, o in enumerate(base.ops)}
    params = [name for name, _ in model.named_parameters() if layout.param_stage.get(name) == k]
    step.keep_params(params)
    opt = [o for o in step.ops if o.phase is Phase.OPTIMIZER and stage_of.get(id(o)) in (k, None)]
    kept_opt = {id(o) for o in opt}
    fwd = [o for o in step.ops if o.phase is Phase.FORWARD and stage_of[id(o)] == k]
    bwd = [o for o in step.ops if o.phase is Phase.BACKWARD and stage_of[id(o)] == k]

    start = Op("pipelining: clear_runtime_states", None, Phase.FORWARD, "")
    ops: list[Op] = [start]
    copies: dict[tuple[str, int], dict[int, Op]] = {}
    ends: dict[int, Op] = {}  # micro-batch -> the last op of its backward
    actions = order(strategy.schedule, S, k, m)
    backwards = [i for kind, i in actions if kind == "B"]
    for kind, i in actions:
        src = fwd if kind == "F" else bwd
        if not src:  # keep a marker so that frees have an op to point at
            src = [Op(f"pipelining: {'forward' if kind == 'F' else 'backward'} (no op)", None,
                      Phase.FORWARD if kind == "F" else Phase.BACKWARD, "")]
        made = {id(o): dataclasses.replace(o) for o in src}
        copies[(kind, i)] = made
        ops += made.values()
        if kind == "B":
            ends[i] = ops[-1]
    end = Op("pipelining: end of schedule step", None, Phase.BACKWARD, "")
    ops.append(end)
    merge = None
    if last:
        merge = Op("pipelining: merge_chunks (torch.cat of the outputs)", None, Phase.BACKWARD, "")
        ops.append(merge)
    ops += opt

    def held_grad_free(i: int) -> Op:
        """Where the send of micro-batch ``i``'s input gradient lets it go."""
        if gpipe:
            return end
        j = backwards.index(i)
        return ends[backwards[j + 1]] if j + 1 < len(backwards) else end

    position = {id(o): j for j, o in enumerate(ops)}

    def sent_output_free(i: int) -> Op:
        """Where the send of micro-batch ``i``'s stage output lets it go (at the earliest)."""
        if gpipe or i == m - 1:  # GPipe: fwd_sends_to_wait; 1F1B: the last fwd_sends
            return end
        warmup = min(m, S - k)
        if i == warmup - 2:  # 1F1B: the last warm-up send_work, rebound when the cool-down starts
            return ends[backwards[m - warmup]]
        return ends[i]

    seed = next((o for o in step.ops if o.phase is Phase.BACKWARD), None)
    seed = seed if seed is not None and seed.op == "aten.ones_like.default" else None
    out_op = _output_op(base, layout, k, last) if not last else None
    out_op = step.ops[base.ops.index(out_op)] if out_op is not None else None
    new_blocks: list[Block] = []
    inputs = [b for b in step.blocks if b.alloc is None and b.category is Category.INPUT]
    for b in step.blocks:
        if b.alloc is None:
            if b.category in (Category.INPUT, Category.BUFFER):
                continue  # placed below
            free = b.free if b.free is None or id(b.free) in kept_opt else end
            new_blocks.append(dataclasses.replace(b, free=free))
            continue
        where = stage_of.get(id(b.alloc))
        if b.alloc.phase is Phase.OPTIMIZER:
            if id(b.alloc) in kept_opt:
                new_blocks.append(b)
            continue
        if where != k:
            continue
        kind = "F" if b.alloc.phase is Phase.FORWARD else "B"
        for i in range(m):
            alloc = copies[(kind, i)][id(b.alloc)]
            if b.category is Category.GRADIENT and b.owner is not None:
                if i == backwards[0]:  # the first backward creates .grad
                    if as_views:  # ... which DDP's hook in the last backward replaces by its bucket view
                        made = copies[("B", backwards[-1])]
                        hook = made[id(b.alloc)]
                        free = hook if len(backwards) == 1 else _accumulated(made, hook)
                        new_blocks.append(dataclasses.replace(b, alloc=alloc, free=free))
                        continue
                    new_blocks.append(dataclasses.replace(b, alloc=alloc))
                else:  # the later ones add a temporary in place (AccumulateGrad)
                    new_blocks.append(Block(b.nbytes, Category.TEMPORARY, alloc, _accumulated(copies[("B", i)], alloc)))
                continue
            free = _free(b, i, kind, k, last, copies, ends, stage_of, held_grad_free, seed)
            if b.alloc is out_op:  # the stage's output: also held by its send
                held = sent_output_free(i)
                if free is not None and position[id(held)] > position[id(free)]:
                    free = held
            new_blocks.append(dataclasses.replace(b, alloc=alloc, free=free))
    present = {id(o) for o in ops}
    for b in new_blocks:  # freed by an op another stage runs: alive to the end of the step
        if b.free is not None and id(b.free) not in present:
            b.free = None
    step.ops = ops
    step.blocks = new_blocks

    # the sample: the model input on stage 0, the targets on the last stage (whole batch)
    for j, b in enumerate(inputs):
        if (j == 0 and first) or (j > 0 and last):
            step.add(b.nbytes * m, Category.INPUT, None, None)
    # module buffers stay with their module
    buffers = sum((Poly.const(t.numel() * t.element_size()) for name, t in model.named_buffers()
                   if layout.buffer_stage.get(name) == k), ZERO)
    if buffers != ZERO:
        step.add(buffers, Category.BUFFER, None, None)
    # the runtime's receive buffers, one per micro-batch
    if not first:
        step.add(outputs[k - 1] * m, Category.COMMUNICATION, None, None)
    if not last:
        step.add(outputs[k] * m, Category.COMMUNICATION, None, None)
    else:  # the previous step's output_chunks until clear_runtime_states; the merged output
        step.add(outputs[k] * m, Category.ACTIVATION, None, start)
        step.add(outputs[k] * m, Category.TEMPORARY, merge, None)
    if strategy.data_parallel > 1:  # DDP over the stage's replicas: the reducer's buckets of its parameters
        for nbytes in ddp.bucket_bytes(model, base, strategy.bucket_cap_mb, names=set(params)):
            step.add(nbytes, Category.COMMUNICATION, None, None)
    return step


def _free(b: Block, i: int, kind: str, k: int, last: bool, copies, ends, stage_of, held_grad_free,
          seed: Op | None) -> Op | None:
    """Where micro-batch ``i``'s copy of ``b`` (allocated by this stage) is freed.  ``seed``: the
    op making the loss's gradient (``torch.autograd.backward``'s ``ones_like``), which the
    capture's one backward frees at its end and each of the last stage's ``stage_backward``
    calls at the end of its own."""
    f = b.free
    if f is None:
        return None if last and kind == "F" else ends[i]
    where = stage_of.get(id(f))
    if where == k and f.phase is not Phase.OPTIMIZER:
        return copies["F" if f.phase is Phase.FORWARD else "B", i][id(f)]
    if kind == "B" and where is not None and where < k and b.alloc is not seed:
        return held_grad_free(i)  # this stage's input gradient, held by its send
    return ends[i]  # kept in fwd_cache until this micro-batch's backward is done


def _accumulated(ops: dict[int, Op], alloc: Op) -> Op:
    """Where ``AccumulateGrad`` has added a later micro-batch's weight gradient (computed at
    ``alloc``) into ``.grad``: the autograd node computing it returns all its gradients first,
    so the temporary lives to the last op before the backward of another module starts."""
    run = list(ops.values())
    j = run.index(alloc)
    while j + 1 < len(run) and run[j + 1].module in ("", alloc.module):
        j += 1
    return run[j]
