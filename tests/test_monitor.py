"""The live monitor (estimator.monitor) in a real loop of a tiny model: CPU measurements against
the prediction, phases, hooks, budget warnings, results.  CUDA paths: ``gpu`` tests."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import estimator
from estimator import InputError
from estimator.monitor import MemoryMonitor, MemoryWarning, StepSample

B = 32


def make_model():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def loss_fn(out, x):
    return out.square().mean()


@pytest.fixture(scope="module")
def rep():
    # params 64*256*4 + 256*4 + 256*10*4 + 10*4 = 76,840 B; AdamW; peak in the optimizer step
    return estimator.report(make_model(), torch.randn(B, 64), optimizer="adamw", loss_fn=loss_fn, device="cpu")


def train(model, opt, mon=None, steps=3, marks=True):
    """The step estimator.capture.steps runs, written as a user's loop."""
    for _ in range(steps):
        x = torch.randn(B, 64)
        if mon and marks:
            mon.phase("forward", batch=B)
        out = model(x)
        loss = loss_fn(out, x)
        if mon and marks:
            mon.phase("backward")
        loss.backward()
        if mon and marks:
            mon.phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mon and marks:
            mon.step()
    del x, out, loss


def test_cpu_measurement_equals_prediction(rep):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryWarning)  # no budget on CPU: no warning
        with MemoryMonitor(rep, device="cpu").attach(model, opt, auto_step=False) as mon:
            train(model, opt, mon)
    assert len(mon.samples) == 3
    first = mon.samples[0]
    assert first.phases[0].start == 76_840  # the attached model's parameters when the monitor started
    for s in mon.samples:
        assert isinstance(s, StepSample) and s.batch == B
        assert [p.name for p in s.phases] == ["start", "forward", "backward", "optimizer"]
        # the profiler's allocator events, summed: the same bytes as the fake run predicts
        assert s.peak == s.predicted == rep.peak_bytes
        assert s.error == 0.0
        assert s.phases[-1].peak == s.phases[-1].predicted == rep.peak_bytes  # the peak is in the optimizer step
        assert s.reserved is None and s.device_used is None
    # from step 1 on the optimizer state exists (the prediction's steady state): backward agrees too
    assert all(s.phases[2].peak == s.phases[2].predicted for s in mon.samples[1:])
    assert first.phases[2].peak < first.phases[2].predicted
    # the loop keeps the previous step's output and loss alive during the next forward (10*32*4 + 4 B):
    # memory a training script really holds, which fxmem's step (out and loss freed at its end) does not
    later = mon.samples[1].phases[1]
    assert later.peak == later.predicted + 32 * 10 * 4 + 4
    assert mon.peak == rep.peak_bytes
    assert not torch.autograd._profiler_enabled()


def test_hooks_mark_phases_and_end_steps(rep):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with MemoryMonitor(rep, device="cpu").attach(model, opt) as mon:
        train(model, opt, marks=False)
    assert len(mon.samples) == 3  # the optimizer's post-hook ended each step
    for s in mon.samples:
        assert s.batch == B  # read from the forward's input
        assert [p.name for p in s.phases] == ["start", "forward", "backward", "optimizer"]
        assert s.peak == rep.peak_bytes
    # hooks are gone after the monitor stopped
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_inference_hooks_end_the_step_after_forward():
    model = make_model().eval()
    irep = estimator.report(model, torch.randn(B, 64), mode="inference", device="cpu")
    with MemoryMonitor(irep, device="cpu").attach(model) as mon, torch.no_grad():
        for _ in range(2):
            x = torch.randn(B, 64)
            out = model(x)
    del x, out
    assert [[p.name for p in s.phases] for s in mon.samples] == [["start", "forward"]] * 2
    assert mon.samples[0].peak == irep.peak_bytes  # parameters + input + two hidden activations


def test_no_marks_is_one_phase_and_pending_step_recorded(rep):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with MemoryMonitor(rep, device="cpu", batch=B) as mon:
        train(model, opt, steps=1, marks=False)
        mon.step()
        mon.phase("forward")  # a step left open: recorded when the monitor stops
    assert [[p.name for p in s.phases] for s in mon.samples] == [["step"], ["start", "forward"]]
    # not attached: the count starts at 0 and holds what the loop allocated (state, then the step)
    assert mon.samples[0].peak == rep.peak_bytes - 76_840


def test_warnings_before_a_predicted_oom(rep):
    budget = rep.peak_bytes + 1_000  # 99.8 % of it: above warn_at = 0.9
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with MemoryMonitor(rep, device="cpu", budget=budget).attach(model, opt, auto_step=False) as mon:
            train(model, opt, mon, steps=2)
            mon.phase("forward", batch=64)  # predicted not to fit at all
    messages = [str(w.message) for w in record if issubclass(w.category, MemoryWarning)]
    assert len(messages) == 3, messages  # each warning once
    assert "predicted peak at batch 32" in messages[0] and f"largest batch that fits: {rep.max_batch(budget)}" in messages[0]
    assert "step 0 used" in messages[1] and "of the budget" in messages[1]
    assert "batch 64" in messages[2] and "predicted to run out of memory" in messages[2]
    assert mon.samples[-1].batch == 64 and mon.samples[-1].predicted == rep.at(64)


def test_results(rep, tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with MemoryMonitor(rep, device="cpu", budget="1GiB").attach(model, opt) as mon:
        train(model, opt, steps=2, marks=False)
    data = json.loads(json.dumps(mon.to_dict()))
    assert data["budget"] == 2**30 and data["prediction"]["peak_bytes"] == rep.peak_bytes
    assert [s["step"] for s in data["steps"]] == [0, 1]
    assert data["steps"][0]["measured"] == rep.peak_bytes and data["steps"][0]["error_pct"] == 0.0
    assert data["steps"][0]["phases"][1]["name"] == "forward"
    table = mon.table()
    assert "budget 1.00 GiB" in table and "437.44 KiB" in table and "+0.00 %" in table
    pytest.importorskip("matplotlib")
    fig = mon.plot()
    assert len(fig.axes) == 2  # the steps, and the last step's phases over the predicted timeline
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "peak allocated (measured)" in labels and "predicted peak" in labels
    fig.savefig(tmp_path / "monitor.png")
    no_prediction = MemoryMonitor(device="cpu")
    with no_prediction:
        torch.ones(10)
        no_prediction.step()
    assert len(no_prediction.plot().axes) == 1


def test_bad_use():
    with pytest.raises(InputError, match="warn_at"):
        MemoryMonitor(device="cpu", warn_at=0)
    with pytest.raises(InputError, match="'cuda' or 'cpu'"):
        MemoryMonitor(device="meta")
    with pytest.raises(InputError, match="not running"):
        MemoryMonitor(device="cpu").phase("forward")
    with pytest.raises(InputError, match="no step"):
        pytest.importorskip("matplotlib")
        MemoryMonitor(device="cpu").plot()
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="cuda"):
            MemoryMonitor(device="cuda")


def test_stops_on_error_and_with_another_profiler():
    with pytest.raises(ValueError, match="boom"), MemoryMonitor(device="cpu") as mon:
        mon.phase("forward")
        raise ValueError("boom")
    assert len(mon.samples) == 1 and not torch.autograd._profiler_enabled()
    from torch.autograd.profiler import profile

    with profile(), pytest.raises(RuntimeError, match="stop the other profiler"):
        MemoryMonitor(device="cpu").start()


@pytest.mark.gpu
def test_cuda_monitor(rep):
    device = torch.device("cuda")
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters())
    with MemoryMonitor(rep, device="cuda").attach(model, opt) as mon:
        for _ in range(3):
            x = torch.randn(B, 64, device=device)
            loss_fn(model(x), x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert len(mon.samples) == 3
    for s in mon.samples:
        assert [p.name for p in s.phases] == ["start", "forward", "backward", "optimizer"]
        assert s.peak_reserved >= s.peak > 76_840 and s.reserved >= s.end
        assert s.device_used is not None and s.device_used >= s.reserved
    steady = mon.samples[-1]
    # CUDA is not modelled yet (rounding to 512 B blocks, cuBLAS workspace, foreach optimizer):
    # the CPU prediction is a floor, not an exact figure, here
    assert steady.peak >= rep.peak_bytes * 0.9


@pytest.mark.gpu
def test_cuda_warns_near_the_budget(rep):
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with MemoryMonitor(None, device="cuda", budget=200_000).attach(model, opt):
            x = torch.randn(B, 64, device="cuda")
            loss_fn(model(x), x).backward()
            opt.step()
    assert any(issubclass(w.category, MemoryWarning) and "of the budget" in str(w.message) for w in record)
