"""The GPU validation suite's plumbing, runnable without a GPU (the measurements are stubbed, or
run on a CPU stand-in in real processes); the real run is `python -m validators.gpu` on a GPU
machine (the `gpu`-marked test here runs one case of it)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import pytest
import torch

import estimator
import models_zoo
from models_zoo import steps
from validators import cuda, gpu
from validators.cuda import CudaMeasurement, RunMeasurement
from validators.gpu import Case, Prediction, Protocol

HEADER = {"gpu_arg": "H200", "device": "stub", "torch": "x", "cuda": "y"}


def test_predictions_match_a_direct_report_and_the_comparison_renders(tmp_path):
    predictions = list(gpu.predict(cases=[("mlp", "debug", (2, 4))], gpu="H200"))
    assert len(predictions) == 2 * 2 * 2  # modes x dtypes x batches
    p = next(p for p in predictions if (p.mode, p.dtype, p.batch) == ("train", "fp32", 4))
    model, make_sample, loss_fn = models_zoo.get("mlp", "debug", device="meta")
    rep = estimator.report(model, make_sample(4), batch=4, optimizer="adamw", loss_fn=loss_fn, device="cuda", gpu="H200")
    assert (p.allocated, p.reserved, p.device) == (rep.peak_bytes, rep.reserved_bytes, rep.device_bytes)
    assert (p.step_allocated, p.step_reserved, p.steps, p.repeated) == (
        rep.cuda.step_allocated, rep.cuda.step_reserved, rep.cuda.steps, rep.cuda.repeated)

    # A stub "device" whose steady step takes 1 % more than the step prediction allocates and
    # exactly its reserved.
    by_case = {p.case: p for p in predictions}

    def fake_measure(case):
        pred = by_case[case]
        return CudaMeasurement(pred.step_allocated * 101 // 100, pred.step_reserved, 0, None)

    rows = gpu.compare(predictions, fake_measure)
    assert [r.prediction for r in rows] == predictions and {r.protocol for r in rows} == {Protocol.STEP}
    stats = gpu.summary(rows)
    assert stats["cases"] == 8 and stats["reserved_max_abs_error_pct"] == 0
    assert 0.98 < stats["allocated_median_abs_error_pct"] < 1.0  # -1/101
    text = gpu.to_markdown(rows, HEADER)
    assert "| mlp (debug) | train | fp32 | 4 |" in text and "## One steady step" in text

    # The real suite's mlp case as `measure` predicts what the file lacks: `python -m
    # validators.gpu predict --missing --models mlp` in a process that cannot see a GPU.
    path, failed = tmp_path / "p.json", []
    gpu._Predicting(["mlp"], path).finish(None, failed)
    assert failed == []
    data = json.loads(path.read_text())
    assert data["versions"] == {"torch": torch.__version__, "gpu_arg": "H200", "format": gpu.FORMAT}
    assert {p.case for p in gpu.load_predictions(path)} == set(gpu.suite([gpu.CASES[0]], ()))  # mlp (small): 12


# Users' own steps at the size of the CPU validation (the suite's are GPU-sized).
TINY_STEPS = (
    gpu.StepCase("clip_grad_norm_ + loss.item()", steps.net, steps.data, (2, 4)),
    gpu.StepCase("bf16 autocast + GradScaler + clipping", steps.net, steps.data, (4,)),
)


def test_user_steps_are_predicted_with_report_step_and_measured_as_user_steps(monkeypatch):
    predictions = list(gpu.predict_steps(TINY_STEPS, gpu="H200"))
    assert [(p.model, p.size, p.mode, p.dtype, p.batch) for p in predictions] == [
        ("steps", "clip_grad_norm_ + loss.item()", "train", "fp32", 2),
        ("steps", "clip_grad_norm_ + loss.item()", "train", "fp32", 4),  # the b = 2 capture's formula at 4
        ("steps", "bf16 autocast + GradScaler + clipping", "train", "fp32", 4),
    ]
    for p, make_step in ((predictions[1], steps.clipped), (predictions[2], steps.amp_step)):
        case = steps.CASES[p.size]
        assert case.step is make_step
        rep = estimator.report(steps.net(), steps.data(4), step=case.step, optimizer=case.optimizer, device="cuda",
                               gpu="H200")
        assert (p.allocated, p.reserved, p.device) == (rep.peak_bytes, rep.reserved_bytes, rep.device_bytes)
        assert (p.step_allocated, p.step_reserved) == (rep.cuda.step_allocated, rep.cuda.step_reserved)

    # measure() hands a step case to measure_cuda_user_step: a fresh model, the sample at the
    # case's batch, the case's step function, state factory and mode.
    calls = []

    def fake_user_step(model, sample, fn, optimizer, mode):
        calls.append((model, sample, fn, optimizer, mode))
        return CudaMeasurement(123, 456, 0, None)

    def no_zoo_step(*args, **kwargs):
        raise AssertionError("a user step measured with the built-in step")

    monkeypatch.setattr(cuda, "measure_cuda_user_step", fake_user_step)
    monkeypatch.setattr(cuda, "measure_cuda", no_zoo_step)
    monkeypatch.setattr(gpu, "STEP_CASES", TINY_STEPS)
    (row,) = gpu.compare([predictions[2]])
    model, (x, y), fn, optimizer, mode = calls[0]
    assert isinstance(model, steps.Net) and x.shape == (4, 32) and y.shape == (4,)
    assert (fn, optimizer, mode) == (steps.amp_step, steps.amp_state, "train")
    assert (row.allocated, row.reserved) == (123, 456)

    # A failing case is listed, the others still compared and rendered.
    def flaky(case):
        if case.batch == 2:
            raise RuntimeError("CUDA out of memory.\nTried to allocate ...")
        p = next(p for p in predictions if p.case == case)
        return CudaMeasurement(p.step_allocated, p.step_reserved, 0, None)

    failed = []
    rows = gpu.compare(predictions, flaky, failed=failed)
    assert [r.prediction for r in rows] == predictions[1:]
    assert failed == [("your step: clip_grad_norm_ + loss.item(), train, fp32, b = 2 (one steady step)",
                       "RuntimeError: CUDA out of memory.")]  # its first line
    text = gpu.to_markdown(rows, HEADER, failed)
    assert "| your step: bf16 autocast + GradScaler + clipping | train | fp32 | 4 |" in text
    assert "**2 of them users' own steps: max_memory_allocated median |error| 0.00 %" in text
    assert "**1 failure(s)** (not in the tables):" in text


def test_predict_adds_the_steps_and_keeps_the_other_cases(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    monkeypatch.setattr(gpu, "PREDICTIONS", path)
    monkeypatch.setattr(gpu, "CASES", (("mlp", "debug", (2,)),))
    monkeypatch.setattr(gpu, "STEP_CASES", TINY_STEPS[:1])
    assert gpu.main(["predict", "--models", "mlp"]) == 0
    zoo = json.loads(path.read_text())["predictions"]
    assert len(zoo) == 2 * 2  # modes x dtypes
    assert gpu.main(["predict", "--models", "steps"]) == 0  # the steps appended, the zoo's kept as they were
    both = json.loads(path.read_text())["predictions"]
    assert both[:4] == zoo and [(p["model"], p["batch"]) for p in both[4:]] == [("steps", 2), ("steps", 4)]

    # measure/all: only what the file lacks is predicted (here one step case's entries).
    path.write_text(json.dumps({"versions": gpu._versions(), "predictions": both[:4]}))
    predicted = []
    found = gpu.update_predictions(gpu.CASES, gpu.STEP_CASES, progress=predicted.append)
    assert [(p.model, p.batch) for p in predicted] == [("steps", 2), ("steps", 4)]
    assert [asdict(p) for p in found][:4] == zoo and json.loads(path.read_text())["predictions"][:4] == zoo
    assert gpu.update_predictions(gpu.CASES, gpu.STEP_CASES, progress=predicted.append) == found
    assert len(predicted) == 2  # nothing missing: nothing predicted again

    # A file of the previous format (no step figures) is stale as a whole.
    path.write_text(json.dumps({"versions": {"torch": torch.__version__, "gpu_arg": "H200"}, "predictions": zoo}))
    assert gpu.load_predictions(path) is None


def _prediction(case: Case, allocated: int, reserved: int, device: int, step_allocated: int, step_reserved: int,
                steps: int = 3) -> Prediction:
    return Prediction(*asdict(case).values(), allocated, reserved, device, step_allocated, step_reserved, steps, True,
                      0.0)


def test_both_protocols_are_measured_joined_and_written(tmp_path, monkeypatch):
    # The orchestration of `python -m validators.gpu measure` with both measurements stubbed and
    # stored predictions (no estimator involved): mlp (debug) at b = 2, 4 and one user step at
    # b = 2, 4.
    monkeypatch.setattr(gpu, "CASES", (("mlp", "debug", (2, 4)),))
    monkeypatch.setattr(gpu, "STEP_CASES", TINY_STEPS[:1])
    cases = gpu.suite(gpu.CASES, gpu.STEP_CASES)
    assert len(cases) == 2 * 2 * 2 + 2
    # Predicted: run allocated 1000 + b, reserved 2 MiB, device 2 MiB + 500 MiB; step 800 + b, 2 MiB;
    # the replay of bf16 training one step longer than the measured runs.
    mib = 2**20
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"versions": gpu._versions(), "predictions": [
        asdict(_prediction(c, 1000 + c.batch, 2 * mib, 502 * mib, 800 + c.batch, 2 * mib,
                           cuda.RUN_STEPS + 1 if (c.mode, c.dtype) == ("train", "bf16") else 3)) for c in cases]}))

    ran = []

    def fake_runs(chosen, device, steps, failed, deadline, progress):
        ran.extend(chosen)
        out = {}
        for c in chosen:
            if c.mode == "inference" and c.dtype == "bf16":
                failed.append((f"{c.name} (a run from a cold start)", "RuntimeError: CUDA error: an illegal access"))
                continue
            # 2 % under the allocated prediction, the reserved one exact, nvidia-smi 4 MiB more
            m = RunMeasurement((1000 + c.batch) * 100 // 102, 2 * mib, steps, 600 * mib, 94 * mib)
            out[c] = m
            progress(c, m, {"measure_seconds": 1.5})
        return out

    def fake_step(case, device):
        assert device == torch.device("cpu")
        return CudaMeasurement(800 + case.batch, 2 * mib, 0, None)  # exact

    monkeypatch.setattr(gpu, "measure_runs", fake_runs)
    monkeypatch.setattr(gpu, "measure", fake_step)
    assert gpu.main(["measure", "--device", "cpu", "--out", str(tmp_path), "--predictions", str(path)]) == 1

    # The run protocol at the largest batch of each (model, size, mode, dtype), in order.
    assert ran == [c for c in cases if c.batch == 4]
    data = json.loads((tmp_path / gpu.RESULTS_JSON).read_text())
    run = [r for r in data["rows"] if r["protocol"] == "run"]
    step = [r for r in data["rows"] if r["protocol"] == "step"]
    assert len(run) == 4 and len(step) == 10  # one run failed; every step measured
    # b = 4: predicted 1004, measured 1004 * 100 // 102 = 984: (1004 - 984) / 984 = +2.03 %
    assert run[0]["allocated"] == 984 and run[0]["allocated_error_pct"] == pytest.approx(100 * 20 / 984)
    assert run[0]["reserved_error_pct"] == 0
    # nvidia-smi: the process's share 600 - 94 = 506 MiB, predicted 502: -0.79 %; context 504 MiB
    assert run[0]["device_used"] == 506 * mib and run[0]["device_error_pct"] == pytest.approx(-400 / 506)
    assert run[0]["context"] == 504 * mib
    assert all(r["allocated_error_pct"] == 0 and r["device_used"] is None for r in step)
    assert data["summary"]["step"]["allocated_max_abs_error_pct"] == 0
    assert data["summary"]["run"]["device_cases"] == 4
    assert data["failed"] == [{"case": "mlp (debug), inference, bf16, b = 4 (a run from a cold start)",
                               "error": "RuntimeError: CUDA error: an illegal access"}]
    assert data["settings"] == {"steps": cuda.RUN_STEPS, "run_batches": "largest", "budget": None}
    text = (tmp_path / gpu.RESULTS_MD).read_text()
    assert "## A run from a cold start" in text and "## One steady step" in text
    assert ("| mlp (debug) | train | fp32 | 4 | 3 | 1,004 | 984 | +2.03 % | 2,097,152 | 2,097,152 | +0.00 % "
            "| 526,385,152 | 530,579,456 | -0.79 % | 528,482,304 |") in text
    assert "| mlp (debug) | train | fp32 | 2 | 802 | 802 | +0.00 % | 2,097,152 | 2,097,152 | +0.00 % |" in text
    assert "**4 cases: max_memory_allocated median |error| 2.0" in text  # the run's line
    assert "**10 cases: max_memory_allocated median |error| 0.00 %" in text  # the step's line
    assert "- mlp (debug), inference, bf16, b = 4 (a run from a cold start): `RuntimeError" in text
    assert len(data["measured"]["run"]) == 4 and len(data["measured"]["step"]) == 10
    assert data["measured"]["run"][0] == asdict(cases[1]) | {
        "max_allocated": 984, "max_reserved": 2 * mib, "steps": cuda.RUN_STEPS, "device_used": 600 * mib,
        "device_before": 94 * mib, "device": 506 * mib}
    assert f"1 case(s) predicted over more steps than the {cuda.RUN_STEPS} run" in text

    # Out of time before the first case: nothing measured, one line says so.
    failed = []
    assert gpu.measure_steps(cases, fake_step, failed, deadline=time.monotonic() - 1) == {}
    assert failed == [("10 case(s), one steady step (mlp (debug), train, fp32, b = 2 and after)",
                       "not measured: the time budget (--budget) ran out")]


def test_each_run_is_a_process_of_its_own():
    # The run protocol's processes on the CPU stand-in (validators.cuda._stand_in: the bytes
    # the run holds at its end): a zoo case and a case that fails to build, each in a process.
    mlp = Case("mlp", "debug", "train", "fp32", 4)
    bad = Case("mlp", "no-such-size", "train", "fp32", 4)
    failed, reports = [], {}
    measured = gpu.measure_runs([bad, mlp], "cpu", steps=3, failed=failed,
                                progress=lambda case, m, result: reports.setdefault(case, result))
    assert list(measured) == [mlp] and reports[mlp]["pid"] != os.getpid()
    assert failed == [("mlp (no-such-size), train, fp32, b = 4 (a run from a cold start)",
                       "ValueError: unknown size 'no-such-size' for model 'mlp'. Valid: debug, small")]
    # mlp (debug): 6,922 fp32 parameters = 27,688 B, AdamW's exp_avg and exp_avg_sq 2 x 27,688,
    # 6 step counters of 4 B, the last batch (x 4 x 32 fp32 512 B, labels 4 int64 32 B), the
    # output 4 x 10 fp32 160 B and the loss 4 B (the gradients were set to None).
    assert 3 * 27_688 + 6 * 4 + 512 + 32 + 160 + 4 == 83_796
    assert measured[mlp] == RunMeasurement(83_796, 83_796, 3, None, None)

    # A user step as its process builds it (here in this one): the suite's Net(1024, 4096) in
    # inference holds its parameters (1024 x 4096 + 4096 + 2 x 4096 + 4096 x 4096 + 4096 + 4096 x 10
    # + 10 = 21,028,874 fp32) and the last batch (2 x 1024 fp32, 2 int64).
    tta = Case(gpu.STEPS, "test-time augmentation (inference)", "inference", "fp32", 2)
    assert gpu.prepare_run(tta, "cpu", steps=2)() == RunMeasurement(21_028_874 * 4 + 2 * 1024 * 4 + 2 * 8,
                                                                     21_028_874 * 4 + 2 * 1024 * 4 + 2 * 8, 2,
                                                                     None, None)

    # Out of time: no process started, the cases named in one line.
    failed = []
    assert gpu.measure_runs([mlp, tta], "cpu", failed=failed, deadline=time.monotonic() - 1) == {}
    assert failed == [("2 case(s), a run from a cold start (mlp (debug), train, fp32, b = 4 and after)",
                       "not measured: the time budget (--budget) ran out")]


def test_the_cpu_stand_ins():
    # measure_user_step_run's loop in this process on the stand-in: Net(32, 96) (13,642 fp32
    # parameters, 8 tensors) with AdamW after 5 clipped steps: parameters, exp_avg, exp_avg_sq,
    # 8 step counters, and the last batch (4 x 32 fp32, 4 int64); clipped() zeroes the gradients
    # to None and returns the loss as a float.
    held = 3 * 13_642 * 4 + 8 * 4 + 4 * 32 * 4 + 4 * 8
    m = cuda.measure_user_step_run(steps.net(), steps.data(4), steps.clipped, "adamw", "train", steps=5, device="cpu")
    assert m == RunMeasurement(held, held, 5, None, None)

    # The step protocol's stand-in (`--device cpu`): the CPU measurement of the steady step, whose
    # optimizer step holds mlp (debug)'s parameters, gradients, exp_avg and exp_avg_sq (4 x 27,688 B).
    one = gpu.measure(Case("mlp", "debug", "train", "fp32", 2), "cpu")
    assert one.max_reserved == one.max_allocated > 4 * 27_688 and one.device_used is None


@pytest.mark.gpu
def test_one_case_of_both_protocols_on_cuda():
    # The real thing for mlp (debug): a run in a fresh process, then the steady step here.
    case = Case("mlp", "debug", "train", "fp32", 8)
    failed = []
    runs = gpu.measure_runs([case], failed=failed)
    assert failed == []
    run = runs[case]
    # Every steady step is a step of the run (same tensors, the same cuBLAS workspaces): the run's
    # allocated peak is at least the step's.
    one = gpu.measure(case)
    assert run.max_allocated >= one.max_allocated > 0 and run.max_reserved >= run.max_allocated
    assert run.device is not None and run.device > run.max_reserved  # the CUDA context on top
