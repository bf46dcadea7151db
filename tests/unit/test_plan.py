"""Plan contract: validation, JSON round trip, share overlaps."""

from __future__ import annotations

import json

import pytest

from deepcee.errors import PlanError
from deepcee.plan import Estimate, Plan, StagePlan, share_overlaps
from deepcee.planfile import plan_from_dict


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


# -- schema 2: replicas, strategies, servers --------------------------------------------------
from deepcee.plan import EXACT, ReplicaPlan, Strategy  # noqa: E402


def two_replicas(**kw) -> Plan:
    r0 = ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=2, devices=("a",), shares=(2,)),
                             StagePlan(layer_start=2, layer_stop=5, devices=("b", "c"), shares=(1, 1), recompute=True)),
                     microbatch_size=2, num_microbatches=3, schedule="1f1b")
    r1 = ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=5, devices=("d",), shares=(4,), sync="ps"),),
                     microbatch_size=4, num_microbatches=1, schedule="gpipe")
    base = dict(system="deepcee", cluster="c", model="m", global_batch=10, replicas=(r0, r1), servers=("d",),
                strategy=Strategy(kind="model-averaging", period=10, outer_optimizer="nesterov", outer_lr=0.7,
                                  outer_momentum=0.9))
    base.update(kw)
    return Plan(**base)


def test_replicas_round_trip_and_views() -> None:
    p = two_replicas()
    d = json.loads(json.dumps(p.to_dict()))
    assert d["schema_version"] == 2 and d["semantics"] == "relaxed"
    q = plan_from_dict(d)
    assert q == p
    assert q.devices == ("a", "b", "c", "d") and q.locate("c") == (0, 1) and q.locate("d") == (1, 0)
    assert q.replica_offsets() == (0, 6) and q.num_layers == 5 and q.syncs_used == {"allreduce-ring", "ps"}
    with pytest.raises(PlanError, match="has 2 replicas"):
        _ = q.stages
    assert "H=10" in q.strategy.describe() and "relaxed" in q.strategy.describe()


def test_overlap_round_trips_and_old_plans_read_as_blocking() -> None:
    blocking = two_replicas()
    d = json.loads(json.dumps(blocking.to_dict()))
    assert "overlap" not in d["strategy"]  # plans without it are written as before
    assert plan_from_dict(d).strategy.overlap is False
    overlapped = two_replicas(strategy=Strategy(kind="model-averaging", period=10, overlap=True))
    d = json.loads(json.dumps(overlapped.to_dict()))
    assert d["strategy"]["overlap"] is True and plan_from_dict(d) == overlapped
    assert "overlapped (applied one period late)" in overlapped.strategy.describe()
    with pytest.raises(PlanError, match=r"p.json: strategy.overlap: expected true or false"):
        plan_from_dict({**d, "strategy": {**d["strategy"], "overlap": "yes"}}, file="p.json")
    with pytest.raises(PlanError, match=r"p.json: strategy.overlap: overlap applies to model-averaging only"):
        plan_from_dict({**d, "strategy": {"kind": "partial", "overlap": True}}, file="p.json")


def test_schema_1_still_loads_as_one_replica() -> None:
    p = make_plan()
    d = p.to_dict()
    v1 = {k: v for k, v in d.items() if k not in ("replicas", "strategy", "servers", "semantics")}
    v1.update(schema_version=1, **{k: v for k, v in d["replicas"][0].items()})
    q = plan_from_dict(v1)
    assert q == p and q.strategy == EXACT and q.semantics == "exact" and q.num_replicas == 1


def test_replace_one_pipeline_fields() -> None:
    p = make_plan()
    q = p.replace(schedule="gpipe", estimate=Estimate(iteration_s=1.0, samples_per_s=8.0))
    assert q.schedule == "gpipe" and q.stages == p.stages and q.estimate.samples_per_s == 8.0


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(global_batch=9), "replica batches 6 \\+ 4 != global_batch 9"),
        (dict(servers=()), "servers: parameter-server sync needs at least one server"),
        (dict(servers=("d", "d")), "servers: a device is listed twice"),
        (dict(replicas=(ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=4, devices=("d",), shares=(4,)),),
                                    microbatch_size=4, num_microbatches=1, schedule="gpipe"),
                        ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=5, devices=("e",), shares=(6,)),),
                                    microbatch_size=6, num_microbatches=1, schedule="gpipe"))),
         "replicas\\[1\\].stages: covers 5 layers, replica 0 covers 4"),
        (dict(replicas=(ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=5, devices=("d",), shares=(4,)),),
                                    microbatch_size=4, num_microbatches=1, schedule="gpipe"),
                        ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=5, devices=("d",), shares=(6,)),),
                                    microbatch_size=6, num_microbatches=1, schedule="gpipe"))),
         "device 'd' is in replicas 0 and 1"),
    ],
)
def test_invalid_replica_plans_name_the_field(kw: dict, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        two_replicas(**kw)


def test_replica_errors_in_files_name_the_replica() -> None:
    d = two_replicas().to_dict()
    d["replicas"][1]["stages"][0]["shares"] = [3]
    with pytest.raises(PlanError, match=r"p.json: replicas\[1\].stages\[0\].shares: shares \[3\] sum to 3"):
        plan_from_dict(d, file="p.json")


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(kind="gossip"), "strategy.kind: unknown strategy 'gossip'"),
        (dict(kind="asgd-ga"), "strategy.staleness_bound: asgd-ga needs a staleness bound >= 1"),
        (dict(period=0), "strategy.period: must be an integer >= 1, got 0"),
        (dict(outer_lr=float("nan")), "strategy.outer_lr: must be a finite number"),
        (dict(outer_momentum=1.0), "strategy.outer_momentum: must be < 1"),
        (dict(min_group=3, max_group=2), "strategy.max_group: max_group 2 < min_group 3"),
        (dict(kind="asgd-ga", staleness_bound=1, overlap=True), "strategy.overlap: overlap applies to model-averaging"),
        (dict(kind="model-averaging", overlap=1), "strategy.overlap: must be true or false"),
    ],
)
def test_invalid_strategies(kw: dict, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        Strategy(**kw)


def test_relaxed_strategy_needs_replicas() -> None:
    with pytest.raises(PlanError, match="joins replicas; the plan has one"):
        make_plan(strategy=Strategy(kind="partial"))


def test_estimate_source_is_checked_when_a_file_is_read() -> None:
    d = make_plan(estimate=Estimate(iteration_s=1.0, samples_per_s=8.0, source="simulator")).to_dict()
    assert plan_from_dict(d).estimate.source == "simulator"
    with pytest.raises(PlanError) as info:
        plan_from_dict({**d, "estimate": {**d["estimate"], "source": "guess"}}, file="p.json")
    msg = str(info.value)
    assert msg.startswith("p.json:") and "estimate.source" in msg and "'guess'" in msg
