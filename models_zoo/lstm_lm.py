"""LSTM language model: embedding -> nn.LSTM (batch_first) -> Linear head with bias over the vocab.

The head sees the LSTM's output as PyTorch returns it: ``batch_first`` runs the recurrence on the
``(T, B, H)`` layout and hands back its transpose, a non-contiguous ``(B, T, H)`` view (strides
``(H, B*H, 1)``).  ``F.linear`` then takes ``matmul`` + ``output.add_(bias)`` in place
(aten/src/ATen/native/Linear.cpp), the branch the fake run would not take by itself
(``estimator/corrections/composite.py``): the logits are the largest tensor of the step.

Sample: dict {"input_ids": (B, T) int64}; loss is next-token cross-entropy.
"""

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    vocab_size: int = 512  # token ids; the head's output width
    seq_len: int = 16  # sample length T
    embed_dim: int = 32  # embedding width
    hidden: int = 64  # LSTM hidden size
    layers: int = 1  # stacked LSTM layers, one fused module


SIZES: dict[str, Config] = {
    "debug": Config(),
    "small": Config(vocab_size=16384, seq_len=64, embed_dim=256, hidden=512, layers=2),
}


class LSTMLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        self.lstm = nn.LSTM(cfg.embed_dim, cfg.hidden, num_layers=cfg.layers, batch_first=True)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, _ = self.lstm(self.embed(input_ids))  # (B, T, H), a transposed (T, B, H) buffer
        return self.head(x)  # (B, T, vocab_size)


def make(cfg: Config):
    return LSTMLM(cfg), partial(_common.token_sample, cfg.vocab_size, cfg.seq_len), _common.lm_loss
