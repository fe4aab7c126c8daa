"""``report(depth_symbols=True)``: the peak in ``b`` and the number of blocks ``L``
(``estimator/orchestrate/depth_formula.py``), exact against the reports of models built with
other depths, on both targets, with a period and with a head of blocks of their own."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import estimator
from estimator.reporting.depth import L
from estimator.vocab.errors import CaptureError, InputError
from estimator.vocab.symbolic import B

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256)


def _llm(family: str, layers: int) -> nn.Module:
    torch.manual_seed(0)
    config = {"llama": transformers.LlamaConfig, "gemma2": transformers.Gemma2Config,
              "qwen2_moe": transformers.Qwen2MoeConfig}[family]
    extra = {"gemma2": dict(head_dim=16, sliding_window=8),  # alternating sliding / global layers
             "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,  # a dense first layer
                               shared_expert_intermediate_size=32, mlp_only_layers=[0])}.get(family, {})
    return transformers.AutoModelForCausalLM.from_config(config(num_hidden_layers=layers, **SMALL, **extra))


def _tokens(b: int = 2) -> dict:
    ids = torch.randint(0, 256, (b, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _loss(out, sample):
    return out.loss


def _formula_at(rep, b: int) -> int:
    """The report's own peak formula at ``b`` (on the CUDA target ``Report.at`` is the device's figure)."""
    return int(rep.peak.subs(B, b))


def test_llama_train_cpu_exact_at_other_depths():
    rep = estimator.report(_llm("llama", 8), _tokens(), batch=2, loss_fn=_loss, device="cpu", depth_symbols=True)
    depth = rep.depth_formula
    assert (depth.path, depth.blocks, depth.head, depth.period, depth.blocks_from) == ("model.layers", 8, 0, 1, 6)
    assert depth.peak.free_symbols == {B, L}
    for b in (2, 5):
        assert depth.at(b, 8) == _formula_at(rep, b)
    for layers in (6, 11):
        other = estimator.report(_llm("llama", layers), _tokens(), batch=2, loss_fn=_loss, device="cpu")
        assert [depth.at(b, layers) for b in (2, 5)] == [_formula_at(other, b) for b in (2, 5)]


def test_llama_cuda_inference_exact():
    rep = estimator.report(_llm("llama", 8), _tokens(), batch=2, device="cuda", mode="inference", depth_symbols=True)
    depth = rep.depth_formula
    assert any(note.startswith("checked one unit deeper") for note in depth.notes)
    other = estimator.report(_llm("llama", 10), _tokens(), batch=2, device="cuda", mode="inference")
    assert [depth.at(b, 10) for b in (2, 3)] == [_formula_at(other, b) for b in (2, 3)]


def test_the_deeper_config_keeps_what_is_set_after_its_fields():
    """The model one unit deeper gets a copy of the config with its depth and per-block lists one
    unit longer and every other attribute kept: transformers sets the attention and experts
    implementations after the config's fields (``_attn_implementation_internal``), which a config
    rebuilt from its fields (``dataclasses.replace``) lost; Qwen2-MoE's model-level masks then
    followed another implementation than its blocks' and the check refused its formula."""
    rep = estimator.report(_llm("qwen2_moe", 8), _tokens(), batch=2, loss_fn=_loss, device="cuda",
                           depth_symbols=True)
    depth = rep.depth_formula
    assert (depth.head, depth.period) == (1, 1)
    assert any(note.startswith("checked one unit deeper") for note in depth.notes)
    other = estimator.report(_llm("qwen2_moe", 11), _tokens(), batch=2, loss_fn=_loss, device="cuda")
    assert [depth.at(b, 11) for b in (2, 5)] == [_formula_at(other, b) for b in (2, 5)]


def test_code_outside_the_blocks_that_follows_the_depth_is_refused():
    # Gemma-2 (alternating sliding-window and global attention, units of 2 blocks) makes a scalar
    # per unit outside its blocks (8 B at its model level, kept to the end): built one unit deeper
    # from the 12-layer capture its step lacks it, so the formula would be 8 B a unit low.  The
    # model one unit deeper (its config saying 14 layers) runs it: refused, naming the op.
    refused = r"not the step of the model one unit deeper.*from op 8: aten.lift_fresh.default in model\)"
    with pytest.raises(CaptureError, match=refused):
        estimator.report(_llm("gemma2", 12), _tokens(), batch=2, device="cuda", mode="inference", depth_symbols=True)


class _Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        return self.proj(x)[..., :16]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Wide(_Block):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 96), nn.Linear(96, 16)


class _Net(nn.Module):
    """A first block of its own (a head of one), then ``units`` units of two blocks that
    alternate (a period of 2); no config: nothing names its depth outside the blocks."""

    def __init__(self, units: int):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Stem(), *(b for _ in range(units) for b in (_Block(), _Wide()))])
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _mse(out, x):
    return out.square().mean()


def test_period_and_head_count_in_depth():
    rep = estimator.report(_Net(7), torch.randn(4, 16), loss_fn=_mse, device="cpu", depth_symbols=True)
    depth = rep.depth_formula
    assert (depth.head, depth.period, depth.blocks, depth.blocks_from) == (1, 2, 15, 13)  # L counts the stem
    notes = " ".join(depth.notes)
    assert "of their own" in notes
    assert "not checked one unit deeper (no config of the model names its number of blocks" in notes
    for units in (6, 10):
        other = estimator.report(_Net(units), torch.randn(4, 16), loss_fn=_mse, device="cpu")
        assert [depth.at(b, 1 + 2 * units) for b in (4, 9)] == [other.at(b) for b in (4, 9)]
    with pytest.raises(InputError, match="every 2 blocks"):
        depth.at(4, 16)


def test_renderings():
    rep = estimator.report(_Net(7), torch.randn(4, 16), loss_fn=_mse, device="cpu", depth_symbols=True)
    depth = rep.depth_formula
    markdown = rep.to_markdown()
    assert "**In terms of depth** (L = blocks of `blocks`, 15 in the model; valid for L ≥ 13 (every 2)" in markdown
    assert f"| 15 | {depth.at(4, 15):,} |" in markdown  # the model's own depth, at the report's batch
    assert r"\mathrm{peak}(b, L)" in rep.to_latex()
    data = json.loads(rep.to_json())["depth_formula"]
    assert (data["symbols"], data["head"], data["period"], data["blocks_from"]) == (["b", "L"], 1, 2, 13)

    def value(coefficients: list[int], b: int) -> int:
        return sum(c * b**i for i, c in enumerate(coefficients))

    # each piece: fixed + units * per_unit, units = (L - head) / period, exact integer coefficients
    assert max(value(p["fixed"], 4) + 7 * value(p["per_unit"], 4) for p in data["pieces"]) == depth.at(4, 15)


def test_refusals():
    with pytest.raises(CaptureError, match="not built from a capture of a few"):
        estimator.report(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4), device="cpu",
                         depth_symbols=True)
    with pytest.raises(InputError, match="mode='generate'"):
        estimator.report(_llm("llama", 8), {"input_ids": _tokens()["input_ids"]}, mode="generate", new_tokens=2,
                         device="cpu", depth_symbols=True)
    with pytest.raises(InputError, match="one device's step"):
        estimator.report(_Net(7), torch.randn(4, 16), loss_fn=_mse, device="cpu", depth_symbols=True,
                         strategy=estimator.Strategy(data_parallel=2))
    with pytest.raises(InputError, match="depth_symbols must be True or False"):
        estimator.report(_Net(7), torch.randn(4, 16), loss_fn=_mse, device="cpu", depth_symbols="yes")
    depth = estimator.report(_Net(7), torch.randn(4, 16), loss_fn=_mse, device="cpu", depth_symbols=True).depth_formula
    with pytest.raises(InputError, match="holds for 13 blocks of blocks or more"):
        depth.at(4, 11)


def test_command_line(tmp_path):
    from click.testing import CliRunner

    from estimator.cli import cli

    (tmp_path / "deep.py").write_text(
        "import dataclasses, models_zoo\n"
        "def make():\n"
        "    cfg = dataclasses.replace(models_zoo.llama.SIZES['debug'], n_layers=8)\n"
        "    model, make_sample, loss_fn = models_zoo.llama.make(cfg)\n"
        "    return model, make_sample(4), loss_fn\n")
    model = f"{tmp_path / 'deep.py'}:make"
    formula = CliRunner().invoke(cli, ["formula", model, "--device", "cpu", "--depth-symbols", "-q"])
    assert formula.exit_code == 0, formula.output
    # the peak in b, then in b and L (the README's model: 8 blocks of 8 from a capture of 5)
    assert formula.output.splitlines()[1] == ("Max(172800*L*b + 554532*L + 69888*b + 279572, "
                                              "172800*L*b + 554532*L + 88960*b + 201492)    # L = blocks of layers")
    report = CliRunner().invoke(cli, ["report", model, "--device", "cpu", "--depth-symbols", "-q"])
    assert "**In terms of depth** (L = blocks of `layers`, 8 in the model" in report.output
    assert "| 8 | 10,524,980 |" in report.output
