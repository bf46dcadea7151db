"""Which islands, in which order: the search over island chains (torch-free).

A *chain* is an ordered list of ``(island index, groups kept)`` (see [Note: plan space] in
:mod:`deepcee.planner.space`); :func:`search_chains` finds the chains worth laying out and
hands each to an ``evaluate`` callback (the best closed form over the chain's layouts and
microbatch sizes, :meth:`deepcee.planner.steps.SearchState.evaluate_layout`).

[Note: chain search]
Chains are built from *units*: with at most ``exhaustive_islands`` islands a unit is one
island (with each choice of groups kept); above that, islands are first merged into
``exhaustive_islands`` clusters by their 1 MB transfer time (average linkage) and a unit is a
cluster's islands in a short-path order (or its reverse). Every ordered subset of units is a
chain. Chains are taken best first by a lower bound that no plan on the chain beats in the
simulator (:meth:`ChainBounds.bound`):

- compute: all samples over the summed speed of the chain's devices;
- each hop between consecutive islands: all samples x the model's smallest boundary bytes
  over the summed bandwidth of every link resource between the two islands, plus the hop's
  latency;
- latency: a microbatch goes out and back over every hop once: the sum of both latencies;
- memory: the chain's devices hold the model state at least once (else the chain is skipped).

A chain's extensions are bounded by the same terms with every unit not yet in it added to
the compute term, so a best-first (branch and bound) search evaluates exactly the chains
whose bound is below the best plan found so far (its closed form, with a margin,
:data:`PRUNE_MARGIN`), in bound order: with one island per unit the result is exact over
chains up to the proven gap printed, ``simulated best / least bound left - 1`` (0 when no
chain left can beat the simulated best). ``chain_budget``
caps the evaluations; when it stops the search early, :attr:`ChainResult.gap` is the proven
gap: how much better than the best found an unevaluated chain could be, at most.

When ``chain_budget`` stops the exact search, the bound (which favours chains with more
devices) has spent the budget on orders of the largest subsets; its two best chains then seed
a local search over which devices are used only (drop an island, insert a left-out one, change
the groups kept; ``chain_budget // 5`` evaluations each; where no such move improves, dropping two
islands at once, with as many evaluations again: on WAN seeds 25 and 85 the best chain left out
two more islands than the local search's end, and dropping either alone was worse or did not fit,
356.0 -> 344.6 s and 445.0 -> 395.0 s). A search that follows the closed form
also finds where the closed form is most optimistic, so the chains it ends on are laid out in
full and kept only where the cost model's screen confirms them (:func:`deepcee.planner.search.
_confirmed_end`); everything else it added is taken back. The gap printed stays the best-first
search's proof.

The bound cannot tell orders of one set of islands apart (on WAN seed 60 all 150 chains had the
bound 51.2 s, their closed forms 208-235 s, while an order of six of the eight islands that the
search never reached is at 128.0 s; orders of that set range from 128.0 s to infeasible), and
the local search above stops where no single move over the devices used improves. So after it,
on clusters of at most ``polish_max_devices`` devices, the *chain walk* (:func:`walk_chains`,
``walk_budget`` evaluations) goes on from the best chain: an iterated local search whose moves
are those of :func:`_moves`, an island replaced by a left-out one in its place, and every swap
and move of one island (:func:`order_moves`), best improvement until none improves, then two
random moves from the best chain (seeded: deterministic) and down again. Its chain, where its
closed form beats the best chain's, is laid out in full, taken back from the main search and
searched on its own after it, as the second look's configurations ([Note: second look] in
:mod:`deepcee.planner.search`): its plan replaces the main search's only where the simulator
rates it faster, so the walk never makes a plan slower. Handed to the main search instead, such
chains made plans slower as often as faster (their configurations took the places of those that
had made the plan: on 32 WAN seeds, 7 faster and 14 slower for a best-first search with at most
10 orders per set, 7 and 8 for those chains beside the first 150).

With merged units, the exact search over units seeds a local search on single islands
(:func:`improve_chain`): drop an island, insert a left-out one anywhere, swap two neighbours,
reverse a run, change the groups kept; the best improving move is taken until none improves
(deterministic: moves are tried in a fixed order, ties keep the earlier).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from deepcee.cluster import Cluster
from deepcee.planner.grouping import Grouping
from deepcee.planner.options import PlannerOptions
from deepcee.planner.space import Chain, short_path
from deepcee.profile import ModelProfile

log = logging.getLogger(__name__)

_INF = math.inf
PRUNE_MARGIN = 0.3
"""Chains are evaluated while their bound is below the best closed form x (1 + this): the
closed form can be optimistic, and the bound must not cut a chain the simulator would prefer.
The gap printed is against the simulated best, so it holds whatever the closed form said."""


WALK_MAX_BUDGET = 10_000
"""The chain walk's perturbations are at most 4x this (and 4x its budget): past it, a budget larger
than the chains within reach would keep perturbing among chains already seen."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainResult:
    """What :func:`search_chains` did."""

    best_s: float
    """Best closed form over the evaluated chains (``inf`` if none fits)."""
    evaluated: int
    """Chains evaluated."""
    gap: float
    """Proven gap: an unevaluated chain could beat ``best_s`` by at most this fraction (0 when
    every chain with a bound below the best was evaluated)."""
    exact: bool
    """Whether units were single islands (so the search is exact over chains)."""
    considered: int
    """Chains whose bound was computed."""
    open_bound: float = _INF
    """The least lower bound of a chain not evaluated (``inf``: none is left): no plan on an
    unevaluated chain simulates faster than this."""


class ChainBounds:
    """The lower-bound terms of [Note: chain search] per island and per island pair."""

    def __init__(self, cluster: Cluster, model: ModelProfile, grouping: Grouping, global_batch: int,
                 marginal_s: Callable[[str], float], pipe_bandwidth: Callable[[tuple, tuple], float]) -> None:
        self.grouping, self.batch = grouping, global_batch
        n = len(grouping.islands)
        self.kept = [[tuple(d for g in isl.groups[:k] for d in g.devices) for k in range(len(isl.groups) + 1)]
                     for isl in grouping.islands]
        self.speed = [[sum(1.0 / marginal_s(d) for d in devs) for devs in row] for row in self.kept]
        self.memory = [[sum(cluster.memory_bytes(d) for d in devs) for devs in row] for row in self.kept]
        self.state = model.parameter_count * model.state_bytes_per_parameter
        least = min((model.boundary_bytes(b) for b in range(1, model.num_layers)), default=0.0)
        self.hop = np.zeros((n, n))
        self.latency = np.zeros((n, n))
        for i, j in itertools.permutations(range(n), 2):
            a, b = self.kept[i][-1], self.kept[j][-1]
            self.hop[i, j] = global_batch * least / pipe_bandwidth(a, b)
            self.latency[i, j] = cluster.link(a[0], b[0]).latency_s
        self._hop, self._latency = self.hop.tolist(), self.latency.tolist()  # the same numbers, read faster

    def hops(self, chain: Chain) -> tuple[float, float]:
        """(worst hop, summed round-trip latency) of ``chain``."""
        worst, lat = 0.0, 0.0
        hop, latency = self._hop, self._latency
        for (i, _), (j, _) in itertools.pairwise(chain):
            worst = max(worst, hop[i][j] + latency[i][j], hop[j][i] + latency[j][i])
            lat += latency[i][j] + latency[j][i]
        return worst, lat

    def bound(self, chain: Chain, extra_speed: float = 0.0) -> float:
        """Lower bound of every plan on ``chain`` (``extra_speed``: devices that may still join)."""
        speed = sum(self.speed[i][k] for i, k in chain) + extra_speed
        worst, lat = self.hops(chain)
        return max(self.batch / speed if speed > 0 else _INF, worst, lat)

    def fits(self, chain: Chain) -> bool:
        return sum(self.memory[i][k] for i, k in chain) >= self.state


Unit = tuple[Chain, ...]
"""The choices of one unit: each a run of ``(island, groups kept)``."""


def island_units(grouping: Grouping, options: PlannerOptions) -> list[Unit]:
    """One unit per island; its choices are the prefixes of its groups (all of them only,
    without exclusion)."""
    out = []
    for i, isl in enumerate(grouping.islands):
        keeps = range(1, len(isl.groups) + 1) if options.allow_exclusion else [len(isl.groups)]
        out.append(tuple(((i, k),) for k in reversed(keeps)))
    return out


def merged_units(grouping: Grouping, dist: np.ndarray, count: int) -> list[Unit]:
    """``count`` units of nearby islands (average linkage on ``dist``), each in a short-path order
    or its reverse, every group kept."""
    n = len(grouping.islands)
    labels = fcluster(linkage(squareform(dist, checks=False), method="average"), t=count, criterion="maxclust")
    out = []
    for lab in sorted(set(labels), key=lambda x: min(i for i in range(n) if labels[i] == x)):
        members = [i for i in range(n) if labels[i] == lab]
        path = short_path(dist, members)
        runs = [tuple((i, len(grouping.islands[i].groups)) for i in p) for p in (path, path[::-1])]
        out.append(tuple(dict.fromkeys(runs)))
    return out


def search_chains(units: list[Unit], bounds: ChainBounds, evaluate: Callable[[Chain], float], *,
                  budget: int, allow_exclusion: bool, incumbent: Callable[[], float],
                  progress: Callable[[float], None] | None = None) -> tuple[ChainResult, list[tuple[float, Chain]]]:
    """Best-first search over ordered subsets of ``units`` (see [Note: chain search]).

    ``evaluate(chain)`` lays a chain out and returns its best closed form; ``incumbent()`` is the
    best closed form so far (the search state keeps it). Returns the result and every evaluated
    chain with its value."""
    total = [max((bounds.speed[i][k] for run in unit for i, k in run), default=0.0) for unit in units]
    heap: list[tuple[float, int, int, tuple[int, ...], Chain]] = []
    tick = itertools.count()
    considered = 0

    def push(used: tuple[int, ...], chain: Chain) -> None:
        nonlocal considered
        considered += 1
        rest = sum(total[u] for u in range(len(units)) if u not in used)
        if (allow_exclusion or len(used) == len(units)) and bounds.fits(chain):
            heapq.heappush(heap, (bounds.bound(chain), next(tick), 0, used, chain))
        if len(used) < len(units):
            heapq.heappush(heap, (bounds.bound(chain, rest), next(tick), 1, used, chain))

    for u, unit in enumerate(units):
        for run in unit:
            push((u,), run)
    done: list[tuple[float, Chain]] = []
    gap, open_bound = 0.0, _INF
    while heap:
        bound, _, kind, used, chain = heapq.heappop(heap)
        best = incumbent()
        if bound >= best * (1 + PRUNE_MARGIN):
            open_bound = bound
            break
        if kind == 1:
            for u in range(len(units)):
                if u not in used:
                    for run in units[u]:
                        push((*used, u), chain + run)
            continue
        if len(done) >= budget:
            gap = best / bound - 1.0 if bound > 0 else _INF
            open_bound = bound
            break
        done.append((evaluate(chain), chain))
        if progress is not None:
            progress(len(done) / budget)
    best = incumbent()
    return ChainResult(best_s=best, evaluated=len(done), gap=max(0.0, gap), exact=all(len(u[0]) == 1 for u in units),
                       considered=considered, open_bound=open_bound), done


def order_moves(chain: Chain) -> list[Chain]:
    """The orders of ``chain``'s islands one move away, in a fixed order, without repeats: two
    islands swapped, one island moved to another place, a run of three or more reversed."""
    out = [chain[:a] + (chain[b],) + chain[a + 1:b] + (chain[a],) + chain[b + 1:]
           for a, b in itertools.combinations(range(len(chain)), 2)]
    for k in range(len(chain)):
        rest = chain[:k] + chain[k + 1:]
        out += [rest[:j] + (chain[k],) + rest[j:] for j in range(len(chain)) if j not in (k, k - 1, k + 1)]
    out += [chain[:a] + chain[a:b][::-1] + chain[b:] for a, b in itertools.combinations(range(len(chain) + 1), 2)
            if b - a >= 3]
    return list(dict.fromkeys(c for c in out if c != chain))


def walk_chains(start: Chain, value: float, evaluate: Callable[[Chain], float], *, islands: int,
                keeps: Sequence[int], allow_exclusion: bool, budget: int, fits: Callable[[Chain], bool],
                known: Mapping[Chain, float] | None = None, seed: int = 0) -> tuple[float, Chain, int]:
    """The chain walk of [Note: chain search]: an iterated local search from ``start`` (its value
    ``value``) over every move of :func:`_moves`, an island replaced by a left-out one in its place,
    and :func:`order_moves`; the best improving move until none improves, then two random moves
    (``random.Random(seed)``: deterministic) from the best chain and a local search again, while
    ``budget`` evaluations last. Chains that do not fit (``fits``) count as infinite and are not
    evaluated. Returns (best value, its chain, evaluations); ``known`` as in :func:`improve_chain`."""
    seen: dict[Chain, float] = {**(known or {}), start: value}
    spent = 0
    rng = random.Random(seed)

    def neighbours(chain: Chain) -> list[Chain]:
        out = _moves(chain, islands, keeps, allow_exclusion)
        if allow_exclusion:
            used = {i for i, _ in chain}
            out += [chain[:k] + ((i, keeps[i]),) + chain[k + 1:]
                    for i in range(islands) if i not in used for k in range(len(chain))]
        return list(dict.fromkeys(out + order_moves(chain)))

    def value_of(chain: Chain) -> float:
        nonlocal spent
        if chain not in seen:
            if fits(chain):
                seen[chain], spent = evaluate(chain), spent + 1
            else:
                seen[chain] = _INF
        return seen[chain]

    def descend(chain: Chain, v: float) -> tuple[float, Chain]:
        while spent < budget:
            best: tuple[float, Chain] | None = None
            for move in neighbours(chain):
                if spent >= budget:
                    break
                x = value_of(move)
                if x < v * (1 - 1e-9) and (best is None or x < best[0]):
                    best = (x, move)
            if best is None:
                break
            v, chain = best
        return v, chain

    best_v, best_c = descend(start, value)
    tries = 0
    while spent < budget and tries < 4 * min(budget, WALK_MAX_BUDGET):  # once the space is seen, perturbations
        # evaluate nothing new: bounded, or a huge budget on a small space would never end
        tries += 1
        chain = best_c
        for _ in range(2):
            moves = neighbours(chain)
            chain = moves[rng.randrange(len(moves))] if moves else chain
        v = value_of(chain)
        if not math.isfinite(v):
            continue
        v, chain = descend(chain, v)
        if v < best_v * (1 - 1e-9):
            best_v, best_c = v, chain
    return best_v, best_c, spent


def _moves(chain: Chain, islands: int, keeps: Sequence[int], allow_exclusion: bool, *,
           reorder: bool = True) -> list[Chain]:
    """Neighbours of ``chain`` (see [Note: chain search]), in a fixed order; ``reorder=False``:
    only the moves that change which devices are used (drop, insert, groups kept)."""
    out: list[Chain] = []
    used = {i for i, _ in chain}
    if allow_exclusion and len(chain) > 1:
        out += [chain[:k] + chain[k + 1:] for k in range(len(chain))]
    for i in range(islands):
        if i not in used:
            out += [chain[:k] + ((i, keeps[i]),) + chain[k:] for k in range(len(chain) + 1)]
    if reorder:
        out += [chain[:k] + (chain[k + 1], chain[k]) + chain[k + 2:] for k in range(len(chain) - 1)]
        for a, b in itertools.combinations(range(len(chain) + 1), 2):
            if b - a >= 3:
                out.append(chain[:a] + chain[a:b][::-1] + chain[b:])
    if allow_exclusion:
        for k, (i, kept) in enumerate(chain):
            for other in range(1, keeps[i] + 1):
                if other != kept:
                    out.append(chain[:k] + ((i, other),) + chain[k + 1:])
    return out


def improve_chain(start: Chain, value: float, evaluate: Callable[[Chain], float], *, islands: int,
                  keeps: Sequence[int], allow_exclusion: bool, budget: int,
                  reorder: bool = True, known: dict[Chain, float] | None = None,
                  pair_drops: bool = False) -> tuple[float, Chain, int]:
    """Local search from ``start`` (its value ``value``): the best improving move until none
    improves or ``budget`` evaluations are spent. Returns (value, chain, evaluations).
    ``reorder=False``: moves that change the devices used only (see :func:`_moves`); ``known``:
    chains already evaluated, with their values (not evaluated again, not counted);
    ``pair_drops``: where no move improves, dropping two islands at once is tried too, with a
    budget of its own as large as ``budget`` (see [Note: chain search])."""
    seen = {**(known or {}), start: value}
    spent, paired, extra = 0, 0, budget if pair_drops and allow_exclusion else 0
    while spent < budget:
        best = _best_move(_moves(start, islands, keeps, allow_exclusion, reorder=reorder), value, evaluate, seen,
                          budget - spent)
        spent += best[2]
        if best[0] is None and extra > 0 and len(start) > 2:
            pairs = [tuple(x for k, x in enumerate(start) if k not in (a, b))
                     for a, b in itertools.combinations(range(len(start)), 2)]
            best = _best_move(pairs, value, evaluate, seen, extra)
            extra, paired = extra - best[2], paired + best[2]
        if best[0] is None:
            break
        value, start = best[0], best[1]
    return value, start, spent + paired


def _best_move(moves: list[Chain], value: float, evaluate: Callable[[Chain], float], seen: dict[Chain, float],
               budget: int) -> tuple[float | None, Chain | None, int]:
    """The best of ``moves`` not in ``seen`` that improves on ``value`` (``None`` if none does),
    evaluating them (and recording them in ``seen``) up to ``budget``; with the evaluations spent."""
    best: tuple[float, Chain] | None = None
    spent = 0
    for move in moves:
        if move in seen:
            continue
        if spent >= budget:
            break
        seen[move] = evaluate(move)
        spent += 1
        if seen[move] < value * (1 - 1e-9) and (best is None or seen[move] < best[0]):
            best = (seen[move], move)
    return (None, None, spent) if best is None else (best[0], best[1], spent)
