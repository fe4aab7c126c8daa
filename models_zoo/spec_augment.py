"""A speech encoder with SpecAugment-style time masking (as wav2vec 2.0 / HuBERT train).

In training, a random share of the frames is replaced by a learned mask embedding:
``x[mask] = self.mask_embed`` with a random boolean ``mask`` drawn in ``forward`` -- an
``index_put_`` whose index count depends on the draw (wav2vec 2.0's
``hidden_states[mask_time_indices] = self.masked_spec_embed``).  In eval nothing is masked.
Then a convolutional subsampling, transformer layers (``masked_lm.Layer``) and a per-frame classifier (CTC-like
frame targets, cross-entropy).

Sample: dict {"features": (B, T, n_mels) float32, "targets": (B, T // 2) int64}.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common, masked_lm

DATA_DEPENDENT = "sample"  # fxmem's validation uses the sizes of the measured step's draw


@dataclass(frozen=True)
class Config:
    n_mels: int = 16
    frames: int = 32
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_classes: int = 32
    mask_prob: float = 0.3


SIZES: dict[str, Config] = {
    "debug": Config(),
    "base": Config(n_mels=80, frames=1000, d_model=512, n_layer=12, n_head=8, n_classes=500),
}


class Encoder(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.mask_embed = nn.Parameter(torch.zeros(cfg.n_mels))
        self.subsample = nn.Conv1d(cfg.n_mels, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.layers = nn.ModuleList(masked_lm.Layer(cfg) for _ in range(cfg.n_layer))
        self.classifier = nn.Linear(cfg.d_model, cfg.n_classes)

    def forward(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = features
        if self.training:
            mask = torch.rand(x.shape[:2], device=x.device) < self.cfg.mask_prob  # (B, T) frames to mask
            x = x.clone()
            x[mask] = self.mask_embed.to(x.dtype)
        x = F.gelu(self.subsample(x.transpose(1, 2))).transpose(1, 2)  # (B, T/2, d)
        for layer in self.layers:
            x = layer(x)
        logits = self.classifier(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def sample(cfg: Config, batch: int) -> dict[str, torch.Tensor]:
    _common.check_batch(batch)
    return {"features": _common.randn(batch, cfg.frames, cfg.n_mels),
            "targets": _common.randint(cfg.n_classes, batch, (cfg.frames + 1) // 2)}


def make(cfg: Config):
    return Encoder(cfg), partial(sample, cfg), lambda loss, sample: loss
