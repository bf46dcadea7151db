"""How replicas agree on parameters, one rank's side: the plan's strategy over its sync.

The trainer (:mod:`deepcee.runtime.trainer`) runs a step's schedule row; this module does the
rest of the step for the plan's :class:`~deepcee.plan.Strategy`:

- ``exact``: :func:`sync_exact` combines each layer segment's gradients over ALL its holders
  in every replica ([Note: layer segments] in :mod:`deepcee.runtime.partition`), by the
  segment's sync (ring or hierarchical all-reduce, ZeRO-2 run as an all-reduce, or the
  parameter servers of [Note: ps sync] in :mod:`deepcee.runtime.ps`); with the loss weighting
  of [Note: loss weighting] this is the single-process gradient; then one optimizer step.
- the relaxed rules run their own loop (:func:`run_relaxed`, one record per local step,
  gathered once at the end so that no global barrier appears where the rule has none).
  Each replica sums gradients over its own stages' devices only (its batch's mean), then:

  - ``model-averaging`` (:class:`ModelAveraging`): its own optimizer step; every ``period``
    local steps all replicas combine their parameters per segment ([Note: deterministic
    averaging] in :mod:`deepcee.runtime.replicas`): plain mean, or DiLoCo's outer step
    ([Note: outer nesterov]); with ``overlap`` (:class:`OverlappedAveraging`) the combination
    runs while the next period's local steps do and lands one period late ([Note: overlapped
    averaging] in :mod:`deepcee.runtime.overlap`);
  - ``asgd-ga`` (:class:`AsgdGa`): no local optimizer; gradients summed over ``k`` local
    steps, pushed to the parameter servers, the servers' model pulled ([Note: asgd-ga]);
  - ``partial`` (:class:`Partial`): its own optimizer step, then the group the coordinator
    gives it averages ([Note: partial averaging] in :mod:`deepcee.runtime.coordinator`).

[Note: outer nesterov]
DiLoCo's outer optimizer, per segment, at the segment's root (it alone keeps the state):
``anchor`` is the segment's parameters after the previous average (the initial ones at
first), ``delta = mean over replicas (in order) of (anchor - theta_r)``, then SGD with
Nesterov momentum as ``torch.optim.SGD(nesterov=True)`` does it: ``buf = delta`` the first
time, else ``buf = mu * buf + delta``; ``anchor = anchor - lr * (delta + mu * buf)``; every
holder takes the new anchor as its parameters. The inner optimizers keep their state.

[Note: probe evaluations]
A model-averaging run evaluates only right after an average (every replica then holds one
model), so with a long period its first evaluation comes late and the evaluation curve cannot
be compared with a synchronous run's at the same samples. A *probe* fills the gap: after local
step ``k`` with ``k + 1`` a multiple of ``eval_every`` but not of the period, each rank keeps a
copy of its parameters (the snapshot). The probes are taken later, at the next point where the
replicas meet anyway: right after the next average (before any evaluation), or after the run's
last step. There every replica combines each snapshot exactly as an average would have then
(plain: the mean; outer Nesterov: the outer step from the anchor and momentum as they were
before this average, nothing stored), evaluates that model like an evaluation ([Note:
evaluation data]), and finally puts its own parameters back, bit for bit. Deferring keeps the
run's pace: a probe taken at step ``k`` would make every replica wait for the slowest at every
multiple of ``eval_every``, a meeting the run without probes does not have. Nothing the run
trains changes (parameters, inner and outer optimizer state, data order); the probes'
messages and forward passes fall between ``end_wall`` and ``resume_wall`` like an
evaluation's, so they are not counted in any step. Each loss is recorded on its own step
``k`` as ``probe_loss`` (never ``eval_loss``) and never stops the run at the target: only
models the replicas really hold are judged. Cost: one copy of a rank's parameters per
pending probe (``period // eval_every`` at most). Overlapped averaging takes no probes: its
rounds in flight use the same messages, and "the model the replicas would hold" there
depends on a round that has not landed (:meth:`OverlappedAveraging.probes`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.plan import Plan
from deepcee.runtime import coordinator as coord
from deepcee.runtime.evaluation import evaluate
from deepcee.runtime.executor import run_step
from deepcee.runtime.overlap import Rounds
from deepcee.runtime.partition import Segment, Topology
from deepcee.runtime.ps import (
    AppliedPush,
    AsgdServer,
    asgd_push_pull,
    push_pull_gradients,
    segment_holders_of_server,
    serve_ps_segment,
    server_rank_of,
)
from deepcee.runtime.records import RankMetrics, StepMetrics, step_metrics
from deepcee.runtime.replica_records import ReplicaGroup, ServerPush, StrategyRun
from deepcee.runtime.replicas import (
    Messenger,
    SegmentParams,
    allreduce_gradients,
    mean_in_order,
    star_mean,
)
from deepcee.runtime.target import reached

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer

log = logging.getLogger(__name__)

ALLREDUCE_SYNCS = ("allreduce-ring", "allreduce-hier", "zero2")


def segment_sync(plan: Plan, seg: Segment) -> str:
    """The sync of a segment: its stages' own (HeteroG) or the plan's; replicas must agree."""
    kinds = {plan.replicas[r].stages[s].sync or plan.sync for r, s in enumerate(seg.stages)}
    if len(kinds) > 1:
        raise RuntimeSetupError(f"layers [{seg.start}, {seg.stop}) are synchronised by {sorted(kinds)} in different "
                                "replicas; their holders must use one")
    return kinds.pop()


def make_sync_groups(plan: Plan, topo: Topology, make_group: Callable[[tuple[int, ...]], Any]) -> dict[tuple, Any]:
    """The gradient all-reduce groups of ``plan``; every rank calls this, in one order."""
    groups: dict[tuple, Any] = {}
    if plan.strategy.kind == "exact":
        for j, seg in enumerate(topo.segments()):
            if len(seg.ranks) > 1 and segment_sync(plan, seg) in ALLREDUCE_SYNCS:
                groups[("segment", j)] = make_group(seg.ranks)
        return groups
    for r, rep in enumerate(plan.replicas):
        for s in range(rep.num_stages):
            if len(topo.stage_ranks(s, r)) > 1:
                groups[("stage", r, s)] = make_group(topo.stage_ranks(s, r))
    return groups


def check_sync(plan: Plan, topo: Topology) -> None:
    """Reject what cannot run: ``none`` on a layer with several holders, ties across replicas."""
    shared = topo.segments() if plan.strategy.kind == "exact" else ()
    for seg in shared:
        if segment_sync(plan, seg) == "none" and len(seg.ranks) > 1:
            raise RuntimeSetupError(f"plan has sync 'none' but layers [{seg.start}, {seg.stop}) are held by ranks "
                                    f"{list(seg.ranks)}, whose copies would drift apart")
    if plan.strategy.kind != "exact":
        for r, rep in enumerate(plan.replicas):
            for s, st in enumerate(rep.stages):
                if (st.sync or plan.sync) == "none" and len(st.devices) > 1:
                    raise RuntimeSetupError(f"plan has sync 'none' but replicas[{r}].stages[{s}] runs on "
                                            f"{list(st.devices)}, whose copies would drift apart")


# -- exact ----------------------------------------------------------------------------------


def _elastic_waiter(t: Trainer) -> Any:
    """An elastic run's waiter (it watches for lost peers), else ``None`` (a plain blocking wait)."""
    return t.w.waiter if t.w.waiter.out_of_band else None


def sync_exact(t: Trainer) -> float:
    """Every segment this rank holds: gradients summed over all holders. Returns wall seconds."""
    t0 = t.clock.wall()
    for j, seg in t.my_segments:
        kind = segment_sync(t.plan, seg.segment)
        if len(seg.segment.ranks) == 1 or kind == "none":
            continue
        if kind == "ps":
            push_pull_gradients(t.messenger, seg, server_rank_of(t.topo, t.cluster, t.placement.device))
            continue
        devices = tuple(t.topo.device_of(r) for r in seg.segment.ranks)
        allreduce_gradients(seg, t.sync_groups[("segment", j)], timeout_s=t.cfg.timeout_s,
                            describe=t.topo.describe(t.w.rank), clock=t.clock,
                            pace=t.pace_for(devices, kind), waiter=_elastic_waiter(t))
    return t.clock.wall() - t0


def serve_exact_step(t: Trainer) -> None:
    """A server rank's part of one exact step: every ``ps`` segment, in layer order ([Note: ps sync])."""
    servers = sorted(t.topo.server_ranks.values())
    for seg in t.topo.segments():
        if len(seg.ranks) == 1 or segment_sync(t.plan, seg) != "ps":
            continue
        holders = segment_holders_of_server(t.topo, t.cluster, seg, t.w.rank)
        serve_ps_segment(t.messenger, SegmentParams.of(seg, t.blocks), holders, servers)


# -- relaxed ----------------------------------------------------------------------------------


def sync_in_replica(t: Trainer) -> float:
    """Gradients summed over the devices of this rank's stage (its replica's batch mean)."""
    p = t.placement
    group = t.sync_groups.get(("stage", p.replica, p.stage))
    if group is None:
        return 0.0
    t0 = t.clock.wall()
    rep = t.plan.replicas[p.replica]
    st = rep.stages[p.stage]
    ranks = t.topo.stage_ranks(p.stage, p.replica)
    seg = SegmentParams(segment=Segment(start=st.layer_start, stop=st.layer_stop, holders=(ranks,), stages=(p.stage,)),
                        params=t.stage.params)
    kind = st.sync or t.plan.sync
    allreduce_gradients(seg, group, timeout_s=t.cfg.timeout_s, describe=t.topo.describe(t.w.rank), clock=t.clock,
                        pace=t.pace_for(st.devices, kind if kind in ALLREDUCE_SYNCS else "allreduce-ring"),
                        waiter=_elastic_waiter(t))
    return t.clock.wall() - t0


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalStep:
    """One local step of one rank under a relaxed strategy (wall seconds)."""

    replica: int
    step: int
    metrics: RankMetrics
    start_wall: float
    end_wall: float
    comm_s: float
    """Averaging, pushing and pulling after the step (not in ``metrics.sync_s``)."""
    eval_loss: float | None = None
    """The evaluation after this step (``model-averaging`` only, right after an average)."""
    probe_loss: float | None = None
    """The probe of the average after this step, taken later ([Note: probe evaluations])."""
    off_clock: bool = False
    """Whether an evaluation or probes ran between ``end_wall`` and ``resume_wall``."""
    resume_wall: float = 0.0
    """When the next local step could start: ``end_wall`` plus evaluations and probes (not counted)."""


@dataclass(slots=True)
class RelaxedRun:
    """What one rank brings to the end-of-run gather under a relaxed strategy."""

    rank: int
    steps: list[LocalStep] = field(default_factory=list)
    pushes: list[AppliedPush] = field(default_factory=list)
    groups: list[coord.GroupRecord] = field(default_factory=list)
    averages: int = 0


class _Runner(ABC):
    """The per-rank part of a relaxed strategy: what happens after a local step's gradients."""

    def __init__(self, t: Trainer) -> None:
        self.t = t
        self.replica = t.placement.replica
        self.averages = 0

    def more(self, k: int) -> bool:
        """Whether local step ``k`` runs."""
        return k < self.t.cfg.steps

    def zero_grad(self, k: int) -> None:
        self.t.stage.zero_grad()

    @abstractmethod
    def after_step(self, k: int) -> float:
        """What follows local step ``k`` (average, push, group round); returns its seconds."""

    def evaluates(self, k: int) -> bool:
        """Whether an evaluation follows local step ``k`` (only where every replica holds the same model)."""
        return False

    def evaluate(self) -> float:
        """The evaluation loss of the model the replicas agree on (every rank calls it together)."""
        return evaluate(self.t)

    def probes(self, k: int) -> bool:
        """Whether local step ``k`` gets a probe of the average ([Note: probe evaluations])."""
        return False

    def take_probes(self, k: int) -> dict[int, float]:
        """The probes due after local step ``k``: step index -> loss (every rank calls it together)."""
        return {}

    def finish(self, run: RelaxedRun) -> None:
        run.averages = self.averages


class ModelAveraging(_Runner):
    """``model-averaging``: plain or outer Nesterov every ``period`` local steps."""

    def __init__(self, t: Trainer) -> None:
        super().__init__(t)
        self.all = tuple(range(t.plan.num_replicas))
        self.outer: dict[int, dict[str, torch.Tensor]] = {}
        self.pending: list[tuple[int, list[torch.Tensor]]] = []
        """Probes to take: (local step, this rank's parameters per segment then)."""
        self.outer_before: dict[int, dict[str, torch.Tensor]] | None = None
        """The outer state before the latest average, while probes from before it are pending."""

    def after_step(self, k: int) -> float:
        self.t.optimizer.step()
        if self.probes(k):
            self.pending.append((k, [seg.flat_values() for _, seg in self.t.my_segments]))
        if (k + 1) % self.t.plan.strategy.period:
            return 0.0
        if self.pending:  # their outer step is the one before this average ([Note: probe evaluations])
            self.outer_before = {j: {n: v.clone() for n, v in st.items()} for j, st in self.outer.items()}
        t0 = self.t.clock.wall()
        for j, seg in self.t.my_segments:
            combine = self._nesterov(j, seg) if self.t.plan.strategy.outer_optimizer == "nesterov" else None
            seg.set_values(star_mean(self.t.messenger, seg.segment, self.all, seg.flat_values(), combine))
        self.averages += 1
        return self.t.clock.wall() - t0

    def probes(self, k: int) -> bool:
        # every rank computes the same answer from the config, so all take part together
        every, done = self.t.cfg.eval_every, k + 1
        on = self.t.cfg.probes is not False and bool(every)
        return on and done % every == 0 and done % self.t.plan.strategy.period != 0

    def take_probes(self, k: int) -> dict[int, float]:
        """[Note: probe evaluations]: right after an average or the run's last step, each pending
        snapshot's would-be average evaluated; this rank's own parameters put back."""
        if not self.pending or ((k + 1) % self.t.plan.strategy.period and k + 1 < self.t.cfg.steps):
            return {}
        nesterov = self.t.plan.strategy.outer_optimizer == "nesterov"
        states = self.outer if self.outer_before is None else self.outer_before
        own = [(seg, seg.flat_values()) for _, seg in self.t.my_segments]
        out = {}
        try:
            for step, snapshot in self.pending:
                for (j, seg), values in zip(self.t.my_segments, snapshot, strict=True):
                    combine = self._nesterov(j, commit=False, states=states) if nesterov else None
                    seg.set_values(star_mean(self.t.messenger, seg.segment, self.all, values, combine))
                out[step] = evaluate(self.t)
        finally:
            for seg, values in own:
                seg.set_values(values)
            self.pending, self.outer_before = [], None
        return out

    def evaluates(self, k: int) -> bool:
        # right after an average (all replicas hold the same model), the first at or after each
        # multiple of eval_every: every rank computes the same answer, so all evaluate together
        every, period = self.t.cfg.eval_every, self.t.plan.strategy.period
        done = k + 1
        return bool(every) and done % period == 0 and done // every > (done - period) // every

    def _nesterov(self, j: int, seg: SegmentParams | None = None, *, commit: bool = True,
                  states: dict[int, dict[str, torch.Tensor]] | None = None,
                  ) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        """[Note: outer nesterov] at the segment's root (called there only); ``commit=False``:
        the step's result only, from ``states`` (default: the current outer state), left as it is (a probe)."""
        s = self.t.plan.strategy
        state = (self.outer if states is None else states).get(j) or {"anchor": self.t.initial_values[j].clone()}
        if commit:
            self.outer[j] = state

        def combine(thetas: list[torch.Tensor]) -> torch.Tensor:
            delta = mean_in_order([state["anchor"] - th for th in thetas])
            buf = state.get("buf")
            if buf is None:
                buf = delta.clone()
            else:
                buf = buf.mul_(s.outer_momentum).add_(delta) if commit else buf * s.outer_momentum + delta
            anchor = state["anchor"] - s.outer_lr * (delta + s.outer_momentum * buf)
            if commit:
                state["buf"], state["anchor"] = buf, anchor
            return anchor

        return combine


class OverlappedAveraging(ModelAveraging):
    """``model-averaging`` with ``overlap``: rounds in flight during local steps ([Note: overlapped averaging])."""

    def __init__(self, t: Trainer) -> None:
        super().__init__(t)
        self.rounds = Rounds(t.messenger, t.my_segments, t.plan.num_replicas, self._combine, t.initial_values)

    def _combine(self, j: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        return self._nesterov(j) if self.t.plan.strategy.outer_optimizer == "nesterov" else mean_in_order

    def after_step(self, k: int) -> float:
        self.t.optimizer.step()
        t0 = self.t.clock.wall()
        at_sync, last = (k + 1) % self.t.plan.strategy.period == 0, k + 1 == self.t.cfg.steps
        if at_sync or last:  # the run's last step ends with a blocking sync point
            self.rounds.sync_point()
            self.averages += 1
            if last:
                self.rounds.finish()
        else:
            self.rounds.poll()  # a root combines a round whose copies all arrived
        return self.t.clock.wall() - t0

    def probes(self, k: int) -> bool:
        return False  # refused when asked for (check_relaxed): see [Note: probe evaluations]

    def evaluate(self) -> float:
        """``anchor_k``, the model every replica knows at a sync point; the replicas' own copies are put back."""
        own = [(seg, seg.flat_values().clone()) for _, seg in self.t.my_segments]
        self.rounds.set_anchor()
        try:
            return evaluate(self.t)
        finally:
            for seg, values in own:
                seg.set_values(values)

    def finish(self, run: RelaxedRun) -> None:
        if self.rounds.pending is not None:  # stopped at the target: drain, keep the evaluated anchor
            evaluated = dict(self.rounds.anchor)
            self.rounds.take()
            self.rounds.anchor = evaluated
            self.rounds.set_anchor()
        super().finish(run)


class AsgdGa(_Runner):
    """``asgd-ga``: push every ``k`` local steps' gradients, pull the servers' model ([Note: asgd-ga])."""

    def zero_grad(self, k: int) -> None:
        if k % self.t.plan.strategy.accumulation_steps == 0:
            self.t.stage.zero_grad()

    def after_step(self, k: int) -> float:
        acc = self.t.plan.strategy.accumulation_steps
        if (k + 1) % acc and k + 1 < self.t.cfg.steps:
            return 0.0
        t0 = self.t.clock.wall()
        sync_in_replica(self.t)
        asgd_push_pull(self.t.messenger, [s for _, s in self.t.my_segments], self.replica, self.t.topo,
                       steps_run=k % acc + 1, store=self.t.w.store, job=self.t.job.name, round_=k // acc)
        self.averages += 1
        return self.t.clock.wall() - t0


class Partial(_Runner):
    """``partial``: after every local step, average with the group the coordinator forms."""

    def __init__(self, t: Trainer) -> None:
        super().__init__(t)
        self.stopped = False
        self.leader = t.topo.replica_ranks(self.replica)[0]

    def more(self, k: int) -> bool:
        return not self.stopped

    def after_step(self, k: int) -> float:
        t = self.t
        t.optimizer.step()
        t0 = t.clock.wall()
        if t.w.rank == self.leader:
            coord.announce(t.w.store, t.job.name, self.replica, k, t.clock)
        a = coord.assignment(t.w.store, t.job.name, self.replica, k, t.cfg.timeout_s)
        if len(a.members) > 1:
            for _, seg in t.my_segments:
                seg.set_values(star_mean(t.messenger, seg.segment, a.members, seg.flat_values()))
            self.averages += 1
        self.stopped = a.final
        return t.clock.wall() - t0


RUNNERS: dict[str, type[_Runner]] = {"model-averaging": ModelAveraging, "asgd-ga": AsgdGa, "partial": Partial}


def runner_for(t: Trainer) -> _Runner:
    s = t.plan.strategy
    return OverlappedAveraging(t) if s.overlap else RUNNERS[s.kind](t)


def check_relaxed(t: Trainer) -> None:
    """What relaxed runs do not support yet, refused with the reason."""
    kind = t.plan.strategy.kind
    if t.cfg.checkpoint_every or t.cfg.resume:
        raise SpecError(f"checkpoints are not supported with the relaxed strategy {kind!r} yet (replicas hold "
                        "different models, and asgd-ga/partial replicas are at different steps)", field="checkpoint")
    if t.ties:
        raise SpecError("tied parameters are not supported with several replicas yet", field="model")
    if kind != "model-averaging" and (t.cfg.eval_every or t.cfg.target_loss is not None):
        raise SpecError(f"evaluations and a target loss need every replica to hold the same model at some step; "
                        f"under {kind!r} they never do at one step (supported: model-averaging, after its "
                        "averages)", field="eval_every")
    if t.cfg.probes and kind == "model-averaging" and t.plan.strategy.overlap:
        raise SpecError("probes of the average are not taken under overlapped averaging (its rounds in flight "
                        "share the messages, and the average it would take depends on a round not yet landed); "
                        "drop --probes, or average without overlap", field="probes")


def warm_up_averaging(t: Trainer) -> float:
    """Before the run's clock starts: one averaging of zeros over the pairs and sizes the real
    averages use, in mode ``realnet``, so that the run's first average finds its TCP
    connections past slow start, as every later average does. Returns the wall seconds spent.

    [Note: warm connections before the clock]
    A fresh TCP connection starts from an initial window of 10 segments; over a 20-40 ms
    link one ~1 MB model copy then needs six to seven round trips of slow start, and the
    first average of a run took 1.2-1.3 emulated s against 0.3 s for the later ones (gpt-tiny,
    local-small, realnet, paced: [Note: paced messages over slow links] in
    :mod:`deepcee.runtime.paced`). The connections are long-lived and the namespaces keep
    their window across idle time, so only the first use pays it; in a run of a few averages
    that one-off set-up cost would dominate the measured time to target, where the simulator
    (and a long run) has none. Exchanged before the shared epoch, like the process group's own
    set-up, and reported (not hidden) in the rank's log. Mode ``real`` and ``emulated`` skip it
    (emulated links have no window; real networks are left as they are). Only model averaging
    (blocking or overlapped) warms up: its pairs are fixed; the partial strategy's groups and
    the parameter servers' pushes vary by step."""
    if t.cfg.mode != "realnet" or t.plan.strategy.kind != "model-averaging" or not t.active:
        return 0.0
    m = Messenger(rank=t.w.rank, topo=t.topo, cluster=t.cluster, torch_device=t.w.device,
                  timeout_s=t.cfg.timeout_s, pace=True, dilation=t.dilation)
    t0 = t.clock.wall()
    everyone = tuple(range(t.plan.num_replicas))
    for _, seg in t.my_segments:
        star_mean(m, seg.segment, everyone, torch.zeros_like(seg.flat_values()))
    return t.clock.wall() - t0


def run_relaxed(t: Trainer) -> RelaxedRun:
    """This rank's whole run under a relaxed strategy (see the module docstring)."""
    run = RelaxedRun(rank=t.w.rank)
    coordinator = None
    if t.plan.strategy.kind == "partial" and t.w.rank == 0:
        coordinator = coord.Coordinator(store=t.w.store, job=t.job.name, num_replicas=t.plan.num_replicas,
                                        steps=t.cfg.steps, strategy=t.plan.strategy, dilation=t.dilation,
                                        timeout_s=t.cfg.timeout_s, clock=t.clock)
        coordinator.start()
    if t.topo.is_server(t.w.rank):
        rounds = -(-t.cfg.steps // t.plan.strategy.accumulation_steps)
        run.pushes = AsgdServer(t.messenger, t.topo, t.blocks, t.cfg.optimizer.build, t.plan.strategy, rounds,
                                fixed_order=t.cfg.fixed_arrival_order, timeout_s=t.cfg.timeout_s, store=t.w.store,
                                job=t.job.name).serve()
        return run
    runner = runner_for(t)
    probe_losses: dict[int, float] = {}
    k = 0
    while runner.more(k):
        start = t.clock.wall()
        runner.zero_grad(k)
        rec = run_step(t.actions, t.stage, t.p2p, t.feeds(k), t.pacer, trace=t.cfg.trace)
        sync_s = 0.0 if t.plan.strategy.kind == "asgd-ga" else sync_in_replica(t)
        comm_s = runner.after_step(k)
        end = t.clock.wall()
        taken = runner.take_probes(k)  # before the evaluation: they may restore parameters
        probe_losses.update(taken)
        eval_loss = runner.evaluate() if runner.evaluates(k) else None
        metrics = t.rank_metrics(rec, sync_s)
        if t.cfg.trace and comm_s > 0:  # the cross-replica exchange, for timelines
            metrics = replace(metrics, trace=(*metrics.trace, (f"SYNC {t.plan.strategy.kind}", end - comm_s, end)))
        run.steps.append(LocalStep(replica=runner.replica, step=k, metrics=metrics,
                                   start_wall=start, end_wall=end, comm_s=comm_s, eval_loss=eval_loss,
                                   off_clock=eval_loss is not None or bool(taken), resume_wall=t.clock.wall()))
        k += 1
        if reached(eval_loss, t.cfg.target_loss):
            break  # the evaluation loss is all-reduced: every rank stops after the same step
    run.steps = [replace(ls, probe_loss=probe_losses.get(ls.step)) for ls in run.steps]
    runner.finish(run)
    if coordinator is not None:
        coordinator.join()
        run.groups = list(coordinator.groups)
    return run


# -- what the run reports -------------------------------------------------------------------------


def describe_sync(plan: Plan, topo: Topology) -> str:
    """One line for the result: how gradients or parameters were combined."""
    if plan.strategy.kind != "exact":
        return f"{plan.strategy.kind} across {plan.num_replicas} replicas; gradients summed inside each stage"
    kinds = sorted({segment_sync(plan, seg) for seg in topo.segments() if len(seg.ranks) > 1})
    if not kinds:
        return "none"
    what = {"ps": "parameter servers (push to the island's server, servers combine, pull)"}
    return "; ".join(what.get(k, f"{k} (gloo/nccl SUM)") for k in kinds) + (
        " over each layer segment's holders in every replica" if plan.num_replicas > 1 else
        " over each stage's devices")


def relaxed_records(gathered: list[RelaxedRun | None], t: Trainer) -> tuple[list[StepMetrics], StrategyRun]:
    """Rank 0: one record per local step index (the replicas that ran it) and the run's summary."""
    runs = [g for g in gathered if g is not None]
    plan, epoch = t.plan, t.epoch
    by_k: dict[int, list[LocalStep]] = {}
    for run in runs:
        for ls in run.steps:
            by_k.setdefault(ls.step, []).append(ls)
    records = []
    for k in sorted(by_k):
        steps = by_k[k]
        reps = sorted({x.replica for x in steps})
        # the same replicas' previous step (a slow replica's step k-1 may end after a fast one's k)
        # (an evaluation after that step is not counted: it starts from its end)
        before = [x.resume_wall for x in by_k.get(k - 1, ()) if x.replica in reps]
        prev = max(before) if before else min(x.start_wall for x in steps)
        batch = sum(plan.replicas[r].batch for r in reps)
        ranks = [replace(x.metrics, sync_s=x.metrics.sync_s + x.comm_s) for x in steps]
        ev = next((x.eval_loss for x in steps if x.eval_loss is not None), None)
        probe = next((x.probe_loss for x in steps if x.probe_loss is not None), None)
        rec = step_metrics(k, ranks, max(x.end_wall for x in steps) - prev, global_batch=batch, emulation=t.info,
                           epoch=epoch if t.cfg.trace else None, strategy=plan.strategy, eval_loss=ev,
                           probe_loss=probe)
        loss = sum(plan.replicas[x.replica].batch / batch * x.metrics.loss for x in steps)
        records.append(replace(rec, loss=loss))
    return records, _strategy_run(runs, t)


def _strategy_run(runs: list[RelaxedRun], t: Trainer) -> StrategyRun:
    plan, d, epoch = t.plan, t.dilation, t.epoch
    ends: dict[tuple[int, int], float] = {}
    combines = [0] * plan.num_replicas
    for run in runs:
        for ls in run.steps:
            ends[(ls.replica, ls.step)] = max(ends.get((ls.replica, ls.step), 0.0), ls.end_wall)
        if run.steps:
            combines[run.steps[0].replica] = max(combines[run.steps[0].replica], run.averages)
    local = [sum(1 for r, _ in ends if r == q) for q in range(plan.num_replicas)]
    t_a = max(ends.get((q, 0), float("inf")) for q in range(plan.num_replicas))
    t_b = max(ends.values(), default=float("nan"))
    done = sum(plan.replicas[r].batch for (r, _), end in ends.items() if t_a < end <= t_b)
    # evaluations and probes (all ranks at once) are not training time: from the last rank's
    # arrival at one to its end, inside the window (a rank waiting there for a slower one is still
    # counted, as at an average; an evaluation after the last step adds nothing)
    evals: dict[int, list[LocalStep]] = {}
    for run in runs:
        for ls in run.steps:
            if ls.off_clock:
                evals.setdefault(ls.step, []).append(ls)
    pauses = [max(0.0, min(min(x.resume_wall for x in e), t_b) - max(max(x.end_wall for x in e), t_a))
              for e in evals.values()]
    window = (t_b - t_a - sum(pauses)) / d
    groups = [ReplicaGroup(round=g.round, members=g.members, full=g.full, open_s=(g.open_wall - epoch) / d,
                           close_s=(g.close_wall - epoch) / d, arrivals=g.arrivals)
              for run in runs for g in run.groups]
    pushes = [ServerPush(server=t.topo.device_of(run.rank), replica=p.replica, version=p.version,
                         staleness=p.staleness, applied_s=(p.applied_s - epoch) / d)
              for run in runs for p in run.pushes]
    return StrategyRun(kind=plan.strategy.kind, local_steps=tuple(local),
                       samples=tuple(n * rep.batch for n, rep in zip(local, plan.replicas, strict=True)),
                       combines=tuple(combines), window_s=window if window > 0 else float("nan"),
                       samples_per_s=done / window if window > 0 else float("nan"),
                       groups=tuple(groups), pushes=tuple(pushes))
