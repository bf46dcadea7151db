"""A cluster's lookup tables and the resolution of a device pair to its link.

Torch-free. :func:`build_index` checks that the parts of a cluster refer to each other
correctly and builds the :class:`ClusterIndex` once, when the cluster is made;
:func:`resolve_link` applies the resolution order and the resource rules of
[Note: link resources] in :mod:`deepcee.cluster`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepcee.cluster.parts import Device, DeviceKind, Island, Link, LinkEntry, LinkSpec, Node
from deepcee.errors import ClusterSpecError

if TYPE_CHECKING:
    from deepcee.cluster.model import ClusterView

ROUTE_PROBE_BYTES = 1e6
"""Island paths are chosen by the transfer time of this many bytes (latencies add)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterIndex:
    """The lookup tables of one cluster (built by :func:`build_index`)."""

    devices: Mapping[str, Device]
    """Device name -> device."""
    nodes: Mapping[str, Node]
    """Node name -> node."""
    islands: Mapping[str, Island]
    """Island name -> island."""
    explicit: Mapping[tuple[str, str], LinkSpec]
    """``(a, b)`` -> spec of the ``[[links]]`` entry from ``a`` to ``b`` (island, node or device
    names). An undirected entry also gives ``(b, a)`` unless an earlier entry set it; a later
    entry with the same ``(a, b)`` replaces an earlier one."""
    order: Mapping[str, tuple[int, str, int]]
    """Device -> ``(island position in the file, node name, device position in the file)``:
    the ring and report order, which keeps an island's, then a node's, devices together."""
    island_routes: Mapping[tuple[str, str], tuple[str, ...]]
    """``(src island, dst island)`` -> the islands on the path with the least transfer time
    of :data:`ROUTE_PROBE_BYTES`, both ends included, for every ordered pair of islands that
    hold devices. Used only for device pairs that no ``[[links]]`` entry joins."""
    resolved: dict[tuple[str, str], Link]
    """``(src device, dst device)`` -> resolved link: a memo filled by
    :meth:`~deepcee.cluster.Cluster.link`; with ``views`` the only tables that grow after construction."""
    views: dict[frozenset[str], ClusterView]
    """Device set -> :meth:`~deepcee.cluster.Cluster.view_key` of it: a memo."""


def build_index(*, kinds: Mapping[str, DeviceKind], islands: Sequence[Island], nodes: Sequence[Node],
                devices: Sequence[Device], links: Sequence[LinkEntry], source: str = "") -> ClusterIndex:
    """The tables of a cluster made of these parts; ``source`` (its file) goes into errors.

    Raises :class:`ClusterSpecError` for a cluster without devices, a duplicate name, a name
    that refers to nothing, and islands that no path of ``[[links]]`` entries joins.
    """
    def err(msg: str, fld: str) -> ClusterSpecError:
        return ClusterSpecError(msg, file=source or None, field=fld)

    if not devices:
        raise err("a cluster needs at least one device", "nodes")
    island_by_name: dict[str, Island] = {}
    for i in islands:
        island_by_name.setdefault(i.name, i)  # the first of a name, as link resolution always took
    node_by_name: dict[str, Node] = {}
    for n in nodes:
        if n.name in node_by_name:
            raise err(f"duplicate node name {n.name!r}", "nodes.name")
        if n.island not in island_by_name:
            raise err(f"node {n.name!r} names unknown island {n.island!r}", "nodes.island")
        if n.kind not in kinds:
            raise err(f"node {n.name!r} names unknown kind {n.kind!r}", "nodes.kind")
        node_by_name[n.name] = n
    dev_by_name: dict[str, Device] = {}
    for d in devices:
        if d.name in dev_by_name:
            raise err(f"duplicate device name {d.name!r}", "devices")
        if d.node not in node_by_name:
            raise err(f"device {d.name!r} names unknown node {d.node!r}", "devices.node")
        if d.island != node_by_name[d.node].island:
            raise err(f"device {d.name!r} names island {d.island!r}, its node {d.node!r} is in island "
                      f"{node_by_name[d.node].island!r}", "devices.island")
        if d.kind not in kinds:
            raise err(f"device {d.name!r} names unknown kind {d.kind!r}", "devices.kind")
        dev_by_name[d.name] = d
    named = set(island_by_name) | set(node_by_name) | set(dev_by_name)
    explicit: dict[tuple[str, str], LinkSpec] = {}
    for e in links:
        for end in (e.a, e.b):
            if end not in named:
                raise err(f"link names unknown island, node or device {end!r}", "links.between")
        explicit[(e.a, e.b)] = e.spec
        if not e.directed:
            explicit.setdefault((e.b, e.a), e.spec)
    island_pos = {i.name: k for k, i in enumerate(islands)}
    order = {d.name: (island_pos[d.island], d.node, k) for k, d in enumerate(devices)}
    return ClusterIndex(
        devices=dev_by_name, nodes=node_by_name, islands=island_by_name, explicit=explicit, order=order,
        island_routes=_island_routes(islands, devices, explicit, source), resolved={}, views={},
    )


def _island_routes(islands: Sequence[Island], devices: Sequence[Device],
                   explicit: Mapping[tuple[str, str], LinkSpec], source: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """Shortest island paths (Dijkstra on transfer time) between the islands that hold devices.

    A path may pass through any island, one without devices too: a cluster restricted to some
    devices (:meth:`~deepcee.cluster.Cluster.subset`, the relaxed search's replicas, the
    adapter's plan without a lost device) keeps every island, so its routes are the full
    cluster's. Only islands with devices must be joined."""
    every = list(dict.fromkeys(i.name for i in islands))
    held = {d.island for d in devices}
    names = [i for i in every if i in held]
    routes: dict[tuple[str, str], tuple[str, ...]] = {}
    for src in names:
        prev = _shortest_from(src, every, explicit)
        for dst in names:
            if dst == src:
                continue
            if dst not in prev:
                a = next(d.name for d in devices if d.island == src)
                b = next(d.name for d in devices if d.island == dst)
                raise ClusterSpecError(
                    f"no path between devices {a!r} (island {src!r}) and {b!r} (island {dst!r}); "
                    f"add a [[links]] entry between {src!r} and {dst!r}",
                    file=source or None,
                    field="links",
                )
            path = [dst]
            while path[-1] != src:
                path.append(prev[path[-1]])
            routes[(src, dst)] = tuple(reversed(path))
    return routes


def _shortest_from(src: str, names: Sequence[str], explicit: Mapping[tuple[str, str], LinkSpec]) -> dict[str, str]:
    """Island -> its predecessor on the quickest path from ``src``, for every island reached."""
    dist = {src: 0.0}
    prev: dict[str, str] = {}
    heap = [(0.0, src)]
    while heap:
        t, u = heapq.heappop(heap)
        if t > dist.get(u, float("inf")):
            continue
        for v in names:
            spec = explicit.get((u, v)) if u != v else None
            if spec is None:
                continue
            nt = t + spec.latency_s + ROUTE_PROBE_BYTES / spec.bandwidth_bytes_per_s
            if nt < dist.get(v, float("inf")):
                dist[v], prev[v] = nt, u
                heapq.heappush(heap, (nt, v))
    return prev


def resolve_link(index: ClusterIndex, a: Device, b: Device) -> Link:
    """The directed link from device ``a`` to device ``b`` (two different devices).

    Most specific first: a ``[[links]]`` entry naming the two devices, the two nodes, then
    the two islands; else the node's intra link, the island's intra link, or the quickest
    island path. See [Note: link resources] in :mod:`deepcee.cluster` for ``resource``.
    """
    spec = _explicit(index, a, b)
    resource = f"{a.node}->{b.node}"
    if spec is None:
        if a.node == b.node:
            spec, resource = index.nodes[a.node].intra, f"{a.name}->{b.name}"
        elif a.island == b.island:
            spec = index.islands[a.island].intra
        else:
            spec, resource = _routed(index, a, b)
    elif a.node == b.node:
        resource = f"{a.name}->{b.name}"
    return Link(src=a.name, dst=b.name, latency_s=spec.latency_s, bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s,
                resource=resource, trace=spec.trace)


def _explicit(index: ClusterIndex, a: Device, b: Device) -> LinkSpec | None:
    for key in ((a.name, b.name), (a.node, b.node), (a.island, b.island)):
        if key in index.explicit and key[0] != key[1]:
            return index.explicit[key]
    return None


def _routed(index: ClusterIndex, a: Device, b: Device) -> tuple[LinkSpec, str]:
    """Spec and resource of the island path: latencies add, the narrowest hop sets the rest."""
    path = index.island_routes[(a.island, b.island)]
    hops = [index.explicit[(u, v)] for u, v in zip(path, path[1:], strict=False)]
    if len(hops) == 1:
        return hops[0], f"{a.node}->{b.node}"
    narrow = min(range(len(hops)), key=lambda i: hops[i].bandwidth_bytes_per_s)
    spec = LinkSpec(
        latency_s=sum(h.latency_s for h in hops),
        bandwidth_bytes_per_s=hops[narrow].bandwidth_bytes_per_s,
        trace=hops[narrow].trace,
    )
    return spec, f"{path[narrow]}->{path[narrow + 1]}"
