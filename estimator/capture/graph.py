"""Record the aten ops a step dispatches as a ``torch.fx.Graph``.

Every op becomes a ``call_function`` node whose target is the aten overload; tensor arguments
point at the node that produced them (tensors the step did not produce — parameters,
buffers, inputs, optimizer state — are placeholders named after what they are); multi-output
ops get ``getitem`` nodes; sizes that are symbolic appear as their sympy expressions.  Each
node's ``meta["tensor_meta"]`` holds its output's shape, dtype and stride (no values: the
graph must not keep storages alive, or frees would not be seen; symbolic sizes as sympy).

This is the eager program exactly as it ran — the same ops ``make_fx`` would record — at a
fraction of ``make_fx``'s cost, and without its hold (``node.meta["val"]``) on every output.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import sympy
import torch
from torch import fx
from torch.fx.passes.shape_prop import TensorMetadata
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakTensorKeyDictionary

from estimator.vocab.symbolic import as_expr


def _metadata(t: torch.Tensor) -> TensorMetadata:
    # Not shape_prop's extractor: its contiguity queries would add shape guards.  Symbolic sizes
    # and strides as sympy expressions, as in the arguments: no hold on the capture's ShapeEnv,
    # and the graph pickles (``compare``'s worker processes send it back).
    return TensorMetadata(tuple(as_expr(x) for x in t.shape), t.dtype, t.requires_grad,
                          tuple(as_expr(x) for x in t.stride()), None, False, {})


def map_metadata(meta: Any, fn) -> Any:
    """A node's ``meta["tensor_meta"]`` (one ``TensorMetadata``, or a tuple/list of them and
    others for a multi-output op) with ``fn`` applied to its sympy sizes and strides."""
    if isinstance(meta, TensorMetadata):
        return meta._replace(shape=map_exprs(meta.shape, fn), stride=map_exprs(meta.stride, fn))
    if isinstance(meta, (list, tuple)):
        return type(meta)(map_metadata(m, fn) for m in meta)
    return meta


class GraphRecorder:
    """Builds the graph op by op; ``names`` maps ``id(tensor)`` to a placeholder name."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self._nodes = WeakTensorKeyDictionary()
        self._names: dict[int, str] = {}

    def name(self, t: torch.Tensor, name: str) -> None:
        self._names[id(t)] = re.sub(r"\W", "_", name)

    def _node(self, t: torch.Tensor) -> fx.Node:
        node = self._nodes.get(t)
        if node is None:
            node = self.graph.placeholder(self._names.get(id(t), "external"))
            node.meta["tensor_meta"] = _metadata(t)
            self._nodes[t] = node
        return node

    def _arg(self, x: Any) -> Any:
        """``x`` with tensors as their nodes and symbolic sizes as sympy expressions (what
        ``tree_map`` would give over an aten op's arguments: tensors, numbers and lists or tuples
        of them, a ``torch.Size`` as a tuple; written out, as it runs for every op)."""
        if isinstance(x, torch.Tensor):
            return self._node(x)
        if isinstance(x, (list, tuple)):
            items = [self._arg(y) for y in x]
            return items if isinstance(x, list) else tuple(items)
        if isinstance(x, dict):
            return {k: self._arg(v) for k, v in x.items()}
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return as_expr(x)
        return x

    def record(self, func, args, kwargs, out) -> fx.Node:
        node = self.graph.call_function(func, self._arg(tuple(args)), self._arg(dict(kwargs)))
        if isinstance(out, torch.Tensor):
            self._nodes[out] = node
            node.meta["tensor_meta"] = _metadata(out)
        elif isinstance(out, (tuple, list)):
            node.meta["tensor_meta"] = tree_map_only(torch.Tensor, _metadata, out)
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    item.meta["tensor_meta"] = _metadata(t)
                    self._nodes[t] = item
        return node

    def finish(self, outputs: list[torch.Tensor]) -> fx.Graph:
        self.graph.output([self._node(t) for t in outputs])
        return self.graph


def map_exprs(x: Any, fn) -> Any:
    """A node's ``args`` or ``kwargs`` with ``fn`` applied to their sympy expressions (what
    ``tree_map_only(sympy.Basic, fn, x)`` gives; ``x`` itself, unchanged, when it holds none)."""
    if isinstance(x, sympy.Basic):
        return fn(x)
    if isinstance(x, (list, tuple)):
        items = [map_exprs(y, fn) for y in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return items if isinstance(x, list) else tuple(items)
    if isinstance(x, dict):
        items = {k: map_exprs(v, fn) for k, v in x.items()}
        return x if all(items[k] is v for k, v in x.items()) else items
    return x
