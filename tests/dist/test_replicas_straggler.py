"""A straggler, measured: one of six equal devices (one replica each) runs 3x slower. Under
the exact strategy (all-reduce every step) every replica waits for it, so throughput drops to
its pace; under partial averaging (SDPipe) the others go on and average among themselves, so
throughput stays near (5 + 1/3) / 6 of the un-straggled run (the last round, a full average,
waits for the straggler once). The test asserts the behaviour; the ratios are reported by
benchmarks/straggler.py (whose cluster and runs this test loads). Both with and without the straggler are measured in the same
launch (emulated devices on one island: links are not the bottleneck). ONE launch of 6
processes under a hard deadline."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from deepcee.runtime.launch import launch_jobs

pytestmark = pytest.mark.dist

DEADLINE_S = 300
STEPS = 12
"""All-reduce steps (its pace is steady)."""
ROUNDS = 45
"""Partial rounds: enough that the one wait for the straggler, at the end, weighs little."""


def _bench():
    """benchmarks/straggler.py: the one copy of the cluster, plans and runs."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "straggler.py"
    spec = importlib.util.spec_from_file_location("straggler_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("straggler_bench", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rates(tmp_path_factory):
    jobs = _bench().jobs(STEPS, ROUNDS, tmp_path_factory.mktemp("straggler"))
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
    # The throughput ratios themselves (about
    # 1/3 for all-reduce, about 0.9 for partial on a quiet machine) are performance figures:
    # benchmarks/straggler.py reports them. On a 2-core CI runner the six paced processes
    # compete with the launcher and gloo threads, so this test asserts only what the strategies
    # DO: all-reduce steps wait for the straggler; under partial averaging the others go on (the
    # straggler runs far fewer local steps), which keeps more of the throughput than all-reduce.
    steps = rates["partial-straggler"].replicas.local_steps
    assert steps[-1] < 0.6 * min(steps[:-1]), f"the straggler was waited for: local steps {steps}"
    assert part > ar, f"partial kept {part:.0%} of its throughput, all-reduce {ar:.0%}"
