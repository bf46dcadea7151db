"""The elastic leader's next plan for a plan of several replicas ([Note: elastic replicas] in
:mod:`deepcee.adapter.elastic`): the replicas that lost nothing stay as they are, a replica that
lost a device is re-planned on its survivors or dropped (its samples to another), whichever the
simulator finds faster; the global batch stays."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepcee.adapter import elastic as ae
from deepcee.models import get_model
from deepcee.plan import Plan, ReplicaPlan, StagePlan
from deepcee.scenarios import load_scenario

C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"


def _rep(stages, m, schedule="1f1b") -> ReplicaPlan:
    sts = tuple(StagePlan(layer_start=a, layer_stop=b, devices=d, shares=s) for a, b, d, s in stages)
    return ReplicaPlan(stages=sts, microbatch_size=sum(stages[0][3]), num_microbatches=m, schedule=schedule)


@pytest.fixture(scope="module")
def world():
    cluster = load_scenario("local-small")
    plan = Plan(system="test", cluster="local-small", model="gpt-tiny", global_batch=8, sync="allreduce-ring",
                replicas=(_rep([(0, 3, (C0,), (2,)), (3, 6, (C1,), (2,))], 2),
                          _rep([(0, 6, (E0, E1), (1, 1))], 2, "gpipe")))
    h = SimpleNamespace(planning_cluster=lambda t: cluster, model_profile=lambda t: get_model("gpt-tiny"),
                        spec=SimpleNamespace(policy=None, devices=(C0, C1, E0, E1)))
    return plan, h, SimpleNamespace(plan=plan)


def _holds_every_layer(plan: Plan) -> bool:
    return all(sorted(layer for st in rep.stages for layer in range(st.layer_start, st.layer_stop))
               == list(range(plan.num_layers)) for rep in plan.replicas)


def test_the_faster_of_replanning_the_hit_replica_and_dropping_it(world) -> None:
    plan, h, t = world
    survivors = (C0, C1, E0)
    got = ae.next_plan(h, t, survivors)
    assert got.global_batch == plan.global_batch and set(got.devices) <= set(survivors) and _holds_every_layer(got)
    assert got.estimate is not None and got.estimate.source == "simulator"
    kept = plan.replicas[0]
    replanned = ae._scored(h, t, plan.replace(replicas=(kept, *ae._replica_on(h, t, (E0,), 4)), estimate=None),
                           survivors)
    dropped = ae._scored(h, t, plan.replace(replicas=tuple(ae._replica_on(h, t, kept.devices, 8)), estimate=None),
                         survivors)
    assert replanned.replicas[0] == kept  # the replica that lost nothing goes on as it was
    best = max((replanned, dropped), key=lambda p: p.estimate.samples_per_s)
    assert got == best


def test_a_replica_with_no_survivor_is_dropped(world) -> None:
    plan, h, t = world
    got = ae.next_plan(h, t, (C0, C1))
    assert got.global_batch == plan.global_batch and set(got.devices) <= {C0, C1} and _holds_every_layer(got)


def test_a_device_coming_back_gets_the_planners_plan_on_every_device(world) -> None:
    plan, h, t = world
    fewer = SimpleNamespace(plan=ae.next_plan(h, t, (C0, C1, E0)))
    got = ae.next_plan(h, fewer, (C0, C1, E0, E1))
    assert set(got.devices) <= {C0, C1, E0, E1} and got.global_batch == plan.global_batch


def test_a_fault_naming_no_peer_regroups_the_same_members_once(world) -> None:
    # every member answered and the fault names no peer (a collective timed out): the same
    # members go on at the next step in a new generation; failing again there ends the run
    import pickle

    import torch
    import torch.distributed as dist

    from deepcee.errors import RuntimeSetupError
    from deepcee.runtime.elastic import ElasticConfig, Fault, JoinRecord, Session

    plan, h, _ = world
    devices = (C0, C1, E0, E1)
    s = Session(dist.HashStore(), ElasticConfig(), device=C0, launch_devices=devices, timeout_s=5.0,
                torch_device=torch.device("cpu"))
    t = SimpleNamespace(plan=plan, first_step=0, w=SimpleNamespace(waiter=s))
    joins = [JoinRecord(device=d, rank=r, applied=5, version=0, layers=(0, 1), detected_s=0.0)
             for r, d in enumerate(devices)]
    fault = Fault(by=C1, suspect=None, reason="the checkpoint save did not complete in time", at_s=1.0)
    tr = ae.decide_recovery(h, t, 0, joins, [], [], fault)
    assert tr.devices == devices and tr.resume_step == 5 and not tr.lost and ae.transition_kind(tr) == "regroup"
    assert tr.detail.plan == plan and tr.detail.moves == () and tr.detail.steps_redone == 0
    s.store.set("g0/decision", pickle.dumps(tr))
    with pytest.raises(RuntimeSetupError, match="failed again at step 5"):
        ae.decide_recovery(h, t, 1, joins, [], [], fault)
    assert ae.decide_recovery(h, t, 1, [_at_step(j, 6) for j in joins], [], [], fault).resume_step == 6


def _at_step(j, applied):
    from dataclasses import replace

    return replace(j, applied=applied)
