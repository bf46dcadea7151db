"""Cluster files: strict validation with one-line errors naming file, field and value."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepcee.cluster import cluster_from_dict, load_cluster
from deepcee.errors import ClusterSpecError
from deepcee.scenarios import load_scenario, scenario_names

GOOD = """
name = "t"
[kinds.k]
peak_tflops = 10
memory_gib = 8
[islands.a]
latency_us = 10
bandwidth_gbit_per_s = 10
[islands.b]
latency_us = 10
bandwidth_gbit_per_s = 10
[[nodes]]
name = "n0"
island = "a"
kind = "k"
devices = 2
[[nodes]]
name = "n1"
island = "b"
kind = "k"
devices = 1
slowdown = 2.0
[[links]]
between = ["a", "b"]
latency_ms = 20
bandwidth_mbit_per_s = 100
"""

HOP_TO_C = """
[islands.c]
latency_us = 10
bandwidth_gbit_per_s = 10
[[nodes]]
name = "n2"
island = "c"
kind = "k"
devices = 1
[[links]]
between = ["b", "c"]
latency_ms = 5
bandwidth_mbit_per_s = 50
"""
"""Island ``c`` (one device), reached from ``a`` only through ``b``."""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return p


def test_good_cluster_resolves_links(tmp_path: Path) -> None:
    c = load_cluster(write(tmp_path, GOOD))
    assert c.device_names == ("n0:0", "n0:1", "n1:0")
    cross = c.link("n0:0", "n1:0")
    assert cross.latency_s == pytest.approx(0.02)
    assert cross.bandwidth_bytes_per_s == pytest.approx(12.5e6)
    assert cross.resource == "n0->n1"
    # devices of one node share the node-pair pipe; inside a node each pair has its own
    assert c.link("n0:1", "n1:0").resource == cross.resource
    assert c.link("n0:0", "n0:1").resource == "n0:0->n0:1"
    assert c.effective_flops_per_s("n1:0") == pytest.approx(10e12 * 0.4 / 2.0)
    assert cross.transfer_time_s(12.5e6) == pytest.approx(1.02)


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        ("devices = 2", "devices = 2\ncolour = 3", "nodes[0].colour: unknown key"),
        ("peak_tflops = 10", "peak_tflops = -10", "kinds.k.peak_tflops: must be in (0, 1,000,000] TFLOP/s, got -10"),
        ("latency_ms = 20", "", "links[0].latency_*: missing required value"),
        ('kind = "k"\ndevices = 1', 'kind = "zz"\ndevices = 1', "nodes[1].kind: unknown name 'zz' (known: k)"),
        ("bandwidth_mbit_per_s = 100", "bandwidth_mbit_per_s = 0", "bandwidth_mbit_per_s: must be in [0.001, 1,000,000,000] Mbit/s, got 0"),
        ("slowdown = 2.0", "slowdown = [1.0, 2.0]", "slowdown: needs 1 values"),
        ('between = ["a", "b"]', 'between = ["a", "c"]', "links[0].between: link end 'c' names no island, node or device"),
    ],
)
def test_bad_cluster_names_field_and_value(tmp_path: Path, old: str, new: str, needle: str) -> None:
    p = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(ClusterSpecError) as info:
        load_cluster(p)
    msg = str(info.value)
    assert str(p) in msg and needle in msg
    assert "\n" not in msg


def test_no_path_between_islands(tmp_path: Path) -> None:
    text = GOOD.split("[[links]]")[0]
    with pytest.raises(ClusterSpecError, match=r"no path between devices 'n0:0' \(island 'a'\) and 'n1:0'"):
        load_cluster(write(tmp_path, text))


def test_multi_hop_route_takes_narrowest_hop(tmp_path: Path) -> None:
    c = load_cluster(write(tmp_path, GOOD + HOP_TO_C))
    link = c.link("n0:0", "n2:0")
    assert link.latency_s == pytest.approx(0.025)
    assert link.bandwidth_bytes_per_s == pytest.approx(50e6 / 8)
    assert link.resource == "b->c"


def test_a_subset_keeps_routes_through_islands_it_leaves_without_devices(tmp_path: Path) -> None:
    """a reaches c only through b: the cluster without b's devices resolves a -> c as the full
    one does (it raised "no path" when the relaxed search planned a replica on a and c alone),
    and an island without devices can be a route's hop in a cluster file too."""
    full = load_cluster(write(tmp_path, GOOD + HOP_TO_C))
    sub = full.subset(["n0:0", "n0:1", "n2:0"])
    assert sub.device_names == ("n0:0", "n0:1", "n2:0")
    assert sub.link("n0:0", "n2:0") == full.link("n0:0", "n2:0")
    assert sub.view_key(sub.device_names) == full.view_key(sub.device_names)
    transit = GOOD.replace('[[nodes]]\nname = "n1"\nisland = "b"\nkind = "k"\ndevices = 1\nslowdown = 2.0\n', "")
    c = load_cluster(write(tmp_path, transit + HOP_TO_C))
    assert c.device_names == ("n0:0", "n0:1", "n2:0")
    assert c.link("n0:0", "n2:0").latency_s == pytest.approx(0.025)
    assert c.link("n0:0", "n2:0").resource == "b->c"


def test_most_specific_entry_wins_and_directed_entries_go_one_way(tmp_path: Path) -> None:
    text = GOOD + """
[[links]]
between = ["n0:1", "n1:0"]
directed = true
latency_ms = 1
bandwidth_mbit_per_s = 1000
"""
    c = load_cluster(write(tmp_path, text))
    fwd, back = c.link("n0:1", "n1:0"), c.link("n1:0", "n0:1")
    assert (fwd.latency_s, fwd.bandwidth_bytes_per_s) == (pytest.approx(0.001), pytest.approx(125e6))
    assert back.latency_s == pytest.approx(0.02)  # the island entry: the device entry is directed
    assert c.link("n0:0", "n1:0").latency_s == pytest.approx(0.02)
    assert fwd.resource == "n0->n1"  # still the node pair's pipe
    index = c._index
    assert index.island_routes == {("a", "b"): ("a", "b"), ("b", "a"): ("b", "a")}
    assert [index.order[d] for d in c.device_names] == [(0, "n0", 0), (0, "n0", 1), (1, "n1", 2)]
    assert set(index.resolved) == {("n0:1", "n1:0"), ("n1:0", "n0:1"), ("n0:0", "n1:0")}


def test_json_round_trip(tmp_path: Path) -> None:
    c = load_cluster(write(tmp_path, GOOD))
    d = json.loads(json.dumps(c.to_dict()))
    c2 = cluster_from_dict(d)
    assert c2.device_names == c.device_names
    for a in c.device_names:
        for b in c.device_names:
            if a != b:
                assert c2.link(a, b) == c.link(a, b)
    with pytest.raises(ClusterSpecError, match="schema_version"):
        cluster_from_dict({**d, "schema_version": 99})


def test_builtin_scenarios_load() -> None:
    names = scenario_names()
    for expected in ("cee-testbed", "cee-testbed-500m", "local-small", "scale-2", "scale-16"):
        assert expected in names
    tb = load_scenario("cee-testbed")
    assert len(tb.devices) == 15
    assert set(tb.island_devices()) == {"cloud", "edge", "end"}
    assert tb.link("cloud0:0", "edge0:0").bandwidth_bytes_per_s == pytest.approx(100e6 / 8)
    assert load_scenario("cee-testbed-500m").link("cloud0:0", "edge0:0").bandwidth_bytes_per_s == pytest.approx(500e6 / 8)
    assert [len(load_scenario(f"scale-{n}").nodes) for n in (2, 4, 8, 12, 16)] == [2, 4, 8, 9, 16]
    small = load_scenario("local-small")
    assert len(small.devices) == 5 and small.emulation


def test_cli_bad_cluster_exits_2_with_one_line(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("peak_tflops = 10", "peak_tflops = -1"))
    out = subprocess.run(
        [sys.executable, "-m", "deepcee.cli", "plan", "--cluster", str(p), "--model", "gpt2", "--global-batch", "8",
         "-o", str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "peak_tflops" in lines[0] and "-1" in lines[0]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "plan.json").exists()


def test_the_four_region_example_routes_its_edge_site_through_eu_west() -> None:
    """``examples/four-regions.toml`` (docs/results.md, session 30): the edge site has a link to
    eu-west only, so us-east reaches it through eu-west, on the whole cluster and on a replica's
    devices alone (us-east and the edge site), as the relaxed search plans them."""
    root = Path(__file__).resolve().parents[2]
    c = load_cluster(root / "examples" / "four-regions.toml")
    assert len(c.device_names) == 34 and {i.name for i in c.islands} == {"us-east", "eu-west", "ap-south", "edge"}
    link = c.link("use0:0", "e0:0")
    assert link.latency_s == pytest.approx(0.095) and link.bandwidth_bytes_per_s == pytest.approx(100e6 / 8)
    replica = c.subset([d for d in c.device_names if d.startswith(("use", "e0", "e1"))])
    assert replica.link("use0:0", "e0:0") == link
