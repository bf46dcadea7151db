"""The adapter's controller in the real runtime (4 gloo processes, one launch, hard deadline).

- Re-plans and re-tunes forced mid-run (a scripted policy) end with exactly the parameters,
  losses and first-step gradients of a single-process float64 reference that never changed
  plan (same data, same steps): layers move between stages, stages change device count,
  devices go idle and come back, AdamW and SGD-with-momentum state moves with the layers.
- Emulated links with a 5x bandwidth drop: rank 0's link monitor, fed only with the
  runtime's own transfer timings, tracks the traced bandwidth before and after the drop.
- The production policy on a noisy but stationary trace keeps the plan (no flapping).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from _runtime_helpers import load_captures, make_plan, reference

from deepcee.adapter.controller import DefaultPolicy, ScriptedPolicy, adaptive_job, traced_cluster
from deepcee.adapter.policy import PolicyConfig
from deepcee.cluster import BandwidthTrace
from deepcee.runtime.job import OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.scenarios import load_scenario
from deepcee.traces import load_named_trace

pytestmark = pytest.mark.dist

DEADLINE_S = 85
RTOL, ATOL = 1e-10, 1e-12
C0, C1, E0, N0 = "cloud0:0", "cloud0:1", "edge0:0", "end0:0"
DEVICES = (C0, C1, E0, N0)
ADAM = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01)
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
MBIT = 1e6 / 8

# gpt-tiny (6 layers), global batch 8. C1 idle at first; N0 idle in the middle; C0 idle at the end.
GPT_PLANS = [
    make_plan("gpt-tiny", [(0, 3, (C0,), (4,)), (3, 6, (E0, N0), (2, 2))], 2, "1f1b"),
    # after step 1: layer 2 moves to stage 1, stage 0 grows to 2 devices (C1 joins), stage 1 shrinks
    make_plan("gpt-tiny", [(0, 2, (C0, C1), (1, 3)), (2, 6, (E0,), (4,))], 2, "zb-h1"),
    # after step 3: re-tune (same stages; 4 microbatches, other shares, other schedule)
    make_plan("gpt-tiny", [(0, 2, (C0, C1), (1, 1)), (2, 6, (E0,), (2,))], 4, "gpipe"),
    # after step 4: everything moves: N0 returns with layers 0-3, stage 1 on C1 + E0, C0 idle
    make_plan("gpt-tiny", [(0, 4, (N0,), (4,)), (4, 6, (C1, E0), (3, 1))], 2, "1f1b"),
]
GPT_CHANGES = ((1, 1), (3, 2), (4, 3))  # (after step, plan index)
# resnet-tiny (8 layers), global batch 6, SGD with momentum: a 3-stage plan becomes 2 stages
RESNET_PLANS = [
    make_plan("resnet-tiny", [(0, 3, (C0, C1), (2, 1)), (3, 6, (E0,), (3,)), (6, 8, (N0,), (3,))], 2, "1f1b"),
    make_plan("resnet-tiny", [(0, 5, (E0,), (2,)), (5, 8, (C0, N0), (1, 1))], 3, "zb-h2"),
]
STEPS = 6


def _config(steps: int, opt: OptimizerConfig, mode: str = "real") -> TrainConfig:
    return TrainConfig(steps=steps, dtype="float64", optimizer=opt, mode=mode, timeout_s=40, capture=mode == "real")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cluster = load_scenario("local-small")
    root = tmp_path_factory.mktemp("adapter-runtime")
    jobs = {
        "gpt-replan": adaptive_job(
            GPT_PLANS[0], cluster, model="gpt-tiny", config=_config(STEPS, ADAM), run_dir=root / "gpt", name="gpt",
            devices=DEVICES, policy=ScriptedPolicy(changes=tuple((k, GPT_PLANS[i]) for k, i in GPT_CHANGES))),
        "resnet-replan": adaptive_job(
            RESNET_PLANS[0], cluster, model="resnet-tiny", config=_config(4, SGD), run_dir=root / "resnet",
            name="resnet", devices=DEVICES, policy=ScriptedPolicy(changes=((1, RESNET_PLANS[1]),))),
    }
    # emulated cloud-edge link (100 Mbit/s, 20 ms) drops 5x at emulated t = 1.2 s; adapter off
    drop = BandwidthTrace(times_s=(0.0, 1.2), bandwidth_bytes_per_s=(100 * MBIT, 20 * MBIT), name="drop")
    monitored = make_plan("gpt-tiny", [(0, 3, (C0,), (2,)), (3, 6, (E0,), (2,))], 4, "1f1b")
    jobs["monitor-drop"] = adaptive_job(
        monitored, traced_cluster(cluster, drop, between=[("cloud", "edge")], time_scale=1.0), model="gpt-tiny",
        config=_config(12, ADAM, "emulated"), run_dir=root / "drop", name="drop", devices=DEVICES, adapt=False)
    # the production policy (simulator scorer, planner) on noise without a trend: no change, even
    # with a single confirming check (the setting of benchmarks/adapter.py; the default has two)
    noisy = load_named_trace("noisy-stationary")
    jobs["noisy"] = adaptive_job(
        monitored, traced_cluster(cluster, noisy, between=[("cloud", "edge")], time_scale=0.05), model="gpt-tiny",
        config=_config(10, ADAM, "emulated"), run_dir=root / "noisy", name="noisy", devices=DEVICES,
        policy=DefaultPolicy(config=PolicyConfig(confirm_checks=1)))
    t0 = time.monotonic()
    results = launch_jobs(list(jobs.values()), world_size=len(DEVICES), deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S
    return {name: (job, res) for (name, job), res in zip(jobs.items(), results, strict=True)}


def _check_exact(job, result, plans, opt, steps):
    losses, grads0, params = reference(job.model, plans[0], steps, opt)
    for got, want in zip(result.losses, losses, strict=True):
        assert got == pytest.approx(want, rel=RTOL)
    caps = load_captures(job.run_dir)
    assert sorted(caps) == sorted(DEVICES.index(d) for d in plans[-1].devices)  # every active rank at the end
    seen = set()
    for rank, cap in caps.items():
        for key, p in cap["params"].items():
            torch.testing.assert_close(p, params[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} param {k}: {m}")
            seen.add(key)
        for key, g in cap.get("grads", {}).items():  # ranks active at step 0: that step's gradients
            torch.testing.assert_close(g, grads0[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} step-0 grad {k}: {m}")
    assert seen == set(params), f"parameters never checked: {sorted(set(params) - seen)[:5]}"


def test_replans_and_retune_end_exactly_where_an_unchanged_run_ends(runs):
    job, result = runs["gpt-replan"]
    expected = [GPT_PLANS[0]] + [GPT_PLANS[i] for _, i in GPT_CHANGES]
    _check_exact(job, result, expected, ADAM, STEPS)
    changes = result.adapter.changes
    assert [(c.start_step, c.kind) for c in changes] == [(2, "replan"), (4, "retune"), (5, "replan")]
    # layer 2 moves C0 -> E0; C1 gets layers 0 and 1 from C0; the retune moves nothing
    assert sorted(changes[0].moves) == [(0, C0, C1), (1, C0, C1), (2, C0, E0)]
    assert changes[1].moves == () and changes[1].moved_bytes == 0
    assert {(layer, dst) for layer, _, dst in changes[2].moves} == {(0, N0), (1, N0), (2, N0), (3, N0),
                                                                       (4, C1), (5, C1)}
    assert result.adapter.plans == tuple(expected)
    # each change is in the first step it applies to, every active rank's part of it at the boundary after
    applied = {m.step: m.change.kind for m in result.metrics if m.change is not None}
    assert applied == {2: "replan", 4: "retune", 5: "replan"}
    assert set(result.metrics[2].boundary.change_by_device) == set(GPT_PLANS[1].devices)


def test_sgd_momentum_moves_with_the_layers(runs):
    job, result = runs["resnet-replan"]
    _check_exact(job, result, RESNET_PLANS, SGD, 4)
    assert [c.kind for c in result.adapter.changes] == ["replan"]


def test_monitor_tracks_a_5x_drop_from_the_runtimes_own_transfers(runs):
    job, result = runs["monitor-drop"]
    metrics = [m.boundary for m in result.metrics]
    forward = "cloud0->edge0"
    before = [m for m in metrics if m.end_s < 1.2]
    assert len(before) >= 2 and metrics[-1].end_s > 1.6, [m.end_s for m in metrics]
    bw = lambda m: m.link_estimates[forward].bandwidth_bytes_per_s / MBIT  # noqa: E731
    assert bw(before[-1]) == pytest.approx(100, rel=0.1)
    assert bw(metrics[-1]) == pytest.approx(20, rel=0.1)
    assert forward in metrics[-1].changed_links
    assert all(m.decision in ("keep", None) for m in metrics)  # adapter off: monitor only
    assert result.mode == "emulated" and result.adapter.changes == () and not result.adapter.adapt
    # the file on disk has the keys readers of metrics.jsonl use
    lines = [json.loads(line) for line in (Path(job.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [line["end_s"] for line in lines] == [m.end_s for m in metrics]
    assert {"link_estimates", "changed_links", "plan_version", "decision", "control_s"} <= set(lines[0])


def test_production_policy_does_not_flap_on_a_noisy_stationary_trace(runs):
    job, result = runs["noisy"]
    assert result.adapter.changes == ()
    assert all(m.boundary.decision in ("keep", None) for m in result.metrics)
    assert not any(m.boundary.changed_links for m in result.metrics)
