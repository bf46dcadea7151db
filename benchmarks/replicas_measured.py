"""Measured: every replica strategy on all islands vs the best single island, with the simulator's error.

On the emulated ``local-small`` cluster (3 islands, 5 CPU devices, one 2x slower, 100 Mbit/s
and 20-40 ms between islands), for ``gpt-tiny`` and ``resnet-tiny``:

- baselines, measured in the same run: synchronous data parallel on one island alone (cloud:
  2 devices; edge: 2 devices, one 2x slower); the better one is "the best single island";
- all islands, three replicas (one per island: cloud 2 devices, edge 2 devices with shares by
  speed, end 1 device; each replica's batch by its island's speed), under every strategy:
  exact (ring all-reduce, hierarchical all-reduce, parameter servers on cloud0:0 and
  edge0:0), model averaging every 10 steps (plain and DiLoCo's outer Nesterov), ASGD-GA
  (k = 4, staleness <= 2, same servers), partial averaging (window 10 ms, full every 10).

Each run's samples/s is emulated time (wall / dilation D): exact runs, the global batch over
the median step; relaxed runs, samples completed per second once every replica finished its
first step (their replicas keep no common pace). The simulator's prediction comes from a
measured profile of the same emulated devices and links (``deepcee profile``); plans it cannot
simulate yet (several replicas, until the multi-replica simulator lands) are reported as
pending. Prints a table, writes ``<out>/replicas_measured.json``.

    python benchmarks/replicas_measured.py [--steps 20] [--models gpt-tiny,resnet-tiny] [--no-simulator]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from deepcee.plan import Plan, ReplicaPlan, StagePlan, Strategy
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.scenarios import load_scenario

C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"
SERVERS = (C0, E0)


def _replica(devices: tuple[str, ...], shares: tuple[int, ...], layers: int) -> ReplicaPlan:
    return ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=layers, devices=devices, shares=shares),),
                       microbatch_size=sum(shares), num_microbatches=1, schedule="gpipe")


def plans(model: str, layers: int) -> dict[str, Plan]:
    """The single-island baselines and every strategy on all islands (see the module docstring)."""
    cloud, edge, end = _replica((C0, C1), (4, 4), layers), _replica((E0, E1), (4, 2), layers), _replica((N0,), (4,), layers)

    def plan(name: str, reps: tuple[ReplicaPlan, ...], **kw) -> Plan:
        return Plan(system=name, cluster="local-small", model=model, global_batch=sum(r.batch for r in reps),
                    replicas=reps, **kw)

    every = (cloud, edge, end)
    return {
        "cloud island (sync)": plan("cloud-island", (cloud,)),
        "edge island (sync)": plan("edge-island", (edge,)),
        "all: exact ring": plan("exact-ring", every),
        "all: exact hierarchical": plan("exact-hier", every, sync="allreduce-hier"),
        "all: exact ps": plan("exact-ps", every, sync="ps", servers=SERVERS),
        "all: model averaging H=10": plan("ma", every, strategy=Strategy(kind="model-averaging", period=10)),
        "all: DiLoCo nesterov H=10": plan("diloco", every, strategy=Strategy(
            kind="model-averaging", period=10, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)),
        "all: asgd-ga k=4": plan("asgd-ga", every, servers=SERVERS,
                                 strategy=Strategy(kind="asgd-ga", accumulation_steps=4, staleness_bound=2)),
        "all: partial P=10": plan("partial", every, strategy=Strategy(kind="partial", window_s=0.01, min_group=2,
                                                                      full_sync_every=10)),
    }


def simulated(plan: Plan, measured) -> tuple[float | None, str]:
    """The simulator's samples/s for ``plan`` on the measured cluster and profile, or why not."""
    from deepcee.errors import DeepceeError
    from deepcee.simulator.engine import simulate

    try:
        return simulate(plan, measured.cluster, measured.profile, iterations=3, record=False).samples_per_s, ""
    except DeepceeError as exc:
        return None, f"pending: {str(exc)[:90]}"


def run_model(model: str, steps: int, out: Path, with_simulator: bool) -> list[dict]:
    from deepcee import nets

    cluster = load_scenario("local-small")
    layers = len(nets.build(model, 0)[0])
    ps = plans(model, layers)
    measured = None
    if with_simulator:
        from deepcee.profiler.network import NetworkBudget
        from deepcee.profiler.run import profile_cluster

        budget = NetworkBudget(max_full_ranks=1, min_bytes=256 << 10, max_bytes=1 << 20, growth=4, repeats=2,
                               max_s_per_pair=8.0)
        measured = profile_cluster(cluster, model, out / model / "profile", emulated=True, network_budget=budget)
    jobs = [Job(name=f"{model}-{p.system}", plan=p, cluster=cluster, model=model, run_dir=str(out / model / p.system),
                config=TrainConfig(steps=steps, optimizer=OptimizerConfig(name="sgd", lr=0.01), mode="emulated",
                                   timeout_s=120))
            for p in ps.values()]
    t0 = time.monotonic()
    results = launch_jobs(jobs, deadline_s=3000)
    rows = []
    for (label, p), res in zip(ps.items(), results, strict=True):
        sim, why = simulated(p, measured) if measured is not None else (None, "not asked")
        rows.append({"model": model, "run": label, "semantics": res.semantics, "strategy": res.strategy,
                     "devices": len(p.devices), "global_batch": p.global_batch, "measured_samples_per_s":
                     res.samples_per_s, "simulated_samples_per_s": sim,
                     "simulator_error": None if sim is None else sim / res.samples_per_s - 1, "simulator_note": why,
                     "local_steps": None if res.replicas is None else list(res.replicas.local_steps),
                     "dilation": res.dilation, "run_dir": res.run_dir})
    print(f"{model}: {len(jobs)} runs in {time.monotonic() - t0:.0f} s (wall)")
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<12} {'run':<28} {'sem':<8} {'samples/s':>10} {'vs best island':>15} {'sim':>9} {'err':>7}"]
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        best = max((r for r in mine if "island" in r["run"]), key=lambda r: r["measured_samples_per_s"])
        for r in mine:
            sim = "pending" if r["simulated_samples_per_s"] is None else f"{r['simulated_samples_per_s']:.1f}"
            err = "" if r["simulator_error"] is None else f"{r['simulator_error']:+.0%}"
            ratio = r["measured_samples_per_s"] / best["measured_samples_per_s"]
            lines.append(f"{model:<12} {r['run']:<28} {r['semantics']:<8} {r['measured_samples_per_s']:>10.1f} "
                         f"{ratio:>14.2f}x {sim:>9} {err:>7}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default="gpt-tiny,resnet-tiny")
    ap.add_argument("--no-simulator", action="store_true", help="skip profiling and the simulator's predictions")
    ap.add_argument("--out", default="reports/replicas_measured")
    args = ap.parse_args()
    out = Path(args.out)
    rows = [r for m in args.models.split(",") for r in run_model(m, args.steps, out, not args.no_simulator)]
    print("(samples/s in emulated time; baseline: the best single island, measured in the same run)")
    print(table(rows))
    out.mkdir(parents=True, exist_ok=True)
    (out / "replicas_measured.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out / 'replicas_measured.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
