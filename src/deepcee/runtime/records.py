"""What a run records: per-rank and per-step metrics and the run's result, as typed records.

Every launch path returns the same :class:`TrainResult` (local processes, the real-network
mode, ``torchrun`` through :func:`deepcee.runtime.rank.run_jobs_on_rank`, and the adapter,
which fills :attr:`TrainResult.adapter`). On disk, rank 0 writes one :meth:`StepMetrics.to_dict`
per line of ``<run_dir>/metrics.jsonl`` and :meth:`TrainResult.to_dict` to
``<run_dir>/result.json``; ``from_dict`` reads them back (files written before the metrics
lines carried ``schema_version`` have the same keys and still load).

Units: seconds are *emulated* seconds (wall seconds divided by the run's dilation) everywhere
except in :class:`RankMetrics`, which travels from each rank to rank 0 before the division
(its ``transfers`` excepted: they are already emulated seconds since the run's epoch).
Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from deepcee.errors import RunFileError
from deepcee.inputs import read_json, read_json_lines
from deepcee.plan import EXACT, Plan, Semantics, Strategy
from deepcee.planfile import plan_from_dict
from deepcee.runtime.emulation import EmulationInfo
from deepcee.runtime.replica_records import StrategyRun
from deepcee.runtime.target import TargetOutcome, clock_of, outcome

METRICS_SCHEMA_VERSION = 1
RESULT_FORMAT = "deepcee.train-result"
RESULT_SCHEMA_VERSION = 1

Timed = tuple[str, float, float]
"""``(action, start_s, end_s)`` of one schedule action."""
Transfer = tuple[str, int, float, float]
"""``(link resource, bytes, send start_s, delivery_s)`` of one received piece."""


def _info(d: Mapping[str, Any]) -> EmulationInfo:
    return EmulationInfo(mode=d["mode"], dilation=float(d["dilation"]), cores=float(d["cores"]),
                         emulated=tuple(d["emulated"]))


# -- one rank, one step (gathered on rank 0, never written) --------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RankChange:
    """This rank's part of a plan change applied before the step (emulated seconds)."""

    change_s: float
    """The whole change on this rank: state moves and rebuilding."""
    move_s: float
    """Of which moving parameters and optimizer state."""

    def to_dict(self) -> dict[str, float]:
        return {"change_s": self.change_s, "move_s": self.move_s}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RankChange:
        return RankChange(change_s=float(d["change_s"]), move_s=float(d["move_s"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMetrics:
    """What one active rank did in one step (wall seconds, not yet divided by the dilation)."""

    rank: int
    stage: int
    device: str
    loss: float
    """This rank's weighted loss (non-zero on the last stage only; their sum is the batch mean)."""
    compute_s: float
    cpu_s: float
    wait_s: float
    sync_s: float
    peak_in_flight: int
    bytes_sent: Mapping[str, int]
    """``"src->dst"`` device pair -> bytes this rank sent."""
    trace: tuple[Timed, ...] = ()
    """Every action's wall start and end, when tracing."""
    transfers: tuple[Transfer, ...] = ()
    """Every received piece, in emulated seconds since the run's epoch (the adapter's monitor reads them)."""
    change: RankChange | None = None
    grad_norm: float | None = None
    """The global gradient norm before clipping (the same on every rank), when measured."""
    replica: int = 0
    peak_memory_bytes: float = 0.0
    """This rank's peak memory since its job started (:mod:`deepcee.runtime.peak_memory`)."""


# -- one step (a line of metrics.jsonl) -----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StageMetrics:
    """A stage's slowest device in one step (emulated seconds)."""

    stage: int
    compute_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    replica: int = 0
    """Which replica's stage (written only when not 0)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage, "compute_s": self.compute_s, "wait_s": self.wait_s,
                               "sync_s": self.sync_s}
        if self.replica:
            out["replica"] = self.replica
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> StageMetrics:
        return StageMetrics(stage=int(d["stage"]), compute_s=float(d["compute_s"]), wait_s=float(d["wait_s"]),
                            sync_s=float(d["sync_s"]), replica=int(d.get("replica", 0)))


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkEstimateRecord:
    """The link monitor's estimate of one link resource after a step."""

    latency_s: float
    bandwidth_bytes_per_s: float
    changed: bool
    n: int
    """Observations behind it."""

    def to_dict(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "changed": self.changed, "n": self.n}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> LinkEstimateRecord:
        return LinkEstimateRecord(latency_s=float(d["latency_s"]), bandwidth_bytes_per_s=float(d["bandwidth_bytes_per_s"]),
                                  changed=bool(d["changed"]), n=int(d["n"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryMetrics:
    """What a trainer whose plan may change records at the end of a step (see
    :meth:`deepcee.runtime.hooks.TrainerHooks.decide`). On disk its fields sit at the top level
    of the step's line."""

    plan_version: int
    """How many plan changes were applied before this step."""
    end_s: float
    """Emulated seconds since the run's epoch when the step ended."""
    link_estimates: Mapping[str, LinkEstimateRecord] = field(default_factory=dict)
    changed_links: tuple[str, ...] = ()
    change_by_device: Mapping[str, RankChange] = field(default_factory=dict)
    """Every active rank's part of the change applied before this step (empty: none)."""
    decision: str | None = None
    """Kind of the decision for the next step (``None`` after the last step)."""
    reason: str | None = None
    control_s: float | None = None
    """Gathering, deciding and broadcasting the decision (not part of any step's time)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"plan_version": self.plan_version, "end_s": self.end_s,
                               "link_estimates": {r: e.to_dict() for r, e in self.link_estimates.items()},
                               "changed_links": list(self.changed_links)}
        if self.change_by_device:
            out["change_by_device"] = {d: c.to_dict() for d, c in self.change_by_device.items()}
        if self.decision is not None:
            out.update(decision=self.decision, reason=self.reason, control_s=self.control_s)
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> BoundaryMetrics | None:
        if "plan_version" not in d:
            return None
        return BoundaryMetrics(
            plan_version=int(d["plan_version"]), end_s=float(d["end_s"]),
            link_estimates={r: LinkEstimateRecord.from_dict(e) for r, e in d.get("link_estimates", {}).items()},
            changed_links=tuple(d.get("changed_links", ())),
            change_by_device={k: RankChange.from_dict(v) for k, v in d.get("change_by_device", {}).items()},
            decision=d.get("decision"), reason=d.get("reason"), control_s=d.get("control_s"))


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedChange:
    """A plan change applied before the step and counted in its time (see
    :meth:`deepcee.runtime.hooks.TrainerHooks.apply`); on disk keys ``change`` (the kind),
    ``change_s`` and ``moved_bytes``."""

    kind: str
    change_s: float
    """Rank 0's time for the change (emulated seconds; every rank's: :attr:`BoundaryMetrics.change_by_device`)."""
    moved_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"change": self.kind, "change_s": self.change_s, "moved_bytes": self.moved_bytes}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> AppliedChange | None:
        if "change" not in d:
            return None
        return AppliedChange(kind=d["change"], change_s=float(d["change_s"]), moved_bytes=float(d["moved_bytes"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
    """One step of a run, as rank 0 records it (one line of ``metrics.jsonl``)."""

    step: int
    loss: float
    """Mean loss over the global batch."""
    step_s: float
    samples_per_s: float
    emulation: EmulationInfo
    stages: tuple[StageMetrics, ...]
    link_bytes: Mapping[str, int]
    """``"src->dst"`` device pair -> bytes sent in the step."""
    cpu_s: Mapping[str, float]
    """Device -> CPU seconds of its compute (not divided by the dilation)."""
    trace: Mapping[str, tuple[Timed, ...]] | None = None
    """Device -> every action's start and end (emulated seconds since the epoch), when tracing."""
    change: AppliedChange | None = None
    boundary: BoundaryMetrics | None = None
    lr: float | None = None
    """The learning rate of the step (after the schedule)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping (every stage, device and replica; measured when clipping)."""
    eval_loss: float | None = None
    """Mean loss on the held-out batches after this step, when evaluated."""
    probe_loss: float | None = None
    """Model averaging between averages: the held-out loss of the average the replicas would
    take after this step (a probe; [Note: probe evaluations] in :mod:`deepcee.runtime.strategies`)."""
    semantics: Semantics = "exact"
    strategy: str = EXACT.describe()
    """The run's update rule (:meth:`deepcee.plan.Strategy.describe`); lines written before it
    existed were exact."""
    peak_memory_bytes: Mapping[str, float] = field(default_factory=dict)
    """Device -> its rank's peak memory since the job started (resident set on CPU, the CUDA
    allocator's reservation on GPU); empty in records written before it was kept."""

    @property
    def mode(self) -> str:
        return self.emulation.mode

    @property
    def dilation(self) -> float:
        return self.emulation.dilation

    @property
    def emulated(self) -> tuple[str, ...]:
        return self.emulation.emulated

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": METRICS_SCHEMA_VERSION, "step": self.step, "loss": self.loss, "step_s": self.step_s,
            "samples_per_s": self.samples_per_s, **self.emulation.to_dict(),
            "stages": [s.to_dict() for s in self.stages], "link_bytes": dict(self.link_bytes),
            "cpu_s": dict(self.cpu_s), "semantics": self.semantics, "strategy": self.strategy,
        }
        out.update({k: getattr(self, k) for k in ("lr", "grad_norm", "eval_loss", "probe_loss") if getattr(self, k) is not None})
        if self.change is not None:
            out.update(self.change.to_dict())
        if self.boundary is not None:
            out.update(self.boundary.to_dict())
        if self.trace is not None:
            out["trace"] = {dev: [list(t) for t in acts] for dev, acts in self.trace.items()}
        if self.peak_memory_bytes:
            out["peak_memory_bytes"] = dict(self.peak_memory_bytes)
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> StepMetrics:
        trace = d.get("trace")
        return StepMetrics(
            step=int(d["step"]), loss=float(d["loss"]), step_s=float(d["step_s"]),
            samples_per_s=float(d["samples_per_s"]), emulation=_info(d),
            stages=tuple(StageMetrics.from_dict(s) for s in d["stages"]),
            link_bytes={k: int(v) for k, v in d["link_bytes"].items()},
            cpu_s={k: float(v) for k, v in d["cpu_s"].items()},
            trace=None if trace is None else {dev: tuple((a, float(t0), float(t1)) for a, t0, t1 in acts)
                                               for dev, acts in trace.items()},
            change=AppliedChange.from_dict(d), boundary=BoundaryMetrics.from_dict(d),
            lr=_opt_float(d, "lr"), grad_norm=_opt_float(d, "grad_norm"), eval_loss=_opt_float(d, "eval_loss"),
            probe_loss=_opt_float(d, "probe_loss"), semantics=d.get("semantics", "exact"), strategy=d.get("strategy", EXACT.describe()),
            peak_memory_bytes={k: float(v) for k, v in d.get("peak_memory_bytes", {}).items()})


def _opt_float(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    return None if v is None else float(v)


def step_metrics(step: int, ranks: Sequence[RankMetrics], step_wall_s: float, *, global_batch: int,
                 emulation: EmulationInfo, epoch: float | None = None, change: AppliedChange | None = None,
                 boundary: BoundaryMetrics | None = None, lr: float | None = None, grad_norm: float | None = None,
                 eval_loss: float | None = None, probe_loss: float | None = None,
                 strategy: Strategy = EXACT) -> StepMetrics:
    """One step's record from the active ranks' records; ``epoch`` (wall) given: keep their traces."""
    d = emulation.dilation
    stages: dict[tuple[int, int], list[float]] = {}
    links: dict[str, int] = {}
    for r in ranks:
        s = stages.setdefault((r.replica, r.stage), [0.0, 0.0, 0.0])
        for i, v in enumerate((r.compute_s, r.wait_s, r.sync_s)):
            s[i] = max(s[i], v / d)  # the stage's slowest device
        for link, n in r.bytes_sent.items():
            links[link] = links.get(link, 0) + n
    trace = None
    if epoch is not None:
        trace = {r.device: tuple((a, (t0 - epoch) / d, (t1 - epoch) / d) for a, t0, t1 in r.trace) for r in ranks}
    return StepMetrics(
        step=step, loss=sum(r.loss for r in ranks), step_s=step_wall_s / d,
        samples_per_s=global_batch / (step_wall_s / d), emulation=emulation,
        stages=tuple(StageMetrics(replica=q, stage=k, compute_s=c, wait_s=w, sync_s=y)
                     for (q, k), (c, w, y) in sorted(stages.items())),
        link_bytes=links, cpu_s={r.device: r.cpu_s for r in ranks}, trace=trace, change=change, boundary=boundary,
        lr=lr, grad_norm=grad_norm, eval_loss=eval_loss, probe_loss=probe_loss, semantics=strategy.semantics, strategy=strategy.describe(),
        peak_memory_bytes={r.device: r.peak_memory_bytes for r in ranks if r.peak_memory_bytes > 0})


# -- the run --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanChange:
    """A plan change the adapter applied during a run (predictions from the policy)."""

    start_step: int
    kind: str
    reason: str
    change_s: float
    """Measured on rank 0 (emulated seconds)."""
    moved_bytes: float
    moves: tuple[tuple[int, str, str], ...] = ()
    """``(layer, from device, to device)``."""
    predicted_current_s: float | None = None
    predicted_new_s: float | None = None
    predicted_change_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"start_step": self.start_step, "kind": self.kind, "reason": self.reason, "change_s": self.change_s,
                "moved_bytes": self.moved_bytes, "moves": [list(m) for m in self.moves],
                "predicted_current_s": self.predicted_current_s, "predicted_new_s": self.predicted_new_s,
                "predicted_change_s": self.predicted_change_s}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> PlanChange:
        return PlanChange(start_step=int(d["start_step"]), kind=d["kind"], reason=d["reason"],
                          change_s=float(d["change_s"]), moved_bytes=float(d["moved_bytes"]),
                          moves=tuple((int(a), b, c) for a, b, c in d["moves"]),
                          predicted_current_s=d["predicted_current_s"], predicted_new_s=d["predicted_new_s"],
                          predicted_change_s=float(d["predicted_change_s"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterRun:
    """The adapter's part of a result: every plan in force and every change."""

    adapt: bool
    """``False``: the monitor ran but the plan was always kept."""
    devices: tuple[str, ...]
    """Rank ``r`` ran ``devices[r]``."""
    plans: tuple[Plan, ...]
    changes: tuple[PlanChange, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"adapt": self.adapt, "devices": list(self.devices), "plans": [p.to_dict() for p in self.plans],
                "changes": [c.to_dict() for c in self.changes]}

    @staticmethod
    def from_dict(d: Mapping[str, Any], *, file: str = "<result.json>") -> AdapterRun:
        return AdapterRun(adapt=bool(d["adapt"]), devices=tuple(d["devices"]),
                          plans=tuple(plan_from_dict(dict(p), file=file) for p in d["plans"]),
                          changes=tuple(PlanChange.from_dict(c) for c in d["changes"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """Where one rank ran: its plan device, stage, backend, torch device and host."""

    rank: int
    device: str
    stage: int | None
    """``None``: idle in the plan in force at the start."""
    backend: str
    torch_device: str
    host: str
    node: str = ""
    """The cluster node this rank's machine was mapped to (torchrun), else empty."""
    launcher_rank: int | None = None
    """The rank ``torchrun`` gave the process (before deepcee mapped it to a device), if any."""

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": self.device, "stage": self.stage, "backend": self.backend,
                "torch_device": self.torch_device, "host": self.host, "node": self.node,
                "launcher_rank": self.launcher_rank}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RankInfo:
        return RankInfo(rank=int(d["rank"]), device=d["device"], stage=d["stage"], backend=d["backend"],
                        torch_device=d["torch_device"], host=d["host"], node=d.get("node", ""),
                        launcher_rank=d.get("launcher_rank"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRecord:
    """Where a resumed run started from (see :func:`deepcee.runtime.checkpoint.choose`)."""

    step: int
    folder: str
    plan_digest: str
    """The plan that wrote the checkpoint."""
    same_plan: bool
    steps_lost: int = 0
    """Steps that newer, damaged checkpoints held: redone by this run."""
    skipped: tuple[tuple[int, str], ...] = ()
    """``(step, reason)`` of every newer checkpoint passed over, newest first."""

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "folder": self.folder, "plan_digest": self.plan_digest, "same_plan": self.same_plan,
                "steps_lost": self.steps_lost, "skipped": [list(x) for x in self.skipped]}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ResumeRecord:
        return ResumeRecord(step=int(d["step"]), folder=d["folder"], plan_digest=d["plan_digest"],
                            same_plan=bool(d["same_plan"]), steps_lost=int(d.get("steps_lost", 0)),
                            skipped=tuple((int(a), str(b)) for a, b in d.get("skipped", ())))


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainResult:
    """What a run measured (times already divided by the dilation in modes ``emulated`` and
    ``realnet``): ``result.json`` plus the steps' records."""

    job: str
    plan_digest: str
    system: str
    schedule: str
    global_batch: int
    start_step: int
    """First step of this run (> 0 when it resumed from a checkpoint)."""
    steps: int
    sync: str
    losses: tuple[float, ...]
    """Mean loss over the global batch, per step of this run."""
    step_s: tuple[float, ...]
    median_step_s: float
    samples_per_s: float
    """Global batch / median step time, first step (warm-up) excluded when there are more."""
    emulation: EmulationInfo
    run_dir: str
    metrics: tuple[StepMetrics, ...] = ()
    """This run's steps (``metrics.jsonl`` may also hold an earlier run's, before a resume)."""
    adapter: AdapterRun | None = None
    eval_losses: tuple[tuple[int, float], ...] = ()
    """``(steps completed, mean held-out loss)`` of every evaluation."""
    probe_losses: tuple[tuple[int, float], ...] = ()
    """``(steps completed, held-out loss)`` of every probe of the average (model averaging)."""
    ranks: tuple[RankInfo, ...] = ()
    """Every rank that trained: device, stage, backend, torch device, host."""
    resumed: ResumeRecord | None = None
    semantics: Semantics = "exact"
    strategy: str = EXACT.describe()
    """The update rule (:meth:`deepcee.plan.Strategy.describe`; results written before it were exact)."""
    replicas: StrategyRun | None = None
    """What a relaxed strategy did (``None`` for exact runs)."""
    target: TargetOutcome | None = None
    """Evaluation loss against time and samples, and the time to the target loss when one was set
    ([Note: time to target] in :mod:`deepcee.runtime.target`; ``None``: no evaluations)."""

    @property
    def mode(self) -> str:
        return self.emulation.mode

    @property
    def dilation(self) -> float:
        return self.emulation.dilation

    @property
    def emulated(self) -> tuple[str, ...]:
        """Which figures come from emulation (empty in mode ``real``)."""
        return self.emulation.emulated

    @property
    def peak_memory_bytes(self) -> dict[str, float]:
        """Device -> the largest peak memory its rank reported over the run's steps."""
        out: dict[str, float] = {}
        for m in self.metrics:
            for d, b in m.peak_memory_bytes.items():
                out[d] = max(out.get(d, 0.0), b)
        return out

    def to_dict(self) -> dict[str, Any]:
        """``result.json`` (the metrics are in ``metrics.jsonl``)."""
        out = {"format": RESULT_FORMAT, "schema_version": RESULT_SCHEMA_VERSION, "job": self.job,
               "plan_digest": self.plan_digest, "system": self.system, "schedule": self.schedule,
               "global_batch": self.global_batch, "start_step": self.start_step, "steps": self.steps,
               "sync": self.sync, "losses": list(self.losses), "step_s": list(self.step_s),
               "median_step_s": self.median_step_s, "samples_per_s": self.samples_per_s,
               **self.emulation.to_dict(), "run_dir": self.run_dir, "semantics": self.semantics,
               "strategy": self.strategy}
        if self.adapter is not None:
            out["adapter"] = self.adapter.to_dict()
        if self.eval_losses:
            out["eval_losses"] = [list(e) for e in self.eval_losses]
        if self.probe_losses:
            out["probe_losses"] = [list(e) for e in self.probe_losses]
        if self.ranks:
            out["ranks"] = [r.to_dict() for r in self.ranks]
        if self.resumed is not None:
            out["resumed"] = self.resumed.to_dict()
        if self.replicas is not None:
            out["replicas"] = self.replicas.to_dict()
        if self.target is not None:
            out["target"] = self.target.to_dict()
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any], *, metrics: Sequence[StepMetrics] = (), file: str = "<result.json>",
                  ) -> TrainResult:
        adapter, replicas = d.get("adapter"), d.get("replicas")
        return TrainResult(
            job=d["job"], plan_digest=d["plan_digest"], system=d["system"], schedule=d["schedule"],
            global_batch=int(d["global_batch"]), start_step=int(d["start_step"]), steps=int(d["steps"]),
            sync=d["sync"], losses=tuple(d["losses"]), step_s=tuple(d["step_s"]),
            median_step_s=float(d["median_step_s"]), samples_per_s=float(d["samples_per_s"]), emulation=_info(d),
            run_dir=d["run_dir"], metrics=tuple(metrics),
            adapter=None if adapter is None else AdapterRun.from_dict(adapter, file=file),
            eval_losses=tuple((int(a), float(b)) for a, b in d.get("eval_losses", ())),
            probe_losses=tuple((int(a), float(b)) for a, b in d.get("probe_losses", ())),
            ranks=tuple(RankInfo.from_dict(r) for r in d.get("ranks", ())),
            resumed=None if d.get("resumed") is None else ResumeRecord.from_dict(d["resumed"]),
            semantics=d.get("semantics", "exact"), strategy=d.get("strategy", EXACT.describe()),
            replicas=None if replicas is None else StrategyRun.from_dict(replicas),
            target=None if d.get("target") is None else TargetOutcome.from_dict(d["target"]))

    @staticmethod
    def from_run_dir(run_dir: str | Path) -> TrainResult:
        """The result a run left in ``run_dir`` (``result.json`` and its lines of ``metrics.jsonl``)."""
        path = Path(run_dir) / "result.json"
        d = read_json(path, RunFileError)
        lines = read_step_metrics(Path(run_dir) / "metrics.jsonl")
        try:
            n = len(d["losses"])
            res = TrainResult.from_dict(d, metrics=lines[len(lines) - n:] if n else (), file=str(path))
        except (KeyError, TypeError, ValueError) as exc:
            raise RunFileError(f"malformed run result: {exc!r}"[:200], file=str(path)) from None
        return replace(res, run_dir=str(run_dir))


def train_result(records: Sequence[StepMetrics], *, job: str, plan: Plan, plan_digest: str, start_step: int,
                 steps: int, sync: str, emulation: EmulationInfo, run_dir: str,
                 adapter: AdapterRun | None = None, ranks: Sequence[RankInfo] = (),
                 resumed: ResumeRecord | None = None,
                 replicas: StrategyRun | None = None, target_loss: float | None = None) -> TrainResult:
    """The result of a run from its steps' records (rank 0). A relaxed run's samples/s is
    :attr:`StrategyRun.samples_per_s` (its replicas do not keep one pace)."""
    evaluated = any(r.eval_loss is not None or r.probe_loss is not None for r in records)
    target = outcome([(r.step, r.step_s, round(r.samples_per_s * r.step_s), r.eval_loss) for r in records],
                     target_loss=target_loss, clock=clock_of(emulation.mode),
                     probes={r.step: r.probe_loss for r in records if r.probe_loss is not None},
                     ) if evaluated or target_loss else None
    steady = [r.step_s for r in records[1:]] or [r.step_s for r in records]
    median = statistics.median(steady) if steady else float("nan")
    rate = plan.global_batch / median if steady else float("nan")
    return TrainResult(
        job=job, plan_digest=plan_digest, system=plan.system, schedule="+".join(r.schedule for r in plan.replicas),
        global_batch=plan.global_batch, start_step=start_step, steps=steps, sync=sync,
        losses=tuple(r.loss for r in records), step_s=tuple(r.step_s for r in records), median_step_s=median,
        samples_per_s=rate if replicas is None else replicas.samples_per_s, emulation=emulation,
        run_dir=run_dir, metrics=tuple(records), adapter=adapter, ranks=tuple(ranks), resumed=resumed,
        eval_losses=tuple((r.step + 1, r.eval_loss) for r in records if r.eval_loss is not None),
        probe_losses=tuple((r.step + 1, r.probe_loss) for r in records if r.probe_loss is not None),
        semantics=plan.semantics, strategy=plan.strategy.describe(), replicas=replicas, target=target)


def read_step_metrics(path: str | Path) -> list[StepMetrics]:
    """Every line of a ``metrics.jsonl`` (read by the input layer; a malformed line is named)."""
    out = []
    for n, d in enumerate(read_json_lines(path, RunFileError), 1):
        try:
            out.append(StepMetrics.from_dict(d))
        except (KeyError, TypeError, ValueError) as exc:
            raise RunFileError(f"malformed step record: {exc!r}"[:200], file=str(path), field=f"line {n}") from None
    return out
