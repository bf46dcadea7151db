"""Plan contract: validation, JSON round trip, share overlaps."""

from __future__ import annotations

import json

import pytest

from deepcee.errors import PlanError
from deepcee.plan import Estimate, Plan, StagePlan, plan_from_dict, share_overlaps


def make_plan(**kw) -> Plan:
    base = dict(
        system="deepcee", cluster="c", model="m", global_batch=8, microbatch_size=4, num_microbatches=2,
        stages=(StagePlan(layer_start=0, layer_stop=3, devices=("a", "b"), shares=(3, 1)),
                StagePlan(layer_start=3, layer_stop=5, devices=("c",), shares=(4,))),
        schedule="1f1b",
    )
    base.update(kw)
    return Plan(**base)


def test_round_trip() -> None:
    p = make_plan(estimate=Estimate(iteration_s=1.5, samples_per_s=5.3, peak_memory_bytes={"a": 1e9}),
                  explanation=("why",))
    q = plan_from_dict(json.loads(json.dumps(p.to_dict())))
    assert q == p
    assert q.devices == ("a", "b", "c") and q.stage_of("c") == 1 and q.num_layers == 5


def test_share_overlaps_cover_every_sample_once() -> None:
    ov = share_overlaps((3, 1), (2, 2))
    assert ov == [(0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4)]
    assert sum(hi - lo for _, _, lo, hi in ov) == 4
    with pytest.raises(PlanError, match="different microbatch sizes"):
        share_overlaps((1, 1), (3,))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(global_batch=9), "!= global_batch 9"),
        (dict(schedule="zzz"), "unknown schedule 'zzz'"),
        (dict(stages=(StagePlan(layer_start=0, layer_stop=3, devices=("a",), shares=(4,)),
                      StagePlan(layer_start=4, layer_stop=5, devices=("c",), shares=(4,)))), "starts at layer 4"),
        (dict(stages=(StagePlan(layer_start=0, layer_stop=3, devices=("a",), shares=(4,)),
                      StagePlan(layer_start=3, layer_stop=5, devices=("a",), shares=(4,)))), "device 'a' is in two stages"),
        (dict(schedule="compact"), "needs explicit per-stage actions"),
    ],
)
def test_invalid_plans_name_the_value(kw: dict, needle: str) -> None:
    with pytest.raises(PlanError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        make_plan(**kw)


def test_bad_share_is_rejected() -> None:
    with pytest.raises(PlanError, match=r"shares must be whole samples >= 1, got \[0, 4\]"):
        StagePlan(layer_start=0, layer_stop=1, devices=("a", "b"), shares=(0, 4))
