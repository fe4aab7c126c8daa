"""The autograd engine's gradient sums, in place where the real engine sums in place.

When two nodes send a gradient to the same input of a node (a tensor used twice, a weight used
at every step of a loop), the engine sums them in that node's input buffer:
``torch/csrc/autograd/input_buffer.cpp`` ``accumulate()`` runs ``old.add_(new)`` when grad mode
is off and ``can_accumulate_inplace(old)``: a plain (not subclass-like), non-overlapping and
dense tensor whose last reference and whose storage's last reference the buffer holds (not a
view: a view's base holds the storage too); else ``old + new``.  FakeTensors are subclass-like,
so the capture always sees ``old + new``: one gradient-sized allocation too many at every sum
(a pure-torch selective scan sums one per time step: Mamba +5 … +8 %).

``GradSums`` puts the real engine's choice back.  Every ``aten.add.Tensor`` the engine may have
run (inside ``backward()``/``grad()``, grad mode off, two operands of the output's shape and
dtype) is a candidate.  A pre-hook on each node whose input receives several gradients (the
graph is walked when the backward starts, as the engine's ``compute_dependencies`` counts
edges) sees the summed gradient the node gets and follows its chain of sums back: a sum whose
``old`` storage died at that very op had no holder but the buffer, so the real engine ran
``old.add_(new)``: the output is ``old``'s storage, nothing is allocated and ``old`` is not
freed.  A candidate that is not a buffer's sum never reaches a node's input and is left as it
ran.  Only contiguous ``old`` operands qualify (checked on the sizes' expressions, no shape
guard): another dense layout is kept out of place, an over-estimate by one gradient, never under.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.autograd.graph import GradientEdge
from torch.autograd.variable import Variable

from estimator.corrections.registry import is_contiguous

_ADD = torch.ops.aten.add.Tensor


class GradSums:
    """The candidate sums of one ``Tracker`` and the rewrite of those the engine runs in place."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.running = 0  # backward()/grad() calls under way
        self._sums: dict[int, tuple[int, int]] = {}  # key of a sum's output -> (op index, key of its old)

    def saw(self, func, args, kwargs, out, index: int, new: dict[int, int]) -> None:
        """Called by the tracker for every op: note ``old + new`` as the engine runs it."""
        if func is not _ADD or not self.running or kwargs or torch.is_grad_enabled() or id(out) not in new:
            return
        old, var = args
        if not (isinstance(old, torch.Tensor) and isinstance(var, torch.Tensor)):
            return
        # A view keeps its base's storage alive (use_count 2); a gradient sent to the same input
        # twice (``h + h``: AddBackward0 returns one tensor for both) is held by the node's outputs.
        if old._is_view() or old.untyped_storage()._cdata == var.untyped_storage()._cdata \
                or old.shape != out.shape or var.shape != out.shape or old.dtype != out.dtype or not is_contiguous(old):
            return
        key = self.tracker.key_of(old)
        if key is not None:
            self._sums[new[id(out)]] = (index, key)

    @contextlib.contextmanager
    def engine(self):
        """Pre-hooks on the nodes whose inputs take several gradients, for every backward run
        while this is entered: the autograd engine's ``run_backward`` (which ``backward()``,
        ``grad()`` and the substitution mode's backward all call, torch/autograd/graph.py
        ``_engine_run_backward``) is wrapped."""
        engine = Variable._execution_engine
        Variable._execution_engine = _Counted(engine, self)
        try:
            yield
        finally:
            Variable._execution_engine = engine

    def _hook(self, outputs) -> list:
        """Walk the graph from ``outputs``; a pre-hook on each node one of whose inputs several
        edges feed."""
        roots = [o.node if isinstance(o, GradientEdge) else o.grad_fn for o in outputs]
        seen = {root for root in roots if root is not None}
        queue = collections.deque(seen)
        feeds: collections.Counter = collections.Counter()  # (node, input) -> edges into it
        while queue:
            node = queue.popleft()
            for fn, nr in node.next_functions:
                if fn is None:
                    continue
                feeds[fn, nr] += 1
                if fn not in seen:
                    seen.add(fn)
                    queue.append(fn)
        shared: dict = collections.defaultdict(list)
        for (fn, nr), count in feeds.items():
            if count > 1:
                shared[fn].append((nr, count - 1))
        return [fn.register_prehook(self._prehook(slots)) for fn, slots in shared.items()]

    def _prehook(self, slots: list[tuple[int, int]]):
        def prehook(grads):
            self.tracker.flush()  # the frees of the last sum, before the node runs
            for nr, sums in slots:
                grad = grads[nr] if nr < len(grads) else None
                if isinstance(grad, torch.Tensor):
                    self._in_place(self.tracker.key_of(grad), sums)

        return prehook

    def _in_place(self, key: int | None, sums: int) -> None:
        """Rewrite the chain of at most ``sums`` sums that made the gradient stored as ``key``,
        latest first, for each sum whose ``old`` died at it."""
        while key in self._sums and sums > 0:
            index, old = self._sums.pop(key)
            sums -= 1
            event = self.tracker.ops[index]
            if old in event.frees and key in event.allocs:
                event.frees.remove(old)
                event.allocs.remove(key)
                self.tracker.rename(key, old, index)
            key = old


class _Counted:
    """The autograd engine, its ``run_backward`` with ``GradSums``' pre-hooks around it."""

    def __init__(self, engine, sums: GradSums):
        self._engine, self._sums = engine, sums

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def run_backward(self, outputs, *args, **kwargs):
        handles = self._sums._hook(outputs)
        self._sums.running += 1
        try:
            return self._engine.run_backward(outputs, *args, **kwargs)
        finally:
            self._sums.running -= 1
            for handle in handles:
                handle.remove()
