"""Two-level grouping of a cluster's devices: islands by network, then groups by compute.

Torch-free. Works from any :class:`~deepcee.cluster.Cluster`: the islands a cluster file
declares are only used to *name* what the network says (a measured cluster from the profiler
may declare nothing useful).

**Level 1, islands.** The distance between two devices is the time to move 1 MB between them,
``latency_s + 1e6 / bandwidth_bytes_per_s``, the larger of the two directions. Devices are
clustered hierarchically (scipy, *complete* linkage, so every pair inside an island is at
most the threshold apart) and the tree is cut at ``island_threshold_s``.

[Note: island threshold]
The default, 10 ms for 1 MB, is 800 Mbit/s with no latency. A gigabit LAN with sub-millisecond
latency (8-9 ms per MB) stays inside one island; anything slower than ~800 Mbit/s, or a gigabit
path with more than ~2 ms of latency (a metro or WAN hop: 13 ms per MB at 5 ms), is cut. The
WAN links deepcee targets (100-500 Mbit/s, tens of ms: 36-100 ms per MB) are far above it,
and data-centre links (10-100 Gbit/s: 0.1-1 ms per MB) far below it. 20 ms (400 Mbit/s)
would merge a gigabit site with a gigabit-but-5-ms neighbour, which is the
edge-end situation of the DeepCEE testbed, so we cut lower.

**Level 2, groups.** Inside an island, devices are sorted by effective FLOP/s (fastest first,
file order among equals) and cut wherever a device is more than ``speed_ratio`` times slower
than its faster neighbour, or more than ``speed_ratio`` times slower than the fastest device
of the current group (so a slow drift cannot chain very different devices together).

**Scale.** Devices of one node that no device-level link entry touches have identical links to
everything outside the node, so they are collapsed into one point before clustering (1,024
devices on 4-GPU servers cluster as 256 points). Naming is deterministic: an island takes
the declared island name most of its devices carry (ties: file order), with ``.2``, ``.3``
for repeats; islands are ordered by their first device in file order; groups are named
``<island>/g<k>``, fastest first.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from deepcee.cluster import Cluster, Link
from deepcee.errors import ClusterSpecError
from deepcee.units import fmt_rate

log = logging.getLogger(__name__)

PROBE_BYTES = 1e6
"""Message size of the island distance (1 MB)."""
DEFAULT_ISLAND_THRESHOLD_S = 10e-3
"""See [Note: island threshold]."""
DEFAULT_SPEED_RATIO = 1.5
"""Devices within 1.5x of each other's speed share a group: shares absorb such gaps cheaply,
larger ones are better served by giving the slower devices their own stage."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceGroup:
    """Level-2 group: devices of one island with similar compute."""

    name: str
    island: str
    devices: tuple[str, ...]
    """In cluster file order."""
    flops_per_s: tuple[float, ...]
    """Effective FLOP/s of each device (same order as ``devices``)."""

    def __post_init__(self) -> None:
        if not self.devices or len(self.devices) != len(self.flops_per_s):
            raise ClusterSpecError(f"group {self.name!r}: needs devices and one speed each, "
                                   f"got {self.devices} and {self.flops_per_s}")

    @property
    def total_flops_per_s(self) -> float:
        return float(sum(self.flops_per_s))


@dataclass(frozen=True, slots=True, kw_only=True)
class IslandGroup:
    """Level-1 group: devices joined by fast links, split into groups (fastest first)."""

    name: str
    devices: tuple[str, ...]
    groups: tuple[DeviceGroup, ...]
    max_internal_s: float
    """Largest 1 MB transfer time between two of its devices (0 for one device)."""

    @property
    def total_flops_per_s(self) -> float:
        return sum(g.total_flops_per_s for g in self.groups)


@dataclass(frozen=True, slots=True, kw_only=True)
class Grouping:
    """The result of :func:`group_devices`."""

    cluster: str
    islands: tuple[IslandGroup, ...]
    island_threshold_s: float
    speed_ratio: float
    cuts: tuple[str, ...]
    """One line per cut, made while grouping (see :meth:`explain`)."""

    @property
    def groups(self) -> tuple[DeviceGroup, ...]:
        return tuple(g for isl in self.islands for g in isl.groups)

    def island(self, name: str) -> IslandGroup:
        for isl in self.islands:
            if isl.name == name:
                return isl
        raise ClusterSpecError(f"no island {name!r} in the grouping (have {[i.name for i in self.islands]})")

    def island_of(self, device: str) -> str:
        for isl in self.islands:
            if device in isl.devices:
                return isl.name
        raise ClusterSpecError(f"device {device!r} is not in the grouping")

    def explain(self) -> list[str]:
        """Each cut: which links separate islands (latency, bandwidth), which speed gaps separate groups."""
        head = (f"{len(self.islands)} island(s), {len(self.groups)} group(s) "
                f"(islands cut at {self.island_threshold_s * 1e3:.3g} ms per MB, "
                f"groups cut at a {self.speed_ratio:g}x speed gap)")
        return [head, *self.cuts]

    def describe(self) -> str:
        """:meth:`explain` plus one line per group with each device's effective speed."""
        lines = self.explain()
        for isl in self.islands:
            for g in isl.groups:
                speeds = ", ".join(f"{d} {f / 1e9:.3g} GFLOP/s" for d, f in zip(g.devices, g.flops_per_s, strict=True))
                lines.append(f"group {g.name}: {speeds}")
        return "\n".join(lines) + "\n"


def distance_s(link: Link) -> float:
    """Island distance of one direction: time to move :data:`PROBE_BYTES`."""
    return link.latency_s + PROBE_BYTES / link.bandwidth_bytes_per_s


def _units(cluster: Cluster, threshold_s: float) -> list[tuple[str, ...]]:
    """Points to cluster: whole nodes where their devices are interchangeable, else devices."""
    device_level = {e.a for e in cluster.links} | {e.b for e in cluster.links}
    units: list[tuple[str, ...]] = []
    for devs in cluster.node_devices().values():
        same = len(devs) == 1 or (
            not any(d in device_level for d in devs)
            and max(distance_s(cluster.link(a, b)) for a in devs[:2] for b in devs[:2] if a != b) <= threshold_s
        )
        units += [devs] if same else [(d,) for d in devs]
    return units


def _distance_matrix(cluster: Cluster, units: list[tuple[str, ...]]) -> np.ndarray:
    """Symmetric 1 MB times between unit representatives (the worse direction).

    Units whose node and devices no link entry names resolve their links from the declared
    islands alone (see [Note: link resources] in :mod:`deepcee.cluster`), so one lookup per
    pair of declared islands serves them all.
    """
    named = {e.a for e in cluster.links} | {e.b for e in cluster.links}
    plain = [not (cluster.device(u[0]).node in named or any(d in named for d in u)) for u in units]
    isl = [cluster.device(u[0]).island for u in units]
    cache: dict[tuple[str, str], float] = {}
    n = len(units)
    dist = np.zeros((n, n))
    for i in range(n):
        a = units[i][0]
        for j in range(i + 1, n):
            b = units[j][0]
            key = (isl[i], isl[j]) if plain[i] and plain[j] else None
            d = cache.get(key) if key else None
            if d is None:
                d = max(distance_s(cluster.link(a, b)), distance_s(cluster.link(b, a)))
                if key:
                    cache[key] = d
            dist[i, j] = dist[j, i] = d
    return dist


def _island_labels(dist: np.ndarray, threshold_s: float, first_pos: list[int]) -> list[int]:
    """Island index per unit; islands numbered by their first device in file order."""
    n = len(dist)
    if n == 1:
        return [0]
    tree = linkage(squareform(dist, checks=False), method="complete")
    raw = [int(r) for r in fcluster(tree, t=threshold_s, criterion="distance")]
    first: dict[int, int] = {}
    for r, p in zip(raw, first_pos, strict=True):
        first[r] = min(first.get(r, p), p)
    order = {r: k for k, r in enumerate(sorted(first, key=first.__getitem__))}
    return [order[r] for r in raw]


def _name_islands(cluster: Cluster, members: list[list[str]]) -> list[str]:
    names, used = [], Counter()
    for devs in members:
        votes = Counter(cluster.device(d).island for d in devs)
        top = max(votes.values())
        base = next(cluster.device(d).island for d in devs if votes[cluster.device(d).island] == top)
        used[base] += 1
        names.append(base if used[base] == 1 else f"{base}.{used[base]}")
    return names


def _speed_groups(cluster: Cluster, island: str, devices: tuple[str, ...],
                  speed_ratio: float) -> tuple[list[DeviceGroup], list[str]]:
    pos = {d: i for i, d in enumerate(devices)}
    speed = {d: cluster.effective_flops_per_s(d) for d in devices}
    ordered = sorted(devices, key=lambda d: (-speed[d], pos[d]))
    runs: list[list[str]] = [[ordered[0]]]
    cuts: list[str] = []
    for prev, d in zip(ordered, ordered[1:], strict=False):
        gap, span = speed[prev] / speed[d], speed[runs[-1][0]] / speed[d]
        if gap > speed_ratio or span > speed_ratio:
            why = (f"{prev} at {speed[prev] / 1e12:.3g} TFLOP/s vs {d} at {speed[d] / 1e12:.3g} TFLOP/s: "
                   f"{gap:.2f}x" if gap > speed_ratio else
                   f"{d} is {span:.2f}x slower than the group's fastest {runs[-1][0]}")
            cuts.append(f"island {island}: group g{len(runs) - 1} | g{len(runs)}: {why} > {speed_ratio:g}x")
            runs.append([])
        runs[-1].append(d)
    groups = []
    for k, run in enumerate(runs):
        devs = tuple(sorted(run, key=pos.__getitem__))
        groups.append(DeviceGroup(name=f"{island}/g{k}", island=island, devices=devs,
                                  flops_per_s=tuple(speed[d] for d in devs)))
    return groups, cuts


def _describe_link(cluster: Cluster, a: str, b: str) -> str:
    fwd, back = cluster.link(a, b), cluster.link(b, a)
    worse = fwd if distance_s(fwd) >= distance_s(back) else back
    return (f"{worse.src}->{worse.dst} {fmt_rate(worse.bandwidth_bytes_per_s)}, "
            f"{worse.latency_s * 1e3:.3g} ms: {distance_s(worse) * 1e3:.3g} ms per MB")


def _island_cuts(cluster: Cluster, names: list[str], units: list[tuple[str, ...]], labels: list[int],
                 dist: np.ndarray, threshold_s: float) -> list[str]:
    """Per pair of islands: their fastest and slowest link (complete linkage cuts on the slowest)."""
    lab = np.asarray(labels)
    out = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            block = dist[np.ix_(lab == i, lab == j)]
            ui, uj = np.flatnonzero(lab == i), np.flatnonzero(lab == j)
            lo = np.unravel_index(np.argmin(block), block.shape)
            hi = np.unravel_index(np.argmax(block), block.shape)
            fast = _describe_link(cluster, units[ui[lo[0]]][0], units[uj[lo[1]]][0])
            line = f"islands {names[i]} | {names[j]}: fastest link {fast}"
            if block[hi] > block[lo]:
                line += f"; slowest {_describe_link(cluster, units[ui[hi[0]]][0], units[uj[hi[1]]][0])}"
            out.append(line + f" (> {threshold_s * 1e3:.3g} ms)")
    return out


def group_devices(cluster: Cluster, *, island_threshold_s: float = DEFAULT_ISLAND_THRESHOLD_S,
                  speed_ratio: float = DEFAULT_SPEED_RATIO) -> Grouping:
    """Group ``cluster``'s devices into islands (network) and groups (compute). See the module docstring."""
    if not island_threshold_s > 0:
        raise ClusterSpecError(f"island_threshold_s must be > 0, got {island_threshold_s!r}")
    if not speed_ratio >= 1:
        raise ClusterSpecError(f"speed_ratio must be >= 1, got {speed_ratio!r}")
    units = _units(cluster, island_threshold_s)
    dist = _distance_matrix(cluster, units)
    pos = {d: i for i, d in enumerate(cluster.device_names)}
    labels = _island_labels(dist, island_threshold_s, [min(pos[d] for d in u) for u in units])
    members: list[list[str]] = [[] for _ in range(max(labels) + 1)]
    for unit, lab in zip(units, labels, strict=True):
        members[lab] += unit
    members = [sorted(m, key=pos.__getitem__) for m in members]
    names = _name_islands(cluster, members)
    cuts = _island_cuts(cluster, names, units, labels, dist, island_threshold_s)
    islands = []
    lab = np.asarray(labels)
    for k, (name, devs) in enumerate(zip(names, members, strict=True)):
        groups, gcuts = _speed_groups(cluster, name, tuple(devs), speed_ratio)
        cuts += gcuts
        block = dist[np.ix_(lab == k, lab == k)]
        inside = float(block.max()) if block.size else 0.0
        if len(devs) > 1 and any(len(u) > 1 for u, lb in zip(units, labels, strict=True) if lb == k):
            inside = max(inside, max(distance_s(cluster.link(u[0], u[1])) for u, lb in zip(units, labels, strict=True)
                                     if lb == k and len(u) > 1))
        islands.append(IslandGroup(name=name, devices=tuple(devs), groups=tuple(groups), max_internal_s=inside))
        nodes = len({cluster.device(d).node for d in devs})
        cuts.append(f"island {name}: {len(devs)} device(s) on {nodes} node(s), internal links up to "
                    f"{inside * 1e3:.3g} ms per MB; {len(groups)} group(s)")
    log.debug("grouped %d devices of %s into %d islands", len(pos), cluster.name, len(islands))
    return Grouping(cluster=cluster.name, islands=tuple(islands), island_threshold_s=island_threshold_s,
                    speed_ratio=speed_ratio, cuts=tuple(cuts))
