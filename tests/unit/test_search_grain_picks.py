"""Which island keeps one device per stage when the stages must be cut to the layers ([Note: mixed
granularity] in deepcee.planner.grains): the fast one, not the one with the least memory."""

from __future__ import annotations

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.planner.search import PlannerOptions, plan_training
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.simulator.engine import simulate
from deepcee.units import GIB

FAST = LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)
NVLINK = LinkSpec(latency_s=5e-6, bandwidth_bytes_per_s=12.5e9)
WAN = LinkSpec(latency_s=0.01, bandwidth_bytes_per_s=1e9)


def _cluster() -> Cluster:
    """Three islands of 4 devices on one node each, every device holding one layer's state (not
    two): ``slow`` (10 TFLOP/s, least memory), ``fast`` (20 TFLOP/s), ``mid`` (15 TFLOP/s, most memory)."""
    spec = {"slow": (10e12, 2.6), "fast": (20e12, 2.8), "mid": (15e12, 3.0)}
    kinds = {k: DeviceKind(name=k, peak_flops_per_s=f, memory_bytes=g * GIB) for k, (f, g) in spec.items()}
    nodes = tuple(Node(name=f"{k}0", island=k, kind=k, devices=tuple(f"{k}0:{j}" for j in range(4)), intra=NVLINK)
                  for k in spec)
    devices = tuple(Device(name=d, kind=n.kind, node=n.name, island=n.island) for n in nodes for d in n.devices)
    return Cluster(name="picks", kinds=kinds, islands=tuple(Island(name=k, intra=FAST) for k in spec), nodes=nodes,
                   devices=devices, links=(LinkEntry(a="slow", b="fast", spec=WAN), LinkEntry(a="fast", b="mid", spec=WAN),
                                           LinkEntry(a="slow", b="mid", spec=WAN)))


def _model(layers: int) -> ModelProfile:
    return ModelProfile(name="toy", input_bytes=1e5, layers=tuple(
        LayerProfile(name=f"l{k}", forward_flops=2e11, input_grad_flops=2e11, weight_grad_flops=2e11,
                     parameter_count=100_000_000, activation_bytes=1e6, output_bytes=1e5) for k in range(layers)))


def test_the_fast_island_keeps_one_device_per_stage() -> None:
    """8 layers, one per stage: one device per stage everywhere is 12 stages, two everywhere holds
    6 layers. One island must keep one device per stage: the fast one makes every stage as fast
    as two slow devices; the slow one (kept fine by coarsening the most memory first, and
    unreachable from there by one island's step alone) halves the pipeline's speed."""
    c, m = _cluster(), _model(8)
    plan = plan_training(c, m, 16, options=PlannerOptions(allow_exclusion=False, explain_counterfactuals=False)).plan
    sizes = {c.device(st.devices[0]).island: len(st.devices) for st in plan.stages}
    assert sizes == {"slow": 2, "fast": 1, "mid": 2}
    sim = simulate(plan, c, m, record=False)
    assert all(b <= c.memory_bytes(d) for d, b in sim.peak_memory_bytes.items())
