"""The `fxmem` command as a user runs it: a subprocess, its output and its exit code."""

import json
import subprocess
import sys

import pytest


def fxmem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "estimator", *args], capture_output=True, text=True, timeout=300)


def test_report_table():
    run = fxmem("report", "mlp", "--batch", "4")
    assert run.returncode == 0, run.stderr
    assert "fxmem: MLP, train, optimizer adamw, device cpu, batch 4" in run.stdout
    assert "formula (bytes, symbolic capture" in run.stdout


def test_report_json_with_budget():
    run = fxmem("report", "mlp", "--json", "--budget", "1MiB", "--mode", "inference")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["mode"] == "inference" and data["budget"]["bytes"] == 2**20
    assert data["budget"]["max_batch"] > 0


@pytest.mark.parametrize(
    "args, code, message",
    [
        (("report", "gtp"), 2, "did you mean 'gpt'"),
        (("report", "gpt", "--size", "huge"), 2, "unknown size 'huge'"),
        (("report", "mlp", "--budget", "lots"), 2, "cannot parse the memory size 'lots'"),
        (("report", "mlp", "--batch", "0"), 2, "batch must be a positive int"),
    ],
)
def test_bad_input_exits_nonzero_with_a_message(args, code, message):
    run = fxmem(*args)
    assert run.returncode == code
    assert message in run.stderr
    assert "Traceback" not in run.stderr
