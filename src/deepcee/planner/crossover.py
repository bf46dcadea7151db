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
device used), deepcee's free plan when it uses one, the baselines that use one, and with the
sweep pool its best entry that uses one (:meth:`~deepcee.planner.sweep_pool.PoolPlanner.
best_using`: the full search's plans on some of the left-out devices, re-scored at the point).
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

Re-scored layouts can miss what the left-out devices give at a point far from the planned one: on
a 4-region cluster (16 A100s kept, 18 other GPUs left out behind 0.1-1 Gbit/s links, llama-7b at
batch 512) the pool's best plan with them at 10 Gbit/s gave 17.4 samples/s against 24.9 without,
and ``compare`` printed that leaving them out stays best over the whole range, while a new search
there plans 5 stages on the eu-west and us-east GPUs at 29.3 samples/s. So where the planner only
re-scores, a ``confirm`` planner (``compare``: the lighter search) searches anew at the top of
each sweep, the end that favours the left-out devices most (the highest bandwidth, the largest
batch). The plans the searches find join the re-scored pool
(:meth:`deepcee.planner.sweep_pool.PoolPlanner.add`) and the sweep is re-scored with them, every
point keeping its better figures; then, while the first point where the left-out devices pay off
is not the sweep's first, a search just below it checks whether the crossover lies lower (at
most :data:`CONFIRM_SEARCHES_MAX` searches per sweep). The search is of the whole cluster (its
plan is "with" where it uses a left-out device, else "without"). The note names the points
searched.
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
    """A :class:`SweepPlanner` that plans each distinct (view of the cluster's devices, batch,
    exclusion) once: the bandwidth sweep's plan on the kept devices is the same at every
    bandwidth, since the swept links are not in the kept devices' view ([Note: cluster views] in
    :mod:`deepcee.cluster`)."""

    def __init__(self, planner: SweepPlanner) -> None:
        self.planner = planner
        self.plans: dict[tuple, Plan | None] = {}

    def __call__(self, cluster: Cluster, model: ModelProfile, global_batch: int, *,
                 use_all_devices: bool = False) -> Plan | None:
        key = (cluster.view_key(cluster.device_names), model.name, global_batch, use_all_devices)
        if key not in self.plans:
            self.plans[key] = self.planner(cluster, model, global_batch, use_all_devices=use_all_devices)
        return self.plans[key]


def with_without(cluster: Cluster, model: ModelProfile, batch: int, kept: Sequence[str], *,
                 planner: SweepPlanner, baselines: bool = True, kept_cluster: Cluster | None = None,
                 using: Callable[[Cluster, int], Plan | None] | None = None) -> tuple[float, float]:
    """(best samples/s using a left-out device, best samples/s on the kept devices only).
    ``kept_cluster``: ``cluster.subset(kept)`` when the caller has it; ``using(cluster, batch)``:
    the best plan that uses at least one left-out device, where the planner can say (the sweep
    pool)."""
    kept_set = set(kept)
    without: list[float] = []
    with_: list[float] = []
    free = planner(cluster, model, batch)
    # when the free plan already uses every device, it is the all-devices search's answer too
    every = free if free is not None and len(free.devices) == len(cluster.device_names) else \
        planner(cluster, model, batch, use_all_devices=True)
    partial = using(cluster, batch) if using is not None else None
    for plan in (planner(kept_cluster or cluster.subset(kept), model, batch), free, every, partial):
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


def _points(values: Sequence[float], evaluate: Callable[[float], tuple[float, float]], step: str,
            progress: Progress | None = None, before: Sequence[SweepPoint] = ()) -> list[SweepPoint]:
    """Each value's (with, without) from ``evaluate``; where ``before`` is given, the better of
    its figures and the new ones, point by point."""
    points = []
    for k, v in enumerate(values):
        if progress is not None:
            progress(step, k / len(values))
        w, wo = evaluate(v)
        if before:
            w, wo = max(w, before[k].with_samples_per_s), max(wo, before[k].without_samples_per_s)
        points.append(SweepPoint(value=float(v), with_samples_per_s=w, without_samples_per_s=wo))
    return points


def _sweep(parameter: str, values: Sequence[float], points: Sequence[SweepPoint], fmt: Callable[[float], str],
           searched: Sequence[int] = ()) -> Sweep:
    """The sweep's crossover and note (``searched``: the points searched anew)."""
    cross = find_crossover(values, [p.with_samples_per_s for p in points], [p.without_samples_per_s for p in points])
    if cross is not None:
        note = f"the left-out devices start to pay off at {parameter} ~ {fmt(cross)}"
    elif points and all(p.with_samples_per_s > p.without_samples_per_s for p in points):
        note = f"the left-out devices pay off over the whole {parameter} range swept"
    else:
        note = f"leaving the devices out stays best over the whole {parameter} range swept ({fmt(values[0])} .. {fmt(values[-1])})"
    if searched:
        note += f" (searched anew at {', '.join(fmt(values[k]) for k in searched)})"
    return Sweep(parameter=parameter, points=tuple(points), crossover=cross, note=note)


CONFIRM_SEARCHES_MAX = 3
"""At most this many new searches per sweep in :func:`_confirmed` (each costs a search of the whole
cluster: 3-7 CPU s at 512 devices, where ``compare`` has a 30 s target)."""


def _confirmed(values: Sequence[float], points: Sequence[SweepPoint], search: Callable[[float], tuple[float, float]],
               rescore: Callable[[list[SweepPoint]], list[SweepPoint]],
               progress: Callable[[float], None] | None) -> tuple[list[SweepPoint], list[int]]:
    """The sweep's ``points`` checked by new searches ([Note: crossover], last paragraph): first at
    the top of the range; then, while the first point where the left-out devices pay off is not the
    first point, just below it (where a search can move the crossover down). Each searched point
    takes the better figures of the two, and after each search ``rescore`` re-scores every point
    with the searches' layouts added. Returns the points and the indices searched."""
    out = list(points)
    searched: list[int] = []
    k: int | None = len(out) - 1
    while k is not None and k not in searched and len(searched) < CONFIRM_SEARCHES_MAX:
        if progress is not None:
            progress(len(searched) / CONFIRM_SEARCHES_MAX)
        w, wo = search(values[k])
        p = out[k]
        out[k] = SweepPoint(value=p.value, with_samples_per_s=max(p.with_samples_per_s, w),
                            without_samples_per_s=max(p.without_samples_per_s, wo))
        searched.append(k)
        out = rescore(out)
        first = next((j for j, q in enumerate(out) if q.with_samples_per_s > q.without_samples_per_s), None)
        k = first - 1 if first else None
    return out, sorted(searched)


def crossover_study(cluster: Cluster, model: ModelProfile, global_batch: int, kept: Sequence[str], *,
                    planner: SweepPlanner, batches: Sequence[int] = SWEEP_BATCHES,
                    bandwidths_bytes_per_s: Sequence[float] = SWEEP_BANDWIDTHS_BYTES_PER_S,
                    planned: tuple[float, float] | None = None, baselines: bool = True,
                    confirm: SweepPlanner | None = None, progress: Progress | None = None) -> Crossover:
    """Sweep the global batch and the kept-to-left-out bandwidth. See [Note: crossover].

    ``planned``: (best samples/s with a left-out device, best without) at the planned point
    from the full search (the plan itself and its counterfactuals, all simulated); the batch
    sweep includes ``global_batch`` and takes the better of those and its own figures there, so
    the curves pass through the plan's own numbers. ``baselines=False``: the baselines are not
    built again at every point (the planner holds their plans, [Note: sweep pool]).
    ``confirm``: a planner that searches anew, run at a few points of each sweep where
    ``planner`` only re-scores ([Note: crossover], last paragraph).
    ``progress(step, fraction)`` is called before each point."""
    left_out = tuple(d for d in cluster.device_names if d not in set(kept))
    if not left_out:
        raise DeepceeError("crossover needs left-out devices; every device is kept")
    _, links = slow_link_entries(cluster, kept, 1.0)
    pool_best_using = getattr(planner, "best_using", None)
    planner = _Memo(planner)
    left_set = frozenset(left_out)
    using_memo: dict[tuple, Plan | None] = {}

    def using(c: Cluster, b: int) -> Plan | None:
        key = (c.view_key(c.device_names), model.name, b)
        if key not in using_memo:
            using_memo[key] = pool_best_using(c, model, b, left_set)
        return using_memo[key]

    use = using if pool_best_using is not None else None
    # the batch sweep's points plan on one kept sub-cluster object, not an equal new one per point:
    # the cost model memoises stage terms and links per cluster object (same content, same figures)
    kept_cluster = cluster.subset(kept)

    def at_bandwidth(bw: float) -> tuple[float, float]:
        entries, _ = slow_link_entries(cluster, kept, bw)
        return with_without(cluster.with_links(entries), model, global_batch, kept, planner=planner,
                            baselines=baselines, using=use)

    def at_batch(b: float) -> tuple[float, float]:
        w, wo = with_without(cluster, model, int(b), kept, planner=planner, baselines=baselines,
                             kept_cluster=kept_cluster, using=use)
        if planned is not None and int(b) == global_batch:
            w, wo = max(w, planned[0]), max(wo, planned[1])
        return w, wo

    searching = _Memo(confirm) if confirm is not None else None

    def searched_at(c: Cluster, b: int) -> tuple[float, float]:
        """(with, without) of a new search of the whole cluster ``c`` at batch ``b``: its plan
        counts as "with" where it uses a left-out device, else as "without" (then no plan with
        them beats it, as far as the search sees)."""
        plan = searching(c, model, b)
        if plan is None:
            return 0.0, 0.0
        sps = plan.estimate.samples_per_s
        return (sps, 0.0) if not left_set.isdisjoint(plan.devices) else (0.0, sps)

    def search_bandwidth(bw: float) -> tuple[float, float]:
        return searched_at(cluster.with_links(slow_link_entries(cluster, kept, bw)[0]), global_batch)

    values = sorted({*batches, global_batch}) if planned is not None else batches
    bws = list(bandwidths_bytes_per_s)
    by_batch = _points(values, at_batch, "crossover sweep of the global batch", progress)
    by_bw = _points(bws, at_bandwidth, "crossover sweep of the bandwidth", progress)
    on_batch: list[int] = []
    on_bw: list[int] = []
    if searching is not None:
        add = getattr(planner.planner, "add", None)
        rescored_with = {"batch": 0, "bandwidth": 0}  # pool additions each sweep has been re-scored with
        added = [0]

        def rescorer(name: str, sweep_values: Sequence[float], evaluate: Callable[[float], tuple[float, float]],
                     step: str) -> Callable[[list[SweepPoint]], list[SweepPoint]]:
            def rescore(points: list[SweepPoint]) -> list[SweepPoint]:
                found = [p for p in searching.plans.values() if p is not None]
                if add is not None and found and add(found):
                    added[0] += 1
                    planner.plans.clear()
                    using_memo.clear()
                if rescored_with[name] == added[0]:
                    return points
                rescored_with[name] = added[0]
                return _points(sweep_values, evaluate, step, progress, before=points)
            return rescore

        def report(step: str) -> Callable[[float], None] | None:
            return None if progress is None else lambda f: progress(step, f)

        again = ", searched layouts added"
        batch_rescore = rescorer("batch", values, at_batch, "crossover sweep of the global batch" + again)
        by_batch, on_batch = _confirmed(values, by_batch, lambda b: searched_at(cluster, int(b)), batch_rescore,
                                        report("crossover search of the global batch"))
        by_bw, on_bw = _confirmed(bws, by_bw, search_bandwidth,
                                  rescorer("bandwidth", bws, at_bandwidth, "crossover sweep of the bandwidth" + again),
                                  report("crossover search of the bandwidth"))
        by_batch = batch_rescore(by_batch)  # with the bandwidth searches' layouts too
    batch = _sweep("global_batch", values, by_batch, lambda v: f"{v:.0f}", on_batch)
    bandwidth = _sweep("bandwidth_bytes_per_s", bws, by_bw, fmt_rate, on_bw)
    return Crossover(kept_devices=tuple(kept), left_out_devices=left_out, slow_links=tuple(links),
                     batch=batch, bandwidth=bandwidth)
