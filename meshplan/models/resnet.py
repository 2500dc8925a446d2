"""A small ResNet (conv, batch norm, ReLU, max pool, residual adds, average pool, linear head) for
tests and examples of convolutional models."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True, slots=True)
class ResNetConfig:
    in_channels: int = 3
    """Channels of the input image."""
    width: int = 8
    """Channels of the stem; each stage doubles them."""
    stages: int = 2
    """Stages of one basic block each; every stage after the first halves the resolution."""
    classes: int = 10
    """Outputs of the linear head."""


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the input (projected by a 1x1 conv when the shape changes), then relu."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig = ResNetConfig()) -> None:
        super().__init__()
        w = config.width
        self.stem = nn.Sequential(nn.Conv2d(config.in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2))
        blocks, cin = [], w
        for i in range(config.stages):
            cout = w * 2**i
            blocks.append(BasicBlock(cin, cout, stride=1 if i == 0 else 2))
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cin, config.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.layers(self.stem(x))).flatten(1))


def resnet_small():
    """`(model, example_inputs, example_kwargs)`: the default ResNet on a batch of 8 16x16 images."""
    torch.manual_seed(0)
    return ResNet(), (torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)),), {}
