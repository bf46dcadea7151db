"""How close is the planner to the best plan of its own plan space? Brute force on small cases.

For seeded random instances (at most 8 devices in up to 3 islands, at most 12 layers, random
speeds, memories, links and layer costs) this compares :func:`plan_training` with an
exhaustive search over the *same plan space* (see [Note: plan space] in
:mod:`deepcee.planner.space`): every island subset in every order, every prefix of groups,
every layout, every microbatch size, every contiguous layer split, every schedule (compact
built as the planner builds it) and sync, with shares proportional to speed. Both are scored
by the same final scorer, one simulated iteration (:func:`deepcee.simulator.engine.simulate`).

The exhaustive search is exact but does not simulate every plan: it computes, for every plan,
a lower bound on its simulated time that follows from the simulator's rules (each device runs
its actions in order; a stage's all-reduce and optimizer step follow its last action; a
microbatch's forward and backward pass every stage in turn; a link resource serialises its
transfers one after another), and simulates plans in increasing order of that bound until
the bound reaches the best simulated time found. No unsimulated plan can beat that.

Baseline measured in the same run: the brute-force optimum itself (the table shows the gap
of the planner to it, and the time each took).

Run: ``python benchmarks/planner_optimality.py [--instances 200] [--out reports/planner_optimality.json]``
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.comm import allreduce_s
from deepcee.errors import InfeasiblePlanError
from deepcee.plan import Plan, save_json_atomic, share_overlaps
from deepcee.planner.cost_model import (
    AnalyticCostModel,
    RangeTables,
    largest_remainder_shares,
    range_time_s,
)
from deepcee.planner.grouping import group_devices
from deepcee.planner.search import (
    PlannerOptions,
    StageLayout,
    build_plan,
    chain_layouts,
    compact_plan,
    enumerate_chains,
    fed_grains,
    in_flight_counts,
    island_distances,
    microbatch_sizes,
    plan_training,
)
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.simulator.engine import optimizer_step_s, simulate
from deepcee.units import GIB

SYNCS = ("allreduce-ring", "allreduce-hier")


# ----------------------------------------------------------------------------- instances


def random_instance(seed: int, *, max_devices: int = 8, max_layers: int = 12) -> tuple[Cluster, ModelProfile, int]:
    """A seeded random cluster (<= ``max_devices`` in <= 3 islands), model and global batch."""
    rng = random.Random(seed)
    n_dev = rng.randint(2, max_devices)
    n_isl = rng.randint(1, min(3, n_dev))
    counts = [1] * n_isl
    for _ in range(n_dev - n_isl):
        counts[rng.randrange(n_isl)] += 1
    kinds = {
        "fast": DeviceKind(name="fast", peak_flops_per_s=40e12, memory_bytes=rng.choice([8, 16, 24]) * GIB,
                           achievable_fraction=0.5, per_layer_overhead_s=2e-5),
        "slow": DeviceKind(name="slow", peak_flops_per_s=12e12, memory_bytes=rng.choice([4, 8, 16]) * GIB,
                           achievable_fraction=0.5, per_layer_overhead_s=3e-5),
    }
    islands, nodes, devices = [], [], []
    for i, count in enumerate(counts):
        islands.append(Island(name=f"i{i}", intra=LinkSpec(latency_s=1e-4, bandwidth_bytes_per_s=1.25e9)))
        k = 0
        while count > 0:
            width = min(count, rng.choice([1, 2, 2]))
            kind = rng.choice(["fast", "fast", "slow"])
            names = tuple(f"i{i}n{k}:{j}" for j in range(width))
            nodes.append(Node(name=f"i{i}n{k}", island=f"i{i}", kind=kind, devices=names,
                              intra=LinkSpec(latency_s=1e-5, bandwidth_bytes_per_s=12.5e9)))
            devices += [Device(name=d, kind=kind, node=f"i{i}n{k}", island=f"i{i}",
                               slowdown=rng.choice([1.0, 1.0, 1.25, 2.0])) for d in names]
            count, k = count - width, k + 1
    links = tuple(LinkEntry(a=f"i{a}", b=f"i{b}", spec=LinkSpec(
        latency_s=rng.uniform(3e-3, 40e-3), bandwidth_bytes_per_s=rng.choice([10, 50, 100, 500, 1000]) * 1e6 / 8))
        for a, b in itertools.combinations(range(n_isl), 2))
    cluster = Cluster(name=f"random-{seed}", kinds=kinds, islands=tuple(islands), nodes=tuple(nodes),
                      devices=tuple(devices), links=links)
    layers = []
    for k in range(rng.randint(2, max_layers)):
        f = rng.uniform(0.5e9, 20e9)
        layers.append(LayerProfile(name=f"l{k}", forward_flops=f, input_grad_flops=f * rng.uniform(0.8, 1.2),
                                   weight_grad_flops=f * rng.uniform(0.6, 1.2),
                                   parameter_count=rng.randint(1, 60) * 1_000_000,
                                   activation_bytes=rng.uniform(2e6, 60e6), output_bytes=rng.uniform(0.1e6, 4e6)))
    model = ModelProfile(name=f"random-{seed}", layers=tuple(layers), input_bytes=rng.uniform(0.1e6, 1e6))
    return cluster, model, rng.choice([4, 6, 8, 12, 16])


# ----------------------------------------------------------------------------- brute force


@dataclass(frozen=True, slots=True, kw_only=True)
class BruteResult:
    plan: Plan | None
    iteration_s: float
    plans: int
    """Plans in the space that fit memory (each schedule and sync counted)."""
    simulated: int
    seconds: float


class _Tables:
    """What the lower-bound terms of one brute-force run share: exact range matrices per device
    profile, optimizer and all-reduce matrices, memory terms (built once, not per layout)."""

    def __init__(self, cluster: Cluster, model: ModelProfile) -> None:
        self.cluster, self.model = cluster, model
        n = model.num_layers
        params = np.concatenate([[0.0], np.cumsum([la.parameter_count for la in model.layers])])
        acts = np.concatenate([[0.0], np.cumsum([la.activation_bytes for la in model.layers])])
        bnd = np.array([model.boundary_bytes(b) for b in range(n + 1)])
        self.state = (params[None, :] - params[:, None]) * model.state_bytes_per_parameter
        self.acts = acts[None, :] - acts[:, None]
        self.buf = bnd[:, None] + bnd[None, :]
        self._times: dict[tuple, tuple[np.ndarray, ...]] = {}
        self._opt: dict[tuple, np.ndarray] = {}
        self._allreduce: dict[tuple, np.ndarray] = {}
        self._terms: dict[tuple, _Terms] = {}

    def times(self, device: str, share: int) -> tuple[np.ndarray, ...]:
        """``F``, ``I``, ``W`` of every range on ``device`` with ``share`` samples."""
        kind, slow = self.cluster.kind_of(device), self.cluster.device(device).slowdown
        key = (kind.name, slow, share)
        if key not in self._times:
            self._times[key] = tuple(range_time_s(self.model, kind, p, share, slow) for p in "FIW")
        return self._times[key]

    def optimizer(self, device: str) -> np.ndarray:
        kind, slow = self.cluster.kind_of(device), self.cluster.device(device).slowdown
        key = (kind.name, slow)
        if key not in self._opt:
            n = self.model.num_layers
            self._opt[key] = np.array([[optimizer_step_s(self.model, a, b, kind, slow) if a < b else 0.0
                                        for b in range(n + 1)] for a in range(n + 1)])
        return self._opt[key]

    def allreduce(self, devices: tuple[str, ...], syncs: tuple[str, ...]) -> np.ndarray:
        key = (devices, syncs)
        if key not in self._allreduce:
            n, m = self.model.num_layers, self.model
            self._allreduce[key] = np.array([[min(allreduce_s(self.cluster, devices, m.gradient_bytes(a, b), s)
                                                  for s in syncs) if a < b else 0.0 for b in range(n + 1)]
                                             for a in range(n + 1)])
        return self._allreduce[key]

    def terms(self, devices: tuple[str, ...], shares: tuple[int, ...], m: int, syncs: tuple[str, ...]) -> _Terms:
        key = (devices, shares, m, syncs)
        if key not in self._terms:
            self._terms[key] = _Terms(self, devices, shares, m, syncs)
        return self._terms[key]


class _Terms:
    """Per stage and layer range ``[a, b)``: the terms of the lower bound (numpy matrices).

    ``B`` is taken as ``I + W``, which holds for the analytic instances generated here (a
    measured profile's fused backward is cheaper and would need its own term)."""

    def __init__(self, tables: _Tables, devices: tuple[str, ...], shares: tuple[int, ...], m: int,
                 syncs: tuple[str, ...]) -> None:
        per = [tables.times(d, share) for d, share in zip(devices, shares, strict=True)]
        f, i, w = (np.array([x[k] for x in per]) for k in range(3))
        self.f_min, self.i_min, self.w_min = f.min(axis=0), i.min(axis=0), w.min(axis=0)
        self.busy = m * (f + i + w).max(axis=0)
        self.opt = np.max([tables.optimizer(d) for d in devices], axis=0)
        self.allreduce = tables.allreduce(devices, syncs)
        self._tables = tables
        self._mem = [(share, tables.cluster.memory_bytes(d)) for d, share in zip(devices, shares, strict=True)]

    def fits(self, in_flight: int) -> np.ndarray:
        """Per range: every device's memory need (:mod:`deepcee.simulator.memory`) within its memory."""
        t = self._tables
        ok = np.ones_like(t.state, dtype=bool)
        for share, cap in self._mem:
            ok &= t.state + in_flight * share * t.acts + share * t.buf <= cap
        return ok


class _Link:
    """Per boundary layer: the fastest single piece (latency + its bytes) and each resource's load."""

    def __init__(self, cluster: Cluster, model: ModelProfile, src: tuple[str, ...], src_shares: tuple[int, ...],
                 dst: tuple[str, ...], dst_shares: tuple[int, ...]) -> None:
        bnd = np.array([model.boundary_bytes(b) for b in range(model.num_layers + 1)])
        self.piece, self.load, self.lat = [], [], []
        for direction in range(2):
            piece = np.full_like(bnd, np.inf)
            per: dict[str, list[float]] = {}
            for i, j, lo, hi in share_overlaps(src_shares, dst_shares):
                a, b = (src[i], dst[j]) if direction == 0 else (dst[j], src[i])
                link = cluster.link(a, b)
                piece = np.minimum(piece, link.latency_s + (hi - lo) * bnd / link.bandwidth_bytes_per_s)
                r = per.setdefault(link.resource, [0.0, link.latency_s])
                r[0] += (hi - lo) / link.bandwidth_bytes_per_s
                r[1] = min(r[1], link.latency_s)
            self.piece.append(piece)
            # per boundary layer: the busiest resource's serialisation of one microbatch; the least latency
            self.load.append(np.max([x[0] * bnd for x in per.values()], axis=0))
            self.lat.append(min(x[1] for x in per.values()))


def _lower_bounds(terms: list[_Terms], links: list[_Link], splits: np.ndarray, m: int) -> np.ndarray:
    """Lower bound on the simulated iteration time of every split (rows of ``splits``)."""
    s_count = len(terms)
    a, b = splits[:, :-1], splits[:, 1:]
    get = lambda mat, s: mat[a[:, s], b[:, s]]  # noqa: E731
    f = [get(t.f_min, s) for s, t in enumerate(terms)]
    i = [get(t.i_min, s) for s, t in enumerate(terms)]
    w = [get(t.w_min, s) for s, t in enumerate(terms)]
    tail = [get(t.allreduce, s) + get(t.opt, s) for s, t in enumerate(terms)]
    fwd = [links[k].piece[0][a[:, k + 1]] for k in range(s_count - 1)]
    bwd = [links[k].piece[1][a[:, k + 1]] for k in range(s_count - 1)]
    head = [np.zeros(len(splits))]
    for s in range(1, s_count):
        head.append(head[-1] + f[s - 1] + fwd[s - 1])
    bound = np.zeros(len(splits))
    for s, t in enumerate(terms):
        bound = np.maximum(bound, head[s] + get(t.busy, s) + tail[s])
        down = sum((f[k] + fwd[k - 1] for k in range(s + 1, s_count)), np.zeros(len(splits)))
        back = sum((i[k] for k in range(s, s_count)), np.zeros(len(splits)))
        back = back + sum((bwd[k] for k in range(s, s_count - 1)), np.zeros(len(splits)))
        bound = np.maximum(bound, head[s] + m * f[s] + down + back + w[s] + tail[s])
    for k in range(s_count - 1):
        layer = a[:, k + 1]
        bound = np.maximum(bound, head[k] + f[k] + m * links[k].load[0][layer] + links[k].lat[0])
        bound = np.maximum(bound, head[k + 1] + f[k + 1] + i[k + 1] + m * links[k].load[1][layer] + links[k].lat[1])
    return bound


def _space(cluster: Cluster, model: ModelProfile, options: PlannerOptions, global_batch: int) -> list[StageLayout]:
    grouping = group_devices(cluster, island_threshold_s=options.island_threshold_s, speed_ratio=options.speed_ratio)
    dist = island_distances(cluster, grouping)
    max_stages = min(model.num_layers, options.max_stages or model.num_layers)
    out: dict[tuple, StageLayout] = {}
    for chain in enumerate_chains(grouping, dist, options):
        # the planner's granularities for this batch too ([Note: fed granularities] in deepcee.planner.space)
        for lay in chain_layouts(grouping, chain, max_stages, extra=fed_grains(microbatch_sizes(global_batch, options))):
            out.setdefault(lay.slots, lay)
    return list(out.values())


def brute_force(cluster: Cluster, model: ModelProfile, global_batch: int,
                options: PlannerOptions | None = None) -> BruteResult:
    """The plan of the plan space with the least simulated iteration time (see the module docstring)."""
    t0 = time.perf_counter()
    options = options or PlannerOptions()
    n_layers = model.num_layers
    tables = RangeTables(cluster, model, options.syncs)
    cache = _Tables(cluster, model)
    speed = {d: cluster.effective_flops_per_s(d) for d in cluster.device_names}
    entries: list[tuple[StageLayout, int, np.ndarray, list[list[tuple[str, str]]]]] = []
    bounds: list[np.ndarray] = []
    plans = 0
    for lay in _space(cluster, model, options, global_batch):
        stages = len(lay.slots)
        if stages > n_layers:
            continue
        splits = np.array([(0, *c, n_layers) for c in itertools.combinations(range(1, n_layers), stages - 1)])
        spans = any(len({cluster.device(d).node for d in s}) > 1 for s in lay.slots)
        syncs = options.syncs if spans else options.syncs[:1]
        for n in microbatch_sizes(global_batch, options):
            if n < max(len(s) for s in lay.slots):
                continue
            m = global_batch // n
            shares = [largest_remainder_shares(s, [speed[d] for d in s], n) for s in lay.slots]
            terms = [cache.terms(s, sh, m, syncs) for s, sh in zip(lay.slots, shares, strict=True)]
            links = [_Link(cluster, model, lay.slots[k], shares[k], lay.slots[k + 1], shares[k + 1])
                     for k in range(stages - 1)]
            choices: list[list[tuple[str, str]]] = [[] for _ in splits]
            for sched in options.schedules:
                in_flight = in_flight_counts(sched, stages, m)
                ok = np.ones(len(splits), dtype=bool)
                for s, t in enumerate(terms):
                    ok &= t.fits(in_flight[s])[splits[:, s], splits[:, s + 1]]
                if sched == "compact" and stages < 2:
                    ok[:] = False  # the planner builds compact only for pipelines
                for k in np.flatnonzero(ok):
                    choices[k] += [(sched, y) for y in syncs]
            keep = [k for k in range(len(splits)) if choices[k]]
            if not keep:
                continue
            plans += sum(len(choices[k]) for k in keep)
            entries.append((lay, n, splits[keep], [choices[k] for k in keep]))
            bounds.append(_lower_bounds(terms, links, splits[keep], m))
    flat = [(float(bd), e, r) for e, bb in enumerate(bounds) for r, bd in enumerate(bb)]
    flat.sort(key=lambda x: (x[0], x[1], x[2]))
    best: tuple[float, Plan | None] = (math.inf, None)
    simulated = 0
    for bound, e, r in flat:
        if bound >= best[0]:
            break
        lay, n, splits, choices = entries[e]
        for sched, sync in choices[r]:
            plan = build_plan(lay, tuple(int(x) for x in splits[r]), cluster=cluster, model=model,
                              global_batch=global_batch, microbatch_size=n,
                              schedule="zb-h1" if sched == "compact" else sched, sync=sync)
            if sched == "compact":
                plan = compact_plan(plan, cluster, model, AnalyticCostModel().breakdown(plan, cluster, model), tables)
                if plan is None:
                    continue
            sim = simulate(plan, cluster, model, record=False)
            simulated += 1
            if any(v > cluster.memory_bytes(d) for d, v in sim.peak_memory_bytes.items()):
                continue
            assert sim.iteration_s >= bound * (1 - 1e-9), (sim.iteration_s, bound, plan)  # the bound is valid
            if sim.iteration_s < best[0]:
                best = (sim.iteration_s, plan)
    return BruteResult(plan=best[1], iteration_s=best[0], plans=plans, simulated=simulated,
                       seconds=time.perf_counter() - t0)


# ----------------------------------------------------------------------------- the comparison


def run_instance(seed: int, *, max_devices: int = 8, max_layers: int = 12) -> dict:
    cluster, model, batch = random_instance(seed, max_devices=max_devices, max_layers=max_layers)
    t0 = time.perf_counter()
    try:
        planned = plan_training(cluster, model, batch).plan
        planner_s: float | None = simulate(planned, cluster, model, record=False).iteration_s
    except InfeasiblePlanError:
        planned, planner_s = None, None
    plan_time = time.perf_counter() - t0
    brute = brute_force(cluster, model, batch)
    brute_s = brute.iteration_s if brute.plan is not None else None
    gap = None if planner_s is None or brute_s is None else planner_s / brute_s - 1.0
    return {
        "seed": seed, "devices": len(cluster.devices), "islands": len(cluster.islands), "layers": model.num_layers,
        "global_batch": batch, "planner_s": planner_s, "brute_s": brute_s, "gap": gap,
        "planner_stages": planned.num_stages if planned else None,
        "brute_stages": brute.plan.num_stages if brute.plan else None,
        "planner_schedule": planned.schedule if planned else None,
        "brute_schedule": brute.plan.schedule if brute.plan else None,
        "planning_s": plan_time, "brute_force_s": brute.seconds, "space_plans": brute.plans,
        "simulated": brute.simulated,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=200)
    ap.add_argument("--max-devices", type=int, default=8)
    ap.add_argument("--max-layers", type=int, default=12)
    ap.add_argument("--out", default="reports/planner_optimality.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    print(f"{'seed':>5}{'dev':>5}{'isl':>5}{'lay':>5}{'batch':>6}{'planner s':>12}{'brute s':>12}{'gap %':>8}"
          f"{'plan t':>8}{'brute t':>9}{'space':>9}{'sims':>7}")
    for seed in range(args.instances):
        r = run_instance(seed, max_devices=args.max_devices, max_layers=args.max_layers)
        rows.append(r)
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"{r['seed']:>5}{r['devices']:>5}{r['islands']:>5}{r['layers']:>5}{r['global_batch']:>6}"
              f"{fmt(r['planner_s'], '12.5g')}{fmt(r['brute_s'], '12.5g')}"
              f"{fmt(None if r['gap'] is None else 100 * r['gap'], '8.3f')}"
              f"{r['planning_s']:>8.3f}{r['brute_force_s']:>9.3f}{r['space_plans']:>9}{r['simulated']:>7}", flush=True)
    both = [r for r in rows if r["gap"] is not None]
    mismatch = [r["seed"] for r in rows if (r["planner_s"] is None) != (r["brute_s"] is None)]
    within = sum(1 for r in both if r["gap"] <= 0.01)
    worst = max(both, key=lambda r: r["gap"], default=None)
    summary = {
        "instances": len(rows), "comparable": len(both), "within_1pct": within,
        "worst_gap": worst["gap"] if worst else None, "worst_seed": worst["seed"] if worst else None,
        "feasibility_mismatches": mismatch,
        "mean_planning_s": float(np.mean([r["planning_s"] for r in rows])),
        "mean_brute_force_s": float(np.mean([r["brute_force_s"] for r in rows])),
        "total_s": time.perf_counter() - t0,
    }
    print(f"\n{within} of {len(both)} comparable instances within 1% of the brute-force optimum; worst gap "
          f"{100 * (summary['worst_gap'] or 0):.3f}% (seed {summary['worst_seed']}); infeasible mismatches: "
          f"{mismatch or 'none'}; mean planning {summary['mean_planning_s']:.3f} s, mean brute force "
          f"{summary['mean_brute_force_s']:.3f} s, total {summary['total_s']:.0f} s")
    save_json_atomic(Path(args.out), {"schema_version": 1, "format": "deepcee.bench.planner_optimality",
                                      "summary": summary, "instances": rows})
    print(f"wrote {args.out}")
    return 0 if within == len(both) and not mismatch else 1


if __name__ == "__main__":
    raise SystemExit(main())
