"""The adapter's training hooks: apply keep / re-tune / re-plan decisions to a running job (torch).

An adaptive job (:func:`deepcee.adapter.controller.adaptive_job`) carries an :class:`AdaptSpec`
as its :attr:`~deepcee.runtime.job.Job.hooks`; on every rank it builds an
:class:`AdaptiveHooks`, the :class:`~deepcee.runtime.hooks.TrainerHooks` of a
:class:`~deepcee.runtime.trainer.Trainer` whose plan can change between steps. Ranks are tied
to devices for the whole run (:class:`~deepcee.adapter.messages.DeviceTopology`: rank ``r`` is
always device ``devices[r]``, whichever plan is in force), so a plan may leave devices idle and
bring them back; idle ranks still take part in every gather and broadcast.

[Note: adapter step boundary]
At the end of every step but the last, on every rank of the world:

1. the step's per-rank records, including every received piece's timing
   (:attr:`deepcee.runtime.records.RankMetrics.transfers`: link resource, bytes, send start,
   delivery, in emulated seconds), are gathered on rank 0 (over the world: idle ranks send
   nothing but still take part);
2. rank 0's :class:`~deepcee.adapter.coordinator.Coordinator` feeds them to its link monitor
   and, when adapting, asks its policy on the planning cluster corrected by the monitor's
   estimates; the policy never sees the links' traces, only what the transfers showed;
3. rank 0 broadcasts a :class:`~deepcee.adapter.messages.DecisionMessage` (kind, the new plan,
   the step it starts at, the state moves) over the world; every rank checks the start step,
   so all agree on the new plan and when it starts.

Steps 1-3 are the *control* time, recorded per step (``control_s``) and excluded from step
times. Then, before the next step and counted in its time (``change_s``):

- **re-tune** (same stages on the same devices; other microbatch size, count or shares): the
  topology, schedule row and transport are rebuilt (:meth:`Trainer.reshard
  <deepcee.runtime.trainer.Trainer.reshard>`); no state moves, the stage module and its
  optimizer stay;
- **re-plan**: for every layer, each device of its new stage that did not hold it receives
  its parameters and optimizer state (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``; SGD
  ``momentum_buffer``) from one device of its old stage (every device of a stage holds a
  replica; :func:`~deepcee.adapter.messages.state_moves` picks the one whose link frees first,
  as :func:`~deepcee.adapter.policy.state_movement` costs it); the moves run pairwise in the
  message's order (a global order: no deadlock) over the emulated links
  (:class:`~deepcee.runtime.emulation.LinkShaper`: bytes and latency, queueing on shared
  resources). Then every rank creates the new plan's stage groups (``new_group`` is
  collective over the world), and every active rank rebuilds its stage from the blocks it
  holds, agrees boundary shapes with its new peers, rebuilds its optimizer with the moved
  or kept state, and its transport. Parameters and optimizer state are exactly those a run
  without the change would have (tested against a single-process reference).

With ``elastic`` settings (:class:`~deepcee.runtime.elastic.ElasticConfig`) the ranks are an
elastic run's ([Note: elastic process groups] in :mod:`deepcee.runtime.elastic`): step
records and the decision travel through the store, each step's update waits for the commit
point, a failed step goes to :func:`deepcee.adapter.elastic.recover`, and rank 0 takes a
device that comes back in at a step boundary ([Note: elastic re-plan] there). Rank ``r`` then
runs ``devices[r]`` of the generation in force (:attr:`AdaptiveHooks.devices`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from deepcee.adapter import elastic as aelastic
from deepcee.adapter.coordinator import Coordinator, DefaultPolicy, PolicyContext, PolicyFactory
from deepcee.adapter.messages import DecisionMessage, DeviceTopology
from deepcee.adapter.monitor import MonitorConfig
from deepcee.adapter.policy import DecisionKind
from deepcee.adapter.statemove import move_state, rebuild
from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.plan import Plan
from deepcee.profile import ModelProfile
from deepcee.runtime import boundary
from deepcee.runtime.elastic import ElasticConfig, Transition
from deepcee.runtime.job import Job
from deepcee.runtime.partition import Topology
from deepcee.runtime.records import (
    AdapterRun,
    AppliedChange,
    BoundaryMetrics,
    LinkEstimateRecord,
    PlanChange,
    RankChange,
    RankMetrics,
)
from deepcee.traces import snapshot

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer, Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptSpec:
    """:attr:`deepcee.runtime.job.Job.hooks` of an adaptive job (pickled to every rank)."""

    devices: tuple[str, ...]
    """Rank ``r`` runs ``devices[r]`` for the whole run; every plan must use only these."""
    adapt: bool = True
    """``False``: same machinery and monitor, but the plan is always kept (the baseline)."""
    policy: PolicyFactory = field(default_factory=DefaultPolicy)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    planning_cluster: Cluster | None = None
    """What the policy plans on (no traces); ``None``: the job's cluster frozen at time 0,
    restricted to ``devices``."""
    elastic: ElasticConfig | None = None
    """Survive lost devices and take them back ([Note: elastic re-plan] in
    :mod:`deepcee.adapter.elastic`); ``None``: a lost device ends the run."""

    def __post_init__(self) -> None:
        if not self.devices or len(set(self.devices)) != len(self.devices):
            raise SpecError(f"devices must be distinct and non-empty, got {list(self.devices)}", field="devices")

    def hooks(self, job: Job, worker: Worker) -> AdaptiveHooks:
        return AdaptiveHooks(self, job, worker)

    def rank_devices(self, job: Job) -> tuple[str, ...]:
        return self.devices

    def warm(self, job: Job, device: torch.device) -> None:
        """A process that comes back pays its one-off costs before it asks to (elastic runs)."""
        from deepcee import nets
        from deepcee.runtime import params as rparams
        from deepcee.runtime.data import dataset_for

        dtype = getattr(torch, job.config.dtype)
        if isinstance(job.model, str):
            blocks, loss_fn = nets.build(job.model, job.config.seed, dtype=dtype)
        else:
            blocks, loss_fn = [b.to(dtype) for b in rparams.private_blocks(job.model)], None
        _warm_blocks(blocks, job.loss_fn or loss_fn, job.dataset or dataset_for(job.model, job.config.seed),
                     job.config, device)


def layer_state_bytes(blocks: Sequence[nn.Module], optimizer: str, momentum: float = 0.0) -> list[float]:
    """Bytes of each layer's parameters and optimizer state (AdamW: 2 moments; SGD: momentum)."""
    states = 2 if optimizer == "adamw" else (1 if momentum else 0)
    return [float(sum(p.numel() * p.element_size() for p in b.parameters()) * (1 + states)) for b in blocks]


class AdaptiveHooks:
    """One rank's hooks of a run whose plan changes at step boundaries. See the module docstring."""

    def __init__(self, spec: AdaptSpec, job: Job, worker: Worker) -> None:
        if worker.world_size != len(spec.devices) and spec.elastic is None:
            raise RuntimeSetupError(f"an adaptive job needs one rank per device of {list(spec.devices)}, "
                                    f"the world has {worker.world_size}")
        if spec.elastic is None and (job.config.checkpoint_every or job.config.resume):
            raise SpecError("checkpoints are supported with the adapter only in an elastic run (the plan changes)",
                            field="checkpoint")
        if job.plan.num_replicas > 1 and (spec.elastic is None or job.plan.strategy.kind != "exact"):
            raise SpecError(f"the adapter re-tunes and re-plans one pipeline; plan {job.plan.system!r} has "
                            f"{job.plan.num_replicas} replicas ({job.plan.strategy.describe()}), whose links and "
                            "strategy it does not model yet: run it without --adapt (an elastic run takes "
                            "several replicas under the exact strategy)", field="plan.replicas")
        self.spec = spec
        self.devices: tuple[str, ...] = spec.devices
        """Rank ``r`` runs ``devices[r]`` (an elastic run: of the generation in force)."""
        self.events: list[dict[str, Any]] = []
        """Rank 0 of an elastic run: its transitions (``elastic.json``)."""
        self.version = 0
        self.plans: list[Plan] = [job.plan]
        self.changes: list[PlanChange] = []
        self._pending: DecisionMessage | None = None
        self._rank_change: RankChange | None = None
        self._coordinator: Coordinator | None = None

    # -- set-up --------------------------------------------------------------------------
    def topology(self, plan: Plan, world_size: int) -> Topology:
        return DeviceTopology(plan, self.devices)

    def gathers_over_world(self) -> bool:
        return True  # idle ranks take part in every gather and broadcast

    def takes_part(self, trainer: Trainer) -> bool:
        return True

    def device(self, trainer: Trainer) -> str:
        return self.devices[trainer.w.rank]

    def paced_devices(self, trainer: Trainer) -> Sequence[str]:
        return self.spec.devices  # fixed for the run, whatever the plans use

    def prepare(self, t: Trainer) -> None:
        _warm_up(t)
        if self.spec.elastic is not None:
            aelastic.session(t).applied = t.start_step
        if t.w.rank == 0:
            self.ensure_coordinator(t)
            self._coordinator.warm_up(t.plan)

    def planning_cluster(self, t: Trainer) -> Cluster:
        """What plans are made on: the spec's planning cluster, else the job's at time 0 (no traces)."""
        if self.spec.planning_cluster is not None:
            return self.spec.planning_cluster
        return snapshot(t.cluster, 0.0).subset(self.spec.devices)

    def model_profile(self, t: Trainer) -> ModelProfile:
        """The profile re-plans use: the policy's, else the built-in model's analytic one."""
        profile = getattr(self.spec.policy, "profile", None)
        if profile is not None:
            return profile
        if not isinstance(t.job.model, str):
            raise SpecError("re-planning a user model needs its profile (DefaultPolicy(profile=...))", field="profile")
        from deepcee.models import get_model

        return get_model(t.job.model)

    def layer_bytes(self, t: Trainer) -> list[float]:
        opt = t.cfg.optimizer
        return layer_state_bytes(t.blocks, opt.name, opt.momentum)

    def ensure_coordinator(self, t: Trainer) -> None:
        """Rank 0's monitor and policy (a rank that becomes rank 0 mid-run starts them afresh)."""
        if self._coordinator is None:
            model = t.job.model if isinstance(t.job.model, str) else "user"
            ctx = PolicyContext(plan=t.plan, cluster=self.planning_cluster(t), model=model, steps=t.cfg.steps,
                                clock=t.emulated_s)
            self._coordinator = Coordinator(self.spec, t.plan, ctx.cluster, ctx, self.layer_bytes(t))

    # -- the step boundary ---------------------------------------------------------------
    def decide(self, t: Trainer, step: int, gathered: Sequence[RankMetrics | None] | None) -> BoundaryMetrics:
        t0 = t.clock.wall()
        end_s = t.emulated_s(t0)
        estimates: dict[str, LinkEstimateRecord] = {}
        changed: dict[str, RankChange] = {}
        if self._coordinator is not None:
            self._coordinator.observe(gathered)
            estimates = self._coordinator.link_estimates()
            # every active rank's part of the change before this step
            changed = {r.device: r.change for r in gathered if r is not None and r.change is not None}
        record = BoundaryMetrics(plan_version=self.version, end_s=end_s, link_estimates=estimates,
                                 changed_links=tuple(r for r, e in estimates.items() if e.changed),
                                 change_by_device=changed)
        if step == t.cfg.steps - 1:
            return record
        msg = self._decision(t, step)
        if msg.start_step != step + 1:
            raise RuntimeSetupError(f"rank {t.w.rank}: decision for step {msg.start_step} arrived after step {step}")
        self._pending = msg if msg.changes_plan else None
        return BoundaryMetrics(plan_version=record.plan_version, end_s=end_s, link_estimates=estimates,
                               changed_links=record.changed_links, change_by_device=changed,
                               decision=msg.kind.value, reason=msg.reason,
                               control_s=(t.clock.wall() - t0) / t.dilation)

    def _decision(self, t: Trainer, step: int) -> DecisionMessage:
        """Rank 0's decision after ``step``, on every rank (through the store in an elastic run)."""
        msg = None
        if self._coordinator is not None:
            msg = self._coordinator.decide(step, t.plan)
            back = aelastic.session(t).rejoin_requests() if self.spec.elastic is not None else []
            if back:
                tr = aelastic.decide_rejoin(self, t, step, back)
                aelastic.session(t).admit(tr)
                msg = DecisionMessage(kind=DecisionKind.REPLAN, start_step=step + 1, plan=tr.detail.plan,
                                      moves=tr.detail.moves, reason=tr.reason, transition=tr)
        if self.spec.elastic is not None:
            s = aelastic.session(t)
            if msg is not None:
                s.publish(f"decision/{step}", msg)
            return msg or s.receive(f"decision/{step}", f"rank 0's decision after step {step}")
        box: list[Any] = [msg]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def apply(self, t: Trainer) -> AppliedChange | None:
        msg, self._pending = self._pending, None
        if msg is None:
            return None
        if msg.transition is not None:
            return aelastic.enter(self, t, msg.transition)
        t0 = t.clock.wall()
        received = move_state(t, self.devices, msg.moves)
        t_moved = t.clock.wall()
        kept_state = t.optimizer.state if t.active else {}
        old_plan, was_active = t.plan, t.active
        t.set_plan(msg.plan)  # every rank: the new stage groups
        self.version += 1
        self.plans.append(msg.plan)
        if t.active:
            if msg.kind == DecisionKind.RETUNE and was_active:
                t.reshard()
            else:
                rebuild(t, f"{t.job.name}/v{self.version}", received, kept_state)
        else:
            t.stage = t.optimizer = t.p2p = None
        change_s = (t.clock.wall() - t0) / t.dilation
        self._rank_change = RankChange(change_s=change_s, move_s=(t_moved - t0) / t.dilation)
        self.changes.append(PlanChange(
            start_step=msg.start_step, kind=msg.kind.value, reason=msg.reason, change_s=change_s,
            moved_bytes=msg.moved_bytes, moves=tuple((m.layer, m.src, m.dst) for m in msg.moves),
            predicted_current_s=msg.predicted_current_s, predicted_new_s=msg.predicted_new_s,
            predicted_change_s=msg.predicted_change_s))
        log.info("rank %d: %s from step %d (%s -> %s stages) in %.3g s", t.w.rank, msg.kind, msg.start_step,
                 old_plan.num_stages, msg.plan.num_stages, change_s)
        return AppliedChange(kind=msg.kind.value, change_s=change_s, moved_bytes=msg.moved_bytes)

    def rank_change(self) -> RankChange | None:
        out, self._rank_change = self._rank_change, None
        return out

    # -- an elastic run -----------------------------------------------------------------
    def before_update(self, t: Trainer, step: int) -> None:
        if self.spec.elastic is not None:
            aelastic.session(t).commit(step, parties=t.topo.num_active)

    def recover(self, t: Trainer, step: int, exc: BaseException) -> tuple[int, AppliedChange | None]:
        if self.spec.elastic is None or isinstance(exc, SpecError | KeyboardInterrupt):
            raise exc
        return aelastic.recover(self, t, step, exc)

    def admitted(self, tr: Transition) -> None:
        self.devices = tr.devices

    def join(self, t: Trainer, tr: Transition) -> None:
        aelastic.join(self, t, tr)

    def adapter_run(self) -> AdapterRun:
        return AdapterRun(adapt=self.spec.adapt, devices=self.spec.devices, plans=tuple(self.plans),
                          changes=tuple(self.changes))


# ---------------------------------------------------------------------------------------
# on a rank: warm-up, rebuilding a stage, moving layer state
# ---------------------------------------------------------------------------------------


def _warm_up(t: Trainer) -> None:
    """Pay one-off costs now, not in the first step a rank runs after a change (a standby
    device is kept ready): the first optimizer built in a process imports ``torch._dynamo``
    (measured: about 4 s), and the first forward and backward through a block costs its
    process about 2x a later one."""
    _warm_blocks(t.blocks, t.loss_fn, t.dataset, t.cfg, t.w.device)


def _warm_blocks(blocks: Sequence[nn.Module], loss_fn: Any, dataset: Any, cfg: Any, device: torch.device) -> None:
    """Build and step an optimizer once, run every block once on two samples; parameters,
    gradients and buffers are left as they were."""
    dummy = nn.Parameter(torch.zeros(1, device=device))
    opt = cfg.optimizer.build([dummy])
    dummy.grad = torch.zeros_like(dummy)
    opt.step()
    if loss_fn is None:
        return
    buffers = [(b, b.detach().clone()) for block in blocks for b in block.buffers()]
    batch = dataset.batch(0, 2)
    dtype = getattr(torch, cfg.dtype)
    x = boundary.to_device(batch.inputs, device, dtype)  # tensors or structures of them
    for block in blocks:
        x = block(x)
    loss_fn(x, boundary.to_device(batch.targets, device, dtype)).backward()
    with torch.no_grad():
        for block in blocks:
            for p in block.parameters():
                p.grad = None
        for b, saved in buffers:
            b.copy_(saved)
