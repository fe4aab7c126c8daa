"""``report(mode="generate")``: transformers' ``model.generate()`` (prefill, then a decode step per
new token) against the same call measured on CPU, the KV cache as its own category, the formula
in the prompt length on the CUDA target, the command line and the refusals.

The full grid (three models, both caches, three (s, n), b = 2 and 8) is
``python -m validators.generate`` (docs/validation.md, "Generation"); these are a few of its cases.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import estimator
from estimator import Category
from estimator.capture import steps
from estimator.cli import cli
from estimator.vocab.errors import CaptureError, InputError

pytest.importorskip("transformers")
from validators import generate as gen  # noqa: E402 (needs transformers)
from validators.cpu import measure_user_step  # noqa: E402

TOLERANCE_PCT = 0.5  # the bar; every case here measures exact to the byte


@pytest.mark.parametrize("name, cache, s, n", [
    ("gpt2", None, 8, 4),  # multi-head attention, DynamicCache (torch.cat at every step)
    ("llama", "static", 8, 4),  # grouped-query attention, a StaticCache sized at the prefill
    ("mixtral", None, 8, 3),  # experts: the routed tokens' sizes and values from the probe
])
def test_generate_matches_the_measured_call(name, cache, s, n):
    for row in gen.run_case(name, cache, s, n, batches=(2, 5)):
        assert abs(row.error) <= TOLERANCE_PCT, row
        assert row.predicted == row.measured, row  # exact to the byte today


def test_kv_cache_is_its_own_category():
    """Llama (2 layers, 2 key/value heads of head_dim 64 / 4 = 16, fp32): keys and values are
    2 x 2 layers x 2 heads x 16 x 4 B = 512 B per token and sequence.  A dynamic cache after the
    last call holds s + n - 1 tokens (the last new token's keys are never computed): 8 + 4 - 1 = 11."""
    rep = estimator.report(gen.make_model("llama"), gen.make_sample(2, 8), mode="generate", new_tokens=4,
                           device="cpu", batch=3)
    g = rep.generation
    assert (g.new_tokens, g.prompt_tokens, g.cache, g.kv_bytes_per_token, g.cache_tokens) == (
        4, 8, "DynamicCache", 512, 11)
    assert g.kv_bytes(3) == 3 * 11 * 512
    assert rep.mode is estimator.Mode.GENERATE
    # the cache at the peak is a multiple of whole tokens of whole sequences: 512 B x tokens x b
    kv = rep.breakdown_formula[Category.KV_CACHE]
    assert kv.coeff(1) % 512 == 0 and kv(3) == rep.breakdown[Category.KV_CACHE] > 0
    assert any(note.startswith("generate: the peak is in") for note in rep.notes)
    assert json.loads(rep.to_json())["generation"]["kv_bytes_per_token"] == 512


def _small_vocab_gpt2():
    """A vocabulary of 64: the logits stay small, so the growing cache puts the peak in the last
    decode step (with the validator's 1,000 tokens, these short runs peak in the prefill)."""
    from estimator.integrations._common import import_optional

    transformers = import_optional("transformers", "test")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=64)
    sample = {"input_ids": torch.randint(0, 64, (2, 2)), "attention_mask": torch.ones(2, 2, dtype=torch.long)}
    return transformers.GPT2LMHeadModel(config).eval(), sample


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fewer_new_tokens_from_one_report(device):
    """A dynamic cache's run of n' < n tokens is the run of n up to its n'-th decode step:
    ``at``/``max_batch``/``fits(new_tokens=n')`` equal a separate report's, on both targets."""
    model, sample = _small_vocab_gpt2()
    rep = estimator.report(model, sample, mode="generate", new_tokens=10, device=device)
    other = estimator.report(model, sample, mode="generate", new_tokens=6, device=device)
    assert (rep.generation.where, other.generation.where) == ("decode step 9 of 9", "decode step 5 of 5")
    for b in (2, 9):
        assert rep.at(b, new_tokens=6) == other.at(b) < rep.at(b)
    if device == "cpu":  # 1 MiB: 13,504 B per sequence over 433,180 B, 6 tokens (the 10 tokens': 17,664 B)
        assert rep.max_batch("1MiB", new_tokens=6) == other.max_batch("1MiB") == (2**20 - 433180) // 13504 == 45
        assert rep.max_batch("1MiB") == (2**20 - 433180) // 17664 == 34
        assert rep.fits("1MiB", b=45, new_tokens=6) and not rep.fits("1MiB", b=45)
    else:  # device memory: the allocator replay, whose reserved bytes grow in 2 MiB (and 20 MiB) steps
        budget = other.on_device(200).device
        assert rep.max_batch(budget, new_tokens=6) == other.max_batch(budget) >= 200
        assert rep.fits(budget, b=200, new_tokens=6)
    with pytest.raises(InputError, match="goes further"):
        rep.at(2, new_tokens=11)


def test_static_cache_remembers_a_longer_generation():
    """transformers sizes a StaticCache for the longest generation the model object has run
    (``_previous_max_cache_length``): fxmem's copy of the model carries it, and says so."""
    model = gen.make_model("gpt2")
    measure_user_step(model, gen.make_sample(2, 16), steps.Generation(8, "static"), None, "generate")
    rep = estimator.report(model, gen.make_sample(2, 8), mode="generate", new_tokens=3,
                           cache_implementation="static", device="cpu")
    assert rep.generation.cache_tokens == 16 + 8 - 1  # not 8 + 3 - 1: the earlier, longer call's
    assert any("_previous_max_cache_length" in note for note in rep.notes)


def test_prompt_length_symbolic_on_cuda():
    """With ``dynamic=`` the CUDA target's formula is in b and s (no host-measured kernel there):
    at another prompt length it equals a separate capture at that length."""
    dynamic = {"input_ids": {1: "s"}, "attention_mask": {1: "s"}}
    rep = estimator.report(gen.make_model("gpt2"), gen.make_sample(2, 8), mode="generate", new_tokens=3,
                           device="cuda", dynamic=dynamic)
    assert estimator.S in rep.peak.free_symbols
    other = estimator.report(gen.make_model("gpt2"), gen.make_sample(2, 20), mode="generate", new_tokens=3,
                             device="cuda")
    for b in (2, 7):
        assert rep.peak.subs({estimator.B: b, estimator.S: 20}) == other.peak.subs(estimator.B, b)


def test_command_line(tmp_path):
    """``fxmem report transformers:DIR --generate N``: the prompt is the sample's input_ids with a
    mask of ones (its labels dropped)."""
    from estimator.integrations._common import import_optional

    transformers = import_optional("transformers", "test")
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=500, n_positions=64).save_pretrained(tmp_path)
    args = ["report", f"transformers:{tmp_path}", "--generate", "3", "--seq-len", "8", "--batch", "2",
            "--device-init", "cpu", "--device", "cpu", "--json", "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["mode"] == "generate"
    # 1 layer x (keys + values) x 2 heads x head_dim 16 x 4 B = 256 B per token; 8 + 3 - 1 tokens
    assert (data["generation"]["kv_bytes_per_token"], data["generation"]["cache_tokens"]) == (256, 10)
    meta = CliRunner().invoke(cli, args[:args.index("--device-init")] + args[args.index("--device-init") + 2:])
    assert meta.exit_code == 0 and "{" in meta.output, meta.output  # built on the meta device: a narrow stand-in answers generate()'s values
    assert json.loads(meta.output[meta.output.index("{"):])["peak_bytes"] == data["peak_bytes"]
    result = CliRunner().invoke(cli, ["report", "mlp", "--cache", "static", "-q"])
    assert result.exit_code == 2 and "--generate" in result.output
    result = CliRunner().invoke(cli, ["report", "mlp", "--generate", "2", "--accumulate", "2", "-q"])
    assert result.exit_code == 2 and "drop --accumulate" in result.output


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "generate"}, "needs new_tokens="),
    ({"mode": "generate", "new_tokens": 0}, "new_tokens must be a positive int"),
    ({"mode": "generate", "new_tokens": 2, "cache_implementation": "paged"}, "cache_implementation must be"),
    ({"mode": "train", "new_tokens": 2}, "belongs to mode='generate'"),
    ({"mode": "generate", "new_tokens": 2, "step": lambda m, s, o: None}, "step= with mode='inference'"),
    ({"mode": "generate", "new_tokens": 2, "amp": "bf16"}, "drop amp"),
    ({"mode": "generate", "new_tokens": 2, "sample": torch.zeros(2, 8, dtype=torch.long)}, "a dict with 'input_ids'"),
    ({"mode": "generate", "new_tokens": 2, "model": torch.nn.Linear(4, 4)}, "needs a model with generate()"),
])
def test_refusals(kwargs, message):
    kwargs = {"model": gen.make_model("gpt2"), "sample": gen.make_sample(2, 8), "device": "cpu", **kwargs}
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        estimator.report(**kwargs)


def test_meta_weights(monkeypatch):
    """``generate()`` asks values fake tensors cannot know (is a prompt padded, has every
    sequence finished); with the weights on the meta device a narrow stand-in (same class, config
    and layers, width 64) answers them: they depend on the mask and the token count only, so the
    report equals the one of the same model with real weights."""
    real = estimator.report(gen.make_model("llama"), gen.make_sample(2, 8), mode="generate", new_tokens=3,
                            device="cpu")
    with torch.device("meta"):
        model = gen.make_model("llama")
    rep = estimator.report(model, gen.make_sample(2, 8), mode="generate", new_tokens=3, device="cpu")
    assert rep.peak == real.peak and rep.breakdown == real.breakdown
    assert any("narrow stand-in" in note for note in rep.notes)
    from estimator.capture import generation

    monkeypatch.setattr(generation, "narrow_stand_in", lambda model: None)  # a config it cannot narrow
    with pytest.raises(CaptureError, match="--device-init cpu"):
        estimator.report(model, gen.make_sample(2, 8), mode="generate", new_tokens=3, device="cpu")


def test_meta_weights_are_captured_once(monkeypatch):
    """``generate()`` reads whether every sequence has finished after each call of the model, so
    the values come first (here from the narrow stand-in's run): one capture, not a first one that
    stops at that value after the warm-up and the prompt (seconds on an 8B config)."""
    from estimator.capture import trace

    calls = []
    capture = trace._capture
    monkeypatch.setattr(trace, "_capture", lambda *args, **kwargs: calls.append(1) or capture(*args, **kwargs))
    with torch.device("meta"):
        model = gen.make_model("llama")
    estimator.report(model, gen.make_sample(2, 8), mode="generate", new_tokens=3, device="cpu")
    assert len(calls) == 1


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_warm_up_is_the_prefill_alone(device, monkeypatch):
    """The warm-up before the capture is one call of the model (the prefill): its loop must not
    read whether every sequence has finished, whose answers (the probe's) go on for the captured
    run's calls (it ran all of them: 3.5 s of Llama-3-8B's capture)."""
    from estimator.capture import trace

    calls = []  # of the model, in each warm-up (one per capture)
    warm_up = trace._user_warm_up

    def counted(fmodel, *args, **kwargs):
        calls.append(0)
        hook = fmodel.register_forward_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))
        try:
            return warm_up(fmodel, *args, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(trace, "_user_warm_up", counted)
    with torch.device(device):
        model = gen.make_model("llama")
    estimator.report(model, gen.make_sample(2, 8), mode="generate", new_tokens=12, device="cpu")
    assert calls and set(calls) == {1}


def test_the_capture_that_stopped_at_a_value_is_not_kept_alive():
    """A capture that stops at a data-dependent value (``NeedsProbe``: here a branch on the
    weights' output) is run again with the probe's values.  Raised from a local name, the
    exception, its traceback and the raising frame made a cycle that kept the stopped capture's
    frames alive, and through their callers the finished capture (a long ``generate()``'s million
    recorded ops, 0.7 GB at 512 new tokens of Llama-3-8B) until the cyclic collector ran, which
    fxmem pauses after a capture: with the collector off, no ``NeedsProbe`` may outlive the report."""
    import gc

    from estimator.capture import datadep

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.linear(x)
            return y * 2 if (y > 0).any() else y

    gc.collect()
    gc.disable()
    try:
        estimator.report(Scaled(), torch.ones(4, 8), device="cpu")
        alive = [o for o in gc.get_objects() if isinstance(o, datadep.NeedsProbe)]
    finally:
        gc.enable()
    assert alive == []


def _families():
    """Tiny configs of the families whose generate() reads values only for several rows (the
    right-padding check with a pad token set), seed 0."""
    from estimator.compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    import transformers as t

    v = gen.VOCAB
    gqa = dict(vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)
    return {
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**gqa, pad_token_id=0)),
        "phi3": (t.Phi3ForCausalLM, t.Phi3Config(**gqa, pad_token_id=0)),
        "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(**gqa, head_dim=16)),
        "opt": (t.OPTForCausalLM, t.OPTConfig(vocab_size=v, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                              num_attention_heads=4, word_embed_proj_dim=64)),
        "falcon": (t.FalconForCausalLM, t.FalconConfig(vocab_size=v, hidden_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4)),
    }


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma2", "opt", "falcon"])
def test_generate_at_batch_one_matches_the_measured_call(family):
    """b = 1 is captured with b hinted at 2: the probe runs on the prompt twice, so the values a
    two-row generate() reads exist; the report at b = 1 is a capture of b = 1 itself."""
    cls, config = _families()[family]

    def make():
        torch.manual_seed(0)
        return cls(config).eval()

    sample = gen.make_sample(1, 8)
    rep = estimator.report(make(), sample, mode="generate", new_tokens=4, device="cpu")
    measured = measure_user_step(make(), sample, steps.Generation(4, None), None, "generate")
    assert rep.peak_bytes == measured.peak_bytes
