"""The cost model's sample lanes ([Note: sample lanes] in :mod:`deepcee.planner.cost_model`).

Stages that mix fast and slow devices, one sample each: the simulator runs each sample's lane
of devices on its own, so the iteration is the slowest lane's pipeline, not a pipeline of
every stage's slowest device. With one link resource per device pair (nothing shared) the
lanes are independent and the cost model equals the simulator.
"""

from __future__ import annotations

import random

import pytest

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.plan import Plan, StagePlan
from deepcee.planner.cost_model import (
    AnalyticCostModel,
    boundary_cost,
    lane_passes,
    lanes_timing,
    pipeline_timing,
    stage_pass_s,
)
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.passes import lower
from deepcee.schedule.program import lowered_schedule
from deepcee.simulator.engine import simulate
from deepcee.simulator.runtime_model import deepcee_runtime, runtime_for


def _mixed_cluster(num_islands: int) -> Cluster:
    """Per island one fast and one slow single-device node (every device pair its own pipe)."""
    kinds = {k: DeviceKind(name=k, peak_flops_per_s=f, memory_bytes=8e9, achievable_fraction=0.5,
                           per_layer_overhead_s=0.0) for k, f in (("fast", 40e12), ("slow", 10e12))}
    fast = LinkSpec(latency_s=1e-5, bandwidth_bytes_per_s=1e10)
    islands, nodes, devices, links = [], [], [], []
    for i in range(num_islands):
        islands.append(Island(name=f"i{i}", intra=fast))
        for k in ("fast", "slow"):
            nodes.append(Node(name=f"{k}{i}", island=f"i{i}", kind=k, devices=(f"{k}{i}:0",), intra=fast))
            devices.append(Device(name=f"{k}{i}:0", kind=k, node=f"{k}{i}", island=f"i{i}"))
    for i in range(num_islands):
        for j in range(i + 1, num_islands):
            links.append(LinkEntry(a=f"i{i}", b=f"i{j}", spec=LinkSpec(latency_s=0.01, bandwidth_bytes_per_s=5e7)))
    return Cluster(name="mixed", kinds=kinds, islands=tuple(islands), nodes=tuple(nodes), devices=tuple(devices),
                   links=tuple(links))


def _model(layers: int) -> ModelProfile:
    return ModelProfile(name="uniform", input_bytes=1e5, layers=tuple(
        LayerProfile(name=f"l{k}", forward_flops=2e10, input_grad_flops=2e10, weight_grad_flops=2e10,
                     parameter_count=1000, activation_bytes=1e6, output_bytes=1e5) for k in range(layers)))


def _alternating_plan(stages: int, m: int, schedule: str) -> Plan:
    """Sample 0 runs fast, slow, fast, ...; sample 1 slow, fast, slow, ... (one sample per device)."""
    st = []
    for s in range(stages):
        order = ("fast", "slow") if s % 2 == 0 else ("slow", "fast")
        st.append(StagePlan(layer_start=2 * s, layer_stop=2 * s + 2, devices=tuple(f"{k}{s}:0" for k in order),
                            shares=(1, 1)))
    return Plan(system="t", cluster="mixed", model="uniform", global_batch=2 * m, microbatch_size=2,
                num_microbatches=m, stages=tuple(st), schedule=schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_independent_lanes_equal_the_simulator(schedule: str):
    cluster, model = _mixed_cluster(4), _model(8)
    plan = _alternating_plan(4, 6, schedule)
    cost = AnalyticCostModel().breakdown(plan, cluster, model)
    sim = simulate(plan, cluster, model, record=False)
    assert cost.iteration_s == pytest.approx(sim.iteration_s, rel=1e-9)
    assert cost.pipeline.makespan_s == pytest.approx(sim.pipeline_s, rel=1e-9)
    # a pipeline of every stage's slowest device (the model before lanes) is pessimistic here
    f, i, w, b = zip(*(stage_pass_s(model, cluster, st) for st in plan.stages), strict=True)
    bounds = [(x.forward, x.backward) for x in cost.boundaries]
    slowest = pipeline_timing(lowered_schedule(plan), f, i, w, [x[0] for x in bounds], [x[1] for x in bounds], b,
                              num_microbatches=plan.num_microbatches, runtime=runtime_for(cluster, model))
    assert slowest.makespan_s > cost.pipeline.makespan_s * 1.01


def test_lanes_are_the_undominated_ones():
    cluster, model = _mixed_cluster(3), _model(6)
    # two lanes, neither at least the other everywhere: both timed
    assert len(lane_passes(_alternating_plan(3, 2, "1f1b"), cluster, model)) == 2
    # the same kinds in every stage: the slow lane dominates the fast one, one pipeline left
    st = tuple(StagePlan(layer_start=2 * s, layer_stop=2 * s + 2, devices=(f"fast{s}:0", f"slow{s}:0"), shares=(1, 1))
               for s in range(3))
    plan = _alternating_plan(3, 2, "1f1b").replace(stages=st)
    lanes = lane_passes(plan, cluster, model)
    assert lanes == [(tuple(stage_pass_s(model, cluster, s) for s in st), 0.0)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("runtime", ["cpu", "cuda"])
def test_lanes_at_once_are_the_interpreter_bit_for_bit(schedule: str, runtime: str):
    # several lanes timed together equal each lane timed by the interpreter, stage by stage
    rng = random.Random(schedule + runtime)
    rt = deepcee_runtime("realnet", device=runtime)
    for _ in range(20):
        s, m = rng.randint(2, 5), rng.randint(1, 8)
        lanes = [tuple(tuple(rng.uniform(0.1, 2) for _ in range(4)) for _ in range(s)) for _ in range(rng.randint(2, 4))]
        cf = [(rng.uniform(-0.5, 1), rng.uniform(0, 1)) for _ in range(s - 1)]
        cb = [(rng.uniform(-0.5, 1), rng.uniform(0, 1)) for _ in range(s - 1)]
        low = lower(build_schedule(schedule, s, m))
        got = lanes_timing(low, [(lane, 0.0) for lane in lanes], cf, cb, num_microbatches=m, runtime=rt)
        each = [pipeline_timing(low, *(tuple(p[k] for p in lane) for k in range(3)), cf, cb, tuple(p[3] for p in lane),
                                num_microbatches=m, runtime=rt) for lane in lanes]
        assert got.stage_end_s == tuple(map(max, *(t.stage_end_s for t in each)))
        assert got.busy_s == pytest.approx(tuple(map(max, *(t.busy_s for t in each))), rel=1e-12)


def test_a_lane_behind_another_on_a_shared_pipe_starts_late_by_its_piece():
    # two 2-device nodes in two islands: both samples cross one pipe each way, the second
    # device's piece after the first's ([Note: pipe lag] in deepcee.planner.lanes)
    kinds = {"gpu": DeviceKind(name="gpu", peak_flops_per_s=10e12, memory_bytes=8e9, achievable_fraction=0.5,
                               per_layer_overhead_s=0.0)}
    fast = LinkSpec(latency_s=1e-5, bandwidth_bytes_per_s=1e10)
    wan = LinkSpec(latency_s=0.01, bandwidth_bytes_per_s=5e7)
    cluster = Cluster(name="pair", kinds=kinds, islands=(Island(name="i0", intra=fast), Island(name="i1", intra=fast)),
                      nodes=tuple(Node(name=f"n{i}", island=f"i{i}", kind="gpu", devices=(f"n{i}:0", f"n{i}:1"),
                                       intra=fast) for i in range(2)),
                      devices=tuple(Device(name=f"n{i}:{k}", kind="gpu", node=f"n{i}", island=f"i{i}")
                                    for i in range(2) for k in range(2)),
                      links=(LinkEntry(a="i0", b="i1", spec=wan),))
    model = _model(4)
    plan = Plan(system="t", cluster="pair", model="uniform", global_batch=8, microbatch_size=2, num_microbatches=4,
                stages=tuple(StagePlan(layer_start=2 * s, layer_stop=2 * s + 2, devices=(f"n{s}:0", f"n{s}:1"),
                                       shares=(1, 1)) for s in range(2)), schedule="1f1b")
    piece_s = model.boundary_bytes(2) / 5e7
    bound = boundary_cost(cluster, *plan.stages, model.boundary_bytes(2))
    assert bound.ahead == {(0, 1, 1): piece_s, (1, 1, 1): piece_s}
    assert sorted(lag for _, lag in lane_passes(plan, cluster, model)) == [piece_s]
