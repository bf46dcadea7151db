"""The layer split: dynamic programming over contiguous layer ranges (step 1 and 2 of
[Note: search] in :mod:`deepcee.planner.search`).

Torch-free. :class:`SplitTables` holds the DP inputs of one (layout, microbatch size): per
stage the :class:`~deepcee.planner.ranges.RangeCosts` of its device set, per boundary the
link costs of one microbatch for every boundary layer (:func:`boundary_arrays`, the terms
of :func:`deepcee.planner.cost_model.boundary_cost` as arrays). :func:`split_layers` is the
DP, tested against brute force; :func:`in_flight_split` the DP that also respects each stage's
in-flight limit.

[Note: in-flight limit]
A stage that holds at most ``k`` microbatches at once, each for at least ``h`` seconds (its
own ``F+I+W`` plus the round trip through every later stage and link, with nothing queued),
cannot finish ``M`` microbatches in less than ``M x h / k`` (Little's law). ``k`` is the
schedule's in-flight count (1F1B/ZB-H1 ``S - s``, ZB-H2 ``2(S-s)-1``, GPipe ``M``), or, for a
compact schedule, what the stage's memory holds. This is how memory limits the link round
trip time a pipeline can hide; the closed form and :func:`in_flight_split` both count it.

[Note: neighbour cycle]
The in-flight limit of a whole stage is not the only one. In a fixed schedule's steady state a
stage ``s`` runs its next ``F`` only after the backward of a microbatch ``k_s`` earlier, and
stage ``s+1`` sends a backward only after the ``F`` it receives (simulated orders: ZB-H2 stage
21 of 32 runs ``I(i) W(i) F(i+21)``, stage 22 ``F(j) I(j-18)``). So between two neighbours only
``k_s - k_{s+1} + 1`` microbatches circulate (3 for ZB-H2, 2 for 1F1B and ZB-H1), and each
turn of that cycle takes stage ``s``'s ``F+I+W``, the link there, stage ``s+1``'s ``F+I`` and
the link back: over a slow link with latency the cycle, not the link's bytes, sets the pace.
The closed form counts it as one more term per boundary: the first ``k_s`` microbatches at the
link's pace (the warm-up does not wait), the rest at ``cycle / (k_s - k_{s+1} + 1)``. "The link
there and back" is what one receiving device waits for (per device and link resource, the
largest latency plus its shares' bytes over the bandwidth; :class:`BoundaryArrays`
``pair_trip``). Found on WAN seed 84 of ``benchmarks/planner_at_scale.py``: a chain of
us-west, us-east, me-central had a closed form of 112.8 s against the cost model's 139.8 s,
its link busy 82% of the time (1.5 s per three microbatches, the cycle); the closed form had
ranked it first (with the cycle: 136.4 s). Over 1,091 fixed-schedule plans the search scored on
WAN seeds 0-39, the closed form's error against the cost model went from a mean of 5.0% (down
to -41%; 168 plans more than 10% too fast) to 1.4% (-7.2% to +5.8%), and its Kendall tau
against the cost model per seed from 0.38 to 0.64 on average. Stages that hold every
microbatch (``k_s >= M``) have no such cycle.

The same holds for any run of stages: the loop from stage ``s`` to a later stage ``t`` and back
holds ``k_s - k_t + 1`` microbatches, and each turn takes stage ``s``'s ``F+I+W`` and the
trips of stages ``s+1..t`` (their ``F+I`` and the links there and back). In a fixed schedule
the warm-ups fall by one or two per stage, so two neighbours bind; the compact builder's capped
zero bubble can give a run of stages equal warm-ups (memory caps them alike), and then the loop
through the whole run binds: one microbatch at a time goes round it. The closed form takes, per
stage ``s``, the slowest of its loops (session 21; on the four-stage test of
``tests/unit/test_split_compact_closed_form.py`` with warm-ups 2, 2, 2, 2 the closed form went
from 8.03 s to 8.59 s against the simulator's 8.90 s).

[Note: compact closed form]
A compact schedule's order is the builder's (:func:`deepcee.schedule.compact.search_compact`):
the best of its templates that fit memory (GPipe, ZB-H1, ZB-H2 and the capped zero bubble,
warm-ups ``min(memory cap, need + 1)``), and, up to ``compact_max_actions`` stages x
microbatches, of its greedy list scheduler. So its closed form is the least over those
(:meth:`SplitTables.compact_counts`): each template as a fixed order with its own in-flight
counts and loops, and the greedy with what memory holds and no loops (it runs a ready backward
without waiting for a forward, so a stage's own in-flight limit is what binds). Before session
21 a compact schedule was scored with the neighbour cycle of its memory caps, as if it were a
fixed order holding that many: 87 of 95 compact plans the search scored on WAN seeds 0-14 came
out more than 10% too slow (median +94%); before session 20, without the cycle, as optimistic
as -74%. Now those 95 plans are within -6.5% to +3.6% of the cost model (mean error 1.7%,
Kendall tau per seed 0.12 in session 20, 0.46 in session 19, now 0.65; all of them above
compact_max_actions, templates only), and on the tests'
four-stage pipeline with memory for 3-15 microbatches per stage against the simulated
compact schedule, greedy or templates only, within 4.2% (the session 20 form: +81% to +470%).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepcee.cluster import Cluster
from deepcee.plan import share_overlaps
from deepcee.planner.ranges import RangeCosts, RangeTables

_INF = math.inf


@dataclass(slots=True)
class BoundaryArrays:
    """Per boundary layer ``a``: forward/backward (latency, serialisation) of one microbatch, and
    ``pair_trip``, what one receiving device waits for there and back: forward, the slowest
    device of the later stage, backward, of the earlier one; each the largest over link resources
    of the latency plus the bytes of the shares it receives over that resource
    ([Note: neighbour cycle])."""

    lat_f: np.ndarray
    ser_f: np.ndarray
    lat_b: np.ndarray
    ser_b: np.ndarray
    pair_trip: np.ndarray


def boundary_arrays(cluster: Cluster, tables: RangeTables, src: tuple[str, ...], src_shares: tuple[int, ...],
                    dst: tuple[str, ...], dst_shares: tuple[int, ...]) -> BoundaryArrays:
    """One boundary between device sets ``src`` and ``dst`` for every boundary layer (see the module docstring)."""
    per: list[dict[str, list[float]]] = [{}, {}]
    fwd, bwd, link = per[0], per[1], cluster.link
    # per receiving device (forward: a device of dst; backward: of src) and link resource: the
    # latency and the seconds per boundary byte of the shares it waits for
    waits: list[dict[tuple[str, str], list[float]]] = [{}, {}]
    for i, j, lo, hi in share_overlaps(src_shares, dst_shares):
        a, b = src[i], dst[j]
        there, back = link(a, b), link(b, a)
        for got, who, lk in ((waits[0], b, there), (waits[1], a, back)):
            w = got.setdefault((who, lk.resource), [0.0, 0.0])
            w[0] = max(w[0], max(0.0, lk.latency_s))
            w[1] += (hi - lo) / lk.bandwidth_bytes_per_s
        for got, lk in ((fwd, there), (bwd, back)):
            r = got.get(lk.resource)
            if r is None:
                got[lk.resource] = [float(hi - lo), max(0.0, lk.latency_s), lk.bandwidth_bytes_per_s]
            else:
                r[0] += hi - lo
                r[1] = max(r[1], lk.latency_s)
    bnd = tables.boundary_bytes
    out = []
    for d in range(2):
        sers = np.outer([samples / bw for samples, _, bw in per[d].values()], bnd)
        lats = np.array([lat for _, lat, _ in per[d].values()])[:, None]
        ser = sers.max(axis=0)
        out += [(sers + lats).max(axis=0) - ser, ser]
    trip = sum(np.max([lat + per_byte * bnd for lat, per_byte in w.values()], axis=0) for w in waits)
    return BoundaryArrays(*out, trip)


@dataclass(slots=True)
class SplitTables:
    """DP inputs of one (layout, n): per stage ``RangeCosts``, per boundary link arrays.

    ``in_flight`` arguments are per stage microbatches held (a fixed schedule's counts), or
    ``None`` for a compact schedule, which holds what memory allows (``RangeCosts.in_flight_caps``).
    With ``recompute``, a range that does not fit memory without recomputation may use it.
    """

    costs: list[RangeCosts]
    bounds: list[BoundaryArrays]
    m: int
    recompute: bool = True
    greedy_actions: int = 0
    """The compact builder runs its greedy list scheduler (not only its templates) up to this many
    stages x microbatches (``PlannerOptions.compact_max_actions``; [Note: compact closed form])."""
    _loads: dict | None = None
    _little: dict | None = None
    _links: list[np.ndarray] | None = None
    _fills: list[np.ndarray] | None = None

    def options(self) -> tuple[bool, ...]:
        return (False, True) if self.recompute else (False,)

    def loads(self, in_flight: Sequence[int] | None) -> list[np.ndarray]:
        """Per stage the iteration load of every range, ``inf`` where empty or out of memory; a
        range that fits only with recomputation gets the recomputing load."""
        key = None if in_flight is None else tuple(in_flight)
        if self._loads is None:
            self._loads = {}
        got = self._loads.get(key)
        if got is None:
            got = self._loads[key] = self._make_loads(in_flight)
        return got

    def _make_loads(self, in_flight: Sequence[int] | None) -> list[np.ndarray]:
        return [rc.load(self.m, None if in_flight is None else in_flight[s], self.recompute)
                for s, rc in enumerate(self.costs)]

    def link_loads(self) -> list[np.ndarray]:
        if self._links is None:
            self._links = [np.zeros(0)] + [self.m * np.maximum(b.ser_f, b.ser_b) + np.maximum(b.lat_f, b.lat_b)
                                           for b in self.bounds]
        return self._links

    def fills(self) -> list[np.ndarray]:
        if self._fills is None:
            self._fills = [np.zeros(0)] + [b.lat_f + b.ser_f + b.lat_b + b.ser_b for b in self.bounds]
        return self._fills

    def fits(self, split: Sequence[int], in_flight: Sequence[int] | None) -> bool:
        return all(math.isfinite(load.item(split[s], split[s + 1])) for s, load in enumerate(self.loads(in_flight)))

    def recompute_flags(self, split: Sequence[int], in_flight: Sequence[int] | None) -> tuple[bool, ...]:
        """Per stage: recompute only where the stage does not fit without it (the cheaper option)."""
        if not self.recompute:
            return (False,) * len(self.costs)
        return tuple(not rc.memory_excess(1 if in_flight is None else in_flight[s], False, self.m)
                     .item(split[s], split[s + 1]) <= 0 for s, rc in enumerate(self.costs))

    def little_terms(self, s: int, flag: bool, in_flight: Sequence[int] | None, fused: bool) -> tuple:
        """Cached per-range terms of stage ``s`` for :func:`in_flight_split`: iteration load, the
        in-flight room ``k / M`` (a hold ``h`` meets the limit when ``h <= tau x k / M``), the
        static mask (non-empty range that fits memory), ``F+I+W`` and the round-trip share."""
        key = (s, flag, None if in_flight is None else in_flight[s], fused)
        if self._little is None:
            self._little = {}
        got = self._little.get(key)
        if got is None:
            rc = self.costs[s]
            size = rc.compute_s.shape[0]
            valid = ~np.tril(np.ones((size, size), dtype=bool))
            if in_flight is None:
                k = rc.in_flight_caps(self.m, flag)
                mem_ok = k >= 1
            else:
                k = np.full((size, size), float(min(in_flight[s], self.m)))
                mem_ok = rc.memory_excess(in_flight[s], flag, self.m) <= 0
            load = self.m * rc.compute_with(flag) + rc.allreduce_s + rc.optimizer_s
            got = self._little[key] = (load, np.maximum(k, 1.0) / self.m, valid & mem_ok, rc.compute_with(flag),
                                       rc.round_trip_s(fused, flag))
        return got

    def stacked_terms(self, s: int, in_flight: Sequence[int] | None, fused: bool) -> tuple[np.ndarray, ...]:
        """:meth:`little_terms` of every option of :meth:`options`, stacked on a first axis; cached."""
        key = ("stacked", s, None if in_flight is None else in_flight[s], fused)
        if self._little is None:
            self._little = {}
        got = self._little.get(key)
        if got is None:
            terms = [self.little_terms(s, flag, in_flight, fused) for flag in self.options()]
            got = self._little[key] = tuple(np.stack(x) for x in zip(*terms, strict=True))
        return got

    def holds(self, split: Sequence[int], flags: Sequence[bool], fused: bool = False) -> list[float]:
        """Per stage, how long one microbatch is held there with nothing queued: its own ``F+I+W``
        and the round trip through every later stage and link (see [Note: in-flight limit])."""
        fills, after, out = self.fills(), 0.0, []
        for s in reversed(range(len(self.costs))):
            a, b = split[s], split[s + 1]
            rc = self.costs[s]
            out.append(rc.compute_with(flags[s]).item(a, b) + after)
            after += rc.round_trip_s(fused, flags[s]).item(a, b) + (fills[s].item(a) if s else 0.0)
        return out[::-1]

    def caps_at(self, split: Sequence[int], flags: Sequence[bool], in_flight: Sequence[int] | None) -> list[int]:
        """Microbatches each stage holds: the fixed schedule's, or what memory allows (compact)."""
        if in_flight is not None:
            return [min(k, self.m) for k in in_flight]
        return [max(1, int(self.costs[s].in_flight_caps(self.m, flags[s]).item(split[s], split[s + 1])))
                for s in range(len(self.costs))]

    def compact_counts(self, split: Sequence[int], flags: Sequence[bool],
                       holds: Sequence[float]) -> list[tuple[list[int], bool]]:
        """What the compact builder may run ([Note: compact closed form]), as (per-stage in-flight
        counts, whether its order ties neighbours into loops): its templates that fit memory,
        GPipe, ZB-H1, ZB-H2 and the capped zero bubble (warm-ups ``min(memory cap, need + 1)``
        made non-increasing along the pipeline; ``need`` the hold over the bottleneck's time per
        microbatch, Little's law, as the builder's ``in_flight_need``); and, up to
        ``greedy_actions`` stages x microbatches, its greedy list scheduler, which holds what
        memory allows and runs a ready backward without waiting for a forward (no loops)."""
        n, m = len(self.costs), self.m
        mem = self.caps_at(split, flags, None)
        cycle = max(self.costs[s].compute_with(flags[s]).item(split[s], split[s + 1]) for s in range(n))
        for s in range(1, n):
            b = self.bounds[s - 1]
            cycle = max(cycle, b.ser_f.item(split[s]), b.ser_b.item(split[s]))
        out = [counts for counts in ([m] * n, [min(n - s, m) for s in range(n)],
                                     [min(2 * (n - s) - 1, m) for s in range(n)])
               if all(k <= cap for k, cap in zip(counts, mem, strict=True))]
        warm, prev = [], m
        for s, cap in enumerate(mem):
            need = max(1, math.ceil(holds[s] / cycle - 1e-9)) if cycle > 0 else 1
            prev = max(1, min(cap, need + 1, prev))
            warm.append(prev)
        if warm not in out:
            out.append(warm)
        got = [(counts, True) for counts in out]
        if n * m <= self.greedy_actions:
            got.append((mem, False))
        return got

    def closed_form(self, split: Sequence[int], loads: list[np.ndarray], in_flight: Sequence[int] | None = None,
                    fused: bool = False, flags: Sequence[bool] | None = None) -> float:
        """``T = bottleneck load + one microbatch through everything else`` (see [Note: search]);
        the loads include each stage's in-flight limit ([Note: in-flight limit]) and the
        neighbour cycle ([Note: neighbour cycle]). ``in_flight=None`` (compact): the least over
        what the compact builder can run ([Note: compact closed form]). ``flags``: per
        stage recomputation (default: only where a stage does not fit without it)."""
        links, fills = self.link_loads(), self.fills()
        flags = self.recompute_flags(split, in_flight) if flags is None else flags
        if not all(math.isfinite(loads[s].item(split[s], split[s + 1])) for s in range(len(self.costs))):
            return _INF
        holds = self.holds(split, flags, fused)
        # the terms that do not depend on the in-flight counts: (iteration term, per microbatch)
        own: list[tuple[float, float]] = []
        link_terms: list[tuple[float, float]] = [(0.0, 0.0)]
        computes, trips = [], [0.0]
        for s, rc in enumerate(self.costs):
            a, b = split[s], split[s + 1]
            c = rc.compute_with(flags[s]).item(a, b)
            computes.append(c)
            own.append((rc.base_load(self.m, flags[s]).item(a, b), c))
            if s:
                bound = self.bounds[s - 1]
                link_terms.append((links[s].item(a), max(bound.ser_f.item(a), bound.ser_b.item(a))))
                trips.append(rc.round_trip_s(fused, flags[s]).item(a, b) + bound.pair_trip.item(a))
        fill = sum(computes) + sum(fills[s].item(split[s]) for s in range(1, len(self.costs)))
        options = (self.compact_counts(split, flags, holds) if in_flight is None
                   else [(self.caps_at(split, flags, in_flight), True)])
        reach = np.cumsum(trips)  # reach[t] - reach[s]: the trips of stages s+1..t
        # a loop's time: stage s's F+I+W and the trips of stages s+1..t (only t > s counts)
        loop_s = np.where(_later(len(trips)), (np.asarray(computes) - reach)[:, None] + reach[None, :], 0.0)
        best = _INF
        for caps, tied in options:
            terms = []
            for s in range(len(self.costs)):
                terms += [own[s], (self.m * holds[s] / caps[s], holds[s] / caps[s])]
                if s:
                    terms.append(link_terms[s])
            if tied:  # [Note: neighbour cycle]: the loop of stages s..t holds k_s - k_t + 1 microbatches
                k = np.asarray(caps, dtype=float)
                worst = np.max(loop_s / np.maximum(1.0, k[:, None] - k[None, :] + 1.0), axis=1)
                for s in range(len(self.costs) - 1):
                    if caps[s] < self.m:
                        terms.append((caps[s] * link_terms[s + 1][1] + (self.m - caps[s]) * worst[s], worst[s]))
            # the first largest term, as numpy's argmax
            top, per_mb = max(terms, key=lambda t: t[0])
            best = min(best, top + fill - per_mb)
        return float(best)


@functools.cache
def _later(n: int) -> np.ndarray:
    """``[s, t]``: whether ``t > s`` (read only)."""
    out = np.triu(np.ones((n, n), dtype=bool), 1)
    out.flags.writeable = False
    return out


def in_flight_split(tab: SplitTables, tau: float, in_flight: Sequence[int] | None, *,
                    fused: bool = False) -> tuple[float, tuple[int, ...], tuple[bool, ...]] | None:
    """The split with the shortest round trip whose every load stays under ``tau``, in-flight
    limits included (see [Note: in-flight limit]); ``(round trip, split, recompute flags)``.

    Dynamic programming from the last stage: ``V_s(a)`` is the least round trip of a microbatch
    from stage ``s`` (starting at layer ``a``) to the end and back. Stage ``s`` on ``[a, b)``
    is allowed when its load ``M (F+I+W) + all-reduce + optimizer``, its link's load and
    ``M x (F+I+W + link round trip + V_{s+1}(b)) / k`` are all ``<= tau`` (``k`` the microbatches
    it holds, which fit memory). Every constraint and the objective grow with ``V_{s+1}``, so
    the least ``V_{s+1}`` is the best for every earlier stage: the result is exact for this
    model. Each range may recompute (when ``tab.recompute``): it pays one more ``F`` and holds
    only its input per microbatch, which raises ``k``.
    """
    n = len(tab.costs)
    size = tab.costs[0].compute_s.shape[0]
    links, fills = tab.link_loads(), tab.fills()
    value = np.full(size, _INF)
    value[size - 1] = 0.0
    rows = np.arange(size)
    backs: list[tuple[np.ndarray, np.ndarray]] = []
    for s in reversed(range(n)):
        after = np.where(links[s + 1] <= tau, fills[s + 1] + value, _INF) if s < n - 1 else value
        # both recomputation options at once: axis 0 of every term (without, with)
        load, room, ok0, compute, trip = tab.stacked_terms(s, in_flight, fused)
        ok = ok0 & (load <= tau) & (compute + after <= tau * room)
        val = np.where(ok, trip + after, _INF)
        if len(val) == 1:
            best, pick = val[0], np.zeros(val[0].shape, dtype=bool)
        else:
            pick = val[1] < val[0]
            best = np.where(pick, val[1], val[0])
        arg = np.argmin(best, axis=1)
        value = best[rows, arg]
        backs.append((arg, pick[rows, arg]))
    if not np.isfinite(value[0]):
        return None
    split, flags, a = [0], [], 0
    for arg, pick in reversed(backs):
        flags.append(bool(pick[a]))
        a = int(arg[a])
        split.append(a)
    return float(value[0]), tuple(split), tuple(flags)


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
