"""``generate()`` with many new tokens, from a run of a few: the decode steps captured once.

Every decode step of ``generate()`` runs the same program: the model on one new token, the
logits processors, the token appended, the next step's inputs made; a dynamic cache holds one
token more at each step (``torch.cat``), a static one is written in place.  Capturing ``n``
steps to learn that costs ``n`` times one step, and users ask for hundreds or thousands.

So the capture runs ``generate()`` as a run of ``n`` new tokens runs it (``max_new_tokens=n``:
a static cache and its masks are sized for ``n``), but leaves its loop after ``CALLS`` calls of
the model (``steps.Generation.stop_after``, where the loop asks whether to go on: host Python,
no tensor op).  Its calls are the prefill, a first decode step (it frees what the prefill made),
three more that prove the repetition, and a last one (the loop left after it, as a real run's
last).  ``extend`` then builds the run of ``n`` calls, event by event, and says so in the notes:

- the proof: the three steps before the last run the same ops (names, modules, phases, the
  categories of what each allocates, its kernels' scratch values); every byte count moves by the
  same amount from one step to the next (its second difference is zero, as polynomials in ``b``
  and ``s``); every tensor a step makes is freed by the same op of the same step or of the
  next, or never, in each of them; they free nothing made before them; and the last step is the
  steps' program up to where it stops (the next step's inputs are not made), its bytes one more
  move along the same line;
- the extension: steps ``CALLS - 1`` to ``n - 2`` are the last proven step moved along its line,
  each freeing what the one before made as the proven steps do; the last step is the captured
  last one moved to position ``n - 1``, freeing what the step before it made as it did in the
  capture, and what earlier calls made (the prefill's tensors) as captured;
- with the prompt length ``s`` a symbol, the guards each step adds (its position against the
  model's limit) move by one token per step too (``_guarded``).

Refused before the proof: a cache whose growth fxmem does not know (``generation.cache_steady``:
quantized or offloaded layers, other kinds), a sliding window still filling at the first proven
step, and on the CPU target a kernel measured on the host whose buffers follow the cache length
(its size ranges need not hold beyond the steps seen).  What three steps cannot show: a size that
follows the cache length through a rounding coarser than three tokens (a block mask padded to
128) looks constant; the known cache layers have none.

Anything else raises ``NotRepeating`` (its message names the step and the op): the caller then
captures every step and says why in the notes.  The result is byte for byte the full capture's
(``tests/test_decode_steps.py`` compares both paths); only the fx graph is the shortened run's
(its nodes stand for every step's).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Any

from estimator.capture import steps, symbols
from estimator.capture.records import RawCapture, StepSpec
from estimator.capture.tracker import OpEvent, Storage
from estimator.vocab.bookkeeping import collector_paused
from estimator.vocab.categories import Mode
from estimator.vocab.symbolic import B, S, ZERO

CALLS = 6  # the prefill, the first decode step, three proving the repetition, the last
FIRST, BEFORE, TEMPLATE, LAST = CALLS - 4, CALLS - 3, CALLS - 2, CALLS - 1  # the proving steps, the last one


class NotRepeating(Exception):
    """The captured decode steps do not repeat as ``extend`` needs (the message says where)."""


def shortened(spec: StepSpec) -> StepSpec | None:
    """``spec`` with its ``generate()`` left after ``CALLS`` calls of the model, or None where the
    full run is as cheap (``new_tokens <= CALLS``) or the step is not a generation."""
    generation = spec.step
    if spec.mode is not Mode.GENERATE or not isinstance(generation, steps.Generation) \
            or generation.stop_after is not None or generation.new_tokens <= CALLS:
        return None
    return dataclasses.replace(spec, step=dataclasses.replace(generation, stop_after=CALLS))


def extend(raw: RawCapture, new_tokens: int) -> RawCapture:
    """The capture of ``generate()`` with ``new_tokens`` calls from ``raw``, its run left after
    ``CALLS`` calls (see the module); ``NotRepeating`` where the proof fails."""
    with collector_paused():
        return _Extension(raw).run(new_tokens)


def _later(guards: tuple, tokens: int) -> tuple:
    """``guards`` of a step ``tokens`` steps later: each position ``s + k`` becomes ``s + k + tokens``."""
    return tuple(g.xreplace({S: S + tokens}) for g in guards)


def _moved(storage: Storage, grown, op: int) -> Storage:
    nbytes = storage.nbytes if grown is ZERO else storage.nbytes + grown
    return Storage(nbytes, storage.category, op, storage.extra, storage.owner, storage.born)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a storage was made: the call's segment (ops from the call's first op to the next
    call's; -1: before the prefill), the op's offset in it and the output's index."""

    segment: int
    offset: int
    index: int


class _Extension:
    def __init__(self, raw: RawCapture):
        calls = raw.decoding.calls if raw.decoding is not None else ()
        if len(calls) != CALLS:
            raise NotRepeating(f"generate() called the model {len(calls)} times before its loop ended, not {CALLS}")
        settled = raw.decoding.steady_from
        if settled is None:
            raise NotRepeating(f"its {raw.decoding.cache} has layers whose growth fxmem does not know (quantized, "
                               "offloaded, or a sliding window that follows a symbolic prompt length)")
        if settled > FIRST:
            raise NotRepeating(f"a sliding window of its {raw.decoding.cache} was still filling at decode step "
                               f"{settled - 1}: the steps after it differ")
        self.raw = raw
        self.starts = (*calls, len(raw.ops))
        self.slot: dict[int, _Slot] = {}  # storage -> where it was made
        self.freed_at: dict[int, int] = {}  # storage -> the op after which it is freed
        for i, op in enumerate(raw.ops):
            segment = self._segment(i)
            for k, sid in enumerate(op.allocs):
                self.slot[sid] = _Slot(segment, i - self._start(segment), k)
            for sid in op.frees:
                self.freed_at[sid] = i

    def _start(self, segment: int) -> int:
        return 0 if segment < 0 else self.starts[segment]

    def _segment(self, i: int) -> int:
        return bisect.bisect_right(self.starts, i, hi=CALLS) - 1  # -1: before the prefill

    def _ops(self, segment: int) -> list[OpEvent]:
        return self.raw.ops[self.starts[segment]:self.starts[segment + 1]]

    def _signature(self, op: OpEvent, kept: tuple[bool, ...] = ()) -> tuple:
        """What must repeat of an op; ``kept``: per output, whether its category is left out (the
        run's result: the last step's ids are the output, a step's are a temporary)."""
        storages = self.raw.storages
        return (op.name, op.phase, op.module, op.owner, len(op.scratch),
                tuple((None if k else storages[s].category, storages[s].owner, storages[s].born)
                      for s, k in itertools.zip_longest(op.allocs, kept[:len(op.allocs)], fillvalue=False)))

    def _fate(self, sid: int) -> tuple[int, int] | None:
        """Where the storage is freed, from where it was made: (segments later, op offset there);
        None: never."""
        i = self.freed_at.get(sid)
        if i is None:
            return None
        segment = self._segment(i)
        return segment - self.slot[sid].segment, i - self._start(segment)

    def _where(self, segment: int, offset: int) -> str:
        op = self._ops(segment)[offset]
        return f"{op.name} in {op.module or 'generate()'} at decode step {segment}"

    def run(self, new_tokens: int) -> RawCapture:
        proof = [self._ops(s) for s in (FIRST, BEFORE, TEMPLATE)]
        signatures = [[self._signature(op) for op in ops] for ops in proof]
        if not signatures[0] == signatures[1] == signatures[2]:
            offset = next((o for o, (a, b, c) in enumerate(zip(*signatures)) if not a == b == c),
                          min(map(len, signatures)))
            raise NotRepeating(f"decode steps {FIRST} to {TEMPLATE} run different ops (first at op {offset} of "
                               f"step {FIRST}: {self._where(FIRST, min(offset, len(proof[0]) - 1))})")
        moves = self._moves(proof)
        pattern = self._fates(proof)
        self._ends(moves, pattern)
        return self._guarded(self._built(new_tokens, moves, pattern), new_tokens - CALLS)

    def _guarded(self, raw: RawCapture, extra: int) -> RawCapture:
        """With ``s`` symbolic each step adds the guards of its position (``s + k <= 2048``: the
        stopping test compares the length with ``max_position_embeddings``): the proven steps add
        the same ones moved by one token; the built steps add the template's moved on, and the
        last step the captured last one's moved to its call, and the ranges narrow by them.  The
        captured last step's guard is one a real last step does not add (its test is done by
        then): the range in ``s`` comes out one token short of the full capture's, on the safe side."""
        per_call = self.raw.call_guards
        if not any(per_call):
            return raw
        if len(per_call) != CALLS or not per_call[TEMPLATE] == _later(per_call[BEFORE], 1) \
                == _later(per_call[FIRST], 2):
            raise NotRepeating("the decode steps add guards on s that do not move with the position: "
                               + "; ".join(", ".join(map(str, g)) for g in per_call[FIRST:LAST]))
        added = [e for k in range(1, extra + 1) for e in _later(per_call[TEMPLATE], k)] + \
            list(_later(per_call[LAST], extra))
        valid = symbols.narrow(raw.valid_from, raw.valid_to, added, B)
        seq = symbols.narrow(*raw.seq_range, added, S) if raw.seq_range is not None else None
        guards = tuple(dict.fromkeys((*raw.guards, *map(str, added))))
        return dataclasses.replace(raw, valid_from=valid[0], valid_to=valid[1], seq_range=seq, guards=guards)

    def _moves(self, proof: list[list[OpEvent]]) -> list[tuple[list, list]]:
        """For each op of the template step, how each output's bytes and each scratch value move
        from one step to the next; ``NotRepeating`` where they do not move on a line."""
        storages = self.raw.storages
        moves = []
        for offset, ops in enumerate(zip(*proof)):
            sizes = [[storages[s].nbytes for s in op.allocs] for op in ops]
            scratch = [list(op.scratch) for op in ops]
            for values in (sizes, scratch):
                for a, b, c in zip(*values):
                    if c - b != b - a:
                        raise NotRepeating(f"{self._where(FIRST, offset)}: its bytes do not grow by the same amount "
                                           f"at each step ({a}, {b}, {c})")
            move = ([c - b for b, c in zip(sizes[1], sizes[2])], [c - b for b, c in zip(scratch[1], scratch[2])])
            if ops[2].kernel is not None and any(m != ZERO for m in (*move[0], *move[1])):
                # a kernel measured on the host (CPU target) picks its buffers by size ranges (oneDNN,
                # the flash kernel's splits): a line through three steps may not hold at the last
                raise NotRepeating(f"{self._where(FIRST, offset)} is measured on this host and its buffers follow "
                                   "the cache length: each step's call is measured")
            moves.append(move)
        return moves

    def _fates(self, proof: list[list[OpEvent]]) -> dict[tuple[int, int], Any]:
        """The fate of each output of a proven step (``_fate``), the same in the first two of them,
        each freed in its own step or the next, or never; the proven steps free nothing made
        before the step before them."""
        pattern = {}
        for offset, (a, b) in enumerate(zip(proof[0], proof[1])):
            for k, (sa, sb) in enumerate(zip(a.allocs, b.allocs)):
                fate = self._fate(sb)
                if self._fate(sa) != fate or (fate is not None and fate[0] > 1):
                    raise NotRepeating(f"{self._where(BEFORE, offset)}: a tensor it makes is not freed where the "
                                       "previous step's is, or lives past the next step")
                pattern[offset, k] = fate
        for segment in (BEFORE, TEMPLATE):
            for offset, op in enumerate(self._ops(segment)):
                if any(self.slot[s].segment not in (segment, segment - 1) if s in self.slot else True
                       for s in op.frees):
                    raise NotRepeating(f"{self._where(segment, offset)}: frees a tensor made before the previous "
                                       "step (state of the run, not of a step)")
        return pattern

    def _ends(self, moves, pattern) -> None:
        """The template frees its own tensors as the pattern says; the last step is the template's
        program up to where it stops, its bytes one more move along each line."""
        template_ops = self._ops(TEMPLATE)
        for offset, op in enumerate(template_ops):
            for k, sid in enumerate(op.allocs):
                fate, expected = self._fate(sid), pattern[offset, k]
                if (fate is not None and fate[0] == 0 or expected is not None and expected[0] == 0) \
                        and fate != expected:
                    raise NotRepeating(f"{self._where(TEMPLATE, offset)}: a tensor it makes is not freed where the "
                                       "previous step's is")
        ops = self._ops(LAST)
        kept = [tuple(s not in self.freed_at for s in op.allocs) for op in ops]  # the run's result
        if len(ops) > len(template_ops) or [self._signature(op, k) for op, k in zip(ops, kept)] != \
                [self._signature(op, k) for op, k in zip(template_ops, kept)]:
            raise NotRepeating(f"the last decode step ({LAST}) is not the steps' program up to where it stops")
        storages = self.raw.storages
        for offset, (op, ref) in enumerate(zip(ops, template_ops)):
            sizes, scratch = moves[offset]
            grown = [storages[s].nbytes - storages[r].nbytes for s, r in zip(op.allocs, ref.allocs)]
            grown_scratch = [s - r for s, r in zip(op.scratch, ref.scratch)]
            if grown != sizes or grown_scratch != scratch:
                raise NotRepeating(f"{self._where(LAST, offset)}: the last step's bytes are not one more step along "
                                   "the line of the steps before")
            for sid in op.frees:
                made = self.slot.get(sid)
                if made is not None and made.segment in (FIRST, BEFORE):
                    raise NotRepeating(f"{self._where(LAST, offset)}: frees a tensor a decode step made two or more "
                                       "steps before (kept to the end of the run)")

    def _built(self, new_tokens: int, moves, pattern) -> RawCapture:
        raw, storages = self.raw, self.raw.storages
        extra = new_tokens - CALLS  # the steps built between the template and the last one (>= 1)
        keep = self.starts[LAST]  # every op before the last step stays where it is
        ops: list[OpEvent] = list(raw.ops[:keep])
        template_ops = self._ops(TEMPLATE)
        made: dict[int, Any] = {}  # the storages the extension makes, in the order it makes them
        keys = itertools.count(max(storages, default=0) + 1)
        # per template op, its outputs' storages and moves, and where they stand in a step's list of
        # outputs (``place``, by (op offset, output index)); the frees of each step as (op offset,
        # output's place, whether the step before's)
        place = {}
        outputs = []
        for offset, op in enumerate(template_ops):
            outs = []
            for k, (sid, move) in enumerate(zip(op.allocs, moves[offset][0])):
                place[offset, k] = len(place)
                outs.append((storages[sid], move if move != ZERO else None))
            scratch = moves[offset][1]
            outputs.append((op, outs, scratch if any(m != ZERO for m in scratch) else None))
        frees = [(fate[1], place[at], fate[0] == 1) for at, fate in pattern.items() if fate is not None]
        # the step before the one being built: its storages in place order; the template's are freed by
        # the first built step, as the pattern says (no longer by the captured last step)
        previous = [sid for op in template_ops for sid in op.allocs]
        for step in range(1, extra + 1):
            start, mine = len(ops), []
            for offset, (op, outs, scratch) in enumerate(outputs):
                allocs = []
                for storage, move in outs:
                    key = next(keys)
                    made[key] = _moved(storage, ZERO if move is None else move * step, start + offset)
                    allocs.append(key)
                mine.extend(allocs)
                ops.append(OpEvent(op.name, op.node, op.phase, op.module, allocs, [],
                                   op.scratch if scratch is None else
                                   tuple(s + m * step for s, m in zip(op.scratch, scratch)), op.kernel, op.owner,
                                   stream=op.stream))
            for offset, at, before in frees:  # the step before's, or its own
                ops[start + offset].frees.append(previous[at] if before else mine[at])
            previous = mine
        # the last step, moved to call n - 1: what the step before made it frees as the captured
        # last step freed the template's; what earlier calls made, as captured
        shift, moved = len(ops) - keep, {}
        for offset, op in enumerate(self._ops(LAST)):
            sizes, scratch = moves[offset]
            for sid, move in zip(op.allocs, sizes):
                moved[sid] = _moved(storages[sid], move * extra, storages[sid].op + shift)
            frees = [previous[place[self.slot[s].offset, self.slot[s].index]]
                     if s in self.slot and self.slot[s].segment == TEMPLATE else s for s in op.frees]
            ops.append(dataclasses.replace(op, frees=frees,
                                           scratch=tuple(s + m * extra for s, m in zip(op.scratch, scratch))))
        # the built steps' storages go before the last step's, as a full capture makes them
        order = list(storages)
        at = next((n for n, sid in enumerate(order) if sid in moved), len(order))
        new_storages = {sid: storages[sid] for sid in order[:at]} | made \
            | {sid: moved.get(sid, storages[sid]) for sid in order[at:]}
        step_ops = len(template_ops)
        calls = (*raw.decoding.calls[:LAST], *(keep + step_ops * i for i in range(extra)), keep + shift)
        decoding = dataclasses.replace(raw.decoding, calls=calls, tokens=raw.decoding.tokens + extra * raw.decoding.grown)
        note = (f"generate(): {new_tokens} calls of the model from a run of {CALLS}: its decode steps {FIRST} to "
                f"{TEMPLATE} ran the same ops, their bytes on one line, so steps {LAST} to {new_tokens - 2} are "
                f"built from them and the last step moved to call {new_tokens - 1} (exact: "
                "estimator/capture/decode_steps.py); report.graph is the shortened run's")
        return dataclasses.replace(raw, ops=ops, storages=new_storages, decoding=decoding, notes=(*raw.notes, note))
