"""The planner's knobs (torch-free): :class:`PlannerOptions`, read by every step of the search.

Its own module so that the search's parts (:mod:`~deepcee.planner.space`,
:mod:`~deepcee.planner.steps`, :mod:`~deepcee.planner.chains`, :mod:`~deepcee.planner.explain`)
and its callers (``compare``, the adapter, the CLI) import it without importing the search.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

from deepcee.errors import PlanError
from deepcee.plan import SCHEDULES
from deepcee.planner.cost_model import CostModel
from deepcee.planner.grouping import DEFAULT_ISLAND_THRESHOLD_S, DEFAULT_SPEED_RATIO

SYNC_CHOICES = ("allreduce-ring", "allreduce-hier")

Progress = Callable[[str, float], None]
"""``(what, fraction done)``: called by long searches (see :attr:`PlannerOptions.progress`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerOptions:
    """Knobs of :func:`~deepcee.planner.search.plan_training`. Defaults are what the CLI uses."""

    schedules: tuple[str, ...] = SCHEDULES
    microbatch_sizes: tuple[int, ...] | None = None
    """Microbatch sizes to try (divisors of the global batch); ``None``: every divisor."""
    syncs: tuple[str, ...] = SYNC_CHOICES
    max_stages: int | None = None
    island_threshold_s: float = DEFAULT_ISLAND_THRESHOLD_S
    speed_ratio: float = DEFAULT_SPEED_RATIO
    allow_exclusion: bool = True
    """Whether islands and slow groups may be left out."""
    recompute: bool = True
    """Whether stages may recompute activations (keep only the stage input per microbatch in
    flight and run the forward again before the backward: memory for compute)."""
    exhaustive_islands: int = 8
    """Up to this many islands, every ordered island subset is searched (branch and bound on a
    lower bound, so the result is exact over chains); above it, the islands are merged into this
    many and the exact search on the merged islands seeds a local search (see
    :mod:`deepcee.planner.chains`)."""
    sweep_top: int = 24
    """Configurations that get the in-flight-aware second DP (step 2)."""
    model_top: int = 12
    """Configurations scored by the cost model for every schedule and sync (step 3)."""
    refine_top: int = 4
    compact_top: int = 6
    refine_best_guides: int = 6
    """Neighbour splits of the best compact plan that get a (screened) compact schedule per step
    of its refinement, built whatever ``compact_budget`` (0: three, within the budget)."""
    confirm_top: int = 5
    """Plans confirmed with the simulator; 0 picks by the cost model alone."""
    confirm_max_work: int = 2_000_000
    """Most simulator work (devices x compute actions x 2, summed over the confirmed plans); the
    best plans are confirmed in order while they fit (a plan alone above it is not simulated).
    150,000 until session 23: on WAN seeds 85, 86 and 98 (41-stage plans of 1,024 microbatches)
    none of the best 5 was confirmed, and the cost model's pick simulated 6.3%, 13.4% and 5.1%
    slower than the plan the simulator picks at 2,000,000 (planning CPU about the same)."""
    compact_max_actions: int = 800
    """Build compact schedules only for plans with at most this many stages x microbatches."""
    compact_budget: int = 600
    """Stages x microbatches summed over the compact schedules built (after the first)."""
    recompute_variant_budget: int = 50_000
    """Stages x microbatches summed over the compact schedules built for the best fixed-schedule
    pipelines with more stages recomputing than their own schedule needs ([Note: compact
    recomputation]; the builder takes about 60 us of CPU per stage x microbatch; 0: none)."""
    refine_budget: int = 40_000
    """Work of boundary refinement in total, counted per cost-model evaluation as devices +
    stages x microbatches (what one evaluation costs); unlimited in effect for small clusters."""
    score_budget: int = 150_000
    """Stages x microbatches timed by the cost model in total (one evaluation times each stage's
    list once); past it the search stops scoring new plans (the best are scored first)."""
    screen_top: int = 32
    """Configurations (closed-form order) screened by the cost model with each fixed schedule
    they admit before step 3; the best ``screen_keep`` of them are scored in full first (see
    [Note: screening] in :mod:`deepcee.planner.search`)."""
    screen_keep: int = 4
    screen_budget: int = 150_000
    """Stages x microbatches of the shortened plans the screening times in total (past it, the
    screens of step 3 come out of ``score_budget``)."""
    chain_budget: int = 150
    """Most island chains evaluated in full (closed form for every layout and microbatch size);
    chains are taken in increasing lower bound, so the budget only matters when many chains
    have bounds below the best plan found (the printed gap then says how much could be missed;
    a local search over the devices used then evaluates up to ``chain_budget // 5`` more chains
    from each of the two best, [Note: chain search])."""
    walk_budget: int = 600
    """Chains the chain walk evaluates after a budget-stopped chain search, on clusters of at most
    ``polish_max_devices`` devices ([Note: chain search] in :mod:`deepcee.planner.chains`); 0: no
    walk. Its chain is searched on its own after the main search and kept only where the simulator
    rates its plan faster."""
    grain_budget: int = 24
    """Layouts the per-island granularity search evaluates per chain, on the best chains (see
    [Note: mixed granularity] in :mod:`deepcee.planner.grains`); 0: one granularity per chain."""
    count_budget: int = 48
    """Layouts the stage-count search evaluates per chain after its granularity search, in the
    count look only: any stage count per island near the granularities found, not only those of
    powers of two (see [Note: stage counts] in :mod:`deepcee.planner.grains`); 0: no count
    search (the count look still lays chains out with their speed counts)."""
    grain_chains: int = 10
    """The best chains (closed form) whose per-island granularities are searched. 10, not 2: on
    WAN seeds 11, 27 and 47 of ``benchmarks/planner_at_scale.py`` the best plan mixes
    granularities on a chain the closed form ranks below its second (session 8). Chains whose
    climb cannot beat the best closed form so far (cut at once) do not count."""
    polish_budget: int = 2_000_000
    """Stages x microbatches the layout polish may time in total (see [Note: layout polish] in
    :mod:`deepcee.planner.polish`); 0: no polish. 2,000,000, not 1,200,000: on WAN seeds 12 and
    47 of ``benchmarks/planner_at_scale.py`` (71 and 46 devices, 34 stages x 512 microbatches)
    the fourth step, the one that reaches the reference's plan, did not fit (seed 12: 204.7 ->
    186.1 s, 40 -> 60 CPU s; seed 47: 414.0 -> 362.6 s)."""
    polish_restarts: int = 2
    """After the climb from the best fixed-schedule plan, the layout polish climbs again from this
    many other starts, taking turns between the best plan of another island order and the best
    plan of another microbatch size, each with its own ``polish_budget`` (see [Note: layout
    polish] in :mod:`deepcee.planner.polish`); 0: one climb only."""
    polish_max_devices: int = 128
    """The layout polish, the compact recomputation variants, the second look ([Note: second
    look] in :mod:`deepcee.planner.search`) and the count look ([Note: stage counts] in
    :mod:`deepcee.planner.grains`) run only on clusters of at most this many devices.
    128, not 256: at 256 devices in 16 islands (``benchmarks/planning_time.py``
    synthetic-256) the polish took 80 of 99 CPU s for 4% (5.541 -> 5.325 s per iteration), and
    the variants cost 1.4 of the 13 CPU s at 512 devices, where ``plan`` has a 10 s target; the
    random WAN clusters of ``benchmarks/planner_at_scale.py``, where both were measured to pay,
    have 16-128 devices."""
    second_look: bool = True
    """After the main search, search the granularity climbs with two-island moves on their own and
    take their plan where the simulator rates it faster ([Note: second look] in
    :mod:`deepcee.planner.search`); ``False`` skips it (``deepcee plan --no-polish``)."""
    count_look: bool = True
    """After the main search, search the configurations of a second chain search that values every
    chain also by its stages in proportion to speed on their own, and take their plan where the
    simulator rates it faster ([Note: stage counts] in :mod:`deepcee.planner.grains`; clusters of
    at most ``polish_max_devices`` devices); ``False`` skips it (``deepcee plan --no-polish``, and
    ``compare``'s crossover sweeps)."""
    node_look: bool = True
    """After the looks, search single nodes on their own where the search's device sets span
    nodes, and take a node's plan where the simulator rates it faster ([Note: node look] in
    :mod:`deepcee.planner.search`); off where every device must be used."""
    explain_counterfactuals: bool = True
    """Plan and simulate the counterfactuals the explanation prints (each island left out or
    added, one stage more or fewer)."""
    cost_model: CostModel | None = None
    """Scores candidates (default :class:`~deepcee.planner.cost_model.AnalyticCostModel`)."""
    confirm_model: CostModel | None = None
    """Confirms the best (default :class:`~deepcee.planner.cost_model.SimulatorCostModel`)."""
    progress: Progress | None = None
    """Called with ``(step, fraction)`` as the search goes (the CLI prints it after 2 s)."""
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
        for name in ("sweep_top", "model_top", "refine_top", "compact_top", "confirm_top", "exhaustive_islands",
                     "chain_budget", "walk_budget", "refine_best_guides", "grain_budget", "count_budget", "grain_chains", "screen_top", "screen_keep",
                     "polish_budget", "polish_restarts", "polish_max_devices", "recompute_variant_budget",
                     "compact_budget", "refine_budget", "score_budget", "screen_budget", "confirm_max_work",
                     "compact_max_actions"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise PlanError(f"must be an integer >= 0, got {value!r}", field=name)
        for name in ("second_look", "count_look", "node_look"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"must be true or false, got {getattr(self, name)!r}", field=name)
        if self.exhaustive_islands < 1:
            raise PlanError(f"must be >= 1, got {self.exhaustive_islands!r}", field="exhaustive_islands")
