"""The built-in ``cee-small`` cluster (the main job's DeepCEE-shaped cluster): it loads, its
shape is the one its description states, and both planners plan on it, cheaply."""

from __future__ import annotations

from deepcee.models import get_model
from deepcee.planner.grouping import group_devices
from deepcee.planner.replicas import RelaxedOptions, plan_replicas
from deepcee.planner.search import plan_training
from deepcee.runtime.emulation import choose_dilation
from deepcee.scenarios import load_scenario, scenario_names


def _compute(cluster, devices) -> float:
    """Device-equivalents: a device of slowdown s counts 1 / s."""
    return sum(1.0 / cluster.device(d).slowdown for d in devices)


def test_cee_small_is_a_cloud_minority_cluster_of_single_device_islands():
    assert "cee-small" in scenario_names() and "local-small" in scenario_names()
    c = load_scenario("cee-small")
    islands = c.island_devices()
    assert [len(d) for d in islands.values()] == [1] * 6
    assert list(islands)[0] == "cloud"
    total = _compute(c, c.device_names)
    # the cloud's one device is the fastest, and a minority (about a quarter) of the compute
    assert _compute(c, islands["cloud"]) / total < 0.3
    assert all(c.device(d).slowdown >= 1.5 for isl, devs in islands.items() if isl != "cloud" for d in devs)
    # every site and end device is its own network island, as the grouping measures it
    assert len(group_devices(c).islands) == 6
    # six single-core processes within 1.2 cores: D = 3.83 / 1.2, below local-small's 3.75
    slow = [c.device(d).slowdown for d in c.device_names]
    assert 3.0 < choose_dilation(slow) < 3.75


def test_cee_small_plans_exact_and_relaxed():
    c = load_scenario("cee-small")
    model = get_model("gpt-tiny")
    exact = plan_training(c, model, 32).plan
    assert exact.semantics == "exact" and exact.devices
    opts = RelaxedOptions(periods=(16,), outer_optimizers=("average",), overlaps=(False,), accumulations=(1,),
                          staleness_bounds=(1,), full_syncs=(1,), exact_syncs=("allreduce-ring",))
    res = plan_replicas(c, model, 32, options=opts, exact_plan=exact)
    every = [s for s in res.candidates if s.plan.strategy.kind == "model-averaging" and s.plan.num_replicas == 6]
    assert every, "no model-averaging plan with a replica on every island"
    assert sum(r.batch for r in every[0].plan.replicas) == 32
