"""The layer split: dynamic programming over contiguous layer ranges (step 1 and 2 of
[Note: search] in :mod:`deepcee.planner.search`).

Torch-free. :class:`SplitTables` holds the DP inputs of one (layout, microbatch size): per
stage the :class:`~deepcee.planner.ranges.RangeCosts` of its device set, per boundary the
link costs of one microbatch for every boundary layer (:func:`boundary_arrays`, the terms
of :func:`deepcee.planner.cost_model.boundary_cost` as arrays). :func:`split_layers` is the
DP, tested against brute force.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepcee.cluster import Cluster
from deepcee.planner.cost_model import share_pairs
from deepcee.planner.ranges import RangeCosts, RangeTables

_INF = math.inf


@dataclass(slots=True)
class BoundaryArrays:
    """Per boundary layer ``a``: forward/backward (latency, serialisation) of one microbatch."""

    lat_f: np.ndarray
    ser_f: np.ndarray
    lat_b: np.ndarray
    ser_b: np.ndarray


def boundary_arrays(cluster: Cluster, tables: RangeTables, src: tuple[str, ...], src_shares: tuple[int, ...],
                    dst: tuple[str, ...], dst_shares: tuple[int, ...]) -> BoundaryArrays:
    """One boundary between device sets ``src`` and ``dst`` for every boundary layer (see the module docstring)."""
    per: list[dict[str, list[float]]] = [{}, {}]
    for i, j, lo, hi in share_pairs(src_shares, dst_shares):
        for d, a, b in ((0, src[i], dst[j]), (1, dst[j], src[i])):
            link = cluster.link(a, b)
            r = per[d].setdefault(link.resource, [0.0, 0.0, link.bandwidth_bytes_per_s])
            r[0] += hi - lo
            r[1] = max(r[1], link.latency_s)
    bnd = tables.boundary_bytes
    out = []
    for d in range(2):
        sers = np.outer([samples / bw for samples, _, bw in per[d].values()], bnd)
        lats = np.array([lat for _, lat, _ in per[d].values()])[:, None]
        ser = sers.max(axis=0)
        out += [(sers + lats).max(axis=0) - ser, ser]
    return BoundaryArrays(*out)


@dataclass(slots=True)
class SplitTables:
    """DP inputs of one (layout, n): per stage ``RangeCosts``, per boundary link arrays."""

    costs: list[RangeCosts]
    bounds: list[BoundaryArrays]
    m: int
    _base: list[np.ndarray] | None = None
    _links: list[np.ndarray] | None = None

    def loads(self, in_flight: Sequence[int]) -> list[np.ndarray]:
        """Per stage the iteration load of every range, ``inf`` where empty or out of memory."""
        if self._base is None:
            size = self.costs[0].compute_s.shape[0]
            invalid = np.tril(np.ones((size, size), dtype=bool))
            self._base = [np.where(invalid, _INF, self.m * rc.compute_s + rc.allreduce_s + rc.optimizer_s)
                          for rc in self.costs]
        return [np.where(rc.memory_excess(k) > 0, _INF, base)
                for rc, k, base in zip(self.costs, in_flight, self._base, strict=True)]

    def link_loads(self) -> list[np.ndarray]:
        if self._links is None:
            self._links = [np.zeros(0)] + [self.m * np.maximum(b.ser_f, b.ser_b) + np.maximum(b.lat_f, b.lat_b)
                                           for b in self.bounds]
        return self._links

    def fills(self) -> list[np.ndarray]:
        return [np.zeros(0)] + [b.lat_f + b.ser_f + b.lat_b + b.ser_b for b in self.bounds]

    def fits(self, split: Sequence[int], in_flight: Sequence[int]) -> bool:
        return all(rc.memory_excess(k)[split[s], split[s + 1]] <= 0
                   for s, (rc, k) in enumerate(zip(self.costs, in_flight, strict=True)))

    def closed_form(self, split: Sequence[int], loads: list[np.ndarray]) -> float:
        """``T = bottleneck load + one microbatch through everything else`` (see [Note: search])."""
        links, fills = self.link_loads(), self.fills()
        terms, per_mb = [], []
        for s in range(len(self.costs)):
            a, b = split[s], split[s + 1]
            terms.append(loads[s][a, b])
            per_mb.append(self.costs[s].compute_s[a, b])
            if s:
                terms.append(links[s][a])
                per_mb.append(max(self.bounds[s - 1].ser_f[a], self.bounds[s - 1].ser_b[a]))
        k = int(np.argmax(terms))
        fill = sum(self.costs[s].compute_s[split[s], split[s + 1]] for s in range(len(self.costs)))
        fill += sum(fills[s][split[s]] for s in range(1, len(self.costs)))
        return float(terms[k] + fill - per_mb[k])


def split_layers(loads: list[np.ndarray], links: list[np.ndarray], *, computes: list[np.ndarray] | None = None,
                 fills: list[np.ndarray] | None = None, tau: float | None = None) -> tuple[float, tuple[int, ...]] | None:
    """Contiguous layer split over ``len(loads)`` stages by dynamic programming.

    Without ``tau``: minimise ``max(loads[s][a_s, a_{s+1}], links[s][a_s])`` (the bottleneck).
    With ``tau``: minimise ``sum(computes[s][a_s, a_{s+1}] + fills[s][a_s])`` subject to every
    load and link term ``<= tau``. ``loads`` hold ``inf`` where a range is invalid (empty or out
    of memory). Returns ``(value, boundaries a_0=0 < ... < a_S=L)`` or ``None`` if infeasible.
    Ties go to the smallest boundary, so the result is deterministic.
    """
    size = loads[0].shape[0]
    cols = np.arange(size)
    if tau is None:
        value = loads[0][0].copy()
    else:
        assert computes is not None and fills is not None
        value = np.where(loads[0][0] <= tau, computes[0][0], _INF)
    back = []
    for s in range(1, len(loads)):
        if tau is None:
            x = np.maximum(np.maximum(value, links[s])[:, None], loads[s])
        else:
            prev = np.where(links[s] <= tau, value + fills[s], _INF)
            x = prev[:, None] + np.where(loads[s] <= tau, computes[s], _INF)
        arg = np.argmin(x, axis=0)
        value = x[arg, cols]
        back.append(arg)
    if not np.isfinite(value[-1]):
        return None
    split, b = [size - 1], size - 1
    for arg in reversed(back):
        b = int(arg[b])
        split.append(b)
    split.append(0)
    return float(value[-1]), tuple(reversed(split))
