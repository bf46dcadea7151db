"""Each island its own granularity: how many devices share a stage, chosen per island (torch-free).

[Note: mixed granularity]
:func:`~deepcee.planner.space.chain_layouts` cuts every island of a chain into stages of at
most ``g`` devices with one ``g`` for the whole chain. The best plans on clusters whose regions
differ in memory and size mix them: a region of small-memory GPUs needs one device per stage
(each holds fewer layers), while a large region needs two or more per stage so the pipeline
keeps no more stages than layers and fewer bubbles (planner_at_scale seeds 1, 32, 47, 82: the
reference's plans, 1 device per stage in some regions and 2 in others, were outside every
uniform layout, and on seeds 1 and 32 every uniform layout of every chain was infeasible).

A chain's *grains* are one granularity per island (:func:`~deepcee.planner.space.island_grains`:
the values at which the island's chunk count changes). Two steps, both scored by the closed
form of step 1 (every microbatch size, :meth:`~deepcee.planner.steps.SearchState.evaluate_layout`):

- :func:`feasible_grains`: when no uniform layout of a chain fits, the finest grains whose
  stage count does not exceed the layers (islands coarsened one step at a time in rounds), so
  the chain still gets a value. Two picks, the better closed form kept: coarsening first the
  islands with the most memory per device (they can hold the extra layers), and coarsening
  first those with the slowest devices (near one layer per stage a stage's speed is its device
  count x device speed, so the fast islands should keep one device per stage and the slow ones
  pair up). Memory alone picked wrong on planner_at_scale seed 32: it kept eu-north's 12 slowest
  devices (8 GiB) at one per stage, closed form 1,074 s on the reference's chain reversed, where
  keeping uk-south's 8 fast ones fine gives 218.7 s; the best chain's value was 258.9 s (195.5 s
  with both picks), and the climb below, on the two best chains, never reached such layouts;
- :func:`climb_grains`: from the best uniform layout and both feasible picks of one of the best
  chains, change one island's granularity one step finer or coarser and take the best improving
  move; when no such step improves, trade one island's step coarser for another's step finer
  (the stage count stays near the layers, where single steps either exceed it or leave a small
  island unable to hold its layers); until none improves or ``grain_budget`` layouts with at
  most ``max_stages`` stages are evaluated. Deterministic (fixed move order, ties keep the
  earlier). With ``pairs`` (the guarded climbs of [Note: second look] in
  :mod:`deepcee.planner.search`), when neither improves, also two islands a step coarser, or two
  a step finer, at once, and ``work`` caps the devices laid out.

[Note: stage counts]
Granularities are powers of two, so an island of 13 devices has 13, 7, 4, 2 or 1 stages and
never 8-12, and the chain search values a chain by its uniform layouts (one granularity for
all its islands), which can be far off what the chain can do. On planner_at_scale seed 23 the
reference's chain (sa-east 13, us-east 5, eu-central 13, ap-south 9 devices; a 37-layer model)
has a closed form of 3,101 s over its uniform layouts, 240.8 s after the granularity climb and
199.0 s with 10, 3, 12 and 5 stages (an exhaustive count over all 7,590 count vectors of that
chain puts those first); the chain search never reached it (seed 75's reference chain: 2,895 s
uniform, 180.5 s with the counts below; ranked 110th of 150).

*Speed counts* (:func:`speed_counts`): the model's layers split over the chain's islands in
proportion to their summed device speed, rounded down and up, one stage per layer (at least
one stage, at most one per device, at most ``max_stages`` in all): near one layer per stage a
stage's time hardly depends on how many stages its island has, while more stages hold fewer
layers each and so keep more microbatches in flight to hide the round trips. Each is laid out
as even contiguous stages per island (:func:`counts_layout`,
:func:`~deepcee.planner.space.counted_layout`).

*The count look* (:func:`deepcee.planner.search._count_look`, ``count_look``): valuing every
chain also by its speed counts inside the main search reached those chains but changed which
chains and configurations the main search kept. So the chain search runs a second time, from
scratch, with every chain also laid out with its speed counts, on clusters of at most
``polish_max_devices`` devices (off for ``deepcee plan --no-polish`` and ``compare``'s
crossover sweeps); the configurations it adds are taken back and searched on their own after
the main search, and its plan is taken only where the simulator rates it faster, as the second
look's ([Note: second look] in :mod:`deepcee.planner.search`). On the 100 WAN instances of
``benchmarks/planner_at_scale.py`` it made 9 plans faster and none slower (simulated; seed 75:
225.0 -> 185.3 s, 81: 385.4 -> 345.1 s, 37: 120.4 -> 107.2 s, 23: 224.6 -> 210.2 s); median
planning CPU over the 100: 27.5 s, against 19.5 s in session 24's run (the machine's load
differed between the runs).

*The count search* (:func:`climb_counts`, ``count_budget`` layouts per chain), in the count look
(and the explanation's counterfactual searches, [Note: counterfactual counts] in
:mod:`deepcee.planner.explain`): after a granularity climb, from the better of where it ended and the speed counts, each
island in turn takes every count from half to twice its own (:func:`count_window`, about the
next coarser and finer granularity's), the others fixed, each improvement at once; after each
pass, the best *trade*: one island one stage more and another one fewer (the closed form follows
the total, so a line search alone stops where one island must gain the stage another gives up:
on seed 23's chain at (9, 3, 13, 5), 239.5 s; the trade to (10, 3, 12, 5) gives 199.0 s); until
no trade improves (even after a pass that did: a further pass is not tried) or the budget is
spent. Deterministic (fixed order; ties
keep the earlier). It follows every granularity climb of the count look's chain search (its
guarded climbs and chain walk included), and runs once more on the chains the main search
climbed, a set of its own. On the 100 WAN instances it made 20 plans faster than the speed
counts alone and none slower (session 26; seed 23: 210.2 -> 198.7 s, 11: 289.8 -> 279.4 s, 77:
178.2 -> 166.0 s, 69: 733.5 -> 706.6 s).

Inside the main search (session 25) it made 26 of the first 72 WAN seeds faster and 3 slower,
seed 43 by 16% (358.9 -> 416.8 s): its near copies of one chain's layout (35 to 38 stages,
closed forms 0.5% apart) took the first 8 of the 16 places in the screen's turns ([Note:
screening] in :mod:`deepcee.planner.search`); keeping only the layouts it started and ended on,
or only where it beat the climb by more than 2%, left seed 43 at 416.8 s.
"""

from __future__ import annotations

import itertools
import math

from deepcee.planner.space import (
    Chain,
    StageLayout,
    counted_layout,
    island_grains,
    kept_devices,
    mixed_layout,
)
from deepcee.planner.steps import SearchState

_INF = math.inf


def _layout_value(search: SearchState, chain: Chain, grains: tuple[int, ...], sizes: list[int] | None) -> float:
    lay = mixed_layout(search.grouping, chain, grains, memo=search.pieces)
    if len(lay.slots) > search.max_stages:
        return _INF
    return search.evaluate_layout(lay, sizes)[0]


def _feasible_pick(search: SearchState, chain: Chain, choices: list[list[int]],
                   first: list[float]) -> tuple[int, ...] | None:
    """Indices into ``choices`` of the finest grains with at most ``max_stages`` stages: islands
    coarsened one step at a time in rounds, within a round the highest ``first`` first (module
    docstring); ``None`` if even the coarsest has too many stages."""
    pick = [0] * len(chain)
    while len(mixed_layout(search.grouping, chain, [c[p] for c, p in zip(choices, pick, strict=True)],
                            memo=search.pieces).slots) > search.max_stages:
        up = [k for k in range(len(chain)) if pick[k] + 1 < len(choices[k])]
        if not up:
            return None
        k = max(up, key=lambda k: (-pick[k], first[k], -k))
        pick[k] += 1
    return tuple(pick)


def _feasible_picks(search: SearchState, chain: Chain, choices: list[list[int]]) -> list[tuple[int, ...]]:
    """The finest grains with at most ``max_stages`` stages, coarsening first the islands with the
    most memory per device, then (a second pick) those with the slowest devices (module docstring);
    distinct, in that order."""
    mem, slow = [], []
    for i, keep in chain:
        devs = [d for g in search.grouping.islands[i].groups[:keep] for d in g.devices]
        mem.append(sum(search.cluster.memory_bytes(d) for d in devs) / len(devs))
        slow.append(sum(search.marginal_s(d) for d in devs) / len(devs))
    picks = (_feasible_pick(search, chain, choices, first) for first in (mem, slow))
    return list(dict.fromkeys(p for p in picks if p is not None))


def _grains(choices: list[list[int]], pick: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(c[p] for c, p in zip(choices, pick, strict=True))


def feasible_grains(search: SearchState, chain: Chain, sizes: list[int] | None = None) -> float:
    """The best closed form of the finest mixed layouts of ``chain`` with at most ``max_stages``
    stages (module docstring); ``inf`` if none fits either."""
    choices = island_grains(search.grouping, chain, extra=search.grains)
    if all(len(c) == 1 for c in choices):
        return _INF
    return min((_layout_value(search, chain, _grains(choices, p), sizes)
                for p in _feasible_picks(search, chain, choices)), default=_INF)


def _moves(cur: tuple[int, ...], choices: list[list[int]], tier: int) -> list[tuple[int, ...]]:
    """Tier 0: one island one step finer or coarser; tier 1: one island one step coarser and
    another one step finer (the stage count then stays about the same); tier 2: two islands one
    step coarser, or two one step finer, at once."""
    def step(pick: tuple[int, ...] | None, k: int, d: int) -> tuple[int, ...] | None:
        if pick is None:
            return None
        return pick[:k] + (pick[k] + d,) + pick[k + 1:] if 0 <= pick[k] + d < len(choices[k]) else None

    if tier == 0:
        return [mv for k in range(len(cur)) for d in (-1, 1) if (mv := step(cur, k, d)) is not None]
    if tier == 1:
        pairs = [(step(step(cur, k, 1), j, -1)) for k, j in itertools.permutations(range(len(cur)), 2)]
    else:
        pairs = [step(step(cur, k, d), j, d) for d in (1, -1) for k, j in itertools.combinations(range(len(cur)), 2)]
    return [mv for mv in pairs if mv is not None]


def climb_grains(search: SearchState, chain: Chain, *, pairs: bool = False, work: list[int] | None = None,
                 counts: bool = False) -> float:
    """Local search over ``chain``'s grains from its best uniform or finest feasible layout (module
    docstring); returns the best closed form found. ``pairs``: when no single step or trade
    improves, two islands a step coarser (or finer) at once too. ``work``: a shared budget of
    devices laid out (each layout evaluated charges its devices; the climb stops when spent).
    ``counts``: then over each island's stage count from where it ended (:func:`climb_counts`,
    ``count_budget`` layouts more; the count look's, [Note: stage counts])."""
    choices = island_grains(search.grouping, chain, extra=search.grains)
    if all(len(c) == 1 for c in choices):
        return _INF
    budget = search.options.grain_budget
    seen: dict[tuple[int, ...], float] = {}
    spent = 0  # layouts evaluated (a layout with more stages than allowed costs nothing)
    near: list[int] | None = None  # the starts with every microbatch size, the moves near the best's

    def value(pick: tuple[int, ...]) -> float:
        nonlocal spent
        if pick not in seen:
            grains = _grains(choices, pick)
            lay = mixed_layout(search.grouping, chain, grains, memo=search.pieces)
            spent += len(lay.slots) <= search.max_stages
            if work is not None and (lay.slots, None if near is None else tuple(near)) not in search.layout_values:
                work[0] -= len(lay.devices)
            seen[pick] = _layout_value(search, chain, grains, near)
        return seen[pick]

    top = max(len(c) for c in choices)
    starts = [tuple(max(p for p, g in enumerate(c) if g <= 2 ** u or p == 0) for c in choices) for u in range(top)]
    starts = list(dict.fromkeys(starts + _feasible_picks(search, chain, choices)))
    best, cur = min(((value(s), s) for s in starts), default=(_INF, ()))
    if not math.isfinite(best):
        return best
    near = search.sizes_near(4)
    tier, last = 0, 2 if pairs else 1
    while spent < budget and (work is None or work[0] > 0):
        step = None
        for mv in _moves(cur, choices, tier):
            if mv in seen or (spent < budget and (work is None or work[0] > 0)):
                got = value(mv)
                if got < best * (1 - 1e-9) and (step is None or got < step[0]):
                    step = (got, mv)
        if step is None:
            if tier == last:
                break
            tier += 1  # nothing improves: trade one island's stages for another's, then (pairs) move two
            continue
        best, cur = step
        tier = 0
    if counts and search.options.count_budget > 0 and (work is None or work[0] > 0):
        sets = island_sets(search, chain)
        ended = tuple(-(-len(devs) // g) for devs, g in zip(sets, _grains(choices, cur), strict=True))
        best = min(best, climb_counts(search, chain, [ended, *speed_counts(search, chain)], near, work))
    return best


def count_window(devices: int, count: int) -> range:
    """The stage counts an island of ``devices`` cut into ``count`` stages searches: from half to
    twice ``count`` (about the counts of the next coarser and finer power-of-two granularity),
    within 1..``devices`` ([Note: stage counts])."""
    return range(max(1, -(-count // 2)), min(devices, 2 * count) + 1)


def island_sets(search: SearchState, chain: Chain) -> list[tuple[str, ...]]:
    """Each island's kept devices of ``chain`` (one merged set per island), in chain order."""
    islands = search.grouping.islands
    return [kept_devices(islands[i], islands[i].groups[:keep]) for i, keep in chain]


def speed_counts(search: SearchState, chain: Chain) -> list[tuple[int, ...]]:
    """Stage counts of ``chain`` with each island's stages about its share of the layers: the model's
    layers split in proportion to the islands' summed device speed, rounded down and up (at least
    one stage, at most one per device, at most ``max_stages`` in all; [Note: stage counts])."""
    sets = island_sets(search, chain)
    speed = [sum(1.0 / search.marginal_s(d) for d in devs) for devs in sets]
    layers = [search.model.num_layers * s / sum(speed) for s in speed]
    out = []
    for rounding in (math.floor, math.ceil):
        counts = [min(len(devs), max(1, int(rounding(x)))) for devs, x in zip(sets, layers, strict=True)]
        while sum(counts) > search.max_stages and max(counts) > 1:
            counts[max(range(len(counts)), key=lambda k: (counts[k], -k))] -= 1
        if sum(counts) <= search.max_stages:
            out.append(tuple(counts))
    return list(dict.fromkeys(out))


def counts_layout(search: SearchState, chain: Chain, counts: tuple[int, ...],
                  sets: list[tuple[str, ...]] | None = None) -> StageLayout:
    """``chain`` with island ``k``'s kept devices cut into ``counts[k]`` even stages (``sets``:
    its :func:`island_sets`, when known)."""
    sets = island_sets(search, chain) if sets is None else sets
    return counted_layout(search.grouping, list(zip((i for i, _ in chain), sets, counts, strict=True)))


def climb_counts(search: SearchState, chain: Chain, starts: list[tuple[int, ...]], sizes: list[int] | None,
                 work: list[int] | None = None, *, per_size: bool = False) -> float:
    """Local search over each island's stage count (any count, not only those of the powers of two)
    from the best of ``starts`` ([Note: stage counts]), each layout valued at its best microbatch
    size of ``sizes`` (``None``: every size); then, with ``per_size`` and several sizes, the same
    search at each size alone, from ``starts`` and where the first ended ([Note: counts per
    size]). Returns the best closed form found. ``work`` as in :func:`climb_grains`."""
    sets = island_sets(search, chain)
    best, end = _count_climb(search, chain, sets, starts, sizes, work)
    every = search.sizes if sizes is None else sizes
    if per_size and len(every) > 1:
        for n in every:
            best = min(best, _count_climb(search, chain, sets, [*starts, end], [n], work)[0])
    return best


# [Note: counts per size]
# Valued at its best microbatch size, a layout's closed form is the lower envelope of one landscape
# per size, and a climb on the envelope stays where one size is best. On WAN seed 118 of
# benchmarks/planner_at_scale.py the chain uk-south, eu-central, me-central, af-south, sa-east
# starts at one device per stage (9, 4, 4, 7, 6 stages; 139.2 s at one sample per microbatch) and
# no single count change or trade improves it there; at two samples per microbatch the same start
# is 197.8 s, and its climb at that size ends at 121.9 s, past the independent reference's
# (9, 4, 2, 6, 4), 130.7 s, whose plan simulates 117.9 s. Me-central's 4 devices in 2 stages need
# two samples per microbatch (each device a sample), so that layout is valued only at two or more.
# So after the climb on the envelope, the count search can climb once per size (``per_size``), each
# with its own ``count_budget``; a climb at a size where no start fits ends at once.
#
# Only the counterfactual searches do ([Note: counterfactual counts] in deepcee.planner.explain).
# In the count look ([Note: stage counts]) the per-size climbs changed plans both ways: on WAN
# seeds 0-22, 3 faster (11: 279.4 -> 274.3 s, 15: 153.2 -> 151.2 s, 0: -0.4%) and 2 slower
# (20: 42.56 -> 43.82 s, +2.95%, past the reference by as much; 14: +0.55%). Their extra
# configurations changed what the count look's second look scored: on seed 20 its plan, 42.56 s,
# came from the polish of that look's best fixed-schedule plan, which the new configurations
# displaced.


def _count_climb(search: SearchState, chain: Chain, sets: list[tuple[str, ...]], starts: list[tuple[int, ...]],
                 sizes: list[int] | None, work: list[int] | None) -> tuple[float, tuple[int, ...]]:
    """One climb of :func:`climb_counts` at ``sizes``: the best closed form and its counts."""
    seen: dict[tuple[int, ...], float] = {}
    budget = search.options.count_budget

    def value(counts: tuple[int, ...]) -> float:
        if counts not in seen:
            if sum(counts) > search.max_stages:
                seen[counts] = _INF
            else:
                lay = counts_layout(search, chain, counts, sets)
                if work is not None and (lay.slots, None if sizes is None else tuple(sizes)) not in search.layout_values:
                    work[0] -= len(lay.devices)
                seen[counts] = search.evaluate_layout(lay, sizes)[0]
        return seen[counts]

    def spent() -> bool:
        return len(seen) >= budget or (work is not None and work[0] <= 0)

    best, cur = min((value(c), c) for c in dict.fromkeys(starts))
    while not spent() and math.isfinite(best):
        for k in range(len(chain)):  # each island's count near its own, the others fixed
            for c in count_window(len(sets[k]), cur[k]):
                mv = cur[:k] + (c,) + cur[k + 1:]
                if mv in seen or not spent():
                    got = value(mv)
                    if got < best * (1 - 1e-9):
                        best, cur = got, mv
        step = None  # then trade one island's stage for another's (the total stays the same)
        for k, j in itertools.permutations(range(len(chain)), 2):
            mv = tuple(c + (1 if x == k else -1 if x == j else 0) for x, c in enumerate(cur))
            if 1 <= mv[j] and mv[k] <= len(sets[k]) and (mv in seen or not spent()):
                got = value(mv)
                if got < best * (1 - 1e-9) and (step is None or got < step[0]):
                    step = (got, mv)
        if step is None:
            break
        best, cur = step
    return best, cur
