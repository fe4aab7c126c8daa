"""bitsandbytes' 4-bit and 8-bit weights built on the meta device (``estimator.integrations.bitsandbytes``).

The quantized weights are bitsandbytes' own ``_quantize`` run on meta tensors (sizes from its
ops' fake kernels), the module replacement transformers' own quantizer: a meta-built model must be
the model ``from_pretrained`` loads with real weights, tensor for tensor and report for report
(that one is checked against real CPU runs in ``test_low_bit.py``).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import estimator
from estimator import Category, integrations
from estimator.vocab.errors import InputError

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from validators.low_bit import QLORA_VOCAB, bnb_qlora_llama, qlora_sample  # noqa: E402

TINY = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=QLORA_VOCAB)


def _config(bits: int):
    import transformers

    if bits == 8:
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)


def _meta_llama(bits: int, mode: str) -> nn.Module:
    """``validators.low_bit``'s tiny Llama, quantized on the meta device (PEFT LoRA for training)."""
    import peft

    model, _, _ = integrations.build("transformers", "LlamaForCausalLM", overrides=TINY, quantization=_config(bits))
    if mode == "train":
        return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).train()
    return model.eval()


def _tensors(model: nn.Module) -> list:
    """Every parameter and its quantization state: name, class, shape, dtype."""
    out = []
    for name, p in model.named_parameters():
        out.append((name, type(p).__name__, tuple(p.shape), p.dtype, p.requires_grad))
        state = getattr(p, "quant_state", None)
        if state is not None:
            for key, t in [("absmax", state.absmax), ("code", state.code), *(
                    [("offset", state.offset), ("absmax2", state.state2.absmax), ("code2", state.state2.code)]
                    if state.nested else [])]:
                out.append((f"{name}.{key}", tuple(t.shape), t.dtype))
        if getattr(p, "SCB", None) is not None:
            out.append((f"{name}.SCB", tuple(p.SCB.shape), p.SCB.dtype))
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_meta_build_is_the_loaded_model(bits):
    """Tensor for tensor what ``from_pretrained(quantization_config=...)`` loads from real weights."""
    assert _tensors(_meta_llama(bits, "inference")) == _tensors(bnb_qlora_llama("inference", bits=bits))


@pytest.mark.parametrize("bits, mode, device", [(4, "train", "cpu"), (4, "train", "cuda"), (4, "inference", "cpu"),
                                                (8, "train", "cpu")])
def test_meta_build_reports_as_the_loaded_model(bits, mode, device):
    """The report of the meta-built model is the report of the loaded one, byte for byte."""
    kwargs = {"device": device, "mode": mode} | ({"gpu": "A100 80GB"} if device == "cuda" else {})
    sample = qlora_sample(2, mode)
    meta = estimator.report(_meta_llama(bits, mode), sample, **kwargs)
    loaded = estimator.report(bnb_qlora_llama(mode, bits=bits), sample, **kwargs)
    assert meta.peak_bytes == loaded.peak_bytes
    assert meta.breakdown == loaded.breakdown


def _linear4bit(double: bool) -> nn.Module:
    with torch.device("meta"):
        layer = bnb.nn.Linear4bit(256, 512, bias=False, compute_dtype=torch.bfloat16, compress_statistics=double,
                                  quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.empty(512, 256, dtype=torch.bfloat16, device="meta"), requires_grad=False,
                                     compress_statistics=double, quant_type="nf4", module=layer)
    return layer


@pytest.mark.parametrize("double", [False, True])
def test_nf4_weight_to_the_byte(double):
    """512 x 256 = 131,072 elements in NF4, blocks of 64: 65,536 B of codes, 2,048 absmax and the
    16-entry fp32 NF4 code (64 B).  The absmax are fp32 (8,192 B), or with double quantization
    uint8 (2,048 B) plus 2,048 / 256 = 8 fp32 second-level absmax (32 B), the 256-entry fp32
    dynamic code (1,024 B) and the fp32 offset (4 B)."""
    from estimator.integrations.bitsandbytes import quantize

    model = quantize(nn.Sequential(_linear4bit(double)))
    state = model[0].weight.quant_state
    assert model[0].weight.bnb_quantized and state.dtype == torch.bfloat16 and state.nested == double
    expected = 65_536 + 64 + (2_048 + 32 + 1_024 + 4 if double else 8_192)
    # (the CUDA target: the CPU's first inference call repacks a 4-bit weight for its own kernel)
    rep = estimator.report(model, torch.randn(2, 256, dtype=torch.bfloat16), mode="inference", device="cuda")
    assert rep.breakdown[Category.PARAMETER] == expected
    # bitsandbytes' process-wide dynamic code stays a CPU tensor: later real quantizations work
    assert bnb.functional.name2qmap["dynamic"].device.type == "cpu"
    bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, compress_statistics=True)._quantize("cpu")


def test_unquantized_weights_are_refused_by_name():
    model = nn.Sequential(_linear4bit(False))
    with pytest.raises(InputError, match=r"Params4bit '0\.weight' is not quantized yet.*integrations\.bitsandbytes"):
        estimator.report(model, torch.randn(2, 256, dtype=torch.bfloat16), mode="inference", device="cpu")


def test_prequantized_config_and_its_refusals(tmp_path):
    """A Hub model quantized already (``quantization_config`` in its ``config.json``) is built quantized;
    ``quantization=False`` builds it unquantized; a method fxmem does not model is an InputError."""
    import transformers

    config = transformers.LlamaConfig(**TINY, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    config.quantization_config = _config(4).to_dict()
    config.save_pretrained(tmp_path)
    prequantized, _, _ = integrations.build("transformers", str(tmp_path))
    built, _, _ = integrations.build("transformers", "LlamaForCausalLM", overrides=TINY, dtype="bfloat16",
                                     quantization=_config(4))
    assert _tensors(prequantized) == _tensors(built)
    plain, _, _ = integrations.build("transformers", str(tmp_path), quantization=False)
    assert type(plain.model.layers[0].mlp.up_proj) is nn.Linear
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match="quantized with 'gptq', which fxmem does not model"):
        integrations.build("transformers", str(tmp_path))
    with pytest.raises(InputError, match="quantization= applies to transformers models only"):
        integrations.build("timm", "resnet18", quantization=_config(4))


def test_command_line_quantize():
    from estimator.cli.models import resolve

    built = resolve("transformers:gpt2", quantize="nf4", batch=1, seq_len=8)
    layer = built.model.transformer.h[0].attn.c_attn  # GPT-2's Conv1D, transposed as transformers loads it
    assert isinstance(layer, bnb.nn.Linear4bit) and tuple(layer.weight.quant_state.shape) == (2304, 768)
    assert not layer.weight.quant_state.nested and layer.compute_dtype == torch.bfloat16
    with pytest.raises(InputError, match="--quantize applies to transformers models only"):
        resolve("mlp", quantize="nf4")
    # --lora R: PEFT's adapters (its default targets for GPT-2: c_attn), the only trainable parameters: QLoRA
    qlora = resolve("transformers:gpt2", quantize="nf4-dq", lora=8, batch=1, seq_len=8).model
    trainable = {n for n, p in qlora.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 12 and all("c_attn.lora_" in n for n in trainable)
    assert qlora.base_model.model.transformer.h[0].attn.c_attn.base_layer.weight.quant_state.nested
    # a model PEFT has no defaults for: every linear layer
    mlp = resolve("mlp", lora=4).model
    trainable = [n for n, p in mlp.named_parameters() if p.requires_grad]
    linears = sum(isinstance(m, nn.Linear) for m in resolve("mlp").model.modules())
    assert len(trainable) == 2 * linears and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_meta_tensors_at_one_place_are_one_tensor():
    """An ``Int8Params`` keeps its codes twice (``data`` and ``CB``, one storage); any meta tensors at
    one place in one storage are faked once, as real tensors sharing a storage are: the meta model's
    report is the CPU model's."""

    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)
            self.register_buffer("alias", self.linear.weight.detach())

        def forward(self, x):
            return self.linear(x) + self.alias.sum()

    with torch.device("meta"):
        meta = Aliased()
    x = torch.randn(2, 64)
    # the weight once: 64 x 64 x 4 B, the bias 256 B; the buffer is the weight's storage
    reports = [estimator.report(m, x, mode="inference", device="cpu") for m in (meta, Aliased())]
    assert reports[0].breakdown == reports[1].breakdown
    assert reports[0].breakdown[Category.PARAMETER] + reports[0].breakdown[Category.BUFFER] == 64 * 64 * 4 + 64 * 4


def test_torchao_nf4_on_the_meta_device():
    """torchtune's QLoRA weights (torchao's ``to_nf4``) need no builder: ``to_nf4`` runs on meta
    tensors as it is, and the meta model reports as the one with real weights."""
    pytest.importorskip("torchao")
    from validators.low_bit import qlora_llama

    with torch.device("meta"):
        meta = qlora_llama()
    assert meta.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    sample = qlora_sample(2, "train")
    reports = [estimator.report(m, sample, device="cpu") for m in (meta, qlora_llama())]
    assert reports[0].breakdown == reports[1].breakdown and reports[0].peak_bytes == reports[1].peak_bytes


def test_nf4_linears_keeps_the_head_and_tied_weights():
    """``nf4_linears`` (the QLoRA what-if's base weights) turns every linear into an NF4 ``Linear4bit``
    but the one it is told to keep and one whose weight is tied to another module's."""
    from estimator.capture.quantized import nf4_linears

    with torch.device("meta"):
        model = nn.ModuleDict({"wte": nn.Embedding(100, 64), "fc": nn.Linear(64, 128), "proj": nn.Linear(128, 64),
                               "head": nn.Linear(64, 100, bias=False), "out": nn.Linear(64, 10)})
    model["head"].weight = model["wte"].weight
    nf4_linears(model, keep=(model["out"],))
    assert {name: type(m).__name__ for name, m in model.items()} == {
        "wte": "Embedding", "fc": "Linear4bit", "proj": "Linear4bit", "head": "Linear", "out": "Linear"}
    assert model["fc"].weight.quant_state.nested and model["fc"].weight.quant_state.dtype == torch.float32
