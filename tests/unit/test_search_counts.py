"""Any stage count per island ([Note: stage counts] in deepcee.planner.grains): the speed counts
of a chain, the windows of counts between two granularity steps, the count search's line searches
and trades, and the count look (the count search on the climbed chains, and a second chain search
with the speed counts, each taken back from the main search and searched on its own)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.planner.grains import climb_counts, count_window
from deepcee.planner.grouping import group_devices
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


@pytest.mark.parametrize("devices", [1, 2, 5, 7, 9, 13, 16, 24])
def test_the_windows_reach_every_count_the_granularities_skip(devices: int) -> None:
    """From the stage count of each power-of-two granularity (or the island's size), the windows
    reach the counts of the next coarser and finer granularity, so together they hold every count
    from 1 to the devices, and each stays in 1..devices around its own count."""
    grains = sorted({2 ** k for k in range(max(1, math.ceil(math.log2(devices))))} | {devices})
    counts = sorted({-(-devices // g) for g in grains})
    covered: set[int] = set()
    for lower, higher in zip(counts, counts[1:] + [devices], strict=True):
        window = count_window(devices, lower)
        assert lower in window and higher in window
        assert window.start >= 1 and window.stop - 1 <= devices
        covered |= set(window)
    assert covered == set(range(1, devices + 1))


def _grouping(sizes: tuple[int, ...]):
    kind = DeviceKind(name="g", peak_flops_per_s=20e12, memory_bytes=16 * GIB)
    names = [chr(ord("a") + k) for k in range(len(sizes))]
    nodes = tuple(Node(name=f"{x}0", island=x, kind="g", devices=tuple(f"{x}0:{j}" for j in range(n)),
                       intra=LinkSpec(latency_s=5e-6, bandwidth_bytes_per_s=12.5e9))
                  for x, n in zip(names, sizes, strict=True))
    cluster = Cluster(name="counts", kinds={"g": kind}, islands=tuple(Island(name=x, intra=FAST) for x in names),
                      nodes=nodes, devices=tuple(Device(name=d, kind="g", node=n.name, island=n.island)
                                                 for n in nodes for d in n.devices),
                      links=tuple(LinkEntry(a=x, b=y, spec=LinkSpec(latency_s=0.05, bandwidth_bytes_per_s=1e8))
                                  for x, y in itertools.combinations(names, 2)))
    return group_devices(cluster)


def _fake_search(sizes: tuple[int, ...], objective, *, budget: int = 48, max_stages: int = 100,
                 microbatch_sizes: tuple[int, ...] = (1,)):
    """A stand-in for the search state: ``evaluate_layout`` scores a layout by ``objective`` of its
    stage count per island (in chain order), and records every call. With several
    ``microbatch_sizes``, ``objective`` takes the size too and a layout gets its best over the
    sizes asked for (all by default), as the search's closed form."""
    grouping = _grouping(sizes)
    order = [isl.name for isl in grouping.islands]
    calls: list[tuple[int, ...]] = []

    def evaluate_layout(layout, sizes=None):
        counts = tuple(sum(1 for s in layout.slots if s[0].startswith(name + "0")) for name in order)
        calls.append(counts)
        if len(microbatch_sizes) == 1:
            return objective(counts), 1
        return min((objective(counts, n), n) for n in (microbatch_sizes if sizes is None else sizes))

    search = SimpleNamespace(grouping=grouping, options=PlannerOptions(count_budget=budget), max_stages=max_stages,
                             layout_values={}, evaluate_layout=evaluate_layout, sizes=list(microbatch_sizes))
    chain = tuple((i, len(isl.groups)) for i, isl in enumerate(grouping.islands))
    return search, chain, calls


def _threshold(counts: tuple[int, ...]) -> float:
    """Rugged like the closed form of WAN seed 23's chain: fewer than 10 stages in all is far worse
    (the stages hold too many layers to keep enough microbatches in flight); past that, island
    ``a`` is best at 5 stages and every extra stage costs a little."""
    a, _ = counts
    if sum(counts) < 10:
        return 1000.0
    return 10.0 + (a - 5) ** 2 + 0.5 * (sum(counts) - 10)


def test_a_trade_moves_on_where_every_line_search_stops() -> None:
    """From counts (7, 3) of islands of 7 and 5 devices: each island's own
    line search only worsens (one fewer stage in ``a`` drops the total under 10; more in ``b``
    adds cost), so only trading a stage of ``a`` for one of ``b`` moves on; two trades reach the
    exhaustive optimum (5, 5)."""
    search, chain, calls = _fake_search((7, 5), _threshold)
    start = _threshold((7, 3))
    line = [(a, 3) for a in count_window(7, 7)] + [(7, b) for b in count_window(5, 3)]
    assert min(_threshold(c) for c in line) >= start  # the line searches alone stay at the start
    got = climb_counts(search, chain, [(7, 3)], None)
    best = min(_threshold(c) for c in itertools.product(range(1, 8), range(1, 6)))
    assert got == best == 10.0
    assert (5, 5) in calls and (7, 3) == calls[0]


def test_the_count_search_keeps_to_its_budget_and_the_stage_limit() -> None:
    search, chain, calls = _fake_search((7, 5), _threshold, budget=4)
    climb_counts(search, chain, [(7, 3)], None)
    assert len(calls) <= 4
    search, chain, calls = _fake_search((7, 5), _threshold, max_stages=10)
    got = climb_counts(search, chain, [(7, 3)], None)
    assert all(sum(c) <= 10 for c in calls) and got == 10.0


def test_the_count_search_is_deterministic_and_never_worse_than_its_start() -> None:
    def bumpy(counts: tuple[int, ...]) -> float:
        return 50.0 + math.sin(3.1 * counts[0]) * 7 + math.cos(1.7 * counts[1] * counts[2]) * 5 - 0.3 * sum(counts)

    runs = []
    for _ in range(2):
        search, chain, calls = _fake_search((9, 6, 13), bumpy)
        got = climb_counts(search, chain, [(5, 3, 4)], None)
        runs.append((got, calls))
    assert runs[0] == runs[1]
    assert runs[0][0] <= bumpy((5, 3, 4)) and runs[0][0] == min(bumpy(c) for c in runs[0][1])


def test_the_count_search_climbs_each_microbatch_size_on_its_own() -> None:
    """[Note: counts per size]: at one sample per microbatch the start (7, 3) is best among every
    count its line searches and trades reach, and at two samples those counts are all worse than
    it, so the climb on the best of both sizes stays there; with ``per_size``, the climb at two
    samples alone walks down to (2, 2), better than anything at one sample."""
    def by_size(counts: tuple[int, ...], n: int) -> float:
        a, b = counts
        return 20.0 + (a - 7) ** 2 + (b - 3) ** 2 if n == 1 else 10.0 + 2.0 * (a - 2) ** 2 + 3.0 * (b - 2) ** 2

    search, chain, calls = _fake_search((7, 5), by_size, microbatch_sizes=(1, 2))
    assert climb_counts(search, chain, [(7, 3)], None) == 20.0  # the climb on the best of both sizes stays
    search, chain, calls = _fake_search((7, 5), by_size, microbatch_sizes=(1, 2))
    got = climb_counts(search, chain, [(7, 3)], None, per_size=True)
    assert got == 10.0 == min(by_size(c, n) for c in itertools.product(range(1, 8), range(1, 6)) for n in (1, 2))
    assert (2, 2) in calls
    # one size only: no climb per size, the climb on that size is all (the figure stays at the start)
    search, chain, calls = _fake_search((7, 5), by_size, microbatch_sizes=(1, 2))
    assert climb_counts(search, chain, [(7, 3)], [1], per_size=True) == 20.0
    # each per-size climb keeps to the budget: the first climb and one per size
    search, chain, calls = _fake_search((7, 5), by_size, budget=4, microbatch_sizes=(1, 2))
    climb_counts(search, chain, [(7, 3)], None, per_size=True)
    assert len(calls) <= 3 * 4


def test_the_counterfactual_searches_climb_stage_counts_from_the_plan(monkeypatch) -> None:
    """[Note: counterfactual counts] in deepcee.planner.explain: each "adding island" and "leaving
    out island" search climbs stage counts on its chains from the chosen plan's own counts per
    island (an added island one stage per device), at the microbatch sizes within 4 of the plan's;
    not where the count look is off."""
    import deepcee.planner.explain as explain_module
    from deepcee.planner.search import plan_training

    cluster, model = _three_islands()
    calls = []
    real = explain_module.climb_counts

    def spy(search, chain, starts, sizes, work=None, *, per_size=False):
        assert per_size  # [Note: counts per size]
        calls.append((tuple(search.grouping.islands[i].name for i, _ in chain), starts, sizes))
        return real(search, chain, starts, sizes, work, per_size=per_size)

    monkeypatch.setattr(explain_module, "climb_counts", spy)
    r = plan_training(cluster, model, 32)
    plan = r.plan
    counts: dict[str, int] = {}
    for st in plan.stages:
        isl = cluster.device(st.devices[0]).island
        counts[isl] = counts.get(isl, 0) + 1
    sizes = {isl.name: sum(1 for d in cluster.devices if d.island == isl.name) for isl in cluster.islands}
    added = [x for x in r.explanation if x.startswith("adding island")]
    left = [x for x in r.explanation if x.startswith("leaving out island")]
    assert added and left and len(calls) >= len(added) + len(left)
    for chain, starts, got in calls:
        assert len(set(chain) ^ set(counts)) == 1  # one island added or left out
        assert starts == [tuple(counts.get(x, sizes[x]) for x in chain)]
        n = plan.microbatch_size
        assert got and all(n / 4 <= x <= 4 * n for x in got)
    for line in added + left:  # each search's own chains were climbed
        name = line.split("island ")[1].split(" (")[0]
        assert any((name in chain) == line.startswith("adding") for chain, _, _ in calls)
    calls.clear()
    from deepcee.planner.options import PlannerOptions as Options

    plan_training(cluster, model, 32, options=Options(count_look=False))
    assert calls == []


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
    groups = _count_look(search, dist)
    assert [what for what, _ in groups] == ["the stage counts of the climbed chains",
                                            "the chain search with stages in proportion to speed"]
    added = [c for _, group in groups for c in group]
    assert all(group for _, group in groups) and search.configs == before
    assert (search.second_look, search.walk_look, search.chain_result, search.best_closed_form) == looks
    assert added  # on this cluster the speed counts give layouts the main search did not have
    assert all((c.layout.slots, c.n, c.split, c.recompute) not in before for c in added)
    assert all(not c.screened for c in added)


def test_count_options_are_checked() -> None:
    from deepcee.errors import PlanError

    with pytest.raises(PlanError, match="count_look"):
        PlannerOptions(count_look=1)
    with pytest.raises(PlanError, match="count_budget"):
        PlannerOptions(count_budget=-1)


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
