"""The result of ``report(depth_symbols=True)``: the step's peak as a formula in the batch size
``b`` (and ``s``) and the number of blocks ``L`` (``estimator.orchestrate.depth_formula`` builds
it, ``estimator.reporting.formulas`` renders it)."""

from __future__ import annotations

import dataclasses

import sympy

from estimator.vocab.errors import InputError
from estimator.vocab.symbolic import Poly

L = sympy.Symbol("L", integer=True, positive=True)


@dataclasses.dataclass(frozen=True)
class DepthPiece:
    """``fixed + units * per_unit`` bytes: one candidate peak of the step as a line in the number
    of units (``period`` blocks each) of the model's repeated blocks."""

    fixed: Poly
    per_unit: Poly

    def at(self, b: int, units: int, s: int | None = None) -> int:
        return self.fixed(b, s) + units * self.per_unit(b, s)


@dataclasses.dataclass(frozen=True)
class DepthFormula:
    """The peak of the step in ``b`` (and ``s``) and the number of blocks ``L`` of ``path``:
    ``L = head + period * units``, from ``head + period * units_from`` blocks on (exact there:
    the built blocks are the captured ones repeated, ``capture/repeated_blocks.py``).

    Example::

        >>> rep = estimator.report(model, x, device="cpu", depth_symbols=True)
        >>> rep.depth_formula.at(8, rep.depth_formula.blocks) == rep.at(8)
        True
    """

    path: str  # the blocks' module (``model.layers``)
    blocks: int  # the model's
    head: int  # blocks of their own before the repeated ones
    period: int  # blocks in one unit of the pattern
    units_from: int  # the fewest units the formula holds for
    pieces: tuple[DepthPiece, ...]  # the peak is their max
    valid_from: int  # the range of b (the report's)
    valid_to: int | None
    seq: int | None = None  # s is a symbol (the sample's length)
    notes: tuple[str, ...] = ()

    @property
    def blocks_from(self) -> int:
        """The fewest blocks the formula holds for."""
        return self.head + self.period * self.units_from

    @property
    def peak(self) -> sympy.Expr:
        """The peak in bytes as a sympy expression in ``b`` (``s``) and ``L``."""
        units = (L - self.head) / sympy.Integer(self.period)
        terms = [sympy.expand(p.fixed.expr + units * p.per_unit.expr) for p in self.pieces]
        return terms[0] if len(terms) == 1 else sympy.Max(*terms)

    def holds_at(self, b: int) -> bool:
        """Whether ``b`` is in the formula's range of batch sizes."""
        return self.valid_from <= b and (self.valid_to is None or b <= self.valid_to)

    def at(self, b: int, blocks: int, s: int | None = None) -> int:
        """The peak in bytes at batch size ``b`` with ``blocks`` blocks (and sequence length ``s``)."""
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < self.blocks_from \
                or (blocks - self.head) % self.period:
            every = f"every {self.period} blocks " if self.period > 1 else ""
            raise InputError(f"the depth formula holds for {self.blocks_from} blocks of {self.path} or more "
                             f"({every}from there), got {blocks!r}")
        if not self.holds_at(b):
            upper = "" if self.valid_to is None else f" to {self.valid_to}"
            raise InputError(f"the depth formula holds for b from {self.valid_from}{upper}, got b={b}")
        if self.seq is not None and s is None:
            s = self.seq
        units = (blocks - self.head) // self.period
        return max(p.at(b, units, s) for p in self.pieces)
