"""estimator.integrations: transformers / timm / torchvision models built from code.

Small configs, estimated on the meta device and measured on CPU with real (seeded) weights:
the same tolerance as tests/test_validation.py. Nothing is downloaded (no network needed).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import estimator
from estimator import InputError, integrations
from estimator.integrations import _common
from validators.cpu import measure_cpu

TOLERANCE = 0.005  # 0.5 %, as tests/test_validation.py


def _needs(module: str) -> None:
    try:
        _common.import_optional(module, module)
    except InputError as exc:
        pytest.skip(f"{module} is not usable here: {exc}")


TINY_LLAMA = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 64,
    "bos_token_id": 0, "eos_token_id": 0,
}
TINY_BERT = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "vocab_size": 512, "max_position_embeddings": 64,
}

# (source, name, build keywords): estimated on meta, measured on CPU.
MEASURED = [
    ("transformers", "llama", {"overrides": TINY_LLAMA, "seq_len": 32}),
    ("timm", "test_vit", {}),  # timm's own tiny ViT, at its 160 x 160 input
]
# Estimated only (a measurement of these costs more test time than it adds).
REPORTED = [
    ("transformers", "BertForSequenceClassification", "train", {"overrides": TINY_BERT, "seq_len": 16}),
    ("transformers", "t5", "train", {"overrides": {"num_layers": 1, "d_model": 32, "d_ff": 64, "num_heads": 2,
                                                   "d_kv": 16, "vocab_size": 128}, "seq_len": 8}),
    ("torchvision", "squeezenet1_1", "train", {"overrides": {"num_classes": 10}, "image_size": 32}),
    ("torchvision", "squeezenet1_1", "inference", {"overrides": {"num_classes": 10}, "image_size": 32}),
]


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize(("source", "name", "kwargs"), MEASURED, ids=[f"{s}:{n}" for s, n, _ in MEASURED])
def test_estimate_matches_cpu_measurement(source, name, kwargs, mode):
    _needs(source)
    model, sample, loss_fn = integrations.build(source, name, batch=2, **kwargs)
    assert next(model.parameters()).device.type == "meta"
    rep = estimator.report(model, sample, batch=2, mode=mode, loss_fn=loss_fn, device="cpu")
    model, sample, loss_fn = integrations.build(source, name, batch=2, device="cpu", **kwargs)
    assert next(model.parameters()).device.type == "cpu"
    measured = measure_cpu(model, sample, mode=mode, loss_fn=loss_fn).peak_bytes
    error = (rep.peak_bytes - measured) / measured
    assert abs(error) <= TOLERANCE, (
        f"{source}:{name} {mode}: estimated {rep.peak_bytes:,} B, measured {measured:,} B, error {error:+.3%} "
        f"({rep.path.value} capture, peak at {rep.peak_piece.op})"
    )


def test_transformers_defaults_lm_sample_and_heads():
    _needs("transformers")
    model, sample, loss_fn = integrations.build("transformers", "gpt2", batch=3)
    assert type(model).__name__ == "GPT2LMHeadModel" and loss_fn is None
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small, tied head
    assert sample["input_ids"].shape == (3, 512) and sample["input_ids"].dtype == torch.int64
    assert sample["labels"] is sample["input_ids"]  # output.loss exists; one tensor, as HF scripts pass it
    assert int(sample["input_ids"].max()) < model.config.vocab_size
    bert, sample, _ = integrations.build("transformers", "bert", batch=2, seq_len=16)
    assert type(bert).__name__ == "BertForMaskedLM" and sample["input_ids"].shape == (2, 16)
    clf, sample, _ = integrations.build("transformers", "BertForSequenceClassification", batch=2)
    assert type(clf).__name__ == "BertForSequenceClassification"
    assert sample["labels"].shape == (2,) and sample["input_ids"].shape == (2, 512)
    vit, sample, _ = integrations.build("transformers", "vit", batch=2)
    assert type(vit).__name__ == "ViTForImageClassification"
    assert sample["pixel_values"].shape == (2, 3, 224, 224) and sample["labels"].shape == (2,)


def test_transformers_local_config_folder(tmp_path):
    _needs("transformers")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16", **TINY_LLAMA}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, sample, _ = integrations.build("transformers", str(tmp_path), batch=2)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.bfloat16  # the config's dtype, as from_config
    assert model.config.num_hidden_layers == 2 and sample["input_ids"].shape == (2, 64)
    model, _, _ = integrations.build("transformers", str(tmp_path / "config.json"), batch=2, dtype="float32",
                                     overrides={"num_hidden_layers": 1})
    assert next(model.parameters()).dtype == torch.float32 and model.config.num_hidden_layers == 1


@pytest.mark.parametrize(("source", "name", "mode", "kwargs"), REPORTED,
                         ids=[f"{s}:{n}-{m}" for s, n, m, _ in REPORTED])
def test_report_runs(source, name, mode, kwargs):
    _needs(source)
    model, sample, loss_fn = integrations.build(source, name, batch=2, **kwargs)
    rep = estimator.report(model, sample, batch=2, mode=mode, loss_fn=loss_fn, device="cpu")
    param_bytes = 4 * sum(p.numel() for p in model.parameters())
    # train: parameters + gradients + AdamW's two moments at least; inference: the parameters
    assert rep.peak_bytes > (4 if mode == "train" else 1) * param_bytes
    assert rep.at(8) > rep.at(2)


def test_timm_and_torchvision_default_samples():
    _needs("timm")
    _needs("torchvision")
    model, sample, loss_fn = integrations.build("timm", "resnet50", batch=2)
    assert sample.shape == (2, 3, 224, 224) and next(model.parameters()).device.type == "meta"
    logits = torch.randn(2, 1000, requires_grad=True)
    assert loss_fn(logits, sample).shape == ()  # cross-entropy against class 0
    _, sample, _ = integrations.build("timm", "vit_base_patch16_384.augreg_in21k_ft_in1k", batch=2)
    assert sample.shape == (2, 3, 384, 384)  # the tag's pretrained_cfg
    _, sample, _ = integrations.build("torchvision", "inception_v3", batch=2)
    assert sample.shape == (2, 3, 299, 299)  # the weights' documented crop, nothing loaded
    _, sample, _ = integrations.build("torchvision", "r3d_18", batch=2)
    assert sample.shape == (2, 3, 16, 112, 112)
    # Segmentation builders default to an ImageNet backbone: built without it, no download.
    _, sample, _ = integrations.build("torchvision", "lraspp_mobilenet_v3_large", batch=2)
    assert sample.shape == (2, 3, 520, 520)  # the weights' resize_size


def test_downloads_are_refused(monkeypatch):
    _needs("torchvision")
    import torchvision

    def pretrained(**kwargs):  # a builder that loads weights, as pretrained backbones do
        torch.hub.load_state_dict_from_url("https://example.invalid/weights.pth", model_dir="/nonexistent")

    monkeypatch.setattr(torchvision.models, "get_model", lambda name, **kwargs: pretrained(**kwargs))
    with pytest.raises(InputError, match="would download https://example.invalid/weights.pth"):
        integrations.build("torchvision", "resnet18")


def test_timm_hub_ids_are_refused():
    # transformers Hub ids fetch config.json only: tests/test_hub_ids.py
    _needs("timm")
    with pytest.raises(InputError, match="never downloads"):
        integrations.build("timm", "hf-hub:timm/resnet50.a1_in1k")


@pytest.mark.parametrize(("source", "name", "suggestion"), [
    ("transformers", "lama", "'llama'"),
    ("timm", "resnet5", "'resnet50'"),
    ("torchvision", "resnet5", "'resnet50'"),
    ("tim", "resnet18", "'timm'"),
])
def test_unknown_names_suggest_close_matches(source, name, suggestion):
    if source in integrations.SOURCES:
        _needs(source)
    with pytest.raises(InputError, match=f"Did you mean .*{suggestion}"):
        integrations.build(source, name)


def test_bad_overrides_and_options():
    _needs("transformers")
    with pytest.raises(InputError, match="no field 'n_layers'.*'n_layer'"):
        integrations.build("transformers", "gpt2", overrides={"n_layers": 2})
    with pytest.raises(InputError, match="batch must be a positive int"):
        integrations.build("transformers", "gpt2", batch=0)
    with pytest.raises(InputError, match="no such file or directory"):
        integrations.build("transformers", "/nonexistent/folder")
    _needs("torchvision")
    with pytest.raises(InputError, match="detection models .* not supported"):
        integrations.build("torchvision", "fasterrcnn_resnet50_fpn")
    with pytest.raises(InputError, match="unexpected keyword argument 'depth'"):
        integrations.build("torchvision", "resnet18", overrides={"depth": 2})


@pytest.mark.parametrize("source", integrations.SOURCES)
def test_missing_package_names_the_extra(source, monkeypatch):
    monkeypatch.setitem(sys.modules, source, None)  # import raises ImportError
    with pytest.raises(InputError, match=rf"pip install 'fxmem\[{source}\]'"):
        integrations.build(source, "anything")


def test_import_estimator_makes_the_libraries_importable():
    """The README's venv has PyPI's torchvision (a CUDA build beside the CPU torch), which cannot
    load its extension: after ``import estimator`` transformers' model classes, peft and timm
    import as the README's examples use them (a fresh interpreter; importing estimator imports
    no torch)."""
    import subprocess
    import sys

    code = ("import sys, estimator; assert 'torch' not in sys.modules; "
            "from transformers import LlamaForCausalLM; from peft import LoraConfig; import timm")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
