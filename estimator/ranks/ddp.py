"""Data parallel replicas: ``DistributedDataParallel`` and ZeRO stage 1
(``ZeroRedundancyOptimizer`` over DDP).

Each rank runs the captured step at its own batch ``b``; what DDP adds
(``torch/nn/parallel/distributed.py``, ``torch/csrc/distributed/c10d/reducer.cpp``):

- Gradient buckets: one flat buffer per bucket, alive from construction on.  The steady state
  (from the 2nd iteration) has the buckets the reducer rebuilds after the first backward, in
  the order the gradients became ready (its hooks run after each ``AccumulateGrad``: the
  capture records that order), closed once they reach the size limit: 1 MiB for the
  first (``dist._DEFAULT_FIRST_BUCKET_BYTES``, when ``bucket_cap_mb`` is the default), then
  ``bucket_cap_mb`` (``compute_bucket_assignment_by_size``); one bucket list per dtype.
  Their total is the bytes of the gradients.
- Without ``gradient_as_bucket_view`` each gradient is copied into its bucket and back:
  gradients and buckets both stay alive (peak = single device + buckets).  With it the
  reducer points ``param.grad`` at its bucket view and the autograd gradient is freed right
  after it was produced.
- ``broadcast_buffers`` (default): each forward first broadcasts the module buffers through
  one flat buffer per dtype (``_broadcast_coalesced``, chunks of 250 MiB), freed right after.

ZeRO-1 (``torch/distributed/optim/zero_redundancy_optimizer.py``): each rank keeps the
optimizer state of, and updates, only the parameters ``_partition_parameters`` gives it --
whole parameters, largest first, each to the rank with the fewest elements so far -- and
then broadcasts them in place.  Its optimizer-phase temporaries are those of its own
parameters.

Not modelled: memory the communication library allocates itself (gloo / NCCL buffers).
"""

from __future__ import annotations

from torch import nn

from estimator.ranks.rankstep import Op, Rank, RankStep
from estimator.vocab.categories import Category, Phase
from estimator.vocab.errors import InputError

MIB = 2**20
FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_CAP_MB = 25.0
BROADCAST_BUCKET_BYTES = 250 * MIB  # DistributedDataParallel.broadcast_bucket_size


def replicas(timeline, model: nn.Module, strategy, target=None) -> list[Rank]:
    step = replicated(timeline, model, strategy)
    n = strategy.data_parallel
    return [Rank("replica", tuple(range(n)), step.timeline())]


def replicated(timeline, model: nn.Module, strategy) -> RankStep:
    """One DDP rank's step: the captured one plus gradient buckets and buffer broadcasts."""
    step = RankStep.of(timeline)
    for nbytes in bucket_bytes(model, step, strategy.bucket_cap_mb):
        step.add(nbytes, Category.COMMUNICATION, None, None)
    if strategy.gradient_as_bucket_view:
        for block in step.blocks:
            if block.category is Category.GRADIENT and block.alloc is not None:
                block.free = block.alloc  # replaced by its bucket view once AccumulateGrad ran
    _broadcast_buffers(step, model)
    return step


def bucket_bytes(model: nn.Module, step: RankStep, cap_mb: float = DEFAULT_CAP_MB,
                 names: set[str] | None = None) -> list[int]:
    """The sizes of the reducer's buckets in the steady state (rebuilt in gradient-ready order);
    ``names``: the parameters the wrapped module holds (default: all of ``model``'s)."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad and (names is None or name in names)}
    ready = [name for name in step.grad_order if name in params]
    order = ready + [n for n in reversed(params) if n not in ready]
    cap = int(cap_mb * MIB)
    limits = [FIRST_BUCKET_BYTES, cap] if cap_mb == DEFAULT_CAP_MB else [cap]
    open_: dict[object, list[int]] = {}  # dtype -> [bytes so far, index into limits]
    done: list[int] = []
    for name in order:
        p = params[name]
        current = open_.setdefault(p.dtype, [0, 0])
        current[0] += p.numel() * p.element_size()
        if current[0] >= limits[current[1]]:
            done.append(current[0])
            current[0], current[1] = 0, min(current[1] + 1, len(limits) - 1)
    return done + [size for size, _ in open_.values() if size]


def _broadcast_buffers(step: RankStep, model: nn.Module) -> None:
    """A flat buffer of each dtype's module buffers at the start of every forward."""
    by_dtype: dict[object, int] = {}
    for b in model.buffers():
        by_dtype[b.dtype] = by_dtype.get(b.dtype, 0) + b.numel() * b.element_size()
    if not by_dtype:
        return
    largest = min(max(by_dtype.values()), BROADCAST_BUCKET_BYTES)
    starts = [i for i, op in enumerate(step.ops)
              if op.phase is Phase.FORWARD and (i == 0 or step.ops[i - 1].phase is not Phase.FORWARD)]
    for i in reversed(starts):
        op = step.insert(i, Op("c10d.broadcast_coalesced (DDP buffers)", None, Phase.FORWARD, ""))
        step.add(largest, Category.COMMUNICATION, op, op)


# ----------------------------------------------------------------------------------------
# ZeRO-1


def zero1(timeline, model: nn.Module, strategy, target=None) -> list[Rank]:
    n = strategy.data_parallel
    parts = partition(model, n)
    base = replicated(timeline, model, strategy)
    if not any(b.category is Category.OPTIMIZER_STATE for b in base.blocks):
        raise InputError("Strategy(sharding='zero1') shards the optimizer state: this step has none "
                         "(optimizer=None, or one without state such as plain SGD)")
    groups: dict[tuple, list[int]] = {}
    steps = {}
    for rank, names in enumerate(parts):
        step = base.copy()
        # another rank's optimizer state and update temporaries do not exist here
        step.keep_params(names, replicated=(Category.PARAMETER, Category.GRADIENT))
        timeline_ = step.timeline()
        key = (timeline_.baseline, tuple(tuple(op.peaks()) for op in timeline_.ops))
        groups.setdefault(key, []).append(rank)
        steps[key] = timeline_
    return [Rank("optimizer shard", tuple(ranks), steps[key]) for key, ranks in groups.items()]


def partition(model: nn.Module, world: int) -> list[list[str]]:
    """``ZeroRedundancyOptimizer._partition_parameters``: largest first, each to the rank with
    the fewest elements so far (the first such rank); each rank's optimizer updates its share
    in that order."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    sizes = [0] * world
    parts: list[list[str]] = [[] for _ in range(world)]
    for name, p in sorted(params, key=lambda item: item[1].numel(), reverse=True):  # stable, as sorted()
        rank = sizes.index(min(sizes))
        parts[rank].append(name)
        sizes[rank] += p.numel()
    return parts

