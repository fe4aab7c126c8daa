"""Run the user's step on fake tensors and record it: an fx graph plus allocation events.

``capture(..., symbolic=True)`` makes dim 0 of the sample one symbol and records bytes as
polynomials in ``b``; ``symbolic=False`` runs at one concrete batch size (the fallback path
runs it at several sizes and fits, see ``estimator.api``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import logging
import math
import os
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.optim import optimizer as torch_optimizer
from torch.utils._pytree import tree_flatten, tree_unflatten

from estimator import corrections
from estimator.corrections import custom_ops
from estimator.capture import steps as step
from estimator.capture import compiled, datadep, generation, tracing
from estimator.capture.fake import (SIZE_MAX, RealTensors, deep_copies_in_mode, fake_model, fake_sample, held_note,
                                    has_row_lists, isolated, sample_rows, with_rows)
from estimator.capture.graph import map_exprs
from estimator.corrections.mode import Substitutions
from estimator.capture.tracker import OpEvent, Storage, Tracker, as_expr
from estimator.capture.watchdog import Watchdog
from estimator.vocab.categories import Birth, Born, Category, Mode, Phase
from estimator.corrections.cuda import autocast as cuda_autocast
from estimator.vocab.errors import CaptureError, FxmemError, InputError, SequenceNotSymbolic, SymbolicCaptureFailed
from estimator.capture.checkpointing import checkpointing
from estimator.vocab.strategy import DEFAULT, Strategy
from estimator.vocab.symbolic import B, NotPolynomial, Poly, S
from estimator.corrections.cpu import host as cpu_target
from estimator.vocab.target import TargetSpec


@dataclass(frozen=True)
class StepSpec:
    """What step to run: the mode, the optimizer factory (train), the loss function, the
    target whose kernels and defaults the capture follows, the precision (autocast dtype,
    GradScaler) and the strategy (gradient accumulation, activation checkpointing)."""

    mode: Mode
    optimizer: step.OptimizerFactory | None
    loss_fn: step.LossFn
    target: TargetSpec = field(default_factory=TargetSpec)
    precision: step.Precision = step.FP32
    strategy: Strategy = DEFAULT
    data_dependent: datadep.Policy = field(default_factory=datadep.Policy)  # sizes fake tensors cannot know
    batch_dims: tuple[int, ...] | None = None  # the batch dim of each leaf of tree_flatten(sample); None: dim 0
    keep_output: bool = True  # the built-in train step keeps the model's output alive through backward
    step: step.StepFn | None = None  # the user's own step (then `optimizer` is a StateFactory: model -> state)
    compiled: compiled.Compiled | None = None  # the model is torch.compile'd so (None: eager)


@dataclass(frozen=True)
class RunMarks:
    """Where in the recorded step a real run's first step makes its state (``Born``), by op index:
    ``optimizer_starts[i]``: the op optimizer ``i``'s ``step()`` starts at (None: not stepped);
    ``model_returns``: the op the built-in step's model call returns before (there the previous
    step's ``out = model(x)`` is rebound and freed; None for a user's step, whose step function
    returns before the next one starts)."""

    optimizer_starts: tuple[int | None, ...] = ()
    model_returns: int | None = None


@dataclass(frozen=True)
class Decoding:
    """``mode="generate"``: where each call of the model starts (op indices: the prefill, then one
    decode step per new token but the last), and the KV cache as the last call leaves it:
    ``bytes_per_token`` per sequence (keys and values of every layer, at the capture's dtype)
    and the ``tokens`` it has room for then (a dynamic cache: the tokens it holds; a static
    one: its length), at the sample's sequence length."""

    calls: tuple[int, ...] = ()
    bytes_per_token: int = 0
    tokens: int = 0
    cache: str = ""  # the cache's class name (DynamicCache, StaticCache, ...)


@dataclass
class RawCapture:
    """The events of one captured step; bytes already polynomials in ``b``."""

    ops: list[OpEvent]
    storages: dict[int, Storage]
    graph: fx.Graph
    valid_from: int  # the range of b where the capture holds (from the shape guards)
    valid_to: int | None
    guards: tuple[str, ...]
    seq_range: tuple[int, int | None] | None = None  # where the formula holds in s (s symbolic)
    grad_order: tuple[str, ...] = ()  # parameters in the order AccumulateGrad gave them a gradient
    # micro-batch byte counts (in the micro-batch's rows b) whose per-row bytes the number of
    # micro-batches does not divide: their coefficients in the step's b were rounded up
    rounded: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # how host-measured kernels were priced (CPU target)
    data_dependent: tuple[datadep.Site, ...] = ()  # the data-dependent sizes used (in b)
    freed_first: tuple[int, ...] = ()  # state freed before the first op (zero_grad() first in a user's step)
    marks: RunMarks = RunMarks()  # where a run's first step makes its state
    decoding: Decoding | None = None  # mode="generate": the model's calls and the KV cache


def capture(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
            seq_dims: dict[int, tuple[int, ...]] | None = None) -> RawCapture:
    """Capture one steady-state step (``_capture``); with ``data_dependent='sample'``, or where
    the step needs a data-dependent value (``.item()``), the sizes and values observed on the
    real sample first (``datadep.probe``).  Torch's log records and warnings are kept from the
    user (``quiet``)."""
    with quiet(), _conversions_as_for_real(), tracing.as_for_real(), _global_hooks_suspended() as suspended:
        raw = _capture_probed(model, sample, spec, batch, symbolic, seq_dims)
    if suspended:
        raw.notes += (f"{suspended} global module hook(s) (torch.nn.modules.module.register_module_forward_hook and "
                      "the like) were not run by the capture (they would have been handed fake tensors): memory "
                      "they keep alive is not counted",)
    return raw


def _capture_probed(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
                    seq_dims: dict[int, tuple[int, ...]] | None = None) -> RawCapture:
    policy = spec.data_dependent
    # A one-row sample is captured with b hinted at 2 (sizes 0 and 1 specialize): code that reads
    # values only for several rows (generate()'s right-padding check) reads them in the capture,
    # so the probe runs on the sample's row twice, as a real run at b = 2 on such rows would.
    cycled = symbolic or has_row_lists(spec.batch_dims)
    probe_sample = _with_rows(sample, batch, spec.batch_dims) if cycled else sample
    if policy.needs_probe:
        try:
            spec = dataclasses.replace(spec, data_dependent=_probed(model, probe_sample, spec))
        except InputError:  # the weights are on the meta device: the sample's own values may fix every size
            spec = dataclasses.replace(spec, data_dependent=dataclasses.replace(policy, unprobed=True))
    try:
        return _capture(model, sample, spec, batch, symbolic, seq_dims)
    except datadep.NeedsProbe as exc:
        if spec.data_dependent.observed or spec.data_dependent.values:
            raise _unreached(exc, spec.data_dependent) from None
        try:
            probed = _probed(model, probe_sample, spec)
        except InputError:
            stand_in = generation.narrow_stand_in(model) if spec.mode is Mode.GENERATE else None
            if stand_in is None:
                raise CaptureError(f"{_at(exc)}; the model's weights are on the meta device, so fxmem cannot run "
                                   "it: build it with real (e.g. random) weights (command line: --device-init cpu)"
                                   ) from None
            return _stood_in(model, stand_in, sample, probe_sample, spec, batch, symbolic, seq_dims)
    try:
        return _capture(model, sample, dataclasses.replace(spec, data_dependent=probed), batch, symbolic, seq_dims)
    except datadep.NeedsProbe as exc:
        raise _unreached(exc, probed) from None


def _at(exc: BaseException) -> str:
    where = _user_frame(exc)
    return f"{exc}{f' (at {where})' if where else ''}"


def _unreached(exc: datadep.NeedsProbe, policy: datadep.Policy) -> CaptureError:
    hint = ("; sizes at their bound change which values a step reads (a loop over the experts a router chose): "
            "data_dependent='sample' captures the program the sample runs" if not policy.needs_probe else "")
    return CaptureError(f"{_at(exc)}, but the probe on the sample did not reach it{hint}")


def _with_rows(sample: Any, batch: int, batch_dims: tuple[int | None, ...] | None) -> Any:
    """A one-row ``sample`` with its row repeated ``batch`` times along each tensor's batch dim;
    a sample with row lists with its rows cycled to ``batch`` (the capture at ``batch`` cycles
    them so: the probe then runs what it runs); any other sample as it is."""
    rows, _ = sample_rows(sample, batch_dims)
    lists = has_row_lists(batch_dims)
    if rows == batch or (not lists and (rows != 1 or batch <= 1)):
        return sample
    if lists:
        sample, batch_dims = with_rows(sample, batch_dims, batch)
    leaves, spec = tree_flatten(sample)
    dims = batch_dims or (0,) * len(leaves)
    index = torch.arange(batch) % rows
    return tree_unflatten([t.index_select(d, index) if isinstance(t, torch.Tensor) and d is not None else t
                           for t, d in zip(leaves, dims)], spec)


def _stood_in(model: nn.Module, stand_in: nn.Module, sample: Any, probe_sample: Any, spec: StepSpec, batch: int,
              symbolic: bool, seq_dims) -> RawCapture:
    """``generate()`` of a model on the meta device, its data-dependent values those of
    ``generation.narrow_stand_in``'s real run (noted); refused where the capture needs
    data-dependent sizes too (an MoE's routing: there the values follow the weights)."""
    real_weights = "build it with real (e.g. random) weights (command line: --device-init cpu)"
    probed = _probed(stand_in, probe_sample, spec)
    try:
        raw = _capture(model, sample, dataclasses.replace(spec, data_dependent=probed), batch, symbolic, seq_dims)
    except datadep.NeedsProbe as exc:  # a value the stand-in's run did not ask: one that follows the weights
        raise CaptureError(f"{exc}: the weights are on the meta device and a narrow stand-in's run does not ask "
                           f"it; {real_weights}") from None
    if raw.data_dependent:
        raise CaptureError(f"generate() of this model routes tokens by its weights ({raw.data_dependent[0].site}), "
                           f"which are on the meta device: {real_weights}")
    raw.notes += (f"generate() asks values fake tensors cannot know (whether a prompt is padded, whether every "
                  f"sequence has finished: {len(probed.values)} of them); the weights are on the meta device, so "
                  "they come from a real run of a narrow stand-in (the same class, config and layers, width 64, "
                  "random weights): they depend on the attention mask and the token count, not on the weights",)
    return raw


def _probed(model: nn.Module, sample: Any, spec: StepSpec) -> datadep.Policy:
    """``spec``'s policy with the sizes and values of one real forward and loss on ``sample``
    (the model's train/eval state, buffers and the RNG restored); for a user's step, one real
    run of that step on a copy of the model (its optimizer step must not change the user's)."""
    training = model.training
    model.train(spec.mode is Mode.TRAIN)
    if spec.step is None:
        target = model

        def forward():
            with step.autocast(spec.precision, step.device_type(model, sample)):
                out = step.call_model(model, sample)
                if spec.mode is Mode.TRAIN:
                    spec.loss_fn(out, sample)
    else:
        memo: dict[int, Any] = {}
        target = copy.deepcopy(model, memo)
        fn = isolated(spec.step, memo)
        state = step.user_state(target, spec.mode, spec.optimizer)

        def forward():
            with checkpointing(target, spec.strategy):
                fn(target, sample, state)

    try:
        with Watchdog(), _errors_named(False):
            found = datadep.probe(target, sample, forward, grad=spec.step is not None)
    finally:
        model.train(training)
    return dataclasses.replace(spec.data_dependent, observed=found.sizes, values=found.values)


def _capture(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
             seq_dims: dict[int, tuple[int, ...]] | None = None) -> RawCapture:
    """Capture one steady-state step at ``batch`` (the symbol's hint when ``symbolic``).

    ``seq_dims`` (``id(sample tensor) -> dims``, symbolic captures only) makes those dims the
    sequence length ``s``, hinted by their size in the sample.

    Gradient accumulation over ``k = spec.strategy.accumulate`` micro-batches: the symbol is the
    micro-batch ``m`` (hint ``max(batch // k, 2)``), the fake sample's dim 0 is ``k·m`` (the
    step splits it into ``k`` views of ``m`` rows), and the bytes are mapped to ``b`` by
    ``m = b / k``: exact integer polynomials in ``b`` when ``k`` divides each coefficient
    (rounded up otherwise: ``RawCapture.rounded``); the range of ``b`` is ``k`` times that of
    ``m``.  (A pipeline's micro-batches are not captured here: ``estimate`` maps the plain
    step's formulas to ``b / m``.)
    """
    k = spec.strategy.accumulate
    if not symbolic and batch % k:
        raise CaptureError(f"accumulate={k}: the concrete capture at b={batch} needs a multiple of {k}")
    micro = max(batch // k, 2) if symbolic else batch // k
    if symbolic and k > 1 and seq_dims:  # equal hints would make m and s one symbol (duck sizing)
        sizes = {t.shape[d] for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor)
                 for d in seq_dims.get(id(t), ())}
        while micro in sizes:
            micro += 1
    shape_env = ShapeEnv() if symbolic else None
    mode = FakeTensorMode(shape_env=shape_env, static_shapes=not symbolic)
    memo: dict[int, Any] = {}  # the user's objects -> their fake copies
    fmodel = fake_model(model, mode, memo)
    compiled.eager(fmodel)  # the copy of a compiled module would call the user's module
    if spec.compiled is not None:
        spec.compiled.apply(fmodel)
    dims = spec.batch_dims
    rows, common_dim = sample_rows(sample, dims)
    if has_row_lists(dims):  # a list of dicts, one per row
        if symbolic:
            raise SymbolicCaptureFailed("the sample's row lists (a list of dicts, one per row) make the batch size a "
                                        "Python length")
        sample, dims = with_rows(sample, dims, micro)
    fsample = _full_batch(fake_sample(sample, mode, micro, symbolic, seq_dims if symbolic else None, dims), k, dims)
    batch_symbols = _batch_symbols(fsample, dims)
    module_names = {id(m): name for name, m in fmodel.named_modules()}

    def real_tensors(size: int, symbolic_: bool, repeat: int) -> RealTensors:  # batch-sized ones as the sample's
        def as_batch(t: torch.Tensor, d: int) -> torch.Tensor:
            return _full_batch(fake_sample(t, mode, size, symbolic_, None, (d,)), repeat, (d,))

        return RealTensors(mode, module_names, rows, common_dim, as_batch, spec.target.is_cuda)

    real = real_tensors(micro, symbolic, k)
    tracker = Tracker({id(m): name for name, m in fmodel.named_modules()}, spec.target)
    # A compiled step runs without the torch-function modes (Dynamo would trace into them): the
    # compiler decomposes what the substitutes stand for, and compiled.notes() says what is lost.
    substitutions = (
        Substitutions(spec.target) if corrections.has_substitutes(spec.target.device) and spec.compiled is None
        else contextlib.nullcontext()
    )
    # The fake tensors are CPU tensors, so torch.autocast("cpu") applies the CPU op lists: the
    # CUDA target's capture runs with CUDA's autocast policies instead (innermost: it casts the
    # arguments of substituted functions before the substitutes see them).
    amp_policy = (cuda_autocast.emulate() if spec.target.is_cuda and spec.precision.amp and spec.compiled is None
                  else contextlib.nullcontext())

    # Not only Strategy(checkpoint=): a model's own checkpointing (transformers'
    # activation_checkpointing_enable) and user code save the RNG state the same way.
    rng_states = _fake_rng_state() if not spec.target.is_cuda else contextlib.nullcontext()
    dd = datadep.DataDependent(spec.data_dependent, {id(m): name for name, m in fmodel.named_modules()})
    dd.shadow_sample(fsample, sample, dims)
    user = spec.step is not None
    lengths = generation.symbolic_lengths() if spec.mode is Mode.GENERATE else contextlib.nullcontext()
    runtime = compiled.fake_runtime(spec.compiled) if spec.compiled is not None else contextlib.nullcontext({})
    module_hooks = _module_hooks(tracker) if spec.compiled is None else contextlib.nullcontext()
    with Watchdog(), _errors_named(symbolic), runtime as regions, mode, dd, substitutions, amp_policy, rng_states, \
            _user_step_context(spec), lengths:
        # Inside the fake mode: some optimizers (Adagrad) create their state when constructed.
        if user:
            warm = _user_warm_up(fmodel, fsample, spec, memo, real, module_names)
        else:
            warm = _built_in_warm_up(fmodel, fsample, spec, real_tensors(batch, False, 1))
        run_step, optimizers = warm.run_step, warm.optimizers
        _register_state(tracker, warm.state, warm.kept, _host_state(spec, optimizers))
        _mark_births(tracker, fmodel, warm.state, warm.lazy)
        warm.state, warm.kept = {}, []  # the step alone decides what stays alive (zero_grad() frees the gradients)
        _name_owners(tracker, fmodel, optimizers)
        before = _model_state(fmodel)
        phases = _phases(tracker, fmodel) if user else contextlib.nullcontext()
        dd.new_step()
        decoding = _decoding(tracker, fmodel) if spec.mode is Mode.GENERATE else contextlib.nullcontext({})
        with tracker, module_hooks, _grad_order(fmodel) as grad_order, real.track(tracker), phases, \
                _run_marks(tracker, fmodel, optimizers, watch_model=not user) as marks, decoding as decoded:
            result = run_step(_on_phase(tracker, fmodel))
        tracker.flush()
        after = _model_state(fmodel)
        end = tracker.phase if user else Phase.OPTIMIZER if spec.mode is Mode.TRAIN else Phase.FORWARD
        _label_storages(tracker, fmodel, optimizers, end)
        if not user:  # a user's warm-up step created state only where a real first step does
            _drop_state_without_grad(tracker, optimizers, warm.constructed)
        graph = tracker.recorder.finish([t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)])
        del result
        leak = _step_growth(tracker, shape_env) if user else ()

    def grown() -> tuple[str, ...]:  # last: its extra step must not add guards to what was read
        return _growth_note(fmodel, run_step, mode, real, before, after, micro)

    unknown = set(spec.data_dependent.sites) - set(dd.sites)
    if unknown:
        raise InputError(f"data_dependent names no data-dependent call of this step: {', '.join(sorted(unknown))}; "
                         f"its calls: {', '.join(dd.sites) or 'none'}")
    if symbolic:  # a batch size the model's code fixed fails here, before any kernel is priced at other sizes
        _symbol_range(shape_env, batch_symbols[0], "batch size", SymbolicCaptureFailed)
    notes = _price_host_kernels(tracker, shape_env, batch_symbols[0], micro)
    notes += custom_ops.notes(tracker.ops, tracker.target)  # which ops' memory a user declared
    notes += held_note(model) + real.notes() + warm.notes + leak + datadep.assumed_note(dd.assumed)
    notes += datadep.host_note(dd.host_reads)
    if user and spec.mode is Mode.TRAIN and not any(op.phase is Phase.BACKWARD for op in tracker.ops):
        notes += ("mode='train', but your step ran no backward (no backward() or torch.autograd.grad()): "
                  "estimated as it ran, without gradients; if your real step backpropagates, check that the step "
                  "you passed is the one your loop runs",)
    if spec.compiled is not None:
        notes += compiled.regions_note(regions)
    if not symbolic:
        storages = {sid: _with_bytes(s, Poly.const(int(s.nbytes) + int(s.extra))) for sid, s in tracker.storages.items()}
        for op in tracker.ops:
            op.scratch = tuple(Poly.const(int(x)) for x in op.scratch)
        sites = tuple(dd.sites.values())
        return RawCapture(tracker.ops, storages, graph, batch, batch, (), grad_order=tuple(grad_order),
                          notes=notes + datadep.notes(sites) + grown(), data_dependent=sites,
                          freed_first=tuple(tracker.freed_first), marks=marks["marks"], decoding=decoded.get("decoding"))
    raw = _to_batch_symbol(tracker, graph, shape_env, batch_symbols, k, tuple(dd.sites.values()))
    raw.grad_order, raw.notes = tuple(grad_order), notes + datadep.notes(raw.data_dependent) + grown()
    raw.marks, raw.decoding = marks["marks"], decoded.get("decoding")
    return raw


def _price_host_kernels(tracker: Tracker, shape_env: ShapeEnv | None, batch: set, micro: int) -> tuple[str, ...]:
    """Measure the calls the corrections mark ``@measured`` on this host (CPU target,
    ``estimator.corrections.cpu.host``), in the capture's batch symbol (the micro-batch with
    accumulation)."""
    calls = [op.kernel for op in tracker.ops if op.kernel is not None]
    if not calls:
        return ()
    if shape_env is None:
        return cpu_target.price(calls, tracker.storages, tracker.ops, batch=micro)
    canonical = {shape_env.replace(s) for s in batch}
    symbol = next(iter(canonical))
    valid_from, _ = _symbol_range(shape_env, batch, "batch size", SymbolicCaptureFailed)
    to_b = {s: B for s in canonical | set(batch)}  # the micro-batch's range (the kernels run at micro-batches)
    valid_from, _ = _narrow(valid_from, None, [g.expr.xreplace(to_b) for g in shape_env.guards
                                               if g.expr.free_symbols & set(to_b)], B)

    def values(m: int) -> dict:  # every symbol that is a function of the batch alone, at batch m
        at_m = {c: sympy.Integer(m) for c in canonical}
        known = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
        subs = {s: sympy.sympify(shape_env.replace(s)).xreplace(at_m) for s in [*known, *batch]}
        return {s: v for s, v in subs.items() if v.is_Integer} | at_m

    values = functools.cache(values)
    return cpu_target.price(calls, tracker.storages, tracker.ops, batch=micro, symbol=symbol, values=values,
                            valid_from=valid_from)


@contextlib.contextmanager
def _fake_rng_state():
    """CPU target (every capture: ``Strategy(checkpoint=)``, a model's own checkpointing, user
    code): ``torch.get_rng_state()`` as a fake tensor of the real state's size (5,056 B for the
    Mersenne Twister), which the tracker sees, and ``torch.set_rng_state`` of a fake state as a
    no-op.

    ``torch.utils.checkpoint`` (``preserve_rng_state=True``, the default) keeps the CPU RNG
    state of each checkpointed forward until its recomputation, and ``torch.random.fork_rng``
    copies it again around the recomputation; the real state is a CPU tensor made outside the
    dispatcher, invisible to the tracker.  On the CUDA target that copy is host memory (not
    counted), so this applies to the CPU target only."""
    get, set_ = torch.get_rng_state, torch.set_rng_state
    nbytes = get().numel()

    def fake_set(new_state):
        if not isinstance(new_state, FakeTensor):
            set_(new_state)

    torch.get_rng_state, torch.set_rng_state = lambda: torch.empty(nbytes, dtype=torch.uint8), fake_set
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = get, set_


def _full_batch(fsample, k: int, batch_dims: tuple[int, ...] | None = None):
    """The fake sample of ``k`` micro-batches: the batch dim (``batch_dims``: per leaf of
    ``tree_flatten``, default 0) repeated ``k`` times (one tensor under two names stays one)."""
    if k == 1:
        return fsample
    done: dict[int, torch.Tensor] = {}
    leaves, tree = tree_flatten(fsample)

    def repeat(t: torch.Tensor, d: int) -> torch.Tensor:
        if id(t) not in done:
            done[id(t)] = t.repeat(*[k if i == d else 1 for i in range(t.dim())])
        return done[id(t)]

    dims = batch_dims or (0,) * len(leaves)
    return tree_unflatten([repeat(t, d) if isinstance(t, torch.Tensor) else t for t, d in zip(leaves, dims)], tree)


@dataclass
class _WarmedUp:
    """A step at its steady state: ``run_step(on_phase)`` runs it; ``state`` the tensors alive
    before it by category; ``kept`` the storages a user's step keeps that no tensor names;
    ``constructed`` the ids of the parameters the optimizer gave state when constructed;
    ``lazy`` the state a real run's first step makes (``_lazy_births``)."""

    run_step: Any
    optimizers: list
    state: dict
    kept: list = field(default_factory=list)
    constructed: set[int] = field(default_factory=set)
    notes: tuple[str, ...] = ()
    lazy: dict[int, Born] = field(default_factory=dict)


def _lazy_births(optimizers: list, constructed: set[int], scalers: list) -> dict[int, Born]:
    """``id(tensor) -> Born`` of the state a real run's first step makes: each optimizer's state
    but what its constructor made (Adagrad), made by its first ``step()``
    (``Optimizer._init_group``/``_init_state`` run inside it); a ``GradScaler``'s scale and growth
    tracker, made by its first ``scale(loss)`` (counted from the first backward)."""
    born = {}
    for i, optimizer in enumerate(optimizers):
        for param, values in optimizer.state.items():
            if id(param) not in constructed:
                born |= {id(v): Born(Birth.OPTIMIZER, i) for v in values.values() if isinstance(v, torch.Tensor)}
    for scaler in scalers:
        born |= {id(t): Born(Birth.BACKWARD) for t in step.scaler_state(scaler).values()}
    return born


def _mark_births(tracker: Tracker, model: nn.Module, state: dict, lazy: dict[int, Born]) -> None:
    """``Storage.born`` of the state alive before the step: parameters and buffers in the order
    ``model.to(device)`` moves them (``Module._apply``: children first, then the module's own
    parameters, then its buffers; tensors it holds elsewhere after them), inputs a new batch per
    step, gradients a step keeps made by the first backward, optimizer state by ``lazy`` (else
    made before the first step: an EMA copy, a constructor's state, what a user's step keeps)."""

    def walk(module: nn.Module):
        for child in module.children():
            yield from walk(child)
        yield from (t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)

    order = {}
    for t in walk(model):
        order.setdefault(tracker.key_of(t), len(order))
    by_category = {Category.INPUT: Born(Birth.BATCH), Category.GRADIENT: Born(Birth.BACKWARD)}
    for category, tensors in state.items():
        for t in tensors.values():
            key = tracker.key_of(t)
            if key is None or tracker.storages[key].born is not None:
                continue
            if category in (Category.PARAMETER, Category.BUFFER):
                born = Born(Birth.LOAD, order.get(key, len(order)))
            else:
                born = by_category.get(category) or lazy.get(id(t), Born(Birth.SETUP))
            tracker.storages[key].born = born
    for stored in tracker.storages.values():  # storages no tensor names (a user's step keeps them)
        if stored.op < 0 and stored.born is None:
            stored.born = Born(Birth.SETUP)


def _register_state(tracker: Tracker, state: dict, kept: list, on_host: set[int]) -> None:
    """The tensors alive before the step, by category (but those the target keeps in host
    memory), and the storages a user's step keeps that no tensor names (as optimizer state)."""
    for category, tensors in state.items():
        tracker.register({name: t for name, t in tensors.items() if id(t) not in on_host}, category)
    tracker.register_storages(kept, Category.OPTIMIZER_STATE)


def _built_in_warm_up(fmodel: nn.Module, fsample, spec: StepSpec, real: RealTensors):
    """Build the built-in step's optimizer (and ``GradScaler``) and reach its steady state
    (``_warm_up``)."""
    optimizer, scaler = step.prepare(fmodel, spec.mode, spec.optimizer, spec.precision)
    corrections.apply_optimizer_rules(spec.target, optimizer)
    constructed = set() if optimizer is None else {id(p) for p, values in optimizer.state.items() if values}
    with real:  # a lazy model's first step: a static sample of the batch's rows
        _warm_up(fmodel, optimizer, scaler)

    def run_step(on_phase=lambda phase: None):
        return step.run(fmodel, fsample, spec.mode, optimizer, spec.loss_fn, on_phase, spec.precision, scaler,
                        spec.strategy, spec.batch_dims, spec.keep_output)

    optimizers = [] if optimizer is None else [optimizer]
    return _WarmedUp(run_step, optimizers, step.state_tensors(fmodel, optimizer, fsample, scaler),
                     constructed=constructed, lazy=_lazy_births(optimizers, constructed, [scaler] if scaler else []))


def _warm_up(model: nn.Module, optimizer, scaler) -> None:
    """Reach the steady state the measured step starts from.

    Optimizer state is created lazily by the first ``step()``; it depends on the parameters'
    shapes only, so a step on zero gradients creates it without a forward and backward.  A
    ``GradScaler`` creates its scale and growth tracker at its first ``scale()``: scaling a
    zero loss does, and ``scaler.step``/``update`` then run as in a real first step.  (Lazy
    modules with uninitialised parameters are refused before: ``fake.fake_model``.)
    """
    if scaler is not None:
        scaler.scale(torch.zeros((), device=step.device_type(model)))
    if optimizer is not None:
        for p in step.trainable(model):
            p.grad = torch.zeros_like(p)
        step.optimizer_step(optimizer, scaler)


def _user_warm_up(fmodel: nn.Module, fsample, spec: StepSpec, memo: dict, real: RealTensors,
                  module_names: dict[int, str]):
    """Build the state the user's step is handed (``spec.optimizer(model)``) and run the step once,
    unrecorded: the steady state, whatever the step keeps between steps (optimizer state,
    gradients it does not set to None, an EMA copy, a list it appends to).  The step function is
    a copy whose closure and global containers are copies, the model it names the fake one
    (``fake.isolated``).  ``state``: ``step.user_state_tensors``; ``kept``: the other storages the
    setup and the warm-up step left alive (held by the step's code)."""
    fn = isolated(spec.step, memo)
    births = Tracker(module_names, spec.target)  # every storage the setup and the warm-up create
    with births, real:
        user_state = step.user_state(fmodel, spec.mode, spec.optimizer)
        optimizers = step.optimizers_in(user_state)
        for optimizer in optimizers:
            corrections.apply_optimizer_rules(spec.target, optimizer)
        constructed = {id(p) for optimizer in optimizers for p, values in optimizer.state.items() if values}
        # generate(): a prefill-only call makes what a model makes once (the cache is made per
        # call); the full call would double the capture's cost for nothing
        first = dataclasses.replace(fn, new_tokens=1) if isinstance(fn, step.Generation) else fn
        with checkpointing(fmodel, spec.strategy):
            result = first(fmodel, fsample, user_state)
        del result
    gc.collect()
    state = step.user_state_tensors(fmodel, user_state, fsample)
    known = {t.untyped_storage()._cdata for tensors in state.values() for t in tensors.values()}
    kept = [s for s in births.alive_storages() if s._cdata not in known]

    notes = ()
    if kept:
        notes = (f"your step keeps {len(kept)} tensor(s) alive between steps besides the model, the gradients and "
                 "what its state holds (a list it appends to, a cache, a closure's tensors): "
                 f"{sum(_hint(s.nbytes()) for s in kept):,} B at the capture's batch, counted as optimizer state",)

    def run_step(on_phase=lambda phase: None):  # the phases are found as the step runs (_phases)
        with checkpointing(fmodel, spec.strategy):
            return fn(fmodel, fsample, user_state)

    lazy = _lazy_births(optimizers, constructed, step.instances_in(user_state, torch.amp.GradScaler))
    return _WarmedUp(run_step, optimizers, state, kept, notes=notes, lazy=lazy)


@contextlib.contextmanager
def _run_marks(tracker: Tracker, model: nn.Module, optimizers: list, watch_model: bool):
    """``RunMarks`` of the recorded step: the op each optimizer's ``step()`` starts at and, with
    ``watch_model`` (the built-in step), the op the first call of the model returns before;
    yields a dict whose ``"marks"`` is set when the step has run."""
    starts: dict[int, int] = {}
    returns: list[int] = []
    index = {id(optimizer): i for i, optimizer in enumerate(optimizers)}

    def step_started(optimizer, *_):
        if id(optimizer) in index:
            starts.setdefault(index[id(optimizer)], len(tracker.ops))

    handles = [torch_optimizer.register_optimizer_step_pre_hook(step_started)]
    compiled_call = getattr(model, "_compiled_call_impl", None)
    if watch_model and compiled_call is None:
        handles.append(model.register_forward_hook(lambda *_: returns.append(len(tracker.ops))))
    elif watch_model:  # a forward hook would run inside the compiled region, traced: its len() frozen there
        def call(*args, **kwargs):
            out = compiled_call(*args, **kwargs)
            returns.append(len(tracker.ops))
            return out

        model._compiled_call_impl = call
    found: dict[str, RunMarks] = {}
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
        if watch_model and compiled_call is not None:
            model._compiled_call_impl = compiled_call
    found["marks"] = RunMarks(tuple(starts.get(i) for i in range(len(optimizers))), returns[0] if returns else None)


@contextlib.contextmanager
def _decoding(tracker: Tracker, model: nn.Module):
    """While ``model.generate`` is recorded: the op each call of the model starts at, and after
    each call the KV cache its output carries (``cache``, ``past_key_values`` before transformers
    renamed it: every tensor the cache object holds) labelled ``Category.KV_CACHE`` for its whole life (a dynamic cache's ``torch.cat``
    results, a static cache's buffers); yields a dict whose ``"decoding"`` is set when the step
    has run."""
    calls: list[int] = []
    last: dict[str, Any] = {}

    def returned(module, args, output):
        keys = output.keys() if isinstance(output, Mapping) else ()  # a ModelOutput: its fields that are set
        name = next((k for k in ("cache", "past_key_values") if k in keys), None)  # transformers >= 5.2x: cache
        if name is None:
            return
        cache = output[name]
        tensors = [t for t in step.tensors_in(cache).values() if t.dim() >= 3]
        for t in tensors:
            _relabel(tracker, t, Category.KV_CACHE)
        # keys/values are (batch, heads, tokens, head_dim): bytes per token and sequence
        per_token = [t.element_size() * math.prod(_hint(n) for n in (*t.shape[1:-2], t.shape[-1])) for t in tensors]
        last.update(bytes_per_token=sum(per_token),
                    tokens=max((_hint(t.shape[-2]) for t in tensors), default=0), cache=type(cache).__name__)

    handles = [model.register_forward_pre_hook(lambda *_: calls.append(len(tracker.ops))),
               model.register_forward_hook(returned)]
    found: dict[str, Decoding] = {}
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
    found["decoding"] = Decoding(tuple(calls), **last)


@contextlib.contextmanager
def _user_step_context(spec: StepSpec):
    """While a user's step is captured: its ``GradScaler`` assumes finite gradients on fake
    tensors (``step.finite_gradients``), a deep copy of the fake model (an EMA copy) stays in the
    capture's fake mode (``deep_copies_in_mode``), and on the CUDA target its
    ``torch.autocast("cuda")`` regions autocast the fake CPU tensors with CUDA's op lists
    (``cuda_autocast.device_autocast``)."""
    if spec.step is None:
        yield
        return
    with step.finite_gradients(), deep_copies_in_mode(), (
            cuda_autocast.device_autocast() if spec.target.is_cuda else contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def _phases(tracker: Tracker, model: nn.Module):
    """The phases of a user's step, found as it runs: ops inside ``backward()`` /
    ``torch.autograd.grad`` (the autograd engine running) are the backward, ops inside an
    ``optimizer.step()`` the optimizer step; after a backward, ops outside any module call
    (gradient clipping, an EMA update) belong to the optimizer phase, until a module is called
    again (the next forward).  Each change labels what the phase left behind, as the built-in
    step's callbacks do."""
    on_phase = _on_phase(tracker, model)
    depth = [0, 0]  # backward calls, optimizer steps in progress

    def backward(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapped

    def now() -> Phase:
        if depth[0] or torch._C._current_graph_task_id() != -1:
            return Phase.BACKWARD
        if depth[1]:
            return Phase.OPTIMIZER
        if tracker.phase is Phase.FORWARD or tracker.in_module():
            return Phase.FORWARD
        return Phase.OPTIMIZER

    def update() -> None:
        phase = now()
        if phase is not tracker.phase:
            on_phase(phase)

    def enter(*_):
        depth[1] += 1

    def leave(*_):
        depth[1] -= 1

    saved = torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad
    torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad = map(backward, saved)
    handles = [torch_optimizer.register_optimizer_step_pre_hook(enter),
               torch_optimizer.register_optimizer_step_post_hook(leave)]
    tracker.before_op = update
    try:
        yield
    finally:
        tracker.before_op = None
        torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad = saved
        for handle in handles:
            handle.remove()


def _host_state(spec: StepSpec, optimizers: list) -> set[int]:
    """ids of the optimizer state tensors the target keeps in host memory (not counted)."""
    return {
        id(value)
        for optimizer in optimizers
        for group in optimizer.param_groups
        for p in group["params"]
        for key, value in optimizer.state.get(p, {}).items()
        if isinstance(value, torch.Tensor) and corrections.on_host(spec.target.device, optimizer, group, key, value)
    }


def _with_bytes(storage: Storage, nbytes: Poly) -> Storage:
    return dataclasses.replace(storage, nbytes=nbytes, extra=0)  # extra folded into nbytes


def _batch_symbols(fsample, batch_dims: tuple[int, ...] | None = None) -> tuple[set[sympy.Symbol], set[sympy.Symbol]]:
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


def _symbol_range(shape_env: ShapeEnv, symbols, what: str, error: type) -> tuple[int, int | None]:
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


def _narrow(lo: int, hi: int | None, guards, symbol: sympy.Symbol) -> tuple[int, int | None]:
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


def _to_batch_symbol(tracker: Tracker, graph, shape_env: ShapeEnv, symbols, k: int = 1,
                     sites: tuple[datadep.Site, ...] = ()) -> RawCapture:
    """Map the batch symbols to ``b`` (and the sequence symbols to ``s``) and read the valid
    ranges from the guards.  With ``k`` micro-batches the batch symbol is the micro-batch
    ``m = b / k``."""
    batch, seq = symbols
    lo, hi = _symbol_range(shape_env, batch, "batch size", SymbolicCaptureFailed)
    lo, hi = k * lo, None if hi is None else k * hi
    seq_lo, seq_hi = _symbol_range(shape_env, seq, "sequence length", SequenceNotSymbolic)
    micro = B / k if k > 1 else B
    rounded: list[str] = []  # micro-batch byte counts whose coefficients were rounded up
    to_b = {shape_env.replace(s): micro for s in batch} | {s: micro for s in batch}
    to_b |= {shape_env.replace(s): S for s in seq} | {s: S for s in seq}
    exprs = [g.expr.xreplace(to_b) for g in shape_env.guards if g.expr.free_symbols & set(to_b)]
    lo, hi = _narrow(lo, hi, exprs, B)
    seq_lo, seq_hi = _narrow(seq_lo, seq_hi, exprs, S)
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
        sid: _with_bytes(s, to_poly(s.nbytes) + to_poly(s.extra, bound=True)) for sid, s in tracker.storages.items()
    }
    for op in tracker.ops:
        op.scratch = tuple(to_poly(x, bound=True) for x in op.scratch)
    in_graph = functools.lru_cache(maxsize=None)(lambda e: e.xreplace(to_b))
    for node in graph.nodes:  # symbolic sizes in the graph's arguments, in terms of b (and s)
        args, kwargs = map_exprs(node.args, in_graph), map_exprs(node.kwargs, in_graph)
        if args is not node.args or kwargs is not node.kwargs:
            node.args, node.kwargs = args, kwargs

    def in_b(expr):
        return sympy.expand(shape_env.replace(sympy.sympify(expr)).xreplace(to_b))

    sites = tuple(dataclasses.replace(site, upper=in_b(site.upper), used=in_b(site.used)) for site in sites)
    return RawCapture(tracker.ops, storages, graph, lo, hi, guards, (seq_lo, seq_hi) if seq else None,
                      rounded=tuple(dict.fromkeys(rounded)), data_dependent=sites,
                      freed_first=tuple(tracker.freed_first))


def _integer_in_micro(expr, k: int) -> bool:
    """Whether ``expr`` (in ``b``, the micro-batch being ``b / k``) is an integer polynomial in
    the micro-batch."""
    try:
        Poly.of(sympy.expand(expr.xreplace({B: k * B})))
    except (NotPolynomial, sympy.PolynomialError):
        return False
    return True


def _on_phase(tracker: Tracker, model: nn.Module):
    def on_phase(phase: Phase) -> None:
        _label_storages(tracker, model, (), phase_ended=tracker.phase)
        tracker.phase = phase

    return on_phase


def _label_storages(tracker: Tracker, model: nn.Module, optimizers, phase_ended: Phase) -> None:
    """Name what a phase leaves behind: forward allocations still alive when it ends are
    activations (saved for backward, and the outputs); grads alive after backward are
    gradients; tensors in the optimizers' state are optimizer state."""
    if phase_ended is Phase.FORWARD:
        for key in tracker.alive_keys():
            storage = tracker.storages[key]
            forward = storage.op >= 0 and tracker.ops[storage.op].phase is Phase.FORWARD
            if forward and storage.category is Category.TEMPORARY:
                storage.category = Category.ACTIVATION
    elif phase_ended is Phase.BACKWARD:
        tracker.params_with_grad = set()
        for name, p in model.named_parameters():
            if p.grad is not None:
                tracker.params_with_grad.add(id(p))
                _relabel(tracker, p.grad, Category.GRADIENT)
                _own(tracker, p.grad, name)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for t in tree_flatten(state)[0]:
                if isinstance(t, torch.Tensor):
                    _relabel(tracker, t, Category.OPTIMIZER_STATE)


def _drop_state_without_grad(tracker: Tracker, optimizers: list, constructed: set[int]) -> None:
    """The warm-up gave every trainable parameter a (zero) gradient, so each has optimizer
    state; a real run creates none for a parameter that no loss reaches (``_init_group`` skips
    ``p.grad is None``: an unused pooler, a frozen branch).  Such state is not counted -- unless
    the optimizer created it when constructed (Adagrad: every parameter it is given has state)."""
    if tracker.params_with_grad is None:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in tracker.params_with_grad or id(p) in constructed:
                    continue
                for value in optimizer.state.get(p, {}).values():
                    key = tracker.key_of(value) if isinstance(value, torch.Tensor) else None
                    if key is not None and tracker.storages[key].op < 0:
                        del tracker.storages[key]


def _relabel(tracker: Tracker, t: torch.Tensor, category: Category) -> None:
    key = tracker.key_of(t)
    if key is not None and tracker.storages[key].op >= 0:
        tracker.storages[key].category = category


def _name_owners(tracker: Tracker, model: nn.Module, optimizers: list) -> None:
    """``Storage.owner``: the parameter name of each parameter storage and of its optimizer
    state (gradients are named when backward ends): what sharding and pipeline stages divide by
    parameter."""
    for name, p in model.named_parameters():
        states = [optimizer.state.get(p, {}) for optimizer in optimizers]
        for t in [p, *(v for state in states for v in state.values() if isinstance(v, torch.Tensor))]:
            _own(tracker, t, name)


def _own(tracker: Tracker, t: torch.Tensor, name: str) -> None:
    key = tracker.key_of(t)
    if key is not None and key in tracker.storages and tracker.storages[key].owner is None:
        tracker.storages[key].owner = name


@contextlib.contextmanager
def _grad_order(model: nn.Module):
    """The names of the parameters in the order their ``AccumulateGrad`` ran (where DDP's reducer
    hooks in), first time each; hooks removed on exit."""
    order: dict[str, None] = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.setdefault(name))
        for name, p in model.named_parameters() if p.requires_grad
    ]
    names: list[str] = []
    try:
        yield names
    finally:
        for handle in handles:
            handle.remove()
        names += order


@contextlib.contextmanager
def _module_hooks(tracker: Tracker):
    """Module paths for every op: global forward hooks, removed on exit."""
    pre = nn.modules.module.register_module_forward_pre_hook(lambda m, args: tracker.enter_module(m))
    post = nn.modules.module.register_module_forward_hook(lambda m, args, out: tracker.exit_module(m))
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def _model_state(model: nn.Module) -> dict[str, int]:
    """Bytes of each parameter and buffer (held tensors included) of the fake model, at the
    symbols' hints."""
    state = step.state_tensors(model, None, ())
    return {name: _hint(t.untyped_storage().nbytes())
            for category in (Category.PARAMETER, Category.BUFFER) for name, t in state[category].items()}


def _hint(value) -> int:
    if isinstance(value, torch.SymInt):  # the hint: int() would add a guard
        return int(value.node.hint or 0)
    return int(value)


def _step_growth(tracker: Tracker, shape_env: ShapeEnv | None) -> tuple[str, ...]:
    """A note when a user's step holds more once it returned than before it started (its result
    dropped): what it allocated and keeps (a list of losses it appends to) minus the state it
    freed.  There is then no steady state: every later step starts higher."""
    gc.collect()
    alive = tracker.alive_keys()
    known = {} if shape_env is None else (getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val)

    def nbytes(s: Storage) -> int:
        return int(sympy.sympify(s.nbytes).xreplace(known)) + int(sympy.sympify(s.extra).xreplace(known))

    kept = [s for key, s in tracker.storages.items() if s.op >= 0 and key in alive]
    freed = [s for key, s in tracker.storages.items() if s.op < 0 and key not in alive]
    grown = sum(map(nbytes, kept)) - sum(map(nbytes, freed))
    if grown <= 0:
        return ()
    ops = ", ".join(dict.fromkeys(tracker.ops[s.op].name for s in kept))
    return (f"your step holds {grown:,} B more when it returns than when it started (at the capture's batch; "
            f"allocated by {ops} and still referenced: a list it appends to?). There is no steady state: this is "
            "the next step's peak, and every later step starts that much higher",)


def _growth_note(model: nn.Module, run_step, mode: FakeTensorMode, real: RealTensors, before: dict[str, int],
                 after: dict[str, int], batch: int) -> tuple[str, ...]:
    """A note when the model holds more after each step than before it (a buffer or a list of
    tensors appended to in ``forward``): no steady state.  The measured step was the fake
    model's first, so state it created once (a cache) also looks like growth: only then is one
    more step (``run_step()``) run, not recorded, to see whether it grows again."""
    if sum(after.values()) <= sum(before.values()):
        return ()
    real.tracker = None  # the capture is over: tensors met now are not memory of the step
    try:
        with Watchdog(), mode, real:
            result = run_step()
            del result
    except Exception:  # the step cannot be repeated without the capture's modes: cannot tell
        return ()
    again = _model_state(model)
    grown = sum(again.values()) - sum(after.values())
    if grown <= 0:
        return ()
    names = [name for name, n in again.items() if n > after.get(name, 0)]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return (f"the model's memory grows with every step: it holds {grown:,} B more after each step at b = {batch} "
            f"({shown}: a buffer or a list of tensors added to in forward). There is no steady state: this "
            "estimate is for the next step from the model as given, and every later step holds more",)


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs")


@contextlib.contextmanager
def _global_hooks_suspended():
    """Take the process's global module hooks (``register_module_forward_hook`` and the like)
    out while fxmem runs the step: they would be handed fake tensors.  Yields how many there
    were; they are back in place, in order, on exit."""
    module = nn.modules.module
    saved = {name: dict(getattr(module, name)) for name in _GLOBAL_HOOKS if hasattr(module, name)}
    for name in saved:
        getattr(module, name).clear()
    hooks = sum(len(saved.get(name, {})) for name in _GLOBAL_HOOKS[:4])
    try:
        yield hooks
    finally:
        for name, entries in saved.items():
            table = getattr(module, name)
            added = dict(table)  # registered meanwhile and not removed (not fxmem's: it removes its own)
            table.clear()
            table.update(entries)
            table.update(added)


@contextlib.contextmanager
def _conversions_as_for_real():
    """``module.to(dtype)`` / ``.float()`` / ``.type()`` during the step, as for real tensors.

    ``nn.Module._apply`` converts a FakeTensor parameter with ``torch.utils.swap_tensors``
    (torch/nn/modules/module.py: ``isinstance(param, FakeTensor)``) where a real one is converted
    with ``param.data = param_applied``; the swap refuses tensors that have weak references, as
    the capture's fake parameters do ("Couldn't swap Linear.weight").  While the step runs, a
    swap of a tensor with itself (a conversion that changes nothing) is the no-op it is for real
    tensors, and a refused swap sets ``.data``, as for real tensors: the old storage goes when
    nothing else holds it, the new one is the conversion's copy (priced where it was made)."""
    swap = torch.utils.swap_tensors

    def as_for_real(t1, t2):
        if t1 is t2:
            return
        try:
            swap(t1, t2)
        except RuntimeError:
            t1.data = t2

    torch.utils.swap_tensors = as_for_real
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


@contextlib.contextmanager
def quiet():
    """Torch's log records and warnings are not the user's business while fxmem runs the step
    on fake tensors (a shape error logs a traceback at ERROR before fxmem's one-line error):
    torch's loggers are disabled and warnings recorded for the block, both restored on exit.
    Warnings raised from the user's own files are issued again afterwards, once each; what
    matters of the others is in fxmem's errors and notes."""
    loggers = [logging.getLogger("torch")] + [
        logger for name, logger in list(logging.root.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(logger, logging.Logger)
    ]
    disabled = [(logger, logger.disabled) for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for logger, was in disabled:
            logger.disabled = was
    seen = set()
    for w in caught:
        key = (str(w.message), w.category, w.filename, w.lineno)
        if not w.filename.startswith(_INTERNAL) and key not in seen:
            seen.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


@contextlib.contextmanager
def _errors_named(symbolic: bool):
    """Turn an exception from deep inside torch into one that names the op or line."""
    try:
        yield
    except FxmemError:
        raise
    except Exception as exc:  # re-raised with a clear message
        where = _user_frame(exc)
        undeclared = custom_ops.undeclared_op(exc, where)  # an op without a fake kernel: how to declare it
        if undeclared is not None:
            raise undeclared from exc
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if where:
            message += f" (at {where})"
        cls = SymbolicCaptureFailed if symbolic else CaptureError
        raise cls(f"the model could not be run on fake tensors: {message}") from exc


def _user_frame(exc: BaseException) -> str | None:
    """The innermost frame of the traceback outside torch and fxmem: the user's line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not frame.filename.startswith(_INTERNAL):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"
    return None
