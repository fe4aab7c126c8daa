"""An MLP autoencoder with two kinds of sharing.

1. Weight tying: the decoder has no weight matrices of its own; it applies
   the encoder's Parameters transposed (F.linear(h, enc.weight.t())), so each
   encoder weight is used twice per forward and gets two gradient
   contributions.
2. Module sharing: the bottleneck's `first` and `second` attributes are the
   same nn.Linear instance, so it appears under two names and runs twice.

Sample: a plain tensor x (B, in_features) float32; call model(x). The loss
is reconstruction MSE against x itself.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    in_features: int = 64  # input width; 784 = a flattened 28x28 image
    hidden: int = 32  # encoder hidden width
    latent: int = 16  # code width
    dropout: float = 0.1  # on the input, denoising-autoencoder style


SIZES: dict[str, Config] = {
    "debug": Config(),
    "small": Config(in_features=784, hidden=512, latent=64),
}


class SharedBottleneck(nn.Module):
    """Two residual steps through one Linear registered under two names."""

    def __init__(self, dim: int):
        super().__init__()
        shared = nn.Linear(dim, dim)
        self.first = shared
        self.second = shared  # same instance: parameters() yields its weight once

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z + F.relu(self.first(z))
        return z + F.relu(self.second(z))


class TiedAutoencoder(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.drop = nn.Dropout(cfg.dropout)
        self.enc1 = nn.Linear(cfg.in_features, cfg.hidden)
        self.enc2 = nn.Linear(cfg.hidden, cfg.latent)
        self.bottleneck = SharedBottleneck(cfg.latent)
        # the decoder owns only biases; its weights are the encoder's, transposed
        self.dec2_bias = nn.Parameter(torch.zeros(cfg.hidden))
        self.dec1_bias = nn.Parameter(torch.zeros(cfg.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.enc1(self.drop(x)))  # (B, hidden)
        z = self.bottleneck(self.enc2(h))  # (B, latent)
        h = F.relu(F.linear(z, self.enc2.weight.t(), self.dec2_bias))  # (B, hidden)
        return F.linear(h, self.enc1.weight.t(), self.dec1_bias)  # (B, in_features)


def make_sample(cfg: Config, batch: int) -> torch.Tensor:
    _common.check_batch(batch)
    return _common.randn(batch, cfg.in_features)


def loss_fn(output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, sample)


def make(cfg: Config):
    return TiedAutoencoder(cfg), partial(make_sample, cfg), loss_fn
