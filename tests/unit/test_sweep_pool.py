"""The crossover sweeps' planner re-scores the full search's layouts ([Note: sweep pool])."""

from __future__ import annotations

import pytest

from deepcee.cluster import Cluster, LinkEntry, LinkSpec
from deepcee.models import get_model
from deepcee.planner.cost_model import AnalyticCostModel
from deepcee.planner.search import plan_training
from deepcee.planner.space import StageLayout, build_plan
from deepcee.planner.sweep_pool import PoolPlanner
from deepcee.scenarios import load_scenario
from deepcee.simulator.engine import simulate


@pytest.fixture(scope="module")
def planned():
    cluster, model = load_scenario("cee-testbed"), get_model("gpt2")
    return cluster, model, plan_training(cluster, model, 64)


def _layout(plan):
    return tuple(st.devices for st in plan.stages), tuple(st.layer_start for st in plan.stages)


def test_pool_plans_are_the_searchs_layouts_scored_by_the_simulator(planned) -> None:
    cluster, model, result = planned
    pool = PoolPlanner([result.plan, *(c.plan for c in result.counterfactuals)], [c.plan for c in result.scored])
    layouts = {_layout(p) for p in [result.plan, *(c.plan for c in result.counterfactuals),
                                    *(c.plan for c in result.scored)]}
    for batch in (32, 64, 256):
        for every in (False, True):
            got = pool(cluster, model, batch, use_all_devices=every)
            if got is None:
                continue
            assert _layout(got) in layouts and got.global_batch == batch
            assert not every or len(got.devices) == len(cluster.device_names)
            assert got.estimate.iteration_s == simulate(got, cluster, model, record=False).iteration_s


def test_pool_at_the_planned_point_gives_the_plan_back(planned) -> None:
    """Same batch, same links: the plan itself (its own compact actions) is in the pool."""
    cluster, model, result = planned
    got = PoolPlanner([result.plan])(cluster, model, 64)
    assert got is not None and got.estimate.iteration_s == pytest.approx(result.plan.estimate.iteration_s, rel=1e-9)
    kept = cluster.subset(result.plan.devices)
    sub = PoolPlanner([result.plan])(kept, model, 64)
    assert sub is not None and sub.estimate.iteration_s == pytest.approx(result.plan.estimate.iteration_s, rel=1e-9)


def _without_cloud_end(cluster: Cluster) -> Cluster:
    """The testbed with cloud and end joined only through edge (a routed pair)."""
    return Cluster(name=cluster.name, kinds=cluster.kinds, islands=cluster.islands, nodes=cluster.nodes,
                   devices=cluster.devices, links=tuple(e for e in cluster.links if {e.a, e.b} != {"cloud", "end"}))


def _slow(cluster: Cluster, island: str, bw: float) -> Cluster:
    """``cluster`` with every link entry of ``island`` at ``bw`` (latency kept)."""
    return cluster.with_links(LinkEntry(a=e.a, b=e.b, spec=LinkSpec(latency_s=e.spec.latency_s, bandwidth_bytes_per_s=bw))
                              for e in cluster.links if island in (e.a, e.b))


def test_cluster_views_see_what_a_plan_on_the_devices_sees(planned) -> None:
    """[Note: cluster views]: equal views, equal links and figures; a changed path, another view."""
    cluster, model, _ = planned
    names = cluster.device_names
    cloud_edge = tuple(d for d in names if not d.startswith("end"))
    cloud_end = tuple(d for d in names if not d.startswith("edge"))
    plan = build_plan(StageLayout(slots=(cloud_edge[:8], cloud_edge[8:]), islands=(), label="test"), (0, 7, 14),
                      cluster=cluster, model=model, global_batch=64, microbatch_size=16, schedule="1f1b",
                      sync="allreduce-ring")
    same = [cluster.subset(cloud_edge), _slow(cluster, "end", 1e6), _slow(cluster.subset(names[:-1]), "end", 1e9)]
    for other in same:
        assert other.view_key(cloud_edge) == cluster.view_key(cloud_edge)
        assert AnalyticCostModel().estimate(plan, other, model) == AnalyticCostModel().estimate(plan, cluster, model)
        assert simulate(plan, other, model, record=False).iteration_s == simulate(plan, cluster, model,
                                                                                 record=False).iteration_s
    assert _slow(cluster, "edge", 1e6).view_key(cloud_edge) != cluster.view_key(cloud_edge)
    routed = _without_cloud_end(cluster)
    assert routed.view_key(cloud_end) != cluster.view_key(cloud_end)  # the entry is gone
    # cloud -> end goes through edge: slowing edge's links changes the view of cloud and end alone
    slowed = _slow(routed, "edge", 1e6)
    assert slowed.link("cloud0:0", "end0:0") != routed.link("cloud0:0", "end0:0")
    assert slowed.view_key(cloud_end) != routed.view_key(cloud_end)
    assert routed.subset(cloud_end + ("edge0:0",)).view_key(cloud_end) == routed.view_key(cloud_end)


def test_pool_shares_figures_only_between_equal_views(planned) -> None:
    """One pool over the sweeps' clusters gives what a fresh pool gives at every call."""
    cluster, model, result = planned
    plans = [result.plan, *(c.plan for c in result.counterfactuals)]
    scored = [c.plan for c in result.scored]
    shared = PoolPlanner(plans, scored)
    kept = tuple(d for d in cluster.device_names if not d.startswith("end"))
    routed = _without_cloud_end(cluster)
    renamed = Cluster(name="renamed", kinds=cluster.kinds, islands=cluster.islands, nodes=cluster.nodes,
                      devices=cluster.devices, links=cluster.links)
    points = [(c, b) for c in (cluster, cluster.subset(kept), _slow(cluster, "end", 2e6), _slow(cluster, "end", 5e8),
                               routed, routed.subset(kept), _slow(routed, "edge", 2e6), renamed)
              for b in (32, 64)]
    for c, b in points + points:
        for every in (False, True):
            got, fresh = shared(c, model, b, use_all_devices=every), PoolPlanner(plans, scored)(c, model, b,
                                                                                        use_all_devices=every)
            assert (got is None) == (fresh is None)
            if got is not None:
                assert got == fresh and got.estimate == fresh.estimate
    assert 1 < len(shared.views) < len({(id(c), k) for c, _ in points for k in range(2)})


def test_best_using_takes_the_best_entry_on_a_left_out_device_and_add_grows_the_pool(planned) -> None:
    """The crossover's "with" from the pool ([Note: crossover]): the best entry that uses at least
    one of the given devices, even where the pool's best plan uses none of them; ``add`` takes the
    new searches' plans once."""
    cluster, model, result = planned
    plans = [result.plan, *(c.plan for c in result.counterfactuals)]
    left_out = frozenset(cluster.device_names) - set(result.plan.devices)
    pool = PoolPlanner(plans)
    best = pool(cluster, model, 64)
    assert best is not None and left_out.isdisjoint(best.devices)
    using = pool.best_using(cluster, model, 64, left_out)
    using_any = [p for p in plans if not left_out.isdisjoint(p.devices)]
    assert using_any, "the testbed's counterfactuals add an island the plan leaves out"
    assert using is not None and not left_out.isdisjoint(using.devices)
    assert using.estimate.iteration_s == simulate(using, cluster, model, record=False).iteration_s
    assert using.estimate.iteration_s > best.estimate.iteration_s
    assert pool.best_using(cluster, model, 64, ["no-such-device"]) is None
    small = PoolPlanner([result.plan])
    assert small.best_using(cluster, model, 64, left_out) is None
    assert small.add(using_any) and not small.add(using_any) and not small.add([result.plan])
    assert small.best_using(cluster, model, 64, left_out) is not None
