"""The result of an estimate: frozen dataclasses, no rendering (see ``render``)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import sympy
from torch import fx

from estimator.account import Timeline
from estimator.devices.cuda import CudaMemory, Overhead, predict, workspaces_held
from estimator.reporting.depth import DepthFormula
from estimator.reporting.dtypes import DtypeFormula
from estimator.vocab.categories import Category, Mode, Phase
from estimator.vocab.errors import InputError
from estimator.vocab.strategy import DEFAULT, Strategy
from estimator.vocab.symbolic import ZERO, Poly, max_fitting, nondominated
from estimator.vocab.target import TargetSpec
from estimator.vocab.units import as_int, parse_bytes


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

    @classmethod
    def at(cls, timeline: Timeline, index: int, k: int, fixed: Poly = ZERO) -> Piece:
        """Candidate ``k`` of op ``index`` of ``timeline`` (``Timeline.candidates``; -1: before the
        step) plus ``fixed`` bytes held outside its tensors."""
        if index < 0:
            return cls(sum(timeline.baseline, ZERO) + fixed, Phase.FORWARD, "(before the step)", None, "")
        op = timeline.ops[index]
        return cls(op.peaks()[k] + fixed, op.phase, op.op + (" (kernel scratch)" if k else ""), op.node, op.module)


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
class Generated:
    """``mode="generate"``: what the step generates and what its KV cache costs (at the report's
    sequence length)."""

    new_tokens: int
    prompt_tokens: int  # the prompt's length s (the report's)
    cache: str  # the cache's class: DynamicCache (grown at every step), StaticCache (sized at the prefill)
    kv_bytes_per_token: int  # per sequence: keys and values of every layer
    cache_tokens: int  # the tokens the cache holds (dynamic) or has room for (static) after the last call
    peak_call: int  # where the peak is: 0 the prefill, k the k-th decode step

    @property
    def where(self) -> str:
        return "the prefill" if self.peak_call == 0 else f"decode step {self.peak_call} of {self.new_tokens - 1}"

    def kv_bytes(self, b: int) -> int:
        """The last call's KV cache for ``b`` sequences."""
        return b * self.cache_tokens * self.kv_bytes_per_token


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
    seq: int | None = None  # the sequence length ``s`` of the sample, when the formula is in ``s``
    seq_range: tuple[int, int | None] = (2, None)  # where the formula holds in ``s``
    multiple: int = 1  # b must be a multiple of it (micro-batches of gradient accumulation / a pipeline)
    strategy: Strategy = DEFAULT
    # Distributed strategies: each group of identical ranks' own report; this report is the
    # worst rank's, with ``pieces`` (so ``peak``, ``at``, ``max_batch``) the max over all ranks.
    ranks: tuple[RankReport, ...] = ()
    # The data-dependent sizes the step used (``estimator.vocab.data_dependent.Site``: the call site,
    # ``upper`` and ``used`` in b, and why), for ``report(data_dependent=)``.
    data_dependent: tuple = ()
    # The default bound's report has data-dependent sizes at their upper bound: the same step with
    # the sizes the sample gives (``data_dependent='sample'``), to read beside it; None otherwise.
    at_sample: Report | None = field(default=None, repr=False, compare=False)
    generation: Generated | None = None  # mode="generate": new tokens, KV cache per token, where the peak is
    # report(dtype_symbols=True): the peak and its categories in b and the element width w of the
    # model's float dtype (``estimator.reporting.dtypes.DtypeFormula``).
    dtype_formula: DtypeFormula | None = None
    # report(depth_symbols=True): the peak in b and the number of blocks L of the model's repeated
    # blocks (``estimator.reporting.depth.DepthFormula``).
    depth_formula: DepthFormula | None = None
    trainable_params: int = 0  # Ψ: the model's parameters that require grad (elements)

    @property
    def optimizer_state_per_param(self) -> float | None:
        """Optimizer state at the peak (this device's) in bytes per trainable parameter of the
        model: 8 for AdamW's two fp32 moments, about 2.03 for an 8-bit one (fp32 fallbacks of
        small tensors raise it); None without an optimizer step or trainable parameters."""
        if self.mode is not Mode.TRAIN or not self.trainable_params or self.optimizer is None:
            return None
        return self.breakdown.get(Category.OPTIMIZER_STATE, 0) / self.trainable_params

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
            Overhead.PREVIOUS_OUTPUT: self.cuda.carried,
            Overhead.ALLOCATOR_ROUNDING: self.cuda.allocated - tensors - self.cuda.workspace - self.cuda.carried,
            Overhead.ALLOCATOR_CACHE: self.cuda.reserved - self.cuda.allocated,
            Overhead.CUDA_CONTEXT: self.cuda.context,
            **({Overhead.MANAGED: self.cuda.managed} if self.cuda.managed else {}),
        }

    @property
    def peak(self) -> sympy.Expr:
        """The peak as a sympy expression in ``b`` (and ``s``) (``Max`` over the pieces)."""
        exprs = [p.expr for p in self.pieces]
        return exprs[0] if len(exprs) == 1 else sympy.Max(*exprs)

    def _check_range(self, b: int | None, s: int | None = None) -> tuple[int | None, int | None]:
        """``b`` and ``s`` as ints (``numpy`` integers too), checked against the formula's range
        (``b`` None: ``s`` alone)."""
        if b is not None:
            b = as_int(b, "batch size")
            if b % self.multiple:
                raise InputError(f"this step splits b into micro-batches ({self.strategy.describe()}): b must be a "
                                 f"multiple of {self.multiple}, got b={b}")
            if b < self.valid_from or (self.valid_to is not None and b > self.valid_to):
                upper = "∞" if self.valid_to is None else str(self.valid_to)
                raise InputError(
                    f"the formula holds for {self.valid_from} <= b <= {upper} "
                    f"({'; '.join(self.guards) or 'batch sizes 0 and 1 specialize shapes'}); "
                    f"call estimator.report(..., batch={b}) for b={b}"
                )
        if s is None or s == self.seq:
            return b, s if s is None else int(s)
        if self.seq is None:
            raise InputError("this report's formula is not in s: pass dynamic= to estimator.report to make the "
                             "sequence length a symbol")
        s = as_int(s, "sequence length")
        lo, hi = self.seq_range
        if s < lo or (hi is not None and s > hi):
            raise InputError(f"the formula holds for {lo} <= s <= {'∞' if hi is None else hi} "
                             f"({'; '.join(self.guards) or 'lengths 0 and 1 specialize shapes'})")
        return b, s

    def _pieces_at(self, s: int | None) -> list[Poly]:
        """The peak's pieces as polynomials in ``b`` at sequence length ``s`` (default ``seq``)."""
        s = self.seq if s is None else s
        return [p.bytes.at_s(s) if s is not None else p.bytes for p in self.pieces]

    def _generating(self, new_tokens: int | None) -> Report:
        """This report, or for ``new_tokens`` fewer than it generates (``mode="generate"``, a dynamic
        cache) the same call stopped there: its run is this run up to the decode step it does not
        make (the same ops: the stopping test only answers otherwise), every tensor then freed as
        ``generate`` returns.  For ``at``/``max_batch``/``fits`` only: its breakdown and modules
        stay this report's."""
        g = self.generation
        if new_tokens is None or (g is not None and new_tokens == g.new_tokens):
            return self
        if g is None:
            raise InputError("new_tokens= is for mode='generate' reports")
        n = as_int(new_tokens, "new_tokens")
        if n > g.new_tokens:
            raise InputError(f"this report generates {g.new_tokens} tokens and a run of {n} goes further: call "
                             f"estimator.report(..., new_tokens={n}) (or more, then ask for fewer)")
        if g.cache != "DynamicCache":
            raise InputError(f"a {g.cache} is sized for the prompt and the new tokens at the prefill, so a run of "
                             f"{n} tokens is not part of this one: call estimator.report(..., new_tokens={n})")
        timeline = self.timeline.prefix(self.timeline.decoding.calls[n])  # call n: the first one it does not make
        candidates = timeline.candidates()
        keep = nondominated([poly for poly, _ in candidates], self.valid_from, self.valid_to,
                            self.seq_range[0] if self.seq is not None else 0)
        fixed = Poly.const(workspaces_held(timeline, self.target))  # as orchestrate.estimate._assemble's pieces
        cuda = None
        if self.cuda is not None:
            cuda = predict(timeline.at_s(self.seq) if self.seq is not None else timeline, self.batch, self.target)
        fewer = replace(g, new_tokens=n, cache_tokens=g.cache_tokens - (g.new_tokens - n))
        pieces = tuple(Piece.at(timeline, *candidates[i][1], fixed) for i in keep)
        return replace(self, timeline=timeline, pieces=pieces, cuda=cuda, generation=fewer)

    def at(self, b: int, s: int | None = None, new_tokens: int | None = None) -> int:
        """Predicted peak bytes at batch size ``b`` (and sequence length ``s``, default the
        sample's; ``mode="generate"``: ``new_tokens`` up to the report's); CUDA:
        ``max_memory_allocated``."""
        if new_tokens is not None:
            return self._generating(new_tokens).at(b, s)
        b, s = self._check_range(b, s)
        if self.cuda is not None:
            return self.on_device(b, s).allocated
        return max(p(b) for p in self._pieces_at(s))

    @property
    def per_device(self) -> dict[str, int]:
        """The peak at ``batch`` of each rank group (``role`` -> bytes; CUDA: allocated)."""
        if not self.ranks:
            return {self.strategy.describe(): self.peak_bytes}
        return {r.role: r.report.peak_bytes for r in self.ranks}

    def on_device(self, b: int | None = None, s: int | None = None) -> CudaMemory:
        """CUDA: the allocator's view at ``b`` (default ``batch``) and ``s`` (default ``seq``):
        allocated, reserved, device."""
        if self.cuda is None:
            raise InputError("on_device() is for device='cuda' reports")
        if (b is None or b == self.batch) and (s is None or s == self.seq):
            return self.cuda
        b, s = self._check_range(self.batch if b is None else b, s)
        if self.ranks:  # the rank whose device holds the most
            return max((r.report.on_device(b, s) for r in self.ranks), key=lambda m: m.device)
        return predict(self.timeline.at_s(self.seq if s is None else s), b, self.target)

    def _device_bytes(self, b: int | None, s: int | None, limit: int) -> int:
        """CUDA: the device bytes of the run at ``b`` and ``s``; ``limit + 1`` where the allocator
        model runs out of memory (a ``per_process_memory_fraction`` cap)."""
        from estimator.devices.cuda_allocator import OutOfMemory

        try:
            return self.on_device(b, s).device
        except OutOfMemory:
            return limit + 1

    def _device_fits(self, b: int | None, s: int | None, limit: int) -> bool:
        """CUDA: whether the run at ``b`` and ``s`` fits ``limit`` bytes of device memory."""
        return self._device_bytes(b, s, limit) <= limit

    def _budget(self, budget: int | str | None) -> int:
        if budget is not None:
            return parse_bytes(budget)
        gpu = self.target.gpu
        if self.cuda is None or gpu is None or gpu.total_memory is None:
            raise InputError("give a budget (bytes or e.g. '80GiB'); only a CUDA report for a GPU with a "
                             "known memory size has a default")
        return gpu.total_memory

    def max_batch(self, budget: int | str | None = None, s: int | None = None, new_tokens: int | None = None) -> int:
        """The largest batch size whose step fits in ``budget`` (bytes or ``"80GiB"``) at sequence
        length ``s`` (default the sample's); 0 if none.  ``mode="generate"``: how many sequences
        of prompt ``s`` fit generating ``new_tokens`` (default the report's; fewer with a dynamic
        cache: see ``at``).

        CPU: exact, ``min_i floor((budget - a_i) / c_i)`` over the linear pieces ``a_i + c_i·b``.
        CUDA: the budget is the device's memory (default: the GPU's); the inverted formula
        bounds the answer from above, the allocator replay finds by bisection a ``b`` whose
        ``device_bytes`` fit, and the 8 batches below it are replayed too (reserved memory is not
        monotonic in ``b``): each of them fits; further below, the answer assumes the allocator
        wastes no more than 8 batches' worth of tensors more than it does there.
        """
        if new_tokens is not None:
            return self._generating(new_tokens).max_batch(budget, s)
        _, s = self._check_range(None, s)  # (the report's own batch may lie outside the formula's range)
        limit = self._budget(budget)
        tensor_limit = limit if self.cuda is None else limit - self.cuda.outside_allocator
        try:
            best = max_fitting(self._pieces_at(s), tensor_limit, self.valid_from, self.valid_to)
        except ValueError as exc:
            raise InputError(f"cannot invert the peak formula: {exc}") from exc
        best -= best % self.multiple
        if best < self.valid_from:
            return 0
        if self.cuda is None:
            return best
        k = self.multiple  # bisect over multiples of k: b = k·n
        first = -(-self.valid_from // k)
        n = _bisect(lambda n: self._device_fits(k * n, s, limit), first, best // k)
        pieces = self._pieces_at(s)
        per_row = max(p(k * n) for p in pieces) - max(p(k * (n - 1)) for p in pieces) if n > first else 0
        return k * every_smaller_fits(n, first, lambda m: self._device_bytes(k * m, s, limit), limit, per_row)

    def max_seq(self, budget: int | str | None = None, b: int | None = None) -> int:
        """The largest sequence length whose step fits in ``budget`` at batch size ``b``
        (default ``batch``); 0 if none.  Needs a report with ``s`` symbolic (``dynamic=``)."""
        if self.seq is None:
            raise InputError("max_seq needs a formula in s: pass dynamic= to estimator.report")
        b, _ = self._check_range(self.batch if b is None else b)
        limit = self._budget(budget)
        tensor_limit = limit if self.cuda is None else limit - self.cuda.outside_allocator
        lo, hi = self.seq_range
        try:
            best = max_fitting([p.bytes.in_s(b) for p in self.pieces], tensor_limit, lo, hi)
        except ValueError as exc:
            raise InputError(f"cannot invert the peak formula in s: {exc}") from exc
        if best < lo:
            return 0
        if self.cuda is None:
            return best
        return _bisect(lambda s: self._device_fits(b, s, limit), lo, best)

    def fits(self, budget: int | str | None = None, b: int | None = None, s: int | None = None,
             new_tokens: int | None = None) -> bool:
        """Whether the step at ``b`` (default: ``batch``) and ``s`` fits in ``budget`` (CUDA: the
        device's memory, default the GPU's, compared with ``device_bytes``)."""
        if new_tokens is not None:
            return self._generating(new_tokens).fits(budget, b if b is not None else self.batch, s)
        limit = self._budget(budget)
        if self.cuda is not None:
            return self._device_fits(b, s, limit)
        if b is None and s is None:
            return self.peak_bytes <= limit
        return self.at(self.batch if b is None else b, s) <= limit

    def to_dict(self) -> dict[str, Any]:
        from estimator.reporting.render import to_dict

        return to_dict(self)

    def to_latex(self) -> str:
        """The peak and each category at the peak as a LaTeX ``align*`` block (bytes, MiB)."""
        from estimator.reporting.formulas import to_latex

        return to_latex(self)

    def to_markdown(self) -> str:
        """The peak formula and a Markdown table of the categories at the peak."""
        from estimator.reporting.formulas import to_markdown

        return to_markdown(self)

    def to_json(self, indent: int | None = 2) -> str:
        """``to_dict()`` as JSON, with exact integer coefficients of every formula."""
        from estimator.reporting.formulas import to_json

        return to_json(self, indent)

    def plot_timeline(self, b: int | None = None, **kwargs):
        """The live memory after every op by category (a matplotlib Figure; ``fxmem[plot]``)."""
        from estimator.reporting.plot import plot_timeline

        return plot_timeline(self, b, **kwargs)

    def plot_peak_vs_batch(self, **kwargs):
        """The peak over batch sizes with the budget and the largest batch (a matplotlib Figure)."""
        from estimator.reporting.plot import plot_peak_vs_batch

        return plot_peak_vs_batch(self, **kwargs)

    def __str__(self) -> str:
        from estimator.reporting.render import table

        return table(self)


@dataclass(frozen=True)
class RankReport:
    """One group of identical ranks of a distributed strategy: ``role`` ("replica", "shard 1/4",
    "stage 2/4 (blocks 3:6)"), their ``ranks`` and the report of one of them."""

    role: str
    ranks: tuple[int, ...]
    report: Report


CHECKED_BELOW = 8  # sizes below the bisection's answer replayed (every_smaller_fits)


def every_smaller_fits(n: int, first: int, device, limit: int, per_row: int = 0) -> int:
    """The largest ``m <= n`` such that ``device(m') <= limit`` for ``m' = m`` and the
    ``CHECKED_BELOW`` sizes below it (0 if none).  ``device`` is not monotonic (the caching
    allocator rounds segments to 2 or 20 MiB and fits blocks best-first): a size just below the
    bisection's ``n`` can take more.  Further below, the tensors alone are 8 batches' worth
    smaller: the answer assumes the allocator's overhead does not grow by more than that (stated
    in ``max_batch``).  A size ``m`` over the limit by ``e`` bytes moves the answer to
    ``m - ceil(e / per_row)`` (``per_row``: the tensors' bytes per batch row), not one size down:
    near the limit of a small model's large batch most sizes are over by a segment or two, each
    replay of the run costs seconds, and the answer stays one whose window fits."""
    answer, m = n, n
    while m >= max(first, answer - CHECKED_BELOW):
        excess = device(m) - limit
        if excess > 0:  # the window restarts below m
            answer = m = m - (-(-excess // per_row) if per_row > 0 else 1)
        else:
            m -= 1
    return answer if answer >= first else 0


def _bisect(fits, lo: int, hi: int) -> int:
    """The largest ``n`` in ``[lo, hi]`` with ``fits(n)`` (``fits`` monotone); 0 if none."""
    first, lo = lo, lo - 1  # fits(lo) holds or lo is below the range; the answer is <= hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo if lo >= first else 0
