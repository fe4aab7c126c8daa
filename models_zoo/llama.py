"""Llama-2 style decoder (Touvron et al. 2023).

RMSNorm, rotary position embeddings, grouped-query attention through causal
scaled_dot_product_attention, a SwiGLU MLP, no biases, no dropout, and an
untied lm_head. 7b has Llama-2-7B's shapes: 6,738,415,616 parameters, so
build it with get("llama", "7b", device="meta") unless you mean to fill
27 GB of fp32 memory.

Sample: dict {"input_ids": (B, T) int64}; loss is next-token cross-entropy.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    vocab_size: int = 128  # Llama-2's SentencePiece has 32000
    max_seq_len: int = 32  # RoPE table length; also the sample length T
    dim: int = 64  # residual stream width
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # query heads; must divide dim
    n_kv_heads: int = 2  # key/value heads shared by groups of query heads (GQA); divides n_heads
    hidden_dim: int = 176  # SwiGLU width; Llama-2-7B uses 11008 (~8/3 * dim, rounded to 256)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base frequency


SIZES: dict[str, Config] = {
    "debug": Config(),
    "7b": Config(
        vocab_size=32000, max_seq_len=4096, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, hidden_dim=11008
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32: squaring fp16 activations can overflow
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(cfg: Config, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_seq_len, head_dim), in rotate-half layout."""
    head_dim = cfg.dim // cfg.n_heads
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device).float(), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hd); rotates each (x_i, x_{i+hd/2}) pair by its position's angle
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError("need n_heads | dim and n_kv_heads | n_heads")
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            # share each kv head across `rep` query heads; materialised, as in Meta's reference code
            grouped = (B, self.n_kv_heads, rep, T, self.head_dim)
            k = k[:, :, None].expand(grouped).reshape(B, self.n_heads, T, self.head_dim)  # (B, nh, T, hd)
            v = v[:, :, None].expand(grouped).reshape(B, self.n_heads, T, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C); C / tp under tensor parallelism


class FeedForward(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)  # untied, as in Llama-2
        # non-persistent: derived from the config, so kept out of state_dict
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_rope(self) -> None:
        """Recompute the RoPE tables in place, e.g. after to_empty() from the meta device."""
        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd), broadcast over (B, nh)
        x = self.tok_embeddings(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))  # (B, T, vocab_size)


def make(cfg: Config):
    return Llama(cfg), partial(_common.token_sample, cfg.vocab_size, cfg.max_seq_len), _common.lm_loss
