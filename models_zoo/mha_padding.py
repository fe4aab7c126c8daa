"""A sequence classifier on ``nn.MultiheadAttention`` with a key padding mask.

Pre-LN blocks whose attention is ``nn.MultiheadAttention(batch_first=True)`` called with
``key_padding_mask`` and ``need_weights=False``; the head mean-pools the real tokens.  In eval
without grad every block takes the native fast path (``torch._native_multi_head_attention``:
the packed ``[3, B, H, T, dh]`` q/k/v, the ``[B, H, T, T]`` scores and ``_masked_softmax``);
in training the Python path (``F.multi_head_attention_forward``).  Rows are padded at the end
by different amounts (row 0 is full); the memory does not depend on how many.

Sample: dict {"input_ids": (B, T) int64, "key_padding_mask": (B, T) int64 (1 = padding; the
model passes it as bool), "labels": (B,) int64}.  Forward returns the logits (B, num_labels).
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    vocab_size: int = 128
    seq_len: int = 32  # T
    n_layer: int = 2
    n_head: int = 4  # even: the fast path needs an even number of heads
    dim: int = 64
    ffn_dim: int = 128
    num_labels: int = 4
    dropout: float = 0.1


SIZES: dict[str, Config] = {
    "debug": Config(),
    "base": Config(vocab_size=30522, seq_len=256, n_layer=6, n_head=8, dim=512, ffn_dim=2048, num_labels=8),
}


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.n_head, dropout=cfg.dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.ff = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(), nn.Linear(cfg.ffn_dim, cfg.dim),
                                nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        h, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)
        x = x + h
        return x + self.ff(self.ln_2(x))


class MHAPadding(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_labels)

    def forward(self, input_ids: torch.Tensor, key_padding_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        # labels is accepted so model(**sample) works; the loss lives in loss_fn
        padding = key_padding_mask.bool()
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.size(1), device=input_ids.device))
        for block in self.blocks:
            x = block(x, padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        pooled = (self.ln_f(x) * keep).sum(1) / keep.sum(1)
        return self.head(pooled)


def make_sample(cfg: Config, batch: int) -> dict[str, torch.Tensor]:
    _common.check_batch(batch)
    g = _common.generator()
    input_ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g, device="cpu")
    # row 0 is full length; row i keeps T - (3i mod T/2) tokens, padded at the end
    lengths = cfg.seq_len - (torch.arange(batch) * 3) % (cfg.seq_len // 2)
    key_padding_mask = (torch.arange(cfg.seq_len).unsqueeze(0) >= lengths.unsqueeze(1)).long()
    labels = torch.randint(0, cfg.num_labels, (batch,), generator=g, device="cpu")
    return {"input_ids": input_ids, "key_padding_mask": key_padding_mask, "labels": labels}


def loss_fn(output: torch.Tensor, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, sample["labels"])


def make(cfg: Config):
    return MHAPadding(cfg), partial(make_sample, cfg), loss_fn
