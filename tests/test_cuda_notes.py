"""CUDA reports say what is not modelled with its size: the cuDNN convolution workspace bound
(estimator/devices/cudnn.py, from Conv_v8.cpp / Conv_v7.cpp / ConvShared.cpp) and the CUDA
context's estimate and range (estimator/vocab/gpus.py ``estimated_notes``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import estimator
import models_zoo
from estimator.devices import cudnn
from estimator.devices.cudnn import CallKind
from estimator.orchestrate import estimate
from estimator.vocab import gpus
from estimator.vocab.strategy import Strategy

A100_80 = 85_100_068_864  # resolve_gpu("A100 80GB").total_memory (deviceQuery, observed)
CONTEXT = 512 * 2**20  # DEFAULT_CONTEXT_BYTES = 536,870,912


def captured(model, sample, **kwargs):
    """The report and what ``estimate.result`` received: the request and the captured step."""
    seen = {}
    original = estimate.result

    def spy(request, step_, *roles):
        seen["request"], seen["step"] = request, step_
        return original(request, step_, *roles)

    estimate.result = spy
    try:
        rep = estimator.report(model, sample, device="cuda", **kwargs)
    finally:
        estimate.result = original
    return rep, seen["request"], seen["step"]


def bounds(model, sample, batch, **kwargs):
    rep, request, step_ = captured(model, sample, **kwargs)
    return rep, cudnn.workspace_bounds(step_.at_batch, step_.graph, request.spec.target, batch)


def cudnn_note(rep):
    found = [n for n in rep.notes if n.startswith("cuDNN convolution workspace")]
    assert len(found) <= 1
    return found[0] if found else None


def test_bound_per_call_exact_on_a_small_conv_net():
    """Conv2d(3, 4, 3, padding=1, bias=False), x (2, 3, 8, 8) fp32, SGD (no state), no matmul (no
    cuBLAS workspace), A100 80GB: 85,100,068,864 B, context 536,870,912 B.

    forward conv: weight 4*3*3*3*4 = 432 + input 2*3*8*8*4 = 1,536 + its output 2*4*8*8*4 = 2,048
      = 4,016 B allocated -> 85,100,068,864 - 536,870,912 - 4,016 = 84,563,193,936.
    backward-weight (the input needs no grad: output_mask [False, True, False], one cuDNN call):
      alive before the op: 432 + 1,536 + the kept output 2,048 + the loss 4 + backward's seed 4 +
      grad_output (MeanBackward's div) 2,048 = 6,072 -> 84,563,191,880.
    """
    torch.manual_seed(0)
    model = nn.Conv2d(3, 4, 3, padding=1, bias=False)
    rep, found = bounds(model, torch.randn(2, 3, 8, 8), 2, optimizer="sgd", gpu="A100 80GB")
    assert [(b.call.kind, b.allocated, b.bytes) for b in found] == [
        (CallKind.FORWARD, 4_016, A100_80 - CONTEXT - 4_016),
        (CallKind.BACKWARD_WEIGHT, 6_072, A100_80 - CONTEXT - 6_072),
    ]
    assert A100_80 - CONTEXT - 4_016 == 84_563_193_936
    note = cudnn_note(rep)
    assert "2 cuDNN calls per step (1 forward, 1 backward-weight)" in note
    assert "the most: 84,563,193,936 B, forward of '(the model)'" in note
    assert "Conv_v8.cpp run_conv_plan" in note and "try_configs" in note


def test_bound_is_capped_by_cudnn_conv_wscap_dbg(monkeypatch):
    # CUDNN_CONV_WSCAP_DBG is in MiB: 64 * 2**20 = 67,108,864 < the free memory
    monkeypatch.setenv("CUDNN_CONV_WSCAP_DBG", "64")
    rep, request, step_ = captured(nn.Conv2d(3, 4, 3), torch.randn(2, 3, 8, 8), optimizer="sgd", gpu="A100 80GB")
    found = cudnn.workspace_bounds(step_.at_batch, step_.graph, request.spec.target, 2, wscap_env="64")
    assert {b.bytes for b in found} == {67_108_864}
    assert "CUDNN_CONV_WSCAP_DBG=64 caps the engines' workspaces at 64.00 MiB" in cudnn_note(rep)


def test_calls_follow_the_backend_and_the_output_mask():
    """ConvShared.cpp: backward makes a backward-data call when the input needs a gradient and a
    backward-weight call for the weight; a transposed conv's forward is a backward-data call and its
    input gradient a forward call.  Convolution.cpp: a depthwise fp32 NCHW conv runs the native
    CudaDepthwise2d kernel (no cuDNN), a channels-last one cuDNN."""
    x = torch.randn(2, 4, 8, 8)

    def kinds(model, sample):
        _, request, step_ = captured(model, sample, optimizer="sgd", gpu="A100 80GB")
        return [c.kind.value for c in cudnn.conv_calls(step_.at_batch, step_.graph)]

    two = nn.Sequential(nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3))
    assert kinds(two, x) == ["forward", "forward", "backward-data", "backward-weight", "backward-weight"]
    assert kinds(nn.ConvTranspose2d(4, 4, 3), x) == ["backward-data", "backward-weight"]
    assert kinds(nn.Sequential(nn.Conv2d(4, 4, 1), nn.ConvTranspose2d(4, 4, 3)), x) == [
        "forward", "backward-data", "forward", "backward-weight", "backward-weight"]
    depthwise = nn.Conv2d(4, 8, 3, groups=4)
    assert kinds(depthwise, x) == []
    assert kinds(depthwise.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)) == [
        "forward", "backward-weight"]


def test_unknown_capacity_and_distributed_ranks_give_no_bytes():
    x = torch.randn(2, 3, 8, 8)
    rep = estimator.report(nn.Conv2d(3, 4, 3), x, optimizer="sgd", device="cuda", gpu="sm_80")
    assert "the GPU's capacity is unknown here" in cudnn_note(rep)
    rep = estimator.report(nn.Conv2d(3, 4, 3), x, optimizer="sgd", device="cuda", gpu="A100 80GB",
                           strategy=Strategy(data_parallel=2))
    assert "not computed for each rank of a distributed strategy" in cudnn_note(rep)


def test_benchmark_mode_is_read_from_the_process(monkeypatch):
    x = torch.randn(2, 3, 8, 8)
    rep = estimator.report(nn.Conv2d(3, 4, 3), x, optimizer="sgd", device="cuda", gpu="A100 80GB")
    assert "With torch.backends.cudnn.benchmark=True the first call" in cudnn_note(rep)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    rep = estimator.report(nn.Conv2d(3, 4, 3), x, optimizer="sgd", device="cuda", gpu="A100 80GB")
    assert "torch.backends.cudnn.benchmark is True here" in cudnn_note(rep)


def test_resnet_cuda_report_has_the_workspace_note_and_the_mlp_none():
    model, make_sample, loss_fn = models_zoo.get("resnet", "debug")
    rep = estimator.report(model, make_sample(4), loss_fn=loss_fn, device="cuda", gpu="A100 80GB")
    # resnet debug: 17 convolutions (stem, 4 bottlenecks of 3 + a downsample); every backward
    # computes the weight gradient, all but the stem's the input gradient.
    note = cudnn_note(rep)
    assert "50 cuDNN calls per step (17 forward, 16 backward-data, 17 backward-weight)" in note
    assert "at b = 4 on the NVIDIA A100-SXM4-80GB" in note
    model, make_sample, loss_fn = models_zoo.get("mlp", "debug")
    rep = estimator.report(model, make_sample(4), loss_fn=loss_fn, device="cuda", gpu="A100 80GB")
    assert cudnn_note(rep) is None


@pytest.mark.parametrize("kwargs", [
    {"device": "cuda"},
    {"device": "cuda", "gpu": "V100", "mode": "inference"},
    {"device": "cuda", "gpu": "24GiB", "strategy": Strategy(data_parallel=2)},
])
def test_context_note_on_every_cuda_report(kwargs):
    rep = estimator.report(nn.Linear(8, 4), torch.randn(2, 8), optimizer="sgd", **kwargs)
    context = [n for n in rep.notes if n.startswith("CUDA context: ")]
    assert context == list(gpus.estimated_notes(CONTEXT))
    assert cudnn_note(rep) is None  # no convolution


def test_no_cuda_notes_on_cpu():
    rep = estimator.report(nn.Conv2d(3, 4, 3), torch.randn(2, 3, 8, 8), optimizer="sgd", device="cpu")
    assert not [n for n in rep.notes if n.startswith(("CUDA context", "cuDNN convolution"))]


def test_context_note_states_the_estimate_and_its_range():
    # pytorch/pytorch#85692: 287,047,680 - 20 MiB segment = 266,076,160 B = 253.75 MiB (lazy);
    # 666,632,192 - 20,971,520 = 645,660,672 B = 615.75 MiB (eager); #55277: 1,687 MB = 1,609 MiB.
    (note,) = gpus.estimated_notes(CONTEXT, "")
    assert note.startswith("CUDA context: 512.00 MiB (fxmem's estimate)")
    assert "typically 254 MiB to 400 MiB with lazy module loading" in note
    assert "616 MiB to 1,609 MiB with CUDA_MODULE_LOADING=EAGER or CUDA < 11.7" in note
    (eager,) = gpus.estimated_notes(2**30, "eager")
    assert eager.startswith("CUDA context: 1.00 GiB (as given)")
    assert "CUDA_MODULE_LOADING=EAGER here: every kernel loads at start, typically 616 MiB to 1,609 MiB" in eager
