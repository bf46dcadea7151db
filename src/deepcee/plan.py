"""The plan: the contract read by the simulator and the runtime (torch-free).

A plan holds one or more **replicas**. A replica is one pipeline: contiguous runs of layers
(stages) on sets of devices, each device with a *share* (whole samples) of every microbatch,
a microbatch size and count, and a schedule. Replicas may differ (islands, stage counts,
layer splits, devices); each processes its own batch, ``microbatch_size x num_microbatches``
samples per step, and the plan's ``global_batch`` is their sum. How the holders of a layer
(every device, in every replica, whose stage holds it) agree on its parameters is given by
two fields: ``sync``, the collective that combines gradients (ring or hierarchical
all-reduce, ZeRO-2, parameter servers; a stage may override it, HeteroG-style), and
``strategy``, the update rule: ``exact`` (every step, the single-process result) or one of
the relaxed rules (asynchronous SGD with gradient accumulation, periodic model averaging,
partial averaging among ready replicas), opt-in. The planner writes plans; the simulator
and the runtime only read them.

A plan with one replica reads like a schema-1 plan: ``plan.stages``, ``plan.schedule``,
``plan.microbatch_size`` ... are that replica's (they raise :class:`PlanError` on a plan
with several replicas, so code that handles one pipeline fails loudly on more), and
``Plan(stages=..., microbatch_size=..., ...)`` builds it. Schema-1 files still load.

[Note: share-based resharding]
Within a microbatch, samples are numbered ``0 .. microbatch_size-1`` and device ``k`` of a
stage owns the contiguous range ``[sum(shares[:k]), sum(shares[:k+1]))``. When stage ``s``
and stage ``s+1`` have different devices or shares, sender ``i`` of stage ``s`` sends to
receiver ``j`` of stage ``s+1`` exactly the samples in the intersection of their ranges
(:func:`share_overlaps`); the backward pass sends the same ranges the other way.

[Note: replica batches]
Replica ``r`` owns samples ``[sum(batch[:r]), sum(batch[:r+1]))`` of every global batch
(``batch = microbatch_size x num_microbatches`` of each replica, replicas in plan order), and
inside them microbatch ``m`` is ``[m x microbatch_size, (m+1) x microbatch_size)``. Under the
``exact`` strategy every device weights its mean loss by ``share / global_batch``, so the
gradients summed over all holders of a layer are the global-batch mean, whatever the
replicas look like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from deepcee.errors import PlanError
from deepcee.jsonio import save_json_atomic

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)

ScheduleName = Literal["gpipe", "1f1b", "zb-h1", "zb-h2", "compact"]
SCHEDULES: tuple[ScheduleName, ...] = get_args(ScheduleName)
SyncName = Literal["allreduce-ring", "allreduce-hier", "zero2", "ps", "none"]
SYNCS: tuple[SyncName, ...] = get_args(SyncName)
"""How the holders of a layer combine gradients: ring all-reduce over all of them,
hierarchical all-reduce (inside islands first, then across), ZeRO-2 (reduce-scatter of
gradients, sharded optimizer states, all-gather of parameters), parameter servers (push to
the server of one's island, servers combine, pull), or none (no layer has two holders)."""
StrategyKind = Literal["exact", "asgd-ga", "model-averaging", "partial"]
STRATEGIES: tuple[StrategyKind, ...] = get_args(StrategyKind)
OuterOptimizer = Literal["average", "nesterov"]
OUTER_OPTIMIZERS: tuple[OuterOptimizer, ...] = get_args(OuterOptimizer)
Semantics = Literal["exact", "relaxed"]
EstimateSource = Literal["cost-model", "simulator"]
"""Who made an :class:`Estimate`."""
ESTIMATE_SOURCES: tuple[EstimateSource, ...] = get_args(EstimateSource)


def share_ranges(shares: Sequence[int]) -> list[tuple[int, int]]:
    """Sample range ``[lo, hi)`` of each device of a stage. See [Note: share-based resharding]."""
    out, lo = [], 0
    for s in shares:
        out.append((lo, lo + s))
        lo += s
    return out


def share_overlaps(src_shares: Sequence[int], dst_shares: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """``(src_index, dst_index, lo, hi)`` for every pair of devices that share samples."""
    if sum(src_shares) != sum(dst_shares):
        raise PlanError(f"shares {list(src_shares)} and {list(dst_shares)} cover different microbatch sizes")
    # one merge of the two lists of consecutive ranges (every pair that overlaps, in (i, j) order;
    # a pairwise scan was quadratic in the stage sizes: 3 of 28 CPU s of compare at 512 devices)
    out, i, j, a_lo, b_lo = [], 0, 0, 0, 0
    while i < len(src_shares) and j < len(dst_shares):
        a_hi, b_hi = a_lo + src_shares[i], b_lo + dst_shares[j]
        lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
        if lo < hi:
            out.append((i, j, lo, hi))
        if a_hi <= b_hi:
            i, a_lo = i + 1, a_hi
        if b_hi <= a_hi:
            j, b_lo = j + 1, b_hi
    return out


def _whole(name: str, value: Any, minimum: int, where: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"must be an integer >= {minimum}, got {value!r}", field=where + name)


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """One pipeline stage: layers ``[layer_start, layer_stop)`` on ``devices`` with ``shares``."""

    layer_start: int
    layer_stop: int
    devices: tuple[str, ...]
    shares: tuple[int, ...]
    """Samples of every microbatch each device processes (same order as ``devices``)."""
    recompute: bool = False
    """Activation recomputation: keep only each microbatch's stage input between forward and
    backward and run the forward again before the backward (memory for compute)."""
    sync: SyncName | None = None
    """This stage's layers combine gradients this way instead of the plan's ``sync``
    (HeteroG: parameter server or all-reduce chosen per stage)."""

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_stop:
            raise PlanError(f"stage layers [{self.layer_start}, {self.layer_stop}) are empty or negative")
        if not self.devices:
            raise PlanError("a stage needs at least one device")
        if len(self.shares) != len(self.devices):
            raise PlanError(f"stage on {list(self.devices)}: {len(self.shares)} shares for {len(self.devices)} devices")
        if any((not isinstance(s, int)) or s < 1 for s in self.shares):
            raise PlanError(f"stage on {list(self.devices)}: shares must be whole samples >= 1, got {list(self.shares)}")
        if len(set(self.devices)) != len(self.devices):
            raise PlanError(f"stage lists a device twice: {list(self.devices)}")
        if not isinstance(self.recompute, bool):
            raise PlanError(f"stage on {list(self.devices)}: recompute must be true or false, got {self.recompute!r}")
        if self.sync is not None and self.sync not in SYNCS:
            raise PlanError(f"stage on {list(self.devices)}: unknown sync {self.sync!r} (known: {', '.join(SYNCS)})")

    @property
    def microbatch_size(self) -> int:
        return sum(self.shares)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layer_start": self.layer_start, "layer_stop": self.layer_stop,
                             "devices": list(self.devices), "shares": list(self.shares)}
        if self.recompute:
            d["recompute"] = True
        if self.sync is not None:
            d["sync"] = self.sync
        return d


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaPlan:
    """One pipeline: stages, microbatches and schedule. See the module docstring."""

    stages: tuple[StagePlan, ...]
    microbatch_size: int
    num_microbatches: int
    schedule: ScheduleName
    actions: tuple[tuple[str, ...], ...] = ()
    """Per-stage compute actions in string form (``"1F0"``). Required for ``compact``;
    otherwise empty and rebuilt from ``schedule`` by :func:`deepcee.schedule.build_schedule`."""

    def __post_init__(self) -> None:
        self.check()

    def check(self, where: str = "") -> None:
        """Raise :class:`PlanError` naming ``where`` + the field (``replicas[1].stages[0]...``)."""
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r} (known: {', '.join(SCHEDULES)})",
                            field=where + "schedule")
        _whole("microbatch_size", self.microbatch_size, 1, where)
        _whole("num_microbatches", self.num_microbatches, 1, where)
        if not self.stages:
            raise PlanError("a replica needs at least one stage", field=where + "stages")
        seen: set[str] = set()
        for i, st in enumerate(self.stages):
            if st.microbatch_size != self.microbatch_size:
                raise PlanError(
                    f"shares {list(st.shares)} sum to {st.microbatch_size}, microbatch_size is {self.microbatch_size}",
                    field=f"{where}stages[{i}].shares",
                )
            if i and st.layer_start != self.stages[i - 1].layer_stop:
                raise PlanError(
                    f"starts at layer {st.layer_start}, previous stage stops at {self.stages[i - 1].layer_stop}",
                    field=f"{where}stages[{i}].layer_start",
                )
            dup = seen & set(st.devices)
            if dup:
                raise PlanError(f"device {sorted(dup)[0]!r} is in two stages", field=f"{where}stages[{i}].devices")
            seen |= set(st.devices)
        if self.stages[0].layer_start != 0:
            raise PlanError(f"first stage starts at layer {self.stages[0].layer_start}, not 0",
                            field=f"{where}stages[0]")
        if self.actions and len(self.actions) != len(self.stages):
            raise PlanError(f"{len(self.actions)} action lists for {len(self.stages)} stages", field=where + "actions")
        if self.schedule == "compact" and not self.actions:
            raise PlanError("schedule 'compact' needs explicit per-stage actions", field=where + "actions")

    @property
    def batch(self) -> int:
        """Samples this replica processes per step."""
        return self.microbatch_size * self.num_microbatches

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layer_stop

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for st in self.stages for d in st.devices)

    def stage_of(self, device: str) -> int:
        for i, st in enumerate(self.stages):
            if device in st.devices:
                return i
        raise PlanError(f"device {device!r} is not in the replica")

    def to_dict(self) -> dict[str, Any]:
        return {"microbatch_size": self.microbatch_size, "num_microbatches": self.num_microbatches,
                "schedule": self.schedule, "stages": [s.to_dict() for s in self.stages],
                "actions": [list(a) for a in self.actions]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    """The update rule that joins replicas. ``exact``: every step, gradients of all holders of a
    layer are combined (``Plan.sync``) before one optimizer step, which gives the single-process
    result. The relaxed rules trade statistical efficiency for speed and are opt-in:

    - ``asgd-ga`` (Cloudless-Training): each replica accumulates the gradients of
      ``accumulation_steps`` local steps, pushes them to the parameter servers
      (``Plan.servers``) without waiting for the others, and pulls the servers' newest model;
      a replica may not start a round while its model is more than ``staleness_bound`` server
      updates old.
    - ``model-averaging`` (Cloudless-Training's inter-PS averaging; DiLoCo with an outer
      optimizer): replicas train independently and every ``period`` local steps average their
      models; with ``outer_optimizer = "nesterov"`` the average change is applied through an
      outer SGD with Nesterov momentum (``outer_lr``, ``outer_momentum``).
    - ``partial`` (SDPipe): after every step, the replicas that are ready within ``window_s``
      (at least ``min_group``, at most ``max_group``; 0 = no upper bound) average their
      parameters, formed centrally, averaged among themselves; every ``full_sync_every``
      steps all replicas average (1 = every step, an all-reduce).
    """

    kind: StrategyKind = "exact"
    accumulation_steps: int = 1
    staleness_bound: int = 0
    """``asgd-ga``: the most server updates a replica's model may lag behind (>= 1)."""
    period: int = 1
    """``model-averaging``: local steps between averages (H)."""
    outer_optimizer: OuterOptimizer = "average"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    window_s: float = 0.0
    min_group: int = 2
    max_group: int = 0
    full_sync_every: int = 1
    overlap: bool = False
    """``model-averaging`` only: the average is applied one period late instead of blocking."""

    def __post_init__(self) -> None:
        if self.kind not in STRATEGIES:
            raise PlanError(f"unknown strategy {self.kind!r} (known: {', '.join(STRATEGIES)})", field="strategy.kind")
        for name in ("accumulation_steps", "period", "full_sync_every"):
            _whole(name, getattr(self, name), 1, "strategy.")
        for name in ("staleness_bound", "max_group"):
            _whole(name, getattr(self, name), 0, "strategy.")
        _whole("min_group", self.min_group, 1, "strategy.")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise PlanError(f"unknown outer optimizer {self.outer_optimizer!r} (known: {', '.join(OUTER_OPTIMIZERS)})",
                            field="strategy.outer_optimizer")
        for name, lo in (("outer_lr", 0.0), ("outer_momentum", 0.0), ("window_s", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
                raise PlanError(f"must be a finite number >= {lo:g}, got {v!r}", field=f"strategy.{name}")
        if self.outer_momentum >= 1:
            raise PlanError(f"must be < 1, got {self.outer_momentum!r}", field="strategy.outer_momentum")
        if self.kind == "asgd-ga" and self.staleness_bound < 1:
            raise PlanError(f"asgd-ga needs a staleness bound >= 1, got {self.staleness_bound}",
                            field="strategy.staleness_bound")
        if self.max_group and self.max_group < self.min_group:
            raise PlanError(f"max_group {self.max_group} < min_group {self.min_group}", field="strategy.max_group")
        if not isinstance(self.overlap, bool):
            raise PlanError(f"must be true or false, got {self.overlap!r}", field="strategy.overlap")
        if self.overlap and self.kind != "model-averaging":
            raise PlanError(f"overlap applies to model-averaging only, not {self.kind!r}", field="strategy.overlap")

    @property
    def semantics(self) -> Semantics:
        return "exact" if self.kind == "exact" else "relaxed"

    def describe(self) -> str:
        """One line for reports: the rule, its settings and its semantics."""
        if self.kind == "exact":
            return "exact (synchronous: the single-process result every step)"
        settings = {
            "asgd-ga": f"k={self.accumulation_steps}, staleness <= {self.staleness_bound}",
            "model-averaging": f"H={self.period}, outer {self.outer_optimizer}"
                               + (f" lr {self.outer_lr:g} momentum {self.outer_momentum:g}"
                                  if self.outer_optimizer == "nesterov" else "")
                               + (", overlapped (applied one period late)" if self.overlap else ""),
            "partial": f"window {self.window_s:g} s, group {self.min_group}-{self.max_group or 'all'}, "
                       f"full sync every {self.full_sync_every}",
        }[self.kind]
        return f"{self.kind} ({settings}; relaxed: not the single-process result)"

    def to_dict(self) -> dict[str, Any]:
        # ``overlap`` only when set: plans and calibration files without it read as False, and
        # every file written before it existed stays byte for byte what it was
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "overlap" or self.overlap}


EXACT = Strategy()


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """What the planner or simulator predicted for a plan."""

    iteration_s: float
    samples_per_s: float
    peak_memory_bytes: Mapping[str, float] = field(default_factory=dict)
    bottleneck: str = ""
    source: EstimateSource = "cost-model"
    """``cost-model`` (analytic) or ``simulator``."""

    def exceeds_memory(self, memory_bytes: Callable[[str], float]) -> bool:
        """Whether some device's predicted peak is above ``memory_bytes(device)`` (e.g.
        :meth:`deepcee.cluster.Cluster.memory_bytes`): the plan does not fit."""
        return any(b > memory_bytes(d) for d, b in self.peak_memory_bytes.items())

    def __post_init__(self) -> None:
        if self.source not in ESTIMATE_SOURCES:
            raise PlanError(f"unknown estimate source {self.source!r} (known: {', '.join(ESTIMATE_SOURCES)})",
                            field="estimate.source")


_PIPELINE_FIELDS = ("stages", "microbatch_size", "num_microbatches", "schedule", "actions")


@dataclass(frozen=True, slots=True, init=False)
class Plan:
    """A complete training plan. See the module docstring.

    Build it with ``replicas=(ReplicaPlan(...), ...)``, or, for one pipeline, with the
    replica's fields directly: ``Plan(stages=..., microbatch_size=..., num_microbatches=...,
    schedule=..., actions=...)``.
    """

    system: str
    """Who made it: ``deepcee`` or a baseline's name (``ddp``, ``gpipe-even``, ...)."""
    cluster: str
    model: str
    global_batch: int
    """Samples per step over all replicas (the sum of their batches)."""
    replicas: tuple[ReplicaPlan, ...]
    sync: SyncName
    """How the holders of a layer combine gradients (a stage's own ``sync`` overrides it)."""
    strategy: Strategy
    servers: tuple[str, ...]
    """Devices that host a parameter server (one per island, Cloudless-Training style), for
    ``sync = "ps"`` stages and the ``asgd-ga`` strategy; a server may also compute."""
    excluded_devices: tuple[str, ...]
    estimate: Estimate | None
    explanation: tuple[str, ...]

    def __init__(self, *, system: str, cluster: str, model: str, global_batch: int,
                 replicas: Sequence[ReplicaPlan] | None = None, sync: SyncName = "allreduce-ring",
                 strategy: Strategy = EXACT, servers: Sequence[str] = (), excluded_devices: Sequence[str] = (),
                 estimate: Estimate | None = None, explanation: Sequence[str] = (),
                 stages: Sequence[StagePlan] | None = None, microbatch_size: int | None = None,
                 num_microbatches: int | None = None, schedule: ScheduleName | None = None,
                 actions: Sequence[Sequence[str]] = ()) -> None:
        if replicas is None:
            if stages is None or microbatch_size is None or num_microbatches is None or schedule is None:
                raise PlanError("a plan needs replicas, or stages, microbatch_size, num_microbatches and schedule",
                                field="replicas")
            replicas = (_replica(stages, microbatch_size, num_microbatches, schedule, actions, where=""),)
        elif stages is not None or microbatch_size is not None or num_microbatches is not None or schedule is not None:
            raise PlanError("give either replicas or one pipeline's stages/microbatches/schedule, not both",
                            field="replicas")
        values = {"system": system, "cluster": cluster, "model": model, "global_batch": global_batch,
                  "replicas": tuple(replicas), "sync": sync, "strategy": strategy, "servers": tuple(servers),
                  "excluded_devices": tuple(excluded_devices), "estimate": estimate,
                  "explanation": tuple(explanation)}
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.sync not in SYNCS:
            raise PlanError(f"unknown sync {self.sync!r} (known: {', '.join(SYNCS)})", field="sync")
        if not isinstance(self.strategy, Strategy):
            raise PlanError(f"must be a Strategy, got {self.strategy!r}", field="strategy")
        _whole("global_batch", self.global_batch, 1)
        if not self.replicas:
            raise PlanError("a plan needs at least one replica", field="replicas")
        many = len(self.replicas) > 1
        for r, rep in enumerate(self.replicas):
            if not isinstance(rep, ReplicaPlan):
                raise PlanError(f"must be a ReplicaPlan, got {type(rep).__name__}", field=f"replicas[{r}]")
        total = sum(rep.batch for rep in self.replicas)
        if total != self.global_batch:
            what = ("replica batches " + " + ".join(str(rep.batch) for rep in self.replicas) if many else
                    f"microbatch_size {self.replicas[0].microbatch_size} x num_microbatches "
                    f"{self.replicas[0].num_microbatches}")
            raise PlanError(f"{what} != global_batch {self.global_batch}", field="global_batch")
        self._check_replicas_agree()
        self._check_sync()

    def _check_replicas_agree(self) -> None:
        layers = self.replicas[0].num_layers
        seen: dict[str, int] = {}
        for r, rep in enumerate(self.replicas):
            if rep.num_layers != layers:
                raise PlanError(f"covers {rep.num_layers} layers, replica 0 covers {layers}",
                                field=f"replicas[{r}].stages")
            for d in rep.devices:
                if d in seen:
                    raise PlanError(f"device {d!r} is in replicas {seen[d]} and {r}", field=f"replicas[{r}].stages")
                seen[d] = r

    def _check_sync(self) -> None:
        if len(set(self.servers)) != len(self.servers):
            raise PlanError(f"a device is listed twice: {list(self.servers)}", field="servers")
        if self.strategy.kind != "exact" and len(self.replicas) < 2:
            raise PlanError(f"strategy {self.strategy.kind!r} joins replicas; the plan has one", field="strategy.kind")
        wants_servers = self.strategy.kind == "asgd-ga" or "ps" in self.syncs_used
        if wants_servers and not self.servers:
            raise PlanError("parameter-server sync needs at least one server device", field="servers")

    # -- one pipeline (schema-1 view) -------------------------------------------------------
    def _only(self) -> ReplicaPlan:
        if len(self.replicas) != 1:
            raise PlanError(f"plan {self.system!r} has {len(self.replicas)} replicas; this reads one pipeline "
                            "(use plan.replicas)", field="replicas")
        return self.replicas[0]

    @property
    def stages(self) -> tuple[StagePlan, ...]:
        return self._only().stages

    @property
    def microbatch_size(self) -> int:
        return self._only().microbatch_size

    @property
    def num_microbatches(self) -> int:
        return self._only().num_microbatches

    @property
    def schedule(self) -> ScheduleName:
        return self._only().schedule

    @property
    def actions(self) -> tuple[tuple[str, ...], ...]:
        return self._only().actions

    @property
    def num_stages(self) -> int:
        return self._only().num_stages

    def stage_of(self, device: str) -> int:
        return self._only().stage_of(device)

    # -- every replica ------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def num_layers(self) -> int:
        return self.replicas[0].num_layers

    @property
    def devices(self) -> tuple[str, ...]:
        """Every computing device, replicas in order (the rank order of a launch)."""
        return tuple(d for rep in self.replicas for d in rep.devices)

    @property
    def semantics(self) -> Semantics:
        return self.strategy.semantics

    @property
    def syncs_used(self) -> frozenset[str]:
        return frozenset(st.sync or self.sync for rep in self.replicas for st in rep.stages)

    def locate(self, device: str) -> tuple[int, int]:
        """``(replica, stage)`` of a computing device."""
        for r, rep in enumerate(self.replicas):
            for s, st in enumerate(rep.stages):
                if device in st.devices:
                    return r, s
        raise PlanError(f"device {device!r} is not in the plan")

    def replica_offsets(self) -> tuple[int, ...]:
        """First sample of each replica in the global batch. See [Note: replica batches]."""
        out, lo = [], 0
        for rep in self.replicas:
            out.append(lo)
            lo += rep.batch
        return tuple(out)

    def check_against(self, *, num_layers: int, device_names: Sequence[str], file: str | None = None) -> None:
        """Raise :class:`PlanError` if the plan does not fit the model or the cluster."""
        if self.num_layers != num_layers:
            raise PlanError(
                f"plan covers {self.num_layers} layers, model {self.model!r} has {num_layers}",
                file=file, field="stages" if len(self.replicas) == 1 else "replicas",
            )
        known = set(device_names)
        for r, rep in enumerate(self.replicas):
            for s, st in enumerate(rep.stages):
                for i, d in enumerate(st.devices):
                    if d not in known:
                        raise PlanError(f"device {d!r} is not in cluster {self.cluster!r}", file=file,
                                        field=f"replicas[{r}].stages[{s}].devices[{i}]")
        for i, d in enumerate(self.servers):
            if d not in known:
                raise PlanError(f"device {d!r} is not in cluster {self.cluster!r}", file=file, field=f"servers[{i}]")

    def replace(self, **changes: Any) -> Plan:
        """A copy with ``changes``; one pipeline's fields (``stages``, ``schedule``, ...) change
        the plan's only replica."""
        d: dict[str, Any] = {f: getattr(self, f) for f in self.__dataclass_fields__}
        pipeline = {k: changes.pop(k) for k in _PIPELINE_FIELDS if k in changes}
        d.update(changes)
        if pipeline:
            rep = self._only()
            fields = {k: pipeline.get(k, getattr(rep, k)) for k in _PIPELINE_FIELDS}
            d["replicas"] = (_replica(**fields, where=""),)
        return Plan(**d)

    def to_dict(self) -> dict[str, Any]:
        est = None
        if self.estimate is not None:
            e = self.estimate
            est = {
                "iteration_s": e.iteration_s,
                "samples_per_s": e.samples_per_s,
                "peak_memory_bytes": dict(e.peak_memory_bytes),
                "bottleneck": e.bottleneck,
                "source": e.source,
            }
        return {
            "schema_version": SCHEMA_VERSION,
            "format": "deepcee.plan",
            "system": self.system,
            "cluster": self.cluster,
            "model": self.model,
            "global_batch": self.global_batch,
            "semantics": self.semantics,
            "sync": self.sync,
            "strategy": self.strategy.to_dict(),
            "servers": list(self.servers),
            "replicas": [r.to_dict() for r in self.replicas],
            "excluded_devices": list(self.excluded_devices),
            "estimate": est,
            "explanation": list(self.explanation),
        }


def _replica(stages: Sequence[StagePlan], microbatch_size: int, num_microbatches: int, schedule: ScheduleName,
             actions: Sequence[Sequence[str]], *, where: str) -> ReplicaPlan:
    """A replica whose errors name ``where`` + the field (schema-1 field names for ``where=""``)."""
    try:
        return ReplicaPlan(stages=tuple(stages), microbatch_size=microbatch_size, num_microbatches=num_microbatches,
                           schedule=schedule, actions=tuple(tuple(a) for a in actions))
    except PlanError as exc:
        if not where:
            raise
        raise PlanError(str(exc).replace(f"{exc.field}: ", "", 1) if exc.field else str(exc),
                        field=where + (exc.field or "")) from None


__all__ = ["ESTIMATE_SOURCES", "EXACT", "OUTER_OPTIMIZERS", "SCHEDULES", "STRATEGIES", "SYNCS", "Estimate",
           "EstimateSource", "Plan", "ReplicaPlan", "Semantics", "StagePlan", "Strategy", "save_json_atomic", "share_overlaps", "share_ranges"]


from deepcee._callable import make_callable  # noqa: E402  [Note: callable modules]

make_callable(__name__)
