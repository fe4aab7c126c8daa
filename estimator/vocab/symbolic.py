"""Byte counts as polynomials in the batch size ``b`` (and optionally the sequence length
``s``), and the peak as a max over pieces.

Every live-bytes value of a model whose batch rows are independent is a polynomial in ``b``
with integer coefficients (linear for almost all models); in ``s`` it is a polynomial too
where attention materializes ``s x s`` scores.  Keeping exact integer coefficients instead
of sympy expressions makes the per-op arithmetic cheap; sympy appears only at the surface
(``Poly.expr``, ``peak_formula``).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sympy

B = sympy.Symbol("b", integer=True, positive=True)
S = sympy.Symbol("s", integer=True, positive=True)


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
    """A byte count is not a polynomial in ``b`` (and ``s``) with integer coefficients."""


@dataclass(frozen=True, slots=True)
class Poly:
    """``sum(coeffs[i] * b**i) + sum(c * b**i * s**j for (i, j, c) in mixed)``, exact integers.

    ``coeffs`` are the terms without ``s`` (trailing zeros trimmed); ``mixed`` the terms with
    ``s`` (``j >= 1``, sorted, no zero ``c``), empty unless the capture made ``s`` a symbol.
    """

    coeffs: tuple[int, ...] = ()
    mixed: tuple[tuple[int, int, int], ...] = ()

    @staticmethod
    def const(n: int) -> Poly:
        return Poly((int(n),)) if n else Poly()

    @staticmethod
    def of(value) -> Poly:
        """From an int, a SymInt or a sympy expression in ``b`` (and ``s``)."""
        if isinstance(value, Poly):
            return value
        if isinstance(value, int):
            return Poly.const(value)
        return _from_expr(value)

    def __add__(self, other: Poly) -> Poly:
        a, c = self.coeffs, other.coeffs
        if len(a) == 2 == len(c) and not (self.mixed or other.mixed):  # the most common case, inline (accounting)
            low, high = a[0] + c[0], a[1] + c[1]
            return _line(low, high)
        return self._plus(other, 1)

    def __neg__(self) -> Poly:
        return Poly(tuple(-x for x in self.coeffs), tuple((i, j, -c) for i, j, c in self.mixed))

    def __sub__(self, other: Poly) -> Poly:  # self + (-other) in one pass (the strategies subtract per block)
        a, c = self.coeffs, other.coeffs
        if len(a) == 2 == len(c) and not (self.mixed or other.mixed):  # as in __add__
            low, high = a[0] - c[0], a[1] - c[1]
            return _line(low, high)
        return self._plus(other, -1)

    def _plus(self, other: Poly, sign: int) -> Poly:
        """``self + sign * other`` (``sign`` is 1 or -1)."""
        a, c = self.coeffs, other.coeffs
        n, m = len(a), len(c)
        if n < 3 and m < 3 and not (self.mixed or other.mixed):  # the common case: byte counts c0 + c1*b
            low = (a[0] if n else 0) + sign * (c[0] if m else 0)
            high = (a[1] if n == 2 else 0) + sign * (c[1] if m == 2 else 0)
            return _line(low, high)
        if len(a) == len(c):  # no padding, no index tests
            coeffs = tuple(map(operator.add if sign == 1 else operator.sub, a, c))
        else:
            n = max(len(a), len(c))
            coeffs = tuple((a[i] if i < len(a) else 0) + sign * (c[i] if i < len(c) else 0) for i in range(n))
        if not self.mixed and not other.mixed:
            return _trim(coeffs)
        return _make(coeffs, _merge(self.mixed, tuple((i, j, sign * x) for i, j, x in other.mixed)))

    def __mul__(self, k: int) -> Poly:
        if not k:
            return ZERO
        return _make(tuple(k * x for x in self.coeffs), tuple((i, j, k * c) for i, j, c in self.mixed))

    def __call__(self, b: int, s: int | None = None) -> int:
        c = self.coeffs
        if len(c) < 3 and not self.mixed:  # the common case: c0 + c1*b
            return (c[0] + c[1] * b) if len(c) == 2 else (c[0] if c else 0)
        value = sum(c * b**i for i, c in enumerate(self.coeffs))
        if self.mixed:
            if s is None:
                raise ValueError(f"{self} depends on s: give s")
            value += sum(c * b**i * s**j for i, j, c in self.mixed)
        return value

    @property
    def has_s(self) -> bool:
        return bool(self.mixed)

    def at_s(self, s: int) -> Poly:
        """The polynomial in ``b`` at sequence length ``s``."""
        if not self.mixed:
            return self
        extra: dict[int, int] = {}
        for i, j, c in self.mixed:
            extra[i] = extra.get(i, 0) + c * s**j
        n = max(len(self.coeffs), max(extra) + 1)
        return _trim(tuple((self.coeffs[i] if i < len(self.coeffs) else 0) + extra.get(i, 0) for i in range(n)))

    def in_s(self, b: int) -> Poly:
        """The polynomial in ``s`` at batch size ``b``, as a ``Poly`` whose variable is ``s``."""
        by_j: dict[int, int] = {0: self(b, 0) if self.mixed else self(b)}
        for i, j, c in self.mixed:
            by_j[j] = by_j.get(j, 0) + c * b**i
        return _trim(tuple(by_j.get(j, 0) for j in range(max(by_j) + 1)))

    @property
    def degree(self) -> int:
        """The degree in ``b``."""
        return max(len(self.coeffs) - 1, max((i for i, _, _ in self.mixed), default=-1))

    def coeff(self, i: int) -> int:
        return self.coeffs[i] if i < len(self.coeffs) else 0

    @property
    def expr(self) -> sympy.Expr:
        return _expr(self)

    def dominates(self, other: Poly) -> bool:
        """True when ``self >= other`` for every ``b, s >= 0`` coefficient by coefficient."""
        n = max(len(self.coeffs), len(other.coeffs))
        if not all(self.coeff(i) >= other.coeff(i) for i in range(n)):
            return False
        mine, theirs = {(i, j): c for i, j, c in self.mixed}, {(i, j): c for i, j, c in other.mixed}
        return all(mine.get(k, 0) >= theirs.get(k, 0) for k in mine.keys() | theirs.keys())

    def per_micro(self, m: int, round_up: bool = False) -> Poly:
        """The polynomial of ``b`` equal to ``self(b / m)``: a step of micro-batches of ``b / m``
        rows (``NotPolynomial`` unless ``m**i`` divides each coefficient of ``b**i``; with
        ``round_up`` the coefficients are rounded up instead: an upper bound)."""
        if m == 1:
            return self
        terms = [(i, 0, c) for i, c in enumerate(self.coeffs)] + list(self.mixed)
        if not round_up and any(c % m**i for i, _, c in terms):
            raise NotPolynomial(f"{self} at b/{m} has non-integer coefficients")
        return _make(tuple(-(-c // m**i) for i, c in enumerate(self.coeffs)),
                     tuple((i, j, -(-c // m**i)) for i, j, c in self.mixed))

    def shifted(self, db: int, ds: int = 0) -> Poly:
        """The polynomial of ``(x, y)`` equal to ``self(x + db, y + ds)``."""
        out: dict[tuple[int, int], int] = {}
        terms = [(i, 0, c) for i, c in enumerate(self.coeffs) if c] + list(self.mixed)
        for i, j, c in terms:
            for k in range(i + 1):
                for m in range(j + 1):
                    key = (k, m)
                    out[key] = out.get(key, 0) + c * math.comb(i, k) * db ** (i - k) * math.comb(j, m) * ds ** (j - m)
        flat = tuple(out.get((i, 0), 0) for i in range(max((i for i, j in out if j == 0), default=-1) + 1))
        return _make(flat, tuple(sorted((i, j, c) for (i, j), c in out.items() if j and c)))

    def __str__(self) -> str:
        return str(self.expr)


ZERO = Poly()
_NEW, _SET_COEFFS, _SET_MIXED = object.__new__, Poly.coeffs.__set__, Poly.mixed.__set__


def _line(low: int, high: int) -> Poly:
    """``low + high*b`` (trimmed), made without the dataclass's ``__init__``: a long ``generate()``'s
    accounting makes millions (40 % faster)."""
    if not high:
        return Poly((low,)) if low else ZERO
    p = _NEW(Poly)
    _SET_COEFFS(p, (low, high))
    _SET_MIXED(p, ())
    return p


def _trim(coeffs: tuple[int, ...]) -> Poly:
    end = len(coeffs)
    while end and coeffs[end - 1] == 0:
        end -= 1
    return Poly(coeffs[:end])


def _merge(a, b) -> tuple[tuple[int, int, int], ...]:
    terms: dict[tuple[int, int], int] = {}
    for i, j, c in (*a, *b):
        terms[i, j] = terms.get((i, j), 0) + c
    return tuple(sorted((i, j, c) for (i, j), c in terms.items() if c))


def _make(coeffs: tuple[int, ...], mixed) -> Poly:
    return Poly(_trim(coeffs).coeffs, tuple(t for t in mixed if t[2]))


@functools.lru_cache(maxsize=4096)
def _expr(p: Poly) -> sympy.Expr:
    """``p`` as sympy builds it: the terms in ``b`` alone are built in their canonical form
    directly (``Mul(c, b**i, evaluate=False)``, the number first, a coefficient of 1 left out),
    five times cheaper than letting sympy evaluate each product (the annotated graph has one
    expression per op); terms in ``s`` are multiplied out (sympy orders their factors)."""
    terms = []
    for i, c in enumerate(p.coeffs):
        if not c:
            continue
        if i == 0:
            terms.append(sympy.Integer(c))
        else:
            terms.append(B**i if c == 1 else sympy.Mul(sympy.Integer(c), B**i, evaluate=False))
    terms += [sympy.Integer(c) * B**i * S**j for i, j, c in p.mixed]
    return sympy.Add(*terms)


@functools.lru_cache(maxsize=4096)
def _from_expr(expr) -> Poly:
    expr = sympy.sympify(expr)
    if not expr.free_symbols:
        if not expr.is_integer:
            raise NotPolynomial(f"{expr} is not an integer")
        return Poly.const(int(expr))
    if not expr.free_symbols <= {B, S}:
        raise NotPolynomial(f"{expr} depends on {expr.free_symbols - {B, S}}")
    try:
        poly = sympy.Poly(sympy.expand(expr), B, S)
    except sympy.PolynomialError as exc:
        raise NotPolynomial(f"{expr} is not a polynomial in b" + (" and s" if S in expr.free_symbols else "")) from exc
    coeffs: dict[int, int] = {}
    mixed = []
    for (i, j), c in poly.terms():
        if not c.is_integer:
            raise NotPolynomial(f"{expr} has non-integer coefficients")
        if j:
            mixed.append((i, j, int(c)))
        else:
            coeffs[i] = int(c)
    flat = tuple(coeffs.get(i, 0) for i in range(max(coeffs, default=-1) + 1))
    return _make(flat, tuple(sorted(mixed)))


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


def nondominated(polys: Iterable[Poly], lo: int, hi: int | None, s_lo: int = 0) -> list[int]:
    """Indices of the polynomials that are the maximum somewhere in ``b`` in ``[lo, hi]`` (and
    ``s >= s_lo``).

    Linear pieces in ``b``: the exact upper envelope.  Otherwise coefficient-wise dominance
    of ``p(lo + x, s_lo + y)`` over ``x, y >= 0``, which keeps every piece that can be the
    maximum (and possibly a few that cannot).
    """
    polys = list(polys)
    highest: dict[int, tuple[int, int]] = {}  # lines: slope -> (intercept, index) of the first highest
    for i, p in enumerate(polys):
        c = p.coeffs
        if p.mixed or len(c) > 2:
            break
        slope, intercept = (c[1] if len(c) == 2 else 0), (c[0] if c else 0)
        kept = highest.get(slope)
        if kept is None or intercept > kept[0]:  # (a lower line of the same slope is never the maximum)
            highest[slope] = intercept, i
    else:
        return sorted(_upper_envelope([(slope, intercept, i) for slope, (intercept, i) in highest.items()], lo, hi))
    best: dict[Poly, int] = {}
    for i, p in enumerate(polys):
        best.setdefault(p, i)
    unique = list(best.items())
    kept = undominated([(p.shifted(lo, s_lo),) for p, _ in unique])
    return sorted(unique[n][1] for n in kept)


def undominated(pieces: Sequence[tuple[Poly, ...]]) -> list[int]:
    """Indices (ascending) of the tuples of polynomials in ``x, y >= 0`` that no other tuple
    dominates coefficient-wise in every component (``Poly.dominates``), the first of equal ones.
    Largest first at ``x = y = 0``: a tuple can only be dominated by one at least as large there,
    and dominance is transitive, so comparing with the kept tuples suffices."""
    keep: list[int] = []
    for n in sorted(range(len(pieces)), key=lambda n: tuple(-p(0, 0) for p in pieces[n])):
        if not any(all(q.dominates(p) for q, p in zip(pieces[k], pieces[n])) for k in keep):
            keep.append(n)
    return sorted(keep)


def _upper_envelope(candidates: list[tuple[int, int, int]], lo: int, hi: int | None) -> list[int]:
    # Lines as (slope, intercept, index).  Walk from b = lo to the right: at each breakpoint the line
    # with the largest value and, among ties, the steepest slope takes over.  O(n * k) for k envelope
    # pieces (k is tiny).
    keep, b = [], lo
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
    peak = lambda b: max(p(b) for p in polys)
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


# The element width of the model's float dtype: bytes per element (fp32 4, bf16 and fp16 2).
W = sympy.Symbol("w", integer=True, positive=True)


@dataclass(frozen=True, slots=True)
class WidthPoly:
    """Bytes as a line in the element width ``w`` through two captures of one step: ``lo`` bytes
    (a ``Poly`` in ``b`` and ``s``) at ``w = w_lo``, ``hi`` at ``w = w_hi``.

    A tensor in the model's dtype comes out as ``numel·w``, a tensor of a fixed dtype (an fp32
    master copy, int64 indices) as a constant.  Exact at the two captured widths by construction;
    anywhere else the line is an extrapolation (``at_width`` computes it where it is an integer).
    """

    lo: Poly
    hi: Poly
    w_lo: int = 2
    w_hi: int = 4

    def __add__(self, other: WidthPoly) -> WidthPoly:
        if (self.w_lo, self.w_hi) != (other.w_lo, other.w_hi):
            raise ValueError(f"widths {self.w_lo}/{self.w_hi} and {other.w_lo}/{other.w_hi} differ")
        return WidthPoly(self.lo + other.lo, self.hi + other.hi, self.w_lo, self.w_hi)

    def at_width(self, w: int) -> Poly:
        """The polynomial in ``b`` (and ``s``) at width ``w`` (``NotPolynomial`` where the line has
        no integer coefficients there)."""
        if w == self.w_lo:
            return self.lo
        if w == self.w_hi:
            return self.hi
        return _divided(self.lo * (self.w_hi - w) + self.hi * (w - self.w_lo), self.w_hi - self.w_lo)

    def __call__(self, b: int, w: int, s: int | None = None) -> int:
        return self.at_width(w)(b, s)

    @property
    def terms(self) -> tuple[Poly, Poly, int]:
        """``(a, c, d)``: the bytes are ``(a + c·w) / d``, ``a`` and ``c`` with integer coefficients
        and ``d >= 1`` the smallest such denominator."""
        d = self.w_hi - self.w_lo
        a, c = self.lo * self.w_hi - self.hi * self.w_lo, self.hi - self.lo
        g = math.gcd(d, *_coefficients(a), *_coefficients(c))
        return _divided(a, g), _divided(c, g), d // g

    @property
    def expr(self) -> sympy.Expr:
        a, c, d = self.terms
        return sympy.collect(sympy.expand((a.expr + c.expr * W) / d), W)

    def __str__(self) -> str:
        return str(self.expr)


def _coefficients(p: Poly) -> list[int]:
    return [*p.coeffs, *(c for _, _, c in p.mixed)]


def _divided(p: Poly, d: int) -> Poly:
    if any(c % d for c in _coefficients(p)):
        raise NotPolynomial(f"{p} / {d} has non-integer coefficients")
    return _make(tuple(c // d for c in p.coeffs), tuple((i, j, c // d) for i, j, c in p.mixed))
