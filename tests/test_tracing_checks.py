"""Library branches on "am I being traced?" take the real eager branch (estimator/capture/
tracing.py), with the values that follow the sample alone known (estimator/capture/shadows.py).

transformers' ``masking_utils`` skips the causal mask of an all-ones attention mask in a real
eager run; FakeTensors made ``is_tracing(mask)`` true, and the capture priced a (b, 1, s, s)
mask the real run never makes (+16 % at s = 128 on these models).  Each case against the CPU
allocator (tolerance: 0 B)."""

from __future__ import annotations

import pytest
import torch

import estimator
from validators.cpu import measure_cpu

transformers = pytest.importorskip("transformers")
from validators.outside import llama_like, switch, switch_sample, tokens  # noqa: E402 (needs transformers)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
@pytest.mark.parametrize("mask", [True, False], ids=["all-ones mask", "no mask"])
def test_causal_lm_training_takes_the_real_mask_branch(name, mask):
    sample = tokens(4, mask)
    rep = estimator.report(llama_like(name), sample, device="cpu")
    assert rep.peak_bytes == measure_cpu(llama_like(name), sample).peak_bytes


def test_a_meta_model_reads_the_mask_without_a_probe():
    """The mask's value follows the sample alone: no real run of the weights is needed."""
    with torch.device("meta"):
        model = llama_like("qwen2")
    with_mask = estimator.report(model, tokens(4, True), device="cpu").peak_bytes
    without = estimator.report(model, tokens(4, False), device="cpu").peak_bytes
    assert with_mask == without + 4 * 128 * 8  # the int64 mask itself, and no (b, 1, s, s) mask


def test_the_library_check_is_restored():
    from transformers.utils import import_utils

    before = import_utils.is_fake_tensor
    estimator.report(llama_like("llama"), tokens(2, True), device="cpu", mode="inference")
    assert import_utils.is_fake_tensor is before


def test_a_zero_dim_tensor_in_an_f_string_is_its_value():
    """``Tensor.__format__`` prints a 0-dim tensor as its number only for ``type(self) is Tensor``;
    transformers' Switch router names its experts so (``self[f"expert_{expert_idx[0]}"]``)."""

    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleDict({f"expert_{i}": torch.nn.Linear(8, 8) for i in range(2)})

        def forward(self, x, which):
            return self.experts[f"expert_{which[0]}"](x)

    x, which = torch.randn(4, 8), torch.ones(4, dtype=torch.long)
    rep = estimator.report(Named(), (x, which), mode="inference", device="cpu")  # which follows the sample
    assert rep.peak_bytes == measure_cpu(Named(), (x, which), "inference", None).peak_bytes
    assert torch.Tensor.__format__.__module__ == "torch._tensor"  # restored


def test_switch_transformers_routes_as_the_sample_does():
    """transformers ``SwitchTransformersForConditionalGeneration``: the router's expert names in
    f-strings, its expert loop over the experts it chose; under data_dependent='sample' within
    0.5 % of the CPU allocator (measured: +0.16 % at b = 2, +0.21 % at b = 8)."""
    sample = switch_sample(2)
    rep = estimator.report(switch(), sample, device="cpu", data_dependent="sample")
    measured = measure_cpu(switch(), sample).peak_bytes
    assert abs(rep.peak_bytes - measured) / measured <= 0.005
