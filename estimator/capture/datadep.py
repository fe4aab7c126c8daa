"""Data-dependent sizes and values: what a fake tensor cannot know, decided by a policy.

``torch.nonzero``, boolean-mask indexing (``h[score > 0]``, ``x[mask] = v``),
``masked_select`` and ``unique`` return tensors whose size depends on the data; ``.item()`` /
``bool(t)`` return a value that does.  Fake tensors have no data, so torch refuses them
(``DynamicOutputShapeException``).  While capturing, the ``DataDependent`` dispatch mode answers
each such call instead:

- a **size** ``n`` has a known range, ``0 ≤ n ≤ upper`` (``upper``: the elements the mask or
  input has, a formula in the batch size).  Which ``n`` the capture uses is the user's
  ``data_dependent=`` policy (``Policy``): ``"max"`` (default) the upper bound, the safe worst
  case for "will it fit"; ``"sample"`` the value observed on the user's own sample, by a real
  forward of the model (``probe``: real weights only), scaled to other batch sizes per row; a
  fraction of the upper bound; or, per call site, a number.  Where a constraint fixes a total
  the bound respects it: the rows of ``F.one_hot`` have one 1 each, so the ``nonzero`` calls over
  (parts of) one one-hot tensor share its ``numel(indices)`` ones — an MoE's tokens routed to
  its experts sum to tokens × top-k, and its saved activations are exact under ``"max"`` too
  (the first expert that asks takes the whole budget: the worst case for a transient);
- a **value** (``.item()``, ``bool(tensor)``) cannot be bounded: the probe's observation is
  used where the weights are real; otherwise the capture stops with an error naming the line.

Each call has a *site*: ``"<module path>:<op>#<k>"``, the ``k``-th such call of that op inside
one call of that module (so a checkpointed module's recomputation meets the same sites).  Every
size used is recorded (``Site``) for the report's notes.

The policy and the sites are descriptions (``estimator.vocab.data_dependent``).  Corrections call
``corrections.data_sizes.count(op, upper)`` for a data-dependent size they price themselves
(native fast paths over nested tensors), and register ``@observes(op)`` there to tell the probe
how to read that size from a real call; this module's ``DataDependent`` answers them.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from estimator.capture import compiled, routing, watchdog
from estimator.capture.shadows import EXCHANGED, LIMIT, ROUTED, Shadows
from estimator.corrections.data_sizes import ACTIVE, OBSERVERS, inside_kernel  # the seam corrections read
from estimator.vocab.data_dependent import SAMPLE, Policy, Site, Source
from estimator.vocab.errors import CaptureError, InputError
from estimator.vocab.symbolic import as_expr

aten = torch.ops.aten


class NeedsProbe(CaptureError):
    """A data-dependent value (``.item()``, ``bool(tensor)``) that only a real run can give;
    ``after_topk``: a ``torch.topk`` of scores no shadow knows ran before it (a router's picks,
    which a ``Policy.routing`` would give: ``routing.py``)."""

    def __init__(self, message: str, after_topk: bool = False) -> None:
        super().__init__(message)
        self.after_topk = after_topk


# -- call sites ---------------------------------------------------------------------------
class _Sites:
    """``"<module>:<op>#<k>"`` for each call: global module hooks keep the module stack and, per
    module call, a counter per op."""

    def __init__(self, module_names: Mapping[int, str], on_call: Callable[[str, tuple], None] | None = None):
        self._names = module_names
        self._stack: list[tuple[str, dict[str, int]]] = [("", {})]
        self._calls: dict[str, int] = {}  # calls of each module so far
        self._on_call = on_call  # (f"{module}#{k}", its positional arguments), as each module call starts

    def restart(self) -> None:
        self._stack, self._calls = [("", {})], {}

    def key(self, op: str) -> str:
        module, counts = self._stack[-1]
        k = counts.get(op, 0)
        counts[op] = k + 1
        return f"{module}:{op}#{k}"

    @contextlib.contextmanager
    def hooks(self):
        if compiled.transparent():  # Dynamo would trace the hooks into the compiled step (graph breaks)
            yield self
            return

        def enter(m, args):
            name = self._names.get(id(m), type(m).__name__)
            self._stack.append((name, {}))
            if self._on_call is not None:
                k = self._calls.get(name, 0)
                self._calls[name] = k + 1
                self._on_call(f"{name}#{k}", args)

        def leave(m, args, out):
            if len(self._stack) > 1:
                self._stack.pop()

        pre = nn.modules.module.register_module_forward_pre_hook(enter)
        post = nn.modules.module.register_module_forward_hook(leave, always_call=True)
        try:
            yield self
        finally:
            pre.remove()
            post.remove()


_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _user_line() -> str:
    """``file:line`` of the innermost frame outside torch and fxmem: values are keyed by the line
    that asks for them, since real and fake tensors do not ask equally often (indexing with a
    0-dim tensor calls ``item()`` on a real CPU tensor only)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
    return "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _short(func) -> str:
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


# -- the capture's mode -------------------------------------------------------------------
_PROBES: list[Probe] = []


class DataDependent(TorchDispatchMode):
    """Answers data-dependent ops on fake tensors by the policy (see the module docstring)."""

    supports_higher_order_operators = True  # a compiled region's RNG operators: passed on

    ignore_compile_internals = staticmethod(compiled.transparent)  # a compiled step runs under it

    def __init__(self, policy: Policy, module_names: Mapping[int, str]):
        super().__init__()
        self.policy = policy
        self.sites: dict[str, Site] = {}
        self._sites = _Sites(module_names, self._seed_inputs if policy.inputs else None)
        self._nnz = _PerStorage()  # a mask (storage, offset, version, shape) -> its n
        self._budget = _PerStorage()  # a one-hot tensor (or a copy of part of it) -> [ones left]
        self._distinct = _PerStorage()  # arange outputs (distinct values) -> True
        self.assumed: dict[str, None] = {}  # floating-point values answered with 0.0 (by site)
        self.host_reads: dict[str, None] = {}  # .numpy() values the probe's real run gave (by site)
        self.shadows = Shadows()  # the real values of what follows the sample alone
        self.read_values = False  # whether a shadow or the probe gave a value or size
        self.exchanged: dict[str, None] = {}  # values read that a collective brought (by site): shadows.py
        self.routed: dict[str, None] = {}  # values read that follow a router's assumed picks: routing.py
        self.unrouted = False  # a torch.topk of unknown scores ran, its picks not assumed (routing.py)

    def shadow_sample(self, fsample, sample, batch_dims: tuple[int, ...] | None = None) -> None:
        """Each sample tensor as the shadow of its fake copy (``shadows.py``)."""
        fakes, reals = tree_flatten(fsample)[0], tree_flatten(sample)[0]
        dims = batch_dims or (0,) * len(fakes)
        for fake, real, dim in zip(fakes, reals, dims):
            if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor) and not real.is_meta:
                self.shadows.seed(fake, real, 0 if dim is None else dim)

    def _seed_inputs(self, call: str, args: tuple) -> None:
        """A module call's integer tensor arguments that have no shadow get the probe's values for
        the same call (``Policy.inputs``: a router's expert indices, which a parallelized step sends
        to other ranks)."""
        for i, a in enumerate(args):
            real = self.policy.inputs.get(f"{call}:{i}")
            if real is not None and isinstance(a, torch.Tensor) and self.shadows.get(a) is None:
                self.shadows.seed(a, real)

    def _known(self, key: str, t: torch.Tensor, known):
        """``known`` (a shadow's value or count), noting one a collective brought or a router's
        assumed picks fix."""
        if known is not None:
            marks = self.shadows.read(t)
            if EXCHANGED in marks:
                self.exchanged[key] = None
            if ROUTED in marks:
                self.routed[key] = None
        return known

    def new_step(self) -> None:
        """The measured step starts: the sites of calls outside any module count from 0 again, as in
        the probe's single run (a user's step calls ``loss.item()`` in the warm-up step too)."""
        self._sites.restart()

    def __enter__(self):
        ACTIVE.append(self)
        self._hooks = self._sites.hooks()
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)
            ACTIVE.remove(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(self, func, args, kwargs)
        else:
            out = func(*args, **kwargs)
            if func in _KEEPS_BUDGET and isinstance(args[0], torch.Tensor):
                pool = self._budget.get(args[0])
                if pool is not None and isinstance(out, torch.Tensor) and self._budget.get(out) is None:
                    self._budget.set(out, pool)
        if self.shadows:
            self.shadows.follow(func, args, kwargs, out)
        return out

    # -- sizes --------------------------------------------------------------------------
    def size(self, op: str, upper, mask: torch.Tensor | None = None):
        """The size to use for one data-dependent call (an int or SymInt), recorded as a site; the
        count of ``mask``'s nonzeros where the sample's own values fix it (its shadow,
        ``shadows.py``)."""
        key = self._sites.key(op)
        pool = self._budget.get(mask) if mask is not None else None
        known = self._known(key, mask, self.shadows.count(mask)) if mask is not None else None
        used, source, observed = self._choose(key, as_expr(upper), known)
        if pool is not None and source is Source.BOUND:
            left = pool[0]
            used = left if _le(left, used) else used
            pool[0] = sympy.expand(left - used)
            source = Source.BUDGET
        self.sites[key] = Site(key, op, as_expr(upper), used, source, observed, inside_kernel())
        return _symint(used, upper)

    def _choose(self, key: str, upper, known: tuple[int, int] | None = None):
        choice = self.policy.sites.get(key, self.policy.default)
        if isinstance(choice, int):
            return sympy.Integer(choice), Source.GIVEN, None
        if isinstance(choice, float):
            return _scaled(upper, choice), Source.FRACTION, None
        if choice == SAMPLE and known is not None:  # the sample's own values fix it: no probe needed
            self.read_values = True
            return _per_row(upper, *known), Source.INPUTS, known
        if choice == SAMPLE:
            seen = self.policy.observed.get(key)
            if seen is None and self.policy.unprobed:
                raise meta_weights(f"the size of {key}")
            if seen is None:
                return sympy.sympify(upper), Source.UNOBSERVED, None
            self.read_values = True
            return _per_row(upper, *seen), Source.SAMPLE, seen
        return sympy.sympify(upper), Source.BOUND, None

    def sequence_lengths(self, given: list[int] | None, rows: int, padded: int) -> list[int]:
        """The lengths ``pack_padded_sequence`` packs (a concrete capture; the site
        ``pack_padded_sequence``, ``upper`` = every one of the ``rows`` sequences ``padded`` long):
        the ``given`` values (the lengths' shadow: the sample fixes them) where the policy says
        ``"sample"``; else the size the policy gives spread over the sequences, longest first (the
        bound: all ``padded`` long)."""
        upper = rows * padded
        key = self._sites.key("pack_padded_sequence")
        used, source, observed = self._choose(key, upper, None if given is None else (sum(given), upper))
        self.sites[key] = Site(key, "pack_padded_sequence", sympy.Integer(upper), used, source, observed)
        if source is Source.INPUTS:
            return given
        q, r = divmod(min(int(used), upper), rows)
        return [min(q + 1, padded)] * r + [max(q, 1)] * (rows - r)

    def host(self, t: torch.Tensor):
        """The values of ``t.numpy()`` on a fake tensor (host code reading them: a matching on
        the host, ``scipy.optimize.linear_sum_assignment``): its shadow where they follow the
        sample alone (a tensor), else the probe's (a numpy array: same site, same shape), else
        ``NeedsProbe``."""
        key = self._sites.key(f"numpy@{_user_line()}")
        real = self.shadows.get(t)
        if real is not None:
            self.read_values = True
            return real
        seen = self.policy.values.get(key)
        if hasattr(seen, "__array__") and getattr(seen, "shape", None) == tuple(t.shape):
            self.host_reads[key] = None
            self.read_values = True
            return seen
        raise NeedsProbe(f"values read on the host ({key}, .numpy()): only a real run of the model can give them")

    def nnz(self, mask: torch.Tensor):
        """The number of nonzeros the capture uses for ``mask`` (the same for every call on one
        mask: the forward's ``x[mask]`` and its backward's ``index_put_`` agree)."""
        key = _mask_key(mask)
        n = self._nnz.get(mask, key)
        if n is None:
            n = self.size("nonzero", mask.numel(), mask)
            self._nnz.set(mask, n, key)
        return n

    def value(self, func, args):
        """A data-dependent scalar: its shadow's (a value that follows the sample alone, at this
        capture's batch), else the probe's (at the sample's), else 0.0 for a floating-point one (a
        logged loss or gradient norm: memory does not depend on it, noted), else ``NeedsProbe``."""
        key = self._sites.key(f"{_short(func)}@{_user_line()}")
        known = self._known(key, args[0], self.shadows.value(args[0]))
        if known is None and key in self.policy.values:
            known = self.policy.values[key]
        if known is not None:
            self.read_values = True
            return known
        if args[0].is_floating_point():
            self.assumed[key] = None
            return 0.0
        # (raised without a local name: a frame holding its own exception would keep the capture's frames, and
        # the run they recorded, alive until the cyclic collector runs)
        raise NeedsProbe(f"a data-dependent value ({key}): only a real run of the model can give it", self.unrouted)


def probing() -> Probe | None:
    return _PROBES[-1] if _PROBES else None


class _PerStorage:
    """Values keyed by a tensor's storage (and ``extra``), dropped when that storage is freed:
    storage addresses are reused, and a new mask must not find a dead one's size (a weak
    reference on the storage, as the tracker keeps)."""

    def __init__(self):
        self._values: dict[tuple, Any] = {}
        self._refs: dict[int, weakref.ref] = {}

    def get(self, t: torch.Tensor, extra: tuple = ()):
        return self._values.get((t.untyped_storage()._cdata, *extra))

    def set(self, t: torch.Tensor, value, extra: tuple = ()) -> None:
        storage = t.untyped_storage()
        address = storage._cdata
        if address not in self._refs:
            self._refs[address] = weakref.ref(storage, lambda _, a=address: self._drop(a))
        self._values[(address, *extra)] = value

    def _drop(self, address: int) -> None:
        self._refs.pop(address, None)
        for key in [k for k in self._values if k[0] == address]:
            del self._values[key]


def _mask_key(t: torch.Tensor) -> tuple:
    """A mask's view of its storage: one size per (offset, version, shape)."""
    return t.storage_offset(), t._version, tuple(as_expr(s) for s in t.shape)


def _le(a, b) -> bool:
    """``a ≤ b`` for every positive value of the symbols (False when unknown)."""
    diff = sympy.expand(sympy.sympify(b) - sympy.sympify(a))
    if diff.is_number:
        return bool(diff >= 0)
    poly = sympy.Poly(diff, *sorted(diff.free_symbols, key=str))
    return all(c >= 0 for c in poly.coeffs())


def _scaled(upper, fraction: float):
    """``fraction × upper``, each coefficient rounded up (so the size stays an integer
    polynomial and at least ``fraction`` of every row)."""
    upper = sympy.sympify(upper)
    if upper.is_number:
        return sympy.Integer(math.ceil(fraction * int(upper)))
    symbols = sorted(upper.free_symbols, key=str)
    poly = sympy.Poly(upper, *symbols)
    return sum((sympy.Integer(math.ceil(fraction * int(c))) * sympy.Mul(*[s**e for s, e in zip(symbols, m)])
                for m, c in poly.terms()), sympy.Integer(0))


def _per_row(upper, n: int, bound: int):
    """The size observed on the sample (``n`` of ``bound``) at any batch: with ``upper = c·x``,
    ``floor(n / x0)·x + (n mod x0)`` (``x0 = bound / c``: exact on the sample, the sample's
    rate per row elsewhere); a constant bound keeps ``n``; otherwise the sample's fraction."""
    upper = sympy.sympify(upper)
    if upper.is_number or not bound:
        return sympy.Integer(n)
    if len(upper.free_symbols) == 1:
        (x,) = upper.free_symbols
        c = sympy.simplify(upper / x)
        if c.is_Integer and bound % int(c) == 0:
            x0 = bound // int(c)
            return sympy.Integer(n // x0) * x + (n % x0)
    return _scaled(upper, n / bound)


def _symint(expr, like):
    """``expr`` as a size: an int, or a SymInt of the shape environment ``like`` lives in."""
    expr = sympy.sympify(expr)
    if expr.is_number:
        return int(expr)
    node = like.node
    env = node.shape_env
    known = getattr(env, "backed_var_to_val", None) or env.var_to_val
    hint = int(expr.xreplace({s: known[s] for s in expr.free_symbols}))
    return env.create_symintnode(expr, hint=hint)


# -- handlers -------------------------------------------------------------------------------
def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _nonzero(mode: DataDependent, func, args, kwargs):
    (x,) = args
    n = mode.nnz(x)
    return x.new_empty((n, x.dim()), dtype=torch.long)


def _masked_select(mode: DataDependent, func, args, kwargs):
    x, mask = args
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    full = mask.expand(shape) if tuple(mask.shape) != tuple(shape) else mask
    return x.new_empty((mode.nnz(full),))


def long_indices(mode: DataDependent, indices) -> list:
    """Boolean masks among advanced indices replaced by their nonzero columns (what ATen's
    ``expandTensors`` does, aten/src/ATen/native/IndexingUtils.h)."""
    out = []
    for index in indices:
        if _is_mask(index):
            rows = index.new_empty((mode.nnz(index), index.dim()), dtype=torch.long)
            out.extend(rows.select(1, j) for j in range(index.dim()))
        else:
            out.append(index)
    return out


def _index(mode: DataDependent, func, args, kwargs):
    x, indices, *rest = args
    if not any(_is_mask(i) for i in indices):
        return func(*args, **kwargs)
    return func(x, long_indices(mode, indices), *rest, **kwargs)


def _bind(func, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in (``registry.bind``'s rule; that
    module imports this one)."""
    bound = {a.name: a.default_value for a in func._schema.arguments}
    bound.update(zip(bound, args), **kwargs)
    return bound


def _unique(mode: DataDependent, func, args, kwargs):
    """``_unique2`` / ``unique_consecutive`` / ``unique_dim``: ``n`` distinct values (rows of
    ``dim``) of the input's; the inverse has the input's shape, the counts ``n`` entries."""
    x = args[0]
    bound = _bind(func, args, kwargs)
    dim = bound.get("dim")
    if dim is None:
        n = mode.size(_short(func), x.numel())
        values = x.new_empty((n,))
        inverse_shape = x.shape
    else:
        n = mode.size(_short(func), x.shape[dim])
        values = x.new_empty((*x.shape[:dim], n, *x.shape[dim + 1:]))
        inverse_shape = (x.shape[dim],)
    inverse = x.new_empty(inverse_shape if bound.get("return_inverse") else (0,), dtype=torch.long)
    counts = x.new_empty((n,) if bound.get("return_counts") else (0,), dtype=torch.long)
    return values, inverse, counts


def _ctc_loss(mode: DataDependent, func, args, kwargs):
    """``_ctc_loss.Tensor`` (``F.ctc_loss`` with length tensors): ``log_alpha`` is
    ``(batch, time, 2·L + 1)`` with ``L`` the longest target (aten/src/ATen/native/LossCTC.cpp
    ``ctc_loss_cpu_template``; the CUDA kernel alike) -- at most the padded targets' length."""
    log_probs, targets = args[0], args[1]
    upper = targets.shape[1] if targets.dim() == 2 else targets.shape[0]
    longest = mode.size("ctc_max_target_length", upper)
    batch, time = log_probs.shape[1], log_probs.shape[0]
    if log_probs.dim() == 2:  # unbatched
        batch, time = 1, log_probs.shape[0]
    return log_probs.new_empty((batch,)), log_probs.new_empty((batch, time, 2 * longest + 1))


def _scalar(mode: DataDependent, func, args, kwargs):
    if getattr(args[0], "constant", None) is not None:  # a fake tensor that knows its value (torch.tensor(0.))
        return func(*args, **kwargs)
    return mode.value(func, args)


_HANDLERS: dict[Any, Callable] = {
    aten.nonzero.default: _nonzero,
    aten.masked_select.default: _masked_select,
    aten.index.Tensor: _index,
    aten.index_put.default: _index,
    aten.index_put_.default: _index,
    aten._index_put_impl_.default: _index,
    aten._unique2.default: _unique,
    aten.unique_consecutive.default: _unique,
    aten.unique_dim.default: _unique,
    aten._local_scalar_dense.default: _scalar,
    aten._ctc_loss.Tensor: _ctc_loss,
    aten.topk.default: routing.topk,
}

# Ops whose output holds a subset of a one-hot tensor's elements: it keeps the budget of ones.
_KEEPS_BUDGET = {aten.index.Tensor, aten.select.int, aten.slice.Tensor, aten.clone.default,
                 aten._to_copy.default, aten.permute.default, aten.view.default, aten._unsafe_view.default}


def _arange(mode: DataDependent, func, args, kwargs):
    out = func(*args, **kwargs)
    mode._distinct.set(out, True)
    return out


def _equal_to_distinct(mode: DataDependent, func, args, kwargs):
    """``x.unsqueeze(-1) == arange(C)`` (``F.one_hot`` on fake tensors, Onehot.cpp): each element
    of ``x`` equals at most one of the distinct values, so the result has at most ``numel(x)``
    ones -- a budget the ``nonzero`` calls over (parts of) it share."""
    out = func(*args, **kwargs)
    a, b = args
    for x, values in ((a, b), (b, a)):
        if isinstance(values, torch.Tensor) and values.dim() == 1 and mode._distinct.get(values) \
                and isinstance(x, torch.Tensor) and x.dim() >= 1 and as_expr(x.shape[-1]) == 1:
            mode._budget.set(out, [sympy.sympify(as_expr(x.numel()))])
            break
    return out


def _scatter_ones(mode: DataDependent, func, args, kwargs):
    """``zeros(...).scatter_(dim, index, 1)`` (``F.one_hot`` on real tensors): at most
    ``numel(index)`` ones."""
    out = func(*args, **kwargs)
    value = args[3] if len(args) > 3 else kwargs.get("value")
    if value == 1:
        mode._budget.set(out, [sympy.sympify(as_expr(args[2].numel()))])
    return out


_HANDLERS[aten.arange.default] = _arange
_HANDLERS[aten.arange.start] = _arange
_HANDLERS[aten.arange.start_step] = _arange
_HANDLERS[aten.eq.Tensor] = _equal_to_distinct
_HANDLERS[aten.scatter_.value] = _scatter_ones


# -- the probe: a real forward on the user's sample ------------------------------------------
class Probe(TorchDispatchMode):
    """Records, on real tensors, the sizes of the calls ``DataDependent`` answers and the values
    of ``.item()`` and ``.numpy()`` (``host``), by the same sites."""

    def __init__(self, module_names: Mapping[int, str], inputs: bool = False):
        super().__init__()
        self.sizes: dict[str, tuple[int, int]] = {}
        self.values: dict[str, Any] = {}
        self.inputs: dict[str, torch.Tensor] = {}  # with ``inputs``: the modules' integer tensor arguments
        self._sites = _Sites(module_names, self._record_inputs if inputs else None)
        self._seen = _PerStorage()  # masks already counted

    def _record_inputs(self, call: str, args: tuple) -> None:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and not a.is_floating_point() and not a.is_complex() \
                    and a.dtype is not torch.bool and a.numel() <= LIMIT:
                self.inputs[f"{call}:{i}"] = a.detach().clone()

    def __enter__(self):
        _PROBES.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _PROBES.remove(self)
        return super().__exit__(*exc)

    def host(self, array) -> None:
        """A real tensor's ``.numpy()``: its values, by the site the capture reads them at."""
        self.values[self._sites.key(f"numpy@{_user_line()}")] = array.copy()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        watchdog.beat(func)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            self.values[self._sites.key(f"{_short(func)}@{_user_line()}")] = out
        elif func is aten.nonzero.default:
            self._mask(args[0], int(out.shape[0]))
        elif func is aten.masked_select.default:
            shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
            self._mask(args[1].expand(shape), int(out.shape[0]))
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                      aten._index_put_impl_.default):
            for index in args[1]:
                if _is_mask(index):
                    self._mask(index, int(index.count_nonzero()))
        elif func in (aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default):
            dim = _bind(func, args, kwargs).get("dim")  # unique_consecutive's is its 4th argument
            upper = args[0].numel() if dim is None else args[0].shape[dim]
            self.sizes[self._sites.key(_short(func))] = (int(out[0].shape[0 if dim is None else dim]), int(upper))
        elif func is aten._ctc_loss.Tensor:
            targets = args[1]
            upper = targets.shape[1] if targets.dim() == 2 else targets.shape[0]
            self.sizes[self._sites.key("ctc_max_target_length")] = (int(args[3].max()), int(upper))
        elif func in OBSERVERS:
            self.sizes[self._sites.key(_short(func))] = OBSERVERS[func](args, kwargs, out)
        return out

    def _mask(self, mask: torch.Tensor, n: int) -> None:
        key = _mask_key(mask)
        if not self._seen.get(mask, key):  # one size per mask, as in the capture
            self._seen.set(mask, True, key)
            self.sizes[self._sites.key("nonzero")] = (n, int(mask.numel()))


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _from_a_library(hook) -> bool:
    """Whether ``hook`` is a library's (installed in site-packages: transformers' output capturing,
    accelerate's device alignment), part of what the model computes, not the user's own."""
    fn = getattr(hook, "func", hook)  # functools.partial
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path


@contextlib.contextmanager
def _user_hooks_off(model: nn.Module):
    """The user's forward hooks on ``model``'s modules taken out (they would be handed the real
    tensors the user's code keeps), a library's left in (transformers 5 collects ``hidden_states``
    through hooks); and on exit every module as it was: its hooks, and no attribute the probe's
    run added (transformers marks a model whose capturing hooks it installed)."""
    modules = list(model.modules())
    saved = [(set(m.__dict__), {name: dict(getattr(m, name)) for name in _MODULE_HOOKS if hasattr(m, name)})
             for m in modules]
    for m, (_, hooks) in zip(modules, saved):
        for name, table in hooks.items():
            for key, hook in table.items():
                if not _from_a_library(hook):
                    getattr(m, name).pop(key, None)
    try:
        yield
    finally:
        for m, (attributes, hooks) in zip(modules, saved):
            for attribute in set(m.__dict__) - attributes:
                del m.__dict__[attribute]
            for name, table in hooks.items():
                getattr(m, name).clear()
                getattr(m, name).update(table)


def meta_weights(what: str) -> InputError:
    """data_dependent='sample' needing a real forward of weights on the meta device."""
    return InputError(f"data_dependent='sample' observes {what} on the sample with the model's weights, but they "
                      "are on the meta device: use 'max' (the safe bound), a fraction, or numbers per site "
                      "(report(..., data_dependent={'site': n}))")


def refuse_meta(model: nn.Module) -> None:
    """``meta_weights`` where ``model`` has tensors on the meta device: no real run of it."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise meta_weights("the sizes")


def probe(model: nn.Module, sample, forward: Callable[[], Any], grad: bool = False, inputs: bool = False) -> Probe:
    """Run ``forward()`` (the model's forward and loss on the real sample, no grad unless ``grad``: a
    user's whole step) recording the data-dependent sizes and values; the model's buffers, hooks
    and the RNG come back as they were, and the user's own forward hooks do not run (they would
    see real tensors the user's code keeps: a hook that changes a module's output changes what the
    probe sees, a limitation); a library's hooks do (``_user_hooks_off``).  ``inputs``: also keep
    the integer tensors handed to each module call (``Probe.inputs``)."""
    refuse_meta(model)
    names = {id(m): name for name, m in model.named_modules()}
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    recorder = Probe(names, inputs)
    try:
        with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(grad), _user_hooks_off(model), \
                recorder._sites.hooks(), recorder:
            forward()
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])
    return recorder
