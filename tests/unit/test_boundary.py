"""Stage boundaries that carry a structure of tensors: flatten/unflatten, the agreed meta, and
two stages in one process whose boundary holds a tensor with a gradient, a floating tensor
without one and an integer tensor, against plain autograd (split and fused backward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepcee.errors import SpecError
from deepcee.runtime import boundary
from deepcee.runtime.boundary import BoundaryMeta, TensorMeta
from deepcee.runtime.stage import StageRunner

torch.set_num_threads(1)


def test_flatten_round_trip_and_meta_json():
    x = {"h": torch.zeros(3, 4), "extra": (torch.ones(3, dtype=torch.long), None), "l": [torch.zeros(3, 2)]}
    spec, leaves = boundary.flatten(x)
    assert len(leaves) == 4 and leaves[2] is None
    back = boundary.unflatten(spec, leaves)
    assert back.keys() == x.keys() and isinstance(back["extra"], tuple) and isinstance(back["l"], list)
    meta = BoundaryMeta.of(x)
    assert [t.shape for t in meta.tensors] == [(4,), (), (2,)]
    assert BoundaryMeta.from_dict(meta.to_dict()) == meta
    assert TensorMeta.from_json(meta.to_json()) == meta
    assert meta.bytes_per_sample == 4 * 4 + 8 + 2 * 4
    zeros = meta.zeros(5)
    assert zeros["extra"][1] is None and zeros["h"].shape == (5, 4) and zeros["extra"][0].dtype == torch.long
    assert meta.pick(None) == [None, None, None]
    assert boundary.num_samples(boundary.take(x, 1, 3)) == 2


def test_bad_boundary_values_name_where_they_are():
    with pytest.raises(SpecError, match=r"boundary\['n'\]: .* got int"):
        boundary.flatten({"h": torch.zeros(2), "n": 3})
    with pytest.raises(SpecError, match="samples first"):
        boundary.num_samples({"a": torch.zeros(2, 3), "b": torch.zeros(1, 3)})


def test_grad_flags_follow_autograd():
    w = nn.Parameter(torch.ones(3))
    x = torch.randn(2, 3)
    meta = BoundaryMeta.of({"h": x * w, "cos": x.cos(), "ids": torch.zeros(2, dtype=torch.long)})
    assert meta.grad_mask == (True, False, False)
    assert TensorMeta.of(x * w).grad  # a plain tensor keeps the single-tensor meta


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        n = x.shape[0]
        return {"h": torch.tanh(self.lin(x)), "side": self.scale * x.sum(1, keepdim=True),
                "rot": torch.arange(4.0).expand(n, 4).sin(), "ids": (x[:, 0] > 0).long()}


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, s: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(s["h"] * s["rot"] + s["side"]) + s["ids"][:, None].to(s["h"].dtype)


def _reference(blocks, x, y):
    out = blocks[1](blocks[0](x))
    nn.functional.mse_loss(out, y).backward()
    return [p.grad.clone() for b in blocks for p in b.parameters()]


@pytest.mark.parametrize("split_backward", [True, False])
def test_structured_boundary_gradients_match_autograd(split_backward):
    torch.manual_seed(0)
    blocks = [First().double(), Last().double()]
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    ref = _reference(blocks, x, y)
    for b in blocks:
        b.zero_grad(set_to_none=True)
    first = StageRunner([blocks[0]], stage=0, is_first=True, is_last=False, dtype=torch.float64)
    last = StageRunner([blocks[1]], stage=1, is_first=False, is_last=True, loss_fn=nn.functional.mse_loss,
                       dtype=torch.float64)
    last.input_grads = BoundaryMeta.of(blocks[0](x)).grad_mask  # what start-up agrees: h and side only
    for m in range(3):
        out = first.forward(m, x[2 * m:2 * m + 2])
        last.forward(m, out, y[2 * m:2 * m + 2], loss_scale=1 / 3)
        assert first.output_grad_mask(m) == (True, True, False, False)
    for m in range(3):
        if split_backward:
            g = last.backward_input(m)
            last.backward_weight(m)
        else:
            g = last.backward(m)
        assert g["rot"] is None and g["ids"] is None and g["h"].shape == (2, 4)
        if split_backward:
            assert first.backward_input(m, g) is None
            first.backward_weight(m)
        else:
            first.backward(m, g)
    grads = [p.grad for s in (first, last) for p in s.module.parameters()]
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)


def test_profiler_probes_blocks_with_structured_boundaries():
    """The per-layer probe drives the same stage runner: a dict boundary whose rotary-like
    tensor gets no gradient is timed, and its bytes are counted, like a plain one."""
    from deepcee.profiler.layer_probe import probe_blocks
    from deepcee.profiler.probes import ProbeConfig

    torch.manual_seed(0)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    layers, ranges, _ = probe_blocks([First(), Last()], inputs=x, targets=y, loss_fn=nn.functional.mse_loss,
                                     config=ProbeConfig(microbatch_sizes=(1, 2), warmup=0, repeats=1, score_repeats=1))
    assert len(layers) == 2 and len(ranges) == 1
    assert all(la.passes[p].median_s[-1] > 0 for la in layers for p in ("F", "I", "W", "B"))
    assert layers[0].peak_memory_bytes > 0
