"""``report(depth_symbols=True)``: the step's peak in the batch size ``b`` and the number of
blocks ``L`` of the model's repeated blocks (``DepthFormula``).

A model whose blocks repeat is captured with five units of them and built to its depth
(``capture/repeated_blocks.py``: the copies of the template unit are its ops and tensors again,
proven by three captured units).  The same capture builds the step at any depth from six units
on, so the formula is exact without fitting: the step is built at the model's ``U`` units and at
``U + 1``, and every candidate peak (the bytes alive at one op, with its kernel scratch) is a line
in the number of units through its two values.  Which ops are candidates at every depth: the ops
that are no copy (the head, the five captured units, the loss, what runs outside the blocks), and
of the copies the first and the last (``repeated_blocks.extend``'s origins: the same op of the
template at the first built unit, and at the last one, counted from the end).  Any copy between
holds, at each of its ops, a value on the line from the first copy's to the last's (each copy moves
every count by the same bytes), so its peak is never above both.  The formula is the max of these
lines.

What one capture cannot see: code outside the blocks that follows their number through the config
(a loop over its ``layer_types``).  So the model one unit deeper is captured too
(``trace.capture(deeper=True)``, ``capture/depth.py``) and must run the step built one unit deeper,
op for op and byte for byte, or the formula is refused naming the first op where they part
(``_checked``); a model without a config that names its depth is not checked, and a note says so.

Not supported (refused by name): a step whose blocks were not built from a few (no repeated
blocks, the proof failed, a compiled step), ``generate()`` (its decode steps are built after the
blocks), strategies over several devices.
"""

from __future__ import annotations

import dataclasses

from estimator.account import Timeline, account
from estimator.capture import repeated_blocks
from estimator.capture.trace import capture
from estimator.devices import cuda
from estimator.orchestrate.path import Formula, hint_of
from estimator.reporting.depth import DepthFormula, DepthPiece
from estimator.reporting.result import CapturePath
from estimator.vocab.categories import Mode
from estimator.vocab.errors import CaptureError, InputError
from estimator.vocab.symbolic import Poly, undominated

UNITS_FROM = repeated_blocks.UNITS + 1  # one built unit at least: its first and last copy


def check(request) -> None:
    """Refuse what a depth formula cannot be made of, before any capture."""
    if request.spec.mode is Mode.GENERATE:
        raise InputError("depth_symbols=True with mode='generate': its decode steps are built after the blocks; "
                         "report the generation at each depth you consider")
    if request.strategy.distributed:
        raise InputError(f"depth_symbols=True with strategy={request.strategy.describe()!r}: the depth formula is "
                         "made for one device's step, not per rank")


def build(request, formula: Formula) -> DepthFormula:
    """The depth formula of ``request`` (``orchestrate.checked.Checked``) whose capture is ``formula``."""
    if formula.shallow is None:
        why = next((n for n in formula.notes if "every one of its" in n), None) or (
            "the batch size could not stay a symbol" if formula.path is CapturePath.CONCRETE else
            "the model holds no nn.ModuleList of six or more blocks that repeat, or the step is compiled")
        raise CaptureError(f"depth_symbols=True: the step's blocks were not built from a capture of a few of them "
                           f"({why}), so there is no formula in their number")
    plan, shallow = formula.shallow
    target, points = request.spec.target, {}
    for units in (plan.units, plan.units + 1):
        origins: list = []
        at_depth = dataclasses.replace(plan, units=units)
        timeline = account(repeated_blocks.extend(shallow, at_depth, origins, plan))  # (the last: one unit deeper)
        # what Report.peak adds to every op (the cuBLAS workspaces: one per thread that runs matmuls, at any depth)
        held = Poly.const(cuda.workspaces_held(timeline, target))
        points[units] = _candidates(timeline, origins, at_depth.copies), held
    (here, held), (deeper, _) = points[plan.units], points[plan.units + 1]
    checked = _checked(request, formula, timeline)
    if here.keys() != deeper.keys():
        raise CaptureError("depth_symbols=True: the step built one unit deeper runs other ops "
                           "(a bug: please report it)")
    lines: dict[tuple[Poly, Poly], None] = {}
    for key, value in here.items():
        per_unit = deeper[key] - value
        lines.setdefault((value - per_unit * plan.units + held, per_unit))
    pieces = _nondominated(list(lines), formula.valid_from, formula.seq_range_lo)
    units = "blocks" if plan.period == 1 else f"units of {plan.period} blocks"
    notes = [f"{plan.name}: the step built at {plan.units} and {plan.units + 1} {units} from its capture of "
             f"{plan.captured} blocks; each candidate peak (the bytes alive at an op) is a line in their number: "
             "exact, not fitted", checked]
    if plan.head:
        notes.append(f"the first {plan.head} blocks of {plan.name} are of their own: L counts them too")
    return DepthFormula(plan.name, plan.blocks, plan.head, plan.period, UNITS_FROM,
                        tuple(DepthPiece(fixed, per_unit) for fixed, per_unit in pieces),
                        formula.valid_from, formula.valid_to, formula.seq, tuple(notes))


def _checked(request, formula: Formula, built: Timeline) -> str:
    """Check the step built one unit deeper against the model one unit deeper: its config says so
    and its shallow copy is captured (``trace.capture(deeper=True)``), so code outside the blocks
    that follows their number (a loop over the config's layers) runs as it would there; the note
    says what was checked.  ``CaptureError`` where the two differ."""
    spec = request.capture_spec
    if formula.bound is not None:
        spec = dataclasses.replace(spec, data_dependent=formula.bound)
    seq_dims = request.seq_dims if formula.seq is not None else None
    try:
        raw = capture(request.model, request.sample, spec, hint_of(request.batch, request.microbatches, formula.seq),
                      symbolic=True, seq_dims=seq_dims, deeper=True)
    except CaptureError as exc:
        return (f"not checked one unit deeper ({exc}): the formula assumes the code outside the blocks does not "
                "follow their number")
    real = account(raw)
    if real.baseline != built.baseline or len(real.ops) != len(built.ops) or real.storages != built.storages \
            or any(_op(a) != _op(b) for a, b in zip(real.ops, built.ops)):
        at = next((i for i, (a, b) in enumerate(zip(real.ops, built.ops)) if _op(a) != _op(b)),
                  min(len(real.ops), len(built.ops)))
        where = f"op {at}: {real.ops[at].op} in {real.ops[at].module or '-'}" if at < len(real.ops) else "its end"
        raise CaptureError(f"depth_symbols=True: the step built one unit deeper from the captured blocks is not the "
                           f"step of the model one unit deeper, its config saying so (from {where}): something outside "
                           "the blocks follows their number (a loop over the config's layers) or the data, so the peak "
                           "is no formula in the depth; report each depth you consider")
    return ("checked one unit deeper: the model with its config saying so runs exactly the step the formula is "
            "built from")


def _op(op) -> tuple:
    """What two steps must share at an op (but the fx node's name)."""
    return op.op, op.phase, op.module, op.live, op.allocated, op.scratch, op.total, op.owner


def _candidates(timeline: Timeline, origins: list, copies: range) -> dict[tuple, Poly]:
    """The candidate peaks of a step whose built units are ``copies``, by where they are at every
    depth: an op that is no copy, or the first or last copy of a template op; and which scratch value."""
    first, last = copies[0], copies[-1]
    found = {}
    for op, (i, real) in zip(timeline.ops, origins):
        tags = [("op", i)] if real is None else [t for t, unit in ((("first", i), first), (("last", i), last))
                                                  if real == unit]
        for tag in tags:
            for k, poly in enumerate(op.peaks()):
                found[(*tag, k)] = poly
    return found


def _nondominated(lines: list[tuple[Poly, Poly]], b_lo: int, s_lo: int) -> list[tuple[Poly, Poly]]:
    """The lines ``fixed + u * per_unit`` that can be the largest somewhere with ``u >= UNITS_FROM``,
    ``b >= b_lo`` (and ``s >= s_lo``): coefficient-wise dominance at the domain's corner and of the
    slope, which keeps every line that can be the maximum (and possibly a few that cannot)."""
    corner = [((fixed + per_unit * UNITS_FROM).shifted(b_lo, s_lo), per_unit.shifted(b_lo, s_lo))
              for fixed, per_unit in lines]
    return [lines[n] for n in undominated(corner)]
