"""Hugging Face ``Trainer``'s own step (``integrations.trainer.trainer_step``) against a real
``transformers.Trainer`` run on CPU.

A tiny GPT-2 (2 layers, width 64, built from its config: nothing is downloaded) trains for two
optimizer steps under the real ``Trainer`` (accelerate's dataloader, AdamW in two weight-decay
groups, the gradient norm and clipping, the linear scheduler);
``validators.trainer.measure_trainer`` measures the second step with the CPU allocator's
profiler events, the bytes alive at its start measured too.  fxmem predicts it with
``estimator.report(model, batch, step=trainer_step(), optimizer=trainer_optimizer())``.

Tolerance: 0.5 % (the zoo's) for the raw peak.  What the real run holds besides the step is
known: the next batch, which accelerate's ``DataLoaderShard`` has already fetched (one collated
batch, on the host).  With it added the prediction is exact to the byte at b = 1, and 48 B under
at b = 4, s = 32, where the peak falls while GPT-2's GELU still holds the three Python numbers
it multiplies by (8-byte double tensors autograd saves for backward, which fxmem counts as the
``mul``'s scratch only): ``ZERO_DIM_SLACK`` allows for such 0-dim tensors.
"""

from __future__ import annotations

import pytest
import torch
from trainer_cases import S, batch_of, dataset, gpt2, needs_trainer

import estimator
from estimator import InputError

TOLERANCE = 0.005  # 0.5 %, as tests/test_validation.py
ZERO_DIM_SLACK = 64  # bytes: a few 0-dim tensors (wrapped Python numbers, scalars)
B = 4


_REPORTS: dict[tuple, estimator.Report] = {}


def predict(b: int, seq: int, optim: str | None = None, max_grad_norm: float | None = 1.0) -> estimator.Report:
    """fxmem's prediction of Trainer's step on the first ``b`` rows of ``dataset(3 * b, seq)``
    (computed once per configuration)."""
    from estimator.integrations.trainer import trainer_optimizer, trainer_step

    key = (b, seq, optim, max_grad_norm)
    if key not in _REPORTS:
        _REPORTS[key] = estimator.report(gpt2(), batch_of(dataset(3 * b, seq), b), step=trainer_step(max_grad_norm),
                                         optimizer=trainer_optimizer(optim), device="cpu")
    return _REPORTS[key]


# (b, s, TrainingArguments.optim, max_grad_norm): Trainer's defaults (fused AdamW, clipping at
# 1.0), and the for-loop AdamW without clipping (the norm is still computed) at b = 1.
CASES = [(B, S, None, 1.0), (1, 4, "adamw_torch", 0.0)]


@pytest.mark.parametrize(("b", "seq", "optim", "max_grad_norm"), CASES)
def test_trainer_step_matches_a_real_trainer(tmp_path, b, seq, optim, max_grad_norm):
    needs_trainer()
    from validators.trainer import measure_trainer

    rows = dataset(3 * b, seq)  # 3 batches: the measured 2nd step is not its epoch's last
    args = {"max_grad_norm": max_grad_norm, **({"optim": optim} if optim else {})}
    measured = measure_trainer(gpt2(), rows, output_dir=str(tmp_path), batch_size=b, step=2, **args)
    m, rep = measured.measurement, predict(b, seq, optim, max_grad_norm)
    error = (rep.peak_bytes - m.peak_bytes) / m.peak_bytes
    assert abs(error) <= TOLERANCE, f"predicted {rep.peak_bytes:,} B, measured {m.peak_bytes:,} B ({error:+.3%})"

    # The prediction lacks exactly the batch the dataloader holds ahead (input_ids and labels, int64).
    assert measured.batch_bytes == 2 * b * seq * 8
    gap = m.peak_bytes - (rep.peak_bytes + measured.batch_bytes)
    assert 0 <= gap <= ZERO_DIM_SLACK, (f"measured {m.peak_bytes:,} B = predicted {rep.peak_bytes:,} + batch "
                                        f"{measured.batch_bytes:,} + {gap:,} B")
    # The state before the step, listed: parameters, the batch, AdamW's two moments and step
    # counters, Trainer's _tr_loss and the previous step's loss and norm (0-dim fp32 each).  The
    # real run also holds the next batch, and num_items_in_batch (4 B, made before the step
    # starts; fxmem counts it inside the step).
    model = gpt2()
    params = sum(p.numel() * 4 for p in model.parameters())
    optimizer_state = 2 * params + 4 * len(list(model.parameters())) + 3 * 4
    assert rep.breakdown[estimator.Category.OPTIMIZER_STATE] == optimizer_state
    assert m.baseline_bytes == params + 2 * measured.batch_bytes + optimizer_state + 4


def test_clipping_and_the_built_in_step():
    """What ``trainer_step`` adds to the built-in ``keep_output=False`` step.  At this size the
    peak is in backward (the logits' log-softmax gradient): clipping has not started, and the
    norm it computes is a 0-dim tensor (the gradients are scaled in place), so the clipping
    itself does not move the peak.  The Trainer step holds a few 0-dim tensors more than the
    built-in one (its loss and norm kept between steps, ``_tr_loss``, ``num_items_in_batch``)."""
    needs_trainer()
    predicted = predict(B, S)
    dropped = estimator.report(gpt2(), batch_of(dataset(3 * B, S), B), keep_output=False, device="cpu")
    assert predicted.peak_piece.phase is estimator.Phase.BACKWARD
    assert predicted.peak_piece.op == dropped.peak_piece.op
    assert 0 < predicted.peak_bytes - dropped.peak_bytes <= ZERO_DIM_SLACK


def test_optimizer_is_trainers():
    """``trainer_optimizer()`` builds what ``Trainer.create_optimizer`` does: its class and
    keywords for the default ``optim`` and the same weight-decay split (checked against
    Trainer's own methods, for GPT-2 and for BERT's ``LayerNorm`` modules)."""
    needs_trainer()
    from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

    from estimator.integrations.trainer import TrainerLoop, _decay_parameter_names, trainer_optimizer

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    loop = trainer_optimizer()(gpt2())
    assert isinstance(loop, TrainerLoop) and type(loop.optimizer) is cls
    assert {k: loop.optimizer.defaults[k] for k in kwargs} == kwargs  # lr, betas, eps, fused=True
    assert [len(g["params"]) for g in loop.optimizer.param_groups] == [10, 18]  # matrices / biases, norms
    bert = BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                      num_attention_heads=2, vocab_size=128))
    for model in (gpt2(), bert):
        assert _decay_parameter_names(model) == Trainer.get_decay_parameter_names(None, model)
    with_args = trainer_optimizer(args=args)(gpt2())
    assert type(with_args.optimizer) is cls and with_args.optimizer.defaults["fused"] is True


def test_the_clip_is_accelerates():
    """Without ``torch.distributed`` accelerate clips with ``clip_grad_norm_``; with it (here),
    ``get_total_norm``, a ``stack`` of one norm and its 2-norm, then ``clip_grads_with_norm_``:
    the same gradients and norm."""
    needs_trainer()
    from estimator.integrations.trainer import _clip_grad_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(t) for t in (torch.randn(5, 3), torch.randn(7), torch.ones(2))]
    for p in params[:2]:
        p.grad = torch.randn_like(p) * 3
    expected = [p.grad.clone() for p in params[:2]]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params[:2]]
    for c, g in zip(copies, expected):
        c.grad = g.clone()
    reference = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    total = torch.nn.utils.get_total_norm(expected)
    norm = _clip_grad_norm(params, 1.0)
    assert torch.allclose(norm, total) and torch.allclose(norm, reference)
    for p, c, g in zip(params, copies, expected):
        assert torch.allclose(p.grad, g * (1.0 / (total + 1e-6))) and torch.allclose(p.grad, c.grad)
    assert params[2].grad is None


def test_bad_input():
    needs_trainer()
    from transformers import TrainingArguments

    from estimator.integrations.trainer import trainer_optimizer, trainer_step

    with pytest.raises(InputError, match="max_grad_norm"):
        trainer_step("1.0")
    with pytest.raises(InputError, match="adamw_torch"):
        trainer_optimizer("adafactor")
    with pytest.raises(InputError, match="label_smoothing_factor=0.1"):
        trainer_step(args=TrainingArguments(output_dir="unused", label_smoothing_factor=0.1, use_cpu=True))
    with pytest.raises(InputError, match="TrainingArguments"):
        trainer_optimizer(args=["adamw_torch"])
    batch = batch_of(dataset(2), 2)
    with pytest.raises(InputError, match="dict of tensors"):
        estimator.report(gpt2(), (batch["input_ids"],), step=trainer_step(), optimizer=trainer_optimizer(),
                         device="cpu")
    with pytest.raises(InputError, match="mode='train'"):
        estimator.report(gpt2(), batch, step=trainer_step(), mode="inference", device="cpu")
    with pytest.raises(InputError, match="no loss"):
        estimator.report(gpt2(), {"input_ids": batch["input_ids"]}, step=trainer_step(),
                         optimizer=trainer_optimizer(), device="cpu")
