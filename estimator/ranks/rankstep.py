"""A captured step as editable objects: ``RankStep`` (ops and storage blocks whose allocation and
free point at op objects, so strategies insert, drop, repeat and reorder ops), and ``Rank``, one
group of identical ranks with its ``Timeline``.

The strategy modules (``ddp``, ``fsdp``, ``pipeline``) edit a ``RankStep``; ``ranks.per_rank``
picks the strategy module for a ``Strategy``.  This model is what they share, so it lives apart
from both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from estimator.account import CATEGORIES, OpMemory, Timeline
from estimator.vocab.categories import Category, Phase
from estimator.vocab.symbolic import ZERO, Poly

_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


@dataclass(eq=False)
class Op:
    """One op of a rank's step (identity matters: blocks point at it)."""

    op: str
    node: str | None
    phase: Phase
    module: str
    scratch: tuple[Poly, ...] = ()
    owner: str | None = None  # optimizer phase: the parameter it updates
    stream: int = 0  # the stream it runs on (``OpMemory.stream``)


@dataclass(eq=False)
class Block:
    """One storage of a rank's step."""

    nbytes: Poly
    category: Category
    alloc: Op | None  # allocated by this op; None: alive before the step
    free: Op | None  # freed after this op; None: alive after the step
    owner: str | None = None  # the parameter it holds, or the gradient / optimizer state of


@dataclass
class RankStep:
    """A step as editable ops and blocks (``RankStep.of(timeline)``, ``.timeline()``)."""

    ops: list[Op] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    grad_order: tuple[str, ...] = ()  # parameters in the order backward gave them a gradient

    @classmethod
    def of(cls, timeline: Timeline) -> RankStep:
        ops = [Op(o.op, o.node, o.phase, o.module, o.scratch, o.owner, o.stream) for o in timeline.ops]
        owners = timeline.owners or (None,) * len(timeline.storages)
        blocks = [
            Block(nbytes, category, ops[op] if op >= 0 else None, None if freed is None else ops[freed], owner)
            for (nbytes, category, op, freed), owner in zip(timeline.storages, owners)
        ]
        return cls(ops, blocks, timeline.grad_order)

    def per_micro(self, m: int, round_up: bool = False) -> RankStep:
        """The step with every byte count ``p(b)`` replaced by ``p(b / m)`` (``Poly.per_micro``),
        in place; returns it."""
        for b in self.blocks:
            b.nbytes = b.nbytes.per_micro(m, round_up)
        for o in self.ops:
            o.scratch = tuple(x.per_micro(m, round_up) for x in o.scratch)
        return self

    def copy(self) -> RankStep:
        """A deep copy (ops and blocks are new objects)."""
        ops = {id(o): dataclasses.replace(o) for o in self.ops}
        blocks = [
            dataclasses.replace(b, alloc=b.alloc and ops[id(b.alloc)], free=b.free and ops[id(b.free)])
            for b in self.blocks
        ]
        return RankStep(list(ops.values()), blocks, self.grad_order)

    def timeline(self) -> Timeline:
        """The ``Timeline`` of this step (live bytes by category after every op)."""
        index = {id(o): i for i, o in enumerate(self.ops)}
        allocs: dict[int, list[Block]] = {}
        frees: dict[int, list[Block]] = {}
        current = [ZERO] * len(CATEGORIES)
        storages = []
        for b in self.blocks:
            at = -1 if b.alloc is None else index[id(b.alloc)]
            freed = None if b.free is None else index[id(b.free)]
            if freed is not None and freed < at:
                raise AssertionError(f"a {b.category.value} block is freed (op {freed}) before it exists (op {at})")
            storages.append((b.nbytes, b.category, at, freed))
            if at < 0:
                current[_INDEX[b.category]] += b.nbytes
            else:
                allocs.setdefault(at, []).append(b)
            if freed is not None:
                frees.setdefault(freed, []).append(b)
        baseline = tuple(current)
        total = sum(current, ZERO)
        ops = []
        for i, o in enumerate(self.ops):
            allocated = [ZERO] * len(CATEGORIES)
            for b in allocs.get(i, ()):
                allocated[_INDEX[b.category]] += b.nbytes
                current[_INDEX[b.category]] += b.nbytes
                total += b.nbytes
            ops.append(OpMemory(i, o.op, o.node, o.phase, o.module, tuple(current), tuple(allocated), o.scratch,
                                total, o.owner, o.stream))
            for b in frees.get(i, ()):
                current[_INDEX[b.category]] -= b.nbytes
                total -= b.nbytes
        return Timeline(baseline, tuple(ops), tuple(storages), tuple(b.owner for b in self.blocks), self.grad_order)

    # -- helpers the strategies share ---------------------------------------------------
    def insert(self, position: int, op: Op) -> Op:
        """Insert ``op`` before ``self.ops[position]`` (at the end when ``position == len``)."""
        self.ops.insert(position, op)
        return op

    def add(self, nbytes: Poly | int, category: Category, alloc: Op | None, free: Op | None,
            owner: str | None = None) -> Block:
        block = Block(Poly.of(nbytes), category, alloc, free, owner)
        self.blocks.append(block)
        return block

    def keep_params(self, order: list[str], replicated: tuple[Category, ...] = ()) -> None:
        """Keep only the parameters ``order`` names (a rank's share): the others' parameter,
        gradient and optimizer-state blocks and optimizer temporaries go (but not those of a
        ``replicated`` category), and the optimizer updates the kept ones in ``order``.

        A per-parameter optimizer (the for-loop implementations) runs one segment of ops per
        parameter; a temporary one segment leaves in a local variable is freed at the same op
        of the next segment (``denom`` of Adam lives until the next parameter's replaces it),
        so it moves with the segments: freed at that op of the next kept segment, or where the
        loop ends.  Foreach implementations run over all parameters at once: their per-parameter
        outputs are kept or dropped, the ops stay."""
        kept = set(order)
        self.blocks = [b for b in self.blocks if b.owner is None or b.owner in kept or b.category in replicated]
        opt = [i for i, op in enumerate(self.ops) if op.phase is Phase.OPTIMIZER]
        segments: dict[str, list[Op]] = {}
        for i in opt:
            owner = self.ops[i].owner
            if owner is not None:
                if owner in segments and segments[owner][-1] is not self.ops[i - 1]:
                    return  # not one contiguous run per parameter: leave the order alone
                segments.setdefault(owner, []).append(self.ops[i])
        if not segments:
            return
        first = min(self.ops.index(s[0]) for s in segments.values())
        last = max(self.ops.index(s[-1]) for s in segments.values())
        if any(op.owner is None for op in self.ops[first:last + 1]):
            return  # ops shared by the parameters inside the loop: leave the order alone
        new = [segments[name] for name in order if name in segments]
        where = {id(op): (k, j) for k, seg in enumerate(new) for j, op in enumerate(seg)}
        position = {id(op): j for seg in segments.values() for j, op in enumerate(seg)}
        # what a dropped segment allocated goes with it; what it freed is freed where the loop ends
        self.blocks = [b for b in self.blocks if b.alloc is None or id(b.alloc) not in position
                       or id(b.alloc) in where]
        loop_end = new[-1][-1] if new else (self.ops[first - 1] if first else None)
        for b in self.blocks:
            dropped_free = b.free is not None and id(b.free) in position and id(b.free) not in where
            if dropped_free and (b.alloc is None or id(b.alloc) not in where):  # freed by a dropped segment
                b.free = loop_end
                continue
            if b.alloc is None or id(b.alloc) not in where or b.free is None:
                continue
            k, _ = where[id(b.alloc)]
            if id(b.free) in where and where[id(b.free)][0] == k:
                continue  # freed within its own segment
            if id(b.free) not in position:  # freed after the loop
                continue
            j = position[id(b.free)]
            nxt = new[k + 1] if k + 1 < len(new) else None
            b.free = nxt[j] if nxt is not None and j < len(nxt) else loop_end
        self.ops[first:last + 1] = [op for seg in new for op in seg]


@dataclass(frozen=True)
class Rank:
    """The step of one group of identical ranks: ``role`` names them ("replica",
    "stage 1/4 (blocks 3:6)", "shard 3/4"), ``ranks`` are their indices."""

    role: str
    ranks: tuple[int, ...]
    timeline: Timeline
