"""Analytic cost model: closed forms, the dry-run model, the simulator, memory, range tables.

The cost model times the plan's lowered schedule with the simulator's interpreter on
stage-level costs; the tests below tie it to the dry run (bit for bit) and to the simulator
(one device per stage, every schedule, a grid of stages x microbatches).
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from conftest import measured_model, random_cluster

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.comm import allreduce_curve_s, allreduce_s
from deepcee.errors import ScheduleError
from deepcee.models import get_model
from deepcee.plan import Plan, StagePlan, share_overlaps, share_ranges
from deepcee.planner.cost_model import (
    AnalyticCostModel,
    RangeTables,
    SimulatorCostModel,
    largest_remainder_shares,
    pipeline_timing,
    range_time_s,
    stage_compute_s,
)
from deepcee.planner.search import compact_plan
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.scenarios import load_scenario
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.passes import dry_run, lower
from deepcee.simulator.engine import allreduce_time_s, optimizer_step_s, simulate
from deepcee.simulator.memory import device_memory, device_memory_bytes
from deepcee.simulator.runtime_model import DEFAULT_RUNTIME

FIXED = ("gpipe", "1f1b", "zb-h1", "zb-h2")


def _chain_cluster(num: int, *, wan_bytes_per_s: float = 12.5e6, per_node: int = 1) -> Cluster:
    """``num`` nodes of ``per_node`` devices, one island each, joined by one WAN spec."""
    kinds = {"gpu": DeviceKind(name="gpu", peak_flops_per_s=10e12, memory_bytes=8e9, achievable_fraction=0.5,
                               per_layer_overhead_s=0.0)}
    fast = LinkSpec(latency_s=1e-5, bandwidth_bytes_per_s=1e10)
    islands, nodes, devices, links = [], [], [], []
    for i in range(num):
        names = tuple(f"n{i}:{k}" for k in range(per_node))
        islands.append(Island(name=f"i{i}", intra=fast))
        nodes.append(Node(name=f"n{i}", island=f"i{i}", kind="gpu", devices=names, intra=fast))
        devices += [Device(name=n, kind="gpu", node=f"n{i}", island=f"i{i}") for n in names]
    for i in range(num):
        for j in range(i + 1, num):
            links.append(LinkEntry(a=f"i{i}", b=f"i{j}",
                                   spec=LinkSpec(latency_s=0.01, bandwidth_bytes_per_s=wan_bytes_per_s)))
    # timed as deepcee's CPU/gloo runtime runs it (these tests name its handshakes and buffers)
    return Cluster(name="chain", kinds=kinds, islands=tuple(islands), nodes=tuple(nodes), devices=tuple(devices),
                   links=tuple(links), emulation="CPU worker processes (the CPU/gloo runtime)")


def _uniform_model(layers: int, *, flops: float = 1e9, params: int = 1000, act: float = 1e6,
                   out: float = 1e5) -> ModelProfile:
    return ModelProfile(name="uniform", input_bytes=out, layers=tuple(
        LayerProfile(name=f"l{k}", forward_flops=flops, input_grad_flops=flops, weight_grad_flops=flops,
                     parameter_count=params, activation_bytes=act, output_bytes=out) for k in range(layers)))


def _plan(cluster: Cluster, split: list[int], stages: list[tuple[str, ...]], n: int, m: int, schedule: str,
          sync: str = "allreduce-ring") -> Plan:
    st = tuple(StagePlan(layer_start=split[k], layer_stop=split[k + 1], devices=devs,
                         shares=largest_remainder_shares(devs, [1.0] * len(devs), n))
               for k, devs in enumerate(stages))
    return Plan(system="test", cluster=cluster.name, model="m", global_batch=n * m, microbatch_size=n,
                num_microbatches=m, stages=st, schedule=schedule, sync=sync)


@pytest.mark.parametrize("s,m", [(1, 1), (2, 3), (4, 4), (4, 9), (6, 3)])
def test_unit_cost_closed_forms(s: int, m: int):
    """gpipe and 1f1b: (M + S - 1)(F + B); zb-h1 with F = I = W = 1 and M >= S: 3M + 2(S - 1)."""
    for name in ("gpipe", "1f1b"):
        t = pipeline_timing(lower(build_schedule(name, s, m)), [1.0] * s, [1.0] * s, [1.0] * s,
                            [(0.0, 0.0)] * (s - 1), [(0.0, 0.0)] * (s - 1))
        assert t.makespan_s == pytest.approx((m + s - 1) * 3.0)
    if m >= s:
        t = pipeline_timing(lower(build_schedule("zb-h1", s, m)), [1.0] * s, [1.0] * s, [1.0] * s,
                            [(0.0, 0.0)] * (s - 1), [(0.0, 0.0)] * (s - 1))
        assert t.makespan_s == pytest.approx(3 * m + 2 * (s - 1))


def test_unit_cost_closed_form_with_uniform_comm():
    """gpipe with F = 1, B = 2 and a pure-latency link c: (M + S - 1)(F + B) + 2 (S - 1) c."""
    s, m, c = 4, 8, 0.25
    t = pipeline_timing(lower(build_schedule("gpipe", s, m)), [1.0] * s, [1.0] * s, [1.0] * s,
                        [(c, 0.0)] * (s - 1), [(c, 0.0)] * (s - 1))
    assert t.makespan_s == pytest.approx((m + s - 1) * 3.0 + 2 * (s - 1) * c)


def test_pipeline_timing_is_the_dry_run_bit_for_bit_on_random_costs():
    # the unrecorded run lets each stage run until it blocks; the dry run keeps time order
    rng = random.Random(7)
    for _ in range(200):
        s, m, name = rng.randint(1, 5), rng.randint(1, 8), rng.choice(FIXED)
        f, i, w = ([rng.uniform(0.1, 2) for _ in range(s)] for _ in range(3))
        cf = [(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(s - 1)]
        cb = [(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(s - 1)]
        sched = build_schedule(name, s, m)
        ref = dry_run(sched, forward_s=f, input_grad_s=i, weight_grad_s=w, comm_forward=cf, comm_backward=cb)
        got = pipeline_timing(lower(sched), f, i, w, cf, cb)
        assert got.makespan_s == ref.makespan_s
        assert got.busy_s == ref.busy_s


def test_pipeline_timing_takes_lowered_schedules_only():
    with pytest.raises(ScheduleError, match="lower"):
        pipeline_timing(build_schedule("1f1b", 2, 2), [1.0] * 2, [1.0] * 2, [1.0] * 2, [(0.0, 0.0)], [(0.0, 0.0)])


@pytest.mark.parametrize("schedule", FIXED)
def test_one_device_stages_equal_the_simulator_on_a_grid(schedule: str):
    # Stage-level costs are exact with one device per stage, so the cost model's pipeline is
    # the simulator's: same lowered lists, same interpreter, every stage and microbatch count.
    rng = random.Random(FIXED.index(schedule))
    for s in range(1, 6):
        for m in (1, 2, 3, 5, 8):
            c = _chain_cluster(s, wan_bytes_per_s=rng.uniform(5e6, 5e7))
            model = _uniform_model(s * 2, out=rng.uniform(1e4, 1e6))
            p = _plan(c, [2 * k for k in range(s + 1)], [(f"n{k}:0",) for k in range(s)], 2, m, schedule)
            est = AnalyticCostModel().breakdown(p, c, model)
            sim = simulate(p, c, model, record=False)
            assert est.iteration_s == pytest.approx(sim.iteration_s, rel=1e-12, abs=0), (s, m)
            assert est.pipeline.makespan_s == pytest.approx(sim.pipeline_s, rel=1e-12, abs=0), (s, m)


@pytest.mark.parametrize("schedule", FIXED)
def test_one_device_stages_match_the_simulator(schedule: str):
    c, m = load_scenario("cee-testbed"), get_model("gpt2")
    p = Plan(system="t", cluster=c.name, model=m.name, global_batch=32, microbatch_size=4, num_microbatches=8,
             stages=tuple(StagePlan(layer_start=a, layer_stop=b, devices=(d,), shares=(4,))
                          for a, b, d in ((0, 4, "cloud0:0"), (4, 8, "cloud1:0"), (8, 11, "edge0:0"),
                                          (11, 14, "end0:0"))),
             schedule=schedule)
    est = AnalyticCostModel().estimate(p, c, m)
    sim = SimulatorCostModel().estimate(p, c, m)
    assert est.iteration_s == pytest.approx(sim.iteration_s, rel=1e-9)
    assert est.peak_memory_bytes == pytest.approx(dict(sim.peak_memory_bytes))
    assert est.source == "cost-model" and sim.source == "simulator"


def test_data_parallel_plan_is_compute_plus_allreduce_plus_optimizer():
    c = _chain_cluster(1, per_node=4)
    model = _uniform_model(3, params=10**6)
    devs = tuple(d.name for d in c.devices)
    p = _plan(c, [0, 3], [devs], 8, 2, "1f1b")
    cost = AnalyticCostModel().breakdown(p, c, model)
    per_mb = sum(model.time_s(0, 3, x, 2, c.kinds["gpu"]) for x in "FIW")
    ar = allreduce_time_s(c, devs, model.gradient_bytes(0, 3), "allreduce-ring", DEFAULT_RUNTIME)
    assert ar > allreduce_s(c, devs, model.gradient_bytes(0, 3), "allreduce-ring")  # gloo's ready handshakes
    opt = optimizer_step_s(model, 0, 3, c.kinds["gpu"])
    assert cost.iteration_s == pytest.approx(2 * per_mb + ar + opt)
    assert ar > 0 and cost.allreduce_s == (pytest.approx(ar),)


@pytest.mark.parametrize("schedule,expect", [
    ("gpipe", lambda s, S, M: M), ("1f1b", lambda s, S, M: min(S - s, M)),
    ("zb-h1", lambda s, S, M: min(S - s, M)), ("zb-h2", lambda s, S, M: min(2 * (S - s) - 1, M))])
def test_memory_uses_the_schedule_in_flight_counts(schedule, expect):
    c = _chain_cluster(4)
    model = _uniform_model(8)
    p = _plan(c, [0, 2, 4, 6, 8], [(f"n{k}:0",) for k in range(4)], 2, 5, schedule)
    cost = AnalyticCostModel().breakdown(p, c, model)
    for s, st in enumerate(p.stages):
        k = expect(s, 4, 5)
        assert cost.in_flight[s] == k
        full = device_memory(model, st.layer_start, st.layer_stop, share=2, in_flight=k, num_microbatches=5,
                             kind="gpu")
        assert full.plan_bytes == pytest.approx(device_memory_bytes(model, st.layer_start, st.layer_stop, share=2,
                                                                    in_flight=k))
        assert cost.memory_bytes[st.devices[0]] == pytest.approx(full.total_bytes)
    assert cost.fits


def test_recomputation_and_runtime_terms_combine():
    """A recomputing stage keeps its input per microbatch in flight plus one microbatch's
    activations (planner-10's plan terms); the runtime terms come on top, the same in the cost
    model and the simulator."""
    c = _chain_cluster(2)
    model = _uniform_model(4, act=1e6)
    p = _plan(c, [0, 2, 4], [("n0:0",), ("n1:0",)], 2, 4, "1f1b")
    p = Plan(**{**{f: getattr(p, f) for f in ("system", "cluster", "model", "global_batch", "microbatch_size",
                                              "num_microbatches", "schedule", "sync")},
                "stages": (replace(p.stages[0], recompute=True), p.stages[1])})
    cost = AnalyticCostModel().breakdown(p, c, model)
    assert dict(cost.memory_bytes) == pytest.approx(dict(simulate(p, c, model, record=False).peak_memory_bytes))
    st, k = p.stages[0], cost.in_flight[0]
    full = device_memory(model, 0, 2, share=2, in_flight=k, num_microbatches=4, kind="gpu", recompute=True)
    assert full.activation_bytes == pytest.approx(k * 2 * model.boundary_bytes(0) + 2 * model.activation_bytes(0, 2))
    assert full.plan_bytes == pytest.approx(device_memory_bytes(model, 0, 2, share=2, in_flight=k, recompute=True))
    assert cost.memory_bytes[st.devices[0]] == pytest.approx(full.total_bytes)
    plain = device_memory(model, 0, 2, share=2, in_flight=k, num_microbatches=4, kind="gpu")
    assert full.runtime_buffer_bytes == plain.runtime_buffer_bytes and k > 1
    assert full.total_bytes < plain.total_bytes


def test_out_of_memory_is_reported():
    c = _chain_cluster(2)
    model = _uniform_model(4, act=3e9)  # 3 GB per sample per layer: two layers x 2 samples > 8 GB
    p = _plan(c, [0, 2, 4], [("n0:0",), ("n1:0",)], 2, 2, "gpipe")
    cost = AnalyticCostModel().breakdown(p, c, model)
    assert not cost.fits and set(cost.shortfall_bytes) == {"n0:0", "n1:0"}
    assert "out of memory on n" in cost.bottleneck


def test_bottleneck_names_the_slow_link():
    c = _chain_cluster(2, wan_bytes_per_s=1e6)
    model = _uniform_model(4, out=1e6)  # 1 MB per sample at 1 MB/s: the link dominates
    p = _plan(c, [0, 2, 4], [("n0:0",), ("n1:0",)], 2, 4, "1f1b")
    est = AnalyticCostModel().estimate(p, c, model)
    assert est.bottleneck.startswith("link n0->n1")
    assert est.iteration_s > 4 * 2.0  # four microbatches of 2 MB at 1 MB/s


def test_boundary_resources_are_shared():
    """Two senders on one node to one receiver on another: one pipe, so bytes add up."""
    c = _chain_cluster(2, per_node=2)
    model = _uniform_model(2, out=1e6)
    p = _plan(c, [0, 1, 2], [("n0:0", "n0:1"), ("n1:0",)], 2, 1, "gpipe")
    cost = AnalyticCostModel().breakdown(p, c, model)
    lat, ser = cost.boundaries[0].forward
    assert ser == pytest.approx(2 * 1e6 / 12.5e6)
    assert lat == pytest.approx(0.01)


def test_share_overlaps_is_the_pairwise_scan():
    rng = random.Random(5)
    for _ in range(300):
        src = [rng.randint(1, 5) for _ in range(rng.randint(1, 7))]
        total = sum(src)
        cuts = sorted(rng.sample(range(1, total), rng.randint(0, total - 1)))
        dst = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        every = [(i, j, max(a_lo, b_lo), min(a_hi, b_hi)) for i, (a_lo, a_hi) in enumerate(share_ranges(src))
                 for j, (b_lo, b_hi) in enumerate(share_ranges(dst)) if max(a_lo, b_lo) < min(a_hi, b_hi)]
        assert share_overlaps(src, dst) == every


def test_allreduce_curve_equals_allreduce_s_bit_for_bit():
    rng = random.Random(11)
    for trial in range(40):
        c = random_cluster(rng) if trial else load_scenario("cee-testbed")
        names = list(c.device_names)
        devs = rng.sample(names, rng.randint(1, len(names)))
        sizes = [0.0, 1.0, *(rng.uniform(1e3, 1e9) for _ in range(4))]
        for sync in ("allreduce-ring", "allreduce-hier", "zero2", "none"):
            assert allreduce_curve_s(c, devs, sizes, sync) == [allreduce_s(c, devs, x, sync) for x in sizes], (trial, sync)


def test_largest_remainder_shares():
    assert largest_remainder_shares("ab", [2.0, 1.0], 6) == (4, 2)
    assert largest_remainder_shares("ab", [10.0, 1.0], 11) == (10, 1)
    assert largest_remainder_shares("abc", [100.0, 1.0, 1.0], 4) == (2, 1, 1)
    assert sum(largest_remainder_shares("abcde", [3.0, 1.0, 1.0, 2.0, 5.0], 17)) == 17
    with pytest.raises(ValueError, match="at least one"):
        largest_remainder_shares("abc", [1.0, 1.0, 1.0], 2)


def test_range_tables_match_direct_terms():
    c, m = load_scenario("local-small"), get_model("gpt2")
    devs = ("edge0:0", "edge0:1")
    shares = largest_remainder_shares(devs, [c.effective_flops_per_s(d) for d in devs], 5)
    rc = RangeTables(c, m, ("allreduce-ring", "allreduce-hier")).costs(devs, shares)
    for a, b in ((0, 3), (2, 14), (5, 6), (0, 14)):
        f, i, w = stage_compute_s(m, c, StagePlan(layer_start=a, layer_stop=b, devices=devs, shares=shares))
        assert rc.compute_s[a, b] == pytest.approx(f + i + w)
        # [Note: planner memory = simulator memory]: plan and runtime terms, 3 microbatches per iteration
        need = max(device_memory(m, a, b, share=x, in_flight=2, num_microbatches=3, kind=c.device(d).kind,
                                 stage_devices=len(devs)).total_bytes - c.memory_bytes(d)
                   for d, x in zip(devs, shares, strict=True))
        assert rc.memory_excess(2, False, 3)[a, b] == pytest.approx(need)
        exact = min(allreduce_s(c, devs, m.gradient_bytes(a, b), s) for s in ("allreduce-ring", "allreduce-hier"))
        assert exact <= rc.allreduce_s[a, b] <= exact * 1.05
    assert np.all(np.triu(rc.optimizer_s) >= 0)
    assert rc.optimizer_s[0, 14] == pytest.approx(max(
        optimizer_step_s(m, 0, 14, c.kind_of(d), c.device(d).slowdown) for d in devs))


# ----------------------------------------------------------------------------- measured profiles


@pytest.mark.parametrize("layers", [1, 2, 3, 7])
def test_range_times_equal_time_s_on_every_range(layers: int):
    """Call overhead once per range, first-stage lines from layer 0, fused B: the range tables are
    ``ModelProfile.time_s`` itself (a per-layer sum would pay the overhead once per layer)."""
    c = _chain_cluster(2)
    gpu = c.kinds["gpu"]
    for model in (measured_model("gpu", layers, seed=layers), _uniform_model(layers)):
        for share, slow in ((1, 1.0), (3, 1.7)):
            for passes in ("F", "I", "W", "B", "FIW"):
                got = range_time_s(model, gpu, passes, share, slow)
                want = np.array([[sum(model.time_s(a, b, p, share, gpu, slow) for p in passes)
                                  for b in range(layers + 1)] for a in range(layers + 1)])
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_range_tables_are_time_s_over_the_range_with_a_measured_profile():
    c, model = _chain_cluster(2), measured_model("gpu", 7)
    gpu = c.kinds["gpu"]
    # the overhead really is paid once: a 3-layer range costs less than its layers one by one
    assert model.time_s(2, 5, "F", 1, gpu) < sum(model.time_s(k, k + 1, "F", 1, gpu) for k in range(2, 5))
    devs = ("n0:0", "n1:0")
    rc = RangeTables(c, model).costs(devs, (3, 2))
    for a in range(7):
        for b in range(a + 1, 8):
            st = StagePlan(layer_start=a, layer_stop=b, devices=devs, shares=(3, 2))
            assert rc.compute_s[a, b] == pytest.approx(sum(stage_compute_s(model, c, st)), rel=1e-12)


@pytest.mark.parametrize("schedule", [*FIXED, "compact"])
def test_measured_one_device_stages_match_the_simulator(schedule: str):
    """gpipe/1f1b run the fused B, zero-bubble ones I and W; every action pays the call overhead once."""
    c = _chain_cluster(3, wan_bytes_per_s=1e8)
    model = measured_model("gpu", 7, seed=1)
    p = _plan(c, [0, 3, 5, 7], [("n0:0",), ("n1:0",), ("n2:0",)], 2, 5, "zb-h1" if schedule == "compact" else schedule)
    if schedule == "compact":
        cost = AnalyticCostModel().breakdown(p, c, model)
        p = compact_plan(p, c, model, cost, RangeTables(c, model))
        assert p is not None and p.actions
    cost = AnalyticCostModel().breakdown(p, c, model)
    sim = SimulatorCostModel().estimate(p, c, model)
    assert cost.iteration_s == pytest.approx(sim.iteration_s, rel=1e-9)
    for s, st in enumerate(p.stages):
        for x, got in zip("FIWB", (cost.forward_s[s], cost.input_grad_s[s], cost.weight_grad_s[s],
                                   cost.backward_s[s]), strict=True):
            assert got == model.time_s(st.layer_start, st.layer_stop, x, 2, c.kinds["gpu"])
    assert all(b < i + w for b, i, w in zip(cost.backward_s, cost.input_grad_s, cost.weight_grad_s, strict=True))


def test_other_layers_count_only_where_the_device_memory_is_the_host_memory():
    """deepcee's runtime builds every layer on the host and moves its stage's to the device."""
    import dataclasses

    from deepcee.profile import DeviceMemory

    model = _uniform_model(4)
    gpu = dataclasses.replace(model, measured_memory={"gpu": DeviceMemory(fixed_bytes=1e8)})
    cpu = dataclasses.replace(model, measured_memory={"gpu": DeviceMemory(fixed_bytes=1e8, host_memory=True)})
    on_device = device_memory(gpu, 0, 2, share=1, in_flight=1, num_microbatches=2, kind="gpu")
    on_host = device_memory(cpu, 0, 2, share=1, in_flight=1, num_microbatches=2, kind="gpu")
    assert on_device.other_layers_bytes == 0
    assert on_host.other_layers_bytes == pytest.approx(model.gradient_bytes(2, 4)) and model.gradient_bytes(2, 4) > 0
    written = DeviceMemory.from_dict({"fixed_bytes": 1.0, "method": "resident set after torch"})
    assert written.host_memory and not DeviceMemory.from_dict({"fixed_bytes": 1.0}).host_memory
    assert DeviceMemory.from_dict(DeviceMemory(fixed_bytes=1.0, host_memory=True).to_dict()).host_memory
