"""Fast analytic estimate of any plan: iteration time, memory per device, the bottleneck.

Torch-free. The planner scores thousands of candidates with this model and confirms the best
few with the simulator (:class:`SimulatorCostModel`); both implement :class:`CostModel`.

The model, per plan (``S`` stages, ``M`` microbatches):

1. **Stage compute.** ``F``, ``I``, ``W`` and ``B`` of stage ``s`` per microbatch: the maximum
   over the stage's devices of ``model.time_s(layers of s, pass, device share, kind, slowdown)``
   (the stage waits for its slowest device; shares proportional to speed make that small).
   ``B`` is its own pass, not ``I + W``: a measured profile's fused backward costs less, and
   a measured kind pays its call overhead once per action (see :mod:`deepcee.profile`).
2. **Boundary transfers.** Between stage ``s`` and ``s+1`` every sender/receiver pair that
   shares samples (see [Note: share-based resharding] in :mod:`deepcee.plan`) moves
   ``samples x boundary bytes``; pairs on the same link resource (see [Note: link resources]
   in :mod:`deepcee.cluster`) serialise one after the other. A boundary direction becomes
   one ``(latency_s, serialization_s)`` pair: ``serialization_s`` = the busiest resource's
   bytes / bandwidth (how long the boundary is occupied), ``latency_s`` = what makes the
   delivery (the latest receiver's own pieces and latency) out of that: negative when pipes
   carry pieces for several receivers, see [Note: shared pipe delivery].
   The backward direction carries the same bytes the other way.
3. **Pipeline.** The plan's lowered schedule (:func:`deepcee.schedule.program.lowered_schedule`,
   the lists the simulator and the runtime run) timed on every device at once
   (:func:`devices_timing`, [Note: devices at once] in :mod:`deepcee.planner.lanes`): each
   device with its own ``F``/``I``/``W``/``B`` (1, taken per device), each send's pieces over
   their own pipes as the simulator issues them (the pieces of 2, not the boundary-wide pair),
   a stage ending with its last device. It is the simulator's own recursion except where a pipe
   shared by several senders is served out of the simulator's order ([Note: pipe order]), so
   exact with one device per stage, or wherever every shared pipe serves in the simulator's
   order; zero-bubble schedules get their bubble filled by ``W`` because their ``W`` actions
   are in the list. :func:`pipeline_timing` is the stage-level
   dry run on the costs of 1 and 2 (what the compact builder and tests use).
4. **Synchronisation.** Conservatively, a stage's gradient all-reduce
   (:func:`deepcee.simulator.engine.allreduce_time_s`: the ring model plus the runtime's
   handshakes) starts only after the stage finished
   its whole list (no bucketed overlap with its own backward, which split ``W`` passes and
   shares would make schedule-dependent); it does overlap with other stages' work, which
   is how 1F1B's early-finishing last stages hide theirs. Then the optimizer step
   (:func:`deepcee.simulator.engine.optimizer_step_s`) and the runtime's per-step
   bookkeeping. The iteration ends when the last stage's optimizer step ends. This is the
   simulator's order of events, with the simulator's runtime for the cluster
   (:func:`deepcee.simulator.runtime_model.runtime_for`: on CPU its receive handshake enters
   the pipeline's tables).
5. **Memory.** Per device :func:`deepcee.simulator.engine.peak_memory` (the simulator's own:
   :func:`deepcee.simulator.memory.device_memory`, plan and runtime terms, with recomputation
   where a stage recomputes) with the schedule's in-flight count per stage (:func:`deepcee.schedule.program.stage_in_flight`:
   GPipe ``M``, 1F1B/ZB-H1 ``min(S-s, M)``, ZB-H2 ``min(2(S-s)-1, M)``, compact from its
   actions), checked against ``cluster.memory_bytes``.

For the planner's layer-split search, :class:`~deepcee.planner.ranges.RangeCosts` tabulates
the same terms for every contiguous layer range ``[a, b)`` of one device set at once (numpy
matrices; see [Note: range times] in :mod:`deepcee.planner.ranges`).

What is approximate against the simulator: a pipe shared by several devices of a stage can serve
a piece before one issued earlier where the stage waits on it ([Note: pipe order] in
:mod:`deepcee.planner.lanes`); transfers of different boundaries that share one resource are not
queued behind each other; bandwidth traces are read at time 0 for the pipeline.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Protocol

import numpy as np

from deepcee.cluster import Cluster
from deepcee.plan import Estimate, Plan, StagePlan, share_overlaps
from deepcee.planner.lanes import PASSES, Pieces, boundary_pieces, devices_at_once
from deepcee.planner.ranges import RangeCosts as RangeCosts
from deepcee.planner.ranges import RangeTables as RangeTables
from deepcee.planner.ranges import largest_remainder_shares as largest_remainder_shares
from deepcee.planner.ranges import range_time_s as range_time_s
from deepcee.profile import ModelProfile
from deepcee.schedule.interpreter import Execution, LinkCost, stage_tables
from deepcee.schedule.ir import ActionKind, Schedule
from deepcee.schedule.program import lowered_schedule, stage_in_flight
from deepcee.simulator.engine import (
    _Simulation,
    allreduce_time_s,
    optimizer_step_s,
    peak_memory,
    simulate,
    to_estimate,
)
from deepcee.simulator.runtime_model import RuntimeModel, runtime_for
from deepcee.units import GIB, fmt_rate


class CostModel(Protocol):
    """Anything that scores a plan: the analytic model here, or the simulator."""

    name: str

    def estimate(self, plan: Plan, cluster: Cluster, model: ModelProfile) -> Estimate:
        """Iteration time, throughput, peak memory per device and the bottleneck of ``plan``."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryCost:
    """One stage boundary, both directions, per microbatch."""

    forward: LinkCost
    """``(latency_s, serialization_s)`` of the activation transfer, stage ``s -> s+1``."""
    backward: LinkCost
    """The same for the gradient, ``s+1 -> s``."""
    bytes_per_microbatch: float
    """Bytes of one microbatch over the boundary, all link resources together."""
    busiest_bytes: float = 0.0
    """Bytes of one microbatch on the forward direction's busiest resource (what its
    serialisation time is made of)."""
    resources: int = 1
    """Link resources (pipes) the forward direction uses."""
    link: str = ""
    """The slowest resource of the forward direction, with its bandwidth (for reports)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineTiming:
    """Result of :func:`pipeline_timing`."""

    stage_end_s: tuple[float, ...]
    """When each stage finished its list (from 0)."""
    busy_s: tuple[float, ...]
    """Sum of each stage's compute durations."""

    @property
    def makespan_s(self) -> float:
        return max(self.stage_end_s, default=0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanCost:
    """The analytic model's full breakdown of one plan."""

    forward_s: tuple[float, ...]
    input_grad_s: tuple[float, ...]
    weight_grad_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    """Fused ``B`` per stage (what ``gpipe``/``1f1b`` run; at most ``I + W``)."""
    boundaries: tuple[BoundaryCost, ...]
    pipeline: PipelineTiming
    allreduce_s: tuple[float, ...]
    gradient_bytes: tuple[float, ...]
    """Bytes each stage's all-reduce combines (its layers' gradient)."""
    optimizer_s: tuple[float, ...]
    iteration_s: float
    in_flight: tuple[int, ...]
    memory_bytes: Mapping[str, float]
    shortfall_bytes: Mapping[str, float]
    """Devices whose need exceeds their memory, and by how much."""
    bottleneck: str

    @property
    def fits(self) -> bool:
        return not self.shortfall_bytes


# ----------------------------------------------------------------------------- pieces


def stage_pass_s(model: ModelProfile, cluster: Cluster, stage: StagePlan, passes: str = "FIWB") -> tuple[float, ...]:
    """Each of ``passes`` for one microbatch on the stage: the slowest device with its share."""
    best = [0.0] * len(passes)
    seen: set[tuple] = set()  # devices of one kind, slowdown and share take the same time
    for dev, share in zip(stage.devices, stage.shares, strict=True):
        kind, slow = cluster.kind_of(dev), cluster.device(dev).slowdown
        if (kind.name, slow, share) in seen:
            continue
        seen.add((kind.name, slow, share))
        f = model.time_s(stage.layer_start, stage.layer_stop, "F", share, kind, slow) if stage.recompute else 0.0
        for k, p in enumerate(passes):
            # a recomputing stage runs its forward again before I and B ([Note: recompute timing])
            extra = f if p in "IB" else 0.0
            best[k] = max(best[k], model.time_s(stage.layer_start, stage.layer_stop, p, share, kind, slow) + extra)
    return tuple(best)


def stage_compute_s(model: ModelProfile, cluster: Cluster, stage: StagePlan) -> tuple[float, float, float]:
    """``(F, I, W)`` of one microbatch on the stage: the slowest device with its share."""
    f, i, w = stage_pass_s(model, cluster, stage, "FIW")
    return f, i, w


def boundary_cost(cluster: Cluster, src: StagePlan, dst: StagePlan, bytes_per_sample: float,
                  at_s: float = 0.0, *, first_delivery: bool = True) -> BoundaryCost:
    """Per-microbatch transfer cost between two adjacent stages (see the module docstring, 2).
    ``first_delivery=False``: the boundary is delivered when its busiest pipe is done (what the
    compact builder plans with, see :func:`stage_costs`)."""
    per: list[dict[str, list[float]]] = [defaultdict(lambda: [0.0, 0.0, 0.0]), defaultdict(lambda: [0.0, 0.0, 0.0])]
    # per direction, receiver and resource: (serialisation of its pieces there, latency)
    own: list[dict[tuple[str, str], list[float]]] = [defaultdict(lambda: [0.0, 0.0]), defaultdict(lambda: [0.0, 0.0])]
    for i, j, lo, hi in share_overlaps(src.shares, dst.shares):
        for d, a, b in ((0, src.devices[i], dst.devices[j]), (1, dst.devices[j], src.devices[i])):
            link = cluster.link(a, b)
            bw = link.bandwidth_at(at_s)
            r = per[d][link.resource]
            t = (hi - lo) * bytes_per_sample / bw
            r[0] += t
            r[1] = max(r[1], link.latency_s)
            r[2] = bw
            o = own[d][b, link.resource]
            o[0] += t
            o[1] = max(o[1], link.latency_s)
    pairs = []
    for d in range(2):
        ser = max((r[0] for r in per[d].values()), default=0.0)
        done = _first_delivery_s(own[d]) if first_delivery else max((r[0] + r[1] for r in per[d].values()), default=0.0)
        pairs.append((done - ser, ser))
    worst = max(per[0].items(), key=lambda kv: (kv[1][0] + kv[1][1], kv[0]))
    busiest = max(per[0].values(), key=lambda r: r[0])
    return BoundaryCost(forward=pairs[0], backward=pairs[1],
                        bytes_per_microbatch=src.microbatch_size * bytes_per_sample,
                        busiest_bytes=busiest[0] * busiest[2], resources=len(per[0]),
                        link=f"{worst[0]} ({fmt_rate(worst[1][2])}, {worst[1][1] * 1e3:.3g} ms)")


# [Note: shared pipe delivery]
# A stage's devices each receive their own piece. When k pieces share one link resource (two
# devices of a node sending to one node across a WAN pipe), the pipe is busy for all k but the
# first receiver has its piece after one piece's serialisation, and the device-level simulator's
# critical path runs through the receivers that get theirs first. Timing the whole boundary as
# delivered at the end of the pipe's busy time made the stage-level model 6-19% pessimistic at
# 512 devices (64 devices per stage, 2 per node pipe) and ranked the top plans almost
# independently of the simulator (Kendall tau 0.07). The boundary stays occupied for the busiest
# pipe's bytes; its delivery is when each receiver would have all its own pieces had they gone
# first on their pipes, the latest receiver's (one receiver of all a pipe's pieces: the whole
# pipe, as before; one piece per pipe: unchanged).
# The layer-split DP (:func:`deepcee.planner.split.boundary_arrays`) keeps whole-pipe delivery:
# with this delivery its splits were worse at 256 devices (6.877 s per iteration instead of
# 6.654 s for synthetic-256), the conservative fill leaves the cost model to rank them.


def _first_delivery_s(own: Mapping[tuple[str, str], Sequence[float]]) -> float:
    """When the last receiver has all its pieces, each receiver's pieces first on their pipes
    ([Note: shared pipe delivery])."""
    done: dict[str, float] = {}
    for (dst, _), (ser, lat) in own.items():
        done[dst] = max(done.get(dst, 0.0), ser + lat)
    return max(done.values(), default=0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCosts:
    """Per-stage compute and per-boundary link costs of one microbatch (terms 1 and 2 of the module
    docstring), without timing the pipeline: what the compact builder needs."""

    forward_s: tuple[float, ...]
    input_grad_s: tuple[float, ...]
    weight_grad_s: tuple[float, ...]
    boundaries: tuple[BoundaryCost, ...]


def stage_costs(plan: Plan, cluster: Cluster, model: ModelProfile) -> StageCosts:
    """:class:`StageCosts` of ``plan``."""
    fiw = [stage_pass_s(model, cluster, st, "FIW") for st in plan.stages]
    # the builder's own timing keeps a boundary whole (its latencies are >= 0, and the schedules
    # it builds were tuned on it); the cost model times what it builds per [Note: shared pipe delivery]
    bounds = tuple(boundary_cost(cluster, a, b, model.boundary_bytes(a.layer_stop), first_delivery=False)
                   for a, b in zip(plan.stages, plan.stages[1:], strict=False))
    return StageCosts(forward_s=tuple(x[0] for x in fiw), input_grad_s=tuple(x[1] for x in fiw),
                      weight_grad_s=tuple(x[2] for x in fiw), boundaries=bounds)


def pipeline_timing(lowered: Schedule, forward_s: Sequence[float], input_grad_s: Sequence[float],
                    weight_grad_s: Sequence[float], comm_forward: Sequence[LinkCost],
                    comm_backward: Sequence[LinkCost], backward_s: Sequence[float] | None = None, *,
                    num_microbatches: int | None = None, runtime: RuntimeModel | None = None) -> PipelineTiming:
    """Each stage's finish: the dry run of ``lowered`` (the interpreter on
    :func:`~deepcee.schedule.interpreter.stage_tables`) without recording. ``B`` takes
    ``backward_s`` (default ``I + W``, as in the dry run); ``runtime`` (default none) sets the
    sends' blocking and the receive handshake as the simulator does."""
    tables = stage_tables(lowered, forward_s, input_grad_s, weight_grad_s, comm_forward, comm_backward,
                          backward_s, num_microbatches=num_microbatches)
    if runtime is not None:
        tables = replace(tables, blocking_sends=runtime.sends == "blocking", handshake=runtime.receive_handshake)
    run = Execution(tables)
    ends, _ = run.pipeline(0.0)
    return PipelineTiming(stage_end_s=tuple(ends), busy_s=tuple(run.busy_s))


def stage_device_passes(st: StagePlan, cluster: Cluster, model: ModelProfile) -> list[tuple[float, ...]]:
    """Per device of ``st``, ``(F, I, W, B)`` of one microbatch with its share (devices of one kind,
    slowdown and share computed once)."""
    same: dict[tuple, tuple[float, ...]] = {}
    row = []
    for dev, share in zip(st.devices, st.shares, strict=True):
        key = (cluster.kind_of(dev).name, cluster.device(dev).slowdown, share)
        if key not in same:
            same[key] = stage_pass_s(model, cluster, replace(st, devices=(dev,), shares=(share,)))
        row.append(same[key])
    return row


def devices_timing(lowered: Schedule, per_device: Sequence[Sequence[tuple[float, ...]]],
                   pieces: Sequence[tuple[Pieces, Pieces]], runtime: RuntimeModel | None) -> PipelineTiming:
    """Each stage's finish with every device timed ([Note: devices at once] in :mod:`deepcee.planner.lanes`):
    ``per_device``: per stage and device ``(F, I, W, B)``; ``pieces``: per boundary, both directions'
    :func:`~deepcee.planner.lanes.boundary_pieces`. ``busy_s``: each stage's busiest device.
    One device per stage: the interpreter on the stage tables of those devices and their one piece
    per boundary direction (the same recursion, cheaper on scalars)."""
    if all(len(row) == 1 for row in per_device):
        f, i, w, b = (tuple(row[0][k] for row in per_device) for k in range(4))
        comm = [[(float(pc[d].latency_s[0]), float(pc[d].serialization_s[0])) for pc in pieces] for d in (0, 1)]
        return pipeline_timing(lowered, f, i, w, comm[0], comm[1], b, runtime=runtime)
    dur = [np.array(row, dtype=float) for row in per_device]
    ends = devices_at_once(lowered, dur, pieces, runtime)
    counts = [np.array([sum(1 for a in row if a.kind is k) for k in PASSES], dtype=float) for row in lowered]
    return PipelineTiming(stage_end_s=tuple(float(e.max()) for e in ends),
                          busy_s=tuple(float((d * c).sum(axis=1).max()) for d, c in zip(dur, counts, strict=True)))


# ----------------------------------------------------------------------------- the model


DEVICE_RUN_PER_STAGE = 8
"""Plans with at most this many devices per stage on average (and more than one somewhere) have
their pipeline timed by the simulator's device-level run (:func:`device_run_timing`, exact)
instead of :func:`devices_timing`: the interpreter costs per device and action in Python, the
vectors per stage and action in numpy calls. Measured: 63 devices in 37 stages, 128 microbatches,
65 ms against 500 ms; 448-512 devices in 7-9 stages, 16 microbatches, ~180 ms (the whole
simulation) against 22 ms (10-11 ms since session 8)."""


def device_run_timing(plan: Plan, cluster: Cluster, model: ModelProfile, runtime: RuntimeModel) -> PipelineTiming:
    """Each stage's finish in the simulator's own device-level pipeline run (the interpreter on
    :class:`~deepcee.simulator.engine._Simulation`'s tables, without the synchronisation phase);
    ``busy_s``: each stage's busiest device."""
    sim = _Simulation(plan, cluster, model, runtime)
    run = Execution(sim.tables, record=False)
    n = len(sim.devices)
    ends, _ = run.pipeline([0.0] * n, [-1] * n)
    stage_end, busy = [0.0] * plan.num_stages, [0.0] * plan.num_stages
    for d, s in enumerate(sim.stage_of):
        stage_end[s] = max(stage_end[s], ends[d])
        busy[s] = max(busy[s], run.busy_s[d])
    return PipelineTiming(stage_end_s=tuple(stage_end), busy_s=tuple(busy))


EXACT_WORK = 2_000
"""Plans with stages on several devices and at most this many devices x microbatches are timed
by the simulator's device-level run (see :class:`AnalyticCostModel`)."""


class AnalyticCostModel:
    """The analytic model of the module docstring. It keeps only memos of the last few clusters and
    models' stage terms (:class:`StageTerms`); safe to share.

    [Note: cost model = simulator] Where the stage-level model is approximate (a stage with
    several devices, boundaries over several link resources, resources shared by boundaries)
    and the plan is small (at most ``exact_work`` devices x microbatches), :meth:`estimate`
    times the plan with the simulator's own device-level run instead, so the plans the search
    ranks there are ranked exactly as the simulator would. Larger plans keep the stage-level
    timing (what the benchmarks' rank correlation measures)."""

    name = "cost-model"
    def __init__(self, *, exact_work: int = EXACT_WORK, runtime: RuntimeModel | None = None) -> None:
        self.exact_work = exact_work
        self.runtime = runtime
        """How the plan is run; ``None``: the cluster's (:func:`~deepcee.simulator.runtime_model.runtime_for`)."""
        self._terms: list[StageTerms] = []

    def terms(self, cluster: Cluster, model: ModelProfile) -> StageTerms:
        """The memo of per-stage and per-boundary terms for ``cluster`` and ``model`` (kept for the
        last :data:`TERMS_KEPT` pairs asked: the crossover sweeps alternate between the cluster and
        its kept devices, and a batch sweep keeps most stages)."""
        for k, got in enumerate(self._terms):
            if got.cluster is cluster and got.model is model:
                if k:
                    self._terms.insert(0, self._terms.pop(k))
                return got
        got = StageTerms(cluster, model)
        self._terms[TERMS_KEPT - 1:] = []
        self._terms.insert(0, got)
        return got

    def estimate(self, plan: Plan, cluster: Cluster, model: ModelProfile) -> Estimate:
        if (len(plan.devices) * plan.num_microbatches <= self.exact_work
                and any(len(st.devices) > 1 for st in plan.stages)):
            plan.check_against(num_layers=model.num_layers, device_names=cluster.device_names)
            est = to_estimate(simulate(plan, cluster, model, record=False, runtime=self.runtime), plan, cluster)
            return Estimate(iteration_s=est.iteration_s, samples_per_s=est.samples_per_s,
                            peak_memory_bytes=est.peak_memory_bytes, bottleneck=est.bottleneck, source=self.name)
        cost = self.breakdown(plan, cluster, model)
        return Estimate(iteration_s=cost.iteration_s, samples_per_s=plan.global_batch / cost.iteration_s
                        if cost.iteration_s > 0 else float("inf"),
                        peak_memory_bytes=dict(cost.memory_bytes), bottleneck=cost.bottleneck,
                        source=self.name)

    def breakdown(self, plan: Plan, cluster: Cluster, model: ModelProfile) -> PlanCost:
        """Every term of the estimate (see the module docstring)."""
        plan.check_against(num_layers=model.num_layers, device_names=cluster.device_names)
        memo = self.terms(cluster, model)
        per_device = [memo.passes(st) for st in plan.stages]
        fiwb = [tuple(map(max, *row)) if len(row) > 1 else row[0] for row in per_device]  # the slowest device
        f, i, w, b_ = (tuple(x[k] for x in fiwb) for k in range(4))
        bounds = tuple(memo.boundary(a, b) for a, b in zip(plan.stages, plan.stages[1:], strict=False))
        lowered, in_flight = lowered_schedule(plan), stage_in_flight(plan)
        rt = self.runtime or runtime_for(cluster, model)
        timing = memo.timing(plan, lowered, rt)
        ar, opt, ends = [], [], []
        for s, st in enumerate(plan.stages):
            t = timing.stage_end_s[s]
            ar.append(memo.allreduce(st.devices, model.gradient_bytes(st.layer_start, st.layer_stop), plan.sync, rt, t))
            shards = len(st.devices) if plan.sync == "zero2" else 1
            kinds = {(cluster.device(d).kind, cluster.device(d).slowdown) for d in st.devices}
            opt.append(rt.step_overhead_s + max(optimizer_step_s(model, st.layer_start, st.layer_stop,
                                                                 cluster.kinds[k], slow, shards=shards)
                                                for k, slow in sorted(kinds)))
            ends.append(t + ar[-1] + opt[-1])
        memory = peak_memory(plan, cluster, model, rt)
        short = {d: need - cluster.memory_bytes(d) for d, need in memory.items() if need > cluster.memory_bytes(d)}
        iteration = max(ends)
        cost = PlanCost(forward_s=f, input_grad_s=i, weight_grad_s=w, backward_s=b_, boundaries=bounds, pipeline=timing,
                        allreduce_s=tuple(ar), optimizer_s=tuple(opt), iteration_s=iteration,
                        gradient_bytes=tuple(model.gradient_bytes(st.layer_start, st.layer_stop) for st in plan.stages),
                        in_flight=in_flight, memory_bytes=memory, shortfall_bytes=short, bottleneck="")
        # what a stage runs per microbatch: F + B where its list has fused backwards, else F + I + W
        # (``in map(...)`` scans in C: a generator here was 5% of a WAN instance's planning time)
        per_mb = [f[s] + (b_[s] if ActionKind.B in map(_KIND, row) else i[s] + w[s])
                  for s, row in enumerate(lowered)]
        return _with_bottleneck(cost, plan, per_mb)


_KIND = attrgetter("kind")


def _with_bottleneck(cost: PlanCost, plan: Plan, compute_per_microbatch_s: Sequence[float]) -> PlanCost:
    """Name the largest of: the busiest stage's compute, the busiest link, an all-reduce, the bubble."""
    m, it = plan.num_microbatches, cost.iteration_s
    terms: list[tuple[float, str]] = []
    for s, st in enumerate(plan.stages):
        per_mb = compute_per_microbatch_s[s]
        terms.append((m * per_mb, f"stage {s} compute ({len(st.devices)} device(s) from {st.devices[0]}, "
                                  f"layers {st.layer_start}-{st.layer_stop - 1}): {m} x {per_mb * 1e3:.4g} ms"))
        if cost.allreduce_s[s] > 0:
            terms.append((cost.allreduce_s[s], f"stage {s} gradient all-reduce of {cost.gradient_bytes[s] / 2**20:.3g} "
                                               f"MiB over {len(st.devices)} devices ({plan.sync})"))
    for b, bc in enumerate(cost.boundaries):
        ser = max(bc.forward[1], bc.backward[1])
        # the time is the busiest pipe's: name its bytes, not the boundary's total
        pipes = (f" (of {bc.bytes_per_microbatch / 2**20:.3g} MiB per microbatch over {bc.resources} pipes)"
                 if bc.resources > 1 else "")
        terms.append((m * ser + bc.forward[0], f"link {bc.link} between stages {b} and {b + 1}: "
                                              f"{m} x {bc.busiest_bytes / 2**20:.3g} MiB{pipes}"))
    top, text = max(terms, key=lambda t: t[0])
    bubble = cost.pipeline.makespan_s - top
    if bubble > top:
        text = f"pipeline fill and drain ({bubble:.4g} s idle on the busiest stage); next: {text}"
        top = bubble
    mem = ""
    if cost.shortfall_bytes:
        d, s = max(cost.shortfall_bytes.items(), key=lambda kv: (kv[1], kv[0]))
        mem = f"; out of memory on {d} by {s / GIB:.2f} GiB"
    return PlanCost(**{**{f: getattr(cost, f) for f in cost.__dataclass_fields__},
                       "bottleneck": f"{text} ({top:.4g} s of {it:.4g} s){mem}"})


TERMS_KEPT = 3
"""How many (cluster, model) pairs' :class:`StageTerms` an :class:`AnalyticCostModel` keeps."""

TIMINGS_KEPT = 4_096
"""Pipeline timings :class:`StageTerms` keeps (then starts afresh): a few MB at 512 devices."""


class StageTerms:
    """Terms of :meth:`AnalyticCostModel.breakdown` that depend only on one stage or boundary (and
    the cluster and model), each computed once: a search scores many plans that share stages
    (schedules, syncs, neighbouring splits). Same functions, same arguments: the same figures."""

    __slots__ = ("_allreduce", "_bounds", "_passes", "_pieces", "_timings", "cluster", "model", "traced")

    def __init__(self, cluster: Cluster, model: ModelProfile) -> None:
        self.cluster, self.model = cluster, model
        specs = [i.intra for i in cluster.islands] + [n.intra for n in cluster.nodes] + [e.spec for e in cluster.links]
        self.traced = any(x.trace is not None for x in specs)
        """Whether a bandwidth trace can make an all-reduce depend on when it starts."""
        self._passes: dict[tuple, list[tuple[float, ...]]] = {}
        self._bounds: dict[tuple, BoundaryCost] = {}
        self._pieces: dict[tuple, tuple[Pieces, Pieces]] = {}
        self._allreduce: dict[tuple, float] = {}
        self._timings: dict[tuple, PipelineTiming] = {}

    def passes(self, st: StagePlan) -> list[tuple[float, ...]]:
        """:func:`stage_device_passes` of ``st``."""
        key = (st.devices, st.shares, st.layer_start, st.layer_stop, st.recompute)
        got = self._passes.get(key)
        if got is None:
            got = self._passes[key] = stage_device_passes(st, self.cluster, self.model)
        return got

    def boundary(self, a: StagePlan, b: StagePlan) -> BoundaryCost:
        """:func:`boundary_cost` from ``a`` to ``b`` (at time 0, first delivery)."""
        key = (a.devices, a.shares, a.layer_stop, b.devices, b.shares)
        got = self._bounds.get(key)
        if got is None:
            got = self._bounds[key] = boundary_cost(self.cluster, a, b, self.model.boundary_bytes(a.layer_stop))
        return got

    def pieces(self, a: StagePlan, b: StagePlan) -> tuple[Pieces, Pieces]:
        """:func:`~deepcee.planner.lanes.boundary_pieces` from ``a`` to ``b``, both directions."""
        key = (a.devices, a.shares, a.layer_stop, b.devices, b.shares)
        got = self._pieces.get(key)
        if got is None:
            got = self._pieces[key] = (boundary_pieces(self.cluster, self.model, a, b, 0),
                                       boundary_pieces(self.cluster, self.model, a, b, 1))
        return got

    def timing(self, plan: Plan, lowered: Schedule, runtime: RuntimeModel) -> PipelineTiming:
        """The pipeline timing of ``plan`` (whose lowered schedule is ``lowered``): the simulator's
        device-level run (:func:`device_run_timing`) for plans with at most
        :data:`DEVICE_RUN_PER_STAGE` devices per stage on average and more than one somewhere, else
        :func:`devices_timing`. The same stages under the same schedule recur in a search (plans
        that differ in sync only, re-scored candidates: 52 of 157 timings at 512 devices; 422 of
        1,733 device-level runs, 8.3 of 89 CPU s, on WAN seed 23 of
        ``benchmarks/planner_at_scale.py``), so each is timed once. The key holds everything either
        run reads from the plan and the runtime (the sync and the microbatch size do not enter: a
        stage's shares carry its samples)."""
        key = (plan.schedule, plan.num_microbatches, plan.actions, runtime.sends == "blocking", runtime.receive_handshake,
               tuple((st.devices, st.shares, st.layer_start, st.layer_stop, st.recompute) for st in plan.stages))
        got = self._timings.get(key)
        if got is None:
            if len(self._timings) >= TIMINGS_KEPT:
                self._timings.clear()
            stages = plan.stages
            if len(plan.devices) > plan.num_stages and len(plan.devices) <= DEVICE_RUN_PER_STAGE * plan.num_stages:
                got = device_run_timing(plan, self.cluster, self.model, runtime)
            else:
                got = devices_timing(lowered, [self.passes(st) for st in stages],
                                     [self.pieces(a, b) for a, b in zip(stages, stages[1:], strict=False)], runtime)
            self._timings[key] = got
        return got

    def allreduce(self, devices: tuple[str, ...], nbytes: float, sync: str, runtime: RuntimeModel, at_s: float) -> float:
        """:func:`~deepcee.simulator.engine.allreduce_time_s` (``at_s`` matters only under a trace)."""
        key = (devices, nbytes, sync, runtime, at_s if self.traced else None)
        got = self._allreduce.get(key)
        if got is None:
            got = self._allreduce[key] = allreduce_time_s(self.cluster, devices, nbytes, sync, runtime, at_s=at_s)
        return got


class SimulatorCostModel:
    """The discrete-event simulator behind the :class:`CostModel` protocol (one iteration)."""

    name = "simulator"

    def __init__(self, *, iterations: int = 1) -> None:
        self.iterations = iterations

    def estimate(self, plan: Plan, cluster: Cluster, model: ModelProfile) -> Estimate:
        result = simulate(plan, cluster, model, iterations=self.iterations, record=False)
        return to_estimate(result, plan, cluster)
