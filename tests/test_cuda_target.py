"""The CUDA target without a GPU: optimizer defaults, host state, cuBLAS workspaces, the
allocator replay, and the report's three figures.  Exact numbers, arithmetic in comments;
the kernels' entries are tested in test_cuda_attention.py / test_cuda_kernels.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import estimator
from estimator.account import account
from estimator.capture import steps
from estimator.capture.records import StepSpec
from estimator.capture.trace import capture
from estimator.devices.cuda import Overhead
from estimator.devices.cuda_allocator import OutOfMemory
from estimator.vocab.categories import Category, Mode, Phase, Target
from estimator.vocab.errors import InputError
from estimator.vocab.gpus import resolve_gpu
from estimator.vocab.target import DEFAULT_CONTEXT_BYTES, TargetSpec
from estimator.vocab.units import format_bytes

H100, A100 = resolve_gpu("H100"), resolve_gpu("A100 80GB")
WS_H100 = 32 * 2**20  # CublasHandlePool.cpp: 4096 * 8 * 1024 on sm_90
WS_A100 = 8_519_680  # 4096 * 1024 * 2 + 16 * 1024 * 8 elsewhere


def _timeline(model, sample, optimizer, target: TargetSpec, mode=Mode.TRAIN):
    spec = StepSpec(mode, steps.optimizer_factory(optimizer), steps.default_loss, target)
    return account(capture(model, sample, spec, sample.shape[0], symbolic=False))


def _optimizer_allocations(timeline) -> list[int]:
    return [sum(p(0) for p in op.allocated) for op in timeline.ops if op.phase is Phase.OPTIMIZER]


def test_cuda_adamw_is_foreach_and_its_step_counters_stay_on_the_host():
    model, x = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)), torch.randn(4, 64)
    # params: 64*32 + 32 + 32*8 + 8 = 2344 floats = 9376 B in 4 tensors
    cpu = _timeline(model, x, "adamw", TargetSpec())
    gpu = _timeline(model, x, "adamw", TargetSpec(Target.CUDA, H100))
    # CPU: exp_avg + exp_avg_sq (2 * 9376 B) + four 0-dim fp32 step counters (4 * 4 B).
    assert cpu.baseline[list(Category).index(Category.OPTIMIZER_STATE)](0) == 2 * 9376 + 4 * 4
    # CUDA: the counters are torch.tensor(0.0) on the host ("special device hosting for step").
    assert gpu.baseline[list(Category).index(Category.OPTIMIZER_STATE)](0) == 2 * 9376
    # CUDA's foreach step allocates sqrt(exp_avg_sq) for all parameters in one _foreach_sqrt
    # (9376 B) and a host scalar torch.tensor(1.0) (4 B, counted: not distinguishable here);
    # the CPU for-loop one parameter at a time (the largest, 64*32*4 = 8192 B, at once).
    assert max(_optimizer_allocations(gpu)) == 9376
    assert max(_optimizer_allocations(cpu)) == 8192


def test_an_explicit_foreach_false_is_respected():
    model, x = nn.Linear(64, 32), torch.randn(4, 64)
    factory = lambda params: torch.optim.AdamW(params, foreach=False)
    spec = StepSpec(Mode.TRAIN, factory, steps.default_loss, TargetSpec(Target.CUDA, H100))
    timeline = account(capture(model, x, spec, 4, symbolic=False))
    assert max(_optimizer_allocations(timeline)) == 64 * 32 * 4  # the weight's sqrt alone


def test_linear_inference_on_cuda_allocator_figures_are_exact():
    model, x = nn.Linear(256, 256, bias=False), torch.randn(4, 256)
    rep = estimator.report(model, x, mode="inference", device="cuda", gpu="H100")
    # weight 256*256*4 = 262,144 B, input and output 4*256*4 = 4,096 B each: all <= 1 MiB, so in
    # one 2 MiB small-pool segment; one cuBLAS workspace (forward only) of 32 MiB, its own segment.
    assert rep.cuda.workspaces == 1
    assert rep.cuda.step_allocated == 262_144 + 4_096 + 4_096 + WS_H100 == 33_824_768
    # A run (out = model(x) in a loop): the previous output lives until the next call returns.
    assert rep.cuda.carried == 4_096
    assert rep.peak_bytes == 33_824_768 + 4_096
    assert rep.reserved_bytes == rep.cuda.step_reserved == 2 * 2**20 + WS_H100 == 35_651_584
    assert rep.device_bytes == rep.reserved_bytes + DEFAULT_CONTEXT_BYTES
    assert rep.overheads[Overhead.ALLOCATOR_ROUNDING] == 0  # every size is a multiple of 512
    assert rep.overheads[Overhead.PREVIOUS_OUTPUT] == 4_096
    assert rep.overheads[Overhead.ALLOCATOR_CACHE] == 2 * 2**20 - 270_336 - 4_096
    assert rep.at(4) == rep.peak_bytes
    assert rep.peak.subs(estimator.B, 4) == rep.cuda.step_allocated  # one step: tensors + workspace


def test_training_holds_two_cublas_workspaces_and_a_conv_net_none():
    x = torch.randn(2, 16)
    rep = estimator.report(nn.Linear(16, 4), x, optimizer="sgd", device="cuda", gpu="A100 80GB")
    # forward matmul on the Python thread, backward ones on the autograd device thread
    assert (rep.cuda.workspaces, rep.cuda.workspace) == (2, 2 * WS_A100)
    conv = estimator.report(nn.Conv2d(3, 4, 3), torch.randn(2, 3, 8, 8), optimizer="sgd", device="cuda", gpu="H100")
    assert conv.cuda.workspaces == 0  # cuDNN, not cuBLAS


def test_cublas_workspace_config_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    rep = estimator.report(nn.Linear(16, 4), torch.randn(2, 16), mode="inference", device="cuda", gpu="A100 80GB")
    assert rep.cuda.workspace == 4096 * 1024 * 8  # one workspace, 32 MiB on any GPU


def test_small_tensors_round_to_512_bytes():
    model, x = nn.Linear(3, 1), torch.randn(2, 3)
    rep = estimator.report(model, x, mode="inference", device="cuda", gpu="H100")
    # weight 12 B, bias 4 B, input 24 B, output 8 B: each one 512-byte block;
    # torch.addmm's output is the only op output; 4 blocks = 2,048 B + the 32 MiB workspace; in a
    # run, the previous step's output (8 B: one more block) until the next call returns.
    assert rep.cuda.step_allocated == 4 * 512 + WS_H100
    assert rep.peak_bytes == 5 * 512 + WS_H100
    assert rep.overheads[Overhead.ALLOCATOR_ROUNDING] == 5 * 512 - (12 + 4 + 24 + 8 + 8)


def test_fits_and_max_batch_use_the_gpu_memory_and_the_allocator():
    model, x = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)), torch.randn(8, 1024)
    rep = estimator.report(model, x, optimizer="adamw", device="cuda", gpu="24GiB")
    limit = 24 * 2**30
    n = rep.max_batch()
    assert n > 8
    assert rep.on_device(n).device <= limit < rep.on_device(n + 1).device
    assert rep.fits() and rep.fits(b=n) and not rep.fits(b=n + 1)
    assert rep.max_batch("1GiB") < n
    assert rep.max_batch(DEFAULT_CONTEXT_BYTES) == 0  # nothing left after the context


def test_max_batch_under_a_memory_fraction_stops_where_the_allocator_runs_out():
    model, x = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)), torch.randn(8, 1024)
    full = estimator.report(model, x, optimizer="adamw", device="cuda", gpu="24GiB")
    half = estimator.report(model, x, optimizer="adamw", device="cuda", gpu="24GiB",
                            alloc_conf="per_process_memory_fraction:0.5")
    n = half.max_batch()
    # The allocator may hold 0.5 x 24 GiB: the run at n + 1 runs out of memory in the model (as
    # the real allocator raises), well before the device's 24 GiB less the context.
    assert 8 < n < full.max_batch()
    assert half.fits(b=n) and not half.fits(b=n + 1)
    assert half.on_device(n).reserved <= 12 * 2**30
    with pytest.raises(OutOfMemory):
        half.on_device(n + 1)


def test_cpu_budget_is_required_and_cuda_arguments_need_cuda():
    rep = estimator.report(nn.Linear(4, 4), torch.randn(2, 4), optimizer="sgd", device="cpu")
    with pytest.raises(InputError, match="give a budget"):
        rep.max_batch()
    with pytest.raises(InputError, match=r"gpu= describes a CUDA target but device='cpu' asks for the CPU: drop "
                                         r"device='cpu' \(CUDA is the default\) or drop gpu="):
        estimator.report(nn.Linear(4, 4), torch.randn(2, 4), device="cpu", gpu="H100")
    with pytest.raises(InputError, match="gpu= and alloc_conf= describe a CUDA target"):
        estimator.report(nn.Linear(4, 4), torch.randn(2, 4), device="cpu", gpu="H100", alloc_conf="")
    with pytest.raises(InputError, match="unknown GPU 'H1000'"):
        estimator.report(nn.Linear(4, 4), torch.randn(2, 4), device="cuda", gpu="H1000")
    with pytest.raises(InputError, match="large_segment_size_mb"):  # a known option not modelled
        estimator.report(nn.Linear(4, 4), torch.randn(2, 4), device="cuda", alloc_conf="large_segment_size_mb:40")


def test_cuda_is_the_default_target_and_the_default_gpu_is_named():
    rep = estimator.report(nn.Linear(4, 4), torch.randn(2, 4), optimizer="sgd")  # no device=, no gpu=
    assert rep.device == "cuda" and rep.cuda is not None and rep.target.default_gpu
    assert rep.target.gpu.name == "NVIDIA H100 80GB HBM3" and rep.target.gpu.arch == "sm_90"
    assert any(note.startswith("no gpu= given (CLI: --gpu): the prediction is for the default GPU, the NVIDIA H100 "
                               "80GB HBM3") for note in rep.notes)
    assert rep.to_dict()["cuda"]["max_memory_reserved"] == rep.reserved_bytes
    assert rep.to_dict()["cuda"]["default_gpu"] is True
    text = str(rep).splitlines()
    assert text[0] == ("fxmem: Linear, train, optimizer sgd, b = 2, on NVIDIA H100 80GB HBM3 (default GPU: pass --gpu "
                       "/ gpu= for yours)")
    # the three peaks side by side, and the device memory's share of the GPU's 85,045,477,376 B (79.20 GiB)
    share = f"{100 * rep.device_bytes / 85_045_477_376:.1f} %"
    assert text[1] == (f"peak: {format_bytes(rep.peak_bytes)} allocated, {format_bytes(rep.reserved_bytes)} reserved, "
                       f"{format_bytes(rep.device_bytes)} on the device ({share} of its 79.20 GiB)")
    assert text[2].startswith("      the allocated peak is in the ")
    assert "= max_memory_reserved" in str(rep)
    named = estimator.report(nn.Linear(4, 4), torch.randn(2, 4), optimizer="sgd", device="cuda", gpu="H100")
    assert named.cuda == rep.cuda and named.pieces == rep.pieces and not named.target.default_gpu
    assert not any("no gpu= given" in note for note in named.notes)
    assert str(named).splitlines()[0].endswith(", b = 2, on NVIDIA H100 80GB HBM3")
    assert named.to_dict()["cuda"]["default_gpu"] is False
    cpu = estimator.report(nn.Linear(4, 4), torch.randn(2, 4), optimizer="sgd", device="cpu")
    assert str(cpu).splitlines()[0] == "fxmem: Linear, train, optimizer sgd, b = 2, on the CPU"
    assert str(cpu).splitlines()[1].startswith(f"peak: {format_bytes(cpu.peak_bytes)} ({cpu.peak_bytes:,} B) in the ")
