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
   The best chains' islands then get each their own granularity (devices per stage), by a
   local search from the chain's best uniform layout ([Note: mixed granularity] in
   :mod:`deepcee.planner.grains`).
2. The best ranked configurations get a second DP that minimises the fill subject to the
   bottleneck staying under ``tau`` for a few ``tau`` above the optimum (trading a slightly
   worse bottleneck for a shorter pipeline when there are few microbatches).
3. The best ranked (the cost model's pick of the closed form's best first, [Note: screening])
   are built as plans for every schedule the screen rates near the best, and every sync (ring
   and hierarchical only when a stage spans nodes: otherwise they coincide) and scored by the
   analytic cost
   model (:class:`~deepcee.planner.cost_model.AnalyticCostModel`), plus, with one schedule,
   the best for every stage count and every island (for the explanation); plans that do
   not fit memory are dropped. The best few are refined by moving stage boundaries one
   layer at a time; ``compact`` schedules are built for the best distinct pipelines
   (:func:`~deepcee.schedule.compact.build_compact`, memory limit = what device memory
   allows per stage) within a budget of stages x microbatches, the builder's cost.
4. The best ``confirm_top`` plans (distinct) are simulated, within a work budget; the lowest
   simulated iteration time wins (ties: cost model, then a stable key). Every plan scored in
   full along the way (also a short one the screen scored) is a candidate.
   Before the compact schedules, the best fixed-schedule plan is polished: a local search over
   its layout (an island's stage count, two islands swapped, an island left out or added, the
   microbatch size, the schedule), screened and scored by the cost model ([Note: layout polish]
   in :mod:`deepcee.planner.polish`). After step 4, the configurations of granularity climbs
   with two-island moves get steps 2-4 of their own, and their best plan is taken where the
   simulator rates it faster ([Note: second look]); so do the chain walk's chain and the count
   look's two sets: a search over each island's stage count on the chains the main search
   climbed, and a second chain search that also lays every chain out with one stage per layer,
   the layers split over its islands in proportion to their speed, each of its climbs followed
   by that count search (any stage count per island: [Note: stage counts] in
   :mod:`deepcee.planner.grains`). A look whose best simulates near the main search's is
   polished too.

[Note: screening]
The closed form ranks configurations for step 3, whose cost-model budget (``score_budget``,
stages x microbatches) holds only a handful of plans with a thousand microbatches. On the
random WAN instances of ``benchmarks/planner_at_scale.py`` the closed form was off by up to
3.7x and not in order (seed 82: its best, 398 s, was 744 s by the cost model; its fourth, 418 s,
was 539 s), so the budget went to the wrong plans. So the cost model screens first: a plan with
more than ``8 S`` microbatches (``S`` stages) is timed with ``2 S`` and ``4 S`` microbatches and
its time extrapolated linearly (a pipeline's time is affine in the microbatch count once it is
full; within 4.4% of the full figure, mean 0.6%, on 5 WAN seeds x 10 configurations), at about
``6 S / M`` of the full cost; a shorter plan is scored in full instead.
- Before step 3, the closed form's best configuration of each layout in turn (``screen_top`` of
  them) is screened with **every** fixed schedule it admits (``screen_budget``). The schedule
  matters as much as the split there: over 130 ms links ZB-H2 hides round trips that ZB-H1 waits
  on (seed 3: 819 s with ZB-H1, 549 s with ZB-H2, same split). The ``screen_keep`` best take
  turns with the closed form's best at the score budget (the screen's first, then the closed
  form's first, ...): the closed form is right often enough (seed 60: putting the screen's picks
  first cost 8%; with every schedule screened, seed 15 lost 10.8% that way).
- In step 3 every schedule of a configuration that was not screened yet is screened (from the
  screen budget, then the score budget), and only the schedules the screen rates within
  :data:`~deepcee.planner.steps.SCREEN_MARGIN` of both the configuration's best and the best
  plan scored so far are scored in full, best first.
The screen only orders and prunes work: every plan returned is still scored in full by the cost
model and confirmed by the simulator where ``confirm_max_work`` allows.

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

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from deepcee.cluster import Cluster
from deepcee.errors import InfeasiblePlanError, PlanError
from deepcee.inputs.work import check_planning
from deepcee.plan import Plan
from deepcee.planner.baselines import distinct_nodes
from deepcee.planner.chains import (
    ChainBounds,
    improve_chain,
    island_units,
    merged_units,
    search_chains,
    walk_chains,
)
from deepcee.planner.cost_model import AnalyticCostModel
from deepcee.planner.explain import Counterfactual, explain
from deepcee.planner.grains import climb_grains, counts_layout, feasible_grains, speed_counts
from deepcee.planner.grouping import Grouping, group_devices
from deepcee.planner.options import SYNC_CHOICES, PlannerOptions
from deepcee.planner.polish import layout_plan, polish_layout, segments_of
from deepcee.planner.ranges import RangeTables
from deepcee.planner.space import (
    SCREEN_RULES,
    Chain,
    StageLayout,
    build_plan,
    chain_layouts,
    compact_plan,
    enumerate_chains,
    fed_grains,
    in_flight_counts,
    island_distances,
    island_orders,
    microbatch_sizes,
    schedule_in_flight,
)
from deepcee.planner.split import split_layers
from deepcee.planner.steps import (
    SCREEN_SCHEDULES,
    Candidate,
    Config,
    SearchState,
    final_rank_key,
    plan_key,
    rank_key,
    score_key,
)
from deepcee.profile import ModelProfile
from deepcee.schedule.interpreter import collection_paused
from deepcee.simulator.runtime_model import RuntimeModel, runtime_for
from deepcee.units import GIB

__all__ = [
    "SCREEN_RULES", "SYNC_CHOICES", "Candidate", "Chain", "PlanResult", "PlannerOptions", "StageLayout",
    "build_plan", "chain_layouts", "compact_plan", "enumerate_chains", "fed_grains", "in_flight_counts", "island_distances",
    "island_orders", "microbatch_sizes", "plan_training", "split_layers",
]

log = logging.getLogger(__name__)

_INF = math.inf

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
    counterfactuals: tuple[Counterfactual, ...] = ()
    """The alternatives the explanation prints, each simulated (see [Note: counterfactuals])."""
    scored: tuple[Candidate, ...] = ()
    """Every plan the cost model scored that fits memory, best first (cost-model order)."""
    polish_steps: int = 0
    """Moves the layout polish took ([Note: layout polish]; 0: it found none or did not run)."""



def _progress(options: PlannerOptions, step: str, fraction: float) -> None:
    if options.progress is not None:
        options.progress(step, fraction)


def _search_chains(search: SearchState, dist: np.ndarray, *, speed: bool = False) -> None:
    """Islands and their order (see [Note: chain search] in :mod:`deepcee.planner.chains`);
    ``speed``: each chain also laid out with stages in proportion to its islands' speed ([Note:
    stage counts] in :mod:`deepcee.planner.grains`)."""
    g, opts = search.grouping, search.options
    bounds = ChainBounds(search.cluster, search.model, g, search.global_batch, search.marginal_s,
                         search.pipe_bandwidth)
    exact = len(g.islands) <= opts.exhaustive_islands
    units = island_units(g, opts) if exact else merged_units(g, dist, opts.exhaustive_islands)

    def evaluate(chain: Chain) -> float:
        # after the first chains: microbatch sizes within 4x of the best so far's and the
        # granularities nearest its (the closed form is smooth in both), nearest first until one
        # gives a plan (a granularity whose stages cannot hold the model says nothing about finer
        # ones: testbed/gpt2-xl/128's cloud-only chain was written off); the best chains are laid
        # out again in full below
        layouts = chain_layouts(g, chain, search.max_stages, search.pieces)
        sizes: list[int] | None = None
        near = search.granularity_near() if len(seen) >= 8 else None
        seen.append(chain)
        if near is None:
            best = min((search.evaluate_layout(lay)[0] for lay in layouts), default=_INF)
        else:
            sizes = search.sizes_near(4)
            layouts = sorted(layouts, key=lambda lay: (abs(math.log2(max(lay.granularity, 1) / near)),
                                                       lay.granularity))
            best, found = _INF, 0
            for lay in layouts:
                value = search.evaluate_layout(lay, sizes)[0]
                best, found = min(best, value), found + math.isfinite(value)
                if found >= 1:
                    break
        if speed:
            for counts in speed_counts(search, chain):
                best = min(best, search.evaluate_layout(counts_layout(search, chain, counts), sizes)[0])
        if not math.isfinite(best) and opts.grain_budget > 0:
            best = feasible_grains(search, chain, sizes)  # [Note: mixed granularity]
        return best

    seen: list[Chain] = []

    report = (lambda f: opts.progress("island chains", f)) if opts.progress else None
    result, done = search_chains(units, bounds, evaluate, budget=opts.chain_budget,
                                 allow_exclusion=opts.allow_exclusion, incumbent=lambda: search.best_closed_form,
                                 progress=report)
    search.chain_result = result
    best_chains = sorted(done)
    ends = _devices_used_search(search, best_chains, evaluate) if exact and result.gap > 0 else []
    walked = (_chain_walk(search, bounds, best_chains, evaluate)
              if exact and result.gap > 0 and opts.walk_budget > 0
              and len(search.cluster.device_names) <= opts.polish_max_devices else [])
    for _, chain in best_chains[:4]:  # the best chains with every microbatch size
        _lay_out_in_full(search, chain, grains=False)
    if not speed:
        search.best_chains = [chain for _, chain in best_chains[:4]]
    if opts.grain_budget > 0:  # each island its own granularity on the best chains
        # the best grain_chains chains whose climb can beat the best closed form so far (a
        # climb whose every start's lower bound cannot is cut at once and returns inf; such
        # chains took 8 of the 10 places on WAN seed 6, and the chain of the best plan, 13th,
        # was never climbed)
        climbed: list[Chain] = []
        tried = 0
        for value, chain in best_chains:
            if len(climbed) >= opts.grain_chains or not math.isfinite(value):
                break
            tried += 1
            if math.isfinite(climb_grains(search, chain, counts=speed)):
                climbed.append(chain)
        if not speed:
            search.climbed = climbed
        if opts.second_look and len(search.cluster.device_names) <= opts.polish_max_devices:
            search.second_look = _guarded_climbs(search, climbed, best_chains[tried:], counts=speed)  # [Note: second look]
    for chain in ends:
        _confirmed_end(search, chain)
    if walked:  # searched on their own after the main search, as the second look's
        search.walk_look = _laid_out_apart(search, walked, counts=speed)
    if not exact and done:
        keeps = [len(isl.groups) for isl in g.islands]
        for value, chain in best_chains[:2]:  # the two best merged chains seed the local search
            if not math.isfinite(value):
                continue
            _, _, spent = improve_chain(chain, value, evaluate, islands=len(g.islands), keeps=keeps,
                                        allow_exclusion=opts.allow_exclusion, budget=opts.chain_budget // 2)
            search.chain_moves += spent


# [Note: second look]
# The granularity climb ([Note: mixed granularity] in deepcee.planner.grains) moves one island, or
# trades a step between two, on the best ``grain_chains`` chains. On WAN seed 66 the reference's
# plan mixes granularity on a chain outside those and needs two islands moved at once (51.90
# against 61.56 s). Climbing further inside the main search (session 15: two-island moves and the
# best order of each new set of islands among chains 11-20; session 16: the same, kept only where
# the cost model's screen of what it added beat that of the configurations before) found better
# plans on 9 of the 100 WAN instances but lost 7, by up to 21%: its configurations, ranked
# first by the closed form, took the places of step 3's budgets and of the compact schedules
# that had made the plan. So the guarded climbs' configurations are taken back from the main
# search and searched on their own after it: :func:`_guarded_climbs` climbs, keeps the
# configurations only where the screen rule above holds, and restores the search;
# :func:`_second_look` then runs steps 2-4 on them alone (the in-flight sweep, the screen and
# the cost model, refinement, compact schedules, the simulator) with half the main search's
# budgets, and its best plan replaces the main search's only where the simulator rates it
# faster. The plans the main search scored are not scored again, and when the second look's best
# cost-model figure is more than ``SECOND_LOOK_MARGIN`` above the main search's best, it stops
# before refinement. Where its best simulates within ``LOOK_POLISH_MARGIN`` of the main search's
# best, or faster, its plans are polished too, as the main search's are (WAN seed 17: the count
# look's plan, 104.5 s, was two polish moves from 100.1 s, the independent reference's polish of
# it). Where it is not taken, the search state is restored, so the main search's
# plan and its explanation are what they were without it. Like the layout polish, it runs only on
# clusters of at most ``polish_max_devices`` devices: its climbs cost 0.6 CPU s at 512 devices,
# where ``plan`` has a 10 s target.
# The chains: those the main search climbed (the best ``grain_chains`` whose climb can beat the
# best closed form) and the next ``grain_chains`` after them, whatever their islands. Until the
# closed form counted the neighbour cycle ([Note: neighbour cycle] in deepcee.planner.split),
# the second group was only the best order of each set of islands the first did not use; with
# it, seed 66's chain (ap-south, us-central, eu-west, us-west) came fourth after the climbed
# ones, but another order of its islands had been climbed, so it was left out (60.13 s against
# 51.89 s).

LOOK_POLISH_MARGIN = 0.02
"""A look's plans are polished ([Note: layout polish] in :mod:`deepcee.planner.polish`) where its
best simulates at most this much slower than the main search's best, or faster ([Note: second
look])."""

GUARDED_DEVICES = 128
""":func:`_guarded_climbs` lays out at most ``grain_budget`` layouts of this many devices in all
(fewer of more devices: a layout's closed form costs about its device count)."""

SECOND_LOOK_MARGIN = 0.05
"""The second look goes on to refinement, compact schedules and the simulator only where its best
plan by the cost model is within this of the main search's best (compact schedules and
refinement gained up to 15% on the WAN instances; [Note: second look])."""


def _guarded_climbs(search: SearchState, first: list[Chain], later: list[tuple[float, Chain]], *,
                    counts: bool = False) -> list[Config]:
    """The granularity climbs again, with two-island moves, on the chains ``first`` (those the
    main search climbed) and on the next ``grain_chains`` of ``later`` (the chains after them,
    best first) ([Note: second look]). Everything they add is taken back; it is returned only
    where the cost model's best screen of it beats that of the configurations before (as
    :func:`_confirmed_end`), else ``[]``."""
    n = search.options.grain_chains
    extra = [chain for value, chain in later[:n] if math.isfinite(value)]
    saved = _snapshot(search)
    before = saved.configs
    work = [search.options.grain_budget * GUARDED_DEVICES]
    for chain in first + extra:
        if work[0] <= 0:
            break
        climb_grains(search, chain, pairs=True, work=work, counts=counts)
    added = [cfg for key, cfg in search.configs.items() if key not in before]
    keep = bool(added) and _screen_of_best(search, added) < _screen_of_best(search, before.values())
    added = _taken_back(search, saved, added)
    return added if keep else []


def _second_look(search: SearchState, top: list[Candidate], cands: list[Candidate], extra: list[Config] | None = None,
                 what: str = "the granularity climbs with two-island moves") -> tuple[list[Candidate], list[Candidate]]:
    """Steps 2-4 on the configurations ``extra`` alone (:attr:`~deepcee.planner.steps.SearchState.
    second_look`'s unless given) ([Note: second look]); ``(top, cands)`` with its plans where its
    best simulates faster than ``top[0]``, else as they were (and the search state restored);
    ``what``: where the configurations came from, for the note."""
    opts = search.options
    saved = _snapshot(search)
    extra = search.second_look if extra is None else extra
    for cfg in extra:
        search.configs.setdefault(cfg.ident, cfg)
    layouts = {cfg.layout.slots for cfg in extra}
    ranked = sorted(extra, key=lambda c: c.key)
    _progress(opts, "second look", 0.0)
    for cfg in ranked[: opts.sweep_top]:
        search.sweep(cfg)
    ranked = sorted((c for c in search.configs.values() if c.layout.slots in layouts), key=lambda c: c.key)
    # budgets of its own, half the main search's
    search.score_used, search.screen_used = opts.score_budget // 2, opts.screen_budget // 2
    search.compact_used, search.refine_used = opts.compact_budget // 2, opts.refine_budget // 2
    first = _turns(search, ranked)
    new: list[Candidate] = []
    picked: set[int] = set()
    for k, cfg in enumerate(first):
        _progress(opts, "second look", 0.5 * (k + 1) / len(first))
        if id(cfg) not in picked:
            picked.add(id(cfg))
            new += search.plans_for(cfg, full=True)
    new = sorted(_dedupe(c for c in new if score_key(c.plan) not in saved.scored), key=rank_key)
    if new and new[0].score_s < top[0].score_s * (1 + SECOND_LOOK_MARGIN):
        new = sorted(_dedupe(new + [search.refine(c) for c in new[: opts.refine_top]]), key=rank_key)
        _progress(opts, "second look", 0.75)
        new = sorted(_dedupe(new + _compacts(search, new, ranked)), key=rank_key)
        got = _confirm(search, new)
        if got and got[0].simulated is not None and got[0].score_s < top[0].score_s * (1 + LOOK_POLISH_MARGIN):
            # near or faster: polished, as the main search's plans are (WAN seeds 17 and 96)
            first, near = len(search.notes), []
            polished = polish_layout(search, new, near)  # [Note: layout polish] in deepcee.planner.polish
            search.notes[first:] = [f"in the second look at {what}: {x}" for x in search.notes[first:]]
            if polished or near:
                _progress(opts, "second look", 0.9)
                new = sorted(_dedupe(new + polished), key=rank_key)
                new = sorted(_dedupe(new + _compacts(search, new, ranked, near)), key=rank_key)
                got = _confirm(search, new)
        if got and got[0].simulated is not None and got[0].score_s < top[0].score_s * (1 - 1e-9):  # faster, not a tie
            search.notes.append(f"the best plan came from a second look at {what} ({got[0].score_s:.4g} s against "
                                f"the main search's {top[0].score_s:.4g} s, simulated)")
            search.compact_used, search.refine_used = saved.counters[:2]  # the main search's budgets
            return sorted(got + top, key=final_rank_key), sorted(_dedupe(cands + new), key=rank_key)
    _restore(search, saved)  # not taken: the search as the main search left it
    return top, cands


def _count_look(search: SearchState, dist: np.ndarray) -> list[tuple[str, list[Config]]]:
    """The count look's two sets of configurations ([Note: stage counts] in
    :mod:`deepcee.planner.grains`), each taken back from the main search and returned with where
    it came from, to be searched on its own after it, as the second look's: the stage-count search
    on the chains the main search climbed, and the chain search again, from scratch, with every
    chain also laid out with stages in proportion to its islands' speed (its granularity climbs,
    guarded climbs and chain walk with the stage-count search too). Empty sets are left out."""
    saved = _snapshot(search)
    for chain in search.climbed:
        climb_grains(search, chain, counts=True)
    climbed = _taken_back(search, saved, [cfg for key, cfg in search.configs.items() if key not in saved.configs])
    kept = (search.second_look, search.walk_look, search.chain_result, search.chain_moves, search.chain_walk,
            search.climbed)
    search.configs, search.layout_values, search.best_closed_form = {}, {}, _INF  # a fresh search: its own pruning
    _search_chains(search, dist, speed=True)
    extra = {id(cfg): cfg for cfg in [*search.configs.values(), *search.second_look, *search.walk_look]}
    added = [cfg for cfg in extra.values() if cfg.ident not in saved.configs]
    added = _taken_back(search, saved, added)
    (search.second_look, search.walk_look, search.chain_result, search.chain_moves, search.chain_walk,
     search.climbed) = kept
    return [(what, group) for what, group in (("the stage counts of the climbed chains", climbed),
                                              ("the chain search with stages in proportion to speed", added)) if group]


def _fed_look(search: SearchState, fed: tuple[int, ...]) -> list[Config]:
    """The configurations of the fed granularities ([Note: fed granularities] in
    :mod:`deepcee.planner.space`) on the chains the main search climbed and its best four: each chain laid out with
    chunks of every size in ``fed``, then its granularity climb with them among its steps; taken
    back from the main search, to be searched on their own after it, as the second look's (in
    the main search they changed which chains a budget-stopped chain search reached: mixed seed
    135 of ``benchmarks/planner_mixed.py`` went from 2.557 to 3.157 s)."""
    chains = list(dict.fromkeys([*search.climbed, *search.best_chains]))
    if not fed or not chains:
        return []
    saved = _snapshot(search)
    search.grains = fed
    try:
        for chain in chains:
            for lay in chain_layouts(search.grouping, chain, search.max_stages, search.pieces, fed):
                if lay.granularity in fed:
                    search.evaluate_layout(lay)
            if search.options.grain_budget > 0:
                climb_grains(search, chain)
    finally:
        search.grains = ()
    return _taken_back(search, saved, [cfg for key, cfg in search.configs.items() if key not in saved.configs])


def _taken_back(search: SearchState, saved: _Saved, added: list[Config]) -> list[Config]:
    """Restore ``search`` to ``saved`` and return ``added`` (configurations to be searched on their
    own) with their screens cleared: screened under the main search's budget, they are screened
    again when searched on their own."""
    _restore(search, saved)
    for cfg in added:
        cfg.screened.clear()
    return added


def _devices_used_search(search: SearchState, best_chains: list[tuple[float, Chain]],
                         evaluate: Callable[[Chain], float]) -> list[Chain]:
    """The local search over the devices used after a budget-stopped chain search ([Note: chain
    search]): from the two best chains, drop or insert an island or change the groups kept. Returns
    the chains it ends on (other than where it started); every configuration it added is taken back
    (:func:`_confirmed_end` lays the ends out in full and keeps what the cost model confirms).

    The bound favours chains with more devices, so the budget went to orders of the largest
    subsets (512 devices in 8 islands: keeping only the fast group of one island took the best
    closed form from 6.17 to 5.80 s)."""
    opts, g = search.options, search.grouping
    if not opts.allow_exclusion or not best_chains:
        return []
    keeps = [len(isl.groups) for isl in g.islands]
    known = {chain: value for value, chain in best_chains}
    saved = _snapshot(search)
    ends: list[Chain] = []
    for value, chain in best_chains[:2]:
        if math.isfinite(value):
            _, end, spent = improve_chain(chain, value, evaluate, islands=len(g.islands), keeps=keeps,
                                          allow_exclusion=True, budget=opts.chain_budget // 5, reorder=False,
                                          known=known, pair_drops=True)
            search.chain_moves += spent
            if end != chain and end not in ends:
                ends.append(end)
    _restore(search, saved)
    return ends


def _chain_walk(search: SearchState, bounds: ChainBounds, best_chains: list[tuple[float, Chain]],
                evaluate: Callable[[Chain], float]) -> list[Chain]:
    """The chain walk after a budget-stopped chain search ([Note: chain search]) from the best
    chain: ``[its end]`` where it beats the best chain's closed form, else ``[]``. Every
    configuration it added is taken back."""
    if not best_chains or not math.isfinite(best_chains[0][0]):
        return []
    g, opts = search.grouping, search.options
    saved = _snapshot(search)
    value, chain = best_chains[0]
    got, end, spent = walk_chains(chain, value, evaluate, islands=len(g.islands),
                                  keeps=[len(isl.groups) for isl in g.islands], allow_exclusion=opts.allow_exclusion,
                                  budget=opts.walk_budget, fits=bounds.fits,
                                  known={c: v for v, c in best_chains})
    search.chain_walk = spent
    _restore(search, saved)
    return [end] if got < value * (1 - 1e-9) else []


def _laid_out_apart(search: SearchState, chains: list[Chain], *, counts: bool = False) -> list[Config]:
    """The configurations of ``chains`` laid out in full (with the granularity search), taken back
    from the main search and returned, to be searched on their own ([Note: chain search])."""
    saved = _snapshot(search)
    for chain in chains:
        _lay_out_in_full(search, chain, grains=search.options.grain_budget > 0, counts=counts)
    return _taken_back(search, saved, [cfg for key, cfg in search.configs.items() if key not in saved.configs])


def _confirmed_end(search: SearchState, chain: Chain) -> bool:
    """Lay ``chain`` (an end of :func:`_devices_used_search`) out in full, with the granularity
    search; keep what that added only where the cost model's best screen of its best
    ``CONFIRM_END_TOP`` configurations beats that of the best configurations before (else take it
    all back). Returns whether kept.

    A search that follows the closed form also finds where the closed form is most optimistic: on
    WAN seed 13 it ended on a 4-island chain at 131.8 s that the cost model and the simulator put at
    216.6 s, and that chain's configurations, ranked first by the closed form, crowded the 159.4 s
    plan out (193.3 s). The ends come *beside* the best chains, not in their place: the local
    search's near copies of the best chain crowded out the chain whose mixed granularity was WAN
    seed 23's plan (261.9 -> 287.9 s)."""
    saved = _snapshot(search)
    before = saved.configs
    _lay_out_in_full(search, chain, grains=search.options.grain_budget > 0)
    added = [cfg for key, cfg in search.configs.items() if key not in before]
    if _screen_of_best(search, added) < _screen_of_best(search, before.values()):
        return True
    _restore(search, saved)
    return False


def _lay_out_in_full(search: SearchState, chain: Chain, *, grains: bool, counts: bool = False) -> None:
    """Every layout of ``chain`` at every microbatch size (and its granularity search; ``counts``:
    and then its stage-count search)."""
    for lay in chain_layouts(search.grouping, chain, search.max_stages, search.pieces):
        search.evaluate_layout(lay)
    if grains:
        climb_grains(search, chain, counts=counts)


CONFIRM_END_TOP = 3
"""Configurations (closed-form order) whose screens stand for a set in :func:`_confirmed_end`: the
closed form's best alone is too coarse (a five-island toy of tests/unit/test_search_chains.py: the
end chain's second configuration is the better plan)."""


def _screen_of_best(search: SearchState, cfgs: Iterable[Config]) -> float:
    """The cost model's best screen (over their fixed schedules) of the ``CONFIRM_END_TOP`` best
    of ``cfgs`` by the closed form."""
    best = sorted(cfgs, key=lambda c: c.key)[:CONFIRM_END_TOP]
    return min((search.screen(cfg, x) for cfg in best for x in SCREEN_SCHEDULES if x in cfg.schedules), default=_INF)


@dataclass(frozen=True, slots=True)
class _Saved:
    """What :func:`_restore` puts back: the configurations and what ranks or budgets them."""

    configs: dict
    layout_values: dict
    best_closed_form: float
    scored: dict
    score_used: int
    screen_used: int
    best_scored_s: float
    screened: tuple[tuple[Config, frozenset[str]], ...]
    swept: frozenset[tuple]
    counters: tuple[float, int, int, int]
    """``compact_used``, ``refine_used``, ``forced_compacts``, ``large_compacts``."""
    notes: int
    """How many notes there were (the notes of what is taken back go with it)."""
    polish: tuple[int, int]
    """``polish_used``, ``polish_steps``."""


def _snapshot(search: SearchState) -> _Saved:
    return _Saved(configs=dict(search.configs), layout_values=dict(search.layout_values),
                  best_closed_form=search.best_closed_form, scored=dict(search.scored), score_used=search.score_used,
                  screen_used=search.screen_used, best_scored_s=search.best_scored_s,
                  screened=tuple((cfg, frozenset(cfg.screened)) for cfg in search.configs.values()),
                  swept=frozenset(search.swept), counters=(search.compact_used, search.refine_used,
                                                           search.forced_compacts, search.large_compacts),
                  notes=len(search.notes), polish=(search.polish_used, search.polish_steps))


def _restore(search: SearchState, saved: _Saved) -> None:
    """Take back what was added since ``saved``: configurations, layout memo, best closed form, the
    plans scored and the budgets spent, the screens (taken back, a rejected end is no step at all:
    with the screen budget it spent left spent, WAN seed 88 went from 159.9 to 173.1 s), the sweeps
    done, the compact, refinement and polish counters, and the notes."""
    search.configs, search.layout_values = dict(saved.configs), dict(saved.layout_values)
    search.best_closed_form, search.scored = saved.best_closed_form, dict(saved.scored)
    search.score_used, search.screen_used, search.best_scored_s = saved.score_used, saved.screen_used, saved.best_scored_s
    for cfg, keys in saved.screened:
        for k in [k for k in cfg.screened if k not in keys]:
            del cfg.screened[k]
    search.swept = set(saved.swept)
    search.compact_used, search.refine_used, search.forced_compacts, search.large_compacts = saved.counters
    del search.notes[saved.notes:]
    search.polish_used, search.polish_steps = saved.polish


def plan_training(cluster: Cluster, model: ModelProfile, global_batch: int, *,
                  options: PlannerOptions | None = None) -> PlanResult:
    """Search the plan space for the fastest plan that fits memory. See the module docstring.

    One pipeline, exact synchronisation; replicas and relaxed strategies are searched on top of
    this by :func:`deepcee.planner.replicas.plan_with_sync` (``deepcee plan --sync relaxed``).
    """
    with collection_paused():  # [Note: search without collection]
        return _plan_training(cluster, model, global_batch, options=options)


# [Note: search without collection]
# The search keeps nearly everything it makes (configurations, layout memos, scored plans, range
# tables) alive until it returns, and makes almost no reference cycles: at 512 devices in 8
# islands the cyclic collector ran 792 times during a plan, freed about 830 objects in all, and
# its passes over the growing state took 0.63 of 11.7 CPU s (timed with `gc.callbacks`). So it is
# paused for the search, as the simulator pauses it ([Note: interpreter without collection]), and
# restored as it was afterwards (nesting and callers that pause it themselves are unaffected);
# reference counting still frees everything that is not in a cycle at once. Only timing changes.


def _plan_training(cluster: Cluster, model: ModelProfile, global_batch: int, *,
                   options: PlannerOptions | None = None) -> PlanResult:
    t0 = time.perf_counter()
    options = options or PlannerOptions()
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch must be an integer >= 1, got {global_batch!r}", field="global_batch")
    check_planning(cluster, model, global_batch)
    search = new_search(cluster, model, global_batch, options)
    dist = island_distances(cluster, search.grouping)
    _search_chains(search, dist)
    if options.count_look and len(cluster.device_names) <= options.polish_max_devices:
        search.count_look = _count_look(search, dist)  # [Note: stage counts]
    fed = _fed_look(search, fed_grains(search.sizes))  # [Note: fed granularities] in deepcee.planner.space
    _progress(options, "layer splits", 0.0)
    ranked = sorted(search.configs.values(), key=lambda c: c.key)
    for k, cfg in enumerate(ranked[: options.sweep_top]):
        search.sweep(cfg)
        _progress(options, "layer splits", (k + 1) / max(1, min(len(ranked), options.sweep_top)))
    ranked = sorted(search.configs.values(), key=lambda c: c.key)
    cands: list[Candidate] = []
    picked: set[int] = set()
    first = _turns(search, ranked)
    _progress(options, "scoring plans", 0.0)
    for full, group in ((True, first), (False, _coverage(ranked))):
        for k, cfg in enumerate(group):
            _progress(options, "scoring plans", (k + 1) / len(group) / 2 + (0.0 if full else 0.5))
            if id(cfg) not in picked:
                picked.add(id(cfg))
                cands += search.plans_for(cfg, full=full)
    # every plan scored in full counts, also those the screen scored (short ones) and no list reached
    cands += [c for c in search.scored.values() if c is not None]
    if not cands:
        raise _infeasible(search)
    cands = sorted(_dedupe(cands), key=rank_key)
    _progress(options, "refining", 0.0)
    refined = [search.refine(c) for c in cands[: options.refine_top]]
    cands = sorted(_dedupe(cands + refined), key=rank_key)
    _progress(options, "layout polish", 0.0)
    near: list[Candidate] = []
    cands = sorted(_dedupe(cands + polish_layout(search, cands, near)), key=rank_key)  # [Note: layout polish]
    _progress(options, "compact schedules", 0.0)
    cands += _compacts(search, cands, ranked, near)
    cands = sorted(_dedupe(cands), key=rank_key)
    top = _confirm(search, cands)
    if search.second_look:  # [Note: second look]
        top, cands = _second_look(search, top, cands)
    if search.walk_look:  # the chain walk's chain ([Note: chain search] in deepcee.planner.chains)
        top, cands = _second_look(search, top, cands, search.walk_look, "the chain walk's island chain")
    for what, extra in search.count_look:
        top, cands = _second_look(search, top, cands, extra, what)  # [Note: stage counts] in deepcee.planner.grains
    _progress(options, "explanation", 0.0)
    top, explanation, counterfactuals, rescued = _explained(search, top, cands)
    # [Note: late looks]: after the explanation's own rescue, so that each can only make the plan faster
    late = [(lambda t, c: _second_look(search, t, c, fed, "stages of as many devices as a microbatch has samples"))
            ] if fed else []  # [Note: fed granularities] in deepcee.planner.space
    late.append(lambda t, c: _node_look(search, t, c))  # [Note: node look]
    late.append(lambda t, c: _order_look(search, t, c))  # [Note: compact order look]
    claims = [] if rescued is None else [rescued]  # notes saying where the plan came from
    for look in late:
        got, cands = look(top, cands)
        if got[0] is not top[0]:  # taken: faster than the plan so far, simulated
            mine = len(search.notes) - 1  # the look's own note saying so, its last
            for k in sorted(claims, reverse=True):  # the plan no longer comes from there
                del search.notes[k]
            mine -= len(claims)
            _progress(options, "explanation", 0.0)
            top, explanation, counterfactuals, rescued = _explained(search, got, cands)
            claims = [mine] + ([] if rescued is None else [rescued])
    best = top[0]
    plan = best.plan.replace(estimate=best.simulated or best.estimate, explanation=tuple(explanation))
    elapsed = time.perf_counter() - t0
    log.info("planned %s on %s in %.3f s (%d candidates): %.4g s per iteration", model.name, cluster.name,
             elapsed, search.evaluated, best.score_s)
    return PlanResult(plan=plan, explanation=tuple(explanation), candidates_evaluated=search.evaluated,
                      planning_s=elapsed, top=tuple(top), grouping=search.grouping, counterfactuals=tuple(counterfactuals),
                      scored=tuple(sorted(_dedupe(c for c in search.scored.values() if c is not None), key=rank_key)),
                      polish_steps=search.polish_steps)


def _explained(search: SearchState, top: list[Candidate], cands: list[Candidate]
               ) -> tuple[list[Candidate], list[str], list[Counterfactual], int | None]:
    """Explain ``top[0]``; where a counterfactual search found a plan the simulator prefers, take
    that one (first in ``top``) and explain it instead. Returns ``(top, explanation,
    counterfactuals, index of the note saying so or None)``."""
    opts, cluster, model = search.options, search.cluster, search.model
    best = top[0]
    explanation, counterfactuals = explain(search, best, cands)
    better = min((c for c in counterfactuals if opts.allow_exclusion
                  or len(c.plan.devices) == len(cluster.device_names)), key=lambda c: c.change, default=None)
    if better is None or better.change >= -1e-9:
        return top, explanation, counterfactuals, None
    # a constrained search found a plan the simulator prefers: take it (and explain it instead)
    best = Candidate(plan=better.plan, estimate=search.analytic().estimate(better.plan, cluster, model),
                     simulated=better.plan.estimate)
    search.notes.append("the best plan came from a counterfactual search (explained above)")
    rescued = len(search.notes) - 1
    _progress(opts, "explanation of the counterfactual's plan", 0.0)
    explanation, counterfactuals = explain(search, best, cands + [best])
    return [best, *top], explanation, counterfactuals, rescued


# [Note: late looks]
# The explanation's counterfactual searches (one stage more or fewer, an island added or left
# out) start from the search's best plan, and where one finds a faster plan it is taken. So a
# look that makes the search's best faster before them can make the returned plan slower: on
# mixed seed 33 of benchmarks/planner_mixed.py the fed look took 2.959 -> 2.906 s, and the
# counterfactual searches from its 5-stage plan found 2.894 s where those from the 10-stage plan
# had found 2.784 s. The fed look and the node look therefore run after that rescue, against
# the plan it returns, and a plan they find faster is explained (and rescued) anew.

# [Note: node look]
# The search's device sets are an island's groups by compute (a prefix of them, cut into chunks),
# and a group spans the island's nodes. Where the island's network is much slower than a node's
# own links (NVLink inside a server, a gigabit LAN or a small model's short iteration between
# servers), the best plan can be one node alone: its all-reduce and its activations stay on the
# node's links. No layout of the groups reaches it. On 40 fuzzed clusters with nodes of several
# kinds in one island (session 28), the best-single-node baseline simulated faster than deepcee's
# plan on five, by up to 1.8x (efficientnet-b0 at batch 17 on one 4-GPU NVLink node of an island
# joined at 1 Gbit/s: 4.90 ms against 8.80 ms on six devices of another island).
# So after the looks and the explanation ([Note: late looks]), each distinct node (identical nodes give identical plans) is searched on its
# own, by this same search on the cluster cut to the node, where: the search laid out no layout on
# exactly its devices, they can hold the model's state, and their bound is below the best plan's
# time; best bound first, at most NODE_LOOK_TOP. The bound is the larger of all samples over their
# summed speed (as the chain search's) and one sample's forward and input-gradient passes on the
# fastest of them. A node's plan is taken where the simulator rates it faster on the whole cluster.
# The same goes for an island's prefixes of groups (at most ISLAND_LOOK_TOP of them, on clusters of
# at most polish_max_devices devices, as the other late looks: at 512 devices two more searches of
# 64-device islands took plan from 5.1 to 15.2 CPU s, over its 10 s target): the search
# lays them out only where its chain search reaches them, and with more than exhaustive_islands
# islands its units are merged clusters of islands. On mixed seed 336 (9 regions, llama-7b at batch
# 3) no chain had us-central alone (one node of 7 L4s, the whole island), and the plan was 20
# stages over all of us-west at 2.838 s; the look searches it alone: 2.242 s (the independent
# reference: 2.274 s). Until session 30 the look assumed every island prefix was laid out, and its
# bound was the first term alone, which a batch of 3 samples makes no bound at all (the slow
# 16-device islands ranked first). On the random WAN clusters of planner_at_scale.py no node or island
# holds the model's state, so none is searched there.

NODE_LOOK_TOP = 4
"""Most nodes the node look searches on their own ([Note: node look])."""
ISLAND_LOOK_TOP = 2
"""Most island prefixes of groups (not one node) the node look searches on their own besides
([Note: node look])."""


def _node_look(search: SearchState, top: list[Candidate], cands: list[Candidate]
               ) -> tuple[list[Candidate], list[Candidate]]:
    """``(top, cands)`` with the best single node's plan first where it simulates faster than
    ``top[0]`` ([Note: node look]), else as they were."""
    opts, cluster, model = search.options, search.cluster, search.model
    if not opts.node_look or not opts.allow_exclusion or not top or top[0].simulated is None:
        return top, cands  # (a plan the simulator did not confirm has no figure to compare with)
    reached = {frozenset(d for slot in slots for d in slot) for slots in search.layouts_seen}
    state = model.parameter_count * model.state_bytes_per_parameter
    best_s = top[0].score_s
    nodes = {frozenset(devs): (f"node {name}", devs) for name, devs in distinct_nodes(cluster, model).items()}
    prefixes: dict[frozenset[str], tuple[str, tuple[str, ...]]] = {}
    for isl in search.grouping.islands:  # an island's prefixes of groups that are not one node
        for k in range(1, len(isl.groups) + 1):
            devs = tuple(d for g in isl.groups[:k] for d in g.devices)
            part = "" if k == len(isl.groups) else f" (its first {k} of {len(isl.groups)} device groups)"
            if frozenset(devs) not in nodes:
                prefixes.setdefault(frozenset(devs), (f"island {isl.name}{part}", devs))

    def ranked(sets: dict[frozenset[str], tuple[str, tuple[str, ...]]], most: int) -> list[tuple]:
        out = []
        for k, (key, (name, devs)) in enumerate(sets.items()):
            if key in reached or sum(cluster.memory_bytes(d) for d in devs) < state:
                continue
            # all samples over the summed speed; one sample's passes on the fastest device
            compute = search.global_batch / sum(1.0 / search.marginal_s(d) for d in devs)
            bound = max(compute, min(search.one_sample_s(d) for d in devs))
            if bound < best_s:
                out.append((bound, compute, k, name, devs))
        return sorted(out)[:most]

    islands_too = len(cluster.device_names) <= opts.polish_max_devices  # as the other late looks
    looks = ranked(nodes, NODE_LOOK_TOP) + (ranked(prefixes, ISLAND_LOOK_TOP) if islands_too else [])
    if not looks:
        return top, cands
    sub_options = dataclasses.replace(opts, node_look=False, explain_counterfactuals=False, progress=None)
    found: list[tuple[Candidate, str]] = []
    devs_of = {name: devs for _, _, _, name, devs in looks}
    for j, (_, _, _, name, devs) in enumerate(looks):
        _progress(opts, "node look", j / len(looks))
        try:
            got = _plan_training(cluster.subset(devs), model, search.global_batch, options=sub_options)
        except InfeasiblePlanError:
            continue
        plan = got.plan.replace(explanation=(), estimate=None)
        found.append((Candidate(plan=plan, estimate=search.analytic().estimate(plan, cluster, model),
                                simulated=search.confirm(plan)), name))
    if not found:
        return top, cands
    cand, name = min(found, key=lambda x: final_rank_key(x[0]))
    if cand.score_s >= top[0].score_s * (1 - 1e-9):  # faster, not a tie
        return top, cands
    island = search.grouping.island_of(cand.plan.devices[0])
    whole = {frozenset(d for g in isl.groups[:k] for d in g.devices)
             for isl in search.grouping.islands for k in range(1, len(isl.groups) + 1)}
    if frozenset(devs_of[name]) not in whole:
        why = (f"the island {island}'s device groups span its nodes, whose links between them are slower than the "
               "node's own")
    else:  # an island's prefix of groups (a node that is one too): the chain search did not reach it
        why = "the island search never laid these devices out alone"
    search.notes.append(f"the best plan is on {name} alone ({cand.score_s:.4g} s against {top[0].score_s:.4g} s "
                        f"on the search's device sets, simulated): {why}")
    return sorted([cand, *top], key=final_rank_key), sorted(_dedupe([*cands, cand]), key=rank_key)


# [Note: compact order look]
# The layout polish judges island orders with fixed schedules ([Note: layout polish] in
# :mod:`deepcee.planner.polish`), and a compact schedule can rank two orders the other way: on
# mixed seed 285 of ``benchmarks/planner_mixed.py`` (Llama 7B at batch 17, one device per stage,
# ap-south's 5 stages before uk-south's 10) the compact plan simulated 5.307 s, and the same stage
# counts with the two regions swapped, split by the bottleneck DP and given their own compact
# schedule, 5.092 s (the independent reference's polish found it in one move; by fixed schedules
# the swap was no better). So, last, where the plan is compact and its stages lie in runs of one
# island each, every swap of two neighbouring islands and the reversed order (three or more)
# are laid out with the plan's stage counts, microbatch size and sync, split by the DP (for
# ZB-H1's microbatches in flight, the base the compact builder starts from) and built as compact
# schedules; the best by the cost model, where faster than the plan, is refined and simulated,
# and taken where the simulator rates it faster. Not above ``polish_max_devices`` devices nor
# without a polish budget (as the polish). On the 60 mixed seeds 240-299 it was taken on 285
# alone; on WAN seeds 2, 9, 16 and 23 on seed 2 alone (49.925 -> 49.894 s).


def _order_look(search: SearchState, top: list[Candidate], cands: list[Candidate]
                ) -> tuple[list[Candidate], list[Candidate]]:
    """``(top, cands)`` with the best compact plan of another island order first where it
    simulates faster than ``top[0]`` ([Note: compact order look]), else as they were."""
    opts = search.options
    best = top[0] if top else None
    if (best is None or best.simulated is None or best.plan.schedule != "compact" or opts.polish_budget <= 0
            or len(search.cluster.device_names) > opts.polish_max_devices):
        return top, cands
    segs = segments_of(search, best.plan)
    if segs is None or len(segs) < 2:
        return top, cands
    names = [search.grouping.islands[x.island].name for x in segs]
    orders = [(segs[:k] + (segs[k + 1], segs[k]) + segs[k + 2:], f"{names[k]} and {names[k + 1]} swapped")
              for k in range(len(segs) - 1)]
    if len(segs) > 2:
        orders.append((segs[::-1], "the island order reversed"))
    n = best.plan.microbatch_size
    found: list[tuple[Candidate, str]] = []
    for k, (order, label) in enumerate(orders):
        _progress(opts, "compact order look", k / len(orders))
        base = layout_plan(search, order, n, "zb-h1", best.plan.sync)
        if base is None:
            continue
        built = search.compact(base, force=True)
        cand = search.score(built) if built is not None else None
        if cand is not None:
            found.append((cand, label))
    if not found:
        return top, cands
    cand, label = min(found, key=lambda x: rank_key(x[0]))
    if cand.estimate.iteration_s >= best.estimate.iteration_s * (1 - 1e-9):
        return top, cands
    cand = search.refine(cand)
    cand = Candidate(plan=cand.plan, estimate=cand.estimate, simulated=search.confirm(cand.plan))
    if cand.score_s >= best.score_s * (1 - 1e-9):  # faster, not a tie
        return top, cands
    search.notes.append(f"the best plan came from the compact order look: {label} ({cand.score_s:.4g} s against "
                        f"{best.score_s:.4g} s, simulated; the polish had judged the orders with fixed schedules)")
    return sorted([cand, *top], key=final_rank_key), sorted(_dedupe([*cands, cand]), key=rank_key)


def new_search(cluster: Cluster, model: ModelProfile, global_batch: int, options: PlannerOptions) -> SearchState:
    """The search state before step 1: devices grouped, range tables and cost model ready."""
    grouping = group_devices(cluster, island_threshold_s=options.island_threshold_s, speed_ratio=options.speed_ratio)
    search = SearchState(cluster=cluster, model=model, global_batch=global_batch, options=options, grouping=grouping,
                         tables=RangeTables(cluster, model, options.syncs, runtime=_runtime_of(options, cluster, model)),
                         cost_model=options.cost_model or AnalyticCostModel(), sizes=microbatch_sizes(global_batch, options),
                         max_stages=min(model.num_layers, options.max_stages or model.num_layers))
    search.min_boundary_bytes = min((model.boundary_bytes(b) for b in range(1, model.num_layers)), default=0.0)
    return search


def _runtime_of(options: PlannerOptions, cluster: Cluster, model: ModelProfile) -> RuntimeModel:
    """The runtime the cost model scores with (its buffers count in the DP's memory): the
    cluster's unless the cost model names one ([Note: which runtime plans a cluster])."""
    return getattr(options.cost_model, "runtime", None) or runtime_for(cluster, model)


def _dedupe(cands: Iterable[Candidate]) -> list[Candidate]:
    seen: dict[tuple, Candidate] = {}
    for c in cands:
        seen.setdefault(plan_key(c.plan), c)
    return list(seen.values())


def _screened(search: SearchState, ranked: list[Config]) -> list[Config]:
    """The ``screen_keep`` best of the closed form's ``screen_top`` configurations that admit a
    fixed schedule, by the cost model's screen of each such schedule ([Note: screening]), best
    first."""
    opts = search.options
    if opts.screen_keep == 0:
        return []
    pool = [cfg for cfg in _by_layout(ranked) if any(x in cfg.schedules for x in SCREEN_SCHEDULES)]
    got = [(min(search.screen(cfg, x) for x in SCREEN_SCHEDULES if x in cfg.schedules), k, cfg)
           for k, cfg in enumerate(pool[: opts.screen_top])]
    return [cfg for value, _, cfg in sorted(got, key=lambda x: x[:2])[: opts.screen_keep] if math.isfinite(value)]


def _turns(search: SearchState, ranked: list[Config]) -> list[Config]:
    """The screen's best and the closed form's best (``model_top`` of ``ranked``) taking turns at
    the score budget ([Note: screening]); a configuration may come twice."""
    return [c for pair in itertools.zip_longest(_screened(search, ranked), ranked[: search.options.model_top])
            for c in pair if c is not None]


def _by_layout(ranked: list[Config]) -> list[Config]:
    """``ranked`` (closed form, best first) in rounds over layouts: the best configuration of every
    layout, then the second best of every layout, and so on (each round in closed-form order).
    The closed form ignores the schedule, so one layout's microbatch sizes and splits could take
    every compact base (local-small/resnet-tiny/64: the two-stage layout whose compact schedule
    is best came after six variants of others)."""
    rounds: dict[tuple, int] = {}
    keyed = []
    for k, cfg in enumerate(ranked):
        r = rounds.get(cfg.layout.slots, 0)
        rounds[cfg.layout.slots] = r + 1
        keyed.append((r, k, cfg))
    return [cfg for _, _, cfg in sorted(keyed, key=lambda x: x[:2])]


def _coverage(ranked: list[Config]) -> list[Config]:
    """The best configuration per stage count and per island used (so the explanation can compare)."""
    out: dict[tuple, Config] = {}
    for cfg in ranked:
        out.setdefault(("stages", len(cfg.layout.slots)), cfg)
        out.setdefault(("islands", frozenset(cfg.layout.islands)), cfg)
        for isl in cfg.layout.islands:
            out.setdefault(("island", isl), cfg)
    return list(out.values())


def _compacts(search: SearchState, cands: list[Candidate], ranked: list[Config],
              near: Sequence[Candidate] = ()) -> list[Candidate]:
    """Compact schedules for the best distinct pipelines (stage devices, microbatch size), taken in
    turn from the cost-model ranking of fixed schedules and from the closed-form ranking (which
    ignores the schedule, as a compact schedule nearly does), up to ``compact_top``, and for the
    best :data:`NEAR_COMPACTS` of ``near`` (the polish's split tier's plans, [Note: layout polish]);
    then the best are refined. All within ``compact_budget`` stages x microbatches, the builder's cost (the best
    one's refinement builds its guides regardless, ``refine_best_guides``)."""
    opts = search.options
    if "compact" not in opts.schedules:
        return []
    by_model = _pipelines(cands)
    by_form: dict[tuple, Plan] = {}
    for cfg in _by_layout(ranked):
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
    chosen = dict(list(bases.items())[: opts.compact_top])
    near_bases = [plan for key, plan in _pipelines(sorted(near, key=rank_key)).items() if key not in chosen]
    plans = [*chosen.values(), *near_bases[:NEAR_COMPACTS]]
    out = []
    for plan in plans:
        built = search.compact(plan)
        if built is None:
            continue
        if (got := search.score(built)) is not None:
            out += [got, *search.sync_variants(got)]  # [Note: sync variants] in deepcee.planner.steps
    fixed: dict[tuple, Plan] = {}
    for c in cands:  # cost-model order: the best plan of each split
        if c.plan.num_stages >= 2 and c.plan.schedule != "compact":
            fixed.setdefault((c.plan.stages, c.plan.microbatch_size), c.plan)
    variants = sorted(_recompute_variants(search, list(fixed.values())[: opts.compact_top]), key=rank_key)
    out.sort(key=rank_key)
    if variants and (not out or rank_key(variants[0]) < rank_key(out[0])):
        out = [variants[0], *out]  # refined first (the best compact plan), the other variants not at all
        variants = variants[1:]
    out += [search.refine(c, first=k == 0) for k, c in enumerate(out)]  # all of them, as far as the budget lasts
    out += variants
    built = {(c.plan.stages, c.plan.microbatch_size) for c in out if c.plan.schedule == "compact"}
    large = any(c.plan.schedule == "compact" and c.plan.num_stages * c.plan.num_microbatches > opts.compact_max_actions
                for c in out)
    if bases and not built:
        search.notes.append("no compact schedule built for the best pipelines (a stage without room for one "
                            "microbatch, the compact budget spent, or two above compact_max_actions "
                            f"{opts.compact_max_actions} built already)")
    elif large:
        # (the note said "no compact schedule built" while the plan was compact: WAN seed 77)
        search.notes.append(f"{len(built)} compact schedule(s) built; those above compact_max_actions "
                            f"{opts.compact_max_actions} (stages x microbatches) from the builder's templates only")
    return out


def _pipelines(cands: Iterable[Candidate]) -> dict[tuple, Plan]:
    """The first fixed-schedule plan of ``cands`` of each pipeline (stage devices, microbatch size)
    with two or more stages, keyed by it (the key of :func:`_compacts`' bases)."""
    out: dict[tuple, Plan] = {}
    for c in cands:
        if c.plan.num_stages >= 2 and c.plan.schedule != "compact":
            out.setdefault((tuple(st.devices for st in c.plan.stages), c.plan.microbatch_size), c.plan)
    return out


NEAR_COMPACTS = 2
"""Compact schedules :func:`_compacts` builds for the polish's near plans, beyond ``compact_top``."""


def _recompute_variants(search: SearchState, plans: list[Plan]) -> list[Candidate]:
    """Compact schedules for ``plans`` (the best fixed-schedule pipelines, cost-model order) with
    recomputation wherever ZB-H2's microbatches in flight need it, with every stage recomputing and
    with their own recomputation (in that order); within ``recompute_variant_budget`` (a schedule
    built before is free). Only the best of them is refined (by :func:`_compacts`).

    [Note: compact recomputation]
    A fixed schedule holds a fixed count of microbatches in flight, so its stages recompute only
    where that count does not fit without (:meth:`~deepcee.planner.split.SplitTables.recompute_flags`),
    and a compact schedule built on such a plan inherits the flags. But a compact schedule holds
    as many microbatches in flight as memory admits, and over WAN links more in flight hide more
    of the round trip: recomputing buys in-flight room with compute. On the random WAN clusters of
    ``benchmarks/planner_at_scale.py`` the best fixed plan with a compact schedule and every stage
    recomputing was 20.6% faster than the same plan with its own flags (seed 60: 235.2 -> 186.7 s),
    and the flags ZB-H2 needs gave 24.4% (seed 50: 933.1 -> 705.0 s); on others the own flags win
    (seed 52: 55.8 s, 62.6 s with ZB-H2's), so all three are built and scored. Compact schedules
    above ``compact_max_actions`` are built from the builder's templates only (linear in the
    size), as everywhere in the search. Not above ``polish_max_devices`` devices (1.4 of 13 CPU s
    at 512 devices, with the same plan)."""
    opts = search.options
    if len(search.cluster.device_names) > opts.polish_max_devices:
        return []
    left = opts.recompute_variant_budget
    out = []
    for plan in plans:
        own = tuple(st.recompute for st in plan.stages)
        lay = StageLayout(slots=tuple(st.devices for st in plan.stages), islands=(), label="")
        tab = search.dp_inputs(lay, plan.microbatch_size)
        if not tab.recompute:
            continue
        split = [st.layer_start for st in plan.stages] + [plan.num_layers]
        h2 = tab.recompute_flags(split, schedule_in_flight("zb-h2", plan.num_stages, tab.m))
        for flags in dict.fromkeys((h2, (True,) * plan.num_stages, own)):
            base = plan.replace(schedule="zb-h1", actions=(), stages=tuple(
                dataclasses.replace(st, recompute=f) for st, f in zip(plan.stages, flags, strict=True)))
            size = plan.num_stages * plan.num_microbatches
            cached = (base.stages, base.microbatch_size, base.sync, False) in search.compacts
            if not cached and size > left:
                continue
            left -= 0 if cached else size
            built = search.compact(base, force=True)
            got = search.score(built, force=True) if built is not None else None
            if got is not None:
                out.append(got)
    return out


def _confirm(search: SearchState, cands: list[Candidate]) -> list[Candidate]:
    k = search.options.confirm_top
    if k == 0:
        return cands[:1]
    # the other syncs of the plans to simulate, where the cost model rates them faster ([Note: sync
    # variants] in deepcee.planner.steps)
    faster = [v for c in cands[:k] for v in search.sync_variants(c) if v.estimate.iteration_s < c.estimate.iteration_s]
    if faster:
        cands = sorted(_dedupe(cands + faster), key=rank_key)
    out, work = [], 0
    for j, c in enumerate(cands[:k]):
        _progress(search.options, "simulating the best plans", j / k)
        w = 6 * len(c.plan.devices) * c.plan.num_microbatches
        if work + w > search.options.confirm_max_work:
            break
        work += w
        out.append(Candidate(plan=c.plan, estimate=c.estimate, simulated=search.confirm(c.plan)))
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
    excess = [np.where(np.tril(np.ones_like(rc.compute_s, dtype=bool)), _INF, rc.memory_excess(1, False, tab.m))
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
