"""User-space WAN relay: real IP packets between network namespaces, shaped per link.

Each rank runs in its own network namespace (:mod:`deepcee.runtime.netns`) whose only
route to the other ranks is a TUN device. The relay process holds the other end of every
TUN device (a file descriptor per rank), reads each IPv4 packet a rank sends, finds the
destination rank from the packet's destination address (bytes 16-20 of the IPv4 header), and
writes the packet into the destination's TUN device at its release time

    start   = max(arrival, resource free)        # FIFO per link resource
    free    = start + len / bandwidth            # the resource is busy while it serialises
    release = free + latency                     # then the packet propagates

where latency is the pair's (``Link.latency_s``) and bandwidth is that of the pair's
*resource* (``Link.resource``, [Note: link resources] in :mod:`deepcee.cluster`): pairs that
share a resource share one FIFO and one rate. A packet that would wait more than
``queue_limit_s`` before its serialisation starts is dropped (drop-tail, like a router
buffer of ``queue_limit_s x bandwidth`` bytes), so TCP sees losses instead of an unbounded
queue. Released packets leave through one priority queue (heap) ordered by release time.
Rates and latencies change live through a control socket (:class:`RelayControl`) and
bandwidth traces are applied at their change times (seconds after ``epoch_s``, which a
control request can move to the training run's start); packets already queued keep the
times they were given (they are "on the wire").

The timing logic is :class:`WanQueue` (pure: an injected ``now``, no I/O; unit-tested);
:func:`serve` is the I/O loop around it and this file is also the relay process's entry::

    python -c "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')" RELAY_FILE \\
        --config relay.json --fds 5,6 --owner deepcee-relay-owner=PID

It is started that way (by :mod:`deepcee.runtime.realnet`), by file, so that it loads
nothing but the standard library and :mod:`deepcee.errors` (no torch: 2-3 s, ~220 MB)
whatever the ``deepcee.runtime`` package imports.

CPU cost. The loop does one ``select`` per wake-up and one ``read`` and one ``write`` system
call per packet; the ``write`` also runs the receiving namespace's IP/TCP input path, which
the kernel charges to the relay. With TUN offload ([Note: TUN offload]) TCP hands over about
12 kB per packet at 100 Mbit/s instead of 1500 B. Measured by ``benchmarks/realnet_link.py``
(20 ms / 100 Mbit/s, one TCP stream saturating the link, 2-core machine at load average 3-7
from other work; five runs): 16-18% of one core with offload (0.015-0.016 CPU-seconds per
MB, about a third in the kernel), 36-45% without; idle, the relay wakes twice a second. Its
ceiling on an unshaped pipe was 1.7-3.3 Gbit/s at 43-56% of a core. It runs at nice -10 with a 1 us
timer slack so that contention delays its releases less. The smallest round trip it adds
over the configured latencies is about 0.5 ms (40.5 ms measured for 2 x 20 ms).
"""

from __future__ import annotations

import argparse
import ctypes
import heapq
import json
import logging
import os
import secrets
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepcee.errors import RuntimeSetupError, SpecError

log = logging.getLogger(__name__)

RELAY_FILE = str(Path(__file__).resolve())
CONFIG_FORMAT = "deepcee.relay-config"
SCHEMA_VERSION = 1
RELEASE_SLACK_S = 1e-4
"""Packets due this soon are released in the same wake-up (0.1 ms, well under any WAN latency)."""
MAX_WAIT_S = 0.5
"""Longest sleep of the loop without I/O (bounds the reaction to a dead owner)."""
READ_BURST = 64
"""Packets read from one TUN device per wake-up before serving the others (fairness)."""
PACKET_MAX_BYTES = 65536
RELAY_NICE = -10
"""Scheduling priority change of the relay process (root only)."""
OWNER_MARKER = "deepcee-relay-owner="
"""Part of the relay's command line: stale-cleanup finds relays whose owner died by it."""


# -- configuration ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PairSpec:
    """One directed rank-to-rank path through the relay."""

    src: int
    dst: int
    latency_s: float
    """One-way propagation delay added after serialisation."""
    resource: str
    """The shared pipe whose rate and FIFO this pair uses."""

    def __post_init__(self) -> None:
        if self.src == self.dst or self.src < 0 or self.dst < 0:
            raise SpecError(f"pair needs two different ranks >= 0, got {self.src!r} -> {self.dst!r}", field="pairs")
        if not self.latency_s >= 0:
            raise SpecError(f"pair {self.src}->{self.dst}: latency_s must be >= 0, got {self.latency_s!r}")
        if not self.resource:
            raise SpecError(f"pair {self.src}->{self.dst}: empty resource name", field="pairs.resource")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResourceSpec:
    """One shared pipe: its nominal rate and an optional piecewise-constant trace."""

    name: str
    bandwidth_bytes_per_s: float
    trace_times_s: tuple[float, ...] = ()
    """Seconds after the relay's epoch at which the rate changes."""
    trace_bandwidth_bytes_per_s: tuple[float, ...] = ()
    """The rate from ``trace_times_s[i]`` on (the nominal rate holds before the first)."""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise SpecError(f"resource {self.name!r}: bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if len(self.trace_times_s) != len(self.trace_bandwidth_bytes_per_s):
            raise SpecError(f"resource {self.name!r}: trace needs as many times as rates, got "
                            f"{len(self.trace_times_s)} and {len(self.trace_bandwidth_bytes_per_s)}")
        if any(b <= a for a, b in zip(self.trace_times_s, self.trace_times_s[1:], strict=False)):
            raise SpecError(f"resource {self.name!r}: trace times must increase, got {self.trace_times_s}")
        if any(not b > 0 for b in self.trace_bandwidth_bytes_per_s):
            raise SpecError(f"resource {self.name!r}: trace rates must be > 0, got {self.trace_bandwidth_bytes_per_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayConfig:
    """Everything the relay process needs, except its file descriptors (JSON, one file)."""

    addresses: tuple[str, ...]
    """IPv4 address of rank ``i``'s TUN device, in rank order."""
    pairs: tuple[PairSpec, ...]
    resources: tuple[ResourceSpec, ...]
    control_path: str
    """Filesystem path of the relay's control socket (works from any network namespace)."""
    queue_limit_s: float = 0.05
    """Drop a packet that would wait longer than this before its serialisation starts."""
    epoch_s: float | None = None
    """``time.monotonic()`` origin of the traces (default: when the relay starts)."""
    vnet_hdr_bytes: int = 0
    """Length of the virtio-net header before each packet (10 with TUN offload, else 0)."""

    def __post_init__(self) -> None:
        n = len(self.addresses)
        if len(set(self.addresses)) != n:
            raise SpecError(f"addresses must be distinct, got {self.addresses}", field="addresses")
        names = {r.name for r in self.resources}
        if len(names) != len(self.resources):
            raise SpecError("duplicate resource names", field="resources")
        seen = set()
        for p in self.pairs:
            if p.src >= n or p.dst >= n:
                raise SpecError(f"pair {p.src}->{p.dst} names a rank outside 0..{n - 1}", field="pairs")
            if p.resource not in names:
                raise SpecError(f"pair {p.src}->{p.dst} names unknown resource {p.resource!r}", field="pairs.resource")
            if (p.src, p.dst) in seen:
                raise SpecError(f"pair {p.src}->{p.dst} given twice", field="pairs")
            seen.add((p.src, p.dst))
        if not self.queue_limit_s > 0:
            raise SpecError(f"must be > 0, got {self.queue_limit_s!r}", field="queue_limit_s")
        if self.vnet_hdr_bytes not in (0, 10, 12):
            raise SpecError(f"must be 0, 10 or 12, got {self.vnet_hdr_bytes!r}", field="vnet_hdr_bytes")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CONFIG_FORMAT, "schema_version": SCHEMA_VERSION, "addresses": list(self.addresses),
            "pairs": [{"src": p.src, "dst": p.dst, "latency_s": p.latency_s, "resource": p.resource} for p in self.pairs],
            "resources": [{"name": r.name, "bandwidth_bytes_per_s": r.bandwidth_bytes_per_s,
                           "trace_times_s": list(r.trace_times_s),
                           "trace_bandwidth_bytes_per_s": list(r.trace_bandwidth_bytes_per_s)} for r in self.resources],
            "control_path": self.control_path, "queue_limit_s": self.queue_limit_s, "epoch_s": self.epoch_s,
            "vnet_hdr_bytes": self.vnet_hdr_bytes,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RelayConfig:
        if d.get("format") != CONFIG_FORMAT or d.get("schema_version") != SCHEMA_VERSION:
            raise SpecError(f"expected format {CONFIG_FORMAT!r} schema_version {SCHEMA_VERSION}, "
                            f"got {d.get('format')!r} {d.get('schema_version')!r}", field="schema_version")
        return RelayConfig(
            addresses=tuple(d["addresses"]), control_path=d["control_path"], queue_limit_s=d["queue_limit_s"],
            epoch_s=d.get("epoch_s"), vnet_hdr_bytes=d.get("vnet_hdr_bytes", 0),
            pairs=tuple(PairSpec(**p) for p in d["pairs"]),
            resources=tuple(ResourceSpec(name=r["name"], bandwidth_bytes_per_s=r["bandwidth_bytes_per_s"],
                                         trace_times_s=tuple(r.get("trace_times_s", ())),
                                         trace_bandwidth_bytes_per_s=tuple(r.get("trace_bandwidth_bytes_per_s", ())))
                            for r in d["resources"]),
        )


# -- the timing core (pure) -------------------------------------------------------------


@dataclass(slots=True)
class _Resource:
    bandwidth_bytes_per_s: float
    free_at: float = float("-inf")
    packets: int = 0
    bytes: int = 0
    dropped: int = 0
    max_backlog_s: float = 0.0


@dataclass(slots=True)
class _Pair:
    latency_s: float
    resource: _Resource


@dataclass(frozen=True, slots=True, kw_only=True)
class ResourceStats:
    name: str
    bandwidth_bytes_per_s: float
    """The rate in force when the stats were taken."""
    packets: int
    bytes: int
    dropped: int
    max_backlog_s: float
    """Longest wait before serialisation any packet saw (queueing delay)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayStats:
    """Counters of a relay (``wall_s`` and ``cpu_s`` only from a running relay process)."""

    resources: tuple[ResourceStats, ...]
    unroutable: int
    """Packets dropped because no pair matches (non-IPv4, unknown address, no link)."""
    queued: int
    wall_s: float = 0.0
    cpu_s: float = 0.0
    """The relay process's own CPU seconds (user + system, including the kernel's receive path
    of the packets it writes)."""
    system_s: float = 0.0
    """The kernel's part of ``cpu_s`` (system calls, TUN copies, the receivers' IP/TCP input)."""
    write_errors: int = 0

    @property
    def cpu_fraction(self) -> float:
        """Fraction of one core the relay used over its life."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def resource(self, name: str) -> ResourceStats:
        for r in self.resources:
            if r.name == name:
                return r
        raise KeyError(f"no resource {name!r} (have {[r.name for r in self.resources]})")

    def to_dict(self) -> dict[str, Any]:
        return {"resources": [{"name": r.name, "bandwidth_bytes_per_s": r.bandwidth_bytes_per_s, "packets": r.packets,
                               "bytes": r.bytes, "dropped": r.dropped, "max_backlog_s": r.max_backlog_s}
                              for r in self.resources],
                "unroutable": self.unroutable, "queued": self.queued, "wall_s": self.wall_s, "cpu_s": self.cpu_s,
                "system_s": self.system_s, "write_errors": self.write_errors}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RelayStats:
        return RelayStats(resources=tuple(ResourceStats(**r) for r in d["resources"]), unroutable=d["unroutable"],
                          queued=d["queued"], wall_s=d["wall_s"], cpu_s=d["cpu_s"], system_s=d["system_s"],
                          write_errors=d["write_errors"])


class WanQueue:
    """Release times of packets on shaped pairs; see the module docstring for the rule.

    Pure: every method takes ``now`` (seconds, any monotonic origin shared with ``epoch_s``).
    ``payload`` is carried untouched to :meth:`pop_due`.
    """

    def __init__(self, pairs: Iterable[PairSpec], resources: Iterable[ResourceSpec], *, queue_limit_s: float,
                 epoch_s: float = 0.0) -> None:
        if not queue_limit_s > 0:
            raise SpecError(f"must be > 0, got {queue_limit_s!r}", field="queue_limit_s")
        self.queue_limit_s = queue_limit_s
        resources = tuple(resources)
        self._resources = {r.name: _Resource(r.bandwidth_bytes_per_s) for r in resources}
        self._pairs: dict[tuple[int, int], _Pair] = {}
        for p in pairs:
            if p.resource not in self._resources:
                raise SpecError(f"pair {p.src}->{p.dst} names unknown resource {p.resource!r}", field="pairs.resource")
            self._pairs[(p.src, p.dst)] = _Pair(p.latency_s, self._resources[p.resource])
        self._specs = resources
        self._changes: list[tuple[float, str, float]] = []
        self._schedule_traces(epoch_s)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.unroutable = 0

    # -- packets -------------------------------------------------------------------------
    def offer(self, src: int, dst: int, nbytes: int, now: float, payload: Any = None) -> float | None:
        """Queue a packet that arrived at ``now``; its release time, or ``None`` when dropped."""
        pair = self._pairs.get((src, dst))
        if pair is None:
            self.unroutable += 1
            return None
        res = pair.resource
        start = res.free_at if res.free_at > now else now
        wait = start - now
        if wait > self.queue_limit_s:
            res.dropped += 1
            return None
        if wait > res.max_backlog_s:
            res.max_backlog_s = wait
        res.free_at = start + nbytes / res.bandwidth_bytes_per_s
        res.packets += 1
        res.bytes += nbytes
        release = res.free_at + pair.latency_s
        self._seq += 1
        heapq.heappush(self._heap, (release, self._seq, dst, payload))
        return release

    def pop_due(self, now: float) -> list[tuple[int, Any]]:
        """``(dst, payload)`` of every packet with release time <= ``now``, in release order."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            _, _, dst, payload = heapq.heappop(heap)
            out.append((dst, payload))
        return out

    def next_release_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def next_event_s(self) -> float | None:
        """The earliest of the next release and the next trace change."""
        times = [t for t in (self.next_release_s(), self._changes[-1][0] if self._changes else None) if t is not None]
        return min(times) if times else None

    def __len__(self) -> int:
        return len(self._heap)

    # -- rates ---------------------------------------------------------------------------
    def _schedule_traces(self, epoch_s: float) -> None:
        changes = [(epoch_s + t, r.name, bw) for r in self._specs
                   for t, bw in zip(r.trace_times_s, r.trace_bandwidth_bytes_per_s, strict=True)]
        self._changes = sorted(changes, reverse=True)  # popped from the end, earliest first

    def set_epoch(self, epoch_s: float, now: float) -> list[tuple[str, float]]:
        """Restart the traces from ``epoch_s`` (e.g. the training run's start): every traced
        resource goes back to its nominal rate, then the changes due by ``now`` apply."""
        for r in self._specs:
            if r.trace_times_s:
                self._resources[r.name].bandwidth_bytes_per_s = r.bandwidth_bytes_per_s
        self._schedule_traces(epoch_s)
        return self.advance(now)

    def advance(self, now: float) -> list[tuple[str, float]]:
        """Apply the trace changes due by ``now``; returns ``(resource, rate)`` applied."""
        applied = []
        while self._changes and self._changes[-1][0] <= now:
            _, name, bw = self._changes.pop()
            self._resources[name].bandwidth_bytes_per_s = bw
            applied.append((name, bw))
        return applied

    def set_bandwidth(self, resource: str, bandwidth_bytes_per_s: float) -> None:
        """New rate for packets offered from now on (queued packets keep their times)."""
        if resource not in self._resources:
            raise SpecError(f"unknown resource {resource!r} (have {sorted(self._resources)})", field="resource")
        if not bandwidth_bytes_per_s > 0:
            raise SpecError(f"must be > 0, got {bandwidth_bytes_per_s!r}", field="bandwidth_bytes_per_s")
        self._resources[resource].bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)

    def set_latency(self, src: int, dst: int, latency_s: float) -> None:
        if (src, dst) not in self._pairs:
            raise SpecError(f"no pair {src}->{dst}", field="pairs")
        if not latency_s >= 0:
            raise SpecError(f"must be >= 0, got {latency_s!r}", field="latency_s")
        self._pairs[(src, dst)].latency_s = float(latency_s)

    def stats(self) -> RelayStats:
        return RelayStats(
            resources=tuple(ResourceStats(name=n, bandwidth_bytes_per_s=r.bandwidth_bytes_per_s, packets=r.packets,
                                          bytes=r.bytes, dropped=r.dropped, max_backlog_s=r.max_backlog_s)
                            for n, r in sorted(self._resources.items())),
            unroutable=self.unroutable, queued=len(self._heap),
        )


# -- the relay process ------------------------------------------------------------------


# [Note: TUN offload]
# With IFF_VNET_HDR and TUNSETOFFLOAD(CSUM | TSO4 | TSO6) the TUN device looks like a NIC
# with segmentation offload: TCP hands the relay "super-packets" of up to 64 kB, each behind
# a 10-byte virtio-net header (flags, gso_type, hdr_len, gso_size, csum_start, csum_offset;
# little-endian), and the relay writes the same bytes into the destination device, whose
# kernel accepts them like a GRO-merged packet. TCP still runs with the MTU's segment size
# (its windows, slow start and ACK clocking are those of MSS-sized segments), but the relay
# moves several segments per system call, which cuts its CPU per byte several-fold. The
# shaping charges the bytes the segments would put on the wire: every segment after the
# first repeats the IP and TCP headers (:func:`wire_bytes`).


def ipv4_destination(packet: bytes, offset: int = 0) -> bytes | None:
    """The 4-byte destination address of the IPv4 packet at ``offset``, or ``None`` for anything else."""
    if len(packet) < offset + 20 or packet[offset] >> 4 != 4:
        return None
    return packet[offset + 16:offset + 20]


def wire_bytes(packet: bytes, vnet_hdr_bytes: int) -> int:
    """Bytes the packet occupies on the wire once cut into MSS-sized segments ([Note: TUN offload])."""
    n = len(packet) - vnet_hdr_bytes
    if vnet_hdr_bytes == 0 or packet[1] == 0:  # no header, or gso_type NONE: one segment
        return n
    gso_size = packet[4] | packet[5] << 8
    ip = vnet_hdr_bytes
    if gso_size == 0 or len(packet) < ip + 40 or packet[ip] >> 4 != 4:
        return n
    headers = (packet[ip] & 0x0F) * 4 + (packet[ip + (packet[ip] & 0x0F) * 4 + 12] >> 4) * 4
    segments = -(-(n - headers) // gso_size)
    return n + max(0, segments - 1) * headers


def _handle_control(sock: socket.socket, queue: WanQueue, stats: Callable[[], RelayStats]) -> bool:
    """Serve the pending control requests; returns False on ``stop``."""
    keep = True
    while True:
        try:
            data, addr = sock.recvfrom(65536)
        except BlockingIOError:
            return keep
        reply: dict[str, Any] = {"ok": True}
        try:
            msg = json.loads(data)
            op = msg.get("op")
            if op == "set_bandwidth":
                queue.set_bandwidth(msg["resource"], float(msg["bandwidth_bytes_per_s"]))
            elif op == "set_latency":
                queue.set_latency(int(msg["src"]), int(msg["dst"]), float(msg["latency_s"]))
            elif op == "set_epoch":
                queue.set_epoch(float(msg["epoch_s"]), time.monotonic())
            elif op == "stop":
                keep = False
            elif op not in ("ping", "stats"):
                raise SpecError(f"unknown op {op!r}")
            reply["stats"] = stats().to_dict()
        except (SpecError, KeyError, ValueError, TypeError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if addr:
            try:
                sock.sendto(json.dumps(reply).encode(), addr)
            except OSError:
                pass  # the client gave up waiting; nothing to tell it


def serve(config: RelayConfig, tun_fds: Sequence[int], *, owner_pid: int | None = None,
          stop: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.monotonic) -> RelayStats:
    """Move packets between ``tun_fds`` (rank order) until a ``stop`` request, ``stop()`` or the owner's death."""
    if len(tun_fds) != len(config.addresses):
        raise SpecError(f"{len(config.addresses)} addresses but {len(tun_fds)} TUN descriptors", field="fds")
    t0, times0 = clock(), os.times()
    queue = WanQueue(config.pairs, config.resources, queue_limit_s=config.queue_limit_s,
                     epoch_s=t0 if config.epoch_s is None else config.epoch_s)
    rank_of_addr = {socket.inet_aton(a): i for i, a in enumerate(config.addresses)}
    rank_of_fd = {fd: i for i, fd in enumerate(tun_fds)}
    hdr = config.vnet_hdr_bytes
    for fd in tun_fds:
        os.set_blocking(fd, False)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ctl.bind(config.control_path)
    ctl.setblocking(False)
    write_errors = 0
    stopping = []

    def stats() -> RelayStats:
        s = queue.stats()
        t = os.times()
        return RelayStats(resources=s.resources, unroutable=s.unroutable, queued=s.queued, wall_s=clock() - t0,
                          cpu_s=t.user + t.system - times0.user - times0.system, system_s=t.system - times0.system,
                          write_errors=write_errors)

    watch = [*tun_fds, ctl.fileno()]
    try:
        while not stopping and not stop():
            now = clock()
            nxt = queue.next_event_s()
            wait = MAX_WAIT_S if nxt is None else min(MAX_WAIT_S, max(0.0, nxt - now))
            ready, _, _ = select.select(watch, [], [], wait)
            now = clock()
            queue.advance(now)
            for fd in ready:
                src = rank_of_fd.get(fd)
                if src is None:
                    if not _handle_control(ctl, queue, stats):
                        stopping.append(True)
                    continue
                for _ in range(READ_BURST):
                    try:
                        pkt = os.read(fd, PACKET_MAX_BYTES)
                    except BlockingIOError:
                        break
                    dst = rank_of_addr.get(ipv4_destination(pkt, hdr) or b"")
                    if dst is None:
                        queue.unroutable += 1
                    else:
                        queue.offer(src, dst, wire_bytes(pkt, hdr), now, pkt)
            for dst, pkt in queue.pop_due(clock() + RELEASE_SLACK_S):
                try:
                    os.write(tun_fds[dst], pkt)
                except OSError:
                    write_errors += 1  # the receiving stack's backlog is full: the packet is lost
            if owner_pid is not None and not ready and os.getppid() != owner_pid:
                log.warning("relay owner %d is gone; stopping", owner_pid)
                break
    finally:
        final = stats()
        ctl.close()
        Path(config.control_path).unlink(missing_ok=True)
    return final


# -- the client side --------------------------------------------------------------------


class RelayControl:
    """Talks to a running relay over its control socket (from any process on this machine)."""

    def __init__(self, control_path: str | Path, *, timeout_s: float = 5.0) -> None:
        self.control_path = str(control_path)
        self.timeout_s = timeout_s

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        # The reply needs a bound client address; a path next to the control socket, removed after.
        client = str(Path(self.control_path).parent / f"c-{os.getpid()}-{secrets.token_hex(4)}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.bind(client)
            try:
                s.settimeout(self.timeout_s)
                s.sendto(json.dumps(msg).encode(), self.control_path)
                reply = json.loads(s.recv(1 << 20))
            except (OSError, TimeoutError) as exc:
                raise RuntimeSetupError(f"relay at {self.control_path} did not answer {msg.get('op')!r} "
                                        f"within {self.timeout_s:g} s: {exc}") from None
            finally:
                Path(client).unlink(missing_ok=True)
        if not reply.get("ok"):
            raise SpecError(f"relay refused {msg}: {reply.get('error')}")
        return reply

    def ping(self) -> RelayStats:
        return RelayStats.from_dict(self._call({"op": "ping"})["stats"])

    def stats(self) -> RelayStats:
        return RelayStats.from_dict(self._call({"op": "stats"})["stats"])

    def set_bandwidth(self, resource: str, bandwidth_bytes_per_s: float) -> None:
        """Change ``resource``'s rate now (a live bandwidth change; queued packets keep their times)."""
        self._call({"op": "set_bandwidth", "resource": resource, "bandwidth_bytes_per_s": bandwidth_bytes_per_s})

    def set_latency(self, src: int, dst: int, latency_s: float) -> None:
        self._call({"op": "set_latency", "src": src, "dst": dst, "latency_s": latency_s})

    def set_epoch(self, epoch_s: float) -> None:
        """Restart the bandwidth traces at ``epoch_s`` (a ``time.monotonic()`` value of this machine)."""
        self._call({"op": "set_epoch", "epoch_s": epoch_s})

    def stop(self) -> RelayStats:
        """Ask the relay to exit; returns its final counters."""
        return RelayStats.from_dict(self._call({"op": "stop"})["stats"])


PR_SET_PDEATHSIG = 1
PR_SET_TIMERSLACK = 29
TIMER_SLACK_NS = 1000


def _tune_process(die_with_parent: bool) -> None:
    """PR_SET_TIMERSLACK: wake within 1 us of a release time instead of the default 50 us;
    PR_SET_PDEATHSIG: the kernel sends SIGTERM if the parent dies (belt to the owner check)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return  # not Linux/glibc: default timer slack; the loop's owner check still ends the relay
    prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS)
    if die_with_parent:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deepcee-relay", description="user-space WAN relay between TUN devices")
    ap.add_argument("--config", required=True)
    ap.add_argument("--fds", required=True, help="TUN file descriptors in rank order, comma-separated")
    ap.add_argument("--owner", default="", help=f"{OWNER_MARKER}PID: exit when that parent is gone")
    ap.add_argument("--stats-out", default="", help="write the final counters here (JSON)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="relay: %(message)s")
    owner = int(a.owner.removeprefix(OWNER_MARKER)) if a.owner else None
    _tune_process(die_with_parent=owner is not None)
    if owner is not None:
        if os.getppid() != owner:
            return 1  # the owner died before we armed the signal
    try:
        # Its wake-ups are the links' timing: under CPU contention a normal-priority relay releases
        # packets late. It uses a small fraction of a core, so a higher priority costs others little.
        os.nice(RELAY_NICE)
    except OSError:
        log.info("cannot raise the relay's priority (not root?); packet timing may lag under load")
    terminated: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: terminated.append(signum))
    try:
        config = RelayConfig.from_dict(json.loads(Path(a.config).read_text()))
        fds = [int(x) for x in a.fds.split(",")]
        final = serve(config, fds, owner_pid=owner, stop=lambda: bool(terminated))
    except (SpecError, OSError, ValueError, KeyError) as exc:
        print(f"relay: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if a.stats_out:
        tmp = Path(a.stats_out + ".tmp")
        tmp.write_text(json.dumps(final.to_dict()))
        tmp.replace(a.stats_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
