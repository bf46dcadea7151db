"""The relay's shaping rule, its configuration and its counters (pure: no I/O, no clock of its own).

:class:`WanQueue` gives each packet offered on a directed rank pair its release time

    start   = max(arrival, resource free)        # FIFO per link resource
    free    = start + len / bandwidth            # the resource is busy while it serialises
    release = free + latency                     # then the packet propagates

where latency is the pair's (``Link.latency_s``) and bandwidth is that of the pair's
*resource* (``Link.resource``, [Note: link resources] in :mod:`deepcee.cluster`): pairs that
share a resource share one FIFO and one rate. A packet that would wait more than
``queue_limit_s`` before its serialisation starts is dropped (drop-tail, like a router
buffer of ``queue_limit_s x bandwidth`` bytes), so TCP sees losses instead of an unbounded
queue. Released packets leave through one priority queue (heap) ordered by release time.
Bandwidth traces apply at their change times (seconds after ``epoch_s``); rates and
latencies can also be set at any time; packets already queued keep the times they were
given (they are "on the wire"). A pair can be *down* (a dead link: fault injection, from
windows in its spec, seconds after ``epoch_s`` like the traces, or set live): every packet
offered on it meanwhile is dropped and counted with the resource's drops, so TCP over it
stalls in retransmissions as over a cut cable.

:class:`RelayConfig` is what the relay process reads (JSON, ``schema_version`` 1);
:class:`RelayStats` is what it reports. The process around this core is
:mod:`deepcee.runtime.realnet.relay`. Standard library and :mod:`deepcee.errors` only.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from deepcee.errors import SpecError

CONFIG_FORMAT = "deepcee.relay-config"
SCHEMA_VERSION = 1

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
    down_s: tuple[tuple[float, float | None], ...] = ()
    """Windows ``(start, stop)`` (seconds after the relay's epoch; ``stop`` ``None``: never back)
    in which the pair drops every packet (a dead link)."""

    def __post_init__(self) -> None:
        if self.src == self.dst or self.src < 0 or self.dst < 0:
            raise SpecError(f"pair needs two different ranks >= 0, got {self.src!r} -> {self.dst!r}", field="pairs")
        for w in self.down_s:
            if len(w) != 2 or not (w[0] >= 0 and (w[1] is None or w[1] > w[0])):
                raise SpecError(f"pair {self.src}->{self.dst}: down windows need 0 <= start < stop, got {w!r}",
                                field="pairs.down_s")
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
            "pairs": [{"src": p.src, "dst": p.dst, "latency_s": p.latency_s, "resource": p.resource,
                       **({"down_s": [list(w) for w in p.down_s]} if p.down_s else {})} for p in self.pairs],
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
            pairs=tuple(PairSpec(**{**p, "down_s": tuple(tuple(w) for w in p.get("down_s", ()))})
                        for p in d["pairs"]),
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
    down_s: tuple[tuple[float, float | None], ...] = ()
    """Windows relative to the queue's epoch (see :class:`PairSpec`)."""
    down_now: bool = False
    """Set live (:meth:`WanQueue.set_down`)."""

    def is_down(self, t_s: float) -> bool:
        """Whether the pair drops packets at ``t_s`` seconds after the epoch."""
        return self.down_now or any(a <= t_s and (b is None or t_s < b) for a, b in self.down_s)


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
                 epoch_s: float = 0.0, down_armed: bool = True) -> None:
        if not queue_limit_s > 0:
            raise SpecError(f"must be > 0, got {queue_limit_s!r}", field="queue_limit_s")
        self.queue_limit_s = queue_limit_s
        resources = tuple(resources)
        self._resources = {r.name: _Resource(r.bandwidth_bytes_per_s) for r in resources}
        self._pairs: dict[tuple[int, int], _Pair] = {}
        for p in pairs:
            if p.resource not in self._resources:
                raise SpecError(f"pair {p.src}->{p.dst} names unknown resource {p.resource!r}", field="pairs.resource")
            self._pairs[(p.src, p.dst)] = _Pair(p.latency_s, self._resources[p.resource], p.down_s)
        self._specs = resources
        self._epoch_s = epoch_s
        self._down_armed = down_armed
        """Whether the pairs' down windows apply yet: they count from a training run's start, so a
        relay whose epoch is its own start applies them only once a run sets it (:meth:`set_epoch`)."""
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
        if pair.down_now or (pair.down_s and self._down_armed):
            if pair.is_down(now - self._epoch_s):
                res.dropped += 1
                return None
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
        """Restart the traces (and the pairs' down windows) from ``epoch_s`` (e.g. the training
        run's start): every traced resource goes back to its nominal rate, then the changes due
        by ``now`` apply."""
        for r in self._specs:
            if r.trace_times_s:
                self._resources[r.name].bandwidth_bytes_per_s = r.bandwidth_bytes_per_s
        self._epoch_s, self._down_armed = epoch_s, True
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

    def set_down(self, src: int, dst: int, down: bool) -> None:
        """Cut the pair now (every packet offered on it is dropped) or bring it back."""
        if (src, dst) not in self._pairs:
            raise SpecError(f"no pair {src}->{dst}", field="pairs")
        self._pairs[(src, dst)].down_now = bool(down)

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
