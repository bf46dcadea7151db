"""The crossover sweeps' planner re-scores the full search's layouts ([Note: sweep pool])."""

from __future__ import annotations

import pytest

from deepcee.models import get_model
from deepcee.planner.search import plan_training
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
