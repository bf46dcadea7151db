"""The closed form's neighbour cycle ([Note: neighbour cycle] in deepcee.planner.split): in a
fixed schedule only ``k_s - k_{s+1} + 1`` microbatches circulate between two neighbouring stages,
so over a link with a long round trip that cycle, not the link's bytes or the stages' compute,
sets the pace; and what one receiving device waits for at a boundary (``pair_trip``)."""

from __future__ import annotations

import pytest

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.planner.search import PlannerOptions, new_search
from deepcee.planner.space import StageLayout, build_plan, schedule_in_flight
from deepcee.planner.split import boundary_arrays
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.simulator import simulate
from deepcee.units import GIB

FAST = LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e10)
FAR = LinkSpec(latency_s=0.1, bandwidth_bytes_per_s=5e7)  # 100 ms, 400 Mbit/s
BATCH = 64


def _cluster() -> Cluster:
    """Islands ``a`` and ``b``: two devices on one node each; 100 ms between them."""
    kind = DeviceKind(name="g", peak_flops_per_s=20e12, memory_bytes=16 * GIB)
    nodes = (Node(name="a0", island="a", kind="g", devices=("a0:0", "a0:1"), intra=FAST),
             Node(name="b0", island="b", kind="g", devices=("b0:0", "b0:1"), intra=FAST))
    devices = tuple(Device(name=d, kind="g", node=n.name, island=n.island) for n in nodes for d in n.devices)
    return Cluster(name="two-sites", kinds={"g": kind}, islands=(Island(name="a", intra=FAST), Island(name="b", intra=FAST)),
                   nodes=nodes, devices=devices, links=(LinkEntry(a="a", b="b", spec=FAR),))


def _model() -> ModelProfile:
    return ModelProfile(name="toy", input_bytes=1e5, layers=tuple(
        LayerProfile(name=f"l{k}", forward_flops=1e10, input_grad_flops=1e10, weight_grad_flops=1e10,
                     parameter_count=1_000_000, activation_bytes=1e6, output_bytes=5e5) for k in range(8)))


LAYOUT = StageLayout(slots=(("a0:0",), ("a0:1",), ("b0:0",), ("b0:1",)), islands=(), label="a > b")
SPLIT = (0, 2, 4, 6, 8)
"""Four stages, the slow link between the second and the third: in a two-stage pipeline the
first stage's own in-flight limit (its round trip through the rest over its ``k_0``
microbatches) already is that cycle."""


@pytest.mark.parametrize("sched", ["1f1b", "zb-h1", "zb-h2"])
def test_the_closed_form_counts_the_cycle_between_neighbours_over_a_slow_link(sched: str) -> None:
    cluster, model = _cluster(), _model()
    search = new_search(cluster, model, BATCH, PlannerOptions())
    n = 2
    tab = search.dp_inputs(LAYOUT, n)
    in_flight = schedule_in_flight(sched, 4, tab.m)
    flags = (False,) * 4
    fused = sched == "1f1b"
    closed = tab.closed_form(SPLIT, tab.loads(in_flight), in_flight, fused=fused, flags=flags)
    plan = build_plan(LAYOUT, SPLIT, cluster=cluster, model=model, global_batch=BATCH, microbatch_size=n,
                      schedule=sched, sync="allreduce-ring", recompute=flags)
    sim = simulate(plan, cluster, model, record=False).iteration_s
    # without the cycle, the largest other term (a stage's compute, its in-flight limit, the
    # link's bytes) and one microbatch through everything else fall far short of the simulated time
    holds, caps = tab.holds(SPLIT, flags, fused), tab.caps_at(SPLIT, flags, in_flight)
    terms = [tab.costs[s].base_load(tab.m, False).item(SPLIT[s], SPLIT[s + 1]) for s in range(4)]
    terms += [tab.m * h / k for h, k in zip(holds, caps, strict=True)]
    terms += [tab.link_loads()[s].item(SPLIT[s]) for s in range(1, 4)]
    fill = sum(tab.costs[s].compute_with(False).item(SPLIT[s], SPLIT[s + 1]) for s in range(4)) \
        + sum(tab.fills()[s].item(SPLIT[s]) for s in range(1, 4))
    assert max(terms) + fill < 0.8 * sim
    assert closed == pytest.approx(sim, rel=0.08)


def test_a_receiving_device_waits_for_every_share_it_takes_over_one_pipe() -> None:
    """Two devices of ``a`` (one sample each) send to the one device of ``b`` (two samples) over
    the one a-b pipe: forward, ``b0:0`` waits for both shares; backward, each device of ``a``
    for its own."""
    cluster, model = _cluster(), _model()
    search = new_search(cluster, model, BATCH, PlannerOptions())
    got = boundary_arrays(cluster, search.tables, ("a0:0", "a0:1"), (1, 1), ("b0:0",), (2,))
    per_sample = search.tables.boundary_bytes / FAR.bandwidth_bytes_per_s
    want = (FAR.latency_s + 2 * per_sample) + (FAR.latency_s + per_sample)
    assert got.pair_trip == pytest.approx(want, rel=1e-12)
    # the boundary's own serialisation is both shares, each way
    assert got.ser_f == pytest.approx(2 * per_sample, rel=1e-12)
    assert got.ser_b == pytest.approx(2 * per_sample, rel=1e-12)
