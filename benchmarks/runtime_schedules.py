"""Measured throughput of ZB-H1 against 1F1B (and others) on the same emulated plan.

gpt-tiny in 4 stages (``embed+block0 | block1 | block2 | block3+head``) on 4 emulated
devices (one process each, one thread, equal speed) joined by emulated links, global batch
``microbatch x microbatches``, float32, AdamW. All schedules run in one launch (same
processes, same start-up), interleaved ``--repeats`` times so that load from other processes
on the machine hits them alike; samples/s is the global batch over the median step time of
all steps but each job's first. The baseline is 1F1B measured in the same run.

Defaults (microbatch 64 x 4 microbatches, 1.0 core for the 4 devices, D = 4) are chosen so
that compute, not fixed per-call overhead, dominates: on these tiny nets the split backward
costs ``I + W`` about 1.1x ``B`` at microbatch 64 but 1.3-1.7x at 4-16 (see
``benchmarks/split_backward.py``), which eats ZB-H1's bubble saving at small microbatches.

As a cross-check the script also *predicts* each schedule's step time with the schedule dry
run (:func:`deepcee.schedule.passes.dry_run`) fed with the F/I/W/B durations measured in this
run (median per stage, from action traces) and the links' alpha-beta times; the optimizer
step and gradient bookkeeping are outside the dry run, so predictions are a lower bound.

Every time reported is emulated time (wall / dilation D); the table says so. Run::

    python benchmarks/runtime_schedules.py --out reports/runtime_schedules.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from deepcee.cluster import cluster_from_toml_dict
from deepcee.plan import Plan, StagePlan, save_json_atomic
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.records import StepMetrics
from deepcee.schedule.passes import dry_run
from deepcee.schedule.program import lowered_schedule

SPLIT = ((0, 2), (2, 3), (3, 4), (4, 6))
BOUNDARY_BYTES_PER_SAMPLE = 64 * 64 * 4  # gpt-tiny activations: seq 64 x d_model 64, float32


def make_cluster(latency_ms: float, bandwidth_mbit: float):
    return cluster_from_toml_dict({
        "name": "bench-4x1",
        "description": "4 single-device nodes in one island (emulated)",
        "emulation": "CPU worker processes, one thread each; links emulated (latency + bytes/bandwidth, FIFO)",
        "kinds": {"cpu-worker": {"peak_tflops": 0.05, "memory_gib": 2.0}},
        "islands": {"site": {"latency_ms": latency_ms, "bandwidth_mbit_per_s": bandwidth_mbit}},
        "nodes": [{"name": f"n{i}", "island": "site", "kind": "cpu-worker", "devices": 1} for i in range(4)],
    }, file="<benchmark>")


def make_plan(schedule: str, microbatch: int, microbatches: int) -> Plan:
    return Plan(system="bench", cluster="bench-4x1", model="gpt-tiny", global_batch=microbatch * microbatches,
                microbatch_size=microbatch, num_microbatches=microbatches, schedule=schedule,
                stages=tuple(StagePlan(layer_start=a, layer_stop=b, devices=(f"n{i}:0",), shares=(microbatch,))
                             for i, (a, b) in enumerate(SPLIT)))


def action_costs(records: list[StepMetrics]) -> dict[str, dict[int, float]]:
    """Median emulated duration of each compute kind per stage, from traced steps (first step dropped)."""
    got: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rec in records[1:]:
        for device, actions in rec.trace.items():
            stage = int(device.removeprefix("n").split(":")[0])
            for name, t0, t1 in actions:
                kind = name.lstrip("0123456789").rstrip("0123456789")
                if kind in ("F", "I", "W", "B"):
                    got[kind][stage].append(t1 - t0)
    return {k: {s: statistics.median(v) for s, v in per.items()} for k, per in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="reports/runtime_schedules.json")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    ap.add_argument("--microbatch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=5.0)
    ap.add_argument("--bandwidth-mbit", type=float, default=1000.0)
    ap.add_argument("--cores", type=float, default=1.0, help="CPU cores the 4 emulated devices may use together")
    args = ap.parse_args()

    cluster = make_cluster(args.latency_ms, args.bandwidth_mbit)
    tmp = tempfile.TemporaryDirectory(prefix="deepcee-bench-")
    root = Path(tmp.name)
    jobs = []
    for rep in range(args.repeats):
        for sched in args.schedules:
            plan = make_plan(sched, args.microbatch, args.microbatches)
            cfg = TrainConfig(steps=args.steps, mode="emulated", cores=args.cores, trace=True, timeout_s=120,
                              optimizer=OptimizerConfig(name="adamw", lr=1e-3))
            jobs.append(Job(name=f"{sched}-{rep}", plan=plan, cluster=cluster, model="gpt-tiny",
                            config=cfg, run_dir=str(root / f"{sched}-{rep}")))
    t0 = time.monotonic()
    results = launch_jobs(jobs, deadline_s=1800)
    wall = time.monotonic() - t0

    by_sched: dict[str, dict[str, Any]] = {}
    for sched in args.schedules:
        runs = [r for j, r in zip(jobs, results, strict=True) if j.name.startswith(sched + "-")]
        steady = [s for r in runs for s in r.step_s[1:]]
        records = [rec for r in runs for rec in r.metrics]
        med = statistics.median(steady)
        by_sched[sched] = {"median_step_s": med, "samples_per_s": args.microbatch * args.microbatches / med,
                           "step_s": steady, "losses": [list(r.losses) for r in runs],
                           "costs_s": action_costs(records), "dilation": runs[0].dilation}
    d = results[0].dilation
    link = cluster.link("n0:0", "n1:0")
    comm = (link.latency_s, args.microbatch * BOUNDARY_BYTES_PER_SAMPLE / link.bandwidth_bytes_per_s)
    # per-stage medians over every run: F from all; I and W from split runs; B from fused runs
    pooled: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for v in by_sched.values():
        for kind, per in v["costs_s"].items():
            for s, c in per.items():
                pooled[kind][s].append(c)
    med_cost = {k: [statistics.median(pooled[k][s]) for s in range(len(SPLIT))] for k in pooled}
    for sched, v in by_sched.items():
        lowered = lowered_schedule(make_plan(sched, args.microbatch, args.microbatches))
        split = any(a.kind.value in ("I", "W") for row in lowered for a in row)
        # the dry run charges a B as I + W, so a fused schedule gets its measured B in two halves
        i_cost, w_cost = ((med_cost["I"], med_cost["W"]) if split
                          else ([b / 2 for b in med_cost["B"]], [b / 2 for b in med_cost["B"]]))
        dr = dry_run(lowered, forward_s=med_cost["F"], input_grad_s=i_cost, weight_grad_s=w_cost,
                     comm_forward=comm, comm_backward=comm)
        v["predicted_step_s"] = dr.makespan_s
        v["predicted_bubble_fraction"] = dr.bubble_fraction

    base = by_sched.get("1f1b") or next(iter(by_sched.values()))
    print(f"gpt-tiny, 4 stages x 1 emulated device, microbatch {args.microbatch} x {args.microbatches}, "
          f"links {args.latency_ms:g} ms / {args.bandwidth_mbit:g} Mbit/s; EMULATED time (wall / D, D = {d:.2f})")
    print(f"{'schedule':9} {'samples/s':>10} {'step ms':>8} {'vs 1f1b':>8} {'dry-run ms':>11} {'dry-run vs 1f1b':>16}")
    for sched, v in by_sched.items():
        gain = v["samples_per_s"] / base["samples_per_s"] - 1
        pgain = base["predicted_step_s"] / v["predicted_step_s"] - 1
        v["gain_vs_1f1b"], v["predicted_gain_vs_1f1b"] = gain, pgain
        print(f"{sched:9} {v['samples_per_s']:10.1f} {1e3 * v['median_step_s']:8.1f} {gain:+8.1%} "
              f"{1e3 * v['predicted_step_s']:11.1f} {pgain:+16.1%}")
    print("per-stage median action times (emulated ms): "
          + "; ".join(f"{k} " + "/".join(f"{1e3 * c:.1f}" for c in med_cost[k]) for k in sorted(med_cost)))
    print(f"wall time of the whole benchmark: {wall:.0f} s")
    tmp.cleanup()
    save_json_atomic(Path(args.out), {
        "format": "deepcee.bench.runtime_schedules", "schema_version": 1, "mode": "emulated", "dilation": d,
        "emulated": list(results[0].emulated), "times": "emulated seconds (wall / dilation)",
        "args": vars(args), "schedules": by_sched, "median_costs_s": med_cost,
    })


if __name__ == "__main__":
    main()
