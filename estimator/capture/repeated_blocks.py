"""A deep model from a capture of a few of its blocks: the repeated blocks captured once.

A transformer's blocks are one program repeated: capturing 80 of them costs 80 times one.  So,
where a model holds its blocks in one ``nn.ModuleList`` (or ``nn.Sequential``) whose members
repeat (the same class, parameter and buffer shapes, dtypes and settings; with a period ``p``
where they alternate, sliding-window and global attention, an MoE every other layer), the
capture runs a shallow copy of the model that keeps five units of ``p`` blocks: the first three
and the last two, under their real names (``_modules`` keys: ``layers.0`` to ``layers.2``,
``layers.78``, ``layers.79``), the rest of the model shared as it is.  ``extend`` then builds the
capture of every block, event by event, and says so in the notes:

- what belongs to a unit: the ops of its modules (and of its parameters, in the optimizer), the
  ops between two of them in the same phase (a functional rotary embedding, a gap between two
  units is the earlier one's), the storages its parameters own or its ops make;
- the proof (each failure a ``NotRepeating`` naming where): the middle three units (positions
  1, 2 and 3: real units 1, 2 and the one before the last) run the same ops (names, phases,
  modules and owners relative to the unit, scratch values, the storages each makes and frees:
  a unit's own, or the unit's before or after it, by their place in that unit), own the same
  storages, which end alike (freed by the unit's own ops, the next's, the previous', by the same
  list op, or never); every list an op holds (a foreach op's outputs, the frees after
  ``zero_grad``), the state before the step, the gradient order and the data-dependent sites
  hold the middle units as adjacent runs, in ascending or descending order; no unit's op
  touches a storage two units away, and the middle units free nothing made outside the units;
- the extension: copies of unit 2 (its ops, storages, names moved to the real unit) go between
  units 2 and 3 wherever unit 2 appears, in the order of the run; every reference of a unit's
  op to a neighbour's storage follows its neighbour (the captured unit before the last now
  frees what the last copy made).

Not tried (the full capture): ``generate()`` (the decode steps have their own extension), a
user's step (its code may name the user's model) and a compiled model; models with fewer than six
units, depths the period does not divide, or blocks that do not repeat from the first.  The
result is byte for byte the full capture's (``tests/test_repeated_blocks.py`` compares both
paths); only the fx graph is the shallow run's (its nodes stand for every unit's).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from typing import Any, Callable

from torch import nn

from estimator.capture.records import RawCapture, RunMarks, StepSpec
from estimator.capture.tracker import OpEvent, Storage
from estimator.vocab.bookkeeping import collector_paused
from estimator.vocab.categories import Birth, Born, Mode

UNITS = 5  # kept units: the first three and the last two; units 1, 2, 3 prove the repetition
FIRST, TEMPLATE, NEXT = 1, 2, 3  # the proving positions; copies of TEMPLATE go between it and NEXT


class NotRepeating(Exception):
    """The captured units do not repeat as ``extend`` needs (the message says where)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The blocks of a model: ``path`` (``model.layers``), the period ``period`` of their
    pattern and the number of ``units`` (of ``period`` blocks) in the real model."""

    path: str
    period: int
    units: int

    @property
    def name(self) -> str:
        return self.path or "the model's blocks"

    @property
    def blocks(self) -> int:
        return self.period * self.units

    def real_unit(self, pos: int) -> int:
        """The real unit of a kept position."""
        return pos if pos < NEXT else self.units - UNITS + pos

    @property
    def kept(self) -> list[int]:
        return [self.real_unit(pos) * self.period + o for pos in range(UNITS) for o in range(self.period)]

    @property
    def copies(self) -> range:
        """The real units built from the template (between it and ``NEXT``)."""
        return range(TEMPLATE + 1, self.real_unit(NEXT))


def plan(model: nn.Module, spec: StepSpec) -> Plan | None:
    """The repeated blocks of ``model`` worth capturing once, or None (see the module)."""
    if spec.mode is Mode.GENERATE or spec.step is not None or spec.compiled is not None:
        return None
    best = None
    for path, module in model.named_modules():
        if type(module) not in (nn.ModuleList, nn.Sequential) or len(module) <= UNITS:
            continue
        if list(module._modules) != [str(i) for i in range(len(module))]:
            continue
        per_layer = _per_layer(getattr(model, "config", None), len(module))
        period = _period([(_signature(block), per_layer(i)) for i, block in enumerate(module)])
        if period is None or len(module) % period or len(module) // period <= UNITS:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, Plan(path, period, len(module) // period))
    return None if best is None else best[1]


def _per_layer(config: Any, layers: int) -> Callable[[int], tuple]:
    """What a model's config says of layer ``i`` (transformers: ``layer_types``, lists of layer
    indices such as ``mlp_only_layers``): code may read it by the layer's index, not its settings."""
    lists = [(k, v) for k, v in sorted(vars(config).items() if config is not None and hasattr(config, "__dict__")
                                       else ()) if isinstance(v, (list, tuple)) and v]

    def at(i: int) -> tuple:
        return tuple((k, v[i]) if len(v) == layers else (k, i in v) for k, v in lists
                     if len(v) == layers or all(type(x) is int for x in v))

    return at


def _period(signatures: list) -> int | None:
    for p in range(1, len(signatures) // (UNITS + 1) + 1):
        if all(signatures[i] == signatures[i - p] for i in range(p, len(signatures))):
            return p
    return None


_SIMPLE = (bool, int, float, str, type(None))


def _signature(block: nn.Module) -> tuple:
    """What must be equal of two blocks to be the same program: classes, parameter and buffer
    shapes, dtypes and whether they train, and the simple settings of every submodule (but its
    index, ``layer_idx``)."""
    parts = []
    for name, m in block.named_modules():
        settings = tuple(sorted((k, v) for k, v in vars(m).items()
                                if not k.startswith("_") and isinstance(v, _SIMPLE)
                                and "idx" not in k and "index" not in k))
        parts.append((name, type(m), settings))
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in block.named_parameters()) + \
        tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_buffers())
    return tuple(parts), tensors


def shallow(model: nn.Module, plan_: Plan) -> nn.Module:
    """A copy of ``model`` whose block list keeps ``plan_.kept`` under their real keys; every
    other module, parameter and setting shared with ``model`` (nothing of it is changed)."""

    def cut(module: nn.Module, parts: list[str]) -> nn.Module:
        twin = copy.copy(module)
        if parts:
            twin._modules = dict(module._modules)
            twin._modules[parts[0]] = cut(module._modules[parts[0]], parts[1:])
        else:
            twin._modules = {str(i): module._modules[str(i)] for i in plan_.kept}
        return twin

    return cut(model, plan_.path.split(".") if plan_.path else [])


def extend(raw: RawCapture, plan_: Plan) -> RawCapture:
    """The capture of the real model from ``raw``, the shallow one's (see the module);
    ``NotRepeating`` where the proof fails."""
    with collector_paused():
        return _Extension(raw, plan_).run()


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A storage as an op refers to it: of the unit ``delta`` positions from the op's, the ``key``-th
    of that unit's storages; or (``delta`` None) a storage of no unit, by its id."""

    delta: int | None
    key: int


class _Extension:
    def __init__(self, raw: RawCapture, plan_: Plan):
        self.raw, self.plan = raw, plan_
        self.prefix = f"{plan_.path}." if plan_.path else ""
        self.pattern = re.compile(rf"^{re.escape(self.prefix)}(\d+)(?=\.|$)")
        self.pos_of_unit = {plan_.real_unit(pos): pos for pos in range(UNITS)}
        ops = raw.ops
        self.op_pos = self._op_positions()
        self.store_pos: dict[int, int | None] = {}
        for sid, s in raw.storages.items():
            pos = self._pos(s.owner)
            self.store_pos[sid] = pos if pos is not None or s.op < 0 else self.op_pos[s.op]
        self.keys: dict[int, int] = {}  # storage -> its index among its unit's storages
        self.by_key: dict[tuple[int, int], int] = {}  # (position, key) -> storage
        counters = [itertools.count() for _ in range(UNITS)]
        for sid, pos in self.store_pos.items():
            if pos is not None:
                self.keys[sid] = k = next(counters[pos])
                self.by_key[pos, k] = sid
        self.freed_by: dict[int, int] = {sid: i for i, op in enumerate(ops) for sid in op.frees}
        # an op whose frees span the units (zero_grad's after the last optimizer op) frees a list,
        # as an op of no unit does: its frees are not its unit's
        self.wide = {i for i, op in enumerate(ops) if self.op_pos[i] is not None and any(
            self.store_pos.get(s) is not None and abs(self.store_pos[s] - self.op_pos[i]) > 1 for s in op.frees)}

    def _freeing(self, i: int) -> int | None:
        """The position op ``i`` frees from (None: a list)."""
        return None if i in self.wide else self.op_pos[i]

    # -- where things belong ------------------------------------------------------------------

    def _block(self, name: str | None) -> int | None:
        match = self.pattern.match(name) if name else None
        return None if match is None else int(match.group(1))

    def _pos(self, name: str | None) -> int | None:
        block = self._block(name)
        return None if block is None else self.pos_of_unit[block // self.plan.period]

    def _op_positions(self) -> list[int | None]:
        """Each op's position: its module's or (optimizer) its parameter's unit; an op between two
        ops of the same unit, or of consecutive ones, in the same phase belongs to the earlier."""
        ops = self.raw.ops
        own = [self._pos(op.module) if self._pos(op.module) is not None else self._pos(op.owner) for op in ops]
        found = list(own)
        previous: tuple[int, int] | None = None  # (op, position) of the last op with a position
        for i, pos in enumerate(own):
            if pos is None:
                continue
            if previous is not None and ops[previous[0]].phase is ops[i].phase and abs(pos - previous[1]) <= 1:
                for j in range(previous[0] + 1, i):
                    if ops[j].phase is ops[i].phase:
                        found[j] = previous[1]
            previous = (i, pos)
        return found

    def _rel(self, name: str | None, pos: int) -> Any:
        """``name`` seen from position ``pos``: its block as (units away, place in the unit)."""
        block = self._block(name)
        if block is None:
            return name
        unit, offset = divmod(block, self.plan.period)
        return self.pos_of_unit[unit] - pos, offset, name[self.pattern.match(name).end():]

    def _renamed(self, name: str | None, pos: int, real: int) -> str | None:
        """``name`` of position ``pos`` as the real unit ``real`` names it (a neighbour's follows)."""
        block = self._block(name)
        if block is None:
            return name
        unit, offset = divmod(block, self.plan.period)
        target = real + self.pos_of_unit[unit] - pos
        return f"{self.prefix}{target * self.plan.period + offset}{name[self.pattern.match(name).end():]}"

    def _ref(self, sid: int, pos: int | None) -> _Ref:
        spos = self.store_pos.get(sid)
        if spos is None or pos is None:
            return _Ref(None, sid)
        if abs(spos - pos) > 1:
            raise NotRepeating(f"an op of {self._unit_name(pos)} touches a tensor of {self._unit_name(spos)}, "
                               "two or more units away")
        return _Ref(spos - pos, self.keys[sid])

    def _unit_name(self, pos: int) -> str:
        first = self.plan.real_unit(pos) * self.plan.period
        return f"{self.prefix}{first}" if self.plan.period == 1 else f"{self.prefix}{first}-{first + self.plan.period - 1}"

    def _storage_sig(self, sid: int, pos: int) -> tuple:
        s = self.raw.storages[sid]
        born = s.born if s.born is None or s.born.when is not Birth.LOAD else Birth.LOAD  # its order: _load_order
        return s.nbytes, s.extra, s.category, self._rel(s.owner, pos), born, s.op < 0

    def _op_sig(self, op: OpEvent, pos: int) -> tuple:
        return (op.name, op.phase, self._rel(op.module, pos), self._rel(op.owner, pos), op.scratch,
                op.kernel is None, tuple(self._storage_sig(s, pos) for s in op.allocs),
                tuple(self._ref_sig(s, pos) for s in op.frees))

    def _ref_sig(self, sid: int, pos: int) -> Any:
        """A storage an op frees, to compare with another unit's: its own unit's by its place there,
        a neighbour's by what it is (the first and last units' storages differ from the middle ones':
        no input gradient, the last norm); the built units follow the template's places."""
        ref = self._ref(sid, pos)
        return (ref.delta, self._storage_sig(sid, pos + ref.delta)) if ref.delta else ref

    # -- runs ---------------------------------------------------------------------------------

    @staticmethod
    def _runs(labels: list[int | None]) -> list[tuple[int | None, int, int]]:
        runs = []
        for label, group in itertools.groupby(enumerate(labels), key=lambda x: x[1]):
            group = list(group)
            runs.append((label, group[0][0], group[-1][0] + 1))
        return runs

    def _templates(self, labels: list[int | None], what: str) -> list[tuple[int, int, int, bool]]:
        """Where the template's runs are: (start, end, where its copies go, ascending), each
        beside a run of the unit before and the unit after it."""
        runs = self._runs(labels)
        found = []
        for i, (label, start, end) in enumerate(runs):
            if label != TEMPLATE:
                continue
            before = runs[i - 1] if i else (None, 0, 0)
            after = runs[i + 1] if i + 1 < len(runs) else (None, 0, 0)
            if before[0] == FIRST and after[0] == NEXT:
                found.append((start, end, end, True, before, after))
            elif before[0] == NEXT and after[0] == FIRST:
                found.append((start, end, start, False, after, before))
            else:
                raise NotRepeating(f"{what}: {self._unit_name(TEMPLATE)} does not sit between "
                                   f"{self._unit_name(FIRST)} and {self._unit_name(NEXT)}")
        return [(start, end, at, ascending, first, nxt) for start, end, at, ascending, first, nxt in found]

    # -- the proof and the extension ------------------------------------------------------------

    def run(self) -> RawCapture:
        self._check_storages()
        ops = self.raw.ops
        op_templates = self._templates(self.op_pos, "the step's ops")
        if not op_templates:
            raise NotRepeating(f"no op ran in {self._unit_name(TEMPLATE)}")
        for start, end, _, _, first, nxt in op_templates:
            sigs = [[self._op_sig(op, pos) for op in ops[a:b]] for pos, (_, a, b) in
                    ((FIRST, first), (TEMPLATE, (TEMPLATE, start, end)), (NEXT, nxt))]
            if not sigs[0] == sigs[1] == sigs[2]:
                offset = next((o for o, (x, y, z) in enumerate(zip(*sigs)) if not x == y == z), min(map(len, sigs)))
                where = ops[start + min(offset, end - start - 1)]
                raise NotRepeating(f"{self._unit_name(FIRST)} to {self._unit_name(NEXT)} run different ops (first at "
                                   f"op {offset} of {self._unit_name(TEMPLATE)}: {where.name} in {where.module or '-'})")
        for i, op in enumerate(ops):
            for sid in op.allocs:
                self._ref(sid, self.op_pos[i])  # nothing two units away
            pos = self._freeing(i)
            for sid in op.frees:
                self._ref(sid, pos)
            if pos in (FIRST, TEMPLATE, NEXT) and any(self.store_pos.get(s) is None for s in op.frees):
                raise NotRepeating(f"{op.name} in {op.module or '-'} frees a tensor made outside the blocks")
        return self._built(op_templates)

    def _check_storages(self) -> None:
        """The middle units own storages alike that end alike; storages are in the order their ops
        make them."""
        per_pos: dict[int, list] = {pos: [] for pos in (FIRST, TEMPLATE, NEXT)}
        for sid, pos in self.store_pos.items():
            if pos in per_pos:
                freed = self.freed_by.get(sid)
                fate = None if freed is None else (self._freeing(freed) - pos if self._freeing(freed) is not None
                                                   else ("list", freed))
                per_pos[pos].append((sid, self._storage_sig(sid, pos), fate))
        rows = [[row[1:] for row in per_pos[pos]] for pos in (FIRST, TEMPLATE, NEXT)]
        if not rows[0] == rows[1] == rows[2]:
            k = next((k for k, (a, b, c) in enumerate(zip(*rows)) if not a == b == c), min(map(len, rows)))
            where = ""
            if k < len(per_pos[TEMPLATE]):
                s = self.raw.storages[per_pos[TEMPLATE][k][0]]
                where = f" (its {s.category.value} {s.owner or 'made by ' + self.raw.ops[s.op].name if s.op >= 0 else ''})"
            raise NotRepeating(f"{self._unit_name(FIRST)} to {self._unit_name(NEXT)} do not hold the same tensors, or "
                               f"do not free them alike: first at tensor {k} of {self._unit_name(TEMPLATE)}{where}")
        made = [sid for op in self.raw.ops for sid in op.allocs]
        if made != [sid for sid, s in self.raw.storages.items() if s.op >= 0]:
            raise NotRepeating("the capture's storages are not in the order its ops made them")

    def _built(self, op_templates) -> RawCapture:
        raw, plan_, storages = self.raw, self.plan, self.raw.storages
        keys = itertools.count(max(storages, default=0) + 1)
        copied: dict[tuple[int, int], int] = {}  # (real unit, key) -> the copy's storage
        made: dict[int, Storage] = {}

        def resolve(ref: _Ref, real: int) -> int:
            if ref.delta is None:
                return ref.key
            unit = real + ref.delta
            pos = self.pos_of_unit.get(unit)
            if pos is not None:
                return self.by_key[pos, ref.key]
            if (unit, ref.key) not in copied:
                copied[unit, ref.key] = next(keys)
            return copied[unit, ref.key]

        def storage_copy(sid: int, real: int, op: int) -> int:
            new = resolve(_Ref(0, self.keys[sid]), real)
            s = storages[sid]
            made[new] = Storage(s.nbytes, s.category, op, s.extra, self._renamed(s.owner, TEMPLATE, real), s.born)
            return new

        def listed(items: list, label: Callable, copy_of: Callable, what: str) -> list:
            """``items`` with copies of the template's runs for every built unit."""
            templates = self._templates([label(x) for x in items], what)
            if not templates:
                return list(items)
            out, last = [], 0
            for start, end, at, ascending, first, nxt in templates:
                run = items[start:end]
                if [self._item_sig(x, FIRST) for x in items[first[1]:first[2]]] != \
                        [self._item_sig(x, TEMPLATE) for x in run] or \
                        [self._item_sig(x, NEXT) for x in items[nxt[1]:nxt[2]]] != \
                        [self._item_sig(x, TEMPLATE) for x in run]:
                    raise NotRepeating(f"{what}: {self._unit_name(FIRST)} to {self._unit_name(NEXT)} differ")
                out += items[last:at]
                units = plan_.copies if ascending else reversed(plan_.copies)
                out += [copy_of(x, real) for real in units for x in run]
                last = at
            return out + items[last:]

        label_sid = self.store_pos.get
        # the state before the step: parameters, buffers, optimizer state
        state = [sid for sid, s in storages.items() if s.op < 0]
        new_storages = {}
        for sid in listed(state, label_sid, lambda sid, real: storage_copy(sid, real, -1), "the state before the step"):
            new_storages[sid] = made.get(sid, storages.get(sid))

        self._load_order(new_storages, listed, resolve)

        # the ops
        ops = raw.ops
        out_ops: list[OpEvent] = []
        index: dict[int, int] = {}  # captured op -> its index now
        starts = {at: (start, end, ascending) for start, end, at, ascending, _, _ in op_templates}

        def freed_list(op: OpEvent) -> list[int]:
            return listed(op.frees, label_sid, lambda sid, r: resolve(_Ref(0, self.keys[sid]), r),
                          f"what is freed after {op.name}")

        def emit(op: OpEvent, pos: int | None, real: int | None, copy_: bool, wide: bool = False) -> None:
            at = len(out_ops)
            if pos is None:  # lists of storages of many units
                allocs = listed(op.allocs, label_sid, lambda sid, r: storage_copy(sid, r, at), f"{op.name}'s outputs")
                frees = freed_list(op)
                for sid in allocs:
                    new_storages[sid] = made[sid] if sid in made else dataclasses.replace(storages[sid], op=at)
                out_ops.append(dataclasses.replace(op, allocs=allocs, frees=frees))
                return
            allocs = []
            for sid in op.allocs:
                if copy_:
                    new = storage_copy(sid, real, at)
                    new_storages[new] = made[new]
                else:
                    new = sid
                    new_storages[sid] = dataclasses.replace(storages[sid], op=at)
                allocs.append(new)
            frees = freed_list(op) if wide else [resolve(self._ref(s, pos), real) for s in op.frees]
            module, owner = op.module, op.owner
            if copy_:
                module, owner = self._renamed(module, TEMPLATE, real), self._renamed(owner, TEMPLATE, real)
            out_ops.append(dataclasses.replace(op, allocs=allocs, frees=frees, module=module, owner=owner))

        for i, op in enumerate(ops):
            if i in starts:
                self._emit_copies(ops, starts[i], emit)
            pos = self.op_pos[i]
            index[i] = len(out_ops)
            emit(op, pos, None if pos is None else plan_.real_unit(pos), False, i in self.wide)
        if len(ops) in starts:
            self._emit_copies(ops, starts[len(ops)], emit)

        def name_label(name: str) -> int | None:
            return self._pos(name)

        grad_order = tuple(listed(list(raw.grad_order), name_label, lambda n, r: self._renamed(n, TEMPLATE, r),
                                  "the gradient order"))
        sites = tuple(listed(list(raw.data_dependent), lambda s: self._pos(s.site),
                             lambda s, r: dataclasses.replace(s, site=self._renamed(s.site, TEMPLATE, r)),
                             "the data-dependent sizes"))
        freed_first = tuple(listed(list(raw.freed_first), label_sid,
                                   lambda sid, r: resolve(_Ref(0, self.keys[sid]), r), "the state freed first"))
        index[len(ops)] = len(out_ops)  # a mark after the last op
        marks = RunMarks(tuple(None if i is None else index[i] for i in raw.marks.optimizer_starts),
                         None if raw.marks.model_returns is None else index[raw.marks.model_returns])
        note = (f"{plan_.name}: {plan_.blocks} blocks from a capture of {UNITS * plan_.period} (the first "
                f"{TEMPLATE + 1} and last {UNITS - TEMPLATE - 1}{' units of ' + str(plan_.period) if plan_.period > 1 else ''}"
                f"): {self._unit_name(FIRST)}, {self._unit_name(TEMPLATE)} and {self._unit_name(NEXT)} ran the same "
                f"ops on the same tensors, so the {len(plan_.copies) * plan_.period} between are built from them "
                "(exact: estimator/capture/repeated_blocks.py); report.graph is the shallow run's")
        measured = sum(op.kernel is not None for op in ops)
        if measured:
            note += (f"; the kernel calls measured on this host that the notes count are the captured blocks' "
                     f"({measured} of {sum(op.kernel is not None for op in out_ops)}: a built block's are its template's)")
        return dataclasses.replace(raw, ops=out_ops, storages=new_storages, grad_order=grad_order,
                                   data_dependent=sites, freed_first=freed_first, marks=marks,
                                   notes=(*raw.notes, note))

    def _load_order(self, new_storages: dict[int, Storage], listed, resolve) -> None:
        """The parameters' and buffers' places in ``Module._apply``'s walk (``Born.order``), the
        copies' after the template's, the later ones moved on by them."""
        walk = sorted((sid for sid, s in self.raw.storages.items() if s.born is not None and s.born.when is Birth.LOAD),
                      key=lambda sid: self.raw.storages[sid].born.order)
        shift, order = 0, -1
        for sid in listed(walk, self.store_pos.get, lambda sid, r: resolve(_Ref(0, self.keys[sid]), r),
                          "the model's load order"):
            if sid in self.raw.storages:
                order = self.raw.storages[sid].born.order + shift
            else:  # a copy: after the one before it
                shift, order = shift + 1, order + 1
            new_storages[sid] = dataclasses.replace(new_storages[sid], born=Born(Birth.LOAD, order))

    def _emit_copies(self, ops, template, emit) -> None:
        start, end, ascending = template
        units = self.plan.copies if ascending else reversed(self.plan.copies)
        for real in units:
            for op in ops[start:end]:
                emit(op, TEMPLATE, real, True)

    def _item_sig(self, item, pos: int) -> Any:
        if isinstance(item, int):
            return self._storage_sig(item, pos)
        if isinstance(item, str):
            return self._rel(item, pos)
        return dataclasses.replace(item, site=self._rel(item.site, pos))
