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
``_LIMIT`` elements (the real compute and memory stay small: masks and ids, not activations).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

_LIMIT = 1 << 20  # elements of one shadow


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

    def seed(self, fake: torch.Tensor, real: torch.Tensor, dim: int = 0) -> None:
        """``real`` (a sample tensor) as the shadow of its fake copy ``fake``: rows repeated along
        ``dim`` to the fake's hint where they differ."""
        shape = _hint_shape(fake)
        if real.shape != shape and real.dim() == len(shape) and real.dim() > dim and real.shape[dim] > 0:
            rows = torch.arange(shape[dim]) % real.shape[dim]
            real = real.index_select(dim, rows)
        if tuple(real.shape) == shape and real.numel() <= _LIMIT:
            self._real[fake] = real.detach()
            self._seeded = True

    def follow(self, func, args, kwargs, out) -> None:
        """After ``func`` ran on fake tensors: run it on the shadows where every tensor argument
        has one, and shadow its outputs; else mark what it wrote as stale.  A higher-order
        operator (a compiled region's ``run_and_save_rng_state``) is not followed: it writes
        nothing it is handed."""
        if not isinstance(func, torch._ops.OpOverload):
            return
        tensors = _tensors(args, kwargs)
        followed = (not tensors or all(self.get(t) is not None for t in tensors)) and self._followable(func, out)
        if followed:
            followed = self._run(func, args, kwargs, out)
        if not followed and func._schema.is_mutable:
            for argument, value in zip(func._schema.arguments, args):
                if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor):
                    self._stale.add(value.untyped_storage()._cdata)

    @staticmethod
    def _followable(func, out) -> bool:
        if torch.Tag.nondeterministic_seeded in func.tags:
            return False
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        return bool(outs) and all(isinstance(n, int) and n <= _LIMIT for n in (hint(t.numel()) for t in outs))

    def _run(self, func, args, kwargs, out) -> bool:
        def real(x):
            return self.get(x) if isinstance(x, torch.Tensor) else hint(x)

        real_args, real_kwargs = tree_map(real, (args, kwargs))
        try:
            with _disable_current_modes(), torch.no_grad():
                result = func(*real_args, **real_kwargs)
        except Exception:  # the shadows cannot follow this op: its outputs have none
            return False
        fakes, reals = tree_flatten(out)[0], tree_flatten(result)[0]
        if len(fakes) != len(reals):
            return False
        for fake, value in zip(fakes, reals):
            if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor) \
                    and tuple(value.shape) == _hint_shape(fake):
                self._real[fake] = value
                self._stale.discard(fake.untyped_storage()._cdata)
        return True
