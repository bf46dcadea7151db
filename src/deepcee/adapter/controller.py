"""Adapter controller: applies keep / re-tune / re-plan decisions to a running training job (torch).

Every rank runs an :class:`AdaptiveTrainer` (a :class:`deepcee.runtime.trainer.Trainer` whose
plan can change between steps). Ranks are tied to devices for the whole run
(:class:`DeviceTopology`: rank ``r`` is always device ``devices[r]``, whichever plan is in
force), so a plan may leave devices idle and bring them back.

[Note: adapter step boundary]
At the end of every step but the last, on every rank of the world:

1. the step's per-rank metrics, including every received piece's timing
   (:attr:`deepcee.runtime.p2p.LinkStats.transfers`: link resource, bytes, send start,
   delivery, in emulated seconds), are gathered on rank 0 (over the world: idle ranks send
   nothing but still take part);
2. rank 0 (the coordinator) feeds them to its :class:`~deepcee.adapter.monitor.LinkMonitor`
   and, when adapting, asks its policy (:class:`~deepcee.adapter.policy.AdapterPolicy` in
   production) on the planning cluster corrected by the monitor's estimates
   (:func:`~deepcee.adapter.policy.cluster_with_estimates`); the policy never sees the links'
   traces, only what the transfers showed;
3. rank 0 broadcasts a :class:`DecisionMessage` (kind, the new plan, the step it starts at,
   the state moves) over the world; every rank checks the start step, so all agree on the
   new plan and when it starts.

Steps 1-3 are the *control* time, recorded per step (``control_s``) and excluded from step
times. Then, before the next step and counted in its time (``change_s``):

- **re-tune** (same stages on the same devices; other microbatch size, count or shares): the
  topology, schedule row and transport are rebuilt; no state moves, the stage module and
  its optimizer stay;
- **re-plan**: for every layer, each device of its new stage that did not hold it receives
  its parameters and optimizer state (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``; SGD
  ``momentum_buffer``) from one device of its old stage (every device of a stage holds a
  replica; :func:`state_moves` picks the one whose link frees first, as
  :func:`~deepcee.adapter.policy.state_movement` costs it); the moves run pairwise in the
  message's order (a global order: no deadlock) over the emulated links
  (:class:`~deepcee.runtime.emulation.LinkShaper`: bytes and latency, queueing on shared
  resources). Then every rank creates the new plan's stage groups (``new_group`` is
  collective over the world), and every active rank rebuilds its stage from the blocks it
  holds, agrees boundary shapes with its new peers, rebuilds its optimizer with the moved
  or kept state, and its transport. Parameters and optimizer state are exactly those a run
  without the change would have (tested against a single-process reference).

Entry point for one machine: :func:`run_adaptive_training` (the CLI's ``deepcee train
--adapt --link-trace drop-5x``).
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

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
    PolicyConfig,
    cluster_with_estimates,
    cost_model_scorer,
    same_stages,
    search_planner,
    simulator_scorer,
)
from deepcee.cluster import BandwidthTrace, Cluster, cluster_from_dict
from deepcee.errors import PlanError, RuntimeSetupError, SpecError
from deepcee.plan import Plan, plan_from_dict
from deepcee.profile import ModelProfile
from deepcee.runtime.executor import schedule_for
from deepcee.runtime.launch import TrainResult, launch_jobs
from deepcee.runtime.partition import Placement, Topology
from deepcee.runtime.trainer import Job, TrainConfig, Trainer, Worker
from deepcee.traces import load_named_trace, snapshot, with_trace

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# ranks tied to devices
# ---------------------------------------------------------------------------------------


class DeviceTopology(Topology):
    """A :class:`Topology` whose ranks are fixed per device: rank ``r`` runs ``devices[r]``.

    Devices of ``devices`` that the plan leaves out are idle ranks (``is_active`` false).
    """

    def __init__(self, plan: Plan, devices: Sequence[str]) -> None:
        super().__init__(plan, len(devices))
        rank_of = {d: r for r, d in enumerate(devices)}
        missing = [d for d in plan.devices if d not in rank_of]
        if missing:
            raise PlanError(f"plan uses device(s) {missing} that no rank runs (ranks run {list(devices)})")
        self.devices = tuple(devices)
        placements = [self._plan_placement(plan, s, k, rank_of) for s, st in enumerate(plan.stages)
                      for k in range(len(st.devices))]
        self._fixed = {p.rank: p for p in placements}
        self._fixed_stage = {s: tuple(rank_of[d] for d in st.devices) for s, st in enumerate(plan.stages)}

    @staticmethod
    def _plan_placement(plan: Plan, s: int, k: int, rank_of: Mapping[str, int]) -> Placement:
        st = plan.stages[s]
        lo = sum(st.shares[:k])
        return Placement(rank=rank_of[st.devices[k]], stage=s, index=k, device=st.devices[k], lo=lo,
                         hi=lo + st.shares[k])

    @property
    def num_active(self) -> int:
        return len(self._fixed)

    @property
    def active_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._fixed))

    def is_active(self, rank: int) -> bool:
        return rank in self._fixed

    def placement(self, rank: int) -> Placement:
        if rank not in self._fixed:
            raise PlanError(f"rank {rank} (device {self.devices[rank]!r}) runs no stage of this plan")
        return self._fixed[rank]

    def rank_of(self, stage: int, index: int) -> int:
        return self._fixed_stage[stage][index]

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return self._fixed_stage[stage]

    def rank_of_device(self, device: str) -> int:
        return self.devices.index(device)


# ---------------------------------------------------------------------------------------
# decisions and state moves (pure)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Move:
    """Layer ``layer``'s parameters and optimizer state go from device ``src`` to ``dst``."""

    layer: int
    src: str
    dst: str

    def __post_init__(self) -> None:
        if self.layer < 0 or self.src == self.dst:
            raise ValueError(f"bad move: layer {self.layer} from {self.src!r} to {self.dst!r}")


def state_moves(old: Plan, new: Plan, cluster: Cluster, layer_bytes: Sequence[float]) -> tuple[Move, ...]:
    """The moves that give every device of ``new`` the state of its layers.

    Per layer of ``new`` (stage order, layer order), each device of its stage that did not
    hold it under ``old`` receives it from one device that did, the one whose link would
    finish it first given what is already booked on each link resource (the rule of
    :func:`deepcee.adapter.policy.state_movement`). ``layer_bytes[i]``: bytes of layer ``i``'s
    state (parameters and optimizer state).
    """
    if old.num_layers != new.num_layers or len(layer_bytes) != new.num_layers:
        raise PlanError(f"plans of {old.num_layers} and {new.num_layers} layers, {len(layer_bytes)} layer sizes")
    holders = {layer: st.devices for st in old.stages for layer in range(st.layer_start, st.layer_stop)}
    load: dict[str, float] = {}
    out = []
    for st in new.stages:
        for layer in range(st.layer_start, st.layer_stop):
            nbytes = float(layer_bytes[layer])
            for d in st.devices:
                if d in holders[layer]:
                    continue
                src = min(holders[layer], key=lambda h: _finish_s(cluster, h, d, nbytes, load))
                link = cluster.link(src, d)
                load[link.resource] = load.get(link.resource, 0.0) + nbytes
                out.append(Move(layer=layer, src=src, dst=d))
    return tuple(out)


def _finish_s(cluster: Cluster, src: str, dst: str, nbytes: float, load: Mapping[str, float]) -> float:
    link = cluster.link(src, dst)
    return link.latency_s + (load.get(link.resource, 0.0) + nbytes) / link.bandwidth_bytes_per_s


def transfers_of(moves: Iterable[Move]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Moves grouped into one message per ``(src, dst)`` pair, in order of first appearance."""
    pairs: dict[tuple[str, str], list[int]] = {}
    for m in moves:
        pairs.setdefault((m.src, m.dst), []).append(m.layer)
    return [(src, dst, tuple(layers)) for (src, dst), layers in pairs.items()]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecisionMessage:
    """What rank 0 broadcasts at a step boundary. See [Note: adapter step boundary]."""

    kind: DecisionKind
    start_step: int
    """The first step run under ``plan``."""
    plan: Plan | None = None
    """The plan from ``start_step`` on (``None`` for keep)."""
    moves: tuple[Move, ...] = ()
    reason: str = ""
    predicted_current_s: float | None = None
    predicted_new_s: float | None = None
    predicted_change_s: float = 0.0
    moved_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {self.start_step}")
        if (self.kind == DecisionKind.KEEP) != (self.plan is None):
            raise ValueError(f"a {self.kind} decision {'has' if self.plan is not None else 'needs'} a plan")
        if self.kind == DecisionKind.RETUNE and self.moves:
            raise ValueError("a re-tune moves no state")

    @property
    def changes_plan(self) -> bool:
        return self.kind != DecisionKind.KEEP

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "start_step": self.start_step,
                "plan": None if self.plan is None else self.plan.to_dict(),
                "moves": [[m.layer, m.src, m.dst] for m in self.moves], "reason": self.reason,
                "predicted_current_s": self.predicted_current_s, "predicted_new_s": self.predicted_new_s,
                "predicted_change_s": self.predicted_change_s, "moved_bytes": self.moved_bytes}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> DecisionMessage:
        return DecisionMessage(
            kind=DecisionKind(d["kind"]), start_step=int(d["start_step"]),
            plan=None if d["plan"] is None else plan_from_dict(dict(d["plan"]), file="<decision>"),
            moves=tuple(Move(layer=int(a), src=b, dst=c) for a, b, c in d["moves"]), reason=d["reason"],
            predicted_current_s=d["predicted_current_s"], predicted_new_s=d["predicted_new_s"],
            predicted_change_s=float(d["predicted_change_s"]), moved_bytes=float(d["moved_bytes"]))


def decision_message(decision: Decision, current: Plan, start_step: int, cluster: Cluster,
                     layer_bytes: Sequence[float]) -> DecisionMessage:
    """The message for a policy's ``decision`` (kind recomputed from the plans; moves for a re-plan)."""
    if not decision.changes_plan:
        return DecisionMessage(kind=DecisionKind.KEEP, start_step=start_step, reason=decision.reason)
    new = decision.plan
    if new.global_batch != current.global_batch or new.num_layers != current.num_layers:
        raise PlanError(f"a new plan must keep the global batch ({current.global_batch}) and layers "
                        f"({current.num_layers}); got {new.global_batch} and {new.num_layers}")
    kind = DecisionKind.RETUNE if same_stages(current, new) else DecisionKind.REPLAN
    moves = state_moves(current, new, cluster, layer_bytes) if kind == DecisionKind.REPLAN else ()
    return DecisionMessage(kind=kind, start_step=start_step, plan=new, moves=moves, reason=decision.reason,
                           predicted_current_s=decision.current_iteration_s,
                           predicted_new_s=decision.new_iteration_s, predicted_change_s=decision.change_cost_s,
                           moved_bytes=float(sum(layer_bytes[m.layer] for m in moves)))


# ---------------------------------------------------------------------------------------
# policies (built on rank 0)
# ---------------------------------------------------------------------------------------


class PolicyLike(Protocol):
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
    def build(self, ctx: PolicyContext) -> PolicyLike: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class DefaultPolicy:
    """:class:`~deepcee.adapter.policy.AdapterPolicy` with the project's scorer and planner."""

    profile: Mapping[str, Any] | None = None
    """``deepcee.profile`` dict (a measured profile); ``None``: the model's analytic profile."""
    scorer: Literal["simulator", "cost-model"] = "simulator"
    replan: bool = True
    """Offer the planner's plan for the new conditions (else re-tunes only)."""
    planner_options: Any = None
    """:class:`deepcee.planner.search.PlannerOptions` for re-plans (default options)."""
    config: PolicyConfig = field(default_factory=PolicyConfig)

    def build(self, ctx: PolicyContext) -> PolicyLike:
        from deepcee.profile import profile_from_dict

        if self.profile is not None:
            model = profile_from_dict(dict(self.profile))
        else:
            from deepcee.models import get_model

            model = get_model(ctx.model)
        scorer = simulator_scorer(model) if self.scorer == "simulator" else cost_model_scorer(model)
        planner = search_planner(model, ctx.plan.global_batch, self.planner_options) if self.replan else None
        return AdapterPolicy(scorer=scorer, model=model, planner=planner, config=self.config, clock=ctx.clock)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScriptedPolicy:
    """Changes to given plans after given steps, whatever the links do (tests, experiments).

    ``changes``: ``(step, plan dict)`` pairs: after ``step`` the plan becomes ``plan``.
    """

    changes: tuple[tuple[int, Mapping[str, Any]], ...]

    def build(self, ctx: PolicyContext) -> PolicyLike:
        return _Scripted({k: plan_from_dict(dict(p)) for k, p in self.changes}, ctx.steps, ctx.clock)


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


# ---------------------------------------------------------------------------------------
# the job's adapter and the coordinator (rank 0)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptSpec:
    """:attr:`deepcee.runtime.trainer.Job.adapter` of an adaptive job (pickled to every rank)."""

    devices: tuple[str, ...]
    """Rank ``r`` runs ``devices[r]`` for the whole run; every plan must use only these."""
    adapt: bool = True
    """``False``: same machinery and monitor, but the plan is always kept (the baseline)."""
    policy: PolicyFactory = field(default_factory=DefaultPolicy)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    planning_cluster: Mapping[str, Any] | None = None
    """What the policy plans on (cluster dict, no traces); ``None``: the job's cluster frozen at
    time 0, restricted to ``devices``."""

    def __post_init__(self) -> None:
        if not self.devices or len(set(self.devices)) != len(self.devices):
            raise SpecError(f"devices must be distinct and non-empty, got {list(self.devices)}", field="devices")

    def trainer(self, job: Job, worker: Worker) -> AdaptiveTrainer:
        return AdaptiveTrainer(job, worker, self)

    def ranks(self, job: Job) -> int:
        return len(self.devices)


class _Coordinator:
    """Rank 0's monitor and policy. See [Note: adapter step boundary]."""

    def __init__(self, spec: AdaptSpec, plan: Plan, cluster: Cluster, ctx: PolicyContext, layer_bytes: Sequence[float]):
        self.spec, self.nominal, self.layer_bytes = spec, cluster, layer_bytes
        self.monitor = LinkMonitor(priors=priors_from_cluster(cluster, plan), config=spec.monitor, clock=ctx.clock)
        self.policy = spec.policy.build(ctx) if spec.adapt else None
        self.steps = ctx.steps

    def warm_up(self, plan: Plan) -> None:
        """Score the starting plan once, so the first real decision pays no imports."""
        scorer = getattr(self.policy, "scorer", None)
        if scorer is not None:
            scorer(plan, self.nominal)
        if getattr(self.policy, "planner", None) is not None:
            import deepcee.planner.search  # noqa: F401  (imported by the first re-plan otherwise)

    def observe(self, gathered: Sequence[dict[str, Any] | None]) -> None:
        """Feed the monitor with one step's received pieces (emulated seconds)."""
        self.monitor.observe_batch([TransferObservation(resource=res, nbytes=n, seconds=t1 - t0, start_s=t0)
                                    for r in gathered if r is not None for res, n, t0, t1 in r["transfers"]])

    def decide(self, step: int, plan: Plan) -> DecisionMessage:
        if self.policy is None:
            return DecisionMessage(kind=DecisionKind.KEEP, start_step=step + 1, reason="adapter off")
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

    def estimates_record(self) -> dict[str, Any]:
        est = self.monitor.estimates()
        return {"link_estimates": {r: {"latency_s": e.latency_s, "bandwidth_bytes_per_s": e.bandwidth_bytes_per_s,
                                       "changed": e.changed, "n": e.n_observations} for r, e in est.items()},
                "changed_links": [r for r, e in est.items() if e.changed]}


# ---------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------


def layer_state_bytes(blocks: Sequence[nn.Module], optimizer: str, momentum: float = 0.0) -> list[float]:
    """Bytes of each layer's parameters and optimizer state (AdamW: 2 moments; SGD: momentum)."""
    states = 2 if optimizer == "adamw" else (1 if momentum else 0)
    return [float(sum(p.numel() * p.element_size() for p in b.parameters()) * (1 + states)) for b in blocks]


class AdaptiveTrainer(Trainer):
    """A trainer whose plan changes at step boundaries. See the module docstring."""

    def __init__(self, job: Job, w: Worker, spec: AdaptSpec) -> None:
        if w.world_size != len(spec.devices):
            raise RuntimeSetupError(f"an adaptive job needs one rank per device of {list(spec.devices)}, "
                                    f"the world has {w.world_size}")
        if job.config.checkpoint_every or job.config.resume:
            raise SpecError("checkpoints are not supported with the adapter (the plan changes)", field="checkpoint")
        self.spec = spec
        self.version = 0
        self.plans: list[Plan] = []
        self.changes: list[dict[str, Any]] = []
        self._pending: DecisionMessage | None = None
        self._rank_change: dict[str, float] = {}
        self._coordinator: _Coordinator | None = None
        super().__init__(job, w)
        self.plans.append(self.plan)

    # -- hooks of Trainer ----------------------------------------------------------------
    def _topology(self, plan: Plan) -> Topology:
        return DeviceTopology(plan, self.spec.devices)

    def _make_job_group(self) -> Any:
        return None  # the world: idle ranks take part in every gather and broadcast

    @property
    def takes_part(self) -> bool:
        return True

    def _device_name(self) -> str:
        return self.spec.devices[self.w.rank]

    def _emulated_devices(self) -> Sequence[str]:
        return self.spec.devices  # fixed for the run, whatever the plans use

    def _prepare(self) -> None:
        self._warm_up()
        if self.w.rank == 0:
            planning = (cluster_from_dict(dict(self.spec.planning_cluster)) if self.spec.planning_cluster is not None
                        else snapshot(self.cluster, 0.0).subset(self.spec.devices))
            model = self.job.model if isinstance(self.job.model, str) else "user"
            ctx = PolicyContext(plan=self.plan, cluster=planning, model=model, steps=self.cfg.steps,
                                clock=self.emulated_s)
            opt = self.cfg.optimizer
            self._coordinator = _Coordinator(self.spec, self.plan, planning, ctx,
                                             layer_state_bytes(self.blocks, opt.name, opt.momentum))
            self._coordinator.warm_up(self.plan)

    def _warm_up(self) -> None:
        """Pay one-off costs now, not in the first step a rank runs after a change (a standby
        device is kept ready): the first optimizer built in a process imports ``torch._dynamo``
        (measured: about 4 s), and the first forward and backward through a block costs its
        process about 2x a later one. Runs every block once on two samples and leaves
        parameters, gradients and buffers as they were."""
        dummy = nn.Parameter(torch.zeros(1, device=self.w.device))
        opt = self.cfg.optimizer.build([dummy])
        dummy.grad = torch.zeros_like(dummy)
        opt.step()
        if self.loss_fn is None:
            return
        buffers = [(b, b.detach().clone()) for block in self.blocks for b in block.buffers()]
        batch = self.dataset.batch(0, 2)
        x = batch.inputs.to(self.w.device)
        dtype = getattr(torch, self.cfg.dtype)
        x = x.to(dtype) if x.is_floating_point() else x
        for block in self.blocks:
            x = block(x)
        targets = batch.targets.to(self.w.device)
        self.loss_fn(x, targets.to(dtype) if targets.is_floating_point() else targets).backward()
        with torch.no_grad():
            for block in self.blocks:
                for p in block.parameters():
                    p.grad = None
            for b, saved in buffers:
                b.copy_(saved)

    def _decide(self, step: int, gathered: list[Any] | None) -> dict[str, Any]:
        t0 = self.clock.wall()
        out: dict[str, Any] = {"plan_version": self.version, "end_s": self.emulated_s(t0)}
        if self._coordinator is not None:
            self._coordinator.observe(gathered)
            out.update(self._coordinator.estimates_record())
            changed = {r["device"]: {"change_s": r["change_s"], "move_s": r["move_s"]}
                       for r in gathered if r is not None and "change_s" in r}
            if changed:  # every active rank's part of the change before this step
                out["change_by_device"] = changed
        if step == self.cfg.steps - 1:
            return out
        box: list[Any] = [None]
        if self._coordinator is not None:
            box[0] = self._coordinator.decide(step, self.plan).to_dict()
        dist.broadcast_object_list(box, src=0)
        msg = DecisionMessage.from_dict(box[0])
        if msg.start_step != step + 1:
            raise RuntimeSetupError(f"rank {self.w.rank}: decision for step {msg.start_step} arrived after step {step}")
        self._pending = msg if msg.changes_plan else None
        out.update(decision=msg.kind.value, reason=msg.reason, control_s=(self.clock.wall() - t0) / self.dilation)
        return out

    def _apply(self) -> dict[str, Any]:
        msg, self._pending = self._pending, None
        if msg is None:
            return {}
        t0 = self.clock.wall()
        received = self._move_state(msg.moves)
        t_moved = self.clock.wall()
        kept_state = self.optimizer.state if self.active else {}
        old_plan, was_active = self.plan, self.active
        self._set_plan(msg.plan)  # every rank: the new stage groups
        self.version += 1
        self.plans.append(msg.plan)
        if self.active:
            if msg.kind == DecisionKind.RETUNE and was_active:
                self._retune()
            else:
                self._rebuild(received, kept_state)
        else:
            self.stage = self.optimizer = self.p2p = None
        change_s = (self.clock.wall() - t0) / self.dilation
        self._rank_change = {"change_s": change_s, "move_s": (t_moved - t0) / self.dilation}
        self.changes.append({"start_step": msg.start_step, "kind": msg.kind.value, "reason": msg.reason,
                             "change_s": change_s, "moved_bytes": msg.moved_bytes,
                             "moves": [[m.layer, m.src, m.dst] for m in msg.moves],
                             "predicted_current_s": msg.predicted_current_s, "predicted_new_s": msg.predicted_new_s,
                             "predicted_change_s": msg.predicted_change_s})
        log.info("rank %d: %s from step %d (%s -> %s stages) in %.3g s", self.w.rank, msg.kind, msg.start_step,
                 old_plan.num_stages, msg.plan.num_stages, change_s)
        return {"change": msg.kind.value, "change_s": change_s, "moved_bytes": msg.moved_bytes}

    def _rank_record(self, rec: Any, sync_s: float) -> dict[str, Any]:
        out = super()._rank_record(rec, sync_s)
        out.update(self._rank_change)  # this rank's part of the change before this step
        self._rank_change = {}
        return out

    # -- applying a change ---------------------------------------------------------------
    def _retune(self) -> None:
        """Same stages: new sample ranges, schedule row and transport; stage and optimizer stay."""
        self.placement = self.topo.placement(self.w.rank)
        self.schedule = schedule_for(self.plan)
        self.actions = self.schedule[self.placement.stage]
        self.p2p = self._make_p2p()

    def _rebuild(self, received: Mapping[int, dict[str, Any]], kept_state: Mapping[Any, Any]) -> None:
        """New stage from the blocks (moved layers loaded first), optimizer state carried over."""
        with torch.no_grad():
            for layer, payload in received.items():
                for name, p in self.blocks[layer].named_parameters():
                    p.copy_(payload["params"][name])
                for name, b in self.blocks[layer].named_buffers():
                    b.copy_(payload["buffers"][name])
        self._build_stage(f"{self.job.name}/v{self.version}")
        start = self.plan.stages[self.placement.stage].layer_start
        for name, p in self.stage.module.named_parameters():
            idx, rest = name.split(".", 1)
            layer = start + int(idx)
            if layer in received:
                state = received[layer]["state"].get(rest)
                if state:
                    self.optimizer.state[p] = {k: _to_device(v, p) for k, v in state.items()}
            elif p in kept_state:
                self.optimizer.state[p] = kept_state[p]
        self.p2p = self._make_p2p()

    def _layer_payload(self, layer: int) -> dict[str, Any]:
        """Parameters, buffers and optimizer state of ``layer`` as this rank holds them (CPU copies)."""
        params, state = {}, {}
        opt_state = self.optimizer.state
        for name, p in self.blocks[layer].named_parameters():
            params[name] = p.detach().cpu().clone()
            if p in opt_state:
                state[name] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                               for k, v in opt_state[p].items()}
        buffers = {name: b.detach().cpu().clone() for name, b in self.blocks[layer].named_buffers()}
        return {"params": params, "buffers": buffers, "state": state}

    def _move_state(self, moves: Sequence[Move]) -> dict[int, dict[str, Any]]:
        """Run this rank's part of ``moves`` (pairwise, in the message's order); returns what it received."""
        me = self.spec.devices[self.w.rank]
        received: dict[int, dict[str, Any]] = {}
        for src, dst, layers in transfers_of(moves):
            if me == src:
                payload = {layer: self._layer_payload(layer) for layer in layers}
                nbytes = sum(_nbytes(v) for v in payload.values())
                deliver = self.clock.wall()
                if self.shaper is not None:
                    deliver = self.shaper.deliver_at(self.cluster.link(src, dst), nbytes, deliver)
                self._send_object({"deliver": deliver, "layers": payload}, dst)
            elif me == dst:
                box = self._recv_object(src)
                if self.shaper is not None:
                    self.clock.sleep_until(box["deliver"])
                received.update(box["layers"])
        return received

    def _send_object(self, obj: Any, dst: str) -> None:
        rank = self.topo.rank_of_device(dst)
        try:
            dist.send_object_list([obj], dst=rank)
        except RuntimeError as exc:
            raise RuntimeSetupError(f"rank {self.w.rank}: sending layer state to rank {rank} ({dst}) failed: "
                                    f"{str(exc)[:160]}") from None

    def _recv_object(self, src: str) -> Any:
        rank = self.topo.rank_of_device(src)
        box: list[Any] = [None]
        try:
            dist.recv_object_list(box, src=rank)
        except RuntimeError as exc:
            raise RuntimeSetupError(f"rank {self.w.rank}: receiving layer state from rank {rank} ({src}) failed: "
                                    f"{str(exc)[:160]}") from None
        return box[0]

    def _result(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        out = super()._result(records)
        out["adapter"] = {"adapt": self.spec.adapt, "devices": list(self.spec.devices),
                          "plans": [p.to_dict() for p in self.plans], "changes": self.changes}
        return out


def _to_device(v: Any, p: torch.Tensor) -> Any:
    # moments live with the parameter; AdamW keeps its step counter on the CPU
    return v.to(p.device) if torch.is_tensor(v) and v.shape == p.shape else v


def _nbytes(payload: Mapping[str, Any]) -> int:
    n = sum(t.numel() * t.element_size() for part in ("params", "buffers") for t in payload[part].values())
    for st in payload["state"].values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


# ---------------------------------------------------------------------------------------
# one call
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveResult:
    """A run with the adapter: the runtime's result plus every plan and change."""

    train: TrainResult
    adapt: bool
    plans: tuple[Plan, ...]
    changes: tuple[dict[str, Any], ...]
    """Per change: start step, kind, reason, measured ``change_s``, moved bytes, moves, predictions."""

    @property
    def samples_per_s(self) -> tuple[float, ...]:
        """Per step: global batch / step time (emulated seconds; a change's cost is in its first step)."""
        return tuple(m["samples_per_s"] for m in self.train.metrics)

    @staticmethod
    def from_run_dir(run_dir: str | Path) -> AdaptiveResult:
        import json

        train = TrainResult.from_run_dir(run_dir)
        d = json.loads((Path(run_dir) / "result.json").read_text())["adapter"]
        return AdaptiveResult(train=train, adapt=d["adapt"], plans=tuple(plan_from_dict(p) for p in d["plans"]),
                              changes=tuple(d["changes"]))


def traced_cluster(cluster: Cluster, link_trace: BandwidthTrace | str | Path | None, *,
                   between: Iterable[tuple[str, str]] | None = None, time_scale: float = 1.0) -> Cluster:
    """``cluster`` with ``link_trace`` (a trace, a built-in name such as ``drop-5x``, or a file)
    rescaled onto the links ``between`` (default: the wide-area links); see :func:`deepcee.traces.with_trace`."""
    if link_trace is None:
        return cluster
    trace = link_trace if isinstance(link_trace, BandwidthTrace) else load_named_trace(link_trace)
    return with_trace(cluster, trace, between=between, time_scale=time_scale)


def adaptive_job(plan: Plan, cluster: Cluster, *, model: Any = "gpt-tiny", config: TrainConfig, run_dir: str | Path,
                 adapt: bool = True, devices: Sequence[str] | None = None, policy: PolicyFactory | None = None,
                 monitor: MonitorConfig | None = None, planning_cluster: Cluster | None = None,
                 name: str | None = None, **job_fields: Any) -> Job:
    """A :class:`~deepcee.runtime.trainer.Job` run by :class:`AdaptiveTrainer` (for :func:`launch_jobs`)."""
    spec = AdaptSpec(devices=tuple(devices or cluster.device_names), adapt=adapt, policy=policy or DefaultPolicy(),
                     monitor=monitor or MonitorConfig(),
                     planning_cluster=None if planning_cluster is None else planning_cluster.to_dict())
    return Job(name=name or f"adapt-{uuid.uuid4().hex[:8]}", plan=plan.to_dict(), cluster=cluster.to_dict(),
               model=model, config=config, run_dir=str(run_dir), adapter=spec, **job_fields)


def run_adaptive_training(plan: Plan, cluster: Cluster, *, model: Any = "gpt-tiny", steps: int, adapt: bool = True,
                          link_trace: BandwidthTrace | str | Path | None = None,
                          between: Iterable[tuple[str, str]] | None = None, trace_time_scale: float = 1.0,
                          devices: Sequence[str] | None = None, policy: PolicyFactory | None = None,
                          profile: ModelProfile | None = None, monitor: MonitorConfig | None = None,
                          planning_cluster: Cluster | None = None, run_dir: str | Path | None = None,
                          deadline_s: float = 600.0, **config: Any) -> AdaptiveResult:
    """Train ``plan`` on local processes (one per device of ``devices``, default every device of
    ``cluster``) with ``link_trace`` playing on the emulated links, adapting when ``adapt``.

    ``link_trace`` is rescaled to each traced link and stretched by ``trace_time_scale``
    (times in emulated seconds: the built-in ``drop-5x`` drops at 20 s x ``trace_time_scale``);
    ``config`` holds :class:`~deepcee.runtime.trainer.TrainConfig` fields. The policy is
    ``policy`` or :class:`DefaultPolicy` with ``profile`` (default: the model's analytic
    profile) and plans on ``planning_cluster`` (default: ``cluster`` without the trace).
    This is what ``deepcee train --plan plan.json --adapt --link-trace drop-5x`` runs.
    """
    if policy is None:
        policy = DefaultPolicy(profile=None if profile is None else profile.to_dict())
    cfg = TrainConfig(steps=steps, **config)
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="deepcee-adapt-"))
    traced = traced_cluster(cluster, link_trace, between=between, time_scale=trace_time_scale)
    job = adaptive_job(plan, traced, model=model, config=cfg, run_dir=run_dir, adapt=adapt, devices=devices,
                       policy=policy, monitor=monitor,
                       planning_cluster=planning_cluster or snapshot(cluster, 0.0).subset(devices or cluster.device_names))
    launch_jobs([job], deadline_s=deadline_s)
    return AdaptiveResult.from_run_dir(run_dir)


__all__ = [
    "AdaptSpec", "AdaptiveResult", "AdaptiveTrainer", "DecisionMessage", "DefaultPolicy", "DeviceTopology", "Move",
    "PolicyContext", "PolicyFactory", "ScriptedPolicy", "adaptive_job", "decision_message", "layer_state_bytes",
    "run_adaptive_training", "state_moves", "traced_cluster", "transfers_of",
]
