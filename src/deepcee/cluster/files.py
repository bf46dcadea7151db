"""Cluster files: hand-written TOML, machine-written JSON, bandwidth traces.

Torch-free. Files use the units in their key names (``latency_ms``, ``bandwidth_mbit_per_s``,
``peak_tflops``, ``memory_gib``, ``per_layer_overhead_us``) and :mod:`deepcee.units`
converts at the edge; JSON holds SI values (``deepcee.cluster`` schema version
:data:`~deepcee.cluster.writer.SCHEMA_VERSION`, written by
:func:`~deepcee.cluster.writer.cluster_to_dict`). Every file goes through the input
layer (:mod:`deepcee.inputs`: encoding, size, nesting, finite numbers) and every value through
its field validator, with the ranges of :mod:`deepcee.inputs.limits`; every error names the
file, the field and the value (:class:`~deepcee.errors.ClusterSpecError`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepcee.cluster.model import Cluster
from deepcee.cluster.parts import (
    BandwidthTrace,
    Device,
    DeviceKind,
    Island,
    LinkEntry,
    LinkSpec,
    Node,
)
from deepcee.cluster.writer import FORMAT, SCHEMA_VERSION
from deepcee.errors import ClusterSpecError
from deepcee.inputs import Fields, read_json, read_toml
from deepcee.inputs.fields import check_format
from deepcee.inputs.limits import (
    BANDWIDTH,
    DATA_BYTES,
    DEVICE_PRICE,
    DEVICES_PER_NODE,
    EGRESS_PRICE,
    FRACTION,
    LATENCY,
    MAX_DEVICES,
    MAX_DEVICES_PER_NODE,
    MAX_NAME_CHARS,
    MEMORY,
    NODE_RANK,
    OVERHEAD,
    PEAK_FLOPS,
    SLOWDOWN,
    TRACE_POINTS,
    TRACE_TIME,
    Limit,
)
from deepcee.units import GIB, rate_field_to_bytes_per_s, time_field_to_s

TRACE_SCHEMA_VERSION = 1
DEFAULT_NODE_LATENCY_S = 5e-6
"""A node's intra link when its ``[[nodes]]`` entry gives no ``latency_*``."""
DEFAULT_NODE_BANDWIDTH_BYTES_PER_S = 100e9 / 8
"""... and when it gives no ``bandwidth_*`` (100 Gbit/s)."""
MAX_TRACE_POINTS = int(TRACE_POINTS.hi)
MAX_LINK_ENTRIES = MAX_DEVICES * 16
"""``[[links]]`` entries: every island pair of a 16-island cluster is 120; this leaves room for
node- and device-level entries."""


# -- TOML (hand-written) -------------------------------------------------------------------


def _unit_value(f: Fields, prefix: str, limit: Limit, default: Any = ...) -> float:
    """Exactly one of the ``prefix_<unit>`` keys, checked in its unit and converted to SI."""
    keys = [k for k in f.record if k.startswith(prefix + "_")]
    if not keys:
        if default is ...:
            raise f.err(prefix + "_*", f"missing required value (e.g. {prefix}_ms or {prefix}_mbit_per_s)")
        return default
    if len(keys) > 1:
        raise f.err(keys[1], f"give {prefix} once, got {keys}")
    key = keys[0]
    try:
        factor = (time_field_to_s(key, 1.0) if prefix == "latency" else DATA_UNITS[key] if prefix == "data"
                  else rate_field_to_bytes_per_s(key.removeprefix("bandwidth_"), 1.0))
    except KeyError:
        f.raw(key)
        raise f.err(key, f"unknown unit in key {key!r}") from None
    unit = key.removeprefix(prefix + "_").replace("_per_s", "/s").replace("mbit", "Mbit").replace("gbit", "Gbit")
    return f.number(key, limit.scaled(factor, unit.upper() if prefix == "data" else unit)) * factor


def _link_spec(f: Fields, base_dir: Path, default_latency_s: Any = ..., default_bandwidth: Any = ...) -> LinkSpec:
    lat = _unit_value(f, "latency", LATENCY, default_latency_s)
    bw = _unit_value(f, "bandwidth", BANDWIDTH, default_bandwidth)
    trace = None
    trace_file = f.text("trace", None)
    if trace_file is not None:
        try:
            trace = load_trace(base_dir / trace_file)
        except ClusterSpecError as exc:  # name the key that points at the trace file, and the file
            raise f.err("trace", str(exc)) from None
    return LinkSpec(latency_s=lat, bandwidth_bytes_per_s=bw, trace=trace)


def cluster_from_toml_dict(data: dict[str, Any], *, file: str = "<cluster>", base_dir: Path = Path(".")) -> Cluster:
    """A cluster from a parsed TOML file; trace files are found relative to ``base_dir``."""
    top = Fields(data, file=file, error=ClusterSpecError)
    name = top.name("name")
    description = top.text("description", "")
    emulation = top.text("emulation", "")
    kinds = {kname: _toml_kind(kname, f) for kname, f in top.table("kinds", max_len=MAX_DEVICES)}
    islands = [_toml_island(iname, f, base_dir) for iname, f in top.table("islands", max_len=MAX_DEVICES)]
    nodes: list[Node] = []
    devices: list[Device] = []
    for f in top.records("nodes", max_len=MAX_DEVICES, min_len=1):
        node, node_devices = _toml_node(f, kinds, islands, base_dir, len(devices))
        nodes.append(node)
        devices += node_devices
    links = [_toml_link(f, base_dir) for f in top.records("links", [], max_len=MAX_LINK_ENTRIES)]
    top.done()
    _check_names(file, islands, nodes, devices, links)
    _check_pairs_once(file, links)
    return _build(file, name=name, kinds=kinds, islands=tuple(islands), nodes=tuple(nodes), devices=tuple(devices),
                  links=tuple(links), description=description, emulation=emulation)


def _toml_kind(kname: str, f: Fields) -> DeviceKind:
    kind = DeviceKind(
        name=kname,
        peak_flops_per_s=f.number("peak_tflops", PEAK_FLOPS.scaled(1e12, "TFLOP/s")) * 1e12,
        memory_bytes=f.number("memory_gib", MEMORY.scaled(GIB, "GiB")) * GIB,
        achievable_fraction=f.number("achievable_fraction", FRACTION, 0.4),
        per_layer_overhead_s=f.number("per_layer_overhead_us", OVERHEAD.scaled(1e-6, "us"), 20.0) * 1e-6,
        source=f.text("source", ""),
    )
    f.done()
    return kind


def _toml_island(iname: str, f: Fields, base_dir: Path) -> Island:
    """One ``[islands.<name>]`` table: its intra link, and optionally the data it holds and its prices."""
    intra = _link_spec(f, base_dir)
    data = _unit_value(f, "data", DATA_BYTES, None)
    device_hour = f.number("price_usd_per_device_hour", DEVICE_PRICE.scaled(1 / 3600, "USD/device-hour"), None)
    egress_gb = f.number("egress_usd_per_gb", EGRESS_PRICE.scaled(1e-9, "USD/GB"), None)
    f.done()
    return Island(name=iname, intra=intra, data_bytes=data,
                  device_usd_per_s=None if device_hour is None else device_hour / 3600.0,
                  egress_usd_per_byte=None if egress_gb is None else egress_gb / 1e9)


DATA_UNITS = {"data_bytes": 1.0, "data_mb": 1e6, "data_gb": 1e9, "data_tb": 1e12, "data_gib": GIB}
"""Keys that state the training data an island holds (decimal MB/GB/TB, or GiB)."""


def _toml_node(f: Fields, kinds: dict[str, DeviceKind], islands: list[Island], base_dir: Path,
               devices_before: int) -> tuple[Node, list[Device]]:
    """One ``[[nodes]]`` entry: the node and its ``devices`` devices, named ``<node>:<index>``."""
    nname = f.name("name")
    count = f.integer("devices", DEVICES_PER_NODE)
    if devices_before + count > MAX_DEVICES:
        raise f.err("devices", f"the cluster would have {devices_before + count:,} devices; the limit is "
                               f"{MAX_DEVICES:,} (MAX_DEVICES: planning time grows with the device count)")
    slow = f.raw("slowdown", 1.0)
    if isinstance(slow, list):
        if len(slow) != count:
            raise f.err("slowdown", f"needs {count} values (one per device), got {len(slow)}")
        slows = f.numbers("slowdown", SLOWDOWN, max_len=count)
    else:
        slows = (f.check("slowdown", SLOWDOWN, slow),) * count
    island = f.name("island", known=[x.name for x in islands])
    kind = f.name("kind", known=kinds)
    intra = _link_spec(f, base_dir, DEFAULT_NODE_LATENCY_S, DEFAULT_NODE_BANDWIDTH_BYTES_PER_S)
    host, node_rank = _machine(f)
    f.done()
    dnames = tuple(f"{nname}:{j}" for j in range(count))
    devices = [
        Device(name=dn, kind=kind, node=nname, island=island, slowdown=float(s))
        for dn, s in zip(dnames, slows, strict=True)
    ]
    node = Node(name=nname, island=island, kind=kind, devices=dnames, intra=intra, host=host, node_rank=node_rank)
    return node, devices


def _toml_link(f: Fields, base_dir: Path) -> LinkEntry:
    between = f.names("between", max_len=2, min_len=2)
    if between[0] == between[1]:
        raise f.err("between", f"needs two different names, got {list(between)!r}")
    directed = f.flag("directed", False)
    entry = LinkEntry(a=between[0], b=between[1], spec=_link_spec(f, base_dir), directed=directed)
    f.done()
    return entry


def _build(file: str, **parts: Any) -> Cluster:
    """``Cluster(**parts)``; its consistency errors get the file's name."""
    try:
        return Cluster(**parts, source=file)
    except ClusterSpecError as exc:
        if exc.file:
            raise
        raise ClusterSpecError(str(exc), file=file) from None


# -- JSON (machine-written) ----------------------------------------------------------------


def _spec_from_json(f: Fields) -> LinkSpec:
    trace = None
    t = f.record_of("trace", None)
    if t is not None:
        trace = _trace(t, t.text("name", ""))
        t.done()
    return LinkSpec(latency_s=f.number("latency_s", LATENCY), bandwidth_bytes_per_s=f.number("bandwidth_bytes_per_s",
                                                                                          BANDWIDTH), trace=trace)


def cluster_from_dict(d: Any, *, file: str = "<cluster.json>") -> Cluster:
    """A cluster from its ``deepcee.cluster`` JSON form (:func:`cluster_to_dict`)."""
    f = Fields(d, file=file, error=ClusterSpecError)
    check_format(f, FORMAT, (SCHEMA_VERSION,))
    name, description, emulation = f.name("name"), f.text("description", ""), f.text("emulation", "")
    kinds = {k: _json_kind(k, kf) for k, kf in f.table("kinds", max_len=MAX_DEVICES)}
    islands = [_json_island(x) for x in f.records("islands", max_len=MAX_DEVICES, min_len=1)]
    _unique(f, "islands", [i.name for i in islands])
    island_names = [i.name for i in islands]
    nodes = [_json_node(x, kinds, island_names) for x in f.records("nodes", max_len=MAX_DEVICES, min_len=1)]
    _unique(f, "nodes", [n.name for n in nodes])
    node_of = {n.name: n for n in nodes}
    devices = [_json_device(x, kinds, node_of) for x in f.records("devices", max_len=MAX_DEVICES, min_len=1)]
    _check_membership(file, nodes, devices)
    links = [_json_link(x) for x in f.records("links", [], max_len=MAX_LINK_ENTRIES)]
    f.done()
    _check_names(file, islands, nodes, devices, links)
    return _build(file, name=name, description=description, emulation=emulation, kinds=kinds,
                  islands=tuple(islands), nodes=tuple(nodes), devices=tuple(devices), links=tuple(links))


def _json_kind(name: str, f: Fields) -> DeviceKind:
    kind = DeviceKind(name=name, peak_flops_per_s=f.number("peak_flops_per_s", PEAK_FLOPS),
                      memory_bytes=f.number("memory_bytes", MEMORY),
                      achievable_fraction=f.number("achievable_fraction", FRACTION, 0.4),
                      per_layer_overhead_s=f.number("per_layer_overhead_s", OVERHEAD, 20e-6),
                      source=f.text("source", ""))
    f.done()
    return kind


def _json_island(f: Fields) -> Island:
    island = Island(name=f.name("name"), intra=_spec_from_json(f), data_bytes=f.number("data_bytes", DATA_BYTES, None),
                    device_usd_per_s=f.number("device_usd_per_s", DEVICE_PRICE, None),
                    egress_usd_per_byte=f.number("egress_usd_per_byte", EGRESS_PRICE, None))
    f.done()
    return island


def _machine(f: Fields) -> tuple[str, int | None]:
    """A node's optional ``host`` (a host name or address) and ``node_rank`` (torchrun's)."""
    return f.text("host", "", max_chars=MAX_NAME_CHARS), f.integer("node_rank", NODE_RANK, None)


def _json_node(f: Fields, kinds: dict[str, DeviceKind], islands: list[str]) -> Node:
    host, node_rank = _machine(f)
    node = Node(name=f.name("name"), island=f.name("island", known=islands), kind=f.name("kind", known=kinds),
                devices=f.names("devices", max_len=MAX_DEVICES_PER_NODE, min_len=1), intra=_spec_from_json(f),
                host=host, node_rank=node_rank)
    f.done()
    return node


def _json_device(f: Fields, kinds: dict[str, DeviceKind], nodes: dict[str, Node]) -> Device:
    name, kind = f.name("name"), f.name("kind", known=kinds)
    node = nodes[f.name("node", known=nodes)]
    island = f.name("island")
    if island != node.island:
        raise f.err("island", f"device {name!r} is in node {node.name!r} of island {node.island!r}, "
                              f"got island {island!r}")
    device = Device(name=name, kind=kind, node=node.name, island=island,
                    slowdown=f.number("slowdown", SLOWDOWN, 1.0))
    f.done()
    return device


def _json_link(f: Fields) -> LinkEntry:
    between = f.names("between", max_len=2, min_len=2)
    if between[0] == between[1]:
        raise f.err("between", f"needs two different names, got {list(between)!r}")
    entry = LinkEntry(a=between[0], b=between[1], directed=f.flag("directed", False), spec=_spec_from_json(f))
    f.done()
    return entry


def _check_membership(file: str, nodes: list[Node], devices: list[Device]) -> None:
    """Each device is listed by its own node, and each listed device exists."""
    node_of = {n.name: n for n in nodes}
    for i, dev in enumerate(devices):
        if dev.name not in node_of[dev.node].devices:
            raise ClusterSpecError(f"device {dev.name!r} is not in the devices of its node {dev.node!r}", file=file,
                                   field=f"devices[{i}].name")
    known = {d.name for d in devices}
    for i, node in enumerate(nodes):
        for j, d in enumerate(node.devices):
            if d not in known:
                raise ClusterSpecError(f"node {node.name!r} lists device {d!r}, which devices[] does not hold",
                                       file=file, field=f"nodes[{i}].devices[{j}]")


def _check_names(file: str, islands: list[Island], nodes: list[Node], devices: list[Device],
                 links: list[LinkEntry]) -> None:
    """Node names are unique, and each ``[[links]]`` end names exactly one island, node or device
    (a name used at two levels would make the entry apply at both)."""
    for field, names in (("islands", [x.name for x in islands]), ("nodes", [x.name for x in nodes])):
        for i, name in enumerate(names):
            where = f"{field}.{name}" if field == "islands" else f"{field}[{i}].name"
            if "->" in name:  # link pipes are named "a->b": "a->b" and "c" would share one with "a" and "b->c"
                raise ClusterSpecError(f"names may not hold '->' (it joins the two ends of a link), got {name!r}",
                                       file=file, field=where)
            if not name.strip() or name != name.strip():  # reports, flags and device names ("node:0") would not show it
                raise ClusterSpecError(f"names may not be blank or start or end with white space, got {name!r}",
                                       file=file, field=where)
    seen: set[str] = set()
    for i, n in enumerate(nodes):
        if n.name in seen:
            raise ClusterSpecError(f"duplicate node name {n.name!r}", file=file, field=f"nodes[{i}].name")
        seen.add(n.name)
    levels: dict[str, list[str]] = {}
    for level, names in (("island", [x.name for x in islands]), ("node", [x.name for x in nodes]),
                         ("device", [x.name for x in devices])):
        for name in set(names):
            levels.setdefault(name, []).append(level)
    for i, e in enumerate(links):
        for end in (e.a, e.b):
            found = levels.get(end, [])
            if len(found) != 1:
                what = (f"names {' and '.join(('an ' if lv == 'island' else 'a ') + lv for lv in found)}: rename one"
                        if found
                        else "names no island, node or device")
                raise ClusterSpecError(f"link end {end!r} {what}", file=file, field=f"links[{i}].between")


def _check_pairs_once(file: str, links: list[LinkEntry]) -> None:
    """Each direction between two names is given by one ``[[links]]`` entry: a hand-written file
    that gives one twice (``["a", "b"]`` and later ``["b", "a"]``) is a mistake whose outcome
    (the later entry replaces the earlier one only where it is directed or first) no reader
    would guess. An asymmetric link is two entries with ``directed = true``."""
    first: dict[tuple[str, str], int] = {}
    for i, e in enumerate(links):
        for pair in ((e.a, e.b),) if e.directed else ((e.a, e.b), (e.b, e.a)):
            if pair in first:
                raise ClusterSpecError(
                    f"{pair[0]!r} -> {pair[1]!r} is already given by links[{first[pair]}]; give each pair once "
                    f"(an asymmetric link: two entries with directed = true)", file=file, field=f"links[{i}].between")
            first[pair] = i


def _unique(f: Fields, key: str, names: list[str]) -> None:
    seen: set[str] = set()
    for i, n in enumerate(names):
        if n in seen:
            raise f.err(f"{key}[{i}].name", f"duplicate name {n!r}")
        seen.add(n)


# -- traces ----------------------------------------------------------------------------------


def _trace(f: Fields, name: str, bandwidth_key: str = "bandwidth_bytes_per_s") -> BandwidthTrace:
    """The ``times_s`` and bandwidth lists of a trace record, checked point by point."""
    times = f.numbers("times_s", TRACE_TIME, max_len=MAX_TRACE_POINTS, min_len=1)
    given = f.raw(bandwidth_key)
    if isinstance(given, list) and len(given) != len(times):
        raise f.err(bandwidth_key, f"needs one value per time ({len(times):,}), got {len(given):,}")
    if bandwidth_key == "bandwidth_mbit_per_s":
        bws = tuple(b * 1e6 / 8 for b in f.numbers(bandwidth_key, BANDWIDTH.scaled(1e6 / 8, "Mbit/s"),
                                                   max_len=len(times), min_len=len(times)))
    else:
        bws = f.numbers(bandwidth_key, BANDWIDTH, max_len=len(times), min_len=len(times))
    for i in range(1, len(times)):
        if times[i] <= times[i - 1]:
            raise f.err("times_s", f"times must increase: times_s[{i}] = {times[i]!r} after {times[i - 1]!r}")
    return BandwidthTrace(times_s=times, bandwidth_bytes_per_s=bws, name=name)


def load_trace(path: str | Path) -> BandwidthTrace:
    """A trace file: JSON ``{"schema_version": 1, "times_s": [...], "bandwidth_mbit_per_s": [...]}``
    (``bandwidth_bytes_per_s`` instead of the Mbit/s list; an optional ``description``)."""
    return read_trace_file(path)[0]


def read_trace_file(path: str | Path) -> tuple[BandwidthTrace, str]:
    """The trace in a trace file and its ``description``."""
    p = Path(path)
    f = Fields(read_json(p, ClusterSpecError), file=str(p), error=ClusterSpecError)
    version = f.raw("schema_version", TRACE_SCHEMA_VERSION)
    if version != TRACE_SCHEMA_VERSION or isinstance(version, bool):
        raise f.err("schema_version", f"expected {TRACE_SCHEMA_VERSION}, got {version!r}"[:100])
    description = f.text("description", "")
    keys = [k for k in ("bandwidth_mbit_per_s", "bandwidth_bytes_per_s") if f.has(k)]
    if len(keys) != 1:
        raise f.err("bandwidth_mbit_per_s", "give exactly one of bandwidth_mbit_per_s and bandwidth_bytes_per_s, "
                                            f"got {keys or 'neither'}")
    trace = _trace(f, p.stem, keys[0])
    f.done()
    return trace, description


def load_cluster(path: str | Path) -> Cluster:
    """Load a cluster from a hand-written TOML file or a machine-written JSON file."""
    p = Path(path)
    if p.suffix == ".json":
        return cluster_from_dict(read_json(p, ClusterSpecError), file=str(p))
    return cluster_from_toml_dict(read_toml(p, ClusterSpecError), file=str(p), base_dir=p.parent)
