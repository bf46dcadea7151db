"""Emulation arithmetic with an injected clock: dilation, compute padding, link queueing."""

from __future__ import annotations

import pytest

from deepcee.cluster import BandwidthTrace, Link
from deepcee.runtime.emulation import (
    Clock,
    DevicePacer,
    FileLedger,
    LinkShaper,
    MemoryLedger,
    choose_dilation,
    padded_wall_s,
)


class FakeClock:
    """Wall and CPU time advance only when told to; sleeping advances wall time."""

    def __init__(self) -> None:
        self.wall_s, self.cpu_s, self.slept = 100.0, 5.0, []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.wall_s += s

    def clock(self) -> Clock:
        return Clock(wall=lambda: self.wall_s, cpu=lambda: self.cpu_s, sleep=self.sleep)


def test_dilation_keeps_emulated_devices_within_the_core_budget():
    assert choose_dilation([1.0], cores=1.2) == 1.0
    assert choose_dilation([1, 1, 1, 2, 1], cores=1.2) == pytest.approx(4.5 / 1.2)
    d = choose_dilation([1, 1, 1, 1], cores=1.2)
    assert sum(1 / (s * d) for s in [1, 1, 1, 1]) == pytest.approx(1.2)
    with pytest.raises(Exception, match="cores"):
        choose_dilation([1.0], cores=0)


def test_pacer_pads_to_cpu_time_times_slowdown_times_dilation():
    fc = FakeClock()
    pacer = DevicePacer(slowdown=2.0, dilation=3.0, clock=fc.clock())

    def work():  # 10 ms of CPU that took 12 ms of wall
        fc.cpu_s += 0.010
        fc.wall_s += 0.012
        return "done"

    result, timing = pacer.run(work)
    assert result == "done"
    assert padded_wall_s(0.010, 2.0, 3.0) == pytest.approx(0.060)
    assert timing.cpu_s == pytest.approx(0.010) and timing.wall_s == pytest.approx(0.060)
    assert fc.slept == [pytest.approx(0.048)]
    # a step that already took longer than its budget is not padded
    fc.slept.clear()

    def slow():
        fc.cpu_s += 0.001
        fc.wall_s += 0.050

    pacer.run(slow)
    assert fc.slept == []
    # disabled pacing measures only
    DevicePacer(slowdown=2.0, dilation=3.0, enabled=False, clock=fc.clock()).run(work)
    assert fc.slept == []


def _link(resource="n0->n1", latency_s=0.02, bw=1e6, trace=None):
    return Link(src="a", dst="b", latency_s=latency_s, bandwidth_bytes_per_s=bw, resource=resource, trace=trace)


def test_link_shaper_alpha_beta_and_fifo_queueing_per_resource():
    fc = FakeClock()
    shaper = LinkShaper(dilation=2.0, ledger=MemoryLedger(), epoch=fc.wall_s, clock=fc.clock())
    t0 = fc.wall_s
    # 100 kB at 1 MB/s = 0.1 s busy, + 20 ms latency; dilated by 2
    first = shaper.deliver_at(_link(), 100_000, t0)
    assert first == pytest.approx(t0 + 2 * (0.1 + 0.02))
    # queued behind the first on the same resource: starts when the pipe is free (t0 + 0.2)
    second = shaper.deliver_at(_link(), 50_000, t0 + 0.05)
    assert second == pytest.approx(t0 + 0.2 + 2 * (0.05 + 0.02))
    # another resource is independent
    other = shaper.deliver_at(_link(resource="n0->n2"), 50_000, t0 + 0.05)
    assert other == pytest.approx(t0 + 0.05 + 2 * (0.05 + 0.02))
    # after the pipe drained, no queueing
    later = shaper.deliver_at(_link(), 10_000, t0 + 10)
    assert later == pytest.approx(t0 + 10 + 2 * (0.01 + 0.02))


def test_link_shaper_reads_bandwidth_trace_in_emulated_time():
    fc = FakeClock()
    trace = BandwidthTrace(times_s=(1.0,), bandwidth_bytes_per_s=(0.5e6,))
    shaper = LinkShaper(dilation=4.0, ledger=MemoryLedger(), epoch=fc.wall_s, clock=fc.clock())
    t0 = fc.wall_s
    # emulated time 0.5 s (wall +2 s): nominal 1 MB/s
    assert shaper.deliver_at(_link(trace=trace, latency_s=0), 100_000, t0 + 2) == pytest.approx(t0 + 2 + 0.4)
    # emulated time 1.5 s (wall +6 s): 0.5 MB/s from the trace
    assert shaper.deliver_at(_link(trace=trace, latency_s=0), 100_000, t0 + 6) == pytest.approx(t0 + 6 + 0.8)


def test_file_ledger_is_shared_and_fifo(tmp_path):
    a, b = FileLedger(tmp_path), FileLedger(tmp_path)
    assert a.reserve("x->y", 10.0, 1.0) == 10.0
    assert b.reserve("x->y", 10.5, 1.0) == 11.0  # another instance (process) sees the booking
    assert b.reserve("x->z", 10.5, 1.0) == 10.5


