"""Tests for models_zoo: every model trains at debug size, real sizes match reference shapes."""

import subprocess
import sys
import time
from contextlib import nullcontext

import pytest
import torch

import models_zoo
from estimator.capture import datadep
from estimator.vocab.data_dependent import Policy
from models_zoo import get, names, sizes

EXPECTED_NAMES = ["mlp", "resnet", "unet", "vit", "gpt", "bert", "rnn", "lstm_lm", "lora", "tied_autoencoder", "llama", "convnets",
                  "custom_op", "moe", "mixtral", "masked_lm", "spec_augment", "mha_padding", "encoder_padding"]

# unique-parameter counts of the reference models (torchvision, GPT-2, Llama-2)
REFERENCE_COUNTS = [
    ("gpt", "gpt2-small", 124_439_808),
    ("llama", "7b", 6_738_415_616),
    ("resnet", "resnet18", 11_689_512),
    ("resnet", "resnet50", 25_557_032),
    ("vit", "vit-b16", 86_567_656),
]


def call(model, sample):
    if isinstance(sample, torch.Tensor):
        return model(sample)
    if isinstance(sample, tuple):
        return model(*sample)
    return model(**sample)


def tensors(sample) -> list[torch.Tensor]:
    if isinstance(sample, torch.Tensor):
        return [sample]
    if isinstance(sample, tuple):
        return list(sample)
    return list(sample.values())


def to_device(sample, device):
    if isinstance(sample, torch.Tensor):
        return sample.to(device)
    if isinstance(sample, tuple):
        return tuple(t.to(device) for t in sample)
    return {k: v.to(device) for k, v in sample.items()}


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() skips shared duplicates


def test_names_and_sizes():
    assert names() == EXPECTED_NAMES
    for name in names():
        assert sizes(name)[0] == "debug"
        assert len(sizes(name)) >= 2


@pytest.mark.parametrize("batch", [2, 8])
@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_debug_train_step(name, batch):
    model, make_sample, loss_fn = get(name)
    assert model.training
    sample = make_sample(batch)
    for t in tensors(sample):
        assert t.device.type == "cpu"
        assert t.shape[0] == batch
        assert t.dtype in (torch.float32, torch.int64)
    loss = loss_fn(call(model, sample), sample)
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable
    for p in model.parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all()
        else:
            assert p.grad is None


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_debug_eval_and_size(name):
    model, make_sample, loss_fn = get(name)
    assert n_params(model) < 200_000
    model.eval()
    sample = make_sample(3)
    with torch.no_grad():
        loss = loss_fn(call(model, sample), sample)
    assert loss.dim() == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_sample_deterministic_and_no_global_rng(name):
    _, make_sample, _ = get(name)
    state = torch.get_rng_state()
    a, b = tensors(make_sample(4)), tensors(make_sample(4))
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_make_sample_rejects_bad_batch(bad):
    _, make_sample, _ = get("mlp")
    with pytest.raises(ValueError, match="batch"):
        make_sample(bad)


@pytest.mark.parametrize("name,size,expected", REFERENCE_COUNTS)
def test_reference_param_counts_on_meta(name, size, expected):
    start = time.perf_counter()
    model, _, _ = get(name, size, device="meta")
    assert time.perf_counter() - start < 5
    assert all(p.device.type == "meta" for p in model.parameters())
    assert n_params(model) == expected


@pytest.mark.parametrize("name,size", [(n, s) for n in EXPECTED_NAMES for s in sizes(n) if s != "debug"])
def test_real_sizes_forward_on_meta(name, size):
    # torch._grouped_mm's meta kernel takes bf16 only (the real CPU kernel and fxmem's fake one take fp32 too)
    model, make_sample, loss_fn = get(name, size, device="meta", dtype=torch.bfloat16 if name == "mixtral" else None)
    sample = to_device(make_sample(2), "meta")
    # meta tensors have no data: data-dependent sizes (x[mask], torch.where) take fxmem's bound
    sizes_bound = datadep.DataDependent(Policy(), {}) if models_zoo.data_dependent(name) else nullcontext()
    with sizes_bound:
        loss = loss_fn(call(model, sample), sample)
    assert loss.dim() == 0


def test_dtype_cast():
    model, make_sample, loss_fn = get("llama", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    sample = make_sample(2)
    assert sample["input_ids"].dtype == torch.int64
    loss_fn(call(model, sample), sample).backward()
    with pytest.raises(ValueError, match="dtype"):
        get("mlp", dtype=torch.int64)


def test_models_are_imported_on_first_use():
    # `fxmem report mlp` must not import the other 18 models (transformers' Mixtral, a custom op).
    code = ("import sys, models_zoo; assert models_zoo.sizes('mlp'); "
            "print(sorted(m for m in sys.modules if m.startswith('models_zoo.'))); "
            "models_zoo.gpt.SIZES; print('models_zoo.gpt' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "['models_zoo._common', 'models_zoo.mlp']" and out[1] == "True"


def test_bad_name_suggests():
    with pytest.raises(ValueError, match="gpt") as err:
        get("gtp")
    assert "'gtp'" in str(err.value) and "Did you mean" in str(err.value)
    with pytest.raises(ValueError, match="llama"):
        sizes("lama")


def test_bad_size_suggests():
    with pytest.raises(ValueError, match="gpt2-small") as err:
        get("gpt", "gpt2-smal")
    assert "'gpt2-smal'" in str(err.value) and "debug" in str(err.value)


def test_weight_sharing():
    gpt, _, _ = get("gpt")
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    ae, _, _ = get("tied_autoencoder")
    assert ae.bottleneck.first is ae.bottleneck.second
    with_dupes = sum(p.numel() for _, p in ae.named_parameters(remove_duplicate=False))
    assert with_dupes > n_params(ae)


def test_lora_freezes_base():
    model, _, _ = get("lora")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert any(not p.requires_grad for p in model.parameters())


def test_bert_padding_and_output():
    model, make_sample, _ = get("bert")
    sample = make_sample(8)
    mask = sample["attention_mask"]
    assert mask.dtype == torch.int64 and bool(mask[0].all()) and not bool(mask[1:].all())
    assert bool((mask[:, 1:] <= mask[:, :-1]).all())  # padding only at the end
    out = call(model, sample)
    assert out.loss.dim() == 0 and out.logits.shape == (8, models_zoo.bert.SIZES["debug"].num_labels)
    no_labels = {k: v for k, v in sample.items() if k != "labels"}
    assert call(model, no_labels).loss is None


def test_llama_rope_buffers_not_persistent():
    model, _, _ = get("llama")
    assert "rope_cos" not in model.state_dict() and "rope_cos" in dict(model.named_buffers())
