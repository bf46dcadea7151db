"""Two-level grouping: islands recovered from link costs, groups from device speeds."""

from __future__ import annotations

import pytest

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.errors import ClusterSpecError
from deepcee.planner.grouping import group_devices
from deepcee.scenarios import load_scenario

FAST = LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)  # 10 Gbit/s
NVLINK = LinkSpec(latency_s=5e-6, bandwidth_bytes_per_s=12.5e9)
WAN = LinkSpec(latency_s=20e-3, bandwidth_bytes_per_s=12.5e6)  # 100 Mbit/s


def _cluster(layout: dict[str, list[tuple[str, list[float]]]], *, declared: str | None = None,
             links: tuple[LinkEntry, ...] | None = None) -> Cluster:
    """``layout``: island -> [(node, [slowdown per device])]. ``declared`` puts every node in one
    declared island (so only measured links can separate them)."""
    kinds = {"gpu": DeviceKind(name="gpu", peak_flops_per_s=100e12, memory_bytes=16e9)}
    islands, nodes, devices = [], [], []
    for isl, node_list in layout.items():
        islands.append(Island(name=isl, intra=FAST))
        for node, slows in node_list:
            names = tuple(f"{node}:{k}" for k in range(len(slows)))
            nodes.append(Node(name=node, island=declared or isl, kind="gpu", devices=names, intra=NVLINK))
            devices += [Device(name=n, kind="gpu", node=node, island=declared or isl, slowdown=s)
                        for n, s in zip(names, slows, strict=True)]
    if declared:
        islands = [Island(name=declared, intra=FAST)]
    return Cluster(name="t", kinds=kinds, islands=tuple(islands), nodes=tuple(nodes), devices=tuple(devices),
                   links=links if links is not None else ())


def test_cee_testbed_islands_are_cloud_edge_end():
    g = group_devices(load_scenario("cee-testbed"))
    assert [i.name for i in g.islands] == ["cloud", "edge", "end"]
    assert g.island("cloud").devices == tuple(f"cloud{n}:{k}" for n in range(2) for k in range(4))
    assert g.island("edge").devices == ("edge0:0", "edge0:1", "edge1:0", "edge1:1")
    assert g.island("end").devices == ("end0:0", "end1:0", "end2:0")
    assert all(len(i.groups) == 1 for i in g.islands)  # all RTX 3090


def test_islands_recovered_from_links_alone():
    """Nodes all declare one island; only node-to-node link entries say who is close."""
    layout = {"a": [("a0", [1, 1]), ("a1", [1, 1])], "b": [("b0", [1])], "c": [("c0", [1, 1]), ("c1", [1])]}
    links = []
    groups = {"a": ["a0", "a1"], "b": ["b0"], "c": ["c0", "c1"]}
    flat = [(isl, n) for isl, ns in groups.items() for n in ns]
    for i, (ia, na) in enumerate(flat):
        for ib, nb in flat[i + 1:]:
            links.append(LinkEntry(a=na, b=nb, spec=FAST if ia == ib else WAN))
    c = _cluster(layout, declared="all", links=tuple(links))
    g = group_devices(c)
    assert [set(i.devices) for i in g.islands] == [
        {"a0:0", "a0:1", "a1:0", "a1:1"}, {"b0:0"}, {"c0:0", "c0:1", "c1:0"}]
    assert [i.name for i in g.islands] == ["all", "all.2", "all.3"]
    assert any("100 Mbit/s" in line for line in g.explain())


def test_groups_split_by_speed_inside_an_island():
    c = _cluster({"x": [("n0", [1.0, 1.0]), ("n1", [1.2, 3.0]), ("n2", [3.3])]})
    g = group_devices(c)
    assert len(g.islands) == 1
    assert [grp.devices for grp in g.islands[0].groups] == [("n0:0", "n0:1", "n1:0"), ("n1:1", "n2:0")]
    assert [grp.name for grp in g.groups] == ["x/g0", "x/g1"]
    cut = [line for line in g.explain() if "g0 | g1" in line]
    assert len(cut) == 1 and "2.50x" in cut[0]


def test_slow_drift_does_not_chain_into_one_group():
    c = _cluster({"x": [("n0", [1.0, 1.3, 1.69, 2.2, 2.86])]})
    g = group_devices(c, speed_ratio=1.5)
    for grp in g.groups:
        assert max(grp.flops_per_s) / min(grp.flops_per_s) <= 1.5 + 1e-9


def test_threshold_merges_and_splits():
    c = load_scenario("cee-testbed")
    # 20 ms per MB merges edge and end (1 Gbit/s at 5 ms = 13 ms per MB), not cloud
    assert [i.name for i in group_devices(c, island_threshold_s=20e-3).islands] == ["cloud", "edge"]
    # 1 s per MB merges everything
    assert len(group_devices(c, island_threshold_s=1.0).islands) == 1


def test_deterministic():
    c = load_scenario("scale-16")
    a, b = group_devices(c), group_devices(c)
    assert a == b and a.explain() == b.explain()


def test_device_level_links_split_a_node():
    layout = {"x": [("n0", [1, 1]), ("n1", [1])]}
    slow = LinkEntry(a="n0:1", b="n1:0", spec=WAN)
    slow2 = LinkEntry(a="n0:1", b="n0:0", spec=WAN)
    g = group_devices(_cluster(layout, links=(slow, slow2)))
    assert [i.devices for i in g.islands] == [("n0:0", "n1:0"), ("n0:1",)]


def test_bad_arguments():
    c = load_scenario("local-small")
    with pytest.raises(ClusterSpecError, match="island_threshold_s"):
        group_devices(c, island_threshold_s=0)
    with pytest.raises(ClusterSpecError, match="speed_ratio"):
        group_devices(c, speed_ratio=0.5)
