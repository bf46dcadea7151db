"""Mixed precision on CUDA: bfloat16 autocast trains like float32 within bfloat16's rounding;
float16 autocast with the dynamic loss scale trains (overflowing steps are skipped, not
applied). One device, one rank; skipped when torch.cuda.is_available() is False."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from deepcee.plan import Plan, StagePlan
from deepcee.runtime.data import Batch
from deepcee.runtime.job import OptimizerConfig
from deepcee.runtime.launch import run_training
from deepcee.scenarios import load_scenario

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
STEPS = 6
PLAN = Plan(system="test", cluster="local-small", model="user", global_batch=16, microbatch_size=8,
            num_microbatches=2, schedule="1f1b",
            stages=(StagePlan(layer_start=0, layer_stop=3, devices=("cloud0:0",), shares=(8,)),))


class Regression:
    def batch(self, step: int, batch_size: int) -> Batch:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(batch_size, 8, generator=g)
        return Batch(inputs=x, targets=torch.sin(x[:, :3]))


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 3))


def _reference() -> list[float]:
    model, data = _model(), Regression()
    opt = SGD.build(list(model.parameters()))
    losses = []
    for step in range(STEPS):
        b = data.batch(step, PLAN.global_batch)
        loss = nn.functional.mse_loss(model(b.inputs), b.targets)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def _run(tmp_path, autocast: str):
    return run_training(PLAN, load_scenario("local-small"), model=_model(), loss_fn=nn.functional.mse_loss,
                        dataset=Regression(), steps=STEPS, run_dir=tmp_path, mode="real", use_cuda=True,
                        autocast=autocast, clip_grad_norm=1.0, optimizer=SGD, deadline_s=300)


def test_bfloat16_autocast_follows_float32(tmp_path):
    res = _run(tmp_path, "bfloat16")
    assert res.ranks[0].backend == "nccl" and res.ranks[0].torch_device.startswith("cuda")
    assert res.losses == pytest.approx(_reference(), rel=3e-2)
    assert all(m.grad_norm is not None and math.isfinite(m.grad_norm) for m in res.metrics)


def test_float16_autocast_with_loss_scale_trains(tmp_path):
    res = _run(tmp_path, "float16")
    assert all(math.isfinite(x) for x in res.losses)
    assert res.losses[-1] < res.losses[0]
