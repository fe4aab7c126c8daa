"""Byte counts as polynomials in the batch size ``b``, and the peak as a max over pieces.

Every live-bytes value of a model whose batch rows are independent is a polynomial in ``b``
with integer coefficients (linear for almost all models).  Keeping exact integer coefficients
instead of sympy expressions makes the per-op arithmetic cheap; sympy appears only at the
surface (``Poly.expr``, ``peak_formula``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sympy

B = sympy.Symbol("b", integer=True, positive=True)


def as_expr(value):
    """An int, or the sympy expression of a SymInt (other values unchanged).

    Arithmetic on SymInts is traced and comparisons add shape guards; on their sympy
    expressions it is plain bookkeeping.
    """
    import torch

    if isinstance(value, torch.SymInt):
        return value.node.expr
    return value


class NotPolynomial(ValueError):
    """A byte count is not a polynomial in ``b`` with integer coefficients."""


@dataclass(frozen=True, slots=True)
class Poly:
    """``sum(coeffs[i] * b**i)``, exact integers; trailing zeros trimmed."""

    coeffs: tuple[int, ...] = ()

    @staticmethod
    def const(n: int) -> Poly:
        return Poly((int(n),)) if n else Poly()

    @staticmethod
    def of(value) -> Poly:
        """From an int, a SymInt or a sympy expression in ``b``."""
        if isinstance(value, Poly):
            return value
        if isinstance(value, int):
            return Poly.const(value)
        return _from_expr(value)

    def __add__(self, other: Poly) -> Poly:
        a, c = self.coeffs, other.coeffs
        if len(a) < len(c):
            a, c = c, a
        return _trim(tuple(x + (c[i] if i < len(c) else 0) for i, x in enumerate(a)))

    def __neg__(self) -> Poly:
        return Poly(tuple(-x for x in self.coeffs))

    def __sub__(self, other: Poly) -> Poly:
        return self + (-other)

    def __mul__(self, k: int) -> Poly:
        return _trim(tuple(k * x for x in self.coeffs))

    def __call__(self, b: int) -> int:
        return sum(c * b**i for i, c in enumerate(self.coeffs))

    @property
    def degree(self) -> int:
        return len(self.coeffs) - 1

    def coeff(self, i: int) -> int:
        return self.coeffs[i] if i < len(self.coeffs) else 0

    @property
    def expr(self) -> sympy.Expr:
        return sum((sympy.Integer(c) * B**i for i, c in enumerate(self.coeffs)), sympy.Integer(0))

    def dominates(self, other: Poly) -> bool:
        """True when ``self >= other`` for every ``b >= 0`` coefficient by coefficient."""
        n = max(len(self.coeffs), len(other.coeffs))
        return all(self.coeff(i) >= other.coeff(i) for i in range(n))

    def __str__(self) -> str:
        return str(self.expr)


ZERO = Poly()


def _trim(coeffs: tuple[int, ...]) -> Poly:
    end = len(coeffs)
    while end and coeffs[end - 1] == 0:
        end -= 1
    return Poly(coeffs[:end])


@functools.lru_cache(maxsize=4096)
def _from_expr(expr) -> Poly:
    expr = sympy.sympify(expr)
    if not expr.free_symbols:
        if not expr.is_integer:
            raise NotPolynomial(f"{expr} is not an integer")
        return Poly.const(int(expr))
    if expr.free_symbols != {B}:
        raise NotPolynomial(f"{expr} depends on {expr.free_symbols - {B}}")
    try:
        poly = sympy.Poly(sympy.expand(expr), B)
    except sympy.PolynomialError as exc:
        raise NotPolynomial(f"{expr} is not a polynomial in b") from exc
    coeffs = poly.all_coeffs()[::-1]
    if not all(c.is_integer for c in coeffs):
        raise NotPolynomial(f"{expr} has non-integer coefficients")
    return _trim(tuple(int(c) for c in coeffs))


def fit(samples: Sequence[tuple[int, int]], exact: bool = True) -> Poly:
    """The line through ``(b, bytes)`` samples; raises ``NotPolynomial`` unless every sample is on it.

    ``exact=False``: the line through the first and the last sample, slope rounded to an
    integer (exact at the first sample), for memory that is linear only up to rounding.
    """
    (b0, y0), (b1, y1) = samples[0], samples[-1]
    slope, rem = divmod(y1 - y0, b1 - b0)
    if not exact:
        slope = round((y1 - y0) / (b1 - b0))
        return _trim((y0 - slope * b0, slope))
    line = _trim((y0 - slope * b0, slope))
    if rem or any(line(b) != y for b, y in samples):
        raise NotPolynomial(f"bytes {[y for _, y in samples]} at b={[b for b, _ in samples]} are not linear in b")
    return line


def nondominated(polys: Iterable[Poly], lo: int, hi: int | None) -> list[int]:
    """Indices of the polynomials that are the maximum somewhere in ``[lo, hi]``.

    Linear pieces: the exact upper envelope.  Higher degree: coefficient-wise dominance,
    which keeps every piece that can be the maximum (and possibly a few that cannot).
    """
    polys = list(polys)
    best: dict[Poly, int] = {}
    for i, p in enumerate(polys):
        best.setdefault(p, i)
    unique = list(best.items())
    if all(p.degree <= 1 for p, _ in unique):
        return sorted(_upper_envelope(unique, lo, hi))
    keep = []
    for p, i in unique:
        if not any(q != p and q.dominates(p) for q, _ in unique):
            keep.append(i)
    return sorted(keep)


def _upper_envelope(lines: list[tuple[Poly, int]], lo: int, hi: int | None) -> list[int]:
    # Walk from b = lo to the right: at each breakpoint the line with the largest value and,
    # among ties, the steepest slope takes over.  O(n * k) for k envelope pieces (k is tiny).
    keep, b = [], lo
    candidates = [(p.coeff(1), p.coeff(0), i) for p, i in lines]
    while True:
        slope, icpt, idx = max(candidates, key=lambda t: (t[1] + t[0] * b, t[0]))
        keep.append(idx)
        # The next integer b at which a steeper line catches up with the current one.
        crossings = [
            max(-((a - icpt) // (s - slope)), b + 1) for s, a, _ in candidates if s > slope
        ]
        nxt = min(crossings, default=None)
        if nxt is None or (hi is not None and nxt > hi):
            return keep
        b = nxt


def max_fitting(polys: Sequence[Poly], budget: int, lo: int, hi: int | None) -> int:
    """The largest integer ``b`` in ``[lo, hi]`` with every polynomial ``<= budget``; ``lo - 1`` if none.

    Exact for linear pieces (``min_i floor((budget - a_i) / c_i)``); bisection on the
    (non-decreasing) maximum otherwise.
    """
    if all(p.degree <= 1 for p in polys):
        best = hi if hi is not None else math.inf
        for p in polys:
            a, c = p.coeff(0), p.coeff(1)
            if c > 0:
                best = min(best, (budget - a) // c)
            elif c == 0 and a > budget:
                return lo - 1
            elif c < 0:
                raise NotPolynomial(f"memory {p} decreases with b")
        if best == math.inf:
            raise ValueError("memory does not grow with b: every batch size fits")
        return max(int(best), lo - 1)
    peak = lambda b: max(p(b) for p in polys)  # noqa: E731
    if peak(lo) > budget:
        return lo - 1
    good, bad = lo, lo * 2
    while peak(bad) <= budget:
        if hi is not None and bad >= hi:
            return hi
        good, bad = bad, bad * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if peak(mid) <= budget else (good, mid)
    return good if hi is None else min(good, hi)
