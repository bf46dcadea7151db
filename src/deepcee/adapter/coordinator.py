"""The adapter's coordinator on rank 0: link monitor, policy, and the decision at each step boundary.

:class:`Coordinator` feeds its :class:`~deepcee.adapter.monitor.LinkMonitor` with the transfer
timings the ranks' step records carry, asks its policy on the planning cluster corrected by
the monitor's estimates (:func:`~deepcee.adapter.policy.cluster_with_estimates`; the policy
never sees the links' traces, only what the transfers showed) and turns the decision into the
:class:`~deepcee.adapter.messages.DecisionMessage` that rank 0 broadcasts (see [Note: adapter
step boundary] in :mod:`deepcee.adapter.hooks`).

Policies are built on rank 0 by a :class:`PolicyFactory` that travels with the job:
:class:`DefaultPolicy` (production: :class:`~deepcee.adapter.policy.AdapterPolicy` with the
simulator or cost-model scorer and the planner) or :class:`ScriptedPolicy` (given plans after
given steps; tests and experiments). No torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from deepcee.adapter.messages import DecisionMessage, DeviceTopology, decision_message
from deepcee.adapter.monitor import LinkMonitor, TransferObservation, priors_from_cluster
from deepcee.adapter.policy import (
    AdapterPolicy,
    AdapterState,
    Decision,
    DecisionKind,
    PolicyConfig,
    cluster_with_estimates,
    cost_model_scorer,
    same_stages,
    search_planner,
    simulator_scorer,
)
from deepcee.cluster import Cluster
from deepcee.errors import PlanError
from deepcee.plan import Plan
from deepcee.profile import ModelProfile
from deepcee.runtime.records import LinkEstimateRecord, RankMetrics

if TYPE_CHECKING:
    from deepcee.adapter.hooks import AdaptSpec
    from deepcee.planner.search import PlannerOptions

log = logging.getLogger(__name__)


class PolicyLike(Protocol):
    """What the coordinator asks of a policy (:class:`~deepcee.adapter.policy.AdapterPolicy`)."""

    def decide(self, state: AdapterState) -> Decision: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyContext:
    """What a policy factory gets on rank 0."""

    plan: Plan
    """The starting plan."""
    cluster: Cluster
    """The planning cluster (declared or measured; no traces)."""
    model: str
    steps: int
    clock: Callable[[], float]
    """Emulated seconds since the run's start."""


class PolicyFactory(Protocol):
    """Builds the policy on rank 0 (the factory is pickled to every rank; the policy is not)."""

    def build(self, ctx: PolicyContext) -> PolicyLike: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class DefaultPolicy:
    """:class:`~deepcee.adapter.policy.AdapterPolicy` with the project's scorer and planner."""

    profile: ModelProfile | None = None
    """The model's profile for the scorer and planner (a measured one); ``None``: the model's
    analytic profile."""
    scorer: Literal["simulator", "cost-model"] = "simulator"
    replan: bool = True
    """Offer the planner's plan for the new conditions (else re-tunes only)."""
    planner_options: PlannerOptions | None = None
    """:class:`deepcee.planner.search.PlannerOptions` for re-plans (default options)."""
    config: PolicyConfig = field(default_factory=PolicyConfig)

    def build(self, ctx: PolicyContext) -> PolicyLike:
        if self.profile is not None:
            model = self.profile
        else:
            from deepcee.models import get_model

            model = get_model(ctx.model)
        scorer = simulator_scorer(model) if self.scorer == "simulator" else cost_model_scorer(model)
        planner = search_planner(model, ctx.plan.global_batch, self.planner_options) if self.replan else None
        return AdapterPolicy(scorer=scorer, model=model, planner=planner, config=self.config, clock=ctx.clock)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScriptedPolicy:
    """Changes to given plans after given steps, whatever the links do (tests, experiments).

    ``changes``: ``(step, plan)`` pairs: after ``step`` the plan becomes ``plan``.
    """

    changes: tuple[tuple[int, Plan], ...]

    def build(self, ctx: PolicyContext) -> PolicyLike:
        return _Scripted(dict(self.changes), ctx.steps, ctx.clock)


class _Scripted:
    def __init__(self, plans: Mapping[int, Plan], steps: int, clock: Callable[[], float]) -> None:
        self.plans, self.steps, self.clock = plans, steps, clock

    def decide(self, state: AdapterState) -> Decision:
        step = self.steps - 1 - state.iterations_left
        plan = self.plans.get(step)
        if plan is None:
            return Decision(kind=DecisionKind.KEEP, plan=state.plan, reason="scripted: keep", at_s=self.clock())
        kind = DecisionKind.RETUNE if same_stages(plan, state.plan) else DecisionKind.REPLAN
        return Decision(kind=kind, plan=plan, reason=f"scripted {kind} after step {step}", at_s=self.clock(),
                        acknowledge=True)



class Coordinator:
    """Rank 0's monitor and policy. See [Note: adapter step boundary]."""

    def __init__(self, spec: AdaptSpec, plan: Plan, cluster: Cluster, ctx: PolicyContext, layer_bytes: Sequence[float]):
        self.spec, self.nominal, self.layer_bytes = spec, cluster, layer_bytes
        self.monitor = LinkMonitor(priors=priors_from_cluster(cluster, plan), config=spec.monitor, clock=ctx.clock)
        self.policy = spec.policy.build(ctx) if spec.adapt else None
        self.steps = ctx.steps

    def warm_up(self, plan: Plan) -> None:
        """Score the starting plan once, so the first real decision pays no imports."""
        if plan.num_replicas > 1:
            return  # never asked (see decide)
        scorer = getattr(self.policy, "scorer", None)
        if scorer is not None:
            scorer(plan, self.nominal)
        if getattr(self.policy, "planner", None) is not None:
            import deepcee.planner.search  # noqa: F401  (imported by the first re-plan otherwise)

    def observe(self, gathered: Sequence[RankMetrics | None]) -> None:
        """Feed the monitor with one step's received pieces (emulated seconds)."""
        self.monitor.observe_batch([TransferObservation(resource=res, nbytes=n, seconds=t1 - t0, start_s=t0)
                                    for r in gathered if r is not None for res, n, t0, t1 in r.transfers])

    def decide(self, step: int, plan: Plan) -> DecisionMessage:
        if self.policy is None:
            return DecisionMessage(kind=DecisionKind.KEEP, start_step=step + 1, reason="adapter off")
        if plan.num_replicas > 1:  # an elastic run's plan: the policy models one pipeline
            return DecisionMessage(kind=DecisionKind.KEEP, start_step=step + 1,
                                   reason="several replicas: the policy is not asked")
        estimated = cluster_with_estimates(self.nominal, self.monitor.estimates().values())
        decision = self.policy.decide(AdapterState(plan=plan, cluster=estimated,
                                                   iterations_left=self.steps - step - 1,
                                                   changed_links=self.monitor.changed()))
        if decision.acknowledge:
            self.monitor.accept()
        try:
            msg = decision_message(decision, plan, step + 1, estimated, self.layer_bytes)
            if msg.changes_plan:
                DeviceTopology(msg.plan, self.spec.devices)  # every device it uses has a rank
        except PlanError as exc:  # rejected here, on rank 0, so no rank ever tries it
            log.warning("adapter: %s rejected: %s", decision.kind, exc)
            return DecisionMessage(kind=DecisionKind.KEEP, start_step=step + 1,
                                   reason=f"{decision.kind} rejected: {exc}")
        if msg.changes_plan:
            for resource, spec in priors_from_cluster(estimated, msg.plan).items():
                if self.monitor.estimate(resource) is None:
                    self.monitor.set_prior(resource, spec)
        return msg

    def link_estimates(self) -> dict[str, LinkEstimateRecord]:
        """The monitor's estimate of every link resource it has seen, as recorded per step."""
        return {r: LinkEstimateRecord(latency_s=e.latency_s, bandwidth_bytes_per_s=e.bandwidth_bytes_per_s,
                                      changed=e.changed, n=e.n_observations)
                for r, e in self.monitor.estimates().items()}
