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
  stage count does not exceed the layers (islands coarsened one step at a time in turn, those
  with the most memory per device first: they can hold the extra layers), so the chain still
  gets a value;
- :func:`climb_grains`: from the best uniform layout of one of the best chains, change one
  island's granularity one step finer or coarser, take the best improving move, until none
  improves or ``grain_budget`` layouts are evaluated. Deterministic (fixed move order, ties
  keep the earlier).
"""

from __future__ import annotations

import math

from deepcee.planner.space import Chain, island_grains, mixed_layout
from deepcee.planner.steps import SearchState

_INF = math.inf


def _layout_value(search: SearchState, chain: Chain, grains: tuple[int, ...], sizes: list[int] | None) -> float:
    lay = mixed_layout(search.grouping, chain, grains, memo=search.pieces)
    if len(lay.slots) > search.max_stages:
        return _INF
    return search.evaluate_layout(lay, sizes)[0]


def _feasible_pick(search: SearchState, chain: Chain, choices: list[list[int]]) -> tuple[int, ...] | None:
    """Indices into ``choices`` of the finest grains with at most ``max_stages`` stages (module docstring)."""
    pick = [0] * len(chain)
    mem = []
    for i, keep in chain:
        devs = [d for g in search.grouping.islands[i].groups[:keep] for d in g.devices]
        mem.append(sum(search.cluster.memory_bytes(d) for d in devs) / len(devs))
    while len(mixed_layout(search.grouping, chain, [c[p] for c, p in zip(choices, pick, strict=True)],
                            memo=search.pieces).slots) \
            > search.max_stages:
        up = [k for k in range(len(chain)) if pick[k] + 1 < len(choices[k])]
        if not up:
            return None
        k = max(up, key=lambda k: (-pick[k], mem[k], -k))
        pick[k] += 1
    return tuple(pick)


def feasible_grains(search: SearchState, chain: Chain, sizes: list[int] | None = None) -> float:
    """The closed form of the finest mixed layout of ``chain`` with at most ``max_stages`` stages
    (module docstring); ``inf`` if it does not fit either."""
    choices = island_grains(search.grouping, chain)
    pick = _feasible_pick(search, chain, choices) if any(len(c) > 1 for c in choices) else None
    if pick is None:
        return _INF
    return _layout_value(search, chain, tuple(c[p] for c, p in zip(choices, pick, strict=True)), sizes)


def climb_grains(search: SearchState, chain: Chain) -> float:
    """Local search over ``chain``'s grains from its best uniform layout (module docstring);
    returns the best closed form found."""
    choices = island_grains(search.grouping, chain)
    if all(len(c) == 1 for c in choices):
        return _INF
    budget = search.options.grain_budget
    seen: dict[tuple[int, ...], float] = {}
    near: list[int] | None = None  # the uniform starts with every microbatch size, the moves near the best's

    def value(pick: tuple[int, ...]) -> float:
        if pick not in seen:
            seen[pick] = _layout_value(search, chain, tuple(c[p] for c, p in zip(choices, pick, strict=True)), near)
        return seen[pick]

    top = max(len(c) for c in choices)
    starts = [tuple(max(p for p, g in enumerate(c) if g <= 2 ** u or p == 0) for c in choices) for u in range(top)]
    starts = list(dict.fromkeys(starts + [p for p in (_feasible_pick(search, chain, choices),) if p is not None]))
    best, cur = min(((value(s), s) for s in starts), default=(_INF, ()))
    if not math.isfinite(best):
        return best
    near = search.sizes_near(4)
    while len(seen) < budget:
        moves = [cur[:k] + (cur[k] + d,) + cur[k + 1:] for k in range(len(cur)) for d in (-1, 1)
                 if 0 <= cur[k] + d < len(choices[k])]
        step = None
        for mv in moves:
            if mv in seen or len(seen) < budget:
                got = value(mv)
                if got < best * (1 - 1e-9) and (step is None or got < step[0]):
                    step = (got, mv)
        if step is None:
            break
        best, cur = step
    return best
