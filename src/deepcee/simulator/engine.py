"""Discrete-event simulator: a lowered schedule executed on a cluster (torch-free).

Model (all times in seconds on one clock that starts at ``start_s``, so link traces, whose
times are on the same clock, keep advancing across iterations):

- Every device of stage ``s`` runs the lowered action list of stage ``s``
  (:func:`deepcee.schedule.program.lowered_schedule`) through the timing interpreter
  (:mod:`deepcee.schedule.interpreter`, which documents the pipeline model: actions in
  order, sends never block, receives wait for every piece, FIFO link resources).
  ``F``/``I``/``W``/``B`` take ``model.time_s(layers of s, pass, device share, device kind,
  device slowdown)``.
- [Note: recompute timing] A stage with ``recompute`` (see :mod:`deepcee.plan`) runs its
  forward again right before each backward: its ``I`` and ``B`` take ``F`` longer (``W``
  reuses what that ``I`` built). The runtime does the same (:mod:`deepcee.runtime.stage`).
- ``SEND_F``/``SEND_B`` issue one transfer per sample overlap between the sender and a device
  of the next (previous) stage (see [Note: share-based resharding] in :mod:`deepcee.plan`), of
  ``samples x model.boundary_bytes(boundary layer)`` bytes, over ``cluster.link(src, dst)``:
  its latency, its bandwidth (integrated over a bandwidth trace), its ``resource`` queue.
  The dry run (:func:`deepcee.schedule.passes.dry_run`) is the same interpreter with given
  per-stage costs, so with one device per stage the two agree exactly.
- When all devices of a stage finished their lists, the stage's gradient synchronisation
  runs (:func:`deepcee.comm.allreduce_s`, evaluated at its start time, plus the runtime's
  handshakes, :func:`allreduce_time_s`; it keeps all the stage's devices busy and does not
  contend with pipeline transfers), then every device takes its optimizer step
  (:func:`optimizer_step_s`: the profile's measured time when it has one, else a FLOP
  estimate) and the runtime's per-step bookkeeping. The iteration ends when the last of these
  ends.

How the runtime runs the plan is a :class:`~deepcee.simulator.runtime_model.RuntimeModel`
(``runtime=``; default the cluster's, :func:`~deepcee.simulator.runtime_model.runtime_for`: deepcee's
own): blocking sends hold the sending device until delivery; a receive handshake delays a
piece until the receiver's ready notice crossed the link (receives posted at the step start);
global-norm gradient clipping adds one scalar all-reduce over one device per stage before any
optimizer step; with a step barrier every device starts the next iteration together, after
the barrier's latencies, otherwise each device starts it when its own step is done, except
that the first device waits for every device when it gathers the step records
(``first_waits_for_all``); iteration ``k`` ends when its last device ends, and its time is
measured from the previous one's end.
A pair of devices with a measured transfer curve in the profile (:class:`deepcee.profile.LinkCurve`)
sends each piece with the curve's time for that size (scaled to the link's bandwidth).

Per device, the time of the simulated iterations splits into ``busy_s`` (F/I/W/B and the
optimizer step), ``sync_s`` (gradient synchronisation), ``comm_wait_s`` (blocked in a
receive) and ``idle_s`` (the rest: bubbles, waiting for the stage or the iteration end).
``bubble_fraction`` is ``1 - pipeline compute / (devices x pipeline span)``, the pipeline
span being the time from the iteration start until the last device finishes its list
(the same definition as the dry run's, which has no synchronisation phase).

The critical path is found by recording, for every segment, the segment that released it
(the device's previous segment, the last-delivered piece of a receive, the transfer ahead
in the resource's queue, or the last device of a stage for its all-reduce), and walking
back from the end; clipped to their successor's start, these segments tile the run.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from deepcee.cluster import Cluster, DeviceKind
from deepcee.comm import allreduce_s, ring_order
from deepcee.plan import Estimate, Plan, share_overlaps
from deepcee.profile import ModelProfile
from deepcee.schedule.interpreter import TRANSFER, Execution, Tables, collection_paused
from deepcee.schedule.program import lowered_schedule, stage_in_flight, stage_recomputed_live
from deepcee.simulator.memory import device_memory
from deepcee.simulator.runtime_model import RuntimeModel, runtime_for

log = logging.getLogger(__name__)

OPTIMIZER_FLOPS_PER_PARAMETER = 10.0
"""Optimizer step cost model: Adam's update reads ~4 values and does ~10 FLOPs per parameter.
On real GPUs the step is bound by memory bandwidth, which device kinds do not record, so this
is a lower bound; it is small next to a pipeline iteration either way."""

EventKind = Literal["compute", "transfer", "wait", "allreduce", "optimizer"]
_ALLREDUCE, _OPTIMIZER = 3, 4
"""Segment kinds added to the interpreter's (``0`` compute, ``1`` transfer, ``2`` wait)."""
_CLIP, _BARRIER = -1, -2
"""``where`` of the all-reduce segments over the whole plan (stage all-reduces: the stage)."""
_KIND_NAMES: tuple[EventKind, ...] = ("compute", "transfer", "wait", "allreduce", "optimizer")


def optimizer_step_s(model: ModelProfile, start: int, stop: int, kind: DeviceKind,
                     slowdown: float = 1.0, *, shards: int = 1) -> float:
    """Optimizer step time of layers ``[start, stop)`` on one device.

    The profile's measured step for the kind when it has one
    (:meth:`deepcee.profile.ModelProfile.optimizer_step_s`), else
    ``OPTIMIZER_FLOPS_PER_PARAMETER`` FLOPs per parameter at the kind's effective FLOP/s;
    times ``slowdown``; with ZeRO-2 each of ``shards`` devices steps only its shard.
    """
    measured = model.optimizer_step_s(start, stop, kind.name, slowdown)
    if measured is not None:
        return measured / max(1, shards)
    params = model.parameters(start, stop) / max(1, shards)
    return slowdown * OPTIMIZER_FLOPS_PER_PARAMETER * params / kind.effective_flops_per_s


def allreduce_time_s(cluster: Cluster, devices: tuple[str, ...] | list[str], nbytes: float, sync: str,
                     runtime: RuntimeModel, at_s: float = 0.0) -> float:
    """A stage's gradient synchronisation as ``runtime`` runs it: :func:`deepcee.comm.allreduce_s`
    plus ``allreduce_handshake_latencies`` one-way latencies of the ring's slowest edge per ring
    step (``2 (k - 1)`` steps for ``k`` devices)."""
    base = allreduce_s(cluster, devices, nbytes, sync, at_s=at_s)
    if base <= 0 or runtime.allreduce == "modelled" or runtime.allreduce_handshake_latencies <= 0:
        return base
    ring = ring_order(cluster, devices)
    k = len(ring)
    slowest = max(cluster.link(ring[i], ring[(i + 1) % k]).latency_s for i in range(k))
    return base + runtime.allreduce_handshake_latencies * 2 * (k - 1) * slowest


def wire_bytes(model: ModelProfile, src: str, dst: str, nbytes: float) -> float:
    """Bytes a piece of ``nbytes`` costs on the link ``src -> dst``: the same, unless the profile
    holds a measured transfer curve for the pair, then the curve's serialisation time for that
    size at the curve's own bandwidth (so the link's bandwidth and traces still scale it)."""
    curve = model.link_curve(src, dst)
    if curve is None or nbytes <= 0:
        return nbytes
    return curve.serialise_s(nbytes) * curve.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One recorded interval of the simulated timeline."""

    kind: EventKind
    where: str
    """Device name; for transfers the link resource (see [Note: link resources])."""
    action: str
    """``1F3``, ``0SEND_F3`` (transfers), ``1RECV_F3`` (waits), ``allreduce``, ``optimizer``."""
    start_s: float
    """Start; for a transfer, the start of its serialisation."""
    end_s: float
    """End; for a transfer, its delivery."""
    stage: int
    iteration: int = 0
    nbytes: float = 0.0
    src: str = ""
    """Sending device (transfers)."""
    dst: str = ""
    """Receiving device (transfers)."""
    issued_s: float = 0.0
    """When the send was issued (transfers); the gap to ``start_s`` is queueing."""
    serialized_s: float = 0.0
    """When serialisation ended (transfers); ``end_s - serialized_s`` is the latency."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """One piece of the critical path."""

    kind: EventKind
    where: str
    """Device name, link resource, or ``stage s all-reduce``."""
    action: str
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if self.end_s < self.start_s:
            raise ValueError(f"segment {self.action!r} ends at {self.end_s} before it starts at {self.start_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """What a simulation measured. Per-device times are summed over all iterations."""

    iteration_s: float
    """Mean iteration time."""
    iteration_times_s: tuple[float, ...]
    samples_per_s: float
    start_s: float
    end_s: float
    pipeline_s: float
    """Mean time from an iteration's start until the last device finished its action list."""
    busy_s: Mapping[str, float]
    sync_s: Mapping[str, float]
    comm_wait_s: Mapping[str, float]
    idle_s: Mapping[str, float]
    bubble_fraction: float
    peak_memory_bytes: Mapping[str, float]
    critical_path: tuple[Segment, ...]
    bottleneck: str
    events: tuple[Event, ...] = ()
    """Empty unless simulated with ``record=True``."""

    def __post_init__(self) -> None:
        if not self.iteration_times_s or any(t < 0 for t in self.iteration_times_s):
            raise ValueError(f"iteration_times_s must be non-empty and >= 0, got {self.iteration_times_s}")
        if not 0.0 <= self.bubble_fraction <= 1.0 + 1e-12:
            raise ValueError(f"bubble_fraction must be in [0, 1], got {self.bubble_fraction}")


class _Simulation:
    """The plan's cost tables for the interpreter, and the synchronisation phase after it.

    Segments are the interpreter's (:data:`deepcee.schedule.interpreter.Segment`); this class
    adds one per stage all-reduce (``where`` = stage index; :data:`_CLIP` and :data:`_BARRIER`
    for the collectives over the whole plan) and one per optimizer step.
    """

    def __init__(self, plan: Plan, cluster: Cluster, model: ModelProfile, runtime: RuntimeModel) -> None:
        plan.check_against(num_layers=model.num_layers, device_names=cluster.device_names)
        self.plan, self.cluster, self.model, self.runtime = plan, cluster, model, runtime
        self.lowered = lowered_schedule(plan)
        self.devices = list(plan.devices)
        # (stage, position in it) of each device, looked up once (plan.stage_of scans the stages)
        self._where = {d: (s, k) for s, st in enumerate(plan.stages) for k, d in enumerate(st.devices)}
        self.stage_of = [self._where[d][0] for d in self.devices]
        self.resources: list[str] = []
        self._same: dict[tuple, tuple[float, float, float, float]] = {}
        pieces, expected = self._link_tables()
        self.tables = Tables(
            rows=self.lowered, stage_of=tuple(self.stage_of), durations=tuple(self._durations(d) for d in self.devices),
            pieces=pieces, expected=expected, num_resources=len(self.resources), names=tuple(self.devices),
            num_microbatches=plan.num_microbatches, blocking_sends=runtime.sends == "blocking",
            handshake=runtime.receive_handshake)

    def _link_tables(self) -> tuple[tuple, tuple]:
        """Per device and direction, one :data:`Piece` per transfer a send issues, and the pieces
        a receive waits for (see [Note: share-based resharding] in :mod:`deepcee.plan`)."""
        plan, index = self.plan, {d: i for i, d in enumerate(self.devices)}
        res_index: dict[str, int] = {}
        n = len(self.devices)
        targets: list[list[list[tuple]]] = [[[], []] for _ in range(n)]
        expected = [[0, 0] for _ in range(n)]
        for s in range(plan.num_stages - 1):
            a, b = plan.stages[s], plan.stages[s + 1]
            per_sample = self.model.boundary_bytes(a.layer_stop)
            for i, j, lo, hi in share_overlaps(a.shares, b.shares):
                for dirn, src, dst in ((0, a.devices[i], b.devices[j]), (1, b.devices[j], a.devices[i])):
                    link = self.cluster.link(src, dst)
                    if link.resource not in res_index:
                        res_index[link.resource] = len(self.resources)
                        self.resources.append(link.resource)
                    targets[index[src]][dirn].append(
                        (index[dst], wire_bytes(self.model, src, dst, (hi - lo) * per_sample), link.latency_s,
                         link.bandwidth_bytes_per_s, link.trace, res_index[link.resource]))
                    expected[index[dst]][dirn] += 1
        return (tuple((tuple(f), tuple(b)) for f, b in targets), tuple((f, b) for f, b in expected))

    def _durations(self, device: str) -> tuple[float, float, float, float]:
        """``F``, ``I``, ``W``, ``B`` of one microbatch on ``device`` with its share."""
        s, k = self._where[device]
        st = self.plan.stages[s]
        share = st.shares[k]
        kind, slowdown = self.cluster.kind_of(device), self.cluster.device(device).slowdown
        key = (s, kind.name, slowdown, share)  # a stage's devices of one kind and share take the same
        if key not in self._same:
            f, i, w, b = (self.model.time_s(st.layer_start, st.layer_stop, p, share, kind, slowdown) for p in "FIWB")
            if st.recompute:  # the forward runs again just before the backward (see [Note: recompute timing])
                i, b = i + f, b + f
            self._same[key] = (f, i, w, b)
        return self._same[key]

    def run(self, start_s: float, iterations: int) -> None:
        self.exe = Execution(self.tables, start_s=start_s, record=True, keep_stamps=False)
        self.segs = self.exe.segments
        self.busy, self.wait = self.exe.busy_s, self.exe.wait_s
        self.sync = [0.0] * len(self.devices)
        self.ends, self.pipe_ends, self.firsts = [], [], []
        n = len(self.devices)
        starts, preds, last = [start_s] * n, [-1] * n, -1
        for _ in range(iterations):
            self.firsts.append(len(self.segs))
            list_end, cause = self.exe.pipeline(starts, preds)
            self.pipe_ends.append(max(list_end))
            starts, preds = self._sync(list_end, cause)
            end = max(starts)
            last = preds[starts.index(end)]
            if self.runtime.step_barrier:
                end, last = self._global(_BARRIER, end, last, 8.0, self.runtime.barrier_latencies)
                starts, preds = [end] * n, [last] * n
            elif self.runtime.first_waits_for_all:  # rank 0 collects every record first
                starts[0], preds[0] = end, last
            self.ends.append(end)
        self.last_seg = last

    def _sync(self, list_end: list[float], cause: list[int]) -> tuple[list[float], list[int]]:
        """Each stage's all-reduce once its devices finished, the clipping collective (when the
        runtime clips), then the optimizer steps and the step's bookkeeping; per device when
        its step ends and the segment that ended it."""
        plan, segs, rt = self.plan, self.segs, self.runtime
        ar_end, ar_seg = [0.0] * plan.num_stages, [-1] * plan.num_stages
        for s, st in enumerate(plan.stages):
            members = [d for d in range(len(self.devices)) if self.stage_of[d] == s]
            first = max(members, key=lambda d: list_end[d])
            begin = list_end[first]
            nbytes = self.model.gradient_bytes(st.layer_start, st.layer_stop)
            dur = allreduce_time_s(self.cluster, st.devices, nbytes, plan.sync, rt, at_s=begin)
            segs.append((_ALLREDUCE, s, "allreduce", begin, begin + dur, cause[first], nbytes, None))
            ar_end[s], ar_seg[s] = begin + dur, len(segs) - 1
            for d in members:
                self.sync[d] += dur
        if rt.gradient_clipping and plan.num_stages > 1:
            s = max(range(plan.num_stages), key=lambda k: ar_end[k])
            t, seg = self._global(_CLIP, ar_end[s], ar_seg[s], 4.0, rt.allreduce_handshake_latencies)
            ar_end, ar_seg = [t] * plan.num_stages, [seg] * plan.num_stages
        ends, preds = [0.0] * len(self.devices), [-1] * len(self.devices)
        for d, name in enumerate(self.devices):
            s = self.stage_of[d]
            st, dev = plan.stages[s], self.cluster.device(name)
            shards = len(st.devices) if plan.sync == "zero2" else 1
            step = optimizer_step_s(self.model, st.layer_start, st.layer_stop, self.cluster.kinds[dev.kind],
                                    dev.slowdown, shards=shards) + rt.step_overhead_s
            segs.append((_OPTIMIZER, d, "optimizer", ar_end[s], ar_end[s] + step, ar_seg[s], 0.0, None))
            self.busy[d] += step
            ends[d], preds[d] = ar_end[s] + step, len(segs) - 1
        return ends, preds

    def _global(self, which: int, begin: float, pred: int, nbytes: float, handshake: float) -> tuple[float, int]:
        """A small collective over the plan that starts at ``begin``: the clipping norm's all-reduce
        over one device per stage, or the step-end barrier (``handshake``: its one-way latencies
        between the first device and the farthest one)."""
        plan, cluster = self.plan, self.cluster
        if which == _CLIP:
            heads = [st.devices[0] for st in plan.stages]
            dur = allreduce_time_s(cluster, heads, nbytes, "allreduce-ring",
                                   replace(self.runtime, allreduce_handshake_latencies=handshake), at_s=begin)
        else:
            root = self.devices[0]
            dur = handshake * max((max(cluster.link(root, d).latency_s, cluster.link(d, root).latency_s)
                                   for d in self.devices if d != root), default=0.0)
        self.segs.append((_ALLREDUCE, which, "gradient norm" if which == _CLIP else "step barrier", begin,
                          begin + dur, pred, nbytes, None))
        for d in range(len(self.devices)):
            self.sync[d] += dur
        return begin + dur, len(self.segs) - 1

    # -- results -------------------------------------------------------------------------
    def where(self, kind: int, where: int) -> str:
        if kind == TRANSFER:
            return self.resources[where]
        if kind == _ALLREDUCE:
            return {_CLIP: "gradient-norm all-reduce", _BARRIER: "step barrier"}.get(where, f"stage {where} all-reduce")
        return self.devices[where]

    def critical_path(self) -> tuple[Segment, ...]:
        out, i, succ_start = [], self.last_seg, None
        while i >= 0:
            kind, where, text, start, end, pred, _, _ = self.segs[i]
            end = end if succ_start is None else min(end, succ_start)
            if end > start:
                out.append(Segment(kind=_KIND_NAMES[kind], where=self.where(kind, where), action=str(text),
                                   start_s=start, end_s=end))
            succ_start, i = start, pred
        return tuple(reversed(out))

    def events(self) -> tuple[Event, ...]:
        out: list[Event] = []
        bounds = [*self.firsts, len(self.segs)]
        devices, stage_of = self.devices, self.stage_of
        for it in range(len(self.firsts)):
            for kind, where, text, start, end, _, nbytes, extra in self.segs[bounds[it]:bounds[it + 1]]:
                if kind == TRANSFER:
                    src, dst, issued, done = extra
                    out.append(Event(kind="transfer", where=self.resources[where], action=str(text), start_s=start,
                                     end_s=end, stage=stage_of[src], iteration=it, nbytes=nbytes,
                                     src=devices[src], dst=devices[dst], issued_s=issued, serialized_s=done))
                elif kind == _ALLREDUCE:
                    if end == start:  # one device, or no synchronisation: nothing ran
                        continue
                    devs = self.plan.stages[where].devices if where >= 0 else devices
                    out += [Event(kind="allreduce", where=d, action=str(text), start_s=start, end_s=end,
                                  stage=where if where >= 0 else stage_of[devices.index(d)], iteration=it,
                                  nbytes=nbytes) for d in devs]
                else:
                    out.append(Event(kind=_KIND_NAMES[kind], where=devices[where], action=str(text),
                                     start_s=start, end_s=end, stage=stage_of[where], iteration=it))
        return tuple(out)

def _bottleneck(path: tuple[Segment, ...], stage_of: Mapping[str, int], iterations: int = 1) -> str:
    """The device, link or all-reduce with the most time on the critical path, and its share;
    over several iterations the times are per iteration (the mean), as the iteration time the
    label is printed beside."""
    total = sum(seg.end_s - seg.start_s for seg in path)
    if total <= 0:
        return "none (the iteration takes no time)"
    per: dict[tuple[str, str], float] = defaultdict(float)
    for seg in path:
        group = "link" if seg.kind == "transfer" else "sync" if seg.kind == "allreduce" else "device"
        per[(group, seg.where)] += seg.end_s - seg.start_s
    (group, where), t = max(per.items(), key=lambda kv: kv[1])
    name = {"link": f"link {where}", "sync": where,
            "device": f"device {where} (stage {stage_of.get(where, '?')})"}[group]
    if iterations == 1:
        return f"{name}: {t / total:.0%} of the critical path ({t:.4g} s of {total:.4g} s)"
    return (f"{name}: {t / total:.0%} of the critical path ({t / iterations:.4g} s of {total / iterations:.4g} s "
            f"per iteration, the mean of {iterations})")


def peak_memory(plan: Plan, cluster: Cluster, model: ModelProfile,
                runtime: RuntimeModel | None = None, stage_syncs: Sequence[str] | None = None) -> dict[str, float]:
    """Peak bytes per device of ``plan`` as ``runtime`` runs it
    (:func:`deepcee.simulator.memory.device_memory`, plan and runtime terms, with its schedule's
    in-flight counts and, where a stage recomputes, its live counts). ``stage_syncs``: each
    stage's sync where it is not the plan's (a replica's stages, :mod:`.pipelines`)."""
    runtime = runtime or runtime_for(cluster, model)
    syncs = tuple(stage_syncs) if stage_syncs is not None else (plan.sync,) * plan.num_stages
    in_flight = stage_in_flight(plan)
    live = stage_recomputed_live(plan) if any(st.recompute for st in plan.stages) else ()
    out = {}
    for s, st in enumerate(plan.stages):
        same: dict[tuple[int, str], float] = {}  # a stage's devices of one kind and share need the same
        for d, share in zip(st.devices, st.shares, strict=True):
            kind = cluster.device(d).kind
            if (share, kind) not in same:
                same[share, kind] = device_memory(
                    model, st.layer_start, st.layer_stop, share=share, in_flight=in_flight[s],
                    num_microbatches=plan.num_microbatches, kind=kind, sync=syncs[s], stage_devices=len(st.devices),
                    runtime=runtime, recompute=st.recompute, recompute_live=live[s] if live else 1).total_bytes
            out[d] = same[share, kind]
    return out


def simulate(plan: Plan, cluster: Cluster, model: ModelProfile, *, start_s: float = 0.0,
             iterations: int = 1, record: bool = True, runtime: RuntimeModel | None = None) -> SimResult:
    """Simulate ``iterations`` training iterations of ``plan`` as ``runtime`` runs it (default
    the cluster's, :func:`~deepcee.simulator.runtime_model.runtime_for`). See the module docstring.

    ``record=False`` skips building the event list (the planner's fast path); the critical
    path and all statistics are computed either way. Raises :class:`ScheduleError` when the
    schedule deadlocks, naming each stuck action.
    """
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    runtime = runtime or runtime_for(cluster, model)
    with collection_paused():  # see [Note: interpreter without collection]
        return _simulated(plan, cluster, model, start_s, iterations, record, runtime)


def _simulated(plan: Plan, cluster: Cluster, model: ModelProfile, start_s: float, iterations: int, record: bool,
               runtime: RuntimeModel) -> SimResult:
    """:func:`simulate`'s run and results."""
    sim = _Simulation(plan, cluster, model, runtime)
    sim.run(start_s, iterations)
    starts = [start_s, *sim.ends[:-1]]
    times = tuple(e - s for s, e in zip(starts, sim.ends, strict=True))
    total_s = sim.ends[-1] - start_s
    pipe_span = sum(p - s for s, p in zip(starts, sim.pipe_ends, strict=True))
    n = len(sim.devices)
    bubble = 1.0 - sim.exe.compute_s / (n * pipe_span) if pipe_span > 0 else 0.0
    path = sim.critical_path()
    stage_of = dict(zip(sim.devices, sim.stage_of, strict=True))
    mean = total_s / iterations
    result = SimResult(
        iteration_s=mean,
        iteration_times_s=times,
        samples_per_s=plan.global_batch / mean if mean > 0 else float("inf"),
        start_s=start_s,
        end_s=sim.ends[-1],
        pipeline_s=pipe_span / iterations,
        busy_s=dict(zip(sim.devices, sim.busy, strict=True)),
        sync_s=dict(zip(sim.devices, sim.sync, strict=True)),
        comm_wait_s=dict(zip(sim.devices, sim.wait, strict=True)),
        idle_s={d: max(0.0, total_s - b - s - w)
                for d, b, s, w in zip(sim.devices, sim.busy, sim.sync, sim.wait, strict=True)},
        bubble_fraction=min(1.0, max(0.0, bubble)),
        peak_memory_bytes=peak_memory(plan, cluster, model, runtime),
        critical_path=path,
        bottleneck=_bottleneck(path, stage_of, iterations),
        events=sim.events() if record else (),
    )
    log.debug("simulated %s on %s: %.4g s per iteration, bottleneck %s", plan.system, cluster.name,
              mean, result.bottleneck)
    return result


def to_estimate(result: SimResult, plan: Plan, cluster: Cluster) -> Estimate:
    """The simulator's figures as a plan :class:`Estimate`; names any device out of memory."""
    over = [f"{d} needs {b / 2**30:.2f} GiB of {cluster.memory_bytes(d) / 2**30:.2f} GiB"
            for d, b in result.peak_memory_bytes.items() if b > cluster.memory_bytes(d)]
    bottleneck = result.bottleneck + ("; out of memory: " + ", ".join(over) if over else "")
    return Estimate(iteration_s=result.iteration_s, samples_per_s=result.samples_per_s,
                    peak_memory_bytes=dict(result.peak_memory_bytes), bottleneck=bottleneck,
                    source="simulator")
