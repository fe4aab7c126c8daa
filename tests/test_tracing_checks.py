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


def _models():
    from estimator.integrations._common import ensure_torchvision_importable

    ensure_torchvision_importable()
    t = transformers
    gqa = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)
    return {"qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**gqa)), "llama": (t.LlamaForCausalLM, t.LlamaConfig(**gqa))}


def _sample(b: int, mask: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (b, 128), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids} | ({"attention_mask": torch.ones_like(ids)} if mask else {})


@pytest.mark.parametrize("name", ["qwen2", "llama"])
@pytest.mark.parametrize("mask", [True, False], ids=["all-ones mask", "no mask"])
def test_causal_lm_training_takes_the_real_mask_branch(name, mask):
    cls, config = _models()[name]
    sample = _sample(4, mask)
    torch.manual_seed(0)
    rep = estimator.report(cls(config), sample, device="cpu")
    torch.manual_seed(0)
    assert rep.peak_bytes == measure_cpu(cls(config), sample).peak_bytes


def test_a_meta_model_reads_the_mask_without_a_probe():
    """The mask's value follows the sample alone: no real run of the weights is needed."""
    cls, config = _models()["qwen2"]
    with torch.device("meta"):
        model = cls(config)
    with_mask = estimator.report(model, _sample(4, True), device="cpu").peak_bytes
    without = estimator.report(model, _sample(4, False), device="cpu").peak_bytes
    assert with_mask == without + 4 * 128 * 8  # the int64 mask itself, and no (b, 1, s, s) mask


def test_the_library_check_is_restored():
    from transformers.utils import import_utils

    before = import_utils.is_fake_tensor
    cls, config = _models()["llama"]
    estimator.report(cls(config), _sample(2, True), device="cpu", mode="inference")
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
    _models()  # torchvision importable
    t = transformers
    config = t.SwitchTransformersConfig(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                        num_decoder_layers=2, num_heads=4, num_experts=4, expert_capacity=8,
                                        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                                        decoder_start_token_id=0)

    def make():
        torch.manual_seed(0)
        return t.SwitchTransformersForConditionalGeneration(config)

    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids, "labels": ids}
    rep = estimator.report(make(), sample, device="cpu", data_dependent="sample")
    measured = measure_cpu(make(), sample).peak_bytes
    assert abs(rep.peak_bytes - measured) / measured <= 0.005
