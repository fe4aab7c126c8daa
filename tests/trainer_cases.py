"""What tests/test_trainer_step.py and tests/test_training_args.py share: a tiny GPT-2 built from
its config (nothing downloaded) and a token dataset, as a real ``transformers.Trainer`` is given
them."""

from __future__ import annotations

import pytest
import torch

from estimator import InputError
from estimator.integrations import _common

S, VOCAB = 32, 512  # tokens per row, vocabulary


def needs_trainer() -> None:
    """Skip unless transformers imports here and accelerate (Trainer's requirement) is installed."""
    try:
        _common.import_optional("transformers", "transformers")
    except InputError as exc:
        pytest.skip(f"transformers is not usable here: {exc}")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")


def config(**overrides):
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                      eos_token_id=0, **overrides)


def gpt2(**overrides):
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(config(**overrides))


def dataset(n: int, seq: int = S) -> list[dict[str, torch.Tensor]]:
    """Token ids with labels = a copy of them (the collator stacks each key on its own)."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (seq,), generator=g) for _ in range(n)]
    return [{"input_ids": ids, "labels": ids.clone()} for ids in rows]


def batch_of(rows: list[dict[str, torch.Tensor]], b: int) -> dict[str, torch.Tensor]:
    """One collated batch of the first ``b`` rows (each key stacked on its own, as the default
    collator does)."""
    return {key: torch.stack([r[key] for r in rows[:b]]) for key in rows[0]}
