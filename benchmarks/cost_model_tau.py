"""Cost model against the simulator on the planner's best plans (issue 10: Kendall tau >= 0.9).

Instances: the WAN instance of seed 2 (:func:`planner_at_scale.wan_instance`) and the synthetic
clusters of 64, 256 and 512 devices of :mod:`planning_time` (same models and batches). For each,
:func:`~deepcee.planner.search.plan_training` runs once (its CPU time is printed), then the top
20 of ``PlanResult.scored`` (the cost model's order) are simulated: Kendall tau
(:func:`planner_at_scale.kendall_tau`) and the largest relative error of the cost model.

``--breakdown`` prints, per plan, where the two differ: each stage's end of its action list
(cost model: its pipeline timing, per device; simulator: the stage's last device), the all-reduce and
optimizer tail after it. ``--cache DIR`` keeps each instance's top plans (pickled) so the
breakdown can be re-run on the same plans after a cost-model change (``--rescore``: do not plan,
score the cached plans with the current cost model).

Baseline measured in the same run: none; the same script on the previous cost model gives the
"before" figures (docs/results.md).

Run: ``python benchmarks/cost_model_tau.py [--only synthetic-256] [--breakdown] [--cache DIR] [--out F]``
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepcee.models import get_model  # noqa: E402
from deepcee.plan import save_json_atomic  # noqa: E402
from deepcee.planner.cost_model import AnalyticCostModel  # noqa: E402
from deepcee.planner.search import plan_training  # noqa: E402
from deepcee.schedule.interpreter import Execution  # noqa: E402
from deepcee.simulator.engine import _Simulation, simulate  # noqa: E402
from deepcee.simulator.runtime_model import runtime_for  # noqa: E402
from planner_at_scale import kendall_tau_of, wan_instance  # noqa: E402
from planning_time import synthetic_cluster  # noqa: E402

INSTANCES = ("wan-2", "synthetic-64", "synthetic-256", "synthetic-512")
_SYNTHETIC = {"synthetic-64": (64, 8, "gpt2-xl", 256), "synthetic-256": (256, 16, "gpt2-xl", 1024),
              "synthetic-512": (512, 8, "llama-1b", 1024)}


def instance(name: str):
    """(cluster, model, global batch) of one named instance."""
    if name == "wan-2":
        return wan_instance(2)
    n, k, model, batch = _SYNTHETIC[name]
    return synthetic_cluster(n, k, seed=n), get_model(model), batch


def breakdown(plans, cluster, model) -> None:
    """Per plan: iteration (cost model, simulator), per stage list end and the tail after it."""
    cm = AnalyticCostModel()
    rt = runtime_for(cluster, model)
    for k, plan in enumerate(plans):
        cost = cm.breakdown(plan, cluster, model)
        sim = _Simulation(plan, cluster, model, rt)
        exe = Execution(sim.tables, start_s=0.0, record=False)
        n = len(sim.devices)
        list_end, _ = exe.pipeline([0.0] * n, [-1] * n)
        ends = [0.0] * plan.num_stages
        for d, s in enumerate(sim.stage_of):
            ends[s] = max(ends[s], list_end[d])
        it = simulate(plan, cluster, model, record=False).iteration_s
        worst = max(range(plan.num_stages), key=lambda s: cost.pipeline.stage_end_s[s] + cost.allreduce_s[s]
                    + cost.optimizer_s[s])
        print(f"  #{k:2d} cm {cost.iteration_s:8.4f} sim {it:8.4f} err {cost.iteration_s / it - 1:+7.2%}  "
              f"S={plan.num_stages} M={plan.num_microbatches} mb={plan.microbatch_size} {plan.schedule:<8}"
              f" devs={len(plan.devices)} crit stage {worst}")
        print("      list end cm : " + " ".join(f"{x:7.3f}" for x in cost.pipeline.stage_end_s))
        print("      list end sim: " + " ".join(f"{x:7.3f}" for x in ends))
        print("      allreduce   : " + " ".join(f"{x:7.3f}" for x in cost.allreduce_s))
        print("      F per mb    : " + " ".join(f"{x * 1e3:7.1f}" for x in cost.forward_s))
        print("      link fwd ser: " + " ".join(f"{b.forward[1] * 1e3:7.1f}" for b in cost.boundaries)
              + "  lat: " + " ".join(f"{b.forward[0] * 1e3:7.1f}" for b in cost.boundaries))
        print("      stage sizes : " + " ".join(f"{len(st.devices):7d}" for st in plan.stages))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=INSTANCES)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--rescore", action="store_true", help="score the cached plans, do not plan")
    ap.add_argument("--out", default="reports/cost_model_tau.json")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'instance':<15}{'plan cpu s':>11}{'plans':>6}{'tau':>7}{'max err':>9}{'best sim s/iter':>16}")
    for name in args.only or INSTANCES:
        cluster, model, batch = instance(name)
        cache = args.cache / f"{name}.pkl" if args.cache else None
        cpu = float("nan")
        if args.rescore and cache is not None and cache.exists():
            plans = pickle.loads(cache.read_bytes())
            cm = AnalyticCostModel()
            est = [cm.estimate(p, cluster, model).iteration_s for p in plans]
        else:
            c0 = time.process_time()
            result = plan_training(cluster, model, batch)
            cpu = time.process_time() - c0
            plans = [c.plan for c in result.scored[:args.top]]
            est = [c.estimate.iteration_s for c in result.scored[:args.top]]
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_bytes(pickle.dumps(plans))
        sims = [simulate(p, cluster, model, record=False).iteration_s for p in plans]
        tau = kendall_tau_of(est, sims)
        tau = float("nan") if tau is None else tau
        err = max(abs(e / s - 1) for e, s in zip(est, sims, strict=True))
        print(f"{name:<15}{cpu:11.2f}{len(plans):6d}{tau:7.2f}{err:9.2%}{min(sims):16.4f}", flush=True)
        rows.append({"instance": name, "planning_cpu_s": None if math.isnan(cpu) else cpu, "plans": len(plans),
                     "kendall_tau": None if math.isnan(tau) else tau, "max_relative_error": err,
                     "estimates_s": est, "simulated_s": sims})
        if args.breakdown:
            breakdown(plans, cluster, model)
    save_json_atomic(Path(args.out), {"schema_version": 1, "format": "deepcee.bench.cost_model_tau", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
