"""Composite ops whose C++ takes another branch on fake tensors (estimator/corrections/composite.py).

Each case is a step where the branch decides the peak; the estimate must equal the CPU
measurement (validators.cpu.measure_cpu) to the byte, and the real-tensor measurement of the
fake branch (the same call under a no-op dispatch mode, which makes ``isTensorSubclassLike``
true) must differ, so the test could fail.
"""

from __future__ import annotations

import pytest
import torch
from session_cache import compare
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import estimator
from estimator.corrections import composite, registry
from estimator.vocab.categories import Target
from validators.cpu import measure_cpu


class _NoOpMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _sum_loss(out, sample):
    return out.sum()


def _predicted(model, sample, mode, loss_fn=None, device="cpu"):
    kwargs = {"gpu": "H100"} if device == "cuda" else {}
    rep = estimator.report(model, sample, batch=sample.shape[0], mode=mode, optimizer="sgd", loss_fn=loss_fn,
                           device=device, **kwargs)
    return rep.peak_bytes


def _measured(model, sample, mode, loss_fn=None, fake_branch=False):
    if not fake_branch:
        return measure_cpu(model, sample, mode, "sgd", loss_fn).peak_bytes
    with _NoOpMode():
        return measure_cpu(model, sample, mode, "sgd", loss_fn).peak_bytes


class TransposedHead(nn.Module):
    """nn.Linear(16, 32) on x.transpose(0, 1): a non-contiguous 3-D input with a bias."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        return self.head(x.transpose(0, 1))


def test_linear_non_contiguous_3d_with_bias_adds_in_place():
    # b = 8, x: (8, 4, 16) fp32; the head sees (4, 8, 16) with strides (16, 64, 1).
    # at::native::linear: not contiguous -> at::matmul, which folds the input into (32, 16)
    # (reshape copies: 32*16*4 = 2,048 B, freed when matmul returns) and runs mm into the
    # (32, 32) output (4,096 B), then output.add_(bias) in place.
    # Baseline: weight 32*16*4 = 2,048 + bias 32*4 = 128 + input 8*4*16*4 = 2,048 -> 4,224 B.
    # Peak (at mm) = 4,224 + 2,048 + 4,096 = 10,368 B.  The fake branch (at::add) holds a second
    # output at the add instead: 4,224 + 4,096 + 4,096 = 12,416 B.
    torch.manual_seed(0)
    x = torch.randn(8, 4, 16)
    assert _measured(TransposedHead(), x, "inference") == 10_368
    assert _measured(TransposedHead(), x, "inference", fake_branch=True) == 12_416
    assert _predicted(TransposedHead(), x, "inference") == 10_368


def test_linear_substitute_leaves_the_fused_paths_to_torch():
    # 2-D (addmm) and contiguous 3-D inputs (_flatten_nd_linear), and no bias: the same ops on
    # fake and real tensors, so the composite runs as it is.
    w, b = torch.randn(4, 3), torch.randn(4)
    for x, bias in ((torch.randn(2, 3), b), (torch.randn(2, 5, 3), b), (torch.randn(5, 2, 3).transpose(0, 1), None)):
        assert composite.linear(None, torch.nn.functional.linear, (x, w, bias), {}) is NotImplemented
    x = torch.randn(5, 2, 3).transpose(0, 1)
    out = composite.linear(None, torch.nn.functional.linear, (x, w), {"bias": b})
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b))


def test_lstm_lm_inference_is_exact():
    # The zoo's lstm_lm: the head's input is the batch_first LSTM's transposed output.  Before the
    # linear entry: +35.9 % at b = 8 and +56.3 % at b = 32 (the logits twice).  Tolerance: the
    # validation's 0.5 % (test_validation runs b = 2 and 32 in both modes; this one is the case that
    # failed, computed once per session).
    row = compare("lstm_lm", "debug", "inference", 32)
    assert abs(row.error) <= 0.5, row


def test_lstm_lm_cuda_target_runs():
    # The CUDA target captures with the substitution mode too (F.linear, cuDNN LSTM substitutes).
    from models_zoo import lstm_lm

    model, make_sample, loss_fn = lstm_lm.make(lstm_lm.SIZES["debug"])
    for mode in ("train", "inference"):
        rep = estimator.report(model, make_sample(8), batch=8, mode=mode, device="cuda", gpu="H100", loss_fn=loss_fn)
        assert rep.peak_bytes > 0


class Indexed(nn.Module):
    """w[idx] * 2: IndexBackward0 runs index_backward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4096, 8))

    def forward(self, idx):
        return self.w[idx] * 2


class Gathered(nn.Module):
    """w.gather(0, idx): GatherBackward0 runs gather_backward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4096, 8))

    def forward(self, idx):
        return self.w.gather(0, idx[:, None].expand(-1, 8)) * 2


class TopOne(nn.Module):
    """w.topk(1, 0): TopkBackward0 runs value_selecting_reduction_backward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4096, 8))

    def forward(self, x):
        return self.w.topk(1, 0)[0] * x.shape[0]


def _backward_case(model_type, sample):
    torch.manual_seed(0)
    measured = _measured(model_type(), sample, "train", _sum_loss)
    fake_branch = _measured(model_type(), sample, "train", _sum_loss, fake_branch=True)
    torch.manual_seed(0)
    predicted = _predicted(model_type(), sample, "train", _sum_loss)
    return measured, fake_branch, predicted


def test_index_backward_puts_in_place():
    # w (4096, 8) fp32 = 131,072 B.  Backward of w[idx]: new_zeros (131,072 B, becomes w.grad)
    # then _index_put_impl_ in place; the fake branch's index_put clones it: +131,072 B.
    measured, fake_branch, predicted = _backward_case(Indexed, torch.randint(0, 4096, (16,)))
    assert fake_branch - measured == 131_072
    assert predicted == measured


def test_gather_backward_scatters_in_place():
    # gather_backward: new_zeros (131,072 B) + scatter_add_; the fake branch's scatter_add: +131,072 B
    measured, fake_branch, predicted = _backward_case(Gathered, torch.randint(0, 4096, (16,)))
    assert fake_branch - measured == 131_072
    assert predicted == measured


def test_value_selecting_backward_scatters_in_place():
    # topk backward: zeros (131,072 B) + scatter_; the fake branch's scatter: +131,072 B
    measured, fake_branch, predicted = _backward_case(TopOne, torch.randn(16))
    assert fake_branch - measured == 131_072
    assert predicted == measured


def test_max_pool1d_inference_allocates_no_indices():
    # (8, 16, 256) fp32 input, kernel 2 -> output (8, 16, 128) = 65,536 B; the real CPU kernel
    # without autograd allocates the output only.  Baseline: the input, 131,072 B -> 196,608 B.
    # The fake branch (max_pool1d_with_indices) also holds int64 indices: +131,072 B.
    x = torch.randn(8, 16, 256)
    model = nn.MaxPool1d(2)
    assert _measured(model, x, "inference") == 196_608
    assert _measured(model, x, "inference", fake_branch=True) == 196_608 + 131_072
    assert _predicted(model, x, "inference") == 196_608


def test_max_pool1d_keeps_its_indices_for_autograd_and_on_cuda():
    # With autograd the real kernel saves the indices too (the composite runs); CUDA always takes
    # max_pool1d_with_indices: only the CPU target has the entry.
    x = torch.randn(2, 4, 8, requires_grad=True)
    assert composite.max_pool1d(None, torch.max_pool1d, (x, 2), {}) is NotImplemented
    assert registry.substitution(Target.CUDA, torch.nn.functional.max_pool1d) is None


def test_in_place_kernels_only_inside_their_backward_nodes():
    # Outside the named backward nodes the out-of-place op stays out of place.
    kernel = registry.fake_kernel_for(Target.CPU, torch.ops.aten.scatter_add.default)
    base = torch.zeros(4, 3)
    out = kernel(base, 0, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3))
    assert out.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert base.sum() == 0


@pytest.mark.parametrize("cell", [nn.GRU, nn.RNN])
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_batch_first_rnn_input_projection_adds_its_bias_in_place(cell, mode):
    # RNN.cpp projects the transposed (T, b, I) input through C++ at::linear: matmul, then the bias
    # added in place for real tensors, out of place for fake ones (GRU inference +9 % at b = 3,
    # +14 % at b = 17 before).
    torch.manual_seed(0)

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = cell(16, 16, num_layers=2, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]

    model, x = Seq(), torch.randn(17, 7, 16)
    if mode == "inference":
        model.eval()
    rep = estimator.report(model, x, mode=mode, device="cpu")
    assert rep.peak_bytes == measure_cpu(model, x, mode=mode).peak_bytes
