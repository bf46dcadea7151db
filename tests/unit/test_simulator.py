"""Simulator: closed forms on unit costs, links (FIFO, traces, resharding), sync, deadlocks, export.

Unit costs: one device kind at 1e12 effective FLOP/s and no per-layer overhead, layers of
1e12 FLOPs per sample for each of F, I and W, so one layer and one sample take exactly
F = I = W = 1 s and B = 2 s; links are instant unless a test says otherwise.
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
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
from deepcee.comm import allreduce_s
from deepcee.errors import ScheduleError
from deepcee.plan import Plan, StagePlan, share_overlaps
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.ir import parse_action, parse_schedule
from deepcee.schedule.passes import dry_run, lower
from deepcee.simulator import engine, optimizer_step_s, simulate, to_estimate
from deepcee.simulator.runtime_model import DEEPSPEED
from deepcee.simulator.trace import chrome_trace, plot_timeline, write_chrome_trace

UNIT_KIND = DeviceKind(name="unit", peak_flops_per_s=1e12, memory_bytes=1e12, achievable_fraction=1.0,
                       per_layer_overhead_s=0.0)
FAST = 1e30  # bytes/s: transfers take no time


CPU_EMULATION = "CPU worker processes (deepcee's CPU/gloo runtime)"


def unit_cluster(node_sizes: Sequence[int], *, latency_s: float = 0.0, bandwidth_bytes_per_s: float = FAST,
                 trace: BandwidthTrace | None = None, memory_bytes: float = 1e12) -> Cluster:
    """One island; node ``k`` holds devices ``n{k}:0 ..``; every link (intra and inter node) alike.
    Emulated CPU devices: simulated with deepcee's CPU runtime unless a test names another
    ([Note: which runtime plans a cluster])."""
    kind = UNIT_KIND if memory_bytes == 1e12 else DeviceKind(
        name="unit", peak_flops_per_s=1e12, memory_bytes=memory_bytes, achievable_fraction=1.0,
        per_layer_overhead_s=0.0)
    spec = LinkSpec(latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s, trace=trace)
    nodes = tuple(Node(name=f"n{k}", island="i", kind="unit", devices=tuple(f"n{k}:{j}" for j in range(c)),
                       intra=spec) for k, c in enumerate(node_sizes))
    devices = tuple(Device(name=d, kind="unit", node=n.name, island="i") for n in nodes for d in n.devices)
    return Cluster(name="unit", kinds={"unit": kind}, islands=(Island(name="i", intra=spec),), nodes=nodes,
                   devices=devices, emulation=CPU_EMULATION)


def unit_model(num_layers: int, *, activation_bytes: float = 0.0, output_bytes: float = 0.0,
               parameter_count: int = 0, flops: float = 1e12) -> ModelProfile:
    layers = tuple(
        LayerProfile(name=f"l{i}", forward_flops=flops, input_grad_flops=flops, weight_grad_flops=flops,
                     parameter_count=parameter_count, activation_bytes=activation_bytes,
                     output_bytes=output_bytes)
        for i in range(num_layers)
    )
    return ModelProfile(name="unit", layers=layers, input_bytes=output_bytes)


def make_plan(stage_devices: Sequence[Sequence[str]], num_microbatches: int, *, schedule: str = "1f1b",
              shares: Sequence[Sequence[int]] | None = None, layers: Sequence[int] | None = None,
              sync: str = "allreduce-ring", actions: Sequence[Sequence[str]] = ()) -> Plan:
    """One layer per stage unless ``layers`` gives each stage's count; one sample per device by default."""
    shares = shares or [[1] * len(devs) for devs in stage_devices]
    layers = layers or [1] * len(stage_devices)
    stages, start = [], 0
    for devs, sh, n in zip(stage_devices, shares, layers, strict=True):
        stages.append(StagePlan(layer_start=start, layer_stop=start + n, devices=tuple(devs), shares=tuple(sh)))
        start += n
    mb = sum(shares[0])
    return Plan(system="test", cluster="unit", model="unit", global_batch=mb * num_microbatches,
                microbatch_size=mb, num_microbatches=num_microbatches, stages=tuple(stages),
                schedule=schedule, sync=sync, actions=tuple(tuple(a) for a in actions))


def chain(num_stages: int) -> tuple[Cluster, list[list[str]]]:
    """One device per node, one stage per device."""
    return unit_cluster([1] * num_stages), [[f"n{s}:0"] for s in range(num_stages)]


def events_of(result, kind: str) -> list:
    return [e for e in result.events if e.kind == kind]


# -- closed forms on unit costs --------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(1, 1), (1, 4), (2, 1), (3, 5), (4, 8), (5, 3)])
def test_fill_drain_schedules_match_closed_form(schedule: str, num_stages: int, num_microbatches: int) -> None:
    cluster, devs = chain(num_stages)
    plan = make_plan(devs, num_microbatches, schedule=schedule)
    r = simulate(plan, cluster, unit_model(num_stages))
    f, b = 1.0, 2.0
    assert r.iteration_s == pytest.approx((num_microbatches + num_stages - 1) * (f + b))
    assert r.samples_per_s == pytest.approx(num_microbatches / r.iteration_s)
    ideal = num_microbatches * (f + b)
    assert r.bubble_fraction == pytest.approx(1 - ideal / r.iteration_s)
    for d in plan.devices:  # every device computes M x (F + B); the rest is bubble
        assert r.busy_s[d] == pytest.approx(ideal)
        total = r.busy_s[d] + r.sync_s[d] + r.comm_wait_s[d] + r.idle_s[d]
        assert total == pytest.approx(r.iteration_s)


@pytest.mark.parametrize("num_microbatches", [2, 6])
def test_peak_memory_counts_microbatches_in_flight(num_microbatches: int) -> None:
    num_stages, act, out = 4, 100.0, 1.0
    cluster, devs = chain(num_stages)
    model = unit_model(num_stages, activation_bytes=act, output_bytes=out)
    for schedule, in_flight in (("1f1b", lambda s: min(num_stages - s, num_microbatches)),
                                ("gpipe", lambda s: num_microbatches)):
        r = simulate(make_plan(devs, num_microbatches, schedule=schedule), cluster, model)
        for s in range(num_stages):
            # stashed activations of the microbatches in flight + one input and one output buffer
            # + deepcee's runtime: every receive of the step posted at its start and every send
            # held until its end (2 M buffers of what the stage receives and sends)
            moved = out * ((s > 0) + (s < num_stages - 1))
            want = in_flight(s) * act + 2 * out + (2 * num_microbatches - 1) * moved
            assert r.peak_memory_bytes[devs[s][0]] == pytest.approx(want)
            # a runtime that posts receives as it reaches them holds in-flight buffers only
            ds = simulate(make_plan(devs, num_microbatches, schedule=schedule), cluster, model, runtime=DEEPSPEED)
            assert ds.peak_memory_bytes[devs[s][0]] == pytest.approx(in_flight(s) * (act + moved) + 2 * out - moved)


def test_zb_h1_has_fewer_bubbles_than_1f1b() -> None:
    cluster, devs = chain(4)
    model = unit_model(4)
    one_f_one_b = simulate(make_plan(devs, 8, schedule="1f1b"), cluster, model)
    zb = simulate(make_plan(devs, 8, schedule="zb-h1"), cluster, model)
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    assert zb.iteration_s < one_f_one_b.iteration_s


def test_explicit_actions_override_the_named_schedule() -> None:
    cluster, devs = chain(2)
    gpipe_rows = [" ".join([f"{s}F{m}" for m in range(3)] + [f"{s}B{m}" for m in range(3)]).split()
                  for s in range(2)]
    plan = make_plan(devs, 3, schedule="1f1b", actions=gpipe_rows)
    r = simulate(plan, cluster, unit_model(2, activation_bytes=10.0))
    assert r.peak_memory_bytes[devs[1][0]] == pytest.approx(3 * 10.0)  # GPipe keeps all 3 in flight
    assert [e.action for e in events_of(r, "compute") if e.where == devs[1][0]] == gpipe_rows[1]


# -- links -----------------------------------------------------------------------------------


def test_single_transfer_takes_latency_plus_bytes_over_bandwidth() -> None:
    cluster = unit_cluster([1, 1], latency_s=0.05, bandwidth_bytes_per_s=1e6)
    plan = make_plan([["n0:0"], ["n1:0"]], 1, shares=[[4], [4]])
    r = simulate(plan, cluster, unit_model(2, output_bytes=1000.0))
    fwd, bwd = events_of(r, "transfer")
    transfer_s = 0.05 + 4 * 1000.0 / 1e6
    assert (fwd.src, fwd.dst, fwd.nbytes, fwd.action) == ("n0:0", "n1:0", 4000.0, "0SEND_F0")
    assert (fwd.issued_s, fwd.start_s) == (pytest.approx(4.0), pytest.approx(4.0))  # F of 4 samples
    assert fwd.end_s - fwd.start_s == pytest.approx(transfer_s)
    assert bwd.end_s - bwd.start_s == pytest.approx(transfer_s) and bwd.action == "1SEND_B0"
    assert r.iteration_s == pytest.approx(4 * 3 + 4 * 3 + 2 * transfer_s)
    assert r.comm_wait_s["n0:0"] == pytest.approx(4 * 3 + 2 * transfer_s)  # both trips and 1's F+B


def test_transfers_sharing_a_resource_queue_fifo() -> None:
    # two senders on node n0 to one receiver on node n1: both use the pipe n0->n1
    cluster = unit_cluster([2, 1], latency_s=0.1, bandwidth_bytes_per_s=1000.0)
    plan = make_plan([["n0:0", "n0:1"], ["n1:0"]], 1, shares=[[1, 1], [2]])
    r = simulate(plan, cluster, unit_model(2, output_bytes=500.0))
    first, second = sorted((e for e in events_of(r, "transfer") if e.action == "0SEND_F0"),
                           key=lambda e: e.start_s)
    assert cluster.link("n0:0", "n1:0").resource == cluster.link("n0:1", "n1:0").resource == "n0->n1"
    assert first.issued_s == second.issued_s == pytest.approx(1.0)
    assert first.serialized_s == pytest.approx(1.5)
    assert second.start_s == pytest.approx(first.serialized_s)  # queued behind the first
    assert second.end_s == pytest.approx(1.5 + 0.5 + 0.1)
    f1 = next(e for e in events_of(r, "compute") if e.action == "1F0")
    assert f1.start_s == pytest.approx(second.end_s)  # the receive needs both pieces
    assert r.critical_path[1].kind == "transfer" and r.critical_path[1].end_s == pytest.approx(1.5)


def test_bandwidth_drop_mid_transfer_is_integrated() -> None:
    trace = BandwidthTrace(times_s=(1.5,), bandwidth_bytes_per_s=(0.25e6,))
    cluster = unit_cluster([1, 1], latency_s=0.01, bandwidth_bytes_per_s=1e6, trace=trace)
    plan = make_plan([["n0:0"], ["n1:0"]], 1)
    model = unit_model(2, output_bytes=1e6)
    fwd = events_of(simulate(plan, cluster, model), "transfer")[0]
    # issued at 1.0: 0.5 s at 1 MB/s moves 0.5 MB, the other 0.5 MB at 0.25 MB/s takes 2 s
    assert fwd.serialized_s == pytest.approx(3.5) and fwd.end_s == pytest.approx(3.51)
    # start_s offsets the clock: starting at 10 s, the whole transfer runs at the dropped rate
    late = events_of(simulate(plan, cluster, model, start_s=10.0), "transfer")[0]
    assert late.serialized_s - late.start_s == pytest.approx(4.0) and late.start_s == pytest.approx(11.0)


def test_iterations_follow_the_trace_clock() -> None:
    cluster = unit_cluster([1, 1], bandwidth_bytes_per_s=1e6,
                           trace=BandwidthTrace(times_s=(6.0,), bandwidth_bytes_per_s=(0.5e6,)))
    plan = make_plan([["n0:0"], ["n1:0"]], 1)
    r = simulate(plan, cluster, unit_model(2, output_bytes=1e6), iterations=3)
    assert r.iteration_times_s[0] == pytest.approx(6 + 2 * 1.0)  # both transfers before the drop
    assert r.iteration_times_s[1] == pytest.approx(6 + 2 * 2.0)  # both after it
    assert r.iteration_times_s[2] == r.iteration_times_s[1]
    assert r.iteration_s == pytest.approx(sum(r.iteration_times_s) / 3)
    assert {e.iteration for e in r.events} == {0, 1, 2}


@pytest.mark.parametrize(
    "shares",
    [[[3, 2], [5]], [[5], [3, 2]], [[3, 1], [2, 2]], [[3, 2], [5], [1, 4]]],
)
def test_uneven_shares_send_each_pair_its_overlap(shares: list[list[int]]) -> None:
    sizes = [len(s) for s in shares]
    cluster = unit_cluster(sizes)
    devs = [[f"n{k}:{j}" for j in range(c)] for k, c in enumerate(sizes)]
    out, num_microbatches = 7.0, 3
    r = simulate(make_plan(devs, num_microbatches, shares=shares), cluster, unit_model(len(shares), output_bytes=out))
    sent: dict[tuple[str, str, str], float] = defaultdict(float)
    for e in events_of(r, "transfer"):
        sent[(e.src, e.dst, e.action[1:-1])] += e.nbytes
    want: dict[tuple[str, str, str], float] = {}
    for s in range(len(shares) - 1):
        for i, j, lo, hi in share_overlaps(shares[s], shares[s + 1]):
            a, b = devs[s][i], devs[s + 1][j]
            want[(a, b, "SEND_F")] = want[(b, a, "SEND_B")] = num_microbatches * (hi - lo) * out
    assert dict(sent) == pytest.approx(want)
    for s, row in enumerate(devs):  # compute time scales with the share
        for d, share in zip(row, shares[s], strict=True):
            assert r.busy_s[d] == pytest.approx(num_microbatches * 3 * share)


# -- agreement with the schedule dry run -----------------------------------------------------


def random_chain(rng: random.Random, num_stages: int) -> tuple[Cluster, ModelProfile, list[int]]:
    """One device per node; each directed boundary its own link; layers of random cost."""
    base = unit_cluster([1] * num_stages)
    entries = []
    for s in range(num_stages - 1):
        for a, b in ((s, s + 1), (s + 1, s)):
            spec = LinkSpec(latency_s=rng.choice([0.0, rng.uniform(0, 0.5)]),
                            bandwidth_bytes_per_s=rng.uniform(50.0, 2000.0))
            entries.append(LinkEntry(a=f"n{a}", b=f"n{b}", spec=spec, directed=True))
    layers = [rng.randint(1, 3) for _ in range(num_stages)]
    model = ModelProfile(name="unit", input_bytes=10.0, layers=tuple(
        LayerProfile(name=f"l{i}", forward_flops=rng.uniform(0.2, 2) * 1e12,
                     input_grad_flops=rng.uniform(0.2, 2) * 1e12, weight_grad_flops=rng.uniform(0.2, 2) * 1e12,
                     parameter_count=0, activation_bytes=1.0, output_bytes=rng.uniform(0, 500))
        for i in range(sum(layers))))
    return base.with_links(entries), model, layers


@pytest.mark.parametrize("seed", range(24))
def test_one_device_per_stage_equals_the_dry_run(seed: int) -> None:
    rng = random.Random(seed)
    num_stages, num_microbatches = rng.randint(1, 5), rng.randint(1, 7)
    schedule = rng.choice(["gpipe", "1f1b", "zb-h1", "zb-h2"])
    cluster, model, layers = random_chain(rng, num_stages)
    share = rng.randint(1, 3)
    plan = make_plan([[f"n{s}:0"] for s in range(num_stages)], num_microbatches, schedule=schedule,
                     shares=[[share]] * num_stages, layers=layers)
    r = simulate(plan, cluster, model)
    bounds = [(st.layer_start, st.layer_stop) for st in plan.stages]
    cost = {p: [model.time_s(a, b, p, share, UNIT_KIND) for a, b in bounds] for p in "FIW"}

    def comm(src: int, dst: int) -> tuple[float, float]:
        link = cluster.link(f"n{src}:0", f"n{dst}:0")
        nbytes = share * model.boundary_bytes(bounds[min(src, dst)][1])
        return link.latency_s, nbytes / link.bandwidth_bytes_per_s

    dry = dry_run(build_schedule(schedule, num_stages, num_microbatches),
                  forward_s=cost["F"], input_grad_s=cost["I"], weight_grad_s=cost["W"],
                  comm_forward=[comm(s, s + 1) for s in range(num_stages - 1)],
                  comm_backward=[comm(s + 1, s) for s in range(num_stages - 1)])
    assert r.iteration_s == pytest.approx(dry.makespan_s, rel=1e-9)
    assert r.bubble_fraction == pytest.approx(dry.bubble_fraction, rel=1e-9, abs=1e-12)
    computes = events_of(r, "compute")
    assert len(computes) == sum(a.kind.is_compute for a in dry.start_s)
    for e in computes:
        a = parse_action(e.action)
        assert (e.start_s, e.end_s) == (pytest.approx(dry.start_s[a]), pytest.approx(dry.end_s[a]))
    for e in events_of(r, "transfer"):
        assert e.end_s == pytest.approx(dry.delivered_s[parse_action(e.action)])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_dry_run_is_the_simulator_on_unit_costs(schedule: str) -> None:
    # The dry run is the simulator's interpreter with given costs: on unit costs (F = I = W = 1,
    # links of latency 0 or 1 and no serialisation) every action starts and ends at the same
    # time in both, bit for bit, over a grid of stages x microbatches.
    for latency in (0.0, 1.0):
        for num_stages in range(1, 7):
            cluster, devs = unit_cluster([1] * num_stages, latency_s=latency), chain(num_stages)[1]
            for num_microbatches in range(1, 9):
                plan = make_plan(devs, num_microbatches, schedule=schedule)
                r = simulate(plan, cluster, unit_model(num_stages))
                dry = dry_run(build_schedule(schedule, num_stages, num_microbatches), forward_s=1.0,
                              input_grad_s=1.0, weight_grad_s=1.0, comm_forward=(latency, 0.0),
                              comm_backward=(latency, 0.0))
                assert r.pipeline_s == dry.makespan_s
                assert r.bubble_fraction == dry.bubble_fraction
                computes = events_of(r, "compute")
                assert len(computes) == sum(a.kind.is_compute for a in dry.start_s)
                for e in computes:
                    a = parse_action(e.action)
                    assert (e.start_s, e.end_s) == (dry.start_s[a], dry.end_s[a])
                for e in events_of(r, "transfer"):
                    assert e.end_s == dry.delivered_s[parse_action(e.action)]


# -- gradient synchronisation and optimizer ---------------------------------------------------


@pytest.mark.parametrize("sync", ["allreduce-ring", "allreduce-hier", "zero2", "none"])
def test_allreduce_and_optimizer_durations(sync: str) -> None:
    cluster = unit_cluster([2, 2, 1], latency_s=1e-3, bandwidth_bytes_per_s=1e9)
    devs = [["n0:0", "n0:1", "n1:0"], ["n2:0"]]
    plan = make_plan(devs, 2, shares=[[1, 1, 1], [3]], layers=[2, 1], sync=sync)
    model = unit_model(3, parameter_count=10**9)
    r = simulate(plan, cluster, model, start_s=3.0)
    begin = max(e.end_s for e in events_of(r, "compute") if e.stage == 0)
    want = allreduce_s(cluster, devs[0], model.gradient_bytes(0, 2), sync, at_s=begin)
    assert (want > 0) == (sync != "none")
    # gloo's ring waits for each receiver's ready notice: one more latency of the ring's slowest
    # edge (n0 -> n1, 1 ms) per step, 2 (k - 1) steps
    want += 2 * 2 * 1e-3 if sync != "none" else 0.0
    ar = events_of(r, "allreduce")  # none for one-device stages or without sync
    assert [e.where for e in ar] == (devs[0] if sync != "none" else [])
    assert all(e.start_s == pytest.approx(begin) and e.end_s - begin == pytest.approx(want) for e in ar)
    steps = {e.where: e for e in events_of(r, "optimizer")}
    shards = 3 if sync == "zero2" else 1
    step = optimizer_step_s(model, 0, 2, cluster.kind_of("n0:0"), 1.0, shards=shards)
    assert step == pytest.approx(10 * 2e9 / 1e12 / shards)
    assert steps["n0:0"].start_s == pytest.approx(begin + want)
    assert steps["n0:0"].end_s - steps["n0:0"].start_s == pytest.approx(step)
    assert r.end_s == pytest.approx(max(e.end_s for e in steps.values()))
    assert r.sync_s["n0:0"] == pytest.approx(want) and r.sync_s["n2:0"] == 0.0


# -- critical path, accounting, failures -------------------------------------------------------


def test_critical_path_tiles_the_run_and_names_the_slow_link() -> None:
    cluster = unit_cluster([1, 1, 1], latency_s=0.2, bandwidth_bytes_per_s=100.0)
    devs = [["n0:0"], ["n1:0"], ["n2:0"]]
    r = simulate(make_plan(devs, 4), cluster, unit_model(3, output_bytes=500.0), start_s=2.0, iterations=2)
    path = r.critical_path
    assert path[0].start_s == pytest.approx(2.0) and path[-1].end_s == pytest.approx(r.end_s)
    for a, b in zip(path, path[1:], strict=False):
        assert b.start_s == pytest.approx(a.end_s)
    assert r.bottleneck.startswith("link n") and "% of the critical path" in r.bottleneck
    fast = simulate(make_plan(devs, 4), unit_cluster([1, 1, 1]), unit_model(3))
    assert fast.bottleneck.startswith("device n")


def test_bottleneck_over_several_iterations_reads_per_iteration() -> None:
    """The label is printed beside one iteration's time: over N iterations its times are the
    per-iteration means (the relaxed search simulates 2; its label read twice the iteration)."""
    import re

    cluster = unit_cluster([1, 1, 1], latency_s=0.2, bandwidth_bytes_per_s=100.0)
    devs = [["n0:0"], ["n1:0"], ["n2:0"]]
    r = simulate(make_plan(devs, 4), cluster, unit_model(3, output_bytes=500.0), iterations=2)
    t, total = map(float, re.search(r"\(([\d.e+-]+) s of ([\d.e+-]+) s per iteration, the mean of 2\)",
                                     r.bottleneck).groups())
    path_s = sum(seg.end_s - seg.start_s for seg in r.critical_path)
    assert total == pytest.approx(path_s / 2, rel=1e-3) and total == pytest.approx(r.iteration_s, rel=1e-3)
    assert 0 < t <= total


def test_deadlock_names_the_stuck_actions(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = unit_cluster([2, 1])
    plan = make_plan([["n0:0", "n0:1"], ["n1:0"]], 2, schedule="compact", shares=[[1, 1], [2]],
                     actions=[["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    # explicit actions are validated first: the marked table names the blocked actions
    with pytest.raises(ScheduleError, match=r"deadlocks.*stage 0 at 0RECV_B0, stage 1 at 1RECV_F1"):
        simulate(plan, cluster, unit_model(2))
    # the interpreter's own check, for what validation lets through
    monkeypatch.setattr(engine, "lowered_schedule", lambda p: lower(parse_schedule(p.actions)))
    with pytest.raises(ScheduleError, match=r"n0:0 at 0RECV_B0 \(0 of 1 pieces arrived\); "
                                            r"n0:1 at 0RECV_B0 .*n1:0 at 1RECV_F1 \(0 of 2 pieces arrived\)"):
        simulate(plan, cluster, unit_model(2))


def test_explicit_actions_are_validated() -> None:
    cluster, devs = chain(2)
    plan = make_plan(devs, 1, schedule="compact", actions=[["0F0", "0I0"], ["1F0", "1B0"]])
    with pytest.raises(ScheduleError, match="stage 0: microbatch 0 has no W"):
        simulate(plan, cluster, unit_model(2))


def test_rejects_a_plan_that_does_not_fit_the_model() -> None:
    cluster, devs = chain(2)
    with pytest.raises(Exception, match="plan covers 2 layers"):
        simulate(make_plan(devs, 2), cluster, unit_model(3))
    with pytest.raises(ValueError, match="iterations must be an integer >= 1, got 0"):
        simulate(make_plan(devs, 2), cluster, unit_model(2), iterations=0)


def test_to_estimate_names_devices_out_of_memory() -> None:
    cluster = unit_cluster([1, 1], memory_bytes=30.0)
    plan = make_plan([["n0:0"], ["n1:0"]], 4)
    r = simulate(plan, cluster, unit_model(2, activation_bytes=20.0), record=False)
    assert r.events == () and r.critical_path
    est = to_estimate(r, plan, cluster)
    assert est.source == "simulator" and est.iteration_s == r.iteration_s
    assert est.samples_per_s == r.samples_per_s and dict(est.peak_memory_bytes) == dict(r.peak_memory_bytes)
    assert "out of memory: n0:0 needs" in est.bottleneck and "n1:0" not in est.bottleneck.split("memory:")[1]


def test_testbed_plan_simulates_fast() -> None:
    from deepcee.scenarios import load_scenario

    cluster = load_scenario("cee-testbed")
    nodes = cluster.node_devices()
    groups = [nodes["cloud0"], nodes["cloud1"], nodes["edge0"] + nodes["edge1"],
              nodes["end0"] + nodes["end1"] + nodes["end2"]]
    shares = [[3] * 4, [3] * 4, [3] * 4, [4] * 3]
    model = unit_model(24, activation_bytes=8e6, output_bytes=5e5, parameter_count=7 * 10**6, flops=2e9)
    plan = make_plan(groups, 32, shares=shares, layers=[6] * 4)
    simulate(plan, cluster, model, record=False)  # warm caches (link resolution)
    t = time.perf_counter()
    r = simulate(plan, cluster, model, record=False)
    elapsed = time.perf_counter() - t
    assert len(plan.devices) == 15 and r.iteration_s > 0
    recorded = simulate(plan, cluster, model)
    assert (recorded.iteration_s, recorded.critical_path) == (r.iteration_s, r.critical_path)
    assert len(recorded.events) > 2000
    assert elapsed < 0.5, f"simulate took {elapsed:.3f} s"  # ~0.01-0.03 s measured; generous on 2 busy cores


# -- export ------------------------------------------------------------------------------------


def test_chrome_trace_is_valid_json_with_the_expected_events(tmp_path) -> None:
    cluster = unit_cluster([2, 1], latency_s=0.01, bandwidth_bytes_per_s=1e4)
    plan = make_plan([["n0:0", "n0:1"], ["n1:0"]], 3, shares=[[1, 1], [2]])
    r = simulate(plan, cluster, unit_model(2, output_bytes=100.0, parameter_count=1000))
    trace = json.loads(json.dumps(chrome_trace(r, plan)))
    evs = trace["traceEvents"]
    names = {e["args"]["name"] for e in evs if e.get("name") == "process_name"}
    assert names == {"stage 0: n0:0", "stage 0: n0:1", "stage 1: n1:0", "link n0->n1", "link n1->n0"}
    computes = [e for e in evs if e.get("cat") == "compute"]
    assert len(computes) == 3 * 2 * 3 and all(e["ph"] == "X" and e["dur"] > 0 for e in computes)
    assert {e["args"]["action"] for e in computes if e["pid"] == 3} == {f"1{k}{m}" for k in "FB" for m in range(3)}
    serialise = [e for e in evs if e.get("cat") == "transfer" and e["ph"] == "X"]
    assert len(serialise) == 2 * 2 * 3 and all(e["args"]["bytes"] == 100.0 for e in serialise)
    assert sum(e["ph"] == "b" for e in evs) == sum(e["ph"] == "e" for e in evs) == len(serialise)
    assert len([e for e in evs if e.get("cat") == "allreduce"]) == 2  # stage 1 has one device: none
    assert min(e["ts"] for e in evs if "ts" in e) == 0.0
    assert trace["otherData"]["iteration_s"] == r.iteration_s
    out = tmp_path / "t" / "trace.json"
    write_chrome_trace(out, r, plan)
    assert json.loads(out.read_text()) == trace


def test_plot_timeline_writes_a_png(tmp_path) -> None:
    cluster = unit_cluster([2, 1], latency_s=0.01, bandwidth_bytes_per_s=1e4)
    plan = make_plan([["n0:0", "n0:1"], ["n1:0"]], 3, shares=[[1, 1], [2]])
    r = simulate(plan, cluster, unit_model(2, output_bytes=100.0, parameter_count=1000), iterations=2)
    out = tmp_path / "timeline.png"
    plot_timeline(r, plan, out, caption="emulated")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="caption must be"):
        plot_timeline(r, plan, out, caption="measured")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="record=True"):
        chrome_trace(simulate(plan, cluster, unit_model(2), record=False), plan)
