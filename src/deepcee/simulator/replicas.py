"""Plans with several replicas, every strategy, over time (torch-free).

:func:`simulate_replicas` runs any plan for ``steps`` steps and returns a
:class:`ReplicaSimResult`. Each replica runs its own pipeline (:mod:`.pipelines`, the
engine's interpreter and cost tables, step after step); what joins replicas runs on one
event loop and one shared network (:mod:`.network`: messages FIFO per link pipe, collectives
holding their pipes, server queues), built as message graphs (:mod:`.strategies`). There is a
global barrier only where the strategy has one:

- ``exact``: every step, all replicas run their pipeline from the same start; each layer
  segment's gradients are combined over all its holders in every replica
  ([Note: layer segments (simulator)]) by the segment's sync (all-reduce or parameter
  servers, [Note: ps sync (simulator)]); then every device's optimizer step; the next step
  starts when the last one ends (as in the engine). A one-replica exact plan is the engine's
  :func:`~deepcee.simulator.engine.simulate`, unchanged (stragglers: one engine iteration at a
  time on the cluster with the slowdowns in force at its start);
- ``model-averaging``, ``asgd-ga``, ``partial``: each replica runs local steps on its own
  clock and meets the others only as its rule says ([Note: relaxed rules (simulator)]);
  overlapped model averaging does not block at a sync point, it waits at the next one for
  what has not arrived ([Note: overlapped averaging (simulator)] in :mod:`.overlap`).

``steps`` counts what the runtime's ``--steps`` counts: global steps (exact), local steps of
every replica (model averaging, ASGD-GA) or rounds (partial).

Figures: per replica, the end of every local step; ``samples_per_s`` is the sum over replicas
of the samples each processed over its own span (start to its last step's end: the rate each
sustains, which ignores the tail in which slower replicas finish alone);
``window_samples_per_s`` is the runtime's measure (samples of the steps that end after every
replica's first step, over that window). Per replica, ``wan_fraction`` is the share of its
span spent in cross-replica synchronisation from the moment it could start (transfers,
collectives, server work and queues) and ``wait_fraction`` the share spent waiting for other
replicas to arrive, for the partial coordinator, or for a server held back by the staleness
bound. Per device: busy (compute, optimizer), sync (its replica's own stage all-reduce),
comm_wait (blocked pipeline receives), cross (cross-replica synchronisation) and idle.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from deepcee.cluster import Cluster, Device
from deepcee.cluster.stragglers import Straggler, slowdown_at
from deepcee.errors import PlanError
from deepcee.plan import Plan
from deepcee.profile import ModelProfile
from deepcee.simulator.engine import Event, simulate
from deepcee.simulator.network import Loop, NetEvent, Network
from deepcee.simulator.overlap import run_overlapped_averaging
from deepcee.simulator.pipelines import ReplicaPipeline, layer_segments, segment_sync
from deepcee.simulator.runtime_model import runtime_for
from deepcee.simulator.strategies import (
    GroupRecord,
    PushRecord,
    run_asgd_ga,
    run_exact,
    run_model_averaging,
    run_partial,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaSimResult:
    """What a simulation of a (replicated) plan measured. See the module docstring."""

    semantics: str
    strategy: str
    """:meth:`~deepcee.plan.Strategy.describe` of the plan's strategy."""
    start_s: float
    end_s: float
    step_ends_s: tuple[tuple[float, ...], ...]
    """Per replica, the end of each of its local steps (global steps for ``exact``)."""
    replica_batches: tuple[int, ...]
    samples_per_s: float
    window_samples_per_s: float
    wan_s: tuple[float, ...]
    wait_s: tuple[float, ...]
    busy_s: Mapping[str, float]
    sync_s: Mapping[str, float]
    comm_wait_s: Mapping[str, float]
    cross_s: Mapping[str, float]
    idle_s: Mapping[str, float]
    peak_memory_bytes: Mapping[str, float]
    egress_bytes: Mapping[str, float]
    """Island -> bytes sent out of it over the run (pipeline, all-reduces, messages)."""
    groups: tuple[GroupRecord, ...] = ()
    pushes: tuple[PushRecord, ...] = ()
    events: tuple[Event, ...] = ()
    sync_events: tuple[NetEvent, ...] = ()
    bottleneck: str = ""

    def __post_init__(self) -> None:
        if not self.step_ends_s or any(not ends for ends in self.step_ends_s):
            raise ValueError(f"every replica needs at least one step, got {self.step_ends_s}")

    @property
    def steps(self) -> tuple[int, ...]:
        """Local steps each replica ran."""
        return tuple(len(e) for e in self.step_ends_s)

    @property
    def step_times_s(self) -> tuple[tuple[float, ...], ...]:
        """Per replica, the time of each local step (from the previous step's end)."""
        return tuple(tuple(b - a for a, b in zip((self.start_s, *ends), ends, strict=False))
                     for ends in self.step_ends_s)

    @property
    def spans_s(self) -> tuple[float, ...]:
        return tuple(ends[-1] - self.start_s for ends in self.step_ends_s)

    @property
    def iteration_s(self) -> float:
        """Time per global batch's worth of samples at ``samples_per_s``."""
        return sum(self.replica_batches) / self.samples_per_s if self.samples_per_s > 0 else math.inf

    @property
    def wan_fraction(self) -> float:
        """Share of all replicas' time spent in cross-replica synchronisation."""
        return sum(self.wan_s) / sum(self.spans_s) if sum(self.spans_s) > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        return sum(self.wait_s) / sum(self.spans_s) if sum(self.spans_s) > 0 else 0.0

    def egress_bytes_per_sample(self) -> Mapping[str, float]:
        done = sum(n * b for n, b in zip(self.steps, self.replica_batches, strict=True))
        return {k: v / done for k, v in self.egress_bytes.items()}


class Run:
    """The state a simulation shares: loop, network, replica pipelines and the records."""

    def __init__(self, plan: Plan, cluster: Cluster, model: ModelProfile, *, stragglers: Sequence[Straggler] = (),
                 record: bool = False, start_s: float = 0.0) -> None:
        self.plan, self.cluster, self.model, self.record, self.start_s = plan, cluster, model, record, start_s
        self.stragglers = tuple(stragglers)
        self.loop = Loop()
        self.loop.now = start_s
        self.net = Network(cluster, record=record, runtime=runtime_for(cluster, model))
        self.pipes = [ReplicaPipeline(plan, r, cluster, model, stragglers=stragglers, record=record)
                      for r in range(plan.num_replicas)]
        self.segments = layer_segments(plan)
        n = plan.num_replicas
        self.step_ends: list[list[float]] = [[] for _ in range(n)]
        self.wan_s, self.wait_s = [0.0] * n, [0.0] * n
        self.groups: list[GroupRecord] = []
        self.pushes: list[PushRecord] = []
        self.server_memory: dict[str, float] = defaultdict(float)
        self.egress: dict[str, float] = defaultdict(float)

    def device(self, name: str) -> Device:
        return self.cluster.device(name)

    def step_done(self, r: int, t: float) -> None:
        self.step_ends[r].append(t)

    def crossed(self, r: int, arrive_s: float, begin_s: float, resume_s: float) -> None:
        """Replica ``r`` arrived at a synchronisation at ``arrive_s``, it could begin at
        ``begin_s`` (others arrived, the group formed) and ``r`` resumed at ``resume_s``."""
        begin_s = min(max(begin_s, arrive_s), resume_s)
        self.wait_s[r] += begin_s - arrive_s
        self.wan_s[r] += resume_s - begin_s

    def server_of(self, device: str) -> str:
        """The server a device talks to: its island's, else the one with the lowest latency
        (the runtime's [Note: server ranks])."""
        servers = self.plan.servers
        if not servers:
            raise PlanError("parameter-server sync needs server devices", field="servers")
        if device in servers:
            return device
        island = self.device(device).island
        same = [s for s in servers if self.device(s).island == island]
        if same:
            return same[0]
        return min(servers, key=lambda s: (self.cluster.link(device, s).latency_s, servers.index(s)))

    def server_flops(self, device: str, at_s: float) -> float:
        return self.cluster.effective_flops_per_s(device) / slowdown_at(self.stragglers, device, at_s)

    def result(self) -> ReplicaSimResult:
        plan = self.plan
        ends = [tuple(e) for e in self.step_ends]
        end_s = max(e[-1] for e in ends)
        rate = sum(len(e) * rep.batch / (e[-1] - self.start_s) for e, rep in zip(ends, plan.replicas, strict=True)
                   if e[-1] > self.start_s)
        busy, sync, wait, cross, idle = {}, {}, {}, {}, {}
        for r, pipe in enumerate(self.pipes):
            span = ends[r][-1] - self.start_s
            for d, name in enumerate(pipe.devices):
                busy[name], sync[name], wait[name] = pipe.busy_s[d], pipe.sync_s[d], pipe.wait_s[d]
                cross[name] = self.wan_s[r] + self.wait_s[r]
                idle[name] = max(0.0, span - busy[name] - sync[name] - wait[name] - cross[name])
        memory: dict[str, float] = {}
        for pipe in self.pipes:
            memory.update(pipe.peak_memory())
        for d, b in self.server_memory.items():
            memory[d] = memory.get(d, 0.0) + b
        egress = defaultdict(float, self.net.egress_bytes)
        for k, v in self.egress.items():
            egress[k] += v
        return ReplicaSimResult(
            semantics=plan.semantics, strategy=plan.strategy.describe(), start_s=self.start_s, end_s=end_s,
            step_ends_s=tuple(ends), replica_batches=tuple(rep.batch for rep in plan.replicas), samples_per_s=rate,
            window_samples_per_s=window_rate(ends, [rep.batch for rep in plan.replicas]),
            wan_s=tuple(self.wan_s), wait_s=tuple(self.wait_s), busy_s=busy, sync_s=sync, comm_wait_s=wait,
            cross_s=cross, idle_s=idle, peak_memory_bytes=memory, egress_bytes=dict(egress),
            groups=tuple(self.groups), pushes=tuple(self.pushes),
            events=tuple(e for pipe in self.pipes for e in pipe.events) if self.record else (),
            sync_events=tuple(self.net.events), bottleneck=self._bottleneck())

    def _bottleneck(self) -> str:
        spans = [e[-1] - self.start_s for e in self.step_ends]
        r = max(range(len(spans)), key=lambda i: self.wan_s[i] + self.wait_s[i])
        if spans[r] <= 0 or self.wan_s[r] + self.wait_s[r] <= 0:
            return "none outside the replicas' own pipelines"
        return (f"replica {r}: {self.wan_s[r] / spans[r]:.0%} of its time in cross-replica synchronisation, "
                f"{self.wait_s[r] / spans[r]:.0%} waiting for others")


def window_rate(ends: Sequence[Sequence[float]], batches: Sequence[int]) -> float:
    """Samples of the steps that end after every replica finished its first step, over that
    window (the runtime's measure); the whole run's rate when the window is empty."""
    t_a = max(e[0] for e in ends)
    t_b = max(e[-1] for e in ends)
    if t_b <= t_a:
        total = sum(len(e) * b for e, b in zip(ends, batches, strict=True))
        return total / t_b if t_b > 0 else math.inf
    done = sum(b for e, b in zip(ends, batches, strict=True) for t in e if t_a < t <= t_b)
    return done / (t_b - t_a)


def simulate_replicas(plan: Plan, cluster: Cluster, model: ModelProfile, *, steps: int = 1,
                      stragglers: Sequence[Straggler] = (), start_s: float = 0.0,
                      record: bool = False) -> ReplicaSimResult:
    """Simulate ``steps`` steps of any plan. See the module docstring."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    plan.check_against(num_layers=model.num_layers, device_names=cluster.device_names)
    for s in stragglers:
        cluster.device(s.device)
    if plan.num_replicas == 1 and plan.strategy.kind == "exact":
        return _one_pipeline(plan, cluster, model, steps, stragglers, start_s, record)
    check_syncs(plan)
    run = Run(plan, cluster, model, stragglers=stragglers, record=record, start_s=start_s)
    runner = {"exact": run_exact, "model-averaging": run_model_averaging,
              "asgd-ga": run_asgd_ga, "partial": run_partial}[plan.strategy.kind]
    if plan.strategy.overlap:
        runner = run_overlapped_averaging
    runner(run, steps)
    run.loop.run()
    for r, ends in enumerate(run.step_ends):
        if not ends:
            raise PlanError(f"replica {r} ran no step (the strategy never let it start)", field="strategy")
    for pipe in run.pipes:
        for island, b in pipe.pass_egress_bytes.items():
            run.egress[island] += b * pipe.passes
        for island, b in pipe.stage_egress().items():
            run.egress[island] += b * pipe.stage_rounds
    result = run.result()
    log.debug("simulated %s (%s) over %d replicas: %.4g samples/s, WAN %.1f%%", plan.system, plan.strategy.kind,
              plan.num_replicas, result.samples_per_s, 100 * result.wan_fraction)
    return result


def _one_pipeline(plan: Plan, cluster: Cluster, model: ModelProfile, steps: int, stragglers: Sequence[Straggler],
                  start_s: float, record: bool) -> ReplicaSimResult:
    """The engine, unchanged; with stragglers one iteration at a time on the slowed cluster."""
    mine = [s for s in stragglers if s.device in plan.devices]
    if not mine:
        results = [simulate(plan, cluster, model, start_s=start_s, iterations=steps, record=record)]
    else:
        results, t = [], start_s
        for _ in range(steps):
            results.append(simulate(plan, _slowed(cluster, mine, t), model, start_s=t, iterations=1, record=record))
            t = results[-1].end_s
    ends, t = [], start_s
    for res in results:
        for it in res.iteration_times_s:
            t += it
            ends.append(t)
    keys = results[0].busy_s.keys()
    total = {name: {d: sum(getattr(res, name)[d] for res in results) for d in keys}
             for name in ("busy_s", "sync_s", "comm_wait_s", "idle_s")}
    egress: dict[str, float] = defaultdict(float)
    pipe = ReplicaPipeline(plan, 0, cluster, model)
    for part in (pipe.pass_egress_bytes, pipe.stage_egress()):
        for island, b in part.items():
            egress[island] += b * steps
    return ReplicaSimResult(
        semantics="exact", strategy=plan.strategy.describe(), start_s=start_s, end_s=ends[-1],
        step_ends_s=(tuple(ends),), replica_batches=(plan.global_batch,),
        samples_per_s=steps * plan.global_batch / (ends[-1] - start_s) if ends[-1] > start_s else math.inf,
        window_samples_per_s=window_rate([ends], [plan.global_batch]), wan_s=(0.0,), wait_s=(0.0,),
        busy_s=total["busy_s"], sync_s=total["sync_s"], comm_wait_s=total["comm_wait_s"],
        cross_s=dict.fromkeys(keys, 0.0), idle_s=total["idle_s"], peak_memory_bytes=results[0].peak_memory_bytes,
        egress_bytes=dict(egress), events=tuple(e for res in results for e in res.events),
        bottleneck=results[-1].bottleneck)


def _slowed(cluster: Cluster, stragglers: Sequence[Straggler], t_s: float) -> Cluster:
    """``cluster`` with every device's slowdown times the stragglers' factors in force at ``t_s``."""
    devices = tuple(replace(d, slowdown=d.slowdown * slowdown_at(stragglers, d.name, t_s)) for d in cluster.devices)
    return replace(cluster, devices=devices)


def describe_result(result: ReplicaSimResult, plan: Plan, stragglers: Sequence[Straggler] = ()) -> list[str]:
    """The result in lines for reports: semantics, each replica, the rates, memory."""
    out = [f"{plan.num_replicas} replica(s), semantics {plan.semantics}: {plan.strategy.describe()}"]
    for r, rep in enumerate(plan.replicas):
        times, span = result.step_times_s[r], result.spans_s[r] or 1.0
        out.append(f"replica {r}: {len(rep.devices)} devices, {rep.num_stages} stages, batch {rep.batch}, "
                   f"{len(times)} local steps, mean {sum(times) / len(times) * 1e3:.2f} ms; "
                   f"{result.wan_s[r] / span:.1%} in cross-replica sync, {result.wait_s[r] / span:.1%} waiting "
                   "for others")
    out.append(f"simulated: {result.samples_per_s:.2f} samples/s (the runtime's window measure: "
               f"{result.window_samples_per_s:.2f}); {result.wan_fraction:.1%} of the replicas' time in "
               f"cross-replica synchronisation, {result.wait_fraction:.1%} waiting for others")
    if plan.semantics == "relaxed":
        out.append("relaxed semantics: samples/s are not comparable with exact plans' without the steps-to-target "
                   "multiplier (deepcee plan --sync relaxed predicts time to target)")
    if stragglers:
        out.append("stragglers: " + ", ".join(f"{s.device} x{s.factor:g} from {s.start_s:g} s to {s.stop_s:g} s"
                                              for s in stragglers))
    out.append("peak memory (GiB): " + ", ".join(f"{d} {b / 2**30:.2f}" for d, b in result.peak_memory_bytes.items()))
    return out


def check_syncs(plan: Plan) -> None:
    """Refuse what no runtime can run: ``none`` on layers with several holders."""
    if plan.strategy.kind != "exact":
        return
    for seg in layer_segments(plan):
        if segment_sync(plan, seg) == "none" and len(seg.devices) > 1:
            raise PlanError(f"sync 'none' but layers [{seg.start}, {seg.stop}) are held by {list(seg.devices)}, "
                            "whose copies would drift apart", field="sync")


__all__ = ["GroupRecord", "PushRecord", "ReplicaSimResult", "Run", "check_syncs", "describe_result", "simulate_replicas",
           "window_rate"]
