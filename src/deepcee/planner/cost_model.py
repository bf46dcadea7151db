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
   bytes / bandwidth, ``latency_s`` = the rest of the slowest resource's delivery time.
   The backward direction carries the same bytes the other way.
3. **Pipeline.** The plan's schedule (built, or the plan's explicit actions for ``compact``)
   is executed by the dry-run model of :func:`deepcee.schedule.passes.dry_run` (each stage
   runs its list in order, sends never block, one FIFO link per boundary direction), by a
   fast array-based recurrence (:func:`pipeline_timing`) that returns each stage's finish.
   It is exact for GPipe/1F1B/ZB-H1/ZB-H2/compact whenever the stage-level costs above are
   exact (one device per stage, one link resource per boundary); zero-bubble schedules get
   their bubble filled by ``W`` because their ``W`` actions are in the list.
4. **Synchronisation.** Conservatively, a stage's gradient all-reduce
   (:func:`deepcee.comm.allreduce_s`) starts only after the stage finished
   its whole list (no bucketed overlap with its own backward, which split ``W`` passes and
   shares would make schedule-dependent); it does overlap with other stages' work, which
   is how 1F1B's early-finishing last stages hide theirs. Then the optimizer step
   (:func:`deepcee.simulator.engine.optimizer_step_s`). The iteration ends when the last
   stage's optimizer step ends. This is the simulator's order of events.
5. **Memory.** Per device :func:`deepcee.simulator.memory.device_memory_bytes` with the
   schedule's in-flight count per stage (:func:`deepcee.schedule.passes.in_flight_per_stage`:
   GPipe ``M``, 1F1B/ZB-H1 ``min(S-s, M)``, ZB-H2 ``min(2(S-s)-1, M)``, compact from its
   actions), checked against ``cluster.memory_bytes``.

For the planner's layer-split search, :class:`~deepcee.planner.ranges.RangeCosts` tabulates
the same terms for every contiguous layer range ``[a, b)`` of one device set at once (numpy
matrices; see [Note: range times] in :mod:`deepcee.planner.ranges`).

What is approximate against the simulator: a stage is timed by its slowest device (the
simulator lets each device of a stage start as soon as its own pieces arrive), a boundary
with several link resources is reduced to one FIFO pair, and transfers of different
boundaries that share one resource are not queued behind each other.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from deepcee.cluster import Cluster
from deepcee.comm import allreduce_s
from deepcee.plan import Estimate, Plan, StagePlan
from deepcee.planner.ranges import RangeCosts as RangeCosts
from deepcee.planner.ranges import RangeTables as RangeTables
from deepcee.planner.ranges import largest_remainder_shares as largest_remainder_shares
from deepcee.planner.ranges import range_time_s as range_time_s
from deepcee.profile import ModelProfile
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.ir import ActionKind, Schedule, parse_schedule
from deepcee.schedule.passes import LinkCost, in_flight_per_stage
from deepcee.simulator.engine import optimizer_step_s, simulate, to_estimate
from deepcee.simulator.memory import device_memory_bytes
from deepcee.units import GIB, fmt_rate

K = ActionKind
_F, _I, _W, _B = 0, 1, 2, 3
_CODE = {K.F: _F, K.I: _I, K.W: _W, K.B: _B}


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
    link: str
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
    for dev, share in zip(stage.devices, stage.shares, strict=True):
        kind, slow = cluster.kind_of(dev), cluster.device(dev).slowdown
        for k, p in enumerate(passes):
            best[k] = max(best[k], model.time_s(stage.layer_start, stage.layer_stop, p, share, kind, slow))
    return tuple(best)


def stage_compute_s(model: ModelProfile, cluster: Cluster, stage: StagePlan) -> tuple[float, float, float]:
    """``(F, I, W)`` of one microbatch on the stage: the slowest device with its share."""
    f, i, w = stage_pass_s(model, cluster, stage, "FIW")
    return f, i, w


def share_pairs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """:func:`deepcee.plan.share_overlaps` by a linear merge of the two range lists (same result,
    linear instead of quadratic in the stage sizes)."""
    out, i, j, a_lo, b_lo = [], 0, 0, 0, 0
    while i < len(src) and j < len(dst):
        a_hi, b_hi = a_lo + src[i], b_lo + dst[j]
        lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
        if lo < hi:
            out.append((i, j, lo, hi))
        if a_hi <= b_hi:
            i, a_lo = i + 1, a_hi
        if b_hi <= a_hi:
            j, b_lo = j + 1, b_hi
    return out


def boundary_cost(cluster: Cluster, src: StagePlan, dst: StagePlan, bytes_per_sample: float,
                  at_s: float = 0.0) -> BoundaryCost:
    """Per-microbatch transfer cost between two adjacent stages (see the module docstring, 2)."""
    per: list[dict[str, list[float]]] = [defaultdict(lambda: [0.0, 0.0, 0.0]), defaultdict(lambda: [0.0, 0.0, 0.0])]
    for i, j, lo, hi in share_pairs(src.shares, dst.shares):
        for d, a, b in ((0, src.devices[i], dst.devices[j]), (1, dst.devices[j], src.devices[i])):
            link = cluster.link(a, b)
            bw = link.bandwidth_at(at_s)
            r = per[d][link.resource]
            r[0] += (hi - lo) * bytes_per_sample / bw
            r[1] = max(r[1], link.latency_s)
            r[2] = bw
    pairs = []
    for d in range(2):
        ser = max((r[0] for r in per[d].values()), default=0.0)
        total = max((r[0] + r[1] for r in per[d].values()), default=0.0)
        pairs.append((total - ser, ser))
    worst = max(per[0].items(), key=lambda kv: (kv[1][0] + kv[1][1], kv[0]))
    return BoundaryCost(forward=pairs[0], backward=pairs[1],
                        bytes_per_microbatch=src.microbatch_size * bytes_per_sample,
                        link=f"{worst[0]} ({fmt_rate(worst[1][2])}, {worst[1][1] * 1e3:.3g} ms)")


def _rows(schedule: Schedule) -> tuple[tuple[tuple[int, int], ...], ...]:
    return tuple(tuple((_CODE[a.kind], a.microbatch) for a in row) for row in schedule)


@lru_cache(maxsize=256)
def _named(name: str, num_stages: int, num_microbatches: int) -> tuple[Schedule, tuple, tuple[int, ...]]:
    """A named schedule, its rows for :func:`pipeline_timing` and its in-flight counts (memoised:
    the planner asks for the same few shapes thousands of times)."""
    sched = build_schedule(name, num_stages, num_microbatches)
    return sched, _rows(sched), in_flight_per_stage(sched)


def pipeline_timing(schedule: Schedule | Sequence[Sequence[tuple[int, int]]], forward_s: Sequence[float], input_grad_s: Sequence[float],
                    weight_grad_s: Sequence[float], comm_forward: Sequence[LinkCost],
                    comm_backward: Sequence[LinkCost], backward_s: Sequence[float] | None = None) -> PipelineTiming:
    """Each stage's finish under the dry-run model (:func:`deepcee.schedule.passes.dry_run`).

    ``B`` takes ``backward_s`` (default ``I + W``, as in the dry run).
    The same rules as the dry run, on plain lists: a stage runs its compute-only list in
    order; ``F`` on ``s > 0`` waits for its activation, ``I``/``B`` on ``s < S-1`` for its
    gradient; a send issued at ``t`` starts at ``max(t, link free)`` and is delivered after
    ``serialization_s + latency_s``. Raises ``ValueError`` on a deadlock (the schedule is
    assumed valid; :func:`deepcee.schedule.passes.validate` names the culprit).
    """
    n = len(schedule)
    rows = schedule if schedule and schedule[0] and isinstance(schedule[0][0], tuple) else _rows(schedule)
    m_count = 1 + max((m for row in rows for _, m in row), default=0)
    f, i, w = list(forward_s), list(input_grad_s), list(weight_grad_s)
    dur = [f, i, w, [a + b for a, b in zip(i, w, strict=True)] if backward_s is None else list(backward_s)]
    arr_f = [[-1.0] * m_count for _ in range(n)]
    arr_b = [[-1.0] * m_count for _ in range(n)]
    free_f, free_b = [0.0] * n, [0.0] * n
    blocked = [-1] * n  # 2*m + direction a stage waits for, -1 when running
    ptr, clock, busy = [0] * n, [0.0] * n, [0.0] * n
    runnable = deque(range(n))
    last = n - 1
    while runnable:
        s = runnable.popleft()
        row, t, p = rows[s], clock[s], ptr[s]
        while p < len(row):
            k, m = row[p]
            if k == _F and s > 0:
                a = arr_f[s][m]
                if a < 0:
                    blocked[s] = 2 * m
                    break
                t = a if a > t else t
            elif (k == _I or k == _B) and s < last:
                a = arr_b[s][m]
                if a < 0:
                    blocked[s] = 2 * m + 1
                    break
                t = a if a > t else t
            d = dur[k][s]
            t += d
            busy[s] += d
            p += 1
            if k == _F and s < last:
                lat, ser = comm_forward[s]
                begin = t if t > free_f[s] else free_f[s]
                free_f[s] = begin + ser
                arr_f[s + 1][m] = begin + ser + lat
                if blocked[s + 1] == 2 * m:
                    blocked[s + 1] = -1
                    runnable.append(s + 1)
            elif (k == _I or k == _B) and s > 0:
                lat, ser = comm_backward[s - 1]
                begin = t if t > free_b[s] else free_b[s]
                free_b[s] = begin + ser
                arr_b[s - 1][m] = begin + ser + lat
                if blocked[s - 1] == 2 * m + 1:
                    blocked[s - 1] = -1
                    runnable.append(s - 1)
        ptr[s], clock[s] = p, t
    stuck = [s for s in range(n) if ptr[s] < len(rows[s])]
    if stuck:
        raise ValueError(f"schedule deadlocks at stages {stuck} (run deepcee.schedule.passes.validate for details)")
    return PipelineTiming(stage_end_s=tuple(clock), busy_s=tuple(busy))


def plan_schedule(plan: Plan) -> Schedule:
    """The compute-only schedule a plan runs (explicit actions win over the named builder)."""
    if plan.actions:
        return parse_schedule(plan.actions)
    return _named(plan.schedule, plan.num_stages, plan.num_microbatches)[0]


def _schedule_rows(plan: Plan) -> tuple[tuple, tuple[int, ...]]:
    if plan.actions:
        sched = parse_schedule(plan.actions)
        return _rows(sched), in_flight_per_stage(sched)
    _, rows, in_flight = _named(plan.schedule, plan.num_stages, plan.num_microbatches)
    return rows, in_flight


# ----------------------------------------------------------------------------- the model


class AnalyticCostModel:
    """The analytic model of the module docstring. Stateless; safe to share."""

    name = "cost-model"

    def estimate(self, plan: Plan, cluster: Cluster, model: ModelProfile) -> Estimate:
        cost = self.breakdown(plan, cluster, model)
        return Estimate(iteration_s=cost.iteration_s, samples_per_s=plan.global_batch / cost.iteration_s
                        if cost.iteration_s > 0 else float("inf"),
                        peak_memory_bytes=dict(cost.memory_bytes), bottleneck=cost.bottleneck,
                        source=self.name)

    def breakdown(self, plan: Plan, cluster: Cluster, model: ModelProfile) -> PlanCost:
        """Every term of the estimate (see the module docstring)."""
        plan.check_against(num_layers=model.num_layers, device_names=cluster.device_names)
        fiwb = [stage_pass_s(model, cluster, st) for st in plan.stages]
        f, i, w, b_ = (tuple(x[k] for x in fiwb) for k in range(4))
        bounds = tuple(boundary_cost(cluster, a, b, model.boundary_bytes(a.layer_stop))
                       for a, b in zip(plan.stages, plan.stages[1:], strict=False))
        rows, in_flight = _schedule_rows(plan)
        timing = pipeline_timing(rows, f, i, w, [b.forward for b in bounds], [b.backward for b in bounds], b_)
        ar, opt, ends = [], [], []
        for s, st in enumerate(plan.stages):
            t = timing.stage_end_s[s]
            ar.append(allreduce_s(cluster, st.devices, model.gradient_bytes(st.layer_start, st.layer_stop),
                                  plan.sync, at_s=t))
            shards = len(st.devices) if plan.sync == "zero2" else 1
            opt.append(max(optimizer_step_s(model, st.layer_start, st.layer_stop, cluster.kind_of(d),
                                            cluster.device(d).slowdown, shards=shards) for d in st.devices))
            ends.append(t + ar[-1] + opt[-1])
        memory, short = {}, {}
        for s, st in enumerate(plan.stages):
            for d, share in zip(st.devices, st.shares, strict=True):
                need = device_memory_bytes(model, st.layer_start, st.layer_stop, share=share,
                                           in_flight=in_flight[s], sync=plan.sync, stage_devices=len(st.devices))
                memory[d] = need
                if need > cluster.memory_bytes(d):
                    short[d] = need - cluster.memory_bytes(d)
        iteration = max(ends)
        cost = PlanCost(forward_s=f, input_grad_s=i, weight_grad_s=w, backward_s=b_, boundaries=bounds, pipeline=timing,
                        allreduce_s=tuple(ar), optimizer_s=tuple(opt), iteration_s=iteration,
                        in_flight=in_flight, memory_bytes=memory, shortfall_bytes=short, bottleneck="")
        # what a stage runs per microbatch: F + B where its list has fused backwards, else F + I + W
        per_mb = [f[s] + (b_[s] if any(k == _B for k, _ in row) else i[s] + w[s]) for s, row in enumerate(rows)]
        return _with_bottleneck(cost, plan, per_mb)


def _with_bottleneck(cost: PlanCost, plan: Plan, compute_per_microbatch_s: Sequence[float]) -> PlanCost:
    """Name the largest of: the busiest stage's compute, the busiest link, an all-reduce, the bubble."""
    m, it = plan.num_microbatches, cost.iteration_s
    terms: list[tuple[float, str]] = []
    for s, st in enumerate(plan.stages):
        per_mb = compute_per_microbatch_s[s]
        terms.append((m * per_mb, f"stage {s} compute ({len(st.devices)} device(s) from {st.devices[0]}, "
                                  f"layers {st.layer_start}-{st.layer_stop - 1}): {m} x {per_mb * 1e3:.4g} ms"))
        if cost.allreduce_s[s] > 0:
            terms.append((cost.allreduce_s[s], f"stage {s} gradient all-reduce over {len(st.devices)} devices "
                                               f"({plan.sync})"))
    for b, bc in enumerate(cost.boundaries):
        ser = max(bc.forward[1], bc.backward[1])
        terms.append((m * ser + bc.forward[0], f"link {bc.link} between stages {b} and {b + 1}: "
                                              f"{m} x {bc.bytes_per_microbatch / 2**20:.3g} MiB"))
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


class SimulatorCostModel:
    """The discrete-event simulator behind the :class:`CostModel` protocol (one iteration)."""

    name = "simulator"

    def __init__(self, *, iterations: int = 1) -> None:
        self.iterations = iterations

    def estimate(self, plan: Plan, cluster: Cluster, model: ModelProfile) -> Estimate:
        result = simulate(plan, cluster, model, iterations=self.iterations, record=False)
        return to_estimate(result, plan, cluster)
