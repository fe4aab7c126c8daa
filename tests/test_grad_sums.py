"""The autograd engine's gradient sums (estimator/capture/grad_sums.py): in place where
torch/csrc/autograd/input_buffer.cpp sums in place, out of place where it does not; each case
against the CPU allocator's measurement (tolerance: 0 B)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import estimator
from validators.cpu import measure_cpu


class Scan(nn.Module):
    """A weight used at every step of a loop: its gradients are summed in AccumulateGrad's input
    buffer, one sum per step after the first, each in place for real."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) * 0.1)

    def forward(self, x):
        h = x[:, 0]
        for t in range(x.shape[1]):
            h = torch.tanh(h @ self.w + x[:, t])
        return h


class Shared(nn.Module):
    """``h + h``: AddBackward0 sends the same tensor to both edges, so the buffer's old gradient
    has a second holder and the engine sums out of place; ``h`` read by three ops: in place."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = self.fc(x)
        return self.fc2((h + h) * torch.tanh(h) + h.exp())


def _sum(out, sample):
    return out.sum()


@pytest.mark.parametrize("model, shape", [(Scan, (6, 64)), (Shared, (64,))])
@pytest.mark.parametrize("b", [2, 17])
def test_gradient_sums_match_the_allocator(model, shape, b):
    x = torch.randn(b, *shape)
    rep = estimator.report(model(), x, mode="train", loss_fn=_sum, device="cpu")
    assert rep.peak_bytes == measure_cpu(model(), x, loss_fn=_sum).peak_bytes


def test_the_engine_is_restored_after_the_capture():
    engine = torch.autograd.variable.Variable._execution_engine
    estimator.report(Scan(), torch.randn(2, 3, 64), mode="train", loss_fn=_sum, device="cpu")
    assert torch.autograd.variable.Variable._execution_engine is engine


def test_mamba_selective_scan_trains_exactly():
    transformers = pytest.importorskip("transformers")
    from estimator.integrations._common import ensure_torchvision_importable

    ensure_torchvision_importable()
    config = transformers.MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                                      conv_kernel=4)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 32))
    sample = {"input_ids": x, "labels": x}
    rep = estimator.report(transformers.MambaForCausalLM(config), sample, mode="train", device="cpu")
    assert rep.peak_bytes == measure_cpu(transformers.MambaForCausalLM(config), sample).peak_bytes  # 255 sums in place
