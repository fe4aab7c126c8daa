"""A job's own pipeline: ``Strategy(mesh={"pp": ..}, parallelize=fn)`` where ``fn`` cuts the model to
the rank's stage, shards it and returns its ``torch.distributed.pipelining`` schedule; the schedule
runs in the capture as written (``estimator/capture/pipelines.py``), against real gloo jobs running
the same function (``validators/distributed.py`` strategy ``"mesh"``)."""

from __future__ import annotations

import functools
import gc
import math
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

import estimator
from estimator import Strategy
from estimator.capture import pipelines
from estimator.vocab.errors import InputError
from models_zoo import parallelize as par
from validators.distributed import _InputOnly, measure_ranks, sequential_mlp

PP_FSDP = {"pp": 2, "dp_shard": 2}


def _mlp(width: int = 256, layers: int = 4):
    model, sample_fn, _ = sequential_mlp(width, layers)
    return _InputOnly(model), sample_fn


def _pipeline(rows: int | None = 16, **options):
    """1F1B over the Sequential's 4 Linear layers: stage 0 children 0-3, stage 1 children 4-7;
    4 micro-batches of ``rows`` (the stages' given shapes: static mode; None: dynamic mode)."""
    return functools.partial(par.sequential_pipeline, rows=rows, microbatches=4, split_points=(4,), **options)


def _report(fn, mesh=PP_FSDP, batch: int = 64, **kwargs):
    model, sample_fn = _mlp()
    return estimator.report(model, sample_fn(batch), batch=batch, device="cpu",
                            strategy=Strategy(mesh=mesh, parallelize=fn), **kwargs)


def _per_rank(rep) -> dict[int, int]:
    return {rank: r.report.peak_bytes for r in rep.ranks for rank in r.ranks}


def _measured(fn, mesh: dict, batch: int, model: str = "mlp") -> dict[int, int]:
    from validators.strategies import MODELS

    return {m.rank: m.peak_bytes for m in measure_ranks("mesh", math.prod(mesh.values()), MODELS[model], batch,
                                                        threads=1, mesh=mesh, parallelize=fn)}


@pytest.mark.parametrize("rows", [16, None], ids=["static", "dynamic"])
def test_pipeline_x_fsdp2_matches_a_real_gloo_job(rows):
    """PP 2 x FSDP2 2 (torchtitan's layout: ``("pp", "dp_shard")``, rank = stage * 2 + shard), 1F1B,
    4 micro-batches of 16 rows of 256: each rank's peak as a real 4-process job measures it, in the
    static mode (the stages given their shapes) and the dynamic mode (the later stage's input shapes
    from the earlier stage's forward, run as its rank: ``pipelines.input_shapes``).  Tolerance: the
    strategies validator's 0.5 %; measured exact to the byte (``python -m validators.strategies``)."""
    rep = _report(_pipeline(rows))
    assert [(r.role, r.ranks) for r in rep.ranks] == [("pp 0 of 2", (0, 1)), ("pp 1 of 2", (2, 3))]
    predicted = _per_rank(rep)
    assert predicted == {0: 2_416_672, 1: 2_416_672, 2: 2_498_596, 3: 2_498_596}
    measured = _measured(_pipeline(rows), PP_FSDP, 64)
    assert all(abs(predicted[k] - measured[k]) <= 0.005 * measured[k] for k in measured)
    # the receive buffers the stages keep: stage 0 receives its output's gradient, stage 1 its
    # input, 4 micro-batches of 16 x 256 fp32 each
    for r in rep.ranks:
        assert r.report.breakdown[estimator.Category.COMMUNICATION] >= 4 * 16 * 256 * 4


def test_one_capture_answers_every_batch():
    """The capture is symbolic in b (the schedule's micro-batch m = b / 4 a symbol, the stages' given
    shapes taken at it): the formula at b = 128 is what a real job at 128 measures (2,793,504 and
    2,957,348 B, GPipe with all-gathers after each forward); b must be a multiple of 4."""
    rep = _report(_pipeline(schedule="gpipe", reshard_after_forward=True))
    assert rep.path is estimator.CapturePath.SYMBOLIC
    assert {r.role: r.report.at(128) for r in rep.ranks} == {"pp 0 of 2": 2_793_504, "pp 1 of 2": 2_957_348}
    assert rep.max_batch(4 * 2**20) % 4 == 0
    with pytest.raises(InputError, match="multiple of 4, got 66"):
        _report(_pipeline(), batch=66)


def test_a_later_stages_ranks_are_grouped_by_their_own_capture():
    """FSDP2 over 3 ranks of 250-row Linears: the last shard is smaller.  Rank 0's capture groups its
    own stage's ranks (0-1 | 2) and the other stage's by place alone; rank 3's capture splits those
    (3-4 | 5), and rank 5 is captured too.  Measured on 6 gloo processes (``validators.strategies``)."""
    model, sample_fn, _ = sequential_mlp(250, 3)
    mesh = {"pp": 2, "dp_shard": 3}
    fn = functools.partial(par.sequential_pipeline, microbatches=2)
    rep = estimator.report(_InputOnly(model), sample_fn(32), batch=32, device="cpu",
                           strategy=Strategy(mesh=mesh, parallelize=fn))
    assert [r.role for r in rep.ranks] == ["pp 0 of 2, dp_shard 0-1 of 3", "pp 0 of 2, dp_shard 2 of 3",
                                           "pp 1 of 2, dp_shard 0-1 of 3", "pp 1 of 2, dp_shard 2 of 3"]
    assert _per_rank(rep) == {0: 1_136_048, 1: 1_136_048, 2: 1_132_032, 3: 1_989_076, 4: 1_989_076, 5: 1_981_044}


def test_a_pure_pipeline_of_four_stages():
    """PP 4 (every rank a stage, the default process group), 8 micro-batches, cross entropy on the
    last stage; measured on 4 gloo processes."""
    model, sample_fn, _ = sequential_mlp(256, 4, 10)
    fn = functools.partial(par.sequential_pipeline, microbatches=8, split_points=(2, 4, 6), loss="cross_entropy")
    rep = estimator.report(_InputOnly(model), sample_fn(128), batch=128, device="cpu",
                           strategy=Strategy(mesh={"pp": 4}, parallelize=fn))
    assert _per_rank(rep) == {0: 1_840_148, 1: 1_971_220, 2: 1_971_220, 3: 353_140}


def test_sends_hold_their_tensor_as_gloos_works_do():
    """ProcessGroupGloo's SendWork keeps its tensor: the fake process group's work does not, the
    capture's does (``pipelines._Held``), until the work is dropped."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pipelines.answered(None, 1):
            sent = torch.ones(4)
            alive = weakref.ref(sent)
            work = dist.isend(sent, dst=1)
            del sent
            gc.collect()
            assert alive() is not None
            work.wait()
            del work
            gc.collect()
            assert alive() is None
    finally:
        dist.destroy_process_group()


def _uncut(model, mesh, loss_fn=nn.functional.mse_loss, part=lambda model: model.seq[0]):
    """A stage over ``part(model)`` (the first Linear: the others not cut away) on every rank."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = PipelineStage(part(model), mesh["pp"].get_local_rank(), 2, torch.device("cpu"))
    return ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)


def test_what_a_pipeline_cannot_be_is_named():
    model, sample_fn = _mlp()

    def report(fn, mode="train", **options):
        return estimator.report(model, sample_fn(8), batch=8, device="cpu", mode=mode,
                                strategy=Strategy(mesh={"pp": 2}, parallelize=fn, **options))

    with pytest.raises(InputError, match="parameters outside this rank's pipeline stages"):
        report(_uncut)
    with pytest.raises(InputError, match="not the model or one of its modules"):
        report(functools.partial(_uncut, part=lambda model: nn.Linear(2, 2)))
    with pytest.raises(InputError, match="without loss_fn"):
        report(functools.partial(_uncut, loss_fn=None))
    with pytest.raises(InputError, match="for mode='train'"):
        report(_pipeline(rows=2), mode="inference")
    with pytest.raises(InputError, match="amp with a pipeline schedule"):
        report(_pipeline(rows=2), amp="bf16")
    with pytest.raises(InputError, match="along another dim than 0"):
        report(_chunked_along_features)


def _chunked_along_features(model, mesh):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    stage = PipelineStage(model.seq, mesh["pp"].get_local_rank(), 2, torch.device("cpu"))
    return ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss, args_chunk_spec=(TensorChunkSpec(1),))


def test_a_sample_is_input_and_target():
    assert pipelines.split_sample({"input_ids": 1, "labels": torch.ones(1)})[0] == (1,)
    x, y = torch.ones(2), torch.zeros(2)
    inputs, target = pipelines.split_sample((x, y))
    assert inputs == (x,) and target is y
    with pytest.raises(InputError, match=r"\(input, target\) or a dict with 'labels'"):
        pipelines.split_sample(x)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_derived_pipeline_model_agrees_with_the_jobs_own_schedule(schedule):
    """``Strategy(pipeline=2)`` (``ranks/pipeline.py``, fxmem's model of the schedule from one
    micro-batch's capture) and the job's schedule run as written give the same peaks but for where the
    sample lives: the derived model keeps the input on stage 0 and the target on the last stage, a job
    whose loader hands every rank the batch (torchtitan's) holds both on each: b x 256 x 4 B more."""
    model, sample_fn, loss_fn = sequential_mlp(256, 4)
    derived = estimator.report(_InputOnly(model), sample_fn(64), batch=64, device="cpu", loss_fn=loss_fn,
                               strategy=Strategy(pipeline=2, microbatches=4, schedule=schedule,
                                                 split_points=("seq.4",)))
    run = _report(_pipeline(schedule=schedule), mesh={"pp": 2})
    for b in (64, 128):
        assert [r.report.at(b) - d.report.at(b) for r, d in zip(run.ranks, derived.ranks)] == [b * 256 * 4] * 2


_MLP_PIPELINE = '''
import torch
from torch import nn


def pipeline(model, mesh):
    """The zoo's MLP over 2 stages: its body on stage 0, its head on stage 1 (shapes inferred)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = mesh["pp"].get_local_rank()
    if stage == 0:
        model.head = nn.Identity()
    else:
        model.body = nn.Sequential()
    fully_shard(model, mesh=mesh["dp_shard"])
    return ScheduleGPipe(PipelineStage(model, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group()),
                         n_microbatches=2, loss_fn=nn.functional.cross_entropy)
'''


def test_cli_runs_a_pipeline_from_a_file(tmp_path):
    from click.testing import CliRunner

    from estimator.cli import cli

    path = tmp_path / "job.py"
    path.write_text(_MLP_PIPELINE)
    result = CliRunner().invoke(cli, ["report", "mlp", "--device", "cpu", "-q", "--batch", "8", "--mesh",
                                      "pp=2,dp_shard=2", "--parallelize", f"{path}:pipeline"])
    assert result.exit_code == 0, result.output
    assert "pp 0 of 2" in result.output and "pp 1 of 2" in result.output
    assert "ScheduleGPipe) runs 2 micro-batches of b/2" in result.output and "dynamic mode" in result.output


def _interleaved(model, mesh, rows: int | None = None):
    """``ScheduleInterleaved1F1B``: 4 stages (a Linear and its ReLU each) on 2 pipeline ranks, rank r
    running stages r and r + 2 (the model's Sequential holding the rank's two chunks), each chunk
    under FSDP2 over ``dp_shard`` if the mesh has it; their shapes given (``rows``) or inferred."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    seq, pp = model.seq, mesh["pp"]
    rank, ranks = pp.get_local_rank(), pp.size()
    chunks = nn.ModuleList([seq[2 * s: 2 * s + 2] for s in (rank, rank + ranks)])
    for name in list(seq._modules):
        del seq._modules[name]
    seq.add_module("chunks", chunks)
    for chunk in chunks if "dp_shard" in mesh.mesh_dim_names else ():
        fully_shard(chunk, mesh=mesh["dp_shard"], reshard_after_forward=False)

    def shapes(s: int) -> dict:
        return {} if rows is None else {"input_args": (torch.empty(rows, 256, requires_grad=s > 0),),
                                        "output_args": (torch.empty(rows, 256, requires_grad=True),)}

    stages = [PipelineStage(chunk, s, 2 * ranks, torch.device("cpu"), group=pp.get_group(), **shapes(s))
              for chunk, s in zip(chunks, (rank, rank + ranks))]
    return ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=nn.functional.mse_loss)


@pytest.mark.parametrize(("mesh", "rows", "measured"), [
    ({"pp": 2}, 8, {0: 2_794_524, 1: 2_892_828}),
    ({"pp": 2}, None, {0: 2_794_524, 1: 2_892_828}),
    (PP_FSDP, None, {0: 2_375_712, 1: 2_375_712, 2: 2_424_868, 3: 2_424_868}),
], ids=["given shapes", "inferred shapes", "inferred shapes, fsdp2"])
def test_several_stages_a_rank(mesh, rows, measured):
    """An interleaved schedule's two stages a rank, as written; in the dynamic mode each later stage
    receives the previous stage's output, found on the rank the schedule places it on
    (``stage_index_to_group_rank``).  ``measured``: real gloo jobs running the same function."""
    assert _per_rank(_report(functools.partial(_interleaved, rows=rows), mesh=mesh, batch=32)) == measured


def test_a_deep_models_stages_are_cut_from_every_block():
    """16 children repeating in pairs would be captured as a shallow copy of 5 pairs and extended
    (``repeated_blocks``); a pipeline's function cuts its stages by the blocks' places, so every block
    is captured, said so.  Measured on 2 gloo processes: 311,596 and 323,884 B."""
    model, sample_fn, _ = sequential_mlp(64, 8)
    rep = estimator.report(_InputOnly(model), sample_fn(16), batch=16, device="cpu",
                           strategy=Strategy(mesh={"pp": 2}, parallelize=functools.partial(par.sequential_pipeline,
                                                                                           microbatches=2)))
    assert _per_rank(rep) == {0: 311_596, 1: 323_884}
    assert any("every one of its 16 blocks was captured" in n and "pipeline schedule" in n for n in rep.notes)


def test_torchtitans_pipeline_job():
    """torchtitan's Llama job with a pipeline (``validators/torchtitan.py`` ``pipeline``, after train.py
    at 9dec370: its split of the layers, stages inferring their shapes, op-level SAC, FSDP2 in bf16
    without reshard after forward, 1F1B, its AdamW), at one thread a rank as the validator runs it.
    Measured on a real 4-process gloo job (``python -m validators.strategies``, which also runs its
    3-D job with TP + SP on 8 processes: exact too)."""
    from validators import cpu, torchtitan

    model, sample_fn, _ = torchtitan.tiny()
    with cpu.threads(1):  # the CPU attention kernel's buffers follow the thread count
        rep = estimator.report(model, sample_fn(4), batch=4, device="cpu", optimizer=torchtitan.optimizer,
                               strategy=Strategy(mesh=PP_FSDP, parallelize=torchtitan.pipeline))
    assert _per_rank(rep) == {0: 1_967_836, 1: 1_967_836, 2: 1_344_584, 3: 1_344_584}
