"""Link monitor: recovers known links, detects real changes quickly, ignores noise and outliers."""

from __future__ import annotations

import numpy as np
import pytest

from deepcee.adapter.monitor import (
    LinkMonitor,
    MonitorConfig,
    TransferObservation,
    priors_from_cluster,
)
from deepcee.cluster import LinkSpec
from deepcee.plan import Plan, StagePlan
from deepcee.scenarios import load_scenario
from deepcee.traces import load_named_trace

LAT, BW = 0.020, 12.5e6  # 20 ms, 100 Mbit/s
PRIOR = {"a->b": LinkSpec(latency_s=LAT, bandwidth_bytes_per_s=BW)}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_recovers_known_link_from_mixed_sizes_without_prior() -> None:
    rng = np.random.default_rng(3)
    clock = Clock()
    mon = LinkMonitor(clock=clock)
    for _ in range(60):
        nbytes = float(rng.choice([2e4, 2e5, 1e6, 2e6]))
        clock.t += 0.5
        mon.observe("a->b", nbytes, (LAT + nbytes / BW) * (1 + rng.uniform(-0.1, 0.1)))
    est = mon.estimate("a->b")
    assert est.method == "fit"
    assert est.latency_s == pytest.approx(LAT, rel=0.10)
    assert est.bandwidth_bytes_per_s == pytest.approx(BW, rel=0.10)
    assert 0.0 < est.spread < 0.1
    assert not est.changed and est.n_observations == MonitorConfig().window
    assert est.updated_s == pytest.approx(30.0)


def test_single_size_uses_known_latency_and_recovers_bandwidth() -> None:
    rng = np.random.default_rng(4)
    mon = LinkMonitor(priors={"a->b": LinkSpec(latency_s=LAT, bandwidth_bytes_per_s=3 * BW)},
                      clock=Clock())
    for _ in range(12):
        mon.observe("a->b", 1e6, (LAT + 1e6 / BW) * (1 + rng.uniform(-0.1, 0.1)))
    est = mon.estimate("a->b")
    assert est.method == "bandwidth" and est.latency_s == LAT
    assert est.bandwidth_bytes_per_s == pytest.approx(BW, rel=0.10)


def test_latency_dominated_transfers_estimate_latency() -> None:
    mon = LinkMonitor(priors={"a->b": LinkSpec(latency_s=0.005, bandwidth_bytes_per_s=BW)}, clock=Clock())
    for _ in range(10):
        mon.observe("a->b", 100.0, 0.030 + 100.0 / BW)
    est = mon.estimate("a->b")
    assert est.method == "latency" and est.latency_s == pytest.approx(0.030, rel=1e-6)


@pytest.mark.parametrize("sizes", [[1e6], [5e5, 1e6, 2e6]])
def test_detects_5x_drop_within_three_observations(sizes) -> None:
    rng = np.random.default_rng(5)
    clock = Clock()
    mon = LinkMonitor(priors=PRIOR, clock=clock)
    first_flag = None
    for i in range(40):
        bw = BW if i < 20 else BW / 5
        nbytes = sizes[i % len(sizes)]
        clock.t = float(i)
        mon.observe("a->b", nbytes, (LAT + nbytes / bw) * (1 + rng.uniform(-0.05, 0.05)))
        if mon.estimate("a->b").changed and first_flag is None:
            first_flag = i
        if i < 20:
            assert not mon.changed()
    assert first_flag is not None and first_flag - 20 + 1 <= 3  # the third post-drop sample at most
    est = mon.estimate("a->b")
    assert est.changed and est.changed_at_s == 20.0
    assert est.bandwidth_bytes_per_s == pytest.approx(BW / 5, rel=0.10)
    assert est.baseline_bandwidth_bytes_per_s == BW
    assert mon.changed() == ("a->b",)


def _trace_observations(trace_name: str, *, step_s: float, nbytes: float, until_s: float, seed: int):
    """One transfer every ``step_s`` on a 20 ms link whose bandwidth follows the trace; +-3% jitter."""
    trace = load_named_trace(trace_name)
    rng = np.random.default_rng(seed)
    t = 0.0
    while t < until_s:
        bw = trace.bandwidth_at(t, BW)
        yield t, (LAT + nbytes / bw) * (1 + rng.uniform(-0.03, 0.03))
        t += step_s


def test_no_change_flagged_on_noisy_stationary_trace() -> None:
    clock = Clock()
    mon = LinkMonitor(priors=PRIOR, clock=clock)
    flags = 0
    for t, seconds in _trace_observations("noisy-stationary", step_s=0.2, nbytes=1e6, until_s=600, seed=6):
        clock.t = t
        mon.observe("a->b", 1e6, seconds)
        flags += mon.estimate("a->b").changed
    assert flags == 0
    est = mon.estimate("a->b")
    assert est.bandwidth_bytes_per_s == pytest.approx(BW, rel=0.08)
    assert est.spread > 0.03  # the noise is seen, and tolerated


def test_drop_then_recover_is_flagged_then_cleared_after_accept() -> None:
    clock = Clock()
    mon = LinkMonitor(priors=PRIOR, clock=clock)
    seen = []
    for t, seconds in _trace_observations("drop-recover", step_s=0.5, nbytes=1e6, until_s=100, seed=7):
        clock.t = t
        mon.observe("a->b", 1e6, seconds)
        est = mon.estimate("a->b")
        seen.append((t, est.changed, est.bandwidth_bytes_per_s))
        if t == 40.0:  # the adapter acted on the drop: the slow link is the new normal
            mon.accept()
            assert not mon.changed()
    flagged = [t for t, c, _ in seen if c]
    assert 20.0 <= flagged[0] <= 21.5  # within 3 samples of the drop
    assert any(60.0 <= t <= 61.5 for t in flagged)  # and within 3 samples of the recovery
    assert not [t for t in flagged if 41 <= t < 60]
    assert seen[-1][2] == pytest.approx(BW, rel=0.05)


def test_single_outlier_raises_no_alarm() -> None:
    mon = LinkMonitor(priors=PRIOR, clock=Clock())
    for i in range(40):
        seconds = LAT + 1e6 / BW
        mon.observe("a->b", 1e6, seconds * (20.0 if i in (15, 30) else 1.0))
    est = mon.estimate("a->b")
    assert not est.changed and est.bandwidth_bytes_per_s == pytest.approx(BW, rel=1e-6)


def test_queued_transfers_are_merged_into_busy_periods() -> None:
    """Two 1 MB sends issued together on one pipe: the second waits for the first."""
    per = 1e6 / BW
    merged, separate = LinkMonitor(priors=PRIOR, clock=Clock()), LinkMonitor(priors=PRIOR, clock=Clock())
    for k in range(10):
        t = 10.0 * k
        batch = [TransferObservation(resource="a->b", nbytes=1e6, seconds=LAT + q * per, start_s=t)
                 for q in (1, 2, 3)]
        # issued after the pipe went idle: a sample of its own
        batch.append(TransferObservation(resource="a->b", nbytes=5e5, seconds=LAT + per / 2, start_s=t + 1.0))
        merged.observe_batch(batch)
        separate.observe_batch([TransferObservation(resource=o.resource, nbytes=o.nbytes, seconds=o.seconds)
                                for o in batch])
    assert merged.estimate("a->b").bandwidth_bytes_per_s == pytest.approx(BW, rel=1e-6)
    assert not merged.estimate("a->b").changed
    assert separate.estimate("a->b").bandwidth_bytes_per_s < 0.9 * BW  # queueing mistaken for a slow link


def test_unknown_resource_and_config_checks() -> None:
    mon = LinkMonitor(clock=Clock())
    assert mon.estimate("x->y") is None and mon.estimates() == {}
    mon.set_prior("x->y", LinkSpec(latency_s=0.01, bandwidth_bytes_per_s=1e6))
    assert mon.estimate("x->y").method == "prior"
    with pytest.raises(ValueError, match="cusum_clip"):
        MonitorConfig(cusum_clip=0.05)
    with pytest.raises(ValueError, match="nbytes"):
        TransferObservation(resource="r", nbytes=-1, seconds=1.0)


def test_priors_from_cluster_cover_the_plan_boundaries() -> None:
    c = load_scenario("local-small")
    plan = Plan(system="t", cluster=c.name, model="m", global_batch=4, microbatch_size=2, num_microbatches=2,
                schedule="1f1b",
                stages=(StagePlan(layer_start=0, layer_stop=2, devices=("cloud0:0", "cloud0:1"), shares=(1, 1)),
                        StagePlan(layer_start=2, layer_stop=4, devices=("edge0:0",), shares=(2,))))
    pri = priors_from_cluster(c, plan)
    assert set(pri) == {"cloud0->edge0", "edge0->cloud0"}
    assert pri["cloud0->edge0"].bandwidth_bytes_per_s == pytest.approx(BW)
    assert pri["cloud0->edge0"].latency_s == pytest.approx(0.02)
