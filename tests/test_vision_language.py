"""A LLaVA-style vision-language model (transformers ``LlavaForConditionalGeneration``: a CLIP
vision tower, a projector, a Llama) in training, inference and ``generate()``, against the CPU
allocator (tolerance: 0 B), and the user's model unchanged by ``report()``.

transformers 5 collects the vision tower's ``hidden_states`` through forward hooks it installs
on first use (and marks the model): the probe (a real forward, ``data_dependent='sample'``) used
to take every hook out, so a model already used raised IndexError; and it left the hooks it made
installed on the user's model."""

from __future__ import annotations

import pytest
import torch

import estimator
from estimator.capture import steps
from validators.cpu import measure_cpu, measure_user_step

transformers = pytest.importorskip("transformers")
from validators.outside import llava as _make  # noqa: E402 (needs transformers)
from validators.outside import llava_sample as _sample


def _state(model):
    return ([(len(m._forward_hooks), len(m._forward_pre_hooks), sorted(m.__dict__)) for m in model.modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize("data_dependent", ["max", "sample"])
def test_llava_matches_the_allocator_and_leaves_the_model_as_it_was(mode, data_dependent):
    model = _make()
    with torch.no_grad():  # a model already used: transformers' capturing hooks are installed
        model(**_sample(2, labels=False))
    before, rng = _state(model), torch.get_rng_state()
    rep = estimator.report(model, _sample(2), mode=mode, device="cpu", data_dependent=data_dependent)
    assert rep.peak_bytes == measure_cpu(_make(), _sample(2), mode=mode).peak_bytes
    after = _state(model)
    assert after[0] == before[0] and all(torch.equal(after[1][k], v) for k, v in before[1].items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_probe_installs_nothing_on_a_fresh_model():
    model = _make()
    before = _state(model)[0]
    estimator.report(model, _sample(2), mode="inference", device="cpu", data_dependent="sample")
    assert _state(model)[0] == before


@pytest.mark.parametrize("b", [1, 2])
def test_llava_generate(b):
    rep = estimator.report(_make().eval(), _sample(b, labels=False), mode="generate", new_tokens=3, device="cpu")
    measured = measure_user_step(_make().eval(), _sample(b, labels=False), steps.Generation(3, None), None, "generate")
    assert rep.peak_bytes == measured.peak_bytes
