"""Stages in proportion to speed ([Note: stage counts] in deepcee.planner.grains): the speed
counts of a chain, and the count look (a second chain search with them, taken back from the main
search and searched on its own)."""

from __future__ import annotations

import itertools
import math

import pytest

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.planner.options import PlannerOptions
from deepcee.units import GIB

FAST = LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)


def _three_islands() -> tuple[Cluster, object]:
    """Islands ``a`` (5 fast devices), ``b`` (7 slow ones), ``c`` (3 mid ones); a 12-layer model."""
    from deepcee.profile import LayerProfile, ModelProfile

    kinds = {"fast": DeviceKind(name="fast", peak_flops_per_s=40e12, memory_bytes=16 * GIB),
             "slow": DeviceKind(name="slow", peak_flops_per_s=10e12, memory_bytes=8 * GIB),
             "mid": DeviceKind(name="mid", peak_flops_per_s=20e12, memory_bytes=12 * GIB)}
    sizes = {"a": ("fast", 5), "b": ("slow", 7), "c": ("mid", 3)}
    nodes = tuple(Node(name=f"{x}0", island=x, kind=k, devices=tuple(f"{x}0:{j}" for j in range(n)),
                       intra=LinkSpec(latency_s=5e-6, bandwidth_bytes_per_s=12.5e9)) for x, (k, n) in sizes.items())
    cluster = Cluster(name="three", kinds=kinds, islands=tuple(Island(name=x, intra=FAST) for x in sizes),
                      nodes=nodes, devices=tuple(Device(name=d, kind=n.kind, node=n.name, island=n.island)
                                                 for n in nodes for d in n.devices),
                      links=tuple(LinkEntry(a=x, b=y, spec=LinkSpec(latency_s=0.03, bandwidth_bytes_per_s=2e8))
                                  for x, y in itertools.combinations(sizes, 2)))
    model = ModelProfile(name="toy", input_bytes=1e5, layers=tuple(
        LayerProfile(name=f"l{k}", forward_flops=2e11, input_grad_flops=2e11, weight_grad_flops=2e11,
                     parameter_count=150_000_000, activation_bytes=1e6, output_bytes=1e5) for k in range(12)))
    return cluster, model


def test_speed_counts_split_the_layers_by_island_speed() -> None:
    from deepcee.planner.grains import island_sets, speed_counts
    from deepcee.planner.search import new_search

    cluster, model = _three_islands()
    search = new_search(cluster, model, 32, PlannerOptions())
    chain = tuple((i, len(isl.groups)) for i, isl in enumerate(search.grouping.islands))
    sets = island_sets(search, chain)
    speed = [sum(1.0 / search.marginal_s(d) for d in devs) for devs in sets]
    share = [model.num_layers * s / sum(speed) for s in speed]
    got = speed_counts(search, chain)
    assert 1 <= len(got) <= 2 and len(set(got)) == len(got)
    for counts in got:
        assert sum(counts) <= search.max_stages
        for n, devs, x in zip(counts, sets, share, strict=True):
            assert 1 <= n <= len(devs)
            assert n == min(len(devs), max(1, math.floor(x))) or n == min(len(devs), max(1, math.ceil(x)))
    assert share[0] > share[1] > 0  # the fast island's share of the layers is the larger


def test_the_count_look_is_taken_back_from_the_main_search() -> None:
    """The second chain search adds nothing to the main search: its configurations come back apart
    (none of them the main search's), with their screens cleared, and the main search's state and
    looks are as they were."""
    from deepcee.planner.search import _count_look, _search_chains, island_distances, new_search

    cluster, model = _three_islands()
    search = new_search(cluster, model, 32, PlannerOptions())
    dist = island_distances(cluster, search.grouping)
    _search_chains(search, dist)
    before = dict(search.configs)
    looks = (list(search.second_look), list(search.walk_look), search.chain_result, search.best_closed_form)
    added = _count_look(search, dist)
    assert search.configs == before
    assert (search.second_look, search.walk_look, search.chain_result, search.best_closed_form) == looks
    assert added  # on this cluster the speed counts give layouts the main search did not have
    assert all((c.layout.slots, c.n, c.split, c.recompute) not in before for c in added)
    assert all(not c.screened for c in added)


def test_count_options_are_checked() -> None:
    from deepcee.errors import PlanError

    with pytest.raises(PlanError, match="count_look"):
        PlannerOptions(count_look=1)


@pytest.mark.parametrize(("look", "most", "calls"), [(True, 128, 1), (False, 128, 0), (True, 8, 0)])
def test_the_count_look_runs_only_where_asked(monkeypatch, look: bool, most: int, calls: int) -> None:
    """``count_look=False`` (``deepcee plan --no-polish``, ``compare``'s sweeps), or a cluster of
    more than ``polish_max_devices`` devices, skip the second chain search; a plan comes back
    either way."""
    import deepcee.planner.search as search_module

    seen = []
    real = search_module._count_look

    def spy(search, dist):
        seen.append(1)
        return real(search, dist)

    monkeypatch.setattr(search_module, "_count_look", spy)
    cluster, model = _three_islands()
    result = search_module.plan_training(cluster, model, 32, options=PlannerOptions(
        count_look=look, polish_max_devices=most, explain_counterfactuals=False))
    assert len(seen) == calls and result.plan.num_stages >= 1


@pytest.mark.parametrize("batch", [16, 32, 64])
def test_the_count_look_never_makes_the_plan_slower(batch: int) -> None:
    """The main search is the same with or without the count look, and the look's plan is taken
    only where the simulator rates it faster: the plan with it is the plan without it, or a faster
    one (simulated)."""
    from deepcee.planner.search import plan_training

    cluster, model = _three_islands()
    off = plan_training(cluster, model, batch, options=PlannerOptions(count_look=False)).plan
    on = plan_training(cluster, model, batch, options=PlannerOptions()).plan
    assert on.estimate.iteration_s <= off.estimate.iteration_s
    if on.estimate.iteration_s == off.estimate.iteration_s:
        assert on.stages == off.stages and on.schedule == off.schedule
