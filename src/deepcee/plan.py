"""The plan: the contract read by the simulator and the runtime (torch-free).

A plan places contiguous runs of layers (stages) on sets of devices, gives each device a
*share* (whole samples) of every microbatch, fixes microbatch size and count, the schedule
and the gradient synchronisation inside each stage, and carries the estimate that justified
it. The planner writes plans; the simulator and the runtime only read them.

[Note: share-based resharding]
Within a microbatch, samples are numbered ``0 .. microbatch_size-1`` and device ``k`` of a
stage owns the contiguous range ``[sum(shares[:k]), sum(shares[:k+1]))``. When stage ``s``
and stage ``s+1`` have different devices or shares, sender ``i`` of stage ``s`` sends to
receiver ``j`` of stage ``s+1`` exactly the samples in the intersection of their ranges
(:func:`share_overlaps`); the backward pass sends the same ranges the other way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deepcee.errors import PlanError
from deepcee.jsonio import read_json, save_json_atomic

SCHEMA_VERSION = 1

ScheduleName = Literal["gpipe", "1f1b", "zb-h1", "zb-h2", "compact"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "zb-h1", "zb-h2", "compact")
SyncName = Literal["allreduce-ring", "allreduce-hier", "zero2", "none"]
SYNCS: tuple[str, ...] = ("allreduce-ring", "allreduce-hier", "zero2", "none")


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
    out = []
    for i, (a_lo, a_hi) in enumerate(share_ranges(src_shares)):
        for j, (b_lo, b_hi) in enumerate(share_ranges(dst_shares)):
            lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
            if lo < hi:
                out.append((i, j, lo, hi))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """One pipeline stage: layers ``[layer_start, layer_stop)`` on ``devices`` with ``shares``."""

    layer_start: int
    layer_stop: int
    devices: tuple[str, ...]
    shares: tuple[int, ...]
    """Samples of every microbatch each device processes (same order as ``devices``)."""

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

    @property
    def microbatch_size(self) -> int:
        return sum(self.shares)


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """What the planner or simulator predicted for a plan."""

    iteration_s: float
    samples_per_s: float
    peak_memory_bytes: Mapping[str, float] = field(default_factory=dict)
    bottleneck: str = ""
    source: str = "cost-model"
    """``cost-model`` (analytic) or ``simulator``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A complete training plan. See the module docstring."""

    system: str
    """Who made it: ``deepcee`` or a baseline's name (``ddp``, ``gpipe-even``, ...)."""
    cluster: str
    model: str
    global_batch: int
    microbatch_size: int
    num_microbatches: int
    stages: tuple[StagePlan, ...]
    schedule: str
    actions: tuple[tuple[str, ...], ...] = ()
    """Per-stage compute actions in string form (``"1F0"``). Required for ``compact``;
    otherwise empty and rebuilt from ``schedule`` by :func:`deepcee.schedule.build_schedule`."""
    sync: str = "allreduce-ring"
    excluded_devices: tuple[str, ...] = ()
    estimate: Estimate | None = None
    explanation: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r} (known: {', '.join(SCHEDULES)})", field="schedule")
        if self.sync not in SYNCS:
            raise PlanError(f"unknown sync {self.sync!r} (known: {', '.join(SYNCS)})", field="sync")
        for name, v in (("global_batch", self.global_batch), ("microbatch_size", self.microbatch_size),
                        ("num_microbatches", self.num_microbatches)):
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"must be an integer >= 1, got {v!r}", field=name)
        if self.microbatch_size * self.num_microbatches != self.global_batch:
            raise PlanError(
                f"microbatch_size {self.microbatch_size} x num_microbatches {self.num_microbatches} "
                f"!= global_batch {self.global_batch}", field="global_batch",
            )
        if not self.stages:
            raise PlanError("a plan needs at least one stage", field="stages")
        seen: set[str] = set()
        for i, st in enumerate(self.stages):
            if st.microbatch_size != self.microbatch_size:
                raise PlanError(
                    f"shares {list(st.shares)} sum to {st.microbatch_size}, microbatch_size is {self.microbatch_size}",
                    field=f"stages[{i}].shares",
                )
            if i and st.layer_start != self.stages[i - 1].layer_stop:
                raise PlanError(
                    f"starts at layer {st.layer_start}, previous stage stops at {self.stages[i - 1].layer_stop}",
                    field=f"stages[{i}].layer_start",
                )
            dup = seen & set(st.devices)
            if dup:
                raise PlanError(f"device {sorted(dup)[0]!r} is in two stages", field=f"stages[{i}].devices")
            seen |= set(st.devices)
        if self.stages[0].layer_start != 0:
            raise PlanError(f"first stage starts at layer {self.stages[0].layer_start}, not 0", field="stages[0]")
        if self.actions and len(self.actions) != len(self.stages):
            raise PlanError(f"{len(self.actions)} action lists for {len(self.stages)} stages", field="actions")
        if self.schedule == "compact" and not self.actions:
            raise PlanError("schedule 'compact' needs explicit per-stage actions", field="actions")

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
        raise PlanError(f"device {device!r} is not in the plan")

    def check_against(self, *, num_layers: int, device_names: Sequence[str], file: str | None = None) -> None:
        """Raise :class:`PlanError` if the plan does not fit the model or the cluster."""
        if self.num_layers != num_layers:
            raise PlanError(
                f"plan covers {self.num_layers} layers, model {self.model!r} has {num_layers}",
                file=file, field="stages",
            )
        unknown = [d for d in self.devices if d not in set(device_names)]
        if unknown:
            raise PlanError(f"device {unknown[0]!r} is not in cluster {self.cluster!r}", file=file, field="stages.devices")

    def replace(self, **changes: Any) -> Plan:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(changes)
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
            "microbatch_size": self.microbatch_size,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "sync": self.sync,
            "stages": [
                {"layer_start": s.layer_start, "layer_stop": s.layer_stop, "devices": list(s.devices),
                 "shares": list(s.shares)}
                for s in self.stages
            ],
            "actions": [list(a) for a in self.actions],
            "excluded_devices": list(self.excluded_devices),
            "estimate": est,
            "explanation": list(self.explanation),
        }


def plan_from_dict(d: dict[str, Any], *, file: str = "<plan.json>") -> Plan:
    if d.get("schema_version") != SCHEMA_VERSION or d.get("format") != "deepcee.plan":
        raise PlanError(
            f"expected format 'deepcee.plan' schema_version {SCHEMA_VERSION}, got "
            f"{d.get('format')!r} {d.get('schema_version')!r}", file=file, field="schema_version",
        )
    try:
        est = d.get("estimate")
        return Plan(
            system=d["system"], cluster=d["cluster"], model=d["model"], global_batch=d["global_batch"],
            microbatch_size=d["microbatch_size"], num_microbatches=d["num_microbatches"],
            schedule=d["schedule"], sync=d.get("sync", "allreduce-ring"),
            stages=tuple(
                StagePlan(layer_start=s["layer_start"], layer_stop=s["layer_stop"], devices=tuple(s["devices"]),
                          shares=tuple(s["shares"]))
                for s in d["stages"]
            ),
            actions=tuple(tuple(a) for a in d.get("actions", [])),
            excluded_devices=tuple(d.get("excluded_devices", [])),
            estimate=Estimate(**est) if est else None,
            explanation=tuple(d.get("explanation", [])),
        )
    except KeyError as exc:
        raise PlanError(f"missing key {exc.args[0]!r}", file=file) from None
    except PlanError as exc:
        raise PlanError(str(exc), file=file) from None
    except TypeError as exc:
        raise PlanError(str(exc), file=file) from None


def load_plan(path: str | Path) -> Plan:
    return plan_from_dict(read_json(path, PlanError), file=str(path))


__all__ = ["Estimate", "Plan", "StagePlan", "load_plan", "plan_from_dict", "save_json_atomic", "share_overlaps",
           "share_ranges"]
