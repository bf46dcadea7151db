"""The closed form of a compact schedule ([Note: compact closed form] in deepcee.planner.split)
follows what the compact builder can run: its templates that fit memory, whose orders tie
neighbouring stages into loops ([Note: neighbour cycle]), and, below ``compact_max_actions``,
its greedy list scheduler, which holds what memory allows. Checked against the simulator on
four stages with a 100 ms link in the middle and memory for a few microbatches per stage."""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.test_split_neighbour_cycle import BATCH, LAYOUT, SPLIT, _cluster, _model

from deepcee.cluster import DeviceKind
from deepcee.planner.cost_model import stage_costs
from deepcee.planner.search import PlannerOptions, new_search
from deepcee.planner.space import build_plan, compact_plan
from deepcee.schedule.compact import capped_zero_bubble
from deepcee.schedule.ir import format_schedule
from deepcee.simulator import simulate
from deepcee.units import GIB

FLAGS = (False,) * 4
N = 2  # samples per microbatch: 32 microbatches


def _setup(memory_gib: float):
    base = _cluster()
    cluster = dataclasses.replace(base, kinds={"g": DeviceKind(name="g", peak_flops_per_s=20e12,
                                                              memory_bytes=memory_gib * GIB)})
    model = _model()
    search = new_search(cluster, model, BATCH, PlannerOptions())
    plan = build_plan(LAYOUT, SPLIT, cluster=cluster, model=model, global_batch=BATCH, microbatch_size=N,
                      schedule="zb-h2", sync="allreduce-ring", recompute=FLAGS)
    return cluster, model, search, plan


@pytest.mark.parametrize("warm", [(2, 2, 2, 2), (3, 3, 3, 3)])
def test_a_loop_through_several_stages_sets_the_pace_when_their_warm_ups_are_equal(warm: tuple[int, ...]) -> None:
    """The capped zero bubble with equal warm-ups: the loop from the first stage to the last holds
    ``k_0 - k_3 + 1 = 1`` microbatch, longer than any loop of two neighbours."""
    cluster, model, search, plan = _setup(16.0)
    tab = search.dp_inputs(LAYOUT, N)
    closed = tab.closed_form(SPLIT, tab.loads(warm), warm, flags=FLAGS)
    ordered = plan.replace(schedule="compact", actions=format_schedule(capped_zero_bubble(4, tab.m, warm)))
    sim = simulate(ordered, cluster, model, record=False).iteration_s
    assert closed == pytest.approx(sim, rel=0.05)


@pytest.mark.parametrize("memory_gib", [0.1, 0.06, 0.045])
@pytest.mark.parametrize("greedy", [True, False])
def test_the_compact_closed_form_follows_the_builder(memory_gib: float, greedy: bool) -> None:
    """``greedy=False``: above ``compact_max_actions`` the builder tries only its templates."""
    cluster, model, search, plan = _setup(memory_gib)
    tab = search.dp_inputs(LAYOUT, N)
    caps = tab.caps_at(SPLIT, FLAGS, None)
    assert max(caps) < tab.m  # memory binds
    if not greedy:
        tab.greedy_actions = 0
    closed = tab.closed_form(SPLIT, tab.loads(None), None, flags=FLAGS)
    built = compact_plan(plan, cluster, model, stage_costs(plan, cluster, model), search.tables,
                         rules=None if greedy else ())
    assert built is not None
    sim = simulate(built, cluster, model, record=False).iteration_s
    assert closed == pytest.approx(sim, rel=0.06)
    # the least over what the builder may run, each scored as a fixed order
    options = tab.compact_counts(SPLIT, FLAGS, tab.holds(SPLIT, FLAGS))
    assert any(not tied for _, tied in options) == greedy
    fixed = [tab.closed_form(SPLIT, tab.loads(k), k, flags=FLAGS) for k, tied in options if tied]
    assert closed <= min(fixed) + 1e-12
