"""U-Net (Ronneberger et al. 2015) for per-pixel classification.

Encoder: (conv3x3-norm-ReLU) x2 then 2x2 max-pool, per level. Decoder:
2x2 ConvTranspose2d upsampling, concatenation with the encoder skip at that
resolution, then (conv3x3-norm-ReLU) x2. Padded convs keep H, W unchanged so
skips concatenate without cropping.

Sample: dict {"images": (B, C, H, W) float32, "masks": (B, H, W) int64}.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    in_channels: int = 3  # RGB
    num_classes: int = 3  # per-pixel classes
    width: int = 8  # channels at the first level; doubles at each level down
    depth: int = 2  # number of pool/upsample steps; H, W must divide 2**depth
    image_size: int = 32  # square input side
    norm: str = "group"  # "group" (batch-size independent) or "batch"
    groups: int = 4  # GroupNorm groups; must divide width


SIZES: dict[str, Config] = {
    "debug": Config(),
    "small": Config(width=32, depth=4, image_size=128, norm="batch"),
}


def _norm(cfg: Config, channels: int) -> nn.Module:
    if cfg.norm == "batch":
        return nn.BatchNorm2d(channels)
    if cfg.norm == "group":
        return nn.GroupNorm(cfg.groups, channels)
    raise ValueError(f"norm must be 'batch' or 'group', got {cfg.norm!r}")


class DoubleConv(nn.Sequential):
    def __init__(self, cfg: Config, cin: int, cout: int):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),  # bias is redundant before a norm
            _norm(cfg, cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            _norm(cfg, cout),
            nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.image_size % (2**cfg.depth):
            raise ValueError(f"image_size {cfg.image_size} must be divisible by 2**depth = {2**cfg.depth}")
        self.cfg = cfg
        widths = [cfg.width * 2**i for i in range(cfg.depth + 1)]  # channels per level, top to bottom
        self.inc = DoubleConv(cfg, cfg.in_channels, widths[0])
        self.down = nn.ModuleList(DoubleConv(cfg, widths[i], widths[i + 1]) for i in range(cfg.depth))
        self.pool = nn.MaxPool2d(2)
        levels = list(reversed(range(cfg.depth)))  # decoder runs bottom-up
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2) for i in levels)
        # decoder input: upsampled (widths[i]) concatenated with the skip (widths[i])
        self.dec = nn.ModuleList(DoubleConv(cfg, 2 * widths[i], widths[i]) for i in levels)
        self.outc = nn.Conv2d(widths[0], cfg.num_classes, 1)

    def forward(self, images: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        # masks is accepted so model(**sample) works; the loss lives in loss_fn
        x = self.inc(images)  # (B, width, H, W)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(self.pool(x))  # halves H, W; doubles channels
        for up, dec in zip(self.up, self.dec):
            x = up(x)  # doubles H, W; halves channels
            x = dec(torch.cat([x, skips.pop()], dim=1))
        return self.outc(x)  # (B, num_classes, H, W)


def make_sample(cfg: Config, batch: int) -> dict[str, torch.Tensor]:
    _common.check_batch(batch)
    s = cfg.image_size
    return {
        "images": _common.randn(batch, cfg.in_channels, s, s),
        "masks": _common.randint(cfg.num_classes, batch, s, s),
    }


def loss_fn(output: torch.Tensor, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, sample["masks"])  # averaged over every pixel


def make(cfg: Config):
    return UNet(cfg), partial(make_sample, cfg), loss_fn
