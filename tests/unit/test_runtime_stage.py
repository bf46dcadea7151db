"""Split backward (I then W) equals fused backward and a plain autograd reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepcee import nets
from deepcee.errors import ScheduleError
from deepcee.runtime.data import dataset_for
from deepcee.runtime.stage import StageRunner

torch.set_num_threads(1)


def _reference(blocks, loss_fn, batch, scale):
    for b in blocks:
        b.zero_grad(set_to_none=True)
    x = batch.inputs.double() if batch.inputs.is_floating_point() else batch.inputs
    for b in blocks:
        x = b(x)
    (loss_fn(x, batch.targets) * scale).backward()
    return [p.grad.clone() for b in blocks for p in b.parameters()]


def _run_pipeline(name: str, split: int, split_backward: bool, microbatches: int = 3, recompute: bool = False):
    """Two stages in one process, microbatches of 2 samples; returns (loss, grads) in block order."""
    blocks, loss_fn = nets.build(name, seed=3, dtype=torch.float64)
    first = StageRunner(blocks[:split], stage=0, is_first=True, is_last=False, dtype=torch.float64,
                        recompute=recompute)
    last = StageRunner(blocks[split:], stage=1, is_first=False, is_last=True, loss_fn=loss_fn, dtype=torch.float64,
                       recompute=recompute)
    batch = dataset_for(name).batch(0, 2 * microbatches)
    scale = 2 / (2 * microbatches)
    loss = 0.0
    for m in range(microbatches):
        mb = batch.slice(2 * m, 2 * m + 2)
        act = first.forward(m, mb.inputs)
        loss += last.forward(m, act, mb.targets, loss_scale=scale).item()
    for m in reversed(range(microbatches)):
        if split_backward:
            g = last.backward_input(m)
            first.backward_input(m, g)
            last.backward_weight(m)
            first.backward_weight(m)
        else:
            first.backward(m, last.backward(m))
    assert first.in_flight == 0 and last.in_flight == 0
    grads = [p.grad.clone() for s in (first, last) for p in s.module.parameters()]
    ref_blocks, _ = nets.build(name, seed=3, dtype=torch.float64)
    ref = _reference(ref_blocks, loss_fn, batch, 1.0)
    return loss, grads, ref


@pytest.mark.parametrize("name,split", [("gpt-tiny", 2), ("gpt-tiny", 5), ("resnet-tiny", 1), ("resnet-tiny", 4)])
@pytest.mark.parametrize("split_backward", [True, False])
def test_stage_gradients_match_reference(name, split, split_backward):
    _, grads, ref = _run_pipeline(name, split, split_backward)
    assert len(grads) == len(ref)
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name,split", [("gpt-tiny", 3), ("resnet-tiny", 2)])
@pytest.mark.parametrize("split_backward", [True, False])
def test_recompute_gives_the_same_loss_and_gradients(name, split, split_backward):
    loss0, grads0, ref = _run_pipeline(name, split, split_backward)
    loss1, grads1, _ = _run_pipeline(name, split, split_backward, recompute=True)
    assert loss1 == pytest.approx(loss0, rel=1e-12)
    for g0, g1, r in zip(grads0, grads1, ref, strict=True):
        torch.testing.assert_close(g1, r, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(g1, g0, rtol=1e-12, atol=1e-14)


def test_recompute_keeps_only_the_input_until_the_backward():
    blocks, loss_fn = nets.build("gpt-tiny", seed=3, dtype=torch.float64)
    stage = StageRunner(blocks[:3], stage=0, is_first=True, is_last=False, dtype=torch.float64, recompute=True)
    batch = dataset_for("gpt-tiny").batch(0, 2)
    out = stage.forward(0, batch.inputs)
    assert not out.requires_grad and stage._state[0].output is None  # no graph held after F
    stage.backward_input(0, torch.ones_like(out))
    assert stage._state[0].output is not None  # rebuilt for I, kept for W
    stage.backward_weight(0)
    assert stage.in_flight == 0


def test_recompute_replays_the_random_state():
    """A stage with dropout: the re-run forward draws the same mask as the first one."""
    torch.manual_seed(11)
    net = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 2)).double()
    x, gy = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    plain = StageRunner([net], stage=1, is_first=False, is_last=False, dtype=torch.float64)
    again = StageRunner([net], stage=1, is_first=False, is_last=False, dtype=torch.float64, recompute=True)
    torch.manual_seed(5)
    y0 = plain.forward(0, x)
    g0 = plain.backward(0, gy)
    torch.manual_seed(5)
    y1 = again.forward(0, x)
    torch.rand(100)  # other work moves the generator between F and B
    g1 = again.backward(0, gy)
    torch.testing.assert_close(y1, y0)
    torch.testing.assert_close(g1, g0)


class _Tied(nn.Module):
    """Uses one weight twice around another layer: two intermediates reach the same weight."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)

    def forward(self, x):
        return self.a(torch.tanh(self.b(self.a(x))))


def test_weight_used_twice_is_not_counted_twice():
    torch.manual_seed(0)
    model = _Tied().double()
    x = torch.randn(4, 5, dtype=torch.float64)
    gy = torch.randn(4, 5, dtype=torch.float64)
    stage = StageRunner([model], stage=1, is_first=False, is_last=False, dtype=torch.float64)
    stage.forward(0, x)
    gx = stage.backward_input(0, gy)
    stage.backward_weight(0)
    split = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    xr = x.clone().requires_grad_(True)
    model(xr).backward(gy)
    for g, r in zip(split, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gx, xr.grad, rtol=1e-12, atol=1e-14)


def test_out_of_order_actions_raise():
    blocks, loss_fn = nets.build("resnet-tiny", seed=0)
    stage = StageRunner(blocks[:2], stage=0, is_first=True, is_last=False)
    with pytest.raises(ScheduleError, match="before its F"):
        stage.backward_input(0, torch.zeros(1))
    batch = dataset_for("resnet-tiny").batch(0, 2)
    out = stage.forward(0, batch.inputs)
    with pytest.raises(ScheduleError, match="before its I"):
        stage.backward_weight(0)
    stage.backward_input(0, torch.ones_like(out))
    with pytest.raises(ScheduleError, match="after its I"):
        stage.backward(0, torch.ones_like(out))


@pytest.mark.parametrize("split_backward", [True, False])
def test_first_stage_without_parameters_runs_every_action(split_backward):
    """A first stage of parameter-less layers has no autograd graph at all: I, W and B do nothing
    (no input gradient to return) instead of failing, and the next stage still trains."""
    torch.manual_seed(0)
    first = StageRunner([nn.Tanh(), nn.ReLU()], stage=0, is_first=True, is_last=False, dtype=torch.float64)
    assert first.params == []
    last = StageRunner([nn.Linear(4, 2)], stage=1, is_first=False, is_last=True, loss_fn=nn.functional.mse_loss,
                       dtype=torch.float64)
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    act = first.forward(0, x)
    last.forward(0, act, y)
    if split_backward:
        g = last.backward_input(0)
        assert first.backward_input(0, g) is None
        first.backward_weight(0)
        last.backward_weight(0)
    else:
        g = last.backward(0)
        assert first.backward(0, g) is None
    assert first.in_flight == 0 and last.in_flight == 0
    ref = nn.Linear(4, 2).double()
    ref.load_state_dict(last.module[0].state_dict())
    nn.functional.mse_loss(ref(torch.relu(torch.tanh(x))), y).backward()
    torch.testing.assert_close(last.module[0].weight.grad, ref.weight.grad)


def test_parameter_less_stage_with_input_gradient_passes_the_gradient_through():
    """An inner stage whose layers have no parameters still returns the input gradient (I and B)."""
    x = torch.randn(3, 4, dtype=torch.float64)
    g = torch.randn(3, 4, dtype=torch.float64)
    for split in (True, False):
        stage = StageRunner([nn.Tanh()], stage=1, is_first=False, is_last=False, dtype=torch.float64)
        stage.forward(0, x)
        gx = stage.backward_input(0, g) if split else stage.backward(0, g)
        if split:
            stage.backward_weight(0)
        torch.testing.assert_close(gx, g * (1 - torch.tanh(x) ** 2))
