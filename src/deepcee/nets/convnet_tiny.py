"""convnet-tiny: a small plain conv net for 3x16x16 images and 6 classes, as a list of blocks.

Made to train to a meaningful accuracy in well under a minute on one CPU core (the shapes task
of :class:`~deepcee.runtime.data.ShapeImageDataset`), so time-to-target runs fit a small
machine. GroupNorm, not BatchNorm, so a sample's result does not depend on which other samples
share its microbatch or device. Blocks, in order:

``stem``    Conv2d(3, 16, 3, padding 1, no bias) + GroupNorm(4, 16) + ReLU      (16x16)
``block0``  Conv2d(16, 32, 3, stride 2, padding 1, no bias) + GroupNorm(4, 32) + ReLU  (8x8)
``block1``  Conv2d(32, 32, 3, padding 1, no bias) + GroupNorm(4, 32) + ReLU     (8x8)
``block2``  Conv2d(32, 64, 3, stride 2, padding 1, no bias) + GroupNorm(4, 64) + ReLU  (4x4)
``head``    adaptive average pool + Linear(64, 6) -> logits ``(n, 6)``

Loss: cross-entropy, mean over the samples of the slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SHAPE = (3, 16, 16)
NUM_CLASSES = 6
GROUPS = 4
# (in_channels, out_channels, stride) of stem, block0..block2
CONVS = ((3, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2))
BLOCK_NAMES: tuple[str, ...] = ("stem", "block0", "block1", "block2", "head")


class ConvBlock(nn.Module):
    """Conv3x3 (padding 1, no bias) + GroupNorm + ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm = nn.GroupNorm(GROUPS, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(CONVS[-1][1], NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def make_block(name: str) -> nn.Module:
    """A fresh (randomly initialised from torch's current RNG) block by name."""
    if name == "head":
        return Head()
    if name in BLOCK_NAMES:
        return ConvBlock(*CONVS[BLOCK_NAMES.index(name)])
    raise KeyError(name)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, mean over the samples of the slice."""
    return F.cross_entropy(logits, targets)
