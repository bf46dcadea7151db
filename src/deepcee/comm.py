"""The alpha-beta link model and the collective algorithms (torch-free core).

The simulator, the planner's cost model and the runtime's link emulation all read these, so
a transfer or an all-reduce costs the same wherever it is scored or emulated.

**Point to point.** A transfer of ``nbytes`` over a :class:`~deepcee.cluster.Link` takes
``latency_s + nbytes / bandwidth_bytes_per_s`` (:meth:`deepcee.cluster.Link.transfer_time_s`);
on a link with a :class:`~deepcee.cluster.BandwidthTrace` the serialisation is integrated
over the trace (:func:`serialise_end_s`): a transfer that straddles a bandwidth change pays
the old rate before it and the new one after. Transfers that share a link ``resource`` (see
[Note: link resources] in :mod:`deepcee.cluster`) queue first in, first out; the queue is
kept by whoever runs the transfers (the simulator, the emulation's ledger).

**Collectives** (gradient synchronisation of one stage; :func:`allreduce_s`).
Ring all-reduce over ``k`` devices in ring order: ``2 (k-1)`` steps; in each step every
device sends ``nbytes / k`` to its successor at the same time. Ring edges that map to the
same link resource share its bandwidth, so a step takes ``max over resources (max latency of
its edges + edges x chunk / bandwidth)``. ZeRO-2 (reduce-scatter of gradients + all-gather of
parameters) moves the same bytes as a ring all-reduce.

Hierarchical all-reduce: reduce-scatter inside each node, an all-reduce across nodes (one
ring per local rank; they all share the node-pair pipes, so the bytes per pipe equal a
leader ring over the full gradient), all-gather inside each node.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from deepcee.cluster import BandwidthTrace, Cluster


def serialise_end_s(start_s: float, nbytes: float, bandwidth_bytes_per_s: float,
                    trace: BandwidthTrace | None) -> float:
    """When ``nbytes`` started at ``start_s`` finish serialising on a (traced) pipe."""
    if trace is None:
        return start_s + nbytes / bandwidth_bytes_per_s
    t, left = start_s, nbytes
    while True:
        rate = trace.bandwidth_at(t, bandwidth_bytes_per_s)
        change = trace.next_change_after(t)
        if change is None or t + left / rate <= change:
            return t + left / rate
        left -= (change - t) * rate
        t = change


def ring_order(cluster: Cluster, devices: Sequence[str]) -> list[str]:
    """Devices ordered so the ring crosses each island and node boundary as rarely as possible."""
    return sorted(devices, key=cluster.topology_key)


def ring_step_s(cluster: Cluster, ring: Sequence[str], chunk_bytes: float, at_s: float = 0.0) -> float:
    """Time of one ring step in which every device sends ``chunk_bytes`` to its successor."""
    return _step_s(_ring_pipes(cluster, ring, at_s), chunk_bytes)


def _ring_pipes(cluster: Cluster, ring: Sequence[str], at_s: float) -> list[tuple[float, int, float]]:
    """Per link resource a ring step uses: (largest latency of its edges, edges, bandwidth at ``at_s``)."""
    per_resource: dict[str, list] = defaultdict(list)
    k = len(ring)
    for i in range(k):
        link = cluster.link(ring[i], ring[(i + 1) % k])
        per_resource[link.resource].append(link)
    return [(max(lk.latency_s for lk in links), len(links), links[0].bandwidth_at(at_s))
            for links in per_resource.values()]


def _step_s(pipes: Sequence[tuple[float, int, float]], chunk_bytes: float) -> float:
    step = 0.0
    for latency, edges, bw in pipes:
        step = max(step, latency + edges * chunk_bytes / bw)
    return step


def ring_allreduce_s(cluster: Cluster, devices: Sequence[str], nbytes: float, at_s: float = 0.0) -> float:
    k = len(devices)
    if k <= 1 or nbytes <= 0:
        return 0.0
    ring = ring_order(cluster, devices)
    return 2 * (k - 1) * ring_step_s(cluster, ring, nbytes / k, at_s)


def hierarchical_allreduce_s(cluster: Cluster, devices: Sequence[str], nbytes: float, at_s: float = 0.0) -> float:
    k = len(devices)
    if k <= 1 or nbytes <= 0:
        return 0.0
    by_node: dict[str, list[str]] = defaultdict(list)
    for d in ring_order(cluster, devices):
        by_node[cluster.device(d).node].append(d)
    intra = 0.0
    for members in by_node.values():
        if len(members) > 1:
            kn = len(members)
            # reduce-scatter then all-gather: (kn-1) steps each, chunk nbytes/kn
            intra = max(intra, 2 * (kn - 1) * ring_step_s(cluster, members, nbytes / kn, at_s))
    leaders = [members[0] for members in by_node.values()]
    inter = ring_allreduce_s(cluster, leaders, nbytes, at_s)
    return intra + inter


def allreduce_s(cluster: Cluster, devices: Sequence[str], nbytes: float, sync: str, at_s: float = 0.0) -> float:
    """Gradient synchronisation time of one stage for a plan's ``sync`` strategy."""
    if sync == "none" or len(devices) <= 1:
        return 0.0
    if sync == "allreduce-hier":
        return hierarchical_allreduce_s(cluster, devices, nbytes, at_s)
    # allreduce-ring and zero2 move the same bytes in the same ring pattern
    return ring_allreduce_s(cluster, devices, nbytes, at_s)


def allreduce_curve_s(cluster: Cluster, devices: Sequence[str], sizes: Sequence[float], sync: str,
                      at_s: float = 0.0) -> list[float]:
    """:func:`allreduce_s` of each of ``sizes`` bytes (the same figures; the ring's links are
    looked up once for all sizes)."""
    k = len(devices)
    if sync == "none" or k <= 1:
        return [0.0] * len(sizes)
    if sync != "allreduce-hier":
        pipes = _ring_pipes(cluster, ring_order(cluster, devices), at_s)
        return [2 * (k - 1) * _step_s(pipes, x / k) if x > 0 else 0.0 for x in sizes]
    by_node: dict[str, list[str]] = defaultdict(list)
    for d in ring_order(cluster, devices):
        by_node[cluster.device(d).node].append(d)
    nodes = [(len(m), _ring_pipes(cluster, m, at_s)) for m in by_node.values() if len(m) > 1]
    leaders = [members[0] for members in by_node.values()]
    kl = len(leaders)
    ring = _ring_pipes(cluster, ring_order(cluster, leaders), at_s) if kl > 1 else []
    out = []
    for x in sizes:
        if x <= 0:
            out.append(0.0)
            continue
        intra = 0.0
        for kn, pipes in nodes:
            intra = max(intra, 2 * (kn - 1) * _step_s(pipes, x / kn))
        out.append(intra + (2 * (kl - 1) * _step_s(ring, x / kl) if kl > 1 else 0.0))
    return out


def best_sync(cluster: Cluster, devices: Sequence[str], nbytes: float) -> tuple[str, float]:
    """The faster of ring and hierarchical all-reduce for these devices."""
    ring = ring_allreduce_s(cluster, devices, nbytes)
    hier = hierarchical_allreduce_s(cluster, devices, nbytes)
    return ("allreduce-hier", hier) if hier < ring else ("allreduce-ring", ring)
