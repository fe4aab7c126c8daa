"""Recurrent language model: embedding -> 2-layer LSTM -> 1-layer GRU -> vocab.

Uses the fused nn.LSTM / nn.GRU modules (batch_first=True) so the recurrent
workspace they keep for backward is part of what gets measured.

Sample: dict {"input_ids": (B, T) int64}; loss is next-token cross-entropy.
"""

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    vocab_size: int = 128  # token ids
    seq_len: int = 16  # sample length T; RNNs have no max context
    embed_dim: int = 32  # embedding width
    hidden: int = 64  # LSTM and GRU hidden size
    lstm_layers: int = 2  # stacked LSTM layers, one fused module
    dropout: float = 0.2  # between embedding, LSTM layers, GRU and the output head


SIZES: dict[str, Config] = {
    "debug": Config(),
    "small": Config(vocab_size=10000, seq_len=64, embed_dim=512, hidden=512),
}


class RNNLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.lstm = nn.LSTM(
            cfg.embed_dim, cfg.hidden, num_layers=cfg.lstm_layers, dropout=cfg.dropout, batch_first=True
        )
        self.gru = nn.GRU(cfg.hidden, cfg.hidden, batch_first=True)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(input_ids))  # (B, T, E)
        x, _ = self.lstm(x)  # (B, T, H); zero initial state, final state unused
        x, _ = self.gru(self.drop(x))  # (B, T, H)
        return self.head(self.drop(x))  # (B, T, vocab_size)


def make(cfg: Config):
    return RNNLM(cfg), partial(_common.token_sample, cfg.vocab_size, cfg.seq_len), _common.lm_loss
