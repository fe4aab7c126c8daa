"""The autograd engine's gradient sums (estimator/capture/grad_sums.py): in place where
torch/csrc/autograd/input_buffer.cpp sums in place, out of place where it does not; each case
against the CPU allocator's measurement (tolerance: 0 B)."""

from __future__ import annotations

import pytest
import torch

import estimator
from validators.cpu import measure_cpu
from validators.outside import Scan, Shared, mamba, mamba_sample, sum_loss as _sum


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


@pytest.mark.parametrize("b", [4, 16])  # 16: the conv1d's backend guard starts the formula there
def test_mamba_selective_scan_trains_exactly(b):
    pytest.importorskip("transformers")
    sample = mamba_sample(b)
    assert estimator.report(mamba(), sample, mode="train", device="cpu").peak_bytes == \
        measure_cpu(mamba(), sample).peak_bytes  # 255 sums in place
