"""The batch symbol of a symbolic capture, and the range of batch sizes where the capture holds.

Before the step runs, ``batch_symbols`` reads which symbols of the fake sample are the batch size
and which the sequence length (the model's code may then fix one to a constant, which must be
detected).  After it, ``to_batch_symbol`` maps them to ``b`` and ``s`` (the micro-batch ``b / k``
with gradient accumulation), makes every byte count a polynomial (a correction's estimate bounded
from above, a micro-batch's count rounded up) and reads the range of ``b`` and ``s`` from the
shape environment's guards (``symbol_range``, ``narrow``); ``hint`` is a symbolic size at the
symbol's hint, without adding a guard.
"""

from __future__ import annotations

import dataclasses
import functools

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_flatten

from estimator.capture.fake import SIZE_MAX
from estimator.capture.graph import map_exprs, map_metadata
from estimator.capture.records import RawCapture
from estimator.capture.tracker import Storage, Tracker, as_expr
from estimator.vocab.data_dependent import Site
from estimator.vocab.errors import SequenceNotSymbolic, SymbolicCaptureFailed
from estimator.vocab.symbolic import B, NotPolynomial, Poly, S


def with_bytes(storage: Storage, nbytes: Poly) -> Storage:
    return dataclasses.replace(storage, nbytes=nbytes, extra=0)  # extra folded into nbytes


def batch_symbols(fsample, batch_dims: tuple[int, ...] | None = None) -> tuple[set[sympy.Symbol], set[sympy.Symbol]]:
    """The symbols of the batch size and of the sequence length, read before the step runs
    (the model's code may specialize them to a constant, which must then be detected).  The
    batch dim (``batch_dims`` per leaf, default 0) is the batch; any other symbolic dim is the
    sequence length.  A fake input's storage size can carry a symbol of its own besides its
    shape's: it belongs to the batch."""
    batch, seq = set(), set()
    leaves = tree_flatten(fsample)[0]
    for t, d in zip(leaves, batch_dims or (0,) * len(leaves)):
        if isinstance(t, torch.Tensor) and d is not None:
            batch |= _free(t.shape[d])
            for i, size in enumerate(t.shape):
                if i != d:
                    seq |= _free(size)
    for t in tree_flatten(fsample)[0]:
        if isinstance(t, torch.Tensor):
            batch |= _free(t.untyped_storage().nbytes()) - seq
    return batch, seq


def _free(value) -> set[sympy.Symbol]:
    return set(sympy.sympify(as_expr(value)).free_symbols)


def symbol_range(shape_env: ShapeEnv, symbols, what: str, error: type) -> tuple[int, int | None]:
    """The range the guards leave to ``symbols`` (which must stay free symbols)."""
    lo, hi = 2, None
    for symbol in symbols:
        resolved = shape_env.replace(symbol)
        if not isinstance(resolved, sympy.Symbol):
            raise error(f"the model's code fixes the {what} (to {resolved})")
        value_range = shape_env.var_to_range[resolved]
        if value_range.lower == value_range.upper:
            raise error(f"the model's code fixes the {what} (to {value_range.lower})")
        lo = max(lo, int(value_range.lower))
        if value_range.upper.is_Integer and value_range.upper < SIZE_MAX:  # else unbounded
            hi = int(value_range.upper) if hi is None else min(hi, int(value_range.upper))
    return lo, hi


def narrow(lo: int, hi: int | None, guards, symbol: sympy.Symbol) -> tuple[int, int | None]:
    """Narrow ``[lo, hi]`` by the guards on ``symbol`` alone that the shape environment did not
    turn into a range (``10*b <= 3072``: a kernel's path choice)."""
    for guard in guards:
        if guard.free_symbols != {symbol} or not isinstance(guard, sympy.core.relational.Relational):
            continue
        try:
            interval = sympy.solve_univariate_inequality(guard, symbol, relational=False)
        except (NotImplementedError, ValueError, TypeError):
            continue
        if not isinstance(interval, sympy.Interval):
            continue  # a union or something stranger: leave the range alone
        if interval.start.is_finite:
            start = int(sympy.ceiling(interval.start))
            lo = max(lo, start + 1 if interval.left_open and start == interval.start else start)
        if interval.end.is_finite:
            end = int(sympy.floor(interval.end))
            end = end - 1 if interval.right_open and end == interval.end else end
            hi = end if hi is None else min(hi, end)
    return lo, hi


def _upper_bound(expr: sympy.Expr) -> sympy.Expr:
    """A polynomial upper bound of a kernel estimate with ``floor``/``ceiling`` in it (for
    b, s >= 0): ``floor(x) <= x``, ``ceiling(x) <= x + 1`` (also torch's ``FloorDiv`` /
    ``CeilToInt`` of SymInt arithmetic); coefficients rounded up later."""
    from torch.utils._sympy.functions import CeilToInt, FloorDiv, FloorToInt

    expr = expr.replace(FloorDiv, lambda a, d: a / d)
    expr = expr.replace(FloorToInt, lambda x: x).replace(CeilToInt, lambda x: x + 1)
    return expr.replace(sympy.floor, lambda x: x).replace(sympy.ceiling, lambda x: x + 1)


def _ceil_coefficients(expr: sympy.Expr) -> sympy.Expr:
    poly = sympy.Poly(sympy.expand(expr), B, S)
    return sum((sympy.ceiling(c) * B**i * S**j for (i, j), c in poly.terms()), sympy.Integer(0))


def to_batch_symbol(tracker: Tracker, graph, shape_env: ShapeEnv, symbols, k: int = 1,
                     sites: tuple[Site, ...] = (), marks: tuple[int, ...] = ()) -> RawCapture:
    """Map the batch symbols to ``b`` (and the sequence symbols to ``s``) and read the valid
    ranges from the guards.  With ``k`` micro-batches the batch symbol is the micro-batch
    ``m = b / k``.  ``marks``: the number of guards at the start of each call of the model
    (``mode="generate"``): ``RawCapture.call_guards`` has the guards each call added."""
    batch, seq = symbols
    lo, hi = symbol_range(shape_env, batch, "batch size", SymbolicCaptureFailed)
    lo, hi = k * lo, None if hi is None else k * hi
    seq_lo, seq_hi = symbol_range(shape_env, seq, "sequence length", SequenceNotSymbolic)
    micro = B / k if k > 1 else B
    rounded: list[str] = []  # micro-batch byte counts whose coefficients were rounded up
    to_b = {shape_env.replace(s): micro for s in batch} | {s: micro for s in batch}
    to_b |= {shape_env.replace(s): S for s in seq} | {s: S for s in seq}
    mapped = [(i, g.expr.xreplace(to_b)) for i, g in enumerate(shape_env.guards) if g.expr.free_symbols & set(to_b)]
    exprs = [e for _, e in mapped]
    ends = (*marks[1:], len(shape_env.guards))
    call_guards = tuple(tuple(e for i, e in mapped if start <= i < end) for start, end in zip(marks, ends))
    lo, hi = narrow(lo, hi, exprs, B)
    seq_lo, seq_hi = narrow(seq_lo, seq_hi, exprs, S)
    guards = tuple(dict.fromkeys(str(e) for e in exprs))

    @functools.lru_cache(maxsize=None)  # storages share a few sizes: each is mapped once
    def to_poly(value, bound: bool = False) -> Poly:
        if isinstance(value, int):
            return Poly.const(value)
        expr = shape_env.replace(sympy.sympify(value)).xreplace(to_b)
        try:
            return Poly.of(expr)
        except NotPolynomial as exc:
            if k > 1 and _integer_in_micro(expr, k):  # bytes per row not a multiple of k: round up
                rounded.append(str(sympy.expand(expr.xreplace({B: k * B}))))
                return Poly.of(_ceil_coefficients(expr))
            if bound:  # a kernel's buffer estimate (correction): its polynomial upper bound will do
                try:
                    return Poly.of(_ceil_coefficients(_upper_bound(expr)))
                except (NotPolynomial, sympy.PolynomialError):
                    pass
            cls = SequenceNotSymbolic if S in expr.free_symbols else SymbolicCaptureFailed
            raise cls(f"a byte count is not a polynomial in b{' and s' if seq else ''}: {exc}") from exc

    # Tensor sizes must be exact polynomials; corrections' estimates may be bounded.
    storages = {
        sid: with_bytes(s, to_poly(s.nbytes) + to_poly(s.extra, bound=True)) for sid, s in tracker.storages.items()
    }
    for op in tracker.ops:
        op.scratch = tuple(to_poly(x, bound=True) for x in op.scratch)
    in_graph = functools.lru_cache(maxsize=None)(lambda e: e.xreplace(to_b))
    for node in graph.nodes:  # symbolic sizes in the graph's arguments and metadata, in terms of b (and s)
        args, kwargs = map_exprs(node.args, in_graph), map_exprs(node.kwargs, in_graph)
        if args is not node.args or kwargs is not node.kwargs:
            node.args, node.kwargs = args, kwargs
        if "tensor_meta" in node.meta:
            node.meta["tensor_meta"] = map_metadata(node.meta["tensor_meta"], in_graph)

    def in_b(expr):
        return sympy.expand(shape_env.replace(sympy.sympify(expr)).xreplace(to_b))

    sites = tuple(dataclasses.replace(site, upper=in_b(site.upper), used=in_b(site.used)) for site in sites)
    return RawCapture(tracker.ops, storages, graph, lo, hi, guards, (seq_lo, seq_hi) if seq else None,
                      rounded=tuple(dict.fromkeys(rounded)), data_dependent=sites,
                      freed_first=tuple(tracker.freed_first), call_guards=call_guards)


def _integer_in_micro(expr, k: int) -> bool:
    """Whether ``expr`` (in ``b``, the micro-batch being ``b / k``) is an integer polynomial in
    the micro-batch."""
    try:
        Poly.of(sympy.expand(expr.xreplace({B: k * B})))
    except (NotPolynomial, sympy.PolynomialError):
        return False
    return True


def hint(value) -> int:
    if isinstance(value, torch.SymInt):  # the hint: int() would add a guard
        return int(value.node.hint or 0)
    return int(value)
