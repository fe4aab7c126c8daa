"""The capture path of one ``report()``: symbolic in ``b`` and ``s``, ``b`` alone, or fitted
concrete captures -- which one held, and the notes that say why it fell back.

``formula`` captures the single-device step as formulas (shared by the requests of one
``compare`` with the same captured step); ``at_batch`` evaluates it at a request's batch (a
concrete capture there when it lies outside the formula's range) and, for a pipeline, maps it
to formulas in the pipeline's batch.  Named after ``CapturePath``, the choice it records;
``orchestrate.checked`` checks the arguments before, ``orchestrate.estimate`` assembles the ``Report`` after.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from estimator.account import CATEGORIES, Timeline, account, fit_timelines
from estimator.capture import compiled
from estimator.capture.records import RawCapture, StepSpec
from estimator.capture.trace import capture
from estimator.ranks.per_rank import RankStep
from estimator.reporting.result import CapturePath
from estimator.vocab.data_dependent import Policy, Site
from estimator.vocab.errors import CaptureError, SymbolicCaptureFailed
from estimator.vocab.symbolic import ZERO, NotPolynomial, Poly

if TYPE_CHECKING:
    from estimator.orchestrate.checked import Checked

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Formula:
    """The captured single-device step as formulas (before any batch is evaluated)."""

    timeline: Timeline
    path: CapturePath
    valid_from: int
    valid_to: int | None
    guards: tuple[str, ...]
    graph: Any
    seq: int | None
    seq_range: tuple[int, int | None] | None
    notes: tuple[str, ...]  # what the capture path had to do (fallbacks)
    data_dependent: tuple[Site, ...] = ()  # the data-dependent sizes used (in b; concrete: at the hint)
    own: tuple[int, Timeline] | None = None  # a compiled step's own program at its batch (static shapes)
    reads_values: bool = True  # it follows the values of the sample or weights (``RawCapture.reads_values``)
    roles: tuple[tuple[int, ...], ...] = ()  # Strategy(mesh=): the ranks grouped by their program (``RawCapture``)
    bound: Policy | None = None  # the routers' bound the captures had to take (``RawCapture.bound``)
    multiple: int = 1  # b must be a multiple of it: a job's pipeline schedule's micro-batches (``RawCapture``)
    shallow: tuple | None = None  # the repeated blocks' plan and capture it was built from (``RawCapture.shallow``)

    @property
    def seq_range_lo(self) -> int:
        return (self.seq_range or (0,))[0]


@dataclasses.dataclass(frozen=True)
class Captured(Formula):
    """The formulas of one request (a pipeline's in its batch) and the timeline at its batch."""

    at_batch: Timeline | None = None  # ``timeline`` at the sample's ``s``, or a capture at ``batch`` itself
    outside: bool = False  # ``batch`` lies outside the formula's range
    separate: bool = False  # ``at_batch`` is a capture of its own (outside, or a compiled step's own program)


def hint_of(batch: int, microbatches: int, seq: int | None) -> int:
    """The batch size a step's capture runs at: one micro-batch's rows, at least 2."""
    hint = max(batch // microbatches, 2)
    return hint + 1 if hint == seq else hint  # equal hints would make b and s one symbol (duck sizing)


Started = Callable[[RawCapture, "int | None"], None]  # a symbolic capture and its s, before it is accounted


def formula_of(checked: Checked, started: Started | None = None) -> Formula:
    """``formula`` of a checked request's single-device step (``Checked.capture_spec``)."""
    return formula(checked.model, checked.sample, checked.capture_spec, checked.batch, checked.microbatches,
                   checked.seq_dims, checked.seq, started)


def formula(model: nn.Module, sample: Any, spec: StepSpec, batch: int, microbatches: int,
            seq_dims: dict[int, tuple[int, ...]] | None, seq: int | None, started: Started | None = None) -> Formula:
    """Capture the step symbolically (b, and s when ``seq_dims``), falling back to b alone and
    then to fitted concrete captures, hinted at the batch of one micro-batch.  ``started``: called
    with a symbolic capture whose timeline the formula will be (no compiled program of its own)
    and the s it holds at, before the capture is accounted (what it starts runs beside that)."""
    notes: list[str] = []
    hint = hint_of(batch, microbatches, seq)
    graph, seq_range = None, None
    given = spec.data_dependent
    try:
        try:
            raw = capture(model, sample, spec, hint, symbolic=True, seq_dims=seq_dims)
        except SymbolicCaptureFailed as exc:  # with s symbolic: try again with b alone first
            if seq is None:
                raise
            spec = _as_found(spec, exc)
            log.info("s could not stay symbolic (%s); capturing with b symbolic only", exc)
            notes.append(f"the sequence length could not stay a symbol ({exc}): the formulas are for s = {seq}")
            seq = None
            raw = capture(model, sample, spec, hint, symbolic=True)
        if started is not None and spec.compiled is None and not raw.symbolic_regions:
            started(raw, seq)
        if raw.bound is not None:
            spec = dataclasses.replace(spec, data_dependent=raw.bound)
        timeline, path, seq_range = account(raw), CapturePath.SYMBOLIC, raw.seq_range
        notes.extend(raw.notes)
        if raw.rounded:
            notes.append(rounded_note(spec.strategy.accumulate, raw.rounded))
        valid_from, valid_to, guards, graph = raw.valid_from, raw.valid_to, raw.guards, raw.graph
        sites, reads_values, roles, multiple = raw.data_dependent, raw.reads_values, raw.roles, raw.multiple
        symbolic_regions, shallow = raw.symbolic_regions, raw.shallow
    except SymbolicCaptureFailed as exc:
        log.info("symbolic capture failed (%s); fitting concrete captures", exc)
        spec = _as_found(spec, exc)
        path, guards, valid_from, symbolic_regions, multiple, shallow = CapturePath.CONCRETE, (), 2, False, 1, None
        reads_values = True  # of several captures: counted as following the values (kept for these alone)
        try:
            timeline, graph, valid_to, note, host_notes, sites, roles = _concrete(model, sample, spec, hint, exc)
        except CaptureError as differs:
            if spec.compiled is None and not isinstance(differs, _ProgramDiffers):
                raise
            # the program follows the batch size (a Python loop over the rows; the compiler's picks):
            # the capture at this size is exact, and holds for it alone
            raw = capture(model, sample, spec, hint, symbolic=False)
            timeline, graph, valid_from, valid_to, sites = account(raw), raw.graph, hint, hint, raw.data_dependent
            roles, multiple = raw.roles, raw.multiple
            why = ("the compiler's choices follow the sizes" if spec.compiled is not None else
                   "the model's Python depends on the batch size, e.g. a loop over its rows")
            note = (f"symbolic capture failed ({exc}) and the programs at b = {hint} and {hint + 1} run different "
                    f"ops ({why}): the numbers hold for b = {hint} only; report each batch size you consider")
            host_notes = raw.notes
        notes.append(note + ("; assumed linear elsewhere" if valid_to is None else
                             "" if valid_to == valid_from else f"; it holds up to b = {valid_to}"))
        notes.extend(host_notes)
        if seq is not None:
            notes.append(f"the formulas are for s = {seq} (dynamic= needs the symbolic capture)")
            seq = None
    _annotate(graph, timeline)
    own = None
    if spec.compiled is not None:
        timeline, own, compiled_notes = _static(model, sample, spec, hint, timeline, seq, path, notes)
        notes.extend(compiled_notes)
    elif symbolic_regions:
        timeline, own, note = _own_program(model, sample, spec, hint, timeline, seq, (
            "your step's torch.compile'd regions (a parallelize function's per-block compile) compile a program of "
            "their own for each batch size (static shapes, as a loop at one batch size does)"))
        notes.append(note)
    bound = spec.data_dependent if spec.data_dependent is not given else None
    return Formula(timeline, path, valid_from, valid_to, guards, graph, seq, seq_range, tuple(notes), sites, own,
                   reads_values, roles, bound, multiple, shallow if own is None else None)


def at_batch(model: nn.Module, sample: Any, spec: StepSpec, batch: int, microbatches: int,
             captured: Formula) -> Captured:
    """The step ``captured`` evaluated at ``batch`` -- a concrete capture there when it lies
    outside the formula's range -- and, for ``microbatches > 1`` (a pipeline), turned into
    formulas in the pipeline's batch."""
    timeline, seq, notes = captured.timeline, captured.seq, list(captured.notes)
    m = microbatches
    micro = batch // m
    valid_from, valid_to = captured.valid_from, captured.valid_to
    at = timeline.at_s(seq) if seq is not None else timeline  # everything at the sample's s
    outside = micro < valid_from or (valid_to is not None and micro > valid_to)
    own = not outside and captured.own is not None and captured.own[0] == micro
    if own:  # a compiled step's program for this batch size
        at = captured.own[1]
    elif outside:  # the formula does not hold here: capture this batch size itself (at the bound the formula took)
        found = spec if captured.bound is None else dataclasses.replace(spec, data_dependent=captured.bound)
        at = account(capture(model, sample, found, micro, symbolic=False))
        notes.append(f"b={batch} is outside the formula's range; its numbers come from a capture at b={batch}")
    if m > 1:  # formulas in the pipeline's batch b: each micro-batch runs b / m rows
        try:
            timeline, at = per_micro(timeline, m), per_micro(at, m)
        except NotPolynomial:
            timeline, at = per_micro(timeline, m, True), per_micro(at, m, True)
            notes.append(rounded_note(m))
        valid_from, valid_to = m * valid_from, None if valid_to is None else m * valid_to
    return Captured(**{**vars(captured), "timeline": timeline, "valid_from": valid_from, "valid_to": valid_to,
                       "notes": tuple(notes)}, at_batch=at, outside=outside, separate=outside or own)


def per_micro(timeline: Timeline, m: int, round_up: bool = False) -> Timeline:
    """``timeline`` of micro-batches of ``b / m`` rows: its storages' and scratch bytes mapped by
    ``Poly.per_micro``, the live bytes recomputed from them."""
    return RankStep.of(timeline).per_micro(m, round_up).timeline()


def rounded_note(k: int, examples: tuple[str, ...] = ()) -> str:
    shown = f" (e.g. a tensor of {examples[0]} bytes for a micro-batch of b rows)" if examples else ""
    return (f"some tensors' bytes per sample are not a multiple of {k}{shown}: their coefficients in b (the step's "
            f"batch, {k} micro-batches of b/{k}) are rounded up, so the formula may be high by less than b bytes "
            "per such tensor")


def _annotate(graph, timeline: Timeline) -> None:
    """``node.meta["fxmem"]`` for each op's node: live bytes after it (sympy, in b), bytes it
    allocated by category, its module path and phase (``NodeMemory``)."""
    nodes = {node.name: node for node in graph.nodes}
    for op in reversed(timeline.ops):  # an extended generate() runs a node once per step: its last run's
        node = nodes.pop(op.node, None)
        if node is not None:
            node.meta["fxmem"] = NodeMemory(op)


class NodeMemory(Mapping):
    """One op's memory as ``node.meta["fxmem"]`` shows it: ``"live"`` (bytes alive after it),
    ``"allocated"`` (bytes it made, by category), ``"module"`` and ``"phase"``; the byte counts
    become sympy expressions when read (a graph has thousands of nodes, few of them read)."""

    __slots__ = ("_op",)
    _KEYS = ("live", "allocated", "module", "phase")

    def __init__(self, op) -> None:
        self._op = op

    def __getitem__(self, key: str):
        op = self._op
        if key == "live":
            return op.total.expr
        if key == "allocated":
            return {c: p.expr for c, p in zip(CATEGORIES, op.allocated) if p != ZERO}
        if key in ("module", "phase"):
            return getattr(op, key)
        raise KeyError(key)

    def __iter__(self):
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)


def _as_found(spec: StepSpec, failed: SymbolicCaptureFailed) -> StepSpec:
    """``spec`` with the data-dependent policy the failed capture had to take (a model on the meta
    device whose routers' picks its step reads: their bound, ``capture/trace._routed``), so that
    the captures after it start there instead of each stopping at the same value first."""
    return spec if failed.data_dependent is None else dataclasses.replace(spec, data_dependent=failed.data_dependent)


def _concrete(model, sample, spec: StepSpec, hint: int, why: Exception):
    """Fit concrete captures; returns the timeline, the graph, the last valid b, a note, and the
    notes (host-measured kernels, data-dependent sizes) and data-dependent sizes of the first
    capture, and the rank roles all captures agree on.

    The captures are at ``hint``, ``hint + k`` and ``4 * hint`` (``k``: the accumulated
    micro-batches, whose number must divide every captured batch; far apart, so that memory
    rounded to pages cannot pass for flat).  If ``4 * hint`` runs other ops, ``hint + 2k`` is
    used instead and the formula holds up to it only.  Memory that is linear only up to
    rounding (kernel workspaces rounded to pages) gets the line through the two ends, exact
    at ``hint``; the note states its largest deviation from the captures.
    """
    k = spec.strategy.accumulate
    next_ = hint + k
    near = [capture(model, sample, spec, b, symbolic=False) for b in (hint, next_)]
    _check_same_ops(near[0], near[1], hint, next_, why)
    far, valid_to = 4 * hint, None
    raw = capture(model, sample, spec, far, symbolic=False)
    if [op.name for op in raw.ops] != [op.name for op in near[0].ops]:
        far, valid_to = hint + 2 * k, hint + 2 * k
        raw = capture(model, sample, spec, far, symbolic=False)
        _check_same_ops(near[0], raw, hint, far, why)
    batches, raws = [hint, next_, far], [*near, raw]
    timelines = [account(r) for r in raws]
    note = f"symbolic capture failed ({why}); the formula is fitted from fake runs at b = {hint}, {next_}, {far}"
    roles = _agreed(raws)
    try:
        return (fit_timelines(batches, timelines), raws[0].graph, valid_to, note, raws[0].notes,
                raws[0].data_dependent, roles)
    except NotPolynomial:
        fitted = fit_timelines([hint, far], [timelines[0], timelines[-1]], exact=False)
        deviation = max(
            abs(op.total(b) - t.ops[i].total(b)) for b, t in zip(batches, timelines) for i, op in enumerate(fitted.ops)
        )
        note += (
            f"; memory is linear in b only up to rounding (kernel buffers rounded to 4 KiB pages): the "
            f"line through b = {hint} and {far} is exact at b = {hint}, off by {deviation:,} B at most at the "
            "other captures, and elsewhere by up to a page per rounded buffer"
        )
        return fitted, raws[0].graph, valid_to, note, raws[0].notes, raws[0].data_dependent, roles


def _agreed(raws) -> tuple[tuple[int, ...], ...]:
    """The ranks' roles every capture agrees on: ranks that share a role in each (what a rank
    receives can differ from another's at one batch size only: a balanced routing that divides
    the tokens evenly at one size and not at the next)."""
    together: dict[int, list[int]] = {}
    for raw in raws:
        for i, ranks in enumerate(raw.roles):
            for rank in ranks:
                together.setdefault(rank, []).append(i)
    split: dict[tuple[int, ...], list[int]] = {}
    for rank, where in together.items():
        split.setdefault(tuple(where), []).append(rank)
    return tuple(tuple(ranks) for ranks in split.values())


def _static(model, sample, spec: StepSpec, hint: int, timeline: Timeline, seq: int | None, path: CapturePath,
            notes_so_far: list[str]):
    """A compiled step at its own batch size: ``torch.compile`` (``dynamic`` not True) compiles a
    loop at one batch size for that size, static shapes, and Inductor plans such a program apart
    from the one-for-every-b program the symbolic capture compiled (a freed buffer reused where two
    sizes happen to coincide, ``torch/_inductor/codegen/wrapper.py`` ``ReuseLine``; small static
    matrices decomposed).  Returns the formula (raised to the static program's peak at ``hint``
    where that is higher), the capture at ``hint`` (``Formula.own``: the report's numbers there)
    and the notes."""
    if compiled.NO_GRAPH in notes_so_far:  # it ran eager: no program of its own at any size
        return timeline, None, []
    label = spec.compiled.label
    notes = [f"the step is compiled (torch.compile, {label}) and estimated as compiled: "
             f"{spec.compiled.program}", *compiled.notes(spec)]
    if spec.compiled.dynamic or path is CapturePath.CONCRETE:  # the formula's captures are static programs
        return timeline, None, notes
    timeline, own, note = _own_program(model, sample, spec, hint, timeline, seq, (
        "each batch size compiles its own program (static shapes, as a loop at one batch size does)"))
    return timeline, own, [*notes, note]


def _own_program(model, sample, spec: StepSpec, hint: int, timeline: Timeline, seq: int | None, what: str):
    """The step captured again at ``hint`` with static shapes, where ``what`` (compiled code) makes
    a program of its own for each batch size: the formula raised to that program's peak at
    ``hint`` where it is higher, the capture at ``hint`` (``Formula.own``) and the note."""
    static = account(capture(model, sample, spec, hint, symbolic=False))
    at = timeline.at_s(seq) if seq is not None else timeline
    formula_peak = max(p(hint) for p, _ in at.candidates())
    static_peak = max(p(hint) for p, _ in static.candidates())
    off = 100 * (static_peak - formula_peak) / static_peak
    raised = static_peak > formula_peak
    if raised:  # never below the program the user runs at b=hint
        timeline = timeline.raised(Poly.const(static_peak - formula_peak))
    note = (f"{what}: the numbers at b={hint} come from that program; the formula in b is the program compiled for "
            f"every b at once (dynamic=True), {formula_peak:,} B at b={hint} ({off:+.1f}% from the static program's "
            f"{static_peak:,} B)"
            + (f"; the formula is raised by the difference, {static_peak - formula_peak:,} B, at every b"
               if raised else "")
            + ("; at other batch sizes the static program can differ as much: report the batch you choose for its "
               "exact numbers" if abs(off) >= 0.5 else ""))
    return timeline, (hint, static), note


class _ProgramDiffers(CaptureError):
    """The concrete captures at two batch sizes run different ops."""


def _check_same_ops(reference, raw, b0: int, b: int, why: Exception) -> None:
    names, expected = [op.name for op in raw.ops], [op.name for op in reference.ops]
    if names != expected:
        first = next((i for i, (x, y) in enumerate(zip(expected, names)) if x != y), min(len(names), len(expected)))
        raise _ProgramDiffers(
            f"symbolic capture failed ({why}) and the concrete fallback runs different ops at b={b0} and "
            f"b={b} (first difference at op {first}): the memory of this model is not one formula in the batch size"
        )
