"""A plain multi-layer perceptron classifier.

Sample: dict {"x": (B, in_features) float32, "labels": (B,) int64}.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    in_features: int = 32  # input width; 784 = a flattened 28x28 image
    hidden: tuple[int, ...] = (64, 64)  # one Linear+activation+dropout per entry
    num_classes: int = 10  # output logits
    activation: str = "gelu"  # "gelu" or "relu"; both are common and cost the same
    dropout: float = 0.1  # > 0 so the dropout masks show up in memory traces


SIZES: dict[str, Config] = {
    "debug": Config(),
    "small": Config(in_features=784, hidden=(2048, 2048, 2048), activation="relu"),
}

_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU}


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {cfg.activation!r}")
        self.cfg = cfg
        layers: list[nn.Module] = []
        width = cfg.in_features
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), _ACTIVATIONS[cfg.activation](), nn.Dropout(cfg.dropout)]
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, cfg.num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # labels is accepted so model(**sample) works; the loss lives in loss_fn
        return self.head(self.body(x))  # (B, num_classes)


def make_sample(cfg: Config, batch: int) -> dict[str, torch.Tensor]:
    _common.check_batch(batch)
    return {
        "x": _common.randn(batch, cfg.in_features),
        "labels": _common.randint(cfg.num_classes, batch),
    }


def loss_fn(output: torch.Tensor, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, sample["labels"])


def make(cfg: Config):
    return MLP(cfg), partial(make_sample, cfg), loss_fn
