"""The plan space: layouts of island chains into stages, and the plans they make.

Torch-free. :func:`enumerate_chains` and :func:`chain_layouts` list the points of the space
that :mod:`deepcee.planner.search` explores, :func:`build_plan` turns one point into a
:class:`~deepcee.plan.Plan`, and :func:`compact_plan` gives a plan a compact schedule.

[Note: plan space]
A plan is one pipeline (see :mod:`deepcee.plan`): stages are device sets, devices of a stage
split every microbatch by share and all-reduce their gradients. The planner searches:

- **chains**: an ordered subset of islands (:mod:`deepcee.planner.grouping`); inside each
  used island a prefix of its groups, fastest first (the slower groups can be left out).
  Islands are chained so the pipeline crosses each slow link once; leaving an island out
  removes its link from the pipeline altogether.
- **layouts** of a chain into stages: each island's kept devices form one device set
  (*merged*) or one per group (*per group*); each set is cut into contiguous chunks of at
  most ``g`` devices (``g`` a power of two, the set's size, or a microbatch size that is no
  power of two: more stages inside an island, for memory or for less all-reduce traffic;
  [Note: fed granularities]), the same ``g`` for the whole chain
  (:func:`chain_layouts`) or one per island (:func:`mixed_layout`, searched on the best
  chains: [Note: mixed granularity] in :mod:`deepcee.planner.grains`), and, in the count look,
  any stage count per island: the layers split over the islands in proportion to their speed
  ([Note: stage counts] in the same module); plus, for a chain of several islands, one stage
  over all of them (data parallel across islands).
- **microbatch size** ``n`` (a divisor of the global batch, at least the largest stage's
  device count so every device gets a sample), **schedule** (gpipe, 1f1b, zb-h1, zb-h2,
  compact), **sync** (ring or hierarchical all-reduce), and the **layer split** (any
  contiguous split, every stage at least one layer). Shares are proportional to device
  speed (:func:`~deepcee.planner.ranges.largest_remainder_shares`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from deepcee.cluster import Cluster
from deepcee.errors import PlanError
from deepcee.plan import Plan, StagePlan
from deepcee.planner.cost_model import StageCosts
from deepcee.planner.grouping import DeviceGroup, Grouping, IslandGroup, distance_s
from deepcee.planner.options import PlannerOptions
from deepcee.planner.ranges import RangeTables, largest_remainder_shares
from deepcee.profile import ModelProfile
from deepcee.schedule.compact import RULE_GRID, Rules, build_compact, search_compact
from deepcee.schedule.ir import format_schedule


@dataclass(frozen=True, slots=True, kw_only=True)
class StageLayout:
    """Device sets of a pipeline, in order (a chain laid out; see [Note: plan space])."""

    slots: tuple[tuple[str, ...], ...]
    islands: tuple[str, ...]
    """Islands used, in pipeline order."""
    label: str
    merged: bool = True
    """Each island's kept groups form one device set (else one per group)."""
    granularity: int = 0
    """Most devices per stage when cutting device sets; 0 for the all-islands data-parallel layout."""
    devices: frozenset[str] = field(init=False, repr=False, compare=False)
    """Every device of the layout."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", frozenset(d for s in self.slots for d in s))


def microbatch_sizes(global_batch: int, options: PlannerOptions) -> list[int]:
    """The microbatch sizes to search: every divisor of the global batch, or the options' own."""
    divisors = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    if options.microbatch_sizes is None:
        return divisors
    bad = [n for n in options.microbatch_sizes if n not in divisors]
    if bad:
        raise PlanError(f"microbatch size {bad[0]} does not divide the global batch {global_batch}",
                        field="microbatch_sizes")
    return sorted(set(options.microbatch_sizes))


def _chunks(devices: Sequence[str], most: int) -> list[tuple[str, ...]]:
    return split_evenly(devices, -(-len(devices) // most))


Chain = tuple[tuple[int, int], ...]
"""(island index, groups kept) in pipeline order."""


def fed_grains(sizes: Sequence[int]) -> tuple[int, ...]:
    """The granularities a search adds to the powers of two for its microbatch ``sizes``: each size
    of at least 3 that is no power of two ([Note: fed granularities])."""
    return tuple(n for n in sizes if n >= 3 and n & (n - 1))


# [Note: fed granularities]
# A stage of ``k`` devices needs microbatches of at least ``k`` samples (every device gets one),
# and a microbatch size must divide the global batch. With a batch of 3, 17 or 100 the sizes are
# 1, 3 or 17, or 1, 2, 4, 5, 10, ...: chunks of powers of two then feed a stage only with some
# devices idle or with fewer devices than samples. So the best chains are also cut into chunks
# of at most ``n`` devices for every such size ``n`` (:func:`fed_grains`), each device one share
# of ``n`` (session 28, mixed-cluster seed 28 of ``benchmarks/planner_mixed.py``: GPT-2 XL at
# batch 3 on an 8-GPU server, 3 stages of 3, 3 and 2 GPUs with microbatches of 3 simulate
# 0.2457 s; 8 stages of one GPU with three microbatches, the best of the powers of two, 0.2574 s).
# Not inside the main search: there the new layouts changed the chains' values and so which
# chains a budget-stopped chain search reached (mixed seed 135: 2.557 -> 3.157 s). The *fed look*
# (``_fed_look`` in :mod:`deepcee.planner.search`) lays the main search's best and climbed chains
# out with them (and climbs their granularities with them among the steps), and searches those
# configurations on their own after the main search, as the second look does; its plan is
# taken only where the simulator rates it faster. Powers of two are there already, so global
# batches of powers of two get no fed look.


def chain_layouts(grouping: Grouping, chain: Chain, max_stages: int, memo: dict | None = None,
                  extra: Sequence[int] = ()) -> list[StageLayout]:
    """Every layout of ``chain`` (see [Note: plan space]) with at most ``max_stages`` stages.
    ``memo``: a dict kept for ``grouping`` that keeps each island's pieces (chains share islands);
    ``extra``: granularities beside the powers of two ([Note: fed granularities])."""
    islands = [grouping.islands[i] for i, _ in chain]
    kept = [isl.groups[:keep] for isl, (_, keep) in zip(islands, chain, strict=True)]
    biggest = max(len(g.devices) for gs in kept for g in gs)
    biggest = max(biggest, max(sum(len(g.devices) for g in gs) for gs in kept))
    sizes = sorted({2 ** k for k in range(int(math.ceil(math.log2(biggest))) + 1)} | {biggest}
                   | {x for x in extra if x < biggest}, reverse=True)
    out: list[StageLayout] = []
    for merged in ((True, False) if any(len(gs) > 1 for gs in kept) else (True,)):
        for g in sizes:
            slots: list[tuple[str, ...]] = []
            parts = []
            for isl, gs in zip(islands, kept, strict=True):
                pieces, part = _island_pieces(isl, gs, merged, g, memo)
                slots += pieces
                parts.append(part)
            if len(slots) <= max_stages:
                out.append(StageLayout(slots=tuple(slots), islands=tuple(i.name for i in islands),
                                       label=" > ".join(parts), merged=merged, granularity=g))
    if len(chain) > 1:
        member = {d for gs in kept for x in gs for d in x.devices}
        every = tuple(d for isl in islands for d in isl.devices if d in member)
        out.append(StageLayout(slots=(every,), islands=tuple(i.name for i in islands),
                               label="data parallel over " + " + ".join(i.name for i in islands)))
    return out


def _island_pieces(isl: IslandGroup, groups: Sequence[DeviceGroup], merged: bool, g: int,
                   memo: dict | None = None) -> tuple[list[tuple[str, ...]], str]:
    """The stages (device tuples) of island ``isl`` keeping ``groups`` (its first ones), in chunks of
    at most ``g`` devices (``merged``: over the kept groups together, else per group), and its
    label part; from ``memo`` when given and seen before."""
    key = (isl.name, len(groups), merged, g)
    if memo is not None and key in memo:
        return memo[key]
    sets = [kept_devices(isl, groups)] if merged else [x.devices for x in groups]
    pieces = [c for s in sets for c in _chunks(s, g)]
    dropped = len(isl.groups) - len(groups)
    part = (f"{isl.name}[{'+'.join(str(len(p)) for p in pieces)}]"
            + (f"(-{dropped} slow group{'s' if dropped > 1 else ''})" if dropped else ""))
    if memo is not None:
        memo[key] = (pieces, part)
    return pieces, part


def kept_devices(isl: IslandGroup, groups: Sequence[DeviceGroup]) -> tuple[str, ...]:
    """The devices of ``groups`` (island ``isl``'s first ones, kept), in the island's order."""
    member = {d for x in groups for d in x.devices}
    return tuple(d for d in isl.devices if d in member)


def island_grains(grouping: Grouping, chain: Chain, merged: bool = True, extra: Sequence[int] = ()) -> list[list[int]]:
    """Per island of ``chain``, the most devices per stage it can be cut into, ascending: the
    powers of two below its largest device set, ``extra`` below it ([Note: fed granularities]) and
    that set's size (the values at which its chunk count changes, as in :func:`chain_layouts`)."""
    out = []
    for i, keep in chain:
        gs = grouping.islands[i].groups[:keep]
        biggest = sum(len(x.devices) for x in gs) if merged else max(len(x.devices) for x in gs)
        out.append(sorted({2 ** k for k in range(int(math.ceil(math.log2(biggest))))} | {biggest}
                          | {x for x in extra if x < biggest}))
    return out


def mixed_layout(grouping: Grouping, chain: Chain, grains: Sequence[int], merged: bool = True,
                 memo: dict | None = None) -> StageLayout:
    """``chain`` laid out with island ``k`` cut into chunks of at most ``grains[k]`` devices (each
    island its own granularity; see [Note: mixed granularity] in :mod:`deepcee.planner.grains`)."""
    slots: list[tuple[str, ...]] = []
    parts = []
    islands = [grouping.islands[i] for i, _ in chain]
    for isl, (_, keep), g in zip(islands, chain, grains, strict=True):
        pieces, part = _island_pieces(isl, isl.groups[:keep], merged, g, memo)
        slots += pieces
        parts.append(part)
    return StageLayout(slots=tuple(slots), islands=tuple(i.name for i in islands), label=" > ".join(parts),
                       merged=merged, granularity=max(grains))


def split_evenly(devices: Sequence[str], count: int) -> list[tuple[str, ...]]:
    """``devices`` in ``count`` contiguous chunks whose sizes differ by at most one (larger first)."""
    base, extra = divmod(len(devices), count)
    out, i = [], 0
    for k in range(count):
        size = base + (1 if k < extra else 0)
        out.append(tuple(devices[i:i + size]))
        i += size
    return out


def counted_layout(grouping: Grouping, segments: Sequence[tuple[int, tuple[str, ...], int]]) -> StageLayout:
    """Stages of ``segments`` in order, each ``(island index, its devices, stage count)`` cut by
    :func:`split_evenly` (any stage count per island, not only the powers of two of
    :func:`chain_layouts`; used by [Note: stage counts] in :mod:`deepcee.planner.grains` and
    [Note: layout polish] in :mod:`deepcee.planner.polish`)."""
    slots: list[tuple[str, ...]] = []
    parts = []
    for i, devices, count in segments:
        if not 1 <= count <= len(devices):
            raise PlanError(f"cannot cut {len(devices)} devices into {count} stages", field="stages")
        pieces = split_evenly(devices, count)
        slots += pieces
        parts.append(f"{grouping.islands[i].name}[{'+'.join(str(len(p)) for p in pieces)}]")
    return StageLayout(slots=tuple(slots), islands=tuple(grouping.islands[i].name for i, _, _ in segments),
                       label=" > ".join(parts), granularity=max(len(x) for x in slots))


def island_distances(cluster: Cluster, grouping: Grouping) -> np.ndarray:
    """Symmetric 1 MB transfer time between islands (first devices, worse direction)."""
    n = len(grouping.islands)
    out = np.zeros((n, n))
    for i, j in itertools.combinations(range(n), 2):
        a, b = grouping.islands[i].devices[0], grouping.islands[j].devices[0]
        out[i, j] = out[j, i] = max(distance_s(cluster.link(a, b)), distance_s(cluster.link(b, a)))
    return out


def short_path(dist: np.ndarray, members: Sequence[int]) -> tuple[int, ...]:
    """A short Hamiltonian path over ``members`` (exact up to 6, else nearest neighbour + 2-opt)."""
    members = sorted(members)
    cost = lambda p: sum(dist[a, b] for a, b in zip(p, p[1:], strict=False))  # noqa: E731
    if len(members) <= 6:
        return min(itertools.permutations(members), key=lambda p: (cost(p), p))
    best: tuple[float, tuple[int, ...]] | None = None
    for start in members:
        path, left = [start], set(members) - {start}
        while left:
            path.append(min(left, key=lambda x: (dist[path[-1], x], x)))
            left.discard(path[-1])
        improved = True
        while improved:  # 2-opt on a path: reversing path[i..j] only changes its two end edges
            improved = False
            for i in range(1, len(path) - 1):
                for j in range(i + 1, len(path)):
                    old = dist[path[i - 1], path[i]] + (dist[path[j], path[j + 1]] if j + 1 < len(path) else 0.0)
                    new = dist[path[i - 1], path[j]] + (dist[path[i], path[j + 1]] if j + 1 < len(path) else 0.0)
                    if new < old - 1e-12:
                        path[i:j + 1] = path[i:j + 1][::-1]
                        improved = True
        cand = (cost(path), tuple(path))
        if best is None or cand < best:
            best = cand
    assert best is not None
    return best[1]


def island_orders(dist: np.ndarray, members: Sequence[int], all_orders: bool) -> list[tuple[int, ...]]:
    if all_orders:
        return list(itertools.permutations(members))
    best = short_path(dist, members)
    return list(dict.fromkeys([best, best[::-1]]))


def enumerate_chains(grouping: Grouping, dist: np.ndarray, options: PlannerOptions) -> list[Chain]:
    """Every chain of the plan space (all island subsets, all orders, group prefixes); what
    :func:`deepcee.planner.chains.search_chains` searches without listing."""
    n = len(grouping.islands)
    subsets = ([c for k in range(1, n + 1) for c in itertools.combinations(range(n), k)]
               if options.allow_exclusion else [tuple(range(n))])
    out: list[Chain] = []
    for sub in subsets:
        for order in island_orders(dist, sub, True):
            keeps = [range(1, len(grouping.islands[i].groups) + 1) if options.allow_exclusion
                     else [len(grouping.islands[i].groups)] for i in order]
            for ks in itertools.product(*keeps):
                out.append(tuple(zip(order, ks, strict=True)))
    return out


def build_plan(layout: StageLayout, split: Sequence[int], *, cluster: Cluster, model: ModelProfile,
               global_batch: int, microbatch_size: int, schedule: str, sync: str,
               actions: tuple[tuple[str, ...], ...] = (), system: str = "deepcee",
               recompute: Sequence[bool] = ()) -> Plan:
    """The plan of one point of the plan space (shares proportional to speed)."""
    stages = []
    for s, devs in enumerate(layout.slots):
        shares = largest_remainder_shares(devs, [cluster.effective_flops_per_s(d) for d in devs], microbatch_size)
        stages.append(StagePlan(layer_start=split[s], layer_stop=split[s + 1], devices=devs, shares=shares,
                                recompute=bool(recompute[s]) if recompute else False))
    used = layout.devices
    return Plan(system=system, cluster=cluster.name, model=model.name, global_batch=global_batch,
                microbatch_size=microbatch_size, num_microbatches=global_batch // microbatch_size,
                stages=tuple(stages), schedule=schedule, sync=sync, actions=actions,
                excluded_devices=tuple(d for d in cluster.device_names if d not in used))


def in_flight_counts(schedule: str, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Microbatches held per stage by a named schedule (``compact``: at least 1, see its limit)."""
    s, m = num_stages, num_microbatches
    if schedule == "gpipe":
        return (m,) * s
    if schedule in ("1f1b", "zb-h1"):
        return tuple(min(s - k, m) for k in range(s))
    if schedule == "zb-h2":
        return tuple(min(2 * (s - k) - 1, m) for k in range(s))
    return (1,) * s


def schedule_in_flight(schedule: str, num_stages: int, num_microbatches: int) -> tuple[int, ...] | None:
    """:func:`in_flight_counts` for a fixed schedule; ``None`` for ``compact``, which holds what
    each stage's memory allows (see [Note: in-flight limit] in :mod:`deepcee.planner.split`)."""
    return None if schedule == "compact" else in_flight_counts(schedule, num_stages, num_microbatches)


FUSED_BACKWARD = ("gpipe", "1f1b")
"""Schedules that run the fused ``B`` (the input gradient leaves after ``I + W``)."""


SCREEN_RULES: tuple[Rules, ...] = tuple(r for r in RULE_GRID if r.feed_downstream == 0 and r.w_slack in (0.0, 1.0))
"""The compact builder's rule settings used to *screen* splits while refining a compact plan: the
six that won most often on the random instances of ``benchmarks/planner_optimality.py`` (about
two thirds of all wins; the templates are always tried). The split a refinement ends on is
built with the full grid."""


def compact_plan(plan: Plan, cluster: Cluster, model: ModelProfile, cost: StageCosts,
                 tables: RangeTables, *, rules: Sequence[Rules] | None = None) -> Plan | None:
    """``plan`` with a compact schedule built from ``cost`` (its stage and link times) by
    :func:`~deepcee.schedule.compact.build_compact` (or with only ``rules``, see
    :data:`SCREEN_RULES`); ``None`` if some stage cannot hold even one microbatch."""
    limits = []
    for st in plan.stages:
        k = tables.costs(st.devices, st.shares).max_in_flight(st.layer_start, st.layer_stop, plan.num_microbatches,
                                                              st.recompute)
        if k < 1:
            return None
        limits.append(k)
    costs = {"num_microbatches": plan.num_microbatches, "forward_s": cost.forward_s,
             "input_grad_s": cost.input_grad_s, "weight_grad_s": cost.weight_grad_s,
             # the builder takes latencies >= 0: a shared pipe's earlier first delivery
             # ([Note: shared pipe delivery]) is the cost model's, not the builder's
             "comm_forward": [(max(0.0, b.forward[0]), b.forward[1]) for b in cost.boundaries],
             "comm_backward": [(max(0.0, b.backward[0]), b.backward[1]) for b in cost.boundaries],
             "memory_limit": limits}
    sched = build_compact(**costs) if rules is None else search_compact(**costs, rules=rules).schedule
    return plan.replace(schedule="compact", actions=format_schedule(sched))
