"""The adapter loop in the simulator: a plan trained through a bandwidth trace, with and
without adaptation, against the optimum for the new conditions (torch-free).

:func:`simulate_adaptive` steps the simulator one iteration at a time on one clock
(``start_s`` carries over, so the trace keeps advancing), feeds the
:class:`~deepcee.adapter.monitor.LinkMonitor` with the transfers the simulator recorded (as
the runtime would see them: bytes, send issue to delivery, so queueing is included and the
monitor's busy-period merging has to undo it), and with ``adapt`` asks the
:class:`~deepcee.adapter.policy.AdapterPolicy` at every iteration boundary. The policy sees
only the nominal cluster corrected by the monitor's estimates, never the trace.

A decision takes effect from the next iteration. A re-plan first moves parameters and
optimizer state (:func:`deepcee.adapter.policy.state_movement`, timed on the *true* links at
that moment); that time is added to the first iteration of the new plan and advances the
clock. A re-tune moves no state and is charged nothing here: the simulator has no model of
the runtime's rebuild time (the policy still budgets ``retune_cost_iterations`` for it).

The **optimum** is the planner's plan for the conditions at ``optimum_at_s`` (default: the
end of the run), i.e. the cluster with every traced link frozen at its value then, simulated
on that frozen cluster.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcee.adapter.monitor import (
    LinkMonitor,
    MonitorConfig,
    TransferObservation,
    priors_from_cluster,
)
from deepcee.adapter.policy import (
    AdapterPolicy,
    AdapterState,
    Decision,
    DecisionKind,
    Planner,
    PolicyConfig,
    Scorer,
    cluster_with_estimates,
    simulator_scorer,
    state_movement,
)
from deepcee.cluster import BandwidthTrace, Cluster
from deepcee.plan import Plan
from deepcee.profile import ModelProfile
from deepcee.traces import snapshot, with_trace

log = logging.getLogger(__name__)

SimulateFn = Callable[..., Any]
"""``simulate(plan, cluster, model, *, start_s, iterations) -> SimResult`` (the engine's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IterationRecord:
    """One simulated iteration."""

    index: int
    start_s: float
    iteration_s: float
    """Wall time of the iteration, including ``change_cost_s``."""
    change_cost_s: float
    """State movement of a re-plan that took effect at this iteration's start."""
    samples_per_s: float
    """``global_batch / iteration_s``."""
    plan_index: int
    """The plan in force (index into :attr:`AdaptiveRun.plans`)."""
    decision: str
    """What the policy decided at the end of this iteration (``keep`` without adaptation)."""
    reason: str = ""
    bandwidth_bytes_per_s: Mapping[str, float] = field(default_factory=dict)
    """The monitor's bandwidth estimate of each link resource after this iteration."""
    changed_links: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimumPoint:
    """The planner's plan for the conditions at ``at_s``, simulated on them."""

    at_s: float
    plan: Plan
    iteration_s: float
    samples_per_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveRun:
    adapt: bool
    trace: str
    iterations: tuple[IterationRecord, ...]
    plans: tuple[Plan, ...]
    """Every plan that was in force, in order; ``plans[0]`` is the starting plan."""
    decisions: tuple[Decision, ...]
    """Every decision that changed the plan."""
    optimum: OptimumPoint | None = None

    @property
    def total_s(self) -> float:
        return sum(r.iteration_s for r in self.iterations)

    @property
    def samples_per_s(self) -> float:
        """Mean over the run (total samples / total time)."""
        total = self.total_s
        return self.plans[0].global_batch * len(self.iterations) / total if total > 0 else float("inf")

    def iteration_at(self, t_s: float) -> int:
        """Index of the iteration running at time ``t_s`` (the last one if past the end)."""
        for r in self.iterations:
            if r.start_s <= t_s < r.start_s + r.iteration_s:
                return r.index
        return self.iterations[-1].index

    def recovery_iterations(self, change_s: float, fraction: float = 0.9) -> int | None:
        """Iterations from the one during which the network changed at ``change_s`` to the
        first later one reaching ``fraction`` of the optimum's samples/s (``None``: never)."""
        if self.optimum is None:
            raise ValueError("this run has no optimum to recover to")
        start = self.iteration_at(change_s)
        for r in self.iterations[start + 1:]:
            if r.samples_per_s >= fraction * self.optimum.samples_per_s:
                return r.index - start
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapt": self.adapt, "trace": self.trace,
            "mean_samples_per_s": self.samples_per_s, "total_s": self.total_s,
            "iterations": [{"index": r.index, "start_s": r.start_s, "iteration_s": r.iteration_s,
                            "change_cost_s": r.change_cost_s, "samples_per_s": r.samples_per_s,
                            "plan": r.plan_index, "decision": r.decision, "reason": r.reason,
                            "changed_links": list(r.changed_links),
                            "bandwidth_bytes_per_s": dict(r.bandwidth_bytes_per_s)} for r in self.iterations],
            "plans": [p.to_dict() for p in self.plans],
            "optimum": None if self.optimum is None else {
                "at_s": self.optimum.at_s, "iteration_s": self.optimum.iteration_s,
                "samples_per_s": self.optimum.samples_per_s, "plan": self.optimum.plan.to_dict()},
        }


def default_planner(model: ModelProfile, global_batch: int) -> Planner | None:
    """The project's planner (:func:`deepcee.planner.search.plan_training`), if installed."""
    try:
        from deepcee.adapter.policy import search_planner

        return search_planner(model, global_batch)
    except ImportError:
        log.warning("deepcee.planner.search is not available: no re-plans, no optimum")
        return None


def simulate_adaptive(plan: Plan, cluster: Cluster, model: ModelProfile, trace: BandwidthTrace | None, *,
                      iterations: int, adapt: bool, planner: Planner | None | str = "default",
                      scorer: Scorer | None = None, between: Iterable[tuple[str, str]] | None = None,
                      relative: bool = True, time_scale: float = 1.0, optimum_at_s: float | None = None,
                      monitor_config: MonitorConfig | None = None, policy_config: PolicyConfig | None = None,
                      simulate_fn: SimulateFn | None = None, with_optimum: bool = True) -> AdaptiveRun:
    """Train ``plan`` for ``iterations`` iterations in the simulator while ``trace`` plays on the
    slow links (see :func:`deepcee.traces.with_trace` for ``between``, ``relative`` and
    ``time_scale``; ``trace=None`` uses the traces already on ``cluster``). See the module
    docstring. ``planner="default"`` uses :func:`default_planner`; ``None`` disables re-plans
    and the optimum (as does ``with_optimum=False``). ``scorer`` defaults to one simulated
    iteration."""
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    if simulate_fn is None:
        from deepcee.simulator.engine import simulate as simulate_fn
    if planner == "default":
        planner = default_planner(model, plan.global_batch)
    traced = cluster if trace is None else with_trace(cluster, trace, between=between, relative=relative,
                                                      time_scale=time_scale)
    nominal = snapshot(traced, 0.0)
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731 - the simulated clock
    monitor = LinkMonitor(priors=priors_from_cluster(nominal, plan), config=monitor_config, clock=clock)
    policy = AdapterPolicy(scorer=scorer or simulator_scorer(model), model=model, planner=planner,
                           config=policy_config, clock=clock)
    plans, records, changes = [plan], [], []
    pending_cost = 0.0
    for i in range(iterations):
        current = plans[-1]
        start = now[0]
        result = simulate_fn(current, traced, model, start_s=start + pending_cost, iterations=1)
        it_s = result.iteration_s + pending_cost
        monitor.observe_batch(_observations(result.events))
        now[0] = start + it_s
        decision = None
        if adapt:
            decision = policy.decide(AdapterState(
                plan=current, cluster=cluster_with_estimates(nominal, monitor.estimates().values()),
                iterations_left=iterations - i - 1, changed_links=monitor.changed()))
        estimates = monitor.estimates()
        records.append(IterationRecord(
            index=i, start_s=start, iteration_s=it_s, change_cost_s=pending_cost,
            samples_per_s=current.global_batch / it_s if it_s > 0 else float("inf"),
            plan_index=len(plans) - 1, decision=(decision.kind.value if decision else DecisionKind.KEEP.value),
            reason=decision.reason if decision else "",
            bandwidth_bytes_per_s={r: e.bandwidth_bytes_per_s for r, e in estimates.items()},
            changed_links=tuple(r for r, e in estimates.items() if e.changed)))
        pending_cost = 0.0
        if decision is None:
            continue
        if decision.acknowledge:
            monitor.accept()
        if decision.changes_plan:
            changes.append(decision)
            if decision.kind == DecisionKind.REPLAN:
                pending_cost = state_movement(current, decision.plan, snapshot(traced, now[0]), model)[1]
            plans.append(decision.plan)
            for resource, spec in priors_from_cluster(cluster_with_estimates(nominal, estimates.values()),
                                                      decision.plan).items():
                if monitor.estimate(resource) is None:
                    monitor.set_prior(resource, spec)
    optimum = None
    if planner is not None and with_optimum:
        optimum = optimum_for(planner, traced, model, now[0] if optimum_at_s is None else optimum_at_s,
                              simulate_fn=simulate_fn)
    return AdaptiveRun(adapt=adapt, trace=trace.name if trace is not None else "", iterations=tuple(records),
                       plans=tuple(plans), decisions=tuple(changes), optimum=optimum)


def _observations(events: Iterable[Any]) -> list[TransferObservation]:
    """The simulator's transfers as the runtime would time them (send issue to delivery)."""
    return [TransferObservation(resource=e.where, nbytes=e.nbytes, seconds=e.end_s - e.issued_s,
                                start_s=e.issued_s)
            for e in events if e.kind == "transfer"]


def optimum_for(planner: Planner, traced: Cluster, model: ModelProfile, at_s: float, *,
                simulate_fn: SimulateFn | None = None) -> OptimumPoint:
    """The planner's plan for the links as they are at ``at_s``, simulated on them."""
    if simulate_fn is None:
        from deepcee.simulator.engine import simulate as simulate_fn
    frozen = snapshot(traced, at_s)
    best = planner(frozen)
    result = simulate_fn(best, frozen, model, start_s=0.0, iterations=1)
    return OptimumPoint(at_s=at_s, plan=best, iteration_s=result.iteration_s, samples_per_s=result.samples_per_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptationComparison:
    """The same plan and trace without and with adaptation, and the optimum."""

    static: AdaptiveRun
    adaptive: AdaptiveRun

    def to_dict(self) -> dict[str, Any]:
        return {"static": self.static.to_dict(), "adaptive": self.adaptive.to_dict()}


def compare_adaptation(plan: Plan, cluster: Cluster, model: ModelProfile, trace: BandwidthTrace | None, *,
                       iterations: int, **kwargs: Any) -> AdaptationComparison:
    """:func:`simulate_adaptive` with ``adapt=False`` and ``adapt=True`` (same arguments). The
    optimum is computed once, for the conditions at the end of the adaptive run (or at
    ``optimum_at_s``), and attached to both runs."""
    adaptive = simulate_adaptive(plan, cluster, model, trace, iterations=iterations, adapt=True, **kwargs)
    static = simulate_adaptive(plan, cluster, model, trace, iterations=iterations, adapt=False,
                               **{**kwargs, "with_optimum": False})
    return AdaptationComparison(static=dataclasses.replace(static, optimum=adaptive.optimum), adaptive=adaptive)


def plot_adaptation(runs: Sequence[AdaptiveRun], path: str | Path, *, title: str = "") -> Path:
    """PNG of samples/s per iteration for each run, the optimum as a dashed line, and a marker
    at each plan change. Uses matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    try:
        for run in runs:
            xs = [r.index for r in run.iterations]
            label = "with adaptation" if run.adapt else "without adaptation"
            line, = ax.plot(xs, [r.samples_per_s for r in run.iterations], marker=".", lw=1.2, label=label)
            for r in run.iterations:
                if r.decision != DecisionKind.KEEP.value:
                    ax.axvline(r.index + 0.5, color=line.get_color(), ls=":", lw=1)
                    ax.text(r.index + 0.5, 0.98, r.decision, transform=ax.get_xaxis_transform(), fontsize=7,
                            rotation=90, va="top", ha="right", color=line.get_color())
        optimum = next((run.optimum for run in runs if run.optimum is not None), None)
        if optimum is not None:
            ax.axhline(optimum.samples_per_s, color="k", ls="--", lw=1,
                       label=f"optimum for conditions at t = {optimum.at_s:.4g} s")
        ax.set_xlabel("iteration")
        ax.set_ylabel("samples/s (simulated)")
        ax.set_ylim(bottom=0)
        ax.set_title(title or f"trace {runs[0].trace}" if runs else title)
        ax.legend(loc="lower left", fontsize=8)
        ax.grid(alpha=0.3)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return out
