"""A sequence classifier on ``nn.TransformerEncoder`` with ``src_key_padding_mask``.

``nn.TransformerEncoder(nn.TransformerEncoderLayer(batch_first=True), enable_nested_tensor=True)``
(post-LN, ReLU).  In eval without grad the encoder converts the padded batch into a nested
tensor of the real tokens (``torch._nested_tensor_from_mask``), runs every layer's native fast
path (``torch._transformer_encoder_layer_fwd``) on it and pads the result back
(``to_padded_tensor``): the memory depends on how many tokens are real -- a data-dependent size
(``DATA_DEPENDENT``).  Every row pads the same share of its tokens at the end
(``Config.pad_share``).  In training every layer takes the Python path.

Sample: dict {"input_ids": (B, T) int64, "src_key_padding_mask": (B, T) int64 (1 = padding; the
model passes it as bool), "labels": (B,) int64}.  Forward returns the logits (B, num_labels).
"""

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common

DATA_DEPENDENT = "sample"  # fxmem's validation uses the sizes of the measured sample


@dataclass(frozen=True)
class Config:
    vocab_size: int = 128
    seq_len: int = 32  # T
    n_layer: int = 2
    n_head: int = 4  # even, and norm_first=False: the nested fast path needs both
    dim: int = 64
    ffn_dim: int = 128
    num_labels: int = 4
    dropout: float = 0.1
    pad_share: float = 0.25  # the padded share of every row's tokens


SIZES: dict[str, Config] = {
    "debug": Config(),
    "base": Config(vocab_size=30522, seq_len=256, n_layer=6, n_head=8, dim=512, ffn_dim=2048, num_labels=8),
}


class EncoderPadding(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        layer = nn.TransformerEncoderLayer(cfg.dim, cfg.n_head, cfg.ffn_dim, dropout=cfg.dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.n_layer, enable_nested_tensor=True)
        self.head = nn.Linear(cfg.dim, cfg.num_labels)

    def forward(self, input_ids: torch.Tensor, src_key_padding_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        # labels is accepted so model(**sample) works; the loss lives in loss_fn
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.size(1), device=input_ids.device))
        h = self.encoder(x, src_key_padding_mask=src_key_padding_mask.bool())
        return self.head(h[:, 0])  # the first token is never padding


def make_sample(cfg: Config, batch: int) -> dict[str, torch.Tensor]:
    _common.check_batch(batch)
    g = _common.generator()
    input_ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g, device="cpu")
    padded = math.floor(cfg.pad_share * cfg.seq_len)
    mask = torch.zeros(batch, cfg.seq_len, dtype=torch.int64)
    mask[:, cfg.seq_len - padded:] = 1
    labels = torch.randint(0, cfg.num_labels, (batch,), generator=g, device="cpu")
    return {"input_ids": input_ids, "src_key_padding_mask": mask, "labels": labels}


def loss_fn(output: torch.Tensor, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, sample["labels"])


def make(cfg: Config):
    return EncoderPadding(cfg), partial(make_sample, cfg), loss_fn
