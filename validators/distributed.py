"""Measure the per-rank peak CPU memory of real ``torch.distributed`` jobs (gloo, this machine).

    ranks = measure_ranks("ddp", 2, functools.partial(models_zoo.get, "mlp", "debug"), batch=8)
    ranks[0].peak_bytes, ranks[0].baseline_bytes, ranks[0].role

``world_size`` processes are started (``multiprocessing`` forkserver, the server preloading
torch and this module: a job costs ~1 s, not ~8), each joins a gloo process group on a free
localhost port (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set as torchrun
would), wraps its model with the strategy, runs ``warmup`` unmeasured steps and one measured
step, and reports its peak as ``validators.cpu`` does -- bytes alive when the measured step
starts + the largest rise of the CPU allocator's total during it, from the allocation events
of ``profile(profile_memory=True)`` -- with one difference: the total counts every thread.

Why: the profiler records the allocations and frees of the threads it follows only, and a
gloo worker thread often drops the last reference to a collective's tensor (FSDP2's
all-gathered parameters): summing the recorded deltas (``validators.cpu``'s way) then keeps
that block alive forever, racily.  ``FLAGS_caffe2_report_cpu_memory_usage`` (set in each
rank) makes the allocator keep its running total over all threads; each allocation event
carries it (``total_allocated``).  ``profiled_peak_delta`` is the ``validators.cpu`` figure
(``cpu._allocation_deltas``) for comparison: equal when no other thread frees.

Bytes alive at the start: the allocator's total then, i.e. everything the rank allocated
since the flag was set (before ``build()``) and still holds.  ``state_bytes`` splits off the
storages of ``estimator.capture.steps.state_tensors`` (parameters, buffers, optimizer state, inputs;
DTensors as their local shard); ``wrapper_bytes`` is the rest: DDP's gradient buckets,
pipeline receive buffers, ...

Strategies (every one but the pipelines takes ``step=``: an ``estimator.Strategy`` whose
accumulation, checkpointing and autocast each rank's step applies):
    single          world 1, no wrapper: the baseline (run it at the per-rank batch).
    ddp             DistributedDataParallel, per-rank batch = batch / world.
                    options: bucket_cap_mb, gradient_as_bucket_view (passed to DDP).
    zero1           DDP + ``ZeroRedundancyOptimizer`` (the optimizer class and defaults of
                    ``optimizer``); options as ddp.
    fsdp2           ``fully_shard`` on each block, then on the root, per-rank batch =
                    batch / world.  options: reshard_after_forward, blocks (a callable
                    model -> list of modules; default: the children with parameters of the
                    model's first nn.Sequential / nn.ModuleList, the model itself included).
    mesh            the job's own parallel code: ``init_device_mesh("cpu", sizes,
                    mesh_dim_names=names)`` from options ``mesh`` ({name: size}), then
                    ``parallelize(model, mesh)`` (option ``parallelize``: picklable, a
                    module-level function or a partial of one); every rank runs ``batch``
                    samples (``batch`` is per rank here); option ``user_step``: the job's own
                    ``step(model, sample, optimizer)`` instead of the built-in step.  A
                    function that returns a pipeline schedule (this rank's stage, the model
                    cut in place) has its step run by ``estimator.capture.pipelines.step``.
    pipeline-gpipe  ``torch.distributed.pipelining`` ScheduleGPipe / Schedule1F1B; an
    pipeline-1f1b   nn.Sequential model is cut into ``world_size`` contiguous stages (balanced
                    by parameter count, or ``split_points``: the child indices where stages
                    2.. start); every rank sees the whole batch in ``microbatches`` chunks
                    (default: world_size).  The sample must be ``(input, target)``; the last
                    stage computes ``loss_fn(output, (None, target_microbatch))``.
                    ``checkpoint=``: a module type whose instances run under
                    ``torch.utils.checkpoint`` in each stage.  ``data_parallel=D``: ``D``
                    pipelines of ``world_size / D`` stages (rank ``k * D + d``: stage ``k`` of
                    pipeline ``d``), each stage's module under DDP over its replicas (the
                    other options go to DDP), ``batch / D`` samples per pipeline; the stages
                    are given their shapes (static mode, see ``_pipeline``).

Not measured: memory gloo allocates outside the c10 CPU allocator (its own malloc'd buffers).
A rank that raises, or a job that outlives ``timeout`` seconds, raises ``RankError`` (naming
the rank and its error) after every process was terminated.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from estimator.capture import pipelines, steps
from estimator.vocab.categories import Mode
from validators import cpu

_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.nn.parallel",
    "torch.profiler",
    "validators.distributed",
)
STRATEGIES = ("single", "ddp", "zero1", "fsdp2", "mesh", "pipeline-gpipe", "pipeline-1f1b")
Build = Callable[[], tuple[nn.Module, Callable[[int], Any], Any]]


class RankError(RuntimeError):
    """A rank raised, or the job timed out."""


@dataclass(frozen=True)
class RankMeasurement:
    rank: int
    world_size: int
    strategy: str
    role: str  # "replica", "shard 0/2", "stage 1/2 (children 4:8)", "single"
    peak_bytes: int  # baseline_bytes + peak_delta
    baseline_bytes: int  # alive when the measured step starts: state + wrapper
    peak_delta: int  # largest rise of the allocator's all-thread total during the measured step
    state_bytes: dict[str, int] = field(default_factory=dict)  # category -> bytes of steps.state_tensors
    wrapper_bytes: int = 0  # baseline_bytes - sum(state_bytes): DDP buckets, pipeline buffers, ...
    events: int = 0  # allocator events in the measured step
    profiled_peak_delta: int = 0  # validators.cpu's running sum of the recorded deltas
    batch: int = 0  # samples this rank's measured step processed
    details: dict[str, Any] = field(default_factory=dict)  # ddp: bucket_sizes (bytes), ...
    seconds: float = 0.0  # wall time of the rank's job (wrap + warm-up + measured step)


# ----------------------------------------------------------------------------------------
# launching


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_ranks(
    strategy: str,
    world_size: int,
    build: Build,
    batch: int,
    optimizer: str | None = "adamw",
    *,
    warmup: int = 2,
    timeout: float = 120.0,
    threads: int = 1,
    **options,
) -> list[RankMeasurement]:
    """Run ``strategy`` on ``world_size`` local processes; one ``RankMeasurement`` per rank.

    ``build`` (picklable: a module-level function or a ``functools.partial`` of one) returns
    ``(model, sample_fn, loss_fn)``: ``sample_fn(batch)`` the same sample on every call,
    ``loss_fn(output, sample)`` (None: ``estimator.capture.steps.default_loss``).  ``batch`` is the
    global batch.  ``warmup`` unmeasured steps come first (two: DDP rebuilds its buckets in
    the second iteration's forward).  Each rank uses ``threads`` intra-op threads."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if strategy == "single" and world_size != 1:
        raise ValueError("strategy 'single' runs one process: world_size must be 1")
    if world_size < 1 or batch < 1:
        raise ValueError(f"world_size and batch must be >= 1, got {world_size}, {batch}")
    if strategy == "mesh" and math.prod(options.get("mesh", {}).values()) != world_size:
        raise ValueError(f"mesh: the mesh {options.get('mesh')} does not have {world_size} ranks")
    if strategy in ("ddp", "zero1", "fsdp2") and batch % world_size:
        raise ValueError(f"{strategy}: batch {batch} does not split over {world_size} ranks")
    import pickle

    try:
        pickle.dumps(build)
    except Exception as e:
        raise ValueError(f"build must be picklable (a module-level function or functools.partial): {e}") from e

    import time

    import torch.multiprocessing as mp

    # One fork server per process, with what every rank imports already imported (several
    # seconds on a small machine, the profiler's first start included): ranks fork from it.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    queue = ctx.SimpleQueue()
    port = _free_port()
    job = (strategy, world_size, build, batch, optimizer, warmup, threads, options, port)
    procs = [ctx.Process(target=_rank_main, args=(rank, job, queue), daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, RankMeasurement] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if not queue.empty():
                rank, ok, payload = queue.get()
                if not ok:
                    raise RankError(f"rank {rank} of {world_size} ({strategy}) failed: {payload}")
                results[rank] = payload
                continue
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead and queue.empty():
                time.sleep(0.2)  # a rank's report may still be in flight
                if queue.empty():
                    r = dead[0]
                    raise RankError(
                        f"rank {r} of {world_size} ({strategy}) died with exit code {procs[r].exitcode} "
                        "without reporting"
                    )
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results))
                raise RankError(
                    f"{strategy} on {world_size} ranks timed out after {timeout:.0f} s; ranks {missing} hung"
                )
            time.sleep(0.02)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        queue.close()
    return [results[r] for r in range(world_size)]


def _rank_main(rank: int, job, queue) -> None:
    strategy, world_size, build, batch, optimizer, warmup, threads, options, port = job
    import time

    import torch.distributed as dist

    start = time.perf_counter()
    try:
        torch.set_num_threads(threads)
        if strategy != "single":
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size),
            )
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        m = _measure(rank, world_size, strategy, build, batch, optimizer, warmup, options)
        queue.put((rank, True, _replace(m, seconds=time.perf_counter() - start)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which ends every rank
        # reported before any teardown: a peer stuck in a collective could hang it
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    if dist.is_initialized():
        dist.destroy_process_group()


def _replace(m: RankMeasurement, **changes) -> RankMeasurement:
    import dataclasses

    return dataclasses.replace(m, **changes)


# ----------------------------------------------------------------------------------------
# bytes alive


def _state_bytes(model, opt, sample) -> dict[str, int]:
    """Bytes by category of ``steps.state_tensors`` (which gives a DTensor's local shard; each
    storage counted once, in its first category)."""
    seen: set[int] = set()
    by_category: dict[str, int] = {}
    for category, tensors in steps.state_tensors(model, opt, sample).items():
        total = 0
        for t in tensors.values():
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        by_category[str(getattr(category, "value", category))] = total
    return by_category


def _report_cpu_memory_usage() -> None:
    """Turn on c10's ``FLAGS_caffe2_report_cpu_memory_usage``: the CPU allocator then counts
    every allocation and free, on every thread, in its running total (``total_allocated`` of
    the profiler's allocation events).  Without it only the threads the profiler follows are
    counted: a block a gloo worker thread frees (it may drop the last reference to a
    collective's tensor) would look alive forever, and the peak would depend on that race.
    No Python binding sets the flag; it is an exported bool of libc10."""
    import ctypes

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _allocations(prof) -> list[tuple[int, int, int, str]]:
    """The CPU allocator events ``(time_ns, delta, total_allocated, op)``, sorted by time
    (``op``: the innermost op or Python function the profiler saw around it)."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            fields = node.extra_fields
            parent = node.parent
            events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated,
                           parent.name if parent is not None else ""))
        stack.extend(node.children)
    events.sort(key=lambda e: e[0])
    return events


# ----------------------------------------------------------------------------------------
# strategies: each returns (model, role, run_step, state_model, sample, batch)


def _blocks(model: nn.Module) -> list[nn.Module]:
    for module in model.modules():
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            return [c for c in module.children() if any(True for _ in c.parameters())]
    return []


def _split(model: nn.Sequential, stages: int, split_points) -> list[int]:
    """Child indices where each stage starts (``[0, ...]``)."""
    children = list(model.children())
    if split_points is not None:
        starts = [0, *split_points]
    else:
        sizes = [sum(p.numel() for p in c.parameters()) for c in children]
        total, starts, acc = sum(sizes), [0], 0
        for i, s in enumerate(sizes):
            # stage k starts at the first child with parameters once k/stages of them are behind
            if len(starts) < stages and acc >= total * len(starts) / stages and i > starts[-1] and s:
                starts.append(i)
            acc += s
    if len(starts) != stages or sorted(set(starts)) != starts or starts[-1] >= len(children):
        raise ValueError(f"cannot cut {len(children)} children into {stages} stages at {starts}")
    return starts


def _measure(rank, world, strategy, build, batch, optimizer, warmup, options) -> RankMeasurement:
    from torch.profiler import ProfilerActivity, profile

    _report_cpu_memory_usage()

    torch.manual_seed(0)
    model, sample_fn, loss_fn = build()
    loss_fn = loss_fn or steps.default_loss
    factory = steps.optimizer_factory(optimizer)
    options = dict(options)
    single = options.pop("step", None) or steps.DEFAULT  # accumulation, checkpointing, autocast in each rank
    user_step = options.pop("user_step", None)
    if user_step is not None and strategy != "mesh":
        raise ValueError(f"{strategy}: the user_step= option is for strategy 'mesh'")
    precision = steps.Precision.of(single.amp, single.grad_scaler, Mode.TRAIN)

    if strategy.startswith("pipeline"):
        if single != steps.DEFAULT:
            raise ValueError(f"{strategy}: the step= option is not supported for pipelines")
        model, role, run, state_model, sample, local_batch, opt = _pipeline(
            rank, world, strategy, model, sample_fn, loss_fn, batch, factory, options
        )
    else:
        local_batch = batch if strategy == "mesh" else batch // world
        schedule = None
        sample = sample_fn(local_batch)
        if isinstance(model, nn.Sequential):  # sample (input, target): feed the input only
            model = _InputOnly(model)
        role = "single"
        if strategy in ("ddp", "zero1"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, **options)
            role = "replica"
            if strategy == "zero1":
                factory = _zero1(factory)
                role = f"optimizer shard {rank}/{world}"
        elif strategy == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            blocks = options.pop("blocks", _blocks)
            for block in blocks(model):
                fully_shard(block, mesh=mesh, **options)
            fully_shard(model, mesh=mesh, **options)
            role = f"shard {rank}/{world}"
        elif strategy == "mesh":
            from torch.distributed.device_mesh import init_device_mesh

            dims = options.pop("mesh")
            parallelize = options.pop("parallelize")
            made = parallelize(model, init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims)))
            schedule = made if pipelines.is_schedule(made) else None  # the job's pipeline: its step runs it
            role = f"rank {rank}/{world}"
        elif options:
            raise ValueError(f"strategy {strategy!r} takes no options, got {sorted(options)}")
        opt, scaler = steps.prepare(model, Mode.TRAIN, factory, precision)
        state_model = model

        def run():
            if user_step is not None:  # the job's own step, handed the optimizer
                return user_step(model, sample, opt)
            if schedule is not None:
                return pipelines.step(schedule, sample, opt)
            return steps.run(model, sample, Mode.TRAIN, opt, loss_fn, precision=precision, scaler=scaler,
                            strategy=single)

    for _ in range(warmup):
        del_result = run()
        del del_result
    gc.collect()
    state = _state_bytes(state_model, opt, sample)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
        del result
    events = _allocations(prof)
    if not events:
        raise RuntimeError("the profiler recorded no CPU allocation in the measured step")
    # the allocator's total counts every block allocated since _report_cpu_memory_usage()
    _, delta, total, _ = events[0]
    baseline = total - delta
    peak = max(0, *(total - baseline for _, _, total, _ in events))
    at = next(i for i, e in enumerate(events) if e[2] - baseline == peak) if peak else 0
    running = profiled_peak = 0
    for _, d in cpu._allocation_deltas(prof):
        running += d
        profiled_peak = max(profiled_peak, running)
    wrapper = baseline - sum(state.values())
    # the allocator events up to the peak, for explaining a difference: (bytes, total - baseline, op)
    details: dict[str, Any] = {"events": [(d, t - baseline, op) for _, d, t, op in events[:at + 1]]}
    if hasattr(model, "reducer"):  # DDP (of a pipeline stage too)
        # the reducer's buckets as they are now (rebuilt in the gradients' ready order after
        # the first iteration); _get_ddp_logging_data()'s bucket_sizes keeps the initial ones
        buckets = model.reducer._get_zeros_like_grad_buckets()
        details |= {
            "bucket_sizes": [b.buffer().numel() * b.buffer().element_size() for b in buckets],
            "gradient_as_bucket_view": bool(model.gradient_as_bucket_view),
        }
        del buckets

    return RankMeasurement(
        rank=rank,
        world_size=world,
        strategy=strategy,
        role=role,
        peak_bytes=baseline + peak,
        baseline_bytes=baseline,
        peak_delta=peak,
        state_bytes=state,
        wrapper_bytes=wrapper,
        events=len(events),
        profiled_peak_delta=profiled_peak,
        details=details,
        batch=local_batch,
    )


def _zero1(factory):
    """``ZeroRedundancyOptimizer`` with the class and defaults of ``factory``'s optimizer."""
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer

    probe = factory([nn.Parameter(torch.zeros(1))])
    accepted = inspect.signature(type(probe).__init__).parameters
    defaults = {k: v for k, v in probe.defaults.items() if k in accepted}

    def make(params):
        return ZeroRedundancyOptimizer(list(params), optimizer_class=type(probe), **defaults)

    return make


def _pipeline(rank, world, strategy, model, sample_fn, loss_fn, batch, factory, options):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if not isinstance(model, nn.Sequential):
        raise TypeError(f"{strategy} cuts an nn.Sequential into stages; got {type(model).__name__}")
    # data_parallel: D replicas of the pipeline, each stage's replicas under DDP (ranks laid out as
    # torchtitan's ("pp", "dp") mesh: rank = stage * D + replica); the other options go to DDP
    replicas = options.pop("data_parallel", 1)
    if world % replicas:
        raise ValueError(f"{strategy}: {world} ranks do not make data_parallel={replicas} pipelines")
    stages = world // replicas
    k, d = divmod(rank, replicas)
    microbatches = options.pop("microbatches", stages)
    starts = _split(model, stages, options.pop("split_points", None))
    # checkpoint: a module type whose instances run under torch.utils.checkpoint (non-reentrant),
    # as estimator.vocab.strategy.Strategy(checkpoint=) does
    checkpoint = options.pop("checkpoint", None)
    if options and replicas == 1:
        raise ValueError(f"{strategy}: unknown options {sorted(options)}")
    if batch % (replicas * microbatches):
        raise ValueError(f"{strategy}: batch {batch} does not split into {replicas} x {microbatches} microbatches")
    bounds = [*starts, len(model)]
    lo, hi = bounds[k], bounds[k + 1]
    first, last = k == 0, k == stages - 1
    submod, whole = model[lo:hi], model
    del model
    sample = sample_fn(batch // replicas)
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise ValueError(f"{strategy}: sample_fn must return (input, target), got {type(sample).__name__}")
    x, target = sample
    sample_shape = tuple(x.shape)
    held = (x if first else None, target if last else None)  # what this rank keeps alive
    del sample, x, target
    wrapped, shapes, pipeline_group = submod, {}, None
    if replicas > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # every rank makes every group, in the same order (new_group is collective)
        pp_groups = [dist.new_group([s * replicas + r for s in range(stages)]) for r in range(replicas)]
        dp_groups = [dist.new_group([s * replicas + r for r in range(replicas)]) for s in range(stages)]
        pipeline_group = pp_groups[d]

        # the stage's shapes given (static mode): the dynamic mode's metadata inference runs a
        # backward through DDP outside no_sync, and the second step's bucket rebuild then fails
        # (torch 2.13 reducer.cpp: "rebuilt parameter indices size is not same as original")
        with torch.no_grad():
            shapes["input_args"] = torch.empty(sample_shape[0] // microbatches, *sample_shape[1:])
            for child in list(whole)[:lo]:
                shapes["input_args"] = child(shapes["input_args"])
            shapes["output_args"] = submod(shapes["input_args"]).requires_grad_()
        # a received activation requires grad (its gradient is sent back), as the dynamic mode infers
        shapes["input_args"].requires_grad_(not first)
        shapes["input_grads"], shapes["output_grads"] = shapes["input_args"], shapes["output_args"]
        wrapped = DDP(submod, process_group=dp_groups[k], **options)
    del whole
    stage = PipelineStage(wrapped, k, stages, torch.device("cpu"), group=pipeline_group, **shapes)
    schedule_cls = ScheduleGPipe if strategy == "pipeline-gpipe" else Schedule1F1B

    def stage_loss(output, target_mb):
        return loss_fn(output, (None, target_mb))

    schedule = schedule_cls(stage, n_microbatches=microbatches, loss_fn=stage_loss)
    opt, _ = steps.prepare(submod, Mode.TRAIN, factory)

    if checkpoint is not None:
        from estimator.capture.checkpointing import checkpointing
        from estimator.vocab.strategy import Strategy

        recompute = Strategy(checkpoint=checkpoint)
    else:
        recompute = None

    def run():
        args = (held[0],) if first else ()
        kwargs = {"target": held[1], "losses": []} if last else {}
        if recompute is None:
            out = schedule.step(*args, **kwargs)
        else:
            with checkpointing(submod, recompute):
                out = schedule.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    role = f"stage {k}/{stages} (children {lo}:{hi})" + (f", replica {d}/{replicas}" if replicas > 1 else "")
    state_sample = [t for t in held if t is not None]
    return wrapped, role, run, submod, state_sample, batch // replicas, opt


class _InputOnly(nn.Module):
    def __init__(self, seq: nn.Sequential):
        super().__init__()
        self.seq = seq

    def forward(self, x, target=None):
        return self.seq(x)


# A build for quick checks: ``functools.partial(sequential_mlp, width=256, layers=4)``.
def sequential_mlp(width: int = 256, layers: int = 4, classes: int | None = None):
    """nn.Sequential of ``layers`` x (Linear(width, width) + ReLU); sample ``(x, target)``
    with a class target when ``classes`` (the last Linear then has ``classes`` outputs),
    else a regression target; loss: cross entropy / MSE."""
    mods: list[nn.Module] = []
    for i in range(layers):
        out = classes if classes and i == layers - 1 else width
        mods += [nn.Linear(width, out), nn.ReLU()]
    model = nn.Sequential(*mods)
    return model, functools.partial(_mlp_sample, width, classes), functools.partial(_mlp_loss, classes)


def _mlp_sample(width, classes, batch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=g)
    target = torch.randint(classes, (batch,), generator=g) if classes else torch.randn(batch, width, generator=g)
    return x, target


def _mlp_loss(classes, output, sample):
    target = sample[-1]
    if classes:
        return nn.functional.cross_entropy(output, target)
    return nn.functional.mse_loss(output, target)
