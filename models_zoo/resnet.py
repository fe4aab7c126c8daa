"""ResNet (He et al. 2015) with BatchNorm, laid out like torchvision's resnet.

Parameter names and counts match torchvision (resnet18: 11,689,512;
resnet50: 25,557,032), with the v1.5 choice of striding the 3x3 conv in
bottleneck blocks.

Sample: tuple (images (B, 3, H, W) float32, labels (B,) int64), so call
model(*sample).
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models_zoo import _common


@dataclass(frozen=True)
class Config:
    block: str = "bottleneck"  # "basic" (resnet18/34) or "bottleneck" (resnet50+)
    layers: tuple[int, int, int, int] = (1, 1, 1, 1)  # blocks per stage
    width: int = 8  # stem/stage-1 channels; 64 in every ImageNet ResNet
    num_classes: int = 10  # classifier outputs
    image_size: int = 32  # the torchvision stem downsamples 32x, so >= 32 keeps stage 4 at >= 1x1
    in_channels: int = 3  # RGB


SIZES: dict[str, Config] = {
    "debug": Config(),
    "resnet18": Config(block="basic", layers=(2, 2, 2, 2), width=64, num_classes=1000, image_size=224),
    "resnet50": Config(block="bottleneck", layers=(3, 4, 6, 3), width=64, num_classes=1000, image_size=224),
}


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    # no bias: the following BatchNorm's shift makes it redundant
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None):
        super().__init__()
        self.conv1 = conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None):
        super().__init__()
        self.conv1 = conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)  # v1.5: stride here, not in conv1
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


_BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.block not in _BLOCKS:
            raise ValueError(f"block must be one of {sorted(_BLOCKS)}, got {cfg.block!r}")
        self.cfg = cfg
        block = _BLOCKS[cfg.block]
        self.inplanes = cfg.width
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(cfg.width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._stage(block, cfg.width, cfg.layers[0], stride=1)
        self.layer2 = self._stage(block, cfg.width * 2, cfg.layers[1], stride=2)
        self.layer3 = self._stage(block, cfg.width * 4, cfg.layers[2], stride=2)
        self.layer4 = self._stage(block, cfg.width * 8, cfg.layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cfg.width * 8 * block.expansion, cfg.num_classes)

    def _stage(self, block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            # the shortcut must match the block's output shape to be added to it
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, 1, None) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # labels is accepted so model(*sample) works; the loss lives in loss_fn
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))  # (B, W, H/4, W/4)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # (B, 8W*exp, H/32, W/32)
        x = torch.flatten(self.avgpool(x), 1)  # (B, 8W*exp)
        return self.fc(x)  # (B, num_classes)


def make_sample(cfg: Config, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    _common.check_batch(batch)
    images = _common.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size)
    return images, _common.randint(cfg.num_classes, batch)


def loss_fn(output: torch.Tensor, sample: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, sample[1])


def make(cfg: Config):
    return ResNet(cfg), partial(make_sample, cfg), loss_fn
