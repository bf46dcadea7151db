"""A straggler, measured: one of six equal devices (one replica each) runs 3x slower. Under
the exact strategy (all-reduce every step) every replica waits for it, so throughput drops to
its pace; under partial averaging (SDPipe) the others go on and average among themselves, so
throughput stays near (5 + 1/3) / 6 of the un-straggled run (the last round, a full average,
waits for the straggler once). The test asserts the behaviour; the ratios are reported by
benchmarks/replicas_measured.py. Both with and without the straggler are measured in the same
launch (emulated devices on one island: links are not the bottleneck). ONE launch of 6
processes under a hard deadline."""

from __future__ import annotations

import time

import pytest

from deepcee.cluster import load_cluster
from deepcee.plan import Plan, ReplicaPlan, StagePlan, Strategy
from deepcee.runtime.emulation import Straggler
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs

pytestmark = pytest.mark.dist

DEADLINE_S = 300
STEPS = 12
"""All-reduce steps (its pace is steady)."""
ROUNDS = 45
"""Partial rounds: enough that the one wait for the straggler, at the end, weighs little."""
BATCH = 6
DEVICES = tuple(f"n0:{i}" for i in range(6))
CLUSTER = """
name = "six"
description = "six equal emulated devices on one node"
[kinds.cpu-worker]
peak_tflops = 0.05
memory_gib = 2.0
[islands.site]
latency_us = 100
bandwidth_gbit_per_s = 10
[[nodes]]
name = "n0"
island = "site"
kind = "cpu-worker"
devices = 6
latency_us = 50
bandwidth_gbit_per_s = 10
"""


def _plan(strategy: Strategy) -> Plan:
    reps = tuple(ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=6, devices=(d,), shares=(BATCH,)),),
                             microbatch_size=BATCH, num_microbatches=1, schedule="gpipe") for d in DEVICES)
    return Plan(system="test", cluster="six", model="gpt-tiny", global_batch=BATCH * len(DEVICES), replicas=reps,
                strategy=strategy)


@pytest.fixture(scope="module")
def rates(tmp_path_factory):
    root = tmp_path_factory.mktemp("straggler")
    (root / "six.toml").write_text(CLUSTER)
    cluster = load_cluster(root / "six.toml")
    # rounds close 10 ms (emulated) after the first replica is ready: long enough for the fast
    # replicas to meet, short beside a step; one full average, at the end
    partial = Strategy(kind="partial", window_s=0.01, min_group=2, full_sync_every=ROUNDS)
    slow = (Straggler(device=DEVICES[-1], factor=3.0),)
    jobs = []
    for name, strategy, steps in (("allreduce", Strategy(), STEPS), ("partial", partial, ROUNDS)):
        for suffix, stragglers in (("", ()), ("-straggler", slow)):
            # a large time dilation (0.6 cores for six devices: D = 10) keeps the pacing above what
            # a busy machine's contention adds, so the straggler's factor is what shows
            cfg = TrainConfig(steps=steps, optimizer=OptimizerConfig(name="sgd", lr=0.01), mode="emulated",
                              cores=0.6, timeout_s=60, stragglers=stragglers)
            jobs.append(Job(name=name + suffix, plan=_plan(strategy), cluster=cluster, model="gpt-tiny", config=cfg,
                            run_dir=str(root / (name + suffix))))
    t0 = time.monotonic()
    results = launch_jobs(jobs, deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S
    return {j.name: r for j, r in zip(jobs, results, strict=True)}


def test_partial_sync_keeps_throughput_where_allreduce_drops_to_the_stragglers_pace(rates):
    ar = rates["allreduce-straggler"].samples_per_s / rates["allreduce"].samples_per_s
    part = rates["partial-straggler"].samples_per_s / rates["partial"].samples_per_s
    print(f"\nsamples/s (emulated): all-reduce {rates['allreduce'].samples_per_s:.1f} -> "
          f"{rates['allreduce-straggler'].samples_per_s:.1f} with the straggler ({ar:.0%}); partial "
          f"{rates['partial'].samples_per_s:.1f} -> {rates['partial-straggler'].samples_per_s:.1f} ({part:.0%})")
    # all-reduce: every step waits for the straggler, whose compute alone is 3x the others'
    slow = rates["allreduce-straggler"]
    straggler_compute = sorted(m.stages[-1].compute_s for m in slow.metrics[1:])[len(slow.metrics) // 2]
    assert slow.median_step_s >= straggler_compute
    # [Note: behaviour here, throughput in benchmarks] The throughput ratios themselves (about
    # 1/3 for all-reduce, about 0.9 for partial on a quiet machine) are performance figures:
    # benchmarks/replicas_measured.py reports them. On a 2-core CI runner the six paced processes
    # compete with the launcher and gloo threads, so this test asserts only what the strategies
    # DO: all-reduce steps wait for the straggler; under partial averaging the others go on (the
    # straggler runs far fewer local steps), which keeps more of the throughput than all-reduce.
    steps = rates["partial-straggler"].replicas.local_steps
    assert steps[-1] < 0.6 * min(steps[:-1]), f"the straggler was waited for: local steps {steps}"
    assert part > ar, f"partial kept {part:.0%} of its throughput, all-reduce {ar:.0%}"
