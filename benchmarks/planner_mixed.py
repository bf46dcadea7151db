"""The planner on random mixed clusters: against every baseline and the independent reference.

``planner_at_scale.py``'s instances are one GPU kind per region and a model no region can hold.
These vary what those do not (seeded, :func:`mixed_instance`):

- 1-9 regions (the same 16 public-cloud locations and WAN latency rule as ``planner_at_scale``),
  WAN bandwidth per server pair drawn from 50 Mbit/s, 100 Mbit/s, 300 Mbit/s, 1 and 5 Gbit/s;
- per region 1-20 GPUs on servers of 1-8 GPUs, **each server its own kind** (the 10
  datasheet-style kinds of ``planner_at_scale``, 8-24 GiB; not measurements), the region's LAN
  1, 10, 25 or 100 Gbit/s with 0.05-2 ms latency, a server's own links 16, 32 or 150 GB/s;
- a built-in model (GPT-2 sizes, BERT-base, Llama 1B and 7B, ResNet-50/101, EfficientNet-B0, or
  a Llama of 4-40 layers, hidden 1,024-4,096) whether or not one server holds it, global batch
  1, 3, 8, 17, 32, 100, 256, 1,000 or 2,048.

Per instance: deepcee's plan (``plan_training``, default options), simulated; every baseline of
``deepcee compare`` (simulated, the same run); with ``--reference-budget-s``, the independent
reference of ``wan_reference.py`` (its global search for that many CPU seconds, then its polish
from deepcee's plan). Reported: where a baseline simulates faster than deepcee's plan (by name;
``fsdp-zero2`` apart: its sharded optimizer state is the simulator's, deepcee's runtime runs
``zero2`` as a plain all-reduce, so the planner does not search it), the gap to the reference,
and the planning CPU time. Every figure is simulated; the clusters are emulated (datasheet-style
speeds), none measured.

Run: ``python benchmarks/planner_mixed.py [--instances 40] [--first 0] [--jobs 2]
[--reference-budget-s 20] [--out reports/planner_mixed.json]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.errors import InfeasiblePlanError
from deepcee.models import get_model
from deepcee.plan import save_json_atomic
from deepcee.profile import ModelProfile
from deepcee.simulator.engine import simulate
from deepcee.units import GIB

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_at_scale import KINDS, REGIONS, _km, check_writable  # noqa: E402  (beside this script)

SCHEMA_VERSION = 1
MODELS = ("gpt2", "gpt2-medium", "gpt2-xl", "bert-base", "llama-1b", "llama-7b", "resnet50", "resnet101",
          "efficientnet-b0", "llama")
BATCHES = (1, 3, 8, 17, 32, 100, 256, 1000, 2048)
GAP_MISS = 0.02
"""A plan more than this much slower than the reference is a miss (as in ``planner_at_scale``)."""
NOT_SEARCHED = ("fsdp-zero2",)
"""Baselines whose strategy the planner does not search (see the module docstring)."""


def mixed_instance(seed: int) -> tuple[Cluster, ModelProfile, int]:
    """A seeded mixed instance (see the module docstring): (cluster, model, global batch)."""
    rng = random.Random(1000 + seed)
    regions = rng.sample(REGIONS, rng.randint(1, 9))
    kinds = {k[0]: DeviceKind(name=k[0], peak_flops_per_s=k[1] * 1e12, memory_bytes=k[2] * GIB,
                              achievable_fraction=k[3], source="datasheet-style figure for the benchmark")
             for k in KINDS}
    islands, nodes, devices, links = [], [], [], []
    for name, *_ in regions:
        count = rng.choice([1, 1, 2, 3, 4, 5, 7, 8, 12, 16, 20])
        islands.append(Island(name=name, intra=LinkSpec(latency_s=rng.uniform(0.05e-3, 2e-3),
                                                        bandwidth_bytes_per_s=rng.choice([1, 10, 25, 100]) * 1.25e8)))
        left, k = count, 0
        while left:
            width = min(rng.choice([1, 2, 4, 8]), left)
            kind = rng.choice(KINDS)
            names = tuple(f"{name}-n{k}:{j}" for j in range(width))
            nodes.append(Node(name=f"{name}-n{k}", island=name, kind=kind[0], devices=names,
                              intra=LinkSpec(latency_s=10e-6, bandwidth_bytes_per_s=rng.choice([16, 32, 150]) * 1e9)))
            devices += [Device(name=d, kind=kind[0], node=f"{name}-n{k}", island=name) for d in names]
            left, k = left - width, k + 1
    for a, b in itertools.combinations(range(len(regions)), 2):
        d = _km(regions[a], regions[b])
        latency = min(0.3, max(0.002, (d / 100.0 + 2) * 1e-3 * rng.uniform(0.9, 1.3)))
        gbit = rng.choice([0.05, 0.1, 0.3, 1.0, 5.0])
        links.append(LinkEntry(a=regions[a][0], b=regions[b][0],
                               spec=LinkSpec(latency_s=latency, bandwidth_bytes_per_s=gbit * 1.25e8)))
    cluster = Cluster(name=f"mixed-{seed}", kinds=kinds, islands=tuple(islands), nodes=tuple(nodes),
                      devices=tuple(devices), links=tuple(links), description="random mixed cluster (benchmark)")
    name = rng.choice(MODELS)
    if name == "llama":
        h = rng.choice([1024, 2048, 4096])
        model = get_model("llama", hidden_size=h, num_layers=rng.choice([4, 8, 16, 24, 40]), num_heads=h // 128,
                          num_kv_heads=h // 128, ffn_size=int(h * 8 / 3) // 256 * 256, seq_len=rng.choice([512, 2048]))
    else:
        model = get_model(name)
    return cluster, model, rng.choice(BATCHES)


def run_instance(seed: int, reference_budget_s: float = 0.0, polish_simulations: int = 80) -> dict:
    """deepcee, the baselines and (with a budget) the reference on instance ``seed``; one row."""
    from deepcee.planner.baselines import build_baselines
    from deepcee.planner.search import plan_training

    cluster, model, batch = mixed_instance(seed)
    row: dict = {"seed": seed, "devices": len(cluster.devices), "regions": len(cluster.islands),
                 "nodes": len(cluster.nodes), "model": model.name, "layers": model.num_layers, "batch": batch}
    c0 = time.process_time()
    try:
        result = plan_training(cluster, model, batch)
    except InfeasiblePlanError as err:
        row["infeasible"] = str(err)
        row["baselines_fitting"] = [b.name for b in build_baselines(cluster, model, batch) if b.plan is not None]
        return row
    row["plan_cpu_s"] = time.process_time() - c0
    plan = result.plan
    mine = simulate(plan, cluster, model, record=False)
    row.update(deepcee_s=mine.iteration_s, deepcee_devices=len(plan.devices), deepcee_stages=plan.num_stages,
               node_look=any(x.startswith(("note: the best plan is on node", "note: the best plan is on island"))
                             for x in plan.explanation),
               over_memory=sorted(d for d, b in mine.peak_memory_bytes.items() if b > cluster.memory_bytes(d)))
    row["baselines_s"] = {b.name: simulate(b.plan, cluster, model, record=False).iteration_s
                          for b in build_baselines(cluster, model, batch) if b.plan is not None}
    row["faster_baselines"] = sorted(name for name, s in row["baselines_s"].items()
                                     if name not in NOT_SEARCHED and s < mine.iteration_s * (1 - 1e-9))
    if reference_budget_s > 0:
        from wan_reference import polish, reference_search

        ref = reference_search(cluster, model, batch, budget_s=reference_budget_s)
        pol = polish(plan, cluster, model, simulations=polish_simulations) if polish_simulations else None
        row["global_s"] = ref["iteration_s"] if ref["plan"] is not None else None
        row["polished_s"] = pol["iteration_s"] if pol is not None and math.isfinite(pol["iteration_s"]) else None
        row["polish_moves"] = [m[0] for m in pol["moves"]] if pol is not None else []
        known = [x for x in (row["global_s"], row["polished_s"]) if x is not None]
        row["gap"] = mine.iteration_s / min(known) - 1 if known else None
    return row


def summary(rows: list[dict]) -> dict:
    planned = [r for r in rows if "deepcee_s" in r]
    gaps = [r["gap"] for r in planned if r.get("gap") is not None]
    cpu = sorted(r["plan_cpu_s"] for r in planned)
    faster: dict[str, int] = {}
    for r in planned:
        for name in r["faster_baselines"]:
            faster[name] = faster.get(name, 0) + 1
    return {
        "instances": len(rows), "planned": len(planned), "infeasible": len(rows) - len(planned),
        "infeasible_with_a_fitting_baseline": sum(1 for r in rows if r.get("baselines_fitting")),
        "below_a_baseline": sum(1 for r in planned if r["faster_baselines"]), "faster_baselines": faster,
        "over_memory": sum(1 for r in planned if r["over_memory"]),
        "node_look_taken": sum(1 for r in planned if r["node_look"]),
        "with_reference": len(gaps), "within_2pct_of_reference": sum(1 for g in gaps if g <= GAP_MISS),
        "worst_gap": max(gaps, default=None),
        "plan_cpu_s": {"median": cpu[len(cpu) // 2] if cpu else None, "max": cpu[-1] if cpu else None},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=40)
    ap.add_argument("--first", type=int, default=0, help="first seed")
    ap.add_argument("--jobs", type=int, default=2, help="processes (at most 2 on the project machine)")
    ap.add_argument("--reference-budget-s", type=float, default=0.0,
                    help="CPU seconds of the reference's global search per instance (0: no reference)")
    ap.add_argument("--polish-simulations", type=int, default=80,
                    help="simulations of the reference's polish from deepcee's plan (with a reference budget)")
    ap.add_argument("--out", default="reports/planner_mixed.json")
    args = ap.parse_args(argv)
    if args.instances < 1 or args.first < 0 or args.jobs < 1 or args.polish_simulations < 0 or not (
            math.isfinite(args.reference_budget_s) and args.reference_budget_s >= 0):
        ap.error(f"--instances and --jobs must be at least 1, --first, --polish-simulations and --reference-budget-s "
                 f"at least 0; got {args.instances!r}, {args.jobs!r}, {args.first!r}, {args.polish_simulations!r} "
                 f"and {args.reference_budget_s!r}")
    check_writable(ap, "--out", args.out)  # now, not after the run
    out = Path(args.out)
    seeds = range(args.first, args.first + args.instances)
    t0 = time.perf_counter()
    print("every figure simulated; clusters emulated from datasheet-style speeds")
    print(f"{'seed':>5}{'dev':>5}{'reg':>4}  {'model':<16}{'batch':>6}{'deepcee s':>12}{'best baseline':>28}"
          f"{'ref gap %':>10}{'cpu s':>7}  note")
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, min(2, args.jobs))) as pool:
        for r in pool.map(run_instance, seeds, itertools.repeat(args.reference_budget_s),
                          itertools.repeat(args.polish_simulations)):
            rows.append(r)
            if "deepcee_s" not in r:
                print(f"{r['seed']:>5}{r['devices']:>5}{r['regions']:>4}  {r['model']:<16}{r['batch']:>6}"
                      f"  no plan: {r['infeasible'][:70]}", flush=True)
                continue
            base = min(r["baselines_s"].items(), key=lambda kv: kv[1], default=("-", math.nan))
            gap = "" if r.get("gap") is None else f"{100 * r['gap']:+.2f}"
            note = "; ".join(filter(None, ["node look" if r["node_look"] else "",
                                           f"below {', '.join(r['faster_baselines'])}" if r["faster_baselines"] else "",
                                           "over memory" if r["over_memory"] else ""]))
            print(f"{r['seed']:>5}{r['devices']:>5}{r['regions']:>4}  {r['model']:<16}{r['batch']:>6}"
                  f"{r['deepcee_s']:>12.5g}{base[0]:>18} {base[1]:>9.4g}{gap:>10}{r['plan_cpu_s']:>7.1f}  {note}",
                  flush=True)
    doc = {"schema_version": SCHEMA_VERSION, "format": "deepcee.planner_mixed", "source": (
        "simulated; emulated clusters (datasheet-style device speeds, drawn links), none measured"),
           "args": vars(args), "wall_s": time.perf_counter() - t0, "summary": summary(rows), "instances": rows}
    save_json_atomic(out, json.loads(json.dumps(doc, default=float)))
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
