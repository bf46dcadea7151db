"""Cluster data model: device kinds, devices, nodes, islands and the links between them.

Torch-free. Units are SI inside (seconds, bytes, bytes/s, FLOP/s); files use the units in
their key names (``latency_ms``, ``bandwidth_mbit_per_s``, ``peak_tflops``, ``memory_gib``)
and :mod:`deepcee.units` converts at the edge.

Link model (alpha-beta): ``time = latency_s + bytes / bandwidth_bytes_per_s``.

[Note: link resources]
A *link* is directed and device-to-device, but the thing that is shared by concurrent
transfers is its ``resource``: inside a node each device pair has its own pipe
(NVLink/PCIe); between nodes every pair of nodes has one pipe per direction, shared by all
devices of those two nodes (a server's WAN uplink is shaped per destination). The simulator
and the upper bound share bandwidth per resource.

Link resolution, most specific first: an explicit ``[[links]]`` entry naming the two devices,
then the two nodes, then the two islands; otherwise the node's intra link (same node), or
the island's intra link (same island). Islands without a direct entry are joined through
the path with the least transfer time for 1 MB (latencies add, the narrowest hop sets the
bandwidth and the resource). Islands that no path joins are an error.
"""

from __future__ import annotations

import bisect
import heapq
import json
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcee.errors import ClusterSpecError
from deepcee.units import GIB, rate_field_to_bytes_per_s, time_field_to_s

SCHEMA_VERSION = 1


def _positive(value: float, what: str, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterSpecError(f"{what} must be a number {bound}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceKind:
    """One model of accelerator, from its datasheet or from measurement."""

    name: str
    peak_flops_per_s: float
    """Peak dense FLOP/s in the training dtype (datasheet)."""
    memory_bytes: float
    """Device memory usable by training."""
    achievable_fraction: float = 0.4
    """Fraction of peak that training kernels reach; compute time = FLOPs / (peak x this)."""
    per_layer_overhead_s: float = 20e-6
    """Fixed cost per layer per pass (kernel launches), independent of microbatch size."""
    source: str = ""
    """Where the numbers come from (shown in reports)."""

    def __post_init__(self) -> None:
        _positive(self.peak_flops_per_s, f"kind {self.name!r}: peak_flops_per_s")
        _positive(self.memory_bytes, f"kind {self.name!r}: memory_bytes")
        _positive(self.per_layer_overhead_s, f"kind {self.name!r}: per_layer_overhead_s", allow_zero=True)
        if not 0 < self.achievable_fraction <= 1:
            raise ClusterSpecError(
                f"kind {self.name!r}: achievable_fraction must be in (0, 1], got {self.achievable_fraction!r}"
            )

    @property
    def effective_flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.achievable_fraction


@dataclass(frozen=True, slots=True, kw_only=True)
class BandwidthTrace:
    """Piecewise-constant bandwidth over time: from ``times_s[i]`` on, ``bandwidth_bytes_per_s[i]``.

    Before ``times_s[0]`` the link's nominal bandwidth holds.
    """

    times_s: tuple[float, ...]
    bandwidth_bytes_per_s: tuple[float, ...]
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.times_s) != len(self.bandwidth_bytes_per_s) or not self.times_s:
            raise ClusterSpecError(
                f"trace {self.name!r}: times_s and bandwidth_bytes_per_s need the same non-zero length, "
                f"got {len(self.times_s)} and {len(self.bandwidth_bytes_per_s)}"
            )
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:], strict=False)):
            raise ClusterSpecError(f"trace {self.name!r}: times_s must increase, got {self.times_s}")
        for bw in self.bandwidth_bytes_per_s:
            _positive(bw, f"trace {self.name!r}: bandwidth_bytes_per_s")

    def bandwidth_at(self, t_s: float, nominal_bytes_per_s: float) -> float:
        i = bisect.bisect_right(self.times_s, t_s) - 1
        return nominal_bytes_per_s if i < 0 else self.bandwidth_bytes_per_s[i]

    def next_change_after(self, t_s: float) -> float | None:
        i = bisect.bisect_right(self.times_s, t_s)
        return self.times_s[i] if i < len(self.times_s) else None

    def scaled(self, factor: float) -> BandwidthTrace:
        """The same trace with every bandwidth multiplied by ``factor``."""
        return BandwidthTrace(
            times_s=self.times_s,
            bandwidth_bytes_per_s=tuple(b * factor for b in self.bandwidth_bytes_per_s),
            name=self.name,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """Latency and bandwidth of one pipe (one direction)."""

    latency_s: float
    bandwidth_bytes_per_s: float
    trace: BandwidthTrace | None = None

    def __post_init__(self) -> None:
        _positive(self.latency_s, "latency_s", allow_zero=True)
        _positive(self.bandwidth_bytes_per_s, "bandwidth_bytes_per_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A resolved directed device-to-device path. See [Note: link resources]."""

    src: str
    dst: str
    latency_s: float
    bandwidth_bytes_per_s: float
    resource: str
    """Identity of the shared pipe; transfers with the same resource share its bandwidth."""
    trace: BandwidthTrace | None = None

    def transfer_time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def bandwidth_at(self, t_s: float) -> float:
        if self.trace is None:
            return self.bandwidth_bytes_per_s
        return self.trace.bandwidth_at(t_s, self.bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    name: str
    kind: str
    node: str
    island: str
    slowdown: float = 1.0
    """Compute time multiplier relative to the kind (emulated or measured); 2.0 = half speed."""

    def __post_init__(self) -> None:
        _positive(self.slowdown, f"device {self.name!r}: slowdown")


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    name: str
    island: str
    kind: str
    devices: tuple[str, ...]
    intra: LinkSpec
    """Link between two devices of this node."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Island:
    name: str
    intra: LinkSpec
    """Link between two nodes of this island."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkEntry:
    """An explicit link between two islands, nodes or devices (both directions unless directed)."""

    a: str
    b: str
    spec: LinkSpec
    directed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Devices and the network between them. Build with :func:`load_cluster` or directly."""

    name: str
    kinds: Mapping[str, DeviceKind]
    islands: tuple[Island, ...]
    nodes: tuple[Node, ...]
    devices: tuple[Device, ...]
    links: tuple[LinkEntry, ...] = ()
    description: str = ""
    emulation: str = ""
    """Non-empty when figures for this cluster come from emulation: says how (shown in reports)."""
    source: str = ""
    """File this cluster was loaded from, for error messages."""
    _index: dict[str, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        err = lambda msg, fld=None: ClusterSpecError(msg, file=self.source or None, field=fld)  # noqa: E731
        if not self.devices:
            raise err("a cluster needs at least one device", "nodes")
        island_names = {i.name for i in self.islands}
        node_by_name: dict[str, Node] = {}
        for n in self.nodes:
            if n.name in node_by_name:
                raise err(f"duplicate node name {n.name!r}", "nodes.name")
            if n.island not in island_names:
                raise err(f"node {n.name!r} names unknown island {n.island!r}", "nodes.island")
            if n.kind not in self.kinds:
                raise err(f"node {n.name!r} names unknown kind {n.kind!r}", "nodes.kind")
            node_by_name[n.name] = n
        dev_by_name: dict[str, Device] = {}
        for d in self.devices:
            if d.name in dev_by_name:
                raise err(f"duplicate device name {d.name!r}", "devices")
            if d.node not in node_by_name:
                raise err(f"device {d.name!r} names unknown node {d.node!r}", "devices.node")
            dev_by_name[d.name] = d
        named = island_names | set(node_by_name) | set(dev_by_name)
        explicit: dict[tuple[str, str], LinkSpec] = {}
        for e in self.links:
            for end in (e.a, e.b):
                if end not in named:
                    raise err(f"link names unknown island, node or device {end!r}", "links.between")
            explicit[(e.a, e.b)] = e.spec
            if not e.directed:
                explicit.setdefault((e.b, e.a), e.spec)
        island_pos = {i.name: k for k, i in enumerate(self.islands)}
        # ring/report order: island (file order), node name, device (file order)
        order = {d.name: (island_pos[d.island], d.node, k) for k, d in enumerate(self.devices)}
        self._index.update(devices=dev_by_name, nodes=node_by_name, explicit=explicit, cache={}, order=order)
        self._index["island_routes"] = self._island_routes()

    # -- lookups -------------------------------------------------------------------------
    def device(self, name: str) -> Device:
        try:
            return self._index["devices"][name]
        except KeyError:
            raise ClusterSpecError(f"unknown device {name!r}", file=self.source or None) from None

    def node(self, name: str) -> Node:
        return self._index["nodes"][name]

    def topology_key(self, device: str) -> tuple[int, str, int]:
        """Sort key that keeps the devices of an island, then of a node, together."""
        return self._index["order"][device]

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

    # -- links ---------------------------------------------------------------------------
    def _explicit(self, a: Device, b: Device) -> LinkSpec | None:
        ex = self._index["explicit"]
        for key in ((a.name, b.name), (a.node, b.node), (a.island, b.island)):
            if key in ex and key[0] != key[1]:
                return ex[key]
        return None

    def _island_spec(self, a: str, b: str) -> LinkSpec | None:
        return self._index["explicit"].get((a, b))

    def _island_routes(self) -> dict[tuple[str, str], tuple[str, ...]]:
        """Shortest island paths (Dijkstra on 1 MB transfer time) for islands with no direct entry."""
        names = [i.name for i in self.islands if any(d.island == i.name for d in self.devices)]
        routes: dict[tuple[str, str], tuple[str, ...]] = {}
        for src in names:
            dist = {src: 0.0}
            prev: dict[str, str] = {}
            heap = [(0.0, src)]
            while heap:
                t, u = heapq.heappop(heap)
                if t > dist.get(u, float("inf")):
                    continue
                for v in names:
                    spec = self._island_spec(u, v) if u != v else None
                    if spec is None:
                        continue
                    nt = t + spec.latency_s + 1e6 / spec.bandwidth_bytes_per_s
                    if nt < dist.get(v, float("inf")):
                        dist[v], prev[v] = nt, u
                        heapq.heappush(heap, (nt, v))
            for dst in names:
                if dst == src:
                    continue
                if dst not in dist:
                    a = next(d.name for d in self.devices if d.island == src)
                    b = next(d.name for d in self.devices if d.island == dst)
                    raise ClusterSpecError(
                        f"no path between devices {a!r} (island {src!r}) and {b!r} (island {dst!r}); "
                        f"add a [[links]] entry between {src!r} and {dst!r}",
                        file=self.source or None,
                        field="links",
                    )
                path = [dst]
                while path[-1] != src:
                    path.append(prev[path[-1]])
                routes[(src, dst)] = tuple(reversed(path))
        return routes

    def link(self, src: str, dst: str) -> Link:
        """The resolved directed link from device ``src`` to device ``dst``."""
        cache = self._index["cache"]
        key = (src, dst)
        if key in cache:
            return cache[key]
        a, b = self.device(src), self.device(dst)
        if src == dst:
            raise ClusterSpecError(f"no link from device {src!r} to itself")
        spec = self._explicit(a, b)
        resource = f"{a.node}->{b.node}"
        if spec is None:
            if a.node == b.node:
                spec, resource = self.node(a.node).intra, f"{src}->{dst}"
            elif a.island == b.island:
                spec = next(i.intra for i in self.islands if i.name == a.island)
            else:
                spec, resource = self._routed(a, b)
        elif a.node == b.node:
            resource = f"{src}->{dst}"
        link = Link(
            src=src,
            dst=dst,
            latency_s=spec.latency_s,
            bandwidth_bytes_per_s=spec.bandwidth_bytes_per_s,
            resource=resource,
            trace=spec.trace,
        )
        cache[key] = link
        return link

    def _routed(self, a: Device, b: Device) -> tuple[LinkSpec, str]:
        path = self._index["island_routes"][(a.island, b.island)]
        hops = [self._island_spec(u, v) for u, v in zip(path, path[1:], strict=False)]
        if len(hops) == 1:
            return hops[0], f"{a.node}->{b.node}"
        narrow = min(range(len(hops)), key=lambda i: hops[i].bandwidth_bytes_per_s)
        spec = LinkSpec(
            latency_s=sum(h.latency_s for h in hops),
            bandwidth_bytes_per_s=hops[narrow].bandwidth_bytes_per_s,
            trace=hops[narrow].trace,
        )
        return spec, f"{path[narrow]}->{path[narrow + 1]}"

    # -- derived clusters ----------------------------------------------------------------
    def subset(self, device_names: Iterable[str]) -> Cluster:
        """The same cluster restricted to ``device_names`` (links unchanged)."""
        keep = set(device_names)
        devices = tuple(d for d in self.devices if d.name in keep)
        nodes_kept = {d.node for d in devices}
        islands_kept = {d.island for d in devices}
        names = keep | nodes_kept | islands_kept
        return Cluster(
            name=self.name,
            kinds=self.kinds,
            islands=tuple(i for i in self.islands if i.name in islands_kept),
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

    # -- JSON (machine-written) ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        def spec(s: LinkSpec) -> dict[str, Any]:
            out: dict[str, Any] = {
                "latency_s": s.latency_s,
                "bandwidth_bytes_per_s": s.bandwidth_bytes_per_s,
            }
            if s.trace is not None:
                out["trace"] = {
                    "name": s.trace.name,
                    "times_s": list(s.trace.times_s),
                    "bandwidth_bytes_per_s": list(s.trace.bandwidth_bytes_per_s),
                }
            return out

        return {
            "schema_version": SCHEMA_VERSION,
            "format": "deepcee.cluster",
            "name": self.name,
            "description": self.description,
            "emulation": self.emulation,
            "kinds": {
                k.name: {
                    "peak_flops_per_s": k.peak_flops_per_s,
                    "memory_bytes": k.memory_bytes,
                    "achievable_fraction": k.achievable_fraction,
                    "per_layer_overhead_s": k.per_layer_overhead_s,
                    "source": k.source,
                }
                for k in self.kinds.values()
            },
            "islands": [{"name": i.name, **spec(i.intra)} for i in self.islands],
            "nodes": [
                {"name": n.name, "island": n.island, "kind": n.kind, "devices": list(n.devices), **spec(n.intra)}
                for n in self.nodes
            ],
            "devices": [
                {"name": d.name, "kind": d.kind, "node": d.node, "island": d.island, "slowdown": d.slowdown}
                for d in self.devices
            ],
            "links": [
                {"between": [e.a, e.b], "directed": e.directed, **spec(e.spec)} for e in self.links
            ],
        }


# ---------------------------------------------------------------------------------------
# TOML loading (hand-written files) and JSON loading (machine-written)
# ---------------------------------------------------------------------------------------


class _Fields:
    """Strict reader of one TOML table: unknown keys and bad values name file and field."""

    def __init__(self, table: Any, where: str, file: str):
        if not isinstance(table, dict):
            raise ClusterSpecError(f"expected a table, got {table!r}", file=file, field=where)
        self.t, self.where, self.file, self.used = table, where, file, set()

    def err(self, key: str, msg: str) -> ClusterSpecError:
        return ClusterSpecError(msg, file=self.file, field=f"{self.where}.{key}" if self.where else key)

    def get(self, key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.t:
            if default is ...:
                raise self.err(key, "missing required value")
            return default
        v = self.t[key]
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
            raise self.err(key, f"expected {getattr(typ, '__name__', typ)}, got {v!r}")
        return v

    def number(self, key: str, default: Any = ..., *, allow_zero: bool = False) -> float:
        v = self.get(key, float, default)
        if v is not None and (v < 0 or (v == 0 and not allow_zero)):
            raise self.err(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
        return v

    def unit_value(self, prefix: str, convert: Any, default: Any = ...) -> float:
        """Exactly one of ``prefix_<unit>`` keys, converted to SI."""
        keys = [k for k in self.t if k.startswith(prefix + "_")]
        if not keys:
            if default is ...:
                raise self.err(prefix + "_*", f"missing required value (e.g. {prefix}_ms or {prefix}_mbit_per_s)")
            return default
        if len(keys) > 1:
            raise self.err(keys[1], f"give {prefix} once, got {keys}")
        key = keys[0]
        v = self.number(key, allow_zero=prefix == "latency")
        try:
            return convert(key, v)
        except KeyError:
            raise self.err(key, f"unknown unit in key {key!r}") from None

    def done(self) -> None:
        extra = sorted(set(self.t) - self.used)
        if extra:
            raise self.err(extra[0], f"unknown key (value {self.t[extra[0]]!r})")


def _link_spec(f: _Fields, base_dir: Path, default_latency_s: float | None = None,
               default_bandwidth: float | None = None) -> LinkSpec:
    lat = f.unit_value("latency", time_field_to_s, default_latency_s if default_latency_s is not None else ...)
    bw = f.unit_value("bandwidth", lambda k, v: rate_field_to_bytes_per_s(k.removeprefix("bandwidth_"), v),
                      default_bandwidth if default_bandwidth is not None else ...)
    trace = None
    trace_file = f.get("trace", str, None)
    if trace_file is not None:
        trace = load_trace(base_dir / trace_file)
    return LinkSpec(latency_s=lat, bandwidth_bytes_per_s=bw, trace=trace)


def cluster_from_toml_dict(data: dict[str, Any], *, file: str = "<cluster>", base_dir: Path = Path(".")) -> Cluster:
    top = _Fields(data, "", file)
    name = top.get("name", str)
    description = top.get("description", str, "")
    emulation = top.get("emulation", str, "")
    kinds: dict[str, DeviceKind] = {}
    for kname, ktab in top.get("kinds", dict).items():
        f = _Fields(ktab, f"kinds.{kname}", file)
        kinds[kname] = DeviceKind(
            name=kname,
            peak_flops_per_s=f.number("peak_tflops") * 1e12,
            memory_bytes=f.number("memory_gib") * GIB,
            achievable_fraction=f.number("achievable_fraction", 0.4),
            per_layer_overhead_s=f.number("per_layer_overhead_us", 20.0, allow_zero=True) * 1e-6,
            source=f.get("source", str, ""),
        )
        if kinds[kname].achievable_fraction > 1:
            raise f.err("achievable_fraction", f"must be in (0, 1], got {kinds[kname].achievable_fraction}")
        f.done()
    islands: list[Island] = []
    for iname, itab in top.get("islands", dict).items():
        f = _Fields(itab, f"islands.{iname}", file)
        islands.append(Island(name=iname, intra=_link_spec(f, base_dir)))
        f.done()
    nodes: list[Node] = []
    devices: list[Device] = []
    node_list = top.get("nodes", list)
    for i, ntab in enumerate(node_list):
        f = _Fields(ntab, f"nodes[{i}]", file)
        nname = f.get("name", str)
        count = f.get("devices", int)
        if count < 1:
            raise f.err("devices", f"must be >= 1, got {count}")
        slow = f.get("slowdown", (float, int, list), 1.0)
        slows = list(slow) if isinstance(slow, list) else [float(slow)] * count
        if len(slows) != count:
            raise f.err("slowdown", f"needs {count} values (one per device), got {len(slows)}")
        for s in slows:
            if not isinstance(s, (int, float)) or isinstance(s, bool) or s <= 0:
                raise f.err("slowdown", f"must be > 0, got {s!r}")
        island = f.get("island", str)
        kind = f.get("kind", str)
        if kind not in kinds:
            raise f.err("kind", f"unknown kind {kind!r} (known: {sorted(kinds)})")
        if island not in {x.name for x in islands}:
            raise f.err("island", f"unknown island {island!r} (known: {[x.name for x in islands]})")
        intra = _link_spec(f, base_dir, 5e-6, 100e9 / 8)
        f.done()
        dnames = tuple(f"{nname}:{j}" for j in range(count))
        nodes.append(Node(name=nname, island=island, kind=kind, devices=dnames, intra=intra))
        devices += [
            Device(name=dn, kind=kind, node=nname, island=island, slowdown=float(s))
            for dn, s in zip(dnames, slows, strict=True)
        ]
    links: list[LinkEntry] = []
    for i, ltab in enumerate(top.get("links", list, [])):
        f = _Fields(ltab, f"links[{i}]", file)
        between = f.get("between", list)
        if len(between) != 2 or not all(isinstance(x, str) for x in between) or between[0] == between[1]:
            raise f.err("between", f"needs two different names, got {between!r}")
        directed = f.get("directed", bool, False)
        links.append(LinkEntry(a=between[0], b=between[1], spec=_link_spec(f, base_dir), directed=directed))
        f.done()
    top.done()
    try:
        return Cluster(
            name=name, kinds=kinds, islands=tuple(islands), nodes=tuple(nodes), devices=tuple(devices),
            links=tuple(links), description=description, emulation=emulation, source=file,
        )
    except ClusterSpecError:
        raise
    except Exception as exc:  # a dataclass check without file context
        raise ClusterSpecError(str(exc), file=file) from None


def _spec_from_json(d: dict[str, Any]) -> LinkSpec:
    trace = None
    if "trace" in d:
        t = d["trace"]
        trace = BandwidthTrace(
            times_s=tuple(t["times_s"]), bandwidth_bytes_per_s=tuple(t["bandwidth_bytes_per_s"]),
            name=t.get("name", ""),
        )
    return LinkSpec(latency_s=d["latency_s"], bandwidth_bytes_per_s=d["bandwidth_bytes_per_s"], trace=trace)


def cluster_from_dict(d: dict[str, Any], *, file: str = "<cluster.json>") -> Cluster:
    if d.get("schema_version") != SCHEMA_VERSION or d.get("format") != "deepcee.cluster":
        raise ClusterSpecError(
            f"expected format 'deepcee.cluster' schema_version {SCHEMA_VERSION}, "
            f"got {d.get('format')!r} {d.get('schema_version')!r}", file=file, field="schema_version",
        )
    try:
        return Cluster(
            name=d["name"],
            description=d.get("description", ""),
            emulation=d.get("emulation", ""),
            kinds={k: DeviceKind(name=k, **v) for k, v in d["kinds"].items()},
            islands=tuple(Island(name=i["name"], intra=_spec_from_json(i)) for i in d["islands"]),
            nodes=tuple(
                Node(name=n["name"], island=n["island"], kind=n["kind"], devices=tuple(n["devices"]),
                     intra=_spec_from_json(n))
                for n in d["nodes"]
            ),
            devices=tuple(Device(**x) for x in d["devices"]),
            links=tuple(
                LinkEntry(a=e["between"][0], b=e["between"][1], directed=e.get("directed", False),
                          spec=_spec_from_json(e))
                for e in d.get("links", [])
            ),
            source=file,
        )
    except KeyError as exc:
        raise ClusterSpecError(f"missing key {exc.args[0]!r}", file=file) from None
    except TypeError as exc:
        raise ClusterSpecError(str(exc), file=file) from None


def load_trace(path: Path) -> BandwidthTrace:
    """A trace file: JSON ``{"schema_version": 1, "times_s": [...], "bandwidth_mbit_per_s": [...]}``."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ClusterSpecError(f"cannot read trace: {exc}", file=str(path)) from None
    if "bandwidth_mbit_per_s" in d:
        bws = tuple(b * 1e6 / 8 for b in d["bandwidth_mbit_per_s"])
    elif "bandwidth_bytes_per_s" in d:
        bws = tuple(d["bandwidth_bytes_per_s"])
    else:
        raise ClusterSpecError("missing bandwidth_mbit_per_s", file=str(path), field="bandwidth_mbit_per_s")
    try:
        return BandwidthTrace(times_s=tuple(d["times_s"]), bandwidth_bytes_per_s=bws, name=Path(path).stem)
    except ClusterSpecError as exc:
        raise ClusterSpecError(str(exc), file=str(path)) from None
    except KeyError as exc:
        raise ClusterSpecError(f"missing key {exc.args[0]!r}", file=str(path)) from None


def load_cluster(path: str | Path) -> Cluster:
    """Load a cluster from a hand-written TOML file or a machine-written JSON file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ClusterSpecError(f"cannot read: {exc.strerror}", file=str(p)) from None
    if p.suffix == ".json":
        try:
            return cluster_from_dict(json.loads(text), file=str(p))
        except json.JSONDecodeError as exc:
            raise ClusterSpecError(f"invalid JSON: {exc}", file=str(p)) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterSpecError(f"invalid TOML: {exc}", file=str(p)) from None
    return cluster_from_toml_dict(data, file=str(p), base_dir=p.parent)
