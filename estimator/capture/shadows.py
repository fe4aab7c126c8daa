"""The real values of the fake tensors that follow the sample alone.

Fake tensors have no values, so a step that reads one (``mask.all()``, ``bool(ids.eq(pad).any())``)
needs a real run of the model (``datadep.probe``), which needs real weights.  But many values
the step reads depend on the sample alone -- an attention mask, token ids, position ids, lengths
-- and those are known without the weights: each sample tensor's fake copy gets a *shadow*, the
real tensor with the fake's rows (the sample's rows repeated to the capture's batch hint), and
every op whose tensor arguments all have shadows (or that has none: ``arange``, ``ones``) runs
on the shadows too, for real, with the sizes' hints.  The capture's data-dependent values are
then read from the shadow (``DataDependent.value``), and library code that asks whether it is
being traced because it cannot read values can be answered as for real tensors where the value
is known (``tracing.py``).

Shadows are dropped where they could be wrong: an op the shadows cannot follow mutates a
shadowed tensor (its storage is marked stale), a random op (its values would not be the real
run's), a shape that differs from the fake's hint (data-dependent sizes), or more than
``LIMIT`` elements (the real compute and memory stay small: masks and ids, not activations).

A collective (on the fake process group of ``Strategy(mesh=)``) brings the other ranks' values:
its outputs get those of a job whose every rank holds this rank's (``_exchanged``), marked
``EXCHANGED`` so the capture can say so and tell the ranks apart by what each receives
(``_diverged``).  A module's integer arguments can be seeded too (``seed``: the probe's, for a
router's indices), and so can a router's top-k picks where no real run gives them (``routing.py``),
marked ``ROUTED``.
Marks follow the values: an op's outputs carry every mark of its inputs.
"""

from __future__ import annotations

import hashlib

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

LIMIT = 1 << 20  # elements of one shadow (and of a module argument the probe keeps to seed one)
# The namespaces of collectives: ``c10d``'s in-place ops and the functional ones (``torch.distributed``'s
# ``_functional_collectives``, ``_c10d_functional_autograd``), which a fake process group runs without values.
_COLLECTIVES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})
_CPU = torch.device("cpu")
EXCHANGED, ROUTED = "exchanged", "routed"  # the marks: a collective brought it; a router's picks assumed


def hint(value):
    """A SymInt/SymFloat/SymBool's hint (no guard); anything else as it is."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.hint
    return value


def _hint_shape(t: torch.Tensor) -> tuple:
    return tuple(hint(s) for s in t.shape)


def _tensors(args, kwargs) -> list:
    """The tensor arguments of an aten op, written out (it runs for every op): tensors and lists
    of tensors, the forms an op's schema takes."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


class Shadows:
    """Real tensors for fake ones, kept alongside the capture (``DataDependent`` owns one)."""

    def __init__(self) -> None:
        self._real = WeakIdKeyDictionary()
        self._seeded = False  # any shadow given yet (an op with no shadowed input is then not looked at)
        self._stale: set[int] = set()  # fake storages written by an op the shadows did not follow
        # fake storages -> the marks of their shadows' values (EXCHANGED: a collective brought them, or they
        # follow from such, with the number of each such collective; ROUTED: from a router's assumed picks)
        self._marks: dict[int, frozenset] = {}
        # the collectives whose values a read followed: their groups (global ranks) -> the places in each whose
        # values first differed from this rank's, by what they received then (``_diverged``, ``read``)
        self.exchanged_groups: dict[tuple[int, ...], dict[int, tuple]] = {}
        self._diverged_at: list[tuple[tuple[int, ...], dict[int, tuple]]] = []  # by collective, as ``_diverged``

    def __bool__(self) -> bool:
        return self._seeded

    def get(self, fake: torch.Tensor) -> torch.Tensor | None:
        real = self._real.get(fake)
        if real is None or fake.untyped_storage()._cdata in self._stale:
            return None
        return real

    def value(self, fake: torch.Tensor):
        """The Python value of a one-element fake tensor that has a shadow, else None."""
        real = self.get(fake)
        if real is None:
            return None
        with _disable_current_modes():
            return real.item()

    def count(self, mask: torch.Tensor) -> tuple[int, int] | None:
        """``(nonzeros, elements)`` of a fake mask that has a shadow, else None."""
        real = self.get(mask)
        if real is None:
            return None
        with _disable_current_modes():
            return int(real.count_nonzero()), real.numel()

    def seed(self, fake: torch.Tensor, real: torch.Tensor, dim: int = 0, mark: str | None = None) -> None:
        """``real`` (a sample tensor) as the shadow of its fake copy ``fake``: rows repeated along
        ``dim`` to the fake's hint where they differ; ``mark``: its values' mark."""
        shape = _hint_shape(fake)
        with _disable_current_modes():  # (a module's argument is seeded inside the capture's modes)
            if real.shape != shape and real.dim() == len(shape) and real.dim() > dim and real.shape[dim] > 0:
                rows = torch.arange(shape[dim]) % real.shape[dim]
                real = real.index_select(dim, rows)
            if tuple(real.shape) == shape and real.numel() <= LIMIT:
                self._set(fake, real.detach(), frozenset({mark}) if mark else frozenset())
                self._seeded = True

    def _set(self, fake: torch.Tensor, real: torch.Tensor, marks: frozenset) -> None:
        address = fake.untyped_storage()._cdata
        self._real[fake] = real
        self._stale.discard(address)  # (a dead storage's address, reused)
        if marks:
            self._marks[address] = marks
        else:
            self._marks.pop(address, None)

    def marks(self, fake: torch.Tensor) -> frozenset:
        """The marks of ``fake``'s shadow's values (``EXCHANGED``, ``ROUTED``, collectives' numbers)."""
        return self._marks.get(fake.untyped_storage()._cdata, frozenset())

    def read(self, fake: torch.Tensor) -> frozenset:
        """``marks(fake)``, for a value the step reads: the collectives it follows count for the
        ranks' roles (``exchanged_groups``; a place keeps the first collective it differed at)."""
        marks = self.marks(fake)
        for k in sorted(m for m in marks if isinstance(m, int)):
            ranks, places = self._diverged_at[k]
            group = self.exchanged_groups.setdefault(ranks, {})
            for place, got in places.items():
                if place not in group or got[0] < group[place][0]:
                    group[place] = got
        return marks

    def _marks_of(self, tensors) -> frozenset:
        return frozenset().union(*(self.marks(t) for t in tensors)) if self._marks else frozenset()

    def follow(self, func, args, kwargs, out) -> None:
        """After ``func`` ran on fake tensors: run it on the shadows where every tensor argument
        has one, and shadow its outputs; else mark what it wrote as stale.  A higher-order
        operator (a compiled region's ``run_and_save_rng_state``) is not followed: it writes
        nothing it is handed."""
        if not isinstance(func, torch._ops.OpOverload):
            return
        if func.namespace in _COLLECTIVES:
            self._collective(func, args, kwargs, out)
            return
        tensors = _tensors(args, kwargs)
        followed = (not tensors or all(self.get(t) is not None for t in tensors)) and self._followable(func, out)
        if followed:
            followed = self._run(func, args, kwargs, out)
        if not followed and func._schema.is_mutable:
            for argument, value in zip(func._schema.arguments, args):
                if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor):
                    self._stale.add(value.untyped_storage()._cdata)

    def _collective(self, func, args, kwargs, out) -> None:
        """A collective's outputs hold the other ranks' values, which no rank's shadows know.
        Where its inputs have shadows they get the values of a job whose every rank holds this
        rank's (``_exchanged``: a sum over ``n`` ranks is ``n`` times the value, an all-gather
        ``n`` copies, an all-to-all ``n`` copies of the chunk this rank sends itself), and are
        marked ``EXCHANGED``; else none.  ``c10d``'s ops write into their first argument
        (``output``, ``output_tensors``, ``tensors``) without saying so in their schemas; a
        functional collective returns its result."""
        bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        in_place = func.namespace == "c10d"
        targets = [t for t in tree_flatten(bound.get(func._schema.arguments[0].name) if in_place else out)[0]
                   if isinstance(t, torch.Tensor)]
        name = func._schema.name.partition("::")[2].rstrip("_")
        written = {id(t) for t in targets} if in_place else set()
        inputs = [t for t in _tensors(args, kwargs) if id(t) not in written] or targets  # all_reduce: in place
        values = None
        if inputs and all(self.get(t) is not None for t in inputs):
            if name in ("wait_tensor", "_wrap_tensor_autograd"):  # the same values
                values = [self.get(inputs[0])]
            else:
                try:
                    with _disable_current_modes(), torch.no_grad():
                        values = _exchanged(name, bound, self.get)
                except Exception:  # noqa: BLE001 -- a group or an argument this rule does not read: no shadow
                    values = None
        if values is None or len(values) != len(targets) or any(
                v is None or tuple(v.shape) != _hint_shape(t) for v, t in zip(values, targets)):
            for t in targets:
                self._stale.add(t.untyped_storage()._cdata)
            return
        marks = self._marks_of(inputs) | {EXCHANGED}
        if name not in ("wait_tensor", "_wrap_tensor_autograd"):
            marks |= {self._diverged(name, bound)}
        for t, value in zip(targets, values):
            self._set(t, value, marks)

    def _diverged(self, name: str, bound: dict) -> int:
        """The collective's number; notes the places of its group whose rank gets other values than
        this one (``_received``), with what it gets.  Until the first collective whose values it
        reads differ so, such a rank runs what this one runs, and ranks that first differ alike run
        alike after (``world.split_roles``)."""
        r, n, ranks = _group(bound)
        places = {}
        with _disable_current_modes():
            mine = _received(name, bound, self.get, r, n)
            for place in range(n) if mine is not None else ():
                theirs = _received(name, bound, self.get, place, n)
                if place != r and not _same(mine, theirs):
                    got = hashlib.blake2b(theirs.numpy().tobytes(), digest_size=16).digest()
                    places[place] = (len(self._diverged_at), tuple(theirs.shape), got)
        self._diverged_at.append((ranks, places))
        return len(self._diverged_at) - 1

    @staticmethod
    def _followable(func, out) -> bool:
        if torch.Tag.nondeterministic_seeded in func.tags:
            return False
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        return bool(outs) and all(isinstance(n, int) and n <= LIMIT for n in (hint(t.numel()) for t in outs))

    def _run(self, func, args, kwargs, out) -> bool:
        def real(x):  # shadows live on the CPU whatever device the capture targets (a factory's device=cuda)
            if isinstance(x, torch.Tensor):
                return self.get(x)
            return _CPU if isinstance(x, torch.device) and x.type != "meta" else hint(x)

        real_args, real_kwargs = tree_map(real, (args, kwargs))
        try:
            with _disable_current_modes(), torch.no_grad():
                result = func(*real_args, **real_kwargs)
        except Exception:  # the shadows cannot follow this op: its outputs have none
            return False
        fakes, reals = tree_flatten(out)[0], tree_flatten(result)[0]
        if len(fakes) != len(reals):
            return False
        marks = self._marks_of(_tensors(args, kwargs))
        for fake, value in zip(fakes, reals):
            if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor) \
                    and tuple(value.shape) == _hint_shape(fake):
                self._set(fake, value, marks)
        return True


# ``torch.distributed.ReduceOp.RedOpType``'s values (c10d's ``ReduceOp.op()``) and the functional
# collectives' names for them
_REDUCE = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max", 5: "band", 6: "bor", 7: "bxor"}


def _reduced(x: torch.Tensor, op, n: int) -> torch.Tensor | None:
    """``op`` over ``n`` ranks that each hold ``x``."""
    op = _REDUCE.get(op.op()) if isinstance(op, torch.ScriptObject) else str(op).lower()
    if op == "sum":
        return x * n
    if op == "product":
        return x**n
    if op == "bxor":
        return x if n % 2 else torch.zeros_like(x)
    return x.clone() if op in ("avg", "min", "max", "band", "bor") else None  # premul_sum: a scale not known


def _group(bound: dict) -> tuple[int, int, tuple[int, ...]]:
    """(this rank's index in the collective's group, the group's size, its global ranks)."""
    import torch.distributed as dist

    if "process_group" in bound:
        pg = dist.ProcessGroup.unbox(bound["process_group"])
    else:
        pg = dist.distributed_c10d._resolve_process_group(bound["group_name"])
    return pg.rank(), pg.size(), tuple(dist.get_process_group_ranks(pg))


def _chunk(x: torch.Tensor, splits, r: int, n: int) -> torch.Tensor:
    """The ``r``-th of ``n`` chunks of ``x`` along dim 0 (``splits``: their sizes; empty: equal)."""
    sizes = [hint(s) for s in splits] if splits else [x.shape[0] // n] * n
    return x.narrow(0, sum(sizes[:r]), sizes[r])


_REDUCE_SCATTER, _ALL_TO_ALL = ("_reduce_scatter_base", "reduce_scatter_tensor"), ("alltoall_base", "all_to_all_single")


def _received(name: str, bound: dict, shadow, place: int, n: int) -> torch.Tensor | None:
    """What the rank at ``place`` of a group of ``n`` gets from a collective that hands ranks
    different parts (a reduce-scatter's chunk, an all-to-all's), in a job whose every rank holds
    this rank's inputs; None where every rank gets the same."""
    if name in _REDUCE_SCATTER:
        return _chunk(shadow(bound.get("input_tensor", bound.get("input"))), (), place, n)
    if name in _ALL_TO_ALL:
        return _chunk(shadow(bound["input"]), bound["input_split_sizes"], place, n)
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _exchanged(name: str, bound: dict, shadow) -> list[torch.Tensor] | None:
    """The outputs of the collective ``name`` (c10d's or a functional one) in a job whose every
    rank holds this rank's inputs: from ``shadow`` of its inputs; None where the rule is not known
    or an input has no shadow."""
    r, n, _ = _group(bound)
    if name == "allreduce":
        reals = [shadow(t) for t in bound["tensors"]]
        return None if None in reals else [_reduced(x, bound["reduce_op"], n) for x in reals]
    if name == "broadcast" and "tensors" in bound:  # the root holds what this rank holds
        reals = [shadow(t) for t in bound["tensors"]]
        return None if None in reals else [x.clone() for x in reals]
    if name in ("broadcast", "all_reduce"):
        x = shadow(bound["input"])
        return None if x is None else [x.clone() if name == "broadcast" else _reduced(x, bound["reduce_op"], n)]
    if name in ("_allgather_base", "all_gather_into_tensor"):
        x = shadow(bound.get("input_tensor", bound.get("input")))
        return None if x is None else [torch.cat([x] * n)]
    if name == "allgather":
        x = shadow(bound["input_tensors"][0]) if len(bound["input_tensors"]) == 1 else None
        return None if x is None else [x.clone() for _ in bound["output_tensors"][0]]
    if name in _REDUCE_SCATTER or name in _ALL_TO_ALL:
        if shadow(bound.get("input_tensor", bound.get("input"))) is None:
            return None
        chunk = _received(name, bound, shadow, r, n)
        return [torch.cat([chunk] * n) if name in _ALL_TO_ALL else _reduced(chunk, bound["reduce_op"], n)]
    return None
