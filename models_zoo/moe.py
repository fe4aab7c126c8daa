"""A decoder-only language model whose MLPs are mixtures of experts (Mixtral-style routing).

Each MoE layer routes every token to its ``top_k`` experts (softmax router, top-k, renormalised
weights) and runs each expert on the tokens routed to it, found with ``torch.where`` on the
one-hot routing mask -- the loop most MoE code writes (Mixtral, Qwen-MoE, DeepSeek in eager).
How many tokens each expert gets depends on the data: fxmem prices it with
``data_dependent=`` (the one-hot mask fixes the total, tokens × top_k).

Sample: dict {"input_ids": (B, T) int64}; loss is next-token cross-entropy.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common

# fxmem's validation of this model uses the sizes observed on the measured sample.
DATA_DEPENDENT = "sample"


@dataclass(frozen=True)
class Config:
    vocab_size: int = 128
    block_size: int = 32  # the sample length T
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_expert: int = 4
    top_k: int = 2
    d_ff: int = 64  # each expert's hidden width


SIZES: dict[str, Config] = {
    "debug": Config(),
    "small": Config(vocab_size=32000, block_size=512, n_layer=8, n_head=8, n_embd=512, n_expert=8, d_ff=1408),
}


class Expert(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.n_embd, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.top_k, self.n_expert = cfg.top_k, cfg.n_expert
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_expert))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = x.reshape(-1, C)  # (N, C), N = B·T tokens
        weights, chosen = torch.topk(F.softmax(self.router(h), dim=-1), self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(h)
        mask = F.one_hot(chosen, self.n_expert).permute(2, 1, 0)  # (E, k, N): one 1 per (token, slot)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])  # the tokens routed to expert e (data-dependent count)
            y = expert(h[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.MultiheadAttention(cfg.n_embd, cfg.n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.moe = MoE(cfg)
        self.register_buffer("causal", torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=self.causal[:T, :T], need_weights=False)[0]
        return x + self.moe(self.ln_2(x))


class MoELM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        x = self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make(cfg: Config):
    return MoELM(cfg), partial(_common.token_sample, cfg.vocab_size, cfg.block_size), _common.lm_loss
