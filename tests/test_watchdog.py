"""No capture waits for ever (estimator/capture/watchdog.py), and the in-place op on a view that
used to hang one (autograd regenerating the view's ``grad_fn`` while the tracker read it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import estimator
from estimator.capture import watchdog
from validators.cpu import measure_cpu
from validators.outside import ScaledInPlace, sum_loss as _sum


@pytest.mark.parametrize("b", [2, 17])
def test_in_place_on_a_linear_view_returns_and_is_exact(b):
    x = torch.randn(b, 8, 16)
    rep = estimator.report(ScaledInPlace(), x, mode="train", loss_fn=_sum, device="cpu")
    assert rep.peak_bytes == measure_cpu(ScaledInPlace(), x, loss_fn=_sum).peak_bytes  # tolerance: 0 B


def test_in_place_on_a_view_in_inference_is_exact():
    x = torch.randn(5, 8, 16)
    rep = estimator.report(ScaledInPlace(), x, mode="inference", device="cpu")
    assert rep.peak_bytes == measure_cpu(ScaledInPlace(), x, mode="inference").peak_bytes


class Spins(nn.Module):
    """A forward that never returns and swallows ordinary exceptions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.fc(x)
        while True:
            try:
                time.sleep(0.05)
            except Exception:
                pass


def test_a_step_that_stops_dispatching_ops_becomes_a_capture_error(monkeypatch):
    monkeypatch.setenv("FXMEM_CAPTURE_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(estimator.CaptureError, match=r"no op for 1 s after aten\.addmm.*FXMEM_CAPTURE_TIMEOUT"):
        estimator.report(Spins(), torch.randn(4, 4), mode="inference", device="cpu")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_bad_timeout_is_an_input_error(monkeypatch, value):
    monkeypatch.setenv("FXMEM_CAPTURE_TIMEOUT", value)
    with pytest.raises(estimator.InputError, match="FXMEM_CAPTURE_TIMEOUT"):
        watchdog.timeout()


def test_the_watchdog_is_off_at_zero(monkeypatch):
    monkeypatch.setenv("FXMEM_CAPTURE_TIMEOUT", "0")
    with watchdog.Watchdog() as dog:
        time.sleep(0.7)  # longer than a poll: nothing is raised
    assert dog.seconds == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the command's guard process needs fork()")
def test_the_command_ends_a_capture_stuck_in_native_code(tmp_path: Path):
    # ctypes.PyDLL keeps the GIL during the call: no Python thread of the process can run, the
    # in-process watchdog included; the command's parent process ends it.
    (tmp_path / "stuck.py").write_text(textwrap.dedent("""
        import ctypes, torch
        from torch import nn

        class Stuck(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                ctypes.PyDLL(None).sleep(1000)
                return self.fc(x)

        def make():
            return Stuck(), torch.randn(4, 4)
    """))
    env = dict(os.environ, FXMEM_CAPTURE_TIMEOUT="3")
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "estimator", "report", "stuck.py:make", "--device", "cpu",
                          "--mode", "inference"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    assert "no op for 3 s" in run.stderr and "was stopped" in run.stderr
    assert time.monotonic() - start < 60
