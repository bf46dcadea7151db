"""A plan's program: the one function from a plan to its validated, lowered action lists."""

from __future__ import annotations

import pytest
from test_simulator import unit_cluster, unit_model

from deepcee.errors import ScheduleError
from deepcee.plan import Plan, StagePlan
from deepcee.planner.compare import breakdown
from deepcee.planner.cost_model import AnalyticCostModel
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.ir import parse_schedule
from deepcee.schedule.passes import in_flight_per_stage, lower
from deepcee.schedule.program import lowered_schedule, stage_in_flight
from deepcee.simulator import simulate


def _plan(schedule: str, m: int, actions: tuple[tuple[str, ...], ...] = ()) -> Plan:
    return Plan(system="t", cluster="unit", model="unit", global_batch=m, microbatch_size=1,
                num_microbatches=m, schedule=schedule, actions=actions,
                stages=tuple(StagePlan(layer_start=s, layer_stop=s + 1, devices=(f"n{s}:0",), shares=(1,))
                             for s in range(3)))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_named_schedules_are_the_builders_lowered(name: str) -> None:
    for m in (1, 2, 5):
        plan = _plan(name, m)
        assert lowered_schedule(plan) == lower(build_schedule(name, 3, m))
        assert stage_in_flight(plan) == in_flight_per_stage(build_schedule(name, 3, m))


def test_explicit_actions_win_and_the_result_is_cached() -> None:
    actions = (("0F0", "0F1", "0B0", "0B1"), ("1F0", "1B0", "1F1", "1B1"), ("2F0", "2B0", "2F1", "2B1"))
    plan = _plan("compact", 2, actions)
    assert lowered_schedule(plan) == lower(parse_schedule(actions))
    assert stage_in_flight(plan) == (2, 1, 1)
    assert lowered_schedule(_plan("compact", 2, actions)) is lowered_schedule(plan)


@pytest.mark.parametrize(("m", "actions", "message"), [
    (1, (("0F0", "0B0"), ("1B0", "1F0"), ("2F0", "2B0")), r"1B0 \(step 0\) comes before its forward"),
    (2, (("0F0", "0B0"), ("1F0", "1B0"), ("2F0", "2B0")), "covers 1 microbatches, the plan has 2"),
    (2, (("0F0", "0B0", "0F1", "0B1"), ("1F1", "1B1", "1F0", "1B0"), ("2F0", "2B0", "2F1", "2B1")),
     "deadlocks"),
])
def test_every_reader_rejects_the_same_bad_plan(m: int, actions: tuple, message: str) -> None:
    plan = _plan("compact", m, actions)
    cluster, model = unit_cluster([1, 1, 1]), unit_model(3)
    for read in (lowered_schedule, lambda p: simulate(p, cluster, model),
                 lambda p: AnalyticCostModel().estimate(p, cluster, model), lambda p: breakdown(p, cluster, model)):
        with pytest.raises(ScheduleError, match=message):
            read(plan)
