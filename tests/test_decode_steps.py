"""``generate()`` with many new tokens from a run of a few calls (``estimator/capture/decode_steps.py``):
the extended capture is the full capture, event for event (both paths compared on several model
families, both caches, both targets), it matches the real call measured on CPU, and every case
where the steps are not proven to repeat captures every step and says why."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

import estimator
from estimator.capture import decode_steps, steps, trace
from estimator.capture.decode_steps import CALLS, NotRepeating
from estimator.orchestrate.checked import check
from estimator.vocab.request import Request
from estimator.vocab.symbolic import S, Poly

transformers = pytest.importorskip("transformers")
from validators import generate as gen  # noqa: E402 (needs transformers)
from validators.cpu import measure_user_step  # noqa: E402

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=gen.VOCAB)


def _model(family: str, **config) -> torch.nn.Module:
    if family in gen.MODELS and not config:
        return gen.make_model(family)
    build = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
             "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
             "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config)}[family]
    torch.manual_seed(0)
    return build[0](build[1](**SMALL, **config)).eval()


def _both(model, sample, **kwargs):
    """The report as fxmem makes it, and with every decode step captured."""
    extended = estimator.report(model, sample, mode="generate", **kwargs)
    shortened = decode_steps.shortened
    decode_steps.shortened = lambda spec: None
    estimator.forget_captures()  # the extended capture is kept for the same step: capture it again
    try:
        full = estimator.report(model, sample, mode="generate", **kwargs)
    finally:
        decode_steps.shortened = shortened
    return extended, full


def _events(rep) -> tuple:
    """Everything of a report's timeline but the fx node names (the extension's steps name the
    nodes of the steps it was built from)."""
    t = rep.timeline
    ops = tuple((op.op, op.phase, op.module, op.live, op.allocated, op.scratch, op.total, op.owner) for op in t.ops)
    return t.baseline, ops, t.storages, t.owners, t.births, t.decoding


def _extended(rep) -> bool:
    return any(f"calls of the model from a run of {CALLS}" in note for note in rep.notes)


@pytest.mark.parametrize("family, config, cache, device, n", [
    ("llama", {}, None, "cuda", CALLS + 3),  # DynamicCache: torch.cat at every step
    ("llama", {}, "static", "cuda", CALLS + 3),  # StaticCache: sized for every token at the prefill, in place
    ("gpt2", {}, None, "cuda", CALLS + 1),  # one step built
    ("qwen2", {}, None, "cuda", CALLS + 3),
    ("mixtral", {}, None, "cuda", CALLS + 3),  # experts: routed sizes at their bound, the same at every step
    ("gemma2", {"head_dim": 16, "sliding_window": 8}, None, "cuda", CALLS + 3),  # alternating layers, window full
    ("llama", {"attn_implementation": "eager"}, "static", "cpu", CALLS + 3),  # no kernel measured on the host
])
def test_extended_capture_is_the_full_capture(family, config, cache, device, n):
    extended, full = _both(_model(family, **config), gen.make_sample(2, 16), new_tokens=n,
                           cache_implementation=cache, device=device)
    assert _extended(extended) and not _extended(full)
    assert _events(extended) == _events(full)
    assert (extended.peak, extended.valid_from, extended.valid_to, extended.guards) == \
        (full.peak, full.valid_from, full.valid_to, full.guards)
    assert extended.generation == full.generation
    if device == "cuda":
        assert extended.cuda == full.cuda


@pytest.mark.parametrize("cache", [None, "static"])
def test_extended_generate_matches_the_measured_call(cache):
    """24 new tokens from a run of 6 calls, against the real call on CPU (exact to the byte; the
    dynamic cache's peak is in the last decode step, which the extension built)."""
    model = _model("llama", attn_implementation="eager")
    rep = estimator.report(model, gen.make_sample(2, 8), mode="generate", new_tokens=24, device="cpu",
                           cache_implementation=cache)
    assert _extended(rep)
    if cache is None:
        assert rep.generation.where == "decode step 23 of 23"
    for b in (2, 5):
        measured = measure_user_step(model, gen.make_sample(b, 8), steps.Generation(24, cache), None, "generate")
        assert rep.at(b) == measured.peak_bytes


@pytest.mark.parametrize("family, config, sample, kwargs, why", [
    # the window (12) fills at the fourth call of a prompt of 8: the steps after it differ
    ("gemma2", {"head_dim": 16, "sliding_window": 12}, (2, 8), {"device": "cuda"}, "was still filling"),
    # the CPU flash attention kernel is measured per call: its buffers follow the cache length
    ("llama", {}, (2, 16), {"device": "cpu"}, "is measured on this host"),
])
def test_steps_not_proven_are_each_captured(family, config, sample, kwargs, why):
    rep = estimator.report(_model(family, **config), gen.make_sample(*sample), mode="generate",
                           new_tokens=CALLS + 2, **kwargs)
    assert not _extended(rep)
    assert any(f"every decode step was captured ({CALLS + 2} calls" in note and why in note for note in rep.notes)
    assert len(rep.timeline.decoding.calls) == CALLS + 2


def test_symbolic_prompt_length_moves_each_steps_guards():
    """With ``s`` a symbol each step adds ``s + k <= 2048`` (the stopping test against
    ``max_position_embeddings``): the built steps add theirs; the captured last step's guard, which
    a real last step does not add, makes the range one token shorter than the full capture's."""
    extended, full = _both(_model("llama"), gen.make_sample(2, 16), new_tokens=12, device="cuda",
                           dynamic={"input_ids": {1: "s"}, "attention_mask": {1: "s"}})
    assert _extended(extended) and _events(extended) == _events(full) and extended.peak == full.peak
    assert full.seq_range == (2, 2048 - 11) and extended.seq_range == (2, 2048 - 12)
    assert extended.guards == (*full.guards, "s + 12 <= 2048")


@pytest.fixture(scope="module")
def short_capture():
    """The shortened run of a 12-token generate() (the loop left after ``CALLS`` calls), as captured."""
    checked = check(Request(_model("llama"), gen.make_sample(2, 16), batch=2, mode="generate", new_tokens=12))
    spec = decode_steps.shortened(checked.capture_spec)
    assert spec.step.stop_after == CALLS and decode_steps.shortened(spec) is None
    return trace.capture(checked.model, checked.sample, spec, 2, symbolic=True)


def test_shortened_run_is_sized_for_every_token(short_capture):
    """The loop is left after ``CALLS`` calls, the sizes are the 12-token run's: the dynamic cache
    after the last call holds 16 + 6 - 1 tokens, one more at each call."""
    decoding = short_capture.decoding
    assert len(decoding.calls) == CALLS and (decoding.tokens, decoding.grown, decoding.steady_from) == (21, 1, 0)
    extended = decode_steps.extend(short_capture, 12)
    assert len(extended.decoding.calls) == 12 and extended.decoding.tokens == 16 + 12 - 1
    assert decode_steps.extend(short_capture, CALLS + 1).decoding.calls[:CALLS - 1] == decoding.calls[:CALLS - 1]


def _tampered(raw, segment: int, grown: Poly):
    """``raw`` with the first output of ``segment``'s first allocating op ``grown`` bytes larger."""
    start, stop = (*raw.decoding.calls, len(raw.ops))[segment:segment + 2]
    sid = next(op.allocs[0] for op in raw.ops[start:stop] if op.allocs)
    storages = dict(raw.storages)
    storages[sid] = dataclasses.replace(storages[sid], nbytes=storages[sid].nbytes + grown)
    return dataclasses.replace(raw, storages=storages)


def test_proof_failures_name_the_step(short_capture):
    raw = short_capture
    with pytest.raises(NotRepeating, match=r"aten\.embedding\.default in model\.embed_tokens at decode step 2: its "
                                           "bytes do not grow by the same amount"):
        decode_steps.extend(_tampered(raw, CALLS - 4, Poly.const(8)), 12)
    with pytest.raises(NotRepeating, match="last step's bytes are not one more step along the line"):
        decode_steps.extend(_tampered(raw, CALLS - 1, Poly.const(8)), 12)
    fewer = dataclasses.replace(raw, decoding=dataclasses.replace(raw.decoding, calls=raw.decoding.calls[:-1]))
    with pytest.raises(NotRepeating, match=f"called the model {CALLS - 1} times"):
        decode_steps.extend(fewer, 12)
    unknown = dataclasses.replace(raw, decoding=dataclasses.replace(raw.decoding, steady_from=None))
    with pytest.raises(NotRepeating, match="growth fxmem does not know"):
        decode_steps.extend(unknown, 12)
    once = [()] * CALLS
    once[CALLS - 3] = (sympy.Le(S + 3, 2048),)  # one proven step adds a guard the others do not
    with pytest.raises(NotRepeating, match=r"guards on s that do not move with the position: ; s \+ 3 <= 2048; $"):
        decode_steps.extend(dataclasses.replace(raw, call_guards=tuple(once)), 12)
