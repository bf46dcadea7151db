"""Overlapped model averaging on the runtime ([Note: overlapped averaging]): plain and DiLoCo's
outer Nesterov, three replicas of uneven batches (4, 2, 2) incl. a two-stage replica and a stage
on two devices, a run that ends between sync points, equal a single-process re-enactment of the
rule BIT FOR BIT (every parameter of every rank) and in their losses; evaluations evaluate the
anchor and leave the replicas' own copies as they were; a run stopped at the target loss keeps
the evaluated anchor on every rank. ONE launch of 5 processes under a hard deadline."""

from __future__ import annotations

import time

import pytest
import torch
from _runtime_helpers import load_captures, make_replicas_plan, relaxed_reference

from deepcee import nets
from deepcee.plan import Strategy
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.partition import Topology
from deepcee.runtime.records import read_step_metrics
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 300
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
STEPS, H = 7, 2
"""Sync points after steps 2, 4 and 6; the run ends at 7, between them (a last blocking one)."""
C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"
LAYOUT = [([(0, 3, (C0,), (2,)), (3, 6, (C1,), (2,))], 2, "1f1b"),  # batch 4, two stages
          ([(0, 6, (E0, E1), (1, 1))], 1, "gpipe"),  # batch 2 on two devices
          ([(0, 6, (N0,), (2,))], 1, "gpipe")]
CASES = {
    "plain": (Strategy(kind="model-averaging", period=H, overlap=True), "real", 2),
    "nesterov": (Strategy(kind="model-averaging", period=H, outer_optimizer="nesterov", outer_lr=0.7,
                          outer_momentum=0.9, overlap=True), "emulated", 0),
}


def _plan(strategy):
    return make_replicas_plan("gpt-tiny", LAYOUT, strategy=strategy)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cluster = load_scenario("local-small")
    root = tmp_path_factory.mktemp("replicas-overlap")
    jobs = [Job(name=name, plan=_plan(s), cluster=cluster, model="gpt-tiny", run_dir=str(root / name),
                config=TrainConfig(steps=STEPS, dtype="float64", optimizer=SGD, mode=mode, timeout_s=60, capture=True,
                                   eval_every=every, eval_batches=1))
            for name, (s, mode, every) in CASES.items()]
    # a target every evaluation reaches: stops at the first sync point, with a round in flight
    jobs.append(Job(name="target", plan=_plan(Strategy(kind="model-averaging", period=3, overlap=True)), cluster=cluster, model="gpt-tiny",
                    run_dir=str(root / "target"),
                    config=TrainConfig(steps=STEPS, dtype="float64", optimizer=SGD, mode="emulated", timeout_s=60,
                                       capture=True, eval_every=1, eval_batches=1, target_loss=100.0)))
    t0 = time.monotonic()
    results = launch_jobs(jobs, world_size=5, deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S
    return {j.name: (j, r) for j, r in zip(jobs, results, strict=True)}


def _check_params(run_dir, plan, finals):
    caps = load_captures(run_dir)
    topo = Topology(plan)
    assert sorted(caps) == list(topo.active_ranks)
    seen = [set() for _ in plan.replicas]
    for rank, cap in caps.items():
        replica = topo.placement(rank).replica
        for key, p in cap["params"].items():
            want = finals[replica][key]
            assert torch.equal(p, want), f"rank {rank} (replica {replica}) {key}: max diff {(p - want).abs().max():.3g}"
            seen[replica].add(key)
    assert all(s == set(finals[0]) for s in seen), "some replica's parameters were never compared"


@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_rule_equals_its_reenactment_bit_for_bit(runs, case):
    job, result = runs[case]
    plan = job.plan
    losses, finals = relaxed_reference("gpt-tiny", plan, STEPS, SGD)
    _check_params(job.run_dir, plan, finals)
    # the final model is one model: every replica took the last round's result
    for name in finals[0]:
        assert all(torch.equal(f[name], finals[0][name]) for f in finals[1:])
    assert result.semantics == "relaxed" and "overlapped (applied one period late)" in result.strategy
    assert result.replicas.local_steps == (STEPS,) * 3
    assert result.replicas.combines == (STEPS // H + 1,) * 3  # three sync points and the last, blocking one
    batches = [rep.batch for rep in plan.replicas]
    want = [sum(b / sum(batches) * losses[r][k] for r, b in enumerate(batches)) for k in range(STEPS)]
    lines = read_step_metrics(f"{job.run_dir}/metrics.jsonl")
    assert [x.loss for x in lines] == pytest.approx(want, rel=1e-12)
    assert all(x.semantics == "relaxed" for x in lines)


def test_evaluations_at_sync_points_do_not_disturb_training(runs):
    _, result = runs["plain"]
    # eval every 2 steps, H = 2: after every sync point (steps 2, 4, 6); the anchor at step 2 is
    # the initial model (round 0 is still in flight), later ones have moved
    curve = result.target.curve
    assert [p.steps for p in curve] == [2, 4, 6]
    assert curve[0].eval_loss != curve[1].eval_loss != curve[2].eval_loss


def test_target_stop_keeps_the_evaluated_anchor_on_every_rank(runs):
    job, result = runs["target"]
    assert result.target.reached and result.target.reached_at.steps == 3
    assert result.replicas.local_steps == (3,) * 3
    blocks, _ = nets.build("gpt-tiny", 0, dtype=torch.float64)
    initial = {f"{i}.{n}": p.detach() for i, b in enumerate(blocks) for n, p in b.named_parameters()}
    _check_params(job.run_dir, job.plan, [initial] * 3)  # anchor_0, the initial model
