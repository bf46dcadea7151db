"""The relaxed strategies on the runtime. Model averaging (plain and DiLoCo's outer Nesterov)
and ASGD-GA with a fixed arrival order equal a single-process re-enactment of the same update
rule BIT FOR BIT (every parameter of every rank, replicas with different stage counts, a
stage on two devices, two parameter servers); the partial scheduler connects every replica at
least once every P rounds (checked on the groups it recorded) and ends with one model; every
result and metrics line states the relaxed semantics and the rule. Probes of the average
([Note: probe evaluations]) leave model averaging's parameters bit for bit as they are, and
their losses are the held-out losses of the re-enactment's would-be averages. ONE launch of 6
processes under a hard deadline."""

from __future__ import annotations

import time

import pytest
import torch
from _runtime_helpers import held_out_loss, load_captures, make_replicas_plan, relaxed_reference

from deepcee.plan import Strategy
from deepcee.cluster.stragglers import Straggler
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.partition import Topology
from deepcee.runtime.records import read_step_metrics
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 300
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
STEPS = 5
C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"
TWO_STAGES = ([(0, 3, (C0,), (2,)), (3, 6, (C1,), (2,))], 2, "1f1b")
TWO_DEVICES = ([(0, 6, (E0, E1), (1, 1))], 1, "gpipe")
ONE_DEVICE = ([(0, 6, (N0,), (2,))], 1, "gpipe")

BITWISE = {
    "model-averaging": (make_replicas_plan("gpt-tiny", [TWO_STAGES, TWO_DEVICES, ONE_DEVICE],
                                           strategy=Strategy(kind="model-averaging", period=2)), "real"),
    "diloco-nesterov": (make_replicas_plan("gpt-tiny", [TWO_STAGES, TWO_DEVICES, ONE_DEVICE], strategy=Strategy(
        kind="model-averaging", period=2, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)), "emulated"),
    "asgd-ga-fixed-order": (make_replicas_plan("gpt-tiny", [TWO_STAGES, TWO_DEVICES], servers=(C0, E0), strategy=Strategy(
        kind="asgd-ga", accumulation_steps=2, staleness_bound=1)), "emulated"),
}
PROBED = ("model-averaging", "diloco-nesterov")
"""Run again with an evaluation every step (mode real): probes after steps 1, 3, 5 (period 2)."""
PARTIAL_ROUNDS, P = 9, 3
PARTIAL = make_replicas_plan("gpt-tiny", [([(0, 6, (d,), (2,))], 1, "gpipe") for d in (C0, C1, E0, N0)],
                             strategy=Strategy(kind="partial", window_s=0.005, min_group=2, max_group=3,
                                               full_sync_every=P))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cluster = load_scenario("local-small")
    root = tmp_path_factory.mktemp("replicas-relaxed")
    jobs = [Job(name=name, plan=plan, cluster=cluster, model=plan.model, run_dir=str(root / name),
                config=TrainConfig(steps=STEPS, dtype="float64", optimizer=SGD, mode=mode, timeout_s=60, capture=True,
                                   fixed_arrival_order=True))
            for name, (plan, mode) in BITWISE.items()]
    jobs += [Job(name=f"{name}-probed", plan=BITWISE[name][0], cluster=cluster, model="gpt-tiny",
                 run_dir=str(root / f"{name}-probed"),
                 config=TrainConfig(steps=STEPS, dtype="float64", optimizer=SGD, mode="real", timeout_s=60,
                                    capture=True, eval_every=1, eval_batches=1))
             for name in PROBED]
    # one replica slowed 3x: the others must not wait for it except in the full rounds
    jobs.append(Job(name="partial", plan=PARTIAL, cluster=cluster, model="gpt-tiny", run_dir=str(root / "partial"),
                    config=TrainConfig(steps=PARTIAL_ROUNDS, dtype="float64", optimizer=SGD, mode="emulated",
                                       timeout_s=60, capture=True, stragglers=(Straggler(device=N0, factor=3.0),))))
    t0 = time.monotonic()
    results = launch_jobs(jobs, world_size=6, deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S
    return {j.name: (j, r) for j, r in zip(jobs, results, strict=True)}


@pytest.mark.parametrize("case", list(BITWISE))
def test_relaxed_rule_equals_its_reenactment_bit_for_bit(runs, case):
    job, result = runs[case]
    plan, _ = BITWISE[case]
    _, finals = relaxed_reference(plan.model, plan, STEPS, SGD)
    caps = load_captures(job.run_dir)
    topo = Topology(plan)
    assert sorted(caps) == list(topo.active_ranks)
    seen = [set() for _ in plan.replicas]
    for rank, cap in caps.items():
        replica = topo.placement(rank).replica
        for key, p in cap["params"].items():
            assert torch.equal(p, finals[replica][key]), (
                f"rank {rank} (replica {replica}) {key}: max diff {(p - finals[replica][key]).abs().max().item():.3g}")
            seen[replica].add(key)
    assert all(s == set(finals[0]) for s in seen), "some replica's parameters were never compared"
    assert result.semantics == "relaxed" and result.strategy == plan.strategy.describe()
    assert result.replicas.local_steps == (STEPS,) * plan.num_replicas
    lines = read_step_metrics(f"{job.run_dir}/metrics.jsonl")
    assert len(lines) == STEPS and all(x.semantics == "relaxed" and x.strategy == result.strategy for x in lines)


def test_model_averaging_combines_every_period(runs):
    _, result = runs["model-averaging"]
    assert result.replicas.combines == (STEPS // 2,) * 3


def test_asgd_servers_apply_every_push_in_turn_within_the_staleness_bound(runs):
    plan, _ = BITWISE["asgd-ga-fixed-order"]
    _, result = runs["asgd-ga-fixed-order"]
    rounds = -(-STEPS // plan.strategy.accumulation_steps)
    for server in (C0, E0):
        pushes = [p for p in result.replicas.pushes if p.server == server]
        assert [p.replica for p in pushes] == [0, 1] * rounds  # the fixed order
        assert [p.version for p in pushes] == list(range(2 * rounds))
        # a replica computes on a model at most `staleness_bound` updates old
        assert all(p.staleness <= plan.strategy.staleness_bound for p in pushes)


def test_partial_groups_connect_every_replica_every_p_rounds(runs):
    job, result = runs["partial"]
    groups = result.replicas.groups
    assert [g.round for g in groups] == list(range(PARTIAL_ROUNDS))
    n = PARTIAL.num_replicas
    for start in range(PARTIAL_ROUNDS - P + 1):
        # the union of the groups of any P consecutive rounds connects all replicas
        assert _components(n, groups[start:start + P]) == 1, f"rounds {start}..{start + P - 1} leave replicas apart"
    for g in groups:
        assert len(g.members) == n if g.full else 2 <= len(g.members) <= 3
    assert groups[-1].full
    # a replica takes part in at most one round per local step; the straggler (3x slower) ran
    # fewer local steps than the fastest replica (which joins every round on a quiet machine;
    # under load a round can close before it is ready, so that is not asserted)
    steps = result.replicas.local_steps
    assert max(steps) <= PARTIAL_ROUNDS and steps[3] < max(steps)
    assert sum(len(g.members) for g in groups) == sum(steps)
    # the last round is a full average: every replica ends with the same model
    caps = load_captures(job.run_dir)
    for rank in range(1, n):
        for key, p in caps[rank]["params"].items():
            assert torch.equal(p, caps[0]["params"][key]), f"replica {rank} {key} differs after the last full round"


def _components(n, groups) -> int:
    """Connected components of replicas ``0..n-1`` joined by ``groups``' members."""
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for g in groups:
        for m in g.members[1:]:
            parent[find(m)] = find(g.members[0])
    return len({find(r) for r in range(n)})


@pytest.mark.parametrize("case", PROBED)
def test_probes_leave_training_bit_for_bit_and_evaluate_the_would_be_average(runs, case):
    plan, _ = BITWISE[case]
    job, result = runs[f"{case}-probed"]
    previews = {}
    _, finals = relaxed_reference(plan.model, plan, STEPS, SGD, previews=previews)
    plain, probed = load_captures(runs[case][0].run_dir), load_captures(job.run_dir)
    topo = Topology(plan)
    assert sorted(probed) == sorted(plain)
    for rank, cap in probed.items():
        replica = topo.placement(rank).replica
        for key, p in cap["params"].items():
            assert torch.equal(p, plain[rank]["params"][key]), f"rank {rank} {key}: the probes changed training"
            assert torch.equal(p, finals[replica][key]), f"rank {rank} {key} differs from the re-enactment"
    # evaluations right after the averages (steps 2, 4), probes between them, kept apart
    assert [s for s, _ in result.eval_losses] == [2, 4]
    assert [s for s, _ in result.probe_losses] == [1, 3, 5] == [k + 1 for k in sorted(previews)]
    for (done, loss), k in zip(result.probe_losses, sorted(previews), strict=True):
        assert loss == pytest.approx(held_out_loss(plan.model, previews[k], plan.global_batch), rel=1e-12), done
    assert [p.steps for p in result.target.probes] == [1, 3, 5]
    assert [p.steps for p in result.target.curve] == [2, 4]
    lines = read_step_metrics(f"{job.run_dir}/metrics.jsonl")
    assert [x.step + 1 for x in lines if x.probe_loss is not None] == [1, 3, 5]
    assert all(x.eval_loss is None for x in lines if x.probe_loss is not None)
