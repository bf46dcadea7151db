"""The island-chain search ([Note: chain search] in deepcee.planner.chains): when ``chain_budget``
stops the best-first search, a local search over the devices used starts from its best chains."""

from __future__ import annotations

import itertools

import deepcee.planner.search as search_module
from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.planner.chains import _moves
from deepcee.planner.search import (
    PlannerOptions,
    _search_chains,
    island_distances,
    new_search,
    plan_training,
)
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.units import GIB

FAST = LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)
FAR = LinkSpec(latency_s=0.02, bandwidth_bytes_per_s=1e8)
ISLANDS = ("a", "b", "c", "d", "e")


def _cluster(slow_flops_per_s: float) -> Cluster:
    """Five islands, each a fast device and a slower one (two groups per island)."""
    kinds = {"g": DeviceKind(name="g", peak_flops_per_s=20e12, memory_bytes=16 * GIB),
             "s": DeviceKind(name="s", peak_flops_per_s=slow_flops_per_s, memory_bytes=16 * GIB)}
    nodes, devices = [], []
    for k in ISLANDS:
        for j, kind in enumerate(("g", "s")):
            nodes.append(Node(name=f"{k}{j}", island=k, kind=kind, devices=(f"{k}{j}:0",), intra=FAST))
            devices.append(Device(name=f"{k}{j}:0", kind=kind, node=f"{k}{j}", island=k))
    return Cluster(name="two-speed", kinds=kinds, islands=tuple(Island(name=k, intra=FAST) for k in ISLANDS),
                   nodes=tuple(nodes), devices=tuple(devices),
                   links=tuple(LinkEntry(a=a, b=b, spec=FAR) for a, b in itertools.combinations(ISLANDS, 2)))


def _model() -> ModelProfile:
    return ModelProfile(name="toy", input_bytes=1e5, layers=tuple(
        LayerProfile(name=f"l{k}", forward_flops=2e11, input_grad_flops=2e11, weight_grad_flops=2e11,
                     parameter_count=200_000_000, activation_bytes=1e6, output_bytes=1e5) for k in range(10)))


def _chain_search(monkeypatch, cluster: Cluster):
    """Step 1 on ``cluster``: the search, the best-first search's own chains (before the local
    search) and each end of the local search with whether the cost model confirmed it."""
    search = new_search(cluster, _model(), 64, PlannerOptions())
    got: dict[str, list] = {"ends": []}
    real_chains, real_end = search_module.search_chains, search_module._confirmed_end

    def chains(*args, **kwargs):
        result, done = real_chains(*args, **kwargs)
        got["done"] = list(done)
        return result, done

    def end(search, chain):
        kept = real_end(search, chain)
        got["ends"].append((chain, kept))
        return kept

    monkeypatch.setattr(search_module, "search_chains", chains)
    monkeypatch.setattr(search_module, "_confirmed_end", end)
    _search_chains(search, island_distances(cluster, search.grouping))
    result = search.chain_result
    assert result.exact and result.gap > 0 and result.evaluated == 150  # the budget stopped it
    # two starts, each ``150 // 5`` single moves and as many pair drops where none improves
    assert 0 < search.chain_moves <= 2 * 2 * (150 // 5)
    return search, got


def test_a_budget_stopped_search_goes_on_over_the_devices_used(monkeypatch) -> None:
    """The bound favours chains with more devices, so the 150 chains of the best-first search are
    orders of (nearly) every device; the local search leaves the 40x slower devices out, and the
    cost model confirms it (best closed form 39.94 -> 19.75 s; the plan: 26.10 s simulated on all 10
    devices before, 19.20 s on the 3 fast devices of three islands)."""
    c = _cluster(0.5e12)
    search, got = _chain_search(monkeypatch, c)
    assert any(kept for _, kept in got["ends"])
    assert search.best_closed_form < 0.6 * min(v for v, _ in got["done"])
    best = min(search.configs.values(), key=lambda x: x.key)
    assert {c.kind_of(d).name for d in best.layout.devices} == {"g"}  # slow devices left out
    plan = plan_training(c, _model(), 64).plan
    assert {c.kind_of(d).name for d in plan.devices} == {"g"}


def test_an_end_the_cost_model_does_not_confirm_is_taken_back(monkeypatch) -> None:
    """With 10x slower devices the local search still finds chains the closed form prefers, but
    the cost model's screen does not: everything it added is taken back."""
    search, got = _chain_search(monkeypatch, _cluster(2e12))
    assert got["ends"] and not any(kept for _, kept in got["ends"])
    for chain, _ in got["ends"]:
        devices = frozenset(d for i, k in chain for grp in search.grouping.islands[i].groups[:k] for d in grp.devices)
        assert not any(cfg.layout.devices == devices for cfg in search.configs.values())


def test_the_local_search_without_reorders_only_changes_the_devices_used() -> None:
    chain = ((0, 2), (1, 2), (2, 1))
    moves = _moves(chain, 4, [2, 2, 2, 2], True, reorder=False)
    assert moves and len(set(moves)) == len(moves)
    for move in moves:
        assert {(i, k) for i, k in move} != set(chain)  # a different set of devices
        kept = [x for x in move if x[0] in {i for i, _ in chain}]
        assert [i for i, _ in kept] == [i for i, _ in chain if i in {j for j, _ in kept}]  # order kept
    # exactly the moves of the full neighbourhood that change the devices used (not the reorders)
    full = _moves(chain, 4, [2, 2, 2, 2], True)
    assert set(moves) == {x for x in full if set(x) != set(chain)}
    assert len(full) > len(moves)


def test_where_no_single_drop_improves_two_islands_are_dropped_together() -> None:
    """A chain of islands 0-4 at 10 s: dropping any one island alone is worse (12 s), dropping 3
    and 4 together is better (8 s). Without ``pair_drops`` the local search stops at the start;
    with it, it ends on (0, 1, 2), and the evaluations of the pairs are counted."""
    from deepcee.planner.chains import improve_chain

    start = tuple((i, 1) for i in range(5))
    calls: list = []

    def evaluate(chain) -> float:
        calls.append(chain)
        used = {i for i, _ in chain}
        if used == {0, 1, 2}:
            return 8.0
        return 12.0 if len(used) == 4 else 20.0

    kwargs = {"islands": 5, "keeps": [1] * 5, "allow_exclusion": True, "budget": 30, "reorder": False}
    value, end, spent = improve_chain(start, 10.0, evaluate, **kwargs)
    assert (value, end) == (10.0, start) and spent == 5  # the five single drops, none better
    calls.clear()
    value, end, spent = improve_chain(start, 10.0, evaluate, pair_drops=True, **kwargs)
    assert (value, end) == (8.0, ((0, 1), (1, 1), (2, 1)))
    assert spent == len(calls) == len(set(calls))  # every chain evaluated once, all counted
    assert ((0, 1), (1, 1), (2, 1)) in calls
