"""Helpers for the runtime's multi-process tests: plans, a float64 single-process reference,
and small importable targets (spawned processes import this module by name)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from deepcee import nets
from deepcee.plan import Plan, StagePlan
from deepcee.runtime import dist as rdist
from deepcee.runtime.data import Batch, dataset_for
from deepcee.runtime.p2p import P2P, TensorMeta
from deepcee.runtime.partition import Topology
from deepcee.runtime.trainer import OptimizerConfig


def make_plan(model: str, stages: list[tuple[int, int, tuple[str, ...], tuple[int, ...]]], num_microbatches: int,
              schedule: str, actions: tuple[tuple[str, ...], ...] = ()) -> Plan:
    mb = sum(stages[0][3])
    return Plan(
        system="test", cluster="local-small", model=model, global_batch=mb * num_microbatches, microbatch_size=mb,
        num_microbatches=num_microbatches, schedule=schedule, actions=actions,
        stages=tuple(StagePlan(layer_start=a, layer_stop=b, devices=d, shares=s) for a, b, d, s in stages),
    )


@dataclass(frozen=True)
class RegressionData:
    """A seeded regression task for a user-supplied nn.Sequential (8 features -> 3 targets)."""

    seed: int = 0

    def batch(self, step: int, batch_size: int) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 10_007 + step)
        x = torch.randn(batch_size, 8, generator=g)
        return Batch(inputs=x, targets=torch.sin(x[:, :3]) + 0.1 * x[:, 3:6])


def user_model() -> nn.Sequential:
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def reference(model, plan: Plan, steps: int, opt: OptimizerConfig, *, loss_fn=None, dataset=None, seed: int = 0):
    """Single process, float64, full global batch: (losses, step-0 grads, final params) keyed ``"<block>.<name>"``."""
    if isinstance(model, str):
        blocks, default_loss = nets.build(model, seed, dtype=torch.float64)
        loss_fn = loss_fn or default_loss
        dataset = dataset or dataset_for(model, seed)
    else:
        blocks = [b.to(torch.float64) for b in nets.as_blocks(model)]
    named = {f"{i}.{n}": p for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    optimizer = opt.build(list(named.values()))
    losses, grads0 = [], None
    for step in range(steps):
        batch = dataset.batch(step, plan.global_batch)
        x = batch.inputs.double() if batch.inputs.is_floating_point() else batch.inputs
        for b in blocks:
            x = b(x)
        loss = loss_fn(x, batch.targets.double() if batch.targets.is_floating_point() else batch.targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        if grads0 is None:
            grads0 = {k: p.grad.clone() for k, p in named.items()}
        optimizer.step()
    return losses, grads0, {k: p.detach().clone() for k, p in named.items()}


def load_captures(run_dir: str | Path) -> dict[int, dict]:
    return {int(p.stem.removeprefix("rank")): torch.load(p, weights_only=False)
            for p in sorted((Path(run_dir) / "capture").glob("rank*.pt"))}


def silent_sender_target(rank: int, world_size: int, store_path: str, timeout_s: float) -> None:
    """Rank 1 waits for an activation that rank 0 never sends."""
    plan = make_plan("gpt-tiny", [(0, 3, ("cloud0:0",), (2,)), (3, 6, ("edge0:0",), (2,))], 1, "gpipe")
    store = rdist.file_store(store_path, world_size, 30)
    rdist.init_process_group(store=store, rank=rank, world_size=world_size, backend="gloo", timeout_s=30,
                             device=torch.device("cpu"))
    try:
        topo = Topology(plan)
        meta = TensorMeta(shape=(64, 64), dtype="float64")
        p2p = P2P(topology=topo, rank=rank, device=torch.device("cpu"), timeout_s=timeout_s,
                  in_meta=meta if rank == 1 else None, out_meta=meta if rank == 0 else None)
        if rank == 1:
            p2p.recv_forward(0)
        else:
            time.sleep(timeout_s + 3)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def sleeper_target(rank: int, world_size: int, store_path: str, seconds: float) -> None:
    time.sleep(seconds)
