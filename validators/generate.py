"""``python -m validators.generate``: ``report(mode="generate")`` against the real ``generate()``
measured on CPU; writes the "Generation" section of docs/validation.md.

Each row: ``estimator.report(model, sample, mode="generate", new_tokens=n,
cache_implementation=...)`` once per model, cache and (prompt length s, new tokens n), evaluated
at each batch size b with ``Report.at(b)``, against ``validators.cpu.measure_user_step`` running
``model.generate(**sample, max_new_tokens=n, min_new_tokens=n, do_sample=False)`` (the same
``estimator.capture.steps.Generation``) on a fresh model of the same config: one unmeasured call, then the
measured one, as the estimate's steady state.  The models are tiny transformers configs built
from code (random weights): GPT-2 (multi-head attention), Llama (grouped-query attention: 4
query heads, 2 key/value heads) and Mixtral (a mixture of experts, 4 experts, top-2 routing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import estimator
from estimator.capture import steps
from estimator.integrations._common import import_optional
from validators.cpu import measure_user_step
from validators.strategies import kept_section, write_section

MARKS = ("<!-- generate -->", "<!-- /generate -->")
VOCAB = 1000
# (prompt length s, new tokens n): a short and a longer prompt, and a long generation whose peak
# is in the decode steps (the cache outgrows the prefill's temporaries)
LENGTHS = ((8, 4), (32, 16), (8, 48))
BATCHES = (2, 8)
CACHES = (None, "static")


def _configs() -> dict:
    transformers = import_optional("transformers", "the generation validation")
    return {
        "gpt2": (transformers.GPT2LMHeadModel,
                 transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128)),
        "llama": (transformers.LlamaForCausalLM,
                  transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                           num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB)),
        # eager attention: no kernel measured on the host, so n > 6 takes the decode steps built from 6 calls
        "llama-eager": (transformers.LlamaForCausalLM,
                        transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                                                 attn_implementation="eager")),
        "mixtral": (transformers.MixtralForCausalLM,
                    transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                               num_local_experts=4, num_experts_per_tok=2)),
    }


MODELS = ("gpt2", "llama", "llama-eager", "mixtral")


def make_model(name: str) -> torch.nn.Module:
    """A fresh tiny model of ``name`` (random weights, seed 0), in eval mode."""
    cls, config = _configs()[name]
    torch.manual_seed(0)
    return cls(config).eval()


def make_sample(b: int, s: int) -> dict[str, torch.Tensor]:
    """``b`` prompts of ``s`` tokens, no padding."""
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long)}


@dataclass(frozen=True)
class Row:
    model: str
    cache: str
    prompt: int
    new_tokens: int
    batch: int
    predicted: int
    measured: int
    peak_in: str
    kv_bytes_per_token: int
    decode_steps: str = "captured"  # "captured": every call; "built": from a 6-call run (capture/decode_steps.py)

    @property
    def error(self) -> float:
        return 100 * (self.predicted - self.measured) / self.measured


def run_case(name: str, cache: str | None, s: int, n: int, batches=BATCHES, device: str = "cpu") -> list[Row]:
    """One report of ``name`` generating ``n`` tokens after ``s``, evaluated and measured at each
    of ``batches``."""
    rep = estimator.report(make_model(name), make_sample(batches[0], s), mode="generate", new_tokens=n,
                           cache_implementation=cache, device=device)
    built = "built" if any("calls of the model from a run of" in note for note in rep.notes) else "captured"
    rows = []
    for b in batches:
        measured = measure_user_step(make_model(name), make_sample(b, s), steps.Generation(n, cache), None, "generate")
        rows.append(Row(name, cache or "dynamic", s, n, b, rep.at(b), measured.peak_bytes, rep.generation.where,
                        rep.generation.kv_bytes_per_token, built))
    return rows


def rows(only: str | None = None):
    for name in MODELS:
        if only is None or only.lower() in name:
            for cache in CACHES:
                for s, n in LENGTHS:
                    yield from run_case(name, cache, s, n)


def to_markdown(found: list[Row], command: str) -> str:
    errors = [abs(r.error) for r in found]
    lines = [
        MARKS[0],
        "## Generation (`report(mode=\"generate\")`)",
        "",
        ("`model.generate(**sample, max_new_tokens=n, min_new_tokens=n, do_sample=False)` of tiny transformers "
         "models built from code (GPT-2: multi-head attention; Llama: grouped-query attention, 2 key/value heads "
         "for 4 query heads, with SDPA and with eager attention; Mixtral: 4 experts, top-2), with the default dynamic "
         "cache and `cache_implementation=\"static\"`. One report per model, cache and (s, n), evaluated at each b; "
         "measured by `validators.cpu.measure_user_step` running the same call (one unmeasured call, then the "
         "measured one). \"peak in\" is where the predicted peak is: the prefill or a decode step. \"decode steps\": "
         "*built* from a run of 6 calls of the model, the repetition proved (`estimator/capture/decode_steps.py`), "
         "or *captured* one by one (n <= 6, or a dynamic cache beside the CPU's SDPA kernel, measured on the host per "
         "call, its buffers following the cache's length)."),
        "",
        f"Reproduce: `{command}`",
        "",
        (f"**{len(found)} cases: median |error| {statistics.median(errors):.3f} %, max |error| {max(errors):.3f} %.**"),
        "",
        "| model | cache | s | n | b | KV B/token | predicted (B) | measured (B) | error | peak in | decode steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    lines += [f"| {r.model} | {r.cache} | {r.prompt} | {r.new_tokens} | {r.batch} | {r.kv_bytes_per_token:,} | "
              f"{r.predicted:,} | {r.measured:,} | {r.error:+.3f} % | {r.peak_in} | {r.decode_steps} |" for r in found]
    return "\n".join(lines) + "\n" + MARKS[1] + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validators.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the models whose name contains this text (does not write the docs)")
    parser.add_argument("--markdown", type=Path, default=Path("docs/validation.md"))
    parser.add_argument("--json", type=Path, default=Path("docs/validation-generate.json"))
    args = parser.parse_args(argv)
    found = []
    for row in rows(args.only):
        print(f"{row.model:8s} {row.cache:8s} s={row.prompt:<3d} n={row.new_tokens:<3d} b={row.batch:<3d} "
              f"predicted {row.predicted:>12,} measured {row.measured:>12,} {row.error:+.3f} % ({row.peak_in})",
              flush=True)
        found.append(row)
    if args.only is None:
        write_section(args.markdown, to_markdown(found, "python -m validators.generate"), MARKS)
        args.json.write_text(json.dumps([asdict(r) | {"error_pct": r.error} for r in found], indent=1) + "\n")
    return 0


def kept(path: Path) -> str:
    """This section of ``path`` ('' if none): what ``python -m validators`` keeps."""
    return kept_section(path, MARKS)


if __name__ == "__main__":
    sys.exit(main())
