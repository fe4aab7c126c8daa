"""Helpers shared by the zoo models: sample generation and loss pieces."""

import torch
import torch.nn.functional as F

SEED = 0  # fixed so make_sample(b) returns identical tensors on every call


def generator() -> torch.Generator:
    """A fresh CPU generator, so samples never touch (or depend on) the global RNG."""
    return torch.Generator(device="cpu").manual_seed(SEED)


def check_batch(batch) -> int:
    # bool is an int subclass; make_sample(True) is almost certainly a bug
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    return batch


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(), device="cpu", dtype=torch.float32)


def randint(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=generator(), device="cpu", dtype=torch.int64)


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal LM loss: position t predicts token t+1, so the last logit has no target."""
    logits = logits[:, :-1, :]  # (B, T-1, V)
    targets = input_ids[:, 1:]  # (B, T-1)
    # float32 upcast: fp16/bf16 softmax over a large vocab loses too much precision
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def token_sample(vocab_size: int, seq_len: int, batch: int) -> dict[str, torch.Tensor]:
    """The causal language models' sample: ``{"input_ids": (batch, seq_len) int64}``."""
    check_batch(batch)
    return {"input_ids": randint(vocab_size, batch, seq_len)}


def lm_loss(output: torch.Tensor, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal language models' loss: next-token cross-entropy on the sample's ids."""
    return next_token_loss(output, sample["input_ids"])
