"""``estimator.compare`` and ``estimator.plan``: rows, captures shared, ranking, bad input."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import estimator
from estimator import InputError, Strategy, planning

PARAMS = 4 * (64 * 64 + 64) * 4  # 4 x Linear(64, 64), fp32: 66_560 B


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def test_compare_rows_against_single_device_reports():
    model, x = Net(), torch.randn(8, 64)
    strategies = {"ddp": Strategy(data_parallel=2), "zero1": Strategy(data_parallel=2, sharding="zero1"),
                  "ckpt": Strategy(checkpoint=nn.Linear)}
    result = estimator.compare(model, x, 8, strategies, budget="2MiB", device="cpu")
    assert [r.label for r in result.rows] == ["single device", "ddp", "zero1", "ckpt"]
    single = estimator.report(model, x, batch=8, device="cpu")
    base = result["single device"]
    assert base.peak_bytes == single.peak_bytes and base.saving == 0 and base.max_batch == single.max_batch("2MiB")
    ddp = result["ddp"]
    assert ddp.peak_bytes == single.peak_bytes + PARAMS  # one bucket of every gradient
    assert ddp.saving == pytest.approx(-PARAMS / single.peak_bytes)
    assert ddp.samples_per_step == 16 and ddp.devices == 2
    # ring all-reduce of the gradients: 2 * (n-1)/n * 66_560 B = 66_560 B per device
    assert ddp.communication_bytes == PARAMS
    assert result["zero1"].communication_bytes == 3 * PARAMS // 2  # + the parameter broadcast
    # 2 stages x DDP 2: each stage all-reduces its half of the gradients, 2 * 1/2 * PARAMS / 2 B
    assert planning.communication_bytes(model, Strategy(pipeline=2, data_parallel=2)) == PARAMS // 2
    assert result["ckpt"].peak_bytes == estimator.report(model, x, batch=8, strategy=strategies["ckpt"],
                                                         device="cpu").peak_bytes
    assert "recomputes" in result["ckpt"].cost
    assert "zero1" in str(result) and result.to_dict()["rows"][1]["label"] == "ddp"
    with pytest.raises(KeyError, match="no strategy 'nope'"):
        result["nope"]


def test_compare_captures_each_step_once(captures):
    model, x = Net(), torch.randn(8, 64)
    result = estimator.compare(model, x, 8, devices=4, device="cpu", workers=1)  # every capture here, counted
    # the default ten: single, bf16, compiled, checkpoint Linear, DDP, ZeRO-1/2/3, pipeline x4 (1F1B),
    # pipeline x2 x DDP 2 -> four captures: the plain step (shared by DDP, ZeRO and both pipelines: their
    # micro-batch is b / 4), bf16, compiled, checkpointing;
    # then the low-bit AdamW and QLoRA what-ifs whose libraries are installed, one capture each
    low_bit, _ = planning.default_optimizers("adamw")
    weights, _ = planning.default_weights(model)
    assert [r.label for r in result.rows] == [
        "single device", "AMP bf16", "compiled", "checkpoint Linear", "DDP x4", "ZeRO-1 x4", "ZeRO-2 x4",
        "ZeRO-3 x4", "pipeline x4 (1F1B)", "pipeline x2 x DDP 2 (1F1B)", *low_bit, *weights]
    assert len(captures) == 4 + len(low_bit) + len(weights)
    assert result["compiled"].cost.startswith("compiles at the first step")


def test_compare_offers_qlora(monkeypatch):
    """The QLoRA what-if is the same step on a meta copy of the model whose linears are NF4
    ``Linear4bit`` s (frozen) with PEFT's LoRA adapters (r = 8) the only trainable parameters;
    the user's model is left as it was; without PEFT it is named among the skipped."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    import bitsandbytes as bnb

    model, x = Net(), torch.randn(8, 64)
    transformed = planning.qlora(model)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    base = [m for m in transformed.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(base) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(m.weight.quant_state.nested and m.weight.quant_type == "nf4" for m in base)
    trainable = {n for n, p in transformed.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    result = estimator.compare(model, x, 8, [Strategy()], weights={"QLoRA": planning.qlora}, device="cpu")
    row = result["QLoRA"]
    assert row.report.trainable_params == sum(p.numel() for p in transformed.parameters() if p.requires_grad)
    assert row.peak_bytes < result["single device"].peak_bytes and row.cost == planning.WEIGHTS_COST
    conv = nn.Sequential(nn.Conv2d(3, 64, 3), nn.Flatten(), nn.Linear(64, 2))  # 1,792 + 130 parameters
    assert planning.default_weights(conv) == ({}, [f"{planning.QLORA}: its linear layers hold 7% of the parameters "
                                                   "(weights={...} asks for it)"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else
                        real_find_spec(name, *a))
    assert planning.default_weights(model) == ({}, [f"{planning.QLORA}: peft not installed (pip install peft)"])
    assert planning.default_weights(model, "inference") == ({}, [])


def test_compare_offers_low_bit_optimizers(monkeypatch):
    """An optimizer what-if is the report of the same step with that optimizer (one capture of its
    own); the default is bitsandbytes' 8-bit AdamW where it is installed, else it is named among
    the skipped."""
    pytest.importorskip("bitsandbytes")
    model, x = Net(), torch.randn(8, 64)
    result = estimator.compare(model, x, 8, [Strategy()], optimizers={"8-bit": "adamw8bit"}, device="cpu")
    assert [r.label for r in result.rows] == ["single device", "8-bit"]
    row = result["8-bit"]
    assert row.peak_bytes == estimator.report(model, x, optimizer="adamw8bit", device="cpu").peak_bytes
    assert row.optimizer == "adamw8bit" and "bitsandbytes" in row.cost and row.strategy == Strategy()
    assert result.to_dict()["rows"][1]["optimizer"] == "adamw8bit"
    import importlib.util

    real = importlib.util.find_spec
    assert list(planning.default_optimizers("adamw")[0]) == ["8-bit AdamW (bitsandbytes)"]
    if real("torchao") is not None:  # on a GPU, AdamW stepped on the CPU too (its constructor asserts a GPU)
        assert planning.default_optimizers("adamw", device="cuda")[0] == {
            "8-bit AdamW (bitsandbytes)": "adamw8bit", "AdamW offloaded to the CPU (torchao)": "cpu_offload_adamw"}
        result = estimator.compare(model, x, 8, [Strategy()], optimizers={"offload": "cpu_offload_adamw"})
        assert result["offload"].peak_bytes == estimator.report(model, x, optimizer="cpu_offload_adamw").peak_bytes
        assert result["offload"].cost.startswith("steps on the CPU")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    found, skipped = planning.default_optimizers("adamw")
    assert found == {} and skipped == ["8-bit AdamW (bitsandbytes): bitsandbytes is not installed (pip install "
                                       "bitsandbytes)"]
    assert planning.default_optimizers("adamw", "inference") == ({}, [])
    assert planning.default_optimizers("sgd") == ({}, [])
    with pytest.raises(InputError, match="optimizers must be a dict"):
        estimator.compare(model, x, 8, [Strategy()], optimizers=["adamw8bit"], device="cpu")
    with pytest.raises(InputError, match="mode='inference' runs no optimizer"):
        estimator.compare(model, x, 8, [Strategy()], optimizers={"8-bit": "adamw8bit"}, mode="inference",
                          device="cpu")


def test_default_strategies_leave_out_what_cannot_apply():
    named, skipped = planning.default_strategies(nn.Linear(4, 4), 8, devices=2)
    assert "checkpoint" not in " ".join(named) and any("checkpointing" in s for s in skipped)
    assert any("pipeline: 0 blocks" in s for s in skipped)
    named, skipped = planning.default_strategies(Net(), 6, devices=4)
    assert any("b=6 does not split into 4" in s for s in skipped)
    named, _ = planning.default_strategies(Net(), 8, devices=1)
    assert list(named) == ["single device", "AMP bf16", "compiled", "checkpoint Linear"]


def test_plan_ranks_by_samples_per_step():
    model, x = Net(), torch.randn(8, 64)
    strategies = [Strategy(), Strategy(data_parallel=2), Strategy(data_parallel=2, sharding="zero1")]
    result = estimator.plan(model, x, "1MiB", devices=2, strategies=strategies, device="cpu")
    assert result.ranked
    per_step = [r.max_samples_per_step for r in result.rows]
    assert per_step == sorted(per_step, reverse=True)
    for r in result.rows:  # each row's max batch is its report's
        assert r.max_batch == r.report.max_batch("1MiB") > 0
    assert str(result).splitlines()[0].startswith("fxmem plan")


def test_plan_and_compare_default_to_the_gpu():
    # no device=, no gpu=: an H100 (85,045,477,376 B), whose memory is plan's budget
    model, x = Net(), torch.randn(8, 64)
    result = estimator.plan(model, x, strategies=[Strategy()])
    (row,) = result.rows
    assert result.budget == 85_045_477_376 and row.report.device == "cuda"
    # the largest b whose device memory fits the GPU (max_batch: bisection over allocator replays)
    assert row.report.on_device(row.max_batch).device <= result.budget < row.report.on_device(row.max_batch + 1).device
    lines = str(result).splitlines()
    assert lines[0] == ("fxmem plan: Net, b = 8, on NVIDIA H100 80GB HBM3 (default GPU: pass --gpu / gpu= for yours), "
                        "budget 79.20 GiB per device")
    assert lines[2].split()[:6] == ["#", "strategy", "devices", "allocated", "per", "device"]
    assert "reserved" in lines[2] and "device memory" in lines[2]
    compared = estimator.compare(model, x, strategies=[Strategy()], gpu="A100 80GB")
    assert str(compared).splitlines()[0] == "fxmem compare: Net, b = 8, on NVIDIA A100-SXM4-80GB"
    assert compared.rows[0].device_bytes == compared.rows[0].report.device_bytes > compared.rows[0].peak_bytes


def test_plan_and_compare_bad_input():
    model, x = Net(), torch.randn(8, 64)
    with pytest.raises(InputError, match="no strategy fits"):
        estimator.plan(model, x, "10KiB", devices=2, strategies=[Strategy(), Strategy(data_parallel=2)], device="cpu")
    with pytest.raises(InputError, match="needs a budget per device .* with device='cpu'; on a GPU"):
        estimator.plan(model, x, device="cpu")
    with pytest.raises(InputError, match="devices must be a positive int"):
        estimator.compare(model, x, devices=0, device="cpu")
    with pytest.raises(InputError, match="estimator.Strategy objects"):
        estimator.compare(model, x, strategies=["ddp"], device="cpu")


def test_master_weights_is_a_capture_of_its_own():
    # the optimizer behind fp32 master weights changes the captured step: not shared with the
    # baseline's capture.  Parameters: 4 x (64 x 64 + 64) bf16 = 33_280 B.  Baseline AdamW state:
    # 2 x 33_280 (bf16); with masters: fp32 copies 66_560 + fp32 AdamW state 2 x 66_560: the
    # difference is 66_560 + 66_560 = 4 x 33_280 (the step counters are the same).
    model, x = Net().to(torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    result = estimator.compare(model, x, 8, {"master": Strategy(master_weights=True)}, device="cpu")
    base, master = result["single device"].report, result["master"].report
    assert master.breakdown[estimator.Category.OPTIMIZER_STATE] - base.breakdown[estimator.Category.OPTIMIZER_STATE] \
        == 4 * 33_280


def test_max_batch_of_a_report_whose_batch_lies_outside_its_formula():
    # A pipeline of 4 micro-batches at b = 4: one row per micro-batch, under the formula's range
    # (b >= 8, the micro-batch's 2 rows): the report at b = 4 is a capture of its own, and
    # max_batch (what compare and plan ask every row) answers from the formula instead of refusing.
    import models_zoo

    model, make_sample, loss_fn = models_zoo.get("gpt")
    rep = estimator.report(model, make_sample(4), loss_fn=loss_fn, strategy=Strategy(pipeline=2, microbatches=4))
    assert rep.batch_outside_range and rep.valid_from == 8
    assert rep.max_batch("1GiB") == rep.valid_to  # 384: the formula's guards end it there
