"""transformers models by Hugging Face Hub id: only config.json, from the local HF cache here.

No network: HF_HUB_OFFLINE=1 and HF_HUB_CACHE a tmp folder laid out as huggingface_hub 2.4 lays
it out (file_download.py: ``models--org--name/refs/<revision>`` holds the commit,
``models--org--name/snapshots/<commit>/config.json`` the file).  huggingface_hub reads both
variables at import (constants.py), so the in-process tests patch its ``constants`` too; the CLI
test sets the variables for a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import estimator
from estimator import InputError, integrations
from estimator.integrations import _common

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # 40 hex digits, as a real commit
TINY = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 16, "tie_word_embeddings": False}
# embed 128*32 + lm_head 32*128 + final norm 32 + 2 layers of (q 32*32, k and v 32*16 each (2 kv
# heads of 8), o 32*32, gate, up and down 32*64 each, two norms 2*32) = 8_224 + 2 * 9_280 = 26_784
PARAMS = 128 * 32 + 32 * 128 + 32 + 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline, empty HF cache (in the environment and in huggingface_hub's constants)."""
    try:
        _common.import_optional("transformers", "transformers")
        from huggingface_hub import constants
    except (InputError, ImportError) as exc:
        pytest.skip(f"transformers is not usable here: {exc}")
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _cache_llama(cache: Path, repo_id: str = "org/tiny-llama", revision: str = "main") -> Path:
    from transformers import LlamaConfig

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / revision).write_text(COMMIT)
    LlamaConfig(architectures=["LlamaForCausalLM"], **TINY).to_json_file(str(snapshot / "config.json"))
    return snapshot


def test_a_cached_hub_config_builds_as_its_local_folder(hub_cache):
    snapshot = _cache_llama(hub_cache)
    model, sample, _ = integrations.build("transformers", "org/tiny-llama", batch=2)
    assert type(model).__name__ == "LlamaForCausalLM" and sample["input_ids"].shape == (2, 16)
    assert sum(p.numel() for p in model.parameters()) == PARAMS
    local, local_sample, _ = integrations.build("transformers", str(snapshot), batch=2)
    peak = estimator.report(model, sample, batch=2, device="cpu").peak_bytes
    assert peak == estimator.report(local, local_sample, batch=2, device="cpu").peak_bytes
    # A revision names a ref of the cache; overrides apply as to a local folder.
    _cache_llama(hub_cache, "org/pinned", revision="v1")
    model, _, _ = integrations.build("transformers", "org/pinned@v1", batch=2, overrides={"num_hidden_layers": 1})
    assert model.config.num_hidden_layers == 1


def test_offline_without_the_config_cached_says_how_to_pass_one(hub_cache):
    with pytest.raises(InputError, match=r"(?s)'meta-llama/Llama-3\.1-8B': its config\.json is not in the local "
                                         r"Hugging Face cache at .*hub and HF_HUB_OFFLINE is set.*HF_HUB_OFFLINE=0.*"
                                         r"folder holding the model's config\.json"):
        integrations.build("transformers", "meta-llama/Llama-3.1-8B", batch=2)
    _cache_llama(hub_cache)
    with pytest.raises(InputError, match=r"'org/tiny-llama@v2': its config\.json is not in the local"):
        integrations.build("transformers", "org/tiny-llama@v2", batch=2)  # a revision not cached


def test_a_local_folder_wins_over_a_hub_id(hub_cache, tmp_path, monkeypatch):
    from transformers import LlamaConfig

    (tmp_path / "org" / "tiny").mkdir(parents=True)
    LlamaConfig(**{**TINY, "num_hidden_layers": 1}).to_json_file(str(tmp_path / "org" / "tiny" / "config.json"))
    monkeypatch.chdir(tmp_path)
    model, _, _ = integrations.build("transformers", "org/tiny", batch=2)  # nothing cached: the folder
    assert model.config.num_hidden_layers == 1


@pytest.mark.parametrize(("error", "message"), [
    ("GatedRepoError", r"gated Hugging Face repo: .*HF_TOKEN"),
    ("RepositoryNotFoundError", r"no Hugging Face repo 'org/x' \(or it is private: huggingface_hub sends HF_TOKEN"),
    ("RemoteEntryNotFoundError", r"'org/x' has no config\.json"),
])
def test_hub_errors_are_input_errors(hub_cache, monkeypatch, error, message):
    import importlib

    import huggingface_hub
    from huggingface_hub import errors
    from huggingface_hub.errors import Response  # the HTTP client's Response huggingface_hub uses

    client = importlib.import_module(Response.__module__.split(".")[0])  # httpx2 in huggingface_hub 2.4

    def refused(*args, **kwargs):  # what hf_hub_download raises for such a repo (no request is made)
        status = 404 if error != "GatedRepoError" else 401
        response = Response(status)
        response.request = client.Request("GET", "https://huggingface.co/org/x/resolve/main/config.json")
        raise getattr(errors, error)("refused", response=response)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused)
    with pytest.raises(InputError, match=message):
        integrations.build("transformers", "org/x", batch=2)


def test_cli_reports_a_cached_hub_id(hub_cache):
    _cache_llama(hub_cache)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "estimator", "report", "transformers:org/tiny-llama", "--batch", "2",
                          "--json", "-q"], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    report = json.loads(run.stdout)
    assert report["model"] == "LlamaForCausalLM" and report["batch"] == 2
    assert report["breakdown"]["parameters"] == 4 * PARAMS  # float32: the cached config's sizes
