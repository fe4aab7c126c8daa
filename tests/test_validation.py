"""The estimate against the CPU ground truth (validators.cpu.measure_cpu) over the whole zoo.

Tolerance: |estimate - measured| / measured <= 0.5 %, the issue's median-error target, applied to
every case.  Known open work (not xfailed on purpose: a colleague is adding per-op corrections
for convolution and LSTM kernels): rnn, resnet, unet.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import estimator
import models_zoo
from validators.cpu import measure_cpu

TOLERANCE = 0.005  # 0.5 %: the median target


@pytest.mark.parametrize("b", [2, 8, 32])
@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("name", models_zoo.names())
def test_zoo_estimate_matches_cpu(name, mode, b):
    model, make_sample, loss_fn = models_zoo.get(name, "debug")
    rep = estimator.report(model, make_sample(b), batch=b, mode=mode, optimizer="adamw", loss_fn=loss_fn)
    # A fresh instance for the measurement: nothing the estimator did can influence it.
    model, make_sample, loss_fn = models_zoo.get(name, "debug")
    measured = measure_cpu(model, make_sample(b), mode=mode, optimizer="adamw", loss_fn=loss_fn).peak_bytes
    error = (rep.peak_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, (
        f"{name} {mode} b={b}: estimated {rep.peak_bytes:,} B, measured {measured:,} B, "
        f"error {error:+.3%} ({rep.path.value} capture, peak at {rep.peak_piece.op})"
    )


@pytest.mark.parametrize("b", [1, 8, 33])
def test_validator_linear_inference_is_hand_arithmetic(b):
    # nn.Linear(16, 4) inference: the profiler sees exactly one allocation, the (b, 4) output
    # (16b).  Baseline: W 16*4*4 = 256 + bias 16 + input b*16*4 = 64b.  Peak = 80b + 272.
    m = measure_cpu(nn.Linear(16, 4), torch.randn(b, 16), mode="inference")
    assert m.baseline_bytes == 272 + 64 * b
    assert m.peak_delta == 16 * b
    assert m.peak_bytes == 80 * b + 272


def test_validator_does_not_count_the_warmup():
    # The optimizer state is created by the warm-up step and belongs to the baseline:
    # Linear(16, 4) + AdamW: 272 params + 552 state + 64b input.
    m = measure_cpu(nn.Linear(16, 4), torch.randn(8, 16), mode="train", optimizer="adamw")
    assert m.baseline_bytes == 272 + 552 + 64 * 8
