"""A run from a cold start, replayed through the caching-allocator model.

What a user's job does, and what ``torch.cuda.max_memory_reserved()`` or nvidia-smi show after a
few steps of it::

    model = build().to("cuda")                  # parameters and buffers arrive (Module._apply's order)
    opt = torch.optim.AdamW(model.parameters())  # (its state comes with the first opt.step())
    for x in batches:            # rebinding x frees the previous step's batch
        x = x.to("cuda")
        out = model(x)           # the previous step's out and loss are freed when out is rebound
        loss = loss_fn(out, x)
        loss.backward(); opt.step(); opt.zero_grad()

The first step differs from the steady ones: the optimizer state is made inside the first
``optimizer.step()`` (``Optimizer._init_group``), out of blocks the step's activations just
freed; a ``GradScaler``'s scale and the gradients a step keeps (``zero_grad(set_to_none=False)``)
come with the first backward; each cuBLAS workspace with the first matmul of its thread
(``CublasHandlePool.cpp``: ``getCurrentCUDABlasHandle`` -> ``getCUDABlasLtWorkspace``).  No
``empty_cache()`` happens, so the segments the first step leaves shape every later one.  Steady
steps follow until the allocator's state (``CachingAllocatorModel.snapshot``) repeats one it
had after an earlier step: the steps between the two are a cycle every later step repeats
(every step runs the same ops from the second on, so a state after step k that equals the one
after step j < k makes step k + 1 repeat step j + 1).  Often the second step already leaves the
first one's layout (an inference step, ``generate()``); often the cycle is of two steps (the
previous output takes one of two blocks in turns).  Small
blocks can drift for many steps before they cycle (BERT-base: 11); the replay also stops when
the peaks, the reserved bytes and the segments have not changed for ``STABLE`` steps, and says
so (``Run.repeated`` False).

Where the state comes from is ``Timeline.births`` (``estimator.capture.phases.mark_births``) and
``Timeline.marks`` (the ops where each ``optimizer.step()`` starts and the built-in step's model
call returns).  A timeline without them (a strategy's per-rank step) loads all of its state
first, in storage order.  Each op's outputs and scratch are allocated on its stream
(``OpMemory.stream``: FSDP2 all-gathers and reduce-scatters on side streams), whose freed blocks
serve that stream only; the state the run loads or makes lazily is on the default stream.  A
user's step function returns before the next starts: what it returns is freed at once.  Not modelled: the allocations of a transformers ``from_pretrained``
load (its order and temporaries; the parameters are placed as ``.to()`` places them), and
optimizers with several parameter groups make each group's state just before that group's
update, not all at the start of ``step()``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Hashable
from dataclasses import dataclass

from estimator.account import Timeline
from estimator.devices.cuda_allocator import AllocatorStats, CachingAllocatorModel, OutOfMemory
from estimator.vocab import forked, progress
from estimator.vocab.allocator_options import AllocatorConfig
from estimator.vocab.categories import Birth, Category, Phase

MAX_STEPS = 16  # steps replayed at most
CHUNK = 1 << 16  # the ops a progress bar moves by
STABLE = 4  # ... or until the figures have not changed for this many steps (a layout that drifts slowly)
FORK_OPS = 1 << 17  # events (or a timeline's ops: cuda.predict_started) from which a forked process pays


@dataclass(frozen=True)
class Run:
    """The allocator's figures over a replayed run (``stats``: its peaks are the run's)."""

    stats: AllocatorStats
    steps: int  # steps replayed
    repeated: bool  # whether the allocator's state repeated (the figures hold for any longer run; else they
    # were the same over the last STABLE steps, or the run reached MAX_STEPS)
    carried: int = 0  # bytes of the previous step's output and loss alive at the allocated peak


def replay_run(timeline: Timeline, b: int, cfg: AllocatorConfig, workspaces: list[tuple[int, int]],
               capacity: int | None = None, device_total: int | None = None, max_steps: int = MAX_STEPS) -> Run:
    """Replay the model's load and steps of ``timeline`` at batch size ``b`` until the allocator's
    state after a step repeats (at least two steps: the first, then a steady one).

    ``workspaces``: ``(op index, bytes)`` of each buffer a library makes at its first use in the
    first step and holds from then on (the cuBLAS workspaces).  ``capacity`` and ``device_total``:
    as ``CachingAllocatorModel`` takes them.
    """
    return _Replay(_Plan(timeline, b, workspaces), timeline, cfg, capacity, device_total).steps(max_steps)


def replay_step(timeline: Timeline, b: int, cfg: AllocatorConfig, workspaces: list[tuple[int, int]],
                capacity: int | None = None, device_total: int | None = None) -> AllocatorStats:
    """One steady step measured after a warm-up step, as a benchmark measures it: the model
    loaded, one batch moved, a first step (what it returns freed at once), ``empty_cache()``,
    ``reset_peak_memory_stats()``, a second step on the same batch: its peaks."""
    replay = _Replay(_Plan(timeline, b, workspaces), timeline, cfg, capacity, device_total)
    return replay.warm_up_protocol().steps(2, reset_after_first=True).stats


def replay_both(timeline: Timeline, b: int, cfg: AllocatorConfig, workspaces: list[tuple[int, int]],
                capacity: int | None = None, device_total: int | None = None) -> tuple[Run, AllocatorStats]:
    """``replay_run`` and ``replay_step`` of one plan: the two are the same up to the end of the
    first step's ops (only what the first step returns is handled apart: kept until the next model
    call in a run, freed at once in the benchmark's protocol), so that part is replayed once and
    the allocator's state copied.  An ``OutOfMemory`` is raised as by ``replay_step`` then
    ``replay_run``.  A long run's two replays after the first step run side by side, the step's in a
    forked process (``vocab.forked``): a long ``generate()``'s replay is seconds per step."""
    with progress.task("CUDA caching-allocator replay", unit="op") as bar:  # a long generate(): seconds
        run = _Replay(_Plan(timeline, b, workspaces), timeline, cfg, capacity, device_total, bar)
        run.step_ops()  # the first step's
        bench = run.fork().warm_up_protocol()
        if len(run.plan.program) < FORK_OPS:
            step = bench.steps(2, reset_after_first=True).stats
            return run.steps(MAX_STEPS), step
        bench.bar = progress.SILENT
        step = forked.started(lambda: bench.steps(2, reset_after_first=True).stats)
        try:
            ran = run.steps(MAX_STEPS)
        except OutOfMemory:
            step()  # the step's own, first
            raise
        except BaseException:
            step.cancel()
            raise
        return ran, step()


class _Replay:
    """The allocator's state over a replayed run of ``plan``'s steps."""

    def __init__(self, plan: _Plan, timeline: Timeline, cfg: AllocatorConfig, capacity: int | None,
                 device_total: int | None, bar: progress.Bar = progress.SILENT) -> None:
        self.plan, self.n_ops, self.bar = plan, len(timeline.ops), bar
        self.alloc = CachingAllocatorModel(cfg, capacity, device_total=device_total)
        self.handles: dict[Hashable, int] = {}
        self.previous: list[tuple[int, int]] = []  # the previous step's output and loss: (handle, bytes)
        self.carried = [0, 0]  # bytes in ``previous`` now, and when the allocated peak was last raised
        self.returns, self.same_batch = plan.returns, False  # a new batch every step (else one, moved once)
        self.done = 0  # steps whose ops were replayed
        self.seen: set = set()  # the allocator's state after each step
        self.figures: list[tuple] = []  # the peaks, reserved bytes and segments after each step
        for key in plan.loaded:
            self._new(key, plan.sizes[key])

    def warm_up_protocol(self) -> _Replay:
        """A benchmark's protocol: what the warm-up step returns is deleted at once; one batch."""
        self.returns, self.same_batch = None, True
        return self

    def fork(self) -> _Replay:
        """A copy of this replay's state (the plan shared)."""
        other = copy.copy(self)
        other.alloc, other.handles, other.previous = self.alloc.copy(), dict(self.handles), list(self.previous)
        other.carried, other.seen, other.figures = list(self.carried), set(self.seen), list(self.figures)
        return other

    def _new(self, key: Hashable, nbytes: int, stream: int = 0) -> None:
        peak = self.alloc.peak_allocated
        self.handles[key] = self.alloc.malloc(nbytes, stream)
        if self.alloc.peak_allocated > peak:
            self.carried[1] = self.carried[0]

    def _drop(self, key: Hashable) -> None:
        handle = self.handles.pop(key, None)
        if handle is not None:
            self.alloc.free(handle)

    def step_ops(self) -> None:
        """The next step's batch and ops (``steps`` then handles what the step leaves)."""
        plan, first, new, drop = self.plan, self.done == 0, self._new, self._drop
        for key in plan.batch:
            if not (self.same_batch and key in self.handles):
                drop(key)
                new(key, plan.sizes[key])
        for key in plan.frees.get(-1, ()):
            drop(key)
        for n, (i, allocs, scratch, stream, frees) in enumerate(plan.program, 1):
            if not n % CHUNK:
                self.bar.update(CHUNK)
            if first:
                for key, nbytes in plan.born.get(i, ()):
                    new(key, nbytes)
            if i == self.returns:
                for handle, _ in self.previous:
                    self.alloc.free(handle)
                self.previous, self.carried[0] = [], 0
            if i == self.n_ops:
                break
            for key, nbytes in allocs:
                new(key, nbytes, stream)
            if scratch:
                new("scratch", scratch, stream)
                drop("scratch")
            for key in frees:
                drop(key)
        self.bar.update(len(plan.program) % CHUNK)
        self.done += 1

    def steps(self, max_steps: int, reset_after_first: bool = False) -> Run:
        """Replay steps (from where the replay is) until the allocator's state repeats, the figures
        are stable, or ``max_steps``; ``reset_after_first``: ``empty_cache()`` and the peaks reset
        after the first step."""
        plan, alloc = self.plan, self.alloc
        for n in range(max_steps):
            if reset_after_first and n == 1:
                alloc.empty_cache()
                alloc.reset_peak_stats()
                self.carried[1] = 0
            if self.done == n:
                self.step_ops()
            for key in plan.survivors:
                if key not in self.handles:
                    continue
                if key in plan.replaces:  # the state the next step frees and makes again
                    self.handles[plan.replaces[key]] = self.handles.pop(key)
                elif self.returns is None:
                    self._drop(key)
                else:
                    self.previous.append((self.handles.pop(key), plan.sizes[key]))
                    self.carried[0] += plan.sizes[key]
            if n or not reset_after_first:  # (the state before an empty_cache() is no step's start)
                snapshot = alloc.snapshot()
                if snapshot in self.seen:  # a cycle (often of two steps: blocks the output takes in turns)
                    return Run(alloc.stats, n + 1, True, self.carried[1])
                self.seen.add(snapshot)
            stats = alloc.stats
            self.figures.append((stats.peak_allocated, stats.peak_reserved, stats.reserved, stats.segments))
            if len(self.figures) > STABLE and len(set(self.figures[-STABLE - 1:])) == 1:
                break
        return Run(alloc.stats, len(self.figures), False, self.carried[1])


class _Plan:
    """The run's events at one batch size, by op index: what each op allocates and frees, the
    state the first step makes before it, the storages that outlive the step."""

    def __init__(self, timeline: Timeline, b: int, workspaces: list[tuple[int, int]]) -> None:
        storages = timeline.storages
        self.sizes = sizes = [nbytes(b) for nbytes, *_ in storages]  # by storage
        births = timeline.births or (None,) * len(storages)  # unknown: state loaded first, in storage order
        allocs: dict[int, list[int]] = {}
        self.frees: dict[int, list[int]] = {}
        made, freeing = allocs.setdefault, self.frees.setdefault  # (a long generate(): a million storages)
        scratch = {i: max(s(b) for s in op.scratch) for i, op in enumerate(timeline.ops) if op.scratch}
        self.born: dict[int, list[tuple[Hashable, int]]] = {}
        self.survivors: list[int] = []
        load, setup, self.batch = [], [], []

        @functools.cache
        def first(phase: Phase) -> int | None:  # (asked only for state born there: not by a long generate())
            return next((i for i, op in enumerate(timeline.ops) if op.phase is phase), None)

        starts = timeline.marks.optimizer_starts
        for k, ((_, category, op, freed), born) in enumerate(zip(storages, births)):
            if freed is not None:
                freeing(freed, []).append(k)
            if op >= 0:
                made(op, []).append(k)
                if freed is None:
                    self.survivors.append(k)
            elif born is None or born.when is Birth.LOAD:
                load.append((k if born is None else born.order, k))
            elif born.when is Birth.SETUP:
                setup.append(k)
            elif born.when is Birth.BATCH:
                self.batch.append(k)
            else:
                at = starts[born.order] if born.when is Birth.OPTIMIZER and born.order < len(starts) else None
                if at is None:
                    at = first(Phase.BACKWARD if born.when is Birth.BACKWARD else Phase.OPTIMIZER)
                self.born.setdefault(0 if at is None else at, []).append((k, self.sizes[k]))
        self.loaded = [k for _, k in sorted(load)] + setup
        for n, (at, nbytes) in enumerate(workspaces):
            self.born.setdefault(at, []).append((("workspace", n), nbytes))
        self.returns = timeline.marks.model_returns
        self.replaces = _replaced(timeline, self.survivors, self.sizes)
        # the ops where anything happens, in order, up to the end of the step (op n: what comes after
        # the last op), as (op, its outputs as (key, bytes), its scratch, its stream, what it frees);
        # what an op allocates is on its stream
        ops, n = timeline.ops, len(timeline.ops)
        busy = {*allocs, *self.frees, *self.born, *(i for i, x in scratch.items() if x), n}
        if self.returns is not None:
            busy.add(self.returns)
        nothing, frees = (), self.frees
        self.program = [(i, tuple([(k, sizes[k]) for k in allocs[i]]) if i in allocs else nothing, scratch.get(i, 0),
                         ops[i].stream if i < n else 0, tuple(frees[i]) if i in frees else nothing)
                        for i in sorted(busy) if 0 <= i <= n]


def _replaced(timeline: Timeline, survivors: list[int], sizes: list[int]) -> dict[int, int]:
    """Storages the step makes that outlive it, paired with the state alive before it that the
    step frees (an optimizer that replaces its state, a step that rebinds a buffer): the same
    category, parameter and size.  Inputs are a new batch every step, not paired."""
    freed: dict[tuple, list[int]] = {}
    for k, (_, category, op, after) in enumerate(timeline.storages):
        if op < 0 and after is not None and category is not Category.INPUT:
            freed.setdefault((category, _owner(timeline, k), sizes[k]), []).append(k)
    pairs = {}
    for k in survivors:
        same = freed.get((timeline.storages[k][1], _owner(timeline, k), sizes[k]))
        if same:
            pairs[k] = same.pop(0)
    return pairs


def _owner(timeline: Timeline, k: int) -> str | None:
    return timeline.owners[k] if timeline.owners else None

