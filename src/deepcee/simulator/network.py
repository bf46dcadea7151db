"""The shared network and the message graphs of synchronisation across replicas (torch-free).

The simulator of replicated plans (:mod:`deepcee.simulator.replicas`) runs on one clock with
an event loop (:class:`Loop`, events in time order, ties first come first served). Everything
that crosses between replicas goes through one :class:`Network`:

- **point-to-point messages** (parameter-server pushes and pulls, the gathers and scatters of
  averaging) take the alpha-beta time of ``cluster.link(src, dst)`` and queue first in, first
  out on its link ``resource`` (see [Note: link resources] in :mod:`deepcee.cluster`), the
  serialisation integrated over a bandwidth trace (:func:`deepcee.comm.serialise_end_s`).
  Because every message is issued by an event at its own time, the queue order is the issue
  order. Messages between two ranks of one device, and control messages (0 bytes), arrive at
  once;
- **collectives** (an all-reduce over the holders of a layer segment) take
  :func:`deepcee.simulator.engine.allreduce_time_s` at their start (gloo's handshakes included), as the engine and the runtime's emulation
  do, and hold every link resource of their ring for that time: a collective starts when
  those pipes are free and later messages on them queue behind it (two collectives that
  share a pipe run one after the other, which gives the same end for the last of them as
  sharing its bandwidth would);
- **server work** (a parameter server summing pushes, applying an update, a root averaging
  models) queues first in, first out per device (:meth:`Network.work`): a server is one
  process, separate from the device's pipeline compute (see [Note: server ranks] in the
  runtime's ``partition`` module, whose placement this follows).

[Note: message graphs]
One synchronisation (the gradient combination of an exact step, one model average, one
group's average, a push or a pull) is a :class:`Graph` of :class:`Node` s. A node belongs to a
device; it *fires* once it has received ``needs`` messages and not before ``ready_s``, then
does its ``work_s`` (on the device's server queue when ``queued``; a ``collective`` node runs
the collective instead), and then sends its messages (``sends``: ``(node, bytes)``, bytes 0 =
a control message). A device's successive synchronisations are chained by control messages,
which is how a rank that holds several segments does them one after another, in layer
order, as the runtime does. A graph is done when every node has fired; ``fired_s`` holds
when each did. A node may be ready before the graph starts (a replica that reached a model
average early sends its copy when it got there, as the runtime's delegates do); the loop
then runs it first, and its messages queue behind whatever the pipes already carry.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deepcee.cluster import Cluster
from deepcee.comm import ring_order, serialise_end_s
from deepcee.simulator.engine import allreduce_time_s
from deepcee.simulator.runtime_model import DEFAULT_RUNTIME, RuntimeModel


class Loop:
    """Events in time order; among equal times, in the order they were scheduled."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._tick = itertools.count().__next__
        self.now = 0.0

    def at(self, t_s: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (t_s, self._tick(), fn))

    def run(self) -> None:
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn(t)


@dataclass(frozen=True, slots=True, kw_only=True)
class NetEvent:
    """One recorded interval of synchronisation: a message, a collective or server work."""

    kind: str
    """``message``, ``collective`` or ``work``."""
    what: str
    """What it was part of (``step 3 segment [0, 4) push``)."""
    where: str
    """Link resource (messages), ``collective`` or the device."""
    start_s: float
    end_s: float
    nbytes: float = 0.0
    src: str = ""
    dst: str = ""
    devices: tuple[str, ...] = ()
    """The devices a collective ran on."""


class Network:
    """Link queues, collective occupancy and server queues shared by all replicas (see the module docstring)."""

    def __init__(self, cluster: Cluster, *, record: bool = False, runtime: RuntimeModel = DEFAULT_RUNTIME) -> None:
        self.cluster, self.record, self.runtime = cluster, record, runtime
        self.free: dict[str, float] = defaultdict(float)
        """Link resource -> when its queue is empty."""
        self.work_free: dict[str, float] = defaultdict(float)
        self.egress_bytes: dict[str, float] = defaultdict(float)
        """Island -> bytes that left it (messages and collectives)."""
        self.events: list[NetEvent] = []
        self._island = {d.name: d.island for d in cluster.devices}

    def send(self, src: str, dst: str, nbytes: float, at_s: float, what: str = "") -> float:
        """Issue a message at ``at_s`` (never earlier than an earlier call); its delivery time."""
        if nbytes <= 0 or src == dst:
            return at_s
        link = self.cluster.link(src, dst)
        begin = max(at_s, self.free[link.resource])
        done = serialise_end_s(begin, nbytes, link.bandwidth_bytes_per_s, link.trace)
        self.free[link.resource] = done
        if self._island[src] != self._island[dst]:
            self.egress_bytes[self._island[src]] += nbytes
        if self.record:
            self.events.append(NetEvent(kind="message", what=what, where=link.resource, start_s=begin,
                                        end_s=done + link.latency_s, nbytes=nbytes, src=src, dst=dst))
        return done + link.latency_s

    def collective(self, devices: Sequence[str], nbytes: float, sync: str, at_s: float, what: str = "") -> float:
        """Run an all-reduce of ``nbytes`` over ``devices`` from ``at_s`` (or once its pipes are
        free); its end."""
        if len(devices) <= 1 or nbytes <= 0 or sync == "none":
            return at_s
        ring = ring_order(self.cluster, devices)
        edges = [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
        resources = {self.cluster.link(a, b).resource for a, b in edges}
        begin = max([at_s, *(self.free[r] for r in resources)])
        # as the engine's stage all-reduce (deepcee's runtime for the cluster: gloo's handshakes on CPU)
        end = begin + allreduce_time_s(self.cluster, devices, nbytes, sync, self.runtime, at_s=begin)
        for r in resources:
            self.free[r] = end
        for island, b in collective_egress(self.cluster, devices, nbytes, sync).items():
            self.egress_bytes[island] += b
        if self.record:
            self.events.append(NetEvent(kind="collective", what=what, where="collective", start_s=begin, end_s=end,
                                        nbytes=nbytes, devices=tuple(devices)))
        return end

    def work(self, device: str, at_s: float, duration_s: float, what: str = "") -> float:
        """Server work of ``duration_s`` on ``device``'s server queue from ``at_s``; its end."""
        begin = max(at_s, self.work_free[device])
        end = begin + duration_s
        self.work_free[device] = end
        if self.record and duration_s > 0:
            self.events.append(NetEvent(kind="work", what=what, where=device, start_s=begin, end_s=end))
        return end


def collective_egress(cluster: Cluster, devices: Sequence[str], nbytes: float, sync: str) -> dict[str, float]:
    """Bytes an all-reduce sends out of each island: a ring moves ``2 (k-1) / k x nbytes`` over
    each of its ``k`` edges; the hierarchical one does that over a ring of one device per node
    (its node-local phases stay inside nodes)."""
    out: dict[str, float] = defaultdict(float)
    if len(devices) <= 1 or nbytes <= 0 or sync == "none":
        return out
    ring = ring_order(cluster, devices)
    if sync == "allreduce-hier":
        seen: dict[str, str] = {}
        for d in ring:
            seen.setdefault(cluster.device(d).node, d)
        ring = list(seen.values())
    k = len(ring)
    if k <= 1:
        return out
    for i in range(k):
        a, b = cluster.device(ring[i]), cluster.device(ring[(i + 1) % k])
        if a.island != b.island:
            out[a.island] += 2 * (k - 1) / k * nbytes
    return out


@dataclass(slots=True)
class Node:
    """One participant's part of a synchronisation. See [Note: message graphs]."""

    device: str
    what: str = ""
    needs: int = 0
    ready_s: float = 0.0
    work_s: float = 0.0
    queued: bool = False
    """Work on the device's server queue (else the node's own time: an optimizer step)."""
    collective: tuple[tuple[str, ...], float, str] | None = None
    """``(devices, bytes, sync)``: fire runs this all-reduce instead of ``work_s``."""
    sends: list[tuple[int, float]] = field(default_factory=list)
    got: int = 0
    latest_s: float = float("-inf")
    fired_s: float | None = None


class Graph:
    """A set of nodes run on a loop and a network; ``on_done`` gets the graph when all fired."""

    def __init__(self, loop: Loop, net: Network, on_done: Callable[[Graph], None] | None = None) -> None:
        self.loop, self.net, self.on_done = loop, net, on_done
        self.nodes: list[Node] = []
        self._left = 0
        self.on_fire: dict[int, Callable[[float], None]] = {}
        """Node index -> called with the node's fire time (after its work)."""

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def link(self, a: int, b: int, nbytes: float = 0.0) -> None:
        """``a`` sends ``nbytes`` to ``b`` when it fires (0: a control message)."""
        self.nodes[a].sends.append((b, nbytes))
        self.nodes[b].needs += 1

    def start(self) -> None:
        self._left = len(self.nodes)
        if not self.nodes and self.on_done is not None:
            self.on_done(self)
        for i, n in enumerate(self.nodes):
            if n.needs == 0:
                self.loop.at(n.ready_s, lambda t, i=i: self._fire(i, t))

    def _deliver(self, i: int, t: float) -> None:
        n = self.nodes[i]
        n.got += 1
        n.latest_s = max(n.latest_s, t)
        if n.got == n.needs:
            self.loop.at(max(n.latest_s, n.ready_s), lambda t2, i=i: self._fire(i, t2))

    def _fire(self, i: int, t: float) -> None:
        n, net = self.nodes[i], self.net
        if n.collective is not None:
            devices, nbytes, sync = n.collective
            end = net.collective(devices, nbytes, sync, t, n.what)
        elif n.queued:
            end = net.work(n.device, t, n.work_s, n.what)
        else:
            end = t + n.work_s
        if end > t:
            self.loop.at(end, lambda t2, i=i: self._sent(i, t2))
        else:
            self._sent(i, t)

    def _sent(self, i: int, t: float) -> None:
        n = self.nodes[i]
        n.fired_s = t
        for j, nbytes in n.sends:
            dst = self.nodes[j].device
            arrive = self.net.send(n.device, dst, nbytes, t, n.what) if nbytes > 0 else t
            if arrive > t:
                self.loop.at(arrive, lambda t2, j=j: self._deliver(j, t2))
            else:
                self._deliver(j, t)
        if i in self.on_fire:
            self.on_fire[i](t)
        self._left -= 1
        if self._left == 0 and self.on_done is not None:
            self.on_done(self)


__all__ = ["Graph", "Loop", "NetEvent", "Network", "Node", "collective_egress"]
