"""Deterministic training data shipped with the package (no downloads).

Every dataset answers ``batch(step, batch_size) -> Batch`` with the *global* batch of step
``step``; it depends only on ``(seed, step, batch_size)``, so every rank computes the same
batch and slices out its own samples (see :mod:`deepcee.runtime.partition`), and a resumed
run continues with exactly the batches it would have seen. A dataset may also answer
``eval_batches(batch_size)`` with held-out global batches ([Note: evaluation data] in
:mod:`deepcee.runtime.evaluation`); both shipped datasets do, from data their training batches
never contain.

- :class:`ByteTextDataset` (``gpt-tiny``): random windows of ``seq_len + 1`` bytes of
  ``deepcee/data/tiny_corpus.txt``; inputs are the first ``seq_len`` bytes, targets the next.
  The last ``holdout_fraction`` (10%) of the corpus is held out: training windows lie before
  it, evaluation windows inside it.
  The corpus is English-like prose written by :func:`generate_corpus` (a seeded grammar with a
  hand-written vocabulary, so there is no licensing question); it is learnable: word
  spelling, grammar and punctuation give a byte-level model plenty to pick up.
- :class:`PatternImageDataset` (``resnet-tiny``): 3x32x32 images of 10 classes; each class
  has a fixed colour grating (orientation, frequency, colour mix drawn from the seed); a
  sample is its class's grating, randomly shifted, at a random contrast, plus Gaussian noise.
  Held-out samples come from a random stream of their own (``eval_size`` of them).
- :class:`ShapeImageDataset` (``convnet-tiny``): 3x16x16 images of 6 shape classes (square,
  disc, triangle, plus, ring, cross), drawn procedurally at a random centre and size, lighter or
  darker than a random background colour, plus Gaussian noise; held out as above.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Protocol

import numpy as np
import torch

from deepcee.errors import SpecError

CORPUS_FILE = "tiny_corpus.txt"


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Inputs and targets of a global batch (first dimension = samples)."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def slice(self, lo: int, hi: int) -> Batch:
        return Batch(inputs=self.inputs[lo:hi], targets=self.targets[lo:hi])


class Dataset(Protocol):
    def batch(self, step: int, batch_size: int) -> Batch: ...


EVAL_STREAM = 0xE7A1
"""Mixed into the seed of held-out batches so they never repeat a training batch's draw."""


# -- text -------------------------------------------------------------------------------

_SUBJECTS = (
    "the old sailor", "a young engineer", "the quiet farmer", "my neighbour", "the river pilot",
    "a tired courier", "the village baker", "our teacher", "the night watchman", "a travelling doctor",
    "the harbour master", "the small child", "a patient gardener", "the mountain guide", "her brother",
    "the clockmaker", "a curious student", "the lighthouse keeper", "the miller", "an honest judge",
)
_VERBS = (
    "carried", "repaired", "painted", "found", "measured", "opened", "watched", "followed",
    "described", "remembered", "counted", "cleaned", "built", "sold", "borrowed", "mended",
    "studied", "visited", "lifted", "checked",
)
_OBJECTS = (
    "the wooden boat", "a heavy basket", "the broken clock", "an old map", "the garden gate",
    "a bundle of letters", "the copper kettle", "the long bridge", "a box of nails", "the blue lantern",
    "the stone wall", "a pair of boots", "the narrow road", "a loaf of bread", "the iron bell",
    "the village well", "a coil of rope", "the tall ladder", "a jar of honey", "the empty barn",
)
_ADVERBS = (
    "slowly", "carefully", "quietly", "before dawn", "in the rain", "without a word", "again",
    "with great care", "after supper", "once more", "at noon", "by lamplight",
)
_PLACES = (
    "near the harbour", "behind the mill", "across the valley", "at the edge of the forest",
    "beside the river", "in the market square", "under the old oak", "on the hill road",
    "inside the workshop", "by the north gate",
)
_LINKS = ("and then", "but", "because", "while", "so", "although", "before", "after")
_OPENERS = (
    "In the morning,", "Later that week,", "Every spring,", "On the third day,", "Long ago,",
    "That evening,", "Some years later,", "At first,",
)
_SAYINGS = (
    "a small mistake can sink a great ship", "the road is shorter with a friend",
    "every tool has its season", "the river remembers what the town forgets",
    "good bread needs time", "a lantern is worth little without oil",
)


def _clause(rng: np.random.Generator) -> str:
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    parts = [pick(_SUBJECTS), pick(_VERBS), pick(_OBJECTS)]
    if rng.random() < 0.5:
        parts.append(pick(_PLACES))
    if rng.random() < 0.4:
        parts.append(pick(_ADVERBS))
    return " ".join(parts)


def _sentence(rng: np.random.Generator) -> str:
    r = rng.random()
    if r < 0.1:
        subject = _SUBJECTS[int(rng.integers(len(_SUBJECTS)))]
        text = f'{subject} said, "{_SAYINGS[int(rng.integers(len(_SAYINGS)))]}."'
    elif r < 0.45:
        text = f"{_clause(rng)} {_LINKS[int(rng.integers(len(_LINKS)))]} {_clause(rng)}."
    else:
        text = _clause(rng) + "."
    if rng.random() < 0.25:
        text = f"{_OPENERS[int(rng.integers(len(_OPENERS)))]} {text}"
    return text[0].upper() + text[1:]


def generate_corpus(seed: int = 0, size_bytes: int = 300_000) -> str:
    """Seeded English-like prose: paragraphs of 3-7 sentences, about ``size_bytes`` long."""
    rng = np.random.default_rng(seed)
    paragraphs, total = [], 0
    while total < size_bytes:
        para = " ".join(_sentence(rng) for _ in range(int(rng.integers(3, 8))))
        paragraphs.append(para)
        total += len(para) + 2
    return "\n\n".join(paragraphs) + "\n"


def load_corpus() -> bytes:
    """The shipped corpus (``deepcee/data/tiny_corpus.txt``) as bytes."""
    return resources.files("deepcee").joinpath("data", CORPUS_FILE).read_bytes()


@dataclass(frozen=True, kw_only=True)
class ByteTextDataset:
    """Byte-level language modelling windows over the shipped corpus. See the module docstring."""

    seq_len: int = 64
    seed: int = 0
    holdout_fraction: float = 0.1

    @cached_property
    def tokens(self) -> np.ndarray:
        data = np.frombuffer(load_corpus(), dtype=np.uint8)
        if data.size * min(self.holdout_fraction, 1 - self.holdout_fraction) < self.seq_len + 2:
            raise SpecError(f"corpus has {data.size} bytes: too few for windows of seq_len + 1 = {self.seq_len + 1} "
                            f"on both sides of a {self.holdout_fraction:g} hold-out")
        return data

    @property
    def split(self) -> int:
        """First byte of the held-out part."""
        return int(self.tokens.size * (1 - self.holdout_fraction))

    def _windows(self, rng: np.random.Generator, lo: int, hi: int, n: int) -> Batch:
        starts = rng.integers(lo, hi - self.seq_len - 1, size=n)
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        w = torch.from_numpy(windows)
        return Batch(inputs=w[:, :-1].contiguous(), targets=w[:, 1:].contiguous())

    def batch(self, step: int, batch_size: int) -> Batch:
        return self._windows(np.random.default_rng([self.seed, step, batch_size]), 0, self.split, batch_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """Random windows inside the held-out part (about as many batches as it has windows)."""
        count = max(1, (self.tokens.size - self.split) // ((self.seq_len + 1) * batch_size))
        for i in range(count):
            rng = np.random.default_rng([self.seed, EVAL_STREAM, i, batch_size])
            yield self._windows(rng, self.split, self.tokens.size, batch_size)


# -- images -----------------------------------------------------------------------------


class _DrawnImages:
    """Images drawn from a seeded stream per step, and held-out ones from a stream training never
    draws from; subclasses say how to draw a batch (``_draw``) and hold ``seed`` and ``eval_size``."""

    __slots__ = ()

    def batch(self, step: int, batch_size: int) -> Batch:
        return self._draw(np.random.default_rng([self.seed, step, batch_size]), batch_size)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """``eval_size`` held-out samples, from a random stream training never draws from."""
        for i in range(max(1, self.eval_size // batch_size)):
            yield self._draw(np.random.default_rng([self.seed, EVAL_STREAM, i, batch_size]), batch_size)


@dataclass(frozen=True, kw_only=True)
class PatternImageDataset(_DrawnImages):
    """Class-dependent colour gratings plus noise. See the module docstring."""

    num_classes: int = 10
    image_size: int = 32
    noise_std: float = 0.8
    seed: int = 0
    eval_size: int = 512
    """Held-out samples (:meth:`eval_batches`)."""

    @cached_property
    def templates(self) -> np.ndarray:
        """``(classes, 3, H, W)`` float32 gratings, unit peak amplitude."""
        rng = np.random.default_rng([self.seed, 0xC1A55])
        yy, xx = np.mgrid[0:self.image_size, 0:self.image_size] / self.image_size
        out = np.empty((self.num_classes, 3, self.image_size, self.image_size), dtype=np.float32)
        for c in range(self.num_classes):
            angle = math.pi * c / self.num_classes + rng.uniform(-0.1, 0.1)
            freq = rng.uniform(2.0, 5.0)
            wave = np.sin(2 * math.pi * freq * (np.cos(angle) * xx + np.sin(angle) * yy))
            colour = rng.uniform(-1.0, 1.0, size=3)
            out[c] = colour[:, None, None] * wave[None]
        return out

    def _draw(self, rng: np.random.Generator, batch_size: int) -> Batch:
        labels = rng.integers(0, self.num_classes, size=batch_size)
        shifts = rng.integers(0, self.image_size, size=(batch_size, 2))
        contrast = rng.uniform(0.5, 1.5, size=batch_size).astype(np.float32)
        images = np.stack([
            np.roll(self.templates[c], (int(dy), int(dx)), axis=(1, 2)) for c, (dy, dx) in zip(labels, shifts, strict=True)
        ]) * contrast[:, None, None, None]
        images += rng.normal(0.0, self.noise_std, size=images.shape).astype(np.float32)
        return Batch(inputs=torch.from_numpy(images.astype(np.float32)), targets=torch.from_numpy(labels.astype(np.int64)))


SHAPES = ("square", "disc", "triangle", "plus", "ring", "cross")


def _shape_masks(labels: np.ndarray, cy: np.ndarray, cx: np.ndarray, r: np.ndarray, size: int) -> np.ndarray:
    """``(n, size, size)`` bool masks of shape ``labels[i]`` centred at ``(cy, cx)`` of radius ``r``."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    dy, dx = yy[None] - cy[:, None, None], xx[None] - cx[:, None, None]
    r = r[:, None, None]
    ay, ax, box = np.abs(dy), np.abs(dx), np.maximum(np.abs(dx), np.abs(dy)) <= r
    dist = np.sqrt(dx * dx + dy * dy)
    masks = np.stack([
        box,                                                          # square
        dist <= r,                                                    # disc
        (ay <= r) & (ax <= (dy + r) / 2),                             # triangle, apex up
        box & ((ax <= r / 3) | (ay <= r / 3)),                        # plus
        (dist <= r) & (dist >= 0.55 * r),                             # ring
        box & (np.abs(ax - ay) <= r / 3),                             # cross (x)
    ])
    return masks[labels, np.arange(len(labels))]


@dataclass(frozen=True, kw_only=True)
class ShapeImageDataset(_DrawnImages):
    """Procedurally drawn shapes plus noise. See the module docstring."""

    image_size: int = 16
    noise_std: float = 0.35
    seed: int = 0
    eval_size: int = 512
    """Held-out samples (:meth:`eval_batches`)."""

    @property
    def num_classes(self) -> int:
        return len(SHAPES)

    def _draw(self, rng: np.random.Generator, n: int) -> Batch:
        size = self.image_size
        labels = rng.integers(0, self.num_classes, size=n)
        r = rng.uniform(0.2, 0.4, size=n).astype(np.float32) * size
        cy, cx = (rng.uniform(r, size - 1 - r).astype(np.float32) for _ in range(2))
        bg = rng.uniform(-0.5, 0.5, size=(n, 3, 1, 1)).astype(np.float32)
        # the shape differs from the background by at least 0.7 in every channel, either way
        step = rng.choice([-1.0, 1.0], size=(n, 1, 1, 1)) * rng.uniform(0.7, 1.2, size=(n, 3, 1, 1))
        mask = _shape_masks(labels, cy, cx, r, size)[:, None].astype(np.float32)
        images = bg + mask * step.astype(np.float32) + rng.normal(0.0, self.noise_std, size=(n, 3, size, size))
        return Batch(inputs=torch.from_numpy(images.astype(np.float32)), targets=torch.from_numpy(labels.astype(np.int64)))


def dataset_for(model: str, seed: int = 0) -> Dataset:
    """The shipped dataset of a built-in net."""
    if model == "gpt-tiny":
        return ByteTextDataset(seed=seed)
    if model == "resnet-tiny":
        return PatternImageDataset(seed=seed)
    if model == "convnet-tiny":
        return ShapeImageDataset(seed=seed)
    raise SpecError(f"no shipped dataset for model {model!r} (known: gpt-tiny, resnet-tiny, convnet-tiny)",
                    field="model")
