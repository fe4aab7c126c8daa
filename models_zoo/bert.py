"""BERT-style encoder (Devlin et al. 2018) for sequence classification.

Post-LN blocks as in the original BERT, with attention written out by hand
(softmax(QK^T / sqrt(d) + mask) V) so the (B, heads, T, T) score and
probability tensors are explicit. Padding is masked additively. The head
pools the [CLS] position. base matches bert-base shapes (12 layers, 768
wide, vocab 30522, T=512): 109,483,778 parameters with a 2-way head.

Sample: dict {"input_ids": (B, T) int64, "attention_mask": (B, T) int64
(1 = token, 0 = padding at the end of some rows), "labels": (B,) int64}.
Forward returns BertOutput(loss, logits).
"""

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    vocab_size: int = 128  # bert-base-uncased's WordPiece has 30522
    max_len: int = 32  # learned positions; also the sample length T
    type_vocab_size: int = 2  # segment A/B embeddings; this model always uses segment 0
    n_layer: int = 2  # encoder blocks
    n_head: int = 4  # attention heads; must divide dim
    dim: int = 64  # hidden width
    ffn_dim: int = 128  # feed-forward width, 4 * dim in BERT
    num_labels: int = 2  # classification outputs
    dropout: float = 0.1  # BERT's hidden and attention dropout
    ln_eps: float = 1e-12  # BERT's LayerNorm epsilon
    pad_id: int = 0  # token id written into padded positions


SIZES: dict[str, Config] = {
    "debug": Config(),
    "base": Config(vocab_size=30522, max_len=512, n_layer=12, n_head=12, dim=768, ffn_dim=3072),
}


@dataclass(frozen=True)
class BertOutput:
    """HF-style output: loss is None when no labels were passed."""

    loss: torch.Tensor | None
    logits: torch.Tensor  # (B, num_labels)


# lets torch.export / pytree-based tracers flatten the output like a tuple
torch.export.register_dataclass(BertOutput, serialized_type_name="models_zoo.bert.BertOutput")


class SelfAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.dim % cfg.n_head:
            raise ValueError(f"dim {cfg.dim} must be divisible by n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.query = nn.Linear(cfg.dim, cfg.dim)
        self.key = nn.Linear(cfg.dim, cfg.dim)
        self.value = nn.Linear(cfg.dim, cfg.dim)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        hs = C // self.n_head
        q = self.query(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.key(x).view(B, T, self.n_head, hs).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, hs).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hs) + mask  # (B, nh, T, T)
        probs = self.attn_dropout(scores.softmax(dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out(y)


class Layer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(), nn.Linear(cfg.ffn_dim, cfg.dim))
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # post-LN: normalise after each residual add, as in the original BERT
        x = self.ln_1(x + self.dropout(self.attention(x, mask)))
        return self.ln_2(x + self.dropout(self.ffn(x)))


class Bert(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_id)
        self.position_embeddings = nn.Embedding(cfg.max_len, cfg.dim)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.dim)
        self.emb_ln = nn.LayerNorm(cfg.dim, eps=cfg.ln_eps)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.pooler = nn.Linear(cfg.dim, cfg.dim)
        self.cls_dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.dim, cfg.num_labels)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> BertOutput:
        T = input_ids.size(1)
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        types = torch.zeros_like(input_ids)  # (B, T): single-segment inputs
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos)
        x = x + self.token_type_embeddings(types)  # (B, T, C)
        x = self.emb_dropout(self.emb_ln(x))  # (B, T, C)
        # additive mask: 0 where attending is allowed, dtype-min on padding keys
        keep = attention_mask[:, None, None, :].to(x.dtype)  # (B, 1, 1, T)
        mask = (1.0 - keep) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))  # (B, C), from [CLS]
        logits = self.classifier(self.cls_dropout(pooled))  # (B, num_labels)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return BertOutput(loss=loss, logits=logits)


def make_sample(cfg: Config, batch: int) -> dict[str, torch.Tensor]:
    _common.check_batch(batch)
    T = cfg.max_len
    g = _common.generator()
    # ids avoid pad_id so the mask alone marks padding
    input_ids = torch.randint(1, cfg.vocab_size, (batch, T), generator=g, device="cpu")
    # row 0 is full length; every other row keeps T/2..T-1 tokens and is padded at the end
    lengths = torch.randint(T // 2, T, (batch,), generator=g, device="cpu")
    lengths[0] = T
    attention_mask = (torch.arange(T, device="cpu")[None, :] < lengths[:, None]).long()  # (B, T)
    input_ids = input_ids.masked_fill(attention_mask == 0, cfg.pad_id)
    labels = torch.randint(0, cfg.num_labels, (batch,), generator=g, device="cpu")
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_fn(output: BertOutput, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    return output.loss  # computed in forward from sample["labels"]


def make(cfg: Config):
    return Bert(cfg), partial(make_sample, cfg), loss_fn
