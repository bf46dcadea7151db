"""Grouping from measurements: a measured cluster built from synthetic probes and link fits
(one declared island, so only the measured links can separate devices) recovers the hidden
islands and speed groups exactly, and the explanation states each cut."""

from __future__ import annotations

import numpy as np
import pytest
from test_profiler_model import synthetic_probe

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkSpec, Node
from deepcee.models import get_model
from deepcee.planner.grouping import group_devices
from deepcee.profiler.model import measured_profile
from deepcee.profiler.network import LinkFit
from deepcee.profiler.run import groups_text, measured_cluster

LAN = LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)
# hidden truth: island -> nodes -> per-device speed factor (time multiplier)
TRUTH = {"dc": {"dc0": [1.0, 1.0], "dc1": [1.0, 1.05]}, "site": {"site0": [1.0, 3.0]}, "phone": {"ph0": [2.0]}}
WAN = {frozenset({"dc", "site"}): (20e-3, 12.5e6), frozenset({"dc", "phone"}): (40e-3, 12.5e6),
       frozenset({"site", "phone"}): (30e-3, 6.25e6)}


def _declared() -> Cluster:
    kinds = {"cpu-worker": DeviceKind(name="cpu-worker", peak_flops_per_s=5e10, memory_bytes=2**31)}
    nodes, devices = [], []
    for nodes_of in TRUTH.values():
        for node, factors in nodes_of.items():
            names = tuple(f"{node}:{k}" for k in range(len(factors)))
            nodes.append(Node(name=node, island="everywhere", kind="cpu-worker", devices=names, intra=LAN))
            devices += [Device(name=d, kind="cpu-worker", node=node, island="everywhere") for d in names]
    return Cluster(name="hidden", kinds=kinds, islands=(Island(name="everywhere", intra=LAN),), nodes=tuple(nodes),
                   devices=tuple(devices))


def _fits(cluster: Cluster, rng: np.random.Generator) -> list[LinkFit]:
    island = {f"{n}:{k}": isl for isl, ns in TRUTH.items() for n, fs in ns.items() for k in range(len(fs))}
    out = []
    for s in cluster.device_names:
        for d in cluster.device_names:
            if s == d:
                continue
            lat, bw = (0.3e-3, 1.0e9) if island[s] == island[d] else WAN[frozenset({island[s], island[d]})]
            lat *= 1 + 0.05 * rng.standard_normal()  # measurement noise
            bw *= 1 + 0.05 * rng.standard_normal()
            out.append(LinkFit(src=s, dst=d, latency_s=lat, bandwidth_bytes_per_s=bw, bandwidth_resolved=True,
                               latency_range_s=(lat, lat), bandwidth_range_bytes_per_s=(bw, bw),
                               residual_iqr_fraction=0.01, sizes_bytes=(16, 1024), median_round_trip_s=(0, 0),
                               messages=10, bytes_sent=1, seconds=1))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouping_on_a_measured_cluster_recovers_the_hidden_islands(seed):
    declared = _declared()
    probes = [synthetic_probe(d, f) for ns in TRUTH.values() for n, fs in ns.items() for d, f in
              zip((f"{n}:{k}" for k in range(len(fs))), fs, strict=True)]
    profile = measured_profile(get_model("gpt-tiny"), probes, source="synthetic")
    measured = measured_cluster(declared, probes, _fits(declared, np.random.default_rng(seed)), "all", profile,
                                emulated=True)
    assert measured.device("site0:1").slowdown == pytest.approx(3.0)
    g = group_devices(measured)
    assert [set(i.devices) for i in g.islands] == [
        {"dc0:0", "dc0:1", "dc1:0", "dc1:1"}, {"site0:0", "site0:1"}, {"ph0:0"}]
    assert [i.name for i in g.islands] == ["everywhere", "everywhere.2", "everywhere.3"]
    # speed groups: dc all within 1.05x -> one group; site 1x vs 3x -> two groups
    assert [len(i.groups) for i in g.islands] == [1, 2, 1]
    assert g.island("everywhere.2").groups[1].devices == ("site0:1",)
    text = groups_text(g)
    assert text.count("islands everywhere") == 3  # one cut line per pair of islands
    assert "3.00x > 1.5x" in text and "Mbit/s" in text
    assert "measured by deepcee profile" in measured.emulation
