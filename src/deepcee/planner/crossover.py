"""The crossover study: where do the devices a plan leaves out start to pay off (torch-free).

When leaving slow devices out is best (see :func:`deepcee.planner.compare.compare`),
:func:`crossover_study` sweeps the global batch and the bandwidth of the slow links the
left-out devices sit behind, and finds where the best plan that uses them starts to beat the
best plan without them. Plans come from a :class:`SweepPlanner` (``compare`` passes deepcee's
search with a lighter effort) and from :func:`~deepcee.planner.baselines.build_baselines`,
all scored by the simulator.

[Note: crossover]
"Without" is the best plan on the kept devices alone: deepcee planning on the sub-cluster,
or any baseline that stays on them. "With" is the best plan that uses at least one
left-out device: deepcee planning on the whole cluster with exclusion forbidden (every
device used), deepcee's free plan when it uses one, and the baselines that use one.
The bandwidth sweep sets every inter-island link that touches a left-out device's island
(and, inside an island, every link between a kept node and a left-out node) to the swept
bandwidth, latency unchanged; the batch sweep keeps the links as they are. ``compare``'s
sweeps re-score the full search's candidates and the baselines' plans at every point
(:class:`deepcee.planner.sweep_pool.PoolPlanner`, [Note: sweep pool]) instead of searching
and building the baselines again (469 CPU s at 512 devices); a caller's own planner (or
:func:`deepcee.planner.compare._planned`, a lighter search per point) with ``baselines=True``
builds the baselines at every point. Either way the figures can sit slightly below a full
search's at that point. The crossover is the first sweep value where "with" beats "without" after a
value where it did not, interpolated on log scales.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from deepcee.cluster import Cluster, LinkEntry, LinkSpec
from deepcee.errors import DeepceeError
from deepcee.plan import Plan
from deepcee.planner.baselines import build_baselines
from deepcee.planner.options import Progress
from deepcee.profile import ModelProfile
from deepcee.units import fmt_rate

SWEEP_BATCHES: tuple[int, ...] = tuple(2**k for k in range(4, 13))
"""16 .. 4096."""
SWEEP_BANDWIDTHS_BYTES_PER_S: tuple[float, ...] = tuple(
    m * 1e6 / 8 for m in (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
)
"""10 Mbit/s .. 10 Gbit/s, about x2 per step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepPoint:
    """One sweep value with the best samples/s with and without the left-out devices."""

    value: float
    """Global batch (samples) or link bandwidth (bytes/s)."""
    with_samples_per_s: float
    """Best plan that uses the left-out devices (0 when none fits)."""
    without_samples_per_s: float
    """Best plan on the kept devices only (0 when none fits)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sweep:
    """One swept parameter, its points and where the left-out devices start to pay off."""

    parameter: str
    """``global_batch`` or ``bandwidth_bytes_per_s``."""
    points: tuple[SweepPoint, ...]
    crossover: float | None
    """Where the plan with the left-out devices starts to win (log-interpolated), or ``None``."""
    note: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Crossover:
    """The crossover study. See [Note: crossover]."""

    kept_devices: tuple[str, ...]
    left_out_devices: tuple[str, ...]
    slow_links: tuple[str, ...]
    """The links swept, as ``a<->b`` (islands or nodes)."""
    batch: Sweep
    bandwidth: Sweep

    def to_dict(self) -> dict[str, Any]:
        def sweep(s: Sweep) -> dict[str, Any]:
            return {
                "parameter": s.parameter,
                "crossover": s.crossover,
                "note": s.note,
                "points": [{"value": p.value, "with_left_out_samples_per_s": p.with_samples_per_s,
                            "without_left_out_samples_per_s": p.without_samples_per_s} for p in s.points],
            }

        return {
            "kept_devices": list(self.kept_devices),
            "left_out_devices": list(self.left_out_devices),
            "slow_links": list(self.slow_links),
            "global_batch_sweep": sweep(self.batch),
            "bandwidth_sweep": sweep(self.bandwidth),
        }



class SweepPlanner(Protocol):
    """deepcee's plan for one point of a sweep, its estimate simulated; ``None`` when nothing fits.
    ``use_all_devices`` forbids leaving any device out."""

    def __call__(self, cluster: Cluster, model: ModelProfile, global_batch: int, *,
                 use_all_devices: bool = False) -> Plan | None: ...


class _Memo:
    """A :class:`SweepPlanner` that plans each distinct (devices, links, batch, exclusion) once: the
    bandwidth sweep's plan on the kept devices is the same at every bandwidth when the swept
    links touch only left-out islands and nodes (:meth:`Cluster.subset` drops their entries)."""

    def __init__(self, planner: SweepPlanner) -> None:
        self.planner = planner
        self.plans: dict[tuple, Plan | None] = {}

    def __call__(self, cluster: Cluster, model: ModelProfile, global_batch: int, *,
                 use_all_devices: bool = False) -> Plan | None:
        key = (cluster.device_names, cluster.islands, cluster.nodes, cluster.links, model.name, global_batch,
               use_all_devices)
        if key not in self.plans:
            self.plans[key] = self.planner(cluster, model, global_batch, use_all_devices=use_all_devices)
        return self.plans[key]


def with_without(cluster: Cluster, model: ModelProfile, batch: int, kept: Sequence[str], *,
                 planner: SweepPlanner, baselines: bool = True, kept_cluster: Cluster | None = None
                 ) -> tuple[float, float]:
    """(best samples/s using a left-out device, best samples/s on the kept devices only).
    ``kept_cluster``: ``cluster.subset(kept)`` when the caller has it."""
    kept_set = set(kept)
    without: list[float] = []
    with_: list[float] = []
    free = planner(cluster, model, batch)
    # when the free plan already uses every device, it is the all-devices search's answer too
    every = free if free is not None and len(free.devices) == len(cluster.device_names) else \
        planner(cluster, model, batch, use_all_devices=True)
    for plan in (planner(kept_cluster or cluster.subset(kept), model, batch), free, every):
        if plan is not None:
            (without if set(plan.devices) <= kept_set else with_).append(plan.estimate.samples_per_s)
    for b in build_baselines(cluster, model, batch) if baselines else ():
        if b.plan is not None:
            (without if set(b.plan.devices) <= kept_set else with_).append(b.samples_per_s)
    return max(with_, default=0.0), max(without, default=0.0)



def slow_link_entries(cluster: Cluster, kept: Sequence[str], bandwidth_bytes_per_s: float
                      ) -> tuple[list[LinkEntry], list[str]]:
    """Link entries that set the links the left-out devices sit behind to ``bandwidth_bytes_per_s``.

    Every inter-island link that touches a left-out device's island, and, inside an island,
    the links between a kept node and a left-out node; latency unchanged.
    """
    kept_set = set(kept)
    out = [d for d in cluster.device_names if d not in kept_set]
    order = {isl.name: k for k, isl in enumerate(cluster.islands)}
    entries: dict[tuple[str, str], LinkEntry] = {}
    for b in out:
        for a in cluster.device_names:
            da, db = cluster.device(a), cluster.device(b)
            if da.island != db.island:
                ends = tuple(sorted((da.island, db.island), key=order.__getitem__))
            elif a in kept_set and da.node != db.node:
                ends = (da.node, db.node)
            else:
                continue
            if ends in entries or ends[::-1] in entries:
                continue
            link = cluster.link(a, b)
            entries[ends] = LinkEntry(a=ends[0], b=ends[1], spec=LinkSpec(
                latency_s=link.latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s))
    return list(entries.values()), [f"{a}<->{b}" for a, b in entries]


def find_crossover(values: Sequence[float], with_sps: Sequence[float], without_sps: Sequence[float]
                   ) -> float | None:
    """First value where ``with`` overtakes ``without`` (log-interpolated ratio = 1), or ``None``."""
    for k in range(1, len(values)):
        before = with_sps[k - 1] / without_sps[k - 1] if without_sps[k - 1] > 0 else math.inf
        after = with_sps[k] / without_sps[k] if without_sps[k] > 0 else math.inf
        if before <= 1.0 < after:
            if not (math.isfinite(after) and before > 0):
                return float(values[k])
            lo, hi = math.log(values[k - 1]), math.log(values[k])
            frac = -math.log(before) / (math.log(after) - math.log(before))
            return float(math.exp(lo + frac * (hi - lo)))
    return None


def _sweep(parameter: str, values: Sequence[float], evaluate: Callable[[float], tuple[float, float]],
           fmt: Callable[[float], str], progress: Progress | None = None) -> Sweep:
    points = []
    for k, v in enumerate(values):
        if progress is not None:
            progress(f"crossover sweep of the {parameter.split('_bytes')[0].replace('_', ' ')}", k / len(values))
        w, wo = evaluate(v)
        points.append(SweepPoint(value=float(v), with_samples_per_s=w, without_samples_per_s=wo))
    cross = find_crossover(values, [p.with_samples_per_s for p in points], [p.without_samples_per_s for p in points])
    if cross is not None:
        note = f"the left-out devices start to pay off at {parameter} ~ {fmt(cross)}"
    elif points and all(p.with_samples_per_s > p.without_samples_per_s for p in points):
        note = f"the left-out devices pay off over the whole {parameter} range swept"
    else:
        note = f"leaving the devices out stays best over the whole {parameter} range swept ({fmt(values[0])} .. {fmt(values[-1])})"
    return Sweep(parameter=parameter, points=tuple(points), crossover=cross, note=note)


def crossover_study(cluster: Cluster, model: ModelProfile, global_batch: int, kept: Sequence[str], *,
                    planner: SweepPlanner, batches: Sequence[int] = SWEEP_BATCHES,
                    bandwidths_bytes_per_s: Sequence[float] = SWEEP_BANDWIDTHS_BYTES_PER_S,
                    planned: tuple[float, float] | None = None, baselines: bool = True,
                    progress: Progress | None = None) -> Crossover:
    """Sweep the global batch and the kept-to-left-out bandwidth. See [Note: crossover].

    ``planned``: (best samples/s with a left-out device, best without) at the planned point
    from the full search (the plan itself and its counterfactuals, all simulated); the batch
    sweep includes ``global_batch`` and takes the better of those and its own figures there, so
    the curves pass through the plan's own numbers. ``baselines=False``: the baselines are not
    built again at every point (the planner holds their plans, [Note: sweep pool]).
    ``progress(step, fraction)`` is called before each point."""
    left_out = tuple(d for d in cluster.device_names if d not in set(kept))
    if not left_out:
        raise DeepceeError("crossover needs left-out devices; every device is kept")
    _, links = slow_link_entries(cluster, kept, 1.0)
    planner = _Memo(planner)
    # the batch sweep's points plan on one kept sub-cluster object, not an equal new one per point:
    # the cost model memoises stage terms and links per cluster object (same content, same figures)
    kept_cluster = cluster.subset(kept)

    def at_bandwidth(bw: float) -> tuple[float, float]:
        entries, _ = slow_link_entries(cluster, kept, bw)
        return with_without(cluster.with_links(entries), model, global_batch, kept, planner=planner,
                            baselines=baselines)

    def at_batch(b: float) -> tuple[float, float]:
        w, wo = with_without(cluster, model, int(b), kept, planner=planner, baselines=baselines,
                             kept_cluster=kept_cluster)
        if planned is not None and int(b) == global_batch:
            w, wo = max(w, planned[0]), max(wo, planned[1])
        return w, wo

    values = sorted({*batches, global_batch}) if planned is not None else batches
    batch = _sweep("global_batch", values, at_batch, lambda v: f"{v:.0f}", progress)
    bandwidth = _sweep("bandwidth_bytes_per_s", bandwidths_bytes_per_s, at_bandwidth, fmt_rate, progress)
    return Crossover(kept_devices=tuple(kept), left_out_devices=left_out, slow_links=tuple(links),
                     batch=batch, bandwidth=bandwidth)
