"""The polish of ``benchmarks/wan_reference.py`` (the reference of ``planner_at_scale``): every
neighbour it tries is a valid plan of the plan space (a compact plan's neighbours get their own
compact schedule), and the plan it returns is simulated at the figure it reports."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import sys
from pathlib import Path

import pytest
from conftest import random_cluster, toy_model

from deepcee.planner.options import PlannerOptions
from deepcee.planner.search import plan_training
from deepcee.simulator import simulate


def _module():
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(root))  # wan_reference is imported by name by planner_at_scale too
    try:
        spec = importlib.util.spec_from_file_location("wan_reference", root / "wan_reference.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("wan_reference", mod)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(root))


def _instance(seed: int):
    rng = random.Random(seed)
    c = random_cluster(rng, name=f"r{seed}")
    m = toy_model(8, params=20_000_000)
    return c, m


@pytest.mark.parametrize("seed", [1, 4])
def test_neighbours_of_a_compact_plan_are_valid_plans_with_their_own_schedules(seed):
    ref_mod = _module()
    c, m = _instance(seed)
    r = plan_training(c, m, 32, options=PlannerOptions(schedules=("compact",), confirm_top=1))
    plan = r.plan
    assert plan.schedule == "compact" or plan.num_stages == 1
    ref = ref_mod._Reference(c, m, plan.global_batch, 1e9)
    labels = []
    for label, trial in ref_mod._neighbours(ref, plan):
        labels.append(label)
        assert trial.global_batch == plan.global_batch
        assert trial.num_microbatches * trial.microbatch_size == plan.global_batch
        if trial.schedule == "compact":
            # its actions are the builder's for its own stages and microbatches
            rebuilt = ref_mod._compact(trial.replace(schedule="zb-h1", actions=()), c, m)
            assert rebuilt is not None and rebuilt.actions == trial.actions
    assert any(lab.startswith("schedule") for lab in labels)
    if plan.num_stages > 1:
        assert any(lab.startswith("boundary") for lab in labels)


def test_polish_from_a_worse_plan_improves_it_and_reports_the_simulated_figure():
    ref_mod = _module()
    c, m = _instance(4)
    r = plan_training(c, m, 32, options=PlannerOptions(schedules=("zb-h1", "1f1b"), confirm_top=1))
    plan = r.plan
    if plan.num_stages < 2:
        pytest.skip("the instance's plan has one stage")
    # every boundary pushed to the end: the first stage holds all but one layer per later stage
    L, S = plan.num_layers, plan.num_stages
    cuts = [0] + [L - S + k for k in range(1, S)] + [L]
    worse = plan.replace(stages=tuple(dataclasses.replace(st, layer_start=cuts[k], layer_stop=cuts[k + 1])
                                      for k, st in enumerate(plan.stages)), estimate=None)
    start_s = simulate(worse, c, m, record=False).iteration_s
    got = ref_mod.polish(worse, c, m, simulations=40)
    assert got["moves"], "a plan with every boundary at the end has an improving neighbour"
    assert got["iteration_s"] < start_s
    assert got["iteration_s"] == pytest.approx(simulate(got["plan"], c, m, record=False).iteration_s, rel=1e-9)
    assert [s for _, s in got["moves"]] == sorted((s for _, s in got["moves"]), reverse=True)
    assert got["simulated"] <= 40 + 1
