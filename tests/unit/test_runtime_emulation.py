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




def test_emulation_info_says_what_each_mode_emulates():
    from deepcee.runtime.emulation import EMULATED_FIGURES, REALNET_FIGURES, emulation_info

    emu, net, real = (emulation_info(m, 2.5) for m in ("emulated", "realnet", "real"))
    assert emu.dilation == net.dilation == 2.5 and real.dilation == 1.0
    assert emu.emulated == EMULATED_FIGURES and real.emulated == ()
    assert net.emulated == REALNET_FIGURES and any("real TCP" in f for f in net.emulated)
    assert not any("all-reduce" in f for f in net.emulated)  # it runs for real over the relay
    assert net.to_dict()["mode"] == "realnet"
    with pytest.raises(Exception, match="mode"):
        emulation_info("simulated", 1.0)


def test_train_config_accepts_realnet_on_cpu_only():
    from deepcee.runtime.job import TrainConfig

    assert TrainConfig(steps=1, mode="realnet").mode == "realnet"
    with pytest.raises(Exception, match="realnet"):
        TrainConfig(steps=1, mode="realnet", use_cuda=True)
    with pytest.raises(Exception, match="realnet"):  # the message lists the modes
        TrainConfig(steps=1, mode="network")


def _jobs(tmp_path, *specs):
    from deepcee.plan import Plan, StagePlan
    from deepcee.runtime.job import Job, TrainConfig
    from deepcee.scenarios import load_scenario

    cluster = load_scenario("local-small")
    out = []
    for i, (devices, mode, dilation) in enumerate(specs):
        plan = Plan(system="t", cluster="local-small", model="gpt-tiny", global_batch=2, microbatch_size=2,
                    num_microbatches=1, schedule="gpipe",
                    stages=tuple(StagePlan(layer_start=3 * k, layer_stop=3 * k + 3, devices=(d,), shares=(2,))
                                 for k, d in enumerate(devices)))
        out.append(Job(name=f"j{i}", plan=plan, cluster=cluster, model="gpt-tiny",
                       config=TrainConfig(steps=1, mode=mode, dilation=dilation), run_dir=str(tmp_path / f"j{i}")))
    return out


def test_realnet_launch_takes_one_device_order_and_one_dilation(tmp_path):
    from deepcee.runtime.launch import _realnet_jobs

    ab = ("cloud0:0", "edge0:1")  # slowdowns 1 and 2: D = 1.5 / 1.2
    jobs, cluster, devices, dilation = _realnet_jobs(_jobs(tmp_path, (ab, "realnet", None), (ab, "realnet", None)), None)
    assert devices == ab and dilation == pytest.approx(choose_dilation([1.0, 2.0]))
    assert all(j.config.dilation == dilation for j in jobs)  # every rank uses the relay's
    with pytest.raises(Exception, match="not in mode 'realnet'"):
        _realnet_jobs(_jobs(tmp_path, (ab, "realnet", None), (ab, "emulated", None)), None)
    with pytest.raises(Exception, match="in one order"):
        _realnet_jobs(_jobs(tmp_path, (ab, "realnet", None), (ab[::-1], "realnet", None)), None)
    with pytest.raises(Exception, match="one time dilation"):
        _realnet_jobs(_jobs(tmp_path, (ab, "realnet", None), (ab, "realnet", 3.0)), None)
    with pytest.raises(Exception, match="world_size is 3"):
        _realnet_jobs(_jobs(tmp_path, (ab, "realnet", None)), 3)


def test_link_outage_holds_transfers_until_the_link_is_back_or_forever():
    import math

    from deepcee.cluster.outages import LinkOutage, outages_by_devices, up_again_s
    from deepcee.errors import ClusterSpecError

    flap = LinkOutage.parse("a0:b0@1:3", ["a0", "b0"])
    gone = LinkOutage(a="a0", b="b0", start_s=5.0)
    assert (flap.start_s, flap.stop_s) == (1.0, 3.0) and math.isinf(gone.stop_s)
    assert up_again_s([flap, gone], 0.5) == 0.5 and up_again_s([flap, gone], 2.0) == 3.0
    assert math.isinf(up_again_s([flap, gone], 6.0))
    for bad in ("a0@1", "a0:zz@1", "a0:b0", "a0:b0@x", "a0:b0@3:1"):
        with pytest.raises(ClusterSpecError):
            LinkOutage.parse(bad, ["a0", "b0"])
    cut = outages_by_devices([flap], {"a0:0": "a0", "b0:0": "b0", "c0:0": "c0"})
    assert set(cut) == {("a0:0", "b0:0"), ("b0:0", "a0:0")}
    fc = FakeClock()
    link = _link(latency_s=0)
    link = type(link)(src="a0:0", dst="b0:0", latency_s=0.0, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                      resource=link.resource)
    shaper = LinkShaper(dilation=2.0, ledger=MemoryLedger(), epoch=fc.wall_s, clock=fc.clock(),
                        outages=outages_by_devices([flap, gone], {"a0:0": "a0", "b0:0": "b0"}))
    t0 = fc.wall_s
    busy = 2 * 100_000 / link.bandwidth_bytes_per_s
    # ready at emulated 1.5 s (wall +3): waits until 3 s (wall +6)
    assert shaper.deliver_at(link, 100_000, t0 + 3) == pytest.approx(t0 + 6 + busy)
    # ready at emulated 5.5 s: never delivered
    assert math.isinf(shaper.deliver_at(link, 100_000, t0 + 11))
