"""The `fxmem` command as a user runs it: a subprocess, its output and its exit code.

Each run is mostly torch's import, so the runs the selected tests need start together, a few
at a time, when the first of them is asked for; each test then checks its own run.  Checks
that need no subprocess (the model-spec errors, each command's --help) run in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

import estimator
import models_zoo
from estimator.cli import _CAPTURING, cli, models
from estimator.vocab.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
FACTORY = textwrap.dedent(
    """
    import torch


    def make():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        return model, torch.randn(4, 16)


    def make_with_loss():
        model, sample = make()
        return model, sample, lambda out, x: out.square().sum()


    def junk():
        return 42


    def not_a_model():
        return "model", torch.randn(4, 16)


    def broken():
        raise RuntimeError("no such dataset")
    """
)
FORMATS = ("sympy", "latex", "markdown", "json")
SUBPROCESS_FORMATS = ("sympy",)  # the others in-process: each subprocess costs ~4 s of CPU

# name -> arguments; "{dir}" is a folder holding FACTORY as factory.py and fxmem_cli_factory.py
CASES = {
    "help": ("--help",),
    "report": ("report", "mlp", "--batch", "4"),
    "report-json": ("report", "mlp", "--json", "--budget", "1MiB", "--mode", "inference", "--device", "cpu", "-q"),
    **{f"formula-{f}": ("formula", "mlp", "--format", f, "--device", "cpu", "-q") for f in SUBPROCESS_FORMATS},
    "fit-json": ("fit", "mlp", "--budget", "1MiB", "--json", "--device", "cpu", "-q"),
    "bad-name": ("report", "gtp"),
    "bad-budget": ("fit", "mlp", "--budget", "lots"),
    "gpu-on-cpu": ("report", "mlp", "--device", "cpu", "--gpu", "H100"),
    "file-factory": ("report", "{dir}/factory.py:make", "--json", "-q"),
    "module-factory": ("report", "fxmem_cli_factory:make_with_loss", "--batch", "16", "--device", "cpu", "-q"),
    "junk-factory": ("report", "{dir}/factory.py:junk"),
    "integration-bad-name": ("report", "torchvision:resnt18"),
}


def uses(*names: str):
    """Declare the runs a test reads (so that only the selected tests' runs start)."""

    def mark(func):
        func.cases = names
        return func

    return mark


def _fxmem(args: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "estimator", *args], check=False, capture_output=True, text=True, timeout=300,
        cwd=cwd, env=env,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fxmem_cli")
    (path / "factory.py").write_text(FACTORY)
    (path / "fxmem_cli_factory.py").write_text(FACTORY)
    return path


@pytest.fixture(scope="module")
def runs(request, folder):
    """name -> Future of its CompletedProcess, started for every selected test of this module."""
    wanted = {name for item in request.session.items for name in getattr(getattr(item, "function", None), "cases", ())}
    pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
    futures: dict[str, Future] = {}
    for name, args in CASES.items():
        if name in wanted:
            futures[name] = pool.submit(_fxmem, tuple(a.replace("{dir}", str(folder)) for a in args), folder)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def ok(runs, name: str) -> subprocess.CompletedProcess:
    run = runs[name].result()
    assert run.returncode == 0, f"{CASES[name]}: exit {run.returncode}\n{run.stderr}"
    assert "Traceback" not in run.stderr
    return run


def failed(runs, name: str, code: int) -> str:
    """The one error line of a failed run."""
    run = runs[name].result()
    assert run.returncode == code, f"{CASES[name]}: exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr and run.stdout == ""
    return run.stderr


@pytest.fixture(scope="module")
def mlp_report():
    model, make_sample, loss_fn = models_zoo.get("mlp", "debug", device="meta")
    return estimator.report(model, make_sample(8), batch=8, mode="train", optimizer="adamw", loss_fn=loss_fn,
                            device="cpu")


# --- commands ----------------------------------------------------------------------------------


@uses("report")
def test_every_command_but_models_preloads_the_capture_stack():
    # estimator.cli.entry imports torch and Dynamo with the collector paused for these commands only
    assert set(cli.commands) - {"models"} == set(_CAPTURING)


def test_report_prints_the_table_and_progress(runs):
    run = ok(runs, "report")  # no --device, no --gpu: the default GPU, said in the first line
    lines = run.stdout.splitlines()
    assert lines[0] == ("fxmem: MLP, train, optimizer adamw, b = 4, on NVIDIA H100 80GB HBM3 (default GPU: pass --gpu "
                        "/ gpu= for yours)")
    assert lines[1].startswith("peak: ") and " allocated, " in lines[1] and " reserved, " in lines[1]
    assert " on the device (" in lines[1] and "% of its 79.20 GiB)" in lines[1]
    assert "= device memory (nvidia-smi)" in run.stdout
    assert "formula (bytes, symbolic capture" in run.stdout
    assert "fxmem: capturing mlp (debug), train, b=4 ..." in run.stderr
    assert "fxmem: done in " in run.stderr


@uses("report-json")
def test_report_json_with_budget(runs):
    run = ok(runs, "report-json")
    assert run.stderr == ""  # --quiet
    data = json.loads(run.stdout)
    assert data["mode"] == "inference" and data["optimizer"] is None and data["batch"] == 8
    assert data["budget"]["bytes"] == 2**20 and data["budget"]["max_batch"] > 0
    assert data["breakdown_coefficients"]  # to_json, not to_dict


def formula_output(runs, fmt: str) -> str:
    if fmt in SUBPROCESS_FORMATS:
        return ok(runs, f"formula-{fmt}").stdout
    result = CliRunner().invoke(cli, ["formula", "mlp", "--format", fmt, "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output
    return result.output


@uses(*(f"formula-{f}" for f in SUBPROCESS_FORMATS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_formula_in_every_format(runs, mlp_report, fmt):
    out = formula_output(runs, fmt).strip()
    if fmt == "json":
        data = json.loads(out)
        assert data["peak"] == str(mlp_report.peak) and data["symbol"] == "b"
    else:
        render = {"sympy": lambda: str(mlp_report.peak), "latex": mlp_report.to_latex, "markdown": mlp_report.to_markdown}
        assert out == render[fmt]().strip()
    assert {"sympy": "Max(", "latex": r"\begin{align*}", "markdown": "| category |", "json": '"peak"'}[fmt] in out


@uses("fit-json")
def test_fit_is_the_reports_max_batch(runs, mlp_report):
    best = mlp_report.max_batch("1MiB")
    assert best > 8
    data = json.loads(ok(runs, "fit-json").stdout)
    assert data["max_batch"] == best and data["budget_bytes"] == 2**20
    assert data["peak_bytes"] == mlp_report.at(best) <= 2**20 < mlp_report.at(best + 1)
    text = CliRunner().invoke(cli, ["fit", "mlp", "--budget", "1MiB", "--device", "cpu", "-q"])
    assert text.exit_code == 0 and text.output.startswith(f"largest batch that fits in 1MiB: {best} (peak ")


def test_fit_when_nothing_fits():
    result = CliRunner().invoke(cli, ["fit", "mlp", "--budget", "1KiB", "--device", "cpu", "-q"])
    assert result.exit_code == 0 and result.output.startswith("nothing fits in 1KiB: the peak at b = 2 is already")
    # on the GPU what must fit is the device memory: the CUDA context (512 MiB, estimated) alone exceeds 100 MiB
    result = CliRunner().invoke(cli, ["fit", "mlp", "--budget", "100MiB", "-q"])
    assert result.exit_code == 0 and result.output.startswith(
        "nothing fits in 100MiB: the device memory at b = 2 is already 578.00 MiB")


def test_fit_on_the_gpu_defaults_to_its_memory():
    # a 24 GiB GPU: the largest b whose device memory (reserved + the CUDA context) fits 24 GiB
    model, make_sample, loss_fn = models_zoo.get("mlp", "debug", device="meta")
    rep = estimator.report(model, make_sample(8), batch=8, loss_fn=loss_fn, device="cuda", gpu="24GiB")
    best = rep.max_batch()
    assert best == rep.max_batch(24 * 2**30) > 8 and rep.on_device(best).device <= 24 * 2**30
    data = _cli_json(["fit", "mlp", "--gpu", "24GiB"], device=None)
    assert data["max_batch"] == best and data["budget_bytes"] == 24 * 2**30 and data["budget_given"] is False
    assert data["device"] == "cuda" and data["gpu"] == "24.00 GiB GPU"
    assert data["device_bytes"] == rep.on_device(best).device and data["peak_bytes"] == rep.at(best)
    text = CliRunner().invoke(cli, ["fit", "mlp", "--gpu", "24GiB", "-q"]).output
    assert text.startswith(f"largest batch that fits in 24.00 GiB, the 24.00 GiB GPU's memory: {best} (device memory ")
    default = CliRunner().invoke(cli, ["fit", "mlp", "--batch", "4", "--budget", "1GiB", "-q"]).output
    assert default.startswith("largest batch that fits in 1GiB: ") and " allocated, " in default
    refused = CliRunner().invoke(cli, ["fit", "mlp", "--device", "cpu", "-q"])
    assert refused.exit_code == 2 and refused.stderr == (
        "fxmem: error: fxmem fit --device cpu needs --budget (e.g. 64GiB); on the GPU (the default target) the budget "
        "defaults to the GPU's memory\n")


@uses("help")
def test_help_lists_commands_and_examples(runs):
    out = ok(runs, "help").stdout
    for command in ("report", "formula", "fit", "compare", "plan", "models"):
        assert f"  {command} " in out
    assert "Examples:" in out and "fxmem report gpt --size gpt2-small --batch 8" in out
    assert "Exit codes:" in out


@pytest.mark.parametrize("command", ["report", "formula", "fit", "compare", "plan", "models"])
def test_each_commands_help_has_examples(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and f"fxmem {command} " in result.output
    if command != "models":
        assert "FILE.py:FUNC" in result.output and "--json" in result.output


# --- model specs -------------------------------------------------------------------------------


@uses("file-factory")
def test_file_factory(runs, folder):
    data = json.loads(ok(runs, "file-factory").stdout)
    assert data["model"] == "Sequential" and data["batch"] == 4  # the sample's batch
    assert not (folder / "__pycache__").exists()  # nothing written beside the user's file


@uses("module-factory")
def test_module_factory_with_its_loss(runs):
    out = ok(runs, "module-factory").stdout
    assert out.startswith("fxmem: Sequential, train, optimizer adamw, b = 16, on the CPU\n")


# --- errors ------------------------------------------------------------------------------------


@uses("bad-name")
def test_unknown_model_suggests_close_names(runs):
    err = failed(runs, "bad-name", 2)
    assert err.startswith("fxmem: error: unknown model 'gtp'. Did you mean 'gpt'?")
    assert "path/to/file.py:factory" in err and err.count("\n") == 1


@uses("bad-budget")
def test_malformed_budget_fails_before_capturing(runs):
    err = failed(runs, "bad-budget", 2)
    assert err == (
        "fxmem: error: cannot parse the memory size 'lots': write a number and a unit, "
        "e.g. '80GiB', '40 GB', '512MiB' or a plain number of bytes\n"
    )


def test_bad_batch_is_a_usage_error():
    result = CliRunner().invoke(cli, ["report", "mlp", "--batch", "0"])
    assert result.exit_code == 2 and "Invalid value for '--batch'" in result.output


@uses("gpu-on-cpu")
def test_contradictory_flags(runs):
    err = failed(runs, "gpu-on-cpu", 2)
    assert err == ("fxmem: error: --gpu H100 describes the GPU target but --device cpu asks for the CPU: drop "
                   "--device cpu (the GPU is the default) or --gpu\n")


@uses("junk-factory")
def test_factory_returning_junk(runs):
    err = failed(runs, "junk-factory", 2)
    assert err.startswith("fxmem: error: ") and err.rstrip().endswith(
        "factory.py:junk() must return (model, sample) or (model, sample, loss_fn), got a value of type int"
    )


def test_gpu_target():
    result = CliRunner().invoke(cli, ["report", "mlp", "--device", "cuda", "--gpu", "H100", "--json", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["device"] == "cuda"


    data = json.loads(result.stdout)
    assert data["cuda"]["max_memory_reserved"] >= data["cuda"]["max_memory_allocated"] == data["peak_bytes"]


def test_seq_makes_fit_give_the_longest_sequence():
    import models_zoo

    model, make_sample, loss_fn = models_zoo.get("gpt", "debug", device="meta")
    rep = estimator.report(model, make_sample(8), batch=8, loss_fn=loss_fn, dynamic={"input_ids": {1: "s"}},
                           device="cpu")
    result = CliRunner().invoke(cli, ["fit", "gpt", "--seq", "input_ids:1", "--budget", "2MiB", "--json", "--device",
                                      "cpu", "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["seq"] == 32 and data["max_seq"] == {"batch": 8, "max_seq": rep.max_seq("2MiB")}
    text = CliRunner().invoke(cli, ["formula", "gpt", "--seq", "input_ids:1", "--device", "cpu", "-q"]).stdout
    assert "s" in text and text.strip() == str(rep.peak)


@pytest.mark.parametrize("args,message", [
    (["--seq", "input_ids:x"], "expected KEY:DIM"),
    (["--seq", "ids:1"], "does not have"),
    (["--device", "cpu", "--alloc-conf", "max_split_size_mb:128"], "describes the GPU target but --device cpu"),
    (["--device", "cuda", "--alloc-conf", "large_segment_size_mb:40"], "large_segment_size_mb"),
])
def test_bad_target_and_seq_flags(args, message):
    result = CliRunner().invoke(cli, ["report", "gpt", *args, "-q"])
    assert result.exit_code == 2 and message in result.stderr


def test_amp_flag():
    result = CliRunner().invoke(cli, ["report", "mlp", "--amp", "bf16", "--json", "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output
    fp32 = CliRunner().invoke(cli, ["report", "mlp", "--json", "--device", "cpu", "-q"])
    assert json.loads(result.stdout)["peak_bytes"] != json.loads(fp32.stdout)["peak_bytes"]


def test_strategy_flags_reach_the_report():
    # --dp 2: DDP replicas, each b = 8 plus the gradient buckets (all the zoo mlp's parameters)
    model, make_sample, loss_fn = models_zoo.get("mlp", "debug", device="meta")
    rep = estimator.report(model, make_sample(8), batch=8, loss_fn=loss_fn,
                           strategy=estimator.Strategy(data_parallel=2, checkpoint="body.*"), device="cpu")
    result = CliRunner().invoke(cli, ["report", "mlp", "--dp", "2", "--checkpoint", "body.*", "--json", "--device",
                                      "cpu", "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["peak_bytes"] == rep.peak_bytes and data["strategy"] == "DDP x2 + checkpoint body.*"
    assert [r["role"] for r in data["ranks"]] == ["replica"] and data["ranks"][0]["ranks"] == [0, 1]


@pytest.mark.parametrize("args,message", [
    (["--zero", "3"], "give data_parallel >= 2"),
    (["--checkpoint", "Nope"], "no module 'Nope'"),
    (["--accumulate", "3"], "multiple of 3"),
    (["--microbatches", "2"], "give pipeline >= 2"),
])
def test_bad_strategy_flags_name_the_setting(args, message):
    result = CliRunner().invoke(cli, ["report", "mlp", *args, "-q"])
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_compare_and_plan():
    specs = ["--strategy", "data_parallel=2", "--strategy", "data_parallel=2,sharding=zero1"]
    result = CliRunner().invoke(cli, ["compare", "mlp", "-n", "2", *specs, "--budget", "1MiB", "--json", "--device",
                                      "cpu", "-q"])
    assert result.exit_code == 0, result.output
    rows = {r["label"]: r for r in json.loads(result.stdout)["rows"]}
    assert list(rows) == ["single device", "DDP x2", "ZeRO-1 x2"]
    assert rows["single device"]["saving"] == 0 and rows["DDP x2"]["samples_per_step"] == 16
    # ZeRO-1 is DDP (buckets too) with half the optimizer state per rank
    assert rows["DDP x2"]["peak_bytes"] > rows["ZeRO-1 x2"]["peak_bytes"] > rows["single device"]["peak_bytes"]
    assert all(r["max_batch"] > 0 for r in rows.values())
    text = CliRunner().invoke(cli, ["compare", "mlp", "-n", "2", *specs, "--device", "cpu", "-q",
                                    "--workers", "1"]).stdout
    assert text.startswith("fxmem compare: MLP, b = 8, on the CPU\n") and "ZeRO-1 x2" in text and "baseline" in text
    assert CliRunner().invoke(cli, ["compare", "mlp", "--workers", "0", "-q"]).exit_code == 2  # at least 1
    bad = CliRunner().invoke(cli, ["compare", "mlp", "--strategy", "ranks=2", "-q"])
    assert bad.exit_code == 2 and "expected key=value" in bad.stderr
    plan = CliRunner().invoke(cli, ["plan", "mlp", "-n", "2", "--budget", "1MiB", "--json", "--device", "cpu", "-q"])
    assert plan.exit_code == 0, plan.output
    ranked = json.loads(plan.stdout)["rows"]
    samples = [r["max_batch"] * (2 if r["devices"] == 2 and "pipeline" not in r["label"] else 1) for r in ranked]
    assert samples == sorted(samples, reverse=True) and ranked[0]["fits"] is not None
    no_budget = CliRunner().invoke(cli, ["plan", "mlp", "--device", "cpu", "-q"])
    assert no_budget.exit_code == 2 and "plan needs a budget per device" in no_budget.stderr  # on the GPU: its memory


@uses("integration-bad-name")
def test_integration_is_delegated(runs):
    err = failed(runs, "integration-bad-name", 2)
    assert err.startswith("fxmem: error: ")
    assert "'resnet18'" in err or "pip install" in err  # a suggestion, or the missing package named


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "estimator", "report", "gpt", "--size", "gpt2-small"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
    )
    line = proc.stderr.readline()  # printed when the capture starts, after the imports
    assert line.startswith("fxmem: capturing gpt (gpt2-small)"), line
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "fxmem: interrupted" in err and "Traceback" not in err and out == ""
    assert list(tmp_path.iterdir()) == []


def test_cli_module_imports_no_torch():
    """`fxmem --help` stays fast: the command module itself imports torch only inside commands."""
    code = textwrap.dedent(
        f"""
        import sys, types
        package = types.ModuleType("estimator")  # the package without its __init__ (which imports torch)
        package.__path__ = [{str(ROOT / "estimator")!r}]
        sys.modules["estimator"] = package
        sys.modules["torch"] = None  # importing torch now raises
        from estimator.cli import main
        assert main(["--help"]) == 0 and main(["report", "--help"]) == 0
        assert "sympy" not in sys.modules
        """
    )
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


# --- model specs in-process (no subprocess needed) ----------------------------------------------


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        ("gpt", {"size": "huge"}, "unknown size 'huge' for model 'gpt'. Valid: debug, gpt2-small"),
        ("gpt", {"size": "gpt2-smal"}, "Did you mean 'gpt2-small'?"),
        ("mlp", {"dtype": "fp8"}, "dtype must be one of fp32, bf16, fp16"),
        ("model.py", {}, "name the factory function in 'model.py': write model.py:FUNCTION"),
        ("{dir}/nope.py:make", {}, "no such file"),
        ("{dir}/factory.py:mak", {}, "has no 'mak'. Did you mean {dir}/factory.py:make?"),
        ("{dir}/factory.py:not_a_model", {}, "the model is a str, not a torch.nn.Module"),
        ("{dir}/factory.py:broken", {}, "factory.py:broken() raised RuntimeError: no such dataset"),
        ("{dir}/factory.py:make", {"size": "debug"}, "--size applies to zoo models only"),
        ("no_such_module_xyz:make", {}, "cannot import module 'no_such_module_xyz'"),
        ("not a module:make", {}, "neither a .py file nor a dotted module name"),
    ],
)
def test_model_spec_errors(folder, spec, kwargs, message):
    with pytest.raises(InputError) as info:
        models.resolve(spec.replace("{dir}", str(folder)), **kwargs)
    assert message.replace("{dir}", str(folder)) in str(info.value)


def test_model_spec_parsing():
    assert models.parse("gpt") == models.ModelArgument("zoo", "gpt")
    assert models.parse("a/b.py:make") == models.ModelArgument("file", "a/b.py", "make")
    assert models.parse("pkg.mod:make") == models.ModelArgument("module", "pkg.mod", "make")
    assert models.parse("timm:resnet50") == models.ModelArgument("integration", "timm", "resnet50")
    assert models.parse("transformers:./configs/a:b") == models.ModelArgument("integration", "transformers", "./configs/a:b")
    assert models.parse("C:/models/x.py:make") == models.ModelArgument("file", "C:/models/x.py", "make")


# --- the user's own step (--step, --optimizer FILE.py:FUNC) and --keep-output/--drop-output -----

STEP_FILE = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn


    def train_step(model, sample, opt):  # for the zoo mlp: a dict sample {"x", "labels"}
        loss = F.cross_entropy(model(sample["x"]), sample["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


    def make_state(model):
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))


    def make():
        return Net(), (torch.randn(4, 16), torch.randint(0, 4, (4,)))


    def net_step(model, sample, opt):
        assert isinstance(model, Net), "the file was imported twice"  # make()'s class: one module
        x, y = sample
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)


    not_callable = 42
    """
)


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fxmem_cli_step")
    (path / "user_step.py").write_text(STEP_FILE)
    (path / "broken_step.py").write_text("def train_step(model, sample, opt:\n    pass\n")
    return path


@pytest.fixture(scope="module")
def user_step(step_dir) -> dict:
    """The step file's functions, loaded independently of the CLI's loader."""
    import runpy

    return runpy.run_path(str(step_dir / "user_step.py"))


def _cli_json(args: list[str], device: str | None = "cpu") -> dict:
    """``fxmem ARGS --json`` (``--device cpu`` unless ``device`` says otherwise: None for the default, the GPU)."""
    result = CliRunner().invoke(cli, [*args, *(["--device", device] if device else []), "--json", "-q"])
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def _mlp(batch: int = 8):
    model, make_sample, loss_fn = models_zoo.get("mlp", "debug", device="meta")
    return model, make_sample(batch), loss_fn


def test_step_flag_is_the_libraries_step(step_dir, user_step, mlp_report):
    # the CLI's mlp (debug) at its default b = 8 and optimizer adamw, the step loaded from the file
    model, sample, _ = _mlp()
    rep = estimator.report(model, sample, batch=8, step=user_step["train_step"], device="cpu")
    data = _cli_json(["report", "mlp", "--step", f"{step_dir}/user_step.py:train_step"])
    assert data["peak_bytes"] == rep.peak_bytes and data["peak"] == str(rep.peak)
    assert data["optimizer"] == "adamw" and data["batch"] == 8
    assert rep.peak_bytes != mlp_report.peak_bytes  # not the built-in step (no clipping, output kept)
    formula_ = CliRunner().invoke(cli, ["formula", "mlp", "--step", f"{step_dir}/user_step.py:train_step", "--device",
                                        "cpu", "-q"])
    assert formula_.exit_code == 0 and formula_.stdout.strip() == str(rep.peak)


def test_step_with_a_state_factory_from_a_file(step_dir, user_step):
    # SGD with momentum: one buffer per parameter where AdamW keeps two
    model, sample, _ = _mlp()
    rep = estimator.report(model, sample, batch=8, step=user_step["train_step"], optimizer=user_step["make_state"],
                           device="cpu")
    adamw = estimator.report(model, sample, batch=8, step=user_step["train_step"], device="cpu")
    data = _cli_json(["report", "mlp", "--step", f"{step_dir}/user_step.py:train_step",
                      "--optimizer", f"{step_dir}/user_step.py:make_state"])
    assert data["peak_bytes"] == rep.peak_bytes and data["peak"] == str(rep.peak)
    assert rep.peak_bytes < adamw.peak_bytes


def test_step_beside_the_model_in_one_file(step_dir, user_step):
    """MODEL and --step in the same file: the file is imported once (the step checks make()'s class)."""
    model, sample = user_step["make"]()
    rep = estimator.report(model, sample, step=user_step["net_step"], device="cpu")
    spec = f"{step_dir}/user_step.py"
    data = _cli_json(["report", f"{spec}:make", "--step", f"{spec}:net_step"])
    assert data["peak_bytes"] == rep.peak_bytes and data["batch"] == 4


def test_keep_and_drop_output_reach_the_report(mlp_report):
    model, sample, loss_fn = _mlp()
    dropped = estimator.report(model, sample, batch=8, loss_fn=loss_fn, keep_output=False, device="cpu")
    assert _cli_json(["report", "mlp", "--drop-output"])["peak_bytes"] == dropped.peak_bytes
    assert _cli_json(["report", "mlp", "--keep-output"])["peak_bytes"] == mlp_report.peak_bytes  # the default
    assert dropped.peak_bytes < mlp_report.peak_bytes


@pytest.mark.parametrize("args,message", [
    (["--step", "{dir}/nope.py:train_step"], "--step: no such file: '{dir}/nope.py'"),
    (["--step", "{dir}/user_step.py:trian_step"],
     "--step: {dir}/user_step.py has no 'trian_step'. Did you mean {dir}/user_step.py:train_step?"),
    (["--step", "{dir}/user_step.py:not_callable"],
     "--step: {dir}/user_step.py:not_callable is a int, not a function step(model, sample, state)"),
    (["--step", "{dir}/broken_step.py:train_step"], "--step: importing {dir}/broken_step.py failed: SyntaxError"),
    (["--step", "{dir}/user_step.py"], "--step: name the function in '{dir}/user_step.py'"),
    (["--step", "{dir}/user_step.py:train_step", "--optimizer", "{dir}/user_step.py:make_stat"],
     "--optimizer: {dir}/user_step.py has no 'make_stat'. Did you mean {dir}/user_step.py:make_state?"),
    # the library's refusals: what shapes the built-in step does not apply to the user's
    (["--step", "{dir}/user_step.py:train_step", "--drop-output"], "keep_output shapes the built-in step"),
    (["--step", "{dir}/user_step.py:train_step", "--amp", "bf16"], "amp shapes the built-in step"),
    (["--step", "{dir}/user_step.py:train_step", "--dp", "2"], "cannot combine with step="),
])
def test_bad_step_flags_are_one_line_input_errors(step_dir, args, message):
    result = CliRunner().invoke(cli, ["report", "mlp", *[a.replace("{dir}", str(step_dir)) for a in args], "-q"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith("fxmem: error: ") and result.stderr.count("\n") == 1
    assert message.replace("{dir}", str(step_dir)) in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", [["compare", "mlp"], ["plan", "mlp", "--budget", "1MiB"]])
def test_compare_and_plan_refuse_a_step(step_dir, command):
    result = CliRunner().invoke(cli, [*command, "--step", f"{step_dir}/user_step.py:train_step", "-q"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == (
        f"fxmem: error: --step: fxmem {command[0]} weighs strategies that transform the built-in step (accumulation, "
        "AMP, DDP, ZeRO, pipeline), which cannot combine with your own step; estimate your step with fxmem report "
        "MODEL --step FILE.py:FUNC (--checkpoint MODULES applies to it)\n"
    )


@pytest.mark.parametrize("command", ["report", "formula", "fit", "compare", "plan"])
def test_step_options_in_help(command):
    out = CliRunner().invoke(cli, [command, "--help"]).output
    offered = command in ("report", "formula", "fit")  # compare / plan: --step hidden (refused, with the reason)
    assert ("--step FILE.py:FUNC" in out) == offered
    assert ("--keep-output / --drop-output" in out) == offered
