"""Each device's step from the captured one: ``per_rank(timeline, model, strategy)``.

The capture records one device's step (at the per-device batch ``b``).  A distributed
strategy changes what each rank holds and when: DDP adds gradient buckets, ZeRO/FSDP shards
parameters, gradients and optimizer state and adds all-gather / reduce-scatter buffers, a
pipeline stage keeps its own parameters and the activations of the micro-batches in flight.
Each strategy module edits a ``RankStep`` -- the captured step as mutable ops and blocks
(storages) whose allocation and free point at op objects, so ops can be inserted, removed or
repeated -- and turns it back into a ``Timeline``, from which the report is computed as for a
single device.

The editable step itself (``RankStep``, ``Op``, ``Block``, ``Rank``) is ``rankstep``: the strategy
modules share it, and this module only picks the strategy module.
"""

from __future__ import annotations

from torch import nn

from estimator.account import Timeline
from estimator.ranks import ddp, fsdp, pipeline
from estimator.ranks.rankstep import Block, Op, Rank, RankStep
from estimator.vocab.strategy import Sharding

__all__ = ["Block", "Op", "Rank", "RankStep", "per_rank"]


def per_rank(timeline: Timeline, model: nn.Module, strategy, target=None, at=None) -> list[Rank]:
    """The ranks of ``strategy`` from the captured single-device ``timeline`` (one ``Rank``
    covering everything for a single-device strategy).  ``model`` is the user's model (its
    parameters' shapes and module paths); ``at(poly)`` evaluates bytes at the report's batch
    (and sequence length), where a strategy's choices depend on it (a pipeline's cut)."""
    if strategy.pipeline > 1:
        return pipeline.stages(timeline, model, strategy, target, at)
    if strategy.sharding is Sharding.ZERO1:
        return ddp.zero1(timeline, model, strategy, target)
    if strategy.sharding is not None:
        return fsdp.ranks(timeline, model, strategy, target)
    if strategy.data_parallel > 1:
        return ddp.replicas(timeline, model, strategy, target)
    return [Rank("single device", (0,), timeline)]
