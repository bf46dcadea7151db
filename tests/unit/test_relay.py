"""The relay's timing core (pure, injected clock), packet parsing, and its configuration."""

from __future__ import annotations

import random
import struct
import subprocess
import sys

import pytest

from deepcee.cluster import BandwidthTrace, LinkEntry, LinkSpec
from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.runtime.realnet import netns, relay_config
from deepcee.runtime.realnet.relay import ipv4_destination, wire_bytes
from deepcee.runtime.realnet.shaping import (
    PairSpec,
    RelayConfig,
    RelayStats,
    ResourceSpec,
    WanQueue,
)
from deepcee.scenarios import load_scenario

MBIT = 1e6 / 8


def queue(latency_s: float = 0.02, bandwidth: float = 100 * MBIT, limit_s: float = 1.0, **kw) -> WanQueue:
    return WanQueue([PairSpec(src=0, dst=1, latency_s=latency_s, resource="a->b"),
                     PairSpec(src=1, dst=0, latency_s=latency_s, resource="b->a")],
                    [ResourceSpec(name="a->b", bandwidth_bytes_per_s=bandwidth, **kw),
                     ResourceSpec(name="b->a", bandwidth_bytes_per_s=bandwidth)], queue_limit_s=limit_s)


def test_one_packet_is_released_after_serialisation_plus_latency():
    q = queue()
    t = q.offer(0, 1, 1500, now=10.0, payload="p")
    assert t == pytest.approx(10.0 + 1500 / (100 * MBIT) + 0.02)
    assert q.next_release_s() == t
    assert q.pop_due(t - 1e-9) == []
    assert q.pop_due(t) == [(1, "p")]
    assert len(q) == 0 and q.next_release_s() is None


def test_back_to_back_packets_queue_fifo_at_the_link_rate():
    q = queue()
    ser = 1500 / (100 * MBIT)  # 120 us
    times = [q.offer(0, 1, 1500, now=0.0, payload=i) for i in range(100)]
    assert times == pytest.approx([0.02 + (i + 1) * ser for i in range(100)])
    # 100 packets of 1500 B: the last one leaves after 100 x 120 us, i.e. the link's 100 Mbit/s
    assert [p for _, p in q.pop_due(1.0)] == list(range(100))
    assert q.stats().resource("a->b").max_backlog_s == pytest.approx(99 * ser)


def test_pairs_sharing_a_resource_share_its_queue_and_others_do_not():
    q = WanQueue([PairSpec(src=0, dst=2, latency_s=0.01, resource="n0->n1"),
                  PairSpec(src=1, dst=2, latency_s=0.03, resource="n0->n1"),
                  PairSpec(src=0, dst=1, latency_s=0.0, resource="intra")],
                 [ResourceSpec(name="n0->n1", bandwidth_bytes_per_s=1000.0),
                  ResourceSpec(name="intra", bandwidth_bytes_per_s=1000.0)], queue_limit_s=10.0)
    a = q.offer(0, 2, 100, now=0.0)   # serialised 0.0-0.1, + 10 ms
    b = q.offer(1, 2, 100, now=0.0)   # waits for a: 0.1-0.2, + its own 30 ms
    c = q.offer(0, 1, 100, now=0.0)   # another resource: no wait
    assert (a, b, c) == pytest.approx((0.11, 0.23, 0.1))
    assert [d for d, _ in q.pop_due(1.0)] == [1, 2, 2]  # release order, not arrival order


def test_idle_link_does_not_bank_credit():
    q = queue(bandwidth=1000.0, latency_s=0.0)
    assert q.offer(0, 1, 100, now=0.0) == pytest.approx(0.1)
    # the link was idle from 0.1 to 5.0: the next packet starts at its arrival
    assert q.offer(0, 1, 100, now=5.0) == pytest.approx(5.1)


def test_drop_tail_when_backlog_exceeds_the_limit():
    q = queue(bandwidth=1000.0, latency_s=0.0, limit_s=0.25)
    kept = [q.offer(0, 1, 100, now=0.0) for _ in range(5)]
    # waits 0, 0.1, 0.2 are within 0.25 s; 0.3 is not
    assert kept[:3] == pytest.approx([0.1, 0.2, 0.3]) and kept[3:] == [None, None]
    s = q.stats().resource("a->b")
    assert (s.packets, s.bytes, s.dropped) == (3, 300, 2)
    assert q.offer(0, 1, 100, now=0.3) == pytest.approx(0.4)  # drained: accepted again


def test_live_rate_change_applies_to_new_packets_only():
    q = queue(bandwidth=1000.0, latency_s=0.0)
    first = q.offer(0, 1, 100, now=0.0)
    q.set_bandwidth("a->b", 100.0)
    second = q.offer(0, 1, 100, now=0.0)
    assert first == pytest.approx(0.1) and second == pytest.approx(0.1 + 1.0)
    assert q.stats().resource("a->b").bandwidth_bytes_per_s == 100.0
    q.set_latency(0, 1, 0.5)
    assert q.offer(0, 1, 100, now=2.0) == pytest.approx(3.5)
    with pytest.raises(SpecError, match="unknown resource 'nope'"):
        q.set_bandwidth("nope", 1.0)
    with pytest.raises(SpecError, match="must be > 0, got 0"):
        q.set_bandwidth("a->b", 0)
    with pytest.raises(SpecError, match="no pair 0->7"):
        q.set_latency(0, 7, 0.1)


def test_bandwidth_trace_changes_the_rate_at_its_times():
    q = WanQueue([PairSpec(src=0, dst=1, latency_s=0.0, resource="r")],
                 [ResourceSpec(name="r", bandwidth_bytes_per_s=1000.0, trace_times_s=(1.0, 2.0),
                               trace_bandwidth_bytes_per_s=(100.0, 4000.0))], queue_limit_s=10.0, epoch_s=50.0)
    assert q.next_event_s() == 51.0  # the first change, nothing queued yet
    assert q.advance(50.5) == []
    assert q.offer(0, 1, 100, now=50.5) == pytest.approx(50.6)
    assert q.advance(51.0) == [("r", 100.0)]
    assert q.offer(0, 1, 100, now=51.0) == pytest.approx(52.0)
    assert q.advance(60.0) == [("r", 4000.0)]
    assert len(q.pop_due(59.0)) == 2
    assert q.offer(0, 1, 100, now=60.0) == pytest.approx(60.025)
    assert q.next_event_s() == pytest.approx(60.025)  # no trace change left


def test_traces_restart_from_a_new_epoch():
    q = WanQueue([PairSpec(src=0, dst=1, latency_s=0.0, resource="r")],
                 [ResourceSpec(name="r", bandwidth_bytes_per_s=1000.0, trace_times_s=(1.0,),
                               trace_bandwidth_bytes_per_s=(100.0,))], queue_limit_s=10.0, epoch_s=0.0)
    assert q.advance(5.0) == [("r", 100.0)]
    assert q.set_epoch(10.0, now=10.5) == []  # back to nominal until 11.0
    assert q.stats().resource("r").bandwidth_bytes_per_s == 1000.0
    assert q.next_event_s() == 11.0
    assert q.advance(11.0) == [("r", 100.0)]


def test_unknown_pair_is_counted_not_queued():
    q = queue()
    assert q.offer(0, 5, 100, now=0.0) is None
    assert q.unroutable == 1 and len(q) == 0


def reference_release_times(arrivals: list[tuple[float, int, int]], latency: dict[int, float],
                            resource_of: dict[int, str], bandwidth: dict[str, float]) -> list[float]:
    """Slow reference: per resource, a packet starts when it arrives or when the previous one ends."""
    out, end = [], {}
    for t, src, n in arrivals:
        r = resource_of[src]
        start = max(t, end.get(r, t))
        end[r] = start + n / bandwidth[r]
        out.append(end[r] + latency[src])
    return out


def test_random_traffic_matches_a_per_resource_reference():
    rng = random.Random(7)
    latency = {0: 0.02, 1: 0.05, 2: 0.0}
    resource_of = {0: "wan", 1: "wan", 2: "lan"}
    bandwidth = {"wan": 12.5e6, "lan": 125e6}
    q = WanQueue([PairSpec(src=s, dst=3, latency_s=latency[s], resource=resource_of[s]) for s in range(3)],
                 [ResourceSpec(name=n, bandwidth_bytes_per_s=b) for n, b in bandwidth.items()], queue_limit_s=1e9)
    t, arrivals = 0.0, []
    for _ in range(2000):
        t += rng.expovariate(5000.0)
        arrivals.append((t, rng.randrange(3), rng.choice([66, 1500, 9000, 65000])))
    got = [q.offer(s, 3, n, now=t, payload=i) for i, (t, s, n) in enumerate(arrivals)]
    assert got == pytest.approx(reference_release_times(arrivals, latency, resource_of, bandwidth), abs=1e-12)
    # popping in steps yields every packet once, in release-time order
    released, now = [], 0.0
    while len(q):
        now += 0.01
        released += [p for _, p in q.pop_due(now)]
    assert sorted(released) == list(range(2000))
    assert [got[i] for i in released] == sorted(got)


# -- packets ------------------------------------------------------------------------------

def ipv4_tcp(payload_bytes: int, dst: str = "10.77.0.2") -> bytes:
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 32 + payload_bytes, 0, 0, 64, 6, 0,
                     bytes([10, 77, 0, 1]), bytes(int(x) for x in dst.split(".")))
    tcp = bytes(12) + bytes([8 << 4]) + bytes(19)  # data offset 8 words = 32 bytes (timestamps)
    return ip + tcp + bytes(payload_bytes)


def vnet(gso_type: int, gso_size: int) -> bytes:
    return struct.pack("<BBHHHH", 1, gso_type, 52, gso_size, 34, 16)


def test_ipv4_destination_and_non_ipv4():
    pkt = ipv4_tcp(10)
    assert ipv4_destination(pkt) == bytes([10, 77, 0, 2])
    assert ipv4_destination(vnet(0, 0) + pkt, 10) == bytes([10, 77, 0, 2])
    assert ipv4_destination(bytes([0x60]) + bytes(60)) is None  # IPv6
    assert ipv4_destination(b"\x45") is None


def test_wire_bytes_counts_the_headers_of_every_segment():
    pkt = ipv4_tcp(10 * 1448)
    assert wire_bytes(pkt, 0) == len(pkt)
    assert wire_bytes(vnet(0, 0) + pkt, 10) == len(pkt)  # not segmented
    # TSO: 10 segments of 1448 B -> 9 more copies of the 52 B IP+TCP header
    assert wire_bytes(vnet(1, 1448) + pkt, 10) == len(pkt) + 9 * 52
    assert wire_bytes(vnet(1, 1000) + ipv4_tcp(2500), 10) == 52 + 2500 + 2 * 52


# -- configuration --------------------------------------------------------------------------

def test_config_round_trip_and_validation(tmp_path):
    cfg = RelayConfig(addresses=("10.77.0.1", "10.77.0.2"), control_path=str(tmp_path / "s"),
                      pairs=(PairSpec(src=0, dst=1, latency_s=0.02, resource="r"),),
                      resources=(ResourceSpec(name="r", bandwidth_bytes_per_s=5.0, trace_times_s=(1.0,),
                                              trace_bandwidth_bytes_per_s=(2.0,)),),
                      vnet_hdr_bytes=10)
    assert RelayConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(SpecError, match="names a rank outside 0..1"):
        RelayConfig(addresses=("a", "b"), control_path="s", resources=cfg.resources,
                    pairs=(PairSpec(src=0, dst=2, latency_s=0.0, resource="r"),))
    with pytest.raises(SpecError, match="unknown resource 'x'"):
        RelayConfig(addresses=("a", "b"), control_path="s", resources=cfg.resources,
                    pairs=(PairSpec(src=0, dst=1, latency_s=0.0, resource="x"),))
    with pytest.raises(SpecError, match="trace times must increase"):
        ResourceSpec(name="r", bandwidth_bytes_per_s=1.0, trace_times_s=(2.0, 1.0), trace_bandwidth_bytes_per_s=(1, 1))
    with pytest.raises(SpecError, match="two different ranks"):
        PairSpec(src=1, dst=1, latency_s=0.0, resource="r")
    with pytest.raises(SpecError, match="schema_version"):
        RelayConfig.from_dict({**cfg.to_dict(), "schema_version": 99})


def test_stats_round_trip():
    q = queue()
    q.offer(0, 1, 1500, now=0.0)
    s = q.stats()
    assert RelayStats.from_dict(s.to_dict()) == s
    assert s.resource("a->b").packets == 1 and s.queued == 1


def test_relay_config_from_cluster_uses_links_resources_and_dilation(tmp_path):
    cluster = load_scenario("local-small")
    devices = ["cloud0:0", "cloud0:1", "edge0:0", "end0:0"]
    cfg = relay_config(cluster, devices, control_path=str(tmp_path / "s"), dilation=2.0)
    assert len(cfg.pairs) == 12 and cfg.addresses[0] == "10.77.0.1" and cfg.addresses[3] == "10.77.0.4"
    by_pair = {(p.src, p.dst): p for p in cfg.pairs}
    res = {r.name: r for r in cfg.resources}
    for (i, j), p in by_pair.items():
        link = cluster.link(devices[i], devices[j])
        assert p.resource == link.resource
        assert p.latency_s == pytest.approx(2.0 * link.latency_s)
        assert res[p.resource].bandwidth_bytes_per_s == pytest.approx(link.bandwidth_bytes_per_s / 2.0)
    # both cloud devices reach the edge node through one shared resource
    assert by_pair[(0, 2)].resource == by_pair[(1, 2)].resource != by_pair[(0, 1)].resource
    with pytest.raises(SpecError, match="appears twice"):
        relay_config(cluster, ["cloud0:0", "cloud0:0"], control_path="s")


def test_relay_queue_limit_keeps_its_bytes_under_dilation(tmp_path):
    cluster = load_scenario("local-small")
    for d in (1.0, 2.5):
        cfg = relay_config(cluster, ["cloud0:0", "edge0:0"], control_path="s", dilation=d, queue_limit_s=0.05)
        rate = {r.name: r.bandwidth_bytes_per_s for r in cfg.resources}[cluster.link("cloud0:0", "edge0:0").resource]
        assert cfg.queue_limit_s == pytest.approx(0.05 * d)
        assert cfg.queue_limit_s * rate == pytest.approx(0.05 * 100 * MBIT)  # 625 kB whatever D


def test_relay_config_scales_traces_with_the_dilation(tmp_path):
    trace = BandwidthTrace(times_s=(1.0, 2.0), bandwidth_bytes_per_s=(5e5, 2e6))
    cluster = load_scenario("local-small").with_links(
        [LinkEntry(a="cloud", b="edge", spec=LinkSpec(latency_s=0.02, bandwidth_bytes_per_s=1e6, trace=trace))])
    cfg = relay_config(cluster, ["cloud0:0", "edge0:0"], control_path="s", dilation=2.0)
    res = {r.name: r for r in cfg.resources}[cluster.link("cloud0:0", "edge0:0").resource]
    assert res.bandwidth_bytes_per_s == 5e5
    assert res.trace_times_s == (2.0, 4.0) and res.trace_bandwidth_bytes_per_s == (2.5e5, 1e6)


def test_missing_privileges_give_a_one_line_reason(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    reason = netns.realnet_unavailable()
    assert reason is not None and reason.startswith("not root") and "\n" not in reason
    with pytest.raises(RuntimeSetupError, match="real-network emulation unavailable: not root"):
        netns.require_realnet()


def test_rank_addresses_are_distinct_and_bounded():
    addrs = [netns.rank_address(r) for r in range(600)]
    assert len(set(addrs)) == 600 and addrs[0] == "10.77.0.1" and addrs[250] == "10.77.1.1"
    with pytest.raises(SpecError, match="rank must be in"):
        netns.rank_address(-1)


def test_relay_namespaces_and_rank_bootstrap_import_without_torch():
    """The relay process, a namespace set-up and a rank's bootstrap must not pay for torch
    (2-3 s, ~220 MB); the package's public names are found lazily."""
    code = ("import sys, deepcee.runtime.realnet.relay, deepcee.runtime.realnet.netns, deepcee.runtime.supervise\n"
            "from deepcee.runtime.realnet import RelayControl, RelayStats, cleanup_stale\n"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_relay_control_path_comes_from_the_environment(monkeypatch):
    from deepcee.runtime import dist as rdist

    monkeypatch.delenv(rdist.RELAY_CONTROL_ENV, raising=False)
    assert rdist.relay_control_path() is None
    monkeypatch.setenv(rdist.RELAY_CONTROL_ENV, "/tmp/x/relay.sock")
    assert rdist.relay_control_path() == "/tmp/x/relay.sock"


def test_namespaces_refuse_a_malformed_congestion_control():
    with pytest.raises(SpecError, match="congestion_control"):
        netns.WanNamespaces(2, congestion_control="cubic; rm -rf /")


def test_a_pair_down_drops_every_packet_in_its_windows_and_only_there():
    # a dead link (fault injection): windows from the epoch, the last one for good; the other
    # direction and other times carry packets as before; set_epoch moves the windows too
    q = WanQueue([PairSpec(src=0, dst=1, latency_s=0.0, resource="r", down_s=((1.0, 2.0), (5.0, None))),
                  PairSpec(src=1, dst=0, latency_s=0.0, resource="s")],
                 [ResourceSpec(name="r", bandwidth_bytes_per_s=1e6), ResourceSpec(name="s", bandwidth_bytes_per_s=1e6)],
                 queue_limit_s=1.0, epoch_s=10.0)
    assert q.offer(0, 1, 100, now=10.5) is not None
    assert q.offer(0, 1, 100, now=11.5) is None
    assert q.offer(1, 0, 100, now=11.5) is not None
    assert q.offer(0, 1, 100, now=12.5) is not None
    assert q.offer(0, 1, 100, now=15.0) is None and q.offer(0, 1, 100, now=1e6) is None
    assert q.stats().resource("r").dropped == 3
    q.set_epoch(100.0, now=100.5)
    assert q.offer(0, 1, 100, now=100.5) is not None and q.offer(0, 1, 100, now=101.5) is None
    q.set_down(1, 0, True)  # live
    assert q.offer(1, 0, 100, now=100.5) is None
    q.set_down(1, 0, False)
    assert q.offer(1, 0, 100, now=100.6) is not None
    with pytest.raises(SpecError, match="no pair 0->2"):
        q.set_down(0, 2, True)
    # a relay whose epoch is its own start applies the windows only once a run sets the epoch
    q = WanQueue([PairSpec(src=0, dst=1, latency_s=0.0, resource="r", down_s=((1.0, None),))],
                 [ResourceSpec(name="r", bandwidth_bytes_per_s=1e6)], queue_limit_s=1.0, epoch_s=0.0, down_armed=False)
    assert q.offer(0, 1, 100, now=5.0) is not None
    q.set_epoch(10.0, now=10.0)
    assert q.offer(0, 1, 100, now=10.5) is not None and q.offer(0, 1, 100, now=11.5) is None
    with pytest.raises(SpecError, match="down windows"):
        PairSpec(src=0, dst=1, latency_s=0.0, resource="r", down_s=((2.0, 1.0),))


def test_relay_config_cuts_the_pairs_of_a_link_outage(tmp_path):
    from deepcee.cluster.outages import LinkOutage

    cluster = load_scenario("local-small")
    devices = ["cloud0:0", "cloud0:1", "edge0:0", "end0:0"]
    cfg = relay_config(cluster, devices, control_path=str(tmp_path / "s"), dilation=2.0,
                       outages=(LinkOutage(a="cloud0", b="end0", start_s=1.5),
                                LinkOutage(a="edge0", b="end0", start_s=1.0, stop_s=3.0)))
    down = {(p.src, p.dst): p.down_s for p in cfg.pairs if p.down_s}
    assert down == {(0, 3): ((3.0, None),), (3, 0): ((3.0, None),), (1, 3): ((3.0, None),), (3, 1): ((3.0, None),),
                    (2, 3): ((2.0, 6.0),), (3, 2): ((2.0, 6.0),)}
    assert RelayConfig.from_dict(cfg.to_dict()) == cfg
