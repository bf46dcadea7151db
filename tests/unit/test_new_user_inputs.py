"""Inputs a new user writes that the other tests never showed: clusters of one device, links
given twice, node names with colons, a model of one's own without a loss."""

from __future__ import annotations

import pytest

from deepcee.cluster import cluster_from_toml_dict
from deepcee.models import get_model
from deepcee.planner.compare import compare


def one_device() -> dict:
    return {
        "name": "one",
        "kinds": {"g": {"peak_tflops": 10.0, "memory_gib": 16.0}},
        "islands": {"a": {"latency_us": 50, "bandwidth_gbit_per_s": 10}},
        "nodes": [{"name": "n0", "island": "a", "kind": "g", "devices": 1}],
    }


def test_compare_on_a_cluster_of_one_device_has_no_leave_out_line() -> None:
    """The best single node then uses every device: nothing is left out, so there is no
    crossover to sweep (it used to fail: 'crossover needs left-out devices')."""
    report = compare(cluster_from_toml_dict(one_device()), get_model("gpt2"), 8)
    assert report.leave_out == "" and report.crossover is None
    assert report.rows[0].system == "deepcee" and report.rows[0].samples_per_s > 0
