"""The result of an estimate: frozen dataclasses, no rendering (see ``render``)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
from torch import fx

from estimator.account import Timeline
from estimator.categories import Category, Mode, Phase
from estimator.errors import InputError
from estimator.symbolic import Poly, max_fitting
from estimator.target.cuda import CudaMemory, Overhead
from estimator.target.spec import TargetSpec
from estimator.units import parse_bytes


class CapturePath(str, enum.Enum):
    SYMBOLIC = "symbolic"  # one fake run with a symbolic batch size: exact for every b in range
    CONCRETE = "concrete"  # fake runs at several batch sizes, fitted op by op


@dataclass(frozen=True)
class Piece:
    """One non-dominated piece of the peak: the bytes alive at one op, as a polynomial in ``b``."""

    bytes: Poly
    phase: Phase
    op: str
    node: str | None
    module: str

    @property
    def expr(self) -> sympy.Expr:
        return self.bytes.expr


@dataclass(frozen=True)
class ModuleRow:
    """Memory attributed to one module (its submodules included)."""

    path: str  # "" is the whole model
    type: str
    params: int  # number of parameters (shared ones counted once)
    param_bytes: int
    activations: Poly  # bytes its ops allocated that stay alive for backward
    at_peak: Poly  # bytes its ops allocated that are alive at the peak (at ``batch``)


@dataclass(frozen=True)
class Report:
    """Peak memory of one step, as a function of the batch size ``b``.

    ``peak_bytes`` is the peak at ``batch``; ``peak`` the formula; ``at(b)`` evaluates it;
    ``max_batch(budget)`` inverts it.

    CUDA target: ``peak_bytes`` is the predicted ``torch.cuda.max_memory_allocated()`` (tensors
    in 512-byte blocks, plus the cuBLAS workspaces), ``reserved_bytes`` the predicted
    ``max_memory_reserved()`` and ``device_bytes`` nvidia-smi's figure (reserved + the CUDA
    context); ``peak`` is the formula of the bytes without the allocator's rounding.  A budget
    is then the device's memory, compared with ``device_bytes``.
    """

    model: str
    mode: Mode
    device: str
    optimizer: str | None
    batch: int
    peak_bytes: int
    pieces: tuple[Piece, ...]
    breakdown: Mapping[Category, int]  # bytes by category at the peak, at ``batch``
    breakdown_formula: Mapping[Category, Poly]  # the same at the op of the peak, for every b
    peak_piece: Piece  # the piece that is the peak at ``batch``
    path: CapturePath
    valid_from: int
    valid_to: int | None  # None: no upper bound
    guards: tuple[str, ...]
    modules: tuple[ModuleRow, ...]
    notes: tuple[str, ...]
    timeline: Timeline = field(repr=False, compare=False)
    graph: fx.Graph | None = field(default=None, repr=False, compare=False)  # the captured aten ops
    batch_outside_range: bool = False  # peak_bytes then comes from a capture at ``batch`` itself
    target: TargetSpec = field(default=TargetSpec(), repr=False, compare=False)
    cuda: CudaMemory | None = None  # CUDA target: the allocator's view at ``batch``

    @property
    def reserved_bytes(self) -> int | None:
        """CUDA: predicted ``torch.cuda.max_memory_reserved()`` at ``batch``; None on CPU."""
        return None if self.cuda is None else self.cuda.reserved

    @property
    def device_bytes(self) -> int | None:
        """CUDA: predicted device memory used (nvidia-smi) at ``batch``; None on CPU."""
        return None if self.cuda is None else self.cuda.device

    @property
    def overheads(self) -> dict[Overhead, int]:
        """CUDA: memory besides the step's tensors at ``batch`` (empty on CPU)."""
        if self.cuda is None:
            return {}
        tensors = sum(self.breakdown.values())
        return {
            Overhead.CUBLAS_WORKSPACE: self.cuda.workspace,
            Overhead.ALLOCATOR_ROUNDING: self.cuda.allocated - tensors - self.cuda.workspace,
            Overhead.ALLOCATOR_CACHE: self.cuda.reserved - self.cuda.allocated,
            Overhead.CUDA_CONTEXT: self.cuda.context,
        }

    @property
    def peak(self) -> sympy.Expr:
        """The peak as a sympy expression in ``b`` (``Max`` over the pieces)."""
        exprs = [p.expr for p in self.pieces]
        return exprs[0] if len(exprs) == 1 else sympy.Max(*exprs)

    def _check_range(self, b: int) -> None:
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise InputError(f"batch size must be a positive int, got {b!r}")
        if b < self.valid_from or (self.valid_to is not None and b > self.valid_to):
            upper = "∞" if self.valid_to is None else str(self.valid_to)
            raise InputError(
                f"the formula holds for {self.valid_from} <= b <= {upper} "
                f"({'; '.join(self.guards) or 'batch sizes 0 and 1 specialize shapes'}); "
                f"call estimator.report(..., batch={b}) for b={b}"
            )

    def at(self, b: int) -> int:
        """Predicted peak bytes at batch size ``b`` (CUDA: ``max_memory_allocated``)."""
        self._check_range(b)
        if self.cuda is not None:
            return self.on_device(b).allocated
        return max(p.bytes(b) for p in self.pieces)

    def on_device(self, b: int | None = None) -> CudaMemory:
        """CUDA: the allocator's view at ``b`` (default ``batch``): allocated, reserved, device."""
        if self.cuda is None:
            raise InputError("on_device() is for device='cuda' reports")
        if b is None or b == self.batch:
            return self.cuda
        self._check_range(b)
        from estimator.target.cuda import predict

        return predict(self.timeline, b, self.target)

    def _budget(self, budget: int | str | None) -> int:
        if budget is not None:
            return parse_bytes(budget)
        gpu = self.target.gpu
        if self.cuda is None or gpu is None or gpu.total_memory is None:
            raise InputError("give a budget (bytes or e.g. '80GiB'); only a CUDA report for a GPU with a "
                             "known memory size has a default")
        return gpu.total_memory

    def max_batch(self, budget: int | str | None = None) -> int:
        """The largest batch size whose step fits in ``budget`` (bytes or ``"80GiB"``); 0 if none.

        CPU: exact, ``min_i floor((budget - a_i) / c_i)`` over the linear pieces ``a_i + c_i·b``.
        CUDA: the budget is the device's memory (default: the GPU's); the inverted formula
        bounds the answer from above and the allocator replay finds the largest ``b`` whose
        ``device_bytes`` fit (bisection: reserved memory grows with ``b``).
        """
        limit = self._budget(budget)
        tensor_limit = limit if self.cuda is None else limit - self.cuda.context
        try:
            best = max_fitting([p.bytes for p in self.pieces], tensor_limit, self.valid_from, self.valid_to)
        except ValueError as exc:
            raise InputError(f"cannot invert the peak formula: {exc}") from exc
        if best < self.valid_from:
            return 0
        if self.cuda is None:
            return best
        lo, hi = self.valid_from - 1, best  # fits(lo) holds (or lo is below the range), answer <= hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.on_device(mid).device <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo if lo >= self.valid_from else 0

    def fits(self, budget: int | str | None = None, b: int | None = None) -> bool:
        """Whether the step at ``b`` (default: ``batch``) fits in ``budget`` (CUDA: the device's
        memory, default the GPU's, compared with ``device_bytes``)."""
        limit = self._budget(budget)
        if self.cuda is not None:
            return self.on_device(b).device <= limit
        return (self.peak_bytes if b is None else self.at(b)) <= limit

    def to_dict(self) -> dict[str, Any]:
        from estimator.report.render import to_dict

        return to_dict(self)

    def to_latex(self) -> str:
        """The peak and each category at the peak as a LaTeX ``align*`` block (bytes, MiB)."""
        from estimator.report.formulas import to_latex

        return to_latex(self)

    def to_markdown(self) -> str:
        """The peak formula and a Markdown table of the categories at the peak."""
        from estimator.report.formulas import to_markdown

        return to_markdown(self)

    def to_json(self, indent: int | None = 2) -> str:
        """``to_dict()`` as JSON, with exact integer coefficients of every formula."""
        from estimator.report.formulas import to_json

        return to_json(self, indent)

    def __str__(self) -> str:
        from estimator.report.render import table

        return table(self)
