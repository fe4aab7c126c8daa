"""``report(dtype_symbols=True)``: the step's bytes in the batch size ``b`` and the element width
``w`` of the model's float dtype (``DtypeFormula``).

A single capture cannot tell which tensors follow the model's dtype: kernels differ by dtype (CPU
bf16 matmuls keep oneDNN scratch, CPU attention upcasts bf16 to fp32, norms keep fp32
statistics, master weights stay fp32).  So the step is captured at two widths -- the model
cast to fp32 (``w = 4``) and to bf16 (``w = 2``), as ``model.to(dtype)`` casts it, float sample
tensors with it -- and every candidate peak (the bytes alive at one op, by category) becomes
the line through its two values: ``a + c·w``, a tensor that follows the dtype giving ``a = 0``,
a fixed fp32 or int64 one ``c = 0``.  The peak is the ``Max`` over the candidates that are the
maximum at either width, so it is exact at both by construction.

The two steps are aligned op by op (``difflib`` on the op names when they differ: an op one
width does not run -- the ``_to_copy`` of a ``.float()`` that is a no-op at fp32 -- counts the
bytes alive between that width's neighbouring ops there), which keeps the formula exact at both
widths; the notes name the ops.  fp16 has bf16's width: it is captured too, and shares the
bf16 line when it has bf16's peak formula and categories at the peak, else gets a line of its
own (through fp32 and fp16) and a note saying where the steps differ.

Not supported: autocast (``amp=``: its compute dtype is 16-bit only, so no second width of it can
be captured) and strategies over several devices.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch import nn

from estimator.account import CATEGORIES, OpMemory, Timeline, Vector
from estimator.capture import steps
from estimator.capture.dtypes import DTYPES, NAMES, cast, model_dtype, width
from estimator.devices import cuda
from estimator.orchestrate.path import Formula
from estimator.reporting.dtypes import DtypeFormula, WidthLine, WidthPiece
from estimator.vocab.categories import Phase
from estimator.vocab.errors import CaptureError, InputError
from estimator.vocab.strategy import Strategy
from estimator.vocab.symbolic import ZERO, Poly, WidthPoly, nondominated

HIGH, LOW, CHECKED = "fp32", "bf16", "fp16"  # the two widths of the line, and the 16-bit dtype checked against it


def check(request) -> None:
    """Refuse what a dtype formula cannot be made of, before any capture."""
    if request.spec.precision.amp is not None:
        raise InputError(
            f"dtype_symbols=True with amp={request.spec.precision.amp!r}: autocast computes in a 16-bit dtype only "
            "(bf16 or fp16, both 2 bytes), so no second width of the compute dtype can be captured and its bytes "
            "cannot be a line in a width symbol; estimate amp='bf16' and amp='fp16' with a report each, or drop amp "
            "for a formula in the model's dtype")
    if request.strategy.distributed:
        raise InputError(f"dtype_symbols=True with strategy={request.strategy.describe()!r}: formulas in the dtype "
                         "are made for one device's step (accumulation, checkpointing, master weights), not per rank")
    model_dtype(request.model)


def build(request, formula: Formula, remake: Callable[[nn.Module, Any, Strategy], Any],
          capture: Callable[[Any], Formula]) -> DtypeFormula:
    """The dtype formula of ``request`` (``orchestrate.checked.Checked``) whose own capture is ``formula``.

    ``remake(model, sample, strategy)`` checks ``report()``'s other arguments again for a cast
    copy (``checked.check``); ``capture(request)`` captures one (``estimate.capture_formula``).
    """
    source = model_dtype(request.model)
    notes, captured = [], {}
    for name in (HIGH, LOW, CHECKED):
        if DTYPES[name] == source:
            captured[name] = formula
            continue
        try:
            captured[name] = capture(_request_at(request, name, remake))
        except (InputError, CaptureError) as exc:
            if name != CHECKED:
                kind = InputError if isinstance(exc, InputError) else CaptureError
                raise kind(f"dtype_symbols=True: the step could not be captured at {name}: {exc}") from exc
            notes.append(f"fp16: the step could not be captured in fp16 ({exc}); the formula is for fp32 and bf16")
    seq = _common_seq({name: f.seq for name, f in captured.items()}, request.seq, notes)
    timelines = {n: f.timeline if seq is not None or request.seq is None else f.timeline.at_s(request.seq)
                 for n, f in captured.items()}
    valid_from = max(f.valid_from for f in captured.values())
    uppers = [f.valid_to for f in captured.values() if f.valid_to is not None]
    valid_to = min(uppers) if uppers else None
    guards = tuple(dict.fromkeys(g for f in captured.values() for g in f.guards))
    batch = request.batch
    at = min(max(batch, valid_from), valid_to if valid_to is not None else batch)  # where the categories are
    if at != batch:
        notes.append(f"b = {batch} is outside the range of the dtype formula; its categories are at b = {at}")
    target = request.spec.target
    lines = []
    first = _Line(timelines[HIGH], timelines[LOW], (HIGH, LOW), target, at, seq, valid_from, valid_to)
    notes.extend(first.differences())
    lines.append(first)
    if CHECKED in timelines:
        own = _Line(timelines[HIGH], timelines[CHECKED], (HIGH, CHECKED), target, at, seq, valid_from, valid_to)
        differs = _fp16_differences(timelines[LOW], timelines[CHECKED])
        if own.same_low(first):
            first.names += (CHECKED,)
            notes.append("fp16: its step holds the bf16 step's bytes at every op, so the line is exact at fp16 too"
                         if not differs else f"fp16: its peak formula and categories at the peak are bf16's, though "
                         f"its step holds other bytes elsewhere ({differs}): the line is exact at fp16 too")
        else:
            lines.append(own)
            notes.extend(own.differences())
            notes.append(f"fp16 ({width(CHECKED)} bytes, as bf16) holds other bytes than bf16 ({differs}), so fp16 "
                         "has a line of its own (through fp32 and fp16), exact at both")
    notes.extend(_general_notes(request, source, target))
    return DtypeFormula(
        model_dtype=NAMES.get(source, str(source)),
        lines=tuple(line.result() for line in lines),
        batch=batch, seq=seq, valid_from=valid_from, valid_to=valid_to, guards=guards,
        params=sum(p.numel() for p in steps.trainable(request.model)),
        notes=tuple(notes),
    )


def _request_at(request, name: str, remake):
    """``request`` for the model and sample cast to ``name``.  With master weights, an fp32 model
    keeps fp32 copies too (which ``report()`` refuses as pointless): the w = 4 point of the same
    program."""
    model, sample = cast(request.model, request.sample, DTYPES[name])
    strategy = request.strategy
    if not (strategy.master_weights and DTYPES[name].itemsize >= 4):
        return remake(model, sample, strategy)
    plain = remake(model, sample, dataclasses.replace(strategy, master_weights=False))
    spec = dataclasses.replace(plain.spec, optimizer=steps.master_weights(plain.spec.optimizer), strategy=strategy)
    return dataclasses.replace(plain, spec=spec)


def _common_seq(seqs: dict[str, int | None], seq: int | None, notes: list[str]) -> int | None:
    """``s`` when every capture kept it a symbol, else None (the formulas are then at the sample's ``s``)."""
    lost = [name for name, kept in seqs.items() if kept is None]
    if seq is None or not lost:
        return seq
    notes.append(f"the sequence length could not stay a symbol at {', '.join(lost)} (that dtype's report says why): "
                 f"the dtype formula is for s = {seq}")
    return None


class _Line:
    """The candidates of two captures aligned op by op, and the line through them."""

    def __init__(self, high: Timeline, low: Timeline, names: tuple[str, str], target, batch: int, seq: int | None,
                 valid_from: int, valid_to: int | None):
        self.names = names  # (the high dtype, the low dtype, [more low dtypes with the same bytes])
        self.w_lo, self.w_hi = width(names[1]), width(names[0])
        self.only: dict[str, Counter] = {names[0]: Counter(), names[1]: Counter()}
        self.candidates = list(self._aligned(low, high))
        fixed = [_fixed(t, target) for t in (low, high)]
        self.totals = [[_sum(c[k]) + fixed[k] for c in self.candidates] for k in (0, 1)]
        s_lo = 2 if seq is not None else 0
        self.envelope = [set(nondominated(t, valid_from, valid_to, s_lo)) for t in self.totals]

        def value(p: Poly) -> int:
            return p(batch, seq) if p.has_s else p(batch)

        # The first maximum at the batch, as a Report picks its peak op: each width's own report's.
        self.peak = [max(range(len(self.candidates)), key=lambda i, k=k: value(self.totals[k][i])) for k in (0, 1)]
        self.keep = sorted(self.envelope[0] | self.envelope[1] | set(self.peak))
        self.pieces = [self._piece(i) for i in self.keep]

    def _piece(self, i: int) -> WidthPiece:
        low, high, *where = self.candidates[i]
        breakdown = {c: self._poly(lo, hi) for c, lo, hi in zip(CATEGORIES, low, high)}
        return WidthPiece(self._poly(self.totals[0][i], self.totals[1][i]), *where, breakdown)

    def _poly(self, lo: Poly, hi: Poly) -> WidthPoly:
        return WidthPoly(lo, hi, self.w_lo, self.w_hi)

    def _aligned(self, low: Timeline, high: Timeline):
        """``(live at low, live at high, phase, op, module)`` for every candidate peak of the two
        steps, aligned op by op (``live_at(k)``: outputs, and kernel scratch as temporaries)."""
        a, b = [op.op for op in low.ops], [op.op for op in high.ops]
        blocks = ([("equal", 0, len(a), 0, len(b))] if a == b
                  else difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes())
        if not a and not b:
            yield low.baseline, high.baseline, Phase.FORWARD, "(before the step)", ""
            return
        for tag, i1, i2, j1, j2 in blocks:
            if tag == "equal":
                for x, y in zip(low.ops[i1:i2], high.ops[j1:j2]):
                    for k in range(max(len(x.scratch), len(y.scratch)) + 1):
                        yield _live(x, k), _live(y, k), *_where(y, k)
                continue
            between = _before(high, j1)
            for x in low.ops[i1:i2]:  # ops the high width does not run: its bytes between its ops
                self.only[self.names[1]][(x.op, x.module)] += 1
                for k in range(len(x.scratch) + 1):
                    yield _live(x, k), between, *_where(x, k)
            between = _before(low, i2)
            for y in high.ops[j1:j2]:
                self.only[self.names[0]][(y.op, y.module)] += 1
                for k in range(len(y.scratch) + 1):
                    yield between, _live(y, k), *_where(y, k)

    def same_low(self, other: _Line) -> bool:
        """Whether the low width holds the same peak formula, and categories at its peak, in both
        lines."""
        return ({self.totals[0][i] for i in self.envelope[0]} == {other.totals[0][i] for i in other.envelope[0]}
                and self.candidates[self.peak[0]][0] == other.candidates[other.peak[0]][0])

    def differences(self) -> list[str]:
        """A note naming the ops only one of the two steps runs (none when they run the same)."""
        parts = []
        for name, found in self.only.items():
            if found:
                shown = ", ".join(f"{n} × {op.removeprefix('aten.')}" + (f" ({module})" if module else "")
                                  for (op, module), n in found.most_common(4))
                rest = sum(found.values()) - sum(n for _, n in found.most_common(4))
                more = f" and {rest} more" if rest else ""
                parts.append(f"only at {name}: {shown}{more}")
        if not parts:
            return []
        return [f"the {self.names[0]} and {self.names[1]} steps run different ops ({'; '.join(parts)}); they are "
                "aligned op by op, an op one step does not run counting that step's bytes between its neighbours, so "
                "the formula stays exact at both widths, but its coefficients of w mix those ops' bytes (a tensor made "
                f"only at {self.names[1]} is a constant minus a multiple of w)"]

    def result(self) -> WidthLine:
        peaks = {name: self.keep.index(self.peak[0 if width(name) == self.w_lo else 1]) for name in self.names}
        return WidthLine({n: width(n) for n in self.names}, tuple(self.pieces), peaks)


def _live(op: OpMemory, k: int) -> Vector:
    return op.live_at(k if k <= len(op.scratch) else 0)


def _where(op: OpMemory, k: int) -> tuple:
    return op.phase, op.op + (" (kernel scratch)" if k else ""), op.module  # k > 0: scratch at one width at least


def _before(t: Timeline, j: int) -> Vector:
    """The bytes alive by category between op ``j - 1`` (and what is freed after it) and op ``j``."""
    if j < len(t.ops):
        return tuple(live - new for live, new in zip(t.ops[j].live, t.ops[j].allocated))
    end = dict.fromkeys(CATEGORIES, ZERO)
    for nbytes, category, _, freed in t.storages:
        if freed is None:
            end[category] += nbytes
    return tuple(end.values())


def _sum(vector: Vector) -> Poly:
    total = ZERO
    for p in vector:
        total = total + p
    return total


def _fixed(t: Timeline, target) -> Poly:
    """Bytes held beside the step's tensors at every op, as ``Report.peak`` counts them (CUDA: the
    cuBLAS workspaces)."""
    return Poly.const(cuda.workspaces_held(t, target))


def _fp16_differences(bf16: Timeline, fp16: Timeline) -> str:
    """Where the fp16 step's bytes differ from the bf16 step's ("" where they are the same at every
    op): how many ops, and the first few with what differs."""
    if [op.op for op in bf16.ops] != [op.op for op in fp16.ops]:
        return "the two steps run different ops"
    found = Counter()
    for x, y in zip(bf16.ops, fp16.ops):
        if x.peaks() != y.peaks() or x.live != y.live:
            what = "kernel scratch" if x.allocated == y.allocated and x.live == y.live else "outputs"
            found[(x.op.removeprefix("aten."), x.module, what)] += 1
    if not found and bf16.baseline == fp16.baseline:
        return ""
    shown = ", ".join(f"{op}" + (f" in {module}" if module else "") + f" ({what}, {n}×)"
                      for (op, module, what), n in found.most_common(3))
    return f"{sum(found.values())} ops differ, e.g. {shown}" if found else "the state before the step differs"


def _general_notes(request, source, target) -> list[str]:
    notes = [f"captured with the model's {NAMES.get(source, source)} tensors (parameters, buffers, float sample "
             "tensors) cast to each dtype as model.to(dtype) casts them; tensors of other dtypes stay as they are"]
    if request.strategy.master_weights:
        notes.append("master weights: the w = 4 (fp32) point keeps fp32 master copies of fp32 parameters (what "
                     "report() refuses as pointless), so the copies, the fp32 gradients and the optimizer state stay "
                     "constants in w and the parameters and gradients follow it")
    if target.is_cuda:
        notes.append("CUDA: the formula is the tensors' bytes plus the cuBLAS workspaces (what Report.peak is); the "
                     "caching allocator's 512-byte blocks and segments (max_memory_allocated/reserved) are not linear "
                     "in the width: a report of one dtype replays them")
    return notes
