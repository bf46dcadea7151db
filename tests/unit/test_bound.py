"""The upper bound: exact on trivial clusters, equal to a brute-force closed form, never beaten."""

from __future__ import annotations

import itertools
import random

import pytest
from conftest import measured_model, random_cluster, toy_model

from deepcee.cluster import Cluster, cluster_from_toml_dict
from deepcee.errors import InfeasiblePlanError
from deepcee.plan import Plan, StagePlan
from deepcee.planner.bound import _islands, _topology, cut_bytes_per_sample, upper_bound
from deepcee.profile import ModelProfile
from deepcee.scenarios import load_scenario
from deepcee.simulator.engine import simulate

GIB = 1024**3


def closed_form(cluster: Cluster, model: ModelProfile, batch: int) -> float:
    """Reference: every LP constraint is a bound on one variable, so T has a closed form."""
    islands = _islands(cluster)
    topo = _topology(cluster, model, batch, islands)
    c_min, _ = cut_bytes_per_sample(model, batch)
    state = model.state_bytes(0, model.num_layers)
    best = 0.0
    for r in range(1, len(islands) + 1):
        for s in itertools.combinations(islands, r):
            nodes = [n for i in s for n in topo.nodes_of[i]]
            if sum(topo.memory_bytes[n] for n in nodes) < state:
                continue
            total = sum(topo.capacity[n] for n in nodes)
            if len(s) > 1:
                for i in s:
                    rest = [m for j in s if j != i for m in topo.nodes_of[j]]
                    total = min(total, topo.bandwidth(topo.nodes_of[i], rest) / c_min)
            best = max(best, total)
    return best


def one_device_cluster() -> Cluster:
    return cluster_from_toml_dict({
        "name": "one",
        "kinds": {"k": {"peak_tflops": 20.0, "memory_gib": 16.0, "achievable_fraction": 0.5}},
        "islands": {"a": {"latency_us": 10, "bandwidth_gbit_per_s": 10}},
        "nodes": [{"name": "n", "island": "a", "kind": "k", "devices": 1, "slowdown": 2.0}],
    })


def test_single_device_bound_is_effective_flops_over_flops_per_sample() -> None:
    c, m = one_device_cluster(), toy_model()
    b = upper_bound(c, m, 32)
    assert b.samples_per_s == pytest.approx(c.effective_flops_per_s("n:0") / m.flops_per_sample(), rel=1e-9)
    assert b.samples_per_s == pytest.approx(20e12 * 0.5 / 2.0 / (6 * 3e9), rel=1e-9)
    assert b.islands == ("a",)
    assert b.binding.startswith("compute")
    assert any("no per-layer overheads" in line for line in b.derivation)


def test_bound_matches_closed_form_on_random_clusters() -> None:
    rng = random.Random(7)
    for trial in range(25):
        c = random_cluster(rng, f"rand{trial}")
        m = toy_model(rng.randint(1, 8), params=rng.choice([1_000_000, 30_000_000, 200_000_000]),
                      out=rng.choice([1e4, 1e6, 1e7]))
        batch = rng.choice([8, 64, 512])
        try:
            b = upper_bound(c, m, batch)
        except InfeasiblePlanError:
            assert closed_form(c, m, batch) == 0.0
            continue
        assert b.samples_per_s == pytest.approx(closed_form(c, m, batch), rel=1e-6), trial


def test_slow_link_keeps_the_bound_on_the_fast_island() -> None:
    c, m = load_scenario("cee-testbed"), toy_model(12, out=8e6, flops=3e10)
    b = upper_bound(c, m, 128)
    per_device = c.effective_flops_per_s("cloud0:0") / m.flops_per_sample()
    # the 100 Mbit/s links make any set with cloud and another island slower than cloud alone
    assert b.islands == ("cloud",)
    assert b.samples_per_s == pytest.approx(8 * per_device, rel=1e-9)
    fast = upper_bound(load_scenario("cee-testbed-500m"), toy_model(12, out=1e4, flops=3e10), 128)
    assert fast.samples_per_s == pytest.approx(15 * per_device, rel=1e-9)
    assert set(fast.islands) == {"cloud", "edge", "end"}


def two_islands(link_mbit_per_s: float) -> Cluster:
    return cluster_from_toml_dict({
        "name": "two",
        "kinds": {"k": {"peak_tflops": 10.0, "memory_gib": 16.0, "achievable_fraction": 0.5}},
        "islands": {"a": {"latency_us": 10, "bandwidth_gbit_per_s": 10},
                    "b": {"latency_us": 10, "bandwidth_gbit_per_s": 10}},
        "nodes": [{"name": "na", "island": "a", "kind": "k", "devices": 2},
                  {"name": "nb", "island": "b", "kind": "k", "devices": 2}],
        "links": [{"between": ["a", "b"], "latency_ms": 10, "bandwidth_mbit_per_s": link_mbit_per_s}],
    })


def test_island_cut_binds_and_is_named() -> None:
    # 10 samples/s per device; c_min = 2 x 0.5 MB; the 100 Mbit/s pipe both ways carries 25 samples/s
    m = toy_model(5, flops=1e11, out=5e5)
    assert cut_bytes_per_sample(m, 32)[0] == pytest.approx(1e6)
    b = upper_bound(two_islands(100), m, 32)
    assert b.samples_per_s == pytest.approx(25.0)
    assert b.islands == ("a", "b")
    assert b.binding.startswith("island cut")
    slow = upper_bound(two_islands(10), m, 32)  # 2.5 samples/s over the cut: one island alone wins
    assert slow.samples_per_s == pytest.approx(20.0)
    assert slow.islands == ("a",)


def test_memory_skips_sets_that_cannot_hold_the_state() -> None:
    c = load_scenario("cee-testbed")
    # 16 B/parameter x 6 x 1e9 = 96 GB: more than a 4-GPU node (88 GiB), less than the cloud island
    m = toy_model(6, params=1_000_000_000)
    b = upper_bound(c, m, 128)
    assert "cloud" in b.islands
    huge = toy_model(6, params=10_000_000_000)  # 960 GB > 330 GiB of all devices
    with pytest.raises(InfeasiblePlanError, match="state needs"):
        upper_bound(c, huge, 128)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_measured_bound_holds_for_fused_backward_and_first_stage_lines(schedule: str) -> None:
    """A whole-model stage runs first-stage lines and (gpipe) the fused B, both cheaper than the
    layers' own F + I + W: the bound takes the cheapest per layer and stays above the simulation."""
    c, m = one_device_cluster(), measured_model("k", 4)
    # every line has a positive fixed part, so time per sample is least at the largest share
    least = sum(min(v.time_s("F", 32) + min(v.time_s("B", 32), v.time_s("I", 32) + v.time_s("W", 32))
                    for v in (t, t.first_stage)) for t in m.measured["k"]) / 32
    b = upper_bound(c, m, 32)
    assert b.samples_per_s == pytest.approx(1.0 / (2.0 * least), rel=1e-9)  # slowdown 2
    plan = Plan(system="t", cluster=c.name, model=m.name, global_batch=32, microbatch_size=32, num_microbatches=1,
                stages=(StagePlan(layer_start=0, layer_stop=4, devices=("n:0",), shares=(32,)),), schedule=schedule)
    assert simulate(plan, c, m, record=False).samples_per_s <= b.samples_per_s
