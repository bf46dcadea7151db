"""The plan search: which devices, which stages, which layer split, microbatches and schedule.

Torch-free. Entry point: :func:`plan_training`.

[Note: plan space]
A plan is one pipeline (see :mod:`deepcee.plan`): stages are device sets, devices of a stage
split every microbatch by share and all-reduce their gradients. The planner searches:

- **chains**: an ordered subset of islands (:mod:`deepcee.planner.grouping`); inside each
  used island a prefix of its groups, fastest first (the slower groups can be left out).
  Islands are chained so the pipeline crosses each slow link once; leaving an island out
  removes its link from the pipeline altogether.
- **layouts** of a chain into stages: each island's kept devices form one device set
  (*merged*) or one per group (*per group*); each set is cut into contiguous chunks of at
  most ``g`` devices (``g`` a power of two, the same for the whole chain: more stages
  inside an island, for memory or for less all-reduce traffic); plus, for a chain of
  several islands, one stage over all of them (data parallel across islands).
- **microbatch size** ``n`` (a divisor of the global batch, at least the largest stage's
  device count so every device gets a sample), **schedule** (gpipe, 1f1b, zb-h1, zb-h2,
  compact), **sync** (ring or hierarchical all-reduce), and the **layer split** (any
  contiguous split, every stage at least one layer). Shares are proportional to device
  speed (:func:`~deepcee.planner.cost_model.largest_remainder_shares`).

[Note: search]
1. Every (layout, ``n``) gets its layer split by dynamic programming over contiguous layer
   ranges (:func:`split_layers`), minimising the bottleneck iteration load
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from deepcee.cluster import Cluster
from deepcee.errors import InfeasiblePlanError, PlanError
from deepcee.plan import SCHEDULES, Estimate, Plan, StagePlan
from deepcee.planner.cost_model import (
    AnalyticCostModel,
    CostModel,
    PlanCost,
    RangeCosts,
    RangeTables,
    SimulatorCostModel,
    largest_remainder_shares,
    share_pairs,
)
from deepcee.planner.grouping import (
    DEFAULT_ISLAND_THRESHOLD_S,
    DEFAULT_SPEED_RATIO,
    Grouping,
    distance_s,
    group_devices,
)
from deepcee.profile import ModelProfile
from deepcee.schedule.compact import RULE_GRID, Rules, build_compact, search_compact
from deepcee.schedule.ir import format_schedule
from deepcee.units import GIB, fmt_rate

log = logging.getLogger(__name__)

SYNC_CHOICES = ("allreduce-ring", "allreduce-hier")
_INF = math.inf


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
    refine_budget: int = 40_000
    """Work of boundary refinement in total, counted per cost-model evaluation as devices +
    stages x microbatches (what one evaluation costs); unlimited in effect for small clusters."""
    """Stages x microbatches summed over the compact schedules built (after the first)."""
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
class Candidate:
    """One scored plan."""

    plan: Plan
    estimate: Estimate
    """The cost model's estimate."""
    simulated: Estimate | None = None
    """The confirming model's estimate (``None`` when not confirmed)."""

    @property
    def score_s(self) -> float:
        return (self.simulated or self.estimate).iteration_s


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


@dataclass(frozen=True, slots=True, kw_only=True)
class StageLayout:
    """Device sets of a pipeline, in order (a chain laid out; see [Note: plan space])."""

    slots: tuple[tuple[str, ...], ...]
    islands: tuple[str, ...]
    """Islands used, in pipeline order."""
    label: str
    merged: bool = True
    """Each island's kept groups form one device set (else one per group)."""
    granularity: int = 0
    """Most devices per stage when cutting device sets; 0 for the all-islands data-parallel layout."""
    devices: frozenset[str] = field(init=False, repr=False, compare=False)
    """Every device of the layout."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", frozenset(d for s in self.slots for d in s))


# ----------------------------------------------------------------------------- plan space


def microbatch_sizes(global_batch: int, options: PlannerOptions) -> list[int]:
    divisors = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    if options.microbatch_sizes is None:
        return divisors
    bad = [n for n in options.microbatch_sizes if n not in divisors]
    if bad:
        raise PlanError(f"microbatch size {bad[0]} does not divide the global batch {global_batch}",
                        field="microbatch_sizes")
    return sorted(set(options.microbatch_sizes))


def _chunks(devices: Sequence[str], most: int) -> list[tuple[str, ...]]:
    q = -(-len(devices) // most)
    base, extra = divmod(len(devices), q)
    out, i = [], 0
    for k in range(q):
        size = base + (1 if k < extra else 0)
        out.append(tuple(devices[i:i + size]))
        i += size
    return out


Chain = tuple[tuple[int, int], ...]
"""(island index, groups kept) in pipeline order."""


def chain_layouts(grouping: Grouping, chain: Chain, max_stages: int) -> list[StageLayout]:
    """Every layout of ``chain`` (see [Note: plan space]) with at most ``max_stages`` stages."""
    islands = [grouping.islands[i] for i, _ in chain]
    kept = [isl.groups[:keep] for isl, (_, keep) in zip(islands, chain, strict=True)]
    biggest = max(len(g.devices) for gs in kept for g in gs)
    biggest = max(biggest, max(sum(len(g.devices) for g in gs) for gs in kept))
    sizes = sorted({2 ** k for k in range(int(math.ceil(math.log2(biggest))) + 1)} | {biggest}, reverse=True)
    out: list[StageLayout] = []
    for merged in ((True, False) if any(len(gs) > 1 for gs in kept) else (True,)):
        for g in sizes:
            slots: list[tuple[str, ...]] = []
            parts = []
            for isl, gs in zip(islands, kept, strict=True):
                member = {d for x in gs for d in x.devices}
                sets = [tuple(d for d in isl.devices if d in member)] if merged else [x.devices for x in gs]
                pieces = [c for s in sets for c in _chunks(s, g)]
                slots += pieces
                dropped = len(isl.groups) - len(gs)
                parts.append(f"{isl.name}[{'+'.join(str(len(p)) for p in pieces)}]"
                             + (f"(-{dropped} slow group{'s' if dropped > 1 else ''})" if dropped else ""))
            if len(slots) <= max_stages:
                out.append(StageLayout(slots=tuple(slots), islands=tuple(i.name for i in islands),
                                       label=" > ".join(parts), merged=merged, granularity=g))
    if len(chain) > 1:
        member = {d for gs in kept for x in gs for d in x.devices}
        every = tuple(d for isl in islands for d in isl.devices if d in member)
        out.append(StageLayout(slots=(every,), islands=tuple(i.name for i in islands),
                               label="data parallel over " + " + ".join(i.name for i in islands)))
    return out


def island_distances(cluster: Cluster, grouping: Grouping) -> np.ndarray:
    """Symmetric 1 MB transfer time between islands (first devices, worse direction)."""
    n = len(grouping.islands)
    out = np.zeros((n, n))
    for i, j in itertools.combinations(range(n), 2):
        a, b = grouping.islands[i].devices[0], grouping.islands[j].devices[0]
        out[i, j] = out[j, i] = max(distance_s(cluster.link(a, b)), distance_s(cluster.link(b, a)))
    return out


def _short_path(dist: np.ndarray, members: Sequence[int]) -> tuple[int, ...]:
    """A short Hamiltonian path over ``members`` (exact up to 6, else nearest neighbour + 2-opt)."""
    members = sorted(members)
    cost = lambda p: sum(dist[a, b] for a, b in zip(p, p[1:], strict=False))  # noqa: E731
    if len(members) <= 6:
        return min(itertools.permutations(members), key=lambda p: (cost(p), p))
    best: tuple[float, tuple[int, ...]] | None = None
    for start in members:
        path, left = [start], set(members) - {start}
        while left:
            path.append(min(left, key=lambda x: (dist[path[-1], x], x)))
            left.discard(path[-1])
        improved = True
        while improved:  # 2-opt on a path: reversing path[i..j] only changes its two end edges
            improved = False
            for i in range(1, len(path) - 1):
                for j in range(i + 1, len(path)):
                    old = dist[path[i - 1], path[i]] + (dist[path[j], path[j + 1]] if j + 1 < len(path) else 0.0)
                    new = dist[path[i - 1], path[j]] + (dist[path[i], path[j + 1]] if j + 1 < len(path) else 0.0)
                    if new < old - 1e-12:
                        path[i:j + 1] = path[i:j + 1][::-1]
                        improved = True
        cand = (cost(path), tuple(path))
        if best is None or cand < best:
            best = cand
    assert best is not None
    return best[1]


def island_orders(dist: np.ndarray, members: Sequence[int], all_orders: bool) -> list[tuple[int, ...]]:
    if all_orders:
        return list(itertools.permutations(members))
    best = _short_path(dist, members)
    return list(dict.fromkeys([best, best[::-1]]))


def enumerate_chains(grouping: Grouping, dist: np.ndarray, options: PlannerOptions) -> list[Chain]:
    """Every chain of the plan space for a small cluster (all subsets, orders, group prefixes)."""
    n = len(grouping.islands)
    subsets = ([c for k in range(1, n + 1) for c in itertools.combinations(range(n), k)]
               if options.allow_exclusion else [tuple(range(n))])
    out: list[Chain] = []
    for sub in subsets:
        for order in island_orders(dist, sub, options.all_orders):
            keeps = [range(1, len(grouping.islands[i].groups) + 1) if options.allow_exclusion
                     else [len(grouping.islands[i].groups)] for i in order]
            for ks in itertools.product(*keeps):
                out.append(tuple(zip(order, ks, strict=True)))
    return out


def build_plan(layout: StageLayout, split: Sequence[int], *, cluster: Cluster, model: ModelProfile,
               global_batch: int, microbatch_size: int, schedule: str, sync: str,
               actions: tuple[tuple[str, ...], ...] = (), system: str = "deepcee") -> Plan:
    """The plan of one point of the plan space (shares proportional to speed)."""
    stages = []
    for s, devs in enumerate(layout.slots):
        shares = largest_remainder_shares(devs, [cluster.effective_flops_per_s(d) for d in devs], microbatch_size)
        stages.append(StagePlan(layer_start=split[s], layer_stop=split[s + 1], devices=devs, shares=shares))
    used = layout.devices
    return Plan(system=system, cluster=cluster.name, model=model.name, global_batch=global_batch,
                microbatch_size=microbatch_size, num_microbatches=global_batch // microbatch_size,
                stages=tuple(stages), schedule=schedule, sync=sync, actions=actions,
                excluded_devices=tuple(d for d in cluster.device_names if d not in used))


def in_flight_counts(schedule: str, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Microbatches held per stage by a named schedule (``compact``: at least 1, see its limit)."""
    s, m = num_stages, num_microbatches
    if schedule == "gpipe":
        return (m,) * s
    if schedule in ("1f1b", "zb-h1"):
        return tuple(min(s - k, m) for k in range(s))
    if schedule == "zb-h2":
        return tuple(min(2 * (s - k) - 1, m) for k in range(s))
    return (1,) * s


SCREEN_RULES: tuple[Rules, ...] = tuple(r for r in RULE_GRID if r.feed_downstream == 0 and r.w_slack in (0.0, 1.0))
"""The compact builder's rule settings used to *screen* splits while refining a compact plan: the
six that won most often on the random instances of ``benchmarks/planner_optimality.py`` (about
two thirds of all wins; the templates are always tried). The split a refinement ends on is
built with the full grid."""


def compact_plan(plan: Plan, cluster: Cluster, model: ModelProfile, cost: PlanCost,
                 tables: RangeTables, *, rules: Sequence[Rules] | None = None) -> Plan | None:
    """``plan`` with a compact schedule built from ``cost`` (its stage and link times) by
    :func:`~deepcee.schedule.compact.build_compact` (or with only ``rules``, see
    :data:`SCREEN_RULES`); ``None`` if some stage cannot hold even one microbatch."""
    limits = []
    for st in plan.stages:
        k = tables.costs(st.devices, st.shares).max_in_flight(st.layer_start, st.layer_stop, plan.num_microbatches)
        if k < 1:
            return None
        limits.append(k)
    costs = {"num_microbatches": plan.num_microbatches, "forward_s": cost.forward_s,
             "input_grad_s": cost.input_grad_s, "weight_grad_s": cost.weight_grad_s,
             "comm_forward": [b.forward for b in cost.boundaries],
             "comm_backward": [b.backward for b in cost.boundaries], "memory_limit": limits}
    sched = build_compact(**costs) if rules is None else search_compact(**costs, rules=rules).schedule
    return plan.replace(schedule="compact", actions=format_schedule(sched))


# ----------------------------------------------------------------------------- layer split DP


@dataclass(slots=True)
class _Boundary:
    """Per boundary layer ``a``: forward/backward (latency, serialisation) of one microbatch."""

    lat_f: np.ndarray
    ser_f: np.ndarray
    lat_b: np.ndarray
    ser_b: np.ndarray


def _boundary(cluster: Cluster, tables: RangeTables, src: tuple[str, ...], src_shares: tuple[int, ...],
              dst: tuple[str, ...], dst_shares: tuple[int, ...]) -> _Boundary:
    per: list[dict[str, list[float]]] = [{}, {}]
    for i, j, lo, hi in share_pairs(src_shares, dst_shares):
        for d, a, b in ((0, src[i], dst[j]), (1, dst[j], src[i])):
            link = cluster.link(a, b)
            r = per[d].setdefault(link.resource, [0.0, 0.0, link.bandwidth_bytes_per_s])
            r[0] += hi - lo
            r[1] = max(r[1], link.latency_s)
    bnd = tables.boundary_bytes
    out = []
    for d in range(2):
        sers = np.outer([samples / bw for samples, _, bw in per[d].values()], bnd)
        lats = np.array([lat for _, lat, _ in per[d].values()])[:, None]
        ser = sers.max(axis=0)
        out += [(sers + lats).max(axis=0) - ser, ser]
    return _Boundary(*out)


@dataclass(slots=True)
class _Tables:
    """DP inputs of one (layout, n): per stage ``RangeCosts``, per boundary link arrays."""

    costs: list[RangeCosts]
    bounds: list[_Boundary]
    m: int
    _base: list[np.ndarray] | None = None
    _links: list[np.ndarray] | None = None

    def loads(self, in_flight: Sequence[int]) -> list[np.ndarray]:
        """Per stage the iteration load of every range, ``inf`` where empty or out of memory."""
        if self._base is None:
            size = self.costs[0].compute_s.shape[0]
            invalid = np.tril(np.ones((size, size), dtype=bool))
            self._base = [np.where(invalid, _INF, self.m * rc.compute_s + rc.allreduce_s + rc.optimizer_s)
                          for rc in self.costs]
        return [np.where(rc.memory_excess(k) > 0, _INF, base)
                for rc, k, base in zip(self.costs, in_flight, self._base, strict=True)]

    def link_loads(self) -> list[np.ndarray]:
        if self._links is None:
            self._links = [np.zeros(0)] + [self.m * np.maximum(b.ser_f, b.ser_b) + np.maximum(b.lat_f, b.lat_b)
                                           for b in self.bounds]
        return self._links

    def fills(self) -> list[np.ndarray]:
        return [np.zeros(0)] + [b.lat_f + b.ser_f + b.lat_b + b.ser_b for b in self.bounds]

    def fits(self, split: Sequence[int], in_flight: Sequence[int]) -> bool:
        return all(rc.memory_excess(k)[split[s], split[s + 1]] <= 0
                   for s, (rc, k) in enumerate(zip(self.costs, in_flight, strict=True)))

    def closed_form(self, split: Sequence[int], loads: list[np.ndarray]) -> float:
        """``T = bottleneck load + one microbatch through everything else`` (see [Note: search])."""
        links, fills = self.link_loads(), self.fills()
        terms, per_mb = [], []
        for s in range(len(self.costs)):
            a, b = split[s], split[s + 1]
            terms.append(loads[s][a, b])
            per_mb.append(self.costs[s].compute_s[a, b])
            if s:
                terms.append(links[s][a])
                per_mb.append(max(self.bounds[s - 1].ser_f[a], self.bounds[s - 1].ser_b[a]))
        k = int(np.argmax(terms))
        fill = sum(self.costs[s].compute_s[split[s], split[s + 1]] for s in range(len(self.costs)))
        fill += sum(fills[s][split[s]] for s in range(1, len(self.costs)))
        return float(terms[k] + fill - per_mb[k])


def split_layers(loads: list[np.ndarray], links: list[np.ndarray], *, computes: list[np.ndarray] | None = None,
                 fills: list[np.ndarray] | None = None, tau: float | None = None) -> tuple[float, tuple[int, ...]] | None:
    """Contiguous layer split over ``len(loads)`` stages by dynamic programming.

    Without ``tau``: minimise ``max(loads[s][a_s, a_{s+1}], links[s][a_s])`` (the bottleneck).
    With ``tau``: minimise ``sum(computes[s][a_s, a_{s+1}] + fills[s][a_s])`` subject to every
    load and link term ``<= tau``. ``loads`` hold ``inf`` where a range is invalid (empty or out
    of memory). Returns ``(value, boundaries a_0=0 < ... < a_S=L)`` or ``None`` if infeasible.
    Ties go to the smallest boundary, so the result is deterministic.
    """
    size = loads[0].shape[0]
    cols = np.arange(size)
    if tau is None:
        value = loads[0][0].copy()
    else:
        assert computes is not None and fills is not None
        value = np.where(loads[0][0] <= tau, computes[0][0], _INF)
    back = []
    for s in range(1, len(loads)):
        if tau is None:
            x = np.maximum(np.maximum(value, links[s])[:, None], loads[s])
        else:
            prev = np.where(links[s] <= tau, value + fills[s], _INF)
            x = prev[:, None] + np.where(loads[s] <= tau, computes[s], _INF)
        arg = np.argmin(x, axis=0)
        value = x[arg, cols]
        back.append(arg)
    if not np.isfinite(value[-1]):
        return None
    split, b = [size - 1], size - 1
    for arg in reversed(back):
        b = int(arg[b])
        split.append(b)
    split.append(0)
    return float(value[-1]), tuple(reversed(split))


# ----------------------------------------------------------------------------- the search


@dataclass(slots=True)
class _Config:
    layout: StageLayout
    n: int
    split: tuple[int, ...]
    schedules: tuple[str, ...]
    closed_form_s: float
    key: tuple = ()


@dataclass(slots=True)
class _Search:
    cluster: Cluster
    model: ModelProfile
    global_batch: int
    options: PlannerOptions
    grouping: Grouping
    tables: RangeTables
    cost_model: CostModel
    sizes: list[int]
    max_stages: int
    configs: dict[tuple, _Config] = field(default_factory=dict)
    dp_tables: dict[tuple, _Tables] = field(default_factory=dict)
    bounds: dict[tuple, _Boundary] = field(default_factory=dict)
    scored: dict[tuple, Candidate] = field(default_factory=dict)
    evaluated: int = 0
    layouts_seen: dict[tuple, StageLayout] = field(default_factory=dict)
    best_closed_form: float = _INF
    min_boundary_bytes: float = 0.0
    _marginal: dict[str, float] = field(default_factory=dict)
    _shares: dict[tuple, tuple[int, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    compact_used: float = 0.0
    forced_compacts: int = 0
    refine_used: int = 0
    _pipes: dict[tuple, float] = field(default_factory=dict)

    # -- step 1 ---------------------------------------------------------------------------
    def shares(self, devs: tuple[str, ...], n: int) -> tuple[int, ...]:
        key = (devs, n)
        got = self._shares.get(key)
        if got is None:
            got = self._shares[key] = largest_remainder_shares(
                devs, [self.cluster.effective_flops_per_s(d) for d in devs], n)
        return got

    def dp_inputs(self, layout: StageLayout, n: int) -> _Tables:
        key = (layout.slots, n)
        got = self.dp_tables.get(key)
        if got is None:
            shares = [self.shares(s, n) for s in layout.slots]
            costs = [self.tables.costs(s, sh) for s, sh in zip(layout.slots, shares, strict=True)]
            bounds = []
            for s in range(1, len(layout.slots)):
                bkey = (layout.slots[s - 1], layout.slots[s], n)
                if bkey not in self.bounds:
                    self.bounds[bkey] = _boundary(self.cluster, self.tables, layout.slots[s - 1], shares[s - 1],
                                                  layout.slots[s], shares[s])
                bounds.append(self.bounds[bkey])
            got = self.dp_tables[key] = _Tables(costs=costs, bounds=bounds, m=self.global_batch // n)
        return got

    def lower_bound(self, layout: StageLayout) -> float:
        """No split of ``layout`` beats this: all samples over the summed device speed, or the
        smallest boundary's bytes over the summed bandwidth of the link resources it can use."""
        bound = self.global_batch / sum(1.0 / self.marginal_s(d) for d in layout.devices)
        for a, b in zip(layout.slots, layout.slots[1:], strict=False):
            bound = max(bound, self.global_batch * self.min_boundary_bytes / self.pipe_bandwidth(a, b))
        return bound

    def marginal_s(self, device: str) -> float:
        """Seconds one more sample adds on ``device`` (F+I+W of the whole model)."""
        got = self._marginal.get(device)
        if got is None:
            kind, slow, m = self.cluster.kind_of(device), self.cluster.device(device).slowdown, self.model
            one = sum(m.time_s(0, m.num_layers, p, 1, kind, slow) for p in "FIW")
            two = sum(m.time_s(0, m.num_layers, p, 2, kind, slow) for p in "FIW")
            got = self._marginal[device] = max(two - one, 1e-30)
        return got

    def pipe_bandwidth(self, src: tuple[str, ...], dst: tuple[str, ...]) -> float:
        """Summed bandwidth of the distinct link resources from ``src`` to ``dst`` (nodes stand for
        their devices, which share the node-pair pipes)."""
        key = (src, dst)
        got = self._pipes.get(key)
        if got is None:
            def reps(devs: tuple[str, ...]) -> list[str]:
                return list({self.cluster.device(d).node: d for d in reversed(devs)}.values())
            a_reps, b_reps = reps(src), reps(dst)
            shared = {self.cluster.device(d).node for d in src} & {self.cluster.device(d).node for d in dst}
            if shared:  # a node split between two stages: pipes are per device pair there
                a_reps, b_reps = list(src), list(dst)
            pipes = {}
            for x in a_reps:
                for y in b_reps:
                    link = self.cluster.link(x, y)
                    pipes[link.resource] = link.bandwidth_bytes_per_s
            got = self._pipes[key] = sum(pipes.values())
        return got

    def evaluate_layout(self, layout: StageLayout, sizes: Sequence[int] | None = None) -> tuple[float, int]:
        """Step 1 for every microbatch size (or ``sizes``); the best closed form and its size
        (``inf`` if nothing fits or the layout cannot beat the best so far)."""
        self.layouts_seen.setdefault(layout.slots, layout)
        best, best_n = _INF, 0
        stages = len(layout.slots)
        if stages > self.model.num_layers or self.lower_bound(layout) >= self.best_closed_form:
            return best, best_n
        for n in self.sizes if sizes is None else sizes:
            if n < max(len(s) for s in layout.slots):
                continue
            tab = self.dp_inputs(layout, n)
            loose = split_layers(tab.loads((1,) * stages), tab.link_loads())
            if loose is None:
                continue
            pending: dict[tuple[int, ...], list[str]] = {}
            shared = []
            for sched in self.options.schedules:
                in_flight = in_flight_counts(sched, stages, tab.m)
                # the optimum under the loosest memory limit is optimal for any tighter limit it meets
                (shared.append(sched) if tab.fits(loose[1], in_flight)
                 else pending.setdefault(in_flight, []).append(sched))
            results = [(loose, shared)] if shared else []
            for in_flight, scheds in pending.items():
                got = split_layers(tab.loads(in_flight), tab.link_loads())
                if got is not None:
                    results.append((got, scheds))
            for (_, split), scheds in results:
                cf = tab.closed_form(split, tab.loads(in_flight_counts(scheds[0], stages, tab.m)))
                self.add_config(layout, n, split, tuple(scheds), cf)
                if cf < best:
                    best, best_n = cf, n
        self.best_closed_form = min(self.best_closed_form, best)
        return best, best_n

    def add_config(self, layout: StageLayout, n: int, split: tuple[int, ...], scheds: tuple[str, ...],
                   cf: float) -> None:
        self.evaluated += 1
        key = (layout.slots, n, split, scheds)
        if key not in self.configs:
            self.configs[key] = _Config(layout=layout, n=n, split=split, schedules=scheds, closed_form_s=cf,
                                        key=(cf, len(self.configs)))

    # -- step 2 ---------------------------------------------------------------------------
    def sweep(self, cfg: _Config) -> None:
        tab = self.dp_inputs(cfg.layout, cfg.n)
        loads = tab.loads(in_flight_counts(cfg.schedules[0], len(cfg.layout.slots), tab.m))
        links, fills = tab.link_loads(), tab.fills()
        computes = [rc.compute_s for rc in tab.costs]
        first = split_layers(loads, links)
        if first is None:
            return
        for factor in (1.0, 1.1, 1.25, 1.5, 2.0):
            got = split_layers(loads, links, computes=computes, fills=fills, tau=first[0] * factor * (1 + 1e-12))
            if got is not None:
                self.add_config(cfg.layout, cfg.n, got[1], cfg.schedules, tab.closed_form(got[1], loads))

    # -- step 3 ---------------------------------------------------------------------------
    def score(self, plan: Plan) -> Candidate | None:
        key = (plan.stages, plan.schedule, plan.sync, plan.actions)
        if key in self.scored:
            return self.scored[key]
        self.evaluated += 1
        est = self.cost_model.estimate(plan, self.cluster, self.model)
        fits = all(b <= self.cluster.memory_bytes(d) for d, b in est.peak_memory_bytes.items())
        cand = Candidate(plan=plan, estimate=est) if fits else None
        self.scored[key] = cand
        return cand

    def plans_for(self, cfg: _Config, *, full: bool = True) -> list[Candidate]:
        """Score ``cfg`` for each of its schedules and syncs (``full=False``: one of each)."""
        out = []
        scheds = [x for x in cfg.schedules if x != "compact"]
        if not full:
            scheds = [x for x in ("zb-h1", "1f1b", "zb-h2", "gpipe") if x in scheds][:1]
        for sched in scheds:
            # ring and hierarchical all-reduce coincide when no stage spans nodes
            spans = any(len({self.cluster.device(d).node for d in s}) > 1 for s in cfg.layout.slots)
            for sync in self.options.syncs if spans and full else self.options.syncs[:1]:
                plan = build_plan(cfg.layout, cfg.split, cluster=self.cluster, model=self.model,
                                  global_batch=self.global_batch, microbatch_size=cfg.n, schedule=sched, sync=sync,
                                  system=self.options.system)
                cand = self.score(plan)
                if cand is not None:
                    out.append(cand)
        if full and not scheds and cfg.schedules == ("compact",) and self.forced_compacts < 2 \
                and len(cfg.layout.slots) > 1:
            # memory admits no fixed schedule here, only a compact one with fewer microbatches in flight
            self.forced_compacts += 1
            base = build_plan(cfg.layout, cfg.split, cluster=self.cluster, model=self.model,
                              global_batch=self.global_batch, microbatch_size=cfg.n, schedule="zb-h1",
                              sync=self.options.syncs[0], system=self.options.system)
            built = self.compact(base, screen=base.num_stages * base.num_microbatches
                                 > self.options.compact_max_actions, force=True)
            cand = self.score(built) if built is not None else None
            if cand is not None:
                out.append(cand)
        return out

    def refine(self, cand: Candidate) -> Candidate:
        """Hill-climb: move stage boundaries by one layer while the cost model improves.

        A compact plan's neighbours are tried with its action order (any order is valid for any
        split) and as zb-h2; the three best of them also get a compact schedule of their own
        (screening rules, while the compact budget lasts); the split it ends on gets a full
        one, if that is better."""
        best = cand
        for _ in range(max(2, 96 // max(1, 6 * (best.plan.num_stages - 1))) if best.plan.num_stages <= 8 else 2):
            plan = best.plan
            splits = [st.layer_start for st in plan.stages] + [plan.num_layers]
            trial = []
            # neighbours: one boundary moved by one or two layers, or a run of two or three
            # adjacent ones moved by one layer (long pipelines: one boundary by one layer)
            wide = plan.num_stages <= 8
            runs = [((k, k + r), step) for r in ((1, 2, 3) if wide else (1,)) for k in range(1, len(splits) - r)
                    for step in ((-2, -1, 1, 2) if r == 1 and wide else (-1, 1))]
            proxies: list[tuple[float, int, tuple[StagePlan, ...]]] = []
            for (lo, hi), step in runs:
                new = list(splits)
                for k in range(lo, hi):
                    new[k] += step
                if any(x >= y for x, y in itertools.pairwise(new)):
                    continue
                stages = tuple(StagePlan(layer_start=new[s], layer_stop=new[s + 1], devices=st.devices,
                                         shares=st.shares) for s, st in enumerate(plan.stages))
                moved = [plan.replace(stages=stages)]
                if plan.schedule == "compact":  # and zb-h2, a proxy of what a compact schedule of its own gives
                    moved.append(plan.replace(stages=stages, schedule="zb-h2", actions=()))
                work = len(moved) * (len(plan.devices) + plan.num_stages * plan.num_microbatches)
                if self.refine_used + work > self.options.refine_budget:
                    break
                self.refine_used += work
                got = [g for g in map(self.score, moved) if g is not None]
                trial += got
                if got:
                    proxies.append((min(g.estimate.iteration_s for g in got), len(proxies), stages))
            # the most promising neighbours of a compact plan get a compact schedule of their own
            for _, _, stages in sorted(proxies)[:3] if plan.schedule == "compact" else ():
                built = self.compact(plan.replace(stages=stages, schedule="zb-h1", actions=()), screen=True)
                got1 = self.score(built) if built is not None else None
                if got1 is not None:
                    trial.append(got1)
            better = min(trial, key=_rank, default=None)
            if better is None or _rank(better) >= _rank(best):
                break
            best = better
        if best is not cand and best.plan.schedule == "compact":
            rebuilt = self.compact(best.plan.replace(schedule="zb-h1", actions=()))
            got = self.score(rebuilt) if rebuilt is not None else None
            if got is not None and _rank(got) < _rank(best):
                best = got
        return best

    def compact(self, plan: Plan, *, screen: bool = False, force: bool = False) -> Plan | None:
        """``plan`` with a compact schedule, or ``None`` (a stage cannot hold one microbatch, or the
        compact budget of stages x microbatches is spent). ``screen``: with :data:`SCREEN_RULES`
        only, charged a quarter of a full build; ``force``: regardless of size and budget."""
        size = plan.num_stages * plan.num_microbatches
        charge = size / 4 if screen else size
        if not force and (size > self.options.compact_max_actions or (
                self.compact_used and self.compact_used + charge > self.options.compact_budget)):
            return None
        self.compact_used += charge
        cost = AnalyticCostModel().breakdown(plan, self.cluster, self.model)
        return compact_plan(plan, self.cluster, self.model, cost, self.tables,
                            rules=SCREEN_RULES if screen else None)


def _rank(c: Candidate) -> tuple:
    p = c.plan
    return (c.estimate.iteration_s, p.num_stages, -p.microbatch_size, SCHEDULES.index(p.schedule), p.sync,
            tuple((st.layer_start, st.devices) for st in p.stages))


def _final_rank(c: Candidate) -> tuple:
    return (round(c.score_s, 12), *_rank(c))


Hint = tuple[bool, int, int]
"""(merged, granularity, microbatch size) of a chain's best layout."""


def _chain_value(search: _Search, chain: Chain, hint: Hint | None = None) -> tuple[float, Hint | None]:
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


def _small_search(search: _Search, dist: np.ndarray) -> None:
    for chain in enumerate_chains(search.grouping, dist, search.options):
        for layout in chain_layouts(search.grouping, chain, search.max_stages):
            search.evaluate_layout(layout)


def _greedy_search(search: _Search, dist: np.ndarray) -> None:
    """Large clusters: all islands in a short order, then drop islands / slow groups while it helps.

    Moves are screened with the current best layout's neighbourhood (:func:`_chain_value` with a
    hint); the accepted move's chain is then evaluated in full.
    """
    g = search.grouping
    members = list(range(len(g.islands)))
    keep = {i: len(g.islands[i].groups) for i in members}
    chain: Chain = tuple((i, keep[i]) for i in _short_path(dist, members))
    best, hint = _chain_value(search, chain)
    if not search.options.allow_exclusion:
        return
    for i in members:  # every island alone is a cheap, useful reference
        _chain_value(search, ((i, keep[i]),))
    while len(members) > 1:
        moves: list[tuple[float, int, Chain, list[int], dict[int, int]]] = []
        for i in members:
            rest = [x for x in members if x != i]
            c: Chain = tuple((x, keep[x]) for x in _short_path(dist, rest))
            moves.append((_chain_value(search, c, hint)[0], len(rest), c, rest, keep))
            if keep[i] > 1:
                k2 = {**keep, i: keep[i] - 1}
                c = tuple((x, k2[x]) for x in _short_path(dist, members))
                moves.append((_chain_value(search, c, hint)[0], len(members), c, members, k2))
        value, _, chain, new_members, new_keep = min(moves, key=lambda m: (m[0], m[1]))
        if not value < best * (1 - 1e-3):
            break
        members, keep = new_members, new_keep
        full, full_hint = _chain_value(search, chain)
        best, hint = min(full, value), full_hint or hint


def plan_training(cluster: Cluster, model: ModelProfile, global_batch: int, *,
                  options: PlannerOptions | None = None) -> PlanResult:
    """Search the plan space for the fastest plan that fits memory. See the module docstring."""
    t0 = time.perf_counter()
    options = options or PlannerOptions()
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch must be an integer >= 1, got {global_batch!r}", field="global_batch")
    grouping = group_devices(cluster, island_threshold_s=options.island_threshold_s, speed_ratio=options.speed_ratio)
    max_stages = min(model.num_layers, options.max_stages or model.num_layers)
    search = _Search(cluster=cluster, model=model, global_batch=global_batch, options=options, grouping=grouping,
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
    cands = sorted(_dedupe(cands), key=_rank)
    refined = [search.refine(c) for c in cands[: options.refine_top]]
    cands = sorted(_dedupe(cands + refined), key=_rank)
    cands += _compacts(search, cands, ranked)
    cands = sorted(_dedupe(cands), key=_rank)
    top = _confirm(search, cands)
    best = top[0]
    explanation = _explain(search, best, cands)
    plan = best.plan.replace(estimate=best.simulated or best.estimate, explanation=tuple(explanation))
    elapsed = time.perf_counter() - t0
    log.info("planned %s on %s in %.3f s (%d candidates): %.4g s per iteration", model.name, cluster.name,
             elapsed, search.evaluated, best.score_s)
    return PlanResult(plan=plan, explanation=tuple(explanation), candidates_evaluated=search.evaluated,
                      planning_s=elapsed, top=tuple(top), grouping=grouping)


def _dedupe(cands: Iterable[Candidate]) -> list[Candidate]:
    seen: dict[tuple, Candidate] = {}
    for c in cands:
        p = c.plan
        seen.setdefault((p.stages, p.schedule, p.sync, p.actions, p.microbatch_size), c)
    return list(seen.values())


def _coverage(ranked: list[_Config]) -> list[_Config]:
    """The best configuration per stage count and per island used (so the explanation can compare)."""
    out: dict[tuple, _Config] = {}
    for cfg in ranked:
        out.setdefault(("stages", len(cfg.layout.slots)), cfg)
        for isl in cfg.layout.islands:
            out.setdefault(("island", isl), cfg)
    return list(out.values())


def _compacts(search: _Search, cands: list[Candidate], ranked: list[_Config]) -> list[Candidate]:
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
    out.sort(key=_rank)
    out += [search.refine(c) for c in out]  # all of them, as far as the budget lasts
    if bases and not search.compact_used:
        search.notes.append(f"no compact schedule built: the best pipelines exceed compact_max_actions "
                            f"{opts.compact_max_actions} (stages x microbatches)")
    return out


def _confirm(search: _Search, cands: list[Candidate]) -> list[Candidate]:
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
    return sorted(out, key=_final_rank) + cands[len(out):k] if out else cands[:1]


def _infeasible(search: _Search) -> InfeasiblePlanError:
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


# ----------------------------------------------------------------------------- explanation


def _explain(search: _Search, best: Candidate, cands: list[Candidate]) -> list[str]:
    plan, cluster = best.plan, search.cluster
    est = best.simulated or best.estimate
    out = [f"grouping: {line}" for line in search.grouping.explain()]
    out.append(f"chose {plan.num_stages} stage(s), microbatch {plan.microbatch_size} x {plan.num_microbatches}, "
               f"schedule {plan.schedule}, sync {plan.sync}: {est.iteration_s:.4g} s per iteration "
               f"({est.samples_per_s:.4g} samples/s, {est.source}; cost model {best.estimate.iteration_s:.4g} s)")
    cost = AnalyticCostModel().breakdown(plan, cluster, search.model)
    for s, st in enumerate(plan.stages):
        isl = sorted({search.grouping.island_of(d) for d in st.devices})
        out.append(f"stage {s}: layers {st.layer_start}-{st.layer_stop - 1} on {len(st.devices)} device(s) "
                   f"in {'+'.join(isl)} ({st.devices[0]}{'...' if len(st.devices) > 1 else ''}), shares "
                   f"{list(st.shares)}; F+I+W {1e3 * (cost.forward_s[s] + cost.input_grad_s[s] + cost.weight_grad_s[s]):.4g} ms "
                   f"per microbatch, all-reduce {1e3 * cost.allreduce_s[s]:.4g} ms")
    out.append(f"bottleneck (cost model): {cost.bottleneck}")
    if best.simulated is not None:
        out.append(f"bottleneck (simulator): {best.simulated.bottleneck}")
    by_stages: dict[int, Candidate] = {}
    for c in cands:
        by_stages.setdefault(c.plan.num_stages, c)
    fewer = [s for s in by_stages if s < plan.num_stages]
    more = [s for s in by_stages if s > plan.num_stages]
    near = ([max(fewer)] if fewer else []) + ([min(more)] if more else [])
    alt = [f"{s} stage(s): {by_stages[s].estimate.iteration_s:.4g} s ({_pct(by_stages[s], best)})" for s in near]
    if alt:
        out.append(f"why {plan.num_stages} stage(s): best cost-model estimate with " + "; ".join(alt))
    out += _left_out(search, best, cands)
    out += [f"note: {n}" for n in search.notes]
    return out


def _pct(c: Candidate, best: Candidate) -> str:
    return f"{100 * (c.estimate.iteration_s / best.estimate.iteration_s - 1):+.1f}%"


def _best_adding(search: _Search, plan: Plan, missing: list[str], cands: list[Candidate]) -> Candidate | None:
    """The best plan using every chosen device and some of ``missing``: among those scored, and
    the three best such configurations of step 1 (scored now with one schedule)."""
    chosen, extra = set(plan.devices), set(missing)
    def adds(devs: Iterable[str]) -> bool:
        devs = set(devs)
        return chosen <= devs and bool(devs & extra)
    found = [c for c in cands if adds(c.plan.devices)][:1]
    # layouts the lower bound pruned never got a split: give the first few one now, unpruned
    saved, search.best_closed_form = search.best_closed_form, _INF
    for lay in [x for x in search.layouts_seen.values() if adds(x.devices)][:8]:
        search.evaluate_layout(lay)
    search.best_closed_form = saved
    configs = [cfg for cfg in sorted(search.configs.values(), key=lambda c: c.key) if adds(cfg.layout.devices)]
    for cfg in configs[:3]:  # the closed form ranks configurations roughly: score a few
        found += search.plans_for(cfg, full=False)
    return min(found, key=_rank, default=None)


def _left_out(search: _Search, best: Candidate, cands: list[Candidate]) -> list[str]:
    plan, cluster, g = best.plan, search.cluster, search.grouping
    used = set(plan.devices)
    out = []
    for isl in g.islands:
        missing = [d for d in isl.devices if d not in used]
        if not missing:
            continue
        what = (f"island {isl.name}" if len(missing) == len(isl.devices)
                else f"{len(missing)} slower device(s) of island {isl.name}")
        line = f"left out {what} ({len(missing)} device(s): {', '.join(missing[:4])}{'...' if len(missing) > 4 else ''})"
        with_it = _best_adding(search, plan, missing, cands)
        if with_it is not None:
            line += (f": the best plan that adds them to the chosen devices estimates "
                     f"{with_it.estimate.iteration_s:.4g} s vs {best.estimate.iteration_s:.4g} s without "
                     f"({_pct(with_it, best)})")
        else:
            line += ": no plan adding them fits memory"
        if plan.devices and len(missing) == len(isl.devices):
            near = min(plan.devices, key=lambda d: distance_s(cluster.link(d, missing[0])))
            link = cluster.link(near, missing[0])
            line += (f"; its best link to the plan, {near}->{missing[0]}: {fmt_rate(link.bandwidth_bytes_per_s)}, "
                     f"{link.latency_s * 1e3:.3g} ms")
        else:
            slow = min(missing, key=cluster.effective_flops_per_s)
            fast = max(plan.devices, key=cluster.effective_flops_per_s)
            line += (f"; {slow} runs at {cluster.effective_flops_per_s(slow) / 1e12:.3g} TFLOP/s vs "
                     f"{cluster.effective_flops_per_s(fast) / 1e12:.3g} for {fast}")
        out.append(line)
    return out
