"""Planning time of :func:`deepcee.planner.search.plan_training` as clusters grow.

Cases: the DeepCEE testbed (``cee-testbed``, GPT-2, global batch 64; target < 1 s) and
synthetic clusters of 16, 64, 256, 512 and 1,024 devices in up to 16 islands (targets: 512
devices in 8 islands planned in < 10 s and compared, crossover sweeps included, in < 30 s;
1,024 devices in 16 islands planned in < 30 s). ``compare`` (deepcee, the baselines, the bound
and the crossover sweeps) is timed on every case, with a target only at 512 devices (and 30 s
on the testbed); ``--plan-only-others`` times it only there. Synthetic clusters are seeded:
islands get 4-GPU (or 2-GPU, 1-GPU) nodes of one of three device kinds (datasheet-style numbers, not measurements), 10 Gbit/s inside an island,
and between islands 100 Mbit/s - 1 Gbit/s with 5-50 ms latency.

Baseline measured in the same run: grouping alone (:func:`group_devices`), which every plan
needs, so the table shows what the search itself adds.

Both wall time and process CPU time are reported, and the targets are checked on CPU time: the
project machine has 2 cores shared with other work, so wall time can exceed CPU time by a lot.
CPU time is noisy there too (the same plan at 512 devices took 10.5-14.9 CPU s in eleven runs
of one afternoon), so ``--repeat N`` plans (and compares) each case N times in the same process
and reports every run and the median; the targets are checked on the median. The machine's own
speed changes between sessions (the same code planned the 512-device case in 10.1 CPU s on one
day and 4.6 on another), so a fixed workload that shares no code with deepcee
(:func:`machine_reference`) is timed before and after the cases and stored with them: compare
runs of different days against it, not by their raw seconds.

Run: ``python benchmarks/planning_time.py [--out reports/planning_time.json] [--quick] [--repeat N]
[--plan-only-others]``
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import time
from pathlib import Path

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.models import get_model
from deepcee.plan import save_json_atomic
from deepcee.planner.compare import compare
from deepcee.planner.grouping import group_devices
from deepcee.planner.search import plan_training
from deepcee.scenarios import load_scenario
from deepcee.units import GIB

KINDS = {
    "a100": DeviceKind(name="a100", peak_flops_per_s=312e12, memory_bytes=38 * GIB, achievable_fraction=0.45,
                       source="datasheet-style figure for the benchmark"),
    "rtx3090": DeviceKind(name="rtx3090", peak_flops_per_s=35.6e12, memory_bytes=22 * GIB, achievable_fraction=0.5,
                          source="datasheet-style figure for the benchmark"),
    "t4": DeviceKind(name="t4", peak_flops_per_s=65e12, memory_bytes=14 * GIB, achievable_fraction=0.25,
                     source="datasheet-style figure for the benchmark"),
}


def synthetic_cluster(num_devices: int, num_islands: int, seed: int = 0) -> Cluster:
    """``num_devices`` GPUs in ``num_islands`` islands (nodes of 4, 2 or 1 GPUs), seeded."""
    rng = random.Random(seed)
    kinds = sorted(KINDS)
    per_island = [num_devices // num_islands + (1 if i < num_devices % num_islands else 0)
                  for i in range(num_islands)]
    islands, nodes, devices, links = [], [], [], []
    for i, count in enumerate(per_island):
        name = f"site{i}"
        islands.append(Island(name=name, intra=LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)))
        width = rng.choice([4, 4, 2, 1]) if count >= 4 else 1
        left, k = count, 0
        while left > 0:
            w = min(width, left)
            kind = rng.choice(kinds)
            dnames = tuple(f"{name}n{k}:{j}" for j in range(w))
            nodes.append(Node(name=f"{name}n{k}", island=name, kind=kind, devices=dnames,
                              intra=LinkSpec(latency_s=10e-6, bandwidth_bytes_per_s=12.5e9)))
            devices += [Device(name=d, kind=kind, node=f"{name}n{k}", island=name) for d in dnames]
            left, k = left - w, k + 1
    for i in range(num_islands):
        for j in range(i + 1, num_islands):
            mbit = rng.choice([100, 200, 500, 1000])
            links.append(LinkEntry(a=f"site{i}", b=f"site{j}", spec=LinkSpec(
                latency_s=rng.uniform(5e-3, 50e-3), bandwidth_bytes_per_s=mbit * 1e6 / 8)))
    return Cluster(name=f"synthetic-{num_devices}x{num_islands}-s{seed}", kinds=KINDS, islands=tuple(islands),
                   nodes=tuple(nodes), devices=tuple(devices), links=tuple(links),
                   description="synthetic benchmark cluster (seeded)")


def machine_reference() -> float:
    """CPU seconds of a fixed workload that shares no code with deepcee (seeded shortest paths
    with ``heapq`` and dicts, float arithmetic in loops, small numpy sums: what the planner's
    time is made of). It reads the same on any code version, so planning times of different
    runs or sessions can be set against how fast the machine was (the project machine's speed
    has changed by about 2x between sessions). Median of 3."""
    import heapq

    import numpy as np

    def once() -> float:
        rng = random.Random(12345)
        n = 3000
        adj = {i: [(rng.randrange(n), rng.uniform(0.1, 5.0)) for _ in range(8)] for i in range(n)}
        c0 = time.process_time()
        total = 0.0
        for src in range(0, n, 30):
            dist = {src: 0.0}
            heap = [(0.0, src)]
            while heap:
                d, u = heapq.heappop(heap)
                if d > dist.get(u, math.inf):
                    continue
                for v, w in adj[u]:
                    nd = d + w
                    if nd < dist.get(v, math.inf):
                        dist[v] = nd
                        heapq.heappush(heap, (nd, v))
            total += sum(dist.values())
        arr = np.arange(64, dtype=float)
        for k in range(40000):
            total += float(np.maximum(arr, k % 7).sum())
        if total <= 0:  # keeps the work from being optimised away
            raise AssertionError
        return time.process_time() - c0

    return statistics.median(once() for _ in range(3))


def _time(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def run_case(name: str, cluster: Cluster, model_name: str, global_batch: int, target_s: float,
             compare_target_s: float | None = None, repeat: int = 1, with_compare: bool = True) -> dict:
    """One case, planned (and, with ``with_compare``, compared) ``repeat`` times in turn; the
    figures are the medians. ``compare_target_s``: ``None`` where only the plan has a target."""
    model = get_model(model_name)
    grouping, g_wall, g_cpu = _time(lambda: group_devices(cluster))
    runs = []
    for _ in range(repeat):
        result, wall, cpu = _time(lambda: plan_training(cluster, model, global_batch))
        run = {"planning_wall_s": wall, "planning_cpu_s": cpu, "iteration_s": result.plan.estimate.iteration_s,
               "candidates_evaluated": result.candidates_evaluated, "compare_wall_s": None, "compare_cpu_s": None}
        if with_compare:
            _, run["compare_wall_s"], run["compare_cpu_s"] = _time(lambda: compare(cluster, model, global_batch))
        runs.append(run)
    if len({(r["iteration_s"], r["candidates_evaluated"]) for r in runs}) > 1:
        raise SystemExit(f"{name}: the runs disagree on the plan ({runs}): the search is not deterministic")

    def med(key: str) -> float | None:
        return None if runs[0][key] is None else statistics.median(r[key] for r in runs)

    cpu, cmp_cpu = med("planning_cpu_s"), med("compare_cpu_s")
    return {
        "case": name, "devices": len(cluster.devices), "islands": len(grouping.islands),
        "groups": len(grouping.groups), "model": model_name, "global_batch": global_batch,
        "grouping_wall_s": g_wall, "grouping_cpu_s": g_cpu, "planning_wall_s": med("planning_wall_s"),
        "planning_cpu_s": cpu, "candidates_evaluated": result.candidates_evaluated, "stages": result.plan.num_stages,
        "devices_used": len(result.plan.devices), "iteration_s": result.plan.estimate.iteration_s,
        "target_s": target_s, "compare_wall_s": med("compare_wall_s"), "compare_cpu_s": cmp_cpu,
        "compare_target_s": compare_target_s, "repeat": repeat, "runs": runs,
        "within_target": cpu < target_s and (compare_target_s is None or cmp_cpu is None or cmp_cpu < compare_target_s),
    }


CASES = [  # (name, devices, islands, model, global batch, plan target, compare target or None)
    ("synthetic-16", 16, 4, "gpt2", 64, 30.0, None),
    ("synthetic-64", 64, 8, "gpt2-xl", 256, 30.0, None),
    ("synthetic-256", 256, 16, "gpt2-xl", 1024, 30.0, None),
    ("synthetic-512", 512, 8, "llama-1b", 1024, 10.0, 30.0),
    ("synthetic-1024", 1024, 16, "llama-7b", 4096, 30.0, None),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/planning_time.json")
    ap.add_argument("--quick", action="store_true", help="only the testbed and the 16-device case")
    ap.add_argument("--plan-only-others", action="store_true",
                    help="compare only where there is a compare target (the testbed and 512 devices)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="plan (and compare) each case N times; the table shows the medians (default 1)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    ref_before = machine_reference()
    print(f"machine reference workload (fixed, shares no code with deepcee): {ref_before:.3f} CPU s", flush=True)
    rows = [run_case("cee-testbed", load_scenario("cee-testbed"), "gpt2", 64, 1.0, 30.0, args.repeat)]
    for name, n, k, model, batch, target, cmp_target in CASES[:1] if args.quick else CASES:
        rows.append(run_case(name, synthetic_cluster(n, k, seed=n), model, batch, target, cmp_target, args.repeat,
                             with_compare=cmp_target is not None or not args.plan_only_others))
        runs = rows[-1]["runs"]
        print(f"  {name}: planned in {rows[-1]['planning_wall_s']:.1f} s (CPU s: "
              + ", ".join(f"{r['planning_cpu_s']:.2f}" for r in runs) + ")"
              + ("" if rows[-1]["compare_cpu_s"] is None else
                 ", compared in CPU s: " + ", ".join(f"{r['compare_cpu_s']:.2f}" for r in runs)), flush=True)
    head = (f"{'case':<16}{'devices':>8}{'islands':>8}{'model':>10}{'batch':>7}{'group s':>9}{'plan s':>9}"
            f"{'cpu s':>8}{'target':>8}{'cmp cpu s':>10}{'ok':>4}{'cands':>7}{'stages':>7}{'used':>6}{'iter s':>10}")
    print(f"(medians of {args.repeat} run(s) per case; every run is in the JSON)" if args.repeat > 1 else "")
    print(head)
    for r in rows:
        cmp = "-" if r["compare_cpu_s"] is None else f"{r['compare_cpu_s']:.1f}"
        print(f"{r['case']:<16}{r['devices']:>8}{r['islands']:>8}{r['model']:>10}{r['global_batch']:>7}"
              f"{r['grouping_wall_s']:>9.3f}{r['planning_wall_s']:>9.3f}{r['planning_cpu_s']:>8.3f}"
              f"{r['target_s']:>8.0f}{cmp:>10}{'yes' if r['within_target'] else 'NO':>4}{r['candidates_evaluated']:>7}"
              f"{r['stages']:>7}{r['devices_used']:>6}{r['iteration_s']:>10.4g}")
    ref_after = machine_reference()
    print(f"machine reference workload: {ref_before:.3f} CPU s before the cases, {ref_after:.3f} after "
          "(set planning times of other runs against it)")
    save_json_atomic(Path(args.out), {"schema_version": 2, "format": "deepcee.bench.planning_time", "cases": rows,
                                      "machine": {"processor": platform.processor() or platform.machine(),
                                                  "reference_cpu_s_before": ref_before,
                                                  "reference_cpu_s_after": ref_after}})
    print(f"wrote {args.out}")
    return 0 if all(r["within_target"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
