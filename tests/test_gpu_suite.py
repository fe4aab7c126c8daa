"""The GPU validation suite's plumbing, runnable without a GPU (the measurement is stubbed);
the real run is `python -m validators.gpu` on a GPU machine."""

from __future__ import annotations

import json

import estimator
import models_zoo
from validators import gpu
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
