"""Turn captured allocation events into bytes: live memory by category after every op.

``account(raw)`` replays the events in order.  At op ``i`` the candidate peaks are everything
alive before it plus what it allocates, and that plus each of its kernel-internal scratch
values (corrections); the storages Python or autograd drop after it are subtracted before
op ``i + 1``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from estimator.capture.records import Decoding, RawCapture, RunMarks
from estimator.vocab import progress
from estimator.vocab.bookkeeping import collector_paused
from estimator.vocab.categories import Born, Category, Phase
from estimator.vocab.symbolic import ZERO, Poly, fit

CATEGORIES = tuple(Category)
_INDEX = {c: i for i, c in enumerate(CATEGORIES)}
_TEMP = _INDEX[Category.TEMPORARY]
Vector = tuple[Poly, ...]  # bytes per category, in CATEGORIES order
_tuple = tuple.__new__  # an OpMemory made without its __new__'s checks (accounting: every op)


class _OpFields(NamedTuple):
    index: int
    op: str  # aten overload
    node: str | None  # fx node name
    phase: Phase
    module: str
    live: Vector  # bytes alive by category once the op's outputs exist
    allocated: Vector  # bytes this op allocated, by category
    scratch: tuple[Poly, ...] = ()  # kernel-internal temporaries on top of ``live`` (corrections)
    total: Poly | None = None  # sum of ``live`` (computed when not given)
    owner: str | None = None  # optimizer phase: the parameter this op updates (None: several, or none)
    stream: int = 0  # the stream it runs on, which its outputs and scratch are allocated on (0: the default)


class OpMemory(_OpFields):
    """Memory at one op of the step (immutable).  A named tuple rather than a dataclass: a long
    ``generate()`` makes one per op, over a million, and a tuple is made three times faster."""

    __slots__ = ()

    def __new__(cls, index: int, op: str, node: str | None, phase: Phase, module: str, live: Vector,
                allocated: Vector, scratch: tuple[Poly, ...] = (), total: Poly | None = None,
                owner: str | None = None, stream: int = 0) -> OpMemory:
        return _tuple(cls, (index, op, node, phase, module, live, allocated, scratch,
                            _sum(live) if total is None else total, owner, stream))

    def peaks(self) -> list[Poly]:
        """The candidate peaks of this op: ``total`` and ``total + s`` for each scratch value."""
        total = self.total
        return [total, *(total + s for s in self.scratch)]

    def live_at(self, k: int) -> Vector:
        """``live`` at candidate ``k`` of ``peaks()`` (scratch counts as temporaries)."""
        if k == 0:
            return self.live
        live = list(self.live)
        live[_TEMP] += self.scratch[k - 1]
        return tuple(live)


@dataclass(frozen=True)
class Timeline:
    """The memory of one step, op by op."""

    baseline: Vector  # alive before the step: parameters, buffers, inputs, optimizer state
    ops: tuple[OpMemory, ...]
    # For each storage: (bytes, category, allocating op or -1, op after which it is freed or None;
    # -1: state freed before the first op).
    storages: tuple[tuple[Poly, Category, int, int | None], ...]
    # For each storage: the name of the parameter it holds, or is the gradient, optimizer state
    # or an optimizer temporary of (None for everything else); empty when unknown.
    owners: tuple[str | None, ...] = ()
    grad_order: tuple[str, ...] = ()  # parameters in the order backward's AccumulateGrad reached them
    # For each storage alive before the step: when it came to be in a run from a cold start (None:
    # made by the step; empty when unknown: then all of it is loaded first, in storage order).
    births: tuple[Born | None, ...] = ()
    marks: RunMarks = RunMarks()  # where the run's first step makes its lazy state
    decoding: Decoding | None = None  # mode="generate": the model's calls and the KV cache
    managed: int = 0  # bytes in CUDA managed memory besides the timeline (``RawCapture.managed``)

    def alive_at(self, index: int):
        """The storages alive while op ``index`` runs."""
        return [s for s in self.storages if s[2] <= index and (s[3] is None or s[3] >= index)]

    @property
    def has_s(self) -> bool:
        """Whether the bytes depend on the sequence length ``s`` (a capture with ``s`` symbolic)."""
        return any(p.has_s for op in self.ops for p in op.peaks()) or any(p.has_s for p in self.baseline)

    def candidates(self) -> list[tuple[Poly, tuple[int, int]]]:
        """Every candidate peak with its (op index, scratch index); the baseline if no op ran."""
        return list(self._candidates)

    def peak_at(self, b: int) -> tuple[int, int]:
        """The (op index, scratch index) of the largest candidate at batch size ``b`` (the first of
        equal ones); every byte count a polynomial in ``b`` alone."""
        found = self._peaks.get(b)
        if found is None:
            values = [poly(b) for poly, _ in self._candidates]
            found = self._peaks[b] = self._candidates[values.index(max(values))][1]
        return found

    @functools.cached_property
    def _peaks(self) -> dict[int, tuple[int, int]]:  # peak_at's answers (a report asks several times)
        return {}

    @functools.cached_property
    def _candidates(self) -> tuple[tuple[Poly, tuple[int, int]], ...]:  # a report asks several times
        found = []
        for i, op in enumerate(self.ops):
            if op.scratch:
                found.extend((poly, (i, k)) for k, poly in enumerate(op.peaks()))
            else:  # most ops (a million in a long generate()): one candidate
                found.append((op.total, (i, 0)))
        return tuple(found) or ((_sum(self.baseline), (-1, 0)),)

    def prefix(self, cut: int) -> Timeline:
        """The first ``cut`` ops, what they made and is alive after them freed there: a run that
        stops at op ``cut`` (``mode="generate"`` with fewer new tokens, a prefix of the run)."""
        storages = tuple((nbytes, category, op, cut - 1 if 0 <= op < cut and (freed is None or freed >= cut) else freed)
                         for nbytes, category, op, freed in self.storages)
        decoding = self.decoding and dataclasses.replace(self.decoding,
                                                         calls=tuple(c for c in self.decoding.calls if c < cut))
        return dataclasses.replace(self, ops=self.ops[:cut], storages=storages, decoding=decoding)

    def at_s(self, s: int) -> Timeline:
        """The same timeline with ``s`` fixed: every byte count a polynomial in ``b`` only."""
        if not self.has_s:
            return self
        return self._map(lambda p: p.at_s(s))

    def raised(self, extra: Poly) -> Timeline:
        """This timeline with ``extra`` bytes more temporaries at every op (each candidate peak raised)."""
        def up(op: OpMemory) -> OpMemory:
            live = list(op.live)
            live[_TEMP] += extra
            return op._replace(live=tuple(live), total=op.total + extra)

        return dataclasses.replace(self, ops=tuple(map(up, self.ops)))

    def _map(self, f) -> Timeline:
        """Every byte count mapped by ``f``."""

        def vec(v: Vector) -> Vector:
            return tuple(f(p) for p in v)

        ops = tuple(
            OpMemory(op.index, op.op, op.node, op.phase, op.module, vec(op.live), vec(op.allocated),
                     vec(op.scratch), f(op.total), op.owner, op.stream)
            for op in self.ops
        )
        storages = tuple((f(nbytes), *rest) for nbytes, *rest in self.storages)
        return dataclasses.replace(self, baseline=vec(self.baseline), ops=ops, storages=storages)


def _sum(vector: Vector) -> Poly:
    total = ZERO
    for p in vector:
        total = total + p
    return total


CHUNK = 1 << 16  # the ops a progress bar moves by


@collector_paused()
def account(raw: RawCapture) -> Timeline:
    """The bytes alive by category at each op of ``raw``, and its storages' lifetimes."""
    with progress.task("accounting", total=len(raw.ops), unit="op") as bar:  # a long generate(): seconds
        return _account(raw, bar)


def skeleton(raw: RawCapture, seq: int | None = None) -> Timeline:
    """What an allocator replay reads of ``account(raw)`` (at ``s = seq`` where given): the
    storages' lifetimes and each op's name, phase, scratch and stream, made in a fraction of the
    time, so that a replay can start while the step is accounted.  No byte counts alive: the
    baseline is empty and the ops are the raw events (``OpEvent``: the same four attributes),
    or, where a scratch value depends on ``s``, ops with empty vectors."""
    ops = raw.ops
    if seq is not None and any(p.has_s for e in ops for p in e.scratch):
        ops = [_tuple(OpMemory, (i, e.name, e.node, e.phase, e.module, (), (), tuple(p.at_s(seq) for p in e.scratch),
                                 ZERO, e.owner, e.stream)) for i, e in enumerate(ops)]
    storages = _lifetimes(raw)
    if seq is not None:
        storages = tuple((nbytes.at_s(seq), *rest) for nbytes, *rest in storages)
    return _timeline(raw, (), ops, storages)


def _timeline(raw: RawCapture, baseline: Vector, ops, storages) -> Timeline:
    """The timeline of ``raw`` with these bytes alive before the step, ops and storages."""
    return Timeline(baseline, tuple(ops), storages, tuple(s.owner for s in raw.storages.values()), raw.grad_order,
                    tuple(s.born for s in raw.storages.values()), raw.marks, raw.decoding, raw.managed)


def _lifetimes(raw: RawCapture) -> tuple[tuple[Poly, Category, int, int | None], ...]:
    """``Timeline.storages`` of ``raw``: each storage's bytes, category, allocating op and the op it
    is freed after (-1: state the step frees before its first op)."""
    freed_after = {sid: i for i, event in enumerate(raw.ops) for sid in event.frees}
    freed_after.update((sid, -1) for sid in raw.freed_first)
    return tuple((s.nbytes, s.category, s.op, freed_after.get(sid)) for sid, s in raw.storages.items())


def _account(raw: RawCapture, bar: progress.Bar) -> Timeline:
    current = [ZERO] * len(CATEGORIES)
    for storage in raw.storages.values():
        if storage.op < 0:
            current[_INDEX[storage.category]] += storage.nbytes
    baseline = tuple(current)
    for sid in raw.freed_first:  # state the step frees before its first op (freed "after op -1")
        current[_INDEX[raw.storages[sid].category]] -= raw.storages[sid].nbytes
    total = _sum(current)

    ops = []
    nothing = (ZERO,) * len(CATEGORIES)
    live = tuple(current)  # shared by the ops between which nothing is allocated or freed
    for i, event in enumerate(raw.ops):
        if not (i + 1) % CHUNK:
            bar.update(CHUNK)
        allocated = nothing
        if event.allocs:
            made = [ZERO] * len(CATEGORIES)
            for sid in event.allocs:
                storage = raw.storages[sid]
                k = _INDEX[storage.category]
                made[k] = storage.nbytes if made[k] is ZERO else made[k] + storage.nbytes
                current[k] += storage.nbytes
                total += storage.nbytes
            allocated, live = tuple(made), tuple(current)
        ops.append(_tuple(OpMemory, (i, event.name, event.node, event.phase, event.module, live, allocated,
                                     event.scratch, total, event.owner, event.stream)))
        for sid in event.frees:
            storage = raw.storages[sid]
            current[_INDEX[storage.category]] -= storage.nbytes
            total -= storage.nbytes
        if event.frees:
            live = tuple(current)

    bar.update(len(raw.ops) % CHUNK)
    return _timeline(raw, baseline, ops, _lifetimes(raw))


def fit_timelines(batches: Sequence[int], timelines: Sequence[Timeline], exact: bool = True) -> Timeline:
    """One timeline with bytes linear in ``b`` from concrete timelines at several batch sizes
    (``symbolic.fit``; ``exact=False`` tolerates rounding).

    The op sequences must be identical: the caller checks that.
    """
    first = timelines[0]

    def line(values: Sequence[Poly]) -> Poly:
        return fit([(b, v(0)) for b, v in zip(batches, values)], exact)

    def fit_vector(vectors: Sequence[Vector]) -> Vector:
        return tuple(line([v[k] for v in vectors]) for k in range(len(CATEGORIES)))

    def fit_scratch(i: int) -> tuple[Poly, ...]:
        scratches = [t.ops[i].scratch for t in timelines]
        if len({len(s) for s in scratches}) == 1:  # the same candidates at every size: one line each
            return tuple(line([s[k] for s in scratches]) for k in range(len(scratches[0])))
        # A kernel that keeps another number of buffers at another size (oneDNN picking another
        # implementation): the line through its in-op peak, the largest candidate at each size.
        return (line([max(s, key=lambda x: x(0), default=ZERO) for s in scratches]),)

    ops = tuple(
        OpMemory(
            op.index, op.op, op.node, op.phase, op.module,
            fit_vector([t.ops[i].live for t in timelines]),
            fit_vector([t.ops[i].allocated for t in timelines]),
            fit_scratch(i),
            stream=op.stream,
        )
        for i, op in enumerate(first.ops)
    )
    storages = first.storages
    if all(len(t.storages) == len(storages) for t in timelines):
        storages = tuple((line([t.storages[k][0] for t in timelines]),) + storages[k][1:] for k in range(len(storages)))
    return dataclasses.replace(first, baseline=fit_vector([t.baseline for t in timelines]), ops=ops, storages=storages)


def allocation_events(timeline: Timeline, b: int, after_state: Sequence[tuple[object, int]] = ()):
    """The step's allocations and frees in program order at batch size ``b``, as
    ``("alloc", key, nbytes)`` (``("alloc", key, nbytes, stream)`` for an op on a side stream,
    ``OpMemory.stream``) / ``("free", key, 0)``: the state alive before the step first,
    then ``after_state`` (``(key, nbytes)`` buffers held across steps, e.g. library
    workspaces), then for each op its outputs, its kernel scratch (the largest candidate,
    allocated and freed inside the op), and the storages dropped after it.  Input for an
    allocator model (``estimator.devices.cuda_allocator.replay``).
    """
    allocs: dict[int, list[int]] = {}
    frees: dict[int, list[int]] = {}
    for key, (nbytes, _, op, freed_after) in enumerate(timeline.storages):
        allocs.setdefault(op, []).append(key)
        if freed_after is not None:
            frees.setdefault(freed_after, []).append(key)
    sizes = [s[0](b) for s in timeline.storages]
    for key in allocs.get(-1, []):
        yield "alloc", key, sizes[key]
    for key, nbytes in after_state:
        yield "alloc", key, nbytes
    for key in frees.get(-1, []):
        yield "free", key, 0
    for i, op in enumerate(timeline.ops):
        on = (op.stream,) if op.stream else ()
        for key in allocs.get(i, []):
            yield "alloc", key, sizes[key], *on
        scratch = max((s(b) for s in op.scratch), default=0)
        if scratch > 0:
            yield "alloc", ("scratch", i), scratch, *on
            yield "free", ("scratch", i), 0
        for key in frees.get(i, []):
            yield "free", key, 0
