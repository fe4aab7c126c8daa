"""CPU kernels measured on the host (estimator/corrections/cpu/host.py): the event arithmetic on exact
numbers, the cache, and whole steps against the CPU allocator's measurement of the same step,
on this host's ISA and on AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` run the
AVX2 code paths on an AVX-512 or AMX machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sympy
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

import estimator
from estimator.corrections.cpu import host as cpu
from validators.cpu import measure_cpu

m = sympy.Symbol("m")


# -- the arithmetic of allocator events ----------------------------------------------------------
def test_peaks_relative_to_outputs():
    # oneDNN forward: src reorder 100, weights 20, blocked dst 50, free weights and src, the
    # plain output 40, free the blocked dst.  Running sums: 100 120 170 | 150 50 90 40.
    # Local maxima 170 and 90, above the 40 B of output: 130 and 50; nothing left behind.
    measured = cpu.Measured((100, 20, 50, -20, -100, 40, -50), (40,))
    assert cpu._peaks(measured) == ([130, 50], 0)


def test_fit_is_linear_per_event_and_checked_at_a_third_size():
    call = cpu.KernelCall(torch.ops.aten.convolution.default, (), {}, 0, ((7, None),))

    def events(b):  # reorder 10*b, constant 64-B scratchpad, output 4*b
        return cpu.Measured((10 * b, 64, -64, 4 * b, -10 * b), (4 * b,))

    sizes = [2, 3, 8]
    fakes = [{7: 4 * b} for b in sizes]
    resolved = cpu.fit(call, sizes, [events(b) for b in sizes], fakes, m)
    # running sums 10b, 10b + 64 | 10b, 14b | 4b: above the output 4b, 6b + 64 and 10b (the
    # first is larger below b = 16, the second above: both kept); the output is what the fake
    # showed: extra 0
    assert resolved.scratch == (6 * m + 64, 10 * m)
    assert resolved.extra == {7: 0}
    # the third size off the line: no formula
    bent = [events(2), events(3), cpu.Measured((80 + 1, 64, -64, 32, -81), (32,))]
    assert cpu.fit(call, sizes, bent, fakes, m) is None
    # other events at one size: no formula either
    other = [events(2), events(3), cpu.Measured((80, 64, 100, -100, -64, 32, -80), (32,))]
    assert cpu.fit(call, sizes, other, fakes, m) is None


def test_undominated_lines():
    # 6m + 64 and 10m cross at m = 16: both kept; 5m + 10 is below 6m + 64 everywhere (m >= 2):
    # dropped; 3 - 2m is never above 0 from m = 2 on: dropped; a repeated line is kept once;
    # the constant 200 is above 6m + 64 at m = 2 but not beyond m = 22: all three kept
    lines = [6 * m + 64, 10 * m, 5 * m + 10, 3 - 2 * m, 10 * m]
    assert cpu._undominated(lines, m) == (6 * m + 64, 10 * m)
    assert cpu._undominated([*lines, 200], m) == (6 * m + 64, 10 * m, 200)


def test_argument_maps_as_pytree_gives_them():
    # the calls' arguments are mapped at every size they are priced at: the written-out maps
    # must give what tree_map / tree_flatten give (types kept: the cache key is their repr)
    t = cpu.TensorArg((2 * m, 3), (3, 1), torch.float32)
    cases = [(t, [1, 1], (0, 0), False, None), [t, (t, [m])], {"dim": [0, m], "out": t}, (), torch.Size([2, 3])]
    double = lambda x: 2 * x if isinstance(x, (int, sympy.Expr)) else x  # noqa: E731
    for args in cases:
        assert repr(cpu._map(double, args)) == repr(tree_map(double, args))
        assert cpu._leaves(args) == tree_flatten(args)[0]


def test_output_larger_or_missing_in_the_real_kernel():
    # the fake backward shows grad_input (key 1, 400 B) that the real kernel does not allocate
    # (output_mask[0] False): extra -400; grad_weight (key 2) as shown.
    call = cpu.KernelCall(torch.ops.aten.native_batch_norm_backward.default, (), {}, 0, ((1, 400), (2, 8)))
    resolved = cpu.exact(call, cpu.Measured((8,), (None, 8)), {1: 400, 2: 8})
    assert resolved.extra == {1: -400, 2: 0}
    assert resolved.scratch == ()


def test_regimes_exact_at_the_requested_batch(monkeypatch):
    # b < 4: one scratch buffer of 2b + 10 B; b >= 4 the kernel books 3b + 40 instead (another
    # split of the batch over threads).  Measured at 2, 3, 8 (+ 9, asked for by _regimes).
    call = cpu.KernelCall(torch.ops.aten.convolution.default, (), {}, 0, ())

    def events(b):
        size = 2 * b + 10 if b < 4 else 3 * b + 40
        return cpu.Measured((size, -size), ())

    monkeypatch.setattr(cpu, "measure", lambda calls: [events(9)])
    got = {b: events(b) for b in (2, 3, 8)}
    resolved = cpu._regimes(call, got, lambda call, b: (None, {}), m, requested=8)
    # the requested batch's regime gives the line 3b + 40 (exact at 8 and 9); the small sizes
    # their values 14 and 16 as constants, below the line everywhere: dropped
    assert resolved.scratch == (3 * m + 40,)
    # requested b = 2: the line through 2 and 3 (2b + 10, exact at 2); b = 8's 64 is above
    # the requested batch's 14, so it is not kept (it would move the number at b = 2)
    assert cpu._regimes(call, got, lambda call, b: (None, {}), m, requested=2).scratch == (2 * m + 10,)


# -- whole steps, measured (every convolution family: tests/test_validation.py, models_zoo.convnets) --
class Net(nn.Module):
    """A convolution body, a mean, a linear head."""

    def __init__(self, body: nn.Module, channels: int):
        super().__init__()
        self.body, self.head = body, nn.Linear(channels, 3)

    def forward(self, x):
        y = self.body(x.to(self.head.weight.dtype))
        return self.head(y.flatten(2).mean(2))


def _loss(out, sample):
    return out.float().pow(2).mean()


def test_one_capture_serves_every_batch():
    # the formula from b = 4 holds at b = 32: no 'b < 16' guard from the meta convolution's
    # backend choice, and every event of the kernels linear in b (checked at b = 2, 3, 4).
    model = Net(nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8)), 8)
    rep = estimator.report(model, torch.randn(4, 3, 8, 8), optimizer="sgd", loss_fn=_loss, device="cpu")
    assert rep.guards == () and rep.valid_to is None
    assert rep.at(32) == measure_cpu(model, torch.randn(32, 3, 8, 8), "train", "sgd", _loss).peak_bytes


def test_measurements_are_cached_per_host(tmp_path, monkeypatch):
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))
    cpu.CACHE.memory.clear()
    model, x = Net(nn.Conv2d(3, 8, 3), 8), torch.randn(2, 3, 8, 8)
    first = estimator.report(model, x, optimizer="sgd", loss_fn=_loss, device="cpu")
    (path,) = tmp_path.iterdir()
    data = json.loads(path.read_text())
    assert data["host"] == cpu.host() and data["calls"]
    cpu.CACHE.memory.clear()  # a new process: read back from disk, nothing run

    def no_run(calls):
        raise AssertionError(f"{len(calls)} calls were run again")

    monkeypatch.setattr(cpu, "_run", no_run)
    assert estimator.report(model, x, optimizer="sgd", loss_fn=_loss, device="cpu").peak_bytes == first.peak_bytes


def test_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("FXMEM_CACHE_DIR", "off")
    assert cpu.cache_dir() is None
    assert cpu.CACHE._file() is None


_AVX2_SCRIPT = textwrap.dedent("""
    import json, torch
    from torch import nn
    import estimator
    from validators.cpu import measure_cpu

    def loss(out, sample):
        return out.pow(2).mean()

    rows = {}
    for name, make, shape in [
        ("depthwise", lambda: nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.Flatten()), (32, 16, 16)),
        ("conv1d", lambda: nn.Sequential(nn.Conv1d(64, 64, 3, stride=2), nn.Flatten()), (64, 64)),
        ("stem", lambda: nn.Sequential(nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(16),
                                       nn.ReLU(inplace=True), nn.Flatten()), (3, 32, 32)),
    ]:
        for mode in ("train", "inference"):
            torch.manual_seed(0)
            rep = estimator.report(make(), torch.randn(8, *shape), mode=mode, optimizer="sgd", loss_fn=loss,
                                   device="cpu")
            torch.manual_seed(0)
            meas = measure_cpu(make(), torch.randn(8, *shape), mode, "sgd", loss).peak_bytes
            rows[f"{name}-{mode}"] = (rep.peak_bytes, meas)
    print(json.dumps({"isa": torch.backends.cpu.get_cpu_capability(), "rows": rows, "notes": rep.notes}))
""")


@pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX"), reason="not an x86-64 AVX host")
def test_avx2_code_paths_exact():
    # The same pricing with PyTorch's kernels and oneDNN limited to AVX2 (as on AVX2-only CI
    # hosts); the variables must be set before torch loads, hence a subprocess.
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["isa"] == "AVX2"
    assert any("AVX2" in n for n in result["notes"])
    for case, (predicted, measured) in result["rows"].items():
        assert predicted == measured, (case, predicted, measured)


class Attention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention (the CPU flash kernel)."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.qkv, self.heads = nn.Linear(d, 3 * d), heads

    def forward(self, x):  # x: (B, T, d)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # (B, h, T, d/h) each
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_cpu_flash_attention_exact(mode):
    # The flash kernel's per-thread blocks and, in backward, its fp32 grad_q accumulator (a q-sized
    # buffer: 4 * 4 * 256 * 16 * 4 = 262,144 B here) are not in the meta kernels: measured.
    torch.manual_seed(0)
    x = torch.randn(4, 256, 64)
    rep = estimator.report(Attention(), x, mode=mode, optimizer="sgd", loss_fn=_loss, device="cpu")
    torch.manual_seed(0)
    assert rep.peak_bytes == measure_cpu(Attention(), x, mode, "sgd", _loss).peak_bytes


def test_calls_too_large_to_run_are_named(monkeypatch):
    # Over the compute limit even at b = 2: not run, and the report says what is not counted.
    monkeypatch.setattr(cpu, "MAX_CALL_FLOPS", 0)
    rep = estimator.report(Net(nn.Conv2d(3, 8, 3), 8), torch.randn(4, 3, 8, 8), optimizer="sgd", loss_fn=_loss,
                           device="cpu")
    assert any("NOT measured" in n and "aten.convolution" in n for n in rep.notes), rep.notes


def test_calls_the_host_cannot_run_are_named(monkeypatch):
    def refuse(calls):
        for call in calls:
            cpu._FAILED[call.key] = "RuntimeError: not on this host"
        return [None] * len(calls)

    monkeypatch.setattr(cpu, "_FAILED", {})  # this process's record of refused calls, restored after
    monkeypatch.setattr(cpu, "_run", refuse)
    monkeypatch.setattr(cpu.CACHE, "table", lambda: {})
    rep = estimator.report(Net(nn.Conv2d(3, 8, 3), 8), torch.randn(4, 3, 8, 8), optimizer="sgd", loss_fn=_loss,
                           device="cpu")
    assert any("could not run on this host (RuntimeError: not on this host)" in n for n in rep.notes), rep.notes


def test_a_call_its_op_refuses_at_a_size_is_not_run():
    """The affordability check runs the op on meta tensors (FLOPs); where the op refuses the
    sizes (fp8 ``_scaled_mm`` needs dimensions divisible by 16: a backward's (N, b) x (b, K) at
    b = 2), the call is not run and says why, instead of failing the report."""
    a = cpu.TensorArg((512, 2), (2, 1), torch.float8_e4m3fn)
    b = cpu.TensorArg((2, 256), (1, 2), torch.float8_e4m3fn)
    scale = cpu.TensorArg((), (), torch.float32)
    call = cpu.Concrete(torch.ops.aten._scaled_mm.default, (a, b, scale, scale), {"out_dtype": torch.bfloat16})
    assert not call.affordable()
    assert "divisible by 16" in cpu._FAILED[call.key]


def test_out_forms_of_matmuls_are_measured_as_their_functional_forms():
    """``mm(a, b, out=buf)`` and ``addmm(..., out=buf)`` (what a compiled region's Inductor program
    calls: ``extern_kernels.mm``) run oneDNN's bf16 matmul as ``mm`` does, its scratchpad
    included: measured on the host as theirs are (before: none, 46,078 B low here)."""
    from validators.cpu import measure_user_step, threads

    def step(model, x, state):
        w = model.weight.detach()
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
        torch.mm(x, w.t(), out=out)
        torch.addmm(model.bias.detach(), x, w.t(), out=out)
        return out.sum()

    def build():
        torch.manual_seed(0)
        return nn.Linear(224, 96).to(torch.bfloat16)

    x = torch.randn(64, 224, dtype=torch.bfloat16)
    with threads(1):
        rep = estimator.report(build(), x, batch=64, device="cpu", step=step, mode="inference")
        measured = measure_user_step(build(), x, step, optimizer=None, mode="inference").peak_bytes
    assert rep.peak_bytes == measured  # tolerance: none (0 B)

