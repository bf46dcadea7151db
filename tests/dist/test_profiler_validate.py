"""deepcee validate end to end: profile a two-device emulated cluster (device and network probes),
build plans, run them with the runtime, compare with the simulator; files written, figures sane.
Small probe and run budgets and hard deadlines: a hang is a failure."""

from __future__ import annotations

import json
import time

import pytest

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.profiler.probes import ProbeConfig
from deepcee.profiler.fidelity import validate_cluster
from deepcee.profiler.network import NetworkBudget

pytestmark = pytest.mark.dist

LAN = LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)
WAN = LinkSpec(latency_s=10e-3, bandwidth_bytes_per_s=100e6 / 8)


def _cluster() -> Cluster:
    kinds = {"cpu": DeviceKind(name="cpu", peak_flops_per_s=5e10, memory_bytes=2**31)}
    return Cluster(
        name="two-sites", kinds=kinds, islands=(Island(name="a", intra=LAN), Island(name="b", intra=LAN)),
        nodes=tuple(Node(name=f"{n}0", island=n, kind="cpu", devices=(f"{n}0:0",), intra=LAN) for n in "ab"),
        devices=(Device(name="a0:0", kind="cpu", node="a0", island="a"),
                 Device(name="b0:0", kind="cpu", node="b0", island="b", slowdown=1.5)),
        links=(LinkEntry(a="a", b="b", spec=WAN),),
    )


def test_validate_profiles_runs_and_compares(tmp_path):
    t0 = time.monotonic()
    lines: list[str] = []
    options = {"device_config": ProbeConfig(microbatch_sizes=(1, 2), warmup=1, repeats=3, score_repeats=1),
               "network_budget": NetworkBudget(duty_cycle=1.0, repeats=1, min_transfer_s=0.01), "deadline_s": 90.0}
    report = validate_cluster(_cluster(), "gpt-tiny", num_plans=3, steps=3, out_dir=tmp_path, spread_repeats=2,
                              profile_options=options, deadline_s=120.0, say=lines.append)
    assert len(report.rows) == 3 and len({r.name for r in report.rows}) == 3
    assert len(report.spread_medians_s) == 2
    for r in report.rows:
        assert r.measured_s > 0 and r.simulated_s > 0 and r.analytic_s > 0 and r.dilation >= 1
        assert abs(r.error) < 1.0  # the same order as the run (a broken profile is off by factors)
    data = json.loads((tmp_path / "validate.json").read_text())
    assert data["format"] == "deepcee.fidelity" and len(data["plans"]) == 3
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert set(profile["measured_call_overhead"]) == {"cpu"}
    assert all("backward" in t and "first_stage" in t for t in profile["measured"]["cpu"])
    assert any("| plan |" in line for line in lines)
    assert time.monotonic() - t0 < 240
