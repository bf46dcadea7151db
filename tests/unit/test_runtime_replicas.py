"""Replicas on ranks (torch-free parts): the replica-aware topology, layer segments, server
ranks, straggler slowdown traces and the partial scheduler's rule for closing a round."""

from __future__ import annotations

import math

import pytest

from deepcee.cluster.stragglers import Straggler
from deepcee.errors import PlanError, SpecError
from deepcee.plan import EXACT, Plan, ReplicaPlan, StagePlan, Strategy
from deepcee.runtime.coordinator import Coordinator
from deepcee.runtime.emulation import Clock, DevicePacer
from deepcee.runtime.partition import Topology, rank_devices, replica_plan


def _rep(stages, m=1, schedule="gpipe"):
    sts = tuple(StagePlan(layer_start=a, layer_stop=b, devices=d, shares=s) for a, b, d, s in stages)
    return ReplicaPlan(stages=sts, microbatch_size=sum(stages[0][3]), num_microbatches=m, schedule=schedule)


def _plan(strategy=EXACT, sync="allreduce-ring", servers=()):
    reps = (_rep([(0, 2, ("a",), (2,)), (2, 6, ("b",), (2,))], m=2, schedule="1f1b"),
            _rep([(0, 3, ("c", "d"), (1, 2)), (3, 6, ("e",), (3,))]))
    return Plan(system="t", cluster="c", model="x", global_batch=7, replicas=reps, sync=sync, strategy=strategy,
                servers=servers)


def test_ranks_run_replicas_in_order_then_servers():
    plan = _plan(sync="ps", servers=("s", "a"))
    topo = Topology(plan)
    assert [topo.device_of(r) for r in range(7)] == ["a", "b", "c", "d", "e", "s", "a"]
    assert rank_devices(plan) == ("a", "b", "c", "d", "e", "s", "a")
    assert topo.num_active == 5 and topo.num_ranks == 7 and topo.is_server(6) and not topo.is_active(6)
    assert topo.rank_of(0, 1, replica=1) == 3 and topo.stage_ranks(1, replica=1) == (4,)
    assert topo.describe(3) == "rank 3 (device d, replica 1, stage 0)"
    assert topo.describe(6) == "rank 6 (parameter server on a)"
    with pytest.raises(PlanError, match="2 parameter servers, only 6 ranks"):
        Topology(plan, world_size=6)
    # a device talks to its island's server, else to the closest
    islands = {"a": "x", "b": "x", "s": "y", "e": "z"}
    assert topo.server_of("b", islands, {"s": 0.1, "a": 0.2}) == 6
    assert topo.server_of("e", islands, {"s": 0.1, "a": 0.2}) == 5


def test_pieces_stay_inside_a_replica_and_samples_follow_replica_batches():
    topo = Topology(_plan())
    assert [(p.peer_rank, p.lo, p.hi) for p in topo.forward_sends(2)] == [(4, 0, 1)]
    assert [(p.peer_rank, p.lo, p.hi) for p in topo.forward_recvs(4)] == [(2, 0, 1), (3, 1, 3)]
    # replica 0 owns samples 0..3 (2 microbatches of 2), replica 1 samples 4..6
    assert topo.global_samples(0, 1) == (2, 4) and topo.global_samples(3, 0) == (5, 7)
    assert topo.loss_scale(3) == pytest.approx(2 / 7)
    relaxed = Topology(_plan(strategy=Strategy(kind="model-averaging", period=2)))
    assert relaxed.loss_scale(3) == pytest.approx(2 / 3)  # its own replica's mean


def test_segments_cut_at_every_replicas_boundaries():
    segs = Topology(_plan()).segments()
    assert [(s.start, s.stop) for s in segs] == [(0, 2), (2, 3), (3, 6)]
    assert [s.holders for s in segs] == [((0,), (2, 3)), ((1,), (2, 3)), ((1,), (4,))]
    assert segs[1].stages == (1, 0) and segs[1].ranks == (1, 2, 3)
    one = replica_plan(_plan(), 1)
    assert one.num_replicas == 1 and one.global_batch == 3 and one.stages[1].devices == ("e",)


def test_straggler_parses_against_device_names_and_paces_only_in_its_window():
    names = ("edge0:1", "a")
    assert Straggler.parse("edge0:1:3", names) == Straggler(device="edge0:1", factor=3.0)
    assert Straggler.parse("edge0:1:3:5:20", names) == Straggler(device="edge0:1", factor=3.0, start_s=5, stop_s=20)
    assert Straggler.parse("a:2:1", names).stop_s == math.inf
    for bad in ("b:3", "edge0:1", "edge0:1:x", "a:2:1:2:3"):
        with pytest.raises(SpecError, match="straggler"):
            Straggler.parse(bad, names)
    with pytest.raises(SpecError, match="start < stop"):
        Straggler(device="a", factor=3, start_s=5, stop_s=5)
    now = [0.0]
    clock = Clock(wall=lambda: now[0], cpu=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    pacer = DevicePacer(slowdown=2.0, dilation=1.5, clock=clock, epoch=10.0,
                        stragglers=(Straggler(device="a", factor=3, start_s=1, stop_s=2),))
    assert pacer.factor_at(10.0) == 2.0 and pacer.factor_at(10.0 + 1.5) == 6.0 and pacer.factor_at(13.0) == 2.0

    def work():
        now[0] += 0.1  # 0.1 s of CPU

    now[0] = 10.0 + 1.5 * 1.2
    _, timing = pacer.run(work)
    assert timing.wall_s == pytest.approx(0.1 * 6.0 * 1.5)


def test_partial_rounds_close_by_window_cap_and_full_sync():
    s = Strategy(kind="partial", window_s=0.5, min_group=2, max_group=3, full_sync_every=3)
    now = [0.0]
    c = Coordinator(store=None, job="j", num_replicas=4, steps=7, strategy=s, dilation=2.0, timeout_s=1,
                    clock=Clock(wall=lambda: now[0]))
    one, two, three = [(0.0, 0, 0)], [(0.0, 0, 0), (0.1, 1, 0)], [(0.0, 0, 0), (0.1, 1, 0), (0.2, 2, 0)]
    assert c._closes(0, one, opened=0.0) == 0
    now[0] = 0.9  # window 0.5 emulated seconds = 1.0 wall
    assert c._closes(0, two, opened=0.0) == 0
    now[0] = 1.0
    assert c._closes(0, one, opened=0.0) == 0 and c._closes(0, two, opened=0.0) == 2
    assert c._closes(0, three + [(0.3, 3, 0)], opened=1.0) == 4  # everyone waits: take all
    assert c._closes(1, three, opened=1.0) == 3  # the cap, before the window ends
    # rounds 2 and 5 (every third) and 6 (the last) wait for all four
    assert [c.full(j) for j in range(7)] == [False, False, True, False, False, True, True]
    assert c._closes(2, three, opened=0.0) == 0
