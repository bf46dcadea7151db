"""Overlapped model averaging in the simulator ([Note: overlapped averaging (simulator)]): on the
unit costs of test_simulator_replicas (a local step of one layer and one sample is F + B = 3 s
plus the optimizer step), communication shorter than a period is hidden, a longer one shows as
the wait for the round trip, and the run ends with one blocking round."""

from __future__ import annotations

import pytest
from test_simulator_replicas import cluster, model, opt, plan, replica

from deepcee.plan import Strategy
from deepcee.simulator.replicas import simulate_replicas

PARAMS = 1000


def _run(period: int, steps: int, latency_s: float, bandwidth: float, *, overlap: bool = True,
         outer: str = "average"):
    s = Strategy(kind="model-averaging", period=period, overlap=overlap, outer_optimizer=outer,
                 outer_lr=0.7 if outer == "nesterov" else 1.0, outer_momentum=0.9 if outer == "nesterov" else 0.0)
    m = model(1, params=PARAMS)
    c = cluster([1, 1], latency_s=latency_s, bandwidth_bytes_per_s=bandwidth)
    return simulate_replicas(plan([replica([["n0:0"]]), replica([["n1:0"]])], s), c, m, steps=steps,
                             record=True), 3 + opt(m)


@pytest.mark.parametrize("outer", ["average", "nesterov"])
def test_communication_shorter_than_a_period_is_hidden(outer: str) -> None:
    hop = 0.5 + PARAMS / 1000.0  # latency + bytes / bandwidth, well under H = 4 steps of ~3 s
    work = (2 + (6 if outer == "nesterov" else 0)) * PARAMS / 1e12
    r, step = _run(4, 12, 0.5, 1000.0, outer=outer)
    # every period costs its H local steps; only the last, blocking round is waited for
    assert r.step_ends_s[1][:-1] == pytest.approx([(i + 1) * step for i in range(11)])
    assert r.step_ends_s[1][-1] == pytest.approx(12 * step + 2 * hop + work)
    assert r.step_ends_s[0][-1] == pytest.approx(12 * step + hop + work)
    assert r.wan_s[1] == pytest.approx(2 * hop + work) and r.wait_s == (0.0, 0.0)
    blocking, _ = _run(4, 12, 0.5, 1000.0, overlap=False, outer=outer)
    assert blocking.step_ends_s[1][-1] == pytest.approx(12 * step + 3 * (2 * hop + work))
    assert r.samples_per_s > blocking.samples_per_s
    # three rounds and the last: copies to the root and results back, over the WAN both ways
    assert r.egress_bytes == pytest.approx({"a": 3 * PARAMS, "b": 3 * PARAMS})
    assert "overlapped" in r.strategy


def test_communication_longer_than_a_period_shows_as_the_wait() -> None:
    lat = 5.0  # one way; the round trip (10 s) is over three local steps of ~3 s at H = 1
    r, step = _run(1, 8, lat, 1e30)
    work = 2 * PARAMS / 1e12
    times = r.step_times_s[1]
    # from the third period on, replica 1 goes at the round trip's pace, not its own
    assert times[3:-1] == pytest.approx([2 * lat + work] * (len(times) - 4))
    assert all(t > step for t in times[2:])
    assert r.wan_s[1] > 0.5 * r.spans_s[1]
    blocking, _ = _run(1, 8, lat, 1e30, overlap=False)
    assert blocking.step_times_s[1][3] == pytest.approx(step + 2 * lat + work)  # blocking pays both
