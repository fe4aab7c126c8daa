"""Low-bit optimizers: fxmem's prediction against the CPU measurement, per byte.

bitsandbytes' 8-bit and paged optimizers (their CPU kernels) and torchao's 8-bit, 4-bit and fp8
AdamW (their compiled updates) on three models: ``fallbacks``, whose parameters of 4,095 and
4,097 elements take the full-precision fallbacks (bitsandbytes' ``min_8bit_size`` of 4,096,
torchao's blocks of 256 that 4,097 does not divide), the zoo's GPT-2 (a transformer) and ResNet
(a conv net), train steps at b = 2 and 8, each row one real CPU step (``validators.cpu``) and one
report.  Then QLoRA two ways, trained (AdamW) and generating: as torchtune builds it
(``qlora_llama``: a Llama whose projections are frozen NF4 weights, torchao's ``NF4Tensor``, with
bf16 LoRA adapters) and as Hugging Face users do (``bnb_qlora_llama``: ``from_pretrained`` with
``BitsAndBytesConfig(load_in_4bit=True, nf4, double quantization, bf16 compute)``, then PEFT LoRA
on the query and value projections; bitsandbytes' CPU kernels); and the same with 8-bit weights
(``load_in_8bit=True``), trained and generating (its outlier columns read on the sample:
``data_dependent="sample"``).  Rows of a library that does not
import here are left out (named in the output).

    PYTHONPATH=. python -m validators.low_bit   # writes its section of docs/validation.md
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

import estimator
import models_zoo
from estimator.capture import steps
from validators.cpu import measure_cpu, measure_user_step, recorded
from validators.strategies import kept_section, write_section

BATCHES = (2, 8)
# name -> (module, class): each built with lr=1e-3 (bitsandbytes' and torchao's defaults otherwise)
OPTIMIZERS = {
    "bnb Adam8bit": ("bitsandbytes.optim", "Adam8bit"),
    "bnb AdamW8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "bnb PagedAdamW": ("bitsandbytes.optim", "PagedAdamW"),
    "bnb PagedAdamW8bit": ("bitsandbytes.optim", "PagedAdamW8bit"),
    "bnb Lion8bit": ("bitsandbytes.optim", "Lion8bit"),
    "ao AdamW8bit": ("torchao.optim", "AdamW8bit"),
    "ao AdamW4bit": ("torchao.optim", "AdamW4bit"),
    "ao AdamWFp8": ("torchao.optim", "AdamWFp8"),
}
MODELS = ("fallbacks", "gpt", "resnet")


class Fallbacks(nn.Module):
    """Two parameters just under and over the libraries' thresholds, and a small MLP (b rows of 64
    features -> 10 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.under = nn.Parameter(torch.randn(4095))  # < 4,096: bitsandbytes' fp32 states
        self.over = nn.Parameter(torch.randn(4097))  # 4,097 % 256 != 0: torchao's full precision
        self.hidden = nn.Linear(64, 512)  # 32,768 + 512 elements
        self.out = nn.Linear(512, 10)  # 5,120 + 10

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x))) + self.under.sum() + self.over.sum()


def build(name: str):
    """(model, make_sample, loss_fn) of a row's model, seeded."""
    torch.manual_seed(0)
    if name == "fallbacks":
        return Fallbacks(), lambda b: torch.randn(b, 64), None
    return models_zoo.get(name, "debug")


class QLoRALinear(nn.Module):
    """torchtune's ``LoRALinear(quantize_base=True)``: the base weight frozen in NF4 (torchao's
    ``to_nf4``: 4-bit codes, a scaler per block of 64, double-quantized), rank-``r`` bf16 adapters."""

    def __init__(self, base: nn.Linear, r: int = 8) -> None:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        super().__init__()
        self.weight = nn.Parameter(to_nf4(base.weight.detach().to(torch.bfloat16)), requires_grad=False)
        self.lora_a = nn.Linear(base.in_features, r, bias=False, dtype=torch.bfloat16)
        self.lora_b = nn.Linear(r, base.out_features, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


def qlora_llama() -> nn.Module:
    """A tiny transformers Llama in bf16 (2 layers, hidden 256, 4 query and 2 key/value heads of 64:
    every projection's NF4 scalers divide into torchao's blocks of 256), its projections
    ``QLoRALinear``, everything else frozen; seeded."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, intermediate_size=512,
                                      vocab_size=QLORA_VOCAB)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, QLoRALinear(child))
    return model


_SAVED: dict[str, str] = {}  # the tiny Llama's random weights, saved once per process (no downloads)


def bnb_qlora_llama(mode: str, bits: int = 4) -> nn.Module:
    """The tiny Llama of ``qlora_llama`` loaded the Hugging Face way: saved with random weights,
    ``from_pretrained`` with bitsandbytes' NF4 4-bit config (double quantization, bf16 compute) on
    the CPU, and for training PEFT LoRA (r = 8) on ``q_proj`` and ``v_proj``.  Built inside
    ``validators.cpu.recorded``: its first inference call repacks the 4-bit weights for the CPU
    (``bitsandbytes.functional._convert_weight_packed_for_cpu``), freeing what loading made."""
    import tempfile

    import peft
    import transformers

    if "dir" not in _SAVED:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=64, intermediate_size=512,
                                          vocab_size=QLORA_VOCAB)
        torch.manual_seed(0)
        _SAVED["dir"] = tempfile.mkdtemp(prefix="fxmem-bnb-qlora-")
        transformers.LlamaForCausalLM(config).save_pretrained(_SAVED["dir"])
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.bfloat16) if bits == 4 else \
        transformers.BitsAndBytesConfig(load_in_8bit=True)
    torch.manual_seed(0)
    with recorded():
        model = transformers.LlamaForCausalLM.from_pretrained(_SAVED["dir"], quantization_config=quantization,
                                                              device_map="cpu")
        if mode == "train":
            return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).train()
    return model.eval()


QLORA_VOCAB = 1000
QLORA_PROMPT, QLORA_NEW = 8, 8  # generate(): prompt tokens, new tokens


def qlora_sample(b: int, mode: str) -> dict[str, torch.Tensor]:
    """``b`` rows of 16 tokens with labels (train) or ``QLORA_PROMPT``-token prompts (generate)."""
    s = 16 if mode == "train" else QLORA_PROMPT
    ids = torch.randint(0, QLORA_VOCAB, (b, s), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long)}
    return {**sample, "labels": ids} if mode == "train" else sample


@dataclass(frozen=True)
class Row:
    optimizer: str
    model: str
    batch: int
    predicted: int
    measured: int
    estimate_seconds: float

    @property
    def error(self) -> float:
        return 100.0 * (self.predicted - self.measured) / self.measured


def optimizer_class(name: str):
    """The class of ``OPTIMIZERS[name]``, or None where its library does not import."""
    module, cls = OPTIMIZERS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError:
        return None


def compare(optimizer: str, model: str, batch: int) -> Row:
    cls = optimizer_class(optimizer)
    factory = lambda params: cls(params, lr=1e-3)  # noqa: E731
    net, make_sample, loss_fn = build(model)
    measured = measure_cpu(net, make_sample(batch), "train", factory, loss_fn)
    net, make_sample, loss_fn = build(model)
    start = time.perf_counter()
    rep = estimator.report(net, make_sample(batch), batch=batch, optimizer=factory, loss_fn=loss_fn, device="cpu")
    return Row(optimizer, model, batch, rep.peak_bytes, measured.peak_bytes, time.perf_counter() - start)


QLORA = {"qlora llama": lambda mode: qlora_llama().train(mode == "train"), "bnb qlora llama": bnb_qlora_llama,
         "bnb int8 lora llama": lambda mode: bnb_qlora_llama(mode, bits=8)}
_QLORA_LIBRARY = {"qlora llama": "torchao", "bnb qlora llama": "bitsandbytes", "bnb int8 lora llama": "bitsandbytes"}
# generate() with 8-bit weights: how many columns of each input hold outliers (past bitsandbytes'
# threshold of 6.0) depends on the values; data_dependent="sample" reads them from a real call on the
# sample (the default, "max", takes every column: an upper bound, not this run)
_QLORA_POLICY = {"bnb int8 lora llama": "sample"}


def compare_qlora(mode: str, name: str = "qlora llama", batches=BATCHES) -> list[Row]:
    """QLoRA (``QLORA[name]``) trained with AdamW, or generating ``QLORA_NEW`` tokens: one report,
    evaluated at each of ``batches`` (``Report.at``), against a real CPU step at each."""
    build = QLORA[name]
    start = time.perf_counter()
    policy = _QLORA_POLICY.get(name, "max")
    if mode == "train":
        rep = estimator.report(build(mode), qlora_sample(batches[0], mode), device="cpu", data_dependent=policy)
    else:
        rep = estimator.report(build(mode), qlora_sample(batches[0], mode), mode="generate", new_tokens=QLORA_NEW,
                               device="cpu", data_dependent=policy)
    seconds = time.perf_counter() - start
    rows = []
    for b in batches:
        if mode == "train":
            measured = measure_cpu(build(mode), qlora_sample(b, mode), "train", "adamw")
        else:
            measured = measure_user_step(build(mode), qlora_sample(b, mode), steps.Generation(QLORA_NEW, None), None,
                                         "generate")
        rows.append(Row("adamw" if mode == "train" else f"generate({QLORA_NEW})", name, b, rep.at(b),
                        measured.peak_bytes, seconds))
    return rows


def run(optimizers=tuple(OPTIMIZERS), models=MODELS, batches=BATCHES) -> tuple[list[Row], list[str]]:
    """The rows, and what was left out (an optimizer or QLoRA whose library does not import)."""
    missing = [o for o in optimizers if optimizer_class(o) is None]
    rows = [compare(o, m, b) for o in optimizers if o not in missing for m in models for b in batches]
    for name, library in _QLORA_LIBRARY.items():
        try:
            importlib.import_module(library)
        except ImportError:
            missing.append(f"{name} ({library})")
            continue
        for mode in ("train", "generate"):
            rows += compare_qlora(mode, name, batches)
    return rows, missing


MARKS = ("<!-- low_bit -->", "<!-- /low_bit -->")


def to_markdown(rows: list[Row], missing: list[str], command: str) -> str:
    exact = sum(r.predicted == r.measured for r in rows)
    lines = [MARKS[0], "## Low-bit optimizers and QLoRA (CPU)", "",
             f"`{command}` (torch {torch.__version__}, {torch.get_num_threads()} threads): "
             f"{exact}/{len(rows)} rows exact to the byte, largest error "
             f"{max((abs(r.error) for r in rows), default=0.0):.3f} %. Train steps; `fallbacks` has parameters of "
             "4,095 and 4,097 elements (bitsandbytes' fp32 states under 4,096 elements, torchao's full precision "
             "where blocks of 256 do not divide); `qlora llama` is a tiny Llama with torchao NF4 weights and bf16 "
             "LoRA adapters (one report per mode, evaluated at each b).", "",
             "| optimizer | model | b | predicted (B) | measured (B) | error | estimate (s) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.optimizer} | {r.model} | {r.batch} | {r.predicted:,} | {r.measured:,} | {r.error:+.3f} % "
              f"| {r.estimate_seconds:.1f} |" for r in rows]
    if missing:
        lines += ["", f"Not run (library not installed): {', '.join(missing)}."]
    return "\n".join(lines) + "\n" + MARKS[1] + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.low_bit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--markdown", type=Path, default=Path("docs/validation.md"),
                        help="the file whose low-bit section is written (all optimizers and models only)")
    parser.add_argument("--json", type=Path, default=Path("docs/validation-low-bit.json"))
    args = parser.parse_args(argv)
    rows, missing = run(args.optimizers, args.models)
    text = to_markdown(rows, missing, "python -m validators.low_bit")
    if args.optimizers == list(OPTIMIZERS) and args.models == list(MODELS):
        write_section(args.markdown, text, MARKS)
        args.json.write_text(json.dumps({"rows": [asdict(r) | {"error_pct": r.error} for r in rows],
                                         "missing": missing}, indent=1) + "\n")
    sys.stdout.write(text)
    return 0 if all(r.predicted == r.measured for r in rows) else 1


def kept(path: Path) -> str:
    """This section of ``path`` ('' if none): what ``python -m validators`` keeps."""
    return kept_section(path, MARKS)


if __name__ == "__main__":
    raise SystemExit(main())
