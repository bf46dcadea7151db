"""The planner on random multi-region clusters against an independent search scored by the simulator.

Instances (seeded, :func:`wan_instance`): 4-8 regions picked from 16 public-cloud region
locations, each with 4-16 GPUs of one kind (8-24 GiB, datasheet-style figures, not
measurements) on servers of 1-8 GPUs; between regions a latency and a bandwidth drawn from
the great-circle distance like a real WAN (nearby regions fast, far ones slow): one-way
latency ``(distance / 100 km/ms + 2 ms) x U(0.9, 1.3)`` clipped to 5-250 ms, bandwidth per
server pair ``2 Gbit/s / (1 + distance / 2500 km) x U(0.8, 1.2)`` clipped to 0.3-2 Gbit/s.
A Llama-style decoder (fp16, Adam: 16 bytes of state per parameter) of 1-13B parameters
whose state alone exceeds every region's memory (so no region can train it alone) and is at
most :data:`STATE_FRACTION` of the summed memory, sequence
length 1024 or 2048, global batch 256-2048.

The reference (:mod:`wan_reference`, beside this script) shares no search code with the planner.
Its **global search** (version 3) screens island chains in the order of its own lower bound
(with uniform layouts and, where memory is tight, the most stages that fit), walks from the best
of them, lays the best chains out with any number of stages per region, splits layers by its
own DP (for 1F1B's and ZB-H2's microbatches in flight), simulates the pooled configurations best
first and the best few with every schedule and both syncs the planner searches, and, while its
budget lasts, widens (more layouts per chain, more configurations with every schedule), within
a budget of CPU seconds of its own process (``--budget-s``); it is *not* exhaustive over chains,
splits and devices per stage (none is affordable at these sizes). Its **polish** starts from deepcee's
own plan and takes, step by step, any neighbour in the plan space that simulates faster (another
schedule, microbatch size, stage count of one region, region order, a region left out or added,
one stage's recomputation, one boundary), within a count of simulations (the same on any
machine). The reference figure is the better of the two: a plan deepcee beats is a failure of
the reference (printed, never counted as a pass), and a plan the polish improves by more than
2% is a miss, printed with the steps that improved it. Baseline measured in the same run: the
reference itself.

Run: ``python benchmarks/planner_at_scale.py [--instances 100] [--jobs 2] [--quick]``; with
``--reference-from reports/planner_at_scale.json`` only the planner is re-run against the
reference plans of that earlier run (re-simulated). ``--save-reference`` writes the reference
results alone; ``benchmarks/references/`` keeps those of the runs ``docs/results.md`` quotes, so
``--reference-from benchmarks/references/wan100_v3_budget40.json --budget-s 40`` compares a
planner change with the same references on any machine.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.errors import DeepceeError, InfeasiblePlanError
from deepcee.models import get_model
from deepcee.plan import Plan, save_json_atomic
from deepcee.profile import ModelProfile
from deepcee.simulator.engine import simulate
from deepcee.simulator.runtime_model import runtime_for
from deepcee.units import GIB

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wan_reference import POLISH_SIMULATIONS, REFERENCE_VERSION, polish, reference_search  # noqa: E402  (beside this script)

REGIONS = (  # name, latitude, longitude (public cloud region locations)
    ("us-east", 38.9, -77.4), ("us-west", 45.6, -121.2), ("us-central", 41.3, -95.9), ("ca-central", 45.5, -73.6),
    ("sa-east", -23.5, -46.6), ("eu-west", 53.3, -6.3), ("eu-central", 50.1, 8.7), ("eu-north", 59.3, 18.1),
    ("uk-south", 51.5, -0.1), ("ap-northeast", 35.7, 139.7), ("ap-southeast", 1.35, 103.8), ("ap-south", 19.1, 72.9),
    ("au-east", -33.9, 151.2), ("me-central", 25.3, 55.3), ("af-south", -33.9, 18.4), ("ap-east", 22.3, 114.2))
KINDS = (  # name, peak fp16 TFLOP/s, memory GiB, achievable fraction (datasheet-style, for the benchmark)
    ("t4", 65.0, 16, 0.25), ("v100-16", 125.0, 16, 0.3), ("a10", 125.0, 24, 0.3), ("rtx3090", 71.0, 24, 0.35),
    ("l4", 121.0, 24, 0.3), ("rtx2080ti", 54.0, 11, 0.3), ("p100", 19.0, 16, 0.5), ("rtx3080", 60.0, 10, 0.35),
    ("a2", 36.0, 16, 0.3), ("rtx4060", 30.0, 8, 0.4))
SHAPES = ((2048, 16), (2560, 20), (3072, 26), (4096, 32), (5120, 40))
"""Llama hidden sizes (with the layer counts of published models near them)."""
STATE_FRACTION = 0.35
"""The model's state is at most this fraction of the cluster's summed memory. At 0.6, 7 of the
first 8 instances had no plan in either search once memory counted the runtime's buffers
(deepcee's runtime holds every receive and send buffer of a step from its start, ``2 x batch x
boundary bytes`` over a stage's devices), and an instance without a plan tests no search."""


# ----------------------------------------------------------------------------- instances


def _km(a: tuple, b: tuple) -> float:
    la1, lo1, la2, lo2 = map(math.radians, (a[1], a[2], b[1], b[2]))
    h = math.sin((la2 - la1) / 2) ** 2 + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2
    return 2 * 6371 * math.asin(math.sqrt(h))


def _regions(rng: random.Random) -> tuple[Cluster, list[float]]:
    regions = rng.sample(REGIONS, rng.randint(4, 8))
    kinds = {k[0]: DeviceKind(name=k[0], peak_flops_per_s=k[1] * 1e12, memory_bytes=k[2] * GIB,
                              achievable_fraction=k[3], source="datasheet-style figure for the benchmark")
             for k in KINDS}
    islands, nodes, devices, links, memory = [], [], [], [], []
    for name, *_ in regions:
        kind = rng.choice(KINDS)
        count = rng.randint(4, 16)
        width = rng.choice([w for w in (1, 2, 4, 8) if w <= count])
        islands.append(Island(name=name, intra=LinkSpec(latency_s=rng.uniform(0.1e-3, 0.5e-3),
                                                        bandwidth_bytes_per_s=rng.choice([10, 25, 100]) * 1.25e8)))
        left, k = count, 0
        while left:
            w = min(width, left)
            names = tuple(f"{name}-n{k}:{j}" for j in range(w))
            nodes.append(Node(name=f"{name}-n{k}", island=name, kind=kind[0], devices=names,
                              intra=LinkSpec(latency_s=10e-6, bandwidth_bytes_per_s=rng.choice([16, 32, 150]) * 1e9)))
            devices += [Device(name=d, kind=kind[0], node=f"{name}-n{k}", island=name) for d in names]
            left, k = left - w, k + 1
        memory.append(count * kind[2] * GIB)
    for a, b in itertools.combinations(range(len(regions)), 2):
        d = _km(regions[a], regions[b])
        lat = min(0.25, max(0.005, (d / 100.0 + 2) * 1e-3 * rng.uniform(0.9, 1.3)))
        gbit = min(2.0, max(0.3, 2.0 / (1 + d / 2500.0) * rng.uniform(0.8, 1.2)))
        links.append(LinkEntry(a=regions[a][0], b=regions[b][0],
                               spec=LinkSpec(latency_s=lat, bandwidth_bytes_per_s=gbit * 1.25e8)))
    cluster = Cluster(name="wan", kinds=kinds, islands=tuple(islands), nodes=tuple(nodes), devices=tuple(devices),
                      links=tuple(links), description="random multi-region cluster (benchmark)")
    return cluster, memory


def wan_instance(seed: int) -> tuple[Cluster, ModelProfile, int]:
    """A seeded instance (see the module docstring): (cluster, model, global batch)."""
    rng = random.Random(seed)
    while True:
        cluster, memory = _regions(rng)
        lo, hi = max(1.0e9, 1.05 * max(memory) / 16), min(13e9, STATE_FRACTION * sum(memory) / 16)
        if lo > hi:
            continue
        target = math.exp(rng.uniform(math.log(lo), math.log(hi)))
        h, _ = min(SHAPES, key=lambda x: abs(math.log(12 * x[0] ** 2 * x[1] / target)))
        layers = max(8, round(target / (12.3 * h * h)))
        model = get_model("llama", hidden_size=h, num_layers=layers, num_heads=h // 128, num_kv_heads=h // 128,
                          ffn_size=int(h * 8 / 3) // 256 * 256, seq_len=rng.choice([1024, 2048]))
        if model.parameter_count * model.state_bytes_per_parameter > max(memory):
            cluster = Cluster(name=f"wan-{seed}", kinds=cluster.kinds, islands=cluster.islands, nodes=cluster.nodes,
                              devices=cluster.devices, links=cluster.links, description=cluster.description)
            return cluster, model, rng.choice([256, 512, 1024, 2048])


# ----------------------------------------------------------------------------- the comparison


def kendall_tau(result, cluster: Cluster, model: ModelProfile, top: int = 20) -> float | None:
    """Kendall tau between the cost model's and the simulator's iteration times over the ``top``
    best plans the cost model scored (issue 10: >= 0.9)."""
    plans = [c for c in result.scored[:top]]
    if len(plans) < 3:
        return None
    sims = [simulate(c.plan, cluster, model, record=False).iteration_s for c in plans]
    return kendall_tau_of([c.estimate.iteration_s for c in plans], sims)


def kendall_tau_of(estimates_s, simulated_s) -> float | None:
    """Kendall tau of two lists of iteration times (``None`` where undefined)."""
    from scipy.stats import kendalltau

    tau = kendalltau(estimates_s, simulated_s).statistic
    return None if math.isnan(tau) else float(tau)


def _cached_reference(entry: dict, cluster: Cluster, model: ModelProfile) -> dict:
    """An earlier run's reference result for the same instance and budget (the reference shares
    no code with the planner, so a planner change does not change it), its plan re-simulated so a
    simulator change shows."""
    from deepcee.planfile import plan_from_dict

    plan = None if entry.get("reference_plan") is None else plan_from_dict(entry["reference_plan"])
    return {"plan": plan, "iteration_s": simulate(plan, cluster, model, record=False).iteration_s if plan else math.inf,
            "chains": entry["reference_chains"], "simulated": entry["reference_simulated"],
            "exhausted": entry["reference_exhausted"], "seconds": entry["reference_seconds"],
            "cpu_s": entry.get("reference_cpu_s"), "cached": True,
            "later_configurations": entry.get("reference_later"), "later_left": entry.get("reference_later_left"),
            "screened": entry.get("reference_screened"), "walk_steps": entry.get("reference_walk_steps"),
            "widening_rounds": entry.get("reference_widening_rounds")}


REFERENCE_FIELDS = (
    "seed", "global_reference_s", "reference_budget_cpu_s", "reference_version", "reference_plan", "reference_chains",
    "reference_simulated", "reference_exhausted", "reference_seconds", "reference_cpu_s", "reference_later",
    "reference_later_left", "reference_screened", "reference_walk_steps", "reference_widening_rounds")
"""What :func:`_cached_reference` and ``--reference-from`` read of a row, and the global search's
figure when it ran (``global_reference_s``: its plan re-simulates to it while the simulator is
unchanged)."""


def reference_only(rows: list[dict]) -> dict:
    """The reference results of ``rows`` alone, as ``--reference-from`` reads them: a global
    search of 40 CPU s per instance is an hour and more of the 100 instances' run, and a planner
    change does not change it. The figures are re-simulated when read, so a simulator change shows."""
    return {"schema_version": 1, "format": "deepcee.bench.planner_at_scale.reference",
            "instances": [{k: r.get(k) for k in REFERENCE_FIELDS} for r in rows]}


SCENARIO_CASES = (
    "cee-testbed/gpt2/64", "cee-testbed/resnet50/64", "cee-testbed/resnet101/128", "cee-testbed/bert-small/128",
    "cee-testbed/efficientnet-b0/32", "cee-testbed/gpt2-xl/128", "cee-testbed/llama-7b/128",
    "cee-testbed-500m/gpt2/64", "cee-testbed-500m/resnet50/128",
    "scale-2/gpt2/64", "scale-4/bert-small/64", "scale-8/gpt2-medium/128", "scale-12/resnet50/256",
    "scale-16/gpt2/256", "scale-16/gpt2-xl/256")
"""``--scenarios``: the DeepCEE testbed and its scalability series (built-in scenarios), each
``scenario/model/global batch``: the golden record's cases of those clusters, and models that
must span nodes."""


def instance(key: int | str) -> tuple[Cluster, ModelProfile, int]:
    """A seeded WAN instance (an int) or a built-in scenario case ``scenario/model/batch``."""
    if isinstance(key, int):
        return wan_instance(key)
    from deepcee.scenarios import load_scenario

    scenario, model, batch = key.split("/")
    return load_scenario(scenario), get_model(model), int(batch)


def run_instance(seed: int | str, budget_s: float = 120.0, tau: bool = False, cached: dict | None = None,
                 polish_simulations: int = POLISH_SIMULATIONS) -> dict:
    from deepcee.planner.search import plan_training

    cluster, model, batch = instance(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    tau_value = None
    try:
        result = plan_training(cluster, model, batch)
        planned = result.plan
        plan_time, plan_cpu = time.perf_counter() - t0, time.process_time() - c0
        planner_s = simulate(planned, cluster, model, record=False).iteration_s
        gap_note = next((x for x in result.explanation if x.startswith("island chains")), "")
        layout_polish_steps = result.polish_steps
        tau_value = kendall_tau(result, cluster, model) if tau else None
    except InfeasiblePlanError:
        planned, planner_s, gap_note, layout_polish_steps = None, None, "", 0
        plan_time, plan_cpu = time.perf_counter() - t0, time.process_time() - c0
    ref = (_cached_reference(cached, cluster, model) if cached is not None
           else reference_search(cluster, model, batch, budget_s=budget_s))
    global_s = ref["iteration_s"] if ref["plan"] is not None else None
    pol = polish(planned, cluster, model, simulations=polish_simulations) if planned and polish_simulations else None
    polished_s = pol["iteration_s"] if pol is not None and math.isfinite(pol["iteration_s"]) else None
    ref_s = min((x for x in (global_s, polished_s) if x is not None), default=None)
    gap = None if planner_s is None or ref_s is None else planner_s / ref_s - 1.0
    best = ref["plan"] if ref_s is not None and ref_s == global_s else (pol["plan"] if pol else None)
    return {
        "seed": seed, "devices": len(cluster.devices), "regions": len(cluster.islands),
        "params_b": model.parameter_count / 1e9, "layers": model.num_layers, "seq_len": model.hyper.get("seq_len"),
        "global_batch": batch, "planner_s": planner_s, "reference_s": ref_s, "gap": gap,
        "global_reference_s": global_s, "global_gap": None if planner_s is None or global_s is None
        else planner_s / global_s - 1.0,
        "polished_s": polished_s, "polish_moves": pol["moves"] if pol else [],
        "polish_simulated": pol["simulated"] if pol else 0, "polish_local_optimum": pol["local_optimum"] if pol else None,
        "polish_cpu_s": pol["cpu_s"] if pol else 0.0, "polish_simulations": polish_simulations,
        "polished_plan": pol["plan"].to_dict() if pol and pol["moves"] else None,
        "planner_devices": len(planned.devices) if planned else None,
        "planner_regions": len({cluster.device(d).island for d in planned.devices}) if planned else None,
        "reference_regions": (len({cluster.device(d).island for d in ref["plan"].devices})
                              if ref["plan"] is not None else None),
        "planner_stages": planned.num_stages if planned else None, "planning_s": plan_time,
        "planner_shape": _shape(planned, cluster), "reference_shape": _shape(ref["plan"], cluster),
        "best_reference_shape": _shape(best, cluster),
        "runtime": runtime_for(cluster, model).name,
        "planning_cpu_s": plan_cpu, "kendall_tau_top20": tau_value, "layout_polish_steps": layout_polish_steps,
        "reference_seconds": ref["seconds"], "reference_cpu_s": ref["cpu_s"], "reference_budget_cpu_s": budget_s,
        "reference_cached": bool(ref.get("cached")),
        "reference_plan": ref["plan"].to_dict() if ref["plan"] is not None else None,
        "reference_version": REFERENCE_VERSION, "reference_screened": ref.get("screened"),
        "reference_walk_steps": ref.get("walk_steps"),
        "reference_chains": ref["chains"], "reference_later": ref.get("later_configurations"),
        "reference_later_left": ref.get("later_left"), "reference_widening_rounds": ref.get("widening_rounds"),
        "reference_simulated": ref["simulated"], "reference_exhausted": ref["exhausted"], "chain_search": gap_note,
    }


def _shape(plan: Plan | None, cluster: Cluster) -> str | None:
    """A plan in one line: stages, devices, regions, schedule, microbatch size (to read a miss)."""
    if plan is None:
        return None
    regions = len({cluster.device(d).island for d in plan.devices})
    recomputes = sum(st.recompute for st in plan.stages)
    return (f"{plan.num_stages} stages on {len(plan.devices)} devices in {regions} regions, {plan.schedule}, "
            f"{plan.num_microbatches} x {plan.microbatch_size}" + (f", {recomputes} recomputing" if recomputes else ""))


def _moves(r: dict) -> str:
    return "; ".join(f"{label} ({t:.4g} s)" for label, t in r.get("polish_moves") or [])


def _note(r: dict) -> str:
    """Why an instance is not a plain pass (printed beside it)."""
    out = []
    if r["gap"] is not None and r["gap"] > 0.02:
        if r["polished_s"] is not None and r["reference_s"] == r["polished_s"]:
            out.append(f"MISS: deepcee {100 * r['gap']:+.2f}%: the polish improved deepcee's {r['planner_shape']} by "
                       f"{_moves(r)} to {r['best_reference_shape']}")
        else:
            ref = "searched every chain under its bound" if r["reference_exhausted"] else "stopped by its budget"
            out.append(f"MISS: deepcee {100 * r['gap']:+.2f}%: deepcee {r['planner_shape']}; global reference ({ref}, "
                       f"{r['reference_chains']} chains, {r.get('reference_later')} later configurations simulated, "
                       f"{r.get('reference_later_left')} left) {r['reference_shape']}")
    elif r["polish_moves"]:
        out.append(f"polish {100 * r['gap']:+.2f}%: {_moves(r)}")
    if r.get("global_gap") is not None and r["global_gap"] < -0.005:
        out.append(f"global reference failure: deepcee {-100 * r['global_gap']:.2f}% faster "
                   f"({'' if r['reference_exhausted'] else 'stopped by its budget; '}reference {r['reference_shape']})")
    if (r["planner_s"] is None) != (r["global_reference_s"] is None):
        out.append("feasibility differs: " + ("only deepcee found a plan" if r["global_reference_s"] is None
                                              else "only the global reference found a plan"))
    if r["planner_s"] is None and r["global_reference_s"] is None:
        out.append("no plan in either search")
    return "; ".join(out)


def _summary(rows: list[dict], t0: float) -> dict:
    """The run's summary over ``rows`` (so far)."""
    both = [r for r in rows if r["gap"] is not None]
    return {
        "instances": len(rows), "comparable": len(both),
        "within_2pct": sum(1 for r in both if r["gap"] <= 0.02),
        "global_reference_failures": [r["seed"] for r in rows
                                      if r["global_gap"] is not None and r["global_gap"] < -0.005],
        "polish_improved": [r["seed"] for r in rows if r["polish_moves"]],
        "layout_polish_moved": [r["seed"] for r in rows if r.get("layout_polish_steps")],
        "misses": [r["seed"] for r in both if r["gap"] > 0.02],
        "worst_gap": max((r["gap"] for r in both), default=None),
        "median_planning_s": float(np.median([r["planning_s"] for r in rows])) if rows else None,
        "median_planning_cpu_s": float(np.median([r["planning_cpu_s"] for r in rows])) if rows else None,
        "kendall_tau_top20": [r["kendall_tau_top20"] for r in rows if r["kendall_tau_top20"] is not None],
        "max_planning_s": max((r["planning_s"] for r in rows), default=None),
        "max_planning_cpu_s": max((r["planning_cpu_s"] for r in rows), default=None),
        "no_plan_in_either": [r["seed"] for r in rows if r["planner_s"] is None and r["global_reference_s"] is None],
        "feasibility_differs": [r["seed"] for r in rows
                                if (r["planner_s"] is None) != (r["global_reference_s"] is None)],
        "total_s": time.perf_counter() - t0,
    }


def check_writable(ap: argparse.ArgumentParser, flag: str, path: str) -> None:
    """Exit with a one-line usage error unless a file can be written at ``path`` (its folder made):
    checked before a long run, not after it."""
    target = Path(path)
    try:
        if target.is_dir():
            raise IsADirectoryError("a folder")
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        ap.error(f"{flag}: cannot write {path!r} ({err})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=100)
    ap.add_argument("--first", type=int, default=0, help="first seed (to run the instances in chunks)")
    ap.add_argument("--tau-every", type=int, default=5,
                    help="measure Kendall tau (cost model vs simulator, top 20) on every k-th instance (0: never)")
    ap.add_argument("--jobs", type=int, default=2, help="processes (at most 2 on the project machine)")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="reference search CPU seconds per instance (three times this while it has no plan)")
    ap.add_argument("--reference-from", default=None, metavar="JSON",
                    help="reuse the reference results of an earlier run's JSON (same seeds and --budget-s; "
                         "re-simulated) and re-run only the planner")
    ap.add_argument("--scenarios", nargs="?", const=",".join(SCENARIO_CASES), default=None, metavar="CASES",
                    help="instead of seeds: built-in scenario cases scenario/model/batch, comma-separated "
                         "(alone: the testbed and its scalability series)")
    ap.add_argument("--seeds", default=None, metavar="LIST",
                    help="only these seeds, comma-separated (instead of --first/--instances; e.g. the instances "
                         "whose plan changed, with --reference-from)")
    ap.add_argument("--polish-simulations", type=int, default=POLISH_SIMULATIONS,
                    help="simulations of the polish from deepcee's plan per instance (0: no polish)")
    ap.add_argument("--quick", action="store_true", help="10 instances, 20 s of reference search each")
    ap.add_argument("--out", default="reports/planner_at_scale.json")
    ap.add_argument("--save-reference", default=None, metavar="JSON",
                    help="also write the reference results alone (what --reference-from reads), e.g. to keep "
                         "them in benchmarks/references/")
    args = ap.parse_args(argv)
    count, budget = (10, 20.0) if args.quick else (args.instances, args.budget_s)
    if not (math.isfinite(budget) and budget > 0) or count < 1 or args.polish_simulations < 0:
        ap.error(f"--budget-s must be a positive number, --instances at least 1 and --polish-simulations at least "
                 f"0, got {budget!r}, {count!r} and {args.polish_simulations!r}")
    if args.save_reference is not None:  # checked now, not after an hour of reference search
        check_writable(ap, "--save-reference", args.save_reference)
    if args.seeds is not None and args.scenarios:
        ap.error("--seeds and --scenarios: give one of them")
    if args.seeds is not None:
        try:
            listed = [int(x) for x in args.seeds.split(",")]
        except ValueError:
            ap.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
        if not listed or min(listed) < 0:
            ap.error(f"--seeds: expected seeds >= 0, got {args.seeds!r}")
    seeds = (args.scenarios.split(",") if args.scenarios else listed if args.seeds is not None
             else range(args.first, args.first + count))
    for case in seeds if args.scenarios else ():
        try:
            instance(case)
        except (ValueError, DeepceeError) as err:
            ap.error(f"--scenarios: {case!r} is not scenario/model/batch of built-in names ({err})")
    earlier: dict[int, dict] = {}
    if args.reference_from:
        import json

        try:
            rows_before = json.loads(Path(args.reference_from).read_text()).get("instances", [])
        except (OSError, ValueError, AttributeError) as err:
            ap.error(f"--reference-from: cannot read {args.reference_from!r} as an earlier run's JSON ({err})")
        for r in rows_before:
            # a reference of another version of the global search is searched anew (a JSON
            # without the field is version 1's)
            if (r.get("reference_budget_cpu_s") == budget and "reference_plan" in r
                    and r.get("reference_version", 1) == REFERENCE_VERSION):
                earlier[r["seed"]] = r
        missing = [s for s in seeds if s not in earlier]
        if missing:
            print(f"{args.reference_from}: no version-{REFERENCE_VERSION} reference at --budget-s {budget:g} for seeds "
                  f"{missing}; searched anew")
    t0 = time.perf_counter()
    print(f"{'seed':>5}{'dev':>5}{'reg':>4}{'params':>7}{'batch':>6}{'planner s':>11}{'ref s':>11}{'gap %':>8}"
          f"{'plan t':>8}{'cpu t':>7}{'ref cpu':>8}{'regions p/r':>12}{'tau':>6}  note")
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, min(2, args.jobs))) as pool:
        taus = [args.tau_every > 0 and isinstance(s, int) and s % args.tau_every == 0 for s in seeds]
        for r in pool.map(run_instance, seeds, itertools.repeat(budget), taus, [earlier.get(s) for s in seeds],
                          itertools.repeat(args.polish_simulations)):
            rows.append(r)
            fmt = lambda v, f: f"{'-':>{f.split('.')[0]}}" if v is None else format(v, f)  # noqa: E731
            note = _note(r)
            print(f"{str(r['seed']):>5}{r['devices']:>5}{r['regions']:>4}{r['params_b']:>6.1f}B{r['global_batch']:>6}"
                  f"{fmt(r['planner_s'], '11.4g')}{fmt(r['reference_s'], '11.4g')}"
                  f"{fmt(None if r['gap'] is None else 100 * r['gap'], '8.2f')}{r['planning_s']:>8.1f}"
                  f"{r['planning_cpu_s']:>7.1f}{'cached' if r['reference_cached'] else format(r['reference_cpu_s'], '.0f'):>8}"
                  f"{str(r['planner_regions']) + '/' + str(r['reference_regions']):>12}"
                  f"{fmt(r['kendall_tau_top20'], '6.2f')}"
                  f"  {note}", flush=True)
            # written after every instance, marked partial, so a cut-off run keeps what it measured
            save_json_atomic(Path(args.out), {"schema_version": 1, "format": "deepcee.bench.planner_at_scale",
                                              "partial": True, "summary": _summary(rows, t0), "instances": rows})
    summary = _summary(rows, t0)
    print(f"\n{summary['within_2pct']} of {summary['comparable']} comparable instances within 2% of the reference; misses: "
          f"{summary['misses'] or 'none'}; polish improved deepcee's plan on {len(summary['polish_improved'])}; "
          f"global reference failures (deepcee better): {len(summary['global_reference_failures'])}; "
          f"no plan in either: {len(summary['no_plan_in_either'])}; feasibility differs: "
          f"{summary['feasibility_differs'] or 'none'}; median planning {summary['median_planning_s']:.1f} s "
          f"(CPU {summary['median_planning_cpu_s']:.1f} s), max {summary['max_planning_s']:.1f} s "
          f"(CPU {summary['max_planning_cpu_s']:.1f} s); "
          f"total {summary['total_s']:.0f} s")
    save_json_atomic(Path(args.out), {"schema_version": 1, "format": "deepcee.bench.planner_at_scale",
                                      "partial": False, "summary": summary, "instances": rows})
    print(f"wrote {args.out}")
    if args.save_reference is not None:
        save_json_atomic(Path(args.save_reference), reference_only(rows))
        print(f"wrote {args.save_reference}")
    return 0 if not summary["misses"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
