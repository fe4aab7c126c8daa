"""The GPU validation suite's plumbing, runnable without a GPU (the measurement is stubbed);
the real run is `python -m validators.gpu` on a GPU machine."""

from __future__ import annotations

import json
from dataclasses import asdict

import estimator
import models_zoo
from models_zoo import steps
from validators import cuda, gpu
from validators.cuda import CudaMeasurement


def test_predictions_match_a_direct_report_and_the_comparison_renders(tmp_path, monkeypatch):
    predictions = list(gpu.predict(cases=[("mlp", "debug", (2, 4))], gpu="H200"))
    assert len(predictions) == 2 * 2 * 2  # modes x dtypes x batches
    p = next(p for p in predictions if (p.mode, p.dtype, p.batch) == ("train", "fp32", 4))
    model, make_sample, loss_fn = models_zoo.get("mlp", "debug", device="meta")
    rep = estimator.report(model, make_sample(4), batch=4, optimizer="adamw", loss_fn=loss_fn, device="cuda", gpu="H200")
    assert (p.allocated, p.reserved, p.device) == (rep.peak_bytes, rep.reserved_bytes, rep.device_bytes)

    # A stub "device" that measures 1 % more allocated and exactly the reserved prediction.
    def fake_measure(pred):
        return CudaMeasurement(pred.allocated * 101 // 100, pred.reserved, 0, None)

    rows = list(gpu.compare(predictions, fake_measure))
    stats = gpu.summary(rows)
    assert stats["cases"] == 8 and stats["reserved_max_abs_error_pct"] == 0
    assert 0.98 < stats["allocated_median_abs_error_pct"] < 1.0  # -1/101
    text = gpu.to_markdown(rows, {"gpu_arg": "H200", "device": "stub", "torch": "x", "cuda": "y"})
    assert "| mlp (debug) | train | fp32 | 4 |" in text
    monkeypatch.setattr(gpu, "PREDICTIONS", tmp_path / "p.json")
    assert gpu.main(["predict", "--models", "mlp"]) == 0  # the real suite's mlp case
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["versions"]["gpu_arg"] == "H200" and data["predictions"][0]["model"] == "mlp"


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

    # measure() hands a step case to measure_cuda_user_step: a fresh model, the sample at the
    # prediction's batch, the case's step function, state factory and mode.
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
    def flaky(p):
        if p.batch == 2:
            raise RuntimeError("CUDA out of memory.\nTried to allocate ...")
        return CudaMeasurement(p.allocated, p.reserved, 0, None)

    failed = []
    rows = list(gpu.compare(predictions, flaky, failed=failed))
    assert [r.prediction for r in rows] == predictions[1:]
    assert failed == [(predictions[0], "RuntimeError: CUDA out of memory.")]  # its first line
    text = gpu.to_markdown(rows, {"gpu_arg": "H200", "device": "stub", "torch": "x", "cuda": "y"},
                           [("your step: clip_grad_norm_ + loss.item(), train, fp32, b = 2", failed[0][1])])
    assert "| your step: bf16 autocast + GradScaler + clipping | train | fp32 | 4 |" in text
    assert "**2 of them users' own steps: max_memory_allocated median |error| 0.00 %" in text
    assert "**1 case(s) failed** (not in the table):" in text


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
