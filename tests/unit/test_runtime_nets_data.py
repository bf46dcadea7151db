"""Built-in nets match their spec; shipped data is deterministic and learnable-looking."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepcee import nets
from deepcee.errors import SpecError
from deepcee.runtime.data import (
    ByteTextDataset,
    PatternImageDataset,
    dataset_for,
    generate_corpus,
    load_corpus,
)

torch.set_num_threads(1)


def _count(blocks):
    return [sum(p.numel() for p in b.parameters()) for b in blocks]


def test_gpt_tiny_shapes_and_parameter_counts():
    blocks, loss_fn = nets.build("gpt-tiny", seed=0)
    assert nets.block_names("gpt-tiny") == ("embed", "block0", "block1", "block2", "block3", "head")
    block = 2 * 64 * 2 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    assert _count(blocks) == [256 * 64 + 64 * 64, block, block, block, block, 2 * 64 + 64 * 256 + 256]
    batch = dataset_for("gpt-tiny").batch(0, 3)
    x = batch.inputs
    for b in blocks:
        x = b(x)
    assert x.shape == (3, 64, 256)
    # untrained: loss near ln(256)
    assert abs(loss_fn(x, batch.targets).item() - 5.545) < 0.5


def test_gpt_tiny_attention_is_causal():
    blocks, _ = nets.build("gpt-tiny", seed=0)
    idx = dataset_for("gpt-tiny").batch(1, 1).inputs
    changed = idx.clone()
    changed[0, 40] = (changed[0, 40] + 1) % 256
    outs = []
    for i in (idx, changed):
        x = i
        for b in blocks:
            x = b(x)
        outs.append(x)
    torch.testing.assert_close(outs[0][:, :40], outs[1][:, :40])
    assert not torch.allclose(outs[0][:, 40:], outs[1][:, 40:])


def test_resnet_tiny_shapes_and_groupnorm():
    blocks, loss_fn = nets.build("resnet-tiny", seed=0)
    assert len(blocks) == 8
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for b in blocks for m in b.modules())
    batch = dataset_for("resnet-tiny").batch(0, 4)
    x, shapes = batch.inputs, []
    for b in blocks:
        x = b(x)
        shapes.append(tuple(x.shape[1:]))
    assert shapes == [(16, 32, 32), (16, 32, 32), (16, 32, 32), (32, 16, 16), (32, 16, 16),
                      (64, 8, 8), (64, 8, 8), (10,)]
    # a sample's output does not depend on the rest of its batch (GroupNorm)
    x1 = batch.inputs[:1]
    for b in blocks:
        x1 = b(x1)
    torch.testing.assert_close(x1, x[:1], rtol=1e-5, atol=1e-6)
    assert loss_fn(x, batch.targets).item() > 0


def test_build_is_deterministic_and_seeded():
    a, _ = nets.build("resnet-tiny", seed=1)
    b, _ = nets.build("resnet-tiny", seed=1)
    c, _ = nets.build("resnet-tiny", seed=2)
    pa, pb, pc = ([p for blk in m for p in blk.parameters()] for m in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc, strict=True))
    with pytest.raises(SpecError, match="unknown net"):
        nets.build("nope")


def test_as_blocks():
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert len(nets.as_blocks(seq)) == 3
    assert len(nets.as_blocks([nn.Linear(2, 2)])) == 1
    with pytest.raises(SpecError, match="not a torch.nn.Module"):
        nets.as_blocks([nn.Linear(2, 2), "x"])


def test_datasets_are_deterministic_per_step():
    for ds in (ByteTextDataset(), PatternImageDataset()):
        a, b, c = ds.batch(5, 8), ds.batch(5, 8), ds.batch(6, 8)
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert not torch.equal(a.inputs, c.inputs)
    text = ByteTextDataset().batch(0, 2)
    assert torch.equal(text.inputs[:, 1:], text.targets[:, :-1])


def test_shipped_corpus_is_the_generator_output():
    assert load_corpus() == generate_corpus(0).encode()
    assert 200_000 < len(load_corpus()) < 500_000


def test_image_classes_are_separable_by_template_correlation():
    ds = PatternImageDataset()
    batch = ds.batch(0, 200)
    t = torch.from_numpy(ds.templates).flatten(1)
    x = batch.inputs.flatten(1)
    # best circular shift is unknown to this check, so use the power spectrum (shift-invariant)
    spec_x = torch.fft.fft2(batch.inputs).abs().flatten(1)
    spec_t = torch.fft.fft2(torch.from_numpy(ds.templates)).abs().flatten(1)
    pred = torch.cdist(spec_x / spec_x.norm(dim=1, keepdim=True), spec_t / spec_t.norm(dim=1, keepdim=True)).argmin(1)
    assert (pred == batch.targets).float().mean() > 0.6
    assert x.shape[1] == t.shape[1]
