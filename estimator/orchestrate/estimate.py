"""One report from a checked request: capture (``orchestrate.path``), per rank, on the device, assembled.

``estimate(request)`` is ``estimator.report``: ``checked.check`` first, then the single-device
step's formulas (``capture_formula``, kept for the same step's next report: ``orchestrate.reuse``), the step at
the request's batch (``capture_step``), each rank's step where the strategy spans devices
(``ranks.per_rank``), the CUDA device's view (``devices.cuda``) and the ``Report``.
``estimate_each`` does it for several requests (``compare``/``plan``), capturing each distinct
step once.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Mapping

from torch import nn

from estimator.account import CATEGORIES, Timeline, skeleton
from estimator.capture import steps, world
from estimator.capture.records import RawCapture
from estimator.devices import cuda, cudnn
from estimator.devices.cuda import CudaMemory
from estimator.orchestrate import depth_formula, dtype_formula, reuse
from estimator.orchestrate import path as capture_path
from estimator.orchestrate.checked import Checked, check
from estimator.orchestrate.path import Captured, Formula
from estimator.orchestrate.workers import capture_each
from estimator.ranks.per_rank import per_rank
from estimator.reporting.result import Generated, ModuleRow, Piece, RankReport, Report
from estimator.vocab import forked, gpus, progress
from estimator.vocab.bookkeeping import collector_paused
from estimator.vocab.categories import Category, Mode, Phase
from estimator.vocab.data_dependent import Policy, Source
from estimator.vocab.errors import CaptureError, FxmemError, InputError
from estimator.vocab.request import Request
from estimator.vocab.strategy import Strategy
from estimator.vocab.symbolic import ZERO, Poly, nondominated


def estimate(request: Request) -> Report:
    """The report of ``request`` (``estimator.report``'s arguments as one object)."""
    checked = check(request)
    for name in ("dtype_symbols", "depth_symbols"):
        if not isinstance(getattr(request, name), bool):
            raise InputError(f"{name} must be True or False, got {getattr(request, name)!r}")
    if not (request.dtype_symbols or request.depth_symbols):
        return _with_sample_sizes(checked, _report(checked))
    if request.dtype_symbols:
        dtype_formula.check(checked)
    if request.depth_symbols:
        depth_formula.check(checked)
    formula = capture_formula(checked)

    def cast(model: nn.Module, sample, strategy: Strategy) -> Checked:  # the same arguments for a cast copy
        return check(request.replace(model=model, sample=sample, strategy=strategy, depth_symbols=False))

    rep = _report(checked, formula)
    if request.depth_symbols:
        rep = dataclasses.replace(rep, depth_formula=depth_formula.build(checked, formula))
    if request.dtype_symbols:
        rep = dataclasses.replace(rep, dtype_formula=dtype_formula.build(checked, formula, cast, capture_formula))
    return rep


def estimate_each(requests: Mapping[str, Request], workers: int | None = None) -> dict[str, Report]:
    """``estimate`` of every request (by label), one capture per distinct captured step
    (``orchestrate.reuse``), those in ``workers`` processes (``orchestrate.workers``; None: one
    per usable core)."""
    checks = {label: check(request) for label, request in requests.items()}  # every argument before any capture
    capture_each(list(checks.values()), workers)
    out = {}
    with progress.task("steps of the comparison", total=len(checks), unit="step") as bar:
        for label, checked in checks.items():
            out[label] = _report(checked)
            bar.update()
    return out


def _report(checked: Checked, formula: Formula | None = None) -> Report:
    """``result`` of ``checked``'s captured step (and, with a mesh, of one rank of each role)."""
    # the allocator's replay: started before the accounting where it is long (_replay_started), else once captured
    early: list[forked.Started[CudaMemory]] = []
    try:
        captured = capture_step(checked, formula, functools.partial(_replay_started, checked, early))
        spec = checked.spec
        if not early and spec.target.is_cuda and not checked.strategy.distributed:  # beside the rest of the report
            early.append(cuda.predict_started(lambda: captured.at_batch, len(captured.at_batch.ops), checked.batch,
                                              spec.target))
        return _with_roles(checked, captured, early[0] if early else None)
    except BaseException:  # no result will be asked for: the replay's process stopped
        for replay in early:
            replay.cancel()
        raise


def _with_roles(checked: Checked, captured: Captured, replay: forked.Started[CudaMemory] | None) -> Report:
    """``result`` of ``captured`` with the step of one rank of each other role (a mesh's)."""
    # the other roles run the same code: where this one had to take its routers' bound, they start there
    start = checked if captured.bound is None else checked.with_policy(captured.bound)
    steps = {ranks: captured for ranks in captured.roles if checked.spec.rank in ranks}
    pending = [ranks for ranks in captured.roles if checked.spec.rank not in ranks]
    while pending:  # one rank of each other role; a pipeline's other stages group their ranks themselves
        others = {ranks: start.at_rank(ranks[0]) for ranks in pending}
        capture_each(list(others.values()))  # in worker processes where there are several
        pending = []
        for ranks, other in others.items():
            step = capture_step(other)
            for part in world.parts(ranks, step.roles):
                if ranks[0] in part:
                    steps[part] = step
                else:
                    pending.append(part)
    roles = tuple(sorted(steps))
    return result(checked, dataclasses.replace(captured, roles=roles), steps, replay)


def _replay_started(checked: Checked, early: list, raw: RawCapture, seq: int | None) -> None:
    """Where the report's CUDA allocator replay will be long (a long ``generate()``), start it
    from the raw capture (``account.skeleton``), so that it runs beside the accounting, and add
    it to ``early``: where the timeline at the batch will be this capture's (one device, one
    micro-batch, the batch inside the capture's range)."""
    spec, batch = checked.spec, checked.batch
    if (spec.target.is_cuda and not checked.strategy.distributed and checked.microbatches == 1
            and len(raw.ops) >= cuda.FORK_OPS and forked.can_fork()
            and raw.valid_from <= batch and (raw.valid_to is None or batch <= raw.valid_to)):
        early.append(cuda.predict_started(lambda: skeleton(raw, seq), len(raw.ops), batch, spec.target))


@collector_paused()  # bookkeeping over every op of the captured step: no capture runs in it
def result(checked: Checked, captured: Captured, roles: Mapping[tuple[int, ...], Captured] | None = None,
           replay: forked.Started[CudaMemory] | None = None) -> Report:
    """The report of the request ``checked`` from its captured step: one device's, or every
    rank's (with a mesh: ``roles``, the steps of the other ranks' roles, by their ranks);
    ``replay``: one device's allocator replay, started already (``_report``; None: ``_assemble`` starts it)."""
    spec, strategy, model, batch = checked.spec, checked.strategy, checked.model, checked.batch
    if batch % captured.multiple:
        raise InputError(f"your pipeline schedule splits the batch into {captured.multiple} micro-batches: the batch "
                         f"must be a multiple of {captured.multiple}, got {batch}")
    notes = [*checked.notes, *captured.notes]
    if spec.target.is_cuda:  # what is not modelled, and the estimated items with their size
        ran = {op.op for op in captured.timeline.ops} | {site.op for site in captured.data_dependent}
        notes += [cuda.not_modelled_note(ran), *cuda.managed_notes(captured.timeline.managed),
                  *gpus.estimated_notes(spec.target.context_bytes),
                  *cudnn.estimated_notes(captured.at_batch or captured.timeline, captured.graph, spec.target, batch,
                                         captured.seq, per_device=not strategy.distributed)]
    if strategy.multiple > 1:
        notes.append(_batch_note(strategy))
    if strategy.mesh is not None:
        notes.extend(world.notes(strategy.mesh, spec.target.is_cuda))
    elif strategy.distributed:  # fxmem's DDP / ZeRO / pipeline ranks (estimator/ranks)
        notes.append("communication: " + world.library_note(spec.target.is_cuda))
    if spec.mode is Mode.TRAIN and spec.step is None and spec.keep_output:
        notes.extend(_kept_output_note(captured.at_batch, batch))
    common = {
        "model": type(model).__name__,
        "mode": spec.mode,
        "device": spec.target.device.value,
        "optimizer": checked.optimizer_name,
        "batch": batch,
        "path": captured.path,
        "valid_from": captured.valid_from,
        "valid_to": captured.valid_to,
        "guards": captured.guards,
        "graph": captured.graph,
        "batch_outside_range": captured.outside,
        "target": spec.target,
        "seq": captured.seq,
        "seq_range": captured.seq_range or (2, None),
        "multiple": max(strategy.multiple, captured.multiple),
        "strategy": strategy,
        "data_dependent": captured.data_dependent,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    if spec.mode is Mode.GENERATE:
        prompt = captured.seq if captured.seq is not None else checked.sample["input_ids"].shape[-1]
        common["generation"] = _generated(spec.step, captured.at_batch or captured.timeline, batch, prompt)
        notes.append(_generated_note(common["generation"], batch))
    if not strategy.distributed:
        rep = _assemble(model, captured.timeline, captured.at_batch, captured, {**common, "notes": tuple(notes)},
                        replay)
        return rep if rep.cuda is None else dataclasses.replace(rep, notes=(*rep.notes, cuda.run_note(rep.cuda)))

    def at(poly: Poly) -> int:  # bytes at the report's batch and sequence length
        return poly(batch, captured.seq) if poly.has_s else poly(batch)

    if strategy.mesh is not None:  # each role's step captured as its rank runs it
        steps_of = {ranks: roles[ranks] if ranks in (roles or {}) else captured
                    for ranks in captured.roles or (tuple(range(strategy.devices)),)}
        per = tuple(RankReport(world.role_name(strategy.mesh, ranks), ranks,
                               _assemble(model, own.timeline, own.at_batch, own, {**common, "notes": ()}))
                    for ranks, own in steps_of.items())
    else:
        ranks = per_rank(captured.timeline, model, strategy, spec.target, at)
        at_batch = per_rank(captured.at_batch, model, strategy, spec.target, at) if captured.separate else ranks
        per = tuple(
            RankReport(r.role, r.ranks, _assemble(model, r.timeline, a.timeline, captured, {**common, "notes": ()}))
            for r, a in zip(ranks, at_batch)
        )
    worst = max(per, key=lambda r: (r.report.peak_bytes if r.report.cuda is None else r.report.cuda.device))
    pieces = [p for r in per for p in r.report.pieces]
    keep = nondominated([p.bytes for p in pieces], captured.valid_from, captured.valid_to, captured.seq_range_lo)
    if worst.report.cuda is not None:
        notes.append(cuda.run_note(worst.report.cuda))
    return dataclasses.replace(worst.report, pieces=tuple(pieces[i] for i in keep), ranks=per, notes=tuple(notes))


def _with_sample_sizes(checked: Checked, rep: Report) -> Report:
    """Under the default bound (``data_dependent='max'``), a report with sizes at their bound also
    gets the same step at the sample's sizes (``Report.at_sample``): the bound is what "will it
    fit" needs, the sample's what a run on it allocates.  The sample's sizes need a real forward
    (real weights) unless the sample's own values fix them; where they cannot be had, a note says
    why."""
    policy = checked.spec.data_dependent
    bounded = {Source.BOUND, Source.BUDGET}
    if policy != Policy() or not any(site.source in bounded for site in rep.data_dependent):
        return rep
    sampled = dataclasses.replace(checked, spec=dataclasses.replace(checked.spec,
                                                                    data_dependent=Policy.of("sample")))
    try:
        at_sample = _report(sampled)
    except FxmemError as exc:
        why = f"the data-dependent sizes at the sample's values could not be had: {exc}"
        return dataclasses.replace(rep, notes=(*rep.notes, why))
    return dataclasses.replace(rep, at_sample=at_sample)


def capture_formula(checked: Checked, started: capture_path.Started | None = None) -> Formula:
    """The request's single-device step as formulas (``orchestrate.path.formula``: symbolic, ``b``
    alone, or concrete fits), or the one kept from an earlier capture of the same step
    (``orchestrate.reuse``); ``started``: as ``orchestrate.path.formula`` takes it."""
    key, hint, formula = reuse.lookup(checked)
    if formula is None:
        formula = capture_path.formula_of(checked, started)
        reuse.keep(key, hint, formula)
    return formula


def capture_step(checked: Checked, formula: Formula | None = None,
                 started: capture_path.Started | None = None) -> Captured:
    """The captured step of ``checked`` (``formula``: its capture, when shared; ``started``: as
    ``capture_formula`` takes it) at the request's batch (``orchestrate.path.at_batch``)."""
    formula = formula or capture_formula(checked, started)
    return capture_path.at_batch(checked.model, checked.sample, checked.capture_spec, checked.batch,
                                 checked.microbatches, formula)


def _assemble(model: nn.Module, timeline: Timeline, at_batch: Timeline, captured: Captured, common: dict,
              replay: forked.Started[CudaMemory] | None = None) -> Report:
    """The report of one device's step: the peak's pieces (formulas), the peak at the batch
    with its breakdown, module rows and, on CUDA, the allocator's view (``replay``: its result,
    where started already, ``cuda.predict_started``)."""
    target, batch, seq = common["target"], common["batch"], common["seq"]
    if replay is None and target.is_cuda:  # beside what follows (seconds for a long generate())
        replay = cuda.predict_started(lambda: at_batch, len(at_batch.ops), batch, target)
    # Bytes held outside the captured tensors at every op (CUDA: the cuBLAS workspaces).
    fixed = Poly.const(cuda.workspaces_held(timeline, target))
    candidates = timeline.candidates()
    keep = nondominated([poly for poly, _ in candidates], captured.valid_from, captured.valid_to, captured.seq_range_lo)
    pieces = tuple(Piece.at(timeline, *candidates[i][1], fixed) for i in keep)
    peak_index, peak_k = at_batch.peak_at(batch)
    formulas = timeline if not captured.separate else at_batch  # in b (and s) where the formula holds
    live = formulas.ops[peak_index].live_at(peak_k) if formulas.ops else formulas.baseline
    breakdown = {c: v(batch, seq) if v.has_s else v(batch) for c, v in zip(CATEGORIES, live)}
    modules = _module_rows(model, at_batch, peak_index)
    on_device = replay() if replay is not None else None
    return Report(
        **common,
        peak_bytes=sum(breakdown.values()) if on_device is None else on_device.allocated,
        pieces=pieces,
        breakdown=breakdown,
        breakdown_formula=dict(zip(CATEGORIES, live)),
        peak_piece=Piece.at(formulas, peak_index, peak_k, fixed),
        modules=modules,
        timeline=timeline,
        cuda=on_device,
    )


def _generated(generation: steps.Generation, timeline: Timeline, batch: int, prompt: int) -> Generated:
    decoding = timeline.decoding
    if decoding is None or not decoding.calls:
        raise CaptureError("mode='generate': generate() never called the model")
    peak, _ = timeline.peak_at(batch)
    call = max(bisect.bisect_right(decoding.calls, peak) - 1, 0)
    return Generated(generation.new_tokens, prompt, decoding.cache or "no cache", decoding.bytes_per_token,
                     decoding.tokens, call)


def _generated_note(generated: Generated, batch: int) -> str:
    cache = (f"its {generated.cache} holds {generated.kv_bytes_per_token:,} B per token and sequence "
             f"(keys and values of every layer): {generated.kv_bytes(batch):,} B for {generated.cache_tokens} tokens "
             f"x {batch} sequences after the last call" if generated.kv_bytes_per_token else
             "the model returned no KV cache (past_key_values): nothing is counted as one")
    needed = generated.prompt_tokens + generated.new_tokens - 1  # the last new token's keys are never computed
    if generated.cache == "StaticCache" and generated.cache_tokens > needed:
        cache += (f"; it is sized for {generated.cache_tokens} tokens, more than this call needs "
                  f"({needed}): transformers sizes a static cache for the longest generation the model object has "
                  "run (its _previous_max_cache_length), as a real call on this model would")
    return f"generate: the peak is in {generated.where}; {cache}"


def _kept_output_note(timeline: Timeline, batch: int) -> list[str]:
    """The cost of ``keep_output=True``: the forward's tensors alive to the end of the step (the
    model's output and the loss) at ``batch``, and whether they are part of the peak."""
    kept = [(nbytes, op) for nbytes, category, op, freed in timeline.storages
            if category is Category.ACTIVATION and freed is None and op >= 0
            and timeline.ops[op].phase is Phase.FORWARD]
    total = sum(nbytes(batch) for nbytes, _ in kept)
    if not total:
        return []
    peak, _ = timeline.peak_at(batch)
    at_peak = all(op <= peak for _, op in kept)
    where = ("part of the peak: a loop that drops the output before backward() (Hugging Face's Trainer, Lightning, "
             "torchtitan; keep_output=False) peaks up to that much lower" if at_peak else "not part of the peak")
    return [f"keep_output=True: the model's output and the loss stay alive through backward and the optimizer step "
            f"(out = model(x); loss = loss_fn(out, y); loss.backward(), as in PyTorch's tutorials and nanoGPT): "
            f"{total:,} B at b = {batch}, {where}"]


def _batch_note(strategy: Strategy) -> str:
    k = strategy.multiple
    if strategy.pipeline > 1:
        return (f"pipeline: {strategy.microbatches} micro-batches of b/{strategy.microbatches} per step; "
                f"b must be a multiple of {k}")
    return f"gradient accumulation: {k} micro-batches of b/{k} per optimizer step; b must be a multiple of {k}"


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
