"""GPT-2 style decoder-only transformer, after nanoGPT's model.py.

Token + learned position embeddings, pre-LN blocks with causal
scaled_dot_product_attention, a GELU MLP, and an lm_head whose weight is the
token embedding (tied). gpt2-small has 124,439,808 unique parameters.

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
    vocab_size: int = 128  # GPT-2's BPE has 50257
    block_size: int = 32  # max context; also the sample length T
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads; must divide n_embd
    n_embd: int = 64  # residual stream width
    dropout: float = 0.1  # on embeddings, attention probs and residual branches
    bias: bool = True  # GPT-2 has biases in Linears and LayerNorms


SIZES: dict[str, Config] = {
    "debug": Config(),
    "gpt2-small": Config(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} must be divisible by n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # weight tying: one Parameter, used for both the input lookup and the output projection
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                # GPT-2: shrink residual-branch outputs so the stream's variance doesn't grow with depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        assert T <= self.cfg.block_size, f"sequence of {T} tokens, the context is {self.cfg.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=input_ids.device)  # (T,)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)  # (B, T, C)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab_size)


def make(cfg: Config):
    return GPT(cfg), partial(_common.token_sample, cfg.vocab_size, cfg.block_size), _common.lm_loss
