"""A BERT-style masked language model that predicts only the masked tokens.

The encoder runs on every token; the prediction head and the loss run on
``hidden[labels != -100]`` only (boolean-mask indexing, as efficient MLM training does:
RoBERTa/MosaicBERT's "sparse prediction"), so the head's activations have a data-dependent
number of rows: the masked tokens of the batch (15 % of the sample's tokens here).

Sample: dict {"input_ids": (B, T) int64, "labels": (B, T) int64, -100 where not masked}.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common

DATA_DEPENDENT = "sample"  # fxmem's validation uses the sizes of the measured sample


@dataclass(frozen=True)
class Config:
    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    mask_rate: float = 0.15


SIZES: dict[str, Config] = {
    "debug": Config(),
    "base": Config(vocab_size=30522, seq_len=512, n_layer=12, n_head=12, d_model=768),
}


class Layer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))
        self.ln_2 = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = self.ln_1(x + self.proj(y))
        return self.ln_2(x + self.ff(x))


class MaskedLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.head = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.GELU(), nn.LayerNorm(cfg.d_model),
                                  nn.Linear(cfg.d_model, cfg.vocab_size))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.size(1), device=input_ids.device))
        for layer in self.layers:
            x = layer(x)
        masked = labels != -100
        logits = self.head(x[masked])  # (n masked tokens, vocab)
        return F.cross_entropy(logits, labels[masked])


def sample(cfg: Config, batch: int) -> dict[str, torch.Tensor]:
    ids = _common.randint(cfg.vocab_size, _common.check_batch(batch), cfg.seq_len)
    chosen = torch.rand(batch, cfg.seq_len, generator=_common.generator()) < cfg.mask_rate
    return {"input_ids": ids, "labels": torch.where(chosen, ids, torch.full_like(ids, -100))}


def make(cfg: Config):
    return MaskedLM(cfg), partial(sample, cfg), lambda loss, sample: loss
