"""Cluster files: hand-written TOML, machine-written JSON, bandwidth traces.

Torch-free. Files use the units in their key names (``latency_ms``, ``bandwidth_mbit_per_s``,
``peak_tflops``, ``memory_gib``, ``per_layer_overhead_us``) and :mod:`deepcee.units`
converts at the edge; JSON holds SI values (``deepcee.cluster`` schema version
:data:`SCHEMA_VERSION`, written by :func:`cluster_to_dict`). Every error names the file, the
field and the value (:class:`~deepcee.errors.ClusterSpecError`).
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable
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
from deepcee.errors import ClusterSpecError
from deepcee.units import GIB, rate_field_to_bytes_per_s, time_field_to_s

SCHEMA_VERSION = 1
FORMAT = "deepcee.cluster"
DEFAULT_NODE_LATENCY_S = 5e-6
"""A node's intra link when its ``[[nodes]]`` entry gives no ``latency_*``."""
DEFAULT_NODE_BANDWIDTH_BYTES_PER_S = 100e9 / 8
"""... and when it gives no ``bandwidth_*`` (100 Gbit/s)."""


# -- TOML (hand-written) -------------------------------------------------------------------


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
        if v is not None and not math.isfinite(v):
            raise self.err(key, f"must be a finite number, got {v!r}")
        if v is not None and (v < 0 or (v == 0 and not allow_zero)):
            raise self.err(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
        return v

    def unit_value(self, prefix: str, convert: Callable[[str, float], float], default: Any = ...) -> float:
        """Exactly one of ``prefix_<unit>`` keys, converted to SI."""
        keys = [k for k in self.t if k.startswith(prefix + "_")]
        if not keys:
            if default is ...:
                raise self.err(prefix + "_*", f"missing required value (e.g. {prefix}_ms or {prefix}_mbit_per_s)")
            return default
        if len(keys) > 1:
            raise self.err(keys[1], f"give {prefix} once, got {keys}")
        key = keys[0]
        v = self.number(key, allow_zero=prefix in ("latency", "data"))
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
    """A cluster from a parsed TOML file; trace files are found relative to ``base_dir``."""
    top = _Fields(data, "", file)
    name = top.get("name", str)
    description = top.get("description", str, "")
    emulation = top.get("emulation", str, "")
    kinds = _toml_kinds(top.get("kinds", dict), file)
    islands = _toml_islands(top.get("islands", dict), file, base_dir)
    nodes: list[Node] = []
    devices: list[Device] = []
    for i, ntab in enumerate(top.get("nodes", list)):
        node, node_devices = _toml_node(_Fields(ntab, f"nodes[{i}]", file), kinds, islands, base_dir)
        nodes.append(node)
        devices += node_devices
    links = _toml_links(top.get("links", list, []), file, base_dir)
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


def _toml_kinds(table: dict[str, Any], file: str) -> dict[str, DeviceKind]:
    kinds: dict[str, DeviceKind] = {}
    for kname, ktab in table.items():
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
    return kinds


def _toml_islands(table: dict[str, Any], file: str, base_dir: Path) -> list[Island]:
    islands: list[Island] = []
    for iname, itab in table.items():
        f = _Fields(itab, f"islands.{iname}", file)
        intra = _link_spec(f, base_dir)
        data = f.unit_value("data", _data_bytes, None)
        device_hour = f.number("price_usd_per_device_hour", None, allow_zero=True)
        egress_gb = f.number("egress_usd_per_gb", None, allow_zero=True)
        try:
            islands.append(Island(name=iname, intra=intra, data_bytes=data,
                                  device_usd_per_s=None if device_hour is None else device_hour / 3600.0,
                                  egress_usd_per_byte=None if egress_gb is None else egress_gb / 1e9))
        except ClusterSpecError as exc:
            raise ClusterSpecError(str(exc), file=file, field=f"islands.{iname}") from None
        f.done()
    return islands


DATA_UNITS = {"data_bytes": 1.0, "data_mb": 1e6, "data_gb": 1e9, "data_tb": 1e12, "data_gib": GIB}
"""Keys that state the training data an island holds (decimal MB/GB/TB, or GiB)."""


def _data_bytes(key: str, value: float) -> float:
    return value * DATA_UNITS[key]


def _toml_node(f: _Fields, kinds: dict[str, DeviceKind], islands: list[Island],
               base_dir: Path) -> tuple[Node, list[Device]]:
    """One ``[[nodes]]`` entry: the node and its ``devices`` devices, named ``<node>:<index>``."""
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
    intra = _link_spec(f, base_dir, DEFAULT_NODE_LATENCY_S, DEFAULT_NODE_BANDWIDTH_BYTES_PER_S)
    host = f.get("host", str, "")
    node_rank = f.get("node_rank", int, None)
    if node_rank is not None and node_rank < 0:
        raise f.err("node_rank", f"must be >= 0, got {node_rank}")
    f.done()
    dnames = tuple(f"{nname}:{j}" for j in range(count))
    devices = [
        Device(name=dn, kind=kind, node=nname, island=island, slowdown=float(s))
        for dn, s in zip(dnames, slows, strict=True)
    ]
    node = Node(name=nname, island=island, kind=kind, devices=dnames, intra=intra, host=host, node_rank=node_rank)
    return node, devices


def _toml_links(entries: list[Any], file: str, base_dir: Path) -> list[LinkEntry]:
    links: list[LinkEntry] = []
    for i, ltab in enumerate(entries):
        f = _Fields(ltab, f"links[{i}]", file)
        between = f.get("between", list)
        if len(between) != 2 or not all(isinstance(x, str) for x in between) or between[0] == between[1]:
            raise f.err("between", f"needs two different names, got {between!r}")
        directed = f.get("directed", bool, False)
        links.append(LinkEntry(a=between[0], b=between[1], spec=_link_spec(f, base_dir), directed=directed))
        f.done()
    return links


# -- JSON (machine-written) ----------------------------------------------------------------


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The ``deepcee.cluster`` JSON form of ``cluster`` (SI values); read back by :func:`cluster_from_dict`."""
    c = cluster
    return {
        "schema_version": SCHEMA_VERSION,
        "format": FORMAT,
        "name": c.name,
        "description": c.description,
        "emulation": c.emulation,
        "kinds": {
            k.name: {
                "peak_flops_per_s": k.peak_flops_per_s,
                "memory_bytes": k.memory_bytes,
                "achievable_fraction": k.achievable_fraction,
                "per_layer_overhead_s": k.per_layer_overhead_s,
                "source": k.source,
            }
            for k in c.kinds.values()
        },
        "islands": [{"name": i.name, **_spec_to_json(i.intra), **_island_extras(i)} for i in c.islands],
        "nodes": [
            {"name": n.name, "island": n.island, "kind": n.kind, "devices": list(n.devices), **_spec_to_json(n.intra),
             **({"host": n.host} if n.host else {}),
             **({"node_rank": n.node_rank} if n.node_rank is not None else {})}
            for n in c.nodes
        ],
        "devices": [
            {"name": d.name, "kind": d.kind, "node": d.node, "island": d.island, "slowdown": d.slowdown}
            for d in c.devices
        ],
        "links": [
            {"between": [e.a, e.b], "directed": e.directed, **_spec_to_json(e.spec)} for e in c.links
        ],
    }


ISLAND_EXTRAS = ("data_bytes", "device_usd_per_s", "egress_usd_per_byte")
"""Optional island fields (data held, prices), written when stated."""


def _island_extras(i: Island) -> dict[str, float]:
    return {k: getattr(i, k) for k in ISLAND_EXTRAS if getattr(i, k) is not None}


def _spec_to_json(s: LinkSpec) -> dict[str, Any]:
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
    """A cluster from its ``deepcee.cluster`` JSON form (:func:`cluster_to_dict`)."""
    if d.get("schema_version") != SCHEMA_VERSION or d.get("format") != FORMAT:
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
            islands=tuple(Island(name=i["name"], intra=_spec_from_json(i), **{k: i[k] for k in ISLAND_EXTRAS if k in i})
                          for i in d["islands"]),
            nodes=tuple(
                Node(name=n["name"], island=n["island"], kind=n["kind"], devices=tuple(n["devices"]),
                     intra=_spec_from_json(n), host=n.get("host", ""), node_rank=n.get("node_rank"))
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
    except ClusterSpecError as exc:
        if exc.file:
            raise
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
