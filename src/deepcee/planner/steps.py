"""The search's shared state and its steps 1-3 (see [Note: search] in :mod:`deepcee.planner.search`).

Torch-free. :class:`SearchState` holds what one :func:`~deepcee.planner.search.plan_training`
call learns as it goes (closed-form configurations, DP tables, scored plans, budgets used) and
runs the steps on it: :meth:`~SearchState.evaluate_layout` (step 1: the layer split of every
microbatch size by the DP and its closed form), :meth:`~SearchState.sweep` (step 2: the
fill-minimising DP), :meth:`~SearchState.plans_for` and :meth:`~SearchState.score` (step 3:
plans scored by the cost model), :meth:`~SearchState.refine` and :meth:`~SearchState.compact`.
:class:`Candidate` is one scored plan; :func:`rank_key` and :func:`final_rank_key` order them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepcee.cluster import Cluster
from deepcee.plan import SCHEDULES, Estimate, Plan, StagePlan
from deepcee.planner.cost_model import AnalyticCostModel, CostModel
from deepcee.planner.grouping import Grouping
from deepcee.planner.ranges import RangeTables, largest_remainder_shares
from deepcee.planner.space import (
    SCREEN_RULES,
    StageLayout,
    build_plan,
    compact_plan,
    in_flight_counts,
)
from deepcee.planner.split import BoundaryArrays, SplitTables, boundary_arrays, split_layers
from deepcee.profile import ModelProfile

if TYPE_CHECKING:
    from deepcee.planner.search import PlannerOptions

_INF = math.inf


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


@dataclass(slots=True)
class Config:
    """One closed-form result of step 1 or 2: a layout, microbatch size and layer split, for the
    schedules whose in-flight counts that split fits; ``key`` ranks it (closed form, then order found)."""

    layout: StageLayout
    n: int
    split: tuple[int, ...]
    schedules: tuple[str, ...]
    closed_form_s: float
    key: tuple = ()


@dataclass(slots=True)
class SearchState:
    """What one planning call has learned so far, and the steps that add to it (module docstring)."""

    cluster: Cluster
    model: ModelProfile
    global_batch: int
    options: PlannerOptions
    grouping: Grouping
    tables: RangeTables
    cost_model: CostModel
    sizes: list[int]
    max_stages: int
    configs: dict[tuple, Config] = field(default_factory=dict)
    dp_tables: dict[tuple, SplitTables] = field(default_factory=dict)
    bounds: dict[tuple, BoundaryArrays] = field(default_factory=dict)
    scored: dict[tuple, Candidate | None] = field(default_factory=dict)
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

    def dp_inputs(self, layout: StageLayout, n: int) -> SplitTables:
        key = (layout.slots, n)
        got = self.dp_tables.get(key)
        if got is None:
            shares = [self.shares(s, n) for s in layout.slots]
            costs = [self.tables.costs(s, sh) for s, sh in zip(layout.slots, shares, strict=True)]
            bounds = []
            for s in range(1, len(layout.slots)):
                bkey = (layout.slots[s - 1], layout.slots[s], n)
                if bkey not in self.bounds:
                    self.bounds[bkey] = boundary_arrays(self.cluster, self.tables, layout.slots[s - 1], shares[s - 1],
                                                        layout.slots[s], shares[s])
                bounds.append(self.bounds[bkey])
            got = self.dp_tables[key] = SplitTables(costs=costs, bounds=bounds, m=self.global_batch // n)
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
            self.configs[key] = Config(layout=layout, n=n, split=split, schedules=scheds, closed_form_s=cf,
                                        key=(cf, len(self.configs)))

    # -- step 2 ---------------------------------------------------------------------------
    def sweep(self, cfg: Config) -> None:
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

    def plans_for(self, cfg: Config, *, full: bool = True) -> list[Candidate]:
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
            better = min(trial, key=rank_key, default=None)
            if better is None or rank_key(better) >= rank_key(best):
                break
            best = better
        if best is not cand and best.plan.schedule == "compact":
            rebuilt = self.compact(best.plan.replace(schedule="zb-h1", actions=()))
            got = self.score(rebuilt) if rebuilt is not None else None
            if got is not None and rank_key(got) < rank_key(best):
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


def rank_key(c: Candidate) -> tuple:
    p = c.plan
    return (c.estimate.iteration_s, p.num_stages, -p.microbatch_size, SCHEDULES.index(p.schedule), p.sync,
            tuple((st.layer_start, st.devices) for st in p.stages))


def final_rank_key(c: Candidate) -> tuple:
    return (round(c.score_s, 12), *rank_key(c))
