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

from deepcee.cluster import Cluster
from deepcee.plan import SCHEDULES, Estimate, Plan, StagePlan
from deepcee.planner.chains import ChainResult
from deepcee.planner.cost_model import (
    EXACT_WORK,
    AnalyticCostModel,
    CostModel,
    SimulatorCostModel,
    stage_costs,
)
from deepcee.planner.grouping import Grouping
from deepcee.planner.options import PlannerOptions
from deepcee.planner.ranges import RangeTables, largest_remainder_shares, syncs_differ
from deepcee.planner.space import (
    FUSED_BACKWARD,
    SCREEN_RULES,
    Chain,
    StageLayout,
    build_plan,
    compact_plan,
    schedule_in_flight,
)
from deepcee.planner.split import (
    BoundaryArrays,
    SplitTables,
    boundary_arrays,
    in_flight_split,
    split_layers,
)
from deepcee.profile import ModelProfile

_INF = math.inf
SCREEN_MARGIN = 0.05
"""A screened configuration is scored in full only with the schedules the screen rates within this
of its best and of the best plan scored so far ([Note: screening]; the extrapolation was within
4.4% of the full figure on the WAN instances of ``benchmarks/planner_at_scale.py``)."""
SCREEN_SCHEDULES = ("zb-h1", "1f1b", "zb-h2", "gpipe")
"""The fixed schedules a configuration is screened with (those it admits)."""


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
    recompute: tuple[bool, ...] = ()
    """Per stage, activation recomputation (empty: only where a stage does not fit without it)."""
    screened: dict[str, float] = field(default_factory=dict)
    """Per fixed schedule, the screen's extrapolated iteration time ([Note: screening]; empty: not
    screened, or screened by scoring in full)."""

    @property
    def ident(self) -> tuple:
        """Its key in :attr:`SearchState.configs`: layout, microbatch size, split, recomputation."""
        return (self.layout.slots, self.n, self.split, self.recompute)


# [Note: sync variants]
# The search scores both syncs (ring and hierarchical all-reduce) for the configurations it lays
# out itself (:meth:`SearchState.plans_for`, where a stage spans nodes), but several paths made a
# plan with one sync and never scored the other: a compact schedule took its base plan's sync, a
# layout polish climb kept its start's for every move, a counterfactual search scored one sync
# only. On 60 mixed clusters of ``benchmarks/planner_mixed.py`` (seeds 240-299, session 29) the
# independent reference beat deepcee by more than 2% four times, twice by that one move of its
# polish: seed 243, a compact plan with a stage of 12 devices on 5 servers over a 1 Gbit/s LAN, 9.956 s
# with ring all-reduce and 9.640 s with hierarchical (by the cost model and the simulator alike);
# seed 270, 13.695 s against 13.280 s, a counterfactual search's plan. Any action order is valid
# with either sync, so, where the syncs differ on a plan's stages (:func:`syncs_differ`), each
# compact plan is scored with every sync, a climb has the other syncs among its moves ([Note: sync
# move] in :mod:`deepcee.planner.polish`), a counterfactual search scores its answer with them,
# and the plans about to be simulated (``_confirm`` in :mod:`deepcee.planner.search`) are joined
# by their variants the cost model rates faster.


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
    grains: tuple[int, ...] = ()
    """Granularities the granularity climbs use beside the powers of two: the fed look's while it
    runs, else none ([Note: fed granularities] in :mod:`deepcee.planner.space`)."""
    configs: dict[tuple, Config] = field(default_factory=dict)
    dp_tables: dict[tuple, SplitTables] = field(default_factory=dict)
    bounds: dict[tuple, BoundaryArrays] = field(default_factory=dict)
    scored: dict[tuple, Candidate | None] = field(default_factory=dict)
    evaluated: int = 0
    layouts_seen: dict[tuple, StageLayout] = field(default_factory=dict)
    layout_values: dict[tuple, tuple[float, int]] = field(default_factory=dict)
    """Step 1's result of each (layout, microbatch sizes) evaluated and not pruned."""
    best_closed_form: float = _INF
    min_boundary_bytes: float = 0.0
    _marginal: dict[str, float] = field(default_factory=dict)
    _one: dict[str, float] = field(default_factory=dict)
    _shares: dict[tuple, tuple[int, ...]] = field(default_factory=dict)
    _analytic: AnalyticCostModel | None = None
    notes: list[str] = field(default_factory=list)
    compact_used: float = 0.0
    forced_compacts: int = 0
    large_compacts: int = 0
    score_used: int = 0
    """Stages x microbatches timed by the cost model so far (see ``PlannerOptions.score_budget``)."""
    refine_used: int = 0
    screen_used: int = 0
    """Stages x microbatches of the shortened plans the screening timed ([Note: screening])."""
    best_scored_s: float = math.inf
    """The cost model's best iteration time of the plans scored so far."""
    swept: set[tuple] = field(default_factory=set)
    """Configurations step 2 ran on (the explanation's constrained searches come back to them)."""
    compacts: dict[tuple, Plan | None] = field(default_factory=dict)
    """Compact schedules built, by (stages, microbatch size, sync, screened)."""
    second_look: list[Config] = field(default_factory=list)
    """Configurations of the guarded granularity climbs, taken back from the main search and
    searched on their own after it ([Note: second look] in :mod:`deepcee.planner.search`)."""
    walk_look: list[Config] = field(default_factory=list)
    """Configurations of the chain walk's chain, taken back from the main search and searched on
    their own after it, as the second look's ([Note: chain search] in
    :mod:`deepcee.planner.chains`)."""
    climbed: list[Chain] = field(default_factory=list)
    """The chains whose granularities the main search climbed."""
    best_chains: list[Chain] = field(default_factory=list)
    """The main search's best chains (closed form), laid out with every microbatch size."""
    count_look: list[tuple[str, list[Config]]] = field(default_factory=list)
    """The count look's sets of configurations, each with where it came from (the stage-count
    search on the climbed chains; a chain search with stages in proportion to speed), taken back
    from the main search and each searched on its own after it, as the second look's ([Note:
    stage counts] in :mod:`deepcee.planner.grains`)."""
    _pipes: dict[tuple, float] = field(default_factory=dict)
    chain_result: ChainResult | None = None
    """What the chain search did (see [Note: chain search])."""
    chain_moves: int = 0
    """Chains evaluated by the local search (clusters of more than ``exhaustive_islands`` islands)."""
    chain_walk: int = 0
    """Chains evaluated by the chain walk after a budget-stopped chain search ([Note: chain search])."""
    pieces: dict[tuple, tuple] = field(default_factory=dict)
    """Each island's stages per (island, groups kept, merged, granularity): the memo of
    :func:`~deepcee.planner.space.chain_layouts` (chains share islands)."""
    polish_used: int = 0
    """Stages x microbatches the layout polish timed ([Note: layout polish])."""
    polish_steps: int = 0
    """Moves the layout polish took."""
    confirmed: dict[tuple, Estimate] = field(default_factory=dict)
    """The confirming model's estimates so far, by plan (a plan confirmed, then explained, or
    explained twice, is simulated once)."""

    def analytic(self) -> AnalyticCostModel:
        """An :class:`AnalyticCostModel` with the defaults (the explanation's breakdown): the
        search's own where it is one (its memo of stage terms is warm), else one kept for the
        search. The figures are the same either way."""
        if self._analytic is None:
            own = self.cost_model
            same = type(own) is AnalyticCostModel and own.runtime is None and own.exact_work == EXACT_WORK
            self._analytic = own if same else AnalyticCostModel()
        return self._analytic

    def confirm(self, plan: Plan) -> Estimate:
        """The confirming model's estimate of ``plan`` (the simulator by default), computed once."""
        key = plan_key(plan)
        got = self.confirmed.get(key)
        if got is None:
            scorer = self.options.confirm_model or SimulatorCostModel()
            got = self.confirmed[key] = scorer.estimate(plan, self.cluster, self.model)
            self.evaluated += 1
        return got

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
            got = self.dp_tables[key] = SplitTables(costs=costs, bounds=bounds, m=self.global_batch // n,
                                                    recompute=self.options.recompute,
                                                    greedy_actions=self.options.compact_max_actions)
        return got

    def lower_bound(self, layout: StageLayout) -> float:
        """No split of ``layout`` beats this: all samples over the summed device speed, or the
        smallest boundary's bytes over the summed bandwidth of the link resources it can use."""
        bound = self.global_batch / sum(1.0 / self.marginal_s(d) for d in layout.devices)
        for a, b in zip(layout.slots, layout.slots[1:], strict=False):
            bound = max(bound, self.global_batch * self.min_boundary_bytes / self.pipe_bandwidth(a, b))
        return bound

    def one_sample_s(self, device: str) -> float:
        """Seconds one sample's forward and input-gradient passes take through the whole model on
        ``device`` (fixed costs included): no plan's iteration is shorter than its fastest
        device's, since a sample is not split between devices and these passes follow one another
        layer by layer (weight gradients can run beside them, so they are left out)."""
        got = self._one.get(device)
        if got is None:
            kind, slow, m = self.cluster.kind_of(device), self.cluster.device(device).slowdown, self.model
            got = self._one[device] = sum(m.time_s(0, m.num_layers, p, 1, kind, slow) for p in "FI")
        return got

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

    def sizes_near(self, factor: int) -> list[int] | None:
        """Microbatch sizes within ``factor`` of the best configuration's so far (``None``: all)."""
        if not self.configs:
            return None
        n = min(self.configs.values(), key=lambda c: c.key).n
        return [x for x in self.sizes if n / factor <= x <= n * factor]

    def granularity_near(self) -> float | None:
        """The most devices per stage of the best configuration's layout so far."""
        if not self.configs:
            return None
        return max(1, min(self.configs.values(), key=lambda c: c.key).layout.granularity)

    def evaluate_layout(self, layout: StageLayout, sizes: Sequence[int] | None = None) -> tuple[float, int]:
        """Step 1 for every microbatch size (or ``sizes``); the best closed form and its size
        (``inf`` if nothing fits or the layout cannot beat the best so far)."""
        self.layouts_seen.setdefault(layout.slots, layout)
        best, best_n = _INF, 0
        stages = len(layout.slots)
        memo = (layout.slots, None if sizes is None else tuple(sizes))
        if memo in self.layout_values:
            return self.layout_values[memo]  # its configurations are already in self.configs
        if stages > self.model.num_layers or self.lower_bound(layout) >= self.best_closed_form:
            return best, best_n
        for n in self.sizes if sizes is None else sizes:
            if n < max(len(s) for s in layout.slots):
                continue
            for split, scheds, cf in self._splits(layout, n):
                self.add_config(layout, n, split, scheds, cf)
                if cf < best:
                    best, best_n = cf, n
        self.best_closed_form = min(self.best_closed_form, best)
        self.layout_values[memo] = (best, best_n)
        return best, best_n

    def _splits(self, layout: StageLayout, n: int) -> list[tuple[tuple[int, ...], tuple[str, ...], float]]:
        """The bottleneck DP's splits of ``layout`` at microbatch size ``n``: one under the loosest
        memory limit (one microbatch in flight), shared by the schedules whose in-flight counts it
        meets (it is optimal for them too), and one per other in-flight vector; each with its
        closed form, the best over its schedules (whose in-flight limits differ)."""
        tab = self.dp_inputs(layout, n)
        stages = len(layout.slots)
        loose = split_layers(tab.loads(None), tab.link_loads())
        if loose is None:
            return []
        pending: dict[tuple[int, ...] | None, list[str]] = {}
        shared = []
        for sched in self.options.schedules:
            if sched == "compact" and stages < 2:
                continue
            in_flight = schedule_in_flight(sched, stages, tab.m)
            (shared.append(sched) if in_flight is None or tab.fits(loose[1], in_flight)
             else pending.setdefault(in_flight, []).append(sched))
        results = [(loose[1], shared)] if shared else []
        for in_flight, scheds in pending.items():
            got = split_layers(tab.loads(in_flight), tab.link_loads())
            if got is not None:
                results.append((got[1], scheds))
        return [(split, tuple(scheds), self.closed_form(tab, split, scheds)) for split, scheds in results]

    def closed_form(self, tab: SplitTables, split: Sequence[int], scheds: Sequence[str],
                    flags: Sequence[bool] | None = None) -> float:
        """The best closed form of ``split`` over ``scheds`` (each with its own in-flight limits)."""
        stages = len(split) - 1
        out = _INF
        for sched in scheds:
            in_flight = schedule_in_flight(sched, stages, tab.m)
            out = min(out, tab.closed_form(split, tab.loads(in_flight), in_flight, fused=sched in FUSED_BACKWARD,
                                           flags=flags))
        return out

    def add_config(self, layout: StageLayout, n: int, split: tuple[int, ...], scheds: tuple[str, ...],
                   cf: float, recompute: tuple[bool, ...] = ()) -> None:
        self.evaluated += 1
        if not math.isfinite(cf):
            return
        key = (layout.slots, n, split, recompute)
        old = self.configs.get(key)
        if old is None:
            self.configs[key] = Config(layout=layout, n=n, split=split, schedules=scheds, closed_form_s=cf,
                                       key=(cf, len(self.configs)), recompute=recompute)
            return
        # one configuration per split: the union of the schedules it fits, the best closed form
        old.schedules = tuple(x for x in SCHEDULES if x in old.schedules or x in scheds)
        if cf < old.closed_form_s:
            old.closed_form_s, old.key = cf, (cf, old.key[1])

    # -- step 2 ---------------------------------------------------------------------------
    SWEEP_FACTORS = (1.0, 1.08, 1.25, 1.6, 2.5)
    """Bottleneck budgets of step 2, as multiples of the bottleneck DP's optimum."""

    def sweep(self, cfg: Config) -> None:
        """Step 2: the in-flight-aware DP (:func:`~deepcee.planner.split.in_flight_split`) for
        each in-flight class of the configuration's schedules and each budget of :data:`SWEEP_FACTORS`."""
        key = (cfg.layout.slots, cfg.n, cfg.split, cfg.recompute, cfg.schedules)
        if key in self.swept:
            return  # its configurations are already in self.configs
        self.swept.add(key)
        tab = self.dp_inputs(cfg.layout, cfg.n)
        stages = len(cfg.layout.slots)
        classes: dict[tuple, list[str]] = {}
        for sched in self.options.schedules:
            if sched == "compact" and stages < 2:
                continue
            in_flight = schedule_in_flight(sched, stages, tab.m)
            classes.setdefault((in_flight, sched in FUSED_BACKWARD), []).append(sched)
        for (in_flight, fused), scheds in classes.items():
            first = split_layers(tab.loads(in_flight), tab.link_loads())
            if first is None:
                continue
            seen: set[tuple] = set()
            for factor in self.SWEEP_FACTORS:
                got = in_flight_split(tab, first[0] * factor * (1 + 1e-12), in_flight, fused=fused)
                if got is None or (got[1], got[2]) in seen:
                    continue
                seen.add((got[1], got[2]))
                cf = self.closed_form(tab, got[1], scheds, got[2])
                self.add_config(cfg.layout, cfg.n, got[1], tuple(scheds), cf, got[2])

    # -- step 3 ---------------------------------------------------------------------------
    def score(self, plan: Plan, *, screen: bool = False, force: bool = False) -> Candidate | None:
        """The cost model's figure of ``plan`` (``None``: does not fit memory, or over budget),
        charged to ``score_budget`` (``screen``: to ``screen_budget``, never over it; ``force``:
        neither, the caller keeps its own budget, as the layout polish does)."""
        key = score_key(plan)
        if key in self.scored:
            return self.scored[key]
        work = plan.num_stages * plan.num_microbatches
        if force:
            pass
        elif screen:
            if self.screen_used + work > self.options.screen_budget:
                return None
            self.screen_used += work
        elif self.score_used + work > self.options.score_budget and math.isfinite(self.best_scored_s):
            # over budget: not scored (and not cached, a cheaper path may come back); until a plan
            # that fits is scored the budget does not bind (scores of plans that do not fit could
            # otherwise spend it all, and the search would say that no plan fits)
            return None
        else:
            self.score_used += work
        self.evaluated += 1
        est = self.cost_model.estimate(plan, self.cluster, self.model)
        fits = all(b <= self.cluster.memory_bytes(d) for d, b in est.peak_memory_bytes.items())
        cand = Candidate(plan=plan, estimate=est) if fits else None
        self.scored[key] = cand
        if cand is not None:
            self.best_scored_s = min(self.best_scored_s, est.iteration_s)
        return cand

    def sync_variants(self, cand: Candidate) -> list[Candidate]:
        """``cand``'s plan with each other sync, scored (with ``force``: a few plans, charged to no
        budget), where the syncs differ on its stages (:func:`~deepcee.planner.ranges.syncs_differ`);
        those that fit. See [Note: sync variants]."""
        plan = cand.plan
        if not syncs_differ(self.cluster, [st.devices for st in plan.stages]):
            return []
        out = []
        for sync in self.options.syncs:
            if sync != plan.sync and (got := self.score(plan.replace(sync=sync, estimate=None), force=True)):
                out.append(got)
        return out

    def screen(self, cfg: Config, sched: str, *, lazy: bool = False) -> float:
        """The cost model's iteration time of ``cfg``'s plan with schedule ``sched``; with many
        microbatches extrapolated from two shorter iterations and kept in ``cfg.screened``
        ([Note: screening]). ``inf``: does not fit, or over budget (``screen_budget``; ``lazy``,
        in step 3: then ``score_budget``, as a screen costs a fraction of the full score it can
        save)."""
        if sched in cfg.screened:
            return cfg.screened[sched]
        tab = self.dp_inputs(cfg.layout, cfg.n)
        stages = len(cfg.layout.slots)
        plan = self._plan(cfg, sched, self.options.syncs[0])
        short = (2 * stages, 4 * stages)
        if tab.m <= 2 * short[1]:
            got = self.score(plan, screen=True)  # about as cheap as the two short ones: the real figure
            return _INF if got is None else got.estimate.iteration_s
        work = stages * sum(short)
        if self.screen_used + work <= self.options.screen_budget:
            self.screen_used += work
        elif lazy and self.score_used + work <= self.options.score_budget:
            self.score_used += work
        else:
            return _INF
        times = []
        for m in short:
            est = self.cost_model.estimate(plan.replace(global_batch=cfg.n * m, num_microbatches=m),
                                           self.cluster, self.model)
            times.append(_INF if est.exceeds_memory(self.cluster.memory_bytes) else est.iteration_s)
        got = times[0] + (tab.m - short[0]) * (times[1] - times[0]) / (short[1] - short[0])
        cfg.screened[sched] = got if all(map(math.isfinite, times)) else _INF
        return cfg.screened[sched]

    def _plan(self, cfg: Config, sched: str, sync: str, flags: tuple[bool, ...] | None = None) -> Plan:
        """``cfg``'s plan with ``sched`` and ``sync``, recomputing where ``flags`` say (default: where
        ``cfg`` says, else where the schedule's microbatches in flight need it)."""
        if flags is None:
            tab = self.dp_inputs(cfg.layout, cfg.n)
            flags = cfg.recompute or tab.recompute_flags(cfg.split, schedule_in_flight(sched, len(cfg.split) - 1, tab.m))
        return build_plan(cfg.layout, cfg.split, cluster=self.cluster, model=self.model, global_batch=self.global_batch,
                          microbatch_size=cfg.n, schedule=sched, sync=sync, system=self.options.system, recompute=flags)

    def plans_for(self, cfg: Config, *, full: bool = True) -> list[Candidate]:
        """Score ``cfg`` for each of its schedules and syncs (``full=False``: one of each). With
        many microbatches (``full``) each schedule is screened first, and only those the screen
        rates within :data:`SCREEN_MARGIN` of the configuration's best and of the best plan scored
        so far are scored in full ([Note: screening])."""
        out = []
        scheds = [x for x in cfg.schedules if x != "compact"]
        if full:
            for x in scheds:
                self.screen(cfg, x, lazy=True)
            known = {x: cfg.screened[x] for x in scheds if x in cfg.screened}  # extrapolated ones
            if known:
                bar = min(min(known.values()), self.best_scored_s) * (1 + SCREEN_MARGIN)
                # best first; a schedule the budget left unscreened is scored after them
                scheds = sorted((x for x in scheds if known.get(x, -_INF) <= bar),
                                key=lambda x: (x not in known, known.get(x, 0.0)))
        else:
            scheds = [x for x in SCREEN_SCHEDULES if x in scheds][:1]
        # ring and hierarchical all-reduce coincide when no stage spans nodes
        spans = any(len({self.cluster.device(d).node for d in s}) > 1 for s in cfg.layout.slots)
        for sched in scheds:
            for sync in self.options.syncs if spans and full else self.options.syncs[:1]:
                cand = self.score(self._plan(cfg, sched, sync))
                if cand is not None:
                    out.append(cand)
        if full and not scheds and cfg.schedules == ("compact",) and self.forced_compacts < 2 \
                and len(cfg.layout.slots) > 1:
            # memory admits no fixed schedule here, only a compact one with fewer microbatches in flight
            self.forced_compacts += 1
            flags = cfg.recompute or self.dp_inputs(cfg.layout, cfg.n).recompute_flags(cfg.split, None)
            base = self._plan(cfg, "zb-h1", self.options.syncs[0], flags)
            built = self.compact(base, screen=base.num_stages * base.num_microbatches
                                 > self.options.compact_max_actions, force=True)
            cand = self.score(built) if built is not None else None
            if cand is not None:
                out.append(cand)
        return out

    def refine(self, cand: Candidate, *, first: bool = False) -> Candidate:
        """Hill-climb: move stage boundaries by one layer while the cost model improves.

        A compact plan's neighbours are *guided* by proxies: its action order on the moved split
        (any order is valid for any split) or zb-h2, and a compact schedule built with the
        screening rules for the most promising; only plans of the plan space are returned: a
        compact schedule built in full for each split a climb ends on, or a neighbour as zb-h2.
        (A compact plan's actions are always the builder's for its own split and costs, so an
        exhaustive search that builds them per split covers every plan returned here.)

        A compact plan climbs twice: once following the built schedules only (the plan space's
        own values: a moved order can beat what the builder makes of its split, and a climb on
        such values stopped one boundary short of splits whose own schedules are faster,
        testbed/resnet101/128), once following every guide (which reaches other splits,
        random3/analytic); the better end wins. ``first`` (the best compact plan): ``refine_best_guides``
        neighbours get a built schedule per step (else three), whatever the compact budget (the
        steps are bounded), so its climb never stops for want of budget."""
        if cand.plan.schedule != "compact":
            return self._climb(cand, first=first, built_only=True)
        return min((self._climb(cand, first=first, built_only=b) for b in (True, False)), key=rank_key)

    def _climb(self, cand: Candidate, *, first: bool, built_only: bool) -> Candidate:
        """One climb of :meth:`refine`: the best plan of the space it found."""
        best, cursor = cand, cand
        compact = cand.plan.schedule == "compact"
        for _ in range(max(2, 96 // max(1, 6 * (cand.plan.num_stages - 1))) if cand.plan.num_stages <= 8 else 2):
            plan = cursor.plan
            trial, guide = self._neighbours(plan)
            built_guides = []
            forced = first and self.options.refine_best_guides > 0
            for _, _, stages, _ in sorted(guide)[: self.options.refine_best_guides if forced else 3] if compact else ():
                built = self.compact(plan.replace(stages=stages, schedule="zb-h1", actions=()), screen=True,
                                     force=forced)
                got1 = self.score(built) if built is not None else None
                if got1 is not None:  # the next step moves this order (fitted to the split), not the old one
                    built_guides.append((got1.estimate.iteration_s, len(guide) + len(built_guides), stages,
                                         got1.plan.actions))
            guide = (built_guides or guide) if built_only else guide + built_guides
            real = min((c for c in trial if c.plan.schedule != "compact"), key=rank_key, default=None)
            if real is not None and rank_key(real) < rank_key(best):
                best = real
            if compact:
                if not guide:
                    break
                value, _, stages, actions = min(guide)
                if value >= cursor.estimate.iteration_s * (1 - 1e-12):
                    break
                cursor = Candidate(plan=plan.replace(stages=stages, actions=actions),
                                   estimate=Estimate(iteration_s=value, samples_per_s=0.0))
            elif real is None or rank_key(real) >= rank_key(cursor):
                break
            else:
                cursor = real
        if compact and cursor is not cand:
            # always built (budget or not): the climb's result is only a plan of the space built in full
            rebuilt = self.compact(cursor.plan.replace(schedule="zb-h1", actions=()), force=True)
            got = self.score(rebuilt) if rebuilt is not None else None
            if got is not None and rank_key(got) < rank_key(best):
                best = got
        return best

    def _neighbours(self, plan: Plan) -> tuple[list[Candidate], list[tuple[float, int, tuple[StagePlan, ...], tuple]]]:
        """Scored neighbours of ``plan`` (one boundary moved by one or two layers, or a run of two
        or three adjacent ones by one; long pipelines: one boundary by one layer), within the
        refine budget; for a compact plan, also (time, order, stages) guides of its order moved."""
        splits = [st.layer_start for st in plan.stages] + [plan.num_layers]
        wide = plan.num_stages <= 8
        runs = [((k, k + r), step) for r in ((1, 2, 3) if wide else (1,)) for k in range(1, len(splits) - r)
                for step in ((-2, -1, 1, 2) if r == 1 and wide else (-1, 1))]
        trial: list[Candidate] = []
        guide: list[tuple[float, int, tuple[StagePlan, ...], tuple]] = []
        for (lo, hi), step in runs:
            new = list(splits)
            for k in range(lo, hi):
                new[k] += step
            if any(x >= y for x, y in itertools.pairwise(new)):
                continue
            stages = tuple(StagePlan(layer_start=new[s], layer_stop=new[s + 1], devices=st.devices,
                                     shares=st.shares, recompute=st.recompute) for s, st in enumerate(plan.stages))
            moved = [plan.replace(stages=stages)]
            if plan.schedule == "compact":
                moved.append(plan.replace(stages=stages, schedule="zb-h2", actions=()))
            work = len(moved) * (len(plan.devices) + plan.num_stages * plan.num_microbatches)
            if self.refine_used + work > self.options.refine_budget:
                break
            self.refine_used += work
            got = [self.score(x) for x in moved]
            trial += [g for g in got if g is not None]
            if plan.schedule == "compact" and got[0] is not None:
                # its order moved to the split: the guide ranks neighbours by it
                guide.append((got[0].estimate.iteration_s, len(guide), stages, plan.actions))
        return trial, guide

    def compact(self, plan: Plan, *, screen: bool = False, force: bool = False) -> Plan | None:
        """``plan`` with a compact schedule, or ``None`` (a stage cannot hold one microbatch, or the
        compact budget of stages x microbatches is spent). ``screen``: with :data:`SCREEN_RULES`
        only, charged a quarter of a full build; ``force``: regardless of budget. Above
        ``compact_max_actions`` stages x microbatches only the builder's templates are tried
        (``rules=()``, linear in the size): the compact schedule of such a plan, by definition
        of the plan space."""
        key = (plan.stages, plan.microbatch_size, plan.sync, screen)
        if key in self.compacts:
            return self.compacts[key]  # built before (same stages, costs and limits: same schedule)
        size = plan.num_stages * plan.num_microbatches
        large = size > self.options.compact_max_actions
        charge = 0 if large else size / 4 if screen else size
        if not force and ((large and self.large_compacts >= 2) or (
                self.compact_used and self.compact_used + charge > self.options.compact_budget)):
            return None
        self.compact_used += charge
        self.large_compacts += large
        cost = stage_costs(plan, self.cluster, self.model)
        got = self.compacts[key] = compact_plan(plan, self.cluster, self.model, cost, self.tables,
                                                rules=() if large else SCREEN_RULES if screen else None)
        return got


def plan_key(plan: Plan) -> tuple:
    """A plan's identity in the search's memos of simulations and candidates: its stages
    (devices, layers, shares, recomputation), schedule, sync, action order and microbatch size."""
    return (plan.stages, plan.schedule, plan.sync, plan.actions, plan.microbatch_size)


def score_key(plan: Plan) -> tuple:
    """A plan's identity in :attr:`SearchState.scored` (:func:`plan_key` without the microbatch size)."""
    return (plan.stages, plan.schedule, plan.sync, plan.actions)


def rank_key(c: Candidate) -> tuple:
    p = c.plan
    return (c.estimate.iteration_s, p.num_stages, -p.microbatch_size, SCHEDULES.index(p.schedule), p.sync,
            tuple((st.layer_start, st.devices) for st in p.stages))


def final_rank_key(c: Candidate) -> tuple:
    return (round(c.score_s, 12), *rank_key(c))
