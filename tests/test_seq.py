"""The sequence length as a second symbol: formulas in b and s (``dynamic=``)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import estimator
import models_zoo
from estimator.vocab.errors import InputError


@pytest.fixture(scope="module")
def gpt():
    model, make_sample, loss_fn = models_zoo.get("gpt", "debug", device="meta")
    rep = estimator.report(model, make_sample(4), batch=4, loss_fn=loss_fn, dynamic={"input_ids": {1: "s"}},
                           device="cpu")
    return model, make_sample, loss_fn, rep


def _direct(gpt, b: int, s: int, **kwargs) -> estimator.Report:
    model, make_sample, loss_fn, _ = gpt
    sample = {"input_ids": make_sample(b)["input_ids"][:, :s]}
    return estimator.report(model, sample, batch=b, loss_fn=loss_fn, **kwargs, device="cpu")


def test_the_formula_in_b_and_s_matches_captures_at_other_lengths(gpt):
    rep = gpt[3]
    assert rep.seq == 32 and rep.seq_range == (3, 32)  # the model asserts T <= block_size (32): a guard
    assert {str(sym) for sym in rep.peak.free_symbols} == {"b", "s"}
    assert rep.at(4) == rep.peak_bytes == _direct(gpt, 4, 32).peak_bytes
    for b, s in [(2, 8), (3, 16), (6, 24)]:
        assert rep.at(b, s) == _direct(gpt, b, s).peak_bytes  # exact: the same ops, other sizes


def test_attention_scores_make_it_quadratic_in_s(gpt):
    rep = gpt[3]
    activations = rep.breakdown_formula[estimator.Category.ACTIVATION]
    # CPU math attention keeps three fp32 s x s tensors per layer and head for backward (the
    # softmax output, dropout's noise, the dropped probabilities): 2 layers x 4 heads x 3 x 4 B.
    assert activations.has_s and (1, 2, 96) in activations.mixed  # the term 96*b*s**2
    assert rep.breakdown[estimator.Category.ACTIVATION] == activations(4, 32)


def test_max_seq_and_max_batch_at_a_length_invert_the_formula(gpt):
    rep = gpt[3]
    budget = rep.at(2, 20)
    assert rep.max_seq(budget, b=2) == 20  # at(2, s) grows with s
    assert rep.max_seq(10 * budget, b=2) == 32  # capped by the guard T <= 32
    m = rep.max_batch(budget, s=16)
    assert rep.at(m, 16) <= budget < rep.at(m + 1, 16)
    assert rep.max_seq(1) == 0
    assert rep.fits(budget, b=2, s=20) and not rep.fits(budget, b=2, s=21)
    with pytest.raises(InputError, match="s <= 32"):
        rep.at(2, 64)


def test_json_and_markdown_carry_both_symbols(gpt):
    rep = gpt[3]
    data = json.loads(rep.to_json())
    assert data["seq"] == 32 and data["symbols"] == ["b", "s"]
    acts = data["breakdown_coefficients"][estimator.Category.ACTIVATION.value]
    assert [1, 2, 96] in acts["b_s"]  # 96 * b**1 * s**2
    assert "peak(b, s)" in rep.to_markdown() and "3 ≤ s ≤ 32" in rep.to_markdown()


def test_cuda_target_replays_at_another_length():
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
    tokens = torch.randint(0, 100, (4, 24))
    rep = estimator.report(model, tokens, device="cuda", gpu="H100", dynamic={1: "s"})
    direct = estimator.report(model, tokens[:, :16], device="cuda", gpu="H100")
    assert rep.seq == 24 and rep.on_device(4, 16) == direct.cuda


def test_cuda_fused_attention_keeps_s_fixed_with_a_note():
    # The CUDA attention rules round sequence lengths to kernel tiles: s stays the sample's.
    model, make_sample, loss_fn = models_zoo.get("gpt", "debug", device="meta")
    rep = estimator.report(model, make_sample(4), batch=4, loss_fn=loss_fn, device="cuda", gpu="H100",
                           dynamic={"input_ids": {1: "s"}})
    assert rep.seq is None and rep.path is estimator.CapturePath.SYMBOLIC
    assert any("could not stay a symbol" in n for n in rep.notes)


class FixedLength(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x.reshape(x.shape[0], 16, 8))  # the code fixes s = 16


def test_a_model_that_fixes_the_length_falls_back_to_b_only_with_a_note():
    rep = estimator.report(FixedLength(), torch.randn(2, 16, 8), dynamic={1: "s"}, optimizer="sgd", device="cpu")
    assert rep.seq is None
    assert any("could not stay a symbol" in n for n in rep.notes)
    assert rep.peak_bytes == estimator.report(FixedLength(), torch.randn(2, 16, 8), optimizer="sgd",
                                              device="cpu").peak_bytes


@pytest.mark.parametrize("dynamic,match", [
    ({"ids": {1: "s"}}, "does not have"),
    ({"input_ids": {2: "s"}}, "not a dim"),
    ({"input_ids": {1: "t"}}, "only 's'"),
    ({"input_ids": "s"}, "must map dims"),
    ([1], "non-empty dict"),
])
def test_bad_dynamic_specs_name_the_problem(dynamic, match):
    model, make_sample, loss_fn = models_zoo.get("gpt", "debug", device="meta")
    with pytest.raises(InputError, match=match):
        estimator.report(model, make_sample(2), loss_fn=loss_fn, dynamic=dynamic, device="cpu")


def test_dims_named_s_must_agree_and_max_seq_needs_s():
    with pytest.raises(InputError, match="one size"):
        estimator.report(nn.Bilinear(4, 4, 2), (torch.randn(2, 3, 4), torch.randn(2, 5, 4)),
                         dynamic={0: {1: "s"}, 1: {1: "s"}}, device="cpu")
    rep = estimator.report(nn.Linear(4, 4), torch.randn(2, 4), optimizer="sgd", device="cpu")
    with pytest.raises(InputError, match="dynamic="):
        rep.max_seq("1GiB")
    with pytest.raises(InputError, match="not in s"):
        rep.at(2, 8)
