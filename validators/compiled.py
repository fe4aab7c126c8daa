"""``python -m validators.compiled``: ``torch.compile``'d steps (Inductor on CPU) predicted with
``estimator.report(..., compile=...)`` against the same compiled steps measured; writes the
"Compiled steps" section of docs/validation.md and docs/validation-compiled.json.

Each row: a fresh model compiled with ``torch.compile(model, mode=...)`` (Dynamo's caches reset
first, so each batch size compiles its own program, as a training loop at that size does), one
warm-up step (the compile), then the measured step (``validators.cpu.measure_cpu``: the CPU
allocator's events).  Beside it the same step eager, measured, so the table shows what
compiling changes, and fxmem's eager estimate (what it answered for a compiled model before).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import estimator
import models_zoo
from validators.cpu import measure_cpu
from validators.strategies import kept_section, write_section

MARKS = ("<!-- compiled -->", "<!-- /compiled -->")
BATCHES = (2, 8, 32)
WIDE_BATCHES = (1024,)  # the MLPs' activations only matter against their 9 MiB of weights at large batches
TOLERANCE_PCT = 2.0  # the target for every row


class NanoBlock(nn.Module):
    """A nanoGPT block written out by hand: causal softmax attention and a tanh-GELU MLP, whose
    pointwise chains Inductor fuses (eager materialises every intermediate)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        h = self.fc(self.ln2(x))
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        return x + self.out(h)


class NanoGPT(nn.Module):
    """Two ``NanoBlock``s over embeddings of (b, t) tokens, an LM head."""

    def __init__(self, vocab: int = 512, d: int = 256, heads: int = 4, layers: int = 2, t: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.blocks = nn.Sequential(*[NanoBlock(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, labels=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


class NormMLP(nn.Module):
    """Linear, LayerNorm, GELU, three times; with ``graph_break`` a graph break after the second
    (``torch._dynamo.graph_break()``, as any Python the compiler cannot trace makes one): two
    compiled regions with eager code between them."""

    def __init__(self, d_in: int = 256, width: int = 1024, classes: int = 10, graph_break: bool = False):
        super().__init__()
        self.graph_break = graph_break
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(w, width), nn.LayerNorm(width), nn.GELU())
                                    for w in (d_in, width, width))
        self.head = nn.Linear(width, classes)

    def forward(self, x, labels=None):
        x = self.layers[1](self.layers[0](x))
        if self.graph_break:  # not inside a loop: Dynamo skips a frame whose loop breaks, compiling none of it
            torch._dynamo.graph_break()
        return self.head(self.layers[2](x))


def _tokens(vocab: int, t: int, batch: int) -> dict[str, torch.Tensor]:
    idx = torch.randint(vocab, (batch, t))
    return {"idx": idx, "labels": torch.roll(idx, -1, 1)}


def _lm_loss(output, sample):
    return F.cross_entropy(output.flatten(0, 1), sample["labels"].flatten())


def _features(d: int, classes: int, batch: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch, d), "labels": torch.randint(classes, (batch,))}


def _class_loss(output, sample):
    return F.cross_entropy(output, sample["labels"])


def _zoo(name: str):
    return lambda: models_zoo.get(name, "debug")


# name -> () -> (model, make_sample(batch), loss_fn); each call builds a fresh, seeded model
MODELS = {
    "nanogpt (2 blocks, t=128, d=256)": lambda: (NanoGPT(), partial(_tokens, 512, 128), _lm_loss),
    "mlp (LayerNorm, GELU, 1024 wide)": lambda: (NormMLP(), partial(_features, 256, 10), _class_loss),
    "mlp with a graph break": lambda: (NormMLP(graph_break=True), partial(_features, 256, 10), _class_loss),
    "resnet (zoo, debug)": _zoo("resnet"),
    "gpt (zoo, debug: SDPA)": _zoo("gpt"),
}
MODES = ("train", "inference")
# (model, compile mode) pairs beyond the default mode: autotuning changes the plan (GEMM templates)
AUTOTUNED = (("nanogpt (2 blocks, t=128, d=256)", "max-autotune-no-cudagraphs"),
             ("mlp (LayerNorm, GELU, 1024 wide)", "max-autotune-no-cudagraphs"),
             ("gpt (zoo, debug: SDPA)", "max-autotune-no-cudagraphs"))


@dataclass(frozen=True)
class Row:
    model: str
    compile_mode: str  # "default" or torch.compile's mode
    mode: str  # train / inference
    batch: int
    predicted: int  # estimator.report(..., compile=...)
    measured: int  # the compiled step
    eager_measured: int  # the same step eager
    eager_predicted: int  # estimator.report(...) eager: fxmem's answer for a compiled model before

    @property
    def error(self) -> float:
        return 100 * (self.predicted - self.measured) / self.measured

    @property
    def compiled_vs_eager(self) -> float:
        return 100 * (self.measured - self.eager_measured) / self.eager_measured

    @property
    def eager_error(self) -> float:
        return 100 * (self.eager_predicted - self.measured) / self.measured


def _build(name: str):
    torch.manual_seed(0)
    return MODELS[name]()


def run_case(name: str, mode: str, batch: int, compile_mode: str | None = None) -> Row:
    """One row (module docstring); every model and sample built afresh from the same seed."""
    compile_ = {"mode": compile_mode}
    model, make_sample, loss_fn = _build(name)
    predicted = estimator.report(model, make_sample(batch), mode=mode, loss_fn=loss_fn, device="cpu",
                                 compile=compile_).peak_bytes
    eager_predicted = estimator.report(model, make_sample(batch), mode=mode, loss_fn=loss_fn, device="cpu").peak_bytes
    model, make_sample, loss_fn = _build(name)
    torch._dynamo.reset()  # this batch size compiles its own program
    measured = measure_cpu(torch.compile(model, mode=compile_mode), make_sample(batch), mode=mode,
                           loss_fn=loss_fn).peak_bytes
    model, make_sample, loss_fn = _build(name)
    eager = measure_cpu(model, make_sample(batch), mode=mode, loss_fn=loss_fn).peak_bytes
    return Row(name, compile_mode or "default", mode, batch, predicted, measured, eager, eager_predicted)


def cases(only: str | None = None):
    """(model, mode, compile mode) of every row, ``only`` filtering by the model's name."""
    found = [(name, mode, None) for name in MODELS for mode in MODES]
    found += [(name, "train", compile_mode) for name, compile_mode in AUTOTUNED]
    return [c for c in found if only is None or only.lower() in c[0].lower()]


def to_markdown(found: list[Row], command: str) -> str:
    errors = [abs(r.error) for r in found]
    eager_errors = [abs(r.eager_error) for r in found]
    lines = [
        MARKS[0],
        "## Compiled steps (`report(..., compile=...)`)",
        "",
        ("`torch.compile`d steps (Inductor, CPU) predicted by running the compiled program on fake tensors: Dynamo's "
         "graphs, AOTAutograd's partition of forward and backward, Inductor's generated wrapper with its buffers "
         "allocated and freed as it writes them, the kernels not run (`estimator/capture/compiled.py`). Measured: the "
         "same model compiled with `torch.compile(model, mode=...)`, Dynamo reset first so each batch size compiles "
         "its own program, one warm-up step, then the measured step (the CPU allocator's events). *Eager* is the same "
         "step without `torch.compile`, measured; *eager estimate* is what fxmem answers for the model eager (what it "
         f"answered for a compiled model before). Target: within {TOLERANCE_PCT:g} % on every row."),
        "",
        f"Reproduce: `{command}`",
        "",
        (f"**{len(found)} cases: median |error| {statistics.median(errors):.3f} %, max |error| {max(errors):.3f} % "
         f"(the eager estimate: median {statistics.median(eager_errors):.1f} %, max {max(eager_errors):.1f} %).**"),
        "",
        "| model | compile mode | mode | b | predicted (B) | measured (B) | error | eager measured (B) | "
        "compiled vs eager | eager estimate's error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r.model} | {r.compile_mode} | {r.mode} | {r.batch} | {r.predicted:,} | {r.measured:,} | "
              f"{r.error:+.3f} % | {r.eager_measured:,} | {r.compiled_vs_eager:+.1f} % | {r.eager_error:+.1f} % |"
              for r in found]
    return "\n".join(lines) + "\n" + MARKS[1] + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.compiled", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the models whose name contains this text (does not write the docs)")
    parser.add_argument("--batches", nargs="*", type=int, help=f"default: {BATCHES}, and {WIDE_BATCHES} for the MLPs")
    parser.add_argument("--markdown", type=Path, default=Path("docs/validation.md"))
    parser.add_argument("--json", type=Path, default=Path("docs/validation-compiled.json"))
    args = parser.parse_args(argv)
    found = []
    for name, mode, compile_mode in cases(args.only):
        batches = args.batches or BATCHES + (WIDE_BATCHES if name.startswith("mlp") else ())
        for b in batches:
            row = run_case(name, mode, b, compile_mode)
            print(f"{row.model:34s} {row.compile_mode:27s} {row.mode:9s} b={b:<3d} predicted {row.predicted:>12,} "
                  f"measured {row.measured:>12,} {row.error:+.3f} % (compiled vs eager {row.compiled_vs_eager:+.1f} %)",
                  flush=True)
            found.append(row)
    if args.only is None:
        write_section(args.markdown, to_markdown(found, "python -m validators.compiled"), MARKS)
        args.json.write_text(json.dumps([asdict(r) | {"error_pct": r.error} for r in found], indent=1) + "\n")
    return 0 if all(abs(r.error) <= TOLERANCE_PCT for r in found) else 1


def kept(path: Path) -> str:
    """This section of ``path`` ('' if none): what ``python -m validators`` keeps."""
    return kept_section(path, MARKS)


if __name__ == "__main__":
    sys.exit(main())
