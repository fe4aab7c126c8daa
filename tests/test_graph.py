"""The per-op helpers of the capture give what torch's pytree gives on aten's arguments and outputs
(they are written out because they run for every op)."""

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

from estimator.capture.graph import GraphRecorder, map_exprs
from estimator.capture.tracker import _leaves
from estimator.vocab.symbolic import as_expr


def test_graph_arguments_as_tree_map_gives_them():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DUCK, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(5, 3), symbolic_context=context)
    recorder = GraphRecorder()
    cases = [
        (x, 1, [x, x], (x.shape, x.shape[0] * 2), None, torch.float32, 0.5),
        ([(1, 2), [3, (x,)]], {"dim": [0, 1]}),
        (torch.Size([4, 2]),),
        (),
    ]

    def reference(v):
        if isinstance(v, torch.Tensor):
            return recorder._node(v)
        return as_expr(v) if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) else v

    for args in cases:
        mine, theirs = recorder._arg(args), tree_map(reference, args)
        assert mine == theirs and repr(mine) == repr(theirs)
    assert recorder._arg({"alpha": x.shape[0], "out": [x]}) == tree_map(reference, {"alpha": x.shape[0], "out": [x]})


def test_op_outputs_as_tree_flatten_lists_them():
    t, u = torch.empty(2), torch.empty(3)
    for out in (t, None, 3, (), (t, u), [t, u], (t, [u, t], None), ([t], [u, None]), torch.return_types.max((t, u))):
        assert _leaves(out) == tree_flatten(out)[0]  # list equality compares the tensors by identity first


def test_node_arguments_mapped_in_b_as_tree_map_only_gives_them():
    s0, b = sympy.Symbol("s0"), sympy.Symbol("b")
    in_b = lambda e: e.xreplace({s0: b})  # noqa: E731
    args = ([s0 * 768, 768], (1, s0), {"size": [2 * s0, 3]})
    assert repr(map_exprs(args, in_b)) == repr(tree_map_only(sympy.Basic, in_b, args))
    unchanged = ([768, 3], (1, None), {"dim": [0]})
    assert map_exprs(unchanged, in_b) is unchanged  # nothing symbolic: the node keeps its arguments
