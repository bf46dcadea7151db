"""resnet-tiny: a small ResNet for 3x32x32 images and 10 classes, as a list of blocks.

GroupNorm instead of BatchNorm, so a sample's result does not depend on which other
samples share its microbatch or device: pipeline/data-parallel runs equal the full-batch
reference exactly. Blocks, in order:

``stem``    Conv2d(3, 16, 3, padding 1, no bias) + GroupNorm(4, 16) + ReLU
``block0``, ``block1``  basic blocks at 16 channels
``block2``  16 -> 32 channels, stride 2 (1x1 conv stride 2 + GroupNorm shortcut)
``block3``  32 channels
``block4``  32 -> 64 channels, stride 2 (1x1 conv stride 2 + GroupNorm shortcut)
``block5``  64 channels
``head``    adaptive average pool + Linear(64, 10) -> logits ``(n, 10)``

Basic block: conv3x3 + GN + ReLU + conv3x3 + GN, add the shortcut, ReLU (convs without bias).
Loss: cross-entropy, mean over the samples of the slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
GROUPS = 4
# (in_channels, out_channels, stride) of block0..block5
_BLOCKS = ((16, 16, 1), (16, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2), (64, 64, 1))
BLOCK_NAMES: tuple[str, ...] = ("stem", *(f"block{i}" for i in range(len(_BLOCKS))), "head")


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(GROUPS, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a (projected when shapes change) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(GROUPS, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(GROUPS, out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.GroupNorm(GROUPS, out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def make_block(name: str) -> nn.Module:
    """A fresh (randomly initialised from torch's current RNG) block by name."""
    if name == "stem":
        return Stem()
    if name == "head":
        return Head()
    if name in BLOCK_NAMES:
        return BasicBlock(*_BLOCKS[int(name.removeprefix("block"))])
    raise KeyError(name)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, mean over the samples of the slice."""
    return F.cross_entropy(logits, targets)
