"""Buffers CPU kernels allocate that the fake kernels do not show, each against the CPU
allocator's measurement at b = 1, 3, 17 (tolerance: 0 B).

- ``upsample_nearest2d`` to a small output copies a contiguous input and output to channels-last
  (corrections/cpu/resample.py, measured on the host);
- ``native_layer_norm_backward`` reduces the weight's and bias's gradients through a
  ``2 x threads x N`` buffer (corrections/cpu/norm.py, from the source and this process's threads);
- a binary op with inputs of two dtypes copies the other one to the common dtype
  (TensorIterator's input promotion, registry.py ``_promoted_input_bytes``): the backward of
  ``scatter_reduce(..., "amax")`` multiplies a bool mask by a float gradient;
- ``abs`` of a complex tensor computes into a complex temporary (corrections/complex.py);
- pooling kernels copy a tensor laid out otherwise than row-major (a sum's expanded gradient, a
  channels-last or transposed map; corrections/cpu/reduce.py, measured on the host).

The models are ``validators.outside``'s (``python -m validators.outside`` runs them at b = 2, 8, 32).
"""

from __future__ import annotations

import pytest
import torch

import estimator
from validators.cpu import measure_cpu
from validators.outside import (ComplexWeights, MaxMessages, StridedPools, TransposedNorm, UpsamplePool,
                                sum_loss as _sum)


CASES = {UpsamplePool: (3, 16, 16), TransposedNorm: (4, 8, 8), MaxMessages: (32,), ComplexWeights: (16,),
         StridedPools: (4, 12, 12)}


@pytest.mark.parametrize("model", list(CASES), ids=lambda m: m.__name__)
@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("b", [1, 3, 17])
def test_kernel_buffers_match_the_allocator(model, mode, b):
    x = torch.randn(b, *CASES[model])
    rep = estimator.report(model(), x, mode=mode, loss_fn=_sum, device="cpu")
    assert rep.peak_bytes == measure_cpu(model(), x, mode=mode, loss_fn=_sum).peak_bytes
