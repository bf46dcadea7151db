"""Measured (emulated devices): throughput kept with one 3x straggler, all-reduce vs partial averaging.

Six equal emulated devices on one island (links are not the bottleneck), one replica each;
the last device runs 3x slower. Under the exact strategy (all-reduce every step) every replica
waits for it; under partial averaging (SDPipe: rounds close 10 ms of emulated time after the
first replica is ready, at least 2 replicas, a full average every ``--rounds``) the others go
on. All four runs (each strategy with and without the straggler) are ONE launch, so they share
the machine's load. Samples/s are emulated (wall time / dilation); device speeds are the
cluster file's, not this machine's. Prints a table, writes ``<out>/straggler.json``.

    python benchmarks/straggler.py [--steps 12] [--rounds 45] [--out reports/straggler]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from deepcee.cluster import load_cluster
from deepcee.cluster.stragglers import Straggler
from deepcee.plan import Plan, ReplicaPlan, StagePlan, Strategy
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs

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
    return Plan(system="straggler-bench", cluster="six", model="gpt-tiny", global_batch=BATCH * len(DEVICES),
                replicas=reps, strategy=strategy)


def jobs(steps: int, rounds: int, work: Path) -> list[Job]:
    """The four runs (each strategy with and without the straggler), to launch together."""
    (work / "six.toml").write_text(CLUSTER)
    cluster = load_cluster(work / "six.toml")
    # rounds close 10 ms (emulated) after the first replica is ready: long enough for the fast
    # replicas to meet, short beside a step; one full average, at the end
    partial = Strategy(kind="partial", window_s=0.01, min_group=2, full_sync_every=rounds)
    slow = (Straggler(device=DEVICES[-1], factor=3.0),)
    out = []
    for name, strategy, n in (("allreduce", Strategy(), steps), ("partial", partial, rounds)):
        for suffix, stragglers in (("", ()), ("-straggler", slow)):
            # a large time dilation (0.6 cores for six devices: D = 10) keeps the pacing above what
            # a busy machine's contention adds, so the straggler's factor is what shows
            cfg = TrainConfig(steps=n, optimizer=OptimizerConfig(name="sgd", lr=0.01), mode="emulated",
                              cores=0.6, timeout_s=60, stragglers=stragglers)
            out.append(Job(name=name + suffix, plan=_plan(strategy), cluster=cluster, model="gpt-tiny", config=cfg,
                           run_dir=str(work / (name + suffix))))
    return out


def measure(steps: int, rounds: int, work: Path) -> dict[str, float]:
    """Samples/s (emulated) of the four runs, launched together."""
    todo = jobs(steps, rounds, work)
    results = launch_jobs(todo, deadline_s=600)
    return {j.name: r.samples_per_s for j, r in zip(todo, results, strict=True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="all-reduce steps")
    ap.add_argument("--rounds", type=int, default=45, help="partial rounds (one full average at the end)")
    ap.add_argument("--out", default="reports/straggler")
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        rates = measure(args.steps, args.rounds, Path(tmp))
    rows = [{"strategy": s, "samples_per_s": rates[s], "with_straggler_samples_per_s": rates[s + "-straggler"],
             "kept": rates[s + "-straggler"] / rates[s]} for s in ("allreduce", "partial")]
    print("one of six emulated devices 3x slower (emulated samples/s; one launch)")
    print(f"{'strategy':<12}{'no straggler':>14}{'straggler':>12}{'kept':>8}")
    for r in rows:
        print(f"{r['strategy']:<12}{r['samples_per_s']:>14.1f}{r['with_straggler_samples_per_s']:>12.1f}{r['kept']:>8.0%}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "straggler.json").write_text(json.dumps({"schema_version": 1, "mode": "emulated", "rows": rows,
                                                    "wall_s": time.monotonic() - t0}, indent=2))
    print(f"wrote {out / 'straggler.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
