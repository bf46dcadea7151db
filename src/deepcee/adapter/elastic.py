"""Device loss and return in the adapter: re-plan on the devices left, move or restore the state.

An adaptive job whose :class:`~deepcee.adapter.hooks.AdaptSpec` has ``elastic`` settings runs
on the mechanism of :mod:`deepcee.runtime.elastic` ([Note: elastic process groups]); this
module makes its decisions and applies them to the trainer.

[Note: elastic re-plan]
When a device is lost, the leader of the survivors (:func:`decide_recovery`) plans the next
generation: the planner (:func:`deepcee.planner.search.plan_training`, on the planning cluster
restricted to the survivors and any device coming back; the model's profile) gives the plan;
then, if every layer still has a survivor holding its current state and the survivors agree
on the step (they do: [Note: elastic process groups], the commit point), each device of the
new plan that lacks a layer receives it from a survivor that holds it
(:func:`~deepcee.adapter.messages.state_moves` over the survivors only), exactly as a re-plan
of the adapter moves it, and training goes on at the next step: no step is redone. If some
layer's only holders were lost, a model half at one step and half at another is no step of
the run, so *every* member restores its new stage from the newest intact checkpoint
(:func:`deepcee.runtime.persist.resume`, by parameter names, under the new plan) and the run
goes on from that checkpoint's step; the steps between are redone (``steps_redone`` in the
event). A device that comes back (:func:`decide_rejoin`, rank 0 at a step boundary) gets the
same treatment: a plan on the members and it, layers moved to it. Every transition is
recorded in ``<run_dir>/elastic.json`` (rank 0) and as a :class:`~deepcee.runtime.records.PlanChange`
of kind ``device-lost`` or ``device-rejoin`` (``regroup``: the same members go on after a fault
that named no peer, :func:`_regroup`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepcee.adapter.messages import Move, state_moves
from deepcee.errors import DeepceeError, RuntimeSetupError
from deepcee.plan import Plan, ReplicaPlan, save_json_atomic
from deepcee.runtime import checkpoint as ckpt
from deepcee.runtime import persist, runlock
from deepcee.runtime.elastic import (
    Excluded,
    Fault,
    JoinRecord,
    LostDevice,
    PeerLost,
    Session,
    Transition,
)
from deepcee.runtime.partition import needs_servers
from deepcee.runtime.records import AppliedChange, PlanChange

if TYPE_CHECKING:
    from deepcee.adapter.hooks import AdaptiveHooks
    from deepcee.runtime.trainer import Trainer

log = logging.getLogger(__name__)

EVENTS_FILE = "elastic.json"
SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticDetail:
    """The adapter's part of a :class:`~deepcee.runtime.elastic.Transition`."""

    plan: Plan
    version: int
    """The plan version from the transition on."""
    moves: tuple[Move, ...] = ()
    restore: str | None = None
    """A checkpoint folder every member restores its new stage from (some layer's state was lost)."""
    applied: int
    """Steps the survivors had applied when the transition was decided."""
    first_step: int
    """The first step of this launch (results count from it)."""
    moved_bytes: float = 0.0

    @property
    def steps_redone(self) -> int:
        return 0 if self.restore is None else self.applied - _restore_step(self.restore)


def _restore_step(folder: str) -> int:
    return int(folder.rstrip("/").rsplit("step-", 1)[1])


def session(t: Trainer) -> Session:
    s = t.w.waiter
    if not isinstance(s, Session):
        raise RuntimeSetupError("an elastic job's ranks must be started by deepcee.runtime.elastic_rank.run_elastic_job")
    return s


def held_layers(t: Trainer) -> tuple[int, ...]:
    """The layers whose current state this rank holds: its stage's, if it runs one."""
    if not t.active or getattr(t, "stage", None) is None:
        return ()
    st = t.pipeline.stages[t.placement.stage]  # its replica's stage
    return tuple(range(st.layer_start, st.layer_stop))


# -- deciding (the leader, or rank 0 for a rejoin) ----------------------------------------------


def replan(h: AdaptiveHooks, t: Trainer, devices: Sequence[str]) -> Plan:
    """The planner's plan for ``devices`` ([Note: elastic re-plan]), labelled like the run's plan."""
    from deepcee.planner.search import plan_training

    planning = h.planning_cluster(t).subset(devices)
    plan = plan_training(planning, h.model_profile(t), t.plan.global_batch,
                         options=getattr(h.spec.policy, "planner_options", None)).plan
    return plan.replace(cluster=t.plan.cluster, model=t.plan.model)


# [Note: elastic replicas]
# A plan of several replicas under the exact strategy gives every replica the same parameters
# and optimizer state after each step, so a layer is held by its stage's devices in *every*
# replica and a replica that loses a device loses no state the others lack. The leader keeps
# the replicas that lost nothing as they are and, for each one that lost a device, considers
# two ways on: that replica re-planned by the planner on its surviving devices (its own share of
# the global batch), or that replica dropped, its samples given to one of the others (re-planned
# on its own devices for the larger batch). The candidate the simulator finds fastest (on the
# planning cluster, the model's profile) is the next plan; the global batch is the same, so the
# mathematics are too. A device coming back, or a plan of one pipeline, gets the planner's plan
# on every device instead (which may be one pipeline or several replicas).


def next_plan(h: AdaptiveHooks, t: Trainer, devices: Sequence[str]) -> Plan:
    """The next generation's plan on ``devices`` ([Note: elastic re-plan], [Note: elastic replicas])."""
    plan = t.plan
    if plan.num_replicas == 1 or any(d not in plan.devices for d in devices):
        return replan(h, t, devices)
    kept = [rep for rep in plan.replicas if all(d in devices for d in rep.devices)]
    hit = [rep for rep in plan.replicas if rep not in kept]
    cands: list[list[ReplicaPlan]] = [list(kept)]
    for rep in hit:
        step: list[list[ReplicaPlan]] = []
        left = tuple(d for d in rep.devices if d in devices)
        for base in cands:
            if left and (sub := _replica_on(h, t, left, rep.batch)) is not None:
                step.append([*base, *sub])
            for j, other in enumerate(base):  # dropped: replica j takes its samples
                if (sub := _replica_on(h, t, other.devices, other.batch + rep.batch)) is not None:
                    step.append([*base[:j], *sub, *base[j + 1:]])
        cands = step
    scored = [_scored(h, t, plan.replace(replicas=tuple(reps), estimate=None), devices) for reps in cands if reps]
    scored = [c for c in scored if c is not None]
    if not scored:
        log.warning("no replica-wise plan on %s; the planner plans them anew", list(devices))
        return replan(h, t, devices)
    return max(scored, key=lambda c: c.estimate.samples_per_s)


def _replica_on(h: AdaptiveHooks, t: Trainer, devices: Sequence[str], batch: int) -> list[ReplicaPlan] | None:
    """The planner's pipeline(s) for ``batch`` samples on ``devices`` (exact, no servers), or ``None``."""
    from deepcee.planner.search import plan_training

    try:
        sub = plan_training(h.planning_cluster(t).subset(devices), h.model_profile(t), batch,
                            options=getattr(h.spec.policy, "planner_options", None)).plan
    except DeepceeError as exc:
        log.info("no plan for %d samples on %s: %s", batch, list(devices), exc)
        return None
    if sub.strategy.kind != "exact" or needs_servers(sub):
        return None
    return list(sub.replicas)


def _scored(h: AdaptiveHooks, t: Trainer, plan: Plan, devices: Sequence[str]) -> Plan | None:
    """``plan`` with the simulator's estimate on the planning cluster, or ``None`` if it does not run there."""
    from deepcee.plan import Estimate
    from deepcee.simulator.replicas import simulate_replicas

    cluster = h.planning_cluster(t).subset(devices)
    try:
        r = simulate_replicas(plan, cluster, h.model_profile(t), steps=2)
    except DeepceeError as exc:
        log.info("candidate plan with %d replicas rejected: %s", plan.num_replicas, exc)
        return None
    return plan.replace(estimate=Estimate(iteration_s=r.iteration_s, samples_per_s=r.samples_per_s,
                                          peak_memory_bytes=dict(r.peak_memory_bytes), bottleneck=r.bottleneck,
                                          source="simulator"))


def cut_off_end(h: AdaptiveHooks, t: Trainer, fault: Fault, joins: Sequence[JoinRecord]) -> str:
    """Which end of a dead link to leave out. [Note: which end of a dead link]: a timeout names
    the peer the reporter could not reach, but a link has two ends and both processes are alive;
    whichever end saw it first is an accident of timing. So the leader re-plans without each end
    and leaves out the one whose loss costs least: first the one that leaves every layer with a
    holder (no checkpoint restore), then the faster plan (the planner's estimate), then the one
    named (the reporter reached the others)."""
    ends = [d for d in (fault.suspect, fault.by) if d in h.devices]
    if len(ends) < 2:
        return fault.suspect or ""

    def cost(end: str) -> tuple[int, float, int]:
        rest = [j for j in joins if j.device != end]
        held = {layer for j in rest for layer in j.layers}
        try:
            plan = next_plan(h, t, tuple(d for d in h.spec.devices if any(j.device == d for j in rest)))
            speed = plan.estimate.samples_per_s if plan.estimate is not None else 0.0
        except DeepceeError:
            speed = 0.0
        return (t.plan.num_layers - len(held), -speed, ends.index(end))

    best = min(ends, key=cost)
    log.info("dead link %s <-> %s: leaving out %s (%s)", fault.by, fault.suspect, best,
             ", ".join(f"without {e}: {cost(e)}" for e in ends))
    return best


def decide_recovery(h: AdaptiveHooks, t: Trainer, gen: int, joins: Sequence[JoinRecord], lost: Sequence[LostDevice],
                    rejoining: Sequence[str], fault: Fault | None) -> Transition:
    """The next generation after a fault ([Note: elastic re-plan]); raises when none can go on."""
    lost = list(lost)
    if not lost:
        # every member answered: a dead link (or a timeout) between the reporter and the device it
        # named; one end is left out ([Note: which end of a dead link])
        suspect = fault.suspect if fault is not None else None
        if suspect is None or suspect not in h.devices:
            return _regroup(h, t, gen, joins, fault)
        suspect = cut_off_end(h, t, fault, joins)
        lost = [LostDevice(device=suspect, rank=h.devices.index(suspect), reason=fault.reason)]
        joins = [j for j in joins if j.device != suspect]
    if not joins:
        raise RuntimeSetupError(f"generation {gen}: every device is lost ({', '.join(d.device for d in lost)})")
    devices = tuple(d for d in h.spec.devices if any(j.device == d for j in joins) or d in rejoining)
    plan = next_plan(h, t, devices)
    holders = {layer: tuple(j.device for j in joins if layer in j.layers) for layer in range(t.plan.num_layers)}
    missing = [layer for layer, held in holders.items() if not held]
    holding = [j for j in joins if j.layers]  # an idle member's step count means nothing
    applied = max((j.applied for j in holding), default=max(j.applied for j in joins))
    base = dict(plan=plan, version=max(j.version for j in joins) + 1, applied=applied, first_step=t.first_step)
    if missing or len({(j.applied, j.version) for j in holding}) > 1:
        choice = ckpt.choose(t.ckpt_root())
        if choice is None:
            names = ", ".join(d.device for d in lost)
            raise RuntimeSetupError(f"device(s) {names} held the only state of layers {_ranges(missing)} and the run "
                                    "has no checkpoint to restore them from (checkpoint_every)")
        detail = ElasticDetail(**base, restore=choice.folder)
        resume = choice.step
    else:
        moves = state_moves(t.plan, plan, h.planning_cluster(t), h.layer_bytes(t), holders=holders)
        detail = ElasticDetail(**base, moves=moves, moved_bytes=float(sum(h.layer_bytes(t)[m.layer] for m in moves)))
        resume = applied
    reason = "; ".join(f"{d.device} lost ({d.reason})" for d in lost)
    return Transition(gen=gen + 1, devices=devices, resume_step=resume, lost=tuple(lost),
                      joined=tuple(d for d in rejoining if d in devices), detail=detail,
                      fault_s=fault.at_s if fault is not None else None, decided_s=time.time(), reason=reason)


def _regroup(h: AdaptiveHooks, t: Trainer, gen: int, joins: Sequence[JoinRecord], fault: Fault | None) -> Transition:
    """Every member answered and the fault names no peer (a collective timed out: over a dead
    link, gloo does not say whose). The same members form a new generation and go on at the
    next step, whose transfers name the peer they wait for if the fault comes back; a second
    such fault with no step done in between ends the run."""
    why = fault.reason if fault is not None else "a step failed"
    applied = max(j.applied for j in joins)
    before = session(t).decision(gen - 1) if gen > 0 else None
    if before is not None and not before.lost and not before.joined and before.resume_step == applied:
        raise RuntimeSetupError(f"generation {gen}: {why}; no device is lost, and the regrouped members failed again "
                                f"at step {applied} without naming a peer")
    if len({(j.applied, j.version) for j in joins if j.layers}) > 1:
        raise RuntimeSetupError(f"generation {gen}: {why}; no device is lost, but the members disagree on the step")
    detail = ElasticDetail(plan=t.plan, version=max(j.version for j in joins) + 1, applied=applied,
                           first_step=t.first_step)
    return Transition(gen=gen + 1, devices=tuple(j.device for j in joins), resume_step=applied, detail=detail,
                      fault_s=fault.at_s if fault is not None else None, decided_s=time.time(),
                      reason=f"regroup: {why}")


def transition_kind(tr: Transition) -> str:
    """``device-lost``, ``device-rejoin`` or ``regroup`` (the same members, after a fault naming no peer)."""
    return "device-lost" if tr.lost else ("device-rejoin" if tr.joined else "regroup")


def decide_rejoin(h: AdaptiveHooks, t: Trainer, step: int, rejoining: Sequence[str]) -> Transition:
    """Rank 0, at the boundary after ``step``: take ``rejoining`` devices back in."""
    s = session(t)
    devices = tuple(d for d in h.spec.devices if d in h.devices or d in rejoining)
    plan = replan(h, t, devices)
    moves = state_moves(t.plan, plan, h.planning_cluster(t), h.layer_bytes(t))
    detail = ElasticDetail(plan=plan, version=h.version + 1, moves=moves, applied=step + 1, first_step=t.first_step,
                           moved_bytes=float(sum(h.layer_bytes(t)[m.layer] for m in moves)))
    return Transition(gen=s.gen + 1, devices=devices, resume_step=step + 1, joined=tuple(rejoining), detail=detail,
                      decided_s=time.time(), reason=f"{', '.join(rejoining)} came back")


def _ranges(layers: Sequence[int]) -> str:
    return ", ".join(str(x) for x in layers)


# -- applying (every member of the next generation) ---------------------------------------------


def recover(h: AdaptiveHooks, t: Trainer, step: int, exc: BaseException) -> tuple[int, AppliedChange]:
    """Step ``step`` failed with ``exc`` on this rank: agree on the next generation and enter it."""
    s = session(t)
    log.warning("%s: step %d failed (%s); recovering", s.me, step, str(exc).splitlines()[0][:200])
    for _ in range(len(h.spec.devices)):
        join = JoinRecord(device=s.me, rank=t.w.rank, applied=s.applied, version=h.version, layers=held_layers(t),
                          detected_s=time.time())
        tr = s.recover(join, lambda *a: decide_recovery(h, t, *a))
        if s.me not in tr.devices:
            t.close_outputs()
            raise Excluded(f"{s.me} was left out of generation {tr.gen} ({tr.reason})")
        try:
            return tr.resume_step, enter(h, t, tr)
        except PeerLost as again:  # another device was lost while this one formed: agree again
            log.warning("%s: generation %d failed while forming: %s", s.me, tr.gen, again)
    raise RuntimeSetupError(f"{s.me}: gave up after {len(h.spec.devices)} failed recoveries") from exc


def enter(h: AdaptiveHooks, t: Trainer, tr: Transition) -> AppliedChange:
    """A member of the current generation enters ``tr``: new process group, plan, state."""
    s = session(t)
    t0 = time.time()
    kept = t.optimizer.state if held_layers(t) else {}
    t.close_outputs()
    s.leave(t.forget_groups())
    rank = s.enter(tr)
    t.w.rank, t.w.world_size = rank, len(tr.devices)
    t.records_key = f"{t.job.name}/g{tr.gen}"
    h.devices = tr.devices
    t.set_plan(tr.detail.plan, make_job_group=True)
    return _settle(h, t, tr, kept, t0)


def join(h: AdaptiveHooks, t: Trainer, tr: Transition) -> None:
    """A device that comes back: its trainer exists in generation ``tr.gen``; set up, take state."""
    t0 = time.time()
    t.records_key = f"{t.job.name}/g{tr.gen}"
    t.setup_local()
    t.start_clock(t._epoch(read=True))
    t.first_step = tr.detail.first_step
    t.stage = t.optimizer = t.p2p = None
    _settle(h, t, tr, {}, t0)
    t.start_step = tr.resume_step


def _settle(h: AdaptiveHooks, t: Trainer, tr: Transition, kept: Mapping[Any, Any], t0: float) -> AppliedChange:
    """State in place (moved or restored), stage rebuilt, rank 0's duties; the event recorded."""
    from deepcee.adapter.statemove import move_state as _move_state
    from deepcee.adapter.statemove import rebuild as _rebuild

    d: ElasticDetail = tr.detail
    key = f"{t.job.name}/g{tr.gen}"
    if d.restore is not None:
        if t.active:
            t.build_stage(key)
        record = persist.resume(t)  # every member, under the new plan, by parameter names
        if record is None or record.step != tr.resume_step:
            raise RuntimeSetupError(f"restoring for generation {tr.gen}: expected checkpoint step {tr.resume_step}, "
                                    f"found {None if record is None else record.step}")
        if t.active:
            t.p2p = t.make_p2p()
    else:
        received = _move_state(t, tr.devices, d.moves)
        if t.active:
            _rebuild(t, key, received, kept)
    if not t.active:
        t.stage = t.optimizer = t.p2p = None
    session(t).applied = tr.resume_step
    h.version = d.version
    h.plans.append(d.plan)
    kind = transition_kind(tr)
    change_s = time.time() - t0
    h.changes.append(PlanChange(start_step=tr.resume_step, kind=kind, reason=tr.reason, change_s=change_s,
                                moved_bytes=d.moved_bytes, moves=tuple((m.layer, m.src, m.dst) for m in d.moves),
                                predicted_new_s=_predicted_s(d.plan)))
    if t.w.rank == 0:
        _rank0_duties(h, t, tr, resumed_s=time.time())
    log.info("%s: generation %d (%s) from step %d in %.2f s", session(t).me, tr.gen, tr.reason, tr.resume_step,
             change_s)
    return AppliedChange(kind=kind, change_s=change_s, moved_bytes=d.moved_bytes)


def _predicted_s(plan: Plan) -> float | None:
    return plan.estimate.iteration_s if plan.estimate is not None else None


def _rank0_duties(h: AdaptiveHooks, t: Trainer, tr: Transition, *, resumed_s: float) -> None:
    """Rank 0 of the new generation: the run folder's lock, the coordinator, outputs, the event."""
    if t.run_lock is None or t.run_lock.handle is None:
        try:
            t.run_lock = runlock.acquire(t.run_dir, job=t.job.name)
        except RuntimeSetupError as exc:
            log.warning("rank 0 of generation %d: %s", tr.gen, exc)
    h.ensure_coordinator(t)
    t.open_outputs(tr.resume_step)
    h.events.append(event_dict(tr, resumed_s))
    save_json_atomic(t.run_dir / EVENTS_FILE, {"schema_version": SCHEMA_VERSION, "events": h.events})


def event_dict(tr: Transition, resumed_s: float) -> dict[str, Any]:
    """One line of ``elastic.json``: wall times are ``time.time()`` seconds."""
    d: ElasticDetail = tr.detail
    est = d.plan.estimate
    return {"generation": tr.gen, "kind": transition_kind(tr), "reason": tr.reason,
            "lost": [{"device": x.device, "rank": x.rank, "reason": x.reason} for x in tr.lost],
            "joined": list(tr.joined), "devices": list(tr.devices), "fault_reported_at": tr.fault_s,
            "decided_at": tr.decided_s, "resumed_at": resumed_s, "steps_applied": d.applied,
            "resume_step": tr.resume_step, "steps_redone": d.steps_redone, "restored_from": d.restore,
            "moved_bytes": d.moved_bytes, "moves": [[m.layer, m.src, m.dst] for m in d.moves],
            "plan": d.plan.to_dict(),
            "predicted_samples_per_s": None if est is None else est.samples_per_s}
