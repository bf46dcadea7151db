"""An upper bound on training throughput that no plan can beat (torch-free).

A fluid relaxation: samples are infinitely divisible, every device computes at its datasheet
effective speed with **no per-layer overheads, no pipeline bubbles, no waiting for
synchronisation**, and compute and communication overlap perfectly. What remains are three
kinds of constraint, solved as one linear program per set of islands ``S``:

- **compute**: island ``i`` does ``y_i`` samples/s worth of work, at most its capacity
  ``cap_i = sum over its devices of 1 / (time of one sample's forward + backward)``
  (analytic profiles: ``effective FLOP/s / FLOPs per sample``); ``T = sum y_i``.
- **island cut** (only when ``S`` holds more than one island): a plan whose stages each stay
  inside one island (deepcee's: a stage runs on a group, and groups lie inside islands), or
  that is data parallel over the whole model, makes every sample cross a cut of every island
  it uses, so each island ``i`` of ``S`` exchanges at least ``c_min`` bytes per sample with
  the rest of ``S``: ``T x c_min <= BW_i(S)``, where
  ``c_min = min(2 x cheapest internal layer boundary, 2 x gradient bytes / global batch)``
  (the activation forward plus its gradient back, or the data-parallel alternative of
  sending and receiving the whole gradient once per iteration) and ``BW_i(S)`` sums the
  bandwidth of every distinct link resource between ``i`` and the rest of ``S``, each
  direction counted once (see [Note: link resources] in :mod:`deepcee.cluster`; a bandwidth
  trace counts at its highest value).
- **memory**: the devices of ``S`` together must hold the model state
  (``parameters x state_bytes_per_parameter``); sets that cannot are skipped.

Islands are those of :func:`deepcee.planner.grouping.group_devices` (the network's view, which
the planner uses too). The bound is the largest ``T`` over all non-empty island sets (at most
16 islands). Sets are visited in decreasing order of their compute-only value, and the search
stops as soon as that value cannot beat the best ``T`` found, so usually only a few LPs are
solved.

What is *not* included, because it would not hold for every plan: a cut between the nodes of
one island (a stage may span nodes, and a cheap-to-synchronise stage shared by two nodes lets
one of them do most of the work while exchanging far less than ``c_min`` per sample; using
only some nodes of an island needs no cut at all), and per-device memory (only the total).
A stage split across islands with few parameters could in principle undercut ``c_min`` the
same way; no deepcee plan does that, and the network-oblivious baselines that might pay far
more for the slow links than the bound allows them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import linprog

from deepcee.cluster import Cluster
from deepcee.errors import InfeasiblePlanError, ProfileError
from deepcee.planner.grouping import group_devices
from deepcee.profile import LayerTiming, ModelProfile, Pass
from deepcee.units import fmt_bytes, fmt_rate

log = logging.getLogger(__name__)

MAX_ISLANDS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """The upper bound on samples/s and how it was reached."""

    samples_per_s: float
    binding: str
    """The constraint that binds: ``compute``, ``island cut`` or ``node cut``, with its numbers."""
    islands: tuple[str, ...]
    """The islands of the set that reaches the bound."""
    derivation: tuple[str, ...]
    """A short derivation, one line per step (shown in reports)."""
    cut_bytes_per_sample: float
    """``c_min``: the least bytes per sample a used island exchanges with the others."""
    compute_samples_per_s: Mapping[str, float] = field(default_factory=dict)
    """Compute capacity (samples/s) of each island, for reports."""

    def __post_init__(self) -> None:
        if not self.samples_per_s > 0:
            raise InfeasiblePlanError(f"upper bound must be > 0 samples/s, got {self.samples_per_s!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples_per_s": self.samples_per_s,
            "binding": self.binding,
            "islands": list(self.islands),
            "cut_bytes_per_sample": self.cut_bytes_per_sample,
            "compute_samples_per_s": dict(self.compute_samples_per_s),
            "derivation": list(self.derivation),
        }


# ---------------------------------------------------------------------------------------
# ingredients
# ---------------------------------------------------------------------------------------


def device_samples_per_s(cluster: Cluster, model: ModelProfile, device: str, global_batch: int) -> float:
    """Most samples/s one device can compute (forward + backward), overheads ignored.

    Analytic profiles: effective FLOP/s over FLOPs per sample. Measured profiles (lines
    ``a + b n`` per layer and pass): per layer, the least time per sample any share ``n`` in
    ``1 .. global_batch`` can reach, ``min(t(1), t(B) / B)`` per pass (``t(n)/n`` is monotone
    in ``n`` for a line), with the cheaper of the fused backward and ``I + W``, and the
    cheaper of the layer's own and its first-stage lines (a plan may run either); the
    per-call overhead is left out.
    """
    kind = cluster.kind_of(device)
    slowdown = cluster.device(device).slowdown
    timings = model.measured.get(kind.name)
    if timings is None:
        flops = model.flops_per_sample()
        if flops <= 0:
            raise ProfileError(f"model {model.name!r} has no FLOPs per sample; no throughput bound exists")
        return cluster.effective_flops_per_s(device) / flops
    per_sample = slowdown * sum(min(_least_per_sample_s(v, global_batch) for v in (t, t.first_stage) if v is not None)
                                for t in timings)
    if per_sample <= 0:
        raise ProfileError(f"model {model.name!r}: measured time per sample on {kind.name!r} is {per_sample!r} s")
    return 1.0 / per_sample


def _least_per_sample_s(timing: LayerTiming, global_batch: int) -> float:
    """Least forward + backward seconds per sample of one layer's lines over shares ``1 .. global_batch``."""
    def per(p: Pass) -> float:
        return min(timing.time_s(p, 1), timing.time_s(p, global_batch) / global_batch)
    return per("F") + min(per("B"), per("I") + per("W"))


def cut_bytes_per_sample(model: ModelProfile, global_batch: int) -> tuple[float, str]:
    """``c_min`` and a line saying which alternative gives it."""
    dp = 2.0 * model.gradient_bytes(0, model.num_layers) / global_batch
    if model.num_layers < 2:
        return dp, f"data parallel only (one layer): 2 x gradient {fmt_bytes(dp * global_batch / 2)} / {global_batch}"
    k = min(range(1, model.num_layers), key=model.boundary_bytes)
    cut = 2.0 * model.boundary_bytes(k)
    if cut <= dp:
        return cut, (f"cheapest cut after layer {model.layers[k - 1].name!r}: 2 x {fmt_bytes(cut / 2)} "
                     f"(activation forward + its gradient back)")
    return dp, (f"data parallel: 2 x gradient {fmt_bytes(dp * global_batch / 2)} / batch {global_batch} "
                f"(cheaper than the best cut, 2 x {fmt_bytes(cut / 2)})")


def _peak_bandwidth(link: Any) -> float:
    if link.trace is None:
        return link.bandwidth_bytes_per_s
    return max(link.bandwidth_bytes_per_s, *link.trace.bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Topology:
    """Per-node capacities and the link resources between every ordered pair of nodes.

    A "node" here is the part of a cluster node inside one island (normally the whole node;
    a node split between islands by device-level links becomes one unit per island).
    """

    islands: tuple[str, ...]
    nodes_of: Mapping[str, tuple[str, ...]]
    capacity: Mapping[str, float]
    """Node -> samples/s."""
    memory_bytes: Mapping[str, float]
    """Node -> total device memory."""
    pipes: Mapping[tuple[str, str], Mapping[str, float]]
    """(src node, dst node) -> {resource: peak bytes/s} of the links between them."""

    def bandwidth(self, inside: Sequence[str], outside: Sequence[str]) -> float:
        """Bytes/s over distinct resources between two node sets, both directions once each."""
        resources: dict[str, float] = {}
        for a in inside:
            for b in outside:
                for key in ((a, b), (b, a)):
                    for res, bw in self.pipes[key].items():
                        resources[res] = max(resources.get(res, 0.0), bw)
        return sum(resources.values())


def _topology(cluster: Cluster, model: ModelProfile, global_batch: int,
              islands: Mapping[str, Sequence[str]]) -> _Topology:
    island_of = {d: i for i, devs in islands.items() for d in devs}
    split = {n for n in {cluster.device(d).node for d in island_of}
             if len({island_of[d] for d in cluster.node(n).devices if d in island_of}) > 1}
    units: dict[str, list[str]] = {}
    nodes_of: dict[str, list[str]] = {i: [] for i in islands}
    for d in cluster.device_names:
        if d not in island_of:
            continue
        node, isl = cluster.device(d).node, island_of[d]
        unit = f"{node}[{isl}]" if node in split else node
        if unit not in units:
            units[unit] = []
            nodes_of[isl].append(unit)
        units[unit].append(d)
    # devices that no device-level link entry names all see the same links as their node's first device
    named = {e.a for e in cluster.links} | {e.b for e in cluster.links}
    reps = {u: [devs[0]] + [d for d in devs[1:] if d in named] for u, devs in units.items()}
    pipes: dict[tuple[str, str], dict[str, float]] = {}
    for a, b in itertools.permutations(units, 2):
        found: dict[str, float] = {}
        for da in reps[a]:
            for db in reps[b]:
                link = cluster.link(da, db)
                found[link.resource] = max(found.get(link.resource, 0.0), _peak_bandwidth(link))
        pipes[(a, b)] = found
    return _Topology(
        islands=tuple(islands), nodes_of={i: tuple(v) for i, v in nodes_of.items()},
        capacity={u: sum(device_samples_per_s(cluster, model, d, global_batch) for d in devs)
                  for u, devs in units.items()},
        memory_bytes={u: sum(cluster.memory_bytes(d) for d in devs) for u, devs in units.items()},
        pipes=pipes,
    )


# ---------------------------------------------------------------------------------------
# one island set: the LP
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SubsetBound:
    """The LP's answer for one set of islands."""

    islands: tuple[str, ...]
    samples_per_s: float
    binding: str


def solve_subset(topo: _Topology, subset: Sequence[str], c_min: float) -> SubsetBound:
    """Maximise ``T`` for the islands ``subset`` (HiGHS via :func:`scipy.optimize.linprog`).

    Variables ``[T, y_i for each island]``; every constraint is a row of ``A_ub`` so that the
    dual values (marginals) say which one binds.
    """
    k = len(subset)
    rows: list[np.ndarray] = []
    rhs: list[float] = []
    labels: list[tuple[str, str]] = []

    def add(coef: dict[int, float], bound: float, label: tuple[str, str]) -> None:
        row = np.zeros(k + 1)
        for j, v in coef.items():
            row[j] = v
        rows.append(row)
        rhs.append(bound)
        labels.append(label)

    add({0: 1.0, **{j + 1: -1.0 for j in range(k)}}, 0.0, ("total", "T <= sum of island work"))
    for j, i in enumerate(subset):
        cap = sum(topo.capacity[n] for n in topo.nodes_of[i])
        add({j + 1: 1.0}, cap, ("compute", f"{i} {cap:.1f} samples/s"))
    if c_min > 0 and k > 1:
        for i in subset:
            rest = [m for j in subset if j != i for m in topo.nodes_of[j]]
            bw = topo.bandwidth(topo.nodes_of[i], rest)
            add({0: c_min}, bw, ("island cut", f"{i} {fmt_rate(bw)} both ways to the other islands"))
    cost = np.zeros(k + 1)
    cost[0] = -1.0
    res = linprog(cost, A_ub=np.vstack(rows), b_ub=np.asarray(rhs), bounds=[(0, None)] * (k + 1), method="highs")
    if res.status != 0:
        raise InfeasiblePlanError(f"bound LP for islands {list(subset)} failed: {res.message}")
    marg = np.abs(res.ineqlin.marginals)
    groups: dict[str, list[str]] = {}
    for j in np.argsort(-marg, kind="stable"):
        if marg[j] > 1e-12 and j > 0:
            groups.setdefault(labels[j][0], []).append(labels[j][1])
    binding = "; ".join(f"{kind} ({', '.join(what)})" for kind, what in groups.items()) or "compute"
    return SubsetBound(islands=tuple(subset), samples_per_s=float(res.x[0]), binding=binding)


# ---------------------------------------------------------------------------------------
# the bound
# ---------------------------------------------------------------------------------------


def _islands(cluster: Cluster) -> dict[str, tuple[str, ...]]:
    """Islands as the planner sees them (:func:`deepcee.planner.grouping.group_devices`).

    deepcee places each stage inside one of these islands, which is what makes the
    island-cut constraint hold for its plans.
    """
    return {isl.name: isl.devices for isl in group_devices(cluster).islands}


def upper_bound(cluster: Cluster, model: ModelProfile, global_batch: int) -> Bound:
    """The most samples/s any plan can reach on ``cluster``. See the module docstring."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise InfeasiblePlanError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    islands = _islands(cluster)
    if len(islands) > MAX_ISLANDS:
        raise InfeasiblePlanError(f"upper bound enumerates island sets; {len(islands)} islands > {MAX_ISLANDS}")
    topo = _topology(cluster, model, global_batch, islands)
    c_min, c_why = cut_bytes_per_sample(model, global_batch)
    state = model.state_bytes(0, model.num_layers)
    island_cap = {i: sum(topo.capacity[n] for n in topo.nodes_of[i]) for i in islands}
    island_mem = {i: sum(topo.memory_bytes[n] for n in topo.nodes_of[i]) for i in islands}
    names = list(islands)
    subsets = [
        combo for r in range(1, len(names) + 1) for combo in itertools.combinations(names, r)
        if sum(island_mem[i] for i in combo) >= state
    ]
    if not subsets:
        total = sum(island_mem.values())
        raise InfeasiblePlanError(
            f"model {model.name!r} state needs {fmt_bytes(state)}, all devices of {cluster.name!r} "
            f"together hold {fmt_bytes(total)}"
        )
    subsets.sort(key=lambda s: -sum(island_cap[i] for i in s))
    best: SubsetBound | None = None
    solved = 0
    for s in subsets:
        if best is not None and sum(island_cap[i] for i in s) <= best.samples_per_s:
            break  # no later set can beat it: compute alone caps T
        sub = solve_subset(topo, s, c_min)
        solved += 1
        if best is None or sub.samples_per_s > best.samples_per_s * (1 + 1e-12):
            best = sub
    assert best is not None
    log.debug("upper bound: %d island sets fit in memory, %d LPs solved", len(subsets), solved)
    derivation = (
        f"fluid relaxation of {model.name} on {cluster.name}, global batch {global_batch}: "
        "no per-layer overheads, no bubbles, no waiting for synchronisation, compute and "
        "communication overlap perfectly; devices at datasheet effective speed",
        "compute capacity (samples/s): " + ", ".join(f"{i} {c:.1f}" for i, c in island_cap.items()),
        f"c_min = {fmt_bytes(c_min)} per sample: {c_why}",
        f"model state {fmt_bytes(state)} must fit in the devices used: {len(subsets)} of "
        f"{2 ** len(names) - 1} island sets do; {solved} LP(s) solved",
        f"best island set {{{', '.join(best.islands)}}}: {best.samples_per_s:.2f} samples/s, bound by {best.binding}",
    )
    return Bound(
        samples_per_s=best.samples_per_s, binding=best.binding, islands=best.islands,
        derivation=derivation, cut_bytes_per_sample=c_min, compute_samples_per_s=island_cap,
    )
