"""The estimate against the CPU ground truth (validators.cpu.measure_cpu) over the whole zoo.

Tolerance: |estimate - measured| / measured <= 0.5 %, the issue's median-error target, applied to
every case: every zoo model's ``debug`` size, and every convolution family of ``convnets`` in
fp32 and bf16 (validators.zoo.cases), in train and inference, on the host that runs the tests.

Batch sizes (suite time): b = 2 and 32 in fp32, b = 32 in bf16.  The branches the batch size
decides are all taken by these two: host kernels of a symbolic capture are measured at b = 2, 3
and 4 for b = 2, at b = 2, 3, b (and b + 1 for a kernel that changes regime) for any b > 4
(estimator/corrections/cpu/host.py ``price``, ``_regimes``); a CPU convolution's backend choice reads
b >= 16 (estimator/corrections/cpu/conv.py); the concrete fallback captures b, b + 1 and 4b for
any b (estimator/orchestrate/path.py ``_concrete``).  b = 8 adds no branch: its kernels are measured
as b = 32's are and, below 16 like b = 2's, fit one line.
``python -m validators`` runs the full matrix: b = 2, 8, 32 for every case.
"""

from __future__ import annotations

import pytest
import torch
from session_cache import compare
from torch import nn

from validators import zoo
from validators.cpu import measure_cpu

TOLERANCE = 0.005  # 0.5 %: the median target


# b = 2 and 32 (fp32), 32 (bf16) here (suite time, see above); python -m validators runs 2, 8, 32 for all.
CASES = [(*case, b) for case in zoo.cases() for b in (2, 32) if case[2] == "fp32" or b == 32]


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("name, size, dtype, b", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_zoo_estimate_matches_cpu(name, size, dtype, b, mode):
    # compare() makes a fresh instance for the measurement: nothing the estimator did can influence it
    # (validators.zoo.compare, once per session: tests/test_fastpath.py's rows are the same calls)
    row = compare(name, size, mode, b, dtype)
    assert abs(row.error) <= 100 * TOLERANCE, (
        f"{name} {size} {dtype} {mode} b={b}: estimated {row.predicted:,} B, measured {row.measured:,} B, "
        f"error {row.error:+.3f} % ({row.capture} capture)"
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


@pytest.mark.parametrize("family", ["blocks", "convs", "tokens"])
def test_random_models_are_exact(family):
    """One seeded model of each ``python -m validators.random_models`` family (a two-layer LSTM, a
    LayerNorm2d/GroupNorm/upsampling conv chain, a batch_first GRU LM: each was off before issue 27's
    last fixes), b = 1 and 17, train and inference: exact against the allocator."""
    from validators import random_models

    seed = {"blocks": 10, "convs": 32, "tokens": 17}[family]
    rows = list(random_models.run([family], range(seed, seed + 1), (1, 17)))
    assert [(r[2], r[3], r[4]) for r in rows] == [(r[2], r[3], r[5]) for r in rows]
