"""Plans with several replicas under the exact strategy against the single-process float64
reference: loss and every gradient after one step, parameters after three, on every rank.
Replicas differ in devices, stage counts, layer splits, shares, microbatches and schedules;
gradients combine by ring or hierarchical all-reduce, by parameter servers (two, each a rank
of its own), and per stage (HeteroG: some layers through a server, others by all-reduce).
A multi-replica run also resumes from its checkpoint exactly. ONE launch of 7 processes
(5 devices + 2 servers), under a hard deadline."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from _runtime_helpers import load_captures, make_replicas_plan, reference

from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.partition import rank_devices
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 300
RTOL, ATOL = 1e-10, 1e-12
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
ADAM = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01)
STEPS = 3
C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"

CASES = {
    # 2 stages x 2 microbatches beside 2 stages x 1 microbatch, cut at other layers, one stage on 2 devices
    "ring-gpt-different-splits": (make_replicas_plan("gpt-tiny", [
        ([(0, 2, (C0,), (2,)), (2, 6, (C1,), (2,))], 2, "1f1b"),
        ([(0, 3, (E0, E1), (1, 1)), (3, 6, (N0,), (2,))], 1, "gpipe")]), ADAM, "real"),
    # 3 stages beside 1 stage on two devices with uneven shares; hierarchical, emulated links
    "hier-resnet-3-vs-1-stages": (make_replicas_plan("resnet-tiny", [
        ([(0, 3, (C0,), (2,)), (3, 6, (E0,), (2,)), (6, 8, (N0,), (2,))], 2, "zb-h1"),
        ([(0, 8, (C1, E1), (1, 2))], 1, "gpipe")], sync="allreduce-hier"), SGD, "emulated"),
    # parameter servers on two computing devices (each server a rank of its own), emulated links
    "ps-gpt-two-servers": (make_replicas_plan("gpt-tiny", [
        ([(0, 2, (C0,), (2,)), (2, 6, (C1,), (2,))], 2, "zb-h1"),
        ([(0, 4, (E0,), (3,)), (4, 6, (E1, N0), (2, 1))], 1, "1f1b")], sync="ps", servers=(C0, E0)), ADAM, "emulated"),
    # HeteroG: the first layers through a server on a device that does not compute, the rest by all-reduce
    "heterog-ps-and-ring": (make_replicas_plan("gpt-tiny", [
        ([(0, 3, (C0,), (2,)), (3, 6, (C1,), (2,))], 1, "gpipe"),
        ([(0, 3, (E0,), (2,)), (3, 6, (E1,), (2,))], 2, "1f1b")],
        servers=(N0,), stage_syncs={(0, 0): "ps", (1, 0): "ps"}), SGD, "real"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cluster = load_scenario("local-small")
    root = tmp_path_factory.mktemp("replicas-exact")
    jobs = []
    for name, (plan, opt, mode) in CASES.items():
        cfg = TrainConfig(steps=STEPS, dtype="float64", optimizer=opt, mode=mode, timeout_s=60, capture=True)
        jobs.append(Job(name=name, plan=plan, cluster=cluster, model=plan.model, config=cfg, run_dir=str(root / name)))
    ck_plan = CASES["ring-gpt-different-splits"][0]
    for name, steps, resume in (("ckpt-straight", 4, False), ("ckpt-first-half", 2, False), ("ckpt-resumed", 4, True)):
        cdir = root / ("ckpt-a" if name == "ckpt-straight" else "ckpt-b")
        jobs.append(Job(name=name, plan=ck_plan, cluster=cluster, model="gpt-tiny",
                        config=TrainConfig(steps=steps, dtype="float64", optimizer=ADAM, mode="real", timeout_s=60,
                                           capture=True, checkpoint_every=2, resume=resume),
                        run_dir=str(root / name), checkpoint_dir=str(cdir)))
    t0 = time.monotonic()
    results = launch_jobs(jobs, world_size=7, deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S
    return {j.name: (j, r) for j, r in zip(jobs, results, strict=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_replicas_match_the_single_process_reference(runs, case):
    job, result = runs[case]
    plan, opt, _ = CASES[case]
    losses, grads0, params = reference(plan.model, plan, STEPS, opt)
    for got, want in zip(result.losses, losses, strict=True):
        assert got == pytest.approx(want, rel=RTOL)
    caps = load_captures(job.run_dir)
    assert sorted(caps) == list(range(len(plan.devices)))  # every computing rank; servers hold no stage
    for rank, cap in caps.items():
        assert cap["grads"], f"rank {rank} captured no gradient"
        for key, g in cap["grads"].items():
            torch.testing.assert_close(g, grads0[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key, r=rank: f"rank {r} grad {k}: {m}")
            torch.testing.assert_close(cap["params"][key], params[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} param {k}: {m}")
    # every layer is held somewhere in every replica: each replica's ranks together checked all of it
    for r in range(plan.num_replicas):
        ranks = [q for q in caps if q < len(plan.devices) and plan.locate(plan.devices[q])[0] == r]
        assert set().union(*(caps[q]["grads"] for q in ranks)) == set(grads0)
    assert result.semantics == "exact" and result.strategy.startswith("exact")
    assert all(rec.semantics == "exact" for rec in result.metrics)


def test_servers_are_ranks_after_the_devices(runs):
    plan = CASES["ps-gpt-two-servers"][0]
    assert rank_devices(plan) == (*plan.devices, C0, E0)
    job, result = runs["ps-gpt-two-servers"]
    assert "parameter servers" in result.sync
    # the pushes and pulls crossed the emulated WAN: a step lasts at least a cloud<->edge round trip (2 x 20 ms)
    assert min(result.step_s) > 0.04
    lines = [json.loads(x) for x in (Path(job.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert {(s.get("replica", 0), s["stage"]) for s in lines[0]["stages"]} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_multi_replica_resume_continues_exactly(runs):
    straight, resumed, half = runs["ckpt-straight"], runs["ckpt-resumed"], runs["ckpt-first-half"]
    assert resumed[1].losses == straight[1].losses[2:]
    assert half[1].losses == straight[1].losses[:2]
    a, b = load_captures(straight[0].run_dir), load_captures(resumed[0].run_dir)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    for rank in a:
        for key, p in a[rank]["params"].items():
            assert torch.equal(p, b[rank]["params"][key]), f"rank {rank} {key} differs after resume"
    assert (Path(straight[0].checkpoint_dir) / "step-00000004" / "manifest.json").exists()
