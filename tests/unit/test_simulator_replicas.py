"""Simulator of replicated plans: every strategy on unit costs, against closed forms and rules.

Unit costs: one device kind at 1e12 effective FLOP/s and no per-layer overhead; each layer
costs 1e12 FLOPs per sample for each of F, I and W, so one layer and one sample take F = 1 s
and B = 2 s. Islands ``a``, ``b``, ``c`` hold one node each; inside an island links are
instant, between islands they have the latency and bandwidth a test gives.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pytest

from deepcee.cluster import (
    BandwidthTrace,
    Cluster,
    Device,
    DeviceKind,
    Island,
    LinkEntry,
    LinkSpec,
    Node,
)
from deepcee.cluster.stragglers import Straggler
from deepcee.errors import ClusterSpecError, PlanError
from deepcee.plan import EXACT, Plan, ReplicaPlan, StagePlan, Strategy
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.simulator import optimizer_step_s, simulate
from deepcee.simulator.pipelines import layer_segments
from deepcee.simulator.replica_trace import replica_chrome_trace
from deepcee.simulator.replicas import simulate_replicas

KIND = DeviceKind(name="unit", peak_flops_per_s=1e12, memory_bytes=1e15, achievable_fraction=1.0,
                  per_layer_overhead_s=0.0)
FAST = LinkSpec(latency_s=0.0, bandwidth_bytes_per_s=1e30)


def cluster(sizes: Sequence[int], *, latency_s: float = 0.5, bandwidth_bytes_per_s: float = 100.0,
            trace: BandwidthTrace | None = None, slowdowns: dict[str, float] | None = None) -> Cluster:
    """Island ``k`` (named a, b, c, ...) is node ``n{k}`` with ``sizes[k]`` devices ``n{k}:j``."""
    names = "abcdefgh"[: len(sizes)]
    slow = slowdowns or {}
    nodes = tuple(Node(name=f"n{k}", island=names[k], kind="unit", devices=tuple(f"n{k}:{j}" for j in range(c)),
                       intra=FAST) for k, c in enumerate(sizes))
    devices = tuple(Device(name=d, kind="unit", node=n.name, island=n.island, slowdown=slow.get(d, 1.0))
                    for n in nodes for d in n.devices)
    wan = LinkSpec(latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s, trace=trace)
    links = tuple(LinkEntry(a=x, b=y, spec=wan) for i, x in enumerate(names) for y in names[i + 1:])
    return Cluster(name="unit", kinds={"unit": KIND}, islands=tuple(Island(name=x, intra=FAST) for x in names),
                   nodes=nodes, devices=devices, links=links, emulation="CPU worker processes (the CPU/gloo runtime)")


def model(layers: int = 1, *, params: int = 0) -> ModelProfile:
    return ModelProfile(name="unit", input_bytes=0.0, gradient_bytes_per_parameter=1.0, layers=tuple(
        LayerProfile(name=f"l{i}", forward_flops=1e12, input_grad_flops=1e12, weight_grad_flops=1e12,
                     parameter_count=params, activation_bytes=0.0, output_bytes=0.0) for i in range(layers)))


def replica(stages: Sequence[Sequence[str]], microbatches: int = 1, layers: Sequence[int] | None = None) -> ReplicaPlan:
    """Microbatches of as many samples as the widest stage has devices, split evenly."""
    layers = layers or [1] * len(stages)
    size = max(len(devs) for devs in stages)
    out, start = [], 0
    for devs, n in zip(stages, layers, strict=True):
        shares = tuple(size // len(devs) + (k < size % len(devs)) for k in range(len(devs)))
        out.append(StagePlan(layer_start=start, layer_stop=start + n, devices=tuple(devs), shares=shares))
        start += n
    return ReplicaPlan(stages=tuple(out), microbatch_size=size, num_microbatches=microbatches, schedule="1f1b")


def plan(replicas: Sequence[ReplicaPlan], strategy: Strategy = EXACT, *, sync: str = "allreduce-ring",
         servers: Sequence[str] = ()) -> Plan:
    return Plan(system="test", cluster="unit", model="unit", global_batch=sum(r.batch for r in replicas),
                replicas=tuple(replicas), strategy=strategy, sync=sync, servers=tuple(servers))


def opt(m: ModelProfile, layers: int = 1) -> float:
    return optimizer_step_s(m, 0, layers, KIND)


# -- exact -----------------------------------------------------------------------------------------


def test_one_replica_exact_is_the_engine() -> None:
    c, m = cluster([2, 1]), model(2, params=1000)
    p = plan([replica([["n0:0", "n0:1"], ["n1:0"]], microbatches=3)])
    engine = simulate(p, c, m, iterations=4, record=False)
    got = simulate_replicas(p, c, m, steps=4)
    assert got.step_times_s[0] == pytest.approx(engine.iteration_times_s)
    assert got.samples_per_s == pytest.approx(engine.samples_per_s)
    assert got.semantics == "exact" and got.wan_fraction == 0.0


def test_replica_memory_is_the_engines_with_recomputation_and_runtime_terms() -> None:
    """Each replica's peak memory is the engine's for it as a one-pipeline plan: a stage that
    recomputes keeps its stage input only (the replica simulator counted its activations in
    full, and dropped as out of memory the replicas the exact search had fitted by recomputing),
    and the runtime's terms (the all-reduce's flat gradient buffer of a stage of several devices)
    count too."""
    from dataclasses import replace

    from deepcee.simulator.engine import peak_memory
    from deepcee.simulator.pipelines import replica_plan

    c = cluster([2, 1, 1])
    m = ModelProfile(name="unit", input_bytes=1e3, layers=tuple(
        LayerProfile(name=f"l{i}", forward_flops=1e12, input_grad_flops=1e12, weight_grad_flops=1e12,
                     parameter_count=1000, activation_bytes=1e6, output_bytes=1e3) for i in range(2)))
    first = replica([["n0:0", "n0:1"], ["n1:0"]], microbatches=4)
    first = replace(first, stages=(replace(first.stages[0], recompute=True), first.stages[1]))
    p = plan([first, replica([["n2:0"]], microbatches=2, layers=[2])])
    got = simulate_replicas(p, c, m, steps=2).peak_memory_bytes
    want = peak_memory(replica_plan(p, 0), c, m)
    assert {d: got[d] for d in want} == want
    kept = peak_memory(replica_plan(replace(p, replicas=(replace(first, stages=(replace(first.stages[0], recompute=False),
                                                                                 first.stages[1])), p.replicas[1])), 0), c, m)
    assert got["n0:0"] < kept["n0:0"]  # recomputation counted


def test_two_one_device_replicas_equal_data_parallel_over_them() -> None:
    """Exact replicas of one device each time like one data-parallel stage over both devices."""
    c, m = cluster([1, 1], latency_s=0.25, bandwidth_bytes_per_s=1000.0), model(1, params=4000)
    dp = plan([ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=1, devices=("n0:0", "n1:0"), shares=(1, 1)),),
                           microbatch_size=2, num_microbatches=2, schedule="1f1b")])
    two = plan([replica([["n0:0"]], 2), replica([["n1:0"]], 2)])
    a = simulate_replicas(dp, c, m, steps=3)
    b = simulate_replicas(two, c, m, steps=3)
    assert b.step_times_s[0] == pytest.approx(a.step_times_s[0])
    assert b.step_times_s[1] == pytest.approx(a.step_times_s[0])
    # pipeline 2 x (F + B) = 6 s, ring of 2: 2 steps of (latency + bytes/2 / bandwidth) and
    # gloo's handshake (one more latency per step, deepcee's runtime), optimizer
    assert a.step_times_s[0][0] == pytest.approx(6 + 2 * (0.25 + 2000 / 1000) + 2 * 0.25 + opt(m))
    assert b.wan_fraction == pytest.approx(2 * (0.5 + 2.0) / (6 + 5.0 + opt(m)))


def test_replicas_with_different_splits_combine_per_segment() -> None:
    c, m = cluster([2, 1]), model(4, params=100)
    p = plan([replica([["n0:0"], ["n0:1"]], layers=[1, 3]), replica([["n1:0"]], layers=[4])])
    segs = layer_segments(p)
    assert [(s.start, s.stop) for s in segs] == [(0, 1), (1, 4)]
    assert [s.devices for s in segs] == [("n0:0", "n1:0"), ("n0:1", "n1:0")]
    r = simulate_replicas(p, c, m, steps=2)
    assert r.steps == (2, 2) and r.step_ends_s[0] == r.step_ends_s[1]  # one global barrier per step


def test_exact_parameter_servers_closed_form() -> None:
    """Each device is its island's server: pushes are local, the servers swap partial sums
    over the WAN (latency + bytes / bandwidth), sum twice, and pulls are local."""
    c, m = cluster([1, 1], latency_s=0.5, bandwidth_bytes_per_s=100.0), model(1, params=1000)
    p = plan([replica([["n0:0"]]), replica([["n1:0"]])], sync="ps", servers=("n0:0", "n1:0"))
    r = simulate_replicas(p, c, m, steps=1, record=True)
    sums = 2 * (1 * 1000 / 1e12)  # own holder, then both partials
    assert r.step_times_s[0][0] == pytest.approx(3 + sums + 0.5 + 1000 / 100 + opt(m))
    assert {e.kind for e in r.sync_events} == {"message", "work"}
    assert r.egress_bytes == pytest.approx({"a": 1000.0, "b": 1000.0})


def test_sync_none_with_several_holders_is_refused() -> None:
    from deepcee.simulator.replicas import check_syncs

    p = plan([replica([["n0:0"]]), replica([["n1:0"]])], sync="none")
    with pytest.raises(PlanError, match="drift apart"):
        check_syncs(p)
    with pytest.raises(PlanError, match="drift apart"):
        simulate_replicas(p, cluster([1, 1]), model(1))


# -- model averaging ----------------------------------------------------------------------------


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_model_averaging_closed_form(outer: str) -> None:
    """Gather to the root (replica 0), root work, scatter; the root's replica goes on as soon
    as it has the average, the other once the scatter arrived."""
    lat, bw, params = 0.5, 100.0, 1000
    c, m = cluster([1, 1], latency_s=lat, bandwidth_bytes_per_s=bw), model(1, params=params)
    s = Strategy(kind="model-averaging", period=2, outer_optimizer=outer, outer_lr=0.7, outer_momentum=0.9)
    r = simulate_replicas(plan([replica([["n0:0"]]), replica([["n1:0"]])], s), c, m, steps=4)
    step, hop = 3 + opt(m), lat + params / bw
    work = (2 + (6 if outer == "nesterov" else 0)) * params / 1e12
    second = 2 * step + 2 * hop + work + 2 * step  # replica 1 arrives at the second average
    assert r.step_ends_s[0] == pytest.approx([step, 2 * step + hop + work, 3 * step + hop + work,
                                              second + hop + work])
    assert r.step_ends_s[1] == pytest.approx([step, 2 * step + 2 * hop + work, 3 * step + 2 * hop + work,
                                              second + 2 * hop + work])
    assert r.wan_s == pytest.approx((2 * (hop + work), 2 * (2 * hop + work)))
    assert r.wait_s == pytest.approx((hop, 0.0))  # replica 0 waits for replica 1 at the second average
    assert r.egress_bytes == pytest.approx({"a": 2 * params, "b": 2 * params})  # scatters, gathers


def test_model_averaging_waits_for_the_slowest_replica() -> None:
    c = cluster([1, 1], latency_s=0.0, bandwidth_bytes_per_s=1e30, slowdowns={"n1:0": 3.0})
    r = simulate_replicas(plan([replica([["n0:0"]]), replica([["n1:0"]])],
                               Strategy(kind="model-averaging", period=5)), c, model(1), steps=10)
    assert r.step_ends_s[0][-1] == pytest.approx(r.step_ends_s[1][-1])
    assert r.wait_s[0] == pytest.approx(2 * 5 * (9 - 3))  # 6 s per local step, twice five steps
    assert r.wait_s[1] == pytest.approx(0.0)


def test_a_link_trace_slows_the_averages() -> None:
    trace = BandwidthTrace(times_s=(10.0,), bandwidth_bytes_per_s=(10.0,))
    s = Strategy(kind="model-averaging", period=1)
    p = plan([replica([["n0:0"]]), replica([["n1:0"]])], s)
    flat = simulate_replicas(p, cluster([1, 1], latency_s=0.0), model(1, params=100), steps=6)
    traced = simulate_replicas(p, cluster([1, 1], latency_s=0.0, trace=trace), model(1, params=100), steps=6)
    assert flat.step_times_s[0][0] == pytest.approx(traced.step_times_s[0][0])
    assert traced.step_times_s[0][-1] > flat.step_times_s[0][-1] + 10


# -- partial ----------------------------------------------------------------------------------------


def _partial(full_every: int, slowdowns: dict[str, float], window_s: float = 0.0, max_group: int = 0, rounds: int = 24):
    c = cluster([1, 1, 1, 1], latency_s=0.01, bandwidth_bytes_per_s=1e6, slowdowns=slowdowns)
    names = ["n0:0", "n1:0", "n2:0", "n3:0"]
    s = Strategy(kind="partial", window_s=window_s, min_group=2, max_group=max_group, full_sync_every=full_every)
    return simulate_replicas(plan([replica([[d]]) for d in names], s), c, model(1, params=10), steps=rounds)


@pytest.mark.parametrize(("full_every", "max_group"), [(1, 0), (3, 0), (4, 2), (5, 3)])
def test_partial_rounds_follow_the_coordinator_rules(full_every: int, max_group: int) -> None:
    r = _partial(full_every, {"n3:0": 2.5, "n2:0": 1.5}, window_s=0.2, max_group=max_group)
    assert [g.round for g in r.groups] == list(range(24))
    for g in r.groups:
        if g.full:
            assert g.members == (0, 1, 2, 3)
        elif max_group:
            assert len(g.members) <= max_group
        assert g.open_s <= g.close_s
    for start in range(0, 24 - full_every + 1):  # every replica is connected within every P rounds
        seen = {q for g in r.groups[start:start + full_every] for q in g.members}
        assert seen == {0, 1, 2, 3}
    assert r.groups[-1].full
    assert r.steps == tuple(sum(q in g.members for g in r.groups) for q in range(4))
    if full_every > 1:
        assert r.steps[0] > r.steps[3]  # the slow replica joins fewer rounds


def test_partial_keeps_its_pace_where_all_reduce_takes_the_stragglers() -> None:
    """One of six replicas 3x slower for a stretch: partial sync keeps >= 80% of its
    throughput, exact all-reduce drops to the straggler's pace (1/3, plus the sync)."""
    names = [f"n{k}:0" for k in range(6)]
    c = cluster([1] * 6, latency_s=0.01, bandwidth_bytes_per_s=1e6)
    lag = [Straggler(device=names[-1], factor=3.0, start_s=10.0, stop_s=1000.0)]
    reps = [replica([[d]]) for d in names]
    part = Strategy(kind="partial", window_s=0.1, min_group=1, full_sync_every=64)
    m = model(1, params=10)
    rates = {}
    for name, p, steps in (("partial", plan(reps, part), 200), ("exact", plan(reps), 50)):
        base = simulate_replicas(p, c, m, steps=steps).samples_per_s
        slow = simulate_replicas(p, c, m, steps=steps, stragglers=lag).samples_per_s
        rates[name] = slow / base
    assert rates["partial"] >= 0.8
    assert rates["exact"] < 0.4


# -- asgd-ga ----------------------------------------------------------------------------------------


def test_asgd_ga_respects_the_staleness_bound() -> None:
    c = cluster([1, 1], latency_s=0.05, bandwidth_bytes_per_s=1e4, slowdowns={"n1:0": 4.0})
    s = Strategy(kind="asgd-ga", accumulation_steps=2, staleness_bound=1)
    p = plan([replica([["n0:0"]]), replica([["n1:0"]])], s, servers=("n0:0", "n1:0"))
    r = simulate_replicas(p, c, model(1, params=100), steps=12)
    assert r.steps == (12, 12)
    assert len(r.pushes) == 2 * 2 * 6  # two servers, two replicas, six rounds each
    # while a replica computes, the servers move at most one update past its model; its own
    # push may then land after a held one, one more update behind
    assert max(x.staleness for x in r.pushes) == 2
    assert r.wait_s[0] > 0  # the fast replica was held back
    loose = simulate_replicas(p.replace(strategy=Strategy(kind="asgd-ga", accumulation_steps=2, staleness_bound=8)),
                              c, model(1, params=100), steps=12)
    assert loose.step_ends_s[0][-1] < r.step_ends_s[0][-1]
    assert max(x.staleness for x in loose.pushes) > 2


def test_asgd_ga_accumulates_before_pushing() -> None:
    c = cluster([1, 1], latency_s=0.0, bandwidth_bytes_per_s=1e30)
    s = Strategy(kind="asgd-ga", accumulation_steps=3, staleness_bound=4)
    p = plan([replica([["n0:0"]]), replica([["n1:0"]])], s, servers=("n0:0",))
    r = simulate_replicas(p, c, model(1, params=10), steps=7)
    assert len(r.pushes) == 2 * 3  # rounds of 3, 3 and 1 local steps
    assert r.step_ends_s[0][:2] == pytest.approx([3.0, 6.0])  # no optimizer, no sync between pushes


# -- output --------------------------------------------------------------------------------------


def test_stragglers_name_known_devices() -> None:
    with pytest.raises(ClusterSpecError, match="DEVICE:FACTOR"):
        Straggler.parse("nope:3", ["n0:0"])
    s = Straggler.parse("n0:0:3:5:20", ["n0:0"])
    assert (s.device, s.factor, s.start_s, s.stop_s) == ("n0:0", 3.0, 5.0, 20.0)
    assert Straggler.parse("n0:0:2", ["n0:0"]).stop_s == math.inf


def test_timeline_holds_pipelines_messages_and_server_work() -> None:
    c, m = cluster([2, 1]), model(2, params=50)
    p = plan([replica([["n0:0"], ["n0:1"]]), replica([["n1:0"]], layers=[2])],
             Strategy(kind="model-averaging", period=1))
    r = simulate_replicas(p, c, m, steps=2, record=True)
    trace = replica_chrome_trace(r, p)
    json.dumps(trace)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert "replica 1 stage 0: n1:0" in names
    assert any(n.startswith("server work on") for n in names)
    assert any(e.get("cat") == "sync" for e in trace["traceEvents"])
    assert trace["otherData"]["semantics"] == "relaxed"
