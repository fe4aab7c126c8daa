"""Vision Transformer (Dosovitskiy et al. 2020), laid out like torchvision's vit_b_16.

Patch-embedding conv, a learned cls token and position embedding, pre-LN
encoder blocks built on nn.MultiheadAttention(batch_first=True), and a
linear head on the cls token. vit-b16 has 86,567,656 parameters, matching
torchvision.

Sample: dict {"images": (B, 3, H, W) float32, "labels": (B,) int64}.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    image_size: int = 32  # square input side; must divide by patch_size
    patch_size: int = 8  # each patch becomes one token
    in_channels: int = 3  # RGB
    dim: int = 64  # token width
    depth: int = 2  # encoder blocks
    heads: int = 4  # attention heads; must divide dim
    mlp_dim: int = 128  # MLP hidden width, 4 * dim in ViT-B
    num_classes: int = 10  # head outputs
    dropout: float = 0.1  # on embeddings, MLP and residual branches (torchvision defaults to 0)
    attn_dropout: float = 0.0  # on attention probabilities, as in torchvision


SIZES: dict[str, Config] = {
    "debug": Config(),
    "vit-b16": Config(
        image_size=224, patch_size=16, dim=768, depth=12, heads=12, mlp_dim=3072, num_classes=1000
    ),
}


class EncoderBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(
            cfg.dim, cfg.heads, dropout=cfg.attn_dropout, batch_first=True
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.ln_2 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_dim),
            nn.GELU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.mlp_dim, cfg.dim),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        # need_weights=False: the averaged (B, N, N) attention map is never used
        h, _ = self.self_attention(h, h, h, need_weights=False)
        x = x + self.dropout(h)
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size {cfg.image_size} must be divisible by patch_size {cfg.patch_size}")
        self.cfg = cfg
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.conv_proj = nn.Conv2d(cfg.in_channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, n_patches + 1, cfg.dim).normal_(std=0.02))
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.Sequential(*(EncoderBlock(cfg) for _ in range(cfg.depth)))
        self.ln = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # labels is accepted so model(**sample) works; the loss lives in loss_fn
        x = self.conv_proj(images)  # (B, D, H/P, W/P)
        x = x.flatten(2).transpose(1, 2)  # (B, N, D)
        cls = self.class_token.expand(x.shape[0], -1, -1)  # (B, 1, D)
        x = torch.cat([cls, x], dim=1) + self.pos_embedding  # (B, N+1, D)
        x = self.ln(self.layers(self.dropout(x)))
        return self.head(x[:, 0])  # (B, num_classes), from the cls token


def make_sample(cfg: Config, batch: int) -> dict[str, torch.Tensor]:
    _common.check_batch(batch)
    return {
        "images": _common.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size),
        "labels": _common.randint(cfg.num_classes, batch),
    }


def loss_fn(output: torch.Tensor, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, sample["labels"])


def make(cfg: Config):
    return ViT(cfg), partial(make_sample, cfg), loss_fn
