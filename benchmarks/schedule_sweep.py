"""Compact zero-bubble builder vs the best fixed schedule, over seeded random pipelines.

For every case: 2-8 stages, ``M`` from ``max(1, S//2)`` to ``3S`` microbatches, per-stage
forward times differing up to 4x between stages (``F = 30 ms x U(1, 4)``,
``I = F x U(0.8, 1.3)``, ``W = F x U(0.5, 1.1)``), per-boundary links with one-way latency
from one of three buckets (0-10, 10-50, 50-200 ms) and bandwidth log-uniform in
10 Mbit/s - 10 Gbit/s (both directions alike), carrying ``--activation-bytes`` per
microbatch each way (default 1 MiB: e.g. 4 samples x 128 tokens x 512 hidden x fp32), and a
per-stage memory limit (microbatches in flight) that is tight (1F1B's in-flight, ``min(S-s,
M)``), medium (ZB-H2's, ``min(2(S-s)-1, M)``) or loose (``M``).

The baseline is the fastest of GPipe, 1F1B, ZB-H1 and ZB-H2 whose in-flight counts fit the
memory limit (the others are inadmissible), all timed by the same dry run
(:func:`deepcee.schedule.passes.dry_run`) in the same process. A win is a makespan more than
1e-9 relative below the baseline, a loss more than 1e-9 above.

Run::

    python benchmarks/schedule_sweep.py --cases 240 --seed 0 --out reports/schedule_sweep.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from deepcee.schedule.builders import build_schedule
from deepcee.schedule.compact import search_compact
from deepcee.schedule.passes import dry_run, in_flight_per_stage

BASELINES = ("gpipe", "1f1b", "zb-h1", "zb-h2")
LATENCY_BUCKETS_S = {"lat 0-10ms": (0.0, 0.010), "lat 10-50ms": (0.010, 0.050), "lat 50-200ms": (0.050, 0.200)}
MEMORY_BUCKETS = ("tight", "medium", "loose")
BANDWIDTH_RANGE_BYTES_PER_S = (10e6 / 8, 10e9 / 8)
TOLERANCE = 1e-9


def make_case(rng: random.Random, activation_bytes: float) -> dict:
    stages = rng.randint(2, 8)
    microbatches = rng.randint(max(1, stages // 2), 3 * stages)
    forward = [0.030 * rng.uniform(1.0, 4.0) for _ in range(stages)]
    input_grad = [f * rng.uniform(0.8, 1.3) for f in forward]
    weight_grad = [f * rng.uniform(0.5, 1.1) for f in forward]
    lat_bucket = rng.choice(sorted(LATENCY_BUCKETS_S))
    lo, hi = LATENCY_BUCKETS_S[lat_bucket]
    links = []
    for _ in range(stages - 1):
        bw = BANDWIDTH_RANGE_BYTES_PER_S[0] * (BANDWIDTH_RANGE_BYTES_PER_S[1] / BANDWIDTH_RANGE_BYTES_PER_S[0]) ** rng.random()
        links.append((rng.uniform(lo, hi), activation_bytes / bw))
    mem_bucket = rng.choice(MEMORY_BUCKETS)
    limit = {
        "tight": [min(stages - s, microbatches) for s in range(stages)],
        "medium": [min(2 * (stages - s) - 1, microbatches) for s in range(stages)],
        "loose": [microbatches] * stages,
    }[mem_bucket]
    return {"stages": stages, "microbatches": microbatches, "forward_s": forward, "input_grad_s": input_grad,
            "weight_grad_s": weight_grad, "comm_forward": links, "comm_backward": links,
            "memory_limit": limit, "latency_bucket": lat_bucket, "memory_bucket": mem_bucket}


def run_case(case: dict) -> dict:
    costs = {k: case[k] for k in ("forward_s", "input_grad_s", "weight_grad_s", "comm_forward", "comm_backward")}
    spans = {}
    for name in BASELINES:
        sched = build_schedule(name, case["stages"], case["microbatches"])
        if all(h <= lim for h, lim in zip(in_flight_per_stage(sched), case["memory_limit"], strict=True)):
            spans[name] = dry_run(sched, **costs).makespan_s
    t0 = time.perf_counter()
    result = search_compact(num_microbatches=case["microbatches"], memory_limit=case["memory_limit"], **costs)
    build_s = time.perf_counter() - t0
    compact = dry_run(result.schedule, **costs).makespan_s
    held = in_flight_per_stage(result.schedule)
    assert all(h <= lim for h, lim in zip(held, case["memory_limit"], strict=True)), (held, case["memory_limit"])
    best_name = min(spans, key=spans.__getitem__)
    base = spans[best_name]
    outcome = "win" if compact < base * (1 - TOLERANCE) else "loss" if compact > base * (1 + TOLERANCE) else "tie"
    return {**{k: case[k] for k in ("stages", "microbatches", "latency_bucket", "memory_bucket", "memory_limit")},
            "baseline": best_name, "baseline_makespan_s": base, "template_makespans_s": spans,
            "compact_makespan_s": compact, "compact_source": result.source, "compact_in_flight": list(held),
            "gain": (base - compact) / base, "outcome": outcome, "build_s": build_s}


def summarise(rows: Sequence[dict]) -> dict:
    gains = [r["gain"] for r in rows if r["outcome"] == "win"]
    return {
        "cases": len(rows),
        "wins": sum(r["outcome"] == "win" for r in rows),
        "ties": sum(r["outcome"] == "tie" for r in rows),
        "losses": sum(r["outcome"] == "loss" for r in rows),
        "mean_gain_when_winning": statistics.fmean(gains) if gains else 0.0,
        "median_gain_when_winning": statistics.median(gains) if gains else 0.0,
        "max_gain": max(gains, default=0.0),
        "mean_gain_all": statistics.fmean(r["gain"] for r in rows) if rows else 0.0,
    }


def print_table(groups: dict[str, dict]) -> None:
    head = f"{'bucket':<16}{'cases':>6}{'wins':>6}{'ties':>6}{'losses':>7}{'mean gain':>11}{'median':>9}{'max':>8}{'mean all':>10}"
    print(head)
    print("-" * len(head))
    for name, s in groups.items():
        print(f"{name:<16}{s['cases']:>6}{s['wins']:>6}{s['ties']:>6}{s['losses']:>7}"
              f"{s['mean_gain_when_winning']:>11.1%}{s['median_gain_when_winning']:>9.1%}{s['max_gain']:>8.1%}"
              f"{s['mean_gain_all']:>10.1%}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--activation-bytes", type=float, default=float(1 << 20),
                        help="bytes per microbatch crossing each boundary, each way (default 1 MiB)")
    parser.add_argument("--out", default="reports/schedule_sweep.json")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    rows = [run_case(make_case(rng, args.activation_bytes)) for _ in range(args.cases)]
    wall_s = time.perf_counter() - t0
    groups = {"all": summarise(rows)}
    for b in sorted(LATENCY_BUCKETS_S):
        groups[b] = summarise([r for r in rows if r["latency_bucket"] == b])
    for b in MEMORY_BUCKETS:
        groups[f"memory {b}"] = summarise([r for r in rows if r["memory_bucket"] == b])
    print(f"compact vs best admissible of {', '.join(BASELINES)} (dry-run makespan; gain = 1 - compact/baseline)")
    print_table(groups)
    sources: dict[str, int] = {}
    for r in rows:
        key = r["compact_source"].split("(")[0] if r["compact_source"].startswith("greedy") else r["compact_source"]
        sources[key] = sources.get(key, 0) + 1
    build = [r["build_s"] for r in rows]
    print(f"winning candidate kinds: {sources}")
    print(f"compact build time per case: mean {statistics.fmean(build) * 1e3:.0f} ms, max {max(build) * 1e3:.0f} ms; "
          f"sweep wall time {wall_s:.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "schedule_sweep", "seed": args.seed, "cases": args.cases,
        "activation_bytes": args.activation_bytes, "baselines": list(BASELINES),
        "summary": groups, "wall_s": wall_s, "rows": rows,
    }, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
