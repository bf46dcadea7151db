"""The plan search: which devices, which stages, which layer split, microbatches and schedule.

Torch-free. Entry point: :func:`plan_training`.

The plan space is described in [Note: plan space] (:mod:`deepcee.planner.space`). The search
is split by concern: :mod:`~deepcee.planner.space` (layouts, plan building),
:mod:`~deepcee.planner.split` (the layer-split DP), :mod:`~deepcee.planner.steps` (the state
and steps 1-3 below), :mod:`~deepcee.planner.explain` (the explanation); this module runs them.
Every public name of those modules that callers used from here is importable from here.

[Note: search]
1. Every (layout, ``n``) gets its layer split by dynamic programming over contiguous layer
   ranges (:func:`~deepcee.planner.split.split_layers`), minimising the bottleneck iteration load
   ``max(M x (F+I+W) + all-reduce + optimizer of each stage, M x serialisation + latency of
   each boundary)`` subject to memory: first under the loosest limit (one microbatch in
   flight); schedules whose in-flight counts that split also meets share it (it is optimal
   for them too), the others get their own run. A closed form ``T = bottleneck load + fill``
   (fill: one microbatch through every other stage and link) ranks the results. A layout
   whose lower bound (all samples over the summed device speed, or the cheapest boundary's
   bytes over the summed bandwidth of the link resources between two of its stages)
   cannot beat the best closed form so far is skipped.
2. The best ranked configurations get a second DP that minimises the fill subject to the
   bottleneck staying under ``tau`` for a few ``tau`` above the optimum (trading a slightly
   worse bottleneck for a shorter pipeline when there are few microbatches).
3. The best ranked are built as plans for every schedule and sync (ring and hierarchical
   only when a stage spans nodes: otherwise they coincide) and scored by the analytic cost
   model (:class:`~deepcee.planner.cost_model.AnalyticCostModel`), plus, with one schedule,
   the best for every stage count and every island (for the explanation); plans that do
   not fit memory are dropped. The best few are refined by moving stage boundaries one
   layer at a time; ``compact`` schedules are built for the best distinct pipelines
   (:func:`~deepcee.schedule.compact.build_compact`, memory limit = what device memory
   allows per stage) within a budget of stages x microbatches, the builder's cost.
4. The best ``confirm_top`` plans (distinct) are simulated, within a work budget; the lowest
   simulated iteration time wins (ties: cost model, then a stable key).

With at most ``exhaustive_islands`` islands every island subset, every prefix of groups, and
the best island order (by slow-link cost) and its reverse are tried; above that, the chain
starts from all islands in a short-path order and islands or slow groups are dropped
greedily while that helps (moves are screened with the current best layout's kind and half,
same and double its granularity and microbatch size; an accepted move's chain is then
evaluated in full). A plan that does not fit
memory is never returned; when nothing fits, :class:`~deepcee.errors.InfeasiblePlanError`
names the device and its shortfall.

How good this is: ``benchmarks/planner_optimality.py`` compares it with an exact
brute-force search of the same plan space, scored by the simulator, on small random
instances; ``benchmarks/planning_time.py`` measures planning time up to 1,024 devices.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepcee.cluster import Cluster
from deepcee.errors import InfeasiblePlanError, PlanError
from deepcee.plan import SCHEDULES, Plan
from deepcee.planner.cost_model import AnalyticCostModel, CostModel, SimulatorCostModel
from deepcee.planner.explain import explain
from deepcee.planner.grouping import (
    DEFAULT_ISLAND_THRESHOLD_S,
    DEFAULT_SPEED_RATIO,
    Grouping,
    group_devices,
)
from deepcee.planner.ranges import RangeTables
from deepcee.planner.space import (
    SCREEN_RULES,
    Chain,
    StageLayout,
    build_plan,
    chain_layouts,
    compact_plan,
    enumerate_chains,
    in_flight_counts,
    island_distances,
    island_orders,
    microbatch_sizes,
    short_path,
)
from deepcee.planner.split import split_layers
from deepcee.planner.steps import Candidate, Config, SearchState, final_rank_key, rank_key
from deepcee.profile import ModelProfile
from deepcee.units import GIB

__all__ = [
    "SCREEN_RULES", "SYNC_CHOICES", "Candidate", "Chain", "PlanResult", "PlannerOptions", "StageLayout",
    "build_plan", "chain_layouts", "compact_plan", "enumerate_chains", "in_flight_counts", "island_distances",
    "island_orders", "microbatch_sizes", "plan_training", "split_layers",
]

log = logging.getLogger(__name__)

_INF = math.inf

SYNC_CHOICES = ("allreduce-ring", "allreduce-hier")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerOptions:
    """Knobs of :func:`plan_training`. Defaults are what the CLI uses."""

    schedules: tuple[str, ...] = SCHEDULES
    microbatch_sizes: tuple[int, ...] | None = None
    """Microbatch sizes to try (divisors of the global batch); ``None``: every divisor."""
    syncs: tuple[str, ...] = SYNC_CHOICES
    max_stages: int | None = None
    island_threshold_s: float = DEFAULT_ISLAND_THRESHOLD_S
    speed_ratio: float = DEFAULT_SPEED_RATIO
    allow_exclusion: bool = True
    """Whether islands and slow groups may be left out."""
    exhaustive_islands: int = 4
    """Up to this many islands, try every island subset; above it, drop islands greedily."""
    all_orders: bool = False
    """Try every island order (default: the shortest slow-link path and its reverse)."""
    sweep_top: int = 24
    """Configurations that get the fill-minimising second DP (step 2)."""
    model_top: int = 12
    """Configurations scored by the cost model for every schedule and sync (step 3)."""
    refine_top: int = 4
    compact_top: int = 6
    confirm_top: int = 5
    """Plans confirmed with the simulator; 0 picks by the cost model alone."""
    confirm_max_work: int = 150_000
    """Most simulator work (devices x compute actions x 2, summed over the confirmed plans); the
    best plans are confirmed in order while they fit (a plan alone above it is not simulated)."""
    compact_max_actions: int = 800
    """Build compact schedules only for plans with at most this many stages x microbatches."""
    compact_budget: int = 250
    """Stages x microbatches summed over the compact schedules built (after the first)."""
    refine_budget: int = 40_000
    """Work of boundary refinement in total, counted per cost-model evaluation as devices +
    stages x microbatches (what one evaluation costs); unlimited in effect for small clusters."""
    cost_model: CostModel | None = None
    """Scores candidates (default :class:`AnalyticCostModel`)."""
    confirm_model: CostModel | None = None
    """Confirms the best (default :class:`SimulatorCostModel`)."""
    system: str = "deepcee"

    def __post_init__(self) -> None:
        for s in self.schedules:
            if s not in SCHEDULES:
                raise PlanError(f"unknown schedule {s!r} (known: {', '.join(SCHEDULES)})", field="schedules")
        if not self.schedules:
            raise PlanError("need at least one schedule", field="schedules")
        for s in self.syncs:
            if s not in SYNC_CHOICES:
                raise PlanError(f"sync {s!r} is not searched (choose from {', '.join(SYNC_CHOICES)})", field="syncs")
        if self.max_stages is not None and self.max_stages < 1:
            raise PlanError(f"max_stages must be >= 1, got {self.max_stages!r}", field="max_stages")
        for name in ("sweep_top", "model_top", "refine_top", "compact_top", "confirm_top", "exhaustive_islands"):
            if getattr(self, name) < 0:
                raise PlanError(f"must be >= 0, got {getattr(self, name)!r}", field=name)



@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """What :func:`plan_training` returns."""

    plan: Plan
    explanation: tuple[str, ...]
    candidates_evaluated: int
    """Complete plans scored: closed-form splits, cost-model and simulator evaluations."""
    planning_s: float
    top: tuple[Candidate, ...]
    """The confirmed candidates, best first."""
    grouping: Grouping



Hint = tuple[bool, int, int]
"""(merged, granularity, microbatch size) of a chain's best layout."""


def _chain_value(search: SearchState, chain: Chain, hint: Hint | None = None) -> tuple[float, Hint | None]:
    """Best closed form over the chain's layouts; with ``hint``, only layouts of the same kind and
    microbatch sizes next to it (half, same, double granularity and size), which is how the
    greedy search screens its moves."""
    best: tuple[float, Hint | None] = (_INF, None)
    for lay in chain_layouts(search.grouping, chain, search.max_stages):
        sizes = None
        if hint is not None:
            merged, g, n = hint
            if lay.granularity != 0 and (lay.merged != merged or lay.granularity not in (g // 2, g, 2 * g)):
                continue
            sizes = [x for x in search.sizes if x in (n // 2, n, 2 * n)]
        value, n_best = search.evaluate_layout(lay, sizes)
        if value < best[0]:
            best = (value, (lay.merged, lay.granularity, n_best))
    return best


def _small_search(search: SearchState, dist: np.ndarray) -> None:
    for chain in enumerate_chains(search.grouping, dist, search.options):
        for layout in chain_layouts(search.grouping, chain, search.max_stages):
            search.evaluate_layout(layout)


def _greedy_search(search: SearchState, dist: np.ndarray) -> None:
    """Large clusters: all islands in a short order, then drop islands / slow groups while it helps.

    Moves are screened with the current best layout's neighbourhood (:func:`_chain_value` with a
    hint); the accepted move's chain is then evaluated in full.
    """
    g = search.grouping
    members = list(range(len(g.islands)))
    keep = {i: len(g.islands[i].groups) for i in members}
    chain: Chain = tuple((i, keep[i]) for i in short_path(dist, members))
    best, hint = _chain_value(search, chain)
    if not search.options.allow_exclusion:
        return
    for i in members:  # every island alone is a cheap, useful reference
        _chain_value(search, ((i, keep[i]),))
    while len(members) > 1:
        moves: list[tuple[float, int, Chain, list[int], dict[int, int]]] = []
        for i in members:
            rest = [x for x in members if x != i]
            c: Chain = tuple((x, keep[x]) for x in short_path(dist, rest))
            moves.append((_chain_value(search, c, hint)[0], len(rest), c, rest, keep))
            if keep[i] > 1:
                k2 = {**keep, i: keep[i] - 1}
                c = tuple((x, k2[x]) for x in short_path(dist, members))
                moves.append((_chain_value(search, c, hint)[0], len(members), c, members, k2))
        value, _, chain, new_members, new_keep = min(moves, key=lambda m: (m[0], m[1]))
        if not value < best * (1 - 1e-3):
            break
        members, keep = new_members, new_keep
        full, full_hint = _chain_value(search, chain)
        best, hint = min(full, value), full_hint or hint


def plan_training(cluster: Cluster, model: ModelProfile, global_batch: int, *,
                  options: PlannerOptions | None = None, sync: str = "exact", **relaxed: Any) -> PlanResult:
    """Search the plan space for the fastest plan that fits memory. See the module docstring.

    ``sync="relaxed"`` also searches replicas and relaxed strategies, judged by predicted time
    to target (:func:`deepcee.planner.replicas.plan_replicas`, which takes ``relaxed``'s
    keywords: ``efficiency``, ``objective``, ...); the default, ``"exact"``, is this search.
    """
    if sync not in ("exact", "relaxed"):
        raise PlanError(f"unknown sync {sync!r} (known: exact, relaxed)", field="sync")
    if sync == "relaxed" or relaxed:
        return _relaxed(cluster, model, global_batch, options, relaxed if sync == "relaxed" else
                        {**relaxed, "options": _exact_only()})
    t0 = time.perf_counter()
    options = options or PlannerOptions()
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch must be an integer >= 1, got {global_batch!r}", field="global_batch")
    grouping = group_devices(cluster, island_threshold_s=options.island_threshold_s, speed_ratio=options.speed_ratio)
    max_stages = min(model.num_layers, options.max_stages or model.num_layers)
    search = SearchState(cluster=cluster, model=model, global_batch=global_batch, options=options, grouping=grouping,
                     tables=RangeTables(cluster, model, options.syncs), cost_model=options.cost_model
                     or AnalyticCostModel(), sizes=microbatch_sizes(global_batch, options), max_stages=max_stages)
    search.min_boundary_bytes = min((model.boundary_bytes(b) for b in range(1, model.num_layers)), default=0.0)
    dist = island_distances(cluster, grouping)
    if len(grouping.islands) <= options.exhaustive_islands:
        _small_search(search, dist)
    else:
        _greedy_search(search, dist)
    ranked = sorted(search.configs.values(), key=lambda c: c.key)
    for cfg in ranked[: options.sweep_top]:
        search.sweep(cfg)
    ranked = sorted(search.configs.values(), key=lambda c: c.key)
    cands: list[Candidate] = []
    picked: set[int] = set()
    for full, group in ((True, ranked[: options.model_top]), (False, _coverage(ranked))):
        for cfg in group:
            if id(cfg) not in picked:
                picked.add(id(cfg))
                cands += search.plans_for(cfg, full=full)
    if not cands:
        raise _infeasible(search)
    cands = sorted(_dedupe(cands), key=rank_key)
    refined = [search.refine(c) for c in cands[: options.refine_top]]
    cands = sorted(_dedupe(cands + refined), key=rank_key)
    cands += _compacts(search, cands, ranked)
    cands = sorted(_dedupe(cands), key=rank_key)
    top = _confirm(search, cands)
    best = top[0]
    explanation = explain(search, best, cands)
    plan = best.plan.replace(estimate=best.simulated or best.estimate, explanation=tuple(explanation))
    elapsed = time.perf_counter() - t0
    log.info("planned %s on %s in %.3f s (%d candidates): %.4g s per iteration", model.name, cluster.name,
             elapsed, search.evaluated, best.score_s)
    return PlanResult(plan=plan, explanation=tuple(explanation), candidates_evaluated=search.evaluated,
                      planning_s=elapsed, top=tuple(top), grouping=grouping)


def _exact_only() -> Any:
    from deepcee.planner.replicas import RelaxedOptions

    return RelaxedOptions(relaxed=False)


def _relaxed(cluster: Cluster, model: ModelProfile, global_batch: int, options: PlannerOptions | None,
             relaxed: dict[str, Any]) -> PlanResult:
    """The replica search (:mod:`deepcee.planner.replicas`) on top of this one's exact plan."""
    from deepcee.planner.replicas import plan_replicas

    exact = plan_training(cluster, model, global_batch, options=options)
    got = plan_replicas(cluster, model, global_batch, exact_plan=exact.plan, **relaxed)
    return PlanResult(plan=got.plan, explanation=got.explanation,
                      candidates_evaluated=exact.candidates_evaluated + len(got.candidates),
                      planning_s=exact.planning_s + got.planning_s, top=exact.top, grouping=exact.grouping)


def _dedupe(cands: Iterable[Candidate]) -> list[Candidate]:
    seen: dict[tuple, Candidate] = {}
    for c in cands:
        p = c.plan
        seen.setdefault((p.stages, p.schedule, p.sync, p.actions, p.microbatch_size), c)
    return list(seen.values())


def _coverage(ranked: list[Config]) -> list[Config]:
    """The best configuration per stage count and per island used (so the explanation can compare)."""
    out: dict[tuple, Config] = {}
    for cfg in ranked:
        out.setdefault(("stages", len(cfg.layout.slots)), cfg)
        for isl in cfg.layout.islands:
            out.setdefault(("island", isl), cfg)
    return list(out.values())


def _compacts(search: SearchState, cands: list[Candidate], ranked: list[Config]) -> list[Candidate]:
    """Compact schedules for the best distinct pipelines (stage devices, microbatch size), taken in
    turn from the cost-model ranking of fixed schedules and from the closed-form ranking (which
    ignores the schedule, as a compact schedule nearly does), up to ``compact_top``; then the best
    are refined. All within ``compact_budget`` stages x microbatches, the builder's cost."""
    opts = search.options
    if "compact" not in opts.schedules:
        return []
    by_model: dict[tuple, Plan] = {}
    for c in cands:
        if c.plan.num_stages >= 2 and c.plan.schedule != "compact":
            by_model.setdefault((tuple(st.devices for st in c.plan.stages), c.plan.microbatch_size), c.plan)
    by_form: dict[tuple, Plan] = {}
    for cfg in ranked:
        key = (cfg.layout.slots, cfg.n)
        if len(cfg.layout.slots) >= 2 and key not in by_form:
            by_form[key] = by_model.get(key) or build_plan(
                cfg.layout, cfg.split, cluster=search.cluster, model=search.model, global_batch=search.global_batch,
                microbatch_size=cfg.n, schedule="zb-h1", sync=opts.syncs[0], system=opts.system)
        if len(by_form) >= opts.compact_top:
            break
    bases: dict[tuple, Plan] = {}
    for a, b in itertools.zip_longest(list(by_model.items())[: opts.compact_top], by_form.items()):
        for key, plan in (x for x in (a, b) if x is not None):
            bases.setdefault(key, plan)
    out = []
    for plan in list(bases.values())[: opts.compact_top]:
        built = search.compact(plan)
        got = search.score(built) if built is not None else None
        if got is not None:
            out.append(got)
    out.sort(key=rank_key)
    out += [search.refine(c) for c in out]  # all of them, as far as the budget lasts
    if bases and not search.compact_used:
        search.notes.append(f"no compact schedule built: the best pipelines exceed compact_max_actions "
                            f"{opts.compact_max_actions} (stages x microbatches)")
    return out


def _confirm(search: SearchState, cands: list[Candidate]) -> list[Candidate]:
    k = search.options.confirm_top
    if k == 0:
        return cands[:1]
    scorer = search.options.confirm_model or SimulatorCostModel()
    out, work = [], 0
    for c in cands[:k]:
        w = 6 * len(c.plan.devices) * c.plan.num_microbatches
        if work + w > search.options.confirm_max_work:
            break
        work += w
        search.evaluated += 1
        out.append(Candidate(plan=c.plan, estimate=c.estimate,
                             simulated=scorer.estimate(c.plan, search.cluster, search.model)))
    if len(out) < min(k, len(cands)):
        search.notes.append(f"confirmed {len(out)} of the best {min(k, len(cands))} plans with the "
                            f"simulator (confirm_max_work {search.options.confirm_max_work} device-actions); "
                            f"the rest are ranked by the cost model")
    return sorted(out, key=final_rank_key) + cands[len(out):k] if out else cands[:1]


def _infeasible(search: SearchState) -> InfeasiblePlanError:
    """The closest miss: one device per stage (the devices with the most memory, at most one per
    layer), the smallest microbatch, one microbatch in flight, and the layer split that
    minimises the worst shortfall (the DP with memory excess as the load)."""
    cluster, model, n = search.cluster, search.model, search.sizes[0]
    pos = {d: i for i, d in enumerate(cluster.device_names)}
    devs = sorted(cluster.device_names, key=lambda d: (-cluster.memory_bytes(d), pos[d]))[: model.num_layers]
    slots = tuple((d,) for d in sorted(devs, key=pos.__getitem__))
    layout = StageLayout(slots=slots, islands=(), label="one device per stage")
    tab = search.dp_inputs(layout, n)
    excess = [np.where(np.tril(np.ones_like(rc.compute_s, dtype=bool)), _INF, rc.memory_excess(1))
              for rc in tab.costs]
    got = split_layers(excess, [np.full(excess[0].shape[0], -_INF)] * len(excess))
    assert got is not None  # every range of a one-layer-or-more split has a finite excess
    split = got[1]
    short, s = max((float(excess[k][split[k], split[k + 1]]), -k) for k in range(len(slots)))
    s, d = -s, slots[-s][0]
    if short <= 0:
        return InfeasiblePlanError(
            f"no plan of {model.name} on {cluster.name} in the searched space (schedules "
            f"{', '.join(search.options.schedules)}, microbatch sizes {search.sizes}); allow more schedules "
            f"or microbatch sizes")
    a, b = split[s], split[s + 1]
    have = cluster.memory_bytes(d)
    return InfeasiblePlanError(
        f"{model.name} needs {(have + short) / GIB:.1f} GiB on {d} (stage {s}, layers {a}-{b - 1}) but it has "
        f"{have / GIB:.1f} GiB; short {short / GIB:.1f} GiB even with one device per stage ({len(slots)} "
        f"stages), microbatch size {n} and one microbatch in flight; add devices or reduce microbatch size")
