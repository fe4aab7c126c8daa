"""The result of ``report(dtype_symbols=True)``: the step's bytes as formulas in the batch size
``b`` and the element width ``w`` of the model's float dtype (frozen dataclasses, no rendering;
``estimator.orchestrate.dtype_formula`` builds them, ``estimator.reporting.formulas`` renders them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import sympy
import torch

from estimator.capture.dtypes import NAMES
from estimator.vocab.categories import Category, Phase
from estimator.vocab.errors import InputError
from estimator.vocab.symbolic import Poly, WidthPoly
from estimator.vocab.units import as_int


@dataclass(frozen=True)
class WidthPiece:
    """One piece of the peak: the bytes alive at one op, in ``b`` (``s``) and ``w``."""

    bytes: WidthPoly
    phase: Phase
    op: str
    module: str
    breakdown: Mapping[Category, WidthPoly]  # the bytes alive at this op by category (they sum to ``bytes``
    # but for a CUDA target's cuBLAS workspaces)

    @property
    def expr(self) -> sympy.Expr:
        return self.bytes.expr


@dataclass(frozen=True)
class WidthLine:
    """One formula in ``b`` (``s``) and ``w``, exact at each dtype of ``widths`` (name -> bytes
    per element), every one of them captured.  ``peaks``: dtype -> the index in ``pieces`` of its
    peak at the report's batch (whose ``breakdown`` is that dtype's categories at the peak).
    """

    widths: Mapping[str, int]
    pieces: tuple[WidthPiece, ...]
    peaks: Mapping[str, int]

    @property
    def peak(self) -> sympy.Expr:
        """The peak in ``b`` (``s``) and ``w``: ``Max`` over the pieces."""
        exprs = [p.expr for p in self.pieces]
        return exprs[0] if len(exprs) == 1 else sympy.Max(*exprs)

    def pieces_at(self, dtype: str) -> list[Poly]:
        """The pieces as polynomials in ``b`` (``s``) at ``dtype``'s width."""
        w = self.widths[dtype]
        return [p.bytes.at_width(w) for p in self.pieces]

    def peak_piece(self, dtype: str) -> WidthPiece:
        """The piece that is ``dtype``'s peak at the report's batch."""
        return self.pieces[self.peaks[dtype]]


@dataclass(frozen=True)
class DtypeFormula:
    """The peak and its categories in ``b`` (and ``s``) and ``w``, the bytes per element of the
    model's float dtype (``w = 4``: fp32, ``w = 2``: bf16 and fp16).

    ``lines[0]`` holds at fp32 and bf16, and at fp16 when the fp16 step has bf16's peak formula and
    categories at the peak; otherwise ``lines[1]`` is fp16's own (through fp32 and fp16) and the
    notes say where the two steps differ.  ``params`` is Ψ, the number of trainable parameters.

    Example (CPU, where ``peak_bytes`` is the formula's value):
        >>> model, x = torch.nn.Linear(16, 4), torch.randn(8, 16)
        >>> rep = estimator.report(model, x, device="cpu", dtype_symbols=True)
        >>> bf16 = estimator.report(model.to(torch.bfloat16), x.to(torch.bfloat16), device="cpu")
        >>> rep.dtype_formula.at(8, "bf16") == bf16.peak_bytes
        True
    """

    model_dtype: str  # the given model's float dtype ("fp32", "bf16", "fp16", "fp64")
    lines: tuple[WidthLine, ...]
    batch: int
    seq: int | None
    valid_from: int
    valid_to: int | None
    guards: tuple[str, ...]
    params: int  # Ψ: trainable parameters
    notes: tuple[str, ...]

    @property
    def peak(self) -> sympy.Expr:
        """``lines[0].peak``: the peak in ``b`` (``s``) and ``w``."""
        return self.lines[0].peak

    @property
    def breakdown_formula(self) -> Mapping[Category, WidthPoly]:
        """The categories at the peak of the given model's dtype (fp32's when that was not
        captured), at the report's batch: formulas at that op, in ``b`` (``s``) and ``w``."""
        return self.peak_piece(self.model_dtype if self.model_dtype in self.dtypes else "fp32").breakdown

    def peak_piece(self, dtype: str | torch.dtype) -> WidthPiece:
        """The piece that is the peak at the report's batch for the model in ``dtype``."""
        return self.line(dtype).peak_piece(_name(dtype))

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes at which a line is exact (each captured)."""
        return tuple(dict.fromkeys(d for line in self.lines for d in line.widths))

    def line(self, dtype: str | torch.dtype) -> WidthLine:
        """The line exact at ``dtype`` (``"bf16"`` or ``torch.bfloat16``)."""
        name = _name(dtype)
        for line in self.lines:
            if name in line.widths:
                return line
        raise InputError(f"the dtype formula was captured at {', '.join(self.dtypes)}, not at {dtype!r}: elsewhere "
                         "(fp64, fp8) its line in w is an extrapolation, not a prediction")

    def at(self, b: int, dtype: str | torch.dtype, s: int | None = None) -> int:
        """The peak bytes at batch size ``b`` (and sequence length ``s``, default the sample's) for
        the model in ``dtype`` (the tensors' bytes, without a CUDA allocator's rounding)."""
        b = as_int(b, "batch size")
        if b < self.valid_from or (self.valid_to is not None and b > self.valid_to):
            upper = "∞" if self.valid_to is None else str(self.valid_to)
            raise InputError(f"the dtype formula holds for {self.valid_from} <= b <= {upper}")
        s = self.seq if s is None else as_int(s, "sequence length")
        return max(p(b, s) if p.has_s else p(b) for p in self.line(dtype).pieces_at(_name(dtype)))


def _name(dtype: str | torch.dtype) -> str:
    """``torch.bfloat16`` or ``"BF16"`` -> ``"bf16"``."""
    return NAMES.get(dtype, str(dtype)) if isinstance(dtype, torch.dtype) else str(dtype).lower()
