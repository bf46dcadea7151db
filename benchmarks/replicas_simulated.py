"""Simulated: every synchronisation strategy on one replica per island of the DeepCEE testbed vs the best synchronous plan.

Cases: ResNet-50 and BERT-small at global batch 128, GPT-2 at 64, on ``cee-testbed``
(cloud-edge and cloud-end links at 100 Mbit/s). In the same run, for each case:

- the baseline: deepcee's best synchronous plan (``deepcee plan``, the exact search);
- one replica per island (cloud, edge, end: all 15 devices when each island's best pipeline
  uses all its devices), each the best pipeline on its island at a batch in proportion to its
  speed, joined by every strategy: exact (ring, hierarchical, parameter servers), model
  averaging every H in {1, 10, 50, 200} (plain and DiLoCo's outer Nesterov, each also
  overlapped: applied one period late, [Note: overlapped averaging] in
  :mod:`deepcee.runtime.overlap`), ASGD-GA (k in
  {1, 4, 16}, staleness bound 3), partial averaging (full sync every P in {1, 4, 16});
- the related systems as baselines (Cloudless-Training, SDPipe, HeteroG:
  :mod:`deepcee.planner.relaxed_baselines`);
- what ``deepcee plan --sync relaxed`` picks among all layouts and these strategies.

Columns: samples/s and its ratio to the synchronous plan; the share of the replicas' time in
cross-replica synchronisation ("WAN") and waiting for other replicas; the steps-to-target
multiplier (the conservative default, NOT measured) and the predicted time to target as a
ratio to the synchronous plan's (below 1: faster). Every figure is *simulated, analytic
profile, datasheet speeds*; relaxed samples/s are not comparable with exact ones without
the multiplier. Run (a few minutes on 2 cores)::

    python benchmarks/replicas_simulated.py --out reports/replicas_simulated.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from deepcee.models import get_model
from deepcee.plan import Strategy, save_json_atomic
from deepcee.planner.efficiency import DefaultEfficiency
from deepcee.planner.relaxed_baselines import build_relaxed_baselines
from deepcee.planner.replicas import RelaxedOptions, Scored, plan_replicas
from deepcee.planner.search import plan_training
from deepcee.scenarios import load_scenario
from deepcee.simulator.replicas import simulate_replicas

SCENARIO = "cee-testbed"
CASES = (("resnet50", 128), ("bert-small", 128), ("gpt2", 64))
OPTIONS = RelaxedOptions(periods=(1, 10, 50, 200), accumulations=(1, 4, 16), staleness_bounds=(3,),
                         full_syncs=(1, 4, 16), max_local_steps=400)
EVERY_LAYOUT = OPTIONS.every_layout()
"""Every layout planned in full (for the table of one layout's strategies)."""
SOURCE = "simulated, analytic profile, datasheet speeds"
NEVER = 10**9
"""A model-averaging period no run reaches: the replicas never synchronise (the layout's compute alone)."""


def _order(s: Scored) -> tuple:
    st = s.plan.strategy
    kind = ("exact", "model-averaging", "asgd-ga", "partial").index(st.kind)
    return kind, st.period, st.outer_optimizer, st.overlap, st.accumulation_steps, st.full_sync_every, s.plan.sync


def _settings(s: Scored) -> str:
    return _settings_of(s.plan)


def _settings_of(p: Any) -> str:
    st = p.strategy
    per_stage = [st_.sync for rep in p.replicas[:1] for st_ in rep.stages if st_.sync]
    sync = "per stage " + ",".join(per_stage) if per_stage else p.sync
    overlap = " overlapped" if st.overlap else ""
    return {"exact": f"exact {sync}", "model-averaging": f"MA H={st.period} {st.outer_optimizer}{overlap}",
            "asgd-ga": f"ASGD-GA k={st.accumulation_steps} s<={st.staleness_bound}",
            "partial": f"partial P={st.full_sync_every}"}[st.kind]


def _row(name: str, s: Any, sync_sps: float, sync_tt: float) -> dict[str, Any]:
    f, r = s.figures, s.result
    return {"strategy": name, "semantics": f.semantics, "devices": len(s.plan.devices),
            "replicas": s.plan.num_replicas, "samples_per_s": r.samples_per_s, "x_sync": r.samples_per_s / sync_sps,
            "wan_fraction": r.wan_fraction, "wait_fraction": r.wait_fraction,
            "multiplier": f.time_to_target.multiplier, "multiplier_source": f.time_to_target.source,
            "time_to_target_vs_sync": f.time_to_target.seconds_per_sync_sample / sync_tt,
            "plan": s.plan.to_dict()}


def run_case(model_name: str, batch: int) -> dict[str, Any]:
    cluster, model = load_scenario(SCENARIO), get_model(model_name)
    t0 = time.perf_counter()
    exact = plan_training(cluster, model, batch).plan
    search = plan_replicas(cluster, model, batch, options=OPTIONS, exact_plan=exact)
    # the table's layout in full: its every strategy, whether or not the search's screen of the
    # layouts ([Note: layout screen] in deepcee.planner.replicas) planned it in full
    table = plan_replicas(cluster, model, batch, options=EVERY_LAYOUT, exact_plan=exact)
    sync = search.exact
    sync_sps, sync_tt = sync.samples_per_s, sync.figures.time_to_target.seconds_per_sync_sample
    every = max((s for s in table.candidates if s.plan.num_replicas == 3), key=lambda s: len(s.plan.devices))
    layout = [s for s in table.candidates if s.layout == every.layout]
    layout.sort(key=_order)
    rows = [_row("sync: deepcee plan (exact search)", sync, sync_sps, sync_tt)]
    rows += [_row(_settings(s), s, sync_sps, sync_tt) for s in layout]
    alone = every.plan.replace(strategy=Strategy(kind="model-averaging", period=NEVER))
    rows.append(_row("no sync (replicas alone: this layout's compute)", Scored(
        plan=alone, result=simulate_replicas(alone, cluster, model, steps=4), figures=every.figures,
        layout=every.layout), sync_sps, sync_tt) | {"semantics": "none", "multiplier": math.nan,
                                                    "time_to_target_vs_sync": math.nan})
    for b in build_relaxed_baselines(cluster, model, batch, efficiency=DefaultEfficiency()):
        if b.result.plan is None:
            rows.append({"strategy": b.result.name, "reason": b.result.reason})
            continue
        rows.append(_row(f"{b.result.name}: {_settings_of(b.result.plan)}", Scored(
            plan=b.result.plan, result=b.simulation, figures=b.figures, layout="regions"), sync_sps, sync_tt))
    rows.append(_row(f"pick (--sync relaxed): {_settings(search.best)}", search.best, sync_sps, sync_tt)
                | {"layout": search.best.layout})
    return {"model": model_name, "global_batch": batch, "layout": every.layout, "rows": rows,
            "seconds": time.perf_counter() - t0}


def print_case(case: dict[str, Any]) -> None:
    print(f"\n{case['model']} at global batch {case['global_batch']} on {SCENARIO} (100 Mbit/s); replicas "
          f"{case['layout']}; {SOURCE}")
    head = (f"{'strategy':<46} {'sem':<7} {'dev':>3} {'samples/s':>10} {'x sync':>7} {'WAN':>5} {'wait':>5} "
            f"{'mult':>5} {'to target':>9}")
    print(head)
    print("-" * len(head))
    for r in case["rows"]:
        if "reason" in r:
            print(f"{r['strategy']:<46} no plan: {r['reason']}")
            continue
        print(f"{r['strategy'][:46]:<46} {r['semantics']:<7} {r['devices']:>3} {r['samples_per_s']:>10.1f} "
              f"{r['x_sync']:>7.2f} {r['wan_fraction']:>5.0%} {r['wait_fraction']:>5.0%} {r['multiplier']:>5.2f} "
              f"{r['time_to_target_vs_sync']:>9.2f}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="reports/replicas_simulated.json")
    parser.add_argument("--only", help="comma-separated model names (default: all cases)")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    cases = []
    for name, batch in CASES:
        if only and name not in only:
            continue
        cases.append(run_case(name, batch))
        print_case(cases[-1])
    print("\nmult: steps-to-target multiplier, the conservative default (not measured); to target: predicted time "
          "to target / the synchronous plan's (below 1 is faster); relaxed samples/s are not comparable with exact "
          "ones without it")
    save_json_atomic(args.out, {"format": "deepcee.benchmark.replicas_simulated", "schema_version": 1,
                                "scenario": SCENARIO, "source": SOURCE, "cases": cases})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
