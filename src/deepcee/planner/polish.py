"""Layout polish: a local search from the search's best plan over its layout (torch-free).

[Note: layout polish]
Steps 1-3 reach a plan's layout only through the chain search (islands and their order chosen
by the closed form) and the granularity climb (one granularity per island, powers of two). The
independent reference of ``benchmarks/planner_at_scale.py``, polishing deepcee's own plan with
the simulator, found better plans one move away on 9 of 100 random WAN clusters (session 9):
one region in one stage fewer, two neighbouring regions swapped, a region left out, another
microbatch size. Those are plans of the plan space that the closed form ranked too low to be
scored. So, after refinement, :func:`polish_layout` climbs from the best plan with a fixed
schedule (a plan whose stages each lie in one island, the islands contiguous):

- **moves** (:func:`_moves`), each a new layout (every island's devices cut into its count of
  stages, evenly: :func:`~deepcee.planner.space.counted_layout`) split by the bottleneck DP at the
  plan's microbatch size for the plan's schedule: one island's stage count -2, -1, +1, +2, halved
  or doubled; two neighbouring islands swapped; the other sync (where ring and hierarchical
  all-reduce differ on the layout: [Note: sync move]); an island left out (when the rest can hold the
  model's state and ``allow_exclusion``); an unused island added at every place (one device per
  stage, or two); the next smaller and larger microbatch size; another fixed schedule; and, as
  a tier of their own tried only when the others and the split's climb are stuck, the stage
  count and island moves that put more devices in a stage than the microbatch has samples,
  with the smallest microbatch size that feeds each (among the others such a move won WAN
  seed 47's first step and led to an end 16% slower; on seed 0 it is the last step, -2%);
- **scoring** in three rounds, so that a step costs a few full scores: every move is timed by
  the cost model with ``2 S`` and ``4 S`` microbatches and extrapolated (as the screen,
  [Note: screening]); those within :data:`ROUGH_MARGIN` of the best move (or the current plan)
  again with ``6 S`` and ``12 S``; the best :data:`TRIES` of those within :data:`SCREEN_SLACK`
  of the best are scored in full; the best full score that improves on the current plan by more
  than :data:`MIN_GAIN` is the next step. (A cap on the moves the first screen passes on lost
  seed 3's best move, an island swap that screen rated seventh of 13; its error there reached
  7%, the second screen's 0.8%);
- **budget**: ``polish_budget`` stages x microbatches timed in total, the rounds charged what
  they time (a plan scored in full once, however many rounds ask for it); a step starts only
  when the budget can screen its whole neighbourhood, and a started step runs to its end (its
  second screen and full scores may overdraw the budget by one step), so a step is never
  judged on half its moves and its work is never thrown away (planner_at_scale seed 12: step 3
  spent 395,000 units, ran dry in its second screen and was dropped). Not run above
  ``polish_max_devices`` devices (the
  neighbourhood grows with the islands and planning time at 512 devices has a target).

When those moves are stuck, two tiers of their own are tried, one step each, before all the
moves again: the **order tier** (:func:`_order_moves`: every run of three or more islands
reversed, every island moved two or more places; the 2-opt and or-opt moves of a travelling
salesman's local search), then the moves that raise the microbatch size. The order of the
islands decides more than the slow links: which island's stages hold the most microbatches in
flight (the first), and which stage needs no recomputation (the last). On WAN seed 32 (6 regions,
39 stages) the best order of the plan's own stage counts, found by scoring all 720 orders with
the cost model (204 fit memory), was 214.2 s against the plan's 249.1 s; no swap of two
neighbours improved the plan, nor did reversing it (259.3 s by the first screen): the best
order was a move of this tier away from other starts. The tier is not among the plain moves
because it doubles a step's neighbourhood at 6-8 islands, and a step's screen costs about its
neighbourhood.

**Restarts.** A climb ends in a local optimum of its start. After the climb from the best
fixed-schedule plan, the polish climbs again from ``polish_restarts`` other starts (each with
its own budget; every end joins the candidates), taking turns: the best plan of an island order
no start has (a distinct sequence of islands), then the best plan of a microbatch size no start
has; all in cost-model order and at most :data:`RESTART_WITHIN` slower than the first start
(:func:`_starts`). On seed 32, the first climb stayed at 249.1 s while the climbs from the
second and third orders reached 214.2 s (the independent reference's best was 225.4 s); on
seed 77 the second order's climb led to 181.9 s against 193.0 s (reference: 182.4 s). Over the
100 WAN instances of ``benchmarks/planner_at_scale.py`` the tier and one such restart made 28
plans faster (by up to 26.7%) and none slower, for a median planning time of 14.7 against 13.4
CPU s (max 56.7 against 33.5). The restart by microbatch size came with the closed form's
neighbour cycle ([Note: neighbour cycle] in :mod:`deepcee.planner.split`), which changed the
starts: on seed 10 the two best starts, 140.03 and 140.06 s at one sample per microbatch, were
both local optima, while the climb from the best plan at two samples (147.8 s) reached 105.4 s;
on seed 52 the climb from the best plan at four samples reached 46.0 s against 58.1 s.

When no layout move improves, the same three rounds climb over the split: every stage boundary
one layer earlier or later (stages recomputing only where their microbatches in flight need
it). The refinement of step 3 cannot do that on long pipelines: it scores every neighbour in
full within ``refine_budget``, which one plan of 22 stages and 1,024 microbatches nearly
spends (planner_at_scale seed 3: the reference's polish found one boundary one layer later,
3.3% faster).

**The split tier.** A move's layout is split by the bottleneck DP, and where a link binds, every
split under the link ties and the DP's first can be far from the best: a layout move can be
slower with that split and faster once its split is climbed. On WAN seed 10 the plan stuck at
105.4 s (ap-southeast, us-west, ca-central and uk-south in 8, 4, 5 and 2 stages); ap-southeast
in 9 stages scored 106.4 s with the DP's split and 98.75 s after three boundary moves, the
independent reference's plan. So when every tier above is stuck, the best :data:`RESPLIT_TRIES`
layout moves by the second screen, within :data:`RESPLIT_WITHIN` of the current plan, are scored
in full and their splits climbed; the best end is the next step where it improves on the
current plan by more than :data:`MIN_GAIN`. The moves it scored, taken or not, are one move
from where the climb ended, and a compact schedule ranks plans differently from the fixed
schedules the polish climbs with: the search builds compact schedules for the best two of them,
beside its own bases (``NEAR_COMPACTS`` in :mod:`deepcee.planner.search`). On cee-testbed/resnet101/128 the move of
the cloud's 8 devices from 4 stages into 5 was 4.9% slower with ZB-H2 and, with its compact
schedule, the plan: 0.06179 s against 0.06357 s. (As candidates beside the others, they took
compact bases from better plans: a counterfactual of that instance got 3.6% slower.) The
plan the climb ends on is refined too (as every candidate) and returned with
the plans scored in full on the way; a compact schedule for it is built by the
search's compact step like for every other pipeline. Deterministic: fixed move order, ties
keep the earlier move.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from deepcee.plan import Plan
from deepcee.planner.ranges import syncs_differ
from deepcee.planner.space import (
    StageLayout,
    build_plan,
    counted_layout,
    schedule_in_flight,
)
from deepcee.planner.split import split_layers
from deepcee.planner.steps import SCREEN_SCHEDULES, Candidate, SearchState, rank_key, score_key

_INF = math.inf
ROUGH = (2, 4)
"""The first screen: every move timed with ``2 S`` and ``4 S`` microbatches, extrapolated."""
ROUGH_MARGIN = 0.10
"""Moves the first screen rates more than this above the best move (or the current plan) are
dropped; that screen was up to 7% off the full figure (WAN seed 3, 22 stages, 512 microbatches)."""
FINE = (6, 12)
"""The second screen, on the moves the first kept: ``6 S`` and ``12 S`` microbatches (within
0.8% of the full figure on seed 3's 13 moves, where ``4 S``/``8 S`` was 2.3% off)."""
TRIES = 2
"""Moves scored in full per step: the second screen's best, within :data:`SCREEN_SLACK`."""
SCREEN_SLACK = 0.01
"""A move is scored in full only if its second screen is within this of the best move's."""
RESTART_WITHIN = 0.10
"""A restart's start is at most this much slower (cost model) than the first climb's start (WAN
seed 77: the order whose climb found the plan started 7.2% slower)."""
MIN_GAIN = 1e-3
"""A step must improve the current plan's cost-model time by more than this fraction."""
RESPLIT_TRIES = 3
"""The split tier (module docstring): layout moves whose split is climbed, the second screen's
best."""
RESPLIT_WITHIN = 0.10
"""The split tier climbs a layout move's split only where its second screen is at most this much
slower than the current plan (WAN seed 10: the move that led to the reference's plan was 1.6%
slower before its split's climb, 6.3% faster after it; cee-testbed/resnet101/128: the move whose
compact schedule is the reference's plan screened 7.6% slower with a fixed schedule, 4.9%
scored in full). The first screen passes moves within :data:`ROUGH_MARGIN`, the same 10%."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One island's run of stages: the island's index in the grouping, its devices in plan order,
    and how many stages they form."""

    island: int
    devices: tuple[str, ...]
    stages: int


@dataclass(frozen=True, slots=True)
class _Move:
    label: str
    segments: tuple[Segment, ...]
    n: int
    schedule: str
    sync: str | None = None
    """``None``: the plan's own (only the sync moves set it)."""


def segments_of(search: SearchState, plan: Plan) -> tuple[Segment, ...] | None:
    """``plan``'s stages as runs of one island each; ``None`` when a stage spans islands or an
    island's stages are not contiguous (no layout move applies)."""
    # the grouping's islands, not the cluster file's: the network may cut a declared island in two
    # or join two (mixed seed 177 of benchmarks/planner_mixed.py: a KeyError on a cut island's name)
    where = {d: k for k, isl in enumerate(search.grouping.islands) for d in isl.devices}
    out: list[Segment] = []
    for st in plan.stages:
        islands = {where[d] for d in st.devices}
        if len(islands) != 1:
            return None
        k = islands.pop()
        if out and out[-1].island == k:
            out[-1] = Segment(k, out[-1].devices + st.devices, out[-1].stages + 1)
        elif any(s.island == k for s in out):
            return None
        else:
            out.append(Segment(k, st.devices, 1))
    return tuple(out)


def _moves(search: SearchState, segs: tuple[Segment, ...], n: int, schedule: str, *,
           raised: bool = False, sync: str | None = None) -> Iterator[_Move]:
    """The neighbours of a plan (module docstring), in a fixed order; ``raised``: instead, the
    island moves that need a larger microbatch size, each with the smallest that fits. ``sync``:
    the plan's; the others are moves where they differ ([Note: sync move])."""
    islands = search.grouping.islands
    most = min(search.max_stages, search.model.num_layers)
    total = sum(s.stages for s in segs)

    def ok(new: tuple[Segment, ...], size: int = n) -> bool:
        if not new or not all(1 <= s.stages <= len(s.devices) for s in new):
            return False
        return (sum(s.stages for s in new) <= most
                and size >= max(-(-len(s.devices) // s.stages) for s in new))  # every device gets a sample

    def sized(new: tuple[Segment, ...]) -> int | None:
        """The microbatch size for the layout ``new`` in this neighbourhood: the plan's (plain
        moves), or (``raised``), where a stage of ``new`` has more devices than the plan's size
        has samples, the smallest size that gives each a sample (adding an island two devices
        per stage to a plan of one sample per microbatch moves both at once: WAN seed 84's
        reference plan is such a pair of moves away)."""
        if ok(new):
            return None if raised else n
        return next((x for x in search.sizes if x > n and ok(new, x)), None) if raised else None

    def name(s: Segment) -> str:
        return islands[s.island].name

    def resized(size: int) -> str:
        return "" if size == n else f" (microbatch size {n} -> {size})"

    for sched in SCREEN_SCHEDULES if not raised else ():
        if sched != schedule and sched in search.options.schedules:
            yield _Move(f"schedule {sched}", segs, n, sched)
    if sync is not None and not raised and syncs_differ(search.cluster, _layout(search, segs).slots):
        for other in search.options.syncs:  # [Note: sync move]
            if other != sync:
                yield _Move(f"sync {other}", segs, n, schedule, other)
    for k, s in enumerate(segs):
        counts = dict.fromkeys((s.stages - 2, s.stages - 1, s.stages + 1, s.stages + 2, s.stages // 2, 2 * s.stages))
        for c in counts:
            new = segs[:k] + (Segment(s.island, s.devices, c),) + segs[k + 1:]
            if c != s.stages and (size := sized(new)) is not None:
                yield _Move(f"{name(s)} in {c} stages (was {s.stages}){resized(size)}", new, size, schedule)
    for k in range(len(segs) - 1 if not raised else 0):
        new = segs[:k] + (segs[k + 1], segs[k]) + segs[k + 2:]
        yield _Move(f"{name(segs[k])} and {name(segs[k + 1])} swapped", new, n, schedule)
    if search.options.allow_exclusion:
        state = search.model.parameter_count * search.model.state_bytes_per_parameter
        for k, s in enumerate(segs if not raised else ()):
            rest = segs[:k] + segs[k + 1:]
            if rest and sum(search.cluster.memory_bytes(d) for r in rest for d in r.devices) >= state and ok(rest):
                yield _Move(f"{name(s)} left out", rest, n, schedule)
        used = {s.island for s in segs}
        for i, isl in enumerate(islands):
            if i in used:
                continue
            room = most - total
            for c in dict.fromkeys(x for x in (min(len(isl.devices), room), min(-(-len(isl.devices) // 2), room))
                                   if x >= 1):
                added = Segment(i, isl.devices, c)
                for k in range(len(segs) + 1):
                    new = segs[:k] + (added,) + segs[k:]
                    if (size := sized(new)) is not None:
                        yield _Move(f"{isl.name} added at place {k} in {c} stages{resized(size)}", new, size, schedule)
    sizes = search.sizes
    if n in sizes and not raised:
        j = sizes.index(n)
        for size in (sizes[x] for x in (j - 1, j + 1) if 0 <= x < len(sizes)):
            if ok(segs, size):
                yield _Move(f"microbatch size {n} -> {size}", segs, size, schedule)


# [Note: sync move]
# A climb kept its start's sync for every move, so a layout it reached where the other sync is
# faster was never scored with it: the other syncs are moves of their own where they differ on the
# layout, and every other move keeps the current plan's sync (see [Note: sync variants] in
# :mod:`deepcee.planner.steps`).


def _order_moves(search: SearchState, segs: tuple[Segment, ...], n: int, schedule: str,
                 **_: object) -> Iterator[_Move]:
    """The order tier (module docstring): every run of three or more islands reversed (the whole
    order among them) and every island moved to a place two or more away (the moves one place
    away are the swaps of :func:`_moves`), the stage counts kept."""
    islands = search.grouping.islands
    for a, b in itertools.combinations(range(len(segs) + 1), 2):
        if b - a >= 3:
            yield _Move(f"{islands[segs[a].island].name} to {islands[segs[b - 1].island].name} reversed",
                        segs[:a] + segs[a:b][::-1] + segs[b:], n, schedule)
    for k, s in enumerate(segs):
        rest = segs[:k] + segs[k + 1:]
        for j in range(len(segs)):
            if abs(j - k) >= 2:
                yield _Move(f"{islands[s.island].name} moved to place {j}", rest[:j] + (s,) + rest[j:], n, schedule)


def _layout(search: SearchState, segs: tuple[Segment, ...]) -> StageLayout:
    return counted_layout(search.grouping, [(s.island, s.devices, s.stages) for s in segs])


def layout_plan(search: SearchState, segs: tuple[Segment, ...], n: int, schedule: str, sync: str) -> Plan | None:
    """The plan of ``segs`` (each island's devices cut evenly into its count of stages) at
    microbatch size ``n``, split by the bottleneck DP for ``schedule``'s microbatches in flight,
    recomputing where those need it (``None``: no split fits memory)."""
    lay = _layout(search, segs)
    tab = search.dp_inputs(lay, n)
    in_flight = schedule_in_flight(schedule, len(lay.slots), tab.m)
    got = split_layers(tab.loads(in_flight), tab.link_loads())
    return None if got is None else build_plan(
        lay, got[1], cluster=search.cluster, model=search.model, global_batch=search.global_batch,
        microbatch_size=n, schedule=schedule, sync=sync, system=search.options.system,
        recompute=tab.recompute_flags(got[1], in_flight))


class _Polish:
    """One climb's budget and the plans it built (see the module docstring)."""

    def __init__(self, search: SearchState) -> None:
        self.search = search
        self.used = 0
        self.plans: dict[tuple, Plan | None] = {}
        self.tried: list[Candidate] = []
        """The plans the split tier scored in full, taken or not (candidates for compact schedules)."""

    def left(self) -> int:
        return self.search.options.polish_budget - self.used

    def plan(self, move: _Move, sync: str) -> Plan | None:
        """The move's plan with ``sync`` unless the move sets its own: its layout split by the
        bottleneck DP for its schedule (``None``: no split fits memory)."""
        sync = move.sync or sync
        key = (move.segments, move.n, move.schedule, sync)
        if key not in self.plans:
            self.plans[key] = layout_plan(self.search, move.segments, move.n, move.schedule, sync)
        return self.plans[key]

    def timed(self, plan: Plan, short: tuple[int, int]) -> float:
        """``plan``'s cost-model time extrapolated from ``short`` microbatch counts (in full when
        it has few microbatches); ``inf`` when it does not fit memory. Charged to the budget."""
        s, m = plan.num_stages, plan.num_microbatches
        if m <= 2 * short[1]:
            got = self.full(plan)
            return _INF if got is None else got.estimate.iteration_s
        self.used += s * sum(short)
        search = self.search
        times = []
        for k in short:
            est = search.cost_model.estimate(plan.replace(global_batch=plan.microbatch_size * k, num_microbatches=k),
                                             search.cluster, search.model)
            if est.exceeds_memory(search.cluster.memory_bytes):
                return _INF
            times.append(est.iteration_s)
        return times[0] + (m - short[0]) * (times[1] - times[0]) / (short[1] - short[0])

    def full(self, plan: Plan) -> Candidate | None:
        """``plan`` scored in full by the cost model (``None``: does not fit), charged only when
        not scored before: the plan of a move with few microbatches is scored in full by each
        round, and its one scoring was charged three times (seed 13 of the WAN instances stopped
        with 11% of the budget left, its step admitted no more, and the reference's polish took
        three more steps)."""
        if score_key(plan) not in self.search.scored:
            self.used += plan.num_stages * plan.num_microbatches
        return self.search.score(plan, force=True)

    def cost(self, plan: Plan, short: tuple[int, int]) -> int:
        """The most :meth:`timed` can charge for ``plan`` at ``short``."""
        s, m = plan.num_stages, plan.num_microbatches
        return s * m if m <= 2 * short[1] else s * sum(short)

    def layout_moves(self, cur: Candidate, moves: Callable[..., Iterator[_Move]] = _moves) -> list[tuple[str, Plan]]:
        """``cur``'s neighbours by ``moves`` (default: the plain layout moves) as plans, those with
        a split that fits."""
        segs = segments_of(self.search, cur.plan)
        if segs is None:
            return []
        built = moves(self.search, segs, cur.plan.microbatch_size, cur.plan.schedule, sync=cur.plan.sync)
        return [(m.label, p) for m in built if (p := self.plan(m, cur.plan.sync)) is not None]

    def raised_moves(self, cur: Candidate) -> list[tuple[str, Plan]]:
        """The island moves that need a larger microbatch size, as plans."""
        return self.layout_moves(cur, functools.partial(_moves, raised=True))

    def order_moves(self, cur: Candidate) -> list[tuple[str, Plan]]:
        """The order tier's moves, as plans."""
        return self.layout_moves(cur, _order_moves)

    def boundary_moves(self, cur: Candidate) -> list[tuple[str, Plan]]:
        """``cur`` with one stage boundary one layer earlier or later, each stage recomputing
        only where its schedule's microbatches in flight need it."""
        plan, search = cur.plan, self.search
        lay = StageLayout(slots=tuple(st.devices for st in plan.stages), islands=(), label="")
        tab = search.dp_inputs(lay, plan.microbatch_size)
        in_flight = schedule_in_flight(plan.schedule, plan.num_stages, tab.m)
        cuts = [st.layer_start for st in plan.stages] + [plan.num_layers]
        out = []
        for s, step in itertools.product(range(1, plan.num_stages), (-1, 1)):
            new = list(cuts)
            new[s] += step
            if not new[s - 1] < new[s] < new[s + 1] or not tab.fits(new, in_flight):
                continue
            flags = tab.recompute_flags(new, in_flight)
            stages = tuple(dataclasses.replace(st, layer_start=new[k], layer_stop=new[k + 1], recompute=flags[k])
                           for k, st in enumerate(plan.stages))
            out.append((f"boundary {s} {step:+d} layer", plan.replace(stages=stages, estimate=None)))
        return out

    def screened(self, cur: Candidate, built: list[tuple[str, Plan]]) -> list[tuple[float, int]] | None:
        """The moves of ``built`` (``cur``'s neighbours) that pass the first screen, as (second
        screen's time, index) in ascending order; ``None`` when the budget cannot screen them all."""
        worst = sum(self.cost(p, tuple(x * p.num_stages for x in ROUGH)) for _, p in built)
        if not built or worst > self.left():
            return None
        rough = [(self.timed(p, tuple(x * p.num_stages for x in ROUGH)), k) for k, (_, p) in enumerate(built)]
        cut = min([cur.estimate.iteration_s] + [t for t, _ in rough]) * (1 + ROUGH_MARGIN)
        fine = sorted((self.timed(built[k][1], tuple(x * built[k][1].num_stages for x in FINE)), k)
                      for t, k in rough if t <= cut)
        return [(t, k) for t, k in fine if math.isfinite(t)]

    def step(self, cur: Candidate, built: list[tuple[str, Plan]]) -> tuple[Candidate, str] | None:
        """The best improving plan of ``built`` (``cur``'s neighbours) scored in full and its
        label, or ``None`` (none improves, or the budget cannot screen them all)."""
        fine = self.screened(cur, built)
        if not fine:
            return None
        bar = fine[0][0] * (1 + SCREEN_SLACK)
        best = None
        for t, k in fine[:TRIES]:
            if t > bar:
                break
            p = built[k][1]
            got = self.full(p)
            if got is not None and (best is None or rank_key(got) < rank_key(best[0])):
                best = (got, built[k][0])
        if best is None or best[0].estimate.iteration_s >= cur.estimate.iteration_s * (1 - MIN_GAIN):
            return None
        return best

    def resplit_step(self, cur: Candidate) -> list[tuple[Candidate, str]] | None:
        """The split tier (module docstring): of ``cur``'s layout moves, the best
        :data:`RESPLIT_TRIES` by the second screen within :data:`RESPLIT_WITHIN` of ``cur``, each
        scored in full and its split climbed by one-layer boundary moves; the best end's path
        (the move, then each boundary step, with labels) where it improves on ``cur`` by more
        than :data:`MIN_GAIN`, else ``None``."""
        built = self.layout_moves(cur)
        fine = self.screened(cur, built)
        if not fine:
            return None
        best: list[tuple[Candidate, str]] | None = None
        for t, k in fine[:RESPLIT_TRIES]:
            if t > cur.estimate.iteration_s * (1 + RESPLIT_WITHIN):
                break
            got = self.full(built[k][1])
            if got is None:
                continue
            path = [(got, built[k][0])]
            while (nxt := self.step(path[-1][0], self.boundary_moves(path[-1][0]))) is not None:
                path.append(nxt)
            self.tried += [c for c, _ in path]
            if best is None or rank_key(path[-1][0]) < rank_key(best[-1][0]):
                best = path
        if best is None or best[-1][0].estimate.iteration_s >= cur.estimate.iteration_s * (1 - MIN_GAIN):
            return None
        return best


def polish_layout(search: SearchState, cands: list[Candidate], near: list[Candidate] | None = None) -> list[Candidate]:
    """Climb from the best fixed-schedule plan of ``cands`` (cost-model order) over its layout,
    then again from ``polish_restarts`` other starts (other island orders and microbatch sizes,
    :func:`_starts`; module docstring); the plans on the way and the refined ends, or ``[]``
    (nothing to polish: no such plan, too many devices, or no budget). ``near``: the split tier's
    other plans are added to it (bases for compact schedules)."""
    opts = search.options
    if opts.polish_budget <= 0 or len(search.cluster.device_names) > opts.polish_max_devices:
        return []
    starts = _starts(search, cands, 1 + opts.polish_restarts)
    out: list[Candidate] = []
    for k, start in enumerate(starts):
        def report(share: float, k: int = k) -> None:  # a climb's share of the polish: its budget spent
            if opts.progress is not None:
                opts.progress("layout polish", (k + min(1.0, share)) / len(starts))

        out += _climb(search, start, _start_label(search, starts, k), report, near)
    return out


def _start_label(search: SearchState, starts: list[Candidate], k: int) -> str:
    """What start ``k`` of :func:`_starts` is, for the polish's note."""
    if k == 0:
        return "the search's best fixed-schedule plan"
    orders = [tuple(s.island for s in segments_of(search, c.plan) or ()) for c in starts[: k + 1]]
    if orders[k] not in orders[:k]:
        return f"the best plan of island order {len(dict.fromkeys(orders))} (restart {k})"
    return f"the best plan at microbatch size {starts[k].plan.microbatch_size} (restart {k})"


def _starts(search: SearchState, cands: list[Candidate], count: int) -> list[Candidate]:
    """The first fixed-schedule plan of ``cands`` (cost-model order) with its stages in runs of
    one island each, then, taking turns, the first plan of an island order no start has and the
    first plan of a microbatch size no start has (module docstring), ``count`` in all, each at
    most :data:`RESTART_WITHIN` slower than the first."""
    pool: list[tuple[Candidate, tuple[int, ...]]] = []
    for c in cands:
        if c.plan.schedule == "compact":
            continue
        segs = segments_of(search, c.plan)
        if segs is None:
            if not pool:  # the best fixed-schedule plan spans islands: no climb at all, as before
                return []
            continue
        if pool and c.estimate.iteration_s > pool[0][0].estimate.iteration_s * (1 + RESTART_WITHIN):
            break  # cost-model order: every later plan is further off
        pool.append((c, tuple(s.island for s in segs)))
    if not pool:
        return []
    out = [pool[0]]
    while len(out) < count:
        orders = {o for _, o in out}
        sizes = {c.plan.microbatch_size for c, _ in out}
        by_order = next((x for x in pool if x[1] not in orders), None)
        by_size = next((x for x in pool if x[0].plan.microbatch_size not in sizes), None)
        turns = (by_order, by_size) if len(out) % 2 else (by_size, by_order)
        got = next((x for x in turns if x is not None), None)
        if got is None:
            break
        out.append(got)
    return [c for c, _ in out]


def _climb(search: SearchState, start: Candidate, what: str,
           report: Callable[[float], None] = lambda share: None, near: list[Candidate] | None = None) -> list[Candidate]:
    """One climb from ``start`` with its own ``polish_budget``: the plans on the way (one per step)
    and the refined end (``[]`` where no move improves); the split tier's other plans are added to
    ``near``. ``report``: called after every step with the
    share of the budget spent."""
    climb = _Polish(search)
    cur, out, labels = start, [], []

    def step(built: list[tuple[str, Plan]]) -> tuple[Candidate, str] | None:
        got = climb.step(cur, built)
        report(climb.used / max(1, search.options.polish_budget))  # after every step, taken or not
        return got

    while True:
        for moves in (climb.layout_moves, climb.boundary_moves):  # the layout first, then its split
            while (nxt := step(moves(cur))) is not None:
                cur = nxt[0]
                out.append(cur)
                labels.append(nxt[1])
                search.polish_steps += 1
        # stuck: the order tier, then the moves that also raise the microbatch size, one step,
        # then all again (tiers of their own: the order tier doubles a step's moves at 6-8
        # islands; among the others, a raising move won seed 47's first step and led to a worse
        # end, 421.0 s against 362.6)
        if (nxt := step(climb.order_moves(cur))) is None and (nxt := step(climb.raised_moves(cur))) is None:
            # last, the split tier: a layout move that is slower with the DP's split and faster
            # once its split is climbed (WAN seed 10)
            path = climb.resplit_step(cur)
            report(climb.used / max(1, search.options.polish_budget))
            if path is None:
                break
            out.append(path[-1][0])
            labels.append(", then ".join(label for _, label in path))
            cur = path[-1][0]
            search.polish_steps += 1
            continue
        cur = nxt[0]
        out.append(cur)
        labels.append(nxt[1])
        search.polish_steps += 1
    search.polish_used += climb.used
    if cur is not start:
        out.append(search.refine(cur))
        search.notes.append(f"layout polish from {what} ({start.estimate.iteration_s:.4g} s "
                            f"by the cost model): {'; '.join(labels)} ({out[-1].estimate.iteration_s:.4g} s after "
                            f"refinement)")
    if near is not None:  # the split tier's plans, taken or not (module docstring)
        near += [c for c in climb.tried if all(c is not x for x in out)]
    return out
