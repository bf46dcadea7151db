"""The cluster: devices and the network between them, and the queries the rest of deepcee asks.

Torch-free. :class:`Cluster` holds the parts (:mod:`deepcee.cluster.parts`) as given, checks
on construction that they refer to each other correctly, and answers lookups and link queries
from its :class:`~deepcee.cluster.routing.ClusterIndex`. Files are read and written by
:mod:`deepcee.cluster.files`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from deepcee.cluster.parts import Device, DeviceKind, Island, Link, LinkEntry, Node
from deepcee.cluster.routing import ClusterIndex, build_index, resolve_link
from deepcee.cluster.writer import cluster_to_dict
from deepcee.errors import ClusterSpecError


class ClusterView:
    """:meth:`Cluster.view_key`'s value: its parts, hashed once (they hold every device of a plan)."""

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ClusterView) and self._hash == other._hash
                                 and self.parts == other.parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Devices and the network between them. Build with :func:`~deepcee.cluster.load_cluster` or directly."""

    name: str
    kinds: Mapping[str, DeviceKind]
    """Kind name -> kind."""
    islands: tuple[Island, ...]
    nodes: tuple[Node, ...]
    devices: tuple[Device, ...]
    """In file order (the order of reports; see :meth:`topology_key` for ring order)."""
    links: tuple[LinkEntry, ...] = ()
    """Explicit ``[[links]]`` entries; see [Note: link resources] in :mod:`deepcee.cluster`."""
    description: str = ""
    emulation: str = ""
    """Non-empty when figures for this cluster come from emulation: says how (shown in reports)."""
    source: str = ""
    """File this cluster was loaded from, for error messages."""
    _index: ClusterIndex = field(init=False, repr=False, compare=False)
    """Lookup tables built from the fields above; see :class:`~deepcee.cluster.routing.ClusterIndex`."""

    def __post_init__(self) -> None:
        index = build_index(kinds=self.kinds, islands=self.islands, nodes=self.nodes, devices=self.devices,
                            links=self.links, source=self.source)
        object.__setattr__(self, "_index", index)  # frozen: the one field set after __init__

    # -- lookups -------------------------------------------------------------------------
    def device(self, name: str) -> Device:
        try:
            return self._index.devices[name]
        except KeyError:
            raise ClusterSpecError(f"unknown device {name!r}", file=self.source or None) from None

    def node(self, name: str) -> Node:
        return self._index.nodes[name]

    def topology_key(self, device: str) -> tuple[int, str, int]:
        """Sort key that keeps the devices of an island, then of a node, together."""
        return self._index.order[device]

    def kind_of(self, device: str) -> DeviceKind:
        return self.kinds[self.device(device).kind]

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    def effective_flops_per_s(self, device: str) -> float:
        d = self.device(device)
        return self.kinds[d.kind].effective_flops_per_s / d.slowdown

    def memory_bytes(self, device: str) -> float:
        return self.kind_of(device).memory_bytes

    def island_devices(self) -> dict[str, tuple[str, ...]]:
        """Island name -> its devices, in file order."""
        out: dict[str, list[str]] = {i.name: [] for i in self.islands}
        for d in self.devices:
            out[d.island].append(d.name)
        return {k: tuple(v) for k, v in out.items() if v}

    def node_devices(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for d in self.devices:
            out[d.node].append(d.name)
        return {k: tuple(v) for k, v in out.items() if v}

    def view_key(self, devices: Iterable[str]) -> ClusterView:
        """What a plan on ``devices`` sees of this cluster ([Note: cluster views]): equal keys of
        two clusters (and one model) give any plan on these devices the same figures."""
        devs = frozenset(devices)
        memo = self._index.views
        got = memo.get(devs)
        if got is None:
            index = self._index
            dev = tuple(self.device(d) for d in sorted(devs, key=self.topology_key))
            nodes = sorted({d.node for d in dev})
            islands = sorted({d.island for d in dev})
            names = devs | set(nodes) | set(islands)
            explicit = tuple(sorted(((k, v) for k, v in index.explicit.items() if k[0] in names and k[1] in names),
                                    key=lambda kv: kv[0]))
            # a path matters only between islands without their own entry (link resolution)
            routes = tuple((r, tuple(index.explicit[hop] for hop in zip(r, r[1:], strict=False)))
                           for r in (index.island_routes[p, q] for p in islands for q in islands
                                     if p != q and (p, q) not in index.explicit))
            got = memo[devs] = ClusterView((dev, tuple(sorted(self.kinds.items())), tuple(index.nodes[n] for n in nodes),
                                            tuple(index.islands[i] for i in islands), explicit, routes, self.emulation))
        return got

    # -- links ---------------------------------------------------------------------------
    def link(self, src: str, dst: str) -> Link:
        """The resolved directed link from device ``src`` to device ``dst``."""
        memo = self._index.resolved
        key = (src, dst)
        link = memo.get(key)  # one lookup: the planner asks ~10^5-10^6 times per plan at 512 devices
        if link is not None:
            return link
        a, b = self.device(src), self.device(dst)
        if src == dst:
            raise ClusterSpecError(f"no link from device {src!r} to itself")
        memo[key] = link = resolve_link(self._index, a, b)
        return link

    # -- derived clusters ----------------------------------------------------------------
    def subset(self, device_names: Iterable[str]) -> Cluster:
        """The same cluster restricted to ``device_names`` (links unchanged).

        Every island stays, those left without devices too: a route between two kept islands
        may pass through an island whose devices are all left out (us-east to an edge site
        through eu-west), and the restricted cluster must resolve it as the full one does."""
        keep = set(device_names)
        devices = tuple(d for d in self.devices if d.name in keep)
        nodes_kept = {d.node for d in devices}
        names = keep | nodes_kept | {i.name for i in self.islands}
        return Cluster(
            name=self.name,
            kinds=self.kinds,
            islands=self.islands,
            nodes=tuple(n for n in self.nodes if n.name in nodes_kept),
            devices=devices,
            links=tuple(e for e in self.links if e.a in names and e.b in names),
            description=self.description,
            emulation=self.emulation,
            source=self.source,
        )

    def with_links(self, extra: Iterable[LinkEntry]) -> Cluster:
        """A copy where ``extra`` link entries override existing ones between the same ends."""
        extra = tuple(extra)
        ends = {(e.a, e.b) for e in extra} | {(e.b, e.a) for e in extra if not e.directed}
        kept = tuple(e for e in self.links if (e.a, e.b) not in ends)
        return Cluster(
            name=self.name,
            kinds=self.kinds,
            islands=self.islands,
            nodes=self.nodes,
            devices=self.devices,
            links=kept + extra,
            description=self.description,
            emulation=self.emulation,
            source=self.source,
        )

    def to_dict(self) -> dict[str, Any]:
        """The machine-written JSON form (``deepcee.cluster`` v1); see :func:`~deepcee.cluster.cluster_to_dict`."""
        return cluster_to_dict(self)
