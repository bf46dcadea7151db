"""Mapping torchrun's processes to a plan's devices by machine ([Note: machine mapping]): by
--cluster-node, by host, by node rank, or (no mapping) by rank order; every inconsistency is
one message naming the device, the expected host and the actual host. Also the cluster
file's host / node_rank fields and the job name, which no path spelling changes."""

from __future__ import annotations

import re

import pytest

from deepcee.cluster import cluster_from_dict, cluster_from_toml_dict, cluster_to_dict
from deepcee.errors import ClusterSpecError, RuntimeSetupError
from deepcee.plan import Plan, StagePlan
from deepcee.runtime.job import job_name
from deepcee.runtime.machines import Report, assign, format_table

DEVICES = ("cloud0:0", "cloud0:1", "edge0:0", "edge0:1")


def _cluster(hosts: dict[str, str] | None = None, ranks: dict[str, int] | None = None):
    nodes = []
    for name, island in (("cloud0", "cloud"), ("edge0", "edge")):
        n = {"name": name, "island": island, "kind": "k", "devices": 2}
        if hosts and name in hosts:
            n["host"] = hosts[name]
        if ranks and name in ranks:
            n["node_rank"] = ranks[name]
        nodes.append(n)
    return cluster_from_toml_dict({
        "name": "two", "kinds": {"k": {"peak_tflops": 1, "memory_gib": 1}},
        "islands": {"cloud": {"latency_us": 10, "bandwidth_gbit_per_s": 10},
                    "edge": {"latency_us": 10, "bandwidth_gbit_per_s": 10}},
        "nodes": nodes,
        "links": [{"between": ["cloud", "edge"], "latency_ms": 20, "bandwidth_mbit_per_s": 100}],
    }, file="two.toml")


def _reports(first: str, *, hosts=("a", "b"), nodes=True, group=(0, 1)) -> list[Report]:
    """Two machines of two processes; ``first`` joined first (torchrun ranks 0 and 1)."""
    order = ("cloud0", "edge0") if first == "cloud0" else ("edge0", "cloud0")
    out = []
    for m, node in enumerate(order):
        for local in range(2):
            out.append(Report(launcher_rank=2 * m + local, local_rank=local, group_rank=group[m], host=hosts[m],
                              nodes=(node,) if nodes else ()))
    return out


@pytest.mark.parametrize("first", ["cloud0", "edge0"])
def test_cluster_node_flag_maps_devices_whatever_the_join_order(first):
    table = assign(_reports(first), _cluster(), DEVICES)
    assert {a.device: a.rank for a in table} == {d: i for i, d in enumerate(DEVICES)}
    assert all(a.device.split(":")[0] == a.node and a.mapped_by == "--cluster-node" for a in table)
    lines = format_table(table, {"cloud0:0": 0, "cloud0:1": 0, "edge0:0": 1, "edge0:1": 1})
    assert lines[1].split()[:3] == ["cloud0:0", "0", "0"] and len(lines) == 5


def test_hosts_in_the_cluster_file_map_machines():
    table = assign(_reports("edge0", hosts=("edge-a", "cloud-b"), nodes=False),
                   _cluster(hosts={"cloud0": "cloud-b", "edge0": "edge-a"}), DEVICES)
    assert [(a.launcher_rank, a.device) for a in table] == [(0, "edge0:0"), (1, "edge0:1"), (2, "cloud0:0"),
                                                             (3, "cloud0:1")]
    assert {a.mapped_by for a in table} == {"host"}


def test_node_ranks_in_the_cluster_file_map_machines():
    table = assign(_reports("edge0", nodes=False, group=(1, 0)), _cluster(ranks={"cloud0": 0, "edge0": 1}), DEVICES)
    assert [a.device for a in table] == ["edge0:0", "edge0:1", "cloud0:0", "cloud0:1"]


def test_wrong_host_names_device_expected_and_actual_host():
    with pytest.raises(RuntimeSetupError, match=r"torchrun rank 0 \(node rank 0, local rank 0, host 'b'\) was mapped "
                                                r"\(by --cluster-node\) to device cloud0:0 of node cloud0, which "
                                                r"two.toml puts on host 'a'; this process runs on host 'b'"):
        assign(_reports("cloud0", hosts=("b", "a")), _cluster(hosts={"cloud0": "a", "edge0": "b"}), DEVICES,
               source="two.toml")
    with pytest.raises(RuntimeSetupError, match=r"no node of two.toml has host 'c' \(hosts there: a, b\)"):
        assign(_reports("cloud0", hosts=("c", "a"), nodes=False), _cluster(hosts={"cloud0": "a", "edge0": "b"}),
               DEVICES, source="two.toml")
    alias = _reports("cloud0", hosts=("a", "b"))
    alias[0] = Report(launcher_rank=0, local_rank=0, group_rank=0, host="a.example", aliases=("a",), nodes=("cloud0",))
    alias[1] = Report(launcher_rank=1, local_rank=1, group_rank=0, host="a.example", aliases=("a",), nodes=("cloud0",))
    assert assign(alias, _cluster(hosts={"cloud0": "a"}), DEVICES)[0].device == "cloud0:0"  # short name matches


def test_inconsistent_launches_fail_with_the_device():
    few = [r for r in _reports("cloud0") if r.launcher_rank != 3]
    with pytest.raises(RuntimeSetupError, match="the plan has 4 devices, torchrun started 3 processes"):
        assign(few, _cluster(), DEVICES)
    both = [Report(launcher_rank=r.launcher_rank, local_rank=r.local_rank, group_rank=r.group_rank, host=r.host,
                   nodes=("cloud0",)) for r in _reports("cloud0")]
    with pytest.raises(RuntimeSetupError, match=r"device edge0:0 \(node edge0\) has no process"):
        assign(both, _cluster(), DEVICES)
    with pytest.raises(RuntimeSetupError, match="node cloud0 is claimed by two machines"):
        mixed = _reports("cloud0")
        mixed[2:] = [Report(launcher_rank=r.launcher_rank, local_rank=r.local_rank, group_rank=1, host="b",
                            nodes=("cloud0", "edge0")) for r in mixed[2:]]
        assign(mixed, _cluster(), DEVICES)
    with pytest.raises(RuntimeSetupError, match="--cluster-node 'cloud9' is not a node of"):
        bad = _reports("cloud0")
        bad[0] = Report(launcher_rank=0, local_rank=0, group_rank=0, host="a", nodes=("cloud9",))
        assign(bad, _cluster(), DEVICES)


def test_no_mapping_keeps_torchrun_rank_order():
    table = assign(_reports("edge0", nodes=False), _cluster(), DEVICES)
    assert [a.device for a in table] == list(DEVICES) and {a.mapped_by for a in table} == {"rank order"}


def test_idle_processes_rank_after_the_plans_devices():
    reports = _reports("cloud0")
    table = assign(reports, _cluster(), DEVICES[:3])  # edge0:1 unused: its process idles
    assert [(a.device, a.rank) for a in table] == [("cloud0:0", 0), ("cloud0:1", 1), ("edge0:0", 2), (None, 3)]


def test_cluster_file_host_and_node_rank_round_trip_and_are_checked():
    c = _cluster(hosts={"cloud0": "h1"}, ranks={"edge0": 1})
    assert c.node("cloud0").host == "h1" and c.node("edge0").node_rank == 1
    back = cluster_from_dict(cluster_to_dict(c), file="two.toml")
    assert back.node("cloud0") == c.node("cloud0") and back.node("edge0") == c.node("edge0")
    top = {"name": "x", "kinds": {"k": {"peak_tflops": 1, "memory_gib": 1}},
           "islands": {"cloud": {"latency_us": 10, "bandwidth_gbit_per_s": 10}}}
    for bad, message in (({"node_rank": -1}, "x.toml: nodes[0].node_rank: must be >= 0, got -1"),
                         ({"host": 5}, "x.toml: nodes[0].host: expected str, got 5")):
        node = {"name": "n", "island": "cloud", "kind": "k", "devices": 1, **bad}
        with pytest.raises(ClusterSpecError, match=re.escape(message)):
            cluster_from_toml_dict({**top, "nodes": [node]}, file="x.toml")


def test_job_name_depends_on_what_is_trained_not_on_how_paths_are_spelled(tmp_path, monkeypatch):
    import argparse

    from deepcee import train
    from deepcee.plan import save_json_atomic

    plan = Plan(system="t", cluster="local-small", model="gpt-tiny", global_batch=2, microbatch_size=2,
                num_microbatches=1, schedule="gpipe",
                stages=(StagePlan(layer_start=0, layer_stop=6, devices=("cloud0:0",), shares=(2,)),))
    (tmp_path / "sub").mkdir()
    save_json_atomic(tmp_path / "plan.json", plan.to_dict())
    monkeypatch.chdir(tmp_path)
    p = argparse.ArgumentParser()
    train.add_train_arguments(p)
    names = set()
    for plan_ref, run_dir in (("plan.json", "run"), (str(tmp_path / "plan.json"), str(tmp_path / "run")),
                              ("sub/../plan.json", "./run/")):
        args = p.parse_args(["--plan", plan_ref, "--run-dir", run_dir])
        names.add(train._job(args, *train._load(args), run_id="r1").name)
    assert len(names) == 1
    assert job_name(plan, "gpt-tiny", run_id="r1") in names
    assert job_name(plan, "gpt-tiny", run_id="r2") not in names and job_name(plan, "resnet-tiny") not in names
