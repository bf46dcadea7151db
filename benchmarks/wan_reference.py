"""The reference of ``benchmarks/planner_at_scale.py``: a search of deepcee's plan space that shares
no search code with the planner, scored by the simulator.

It reuses only the plan format, the compact schedule builder, the memory model and the
simulator. Two parts:

**The global search** (:func:`reference_search`), version 3 (:data:`REFERENCE_VERSION`), in
phases, each ending at a fraction of its budget of CPU seconds of its own process (so a busy
machine does not weaken it much):

1. *Screen* (to :data:`SCREEN_SHARE`): island chains (every ordered subset of regions that holds
   the model's state) in increasing order of its own lower bound on the simulated time (all
   samples over the summed device speed; every hop's bytes over its summed pipes plus its
   latency; the summed round-trip latency), each valued by its best configuration with the same
   stages-per-region rule everywhere (``ceil(devices / g)`` balanced chunks, ``g`` in 1, 2, 4, 8,
   16) and the whole chain as one stage; where none of those fits, the most stages the chain
   allows (``min(layers, devices)``, spread by devices) and, for the 4 smallest microbatch
   sizes, the most stages that fit (each region in chunks of the fewest devices one layer fits
   on, with the stages ahead of it in flight).
2. *Descents* (to :data:`WALK_SHARE`, only where the screen did not reach every chain): from each
   of the :data:`WALK_STARTS` best screened chains, the neighbour chain (two islands swapped, one
   moved, replaced by a left-out one, dropped or added) the screen values best, while it improves;
   then from the best chain found, two seeded random moves away, again and again (an iterated
   local search, deterministic).
3. *Layouts* (to :data:`LAYOUT_SHARE`): the chains in the screen's order, each with any number of
   balanced stages per region (from the best screen layout, a descent that changes one region's
   count at a time; the best :data:`KEEP` layouts seen with every size), and the layer split by its own
   dynamic program over a bottleneck-plus-fill bound (memory with the plan and runtime terms and
   the microbatches in flight of 1F1B and of ZB-H2, each its own split; recomputation where a
   stage does not fit; of the splits with the least bottleneck, the one whose busiest stage is
   least, then whose summed load is least). The best :data:`KEEP` configurations of each chain
   are pooled.
4. *Quick simulations* (to :data:`SIMULATE_SHARE`): the pool by the DP's value, each with the
   schedule its split was made for, where a device is over its memory its stages recomputing too.
5. *Final*: the :data:`FINAL` best simulated get every schedule, with the DP's recomputation and
   with every stage recomputing, and compact (the builder's own schedule for the split, as the
   planner builds it), with the sync whose summed all-reduce is least and, where they differ, the
   other of the two the planner searches (ring, hierarchical); the best plan's split is refined
   by moving one boundary at a time.
6. *Widening*, while the budget lasts (small clusters finish phases 1-5 in a few CPU seconds):
   its CPU time shared evenly between finishing the next best quickly simulated configuration
   as in phase 5 (its best plan refined) and rounds of more layouts (twice the layouts kept per
   chain, their one-region changes valued, the next chains laid out), each new configuration
   simulated quickly. It ends when every configuration it can reach is finished.

Every plan is scored by the simulator. It is *not* exhaustive over chains, splits and devices
per stage (no exhaustive search of those is affordable at these sizes); ``exhausted`` says when
every chain under its final bound was laid out and simulated. Version 1 (sessions up to 22)
enumerated chains by the bound alone, laid out ``g`` in 1, 2, 4, 8, 16 only, split for 1F1B
only, and simulated every schedule of each chain's best 4 at once: at 20 CPU s deepcee beat it
on 99 of 100 instances (by 28% at the median). Version 2 (session 23) had phases 1-5 without the
fitted layouts, the tie-breaks, the second sync and the widening: every plan had the ring sync,
so on ``scale-12/resnet50/256`` deepcee's own layout simulated 0.0856 s instead of 0.0690 s, and
on small clusters it stopped within 4 CPU s of its 40.

**The polish** (:func:`polish`) is a local search from a given plan (``planner_at_scale`` gives
it deepcee's own plan), every neighbour scored by the simulator, first improvement of more than
:data:`POLISH_MIN_GAIN` taken, in a fixed order (deterministic), until no neighbour improves or
:data:`POLISH_SIMULATIONS` simulations are spent. Neighbours, in this order:

1. another schedule (each fixed one and compact; recomputing every stage too); the other sync;
2. the next smaller and larger microbatch size (split and recomputation kept);
3. one region's stages one more or one fewer (its devices in balanced chunks);
4. two neighbouring regions swapped; a region left out; a left-out region added at any place;
5. one stage's recomputation switched;
6. one stage boundary moved by one layer.

Moves 3 and 4 take the reference's own split DP for the new stages and the plan's schedule.
It checks the planner where the global search is weak: a plan it improves by more than 2% is
a plan deepcee could have found by one step in its own space (printed with the steps taken).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import time
from collections.abc import Iterator

import numpy as np

from deepcee.cluster import Cluster
from deepcee.comm import allreduce_s
from deepcee.errors import DeepceeError
from deepcee.plan import Plan, StagePlan
from deepcee.profile import ModelProfile
from deepcee.schedule.compact import search_compact
from deepcee.schedule.ir import format_schedule
from deepcee.simulator.engine import simulate
from deepcee.simulator.memory import device_memory
from deepcee.simulator.runtime_model import runtime_for

REFERENCE_VERSION = 3
"""Bumped when the global search changes (a cached result of another version is not reused)."""
KEEP = 8
"""Configurations of each chain (best by the split DP's value) pooled for simulation."""
SCREEN_SHARE, LAYOUT_SHARE, SIMULATE_SHARE = 0.15, 0.6, 0.85
"""The budget's fractions (CPU seconds) by which the screen of chains, the layouts of the best
screened chains and the quick simulations stop; the rest is for the final schedules and the
refinement."""
WALK_SHARE = 0.4
"""The budget's fraction by which the descents over chains stop."""
WALK_STARTS = 3
"""Chains (best screened) each descent starts from."""
FINAL = 3
"""Configurations (best simulated) that get every schedule and compact."""
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2")
SYNCS = ("allreduce-ring", "allreduce-hier")
"""The syncs of exact plans the planner searches (``deepcee.planner.options.SYNC_CHOICES``)."""
POLISH_SIMULATIONS = 80
"""Most simulations one polish spends (a count, so the polish is the same on any machine)."""
POLISH_MIN_GAIN = 1e-3
"""A neighbour is taken when it simulates faster by more than this fraction (smaller gains cost
simulations and change no verdict at the 2% the benchmark judges)."""



class _Reference:
    """The reference search of the module docstring (its own bound, layouts, split DP)."""

    def __init__(self, cluster: Cluster, model: ModelProfile, batch: int, budget_s: float) -> None:
        # CPU seconds of this process, not wall-clock: on a shared machine a wall-clock budget
        # gave the reference less search the busier the machine was, so its strength (and every
        # verdict against it) moved with other people's work.
        self.c, self.m, self.batch, self.deadline = cluster, model, batch, time.process_time() + budget_s
        self.budget_s = budget_s
        self.islands = [tuple(d for d in cluster.device_names if cluster.device(d).island == isl.name)
                        for isl in cluster.islands]
        self.L = model.num_layers
        self.flops = model.flops_per_sample()
        self.least_bytes = min(model.boundary_bytes(b) for b in range(1, self.L))
        self.best: tuple[float, Plan | None] = (math.inf, None)
        self.last = None  # the last plan's simulation (None where it did not simulate)
        self.simulated = 0
        self.chains = 0
        self.exhausted = True
        # Stage and boundary tables depend only on their devices, samples and microbatches in
        # flight, and recur across layouts and chains: computed once each (the DP spent 3/4 of
        # the reference's budget rebuilding them; the results are the same, the reference just
        # gets further within its budget).
        self._memo: dict = {}
        self._seen: dict[tuple[int, ...], dict[tuple[int, ...], float]] = {}  # layouts valued, per chain
        self.sizes = [n for n in range(1, batch + 1) if batch % n == 0]

    # -- bound and chains ---------------------------------------------------------------
    def _speed(self, devs: tuple[str, ...]) -> float:
        return sum(self.c.effective_flops_per_s(d) for d in devs) / self.flops

    def _pipes(self, a: tuple[str, ...], b: tuple[str, ...]) -> float:
        res = {}
        for x in a:
            for y in b:
                link = self.c.link(x, y)
                res[link.resource] = link.bandwidth_bytes_per_s
        return sum(res.values())

    def chain_bounds(self) -> list[tuple[float, tuple[int, ...]]]:
        n = len(self.islands)
        speed = [self._speed(devs) for devs in self.islands]
        mem = [sum(self.c.memory_bytes(d) for d in devs) for devs in self.islands]
        state = self.m.parameter_count * self.m.state_bytes_per_parameter
        hop = np.zeros((n, n))
        lat = np.zeros((n, n))
        for i, j in itertools.permutations(range(n), 2):
            hop[i, j] = self.batch * self.least_bytes / self._pipes(self.islands[i], self.islands[j])
            lat[i, j] = self.c.link(self.islands[i][0], self.islands[j][0]).latency_s
        pair = [[max(hop[a, b] + lat[a, b], hop[b, a] + lat[b, a]) for b in range(n)] for a in range(n)]
        trips = [[lat[a, b] + lat[b, a] for b in range(n)] for a in range(n)]
        out: list[tuple[float, tuple[int, ...]]] = []

        def grow(order: tuple[int, ...], fast: float, room: float, worst: float, trip: float) -> None:
            # every chain once, its terms summed along the way (the same bound as over permutations)
            if order and room >= state:
                out.append((max(self.batch / fast, worst, trip), order))
            for i in range(n):
                if i not in order:
                    a = order[-1] if order else None
                    grow(order + (i,), fast + speed[i], room + mem[i],
                         worst if a is None else max(worst, pair[a][i]), trip if a is None else trip + trips[a][i])

        grow((), 0.0, 0.0, 0.0, 0.0)
        out.sort()
        return out

    def layouts(self, order: tuple[int, ...]) -> list[list[tuple[str, ...]]]:
        """The screen's layouts of a chain: the same ``g`` in every region (``ceil(devices / g)``
        balanced chunks, ``g`` in 1, 2, 4, 8, 16), and the whole chain as one stage."""
        opts = [[_chunks(self.islands[i], math.ceil(len(self.islands[i]) / g)) for g in (1, 2, 4, 8, 16)]
                for i in order]
        out = [slots for g in range(5) if len(slots := [c for o in opts for c in o[g]]) <= self.L]
        out = list({tuple(x): x for x in out}.values())
        if len(order) > 1:
            out.append([tuple(d for i in order for d in self.islands[i])])
        return out

    def tight_counts(self, order: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Stages per region of the screen's layouts for where memory is tight (valued only where
        no layout of :meth:`layouts` fits): the most stages the chain allows (``min(layers,
        devices)``, spread over its regions by their devices; on seeds 41 and 61 the uniform rules
        jump from more stages than layers, ``g`` = 1, to too few to fit, ``g`` = 2), and, for the
        4 smallest microbatch sizes, the most stages that fit: each region in chunks of the fewest
        devices on which one layer fits with the stages ahead of it in flight (:meth:`_group`;
        small devices share a layer's samples), spread as above where they are more than the
        layers (seed 41: its 8 GiB devices fit only in pairs)."""
        sizes = [len(self.islands[i]) for i in order]
        out = [tuple(_spread(min(self.L, sum(sizes)), sizes))]
        for n in self.sizes[:4]:
            fit: list[int] = []
            for i in order:  # the stages ahead of a region (about one layer each) are in flight
                ahead = max(1, min(self.L - sum(fit), self.batch // n))
                fit.append(math.ceil(len(self.islands[i]) / self._group(i, n, ahead)))
            out.append(tuple(_spread(min(self.L, sum(fit)), fit)))
        return list(dict.fromkeys(out))

    def counted(self, order: tuple[int, ...], counts: tuple[int, ...]) -> list[tuple[str, ...]]:
        """``order`` with ``counts[r]`` balanced stages in its ``r``-th region."""
        return [c for i, k in zip(order, counts, strict=True) for c in _chunks(self.islands[i], k)]

    def _group(self, region: int, n: int, k: int) -> int:
        """The fewest devices of ``region`` (its first ones, at most ``n``) on which every inner
        layer fits alone at microbatch size ``n`` with ``k`` microbatches in flight, recomputing
        (``min(n, devices)`` where none does)."""
        if ("group", region, n, k) not in self._memo:
            devs = self.islands[region]
            inner = range(1, self.L - 1) if self.L > 2 else range(self.L)
            m = self.batch // n

            def fits(g: int) -> bool:
                load = self._stage(devs[:g], _shares(self.c, devs[:g], n), m, k)[0]
                return all(np.isfinite(load[a, a + 1]) for a in inner)

            top = min(n, len(devs))
            self._memo["group", region, n, k] = next((g for g in range(1, top + 1) if fits(g)), top)
        return self._memo["group", region, n, k]

    def configs(self, slots: list[tuple[str, ...]], pairs: list[tuple[int, str]] | None = None) -> list[tuple]:
        """Every microbatch size and split (the DP's, for 1F1B's and ZB-H2's microbatches in
        flight) of a layout, or those of ``pairs`` (size, schedule) only:
        ``(value, slots, n, cut, recompute, schedule)``."""
        out = []
        for n, schedule in pairs or [(n, s) for n in self.sizes for s in ("zb-h1", "zb-h2")]:
            if n >= max(len(s) for s in slots):
                got = self.split(slots, n, schedule)
                if got is not None:
                    out.append((got[0], slots, n, got[1], got[2], schedule))
        return out

    def chain_configs(self, order: tuple[int, ...], keep: int, spread: int = 0) -> list[tuple]:
        """The configurations of a chain over any number of balanced stages per region: from the
        best screen layout, a descent that changes one region's stage count at a time while the
        DP's value (its best microbatch size, split for 1F1B's microbatches in flight) improves;
        ``spread`` times more, every one-region change of the best ``keep`` layouts seen is valued
        too (the widening rounds); then every size and schedule of the best ``keep`` layouts seen.
        The layouts valued are kept per chain, so a later call with a larger ``keep`` or
        ``spread`` values only new ones."""
        opts = [[_chunks(self.islands[i], k) for k in range(1, len(self.islands[i]) + 1)] for i in order]
        starts = {tuple(math.ceil(len(o) / g) - 1 for o in opts) for g in (1, 2, 4, 8, 16)}
        pairs = [(n, "zb-h1") for n in self.sizes]
        seen: dict[tuple[int, ...], float] = self._seen.setdefault(order, {})

        def value(pick: tuple[int, ...]) -> float:
            if pick not in seen:
                slots = [c for o, x in zip(opts, pick, strict=True) for c in o[x]]
                seen[pick] = (min((c[0] for c in self.configs(slots, pairs)), default=math.inf)
                              if len(slots) <= self.L else math.inf)
            return seen[pick]

        def changes(pick: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
            for r, o in enumerate(opts):
                yield from (pick[:r] + (x,) + pick[r + 1:] for x in range(len(o)) if x != pick[r])

        here = min(starts, key=lambda p: (value(p), p))
        if not math.isfinite(value(here)):  # memory is tight: start from the layouts for that
            here = min({tuple(k - 1 for k in counts) for counts in self.tight_counts(order)}, key=lambda p: (value(p), p))
        moved = math.isfinite(value(here))
        while moved:
            moved = False
            for r, o in enumerate(opts):
                best = min((here[:r] + (x,) + here[r + 1:] for x in range(len(o))), key=lambda p: (value(p), p))
                if value(best) < value(here):
                    here, moved = best, True
        for _ in range(spread):
            for _, pick in sorted((v, p) for p, v in seen.items() if math.isfinite(v))[:keep]:
                for other in changes(pick):
                    if self.over():
                        break
                    value(other)
        top = sorted((v, p) for p, v in seen.items() if math.isfinite(v))[:keep]
        out = [c for _, p in top for c in self.configs([c for o, x in zip(opts, p, strict=True) for c in o[x]])]
        if len(order) > 1:
            out += self.configs([tuple(d for i in order for d in self.islands[i])])
        return out

    # -- the split ------------------------------------------------------------------------
    def split(self, slots: list[tuple[str, ...]], n: int,
              schedule: str = "zb-h1") -> tuple[float, list[int], list[bool]] | None:
        """Bottleneck DP (memory with the schedule's microbatches in flight: ``min(S - s, M)`` on
        stage ``s`` of ``S`` for 1F1B and ZB-H1, ``min(2 (S - s) - 1, M)`` for ZB-H2; recompute
        where needed; of the splits with the least bottleneck, one whose busiest stage is least),
        then the bound ``bottleneck + one microbatch through everything else``."""
        m, L = self.batch // n, self.L
        size = L + 1
        invalid = np.tril(np.ones((size, size), dtype=bool))
        loads, per_mb, flags = [], [], []
        for s, devs in enumerate(slots):
            ahead = len(slots) - s
            key = ("stage", devs, n, m, min(2 * ahead - 1 if schedule == "zb-h2" else ahead, m))
            if key not in self._memo:
                comp, rc = self._stage(devs, _shares(self.c, devs, n), m, key[-1])
                self._memo[key] = (np.where(invalid, np.inf, comp), comp / m, rc)
            load, per, rc = self._memo[key]
            loads.append(load)
            per_mb.append(per)
            flags.append(rc)
        links = [None] + [self._memo_link(slots[k], slots[k + 1], n) for k in range(len(slots) - 1)]
        hops = [None] + [m * links[s][0] + links[s][1] for s in range(1, len(slots))]
        value, cut = _split_cut(loads, hops)
        if not math.isfinite(value):
            return None
        fill = sum(per_mb[s][cut[s], cut[s + 1]] for s in range(len(slots)))
        fill += sum(2 * (links[s][0][cut[s]] + links[s][1][cut[s]]) for s in range(1, len(slots)))
        return float(value + fill), cut, [bool(flags[s][cut[s], cut[s + 1]]) for s in range(len(slots))]

    def _prefix(self, values: list[float]) -> np.ndarray:
        p = np.concatenate([[0.0], np.cumsum(values)])
        return p[None, :] - p[:, None]

    def _tables(self) -> dict:
        if not hasattr(self, "_t"):
            model = self.m
            self._t = {"params": self._prefix([la.parameter_count for la in model.layers]),
                       "acts": self._prefix([la.activation_bytes for la in model.layers]),
                       "bnd": np.array([model.boundary_bytes(b) for b in range(self.L + 1)]), "time": {}}
        return self._t

    def _time(self, device: str, share: int) -> tuple[np.ndarray, np.ndarray]:
        """(F+I+W, F) of every range on ``device`` with ``share`` samples (analytic: sums over layers)."""
        t = self._tables()
        kind, slow = self.c.kind_of(device), self.c.device(device).slowdown
        key = (kind.name, slow, share)
        if key not in t["time"]:
            per = [[self.m.time_s(k, k + 1, p, share, kind, slow) for k in range(self.L)] for p in "FIW"]
            t["time"][key] = (self._prefix([a + b + c for a, b, c in zip(*per, strict=True)]), self._prefix(per[0]))
        return t["time"][key]

    def _stage(self, devs: tuple[str, ...], shares: tuple[int, ...], m: int,
               k: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Per range: iteration load (inf where memory does not fit even recomputing) and whether
        the stage recomputes (only where it must); memory as the simulator's model with ``k``
        microbatches in flight."""
        t, model = self._tables(), self.m
        state = t["params"] * model.state_bytes_per_parameter
        bnd = t["bnd"]
        plain = np.ones_like(state, dtype=bool)
        again = np.ones_like(state, dtype=bool)
        worst = np.zeros_like(state)
        worst_rc = np.zeros_like(state)
        ends = bnd.copy()
        ends[0] = ends[-1] = 0.0
        # the runtime's terms (simulator.memory.device_memory), for the runtime that runs this
        # cluster (runtime_for: on GPUs receives in order, buffers for the k microbatches in
        # flight; else every receive and send buffer of the step held at once), and the flat
        # gradient buffer
        held = 2 * m if runtime_for(self.c, model).receives == "at-step-start" else k
        flat = t["params"] * model.gradient_bytes_per_parameter if len(devs) > 1 else 0.0
        for d, sh in zip(devs, shares, strict=True):
            mem = self.c.memory_bytes(d)
            buffers = sh * (bnd[:, None] + bnd[None, :]) + (held - 1) * sh * (ends[:, None] + ends[None, :]) + flat
            plain &= state + k * sh * t["acts"] + buffers <= mem
            again &= state + k * sh * bnd[:, None] + sh * t["acts"] + buffers <= mem
            fiw, f = self._time(d, sh)
            worst, worst_rc = np.maximum(worst, fiw), np.maximum(worst_rc, fiw + f)
        if ("ar", devs) not in self._memo:
            grad = t["params"] * model.gradient_bytes_per_parameter
            xs = np.unique(np.geomspace(max(1.0, grad[grad > 0].min()), grad.max(), 6))
            # the faster of the syncs the planner searches (the plan's sync is chosen per plan,
            # :meth:`_sync`; a bound may take each stage's best)
            ys = [min(allreduce_s(self.c, devs, float(x), sync) for sync in SYNCS) for x in xs]
            self._memo["ar", devs] = np.where(grad > 0, np.interp(grad, xs, ys), 0.0)
        ar = self._memo["ar", devs]
        load = np.where(plain, m * worst, np.where(again, m * worst_rc, np.inf)) + ar
        return load, ~plain & again

    def _memo_link(self, src: tuple[str, ...], dst: tuple[str, ...], n: int) -> tuple[np.ndarray, np.ndarray]:
        key = ("link", src, dst, n)
        if key not in self._memo:
            self._memo[key] = self._link(src, dst, n)
        return self._memo[key]

    def _link(self, src: tuple[str, ...], dst: tuple[str, ...], n: int) -> tuple[np.ndarray, np.ndarray]:
        """Per boundary layer: (busiest pipe's seconds per microbatch, latency)."""
        a, b = _shares(self.c, src, n), _shares(self.c, dst, n)
        per: dict[str, float] = {}
        lat = 0.0
        lo_a = np.cumsum((0,) + a)
        lo_b = np.cumsum((0,) + b)
        for i, j in itertools.product(range(len(src)), range(len(dst))):
            both = min(lo_a[i + 1], lo_b[j + 1]) - max(lo_a[i], lo_b[j])
            if both > 0:
                for x, y in ((src[i], dst[j]), (dst[j], src[i])):
                    link = self.c.link(x, y)
                    per[link.resource] = per.get(link.resource, 0.0) + both / link.bandwidth_bytes_per_s
                    lat = max(lat, link.latency_s)
        bytes_ = np.array([self.m.boundary_bytes(k) for k in range(self.L + 1)])
        return max(per.values()) * bytes_, np.full(self.L + 1, lat)

    # -- simulated candidates ----------------------------------------------------------
    def plans(self, slots: list[tuple[str, ...]], n: int, cut: list[int], flags: list[bool],
              schedule: str = "zb-h1") -> list[Plan]:
        """Every schedule, with the DP's recomputation and with every stage recomputing, and
        compact (``schedule``, the one the split was made for, is among them)."""
        # The split DP counts 1F1B's microbatches in flight; schedules that keep more in flight
        # (GPipe, ZB-H2) may only fit when every stage recomputes, so both variants are simulated.
        base, every = self._variants(slots, n, cut, flags)
        stages = base.stages
        # both syncs where they differ for these stages (hierarchical all-reduce only differs
        # from the ring where a stage spans nodes)
        syncs = [base.sync] + [s for s in SYNCS if s != base.sync and self._sync_s(stages, s) != self._sync_s(stages, base.sync)]
        variants = [p.replace(sync=s) for s in syncs for p in (base, every)]
        out = [p.replace(schedule=s) for p in variants for s in SCHEDULES]
        if len(stages) > 1:
            out += [got for got in (_compact(p, self.c, self.m) for p in variants) if got is not None]
        return out

    def _sync_s(self, stages: tuple[StagePlan, ...], sync: str) -> float:
        """Summed gradient all-reduce seconds of ``stages`` with ``sync``."""
        return sum(allreduce_s(self.c, st.devices, self.m.gradient_bytes(st.layer_start, st.layer_stop), sync)
                   for st in stages if len(st.devices) > 1)

    def _sync(self, stages: tuple[StagePlan, ...]) -> str:
        """The sync (of those the planner searches) whose summed all-reduce is least; ties go to the ring."""
        return min(SYNCS, key=lambda s: (self._sync_s(stages, s), SYNCS.index(s)))

    def quick(self, slots: list[tuple[str, ...]], n: int, cut: list[int], flags: list[bool],
              schedule: str = "zb-h1") -> float:
        """The quick simulation of a configuration: the schedule its split was made for, with the
        DP's recomputation, repaired where it does not fit."""
        base, _ = self._variants(slots, n, cut, flags)
        return self.fitted(base.replace(schedule=schedule))

    def fitted(self, plan: Plan) -> float:
        """``plan`` simulated; while a device is over its memory, its stages recompute too and
        the plan is simulated again (the recomputation the schedule needs, stage by stage)."""
        got = self.score(plan)
        while not math.isfinite(got) and self.last is not None:
            over = {d for d, v in self.last.peak_memory_bytes.items() if v > self.c.memory_bytes(d)}
            stages = tuple(dataclasses.replace(st, recompute=True) if not st.recompute and over & set(st.devices)
                           else st for st in plan.stages)
            if stages == plan.stages:
                break
            plan = plan.replace(stages=stages)
            got = self.score(plan)
        return got

    def _variants(self, slots: list[tuple[str, ...]], n: int, cut: list[int], flags: list[bool]) -> tuple[Plan, Plan]:
        """The configuration as a plan with the DP's recomputation, and with every stage recomputing."""
        stages = tuple(StagePlan(layer_start=cut[s], layer_stop=cut[s + 1], devices=devs,
                                 shares=_shares(self.c, devs, n), recompute=flags[s]) for s, devs in enumerate(slots))
        base = Plan(system="reference", cluster=self.c.name, model=self.m.name, global_batch=self.batch,
                    microbatch_size=n, num_microbatches=self.batch // n, stages=stages, schedule="zb-h1",
                    sync=self._sync(stages))
        return base, base.replace(stages=tuple(dataclasses.replace(st, recompute=True) for st in stages))

    def over(self) -> bool:
        """Past the CPU budget once a feasible plan is known (else past three budgets)."""
        now = time.process_time()
        return now > self.deadline if self.best[1] is not None else now > self.deadline + 2 * self.budget_s

    def score(self, plan: Plan) -> float:
        self.last = None
        if self.over():
            self.exhausted = False
            return math.inf
        try:
            sim = simulate(plan, self.c, self.m, record=False)
        except DeepceeError:
            return math.inf
        self.simulated += 1
        self.last = sim
        if any(v > self.c.memory_bytes(d) for d, v in sim.peak_memory_bytes.items()):
            return math.inf
        if sim.iteration_s < self.best[0]:
            self.best = (sim.iteration_s, plan)
        return sim.iteration_s

    def refine(self, plan: Plan) -> None:
        """Move one boundary by one layer at a time while the simulator improves."""
        best_s = self.score(plan)
        improved = True
        while improved and math.isfinite(best_s):
            improved = False
            cuts = [st.layer_start for st in plan.stages] + [self.L]
            for k, step in itertools.product(range(1, len(cuts) - 1), (-1, 1)):
                new = list(cuts)
                new[k] += step
                if new[k] <= new[k - 1] or new[k] >= new[k + 1]:
                    continue
                stages = tuple(StagePlan(layer_start=new[s], layer_stop=new[s + 1], devices=st.devices,
                                         shares=st.shares, recompute=st.recompute) for s, st in enumerate(plan.stages))
                trial = plan.replace(stages=stages)
                if trial.schedule == "compact":
                    trial = _compact(trial.replace(schedule="zb-h1", actions=()), self.c, self.m)
                    if trial is None:
                        continue
                got = self.score(trial)
                if got < best_s * (1 - 1e-9):
                    plan, best_s, improved = trial, got, True
                    break


def _bottleneck(loads: list[np.ndarray], hops: list[np.ndarray | None], summed: bool = False) -> tuple[float, list[int]]:
    """The split of layers ``0..L`` into ``len(loads)`` ranges whose largest term is least (or,
    ``summed``, whose summed terms are): ``loads[s][a, b]`` for stage ``s`` on layers ``a..b``,
    ``hops[s][a]`` for the boundary at layer ``a`` before stage ``s``. Returns that value and
    the cut (``inf`` where none fits)."""
    size = loads[0].shape[0]
    value = loads[0][0].copy()
    back = []
    for s in range(1, len(loads)):
        x = ((value + hops[s])[:, None] + loads[s] if summed
             else np.maximum(np.maximum(value, hops[s])[:, None], loads[s]))
        arg = np.argmin(x, axis=0)
        value = x[arg, np.arange(size)]
        back.append(arg)
    last = size - 1
    cut, b = [last], last
    for arg in reversed(back):
        b = int(arg[b])
        cut.append(b)
    cut.append(0)
    return float(value[-1]), cut[::-1]


def _split_cut(loads: list[np.ndarray], hops: list[np.ndarray | None]) -> tuple[float, list[int]]:
    """The split whose largest term (:func:`_bottleneck`) is least. Where that term is a link's
    (every split under it ties, and the first tie can be far off: on the DeepCEE testbed with
    llama-7b it simulated 13% slower than the planner's split), of those splits one whose busiest
    stage is least, and of those one whose summed stage terms are least (each pass exact for
    that order). Where a stage binds, the first pass's split."""
    value, cut = _bottleneck(loads, hops)
    if not math.isfinite(value):
        return value, cut
    cap = value * (1 + 1e-9)
    if max(loads[s][cut[s], cut[s + 1]] for s in range(len(loads))) < value / (1 + 1e-9):
        fits = [None] + [np.where(h <= cap, 0.0, np.inf) for h in hops[1:]]
        top, cut = _bottleneck([np.where(x <= cap, x, np.inf) for x in loads], fits)
        top_cap = top * (1 + 1e-9)
        cut = _bottleneck([np.where(x <= top_cap, x, np.inf) for x in loads], fits, summed=True)[1]
    return value, cut


def _spread(total: int, sizes: list[int]) -> list[int]:
    """``total`` stages over regions of ``sizes`` devices, proportional to them (largest
    remainder), each region at least 1 and at most its devices (``len(sizes) <= total <= sum(sizes)``)."""
    ideal = [total * k / sum(sizes) for k in sizes]
    out = [min(k, max(1, int(x))) for k, x in zip(sizes, ideal, strict=True)]
    for j in sorted(range(len(sizes)), key=lambda j: (-(ideal[j] - out[j]), j)):
        if sum(out) >= total:
            break
        out[j] += min(sizes[j] - out[j], total - sum(out))
    while sum(out) > total:  # the floor of 1 can overshoot
        j = max((j for j in range(len(out)) if out[j] > 1), key=lambda j: (out[j] - ideal[j], j))
        out[j] -= 1
    return out


def _chunks(devs: tuple[str, ...], k: int) -> list[tuple[str, ...]]:
    base, extra = divmod(len(devs), k)
    out, i = [], 0
    for j in range(k):
        size = base + (1 if j < extra else 0)
        out.append(devs[i:i + size])
        i += size
    return [c for c in out if c]


def _shares(cluster: Cluster, devs: tuple[str, ...], n: int) -> tuple[int, ...]:
    """Whole samples proportional to speed (largest remainder), each at least 1."""
    speed = [cluster.effective_flops_per_s(d) for d in devs]
    ideal = [n * v / sum(speed) for v in speed]
    out = [max(1, int(x)) for x in ideal]
    while sum(out) > n:
        j = max((k for k in range(len(out)) if out[k] > 1), key=lambda k: (out[k] - ideal[k], k))
        out[j] -= 1
    for j in sorted(range(len(devs)), key=lambda k: (-(ideal[k] - out[k]), k))[: n - sum(out)]:
        out[j] += 1
    return tuple(out)


def _compact(plan: Plan, cluster: Cluster, model: ModelProfile) -> Plan | None:
    """``plan`` with the compact builder's schedule for its own split, as the plan space defines it."""
    from deepcee.planner.cost_model import stage_costs  # the builder's inputs, per the plan format

    cost = stage_costs(plan, cluster, model)
    limits = []
    for st in plan.stages:
        k = 0
        for d, sh in zip(st.devices, st.shares, strict=True):
            # the simulator's memory (plan and runtime terms) with one microbatch held, less that one
            per = sh * (model.boundary_bytes(st.layer_start) if st.recompute
                        else model.activation_bytes(st.layer_start, st.layer_stop))
            one = device_memory(model, st.layer_start, st.layer_stop, share=sh, in_flight=1,
                                num_microbatches=plan.num_microbatches, kind=cluster.device(d).kind,
                                stage_devices=len(st.devices), recompute=st.recompute,
                                runtime=runtime_for(cluster, model)).total_bytes
            room = cluster.memory_bytes(d) - (one - per)
            got = plan.num_microbatches if per <= 0 else int(room // per)
            k = got if k == 0 else min(k, got)
        if k < 1:
            return None
        limits.append(min(k, plan.num_microbatches))
    big = plan.num_stages * plan.num_microbatches > 800
    sched = search_compact(num_microbatches=plan.num_microbatches, forward_s=cost.forward_s,
                           input_grad_s=cost.input_grad_s, weight_grad_s=cost.weight_grad_s,
                           comm_forward=[b.forward for b in cost.boundaries],
                           comm_backward=[b.backward for b in cost.boundaries], memory_limit=limits,
                           **({"rules": ()} if big else {})).schedule
    return plan.replace(schedule="compact", actions=format_schedule(sched))


def reference_search(cluster: Cluster, model: ModelProfile, batch: int, *, budget_s: float = 120.0,
                     keep: int = KEEP) -> dict:
    """The reference of the module docstring; returns its best plan, time and effort."""
    t0, c0 = time.perf_counter(), time.process_time()
    ref = _Reference(cluster, model, batch, budget_s)

    value_of: dict[tuple[int, ...], float] = {}  # the screen's value of every chain it valued

    def screen_value(order: tuple[int, ...]) -> float:
        if order not in value_of:
            value_of[order] = min((c[0] for slots in ref.layouts(order) for c in ref.configs(slots)),
                                  default=math.inf)
            if not math.isfinite(value_of[order]):  # memory is tight: the layouts for that
                value_of[order] = min((c[0] for counts in ref.tight_counts(order)
                                       for c in ref.configs(ref.counted(order, counts))), default=math.inf)
        return value_of[order]

    # 1. the screen: every chain in bound order, valued by its best configuration with the same
    # stages-per-region rule in every region (cheap: a few DPs per microbatch size)
    chains = ref.chain_bounds()
    screened: list[tuple[float, float, tuple[int, ...]]] = []
    for bound, order in chains:
        now = time.process_time() - c0
        # past its share once it has chains to walk from; past the whole budget in any case (on a
        # cluster where few chains fit memory at uniform layouts, seed 41 screened all 109,582
        # chains of 8 regions for 536 CPU s and found 3)
        if now > SCREEN_SHARE * budget_s and (len(screened) >= WALK_STARTS or now > budget_s):
            break
        if math.isfinite(screen_value(order)):
            screened.append((value_of[order], bound, order))
    # 2. where the screen did not reach every chain: a descent from each of its best chains,
    # taking the neighbour (two islands swapped, one moved, replaced, dropped or added) the screen
    # values best while it improves; every chain it values joins the screened ones
    # (chains the screen found infeasible are in value_of too, so they are not valued again)
    bound_of = dict((order, bound) for bound, order in chains)  # the chains that fit memory
    walked = 0
    if len(value_of) < len(chains):
        rng = random.Random(0)  # deterministic: the same instance gives the same reference
        starts = [order for _, _, order in sorted(screened)[:WALK_STARTS]]
        best = min(starts, key=lambda o: (screen_value(o), o), default=None)
        while (best is not None and time.process_time() < c0 + WALK_SHARE * budget_s
               and len(value_of) < len(bound_of)):  # (every chain valued is in bound_of)
            if starts:
                here = starts.pop(0)
            else:  # then from the best chain, two random moves away (iterated local search)
                here = best
                for _ in range(2):
                    here = rng.choice([o for o in _chain_moves(here, len(ref.islands)) if o in bound_of] or [here])
            while time.process_time() < c0 + WALK_SHARE * budget_s:
                steps = [o for o in _chain_moves(here, len(ref.islands)) if o in bound_of]
                step = min(steps, key=lambda o: (screen_value(o), o), default=None)
                if step is None or screen_value(step) >= screen_value(here):
                    break
                here, walked = step, walked + 1
            if screen_value(here) < screen_value(best):
                best = here
    screened = sorted((v, bound_of[o], o) for o, v in value_of.items() if math.isfinite(v))
    # 3. any number of stages per region on the chains in the screen's order, their best
    # configurations pooled
    pool: list[tuple] = []
    tick = itertools.count()
    full: set[tuple[int, ...]] = set()
    for _, _, order in screened:
        # past its share once some chains are laid out (else until the search is over)
        if time.process_time() > c0 + LAYOUT_SHARE * budget_s and (ref.chains >= WALK_STARTS or ref.over()):
            break
        best = heapq.nsmallest(keep, ((v, next(tick), *rest) for v, *rest in ref.chain_configs(order, keep)))
        pool.extend(best)
        full.add(order)
        ref.chains += 1
    pool.sort()
    # 4. the pool by the DP's value, one quick simulation each; 5. every schedule and compact on
    # the best few simulated, and the best refined
    results: list[tuple] = []
    tried: set[tuple] = set()  # configurations simulated quickly
    finished: set[tuple] = set()  # configurations given every schedule

    def key(item: tuple) -> tuple:
        slots, n, cut, _, schedule = item[2:]
        return tuple(slots), n, tuple(cut), schedule

    def quick(item: tuple) -> tuple:
        """``item`` simulated quickly, recorded (tried, results) and returned as a result."""
        tried.add(key(item))
        results.append((ref.quick(*item[2:]), next(tick), item))
        return results[-1]

    def simulate_quickly(items: list[tuple], share: float) -> None:
        for item in items:
            if key(item) in tried:
                continue
            if (time.process_time() > c0 + share * budget_s and ref.best[1] is not None) or ref.over():
                break
            quick(item)

    def finish(items: list[tuple], refine: bool = False) -> None:
        for item in items:
            finished.add(key(item))
            scored = [(ref.score(plan), k, plan) for k, plan in enumerate(ref.plans(*item[2:]))]
            got, _, plan = min(scored, default=(math.inf, 0, None))
            if refine and math.isfinite(got):
                ref.refine(plan)

    simulate_quickly(pool, SIMULATE_SHARE)
    finish([item for _, _, item in heapq.nsmallest(FINAL, results)])
    if ref.best[1] is not None:
        ref.refine(ref.best[1])
    # 6. widening, while the budget lasts (on small clusters phases 1-5 end within a few CPU
    # seconds), its CPU time shared evenly between two tasks: every schedule and compact for the
    # best configuration simulated quickly and not yet so (its best plan refined, the split DP's
    # cut being a bound's), and rounds of more layouts (twice the layouts kept per chain, their
    # one-region changes valued too, and the next FINAL chains laid out), each new configuration
    # simulated quickly
    rounds = 0

    def widen() -> Iterator[None]:
        nonlocal rounds
        while True:
            rounds += 1
            laid = len(full)
            orders = [order for _, _, order in screened if order in full]
            orders += [order for _, _, order in screened if order not in full][:FINAL]
            wider = []
            for order in orders:
                full.add(order)
                wider += [(v, next(tick), *rest) for v, *rest in ref.chain_configs(order, keep << rounds, spread=1)]
                yield
            ref.chains = len(full)
            new = 0
            for item in sorted(wider):
                if key(item) not in tried:
                    heapq.heappush(queue, quick(item))
                    new += 1
                    yield
            if not new and len(full) == laid and all(keep << rounds >= len(ref._seen.get(o, ())) for o in full):
                return

    queue = [r for r in results if key(r[2]) not in finished]
    heapq.heapify(queue)
    spent = [0.0, 0.0]  # CPU seconds of finishing, of widening
    more: Iterator[None] | None = widen()
    while not ref.over():
        while queue and key(queue[0][2]) in finished:
            heapq.heappop(queue)
        t = time.process_time()
        if queue and (spent[0] <= spent[1] or more is None):
            finish([heapq.heappop(queue)[2]], refine=True)
            spent[0] += time.process_time() - t
        elif more is not None:
            if next(more, StopIteration) is StopIteration:
                more = None
            spent[1] += time.process_time() - t
        else:
            break
    # every chain under the final bound searched in full (its best ``keep`` simulated)
    simulated_orders = {tuple(_order_of(ref, item[2])) for _, _, item in results}
    ref.exhausted = all(order in full and order in simulated_orders for bound, order in chains
                        if bound < ref.best[0])
    return {"plan": ref.best[1], "iteration_s": ref.best[0], "chains": ref.chains, "screened": len(screened),
            "walk_steps": walked,
            "simulated": ref.simulated, "later_configurations": len(results),
            "later_left": sum(key(item) not in tried for item in pool), "widening_rounds": rounds,
            "exhausted": ref.exhausted, "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def _chain_moves(order: tuple[int, ...], islands: int) -> Iterator[tuple[int, ...]]:
    """The chains one step from ``order``: two islands swapped, one moved, one replaced by an
    island left out, one dropped, one added at any place."""
    n, out = len(order), [i for i in range(islands) if i not in order]
    for a, b in itertools.combinations(range(n), 2):
        yield order[:a] + (order[b],) + order[a + 1:b] + (order[a],) + order[b + 1:]
    for a in range(n):
        rest = order[:a] + order[a + 1:]
        for b in range(n):
            if b != a:
                yield rest[:b] + (order[a],) + rest[b:]
        for i in out:
            yield order[:a] + (i,) + order[a + 1:]
        if n > 1:
            yield rest
    for i in out:
        for b in range(n + 1):
            yield order[:b] + (i,) + order[b:]


def _order_of(ref: _Reference, slots: list[tuple[str, ...]]) -> list[int]:
    region = {d: k for k, devs in enumerate(ref.islands) for d in devs}
    out: list[int] = []
    for devs in slots:
        for d in devs:
            if not out or out[-1] != region[d]:
                out.append(region[d])
    return out


# ----------------------------------------------------------------------------- the polish


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One region's run of stages in a plan: its devices in plan order and its stage count."""

    region: int
    devices: tuple[str, ...]
    stages: int


def _segments(ref: _Reference, plan: Plan) -> list[_Segment] | None:
    """``plan``'s stages as runs of one region each (``None`` when a stage spans regions or a
    region's stages are not contiguous: no region move applies)."""
    region = {d: k for k, devs in enumerate(ref.islands) for d in devs}
    out: list[_Segment] = []
    for st in plan.stages:
        regions = {region[d] for d in st.devices}
        if len(regions) != 1:
            return None
        r = regions.pop()
        if out and out[-1].region == r:
            out[-1] = _Segment(region=r, devices=out[-1].devices + st.devices, stages=out[-1].stages + 1)
        elif any(s.region == r for s in out):
            return None
        else:
            out.append(_Segment(region=r, devices=st.devices, stages=1))
    return out


def _laid_out(ref: _Reference, plan: Plan, segments: list[_Segment]) -> Iterator[Plan]:
    """``segments`` as stages, split by the reference's DP at ``plan``'s microbatch size, with
    ``plan``'s schedule (or, where that does not fit, every stage recomputing)."""
    slots = [c for s in segments for c in _chunks(s.devices, min(s.stages, len(s.devices)))]
    if len(slots) > ref.L or plan.microbatch_size < max(len(s) for s in slots):
        return
    got = ref.split(slots, plan.microbatch_size)
    if got is None:
        return
    _, cut, flags = got
    stages = tuple(StagePlan(layer_start=cut[k], layer_stop=cut[k + 1], devices=devs,
                             shares=_shares(ref.c, devs, plan.microbatch_size), recompute=flags[k])
                   for k, devs in enumerate(slots))
    for rc in (None, True):
        built = _with_schedule(plan, plan.schedule, ref, stages=stages if rc is None else tuple(
            dataclasses.replace(st, recompute=True) for st in stages))
        if built is not None:
            yield built


def _with_schedule(plan: Plan, schedule: str, ref: _Reference, **changes) -> Plan | None:
    """``plan`` with ``changes`` and ``schedule``; the changes are made on a zb-h1 copy (a compact
    plan's actions name its own microbatches and stages, so a changed compact plan is invalid
    until its schedule is built anew)."""
    base = plan.replace(schedule="zb-h1", actions=(), **changes)
    if schedule != "compact":
        return base.replace(schedule=schedule)
    return _compact(base, ref.c, ref.m) if base.num_stages > 1 else None


def _neighbours(ref: _Reference, plan: Plan) -> Iterator[tuple[str, Plan]]:
    """Every neighbour of ``plan`` in the order of the module docstring, each with a label."""
    every = tuple(dataclasses.replace(st, recompute=True) for st in plan.stages)
    for sched in (*SCHEDULES, "compact"):
        for stages in dict.fromkeys((plan.stages, every)):
            if sched != plan.schedule or stages != plan.stages:
                built = _with_schedule(plan, sched, ref, stages=stages)
                if built is not None:
                    yield f"schedule {sched}{', every stage recomputing' if stages is every else ''}", built
    for sync in SYNCS:
        if sync != plan.sync and plan.sync in SYNCS:
            yield f"sync {sync}", plan.replace(sync=sync)
    sizes = [n for n in range(1, ref.batch + 1) if ref.batch % n == 0 and n >= max(len(s.devices) for s in plan.stages)]
    k = sizes.index(plan.microbatch_size) if plan.microbatch_size in sizes else None
    for n in ([] if k is None else [sizes[j] for j in (k - 1, k + 1) if 0 <= j < len(sizes)]):
        stages = tuple(dataclasses.replace(st, shares=_shares(ref.c, st.devices, n)) for st in plan.stages)
        built = _with_schedule(plan, plan.schedule, ref, stages=stages, microbatch_size=n,
                               num_microbatches=ref.batch // n)
        if built is not None:
            yield f"microbatch size {plan.microbatch_size} -> {n}", built
    yield from _region_moves(ref, plan)
    for s, st in enumerate(plan.stages):
        stages = plan.stages[:s] + (dataclasses.replace(st, recompute=not st.recompute),) + plan.stages[s + 1:]
        built = _with_schedule(plan, plan.schedule, ref, stages=stages)
        if built is not None:
            yield f"stage {s} recompute {'off' if st.recompute else 'on'}", built
    for s, step in itertools.product(range(1, plan.num_stages), (-1, 1)):
        cut = plan.stages[s].layer_start + step
        if plan.stages[s - 1].layer_start < cut < plan.stages[s].layer_stop:
            stages = (plan.stages[:s - 1] + (dataclasses.replace(plan.stages[s - 1], layer_stop=cut),
                                             dataclasses.replace(plan.stages[s], layer_start=cut)) + plan.stages[s + 1:])
            built = _with_schedule(plan, plan.schedule, ref, stages=stages)
            if built is not None:
                yield f"boundary {s} {step:+d} layer", built


def _region_moves(ref: _Reference, plan: Plan) -> Iterator[tuple[str, Plan]]:
    """Moves 3 and 4 of the module docstring."""
    segs = _segments(ref, plan)
    if segs is None:
        return
    name = [isl.name for isl in ref.c.islands]
    for k, s in enumerate(segs):
        for count in (s.stages + 1, s.stages - 1):
            if 1 <= count <= len(s.devices):
                for trial in _laid_out(ref, plan, segs[:k] + [dataclasses.replace(s, stages=count)] + segs[k + 1:]):
                    yield f"{name[s.region]} in {count} stages (was {s.stages})", trial
    for k in range(len(segs) - 1):
        for trial in _laid_out(ref, plan, segs[:k] + [segs[k + 1], segs[k]] + segs[k + 2:]):
            yield f"{name[segs[k].region]} and {name[segs[k + 1].region]} swapped", trial
    state = ref.m.parameter_count * ref.m.state_bytes_per_parameter
    for k, s in enumerate(segs):
        rest = segs[:k] + segs[k + 1:]
        if rest and sum(ref.c.memory_bytes(d) for r in rest for d in r.devices) >= state:
            for trial in _laid_out(ref, plan, rest):
                yield f"{name[s.region]} left out", trial
    used = {s.region for s in segs}
    for r in range(len(ref.islands)):
        if r not in used:
            new = _Segment(region=r, devices=ref.islands[r], stages=len(ref.islands[r]))
            for k in range(len(segs) + 1):
                for trial in _laid_out(ref, plan, segs[:k] + [new] + segs[k:]):
                    yield f"{name[r]} added at place {k}", trial


def polish(plan: Plan, cluster: Cluster, model: ModelProfile, *, simulations: int = POLISH_SIMULATIONS) -> dict:
    """Local search from ``plan`` (module docstring); returns the best plan, its simulated time,
    the moves taken (label, seconds after), the simulations spent and whether it ended at a local
    optimum (no neighbour improves) rather than on its budget."""
    t0 = time.process_time()
    ref = _Reference(cluster, model, plan.global_batch, math.inf)
    best_s = ref.score(plan)
    moves: list[tuple[str, float]] = []
    local_optimum = False
    while ref.simulated < simulations and math.isfinite(best_s):
        for label, trial in _neighbours(ref, plan):
            if ref.simulated >= simulations:
                break
            got = ref.score(trial)
            if got < best_s * (1 - POLISH_MIN_GAIN):
                plan, best_s = trial, got
                moves.append((label, got))
                break
        else:
            local_optimum = True
            break
    return {"plan": plan, "iteration_s": best_s, "moves": moves, "simulated": ref.simulated,
            "local_optimum": local_optimum, "cpu_s": time.process_time() - t0}
