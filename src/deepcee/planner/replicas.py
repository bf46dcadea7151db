"""The relaxed search: replica layouts x strategies, scored by the simulator, judged by time to target.

Torch-free. Entry point: :func:`plan_replicas` (``plan_with_sync(..., sync="relaxed")`` and
``deepcee plan --sync relaxed`` call it; ``--objective cost`` calls it for exact plans too).

[Note: relaxed search]
1. The exact plan: today's search on the whole cluster (:func:`deepcee.planner.search.plan_training`).
2. Blocks: sets of network islands (:mod:`deepcee.planner.grouping`): every non-empty subset
   with at most ``exhaustive_islands`` islands; above, each island, all of them, and all but
   one. Each block gets the best pipeline on its devices by the existing search (lighter
   effort), at a given batch, cached.
3. Layouts: every partition into two or more blocks of every set of two or more islands,
   one replica per block (above ``exhaustive_islands``: one replica per island of each set). Replica batches: first in proportion to each block's FLOP/s,
   then, re-planned, in proportion to each block's planned samples/s (so replicas finish
   their local steps together); replicas fastest first (the averaging root sits in replica 0).
   Only the best ``full_layouts`` layouts by a screen on the first, rough pipelines are
   re-planned ([Note: layout screen]).
4. Strategies on every layout: ``exact`` with ring, hierarchical or parameter-server sync
   (HeteroG/Cloudless-style replicas that stay synchronous), model averaging for each period
   H and outer optimizer (plain; DiLoCo's Nesterov with lr 0.7, momentum 0.9), blocking and
   overlapped (applied one period late: [Note: overlapped averaging] in
   :mod:`deepcee.runtime.overlap`; its statistical efficiency in :mod:`.efficiency`), ASGD-GA for
   each accumulation k and staleness bound, partial averaging for each full-sync interval P
   (window: a fraction of the replicas' mean local step, groups of two or more). Parameter
   servers: the first device of each island the plan uses (Cloudless: one per region).
5. Each candidate is simulated (:func:`deepcee.simulator.replicas.simulate_replicas`, enough
   local steps to cover two synchronisation periods), dropped if a device runs out of memory,
   and ranked by the objective (:func:`deepcee.planner.objective.rank_key`): predicted time
   to target (``multiplier / samples_per_s`` with the plan's statistical efficiency,
   :mod:`deepcee.planner.efficiency`), or dollars per sync-equivalent epoch, or the fastest
   under a budget. With ``--objective cost`` the exact plans of every block (one pipeline on
   that block alone) are candidates too, since a smaller plan may be cheaper.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from deepcee.cluster import Cluster
from deepcee.errors import InfeasiblePlanError, PlanError
from deepcee.plan import Estimate, Plan, Strategy
from deepcee.planner.efficiency import DefaultEfficiency, StatisticalEfficiency
from deepcee.planner.grouping import group_devices
from deepcee.planner.objective import Objective, PlanFigures, plan_figures, rank_key
from deepcee.planner.options import PlannerOptions, Progress
from deepcee.planner.search import PlanResult, plan_training
from deepcee.profile import ModelProfile
from deepcee.simulator.replicas import ReplicaSimResult, simulate_replicas
from deepcee.units import GIB

log = logging.getLogger(__name__)

REPLICA_SEARCH = {"sweep_top": 8, "model_top": 6, "refine_top": 1, "compact_top": 2, "confirm_top": 2}
"""Search effort for each replica's pipeline (PlannerOptions fields; as compare's crossover sweeps)."""
SPEED_SEARCH = {"schedules": ("1f1b", "zb-h1", "zb-h2"), "sweep_top": 6, "model_top": 4, "refine_top": 1,
                "compact_top": 0, "confirm_top": 1}
"""Effort for the first estimate of a block's speed, which only sets the replica batches
(without compact schedules, about 5x faster and within ~10% of the final plan's speed)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RelaxedOptions:
    """The strategies and settings the relaxed search tries. See [Note: relaxed search]."""

    periods: tuple[int, ...] = (1, 4, 16, 64, 256)
    outer_optimizers: tuple[str, ...] = ("average", "nesterov")
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    overlaps: tuple[bool, ...] = (False, True)
    """Model averaging: blocking (``False``) and overlapped (``True``) averages."""
    accumulations: tuple[int, ...] = (1, 4, 16)
    staleness_bounds: tuple[int, ...] = (1, 4)
    full_syncs: tuple[int, ...] = (1, 4, 16)
    window_fraction: float = 0.5
    """Partial: the window, as a fraction of the replicas' mean local step."""
    exact_syncs: tuple[str, ...] = ("allreduce-ring", "allreduce-hier", "ps")
    relaxed: bool = True
    """``False``: exact plans only (the whole cluster's and, for cost, each block's)."""
    exhaustive_islands: int = 4
    max_local_steps: int = 512
    """Most local steps simulated per candidate."""
    full_layouts: int = 6
    """Most replica layouts whose pipelines are planned in full (:data:`REPLICA_SEARCH`): the
    best by the screen of every layout with its first, rough pipelines ([Note: layout screen])."""
    screen_within: float = 0.25
    """Layouts the screen rates more than this much worse than its best are not planned in full."""

    def __post_init__(self) -> None:
        for name in ("periods", "accumulations", "staleness_bounds", "full_syncs"):
            vals = getattr(self, name)
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise PlanError(f"needs integers >= 1, got {vals!r}", field=name)
        if not self.overlaps or any(not isinstance(v, bool) for v in self.overlaps):
            raise PlanError(f"needs true and/or false, got {self.overlaps!r}", field="overlaps")
        if not 0 < self.window_fraction:
            raise PlanError(f"must be > 0, got {self.window_fraction!r}", field="window_fraction")
        if isinstance(self.full_layouts, bool) or not isinstance(self.full_layouts, int) or self.full_layouts < 1:
            raise PlanError(f"needs an integer >= 1, got {self.full_layouts!r}", field="full_layouts")
        if isinstance(self.screen_within, bool) or not (isinstance(self.screen_within, (int, float))
                                                       and 0 <= self.screen_within < float("inf")):
            raise PlanError(f"needs a number >= 0, got {self.screen_within!r}", field="screen_within")

    def every_layout(self) -> RelaxedOptions:
        """These options with every replica layout planned in full, whatever the screen says
        ([Note: layout screen]): for callers that need one layout's every strategy."""
        return replace(self, full_layouts=EVERY_LAYOUT, screen_within=1e9)


EVERY_LAYOUT = 1_000_000
"""``full_layouts`` above any count of replica layouts (:meth:`RelaxedOptions.every_layout`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scored:
    """One candidate: its plan, simulation and figures."""

    plan: Plan
    result: ReplicaSimResult
    figures: PlanFigures
    layout: str
    """``{cloud} | {edge, end}``: the islands of each replica."""

    @property
    def samples_per_s(self) -> float:
        return self.result.samples_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSearchResult:
    """What :func:`plan_replicas` found."""

    plan: Plan
    """The chosen plan, with the simulator's estimate and the explanation."""
    best: Scored
    exact: Scored
    """The exact search's plan on the whole cluster (today's plan)."""
    candidates: tuple[Scored, ...]
    """Every candidate that fits, best first."""
    explanation: tuple[str, ...]
    planning_s: float
    objective: str
    efficiency_source: str
    extra: dict[str, Any] = field(default_factory=dict)


class _Search:
    """The state of one relaxed search: cluster, model, caches and scoring."""

    def __init__(self, cluster: Cluster, model: ModelProfile, global_batch: int, *, options: RelaxedOptions,
                 efficiency: StatisticalEfficiency, objective: Objective, budget_usd: float | None,
                 dataset_samples: float | None, epochs: int) -> None:
        self.cluster, self.model, self.global_batch, self.options = cluster, model, global_batch, options
        self.efficiency, self.objective, self.budget_usd = efficiency, objective, budget_usd
        self.dataset_samples, self.epochs = dataset_samples, epochs
        self._pipelines: dict[tuple[tuple[str, ...], int, bool], Plan | None] = {}
        self.scored: list[Scored] = []
        self.dropped: list[str] = []
        self.screened_layouts = (0, 0, 0)
        """Layouts (listed, screened with a figure, planned in full): [Note: layout screen]."""

    # -- pipelines on blocks ------------------------------------------------------------------
    def pipeline(self, devices: tuple[str, ...], batch: int, *, rough: bool = False) -> Plan | None:
        """The best pipeline on ``devices`` at ``batch`` (``rough``: :data:`SPEED_SEARCH` effort)."""
        key = (devices, batch, rough)
        if key not in self._pipelines:
            try:
                got = plan_training(self.cluster.subset(devices), self.model, batch,
                                    options=PlannerOptions(**(SPEED_SEARCH if rough else REPLICA_SEARCH))).plan
            except (InfeasiblePlanError, PlanError) as exc:
                log.debug("no pipeline on %d devices at batch %d: %s", len(devices), batch, exc)
                got = None
            self._pipelines[key] = got
        return self._pipelines[key]

    def rough_replicas(self, blocks: Sequence[tuple[str, ...]]) -> list[Plan] | None:
        """Each block's rough pipeline (:data:`SPEED_SEARCH`) at a batch in proportion to its
        FLOP/s, in the order of ``blocks``; ``None`` where a block has none."""
        from deepcee.planner.baselines import _NoFit, proportional_shares

        try:
            flops = [sum(self.cluster.effective_flops_per_s(d) for d in b) for b in blocks]
            first = [self.pipeline(b, n, rough=True)
                     for b, n in zip(blocks, proportional_shares(self.global_batch, flops), strict=True)]
        except _NoFit:
            return None
        if any(p is None for p in first):
            return None
        return first

    def replicas(self, blocks: Sequence[tuple[str, ...]]) -> list[Plan] | None:
        """Each block's pipeline at a batch in proportion to its speed (its rough pipeline's),
        fastest first."""
        from deepcee.planner.baselines import _NoFit, proportional_shares

        first = self.rough_replicas(blocks)
        if first is None:
            return None
        try:
            batches = proportional_shares(self.global_batch, [p.estimate.samples_per_s for p in first])
        except _NoFit:
            return None
        plans = [self.pipeline(b, n) for b, n in zip(blocks, batches, strict=True)]
        if any(p is None for p in plans):
            return None
        return sorted(plans, key=lambda p: -p.estimate.samples_per_s)

    # -- scoring -------------------------------------------------------------------------------
    def score(self, plan: Plan, layout: str, *, keep: bool = True) -> Scored | None:
        """``plan`` simulated and its figures; ``None`` (and, with ``keep``, the reason in
        :attr:`dropped`) where it fails or a device runs out of memory. ``keep``: a candidate
        (in :attr:`scored`), else a screen's figure only."""
        steps = _steps(plan.strategy, self.options.max_local_steps)
        try:
            result = simulate_replicas(plan, self.cluster, self.model, steps=steps)
        except PlanError as exc:
            if keep:
                self.dropped.append(f"{layout} {plan.strategy.kind}: {exc}")
            return None
        over = [(b, d) for d, b in result.peak_memory_bytes.items() if b > self.cluster.memory_bytes(d)]
        if over:
            b, d = max(over)
            if keep:
                self.dropped.append(f"{layout} {plan.strategy.describe()}: OOM, needs {b / GIB:.1f} GiB on {d}")
            return None
        figures = plan_figures(plan, result, self.cluster, self.model, self.efficiency,
                               dataset_samples=self.dataset_samples, epochs=self.epochs)
        got = Scored(plan=plan, result=result, figures=figures, layout=layout)
        if keep:
            self.scored.append(got)
        return got

    def key(self, s: Scored) -> tuple:
        return (*rank_key(s.figures, self.objective, self.budget_usd), s.layout, s.plan.strategy.describe())


def _steps(s: Strategy, most: int) -> int:
    if s.kind == "exact":
        return 2
    interval = {"model-averaging": s.period, "asgd-ga": s.accumulation_steps * 2,
                "partial": s.full_sync_every}[s.kind]
    # overlapped averaging ends with a blocking round: four periods keep it from dominating the rate
    return max(8, min(most, (4 if s.overlap else 2) * interval))


def blocks_of(islands: Sequence[tuple[str, ...]], exhaustive: int) -> list[tuple[int, ...]]:
    """Island index sets to plan on (see [Note: relaxed search])."""
    n = len(islands)
    if n <= exhaustive:
        return [c for k in range(1, n + 1) for c in itertools.combinations(range(n), k)]
    every = tuple(range(n))
    return [(i,) for i in range(n)] + [every] + [tuple(x for x in every if x != i) for i in range(n)]


def partitions(items: Sequence[int]) -> Iterator[list[tuple[int, ...]]]:
    """Every set partition of ``items`` (blocks in order of their first item)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        yield [(first,), *part]
        for i in range(len(part)):
            yield [*part[:i], (first, *part[i]), *part[i + 1:]]


def strategies(opts: RelaxedOptions, step_s: float) -> list[tuple[Strategy, str]]:
    """``(strategy, plan sync)`` of every setting tried on a layout."""
    out: list[tuple[Strategy, str]] = [(Strategy(), sync) for sync in opts.exact_syncs]
    for h, outer, overlap in itertools.product(opts.periods, opts.outer_optimizers, opts.overlaps):
        nesterov = outer == "nesterov"
        out.append((Strategy(kind="model-averaging", period=h, outer_optimizer=outer,
                             outer_lr=opts.outer_lr if nesterov else 1.0,
                             outer_momentum=opts.outer_momentum if nesterov else 0.0, overlap=overlap),
                    "allreduce-ring"))
    out += [(Strategy(kind="asgd-ga", accumulation_steps=k, staleness_bound=s), "allreduce-ring")
            for k, s in itertools.product(opts.accumulations, opts.staleness_bounds)]
    out += [(Strategy(kind="partial", window_s=opts.window_fraction * step_s, min_group=2, full_sync_every=p),
             "allreduce-ring") for p in opts.full_syncs]
    return out


def servers_for(cluster: Cluster, devices: Sequence[str]) -> tuple[str, ...]:
    """One parameter server per island the devices span: its first device."""
    seen: dict[str, str] = {}
    for d in devices:
        seen.setdefault(cluster.device(d).island, d)
    return tuple(seen.values())


def _layout_name(names: Sequence[str], blocks: Sequence[tuple[int, ...]]) -> str:
    return " | ".join("{" + ", ".join(names[i] for i in b) + "}" for b in blocks)


def _layouts(islands: Sequence[tuple[str, ...]], exhaustive: int) -> list[list[tuple[int, ...]]]:
    """The replica layouts of [Note: relaxed search] (step 3): blocks of island indices."""
    out = []
    for subset in blocks_of(islands, exhaustive):
        if len(subset) < 2:
            continue
        layouts = partitions(list(subset)) if len(subset) <= exhaustive else iter([[(i,) for i in subset]])
        out += [layout for layout in layouts if len(layout) >= 2]
    return out


def _strategy_plans(search: _Search, reps: Sequence[Plan], system: str) -> list[Plan]:
    """Every strategy of [Note: relaxed search] (step 4) on the replica pipelines ``reps``."""
    devices = tuple(d for p in reps for d in p.devices)
    step_s = sum(p.estimate.iteration_s for p in reps) / len(reps)
    excluded = tuple(d for d in search.cluster.device_names if d not in devices)
    out = []
    for strategy, sync in strategies(search.options, step_s):
        needs = strategy.kind == "asgd-ga" or sync == "ps"
        out.append(Plan(system=system, cluster=search.cluster.name, model=search.model.name,
                        global_batch=search.global_batch, replicas=tuple(p.replicas[0] for p in reps),
                        sync=sync, strategy=strategy,
                        servers=servers_for(search.cluster, devices) if needs else (), excluded_devices=excluded))
    return out


# [Note: layout screen]
# Every replica layout's pipelines were planned twice: roughly (SPEED_SEARCH) at batches in
# proportion to the blocks' FLOP/s, to learn their speeds, then in full (REPLICA_SEARCH) at
# batches in proportion to those speeds. The full plans were 85-90% of the relaxed search's time:
# 142 CPU s on mixed seed 29 of benchmarks/planner_mixed.py (5 islands, 71 layouts), 151 s on
# seed 5. So every layout is first screened on its rough pipelines (every strategy simulated,
# none kept as a candidate), and only the best ``full_layouts`` by the screen, those within
# ``screen_within`` of its best, are planned in full and scored as before. The screen's replicas
# are not balanced to finish their steps together (their batches follow FLOP/s, not speed), so it
# is pessimistic for the layouts whose blocks plan far from their FLOP/s; the margin covers that.


def _relaxed_candidates(search: _Search, islands: Sequence[tuple[str, ...]], names: Sequence[str],
                        system: str, progress: Progress | None = None) -> None:
    opts = search.options
    layouts = _layouts(islands, opts.exhaustive_islands)
    blocks = [[tuple(d for i in b for d in islands[i]) for b in layout] for layout in layouts]
    screened = []  # [Note: layout screen]
    for k, layout in enumerate(layouts):
        if progress is not None:
            progress("replica layouts: rough pipelines", k / len(layouts))
        rough = search.rough_replicas(blocks[k])
        if rough is None:
            search.dropped.append(f"{_layout_name(names, layout)}: a replica has no plan that fits")
            continue
        reps = sorted(rough, key=lambda p: -p.estimate.samples_per_s)
        got = [x for plan in _strategy_plans(search, reps, system)
               if (x := search.score(plan, _layout_name(names, layout), keep=False)) is not None]
        if got:
            best = min(got, key=search.key)
            screened.append((search.key(best), k, best.figures.time_to_target.seconds_per_sync_sample))
    screened.sort()
    chosen = [k for key, k, t in screened[: opts.full_layouts]
              if search.objective != "time" or t <= screened[0][2] * (1 + opts.screen_within)]
    search.screened_layouts = (len(layouts), len(screened), len(chosen))
    seen: set[tuple] = set()
    for j, k in enumerate(sorted(chosen)):
        if progress is not None:
            progress("replica layouts: planned in full", j / len(chosen))
        layout = layouts[k]
        reps = search.replicas(blocks[k])
        if reps is None:
            search.dropped.append(f"{_layout_name(names, layout)}: a replica has no plan that fits")
            continue
        key = tuple(p.replicas[0] for p in reps)
        if key in seen:  # a block's best pipeline left an island out: another layout has it
            continue
        seen.add(key)
        for plan in _strategy_plans(search, reps, system):
            search.score(plan, _layout_name(names, layout))


def _block_candidates(search: _Search, islands: Sequence[tuple[str, ...]], names: Sequence[str],
                      system: str, progress: Progress | None = None) -> None:
    """One exact pipeline on each block alone, at the full batch (candidates for cost)."""
    subsets = list(blocks_of(islands, search.options.exhaustive_islands))
    for k, subset in enumerate(subsets):
        if progress is not None:
            progress("island blocks alone", k / len(subsets))
        devs = tuple(d for i in subset for d in islands[i])
        got = search.pipeline(devs, search.global_batch)
        if got is not None:
            plan = got.replace(system=system, cluster=search.cluster.name,
                               excluded_devices=tuple(d for d in search.cluster.device_names if d not in got.devices))
            search.score(plan, _layout_name(names, [subset]) + " alone")


def plan_replicas(cluster: Cluster, model: ModelProfile, global_batch: int, *, options: RelaxedOptions | None = None,
                  efficiency: StatisticalEfficiency | None = None, objective: Objective = "time",
                  budget_usd: float | None = None, dataset_samples: float | None = None, epochs: int = 1,
                  exact_plan: Plan | None = None, system: str = "deepcee",
                  progress: Progress | None = None) -> ReplicaSearchResult:
    """Search replica layouts and strategies (see [Note: relaxed search]). ``progress(step,
    fraction)`` is called as the layouts are planned (``deepcee plan --sync relaxed`` prints it
    after 2 s, as the exact search's)."""
    t0 = time.perf_counter()
    options = options or RelaxedOptions()
    efficiency = efficiency or DefaultEfficiency()
    if objective not in ("time", "cost"):
        raise PlanError(f"unknown objective {objective!r} (known: time, cost)", field="objective")
    search = _Search(cluster, model, global_batch, options=options, efficiency=efficiency, objective=objective,
                     budget_usd=budget_usd, dataset_samples=dataset_samples, epochs=epochs)
    exact_plan = exact_plan or plan_training(cluster, model, global_batch).plan
    exact = search.score(exact_plan.replace(system=system), "exact search")
    if exact is None:
        raise InfeasiblePlanError(f"the exact plan does not fit: {search.dropped[-1]}")
    grouping = group_devices(cluster)
    islands = [isl.devices for isl in grouping.islands]
    names = [isl.name for isl in grouping.islands]
    if objective == "cost":
        _block_candidates(search, islands, names, system, progress)
    if options.relaxed:
        _relaxed_candidates(search, islands, names, system, progress)
    ranked = sorted(search.scored, key=search.key)
    best = ranked[0]
    explanation = _explain(search, best, exact, ranked)
    plan = best.plan.replace(estimate=Estimate(
        iteration_s=best.result.iteration_s, samples_per_s=best.samples_per_s,
        peak_memory_bytes=dict(best.result.peak_memory_bytes), bottleneck=best.result.bottleneck,
        source="simulator"), explanation=tuple(explanation))
    elapsed = time.perf_counter() - t0
    log.info("relaxed search for %s on %s: %d candidates in %.1f s", model.name, cluster.name, len(ranked), elapsed)
    return ReplicaSearchResult(plan=plan, best=best, exact=exact, candidates=tuple(ranked),
                               explanation=tuple(explanation), planning_s=elapsed, objective=objective,
                               efficiency_source=efficiency.source(best.plan))


def plan_with_sync(cluster: Cluster, model: ModelProfile, global_batch: int, *,
                   options: PlannerOptions | None = None, sync: str = "exact", **relaxed: Any) -> PlanResult:
    """The planner's entry with the synchronisation choice: ``"exact"`` is
    :func:`~deepcee.planner.search.plan_training`'s one-pipeline search; ``"relaxed"`` also
    searches replicas and relaxed strategies on top of its plan, judged by predicted time to
    target (:func:`plan_replicas`, which takes ``relaxed``'s keywords: ``efficiency``,
    ``objective``, ...). Exact with an objective or a budget ranks exact layouts only.

    [Note: planner layering] The relaxed search uses the exact one (each replica's pipeline is
    an exact search on its devices), so it sits above it: this dispatch lives here, and
    :mod:`deepcee.planner.search` never imports this module."""
    if sync not in ("exact", "relaxed"):
        raise PlanError(f"unknown sync {sync!r} (known: exact, relaxed)", field="sync")
    exact = plan_training(cluster, model, global_batch, options=options)
    if sync == "exact" and not relaxed:
        return exact
    if sync == "exact":
        relaxed = {**relaxed, "options": RelaxedOptions(relaxed=False)}
    if options is not None and options.progress is not None:
        relaxed.setdefault("progress", options.progress)
    got = plan_replicas(cluster, model, global_batch, exact_plan=exact.plan, **relaxed)
    return PlanResult(plan=got.plan, explanation=got.explanation,
                      candidates_evaluated=exact.candidates_evaluated + len(got.candidates),
                      planning_s=exact.planning_s + got.planning_s, top=exact.top, grouping=exact.grouping)


def _explain(search: _Search, best: Scored, exact: Scored, ranked: Sequence[Scored]) -> list[str]:
    f, e = best.figures, exact.figures
    goal = {"time": "predicted time to target", "cost": "dollars per sync-equivalent epoch"}[search.objective]
    if search.objective == "cost" and search.budget_usd is not None:
        goal = f"the fastest predicted time to target within ${search.budget_usd:g} per sync-equivalent epoch"
    listed, screened, full = search.screened_layouts
    lines = [f"searched {len(ranked)} plans (replica layouts x strategies and the exact plan), ranked by {goal}"]
    if listed:
        lines.append(f"replica layouts: {listed} listed, {screened} with a plan that fits on their rough pipelines, "
                     f"the best {full} of those planned in full")
    lines += [f"chosen: {best.layout}, {len(best.plan.devices)} devices, {best.plan.num_replicas} replica(s)",
              *f.lines(),
              f"simulated {best.samples_per_s:.4g} samples/s, {f.wan_fraction:.0%} of the replicas' time in "
              f"cross-replica synchronisation"]
    if search.objective == "cost" and f.usd_per_epoch is None:
        why = ("no epoch: state data_* per island in the cluster file, or --dataset-samples" if f.epoch_s is None
               else "no prices for island(s) " + ", ".join(f.unpriced))
        lines.append(f"dollars unknown ({why}): ranked by predicted time to target")
    elif search.budget_usd is not None and f.usd_per_sync_epoch > search.budget_usd:
        lines.append(f"no plan costs ${search.budget_usd:g} or less per sync-equivalent epoch: the cheapest is chosen")
    if best is not exact:
        ratio = f.time_to_target.seconds_per_sync_sample / e.time_to_target.seconds_per_sync_sample
        lines.append(f"vs the exact plan ({len(exact.plan.devices)} devices, {exact.samples_per_s:.4g} samples/s): "
                     f"{best.samples_per_s / exact.samples_per_s:.2f}x its samples/s, {ratio:.2f}x its predicted "
                     "time to target")
    else:
        runner = next((s for s in ranked if s is not exact), None)
        if runner is not None:
            lines.append(f"best other: {runner.layout} {runner.plan.strategy.describe()}: "
                         f"{runner.samples_per_s:.4g} samples/s, time to target "
                         f"{runner.figures.time_to_target.describe()}")
    if f.semantics == "relaxed":
        lines.append("relaxed semantics: replicas do not compute the single-process result; samples/s of relaxed "
                     "plans are not comparable without the steps-to-target multiplier")
    lines += [f"dropped: {x}" for x in search.dropped[:5]]
    return lines


__all__ = ["REPLICA_SEARCH", "RelaxedOptions", "ReplicaSearchResult", "Scored", "blocks_of", "partitions",
           "plan_replicas", "plan_with_sync", "servers_for", "strategies"]
