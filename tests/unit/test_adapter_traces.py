"""Built-in bandwidth traces: shipped files match their generator, load by name, rescale, apply."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deepcee.errors import ClusterSpecError
from deepcee.scenarios import load_scenario
from deepcee.traces import (
    BUILTIN_TRACES,
    builtin_trace_data,
    load_named_trace,
    relative_to,
    slow_link_pairs,
    snapshot,
    trace_from_factors,
    trace_names,
    trace_path,
    with_trace,
    write_builtin_traces,
)

MBIT = 1e6 / 8


def test_shipped_files_are_the_generated_ones(tmp_path) -> None:
    assert trace_names() == sorted(BUILTIN_TRACES)
    for p in write_builtin_traces(tmp_path):
        assert json.loads(p.read_text()) == json.loads(trace_path(p.stem).read_text()), p.stem


def test_drop_5x_and_recover_levels() -> None:
    t = load_named_trace("drop-5x")
    assert t.bandwidth_at(19.9, 0.0) == pytest.approx(100 * MBIT)
    assert t.bandwidth_at(20.0, 0.0) == pytest.approx(20 * MBIT)
    assert t.bandwidth_at(1e6, 0.0) == pytest.approx(20 * MBIT)
    r = load_named_trace("drop-recover")
    assert [r.bandwidth_at(x, 0.0) / MBIT for x in (10, 30, 70)] == pytest.approx([100, 20, 100])


def test_noisy_stationary_is_bounded_noise_without_trend() -> None:
    bws = np.array(load_named_trace("noisy-stationary").bandwidth_bytes_per_s) / MBIT
    assert bws.min() >= 85 - 1e-9 and bws.max() <= 115 + 1e-9
    assert abs(bws[:300].mean() - bws[300:].mean()) < 3  # no drift between the two halves
    assert bws.std() > 5  # it is noisy


def test_ramp_and_periodic_shapes() -> None:
    ramp = load_named_trace("ramp")
    vals = [ramp.bandwidth_at(t, 0.0) / MBIT for t in range(0, 130, 10)]
    assert vals == sorted(vals, reverse=True) and vals[0] == 100 and vals[-1] == pytest.approx(20)
    per = load_named_trace("periodic")
    assert per.bandwidth_at(0, 0) / MBIT == pytest.approx(100)
    assert per.bandwidth_at(15, 0) / MBIT == pytest.approx(40)
    assert per.bandwidth_at(30, 0) / MBIT == pytest.approx(100)


def test_load_by_path_and_unknown_name(tmp_path) -> None:
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"schema_version": 1, "times_s": [0, 5], "bandwidth_mbit_per_s": [8, 16]}))
    assert load_named_trace(p).bandwidth_at(6, 0) == pytest.approx(2e6)
    assert load_named_trace(str(p)).name == "mine"
    with pytest.raises(ClusterSpecError, match="unknown trace 'nope'.*drop-5x"):
        load_named_trace("nope")
    with pytest.raises(ClusterSpecError, match="unknown built-in trace"):
        builtin_trace_data("nope")


def test_relative_rescale_and_factors() -> None:
    t = load_named_trace("drop-5x")
    r = relative_to(t, 1e9, time_scale=0.5)  # a 8 Gbit/s link, drop at 10 s
    assert r.bandwidth_at(5, 0) == pytest.approx(1e9) and r.bandwidth_at(10, 0) == pytest.approx(2e8)
    f = trace_from_factors([0, 3], [1.0, 0.25], 4e6, name="q")
    assert f.bandwidth_at(4, 0) == pytest.approx(1e6) and f.name == "q"
    with pytest.raises(ClusterSpecError, match="time_scale"):
        relative_to(t, 1e9, time_scale=0)


def test_with_trace_puts_rescaled_trace_on_slow_links_and_snapshot_freezes_it() -> None:
    c = load_scenario("local-small")
    assert sorted(slow_link_pairs(c)) == [("cloud", "edge"), ("cloud", "end"), ("edge", "end")]
    traced = with_trace(c, load_named_trace("drop-5x"))
    link = traced.link("cloud0:0", "edge0:0")
    assert link.bandwidth_at(0) == pytest.approx(100 * MBIT)
    assert link.bandwidth_at(25) == pytest.approx(20 * MBIT)
    assert link.latency_s == pytest.approx(0.02)
    assert link.resource == c.link("cloud0:0", "edge0:0").resource
    # intra-island links keep no trace
    assert traced.link("cloud0:0", "cloud0:1").trace is None
    frozen = snapshot(traced, 30.0)
    assert frozen.link("edge0:0", "end0:0").trace is None
    assert frozen.link("edge0:0", "end0:0").bandwidth_bytes_per_s == pytest.approx(20 * MBIT)
    only = with_trace(c, load_named_trace("drop-5x"), between=[("cloud", "edge")])
    assert only.link("cloud0:0", "end0:0").trace is None
