"""A run from a cold start through the caching-allocator model (``estimator.devices.cuda_run``).

The synthetic timelines' expected figures follow the allocator's rules by hand
(``c10/cuda/CUDACachingAllocator.cpp``): requests of (1, 10) MiB get a 20 MiB segment, larger
ones a segment of their size rounded to 2 MiB, best fit takes the smallest free block that
fits, and a large block is split when more than 1 MiB would remain.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import estimator
from estimator.account import CATEGORIES, OpMemory, Timeline
from estimator.capture.records import RunMarks
from estimator.devices.cuda_run import replay_run, replay_step
from estimator.vocab.allocator_options import AllocatorConfig
from estimator.vocab.categories import Birth, Born, Category, Phase
from estimator.vocab.symbolic import ZERO, Poly

MiB = 2**20
_NONE = (ZERO,) * len(CATEGORIES)


def _op(i: int, phase: Phase) -> OpMemory:
    return OpMemory(i, "aten.add.Tensor", None, phase, "", _NONE, _NONE, total=ZERO)


def _timeline(storages, births, phases, marks=RunMarks()) -> Timeline:
    storages = tuple((Poly.const(n * MiB), category, op, freed) for n, category, op, freed in storages)
    return Timeline(_NONE, tuple(_op(i, p) for i, p in enumerate(phases)), storages, births=births, marks=marks)


# P: a 4 MiB parameter; X: a 2 MiB batch; A: a 12 MiB activation made by the forward op and
# freed after the backward op; G: a 4 MiB gradient made by the backward op and freed after the
# optimizer op; M: 4 MiB of optimizer state, which a run's first step makes at optimizer.step().
TRAIN = _timeline(
    [(4, Category.PARAMETER, -1, None), (2, Category.INPUT, -1, None), (4, Category.OPTIMIZER_STATE, -1, None),
     (12, Category.ACTIVATION, 0, 1), (4, Category.GRADIENT, 1, 2)],
    (Born(Birth.LOAD), Born(Birth.BATCH), Born(Birth.OPTIMIZER, 0), None, None),
    (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER),
    RunMarks(optimizer_starts=(2,)),
)


def test_the_first_step_puts_the_optimizer_state_where_activations_were():
    run = replay_run(TRAIN, 1, AllocatorConfig(), [])
    # load: P -> segment 1 (20 MiB) [P4 f16].  Step 1: X -> [P4 X2 f14]; A (12) -> [P4 X2 A12 f2];
    # G (4): no free block fits -> segment 2 [G4 f16]; A freed -> [P4 X2 f14]; M (4) made at the
    # optimizer's step, best fit f14 -> [P4 X2 M4 f10]; G freed -> segment 2 [f20].  Step 2: X
    # again in its place; A -> f20 (the smallest that fits) [A12 f8]; G -> f8 [A12 G4 f4].
    # A freed -> [f12 G4 f4] -> G freed -> [f20]: the layout step 1 left, so every later step repeats
    # step 2 and the replay stops there.  Peak allocated P + X + M + A + G = 26 MiB, reserved 2 x 20 = 40 MiB.
    assert (run.stats.peak_allocated, run.stats.peak_reserved) == (26 * MiB, 40 * MiB)
    assert (run.steps, run.repeated, run.carried) == (2, True, 0)


def test_one_step_after_empty_cache_as_a_benchmark_measures_it():
    stats = replay_step(TRAIN, 1, AllocatorConfig(), [])
    # After step 1 as above, empty_cache() frees segment 2 (wholly free): reserved 20 MiB, and the
    # peaks restart from the 10 MiB allocated (P, X, M).  Step 2: A (12) fits no free block (f10)
    # -> a 12 MiB segment; G -> f10.  Allocated 26 MiB, reserved 20 + 12 = 32 MiB.
    assert (stats.peak_allocated, stats.peak_reserved) == (26 * MiB, 32 * MiB)


def test_the_previous_output_lives_until_the_model_returns():
    # An inference step: the forward op makes the 4 MiB output O, which outlives the step; in a
    # loop (out = model(x)) it is freed once the next step's model call returns (after op 0).
    timeline = _timeline([(4, Category.PARAMETER, -1, None), (4, Category.ACTIVATION, 0, None)],
                         (Born(Birth.LOAD), None), (Phase.FORWARD,), RunMarks(model_returns=1))
    run = replay_run(timeline, 1, AllocatorConfig(), [])
    # P [P4 f16]; step 1: O -> [P4 O4 f12]; step 2: O' -> [P4 O4 O'4 f8], then O freed. Peak 12 MiB.
    assert (run.stats.peak_allocated, run.stats.peak_reserved, run.carried) == (12 * MiB, 20 * MiB, 4 * MiB)
    # A step function instead (no model_returns mark): what it returns dies with it.
    alone = replay_run(_timeline([(4, Category.PARAMETER, -1, None), (4, Category.ACTIVATION, 0, None)],
                                 (Born(Birth.LOAD), None), (Phase.FORWARD,)), 1, AllocatorConfig(), [])
    assert (alone.stats.peak_allocated, alone.carried) == (8 * MiB, 0)


def test_a_workspace_is_made_at_its_first_use():
    # The 32 MiB workspace made at op 1 (the backward) lands after A and stays: segment of 32 MiB.
    run = replay_run(TRAIN, 1, AllocatorConfig(), [(1, 32 * MiB)])
    assert run.stats.peak_reserved == 40 * MiB + 32 * MiB


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))  # registered before the child: first in named_parameters
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * self.scale


def _born(rep) -> dict[str, Born]:
    return {owner: born for owner, born, (_, category, op, _) in
            zip(rep.timeline.owners, rep.timeline.births, rep.timeline.storages)
            if op < 0 and category is Category.PARAMETER}


def test_parameters_arrive_in_module_apply_order_and_adam_state_at_its_step():
    rep = estimator.report(_Scaled(), torch.randn(4, 8), optimizer="adamw", device="cuda")
    # Module._apply: children first (lin.weight, lin.bias), then the module's own (scale).
    assert _born(rep) == {"lin.weight": Born(Birth.LOAD, 0), "lin.bias": Born(Birth.LOAD, 1),
                          "scale": Born(Birth.LOAD, 2)}
    births = rep.timeline.births
    states = [b for b, s in zip(births, rep.timeline.storages) if s[1] is Category.OPTIMIZER_STATE and s[2] < 0]
    assert states and set(states) == {Born(Birth.OPTIMIZER, 0)}  # exp_avg, exp_avg_sq (step: a CPU tensor)
    # the built-in step's optimizer phase starts with optimizer.step()
    first = next(i for i, op in enumerate(rep.timeline.ops) if op.phase is Phase.OPTIMIZER)
    assert rep.timeline.marks.optimizer_starts == (first,)
    assert {b for b, s in zip(births, rep.timeline.storages) if s[1] is Category.INPUT} == {Born(Birth.BATCH)}


def test_adagrad_state_is_made_by_its_constructor():
    rep = estimator.report(nn.Linear(8, 8), torch.randn(4, 8), optimizer="adagrad", device="cuda")
    states = {b for b, s in zip(rep.timeline.births, rep.timeline.storages) if s[1] is Category.OPTIMIZER_STATE}
    assert Born(Birth.SETUP) in states and Born(Birth.OPTIMIZER, 0) not in states


def test_gradients_a_user_step_keeps_come_with_the_first_backward():
    def step(model, x, optimizer):
        optimizer.zero_grad(set_to_none=False)
        model(x).sum().backward()
        optimizer.step()

    rep = estimator.report(nn.Linear(8, 8), torch.randn(4, 8), step=step, optimizer="sgd", device="cuda")
    grads = {b for b, s in zip(rep.timeline.births, rep.timeline.storages) if s[1] is Category.GRADIENT and s[2] < 0}
    assert grads == {Born(Birth.BACKWARD)}
    assert rep.timeline.marks.model_returns is None  # a step function: what it returns dies with it


@pytest.mark.parametrize("forked", [False, True])
def test_replay_both_is_the_two_replays(forked, monkeypatch):
    """``replay_both`` replays the first step's ops once for both protocols: its figures are
    ``replay_run``'s and ``replay_step``'s, replayed apart; also with the step's replay, and the
    report's, in a forked process (a long run's, ``FORK_OPS``)."""
    from estimator.devices import cuda, cuda_run
    from estimator.devices.cuda_run import replay_both, replay_run, replay_step
    from estimator.vocab.allocator_options import AllocatorConfig

    if forked:
        monkeypatch.setattr(cuda_run, "FORK_OPS", 0)
        monkeypatch.setattr(cuda, "FORK_OPS", 0)  # the report's replay, beside its assembly
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    rep = estimator.report(model, torch.randn(8, 256), device="cuda")
    timeline = rep.timeline
    assert rep.cuda == cuda.predict(timeline, 8, rep.target) == cuda.predict_started(
        lambda: timeline, len(timeline.ops), 8, rep.target)()
    for cfg in (AllocatorConfig(), AllocatorConfig.parse("expandable_segments:True")):
        workspaces = [(0, 8 * 2**20)]
        run, step = replay_both(timeline, 8, cfg, workspaces, device_total=80 * 2**30)
        assert run == replay_run(timeline, 8, cfg, workspaces, device_total=80 * 2**30)
        assert step == replay_step(timeline, 8, cfg, workspaces, device_total=80 * 2**30)
        assert run.steps >= 3 and step.peak_allocated > 0
        for capacity in {run.stats.peak_reserved - 1, step.peak_reserved - 1}:  # out of memory: as raised apart
            both, apart = _outcome(lambda: replay_both(timeline, 8, cfg, workspaces, capacity)[::-1]), _outcome(
                lambda: (replay_step(timeline, 8, cfg, workspaces, capacity), replay_run(timeline, 8, cfg, workspaces,
                                                                                         capacity)))
            assert both == apart


def _outcome(replay):
    """What ``replay()`` returns, or the message of the ``OutOfMemory`` it raises."""
    from estimator.devices.cuda_allocator import OutOfMemory

    try:
        return replay()
    except OutOfMemory as exc:
        return str(exc)


@pytest.mark.parametrize("forked", [False, True])
def test_a_long_replay_starts_before_the_accounting(forked, monkeypatch):
    """A long replay starts from the raw capture, beside its accounting (``estimate._replay_started``,
    ``account.skeleton``): with ``s`` a symbol too, the figures are the replay of the report's own
    timeline at the batch and the sample's ``s``, as when started after it."""
    from estimator.account import account, skeleton
    from estimator.devices import cuda, cuda_run
    from estimator.orchestrate import estimate
    from estimator.vocab import forked as forking

    if forked:
        monkeypatch.setattr(cuda_run, "FORK_OPS", 0)
        monkeypatch.setattr(cuda, "FORK_OPS", 0)
    started, raws = [], []
    real = estimate._replay_started

    def spy(checked, early, raw, seq):
        real(checked, early, raw, seq)
        started.append(len(early))
        raws.append((raw, seq))

    monkeypatch.setattr(estimate, "_replay_started", spy)
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    tokens = torch.randint(0, 100, (4, 24))
    rep = estimator.report(model, tokens, batch=6, device="cuda", gpu="H100", dynamic={1: "s"})
    assert rep.seq == 24 and started == [int(forked and forking.can_fork())]
    (raw, seq), = raws
    at_batch = account(raw).at_s(seq)
    assert rep.cuda == cuda.predict(at_batch, 6, rep.target) == cuda.predict(skeleton(raw, seq), 6, rep.target)
    bare = skeleton(raw, seq)  # what a replay reads, as the accounted timeline has it
    assert bare.storages == at_batch.storages and bare.births == at_batch.births and bare.owners == at_batch.owners
    assert [(o.op, o.phase, o.scratch, o.stream) for o in bare.ops] == [
        (o.op, o.phase, o.scratch, o.stream) for o in at_batch.ops]


@pytest.mark.parametrize("early", [True, False])
def test_a_report_that_fails_stops_its_started_replay(early, monkeypatch):
    """A report that raises after its replay started (before the accounting,
    ``estimate._replay_started``, or once captured) leaves no process behind: the replay's child
    is killed and reaped (``forked.Started.cancel``)."""
    import os

    from estimator.devices import cuda, cuda_run
    from estimator.orchestrate import estimate
    from estimator.vocab import forked as forking

    monkeypatch.setattr(cuda_run, "FORK_OPS", 0)
    monkeypatch.setattr(cuda, "FORK_OPS", 0)
    started = []
    start = cuda.predict_started

    def spy(*args):
        replay = start(*args)
        started.append(replay.pid)
        return replay

    monkeypatch.setattr(cuda, "predict_started", spy)
    if not early:
        monkeypatch.setattr(estimate, "_replay_started", lambda *args: None)

    def fails(*args, **kwargs):
        raise RuntimeError("after the capture")

    monkeypatch.setattr(estimate, "result", fails)
    with pytest.raises(RuntimeError, match="after the capture"):
        estimator.report(nn.Linear(8, 8), torch.randn(4, 8), device="cuda")
    assert len(started) == 1 and (started[0] is not None) == forking.can_fork()
    for pid in filter(None, started):
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # killed and reaped already
