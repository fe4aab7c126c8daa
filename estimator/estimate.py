"""``estimator.report()``: check the inputs, capture, account, find the peak, build the Report."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from estimator import step
from estimator.account import CATEGORIES, Timeline, account, fit_timelines
from estimator.capture.trace import StepSpec, capture
from estimator.categories import Category, Mode, Phase
from estimator.errors import CaptureError, InputError, SymbolicCaptureFailed
from estimator.report.result import CapturePath, ModuleRow, Piece, RankReport, Report
from estimator.strategy import DEFAULT, Strategy, blocks, select
from estimator.strategy.ranks import RankStep, per_rank
from estimator.symbolic import ZERO, NotPolynomial, Poly, nondominated
from estimator.target import cuda
from estimator.target.spec import target_spec

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda")


def report(
    model: nn.Module,
    sample: Any,
    batch: int | None = None,
    mode: str = "train",
    optimizer: str | step.OptimizerFactory | None = "adamw",
    loss_fn: step.LossFn | None = None,
    device: str = "cpu",
    gpu: str | int | None = None,
    alloc_conf: str | None = None,
    amp: str | None = None,
    grad_scaler: bool | None = None,
    dynamic: Mapping | None = None,
    strategy: Strategy | None = None,
) -> Report:
    """Predict the peak memory of one training step (or inference) of ``model`` on ``sample``.

    Nothing runs on real data: the step runs once on fake tensors with a symbolic batch size,
    so the result is a formula in ``b`` that ``Report.at`` / ``Report.max_batch`` evaluate.

    Args:
        model: the ``nn.Module`` (real or ``meta``-device weights; it is not modified).
        sample: one example input: a tensor, a tuple (``model(*x)``) or a dict (``model(**x)``);
            dim 0 of every tensor is the batch, of any size.
        batch: the batch size to evaluate at (default: the sample's).
        mode: ``"train"`` (forward, loss, backward, optimizer step) or ``"inference"``
            (``eval()`` + ``no_grad``).
        optimizer: a name (``"sgd"``, ``"sgd-momentum"``, ``"adam"``, ``"adamw"``, …), a callable
            ``params -> Optimizer``, or None (no optimizer step).
        loss_fn: ``loss_fn(output, sample) -> scalar``; default ``output.loss`` if present, else
            the mean of the first floating-point output.
        device: the target whose memory is predicted: ``"cpu"`` (exact against PyTorch's CPU
            allocator) or ``"cuda"``: the step as CUDA runs it (attention backends, fused
            kernels, foreach optimizers), replayed through a model of the caching allocator;
            ``peak_bytes`` is then the predicted ``torch.cuda.max_memory_allocated()``,
            ``reserved_bytes`` ``max_memory_reserved()``, ``device_bytes`` nvidia-smi's figure.
        gpu: CUDA only: the GPU (``"H100"``, ``"A100 80GB"``, ``"sm_90"``, or a memory size such
            as ``"24GiB"``): its architecture decides kernel choices and workspaces, its
            memory is the default budget of ``fits``/``max_batch``.  Default: an H100 (noted).
        alloc_conf: CUDA only: a ``PYTORCH_CUDA_ALLOC_CONF`` string (default: the
            environment's); options the allocator model cannot honour raise ``InputError``.
        amp: mixed precision: ``"fp16"`` or ``"bf16"`` runs the forward and the loss inside
            ``torch.autocast(device, dtype)`` (the target's op lists: CUDA's for
            ``device="cuda"``); None (default): no autocast.
        grad_scaler: train with ``torch.amp.GradScaler`` (``scaler.scale(loss).backward();
            scaler.step(opt); scaler.update()``; its scale and growth tracker count as optimizer
            state).  Default: True for ``amp="fp16"`` in training, else False.

        dynamic: sample dims, besides dim 0, that are the sequence length ``s``, which then
            stays a symbol: ``{"input_ids": {1: "s"}, "labels": {1: "s"}}`` for a dict sample
            (by key), ``{0: {1: "s"}}`` for a tuple (by position), ``{1: "s"}`` for a single
            tensor.  The formulas are then in ``b`` and ``s``; ``Report.at(b, s)``,
            ``max_batch(budget, s=)`` and ``max_seq(budget, b=)`` evaluate and invert them.
        strategy: an ``estimator.Strategy`` (train only, but for ``amp``): ``accumulate=k``
            splits the batch ``b`` (the optimizer step's) into ``k`` micro-batches of ``b / k``
            whose gradients accumulate (``b`` must be a multiple of ``k``; so must every ``b``
            given to ``Report.at``, and ``max_batch`` answers one); ``checkpoint=`` a module
            path, glob, tuple of them or module type whose forward is recomputed in backward
            (``torch.utils.checkpoint``, ``checkpoint_reentrant`` picks the variant);
            ``amp``/``grad_scaler`` as above; ``master_weights`` fp32 copies of a low-precision
            model's weights for the optimizer; ``data_parallel=N`` (DDP, or ``sharding=``
            ZeRO 1/2/3) and ``pipeline=S`` (``microbatches``, ``schedule``, ``split_points``)
            spread the step over devices: ``b`` is then each data-parallel rank's batch (a
            pipeline's: the pipeline's), the report is the worst device's and
            ``Report.ranks`` holds every rank's (see ``estimator.strategy.Strategy``).

    Returns:
        A frozen ``Report``.

    Example:
        >>> import torch, estimator
        >>> model = torch.nn.Linear(16, 4)
        >>> rep = estimator.report(model, torch.randn(8, 16), batch=32, optimizer="sgd")
        >>> rep.peak_bytes == rep.at(32)
        True

    Known limitations: memory must be polynomial in ``b`` (models whose batch rows interact
    through data-dependent shapes cannot be captured); sample tensors become contiguous.
    """
    request = _request(model, sample, batch, mode, optimizer, loss_fn, device, gpu, alloc_conf, amp, grad_scaler,
                       dynamic, strategy)
    return _result(request, _capture_step(request))


@dataclasses.dataclass(frozen=True)
class _Request:
    """``report()``'s arguments, checked."""

    model: nn.Module
    sample: Any
    spec: StepSpec
    batch: int
    dynamic: Mapping | None
    optimizer_name: str | None
    notes: tuple[str, ...]  # what the checks found worth saying (the default GPU, ...)

    @property
    def strategy(self) -> Strategy:
        return self.spec.strategy

    @property
    def capture_spec(self) -> StepSpec:
        """What the capture runs: the step of one device at the batch ``b // microbatches`` (a
        pipeline's micro-batch; the per-device strategies apply to the captured step)."""
        s = self.spec.strategy
        single = Strategy(accumulate=s.accumulate, checkpoint=s.checkpoint, checkpoint_reentrant=s.checkpoint_reentrant,
                          master_weights=s.master_weights)
        return dataclasses.replace(self.spec, strategy=single)

    @property
    def microbatches(self) -> int:
        return self.strategy.microbatches or 1

    @property
    def capture_key(self) -> tuple:
        """Requests with equal keys (in one ``compare``) share the captured formulas."""
        return self.spec.precision, self.capture_spec.strategy


def _request(model, sample, batch, mode, optimizer, loss_fn, device, gpu, alloc_conf, amp, grad_scaler, dynamic,
             strategy) -> _Request:
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sample_batch = _sample_batch(sample)
    batch = sample_batch if batch is None else batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise InputError(f"batch must be a positive int, got {batch!r}")
    try:
        mode_ = Mode(mode)
    except ValueError:
        raise InputError(f"mode must be 'train' or 'inference', got {mode!r}") from None
    device_ = str(device.type if isinstance(device, torch.device) else device)
    if device_ not in DEVICES:
        raise InputError(f"device must be one of {DEVICES}, got {device!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable (output, sample) -> scalar, got {type(loss_fn).__name__}")
    target, notes = target_spec(device_, gpu, alloc_conf)
    factory = step.optimizer_factory(optimizer) if mode_ is Mode.TRAIN else None
    strategy = _strategy(strategy, mode_, model, batch)
    if strategy.master_weights:
        factory = _master_weights(model, factory)
    amp, grad_scaler = _precision_of(strategy, amp, grad_scaler)
    precision = step.Precision.of(amp, grad_scaler, mode_)
    spec = StepSpec(mode_, factory, loss_fn or step.default_loss, target, precision, strategy)
    if mode_ is Mode.TRAIN and optimizer is None:
        notes.append("optimizer=None: no optimizer step and no optimizer state")
    name = _optimizer_name(optimizer) if mode_ is Mode.TRAIN else None
    return _Request(model, sample, spec, batch, dynamic, name, tuple(notes))


def _master_weights(model: nn.Module, factory):
    """The optimizer behind fp32 master weights, for a model with low-precision parameters."""
    if factory is None:
        raise InputError("Strategy(master_weights=True) keeps fp32 copies for the optimizer: give an optimizer")
    dtypes = {p.dtype for p in step.trainable(model) if p.is_floating_point()}
    if not dtypes - {torch.float32, torch.float64}:
        raise InputError("Strategy(master_weights=True) keeps fp32 copies of low-precision parameters, but the "
                         f"model's are {', '.join(sorted(str(d) for d in dtypes)) or 'not floating point'}: "
                         "cast it first (model.to(torch.bfloat16))")
    return step.master_weights(factory)


def _precision_of(strategy: Strategy, amp, grad_scaler):
    """``report(amp=, grad_scaler=)`` or the strategy's (they must agree when both are given)."""
    for name, given, own in (("amp", amp, strategy.amp), ("grad_scaler", grad_scaler, strategy.grad_scaler)):
        if given is not None and own is not None and given != own:
            raise InputError(f"report({name}={given!r}) and Strategy({name}={own!r}) disagree: give one")
    return (amp if amp is not None else strategy.amp,
            grad_scaler if grad_scaler is not None else strategy.grad_scaler)


def _result(request: _Request, step_: _Captured) -> Report:
    """The report of ``request`` from its captured step: one device's, or every rank's."""
    spec, strategy, model, batch = request.spec, request.strategy, request.model, request.batch
    notes = [*request.notes, *step_.notes]
    if spec.target.is_cuda:
        notes.append(cuda.not_modelled_note())
    if strategy.multiple > 1:
        notes.append(_batch_note(strategy))
    common = {
        "model": type(model).__name__,
        "mode": spec.mode,
        "device": spec.target.device.value,
        "optimizer": request.optimizer_name,
        "batch": batch,
        "path": step_.path,
        "valid_from": step_.valid_from,
        "valid_to": step_.valid_to,
        "guards": step_.guards,
        "graph": step_.graph,
        "batch_outside_range": step_.outside,
        "target": spec.target,
        "seq": step_.seq,
        "seq_range": step_.seq_range or (2, None),
        "multiple": strategy.multiple,
        "strategy": strategy,
    }
    if not strategy.distributed:
        return _assemble(model, step_.timeline, step_.at_batch, step_, {**common, "notes": tuple(notes)})

    def at(poly: Poly) -> int:  # bytes at the report's batch and sequence length
        return poly(batch, step_.seq) if poly.has_s else poly(batch)

    ranks = per_rank(step_.timeline, model, strategy, spec.target, at)
    at_batch = per_rank(step_.at_batch, model, strategy, spec.target, at) if step_.outside else ranks
    per = tuple(
        RankReport(r.role, r.ranks, _assemble(model, r.timeline, a.timeline, step_, {**common, "notes": ()}))
        for r, a in zip(ranks, at_batch)
    )
    worst = max(per, key=lambda r: (r.report.peak_bytes if r.report.cuda is None else r.report.cuda.device))
    pieces = [p for r in per for p in r.report.pieces]
    keep = nondominated([p.bytes for p in pieces], step_.valid_from, step_.valid_to, step_.seq_range_lo)
    return dataclasses.replace(worst.report, pieces=tuple(pieces[i] for i in keep), ranks=per, notes=tuple(notes))


@dataclasses.dataclass(frozen=True)
class _Formula:
    """The captured single-device step as formulas (before any batch is evaluated)."""

    timeline: Timeline
    path: CapturePath
    valid_from: int
    valid_to: int | None
    guards: tuple[str, ...]
    graph: Any
    seq: int | None
    seq_range: tuple[int, int | None] | None
    notes: tuple[str, ...]  # what the capture path had to do (fallbacks)

    @property
    def seq_range_lo(self) -> int:
        return (self.seq_range or (0,))[0]


@dataclasses.dataclass(frozen=True)
class _Captured(_Formula):
    """The formulas of one request (a pipeline's in its batch) and the timeline at its batch."""

    at_batch: Timeline | None = None  # ``timeline`` at the sample's ``s``, or a capture at ``batch`` when outside
    outside: bool = False


def _capture_formula(request: _Request) -> _Formula:
    """Capture the step symbolically (b, and s when ``dynamic``), falling back to b alone and
    then to fitted concrete captures.  Requests with the same ``capture_key`` share it."""
    model, sample, spec, notes = request.model, request.sample, request.capture_spec, []
    seq_dims, seq = _seq_dims(sample, request.dynamic)
    hint = max(request.batch // request.microbatches, 2)
    if hint == seq:
        hint += 1  # equal hints would make b and s one symbol (duck sizing)
    graph, seq_range = None, None
    try:
        try:
            raw = capture(model, sample, spec, hint, symbolic=True, seq_dims=seq_dims)
        except SymbolicCaptureFailed as exc:  # with s symbolic: try again with b alone first
            if seq is None:
                raise
            log.info("s could not stay symbolic (%s); capturing with b symbolic only", exc)
            notes.append(f"the sequence length could not stay a symbol ({exc}): the formulas are for s = {seq}")
            seq = None
            raw = capture(model, sample, spec, hint, symbolic=True)
        timeline, path, seq_range = account(raw), CapturePath.SYMBOLIC, raw.seq_range
        notes.extend(raw.notes)
        if raw.rounded:
            notes.append(_rounded_note(spec.strategy.accumulate, raw.rounded))
        valid_from, valid_to, guards, graph = raw.valid_from, raw.valid_to, raw.guards, raw.graph
    except SymbolicCaptureFailed as exc:
        log.info("symbolic capture failed (%s); fitting concrete captures", exc)
        timeline, graph, valid_to, note, host_notes = _concrete(model, sample, spec, hint, exc)
        path, guards, valid_from = CapturePath.CONCRETE, (), 2
        notes.append(note + ("; assumed linear elsewhere" if valid_to is None else f"; it holds up to b = {valid_to}"))
        notes.extend(host_notes)
        if seq is not None:
            notes.append(f"the formulas are for s = {seq} (dynamic= needs the symbolic capture)")
            seq = None
    _annotate(graph, timeline)
    return _Formula(timeline, path, valid_from, valid_to, guards, graph, seq, seq_range, tuple(notes))


def _capture_step(request: _Request, formula: _Formula | None = None) -> _Captured:
    """The captured step of ``request`` (``formula``: its capture, when shared): evaluated at the
    request's batch -- a concrete capture there when it lies outside the formula's range -- and,
    for a pipeline, turned into formulas in the pipeline's batch."""
    formula = formula or _capture_formula(request)
    timeline, seq, notes = formula.timeline, formula.seq, list(formula.notes)
    m = request.microbatches
    batch = request.batch // m
    valid_from, valid_to = formula.valid_from, formula.valid_to
    at_batch = timeline.at_s(seq) if seq is not None else timeline  # everything at the sample's s
    outside = batch < valid_from or (valid_to is not None and batch > valid_to)
    if outside:  # the formula does not hold here: capture this batch size itself
        at_batch = account(capture(request.model, request.sample, request.capture_spec, batch, symbolic=False))
        notes.append(f"b={request.batch} is outside the formula's range; its numbers come from a capture at "
                     f"b={request.batch}")
    if m > 1:  # formulas in the pipeline's batch b: each micro-batch runs b / m rows
        try:
            timeline, at_batch = _per_micro(timeline, m), _per_micro(at_batch, m)
        except NotPolynomial:
            timeline, at_batch = _per_micro(timeline, m, True), _per_micro(at_batch, m, True)
            notes.append(_rounded_note(m))
        valid_from, valid_to = m * valid_from, None if valid_to is None else m * valid_to
    return _Captured(**{**vars(formula), "timeline": timeline, "valid_from": valid_from, "valid_to": valid_to,
                        "notes": tuple(notes)}, at_batch=at_batch, outside=outside)


def _assemble(model: nn.Module, timeline: Timeline, at_batch: Timeline, step_: _Captured, common: dict) -> Report:
    """The report of one device's step: the peak's pieces (formulas), the peak at the batch
    with its breakdown, module rows and, on CUDA, the allocator's view."""
    target, batch, seq = common["target"], common["batch"], common["seq"]
    # Bytes held outside the captured tensors at every op (CUDA: the cuBLAS workspaces).
    fixed = Poly.const(cuda.cublas_workspaces(timeline) * cuda.workspace_bytes(target)) if target.is_cuda else ZERO
    candidates = _candidates(timeline)
    keep = nondominated([poly for poly, _ in candidates], step_.valid_from, step_.valid_to, step_.seq_range_lo)
    pieces = tuple(_piece(timeline, *candidates[i][1], fixed) for i in keep)
    _, (peak_index, peak_k) = max(_candidates(at_batch), key=lambda c: c[0](batch))
    formulas = timeline if not step_.outside else at_batch  # in b (and s) where the formula holds
    live = formulas.ops[peak_index].live_at(peak_k) if formulas.ops else formulas.baseline
    breakdown = {c: v(batch, seq) if v.has_s else v(batch) for c, v in zip(CATEGORIES, live)}
    on_device = cuda.predict(at_batch, batch, target) if target.is_cuda else None
    return Report(
        **common,
        peak_bytes=sum(breakdown.values()) if on_device is None else on_device.allocated,
        pieces=pieces,
        breakdown=breakdown,
        breakdown_formula=dict(zip(CATEGORIES, live)),
        peak_piece=_piece(formulas, peak_index, peak_k, fixed),
        modules=_module_rows(model, at_batch, peak_index),
        timeline=timeline,
        cuda=on_device,
    )


def _per_micro(timeline: Timeline, m: int, round_up: bool = False) -> Timeline:
    """``timeline`` of micro-batches of ``b / m`` rows: its storages' and scratch bytes mapped by
    ``Poly.per_micro``, the live bytes recomputed from them."""
    return RankStep.of(timeline).per_micro(m, round_up).timeline()


def _rounded_note(k: int, examples: tuple[str, ...] = ()) -> str:
    shown = f" (e.g. a tensor of {examples[0]} bytes for a micro-batch of b rows)" if examples else ""
    return (f"some tensors' bytes per sample are not a multiple of {k}{shown}: their coefficients in b (the step's "
            f"batch, {k} micro-batches of b/{k}) are rounded up, so the formula may be high by less than b bytes "
            "per such tensor")


def _batch_note(strategy: Strategy) -> str:
    k = strategy.multiple
    if strategy.pipeline > 1:
        return (f"pipeline: {strategy.microbatches} micro-batches of b/{strategy.microbatches} per step; "
                f"b must be a multiple of {k}")
    return f"gradient accumulation: {k} micro-batches of b/{k} per optimizer step; b must be a multiple of {k}"


def _strategy(strategy: Strategy | None, mode: Mode, model: nn.Module, batch: int) -> Strategy:
    """``strategy`` checked against the mode, the model (checkpointed modules exist) and ``batch``."""
    if strategy is None:
        return DEFAULT
    if not isinstance(strategy, Strategy):
        raise InputError(f"strategy must be an estimator.strategy.Strategy, got {type(strategy).__name__}")
    if mode is not Mode.TRAIN and dataclasses.replace(strategy, amp=None, grad_scaler=None) != DEFAULT:
        raise InputError(f"strategy={strategy.describe()!r}: strategies apply to mode='train' only")
    strategy.check_batch(batch)
    strategy.checkpointed(model)
    select(model, strategy.shard_modules, "shard_modules")
    if strategy.pipeline > 1 and (strategy.split_points is not None or len(blocks(model)) < strategy.pipeline):
        from estimator.strategy import pipeline

        pipeline.split(model, strategy)  # the cut's errors before the capture
    return strategy


def _seq_dims(sample: Any, dynamic: Mapping | None) -> tuple[dict[int, tuple[int, ...]] | None, int | None]:
    """``dynamic`` as ``{id(sample tensor): dims}`` and the sequence length they share."""
    if dynamic is None:
        return None, None
    if not isinstance(dynamic, Mapping) or not dynamic:
        raise InputError(f"dynamic must be a non-empty dict such as {{'input_ids': {{1: 's'}}}}, got {dynamic!r}")
    if isinstance(sample, torch.Tensor) and all(isinstance(k, int) and isinstance(v, str) for k, v in dynamic.items()):
        dynamic = {None: dynamic}  # {1: "s"} for a single-tensor sample
    seq_dims, sizes = {}, {}
    for key, dims in dynamic.items():
        t = sample if key is None else _lookup(sample, key)
        if not isinstance(dims, Mapping) or not dims:
            raise InputError(f"dynamic[{key!r}] must map dims to 's', e.g. {{1: 's'}}, got {dims!r}")
        for d, name in dims.items():
            if name == "b" and d == 0:
                continue  # dim 0 is the batch anyway
            if name != "s":
                raise InputError(f"dynamic[{key!r}][{d!r}] = {name!r}: only 's' (sequence length) is supported "
                                 "besides dim 0 = 'b'")
            if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d < t.dim():
                raise InputError(f"dynamic[{key!r}]: dim {d!r} is not a dim of that tensor (shape "
                                 f"{tuple(t.shape)}; dim 0 is the batch)")
            seq_dims.setdefault(id(t), ())
            seq_dims[id(t)] += (d,)
            sizes.setdefault(t.shape[d], f"{key!r}[{d}]")
    if len(sizes) > 1:
        detail = ", ".join(f"{where}: {size}" for size, where in sizes.items())
        raise InputError(f"the dims named 's' must have one size in the sample, got {detail}")
    seq = next(iter(sizes))
    if seq < 2:
        raise InputError(f"the sample's sequence length must be >= 2 to stay a symbol, got {seq}")
    return seq_dims, seq


def _lookup(sample: Any, key) -> torch.Tensor:
    try:
        t = sample[key]
    except (KeyError, IndexError, TypeError):
        where = list(sample) if isinstance(sample, Mapping) else (
            f"positions 0..{len(sample) - 1}" if isinstance(sample, Sequence) else "a single tensor: use {1: 's'}")
        raise InputError(f"dynamic names {key!r}, which the sample does not have ({where})") from None
    if not isinstance(t, torch.Tensor):
        raise InputError(f"dynamic names {key!r}, which is a {type(t).__name__}, not a tensor")
    return t


def _annotate(graph, timeline: Timeline) -> None:
    """``node.meta["fxmem"]`` for each op's node: live bytes after it (sympy, in b), bytes it
    allocated by category, its module path and phase."""
    nodes = {node.name: node for node in graph.nodes}
    for op in timeline.ops:
        node = nodes.get(op.node)
        if node is not None:
            node.meta["fxmem"] = {
                "live": op.total.expr,
                "allocated": {c: p.expr for c, p in zip(CATEGORIES, op.allocated) if p != ZERO},
                "module": op.module,
                "phase": op.phase,
            }


def _sample_batch(sample: Any) -> int:
    if not isinstance(sample, (torch.Tensor, Mapping, Sequence)) or isinstance(sample, (str, bytes)):
        raise InputError(
            f"sample must be a tensor, a tuple/list or a dict of tensors, got {type(sample).__name__}"
        )
    named = list(_named_tensors(sample))
    if not named:
        raise InputError("the sample holds no tensor: give at least one tensor whose dim 0 is the batch")
    sizes = {}
    for path, t in named:
        if t.dim() == 0:
            raise InputError(f"sample tensor {path or 'sample'} is a scalar: every tensor needs dim 0 = batch")
        sizes.setdefault(t.shape[0], path or "sample")
    if len(sizes) > 1:
        detail = ", ".join(f"{name}: {size}" for size, name in sizes.items())
        raise InputError(f"the sample's tensors disagree on the batch size (dim 0): {detail}")
    return next(iter(sizes))


def _named_tensors(sample: Any, prefix: str = ""):
    if isinstance(sample, torch.Tensor):
        yield prefix, sample
    elif isinstance(sample, Mapping):
        for k, v in sample.items():
            yield from _named_tensors(v, f"{prefix}[{k!r}]")
    elif isinstance(sample, Sequence) and not isinstance(sample, (str, bytes)):
        for i, v in enumerate(sample):
            yield from _named_tensors(v, f"{prefix}[{i}]")


def _concrete(model, sample, spec: StepSpec, hint: int, why: Exception):
    """Fit concrete captures; returns the timeline, the graph, the last valid b, a note and the
    notes of the first capture (host-measured kernels).

    The captures are at ``hint``, ``hint + 1`` and ``4 * hint`` (far apart, so that memory
    rounded to pages cannot pass for flat).  If ``4 * hint`` runs other ops, ``hint + 2`` is
    used instead and the formula holds up to it only.  Memory that is linear only up to
    rounding (kernel workspaces rounded to pages) gets the line through the two ends, exact
    at ``hint``; the note states its largest deviation from the captures.
    """
    near = [capture(model, sample, spec, b, symbolic=False) for b in (hint, hint + 1)]
    _check_same_ops(near[0], near[1], hint, hint + 1, why)
    far, valid_to = 4 * hint, None
    raw = capture(model, sample, spec, far, symbolic=False)
    if [op.name for op in raw.ops] != [op.name for op in near[0].ops]:
        far, valid_to = hint + 2, hint + 2
        raw = capture(model, sample, spec, far, symbolic=False)
        _check_same_ops(near[0], raw, hint, far, why)
    batches, raws = [hint, hint + 1, far], [*near, raw]
    timelines = [account(r) for r in raws]
    note = f"symbolic capture failed ({why}); the formula is fitted from fake runs at b = {hint}, {hint + 1}, {far}"
    try:
        return fit_timelines(batches, timelines), raws[0].graph, valid_to, note, raws[0].notes
    except NotPolynomial:
        fitted = fit_timelines([hint, far], [timelines[0], timelines[-1]], exact=False)
        deviation = max(
            abs(op.total(b) - t.ops[i].total(b)) for b, t in zip(batches, timelines) for i, op in enumerate(fitted.ops)
        )
        note += (
            f"; memory is linear in b only up to rounding (kernel buffers rounded to 4 KiB pages): the "
            f"line through b = {hint} and {far} is exact at b = {hint}, off by {deviation:,} B at most at the "
            "other captures, and elsewhere by up to a page per rounded buffer"
        )
        return fitted, raws[0].graph, valid_to, note, raws[0].notes


def _check_same_ops(reference, raw, b0: int, b: int, why: Exception) -> None:
    names, expected = [op.name for op in raw.ops], [op.name for op in reference.ops]
    if names != expected:
        first = next((i for i, (x, y) in enumerate(zip(expected, names)) if x != y), min(len(names), len(expected)))
        raise CaptureError(
            f"symbolic capture failed ({why}) and the concrete fallback runs different ops at b={b0} and "
            f"b={b} (first difference at op {first}): the memory of this model is not one formula in the batch size"
        )


def _candidates(timeline: Timeline) -> list[tuple[Poly, tuple[int, int]]]:
    """Every candidate peak with its (op index, scratch index); the baseline if no op ran."""
    found = [(poly, (i, k)) for i, op in enumerate(timeline.ops) for k, poly in enumerate(op.peaks())]
    return found or [(sum(timeline.baseline, ZERO), (-1, 0))]


def _piece(timeline: Timeline, index: int, k: int, fixed: Poly = ZERO) -> Piece:
    if index < 0:
        return Piece(sum(timeline.baseline, ZERO) + fixed, Phase.FORWARD, "(before the step)", None, "")
    op = timeline.ops[index]
    return Piece(op.peaks()[k] + fixed, op.phase, op.op + (" (kernel scratch)" if k else ""), op.node, op.module)


def _module_rows(model: nn.Module, timeline: Timeline, peak_index: int) -> tuple[ModuleRow, ...]:
    alive = {id(s) for s in timeline.alive_at(peak_index)} if peak_index >= 0 else set()
    activations: dict[str, Poly] = {}
    at_peak: dict[str, Poly] = {}
    for s in timeline.storages:
        nbytes, category, op_index, _ = s
        if op_index < 0:
            continue
        module = timeline.ops[op_index].module
        if category is Category.ACTIVATION:
            activations[module] = activations.get(module, ZERO) + nbytes
        if id(s) in alive:
            at_peak[module] = at_peak.get(module, ZERO) + nbytes

    def within(table: dict[str, Poly], path: str) -> Poly:
        total = ZERO
        for module, value in table.items():
            if not path or module == path or module.startswith(path + "."):
                total = total + value
        return total

    rows = []
    for path, module in model.named_modules():
        params = {id(p): p for p in module.parameters()}.values()
        rows.append(
            ModuleRow(
                path=path,
                type=type(module).__name__,
                params=sum(p.numel() for p in params),
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                activations=within(activations, path),
                at_peak=within(at_peak, path),
            )
        )
    return tuple(rows)


def _optimizer_name(optimizer) -> str | None:
    if optimizer is None or isinstance(optimizer, str):
        return optimizer
    return getattr(optimizer, "__name__", type(optimizer).__name__)
