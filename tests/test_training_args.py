"""``integrations.training_args.from_training_args``: Hugging Face ``TrainingArguments`` as users
write them, turned into the report of the optimizer step ``transformers.Trainer`` runs.

- The mapping (``training_settings``), exact: ``b`` = ``per_device_train_batch_size`` ×
  ``gradient_accumulation_steps`` with ``Strategy(accumulate=...)``, precision, checkpointing
  keywords, optimizer, FSDP / DDP over ``world_size`` devices; the optimizer state each modelled
  ``optim`` keeps, to the byte.
- The refusals: every setting fxmem does not model raises ``InputError`` naming the field.
- Validation against a real ``Trainer.train()`` on CPU (``validators.trainer.measure_trainer``,
  the second optimizer step, profiler events) with a tiny GPT-2 (2 layers, width 64, s = 32):
  micro-batches of 4, 2 accumulation steps, plain, with Trainer's activation checkpointing, with
  bf16 autocast, and a PEFT LoRA model.  Tolerance 0.5 % (the zoo's) on the raw peak; beyond it
  the gap is explained to the byte: the real run also holds the next micro-batch that
  accelerate's dataloader has fetched (2 × 4 × 32 int64 = 2,048 B).
"""

from __future__ import annotations

import json
import sys
import types

import pytest
from torch import nn
from trainer_cases import VOCAB, S, batch_of, config, dataset, gpt2, needs_trainer

import estimator
from estimator import InputError, Strategy

TOLERANCE = 0.005  # 0.5 %, as tests/test_validation.py
B, K = 4, 2  # micro-batch, accumulation steps


@pytest.fixture(autouse=True)
def _trainer():
    needs_trainer()


def lora():
    """The tiny GPT-2 wrapped by PEFT: the base frozen, rank-4 adapters on the attention and MLP
    projections trainable."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.1,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(gpt2(), config)


def settings(args, **kwargs):
    from estimator.integrations.trainer import training_settings

    return training_settings(args, **kwargs)


# -- the mapping ---------------------------------------------------------------------------------


def test_batch_accumulation_precision_and_checkpointing(tmp_path):
    # b = per_device_train_batch_size x gradient_accumulation_steps = 3 x 4 = 12, Strategy(accumulate=4)
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 3, "gradient_accumulation_steps": 4,
                                "bf16": True, "max_grad_norm": 0.5, "optim": "adafactor",
                                "activation_checkpointing": True,
                                "activation_checkpointing_kwargs": {"use_reentrant": True, "every_n_layers": 2}}))
    s = settings(str(path), device="cpu")
    assert (s.micro_batch, s.accumulate, s.batch) == (3, 4, 12)
    assert s.strategy == Strategy(accumulate=4)
    assert (s.amp, s.grad_scaler, s.max_grad_norm, s.optim) == ("bf16", False, 0.5, "adafactor")
    assert s.checkpointing == {"use_reentrant": True, "every_n_layers": 2}  # activation_checkpointing_enable's
    # The deprecated names are aliases; the defaults: fp32, fused AdamW, clipping at 1.0, no checkpointing.
    assert settings({"gradient_checkpointing": True}).checkpointing == {}
    d = settings({})
    assert (d.batch, d.amp, d.optim, d.max_grad_norm, d.checkpointing, d.use_cache) == \
        (8, None, "adamw_torch_fused", 1.0, None, False)
    # fp16: autocast + GradScaler on CUDA; on the CPU accelerate leaves it off (fp32, noted).
    cuda, cpu = settings({"fp16": True}, device="cuda"), settings({"fp16": True}, device="cpu")
    assert (cuda.amp, cuda.grad_scaler) == ("fp16", True)
    assert (cpu.amp, cpu.grad_scaler) == (None, False) and "fp32" in cpu.notes[0]
    from transformers import TrainingArguments

    as_object = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, use_cpu=True,
                                  report_to="none")
    assert settings(as_object).batch == 2


def test_devices():
    """FSDP2 (transformers' default FSDP) -> ZeRO-3 (``reshard_after_forward=True``, legacy
    ``full_shard``) or ZeRO-2 (``shard_grad_op``) over ``world_size`` devices; plain DDP otherwise."""
    assert settings({"fsdp": "full_shard auto_wrap"}, world_size=4).strategy == \
        Strategy(data_parallel=4, sharding="zero3")
    assert settings({"fsdp": True, "fsdp_config": {"reshard_after_forward": False},
                     "gradient_accumulation_steps": 2}, world_size=8).strategy == \
        Strategy(accumulate=2, data_parallel=8, sharding="zero2")
    assert settings({}, world_size=4).strategy == Strategy(data_parallel=4)


def test_torch_compile():
    """``torch_compile``: accelerate compiles the whole model -> ``Strategy(compile=)``."""
    assert settings({"torch_compile": True}).strategy == Strategy(compile=True)
    assert settings({"torch_compile_mode": "max-autotune"}).strategy == Strategy(compile="max-autotune")


@pytest.mark.parametrize("args, message", [
    ({"torch_compile": True, "torch_compile_backend": "eager"}, "torch_compile_backend='eager': not modelled"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1"),
    ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha=5.0"),
    ({"include_num_input_tokens_seen": True}, "include_num_input_tokens_seen='all'"),
    ({"optim": "lion_32bit"}, "optim='lion_32bit': not modelled by fxmem; it models adamw_torch"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}},
     r"ZeRO stage 2\).*Strategy\(data_parallel=N, sharding='zero2'\)"),
    ({"deepspeed": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}},
     "ZeRO stage 3 with offload"),
    ({"fsdp": "full_shard offload"}, "CPU offload"),
    ({"fsdp": True, "fsdp_config": {"version": 1}}, "FSDP1"),
    ({"fsdp": True, "fsdp_config": {"activation_checkpointing": True}}, "FSDP's own activation checkpointing"),
    ({"fsdp": True}, "world_size >= 2"),
    ({"activation_checkpointing": True, "activation_checkpointing_kwargs": {"offload": True}}, "offload"),
    ({"per_device_train_batch_sise": 4}, "no field 'per_device_train_batch_sise'.*per_device_train_batch_size"),
    (["per_device_train_batch_size"], "a dict of its fields"),
    ({"per_device_train_batch_size": "4"}, "per_device_train_batch_size='4': must be a positive int"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0: must be a positive int"),
    ("/no/such/args.json", "no such TrainingArguments file"),
])
def test_refused(args, message):
    with pytest.raises(InputError, match=message):
        settings(args)


def test_refused_by_from_training_args(monkeypatch):
    from estimator.integrations.training_args import from_training_args

    model = gpt2()
    with pytest.raises(InputError, match=r"4 devices.*Strategy\(accumulate=2.*data_parallel=4"):
        from_training_args(model, {"gradient_accumulation_steps": 2}, world_size=4, device="cpu")
    with pytest.raises(InputError, match="takes optimizer, strategy from the TrainingArguments"):
        from_training_args(model, {}, optimizer="adamw", strategy=Strategy(), device="cpu")
    # the low-bit optims need their library to import (any target: their CPU kernels are run too).
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(InputError, match="adamw_8bit' needs bitsandbytes"):
        settings({"optim": "adamw_8bit"}, device="cuda")
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(InputError, match="adamw_torch_4bit' needs torchao"):
        settings({"optim": "adamw_torch_4bit"}, device="cpu")
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    assert settings({"optim": "paged_adamw_8bit"}, device="cpu").optim == "paged_adamw_8bit"


def test_optimizer_state_to_the_byte():
    """What each ``optim`` keeps, as Trainer builds it, counted from the tiny GPT-2's 28 parameter
    tensors (136,960 elements; 2-D ones (rows, cols)), plus Trainer's own three 0-dim fp32 tensors
    (``_tr_loss``, the last loss and gradient norm: 12 B)."""
    from estimator.integrations.training_args import from_training_args

    params = list(gpt2().parameters())
    assert (len(params), sum(p.numel() for p in params)) == (28, 136_960)
    small = batch_of(dataset(2), 2)
    expected = {
        "sgd": 12,  # torch.optim.SGD without momentum: no state
        # transformers' Adafactor (scale_parameter=False, relative_step=False, beta1=None): factored
        # second moments, a row and a column vector per 2-D parameter, the full one for vectors, and
        # its RMS (a 0-dim fp32 tensor) for every parameter.
        "adafactor": sum(4 * (p.shape[0] + p.shape[1]) if p.dim() == 2 else 4 * p.numel() for p in params)
        + 4 * 28 + 12,
    }
    reports = {}
    for optim, state in expected.items():
        sample = None if optim == "sgd" else small  # None: transformers:NAME's sample, 2 rows of 64 tokens
        reports[optim] = from_training_args(gpt2(), {"per_device_train_batch_size": 2, "optim": optim}, sample,
                                            device="cpu")
        assert reports[optim].breakdown[estimator.Category.OPTIMIZER_STATE] == state, optim
    assert expected["adafactor"] == 18_300
    # The built sample's labels are their own int64 tensor, as a collator stacks them: 2 x (2, 64) x 8 B.
    assert reports["sgd"].breakdown[estimator.Category.INPUT] == 2 * 2 * 64 * 8



def test_bitsandbytes_8bit_state_on_cuda():
    """``adamw_8bit`` (bitsandbytes' 8-bit AdamW) on the CUDA target: its state as bitsandbytes
    makes it, captured: parameters of 4,096 elements or more keep two uint8 states and an fp32
    absmax per block of 256, smaller ones two fp32 states, and so do the embeddings, which
    Trainer's ``create_optimizer`` keeps 32-bit (a ``GlobalOptimManager`` override for each
    ``nn.Embedding``: without it the 32,768 + 4,096 elements of GPT-2's two were under-counted);
    the two 256-entry fp32 quantization maps are shared by every parameter (the CUDA kernel
    updates in place: nothing else)."""
    pytest.importorskip("bitsandbytes")
    from estimator.integrations.training_args import from_training_args

    model = gpt2()
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    blocks = lambda n: -(-n // 256)  # noqa: E731
    state = sum(2 * 4 * p.numel() if p.numel() < 4096 or id(p) in embeddings
                else 2 * p.numel() + 2 * 4 * blocks(p.numel()) for p in model.parameters()) + 2 * 256 * 4 + 12
    rep = from_training_args(model, {"per_device_train_batch_size": 2, "optim": "adamw_8bit"},
                             batch_of(dataset(2), 2), device="cuda")
    assert rep.breakdown[estimator.Category.OPTIMIZER_STATE] == state


# -- against a real Trainer.train() ----------------------------------------------------------------

_REPORTS: dict[str, estimator.Report] = {}

# name -> (the model, the TrainingArguments fields on top of batch 4 x accumulation 2)
CASES = {
    "plain": (gpt2, {}),
    "checkpointing": (gpt2, {"activation_checkpointing": True}),
    "bf16": (gpt2, {"bf16": True}),
    "lora": (lora, {}),
    # low-bit optimizers as Trainer builds them (transformers/trainer_optimizer.py): bitsandbytes' 8-bit
    # AdamW (its CPU kernel) and torchao's 4-bit AdamW (its compiled update); skipped without the library
    "adamw_bnb_8bit": (gpt2, {"optim": "adamw_bnb_8bit"}),
    "adamw_torch_4bit": (gpt2, {"optim": "adamw_torch_4bit"}),
}
_LIBRARY = {"adamw_bnb_8bit": "bitsandbytes", "adamw_torch_4bit": "torchao"}


def predict(case: str) -> estimator.Report:
    from estimator.integrations.training_args import from_training_args

    if case not in _REPORTS:
        make, extra = CASES[case]
        args = {"per_device_train_batch_size": B, "gradient_accumulation_steps": K, **extra}
        _REPORTS[case] = from_training_args(make(), args, batch_of(dataset(3 * B * K), B), device="cpu")
    return _REPORTS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_a_real_trainer(tmp_path, case):
    """Measured on CPU (``python -m validators.trainer`` prints the same rows): exact to the byte in
    every case, the micro-batch accelerate's dataloader holds ahead counted (it shares the CPU's
    allocator); with checkpointing the capture used to hold a (4, 1, 32, 32) causal mask the real
    run never makes (transformers' ``is_tracing`` was true for a FakeTensor;
    estimator/capture/tracing.py)."""
    from validators.trainer import measure_trainer

    if case in _LIBRARY:
        pytest.importorskip(_LIBRARY[case])
    make, extra = CASES[case]
    measured = measure_trainer(make(), dataset(3 * B * K), output_dir=str(tmp_path), batch_size=B, step=2,
                               gradient_accumulation_steps=K, **extra)
    m, rep = measured.measurement, predict(case)
    error = (rep.peak_bytes - m.peak_bytes) / m.peak_bytes
    assert abs(error) <= TOLERANCE, f"predicted {rep.peak_bytes:,} B, measured {m.peak_bytes:,} B ({error:+.3%})"
    assert rep.batch == B * K and rep.multiple == K  # b: the optimizer step's batch
    assert measured.batch_bytes == 2 * B * S * 8  # input_ids and labels, int64: the next micro-batch
    assert f"next micro-batch while the step runs ({measured.batch_bytes:,} B" in rep.notes[-1]
    assert "counted" in rep.notes[-1]
    assert rep.peak_bytes == m.peak_bytes  # tolerance: 0 B


def test_what_the_mapping_changes():
    """Against the nearest explicit report (b = 8, ``Strategy(accumulate=2)``, the built-in step,
    which keeps the output: +6.0 % over the real Trainer run with the config's ``use_cache=True``,
    measured by ``python -m validators.trainer``), Trainer's step drops the output before backward.
    With ``use_cache=False`` as Trainer sets it, the two differ at the peak (the log-softmax
    backward) by one micro-batch's fp32 logits, (4, 32, 512) x 4 B = 262,144 B, less 8 B of 0-dim
    tensors: Trainer's step holds four (``num_items_in_batch``, the loss divided by it, accelerate's
    ``loss / 1`` and the first micro-batch's detached loss), the built-in step two (the loss and
    ``loss / 2``).  A LoRA model trains only its adapters: gradients and AdamW's state for them
    alone."""
    plain = predict("plain")
    model = gpt2()
    model.config.use_cache = False
    explicit = estimator.report(model, batch_of(dataset(3 * B * K), B * K), strategy=Strategy(accumulate=K),
                                device="cpu")
    assert plain.peak_piece.op == explicit.peak_piece.op == "aten._log_softmax_backward_data.default"
    activations = estimator.Category.ACTIVATION
    # ... and the micro-batch accelerate's loader holds ahead (input_ids and labels, int64), which
    # from_training_args counts on the CPU among the activations (made before the model's call)
    ahead = 2 * B * S * 8
    assert explicit.breakdown[activations] - plain.breakdown[activations] == B * S * VOCAB * 4 - (4 - 2) * 4 - ahead
    model = lora()
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapters = sum(p.numel() for p in trainable)
    # per layer, rank 4: c_attn (64 -> 192) A 4x64 + B 192x4, attn.c_proj (64 -> 64), mlp.c_proj (256 -> 64)
    assert len(trainable) == 12
    assert adapters == 2 * (4 * 64 + 192 * 4 + 4 * 64 + 64 * 4 + 4 * 256 + 64 * 4) == 5_632
    rep = predict("lora")
    # The peak is in the second micro-batch's backward: the first one's gradients (adapters only) are
    # alive, and Trainer's last loss was replaced after the first backward (its 4 B freed).
    assert rep.breakdown[estimator.Category.GRADIENT] == 4 * adapters
    # fused AdamW: two fp32 moments and a 4-byte step per adapter tensor; Trainer's three 0-dim tensors
    assert rep.breakdown[estimator.Category.OPTIMIZER_STATE] == 2 * 4 * adapters + 4 * 12 + 12 - 4


def test_command_line(tmp_path):
    """``fxmem report transformers:DIR --training-args args.json`` is ``from_training_args``: the
    tiny GPT-2 built from its config (on meta) predicts what the real model's report does."""
    from click.testing import CliRunner

    from estimator.cli import cli

    config().save_pretrained(tmp_path)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": B, "gradient_accumulation_steps": K}))
    result = CliRunner().invoke(cli, ["report", f"transformers:{tmp_path}", "--training-args", str(args),
                                      "--seq-len", str(S), "--device", "cpu", "--json", "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["batch"], data["peak_bytes"]) == (B * K, predict("plain").peak_bytes)
    refused = CliRunner().invoke(cli, ["report", f"transformers:{tmp_path}", "--training-args", str(args),
                                       "--amp", "bf16", "--device", "cpu", "-q"])
    assert refused.exit_code == 2 and "--training-args decides --amp" in refused.output


def test_checkpointed_trainer_step_recomputes_with_the_cuda_kernels():
    """Trainer's step (``step=``) with the model's own checkpointing on the CUDA target: the
    recomputation in backward runs CUDA's kernels (fused dropout, the SDPA backend) as the first
    forward did -- the backward the user step's phases wrap still runs under the substitutions
    (it failed with "a different number of tensors was saved during the original forward and
    recomputation")."""
    from estimator.integrations.training_args import from_training_args

    args = dict(per_device_train_batch_size=B, gradient_accumulation_steps=K, gradient_checkpointing=True)
    rep = from_training_args(gpt2(), args, sample=batch_of(dataset(B * K), B * K), device="cuda", gpu="H100")
    assert not any(op.op == "aten.bernoulli_.float" for op in rep.timeline.ops)  # CUDA's fused dropout, both times
