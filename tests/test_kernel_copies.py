"""Buffers CPU kernels allocate that the fake kernels do not show, each against the CPU
allocator's measurement at b = 1, 3, 17 (tolerance: 0 B).

- ``upsample_nearest2d`` to a small output copies a contiguous input and output to channels-last
  (corrections/cpu/resample.py, measured on the host);
- ``native_layer_norm_backward`` reduces the weight's and bias's gradients through a
  ``2 x threads x N`` buffer (corrections/cpu/norm.py, measured);
- a binary op with inputs of two dtypes copies the other one to the common dtype
  (TensorIterator's input promotion, registry.py ``_promoted_input_bytes``): the backward of
  ``scatter_reduce(..., "amax")`` multiplies a bool mask by a float gradient;
- ``abs`` of a complex tensor computes into a complex temporary (corrections/complex.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import estimator
from validators.cpu import measure_cpu


class UpsamplePool(nn.Module):
    """Conv, 2x nearest upsample, global average pool; GroupNorm over (b, C) fixes the batch in
    the model's code, so the concrete captures run."""

    def __init__(self):
        super().__init__()
        self.conv, self.up = nn.Conv2d(3, 16, 3, padding=1), nn.Upsample(scale_factor=2, mode="nearest")
        self.pool, self.norm, self.fc = nn.AdaptiveAvgPool2d(1), nn.GroupNorm(4, 16), nn.Linear(16, 4)

    def forward(self, x):  # x: (b, 3, 16, 16)
        return self.fc(self.norm(self.pool(self.up(self.conv(x))).flatten(1)))


class TransposedNorm(nn.Module):
    """LayerNorm over (C, H, W) of a ConvTranspose2d output: N = 8 x 16 x 16."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.ConvTranspose2d(4, 8, 2, stride=2), nn.LayerNorm([8, 16, 16])
        self.fc = nn.Linear(8 * 16 * 16, 4)

    def forward(self, x):  # x: (b, 4, 8, 8)
        return self.fc(self.norm(self.conv(x)).flatten(1))


class MaxMessages(nn.Module):
    """Message passing: each node sends its features to the next two; max, then sum."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):  # x: (b, 32)
        h = self.fc(x)
        src = torch.arange(2 * x.shape[0]) % x.shape[0]
        dst = (src + 1) % x.shape[0]
        msg = h[src]
        agg = torch.zeros_like(h).scatter_reduce(0, dst[:, None].expand(-1, 32), msg, "amax", include_self=False)
        return agg.index_add(0, dst, msg)


class ComplexWeights(nn.Module):
    """A complex-valued parameter; ``abs`` brings the features back to real numbers."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16, dtype=torch.complex64))
        self.fc = nn.Linear(16, 4)

    def forward(self, x):  # x: (b, 16)
        return self.fc((x.to(torch.complex64) @ self.w).abs())


def _sum(out, sample):
    return out.sum()


CASES = {UpsamplePool: (3, 16, 16), TransposedNorm: (4, 8, 8), MaxMessages: (32,), ComplexWeights: (16,)}


@pytest.mark.parametrize("model", list(CASES), ids=lambda m: m.__name__)
@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("b", [1, 3, 17])
def test_kernel_buffers_match_the_allocator(model, mode, b):
    x = torch.randn(b, *CASES[model])
    rep = estimator.report(model(), x, mode=mode, loss_fn=_sum, device="cpu")
    assert rep.peak_bytes == measure_cpu(model(), x, mode=mode, loss_fn=_sum).peak_bytes
