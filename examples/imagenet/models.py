"""Residual networks written out compactly, so the ImageNet example runs without torchvision.

``resnet18`` .. ``resnet152`` follow the layer counts and widths of He et al. (2016) with the ImageNet
stem (7x7 convolution, stride 2, then max pooling); ``resnet_tiny`` is the same design at a width of 8
with one block per stage, small enough to train for a few iterations on a CPU in a test.

:func:`build_model` prefers torchvision's implementation of a name when torchvision is installed, so
``-a vgg16`` or ``-a alexnet`` work there; the names below always work.
"""
from typing import Callable, Dict, List, Type, Union

import torch
from torch import nn


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """Identity when the shapes match, else a strided 1x1 projection (He et al.'s option B)."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                         nn.BatchNorm2d(out_channels))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(
            _conv3x3(in_channels, width, stride), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            _conv3x3(width, width), nn.BatchNorm2d(width))
        self.shortcut = _shortcut(in_channels, width, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with a residual connection (ResNet-50 and deeper)."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            _conv3x3(width, width, stride), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, out_channels, kernel_size=1, bias=False), nn.BatchNorm2d(out_channels))
        self.shortcut = _shortcut(in_channels, out_channels, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """ImageNet-style residual network.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: number of blocks in each of the four stages.
        num_classes: size of the classifier output.
        base_width: channels of the stem and the first stage (doubled at each later stage).
    """

    def __init__(self, block: Type[Union[BasicBlock, Bottleneck]], layers: List[int], num_classes: int = 1000,
                 base_width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base_width, kernel_size=7, stride=2, padding=3, bias=False), nn.BatchNorm2d(base_width),
            nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        stages, channels = [], base_width
        for index, num_blocks in enumerate(layers):
            width = base_width * 2 ** index
            for block_index in range(num_blocks):
                stride = 2 if index > 0 and block_index == 0 else 1
                stages.append(block(channels, width, stride))
                channels = width * block.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Global average pooling as a mean: unlike AdaptiveAvgPool2d, its CUDA backward is deterministic.
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


ARCHITECTURES: Dict[str, Callable[..., ResNet]] = {
    "resnet_tiny": lambda num_classes: ResNet(BasicBlock, [1, 1, 1, 1], num_classes, base_width=8),
    "resnet18": lambda num_classes: ResNet(BasicBlock, [2, 2, 2, 2], num_classes),
    "resnet34": lambda num_classes: ResNet(BasicBlock, [3, 4, 6, 3], num_classes),
    "resnet50": lambda num_classes: ResNet(Bottleneck, [3, 4, 6, 3], num_classes),
    "resnet101": lambda num_classes: ResNet(Bottleneck, [3, 4, 23, 3], num_classes),
    "resnet152": lambda num_classes: ResNet(Bottleneck, [3, 8, 36, 3], num_classes),
}


def torchvision_architectures() -> List[str]:
    """Model constructors torchvision offers (empty when torchvision is not installed)."""
    try:
        import torchvision.models
    except ImportError:
        return []
    return sorted(name for name, item in torchvision.models.__dict__.items()
                  if name.islower() and not name.startswith("_") and callable(item))


def available_architectures() -> List[str]:
    """Every name ``--arch`` accepts here."""
    return sorted(set(ARCHITECTURES) | set(torchvision_architectures()))


def build_model(arch: str, num_classes: int) -> nn.Module:
    """torchvision's ``arch`` when torchvision has it, else the built-in one.

    Raises:
        ValueError: neither knows ``arch``.
    """
    if arch in torchvision_architectures():
        import torchvision.models
        return torchvision.models.__dict__[arch](num_classes=num_classes)
    if arch in ARCHITECTURES:
        return ARCHITECTURES[arch](num_classes)
    raise ValueError(f"unknown architecture {arch!r}: choose one of {available_architectures()} "
                     "(install torchvision for its models)")
