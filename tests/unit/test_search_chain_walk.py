"""The chain walk ([Note: chain search] in deepcee.planner.chains): after a budget-stopped
best-first search, an iterated local search over the islands used and their order, whose chain
is searched on its own and kept only where the simulator rates its plan faster."""

from __future__ import annotations

import itertools

import pytest
from test_search_chains import _cluster, _model  # the five-island toy

from deepcee.planner.chains import improve_chain, order_moves, walk_chains
from deepcee.planner.search import PlannerOptions, plan_training


def test_order_moves_are_every_swap_move_and_reversal_once() -> None:
    chain = tuple((i, 1) for i in range(5))
    moves = order_moves(chain)
    assert len(moves) == len(set(moves)) and chain not in moves
    assert all(sorted(m) == sorted(chain) for m in moves)  # the same islands, another order
    for a, b in itertools.combinations(range(5), 2):  # every swap
        swapped = list(chain)
        swapped[a], swapped[b] = swapped[b], swapped[a]
        assert tuple(swapped) in moves
    for k, j in itertools.permutations(range(5), 2):  # every island moved to every other place
        rest = list(chain[:k] + chain[k + 1:])
        rest.insert(j, chain[k])
        assert tuple(rest) in moves
    assert ((0, 1), (3, 1), (2, 1), (1, 1), (4, 1)) in moves  # a reversed run


def _toy(calls: list, strict: bool = True):
    """Islands 0-4, chains valued by a table: the start (0, 1, 2) at 10 s; the best, (2, 3, 0), at
    4 s, two moves away (island 1 replaced by 3, then the order reversed), every chain on the way
    worse than the start except (0, 3, 2) at 9 s; a chain holding island 4 does not fit."""
    table = {(0, 1, 2): 10.0, (0, 3, 2): 9.0, (2, 3, 0): 4.0}

    def evaluate(chain) -> float:
        calls.append(chain)
        assert not strict or all(i != 4 for i, _ in chain)  # the walk never evaluates it: does not fit
        return table.get(tuple(i for i, _ in chain), 20.0)

    return evaluate


def _fits(chain) -> bool:
    return all(i != 4 for i, _ in chain)


START = ((0, 1), (1, 1), (2, 1))


def test_the_walk_replaces_and_reorders_where_the_devices_used_search_stops() -> None:
    calls: list = []
    kwargs = {"islands": 5, "keeps": [1] * 5, "allow_exclusion": True}
    value, end, _ = improve_chain(START, 10.0, _toy(calls, strict=False), budget=50, reorder=False, pair_drops=True, **kwargs)
    assert (value, end) == (10.0, START)  # no drop, insert or pair drop improves
    calls.clear()
    value, end, spent = walk_chains(START, 10.0, _toy(calls), budget=50, fits=_fits, **kwargs)
    assert (value, end) == (4.0, ((2, 1), (3, 1), (0, 1)))
    assert spent == len(calls) == len(set(calls)) <= 50  # each chain evaluated once, all counted


def test_the_walk_is_deterministic_and_keeps_to_its_budget() -> None:
    runs = []
    for _ in range(2):
        calls: list = []
        got = walk_chains(START, 10.0, _toy(calls), islands=5, keeps=[1] * 5, allow_exclusion=True, budget=7,
                          fits=_fits)
        runs.append((got, calls))
        assert got[2] == len(calls) <= 7
    assert runs[0] == runs[1]


def test_chains_known_before_are_not_evaluated_again() -> None:
    calls: list = []
    known = {((0, 1), (3, 1), (2, 1)): 9.0, ((1, 1), (2, 1)): 20.0}
    walk_chains(START, 10.0, _toy(calls), islands=5, keeps=[1] * 5, allow_exclusion=True, budget=40, fits=_fits,
                known=known)
    assert calls and not set(calls) & set(known)


def test_without_exclusion_the_walk_only_reorders() -> None:
    calls: list = []
    walk_chains(START, 10.0, _toy(calls), islands=5, keeps=[1] * 5, allow_exclusion=False, budget=40,
                fits=_fits)
    # inserting a left-out island is allowed (the devices are all used in the end), dropping one is not
    assert all(len(c) >= 3 for c in calls)


@pytest.mark.parametrize("slow", [0.5e12, 2e12])
def test_the_walk_never_makes_the_plan_slower(slow: float) -> None:
    """Budget-stopped chain searches on the five-island toy: the walk's chain is searched on its
    own, and its plan replaces the main search's only where the simulator rates it faster."""
    c = _cluster(slow)
    with_walk = plan_training(c, _model(), 64, options=PlannerOptions(chain_budget=20))
    without = plan_training(c, _model(), 64, options=PlannerOptions(chain_budget=20, walk_budget=0))
    assert with_walk.plan.estimate.iteration_s <= without.plan.estimate.iteration_s * (1 + 1e-9)
    walked = [line for line in with_walk.explanation if "a walk over islands and orders" in line]
    assert walked and "a walk" not in " ".join(without.explanation)
    # here the walk's plan is taken: 26.10 -> 9.89 s (slow 0.5e12) and 14.36 -> 9.89 s (2e12)
    assert with_walk.plan.estimate.iteration_s < 0.75 * without.plan.estimate.iteration_s
    assert any("the chain walk's island chain" in line for line in with_walk.explanation)


def test_a_budget_beyond_the_chains_within_reach_ends() -> None:
    """Islands 0-2 hold 15 ordered subsets: a budget of 10**12 evaluates each once and returns."""
    calls: list = []
    value, end, spent = walk_chains(START, 10.0, _toy(calls), islands=3, keeps=[1] * 3, allow_exclusion=True,
                                    budget=10**12, fits=_fits)
    assert spent == len(calls) == len(set(calls)) <= 15
    assert value <= 10.0
