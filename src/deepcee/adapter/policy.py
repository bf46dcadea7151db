"""Adapter policy: keep, re-tune microbatches, or re-plan when the network changes (torch-free).

Pure decision logic, called at iteration boundaries with :class:`AdapterState` (the plan in
force, the cluster as the monitor now sees it, the iterations left and the links whose change
the monitor detected). Everything it needs is injected: a *scorer* (plan, cluster ->
predicted iteration seconds; the cost model or the simulator in production, a stub in tests),
a *planner* (cluster -> plan, for re-plans) and a clock.

[Note: adapter cost-benefit]
Candidates are the **re-tunes** of the current plan (same stages, layers and devices; other
microbatch counts and per-device shares, :func:`retune_candidates`) and the planner's plan
for the new conditions (a **re-plan** when its stages differ). For each, with ``old`` and
``new`` the scorer's predicted iteration times on the updated cluster and ``left`` the
iterations still to run:

    benefit = (old - new) x left        cost = change cost (below)

A candidate qualifies when ``(old - new) / old >= min_relative_gain`` and ``benefit > cost x
margin``; among those the one with the largest ``benefit - cost`` wins.
Change cost: a re-tune only drains and restarts at an iteration boundary, so it is charged
``retune_cost_iterations`` of the current iteration time (default 1: a deliberately
conservative allowance for rebuilding the schedule and buffers, to be replaced by the
runtime's measured figure). A re-plan pays that plus moving the parameters and optimizer
state of every layer to each device that gains it (:func:`state_movement`), timed on the
current link estimates.

Hysteresis, so a noisy but stationary network never makes the plan flap:

- nothing is evaluated unless the monitor reports a changed link;
- a change is applied only after ``confirm_checks`` consecutive checks in which a qualifying
  candidate exists (default 2: with the monitor's own CUSUM, which needs at least 3
  transfers, a change must survive two iteration boundaries);
- after ``confirm_checks`` consecutive checks without a qualifying candidate, the decision
  says ``acknowledge`` (the caller then makes the new link level the monitor's baseline);
- after a change, ``cooldown_checks`` checks (default 5) keep the new plan whatever happens,
  so the monitor sees the links the new plan uses before anything else moves.

The policy object keeps only this bookkeeping (streak counters, cooldown); all of it is
per instance and deterministic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from deepcee.adapter.monitor import LinkEstimate
from deepcee.cluster import Cluster, LinkEntry, LinkSpec
from deepcee.errors import DeepceeError
from deepcee.plan import Plan, StagePlan
from deepcee.profile import ModelProfile

log = logging.getLogger(__name__)

Scorer = Callable[[Plan, Cluster], float]
"""Predicted iteration seconds of a plan on a cluster (``inf`` when it does not fit)."""
Planner = Callable[[Cluster], Plan]
"""The best plan for a cluster (the model and batch are bound in)."""
CandidateGenerator = Callable[[Plan, Cluster], Iterable[Plan]]


class DecisionKind(StrEnum):
    KEEP = "keep"
    RETUNE = "retune"
    REPLAN = "replan"


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """Thresholds of :class:`AdapterPolicy`. See [Note: adapter cost-benefit] for their use."""

    min_relative_gain: float = 0.05
    """A change must cut the predicted iteration time by at least this fraction."""
    margin: float = 2.0
    """The saved time over the remaining iterations must exceed the change cost this many times
    (the scorer and the link estimates are both uncertain)."""
    confirm_checks: int = 2
    """Consecutive checks with a qualifying candidate before a change is applied."""
    cooldown_checks: int = 5
    """Checks after a change during which the plan is kept."""
    retune_cost_iterations: float = 1.0
    """Cost of a re-tune (and the fixed part of a re-plan), in current iterations."""

    def __post_init__(self) -> None:
        for name, ok in (("min_relative_gain", 0 <= self.min_relative_gain < 1), ("margin", self.margin >= 0),
                         ("confirm_checks", self.confirm_checks >= 1), ("cooldown_checks", self.cooldown_checks >= 0),
                         ("retune_cost_iterations", self.retune_cost_iterations >= 0)):
            if not ok:
                raise ValueError(f"PolicyConfig.{name} is out of range: {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterState:
    """What the policy sees at one iteration boundary."""

    plan: Plan
    cluster: Cluster
    """The cluster as now estimated (:func:`cluster_with_estimates`)."""
    iterations_left: int
    changed_links: tuple[str, ...] = ()
    """Link resources whose change the monitor detected and that are not yet accepted."""

    def __post_init__(self) -> None:
        if self.iterations_left < 0:
            raise ValueError(f"iterations_left must be >= 0, got {self.iterations_left}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    kind: DecisionKind
    plan: Plan
    """The plan to run from the next iteration on (the current one for ``keep``)."""
    reason: str
    at_s: float
    current_iteration_s: float | None = None
    """Predicted iteration time of the current plan on the updated cluster (when evaluated)."""
    new_iteration_s: float | None = None
    """Predicted iteration time of the best candidate (when evaluated)."""
    change_cost_s: float = 0.0
    moved_bytes: float = 0.0
    acknowledge: bool = False
    """The detected change has been acted on or dismissed: make it the monitor's baseline."""
    candidates_evaluated: int = 0

    @property
    def changes_plan(self) -> bool:
        return self.kind != DecisionKind.KEEP


@dataclass(frozen=True, slots=True, kw_only=True)
class _Scored:
    plan: Plan
    kind: DecisionKind
    iteration_s: float
    cost_s: float
    moved_bytes: float


class AdapterPolicy:
    """The decision of the module docstring. One instance per training run."""

    def __init__(self, *, scorer: Scorer, model: ModelProfile, planner: Planner | None = None,
                 retune: CandidateGenerator | None = None, config: PolicyConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scorer, self.model, self.planner = scorer, model, planner
        self.retune = retune or (lambda plan, cluster: retune_candidates(plan, cluster, model))
        self.config = config or PolicyConfig()
        self._clock = clock
        self._streak = 0  # consecutive checks with a qualifying candidate
        self._dismiss = 0  # consecutive evaluated checks without one
        self._cooldown = 0
        self.changes = 0
        self.checks = 0

    def decide(self, state: AdapterState) -> Decision:
        now = self._clock()
        self.checks += 1
        if self._cooldown > 0:
            self._cooldown -= 1
            return self._keep(state, now, f"cooldown after a change ({self._cooldown} checks left)")
        if not state.changed_links:
            self._streak = self._dismiss = 0
            return self._keep(state, now, "no link change detected")
        if state.iterations_left == 0:
            return self._keep(state, now, "no iterations left", acknowledge=True)
        current = self._score(state.plan, state.cluster)
        scored = self._candidates(state, current)
        best = self._best(scored, current, state.iterations_left)
        common = dict(at_s=now, current_iteration_s=current, candidates_evaluated=len(scored),
                      new_iteration_s=best.iteration_s if best else min((c.iteration_s for c in scored),
                                                                         default=None))
        if best is None:
            self._streak, self._dismiss = 0, self._dismiss + 1
            done = self._dismiss >= self.config.confirm_checks
            if done:
                self._dismiss = 0
            return Decision(kind=DecisionKind.KEEP, plan=state.plan, acknowledge=done,
                            reason=self._why_not(scored, current, state), **common)
        self._dismiss, self._streak = 0, self._streak + 1
        if self._streak < self.config.confirm_checks:
            return Decision(kind=DecisionKind.KEEP, plan=state.plan,
                            reason=f"{best.kind} would gain {_gain(current, best.iteration_s):.0%}; "
                                   f"confirming ({self._streak}/{self.config.confirm_checks} checks)", **common)
        self._streak, self._cooldown = 0, self.config.cooldown_checks
        self.changes += 1
        reason = (f"{best.kind}: {current * 1e3:.4g} -> {best.iteration_s * 1e3:.4g} ms per iteration "
                  f"({_gain(current, best.iteration_s):.0%} faster) over {state.iterations_left} iterations "
                  f"saves {(current - best.iteration_s) * state.iterations_left:.4g} s for a change costing "
                  f"{best.cost_s:.4g} s")
        log.info("adapter: %s (links %s)", reason, ", ".join(state.changed_links))
        return Decision(kind=best.kind, plan=best.plan, reason=reason, change_cost_s=best.cost_s,
                        moved_bytes=best.moved_bytes, acknowledge=True, **common)

    # -- pieces ----------------------------------------------------------------------------
    def _keep(self, state: AdapterState, now: float, reason: str, *, acknowledge: bool = False) -> Decision:
        return Decision(kind=DecisionKind.KEEP, plan=state.plan, reason=reason, at_s=now, acknowledge=acknowledge)

    def _score(self, plan: Plan, cluster: Cluster) -> float:
        try:
            return float(self.scorer(plan, cluster))
        except DeepceeError as exc:  # a candidate the scorer rejects (memory, schedule) is no option
            log.debug("scorer rejected a candidate: %s", exc)
            return float("inf")

    def _candidates(self, state: AdapterState, current_s: float) -> list[_Scored]:
        retune_cost = self.config.retune_cost_iterations * current_s
        out: list[_Scored] = []
        seen = {_key(state.plan)}
        options = list(self.retune(state.plan, state.cluster))
        if self.planner is not None:
            try:
                options.append(self.planner(state.cluster))
            except DeepceeError as exc:
                log.info("adapter: the planner found no plan for the new conditions: %s", exc)
        for plan in options:
            if _key(plan) in seen:
                continue
            seen.add(_key(plan))
            kind = DecisionKind.RETUNE if same_stages(plan, state.plan) else DecisionKind.REPLAN
            moved_bytes, move_s = (0.0, 0.0) if kind == DecisionKind.RETUNE else \
                state_movement(state.plan, plan, state.cluster, self.model)
            out.append(_Scored(plan=plan, kind=kind, iteration_s=self._score(plan, state.cluster),
                               cost_s=retune_cost + move_s, moved_bytes=moved_bytes))
        return out

    def _best(self, scored: Sequence[_Scored], current_s: float, left: int) -> _Scored | None:
        cfg, best, best_net = self.config, None, 0.0
        for c in scored:
            saved = (current_s - c.iteration_s) * left
            if not np.isfinite(c.iteration_s) or _gain(current_s, c.iteration_s) < cfg.min_relative_gain:
                continue
            if saved <= c.cost_s * cfg.margin:
                continue
            if best is None or saved - c.cost_s > best_net:
                best, best_net = c, saved - c.cost_s
        return best

    def _why_not(self, scored: Sequence[_Scored], current_s: float, state: AdapterState) -> str:
        if not scored:
            return "no candidate plan to compare with"
        c = min(scored, key=lambda s: s.iteration_s)
        gain = _gain(current_s, c.iteration_s)
        if gain < self.config.min_relative_gain:
            return (f"keep: best candidate ({c.kind}) gains {gain:.1%}, below "
                    f"{self.config.min_relative_gain:.0%}")
        return (f"keep: best candidate ({c.kind}) saves {(current_s - c.iteration_s) * state.iterations_left:.4g} s "
                f"over {state.iterations_left} iterations, not {self.config.margin:g} x its cost "
                f"{c.cost_s:.4g} s")


def _gain(old_s: float, new_s: float) -> float:
    if not np.isfinite(old_s):
        return 1.0 if np.isfinite(new_s) else 0.0
    return (old_s - new_s) / old_s if old_s > 0 else 0.0


def _key(plan: Plan) -> tuple:
    return (plan.num_microbatches, plan.schedule, plan.sync, plan.actions,
            tuple((s.layer_start, s.layer_stop, s.devices, s.shares) for s in plan.stages))


def same_stages(a: Plan, b: Plan) -> bool:
    """Same layer split on the same devices (only microbatching or shares may differ)."""
    return len(a.stages) == len(b.stages) and all(
        x.layer_start == y.layer_start and x.layer_stop == y.layer_stop and x.devices == y.devices
        for x, y in zip(a.stages, b.stages, strict=True))


# ---------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------


def proportional_shares(samples: int, weights: Sequence[float]) -> tuple[int, ...] | None:
    """Whole shares >= 1 summing to ``samples``, proportional to ``weights`` (largest remainder);
    ``None`` when there are fewer samples than weights."""
    k = len(weights)
    if samples < k:
        return None
    w = np.asarray(weights, dtype=float)
    ideal = (samples - k) * w / w.sum()
    shares = np.floor(ideal).astype(int)
    for j in np.argsort(-(ideal - shares), kind="stable")[: (samples - k) - int(shares.sum())]:
        shares[j] += 1
    return tuple(int(s) + 1 for s in shares)


def retune_candidates(plan: Plan, cluster: Cluster, model: ModelProfile | None = None) -> list[Plan]:
    """Plans with the same stages and every microbatch count that divides the batch (leaving
    each device a sample), each with shares proportional to the current ones, to device speed,
    and (given ``model``) to each device's pipeline rate on the current links
    (:func:`device_rates`, which moves samples away from a device behind a slowed link).

    Plans with explicit actions (``compact``) are built for their microbatch count, so only
    their shares vary. Memory and schedule feasibility are left to the scorer.
    """
    gb, widest = plan.global_batch, max(len(st.devices) for st in plan.stages)
    counts = [plan.num_microbatches] if plan.actions else \
        [m for m in range(1, gb + 1) if gb % m == 0 and gb // m >= widest]
    weightings: list[list[Sequence[float]]] = [
        [st.shares for st in plan.stages],
        [[cluster.effective_flops_per_s(d) for d in st.devices] for st in plan.stages],
    ]
    if model is not None:
        weightings.append(device_rates(plan, cluster, model))
    out = []
    for m in counts:
        size = gb // m
        for weights in weightings:
            shares = [proportional_shares(size, w) for w in weights]
            if any(s is None for s in shares):
                continue
            stages = tuple(StagePlan(layer_start=st.layer_start, layer_stop=st.layer_stop, devices=st.devices,
                                     shares=sh) for st, sh in zip(plan.stages, shares, strict=True))
            out.append(plan.replace(microbatch_size=size, num_microbatches=m, stages=stages, estimate=None))
    return out


def device_rates(plan: Plan, cluster: Cluster, model: ModelProfile) -> list[list[float]]:
    """Per stage, each device's samples per second as the slower of its compute and its
    boundary transfers: ``1 / max(compute s per sample, bytes per sample / bandwidth of each
    link to and from the neighbouring stages' devices)``. Compute and transfers overlap in a
    pipeline, so the slower one sets the device's rate."""
    out = []
    for s, st in enumerate(plan.stages):
        rates = []
        for d, share in zip(st.devices, st.shares, strict=True):
            kind, slow = cluster.kind_of(d), cluster.device(d).slowdown
            per_sample = (model.time_s(st.layer_start, st.layer_stop, "F", share, kind, slow)
                          + model.time_s(st.layer_start, st.layer_stop, "B", share, kind, slow)) / share
            for peer_stage, nbytes in ((s - 1, model.boundary_bytes(st.layer_start)),
                                       (s + 1, model.boundary_bytes(st.layer_stop))):
                if 0 <= peer_stage < plan.num_stages:
                    for peer in plan.stages[peer_stage].devices:
                        for a, b in ((peer, d), (d, peer)):
                            per_sample = max(per_sample, nbytes / cluster.link(a, b).bandwidth_bytes_per_s)
            rates.append(1.0 / per_sample if per_sample > 0 else 1.0)
        out.append(rates)
    return out


# ---------------------------------------------------------------------------------------
# the cost of a re-plan
# ---------------------------------------------------------------------------------------


def state_movement(old: Plan, new: Plan, cluster: Cluster, model: ModelProfile) -> tuple[float, float]:
    """``(bytes, seconds)`` to give every device of ``new`` the state of its layers.

    Per layer, each device of its new stage that did not hold it receives its parameters and
    optimizer state (``state_bytes_per_parameter - gradient_bytes_per_parameter`` bytes per
    parameter: gradients are rebuilt by the next backward) from one device that held it,
    chosen to finish earliest. Transfers on one link resource queue; different resources
    run in parallel; the time is the busiest resource's ``latency + bytes / bandwidth``.
    ZeRO-2 shards are counted as full replicas (an upper bound).
    """
    per_param = max(0.0, model.state_bytes_per_parameter - model.gradient_bytes_per_parameter)
    holders = {layer: st.devices for st in old.stages for layer in range(st.layer_start, st.layer_stop)}
    load: dict[str, float] = {}
    latency: dict[str, float] = {}
    bandwidth: dict[str, float] = {}
    moved = 0.0
    for st in new.stages:
        for layer in range(st.layer_start, st.layer_stop):
            nbytes = model.parameters(layer, layer + 1) * per_param
            if nbytes <= 0:
                continue
            for d in st.devices:
                if d in holders[layer]:
                    continue
                link = min((cluster.link(src, d) for src in holders[layer]),
                           key=lambda lk: lk.latency_s + (load.get(lk.resource, 0.0) + nbytes) / lk.bandwidth_bytes_per_s)
                load[link.resource] = load.get(link.resource, 0.0) + nbytes
                latency[link.resource] = max(latency.get(link.resource, 0.0), link.latency_s)
                bandwidth[link.resource] = link.bandwidth_bytes_per_s
                moved += nbytes
    seconds = max((latency[r] + load[r] / bandwidth[r] for r in load), default=0.0)
    return moved, seconds


# ---------------------------------------------------------------------------------------
# the cluster as the monitor sees it
# ---------------------------------------------------------------------------------------


def cluster_with_estimates(cluster: Cluster, estimates: Iterable[LinkEstimate], *,
                           settled: bool = True) -> Cluster:
    """``cluster`` with each estimated link resource overridden by a :class:`LinkEntry`.

    With ``settled`` (default) a link takes its current estimate only while a change is
    detected and otherwise its baseline (the nominal value, or the last accepted level), so
    estimation noise never moves the cluster the policy plans on. Resources name a device
    pair (inside a node), a node pair, or, for a route over several islands, the island hop
    whose bandwidth is narrowest: that hop gets the estimated bandwidth and keeps its latency
    (the estimate's latency is the whole route's). Overrides are directed.
    Traces on overridden links are dropped: the estimate is the present.
    """
    devices, nodes = set(cluster.device_names), set(cluster.node_devices())
    islands = {i.name for i in cluster.islands}
    overrides: dict[tuple[str, str], LinkSpec] = {}
    for est in estimates:
        a, sep, b = est.resource.partition("->")
        if not sep or not any(a in names and b in names for names in (devices, nodes, islands)):
            raise ValueError(f"link resource {est.resource!r} names no device, node or island pair "
                             f"of cluster {cluster.name!r}")
        lat, bw = (est.latency_s, est.bandwidth_bytes_per_s) if est.changed or not settled else \
            (est.baseline_latency_s, est.baseline_bandwidth_bytes_per_s)
        if a in islands and b in islands and not (a in nodes and b in nodes):
            lat = _entry_spec(cluster, a, b).latency_s  # one hop of a route: its own latency stays
        overrides[(a, b)] = LinkSpec(latency_s=lat, bandwidth_bytes_per_s=bw)
    if not overrides:
        return cluster
    entries = [LinkEntry(a=a, b=b, directed=True, spec=spec) for (a, b), spec in overrides.items()]
    # with_links drops an undirected entry that one override names: keep its other direction
    for e in cluster.links:
        if not e.directed and (e.a, e.b) in overrides and (e.b, e.a) not in overrides:
            entries.append(LinkEntry(a=e.b, b=e.a, directed=True, spec=e.spec))
    return cluster.with_links(entries)


def _entry_spec(cluster: Cluster, a: str, b: str) -> LinkSpec:
    for e in cluster.links:
        if (e.a, e.b) == (a, b) or (not e.directed and (e.b, e.a) == (a, b)):
            return e.spec
    raise ValueError(f"no [[links]] entry between {a!r} and {b!r} in cluster {cluster.name!r}")


# ---------------------------------------------------------------------------------------
# production wiring (imported on use: the planner and the simulator are not needed to decide)
# ---------------------------------------------------------------------------------------


def cost_model_scorer(model: ModelProfile) -> Scorer:
    """The planner's analytic cost model as a scorer (``inf`` for plans that do not fit in memory)."""
    from deepcee.planner.cost_model import AnalyticCostModel

    cm = AnalyticCostModel()

    def score(plan: Plan, cluster: Cluster) -> float:
        cost = cm.breakdown(plan, cluster, model)
        return cost.iteration_s if cost.fits else float("inf")

    return score


def simulator_scorer(model: ModelProfile) -> Scorer:
    """One simulated iteration as a scorer (``inf`` for plans that do not fit in memory)."""
    from deepcee.simulator.engine import simulate

    def score(plan: Plan, cluster: Cluster) -> float:
        result = simulate(plan, cluster, model, record=False)
        if any(b > cluster.memory_bytes(d) for d, b in result.peak_memory_bytes.items()):
            return float("inf")
        return result.iteration_s

    return score


def search_planner(model: ModelProfile, global_batch: int, options: object | None = None) -> Planner:
    """:func:`deepcee.planner.search.plan_training` as a :data:`Planner`."""
    from deepcee.planner.search import plan_training

    def plan(cluster: Cluster) -> Plan:
        return plan_training(cluster, model, global_batch, options=options).plan

    return plan
