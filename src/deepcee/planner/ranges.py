"""Costs of every contiguous layer range ``[a, b)`` at once, for the planner's split search.

Torch-free. :class:`RangeTables` holds numpy matrices indexed ``[a, b]`` (``(L+1) x (L+1)``,
meaningful for ``a < b``) built once per cluster and model; :class:`RangeCosts` combines them
for one device set (a candidate stage) with its shares. The terms are those of
:class:`deepcee.planner.cost_model.AnalyticCostModel`, so a split chosen on these tables is
scored the same way afterwards.

[Note: range times]
:meth:`deepcee.profile.ModelProfile.time_s` is the definition of a stage's compute time, and
it is not a sum of one-layer times: a measured kind pays its ``measured_call_overhead`` once
per call (per stage pass), and a stage that starts at layer 0 runs the layers' first-stage
lines. :func:`range_time_s` therefore builds each range's time from ``time_s`` itself:

- analytic kinds: ``time_s`` is a sum over layers, so one prefix sum gives every range;
- measured kinds: each one-layer time ``t(l, l+1)`` carries the call overhead once, read off
  as ``c = t(1, 2) + t(2, 3) - t(1, 3)``; a range ``[a, b)`` with ``a >= 1`` is the sum of
  its one-layer times minus ``(b - a - 1) x c``; the ranges ``[0, b)`` (first-stage lines)
  are evaluated directly, ``L`` calls.

Both agree with ``time_s`` over any range up to rounding (tested on measured profiles with
call overheads, fused backward and first-stage lines).

[Note: planner memory = simulator memory]
The split DP's memory test (:meth:`RangeCosts.memory_excess`, :meth:`RangeCosts.in_flight_caps`)
counts every term of :func:`deepcee.simulator.memory.device_memory`, which the cost model and
the simulator check plans against: the plan terms and the runtime's (communication buffers,
``(2 M - 1) x n x (in + out)`` when receives are posted at the step start; the all-reduce's flat
gradient buffer on a stage of several devices; fragmentation and fixed overhead per device
kind). With the plan terms alone the DP chose splits that the cost model then dropped as out
of memory: on large models with many microbatches every split, so nothing was returned.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from deepcee.cluster import Cluster, DeviceKind
from deepcee.comm import allreduce_curve_s
from deepcee.profile import ModelProfile
from deepcee.simulator.engine import optimizer_step_s
from deepcee.simulator.runtime_model import DEFAULT_RUNTIME, RuntimeModel


def range_time_s(model: ModelProfile, kind: DeviceKind, passes: str, samples: float,
                 slowdown: float = 1.0) -> np.ndarray:
    """``out[a, b] = sum over p in passes of model.time_s(a, b, p, samples, kind, slowdown)`` for
    every ``a, b`` in ``0 .. L`` (0 where ``b <= a``, as ``time_s`` says); ``passes`` is one or
    more of ``F``, ``I``, ``W``, ``B``. See [Note: range times]."""
    n = model.num_layers

    def t(a: int, b: int) -> float:
        return sum(model.time_s(a, b, p, samples, kind, slowdown) for p in passes)

    one = np.array([t(a, a + 1) for a in range(n)])
    if kind.name in model.measured:
        call = one[1] + one[2] - t(1, 3) if n >= 3 else 0.0
        prefix = np.concatenate([[0.0], np.cumsum(one - call)])
        out = prefix[None, :] - prefix[:, None] + call
        out[0, 1:] = [t(0, b) for b in range(1, n + 1)]
    else:
        prefix = np.concatenate([[0.0], np.cumsum(one)])
        out = prefix[None, :] - prefix[:, None]
    return np.triu(out, k=1)


def largest_remainder_shares(devices: Sequence[str], speeds: Sequence[float], samples: int) -> tuple[int, ...]:
    """Whole samples per device, proportional to ``speeds`` (largest remainder), each at least 1.

    Needs ``samples >= len(devices)``; ties go to the earlier device, so the result is deterministic.
    """
    k = len(devices)
    if samples < k:
        raise ValueError(f"{samples} samples cannot give each of {k} devices at least one")
    total = float(sum(speeds))
    ideal = [samples * v / total for v in speeds]
    out = [int(x) for x in ideal]
    order = sorted(range(k), key=lambda j: (-(ideal[j] - out[j]), j))
    for j in order[: samples - sum(out)]:
        out[j] += 1
    zeros = [j for j in range(k) if out[j] == 0]
    if zeros:  # each device rounded to 0 takes one sample from the most loaded device
        heap = [(-(out[x] - 1) / speeds[x], x) for x in range(k) if out[x] > 1]
        heapq.heapify(heap)
        for j in zeros:
            _, donor = heapq.heappop(heap)
            out[donor] -= 1
            out[j] = 1
            if out[donor] > 1:
                heapq.heappush(heap, (-(out[donor] - 1) / speeds[donor], donor))
    return tuple(out)


class RangeCosts:
    """Costs of one device set (a candidate stage) for every layer range ``[a, b)``.

    Matrices are ``(L+1) x (L+1)``, indexed ``[a, b]``, meaningful for ``a < b``:
    ``compute_s`` (``F+I+W`` of one microbatch on the slowest device, exactly
    :func:`~deepcee.planner.cost_model.stage_compute_s` summed), ``allreduce_s`` (the best of
    the tables' syncs), ``optimizer_s``, and per in-flight count a memory matrix (the worst
    device's need minus its memory; > 0 means it does not fit), from the same formulas as
    :class:`~deepcee.planner.cost_model.AnalyticCostModel`. Build through :class:`RangeTables`,
    which shares work.
    """

    def __init__(self, tables: RangeTables, devices: Sequence[str], shares: Sequence[int]) -> None:
        cluster = tables.cluster
        self.devices, self.shares = tuple(devices), tuple(shares)
        self._tables = tables
        self._profiles = sorted({(cluster.device(d).kind, cluster.device(d).slowdown, sh, cluster.memory_bytes(d))
                                 for d, sh in zip(devices, shares, strict=True)})
        self.compute_s = np.max([tables.range_compute_s(kind, slow, share) for kind, slow, share, _ in self._profiles],
                                axis=0)
        self._forward_s: np.ndarray | None = None
        self._caps: dict[tuple[int, bool], np.ndarray] = {}
        self._rt: dict[tuple, np.ndarray] = {}
        self.allreduce_s = tables.allreduce(self.devices)
        slope = max(tables.optimizer_slope(d) for d in devices)
        self.optimizer_s = tables.params * slope
        self._memory: dict[int, np.ndarray] = {}
        self._with: dict[bool, np.ndarray] = {}
        self._loads: dict[tuple, np.ndarray] = {}

    @property
    def forward_s(self) -> np.ndarray:
        """``F`` of one microbatch on the slowest device, per range (what recomputation adds)."""
        if self._forward_s is None:
            self._forward_s = np.max([self._tables.range_compute_s(kind, slow, share, "F")
                                      for kind, slow, share, _ in self._profiles], axis=0)
        return self._forward_s

    def round_trip_s(self, fused: bool, recompute: bool) -> np.ndarray:
        """What one microbatch adds to the round trip through this stage: ``F`` and the backward
        that sends the input gradient (``I``; the fused ``B``, taken as ``I + W``, for schedules
        without split backward), plus the recomputed ``F``."""
        key = ("rt", fused, recompute)
        got = self._rt.get(key)
        if got is None:
            fi = self.compute_s if fused else np.max([self._tables.range_compute_s(kind, slow, share, "FI")
                                                      for kind, slow, share, _ in self._profiles], axis=0)
            got = self._rt[key] = fi + self.forward_s if recompute else fi
        return got

    def compute_with(self, recompute: bool) -> np.ndarray:
        """``F+I+W`` per microbatch, plus one more ``F`` when recomputing ([Note: recompute timing])."""
        if not recompute:
            return self.compute_s
        got = self._with.get(True)
        if got is None:
            got = self._with[True] = self.compute_s + self.forward_s
        return got

    def load(self, m: int, in_flight: int | None, recompute: bool) -> np.ndarray:
        """Per range the iteration load of ``m`` microbatches (:meth:`base_load`), ``inf`` where
        empty or where the stage does not fit memory holding ``in_flight`` (``None``: one)
        microbatches; with ``recompute``, a range that fits only with recomputation gets the
        recomputing load. Cached: the stages of many layouts share a device set and shares."""
        key = (m, in_flight, recompute)
        got = self._loads.get(key)
        if got is None:
            k = 1 if in_flight is None else in_flight
            load = np.where(self.memory_excess(k, False, m) <= 0, self.base_load(m, False), np.inf)
            if recompute:
                load = np.where(np.isfinite(load), load,
                                np.where(self.memory_excess(k, True, m) <= 0, self.base_load(m, True), np.inf))
            got = self._loads[key] = load
        return got

    def base_load(self, m: int, recompute: bool) -> np.ndarray:
        """Per range ``m x (F+I+W) + all-reduce + optimizer`` (``inf`` where ``b <= a``), memory
        unchecked; ``recompute``: with the recomputed ``F``."""
        key = (m, "base", recompute)
        got = self._loads.get(key)
        if got is None:
            size = self.compute_s.shape[0]
            invalid = np.tril(np.ones((size, size), dtype=bool))
            got = self._loads[key] = np.where(invalid, np.inf, m * self.compute_with(recompute) + self.allreduce_s
                                              + self.optimizer_s)
        return got

    def _memory_terms(self, kind: str, share: int, m: int, recompute: bool) -> tuple[np.ndarray, np.ndarray, float, float]:
        """:meth:`RangeTables.memory_terms` of one of this stage's devices."""
        return self._tables.memory_terms(kind, share, m, recompute, len(self.devices) > 1)


    def memory_excess(self, in_flight: int, recompute: bool, m: int) -> np.ndarray:
        """Worst device's ``need - memory`` (bytes) per range with ``in_flight`` microbatches held of
        ``m`` per iteration (:func:`deepcee.simulator.memory.device_memory`, plan and runtime terms;
        recomputing: one live microbatch)."""
        key = (max(1, in_flight), recompute, m)
        got = self._memory.get(key)
        if got is None:
            got = np.full_like(self._tables.params, -np.inf)
            several = len(self.devices) > 1
            for kind, _, share, mem in self._profiles:
                got = np.maximum(got, self._tables.device_excess(kind, share, m, recompute, several, key[0], mem))
            self._memory[key] = got
        return got

    def in_flight_caps(self, m: int, recompute: bool = False) -> np.ndarray:
        """Per range, the most microbatches (<= ``m``, the microbatches per iteration) every device
        can hold; 0 where not one."""
        key = (m, recompute)
        got = self._caps.get(key)
        if got is None:
            got = np.full_like(self._tables.params, float(m))
            for kind, _, share, mem in self._profiles:
                base, per, frac, fixed = self._memory_terms(kind, share, m, recompute)
                room = (mem - fixed) / (1 + frac) - base
                with np.errstate(divide="ignore", invalid="ignore"):
                    k = np.where(per > 0, np.floor(room / np.where(per > 0, per, 1.0) * (1 + 1e-12)), m)
                got = np.minimum(got, np.where(room < per, 0.0, k))
            got = self._caps[key] = np.clip(got, 0.0, m)
        return got

    def max_in_flight(self, start: int, stop: int, m: int, recompute: bool = False) -> int:
        """Most microbatches (<= ``m``, the microbatches per iteration) the stage can hold on layers
        ``[start, stop)``; 0 if not one."""
        return int(self.in_flight_caps(m, recompute)[start, stop])


def syncs_differ(cluster: Cluster, slots: Sequence[Sequence[str]]) -> bool:
    """Whether ring and hierarchical all-reduce differ on stages ``slots``: some stage spans nodes
    and holds several devices of one of them (else the two coincide, as the cost model's tables
    assume: :meth:`RangeTables.allreduce`)."""
    for devices in slots:
        nodes = [cluster.device(d).node for d in devices]
        if 1 < len(set(nodes)) < len(nodes):
            return True
    return False


class RangeTables:
    """Shared tables for :class:`RangeCosts`: range compute times per (kind, slowdown, share),
    all-reduce curves per device set, parameter/activation/buffer matrices.

    All-reduce curves interpolate linearly in gradient bytes between exact
    :func:`~deepcee.comm.allreduce_s` evaluations on a geometric grid of
    ``grid_points`` sizes (exact at the grid points; the curve is piecewise linear and
    convex, so the interpolation is a slight over-estimate in between).
    """

    def __init__(self, cluster: Cluster, model: ModelProfile, syncs: Sequence[str] = ("allreduce-ring",),
                 grid_points: int = 4, runtime: RuntimeModel = DEFAULT_RUNTIME) -> None:
        self.cluster, self.model, self.syncs, self.grid_points = cluster, model, tuple(syncs), grid_points
        self.runtime = runtime
        """How the plans are run: its communication buffers count in memory."""
        n = model.num_layers
        params = np.concatenate([[0.0], np.cumsum([la.parameter_count for la in model.layers])])
        self.params = params[None, :] - params[:, None]
        acts = np.concatenate([[0.0], np.cumsum([la.activation_bytes for la in model.layers])])
        self.acts = acts[None, :] - acts[:, None]
        self.state = self.params * model.state_bytes_per_parameter
        self.boundary_bytes = np.array([model.boundary_bytes(b) for b in range(n + 1)])
        self.buffers = self.boundary_bytes[:, None] + self.boundary_bytes[None, :]
        self.inputs = np.broadcast_to(self.boundary_bytes[:, None], self.buffers.shape)
        """What a recomputing stage keeps per sample in flight: its input (row ``a``)."""
        ends = self.boundary_bytes.copy()
        ends[0] = ends[-1] = 0.0
        self.moved = ends[:, None] + ends[None, :]
        """Bytes per sample a stage on ``[a, b)`` receives and sends (none at the pipeline's ends)."""
        grads = np.concatenate([[0.0], np.cumsum([model.gradient_bytes(i, i + 1) for i in range(n)])])
        self.grads = grads[None, :] - grads[:, None]
        self.grads_total = float(grads[-1])
        self._compute: dict[tuple, np.ndarray] = {}
        self._allreduce: dict[tuple[str, ...], np.ndarray] = {}
        self._slope: dict[tuple[str, float], float] = {}
        self._costs: dict[tuple, RangeCosts] = {}
        self._memory_terms: dict[tuple, tuple[np.ndarray, np.ndarray, float, float]] = {}
        self._excess: dict[tuple, np.ndarray] = {}

    def memory_terms(self, kind: str, share: int, m: int, recompute: bool,
                     several: bool) -> tuple[np.ndarray, np.ndarray, float, float]:
        """One device's peak per range as ``(1 + fragmentation) x (base + k x per) + fixed`` for ``k``
        microbatches held (``k >= 1``): :func:`deepcee.simulator.memory.device_memory`'s plan and
        runtime terms ([Note: planner memory = simulator memory]), for a device of ``kind`` with
        ``share`` samples per microbatch of ``m`` per iteration, on a stage of ``several`` devices
        or one. Returns (base, per, fragmentation, fixed); cached (the same for every stage)."""
        key = (kind, share, m, recompute, several)
        got = self._memory_terms.get(key)
        if got is not None:
            return got
        rt = self.runtime
        base = self.state + share * self.buffers + (share * self.acts if recompute else 0.0)
        per = share * (self.inputs if recompute else self.acts)
        moved = share * self.moved
        if rt.receives == "at-step-start":  # every receive and send buffer of the step held at once
            base = base + max(0, 2 * m - 1) * moved
        else:  # (k - 1) more pairs
            base, per = base - moved, per + moved
        if several:  # the all-reduce's flat gradient buffer
            base = base + self.grads
        over = self.model.memory_overhead(kind)
        if over is not None and over.host_memory and rt.holds_whole_model:
            base = base + (self.grads_total - self.grads)
        frac, fixed = (over.fragmentation_fraction, over.fixed_bytes) if over is not None else (0.0, 0.0)
        got = self._memory_terms[key] = (base, per, frac, fixed)
        return got

    def device_excess(self, kind: str, share: int, m: int, recompute: bool, several: bool, in_flight: int,
                      memory: float) -> np.ndarray:
        """One device's ``need - memory`` per range holding ``in_flight`` (>= 1) microbatches
        (:meth:`memory_terms`); cached."""
        key = (kind, share, m, recompute, several, in_flight, memory)
        got = self._excess.get(key)
        if got is None:
            base, per, frac, fixed = self.memory_terms(kind, share, m, recompute, several)
            got = self._excess[key] = (1 + frac) * (base + in_flight * per) + fixed - memory
        return got

    def costs(self, devices: Sequence[str], shares: Sequence[int]) -> RangeCosts:
        key = (tuple(devices), tuple(shares))
        got = self._costs.get(key)
        if got is None:
            got = self._costs[key] = RangeCosts(self, devices, shares)
        return got

    def range_compute_s(self, kind: str, slowdown: float, share: int, passes: str = "FIW") -> np.ndarray:
        """``F+I+W`` (or ``passes``) of one device profile for every range (see [Note: range times])."""
        key = (kind, slowdown, share, passes)
        got = self._compute.get(key)
        if got is None:
            k = self.cluster.kinds[kind]
            got = self._compute[key] = range_time_s(self.model, k, passes, share, slowdown)
        return got

    def optimizer_slope(self, device: str) -> float:
        """Optimizer seconds per parameter on ``device`` (:func:`optimizer_step_s` is linear)."""
        d = self.cluster.device(device)
        key = (d.kind, d.slowdown)
        if key not in self._slope:
            m = self.model
            self._slope[key] = optimizer_step_s(m, 0, m.num_layers, self.cluster.kinds[d.kind], d.slowdown) / max(
                1, m.parameter_count)
        return self._slope[key]

    def allreduce(self, devices: tuple[str, ...]) -> np.ndarray:
        got = self._allreduce.get(devices)
        if got is None:
            grad = self.params * self.model.gradient_bytes_per_parameter
            got = np.zeros_like(grad)
            if len(devices) > 1 and grad.max() > 0:
                positive = grad[grad > 0]
                xs = np.unique(np.geomspace(positive.min(), positive.max(), self.grid_points))
                syncs = self.syncs if syncs_differ(self.cluster, [devices]) else self.syncs[:1]
                curves = [allreduce_curve_s(self.cluster, devices, [float(x) for x in xs], s) for s in syncs]
                ys = [min(c[k] for c in curves) for k in range(len(xs))]
                got = np.where(grad > 0, np.interp(grad, xs, ys), 0.0)
            self._allreduce[devices] = got
        return got
