"""A small causal transformer LM fine-tuned with LoRA (Hu et al. 2021).

Every base weight (embeddings, norms, linears, lm_head) is frozen
(requires_grad=False); only the low-rank adapters on the attention and MLP
linears train:  y = base(x) + (dropout(x) @ A^T @ B^T) * alpha / rank.
B starts at zero, so the adapted model starts equal to the base model.

Sample: dict {"input_ids": (B, T) int64}; loss is next-token cross-entropy.
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
    vocab_size: int = 128  # token ids
    seq_len: int = 32  # max context; also the sample length T
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads; must divide dim
    dim: int = 64  # residual stream width
    rank: int = 4  # adapter rank r
    alpha: float = 8.0  # adapter output is scaled by alpha / rank
    lora_dropout: float = 0.05  # on the adapter's input only, as in PEFT
    dropout: float = 0.0  # base-model dropout; usually off when fine-tuning


SIZES: dict[str, Config] = {
    "debug": Config(),
    "small": Config(vocab_size=8192, seq_len=256, n_layer=6, n_head=6, dim=384, rank=8, alpha=16.0),
}


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable rank-r update."""

    def __init__(self, cin: int, cout: int, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base = nn.Linear(cin, cout)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, cin))
        self.lora_B = nn.Parameter(torch.zeros(cout, rank))  # zero: no change to the base model at step 0
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # same init as PEFT
        self.lora_dropout = nn.Dropout(dropout)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (x A^T) B^T: the (.., rank) intermediate is tiny, the (cout, cin) product is never formed
        return self.base(x) + (self.lora_dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scale


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.dim % cfg.n_head:
            raise ValueError(f"dim {cfg.dim} must be divisible by n_head {cfg.n_head}")
        lin = partial(LoRALinear, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.lora_dropout)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.q_proj = lin(cfg.dim, cfg.dim)
        self.k_proj = lin(cfg.dim, cfg.dim)
        self.v_proj = lin(cfg.dim, cfg.dim)
        self.o_proj = lin(cfg.dim, cfg.dim)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.fc1 = lin(cfg.dim, 4 * cfg.dim)
        self.fc2 = lin(4 * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q = self.q_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, -1).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln_2(x)))))


class LoRATransformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            # freeze the whole base model; only adapters train
            p.requires_grad_(name.endswith(("lora_A", "lora_B")))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)  # (T,)
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size)


def make(cfg: Config):
    return LoRATransformer(cfg), partial(_common.token_sample, cfg.vocab_size, cfg.seq_len), _common.lm_loss
