"""Run the user's step on fake tensors and record it: an fx graph plus allocation events.

``capture(..., symbolic=True)`` makes dim 0 of the sample one symbol and records bytes as
polynomials in ``b``; ``symbolic=False`` runs at one concrete batch size (the fallback path
runs it at several sizes and fits, see ``estimator.orchestrate.path``).

Here: the entry point, the probe on the real sample where the step needs data-dependent values,
the capture itself with the warm-ups that reach the steady state, and its notes (host-measured
kernels, a step or model that grows).  The rest of the capture lives beside it: what a capture is
asked and returns in ``records``, the batch symbol and its range in ``symbols``, the phases,
births and owners marked while the step runs in ``phases``, and keeping the user's process
untouched and torch quiet in ``isolation``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import math
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_flatten, tree_unflatten

from estimator import corrections
from estimator.capture import (
    compiled,
    datadep,
    decode_steps,
    depth,
    generation,
    growth,
    isolation,
    phases,
    pipelines,
    repeated_blocks,
    steps,
    symbols,
    tracing,
    value_notes,
    world,
)
from estimator.capture.checkpointing import checkpointing
from estimator.capture.fake import (
    RealTensors,
    fake_model,
    fake_sample,
    has_row_lists,
    held_note,
    isolated,
    sample_rows,
    with_rows,
)
from estimator.capture.records import RawCapture, StepSpec
from estimator.capture.tracker import Tracker
from estimator.capture.watchdog import Watchdog
from estimator.corrections import custom_ops, libraries
from estimator.corrections.cpu import host as cpu_target
from estimator.corrections.cpu import matmul as cpu_matmul
from estimator.corrections.cuda import autocast as cuda_autocast
from estimator.corrections.mode import Substitutions
from estimator.vocab import progress
from estimator.vocab.bookkeeping import collector_fresh
from estimator.vocab.categories import Born, Category, Mode, Phase
from estimator.vocab.data_dependent import Policy, Routing, Source
from estimator.vocab.errors import CaptureError, InputError, SymbolicCaptureFailed
from estimator.vocab.symbolic import B, Poly


def capture(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
            seq_dims: dict[int, tuple[int, ...]] | None = None, deeper: bool = False) -> RawCapture:
    """Capture one steady-state step (``_capture``); with ``data_dependent='sample'``, or where
    the step needs a data-dependent value (``.item()``), the sizes and values observed on the
    real sample first (``datadep.probe``).  Torch's log records and warnings are kept from the
    user (``isolation.quiet``).  ``deeper``: the step of the model one unit of its repeated blocks
    deeper (``depth.deepen``: its config says so), what ``report(depth_symbols=True)``
    checks its formula against."""
    libraries.load_imported()  # the entries of the libraries the model or its optimizer imported
    with isolation.quiet(), isolation.conversions_as_for_real(), tracing.as_for_real(), \
            isolation.optimizer_overrides_kept(), isolation.global_hooks_suspended() as suspended:
        raw = _capture_steps(model, sample, spec, batch, symbolic, seq_dims, deeper)
    if suspended:
        raw.notes += (f"{suspended} global module hook(s) (torch.nn.modules.module.register_module_forward_hook and "
                      "the like) were not run by the capture (they would have been handed fake tensors): memory "
                      "they keep alive is not counted",)
    return raw


def _capture_steps(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
                   seq_dims: dict[int, tuple[int, ...]] | None = None, deeper: bool = False) -> RawCapture:
    """``_capture_generated``; a model whose blocks repeat from a capture of a few of them
    extended to all (``repeated_blocks``), or every block where the capture does not prove they repeat."""
    blocks = repeated_blocks.plan(model, spec)
    if deeper:
        if blocks is None:
            raise CaptureError("its blocks do not repeat")
        more = dataclasses.replace(blocks, units=blocks.units + 1)
        copy_ = repeated_blocks.shallow(model, more, blocks)
        if not depth.deepen(copy_, blocks):
            raise CaptureError(f"no config of the model names its number of blocks ({', '.join(depth.NAMES)})")
        try:
            return _capture_generated(copy_, sample, spec, batch, symbolic, seq_dims, more)
        except repeated_blocks.NotRepeating as exc:
            raise CaptureError(f"the model one unit deeper: {exc}") from None
    if blocks is None:
        return _capture_generated(model, sample, spec, batch, symbolic, seq_dims)
    try:
        return _capture_generated(repeated_blocks.shallow(model, blocks), sample, spec, batch, symbolic, seq_dims,
                                  blocks)
    except SymbolicCaptureFailed:  # the batch symbol's failure, not the depth's: the concrete captures use blocks too
        raise
    except Exception as exc:  # noqa: BLE001 (code that counts the blocks, indexes them: the full model runs)
        reason = exc if isinstance(exc, repeated_blocks.NotRepeating) else f"the shallow copy failed: {exc}"
    raw = _capture_generated(model, sample, spec, batch, symbolic, seq_dims)
    raw.notes += (f"{blocks.name}: every one of its {blocks.blocks} blocks was captured, as a capture of "
                  f"{blocks.captured} did not prove they repeat: {reason}",)
    return raw


def _capture_generated(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
                       seq_dims: dict[int, tuple[int, ...]] | None = None,
                       blocks: repeated_blocks.Plan | None = None) -> RawCapture:
    """``_capture_probed``, of a shallow copy's blocks extended to ``blocks`` where given; then
    ``generate()`` with many new tokens from a run of a few calls of the model extended to all of
    them (``decode_steps``: after the blocks, so that it builds every step once, at full depth),
    or every call where the steps do not repeat."""
    def deep(raw: RawCapture) -> RawCapture:
        return raw if blocks is None else repeated_blocks.extend(raw, blocks)

    short = decode_steps.shortened(spec)
    if short is None:
        return deep(_capture_probed(model, sample, spec, batch, symbolic, seq_dims))
    try:
        return decode_steps.extend(deep(_capture_probed(model, sample, short, batch, symbolic, seq_dims)),
                                   spec.step.new_tokens)
    except decode_steps.NotRepeating as exc:
        raw = deep(_capture_probed(model, sample, spec, batch, symbolic, seq_dims))
        raw.notes += (f"generate(): every decode step was captured ({spec.step.new_tokens} calls of the model), as "
                      f"a run of {decode_steps.CALLS} did not prove the steps repeat: {exc}",)
        return raw


GENERATE_READS = ("generate() reads a data-dependent value after each call of the model (whether every sequence has "
                  "finished: unfinished_sequences.max() == 0)")


def _capture_probed(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
                    seq_dims: dict[int, tuple[int, ...]] | None = None) -> RawCapture:
    """The capture, with the values fake tensors cannot know (sizes, Python branches on tensor
    values) from a real run on the sample (``_probed``) where it needs them (``RawCapture.reads_values``)."""
    policy = spec.data_dependent
    # A one-row sample is captured with b hinted at 2 (sizes 0 and 1 specialize): code that reads
    # values only for several rows (generate()'s right-padding check) reads them in the capture,
    # so the probe runs on the sample's row twice, as a real run at b = 2 on such rows would.
    # On a mesh the probe's module inputs (a router's indices) become the capture's shadows: the
    # same rows at every size (datadep.DataDependent._seed_inputs).
    cycled = symbolic or has_row_lists(spec.batch_dims) or spec.strategy.mesh is not None
    probe_sample = _with_rows(sample, batch, spec.batch_dims) if cycled else sample
    # generate() reads whether every sequence has finished after each call of the model: a capture
    # without the probe's values stops there, after the warm-up and the prompt (seconds on a large model)
    if spec.mode is Mode.GENERATE and not (policy.needs_probe or policy.observed or policy.values):
        stopped, after_topk = GENERATE_READS, False
    else:
        tried = _tried(model, sample, probe_sample, spec, batch, symbolic, seq_dims)
        if isinstance(tried, RawCapture):
            return tried
        stopped, after_topk, spec = tried
    try:
        probed = _probed(model, probe_sample, spec)
    except InputError:
        routed = _routed(model, sample, spec, batch, symbolic, seq_dims) if after_topk else None
        if routed is not None:
            return routed
        stand_in = generation.narrow_stand_in(model) if spec.mode is Mode.GENERATE else None
        if stand_in is None:
            raise CaptureError(f"{stopped}; the model's weights are on the meta device, so fxmem cannot run it: "
                               "build it with real (e.g. random) weights (command line: --device-init cpu)") from None
        return dataclasses.replace(_stood_in(model, stand_in, sample, probe_sample, spec, batch, symbolic,
                                             seq_dims), reads_values=True)
    try:
        raw = _capture(model, sample, dataclasses.replace(spec, data_dependent=probed), batch, symbolic, seq_dims)
        return dataclasses.replace(raw, reads_values=True)
    except datadep.NeedsProbe as exc:
        raise _unreached(exc, probed, spec) from None


def _tried(model: nn.Module, sample: Any, probe_sample: Any, spec: StepSpec, batch: int, symbolic: bool,
           seq_dims) -> RawCapture | tuple[str, bool, StepSpec]:
    """The capture with the values the policy gives (the probe's first where it says ``"sample"``),
    or, where it stopped at a value only a real run gives, where, whether after a router's
    ``torch.topk``, and the spec it ran (``unprobed`` where the probe could not run): its frames,
    and all they hold, go with the exception before the next capture runs."""
    policy = spec.data_dependent
    ran = False  # whether the probe ran
    if policy.needs_probe:
        try:
            spec = dataclasses.replace(spec, data_dependent=_probed(model, probe_sample, spec))
            ran = True
        except InputError:  # the weights are on the meta device: the sample's own values may fix every size
            spec = dataclasses.replace(spec, data_dependent=dataclasses.replace(policy, unprobed=True))
    try:
        raw = _capture(model, sample, spec, batch, symbolic, seq_dims)
        # started at a bound another rank's capture found (``path.Formula.bound``): as ``_routed`` returns it
        return dataclasses.replace(raw, reads_values=raw.reads_values or ran or policy.routed_bound)
    except datadep.NeedsProbe as exc:
        if spec.data_dependent.observed or spec.data_dependent.values:
            raise _unreached(exc, spec.data_dependent, spec) from None
        return _at(exc), exc.after_topk, spec


def _routed(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool, seq_dims) -> RawCapture | None:
    """The capture of a model on meta weights whose step needs a value only a real run gives after a
    router's ``torch.topk``, with its picks at their bound (``Routing.FIRST``, ``routing.py``: expert
    parallelism's token counts follow them); None where a value still stays unknown, or where
    ``generate()`` would need its narrow stand-in anyway (the values of the tokens it samples)."""
    policy = spec.data_dependent
    if policy.routing is not None or spec.mode is Mode.GENERATE:
        return None
    bound = dataclasses.replace(policy, routing=Routing.FIRST, unprobed=True)
    try:
        raw = _capture(model, sample, dataclasses.replace(spec, data_dependent=bound), batch, symbolic, seq_dims)
    except datadep.NeedsProbe:
        return None
    except SymbolicCaptureFailed as exc:  # the captures that follow (b alone, concrete sizes) start at the bound
        exc.data_dependent = bound
        raise
    return dataclasses.replace(raw, reads_values=True, bound=bound)


def _at(exc: BaseException) -> str:
    where = isolation.user_frame(exc)
    return f"{exc}{f' (at {where})' if where else ''}"


def _unreached(exc: datadep.NeedsProbe, policy: Policy, spec: StepSpec) -> CaptureError:
    if spec.strategy.mesh:  # the probe runs the model as you built it, in this process, before any parallelize
        return CaptureError(
            f"{_at(exc)}: under Strategy(mesh=) the probe runs your model unparallelized in this process; the "
            "parallelized step's values follow from the integer tensors its modules were handed there (a router's "
            "expert indices) and from collectives as if every rank held this rank's values (an all-to-all of token "
            "counts), and this one follows from neither: that step is not estimable yet")
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
    steering = [s for s in raw.data_dependent if not s.in_kernel or s.source is Source.SAMPLE]
    if steering:  # the stand-in's run would route tokens by its own weights, or size them
        raise CaptureError(f"generate() of this model routes tokens by its weights ({steering[0].site}), "
                           f"which are on the meta device: {real_weights}")
    raw.notes += (f"generate() asks values fake tensors cannot know (whether a prompt is padded, whether every "
                  f"sequence has finished: {len(probed.values)} of them); the weights are on the meta device, so "
                  "they come from a real run of a narrow stand-in (the same class, config and layers, width 64, "
                  "random weights): they depend on the attention mask and the token count, not on the weights",)
    return raw


def _probed(model: nn.Module, sample: Any, spec: StepSpec) -> Policy:
    """``spec``'s policy with the sizes and values of one real forward and loss on ``sample``
    (the model's train/eval state, buffers and the RNG restored); for a user's step, one real
    run of that step on a copy of the model (its optimizer step must not change the user's)."""
    datadep.refuse_meta(model)  # before the copy: bitsandbytes' Params4bit cannot deep-copy a meta tensor
    training = model.training
    model.train(spec.mode is Mode.TRAIN)
    if spec.step is None:
        target = model

        def forward():
            with steps.autocast(spec.precision, steps.device_type(model, sample)):
                out = steps.call_model(model, sample)
                if spec.mode is Mode.TRAIN:
                    spec.loss_fn(out, sample)
    else:
        memo: dict[int, Any] = {}
        target = copy.deepcopy(model, memo)
        repeated_blocks.map_originals(model, memo)
        fn = isolated(spec.step, memo)
        state = steps.user_state(target, spec.mode, spec.optimizer)

        def forward():
            with checkpointing(target, spec.strategy):
                fn(target, sample, state)

    try:
        with Watchdog(), isolation.errors_named(False), corrections.capture_contexts(spec.target):
            found = datadep.probe(target, sample, forward, grad=spec.step is not None,
                                  inputs=spec.strategy.mesh is not None)
    finally:
        model.train(training)
    return dataclasses.replace(spec.data_dependent, observed=found.sizes, values=found.values, inputs=found.inputs)


def _capture(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
             seq_dims: dict[int, tuple[int, ...]] | None = None) -> RawCapture:
    """``_capture_on``; with ``Strategy(mesh=)``, as rank ``spec.rank`` of a fake process group
    (``world.joined``), the model parallelized by the job's own function first."""
    if spec.strategy.mesh is None:
        return _capture_on(model, sample, spec, batch, symbolic, seq_dims)
    try:
        with world.joined(spec.strategy.mesh, spec.rank) as device_mesh:
            return _capture_on(model, sample, spec, batch, symbolic, seq_dims, device_mesh)
    except pipelines.NeedsInputs as needs:  # a later stage in the dynamic mode: the earlier stages' outputs first
        inputs = pipelines.input_shapes(model, sample, spec.strategy, needs, spec.target)
    with world.joined(spec.strategy.mesh, spec.rank) as device_mesh:
        return _capture_on(model, sample, spec, batch, symbolic, seq_dims, device_mesh, inputs)


def _capture_on(model: nn.Module, sample: Any, spec: StepSpec, batch: int, symbolic: bool,
                seq_dims: dict[int, tuple[int, ...]] | None = None, device_mesh=None,
                stage_inputs: dict | None = None) -> RawCapture:
    """Capture one steady-state step at ``batch`` (the symbol's hint when ``symbolic``).

    ``seq_dims`` (``id(sample tensor) -> dims``, symbolic captures only) makes those dims the
    sequence length ``s``, hinted by their size in the sample.  ``stage_inputs``: what a job's
    pipeline stage in the dynamic mode receives (``pipelines.input_shapes``).

    Gradient accumulation over ``k = spec.strategy.accumulate`` micro-batches: the symbol is the
    micro-batch ``m`` (hint ``max(batch // k, 2)``), the fake sample's dim 0 is ``k·m`` (the
    step splits it into ``k`` views of ``m`` rows), and the bytes are mapped to ``b`` by
    ``m = b / k``: exact integer polynomials in ``b`` when ``k`` divides each coefficient
    (rounded up otherwise: ``RawCapture.rounded``); the range of ``b`` is ``k`` times that of
    ``m``.  A job's own pipeline schedule (``capture.pipelines``) splits the batch the same way,
    ``k`` its ``n_microbatches``.  (The micro-batches of fxmem's pipeline model are not captured
    here: ``estimate`` maps the plain step's formulas to ``b / m``.)
    """
    shape_env = ShapeEnv() if symbolic else None
    mode = FakeTensorMode(shape_env=shape_env, static_shapes=not symbolic)
    memo: dict[int, Any] = {}  # the user's objects -> their fake copies
    fmodel = fake_model(model, mode, memo)
    repeated_blocks.map_originals(model, memo)  # a shallow copy's: the user's modules it stands for
    corrections.apply_model_rules(spec.target, fmodel)
    roles, offload, schedule = (), None, None
    if device_mesh is not None:  # outside the fake mode: ops on the fake model are fake, the mesh's own stay real
        schedule = world.parallelize(spec.strategy.parallelize, fmodel, device_mesh)
        libraries.load_imported()  # FSDP2's ops, where the function imported it
        places = None
        if schedule is not None:  # the job's pipeline: its step runs the schedule (capture.pipelines)
            if repeated_blocks.is_shallow(model):  # the job cuts its stages by the blocks' places and names
                raise repeated_blocks.NotRepeating("your parallelize function returned a pipeline schedule, whose "
                                                   "stages are cut from the blocks by their places")
            spec, places = _pipelined(spec, schedule, fmodel, device_mesh)
        roles = world.roles(fmodel, spec.strategy.mesh, spec.rank, places)
        offload = world.offload(fmodel, spec.target.is_cuda)
    # a job's pipeline splits the batch into its micro-batches as accumulation does
    k = spec.strategy.accumulate if schedule is None else schedule._n_microbatches
    if not symbolic and batch % k:
        what = f"accumulate={k}" if schedule is None else f"the pipeline schedule's {k} micro-batches"
        raise CaptureError(f"{what}: the concrete capture at b={batch} needs a multiple of {k}")
    micro = max(batch // k, 2) if symbolic else batch // k
    if symbolic and k > 1 and seq_dims:  # equal hints would make m and s one symbol (duck sizing)
        sizes = {t.shape[d] for t in tree_flatten(sample)[0] if isinstance(t, torch.Tensor)
                 for d in seq_dims.get(id(t), ())}
        while micro in sizes:
            micro += 1
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
    batch_symbols = symbols.batch_symbols(fsample, dims)
    module_names = {id(m): name for name, m in fmodel.named_modules()}

    def real_tensors(size: int, symbolic_: bool, repeat: int) -> RealTensors:  # batch-sized ones as the sample's
        def as_batch(t: torch.Tensor, d: int) -> torch.Tensor:
            return _full_batch(fake_sample(t, mode, size, symbolic_, None, (d,)), repeat, (d,))

        return RealTensors(mode, module_names, rows, common_dim, as_batch, spec.target.is_cuda)

    real = real_tensors(micro, symbolic, k)
    tracker = Tracker({id(m): name for name, m in fmodel.named_modules()}, spec.target)
    tracker.records_takes = repeated_blocks.is_shallow(model)
    dd = datadep.DataDependent(spec.data_dependent, {id(m): name for name, m in fmodel.named_modules()})
    dd.shadow_sample(fsample, sample, dims)
    user = spec.step is not None
    module_hooks = phases.module_hooks(tracker) if spec.compiled is None else contextlib.nullcontext()
    with _step_modes(spec, symbolic, mode, dd) as regions, \
            offload.transfers(tracker) if offload else contextlib.nullcontext(), \
            pipelines.answered(schedule, pipelines.micro_rows(schedule, fsample), stage_inputs) if schedule \
            else contextlib.nullcontext():
        if spec.compiled is None:
            compiled.submodule_regions(fmodel)
        # Inside the fake mode: some optimizers (Adagrad) create their state when constructed.
        if user:
            warm = _user_warm_up(fmodel, fsample, spec, memo, real, module_names, schedule)
        else:
            warm = _built_in_warm_up(fmodel, fsample, spec, real_tensors(batch, False, 1))
        run_step, optimizers = warm.run_step, warm.optimizers
        if offload:
            tracker.keep_on_host(offload.host_tensors(optimizers))
        managed = phases.managed_state(spec, optimizers)  # CUDA managed memory: outside the allocator's timeline
        if device_mesh is not None and not spec.target.is_cuda:  # a job's state too, in host memory
            tracker.register(world.rank_maps(fmodel), Category.COMMUNICATION)
        tracker.keep_on_host(phases.host_state(spec, optimizers))
        phases.register_state(tracker, warm.state, warm.kept, set(managed))
        phases.mark_births(tracker, fmodel, warm.state, warm.lazy)
        state_names = {key: name for category, tensors in warm.state.items() if category is not Category.INPUT
                       for name, t in tensors.items() if (key := tracker.key_of(t)) is not None}
        warm.state, warm.kept = {}, []  # the step alone decides what stays alive (zero_grad() frees the gradients)
        phases.name_owners(tracker, fmodel, optimizers)
        before = phases.model_state(fmodel)
        user_phases = phases.phases(tracker, fmodel) if user else contextlib.nullcontext()
        dd.new_step()
        decoding = phases.decoding(tracker, fmodel, shape_env) if spec.mode is Mode.GENERATE \
            else contextlib.nullcontext({})
        with collector_fresh(), tracker, module_hooks, phases.grad_order(fmodel) as grad_order, \
                real.track(tracker), user_phases, \
                phases.run_marks(tracker, fmodel, optimizers, watch_model=not user) as marks, decoding as decoded, \
                progress.task(f"capture ({spec.mode.value})", unit="op") as tracker.bar:
            result = run_step(phases.on_phase(tracker, fmodel))
        tracker.flush()
        after = phases.model_state(fmodel)
        end = tracker.phase if user else Phase.OPTIMIZER if spec.mode is Mode.TRAIN else Phase.FORWARD
        phases.label_storages(tracker, fmodel, optimizers, end)
        if not user:  # a user's warm-up step created state only where a real first step does
            phases.drop_state_without_grad(tracker, optimizers, warm.constructed)
        graph = tracker.recorder.finish([t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)])
        del result
        leak = growth.step_growth(tracker, shape_env) if user else ()

    def grown() -> tuple[str, ...]:  # last: its extra step must not add guards to what was read
        return growth.growth_note(fmodel, run_step, mode, real, before, after, micro)

    unknown = set(spec.data_dependent.sites) - set(dd.sites)
    if unknown:
        raise InputError(f"data_dependent names no data-dependent call of this step: {', '.join(sorted(unknown))}; "
                         f"its calls: {', '.join(dd.sites) or 'none'}")
    if symbolic:  # a batch size the model's code fixed fails here, before any kernel is priced at other sizes
        symbols.symbol_range(shape_env, batch_symbols[0], "batch size", SymbolicCaptureFailed)
    notes = _price_host_kernels(tracker, shape_env, batch_symbols[0], micro)
    notes += custom_ops.notes(tracker.ops, tracker.target)  # which ops' memory a user declared
    notes += cpu_matmul.scaled_mm_notes(tracker.ops, tracker.target)
    notes += held_note(model) + real.notes() + warm.notes + leak + value_notes.assumed_note(dd.assumed)
    notes += (offload.notes() if offload else ()) + phases.host_note(phases.host_state(spec, optimizers))
    notes += pipelines.notes(schedule) if schedule is not None else ()
    notes += value_notes.host_note(dd.host_reads) + value_notes.exchanged_note(dd.exchanged, bool(dd.routed))
    notes += value_notes.routed_note(dd.routed, spec.data_dependent.routing)
    if dd.exchanged:  # what a rank receives follows its place in the groups whose values it read
        roles = world.split_roles(roles, dd.shadows.exchanged_groups, fmodel, spec.strategy.mesh)
    if user and spec.mode is Mode.TRAIN and not any(op.phase is Phase.BACKWARD for op in tracker.ops):
        notes += ("mode='train', but your step ran no backward (no backward() or torch.autograd.grad()): "
                  "estimated as it ran, without gradients; if your real step backpropagates, check that the step "
                  "you passed is the one your loop runs",)
    if spec.compiled is not None:
        notes += compiled.regions_note(regions)
    elif regions.get("graphs"):
        notes += compiled.eager_regions_note(regions, spec.target)
    decoding = decoded.get("decoding")
    if not symbolic:
        storages = {sid: symbols.with_bytes(s, Poly.const(int(s.nbytes) + int(s.extra)))
                    for sid, s in tracker.storages.items()}
        for op in tracker.ops:
            op.scratch = tuple(Poly.const(int(x)) for x in op.scratch)
        sites = tuple(dd.sites.values())
        return RawCapture(tracker.ops, storages, graph, batch, batch, (), grad_order=tuple(grad_order),
                          notes=notes + value_notes.notes(sites) + grown(), data_dependent=sites,
                          freed_first=tuple(tracker.freed_first), marks=marks["marks"], decoding=decoding,
                          managed=sum(managed.values()), state_names=state_names, reads_values=dd.read_values,
                          roles=roles, multiple=1 if schedule is None else k)
    raw = symbols.to_batch_symbol(tracker, graph, shape_env, batch_symbols, k, tuple(dd.sites.values()),
                                  decoded.get("guard_marks", ()))
    raw.grad_order, raw.notes = tuple(grad_order), notes + value_notes.notes(raw.data_dependent) + grown()
    raw.marks, raw.decoding, raw.managed = marks["marks"], decoding, sum(managed.values())
    raw.state_names, raw.reads_values, raw.roles = state_names, dd.read_values, roles
    raw.multiple = 1 if schedule is None else k
    raw.symbolic_regions = spec.compiled is None and bool(regions.get("symbolic"))
    return raw


def _pipelined(spec: StepSpec, schedule, fmodel: nn.Module, device_mesh) -> tuple[StepSpec, list[int]]:
    """The spec whose step runs the job's pipeline ``schedule`` (the built-in one: ``pipelines.step``,
    its optimizer over the stage's parameters), and each rank's place in its pipeline."""
    pipelines.check(schedule, fmodel, spec.mode is Mode.TRAIN)
    if spec.step is None:
        if spec.precision.amp is not None:
            raise InputError("amp with a pipeline schedule: the built-in pipeline step runs schedule.step as your "
                             "job does, without autocast; put the autocast in your stage module (or FSDP2's "
                             "MixedPrecisionPolicy in your parallelize function)")
        factory = spec.optimizer
        spec = dataclasses.replace(spec, step=pipelines.Pipelined(schedule), optimizer=None if factory is None else (
            lambda model: steps.prepare(model, Mode.TRAIN, factory).optimizer))
    return spec, pipelines.positions(schedule, device_mesh, math.prod(size for _, size in spec.strategy.mesh))


@contextlib.contextmanager
def _step_modes(spec: StepSpec, symbolic: bool, mode: FakeTensorMode, dd: datadep.DataDependent):
    """What the warm-up and the step run under, outermost first; yields the compiled regions
    (``compiled.fake_runtime``'s dict; empty for an eager step)."""
    eager = spec.compiled is None
    with contextlib.ExitStack() as stack:
        stack.enter_context(Watchdog())  # a step that stops dispatching ops becomes a CaptureError
        stack.enter_context(isolation.errors_named(symbolic))  # errors name the user's line
        regions = stack.enter_context(compiled.fake_runtime(spec.compiled))
        stack.enter_context(mode)
        stack.enter_context(dd)  # data-dependent sizes and values, by the policy
        # A compiled step runs without the torch-function modes (Dynamo would trace into them): the
        # compiler decomposes what the substitutes stand for, and compiled.notes() says what is lost.
        if eager and corrections.has_substitutes(spec.target.device):
            stack.enter_context(Substitutions(spec.target))
        # The fake tensors are CPU tensors, so torch.autocast("cpu") applies the CPU op lists: the
        # CUDA target's capture runs with CUDA's autocast policies instead (innermost: it casts the
        # arguments of substituted functions before the substitutes see them).
        if eager and spec.target.is_cuda and spec.precision.amp:
            stack.enter_context(cuda_autocast.emulate())
        stack.enter_context(corrections.capture_contexts(spec.target))  # libraries' device branches, the target's
        # Not only Strategy(checkpoint=): a model's own checkpointing (transformers'
        # activation_checkpointing_enable) and user code save the RNG state the same way.
        if not spec.target.is_cuda:
            stack.enter_context(_fake_rng_state())
        stack.enter_context(phases.user_step_context(spec))
        if spec.mode is Mode.GENERATE:
            stack.enter_context(generation.symbolic_lengths())
        yield regions


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
    valid_from, _ = symbols.symbol_range(shape_env, batch, "batch size", SymbolicCaptureFailed)
    to_b = {s: B for s in canonical | set(batch)}  # the micro-batch's range (the kernels run at micro-batches)
    valid_from, _ = symbols.narrow(valid_from, None, [g.expr.xreplace(to_b) for g in shape_env.guards
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
    ``lazy`` the state a real run's first step makes (``phases.lazy_births``)."""

    run_step: Any
    optimizers: list
    state: dict
    kept: list = field(default_factory=list)
    constructed: set[int] = field(default_factory=set)
    notes: tuple[str, ...] = ()
    lazy: dict[int, Born] = field(default_factory=dict)


def _built_in_warm_up(fmodel: nn.Module, fsample, spec: StepSpec, real: RealTensors):
    """Build the built-in step's optimizer (and ``GradScaler``) and reach its steady state
    (``_warm_up``)."""
    optimizer, scaler = steps.prepare(fmodel, spec.mode, spec.optimizer, spec.precision)
    corrections.apply_optimizer_rules(spec.target, optimizer)
    constructed = set() if optimizer is None else {id(p) for p, values in optimizer.state.items() if values}
    with real:  # a lazy model's first step: a static sample of the batch's rows
        _warm_up(fmodel, optimizer, scaler)

    def run_step(on_phase=lambda phase: None):
        return steps.run(fmodel, fsample, spec.mode, optimizer, spec.loss_fn, on_phase, spec.precision, scaler,
                        spec.strategy, spec.batch_dims, spec.keep_output)

    optimizers = [] if optimizer is None else [optimizer]
    return _WarmedUp(run_step, optimizers, steps.state_tensors(fmodel, optimizer, fsample, scaler),
                     constructed=constructed,
                     lazy=phases.lazy_births(optimizers, constructed, [scaler] if scaler else []))


def _warm_up(model: nn.Module, optimizer, scaler) -> None:
    """Reach the steady state the measured step starts from.

    Optimizer state is created lazily by the first ``step()``; it depends on the parameters'
    shapes only, so a step on zero gradients creates it without a forward and backward.  A
    ``GradScaler`` creates its scale and growth tracker at its first ``scale()``: scaling a
    zero loss does, and ``scaler.step``/``update`` then run as in a real first steps.  (Lazy
    modules with uninitialised parameters are refused before: ``fake.fake_model``.)
    """
    if scaler is not None:
        scaler.scale(torch.zeros((), device=steps.device_type(model)))
    if optimizer is not None:
        for p in steps.trainable(model):
            p.grad = torch.zeros_like(p)
        steps.optimizer_step(optimizer, scaler)


def _user_warm_up(fmodel: nn.Module, fsample, spec: StepSpec, memo: dict, real: RealTensors,
                  module_names: dict[int, str], schedule=None):
    """Build the state the user's step is handed (``spec.optimizer(model)``) and run the step once,
    unrecorded: the steady state, whatever the step keeps between steps (optimizer state,
    gradients it does not set to None, an EMA copy, a list it appends to).  The step function is
    a copy whose closure and global containers are copies, the model it names the fake one
    (``fake.isolated``).  ``state``: ``steps.user_state_tensors`` (and a job's pipeline ``schedule``'s
    receive buffers); ``kept``: the other storages the setup and the warm-up step left alive (held by
    the step's code)."""
    fn = isolated(spec.step, memo)
    births = Tracker(module_names, spec.target)  # every storage the setup and the warm-up create
    with births, real:
        user_state = steps.user_state(fmodel, spec.mode, spec.optimizer)
        optimizers = steps.optimizers_in(user_state)
        for optimizer in optimizers:
            corrections.apply_optimizer_rules(spec.target, optimizer)
        constructed = {id(p) for optimizer in optimizers for p, values in optimizer.state.items() if values}
        # generate(): a prefill-only call makes what a model makes once (the cache is made per
        # call); the full call would double the capture's cost for nothing.  Its loop is left
        # after the prefill without reading whether every sequence has finished: that read would
        # take the probe's values, which go on for the captured run's calls
        first = dataclasses.replace(fn, new_tokens=1, stop_after=1) if isinstance(fn, steps.Generation) else fn
        with checkpointing(fmodel, spec.strategy):
            result = first(fmodel, fsample, user_state)
        del result
    gc.collect()
    state = steps.user_state_tensors(fmodel, user_state, fsample)
    if schedule is not None:
        state.setdefault(Category.COMMUNICATION, {}).update(pipelines.buffers(schedule))
    known = {t.untyped_storage()._cdata for tensors in state.values() for t in tensors.values()}
    kept = [s for s in births.alive_storages() if s._cdata not in known]

    notes = ()
    if kept:
        notes = (f"your step keeps {len(kept)} tensor(s) alive between steps besides the model, the gradients and "
                 "what its state holds (a list it appends to, a cache, a closure's tensors): "
                 f"{sum(symbols.hint(s.nbytes()) for s in kept):,} B at the capture's batch, counted as optimizer "
                 "state",)

    def run_step(on_phase=lambda phase: None):  # the phases are found as the step runs (phases.phases)
        with checkpointing(fmodel, spec.strategy):
            return fn(fmodel, fsample, user_state)

    lazy = phases.lazy_births(optimizers, constructed, steps.instances_in(user_state, torch.amp.GradScaler))
    return _WarmedUp(run_step, optimizers, state, kept, notes=notes, lazy=lazy)
