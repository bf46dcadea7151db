"""What a plan costs and how fast it reaches the target: the figures every plan reports (torch-free).

For a plan and its simulation (:class:`~deepcee.simulator.replicas.ReplicaSimResult`),
:func:`plan_figures` gives:

- **time to target** (:mod:`deepcee.planner.efficiency`): the statistical-efficiency
  multiplier, its source, and ``multiplier / samples_per_s`` (or seconds, when a calibration
  measured the reference);
- **an epoch**: ``dataset_samples`` if given, else the training data the cluster file states
  (the sum over islands of ``data_*``) over the model's input bytes per sample (an
  assumption: data stored as the model's input tensors), and its time at ``samples_per_s``;
- **where the data lives** (Cloudless-Training's elastic placement): each replica reads its
  samples where its first stage runs (devices weighted by their shares), in proportion to its
  simulated rate; an island that reads more than it holds gets the rest from islands with
  data to spare, cheapest egress first, once, before training (bytes, dollars, and the time at
  the links between the islands, pairs in parallel);
- **dollars per epoch** (when the cluster states prices): every device the plan uses
  (computing or serving) for the epoch at its island's ``price_usd_per_device_hour``, plus
  every byte the plan sends out of an island (pipeline transfers, all-reduces, pushes, pulls,
  averages; from the simulation) at that island's ``egress_usd_per_gb``, plus the data
  movement spread over ``epochs``. Islands the plan uses without a stated price leave the
  dollars unknown (``None``), and the figures say which.

``usd_per_sync_epoch`` (dollars x multiplier) is what ``--objective cost`` minimises: the
cost of as much progress as one epoch of exact training makes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

from deepcee.cluster import Cluster
from deepcee.errors import SpecError
from deepcee.plan import Plan
from deepcee.planner.efficiency import StatisticalEfficiency, TimeToTarget, time_to_target
from deepcee.profile import ModelProfile
from deepcee.simulator.replicas import ReplicaSimResult
from deepcee.units import fmt_bytes, fmt_time

Objective = Literal["time", "cost"]
OBJECTIVES: tuple[Objective, ...] = ("time", "cost")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataMove:
    """Training data moved between islands before training (see the module docstring)."""

    moves: tuple[tuple[str, str, float], ...]
    """``(from island, to island, bytes)``."""
    usd: float | None
    seconds: float

    @property
    def bytes(self) -> float:
        return sum(b for _, _, b in self.moves)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanFigures:
    """Speed, time to target and cost of one plan. See the module docstring."""

    system: str
    semantics: str
    strategy: str
    samples_per_s: float
    wan_fraction: float
    time_to_target: TimeToTarget
    epoch_samples: float | None
    epoch_s: float | None
    egress_bytes_per_sample: float
    data: DataMove | None
    compute_usd_per_epoch: float | None
    egress_usd_per_epoch: float | None
    usd_per_epoch: float | None
    unpriced: tuple[str, ...] = ()
    """Islands the plan uses or sends from whose prices the cluster does not state
    (``("every island",)`` when it states none)."""

    @property
    def usd_per_sync_epoch(self) -> float | None:
        return None if self.usd_per_epoch is None else self.usd_per_epoch * self.time_to_target.multiplier

    def lines(self) -> list[str]:
        out = [f"semantics {self.semantics}: {self.strategy}",
               f"time to target: {self.time_to_target.describe()}"]
        if self.epoch_s is not None:
            out.append(f"epoch: {self.epoch_samples:.4g} samples in {fmt_time(self.epoch_s)}")
        if self.data is not None and self.data.moves:
            usd = "" if self.data.usd is None else f", ${self.data.usd:.2f}"
            out.append(f"data moved before training: {fmt_bytes(self.data.bytes)} ({fmt_time(self.data.seconds)}"
                       f"{usd}): " + ", ".join(f"{a}->{b} {fmt_bytes(x)}" for a, b, x in self.data.moves))
        if self.usd_per_epoch is not None:
            out.append(f"cost: ${self.usd_per_epoch:.2f} per epoch (devices ${self.compute_usd_per_epoch:.2f}, "
                       f"egress ${self.egress_usd_per_epoch:.2f}), ${self.usd_per_sync_epoch:.2f} per "
                       "sync-equivalent epoch")
        elif self.unpriced and self.unpriced != ("every island",):
            out.append(f"cost: unknown (no prices for island(s) {', '.join(self.unpriced)})")
        return out

    def to_dict(self) -> dict[str, Any]:
        t = self.time_to_target
        return {
            "system": self.system, "semantics": self.semantics, "strategy": self.strategy,
            "samples_per_s": self.samples_per_s, "wan_fraction": self.wan_fraction,
            "time_to_target": {"multiplier": t.multiplier, "source": t.source,
                               "seconds_per_sync_sample": t.seconds_per_sync_sample, "seconds": t.seconds,
                               "predicted": True},
            "epoch_samples": self.epoch_samples, "epoch_s": self.epoch_s,
            "egress_bytes_per_sample": self.egress_bytes_per_sample,
            "data_moved": None if self.data is None else {
                "bytes": self.data.bytes, "usd": self.data.usd, "seconds": self.data.seconds,
                "moves": [{"from": a, "to": b, "bytes": x} for a, b, x in self.data.moves]},
            "compute_usd_per_epoch": self.compute_usd_per_epoch, "egress_usd_per_epoch": self.egress_usd_per_epoch,
            "usd_per_epoch": self.usd_per_epoch, "usd_per_sync_epoch": self.usd_per_sync_epoch,
            "unpriced_islands": list(self.unpriced),
        }


def epoch_samples(cluster: Cluster, model: ModelProfile, dataset_samples: float | None) -> float | None:
    """Samples per epoch: given, or the stated data over the model's input bytes per sample."""
    if dataset_samples is not None:
        if not (isinstance(dataset_samples, (int, float)) and math.isfinite(dataset_samples) and dataset_samples > 0):
            raise SpecError(f"must be a number > 0, got {dataset_samples!r}", field="dataset_samples")
        return float(dataset_samples)
    data = [i.data_bytes for i in cluster.islands if i.data_bytes is not None]
    if not data or model.input_bytes <= 0 or sum(data) <= 0:
        return None
    return sum(data) / model.input_bytes


def reading_shares(plan: Plan, result: ReplicaSimResult, cluster: Cluster) -> dict[str, float]:
    """Island -> share of all samples read there (first-stage devices, weighted by replica rate and share)."""
    rates = [n * b / s if s > 0 else 0.0 for n, b, s in zip(result.steps, result.replica_batches, result.spans_s,
                                                            strict=True)]
    total = sum(rates) or 1.0
    out: dict[str, float] = defaultdict(float)
    for rep, rate in zip(plan.replicas, rates, strict=True):
        first = rep.stages[0]
        for d, share in zip(first.devices, first.shares, strict=True):
            out[cluster.device(d).island] += rate / total * share / first.microbatch_size
    return dict(out)


def data_move(plan: Plan, result: ReplicaSimResult, cluster: Cluster) -> DataMove | None:
    """Data moved so every island holds what its replicas read (see the module docstring)."""
    held = {i.name: i.data_bytes or 0.0 for i in cluster.islands}
    total = sum(held.values())
    if total <= 0:
        return None
    need = {k: v * total for k, v in reading_shares(plan, result, cluster).items()}
    short = {k: v - held.get(k, 0.0) for k, v in need.items() if v > held.get(k, 0.0) * (1 + 1e-12)}
    spare = {k: v - need.get(k, 0.0) for k, v in held.items() if v > need.get(k, 0.0)}
    price = {i.name: i.egress_usd_per_byte for i in cluster.islands}
    moves = []
    for dst, want in short.items():
        for src in sorted(spare, key=lambda k: (math.inf if price[k] is None else price[k], k)):
            take = min(want, spare[src])
            if take > 0:
                moves.append((src, dst, take))
                spare[src] -= take
                want -= take
    usd = None if any(price[a] is None for a, _, _ in moves) else sum(price[a] * x for a, _, x in moves)
    return DataMove(moves=tuple(moves), usd=usd, seconds=max((_move_s(cluster, a, b, x) for a, b, x in moves),
                                                             default=0.0))


def _move_s(cluster: Cluster, src: str, dst: str, nbytes: float) -> float:
    devs = cluster.island_devices()
    link = cluster.link(devs[src][0], devs[dst][0])
    return link.latency_s + nbytes / link.bandwidth_bytes_per_s


def plan_figures(plan: Plan, result: ReplicaSimResult, cluster: Cluster, model: ModelProfile,
                 efficiency: StatisticalEfficiency, *, dataset_samples: float | None = None,
                 epochs: int = 1) -> PlanFigures:
    """The figures of one simulated plan. See the module docstring."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise SpecError(f"must be an integer >= 1, got {epochs!r}", field="epochs")
    sps = result.samples_per_s
    per_sample = result.egress_bytes_per_sample()
    samples = epoch_samples(cluster, model, dataset_samples)
    epoch_s = samples / sps if samples is not None and sps > 0 else None
    islands = {i.name: i for i in cluster.islands}
    used = {cluster.device(d).island for d in (*plan.devices, *plan.servers)}
    priced = any(i.device_usd_per_s is not None or i.egress_usd_per_byte is not None for i in cluster.islands)
    unpriced = sorted({k for k in used if islands[k].device_usd_per_s is None}
                      | {k for k, v in per_sample.items() if v > 0 and islands[k].egress_usd_per_byte is None}
                      ) if priced else ["every island"]
    data = data_move(plan, result, cluster)
    compute = egress = usd = None
    if epoch_s is not None and not unpriced:
        devices = set(plan.devices) | set(plan.servers)
        compute = epoch_s * sum(islands[cluster.device(d).island].device_usd_per_s for d in devices)
        egress = samples * sum(v * (islands[k].egress_usd_per_byte or 0.0) for k, v in per_sample.items())
        moved = 0.0 if data is None else data.usd
        usd = None if moved is None else compute + egress + moved / epochs
    return PlanFigures(
        system=plan.system, semantics=plan.semantics, strategy=plan.strategy.describe(), samples_per_s=sps,
        wan_fraction=result.wan_fraction, time_to_target=time_to_target(plan, sps, efficiency),
        epoch_samples=samples, epoch_s=epoch_s, egress_bytes_per_sample=sum(per_sample.values()), data=data,
        compute_usd_per_epoch=compute, egress_usd_per_epoch=egress, usd_per_epoch=usd, unpriced=tuple(unpriced))


def rank_key(f: PlanFigures, objective: Objective, budget_usd: float | None = None) -> tuple:
    """Lower is better. ``time``: time to target; ``cost``: dollars per sync-equivalent epoch,
    or, under ``budget_usd``, the fastest plan within it (plans over it, or without a price, last)."""
    t = f.time_to_target.seconds_per_sync_sample
    cost = f.usd_per_sync_epoch
    if objective == "time":
        return (t,)
    if budget_usd is not None:
        within = cost is not None and cost <= budget_usd
        return (0, t) if within else (1, math.inf if cost is None else cost, t)
    return (math.inf if cost is None else cost, t)


__all__ = ["OBJECTIVES", "DataMove", "Objective", "PlanFigures", "data_move", "epoch_samples", "plan_figures",
           "rank_key", "reading_shares"]
