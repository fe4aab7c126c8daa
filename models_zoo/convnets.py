"""Small convolution networks, one per convolution family, each with a classifier head.

They exist to check the estimator's pricing of convolution and BatchNorm kernels on
every family: depthwise, grouped, dilated, 1-D, 3-D, transposed, large-kernel patch
embedding, the ResNet stem, tiny channel counts and frozen (eval-mode) BatchNorm.
Each size is one family (``Config.family``; "bn-eval" is the "conv-bn" family with
``frozen_bn``), kept small: a training step at batch 32 needs a few MB.

Every family except "transposed" ends in global average pooling + Linear, with
cross-entropy on integer labels:
    sample: tuple (inputs (B, C, *spatial) float32, labels (B,) int64); call model(*sample).
"transposed" is a small conv autoencoder whose loss is the MSE to its input:
    sample: one tensor (B, C, H, W) float32; call model(sample).
``spatial`` is (L,) for "conv1d", (D, H, W) for "conv3d" and (H, W) otherwise.

Inputs are cast to the parameters' dtype in forward, so the float32 samples also run
through a model built with ``models_zoo.get(..., dtype=torch.bfloat16)``; the losses
upcast to float32. Both are no-ops for a float32 model.

"bn-eval": ``ConvNet.train`` keeps every BatchNorm child in eval mode when
``cfg.frozen_bn`` (frozen BN, as in detection fine-tuning): BatchNorm normalises with
its running statistics and never updates them, while its affine weight and bias still
train; ``model.training`` itself follows train()/eval() as usual.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    family: str = "debug"  # the layer stack to build, one of FAMILIES; each zoo size is one family
    in_channels: int = 3  # RGB; depthwise/grouped take a 16-channel feature map so groups divide it
    spatial: tuple[int, ...] = (16, 16)  # input size after (B, C); (L,) for conv1d, (D, H, W) for conv3d
    width: int = 8  # channels of the first conv; later layers use 1x, 2x or 4x this
    num_classes: int = 10  # classifier outputs; unused by "transposed", which reconstructs its input
    groups: int = 4  # "grouped" only: ResNeXt uses 32 groups; 4 keeps 8+ channels per group at width 32
    frozen_bn: bool = False  # BatchNorm stays in eval mode while training (frozen BN in detection fine-tuning)


SIZES: dict[str, Config] = {
    "debug": Config(),
    "depthwise": Config(family="depthwise", in_channels=16, width=32),
    "grouped": Config(family="grouped", in_channels=16, width=32),
    "dilated": Config(family="dilated", spatial=(32, 32), width=16),
    "conv1d": Config(family="conv1d", in_channels=16, spatial=(256,), width=64),
    "conv3d": Config(family="conv3d", in_channels=4, spatial=(8, 16, 16), width=8),
    "transposed": Config(family="transposed", spatial=(32, 32), width=16),
    "patch": Config(family="patch", spatial=(64, 64), width=64),
    "stem": Config(family="stem", spatial=(32, 32), width=32),
    "small-channels": Config(family="small-channels", spatial=(32, 32), width=4),
    "bn-eval": Config(family="conv-bn", width=16, frozen_bn=True),
}


def _debug(cfg: Config) -> tuple[nn.Module, int]:
    w = cfg.width
    body = nn.Sequential(
        nn.Conv2d(cfg.in_channels, w, 3, padding=1, bias=False),  # bias is redundant before a norm
        nn.BatchNorm2d(w),
        nn.ReLU(inplace=True),
        nn.Conv2d(w, w, 3, padding=1, groups=w, bias=False),  # depthwise
        nn.Conv2d(w, 2 * w, 1),  # 1x1
    )
    return body, 2 * w


def _separable(cin: int, cout: int) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cin, 3, padding=1, groups=cin, bias=False),  # depthwise
        nn.Conv2d(cin, cout, 1, bias=False),  # pointwise
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


def _depthwise(cfg: Config) -> tuple[nn.Module, int]:
    # two blocks: only the second depthwise conv computes an input gradient
    return nn.Sequential(*_separable(cfg.in_channels, cfg.width), *_separable(cfg.width, cfg.width)), cfg.width


def _grouped(cfg: Config) -> tuple[nn.Module, int]:
    w, g = cfg.width, cfg.groups
    if cfg.in_channels % g or w % g:
        raise ValueError(f"groups {g} must divide in_channels {cfg.in_channels} and width {w}")
    body = nn.Sequential(
        nn.Conv2d(cfg.in_channels, w, 3, padding=1, groups=g, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(inplace=True),
        nn.Conv2d(w, w, 3, padding=1, groups=g, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(inplace=True),
    )
    return body, w


def _dilated(cfg: Config) -> tuple[nn.Module, int]:
    w = cfg.width
    body = nn.Sequential(
        nn.Conv2d(cfg.in_channels, w, 3, dilation=2, padding=2),  # padding = dilation keeps H, W
        nn.ReLU(inplace=True),
        nn.Conv2d(w, w, 3, dilation=2, padding=2),
        nn.ReLU(inplace=True),
    )
    return body, w


class Residual1d(nn.Module):
    """Strided Conv1d-BN-ReLU, then a residual Conv1d-BN with a ReLU after the sum."""

    def __init__(self, cin: int, width: int):
        super().__init__()
        self.conv1 = nn.Conv1d(cin, width, 3, stride=2, bias=False)  # L -> (L - 3) // 2 + 1
        self.bn1 = nn.BatchNorm1d(width)
        self.conv2 = nn.Conv1d(width, width, 3, padding=1, bias=False)  # keeps L
        self.bn2 = nn.BatchNorm1d(width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))  # (B, W, L')
        return self.relu(x + self.bn2(self.conv2(x)))  # (B, W, L')


def _conv1d(cfg: Config) -> tuple[nn.Module, int]:
    return Residual1d(cfg.in_channels, cfg.width), cfg.width


def _conv3d(cfg: Config) -> tuple[nn.Module, int]:
    w = cfg.width
    body = nn.Sequential(
        nn.Conv3d(cfg.in_channels, w, 3, padding=1, bias=False),
        nn.BatchNorm3d(w),
        nn.ReLU(inplace=True),
        nn.Conv3d(w, 2 * w, 3, stride=2, padding=1),  # halves D, H, W
        nn.ReLU(inplace=True),
    )
    return body, 2 * w


def _transposed(cfg: Config) -> tuple[nn.Module, int]:
    if any(s % 4 for s in cfg.spatial):
        raise ValueError(f"transposed: spatial {cfg.spatial} must be divisible by 4 (two stride-2 steps)")
    w = cfg.width
    body = nn.Sequential(
        nn.Conv2d(cfg.in_channels, w, 3, stride=2, padding=1),  # (B, W, H/2, W/2)
        nn.ReLU(inplace=True),
        nn.Conv2d(w, 2 * w, 3, stride=2, padding=1),  # (B, 2W, H/4, W/4)
        nn.ReLU(inplace=True),
        nn.ConvTranspose2d(2 * w, w, 2, stride=2),  # (B, W, H/2, W/2)
        nn.ReLU(inplace=True),
        nn.ConvTranspose2d(w, cfg.in_channels, 3, stride=2, padding=1, output_padding=1),  # (B, C, H, W)
    )
    return body, cfg.in_channels


class PatchEmbed(nn.Module):
    """ViT/ConvNeXt stem: non-overlapping 16x16 patches, then LayerNorm over channels."""

    patch = 16  # ViT-B/16

    def __init__(self, cin: int, width: int):
        super().__init__()
        self.proj = nn.Conv2d(cin, width, self.patch, stride=self.patch)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)  # (B, W, H/16, W/16)
        # LayerNorm normalises the last dim, so move channels there and back (ConvNeXt's LayerNorm2d)
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # (B, W, H/16, W/16)


def _patch(cfg: Config) -> tuple[nn.Module, int]:
    if any(s % PatchEmbed.patch for s in cfg.spatial):
        raise ValueError(f"patch: spatial {cfg.spatial} must be divisible by {PatchEmbed.patch}")
    return PatchEmbed(cfg.in_channels, cfg.width), cfg.width


def _stem(cfg: Config) -> tuple[nn.Module, int]:
    w = cfg.width
    body = nn.Sequential(
        nn.Conv2d(cfg.in_channels, w, 7, stride=2, padding=3, bias=False),  # (B, W, H/2, W/2)
        nn.BatchNorm2d(w),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),  # (B, W, H/4, W/4)
        nn.Conv2d(w, 2 * w, 1),  # bias kept: the ReLU sits between it and the norm
        nn.ReLU(inplace=True),
        nn.BatchNorm2d(2 * w),
    )
    return body, 2 * w


def _small_channels(cfg: Config) -> tuple[nn.Module, int]:
    w = cfg.width
    body = nn.Sequential(
        nn.Conv2d(cfg.in_channels, w, 3),  # no padding: (B, W, H-2, W-2)
        nn.ReLU(inplace=True),
        nn.Conv2d(w, 4 * w, 1, stride=2),  # strided 1x1: (B, 4W, (H-1)//2, (W-1)//2)
    )
    return body, 4 * w


def _conv_bn(cfg: Config) -> tuple[nn.Module, int]:
    w = cfg.width
    body = nn.Sequential(
        nn.Conv2d(cfg.in_channels, w, 3, padding=1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(inplace=True),
        nn.Conv2d(w, 2 * w, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(inplace=True),
    )
    return body, 2 * w


# family -> (builder returning (body, output channels), number of spatial dims of the input)
FAMILIES = {
    "debug": (_debug, 2),
    "depthwise": (_depthwise, 2),
    "grouped": (_grouped, 2),
    "dilated": (_dilated, 2),
    "conv1d": (_conv1d, 1),
    "conv3d": (_conv3d, 3),
    "transposed": (_transposed, 2),
    "patch": (_patch, 2),
    "stem": (_stem, 2),
    "small-channels": (_small_channels, 2),
    "conv-bn": (_conv_bn, 2),
}

_POOLS = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


class ConvNet(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {cfg.family!r}")
        build, dims = FAMILIES[cfg.family]
        if len(cfg.spatial) != dims:
            raise ValueError(f"family {cfg.family!r} takes {dims} spatial dims, got spatial={cfg.spatial}")
        self.cfg = cfg
        self.body, channels = build(cfg)
        if cfg.family == "transposed":
            self.pool, self.fc = None, None  # the decoder's output is the prediction
        else:
            self.pool = _POOLS[dims](1)  # global average pool
            self.fc = nn.Linear(channels, cfg.num_classes)
        self.train()  # applies frozen_bn from the start

    def train(self, mode: bool = True) -> "ConvNet":
        super().train(mode)
        if self.cfg.frozen_bn:
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()  # running statistics: used, never updated
        return self

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # labels is accepted so model(*sample) works; the loss lives in loss_fn
        # float32 samples into a model cast by get(dtype=...); a no-op when the dtypes match
        x = inputs.to(next(self.parameters()).dtype)  # (B, C, *spatial)
        x = self.body(x)  # (B, channels, *spatial')
        if self.fc is None:
            return x  # (B, C, H, W)
        x = torch.flatten(self.pool(x), 1)  # (B, channels)
        return self.fc(x)  # (B, num_classes)


def make_sample(cfg: Config, batch: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _common.check_batch(batch)
    inputs = _common.randn(batch, cfg.in_channels, *cfg.spatial)  # (B, C, *spatial)
    if cfg.family == "transposed":
        return inputs
    return inputs, _common.randint(cfg.num_classes, batch)  # labels (B,)


def loss_fn(cfg: Config, output: torch.Tensor, sample) -> torch.Tensor:
    # float32 upcast: a bf16 model's loss is reported in float32 (a no-op for float32 models)
    if cfg.family == "transposed":
        return F.mse_loss(output.float(), sample)  # reconstruct the input
    return F.cross_entropy(output.float(), sample[1])


def make(cfg: Config):
    return ConvNet(cfg), partial(make_sample, cfg), partial(loss_fn, cfg)
