"""The controller's pure pieces (which layers move where, decision messages, fixed device
ranks, scripted decisions) and the runtime's link emulation on a bandwidth trace."""

from __future__ import annotations

import json

import pytest
import torch

from deepcee.adapter.coordinator import Coordinator, PolicyContext, ScriptedPolicy
from deepcee.adapter.messages import (
    DecisionMessage,
    DeviceTopology,
    Move,
    decision_message,
    state_moves,
    transfers_of,
)
from deepcee.adapter.policy import AdapterState, Decision, DecisionKind, state_movement
from deepcee.cluster import BandwidthTrace, Link
from deepcee.errors import PlanError
from deepcee.models import get_model
from deepcee.plan import Plan, StagePlan
from deepcee.runtime.emulation import Clock, LinkShaper, MemoryLedger
from deepcee.runtime.records import RankMetrics
from deepcee.scenarios import load_scenario

C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"


def plan(stages, m=2, schedule="1f1b") -> Plan:
    mb = sum(stages[0][3])
    return Plan(system="test", cluster="local-small", model="gpt-tiny", global_batch=mb * m, microbatch_size=mb,
                num_microbatches=m, schedule=schedule,
                stages=tuple(StagePlan(layer_start=a, layer_stop=b, devices=d, shares=s) for a, b, d, s in stages))


@pytest.fixture(scope="module")
def cluster():
    return load_scenario("local-small")


OLD = plan([(0, 3, (C0,), (4,)), (3, 6, (E0, N0), (2, 2))])


def test_no_moves_when_every_device_keeps_its_layers(cluster) -> None:
    assert state_moves(OLD, OLD, cluster, [1.0] * 6) == ()
    shrink = plan([(0, 3, (C0,), (4,)), (3, 6, (E0,), (4,))])  # N0 leaves: nothing to send
    assert state_moves(OLD, shrink, cluster, [1.0] * 6) == ()


def test_moved_layers_and_new_devices_receive_from_a_holder(cluster) -> None:
    new = plan([(0, 2, (C0, C1), (1, 3)), (2, 6, (E0,), (4,))])
    moves = state_moves(OLD, new, cluster, [1e5] * 6)
    assert moves == (Move(layer=0, src=C0, dst=C1), Move(layer=1, src=C0, dst=C1), Move(layer=2, src=C0, dst=E0))
    # idle devices (here C1 is new; E0 keeps 3-5) never send or receive anything else
    assert {m.layer for m in moves if m.dst == E0} == {2}


def test_source_is_the_holder_whose_link_finishes_first(cluster) -> None:
    # layers 3-5 are held by E0 and N0; C1 is 20 ms / 100 Mbit/s from edge and 40 ms from end
    new = plan([(0, 3, (E1,), (4,)), (3, 6, (C1,), (4,))])
    moves = state_moves(OLD, new, cluster, [1e4] * 6)
    assert {m.src for m in moves if m.dst == C1} == {E0}
    # layers 0-2 go to E1 from C0 (the only holder)
    assert [m.src for m in moves if m.dst == E1] == [C0] * 3
    # with large layers the edge->cloud pipe fills and the end's link takes some of the load
    big = state_moves(OLD, new, cluster, [5e6] * 6)
    assert {m.src for m in big if m.dst == C1} == {E0, N0}


def test_moves_match_the_policys_cost_accounting(cluster) -> None:
    model = get_model("gpt-tiny")
    new = plan([(0, 2, (C0, C1), (1, 3)), (2, 6, (E0,), (4,))])
    per_param = model.state_bytes_per_parameter - model.gradient_bytes_per_parameter
    sizes = [model.parameters(i, i + 1) * per_param for i in range(6)]
    moves = state_moves(OLD, new, cluster, sizes)
    moved, _ = state_movement(OLD, new, cluster, model)
    assert sum(sizes[m.layer] for m in moves) == pytest.approx(moved)


def test_transfers_group_moves_per_pair_in_order() -> None:
    moves = [Move(layer=0, src=C0, dst=C1), Move(layer=2, src=C0, dst=E0), Move(layer=1, src=C0, dst=C1)]
    assert transfers_of(moves) == [(C0, C1, (0, 1)), (C0, E0, (2,))]
    with pytest.raises(ValueError, match="bad move"):
        Move(layer=1, src=C0, dst=C0)


def test_state_moves_rejects_other_models(cluster) -> None:
    other = plan([(0, 4, (C0,), (4,)), (4, 8, (E0,), (4,))])
    with pytest.raises(PlanError, match="layers"):
        state_moves(OLD, other, cluster, [1.0] * 8)


def test_decision_message_round_trips_through_json(cluster) -> None:
    new = plan([(0, 2, (C0, C1), (1, 3)), (2, 6, (E0,), (4,))])
    decision = Decision(kind=DecisionKind.REPLAN, plan=new, reason="r", at_s=1.0, current_iteration_s=0.2,
                        new_iteration_s=0.1, change_cost_s=0.05)
    msg = decision_message(decision, OLD, 7, cluster, [10.0, 20.0, 30.0, 1.0, 1.0, 1.0])
    assert msg.kind == DecisionKind.REPLAN and msg.start_step == 7 and msg.moved_bytes == 10 + 20 + 30
    back = DecisionMessage.from_dict(json.loads(json.dumps(msg.to_dict())))
    assert back == msg
    keep = DecisionMessage(kind=DecisionKind.KEEP, start_step=3, reason="no change")
    assert DecisionMessage.from_dict(json.loads(json.dumps(keep.to_dict()))) == keep and not keep.changes_plan


def test_decision_kind_follows_the_plans_and_retunes_move_nothing(cluster) -> None:
    retuned = plan([(0, 3, (C0,), (2,)), (3, 6, (E0, N0), (1, 1))], m=4, schedule="gpipe")
    decision = Decision(kind=DecisionKind.REPLAN, plan=retuned, reason="", at_s=0.0)
    msg = decision_message(decision, OLD, 1, cluster, [1.0] * 6)
    assert msg.kind == DecisionKind.RETUNE and msg.moves == () and msg.moved_bytes == 0
    bigger = plan([(0, 3, (C0,), (4,)), (3, 6, (E0, N0), (2, 2))], m=4)
    with pytest.raises(PlanError, match="global batch"):
        decision_message(Decision(kind=DecisionKind.RETUNE, plan=bigger, reason="", at_s=0.0), OLD, 1, cluster,
                         [1.0] * 6)
    with pytest.raises(ValueError, match="needs a plan"):
        DecisionMessage(kind=DecisionKind.REPLAN, start_step=1)
    with pytest.raises(ValueError, match="moves no state"):
        DecisionMessage(kind=DecisionKind.RETUNE, start_step=1, plan=retuned, moves=(Move(layer=0, src=C0, dst=C1),))


def test_device_topology_keeps_each_devices_rank() -> None:
    devices = (C0, C1, E0, N0)
    a = DeviceTopology(OLD, devices)
    assert a.active_ranks == (0, 2, 3) and not a.is_active(1)
    assert a.placement(3).device == N0 and (a.placement(3).lo, a.placement(3).hi) == (2, 4)
    assert a.stage_ranks(1) == (2, 3) and a.rank_of(1, 1) == 3
    assert [(p.peer_rank, p.lo, p.hi) for p in a.forward_sends(0)] == [(2, 0, 2), (3, 2, 4)]
    assert [p.peer_rank for p in a.forward_recvs(3)] == [0]
    assert a.loss_scale(3) == pytest.approx(2 / 8) and a.global_samples(3, 1) == (6, 8)
    b = DeviceTopology(plan([(0, 2, (N0, C1), (1, 3)), (2, 6, (E0,), (4,))]), devices)
    assert b.rank_of(0, 0) == 3 and b.active_ranks == (1, 2, 3) and "idle" in b.describe(0)
    with pytest.raises(PlanError, match="runs no stage"):
        b.placement(0)
    with pytest.raises(PlanError, match="no rank runs"):
        DeviceTopology(plan([(0, 6, (E1,), (4,))]), devices)


def test_scripted_policy_changes_after_the_given_steps(cluster) -> None:
    new = plan([(0, 2, (C0, C1), (1, 3)), (2, 6, (E0,), (4,))])
    retuned = plan([(0, 2, (C0, C1), (2, 2)), (2, 6, (E0,), (4,))])
    policy = ScriptedPolicy(changes=((1, new), (3, retuned))).build(
        PolicyContext(plan=OLD, cluster=cluster, model="gpt-tiny", steps=6, clock=lambda: 0.0))
    kinds = []
    current = OLD
    for step in range(5):
        d = policy.decide(AdapterState(plan=current, cluster=cluster, iterations_left=6 - step - 1))
        kinds.append(d.kind.value)
        current = d.plan
    assert kinds == ["keep", "replan", "keep", "retune", "keep"] and current == retuned


def test_layer_state_bytes_counts_optimizer_state() -> None:
    from deepcee.adapter.hooks import layer_state_bytes

    blocks = [torch.nn.Linear(4, 2), torch.nn.ReLU()]  # 10 float32 parameters, none
    assert layer_state_bytes(blocks, "adamw") == [120.0, 0.0]
    assert layer_state_bytes(blocks, "sgd", momentum=0.9) == [80.0, 0.0]
    assert layer_state_bytes(blocks, "sgd") == [40.0, 0.0]


# -- the runtime's link emulation follows a bandwidth trace --------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.wall_s = 100.0

    def clock(self) -> Clock:
        return Clock(wall=lambda: self.wall_s, cpu=lambda: 0.0, sleep=lambda s: None)


def _link(trace: BandwidthTrace | None, latency_s: float = 0.01) -> Link:
    return Link(src="a", dst="b", latency_s=latency_s, bandwidth_bytes_per_s=1e6, resource="n0->n1", trace=trace)


def test_a_transfer_straddling_a_drop_pays_each_rate_for_its_part() -> None:
    fc = FakeClock()
    trace = BandwidthTrace(times_s=(0.0, 1.0), bandwidth_bytes_per_s=(1e6, 0.2e6))
    d = 2.0
    shaper = LinkShaper(dilation=d, ledger=MemoryLedger(), epoch=fc.wall_s, clock=fc.clock())
    # ready at emulated 0.9 s: 100 kB at 1 MB/s until 1.0 s, the other 400 kB at 0.2 MB/s (2 s)
    ready = fc.wall_s + 0.9 * d
    assert shaper.deliver_at(_link(trace), 500_000, ready) == pytest.approx(fc.wall_s + d * (1.0 + 2.0 + 0.01))
    # a transfer queued behind it gets the link at emulated 3.0 s and pays the new rate throughout
    assert shaper.deliver_at(_link(trace), 100_000, ready) == pytest.approx(fc.wall_s + d * (3.0 + 0.5 + 0.01))


def test_queueing_decides_which_rate_a_transfer_pays() -> None:
    fc = FakeClock()
    trace = BandwidthTrace(times_s=(0.0, 1.0), bandwidth_bytes_per_s=(1e6, 0.2e6))
    shaper = LinkShaper(dilation=1.0, ledger=MemoryLedger(), epoch=fc.wall_s, clock=fc.clock())
    t0 = fc.wall_s
    # the first transfer ends exactly at the drop; the second was ready before it but starts after
    assert shaper.deliver_at(_link(trace, 0.0), 1_000_000, t0) == pytest.approx(t0 + 1.0)
    assert shaper.deliver_at(_link(trace, 0.0), 100_000, t0 + 0.5) == pytest.approx(t0 + 1.0 + 0.5)


# -- rank 0's coordinator, without processes -------------------------------------------------


def _coordinator(cluster, changes, devices=(C0, C1, E0, N0)):
    from deepcee.adapter.hooks import AdaptSpec

    spec = AdaptSpec(devices=devices, policy=ScriptedPolicy(changes=changes))
    ctx = PolicyContext(plan=OLD, cluster=cluster, model="gpt-tiny", steps=6, clock=lambda: 0.0)
    return Coordinator(spec, OLD, cluster, ctx, [1e5] * 6)


def test_coordinator_turns_decisions_into_messages_and_rejects_plans_without_ranks(cluster) -> None:
    new = plan([(0, 2, (C0, C1), (1, 3)), (2, 6, (E0,), (4,))])
    outside = plan([(0, 3, (E1,), (4,)), (3, 6, (E0,), (4,))])  # edge0:1 has no rank here
    coord = _coordinator(cluster, ((0, new), (1, outside)))
    msg = coord.decide(0, OLD)
    assert msg.kind == DecisionKind.REPLAN and msg.start_step == 1 and msg.plan == new and len(msg.moves) == 3
    rejected = coord.decide(1, new)
    assert rejected.kind == DecisionKind.KEEP and "rejected" in rejected.reason and "edge0:1" in rejected.reason
    assert coord.decide(2, new).kind == DecisionKind.KEEP


def test_coordinator_feeds_the_monitor_with_the_gathered_transfers(cluster) -> None:
    coord = _coordinator(cluster, ())
    link = cluster.link(C0, E0)  # 20 ms, 100 Mbit/s
    slow = link.bandwidth_bytes_per_s / 5
    for step in range(4):
        t = step * 1.0
        transfers = tuple((link.resource, n, t + 0.1 * i, t + 0.1 * i + link.latency_s + n / slow)
                          for i, n in enumerate((100_000, 200_000, 100_000)))
        coord.observe([None, RankMetrics(rank=2, stage=1, device=E0, loss=0.0, compute_s=0.0, cpu_s=0.0, wait_s=0.0,
                                         sync_s=0.0, peak_in_flight=1, bytes_sent={}, transfers=transfers)])
    est = coord.link_estimates()
    assert est[link.resource].changed
    assert est[link.resource].bandwidth_bytes_per_s == pytest.approx(slow, rel=0.05)
