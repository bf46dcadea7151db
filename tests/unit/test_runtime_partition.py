"""Topology: ranks, sample ranges and the pieces each rank sends and receives."""

from __future__ import annotations

import pytest

from deepcee.errors import PlanError
from deepcee.plan import Plan, StagePlan
from deepcee.runtime.partition import Topology


def _plan(*stages, m=2):
    mb = sum(stages[0][1])
    n = len(stages)
    return Plan(system="t", cluster="c", model="x", global_batch=mb * m, microbatch_size=mb, num_microbatches=m,
                schedule="1f1b", stages=tuple(StagePlan(layer_start=i, layer_stop=i + 1, devices=d, shares=s)
                                              for i, (d, s) in enumerate(stages[:n])))


def test_ranks_follow_plan_device_order():
    topo = Topology(_plan((("a", "b"), (3, 1)), (("c",), (4,))), world_size=5)
    assert [topo.device_of(r) for r in range(3)] == ["a", "b", "c"]
    assert topo.rank_of(0, 1) == 1 and topo.rank_of(1, 0) == 2
    assert topo.stage_ranks(0) == (0, 1)
    assert topo.is_active(2) and not topo.is_active(3)
    assert topo.describe(1) == "rank 1 (device b, stage 0)" and topo.describe(4) == "rank 4 (idle)"
    with pytest.raises(PlanError, match="only 2 ranks"):
        Topology(_plan((("a", "b"), (3, 1)), (("c",), (4,))), world_size=2)


def test_uneven_shares_reshard_exactly():
    # stage 0: a owns [0,3), b owns [3,4); stage 1: c owns [0,2), d owns [2,4)
    topo = Topology(_plan((("a", "b"), (3, 1)), (("c", "d"), (2, 2))))
    a, b, c, d = range(4)
    sends_a = [(p.peer_device, p.lo, p.hi, p.local) for p in topo.forward_sends(a)]
    assert sends_a == [("c", 0, 2, slice(0, 2)), ("d", 2, 3, slice(2, 3))]
    assert [(p.peer_device, p.lo, p.hi, p.local) for p in topo.forward_sends(b)] == [("d", 3, 4, slice(0, 1))]
    recv_d = [(p.peer_device, p.lo, p.hi, p.local) for p in topo.forward_recvs(d)]
    assert recv_d == [("a", 2, 3, slice(0, 1)), ("b", 3, 4, slice(1, 2))]
    # gradients travel the same ranges back
    assert topo.backward_sends(d) == topo.forward_recvs(d)
    assert topo.backward_recvs(a) == topo.forward_sends(a)
    assert topo.forward_recvs(a) == [] and topo.forward_sends(c) == []


def test_every_sample_is_sent_once_for_random_shares():
    import random

    rng = random.Random(0)
    for _ in range(50):
        mb = rng.randint(2, 12)

        def shares(k, mb=mb):
            cuts = sorted(rng.sample(range(1, mb), k - 1)) if k > 1 else []
            return tuple(b - a for a, b in zip([0, *cuts], [*cuts, mb], strict=True))

        k0, k1 = rng.randint(1, min(4, mb)), rng.randint(1, min(4, mb))
        topo = Topology(_plan((tuple(f"s{i}" for i in range(k0)), shares(k0)),
                              (tuple(f"t{i}" for i in range(k1)), shares(k1))))
        sent = sorted((p.lo, p.hi) for r in range(k0) for p in topo.forward_sends(r))
        got = sorted((p.lo, p.hi) for r in range(k0, k0 + k1) for p in topo.forward_recvs(r))
        assert sent == got
        covered = [s for lo, hi in sent for s in range(lo, hi)]
        assert covered == list(range(mb))
        for r in range(k0, k0 + k1):  # pieces tile the receiver's local tensor
            local = [i for p in topo.forward_recvs(r) for i in range(p.local.start, p.local.stop)]
            assert local == list(range(topo.placement(r).share))


def test_global_samples_and_loss_scale():
    topo = Topology(_plan((("a", "b"), (3, 1)), (("c",), (4,)), m=3))
    assert topo.global_samples(0, 0) == (0, 3) and topo.global_samples(1, 2) == (11, 12)
    assert topo.global_samples(2, 1) == (4, 8)
    # weights of one microbatch's devices sum to microbatch/global_batch: over all microbatches, 1
    assert topo.loss_scale(0) + topo.loss_scale(1) == pytest.approx(1 / 3)
    assert topo.loss_scale(2) * 3 == pytest.approx(1.0)
