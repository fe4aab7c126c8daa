"""A deep model from a capture of a few of its blocks: the repeated blocks captured once.

A transformer's blocks are one program repeated: capturing 80 of them costs 80 times one.  So,
where a model holds its blocks in one ``nn.ModuleList`` (or ``nn.Sequential``) whose members
repeat (the same class, parameter and buffer shapes, dtypes and settings; with a period ``p``
where they alternate, sliding-window and global attention, an MoE every other layer; after a head
of blocks of their own, DeepSeek's first dense layers), the capture runs a shallow copy of the
model that keeps the head and five units of ``p`` blocks: the first three and the last two, under their real names (``_modules`` keys: ``layers.0`` to ``layers.2``,
``layers.78``, ``layers.79``), the rest of the model shared as it is.  ``extend`` then builds the
capture of every block, event by event, and says so in the notes:

- what belongs to a unit: the ops of its modules (and of its parameters, in the optimizer), the
  ops between two of them in the same phase (a functional rotary embedding, a gap between two
  units is the earlier one's), the ops of no unit that take a middle unit's tensor (code outside
  the blocks working on each one: FSDP2's root pre-forward on every block's parameters, features
  taken from every block's output after the loop), the storages its parameters own, its ops
  make or the state names with its path (``RawCapture.state_names``: buffers, held tensors, an
  EMA copy of the model); state no name places (what a user's step keeps) refuses the extension;
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

``generate()`` too, with a dynamic cache of full-attention layers: it holds one layer per block
(``cache.layers[layer_idx]``), the layers the shallow run does not reach stay empty, and
``Decoding.layer_bytes`` (each layer's bytes per token) is completed with the template's; the
decode steps' own extension runs after (on the few calls' capture at full depth).  Static and
sliding-window caches make a tensor for every layer when they are made (``_per_layer_state``):
those capture every block.
A user's step runs on the shallow copy as the built-in one does; code of it that names the user's
model (a closure, a global) gets the copy too (``map_originals``), and code that reaches a block the
copy leaves out fails there: every block is then captured.  Not tried (the full capture): a compiled
model (its regions carry no module names); models with fewer than six units, or blocks that do not repeat after a head of a quarter of
them.  The result is byte for byte the full capture's
(``tests/test_repeated_blocks.py`` compares both paths); only the fx graph is the shallow run's
(its nodes stand for every unit's).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
import weakref
from typing import Any, Callable, NamedTuple

from torch import nn

from estimator.capture import steps, value_notes
from estimator.capture.records import Decoding, RawCapture, RunMarks, StepSpec
from estimator.capture.tracker import OpEvent, Storage
from estimator.vocab.bookkeeping import collector_paused
from estimator.vocab.categories import Birth, Born, Category, Phase
from estimator.vocab.symbolic import Poly

_JOINS = {"aten.cat.default", "aten.stack.default"}  # outputs of as many bytes as the list they join
UNITS = 5  # kept units: the first three and the last two; units 1, 2, 3 prove the repetition
FIRST, TEMPLATE, NEXT = 1, 2, 3  # the proving positions; copies of TEMPLATE go between it and NEXT


class NotRepeating(Exception):
    """The captured units do not repeat as ``extend`` needs (the message says where)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The blocks of a model: ``path`` (``model.layers``), the period ``period`` of their
    pattern and the number of ``units`` (of ``period`` blocks) in the real model, after ``head``
    blocks of their own (DeepSeek's first dense layers before the MoE ones)."""

    path: str
    period: int
    units: int
    head: int = 0

    @property
    def name(self) -> str:
        return self.path or "the model's blocks"

    @property
    def blocks(self) -> int:
        return self.head + self.period * self.units

    @property
    def captured(self) -> int:
        return self.head + self.period * UNITS

    def real_unit(self, pos: int) -> int:
        """The real unit of a kept position."""
        return pos if pos < NEXT else self.units - UNITS + pos

    def locate(self, block: int) -> tuple[int, int] | None:
        """The unit of a block and its place in it (None: a block of the head)."""
        return None if block < self.head else divmod(block - self.head, self.period)

    def block(self, unit: int, offset: int) -> int:
        return self.head + unit * self.period + offset

    @property
    def kept(self) -> list[int]:
        return [*range(self.head),
                *(self.block(self.real_unit(pos), o) for pos in range(UNITS) for o in range(self.period))]

    @property
    def copies(self) -> range:
        """The real units built from the template (between it and ``NEXT``)."""
        return range(TEMPLATE + 1, self.real_unit(NEXT))


def plan(model: nn.Module, spec: StepSpec) -> Plan | None:
    """The repeated blocks of ``model`` worth capturing once, or None (see the module)."""
    if spec.compiled is not None:
        return None
    if isinstance(spec.step, steps.Generation) and _per_layer_state(spec.step, getattr(model, "config", None)):
        return None
    best = None
    for path, module in model.named_modules():
        if type(module) not in (nn.ModuleList, nn.Sequential) or len(module) <= UNITS:
            continue
        if list(module._modules) != [str(i) for i in range(len(module))]:
            continue
        per_layer = _per_layer(getattr(model, "config", None), len(module))
        found = _pattern([(_signature(block), per_layer(i)) for i, block in enumerate(module)])
        size = sum(p.numel() for p in module.parameters())
        if found is not None and (best is None or size > best[0]):
            best = (size, Plan(path, *found))
    return None if best is None else best[1]


def _pattern(signatures: list) -> tuple[int, int, int] | None:
    """(period, units, head): the fewest head blocks after which the blocks repeat with the
    shortest period, over more than ``UNITS`` units; None where they do not."""
    for head in range(len(signatures) // 4 + 1):
        rest = signatures[head:]
        period = _period(rest)
        if period is not None and len(rest) % period == 0 and len(rest) // period > UNITS:
            return period, len(rest) // period, head
    return None


def _per_layer_state(generation: steps.Generation, config: Any) -> bool:
    """Whether ``generate()``'s cache makes tensors for every layer when it is made (a static
    layer's ``cumulative_length``, a sliding one's window size): the shallow run has them for every
    block, the blocks it leaves out included, interleaved with the reached ones' where they are
    freed, which the extension cannot place (it would fail after the shallow capture)."""
    if generation.cache_implementation not in (None, "dynamic"):
        return True
    types = getattr(config, "layer_types", None) or ()
    return any("sliding" in str(t) or "chunk" in str(t) for t in types) or \
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


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


# a shallow copy -> (copy, original) for each module it copies on the path to the blocks
_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shallow(model: nn.Module, plan_: Plan, source: Plan | None = None) -> nn.Module:
    """A copy of ``model`` whose block list keeps ``plan_.kept`` under their real keys; every
    other module, parameter and setting shared with ``model`` (nothing of it is changed).
    ``source``: the model's own plan where ``plan_`` is another depth (``depth.deepen``): its kept
    blocks then stand under ``plan_``'s keys."""
    twins = []
    blocks = dict(zip(plan_.kept, (source or plan_).kept))

    def cut(module: nn.Module, parts: list[str]) -> nn.Module:
        twin = copy.copy(module)
        twins.append((twin, module))
        if parts:
            twin._modules = dict(module._modules)
            twin._modules[parts[0]] = cut(module._modules[parts[0]], parts[1:])
        else:
            twin._modules = {str(i): module._modules[str(blocks[i])] for i in plan_.kept}
        return twin

    root = cut(model, plan_.path.split(".") if plan_.path else [])
    _TWINS[root] = twins
    return root


def twins(copy_: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """The modules ``shallow`` copied on the path to the blocks of ``copy_``, each with its original."""
    return list(_TWINS.get(copy_, ()))


def is_shallow(model: nn.Module) -> bool:
    """Whether ``model`` is a copy ``shallow`` made (its capture records ``OpEvent.takes``)."""
    return model in _TWINS


def map_originals(model: nn.Module, memo: dict[int, Any]) -> None:
    """After ``model`` was copied with ``memo`` (``copy.deepcopy``, ``fake.fake_model``): where it is a
    shallow copy, the user's modules it stands for map to the copies too, so that a step whose
    code names the user's model (a closure, a global) gets the copy, never the user's model."""
    for twin, original in _TWINS.get(model, ()):
        if id(twin) in memo:
            memo[id(original)] = memo[id(twin)]


def _copied(item: OpEvent | Storage, **changes) -> OpEvent | Storage:
    """``dataclasses.replace`` of an op or a storage (plain slotted dataclasses, their ``__init__``
    checks nothing) without calling ``__init__``: the extension makes one per built op, a million
    for a long ``generate()``."""
    new = object.__new__(type(item))
    for name in type(item).__slots__:
        setattr(new, name, changes[name] if name in changes else getattr(item, name))
    return new


def extend(raw: RawCapture, plan_: Plan, origins: list | None = None, captured: Plan | None = None) -> RawCapture:
    """The capture of the real model from ``raw``, the shallow one's (see the module), which it
    keeps (``RawCapture.shallow``); ``NotRepeating`` where the proof fails.  ``captured``: the plan
    ``raw`` was captured with, where ``plan_`` builds another depth from it (``plan_.units``);
    ``origins``, where given, gets each built op's origin: (its op in ``raw``, a copy's real unit or None)."""
    captured = captured or plan_
    with collector_paused():
        extension = _Extension(raw, plan_, captured)
        built = extension.run()
    if origins is not None:
        origins[:] = extension.origins
    return dataclasses.replace(built, shallow=(captured, raw))


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A storage as an op refers to it: of the unit ``delta`` positions from the op's, the ``key``-th
    of that unit's storages; or (``delta`` None) a storage of no unit, by its id."""

    delta: int | None
    key: int


class _Run(NamedTuple):
    """A run of the template's items (``start:end``) between its neighbours' runs (``first``,
    ``nxt``: (label, start, end)); the copies go at ``at``, in ascending or descending order."""

    start: int
    end: int
    at: int
    ascending: bool
    first: tuple
    nxt: tuple


class _Extension:
    def __init__(self, raw: RawCapture, plan_: Plan, captured: Plan):
        self.raw, self.plan = raw, plan_
        self.read_pos = {captured.real_unit(pos): pos for pos in range(UNITS)}  # a unit named in raw -> its position
        self.moved = captured.units != plan_.units  # the last kept units are renamed (another depth)
        self.origins: list[tuple[int, int | None]] = []  # each built op's: (its op in raw, a copy's real unit)
        self.prefix = f"{plan_.path}." if plan_.path else ""
        self.pattern = re.compile(rf"(?:^|(?<=\.)){re.escape(self.prefix)}(\d+)(?=\.|$)")
        self.pos_of_unit = {plan_.real_unit(pos): pos for pos in range(UNITS)}
        ops = raw.ops
        named = {sid: self._pos(s.owner) if s.owner else self._pos(raw.state_names.get(sid), self._kept_state(s))
                 for sid, s in raw.storages.items()}
        self.op_pos = self._op_positions(named)
        self.store_pos: dict[int, int | None] = {}
        self._names: dict[tuple, str | None] = {}  # _renamed's answers
        for sid, s in raw.storages.items():
            pos = named[sid]
            self.store_pos[sid] = pos if pos is not None or s.op < 0 else self.op_pos[s.op]
            if s.op < 0 and pos is None and s.category is not Category.INPUT and sid not in raw.state_names:
                raise NotRepeating("the step keeps tensors no name places (a list it appends to, a cache): "
                                   "whether they follow the blocks is not known")
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

    @staticmethod
    def _kept_state(s: Storage) -> bool:
        """State a user's step keeps (no parameter owns it): named by where it is in the step's state."""
        return s.category is Category.OPTIMIZER_STATE and s.owner is None

    def _spanning(self, i: int) -> bool:
        """Whether op ``i``, of no unit, joins a list over the middle units into other outputs than
        one per item (``OpEvent.reads``: the per-parameter norms ``clip_grad_norm_`` stacks; a foreach
        op's outputs, one per item, are their items' units')."""
        op = self.raw.ops[i]
        return self.op_pos[i] is None and len(op.allocs) != len(op.reads) and \
            any(self.store_pos.get(s) in (FIRST, TEMPLATE, NEXT) for s in op.reads)

    def _freeing(self, i: int) -> int | None:
        """The position op ``i`` frees from (None: a list)."""
        return None if i in self.wide else self.op_pos[i]

    # -- where things belong ------------------------------------------------------------------

    def _find(self, name: str | None, anywhere: bool = False) -> tuple[re.Match, int, int] | None:
        """Where ``name`` (a path from the model, or ``anywhere``: a name in a user's step state,
        ``ema.model.layers.3.weight``) names a block of the units, with the block's unit and place;
        None: no unit's."""
        match = (self.pattern.search if anywhere else self.pattern.match)(name) if name else None
        found = None if match is None else self.plan.locate(int(match.group(1)))
        return None if found is None else (match, *found)

    def _pos(self, name: str | None, anywhere: bool = False) -> int | None:
        found = self._find(name, anywhere)
        return None if found is None else self.read_pos[found[1]]

    def _op_positions(self, named: dict[int, int | None]) -> list[int | None]:
        """Each op's position: its module's or (optimizer) its parameter's unit; an op between two
        ops of the same unit, or of consecutive ones, in the same phase belongs to the earlier.  An
        op of neither that takes a middle unit's tensor (``OpEvent.takes``: its parameters, by
        ``named``, or what that unit's ops made) is the unit's of the newest such tensor: code
        outside the blocks that works on each of them (FSDP2's root pre-forward views every block's
        parameters, a sum of every block's output at the root) runs once per block."""
        ops = self.raw.ops
        own = [pos if (pos := self._pos(op.module)) is not None else self._pos(op.owner) for op in ops]
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
        made: dict[int, int | None] = {}
        for i, op in enumerate(ops):
            if found[i] is None and op.takes:
                taken = [(sid, pos) for sid in op.takes
                         if (pos := named.get(sid) if named.get(sid) is not None else made.get(sid)) is not None]
                if any(pos in (FIRST, TEMPLATE, NEXT) for _, pos in taken):
                    found[i] = max(taken)[1]
            made.update((sid, found[i]) for sid in op.allocs)
        return found

    def _rel(self, name: str | None, pos: int) -> Any:
        """``name`` seen from position ``pos``: its block as (units away, place in the unit)."""
        found = self._find(name)
        if found is None:
            return name
        match, unit, offset = found
        return name[:match.start(1)], self.read_pos[unit] - pos, offset, name[match.end():]

    def _renamed(self, name: str | None, pos: int, real: int, anywhere: bool = False) -> str | None:
        """``name`` of position ``pos`` as the real unit ``real`` names it (a neighbour's follows)."""
        key = (name, pos, real, anywhere)
        if key in self._names:  # each template name, once per built unit (and decode step)
            return self._names[key]
        found = self._find(name, anywhere)
        if found is None:
            renamed = name
        else:
            match, unit, offset = found
            target = real + self.read_pos[unit] - pos
            renamed = f"{name[:match.start(1)]}{self.plan.block(target, offset)}{name[match.end():]}"
        self._names[key] = renamed
        return renamed

    def _ref(self, sid: int, pos: int | None) -> _Ref:
        spos = self.store_pos.get(sid)
        if spos is None or pos is None:
            return _Ref(None, sid)
        if abs(spos - pos) > 1:
            raise NotRepeating(f"an op of {self._unit_name(pos)} touches a tensor of {self._unit_name(spos)}, "
                               "two or more units away")
        return _Ref(spos - pos, self.keys[sid])

    def _unit_name(self, pos: int) -> str:
        first = self.plan.block(self.plan.real_unit(pos), 0)
        return f"{self.prefix}{first}" if self.plan.period == 1 else f"{self.prefix}{first}-{first + self.plan.period - 1}"

    def _storage_sig(self, sid: int, pos: int) -> tuple:
        s = self.raw.storages[sid]
        born = s.born if s.born is None or s.born.when is not Birth.LOAD else Birth.LOAD  # its order: _load_order
        return s.nbytes, s.extra, s.category, self._rel(s.owner, pos), born, s.op < 0

    def _op_sig(self, op: OpEvent, pos: int) -> tuple:
        return (op.name, op.phase, op.stream, self._rel(op.module, pos), self._rel(op.owner, pos), op.scratch,
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

    def _templates(self, labels: list[int | None], what: str) -> list[_Run]:
        """Where the template's runs are, each beside a run of the unit before and the unit after it."""
        runs = self._runs(labels)
        found = []
        for i, (label, start, end) in enumerate(runs):
            if label != TEMPLATE:
                continue
            before = runs[i - 1] if i else (None, 0, 0)
            after = runs[i + 1] if i + 1 < len(runs) else (None, 0, 0)
            if before[0] == FIRST and after[0] == NEXT:
                found.append(_Run(start, end, end, True, before, after))
            elif before[0] == NEXT and after[0] == FIRST:
                found.append(_Run(start, end, start, False, after, before))
            else:
                raise NotRepeating(f"{what}: {self._unit_name(TEMPLATE)} does not sit between "
                                   f"{self._unit_name(FIRST)} and {self._unit_name(NEXT)}")
        return found

    # -- the proof and the extension ------------------------------------------------------------

    def run(self) -> RawCapture:
        if self.raw.managed:
            raise NotRepeating("its paged optimizer state (CUDA managed memory) is counted as one total, not per block")
        self._check_storages()
        ops = self.raw.ops
        op_templates = self._templates(self.op_pos, "the step's ops")
        if not op_templates:
            raise NotRepeating(f"no op ran in {self._unit_name(TEMPLATE)}")
        for run in op_templates:
            sigs = [[self._op_sig(op, pos) for op in ops[a:b]] for pos, (_, a, b) in
                    ((FIRST, run.first), (TEMPLATE, (TEMPLATE, run.start, run.end)), (NEXT, run.nxt))]
            if not sigs[0] == sigs[1] == sigs[2]:
                offset = next((o for o, (x, y, z) in enumerate(zip(*sigs)) if not x == y == z), min(map(len, sigs)))
                where = ops[run.start + min(offset, run.end - run.start - 1)]
                raise NotRepeating(f"{self._unit_name(FIRST)} to {self._unit_name(NEXT)} run different ops (first at "
                                   f"op {offset} of {self._unit_name(TEMPLATE)}: {where.name} in {where.module or '-'})")
        for i, op in enumerate(ops):
            if self._spanning(i) and any(self.store_pos.get(s) is None for s in op.allocs):
                if op.name not in _JOINS or len(op.allocs) != 1 or self.raw.decoding is not None:
                    raise NotRepeating(f"{op.name} makes a tensor from a list over the blocks (its size may follow "
                                       "their number)")
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
        self._check_unplaced()

    def _check_unplaced(self) -> None:
        """State, or a tensor the optimizer phase makes, that no parameter owns, no name places and
        no unit made, as large as a block's parameters: it may hold every block's (a flat buffer of
        all the parameters sized in Python, which no list op shows), and would not grow with them."""
        storages = self.raw.storages
        block = sum((s.nbytes for sid, s in storages.items()
                     if s.category is Category.PARAMETER and self.store_pos[sid] == TEMPLATE), Poly())
        for sid, s in storages.items():
            if self.store_pos[sid] is not None or s.owner is not None or sid in self.raw.state_names \
                    or s.category is Category.INPUT or (s.op >= 0 and self.raw.ops[s.op].phase is not Phase.OPTIMIZER):
                continue
            if len(s.nbytes.coeffs) <= 1 and not s.nbytes.mixed and block.coeffs and s.nbytes.coeffs \
                    and s.nbytes.coeffs[0] >= block.coeffs[0]:
                made = f"made by {self.raw.ops[s.op].name}" if s.op >= 0 else "state before the step"
                raise NotRepeating(f"a tensor of {s.nbytes.coeffs[0]:,} B ({made}) belongs to no block and is as "
                                   "large as a block's parameters: it may hold every block's")

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

        names = dict(raw.state_names)

        def storage_copy(sid: int, real: int, op: int) -> int:
            new = resolve(_Ref(0, self.keys[sid]), real)
            s = storages[sid]
            made[new] = Storage(s.nbytes, s.category, op, s.extra, self._renamed(s.owner, TEMPLATE, real), s.born)
            if sid in raw.state_names:
                names[new] = self._renamed(raw.state_names[sid], TEMPLATE, real, self._kept_state(s))
            return new

        def listed(items: list, label: Callable, copy_of: Callable, what: str) -> list:
            """``items`` with copies of the template's runs for every built unit."""
            templates = self._templates([label(x) for x in items], what)
            if not templates:
                return list(items)
            out, last = [], 0
            for t in templates:
                run = items[t.start:t.end]
                sig = [self._item_sig(x, TEMPLATE) for x in run]
                if [self._item_sig(x, FIRST) for x in items[t.first[1]:t.first[2]]] != sig or \
                        [self._item_sig(x, NEXT) for x in items[t.nxt[1]:t.nxt[2]]] != sig:
                    raise NotRepeating(f"{what}: {self._unit_name(FIRST)} to {self._unit_name(NEXT)} differ")
                out += items[last:t.at]
                units = plan_.copies if t.ascending else reversed(plan_.copies)
                out += [copy_of(x, real) for real in units for x in run]
                last = t.at
            return out + items[last:]

        def kept(sid: int, **changes) -> Storage:
            """A captured storage in the built step (its owner's unit renamed at another depth)."""
            s, pos = storages[sid], self.store_pos.get(sid)
            if self.moved and pos is not None and s.owner:
                changes["owner"] = self._renamed(s.owner, pos, plan_.real_unit(pos))
            return _copied(s, **changes) if changes else s

        label_sid = self.store_pos.get
        # the state before the step: parameters, buffers, optimizer state
        state = [sid for sid, s in storages.items() if s.op < 0]
        new_storages = {}
        for sid in listed(state, label_sid, lambda sid, real: storage_copy(sid, real, -1), "the state before the step"):
            new_storages[sid] = made[sid] if sid in made else kept(sid)

        self._load_order(new_storages, listed, resolve)

        # the ops
        ops = raw.ops
        out_ops: list[OpEvent] = []
        index: dict[int, int] = {}  # captured op -> its index now
        starts = {t.at: t for t in op_templates}

        def freed_list(op: OpEvent) -> list[int]:
            return listed(op.frees, label_sid, lambda sid, r: resolve(_Ref(0, self.keys[sid]), r),
                          f"what is freed after {op.name}")

        def emit(op: OpEvent, pos: int | None, real: int | None, copy_: bool, wide: bool = False) -> None:
            at = len(out_ops)
            if pos is None:  # lists of storages of many units
                allocs = listed(op.allocs, label_sid, lambda sid, r: storage_copy(sid, r, at), f"{op.name}'s outputs")
                frees = freed_list(op)
                reads = listed(list(op.reads), label_sid, lambda sid, r: resolve(_Ref(0, self.keys[sid]), r),
                               f"the list {op.name} reads")
                for sid in allocs:
                    new_storages[sid] = made[sid] if sid in made else _copied(storages[sid], op=at)
                if len(reads) != len(op.reads) and op.name in _JOINS:  # a cat or stack over the units
                    (out,) = allocs
                    new_storages[out] = self._joined(new_storages[out], op, reads, new_storages)
                out_ops.append(_copied(op, allocs=allocs, frees=frees, reads=tuple(reads)))
                return
            allocs = []
            for sid in op.allocs:
                if copy_:
                    new = storage_copy(sid, real, at)
                    new_storages[new] = made[new]
                else:
                    new = sid
                    new_storages[sid] = kept(sid, op=at)
                allocs.append(new)
            frees = freed_list(op) if wide else [resolve(self._ref(s, pos), real) for s in op.frees]
            module, owner = op.module, op.owner
            if copy_ or (self.moved and pos is not None):
                module, owner = self._renamed(module, pos, real), self._renamed(owner, pos, real)
            out_ops.append(_copied(op, allocs=allocs, frees=frees, module=module, owner=owner))

        for i, op in enumerate(ops):
            if i in starts:
                self._emit_copies(ops, starts[i], emit)
            pos = self.op_pos[i]
            index[i] = len(out_ops)
            self.origins.append((i, None))
            emit(op, pos, None if pos is None else plan_.real_unit(pos), False, i in self.wide)
        if len(ops) in starts:
            self._emit_copies(ops, starts[len(ops)], emit)

        grad_order = tuple(listed(list(raw.grad_order), self._pos, lambda n, r: self._renamed(n, TEMPLATE, r),
                                  "the gradient order"))
        sites = tuple(listed(list(raw.data_dependent), lambda s: self._pos(s.site),
                             lambda s, r: dataclasses.replace(s, site=self._renamed(s.site, TEMPLATE, r)),
                             "the data-dependent sizes"))
        freed_first = tuple(listed(list(raw.freed_first), label_sid,
                                   lambda sid, r: resolve(_Ref(0, self.keys[sid]), r), "the state freed first"))
        index[len(ops)] = len(out_ops)  # a mark after the last op
        decoding = raw.decoding if raw.decoding is None else self._decoding(index)
        marks = RunMarks(tuple(None if i is None else index[i] for i in raw.marks.optimizer_starts),
                         None if raw.marks.model_returns is None else index[raw.marks.model_returns])
        units = f" units of {plan_.period}" if plan_.period > 1 else ""
        head = f"{plan_.head} of their own, then " if plan_.head else ""
        note = (f"{plan_.name}: {plan_.blocks} blocks from a capture of {plan_.captured} ({head}the first "
                f"{TEMPLATE + 1} and last {UNITS - TEMPLATE - 1}{units}): {self._unit_name(FIRST)}, {self._unit_name(TEMPLATE)} and {self._unit_name(NEXT)} ran the same "
                f"ops on the same tensors, so the {len(plan_.copies) * plan_.period} between are built from them "
                "(exact: estimator/capture/repeated_blocks.py); report.graph is the shallow run's")
        captured, calls = sum(op.kernel is not None for op in ops), sum(op.kernel is not None for op in out_ops)
        if captured:
            note += (f"; the notes on kernel calls measured on this host count the captured blocks' {captured}: the "
                     f"step makes {calls}, the built blocks' {calls - captured} each measured (or not) as its "
                     "template's")
        # the data-dependent sizes' notes name every site: those of the built blocks too
        said = set(value_notes.notes(raw.data_dependent))
        at = next((i for i, n in enumerate(raw.notes) if n in said), len(raw.notes))
        kept = [n for n in raw.notes if n not in said]
        notes = (*kept[:at], *value_notes.notes(sites), *kept[at:], note)
        return dataclasses.replace(raw, ops=out_ops, storages=new_storages, grad_order=grad_order, notes=notes,
                                   data_dependent=sites, freed_first=freed_first, marks=marks, decoding=decoding,
                                   state_names=names)

    def _joined(self, out: Storage, op: OpEvent, reads: list[int], storages: dict[int, Storage]) -> Storage:
        """The output of ``torch.cat`` / ``torch.stack`` over a list with the built units' items: as
        many bytes as the items (checked on the captured list)."""
        size = self.raw.storages
        if None in op.reads or out.nbytes != sum((size[s].nbytes for s in op.reads[1:]), size[op.reads[0]].nbytes):
            raise NotRepeating(f"{op.name} over the blocks: its output is not the bytes of its list")
        return dataclasses.replace(out, nbytes=sum((storages.get(s, size.get(s)).nbytes for s in reads[1:]),
                                                   storages.get(reads[0], size.get(reads[0])).nbytes))

    def _decoding(self, index: dict[int, int]) -> Decoding:
        """``generate()``: the calls where their first ops now are, and the cache's bytes per token
        with the built blocks' layers (each the template's layer at its place in the unit)."""
        decoding, plan_ = self.raw.decoding, self.plan
        per_layer = decoding.layer_bytes
        if len(per_layer) != plan_.blocks:
            raise NotRepeating(f"its {decoding.cache or 'cache'} does not hold one layer per block")
        template = plan_.real_unit(TEMPLATE)
        full = [per_layer[i] if (found := plan_.locate(i)) is None or found[0] in self.pos_of_unit
                else per_layer[plan_.block(template, found[1])] for i in range(plan_.blocks)]
        return dataclasses.replace(decoding, calls=tuple(index[i] for i in decoding.calls),
                                   bytes_per_token=sum(full), layer_bytes=tuple(full))

    def _load_order(self, new_storages: dict[int, Storage], listed, resolve) -> None:
        """The parameters' and buffers' places in ``Module._apply``'s walk (``Born.order``): a copy
        is as far from the one before it as its template is from the one before that (one place,
        or none where a parallelize function made every shard at one place), the later ones moved
        on by the copies' steps."""
        storages = self.raw.storages
        walk = sorted((sid for sid, s in storages.items() if s.born is not None and s.born.when is Birth.LOAD),
                      key=lambda sid: storages[sid].born.order)
        step = {sid: storages[sid].born.order - storages[before].born.order for before, sid in zip(walk, walk[1:])}
        template_of: dict[int, int] = {}

        def copy_of(sid: int, real: int) -> int:
            new = resolve(_Ref(0, self.keys[sid]), real)
            template_of[new] = sid
            return new

        shift, order = 0, -1
        for sid in listed(walk, self.store_pos.get, copy_of, "the model's load order"):
            if sid in template_of:
                gap = step.get(template_of[sid], 1)
                shift, order = shift + gap, order + gap
            else:
                order = storages[sid].born.order + shift
            new_storages[sid] = dataclasses.replace(new_storages[sid], born=Born(Birth.LOAD, order))

    def _emit_copies(self, ops, run: _Run, emit) -> None:
        for real in self.plan.copies if run.ascending else reversed(self.plan.copies):
            for i in range(run.start, run.end):
                self.origins.append((i, real))
                emit(ops[i], TEMPLATE, real, True)

    def _item_sig(self, item, pos: int) -> Any:
        if isinstance(item, int):
            return self._storage_sig(item, pos)
        if isinstance(item, str):
            return self._rel(item, pos)
        return dataclasses.replace(item, site=self._rel(item.site, pos))
