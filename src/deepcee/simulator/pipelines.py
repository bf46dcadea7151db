"""One replica's pipeline over time, and the layer segments replicas share (torch-free).

:class:`ReplicaPipeline` runs one replica of a plan step after step on the one timing
interpreter (:mod:`deepcee.schedule.interpreter`), with the engine's cost tables for that
replica as a one-pipeline plan (:class:`deepcee.simulator.engine` builds them), so a
replica's pipeline pass costs exactly what the engine says it costs. A *local step* is a pass
and, when asked, the replica's own gradient all-reduce per stage (the stage's devices only,
:func:`deepcee.simulator.engine.allreduce_time_s`, as in the engine) and the optimizer step; the time a replica
spends joining other replicas is the caller's business (:mod:`deepcee.simulator.replicas`).

Time-varying speed: a :class:`~deepcee.cluster.Straggler` multiplies the compute of its
device by its factor in force when the pass (or the optimizer step) starts: steps, not
single actions, are the unit, which is exact for stretches of several steps and off by at
most one step at a stretch's edges. Link traces act as in the engine: each transfer is
serialised over the trace at its own time. A replica whose devices have no stragglers and
whose links have no traces takes the same time for every pass, so the first pass is
reused (the planner scores hundreds of local steps this way).

[Note: layer segments (simulator)]
Replicas may split layers differently, so the holders of a layer combine per *segment*: a
maximal run of layers held by the same devices in every replica (the cuts are the union of
every replica's stage boundaries); in each replica its holders are the devices of the stage
that holds it. With one replica the segments are the stages. The runtime uses the same
definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from deepcee.cluster import Cluster
from deepcee.cluster.stragglers import Straggler, slowdown_at
from deepcee.comm import ring_order
from deepcee.errors import PlanError
from deepcee.plan import Plan
from deepcee.profile import ModelProfile
from deepcee.schedule.interpreter import COMPUTE, TRANSFER, Execution
from deepcee.simulator.engine import (
    Event,
    _Simulation,
    allreduce_time_s,
    optimizer_step_s,
    peak_memory,
)
from deepcee.simulator.network import collective_egress
from deepcee.simulator.runtime_model import runtime_for

ALLREDUCE_SYNCS = ("allreduce-ring", "allreduce-hier", "zero2")


def replica_plan(plan: Plan, r: int) -> Plan:
    """Replica ``r`` of ``plan`` as a one-pipeline plan with its own batch as global batch."""
    if plan.num_replicas == 1:
        return plan
    rep = plan.replicas[r]
    return Plan(system=plan.system, cluster=plan.cluster, model=plan.model, global_batch=rep.batch,
                replicas=(rep,), sync=plan.sync, servers=plan.servers)


def stage_sync(plan: Plan, r: int, s: int) -> str:
    """The collective replica ``r``'s stage ``s`` uses among its own devices: its own sync or
    the plan's; parameter servers and ``none`` combine inside a replica with a ring."""
    kind = plan.replicas[r].stages[s].sync or plan.sync
    return kind if kind in ALLREDUCE_SYNCS else "allreduce-ring"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSegment:
    """Layers ``[start, stop)`` held by the same devices in every replica. See [Note: layer segments (simulator)]."""

    start: int
    stop: int
    stages: tuple[int, ...]
    """Per replica, the stage that holds the segment."""
    holders: tuple[tuple[str, ...], ...]
    """Per replica, the devices of that stage."""

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for hs in self.holders for d in hs)


def layer_segments(plan: Plan) -> tuple[LayerSegment, ...]:
    cuts = sorted({st.layer_stop for rep in plan.replicas for st in rep.stages} | {0})
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        stages = tuple(next(s for s, st in enumerate(rep.stages) if st.layer_start <= a < st.layer_stop)
                       for rep in plan.replicas)
        out.append(LayerSegment(start=a, stop=b, stages=stages,
                                holders=tuple(rep.stages[s].devices for rep, s in zip(plan.replicas, stages,
                                                                                         strict=True))))
    return tuple(out)


def segment_sync(plan: Plan, seg: LayerSegment) -> str:
    """How a segment's holders combine gradients; every replica's stage must agree."""
    kinds = {plan.replicas[r].stages[s].sync or plan.sync for r, s in enumerate(seg.stages)}
    if len(kinds) > 1:
        raise PlanError(f"layers [{seg.start}, {seg.stop}) are synchronised by {sorted(kinds)} in different "
                        "replicas; their holders must use one", field="replicas.stages.sync")
    return kinds.pop()


@dataclass(slots=True)
class StepTimes:
    """One local step of one replica: per device (replica order), when it finished each part."""

    start_s: float
    list_end: list[float]
    """End of the device's pipeline action list."""
    end: list[float]
    """End of the step on the device (after its stage all-reduce and optimizer, when run)."""


class ReplicaPipeline:
    """One replica run pass after pass. See the module docstring."""

    def __init__(self, plan: Plan, r: int, cluster: Cluster, model: ModelProfile, *,
                 stragglers: Sequence[Straggler] = (), record: bool = False) -> None:
        self.plan, self.r, self.cluster, self.model, self.record = plan, r, cluster, model, record
        self.rep = plan.replicas[r]
        # the pipeline's pieces and the stage all-reduces as deepcee's runtime for the cluster
        # runs them (on CPU: receive handshake, gloo's all-reduce handshakes), as the engine
        self.runtime = runtime_for(cluster, model)
        self.sim = _Simulation(replica_plan(plan, r), cluster, model, self.runtime)
        self.devices: list[str] = list(self.sim.devices)
        self.stage_of: list[int] = list(self.sim.stage_of)
        self.stragglers = tuple(s for s in stragglers if s.device in self.devices)
        self.exe = Execution(self.sim.tables, start_s=0.0, record=record, keep_stamps=False)
        n = len(self.devices)
        self.busy_s, self.wait_s, self.sync_s = [0.0] * n, [0.0] * n, [0.0] * n
        self.events: list[Event] = []
        self._slow = [cluster.device(d).slowdown for d in self.devices]
        self._kinds = [cluster.kind_of(d) for d in self.devices]
        self.constant = not self.stragglers and not self._traced()
        self._cached: tuple[list[float], list[float], list[float]] | None = None
        self._steps: dict[tuple[bool, bool], tuple] = {}
        """(sync, optimizer) -> a constant replica's first local step, for :meth:`_replay`."""
        self.passes = 0
        self.stage_rounds = 0
        """How many times the stage all-reduces ran (for the bytes they send between islands)."""
        self.pass_egress_bytes = self._pass_egress()
        """Island -> bytes one pass sends out of it (pipeline transfers between islands)."""

    def _traced(self) -> bool:
        """Whether a link the replica uses (pipeline transfers, its stage all-reduces) has a trace."""
        if any(piece[4] is not None for sends in self.sim.tables.pieces for side in sends for piece in side):
            return True
        for st in self.rep.stages:
            ring = ring_order(self.cluster, st.devices)
            if any(self.cluster.link(a, b).trace is not None for a, b in zip(ring, ring[1:] + ring[:1], strict=True)
                   if a != b):
                return True
        return False

    def _pass_egress(self) -> dict[str, float]:
        out: dict[str, float] = {}
        island = [self.cluster.device(d).island for d in self.devices]
        for d, (forward, backward) in enumerate(self.sim.tables.pieces):
            for dst, nbytes, *_ in forward + backward:
                if island[d] != island[dst]:
                    out[island[d]] = out.get(island[d], 0.0) + nbytes * self.rep.num_microbatches
        return out

    # -- one pass -----------------------------------------------------------------------------
    def run_pass(self, t0: float, step: int) -> list[float]:
        """Every device's action list from ``t0``; when each finished."""
        self.passes += 1
        if self.constant and self._cached is not None and not self.record:
            offsets, busy, wait = self._cached
            for d in range(len(self.devices)):
                self.busy_s[d] += busy[d]
                self.wait_s[d] += wait[d]
            return [t0 + x for x in offsets]
        factors = [slowdown_at(self.stragglers, d, t0) for d in self.devices]
        base = self.sim.tables
        self.exe.tables = base if all(f == 1.0 for f in factors) else replace(
            base, durations=tuple(tuple(x * f for x in dur) for dur, f in zip(base.durations, factors, strict=True)))
        busy0, wait0, first = list(self.exe.busy_s), list(self.exe.wait_s), len(self.exe.segments)
        list_end, _ = self.exe.pipeline(t0)
        busy = [b - b0 for b, b0 in zip(self.exe.busy_s, busy0, strict=True)]
        wait = [w - w0 for w, w0 in zip(self.exe.wait_s, wait0, strict=True)]
        for d in range(len(self.devices)):
            self.busy_s[d] += busy[d]
            self.wait_s[d] += wait[d]
        if self.constant and self._cached is None:
            self._cached = ([e - t0 for e in list_end], busy, wait)
        if self.record:
            self._record(first, step)
        return list_end

    def _record(self, first: int, step: int) -> None:
        names, res = self.devices, self.sim.resources
        for kind, where, text, start, end, _, nbytes, extra in self.exe.segments[first:]:
            if kind == TRANSFER:
                src, dst, issued, done = extra
                self.events.append(Event(kind="transfer", where=res[where], action=str(text), start_s=start, end_s=end,
                                         stage=self.stage_of[src], iteration=step, nbytes=nbytes, src=names[src],
                                         dst=names[dst], issued_s=issued, serialized_s=done))
            else:
                self.events.append(Event(kind="compute" if kind == COMPUTE else "wait", where=names[where],
                                         action=str(text), start_s=start, end_s=end, stage=self.stage_of[where],
                                         iteration=step))

    # -- a local step ---------------------------------------------------------------------------
    def local_step(self, t0: float, step: int, *, sync: bool = True, optimizer: bool = True) -> StepTimes:
        """A pass, then (``sync``) each stage's all-reduce among its own devices, then
        (``optimizer``) every device's optimizer step."""
        reuse = self.constant and not self.record
        cached = self._steps.get((sync, optimizer)) if reuse else None
        if cached is not None:
            return self._replay(cached, t0, sync)
        before = (list(self.busy_s), list(self.wait_s), list(self.sync_s))
        list_end = self.run_pass(t0, step)
        end = list(list_end)
        if sync:
            self.stage_allreduce(end, step)
        if optimizer:
            for d in range(len(self.devices)):
                end[d] += self.optimizer_s(d, end[d], step)
        if reuse:
            deltas = tuple([x - y for x, y in zip(now, then, strict=True)]
                           for now, then in zip((self.busy_s, self.wait_s, self.sync_s), before, strict=True))
            self._steps[(sync, optimizer)] = ([x - t0 for x in list_end], [x - t0 for x in end], deltas)
        return StepTimes(start_s=t0, list_end=list_end, end=end)

    def _replay(self, cached: tuple, t0: float, sync: bool) -> StepTimes:
        """A constant replica's local step: the first one's times and accounting, shifted."""
        list_off, end_off, deltas = cached
        for acc, delta in zip((self.busy_s, self.wait_s, self.sync_s), deltas, strict=True):
            for d, x in enumerate(delta):
                acc[d] += x
        self.passes += 1
        self.stage_rounds += sync
        return StepTimes(start_s=t0, list_end=[t0 + x for x in list_off], end=[t0 + x for x in end_off])

    def stage_allreduce(self, end: list[float], step: int) -> None:
        """Each stage's all-reduce among its devices once they all finished (``end`` updated)."""
        self.stage_rounds += 1
        for s, st in enumerate(self.rep.stages):
            members = [d for d in range(len(self.devices)) if self.stage_of[d] == s]
            begin = max(end[d] for d in members)
            nbytes = self.model.gradient_bytes(st.layer_start, st.layer_stop)
            dur = allreduce_time_s(self.cluster, st.devices, nbytes, stage_sync(self.plan, self.r, s), self.runtime,
                                   at_s=begin)  # with gloo's handshakes, as the engine
            for d in members:
                self.sync_s[d] += dur
                end[d] = begin + dur
            if self.record and dur > 0:
                self.events += [Event(kind="allreduce", where=self.devices[d], action="allreduce", start_s=begin,
                                      end_s=begin + dur, stage=s, iteration=step, nbytes=nbytes) for d in members]

    def stage_egress(self) -> dict[str, float]:
        """Island -> bytes one round of the stage all-reduces sends out of it."""
        out: dict[str, float] = {}
        for s, st in enumerate(self.rep.stages):
            nbytes = self.model.gradient_bytes(st.layer_start, st.layer_stop)
            for island, b in collective_egress(self.cluster, st.devices, nbytes, stage_sync(self.plan, self.r, s)).items():
                out[island] = out.get(island, 0.0) + b
        return out

    def optimizer_s(self, d: int, at_s: float, step: int, *, start: int | None = None, stop: int | None = None,
                    shards: int | None = None) -> float:
        """Device ``d``'s optimizer step over layers ``[start, stop)`` (default its stage) from
        ``at_s``, counted as busy time and recorded."""
        st = self.rep.stages[self.stage_of[d]]
        a = st.layer_start if start is None else start
        b = st.layer_stop if stop is None else stop
        if shards is None:
            shards = len(st.devices) if stage_sync(self.plan, self.r, self.stage_of[d]) == "zero2" else 1
        slow = self._slow[d] * slowdown_at(self.stragglers, self.devices[d], at_s)
        dur = optimizer_step_s(self.model, a, b, self._kinds[d], slow, shards=shards)
        self.busy_s[d] += dur
        if self.record:
            self.events.append(Event(kind="optimizer", where=self.devices[d], action="optimizer", start_s=at_s,
                                     end_s=at_s + dur, stage=self.stage_of[d], iteration=step))
        return dur

    def peak_memory(self) -> dict[str, float]:
        """Per device, the engine's memory model for this replica as a one-pipeline plan, each
        stage with its own sync: plan and runtime terms, recomputation included, as the exact
        search planned the replica's pipeline with (it counted the plan terms alone, without
        recomputation: a replica whose stages recompute to fit was dropped as out of memory,
        and on mixed cluster 5 of ``benchmarks/planner_mixed.py`` every replica layout was)."""
        return peak_memory(replica_plan(self.plan, self.r), self.cluster, self.model, self.runtime,
                           stage_syncs=[st.sync or self.plan.sync for st in self.rep.stages])


__all__ = ["ALLREDUCE_SYNCS", "LayerSegment", "ReplicaPipeline", "StepTimes", "layer_segments", "replica_plan",
           "segment_sync", "stage_sync"]
