"""Single-process strategies: gradient accumulation and activation checkpointing, exact against
the CPU allocator (``validators.cpu.measure_cpu`` runs the same ``estimator.capture.steps`` code).

Gradient accumulation over ``k`` micro-batches (``Strategy(accumulate=k)``), ``b`` the batch of
one optimizer step, ``m = b / k`` the micro-batch::

    for micro in sample.split(m):            # views: the full input (b rows) stays alive
        out = model(micro); loss = loss_fn(out, micro) / k
        loss.backward()                      # from the 2nd on: new grads are added into .grad
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

Reference: ``nn.Linear(16, 4)``, SGD, default loss ``out.mean()``, k = 2 (fp32, 4 B):

    k = 1 (tests/test_exact.py): 272 + 64b + 16b + 4 + 4 + 16b + 256 + 16       = 96b + 552
    k = 2, peak at the bias-gradient ``sum`` of the 2nd micro-step's backward:
        parameters 272, input 64b (the full batch)
        gradients of micro-step 1, kept for accumulation                          272
        out2 (m, 4) = 16m = 8b, and loss2 = mean / 2 (4 B)                        8b + 4
        backward: one 4-byte scalar gradient, MeanBackward's grad (m, 4) = 8b,
                  the new grad_W 256 and grad_b 16 (added into .grad right after)  8b + 276
        total = 272 + 64b + 272 + 8b + 4 + 8b + 276                               = 80b + 824
    The activations halve (16b -> 8b, twice), but a second set of gradients (272 B) is alive.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import estimator
import models_zoo
from estimator import Category, InputError
from estimator.capture.checkpointing import checkpointing
from estimator.vocab.strategy import Strategy
from models_zoo.gpt import Block
from validators.cpu import measure_cpu


def linear():
    return nn.Linear(16, 4)


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def gpt():
    torch.manual_seed(0)
    return models_zoo.get("gpt", "debug")


@functools.cache
def gpt_report(strategy: Strategy, b: int):
    model, make_sample, loss_fn = gpt()
    return estimator.report(model, make_sample(b), loss_fn=loss_fn, strategy=strategy, device="cpu")


def gpt_measured(strategy: Strategy, b: int) -> int:
    model, make_sample, loss_fn = gpt()
    return measure_cpu(model, make_sample(b), loss_fn=loss_fn, strategy=strategy).peak_bytes


# --------------------------------------------------------------------------------------------
# Gradient accumulation


def test_linear_accumulate_by_hand():
    rep = estimator.report(linear(), torch.randn(8, 16), optimizer="sgd", strategy=Strategy(accumulate=2), device="cpu")
    assert rep.peak == 80 * estimator.B + 824
    assert rep.peak_piece.op == "aten.sum.dim_IntList" and rep.peak_piece.phase is estimator.Phase.BACKWARD
    # at b = 8 (m = 4): activations 8b + 4 = 68; temporaries 8b + 276 = 340
    assert rep.breakdown[Category.ACTIVATION] == 68
    assert rep.breakdown[Category.TEMPORARY] == 340
    assert rep.breakdown[Category.GRADIENT] == 272
    assert rep.valid_from == 4  # micro-batches of at least 2 rows
    for b in (8, 12, 24):
        measured = measure_cpu(linear(), torch.randn(b, 16), optimizer="sgd", strategy=Strategy(accumulate=2))
        assert rep.at(b) == measured.peak_bytes == 80 * b + 824


@pytest.mark.parametrize("k,formula", [
    # AdamW; the non-dominated pieces are in b with integer coefficients (m = b / k)
    (1, (96, 17056, 480, 10776)),
    (2, (80, 17056, 272, 12952)),
    (4, (72, 17056, 168, 12952)),
])
def test_mlp_accumulate(k, formula):
    rep = estimator.report(mlp(), torch.randn(8, 16), strategy=Strategy(accumulate=k), device="cpu")
    a, c, d, e = formula
    assert (a * estimator.B + c) in rep.peak.args or rep.peak == a * estimator.B + c
    assert (d * estimator.B + e) in rep.peak.args
    for b in (8, 16):
        assert rep.at(b) == measure_cpu(mlp(), torch.randn(b, 16), strategy=Strategy(accumulate=k)).peak_bytes


@pytest.mark.parametrize("k,b", [(2, 4), (4, 8)])
def test_gpt_accumulate(k, b):
    rep = gpt_report(Strategy(accumulate=k), b)
    assert rep.peak_bytes == gpt_measured(Strategy(accumulate=k), b)
    # b = 4: k = 1 measures 3,263,608 B; k = 2 2,784,888 B (activations of 2 rows, not 4)
    if k == 2:
        assert rep.peak_bytes == 2_784_888 < gpt_report(Strategy(), b).peak_bytes == 3_263_608


# --------------------------------------------------------------------------------------------
# Activation checkpointing


@pytest.mark.parametrize("reentrant", [False, True])
def test_gpt_checkpoint_blocks(reentrant):
    strategy = Strategy(checkpoint=Block, checkpoint_reentrant=reentrant)
    rep, plain = gpt_report(strategy, 4), gpt_report(Strategy(), 4)
    assert rep.peak_bytes == gpt_measured(strategy, 4)
    # Only the blocks' inputs (and a 5,056-B CPU RNG state per block) are saved for backward.
    assert rep.peak_bytes < plain.peak_bytes
    assert rep.breakdown[Category.ACTIVATION] < plain.breakdown[Category.ACTIVATION]
    slope = lambda r: max(p.bytes.coeff(1) for p in r.pieces)
    assert slope(rep) < slope(plain)  # 271,104 (279,296 reentrant) vs 483,328 B per sample


def test_gpt_accumulate_and_checkpoint():
    strategy = Strategy(accumulate=2, checkpoint=Block)
    rep = gpt_report(strategy, 4)
    assert rep.peak_bytes == gpt_measured(strategy, 4) == 2_416_888
    assert rep.peak_bytes < gpt_report(Strategy(accumulate=2), 4).peak_bytes


def test_checkpoint_selection():
    model, _, _ = gpt()
    by_glob = Strategy(checkpoint="transformer.h.*").checkpointed(model)
    assert [p for p, _ in by_glob] == ["transformer.h.0", "transformer.h.1"]  # outermost matches only
    assert [p for p, _ in Strategy(checkpoint=Block).checkpointed(model)] == [p for p, _ in by_glob]
    assert [p for p, _ in Strategy(checkpoint=("transformer.h.1",)).checkpointed(model)] == ["transformer.h.1"]
    forward = Block.forward
    with checkpointing(model, Strategy(checkpoint=Block)):
        assert "forward" in vars(model.transformer.h[0])
    assert "forward" not in vars(model.transformer.h[0]) and Block.forward is forward


# --------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("kwargs,match", [
    ({"accumulate": 0}, "accumulate"),
    ({"accumulate": -2}, "accumulate"),
    ({"accumulate": 2.0}, "accumulate"),
    ({"accumulate": True}, "accumulate"),
    ({"checkpoint": 42}, "checkpoint"),
    ({"checkpoint": int}, "checkpoint"),
    ({"checkpoint": ()}, "checkpoint"),
    ({"checkpoint_reentrant": "yes"}, "checkpoint_reentrant"),
])
def test_bad_strategy(kwargs, match):
    with pytest.raises(InputError, match=match):
        Strategy(**kwargs)


def test_accumulate_must_divide_the_batch():
    with pytest.raises(InputError, match=r"accumulate=4.*multiple of 4, got b=6"):
        estimator.report(linear(), torch.randn(8, 16), batch=6, strategy=Strategy(accumulate=4), device="cpu")
    with pytest.raises(InputError, match="multiple of 3"):
        estimator.report(linear(), torch.randn(8, 16), strategy=Strategy(accumulate=3), device="cpu")


def test_report_at_and_max_batch_with_accumulation():
    rep = estimator.report(linear(), torch.randn(8, 16), optimizer="sgd", strategy=Strategy(accumulate=4), device="cpu")
    with pytest.raises(InputError, match="multiple of 4, got b=6"):
        rep.at(6)
    with pytest.raises(InputError, match="multiple of 4"):
        rep.fits(10_000, b=10)
    # 72b + 824 <= 10_000 -> b <= 127 -> the largest multiple of 4 is 124
    assert rep.peak == 72 * estimator.B + 824
    assert rep.max_batch(10_000) == 124


def test_checkpoint_unknown_module():
    model, make_sample, loss_fn = gpt()
    with pytest.raises(InputError, match=r"no module 'transformer\.h\.9'; did you mean .*'transformer\.h\.0'"):
        estimator.report(model, make_sample(2), loss_fn=loss_fn, strategy=Strategy(checkpoint="transformer.h.9"),
                         device="cpu")
    with pytest.raises(InputError, match="no instance of it.*Block"):
        estimator.report(model, make_sample(2), loss_fn=loss_fn, strategy=Strategy(checkpoint=nn.Conv2d), device="cpu")


def test_strategy_needs_training():
    with pytest.raises(InputError, match="mode='train' only"):
        estimator.report(linear(), torch.randn(8, 16), mode="inference", strategy=Strategy(accumulate=2), device="cpu")
    with pytest.raises(InputError, match="estimator.vocab.strategy.Strategy"):
        estimator.report(linear(), torch.randn(8, 16), strategy={"accumulate": 2}, device="cpu")


@pytest.mark.parametrize("b", [9, 30])
def test_accumulate_not_dividing_per_sample_bytes(b):
    # k = 3: a micro-batch's output (m, 4) fp32 is 16m = 16b/3 bytes, not an integer polynomial
    # in b: its coefficient is rounded up to 6, so the formula is high by (6 - 16/3)·b = 2b/3
    # bytes per such tensor alive at the peak (the micro-batch input (m, 16) is a view of the
    # full batch: 64b, exact).
    strategy = Strategy(accumulate=3)
    rep = estimator.report(linear(), torch.randn(b, 16), optimizer="sgd", strategy=strategy, device="cpu")
    assert any("not a multiple of 3" in note and "16*b bytes" in note for note in rep.notes)
    measured = measure_cpu(linear(), torch.randn(b, 16), optimizer="sgd", strategy=strategy).peak_bytes
    assert 0 <= rep.peak_bytes - measured <= 2 * (2 * b // 3)


# --------------------------------------------------------------------------------------------
# Activation checkpointing with CPU autocast (bf16)
#
# The recomputation in backward re-enters ``torch.autocast`` (checkpoint.py records the autocast
# state); its weight casts are cached until the recomputation's outermost autocast exits.  The
# capture runs the same code on fake tensors and its timeline matches the allocator's op by op,
# to the byte, in both ``use_reentrant`` modes, with and without accumulation.
#
# The bf16 ``aten::mm``/``aten::addmm`` on CPU run oneDNN's brgemm matmul, whose scratchpad comes
# from the CPU allocator during the call (50,816 B for [128, 64] @ [64, 192], 165,632 B for
# [256, 128] @ [128, 64] on an avx512_bf16 host, 2 threads; a step function of the blocking oneDNN
# picks by ISA).  Those calls are measured on the host (estimator/corrections/cpu/matmul.py): the
# peak, inside a recomputed block's weight-gradient mm, is exact.  (Before: -1.7 to -2.7 %.)
@pytest.mark.parametrize("k,reentrant", [(1, False), (1, True), (2, False), (2, True)])
def test_gpt_checkpoint_with_amp_bf16(k, reentrant):
    strategy = Strategy(accumulate=k, checkpoint=Block, checkpoint_reentrant=reentrant, amp="bf16")
    assert gpt_report(strategy, 4).peak_bytes == gpt_measured(strategy, 4)


def test_fp32_master_weights_of_a_bf16_model():
    # bf16 parameters (220,672 B for the debug GPT); the optimizer keeps an fp32 master copy of
    # each (2 x 220,672 = 441,344 B) and AdamW's fp32 state of the masters (2 x 441,344 + 4 B per
    # step counter): optimizer state 441,344 + 882,800 = 1,324,144 B, exact against the run.
    strategy = Strategy(master_weights=True)
    model, make_sample, loss_fn = models_zoo.get("gpt", "debug", dtype=torch.bfloat16)
    rep = estimator.report(model, make_sample(4), batch=4, loss_fn=loss_fn, strategy=strategy, device="cpu")
    assert rep.breakdown[Category.PARAMETER] == 220_672
    assert rep.breakdown[Category.OPTIMIZER_STATE] == 441_344 + 2 * 441_344 + 4 * len(list(model.parameters()))
    model, make_sample, loss_fn = models_zoo.get("gpt", "debug", dtype=torch.bfloat16)
    assert rep.peak_bytes == measure_cpu(model, make_sample(4), loss_fn=loss_fn, strategy=strategy).peak_bytes
    with pytest.raises(InputError, match="low-precision parameters, but the model's are torch.float32"):
        estimator.report(linear(), torch.randn(4, 16), strategy=strategy, device="cpu")


@pytest.mark.parametrize("reentrant", [False, True])
def test_cuda_target_recomputes_with_the_cuda_kernels(reentrant):
    # The CUDA target substitutes attention (mem-efficient on an H100 for fp32 GPT-2-style
    # attention); the recomputation in backward must run the same substitute, or checkpoint
    # sees other saved tensors than the forward saved and raises.  Each of the 2 blocks' forward
    # attention runs once in forward and once more in backward (recomputed), then its backward.
    model, make_sample, loss_fn = gpt()
    rep = estimator.report(model, make_sample(8), batch=8, loss_fn=loss_fn, device="cuda", gpu="H100",
                           strategy=Strategy(checkpoint=Block, checkpoint_reentrant=reentrant))
    ops = [(op.phase.value, op.op) for op in rep.timeline.ops if "attention" in op.op]
    forward = "aten._scaled_dot_product_efficient_attention.default"
    assert ops.count(("forward", forward)) == 2 and ops.count(("backward", forward)) == 2
    assert ops.count(("backward", "aten._scaled_dot_product_efficient_attention_backward.default")) == 2
    plain = estimator.report(model, make_sample(8), batch=8, loss_fn=loss_fn, device="cuda", gpu="H100")
    assert rep.breakdown[Category.ACTIVATION] < plain.breakdown[Category.ACTIVATION]


@pytest.mark.parametrize("reentrant", [False, True])
def test_cuda_target_recomputes_under_autocast(reentrant):
    # Under amp on the CUDA target the substitutes see their arguments cast by CUDA's autocast
    # policy (corrections/cuda/autocast.py, a torch-function mode of its own): the recomputation
    # in backward must run inside that mode too.  It did not: transformers' Llama's bias-free
    # linear and attention then saw fp32 arguments in the recomputation, saved 38 tensors
    # against the forward's 40, and checkpoint raised.  Now each block's linears and attention
    # run the same substitutes in the forward and in the recomputation, on bf16 arguments.
    pytest.importorskip("transformers")
    from validators import generate

    model = generate.make_model("llama")
    sample = generate.make_sample(2, 16)
    sample = {**sample, "labels": sample["input_ids"]}
    strategy = Strategy(checkpoint=type(model.model.layers[0]), checkpoint_reentrant=reentrant)
    rep = estimator.report(model, sample, batch=2, loss_fn=lambda out, s: out.loss, device="cuda", gpu="H100",
                           amp="bf16", strategy=strategy)
    # cuDNN's attention on an H100 for bf16 (as sdp_utils picks it): 2 blocks, each forward, then recomputed
    runs = [op.phase.value for op in rep.timeline.ops if op.op == "aten._scaled_dot_product_cudnn_attention.default"]
    assert runs == ["forward"] * 2 + ["backward"] * 2
