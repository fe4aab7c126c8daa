"""Captures kept for the process: a report of a step already captured reuses its formulas.

The capture is most of a report's cost, and it is a function of what it runs: the model object
in its present state, the sample's layout, the step (``Checked.capture_spec``), the optimizer,
the torch settings kernels follow and the ops declared to fxmem (``register_op``).  ``key``
makes that one hashable value; ``report``, ``compare`` and ``plan`` keep the last formulas by
it (``keep``) and reuse one (``find``):
- at the same hint (the batch of one micro-batch the capture ran at);
- at another hint inside a symbolic formula's range (``valid_from`` .. ``valid_to``: the guards
  the capture recorded hold there, so a capture there traces the same program, as Dynamo reuses
  a graph whose guards pass), unless the step is compiled (its own program is captured at the
  hint, ``Formula.own``);
- a capture that read values (``Formula.reads_values``: a data-dependent size or branch the
  sample's values or a real run on it gave; every concrete-path capture, to be safe) only for
  the same tensors at the same versions (``Key.values``: ``Tensor._version`` counts in-place
  writes), sample and weights.

What the key holds of the model: every module's class, train/eval flag and attributes (numbers,
strings, containers of them; hooks, functions and other objects by identity, with what their
``__dict__`` holds two levels down; a transformers config by its ``to_dict()``); every parameter
and buffer by identity, type, shape, strides, dtype, device and ``requires_grad``.  Of the
sample: its tree, and each tensor's type, shape (the batch dim left out), strides, dtype and
device.  Objects named by identity are held weakly where they can be: a key whose object died is
dropped (its ``id`` may be another object's now).  ``forget_captures()`` (exported as
``estimator.forget_captures``) drops every kept capture, for a change no key can see (an object
the forward reads that no module attribute reaches, a global the user's code reads).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from estimator.corrections import custom_ops
from estimator.orchestrate.checked import Checked
from estimator.orchestrate.path import Formula, hint_of
from estimator.reporting.result import CapturePath

KEPT = 16  # keys kept (least recently used dropped first; a plan's distinct steps fit): each holds its timeline
_SIMPLE = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
_DEPTH = 3  # how deep an object's attributes count (module -> object -> object)
_ITEMS = 256  # a container longer than this counts by identity and length
_MODULE_PARTS = frozenset({"_parameters", "_buffers", "_modules"})  # walked as such


@dataclasses.dataclass(frozen=True, eq=False)
class Key:
    """What a capture is a function of (``value``), the values it may read besides (``values``:
    which sample and model tensors, at which version) and the objects both name by identity
    (``refs``: weak where they can be, so a key whose object died is seen as such)."""

    value: tuple
    values: tuple
    refs: tuple
    value_refs: tuple = ()  # the tensors of ``values``, weakly

    def alive(self) -> bool:
        return _alive(self.refs)

    def same_values(self, other: Key) -> bool:
        """Whether ``other`` reads the same tensors at the same versions (still alive: an id
        is the tensor's only while it lives)."""
        return self.values == other.values and _alive(self.value_refs)


def _alive(refs: tuple) -> bool:
    return all(r() is not None if isinstance(r, weakref.ref) else True for r in refs)


class _Walk:
    """The hashable value of a model, sample and step, and the objects it names by identity."""

    def __init__(self) -> None:
        self.refs: dict[int, Any] = {}
        self.values: list[tuple] = []  # (id, version) of each sample and model tensor
        self.value_refs: list[weakref.ref] = []
        self._configs: dict[int, str] = {}

    def identity(self, obj: Any) -> tuple:
        if id(obj) not in self.refs:
            try:
                self.refs[id(obj)] = weakref.ref(obj)
            except TypeError:  # not weakly referable: held (a bound method, a partial ...)
                self.refs[id(obj)] = obj
        return type(obj).__qualname__, id(obj)

    def tensor(self, t: torch.Tensor) -> tuple:
        """What a capture reads of ``t`` but its values (those go to ``values``)."""
        if nn.parameter.is_lazy(t):
            return self.identity(t)
        self.values.append((id(t), t._version))
        self.value_refs.append(weakref.ref(t))
        return (type(t).__qualname__, tuple(t.shape), t.stride() if t.layout is torch.strided else None, t.dtype,
                t.device, t.requires_grad, t.layout)

    def value(self, v: Any, depth: int = 0) -> Any:
        if isinstance(v, _SIMPLE):
            return v
        if isinstance(v, torch.Tensor):
            return (*self.tensor(v), *self.identity(v))
        if dataclasses.is_dataclass(v) and not isinstance(v, type):  # a value (the step, its policy ...)
            return type(v).__qualname__, tuple((f.name, self.value(getattr(v, f.name), depth))
                                               for f in dataclasses.fields(v))
        if isinstance(v, nn.Module):
            return self.identity(v)  # a module held, not a submodule: its own walk, if any, is its owner's
        if isinstance(v, (list, tuple, set, frozenset, dict)):
            if len(v) > _ITEMS or depth >= _DEPTH:
                return (*self.identity(v), len(v))
            if isinstance(v, dict):
                return type(v).__qualname__, tuple((self.value(k, depth + 1), self.value(x, depth + 1))
                                                   for k, x in v.items())
            items = tuple(self.value(x, depth + 1) for x in v)
            return type(v).__qualname__, tuple(sorted(items, key=repr)) if isinstance(v, (set, frozenset)) else items
        if callable(getattr(v, "to_dict", None)) and hasattr(v, "to_json_string"):  # a transformers config
            if id(v) not in self._configs:
                self.identity(v)
                self._configs[id(v)] = json.dumps(v.to_dict(), sort_keys=True, default=repr)
            return type(v).__qualname__, self._configs[id(v)]
        attrs = getattr(v, "__dict__", None)
        if attrs is None or depth >= _DEPTH or callable(v):
            return self.identity(v)
        return (*self.identity(v), self.value(attrs, depth + 1))

    def model(self, model: nn.Module) -> tuple:
        modules = tuple(
            (name, type(m), m.training,
             tuple((k, self.value(v)) for k, v in vars(m).items() if k not in _MODULE_PARTS and k != "training"))
            for name, m in model.named_modules(remove_duplicate=False))
        tensors = tuple((name, *self.tensor(t), *self.identity(t))
                        for name, t in (*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)))
        hooks = tuple(self.value(getattr(nn.modules.module, name)) for name in sorted(vars(nn.modules.module))
                      if name.startswith("_global_") and name.endswith("hooks"))
        return modules, tensors, hooks

    def sample(self, sample: Any, batch_dims: tuple | None) -> tuple:
        leaves, spec = tree_flatten(sample)
        dims = batch_dims or (0,) * len(leaves)
        out = []
        for leaf, d in zip(leaves, dims):
            if isinstance(leaf, torch.Tensor):
                kind, shape, *rest = self.tensor(leaf)
                out.append((kind, tuple(None if i == d else n for i, n in enumerate(shape)), *rest))
            else:
                out.append(self.value(leaf))
        return str(spec), tuple(out)


def _settings() -> tuple:
    """The process-wide torch settings kernels and the capture follow."""
    cuda = torch.backends.cuda
    return (torch.get_default_dtype(), torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
            cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled(), cuda.matmul.allow_tf32, torch.backends.cudnn.enabled,
            torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32)


def key(checked: Checked) -> Key | None:
    """The key of ``checked``'s capture; None where a part of it cannot be read or hashed (then
    nothing is kept: the capture runs, and names what is wrong with the request if anything is)."""
    walk = _Walk()
    spec = checked.capture_spec
    try:
        leaves = tree_flatten(checked.sample)[0]
        seq_dims = tuple((i, checked.seq_dims[id(leaf)]) for i, leaf in enumerate(leaves)
                         if checked.seq_dims and id(leaf) in checked.seq_dims)
        value = (walk.value(dataclasses.replace(spec, optimizer=None)), walk.value(checked.request.optimizer),
                 seq_dims, checked.seq, _settings(), walk.value(custom_ops.declarations()),
                 walk.identity(checked.model), walk.model(checked.model), walk.sample(checked.sample, spec.batch_dims))
        hash(value)
    except Exception:  # noqa: BLE001 - a lazy module, an object whose attributes cannot be read ...
        return None
    return Key(value, tuple(walk.values), tuple(walk.refs.values()), tuple(walk.value_refs))


# key.value -> (the key, {hint: (formula, the key it was captured with)}), least recently used first
_kept: collections.OrderedDict[tuple, tuple[Key, dict[int, tuple[Formula, Key]]]] = collections.OrderedDict()


def _holds(formula: Formula, hint: int, compiled: bool) -> bool:
    """Whether ``formula``, captured at another hint, is the capture at ``hint``."""
    return (formula.path is CapturePath.SYMBOLIC and not compiled and formula.valid_from <= hint
            and (formula.valid_to is None or hint <= formula.valid_to))


def lookup(checked: Checked) -> tuple[Key | None, int, Formula | None]:
    """``checked``'s key, the batch its capture runs at (``path.hint_of``) and the kept formula
    that holds there (None: capture it, then ``keep`` it)."""
    k = key(checked)
    hint = hint_of(checked.batch, checked.microbatches, checked.seq)
    return k, hint, find(k, hint, checked.spec.compiled is not None)


def find(k: Key | None, hint: int, compiled: bool) -> Formula | None:
    """A kept formula for key ``k`` at ``hint``, if one holds there."""
    if k is None or k.value not in _kept:
        return None
    kept, formulas = _kept[k.value]
    if not kept.alive():
        del _kept[k.value]
        return None
    _kept.move_to_end(k.value)
    candidates = [formulas[hint]] if hint in formulas else [
        (f, made) for f, made in formulas.values() if _holds(f, hint, compiled)]
    return next((f for f, made in candidates if not f.reads_values or made.same_values(k)), None)


def keep(k: Key | None, hint: int, formula: Formula) -> None:
    """Keep ``formula``, captured at ``hint``, for key ``k``."""
    if k is None:
        return
    _kept.setdefault(k.value, (k, {}))[1][hint] = (formula, k)
    _kept.move_to_end(k.value)
    while len(_kept) > KEPT:
        _kept.popitem(last=False)


def forget_captures() -> None:
    """Drop every kept capture (the next report of each step captures it again)."""
    _kept.clear()
