"""The related systems' synchronisation strategies as baselines, on the same simulator (torch-free).

Every baseline is a plan with one replica per network island (Cloudless-Training's
regions), scored by :func:`deepcee.simulator.replicas.simulate_replicas` and carrying the
simulator's estimate, like the synchronous baselines of :mod:`deepcee.planner.baselines`.
Replica batches follow each island's summed device speed (Cloudless' elastic placement by
the regions' resources). Each system picks its own setting from a small grid by predicted
time to target (the plan's statistical efficiency, :mod:`deepcee.planner.efficiency`), as
the Metis/HetPipe-style baseline searches its own small space:

- ``cloudless-ps-ma``: in each region, data parallel over its devices (one stage, equal
  shares, gradient accumulation when memory demands) with the region's parameter server;
  across regions, model averaging every H local steps (H in :data:`MA_PERIODS`, plain
  averaging). Inside a region the simulator times the parameter server as a ring all-reduce
  (same bytes over the region's fast links).
- ``cloudless-ps-asgd``: the same regions; across regions ASGD with gradient accumulation
  (k in :data:`ASGD_ACCUMULATIONS`), staleness bound = the number of regions.
- ``sdpipe-partial``: in each region a pipeline with an even layer split and 1F1B
  (``1f1b-even`` on the region's devices); partial averaging among the replicas ready within
  half a local step, groups of two or more, full sync every P rounds (P in :data:`FULL_SYNCS`).
- ``heterog``: exact. In each region a pipeline of ``S`` stages (``S`` = the smallest
  region's device count, at most the layer count; devices dealt round-robin, so stages of
  different regions hold different numbers of devices: uneven replicas), even layer split;
  each stage's gradients combined across regions by a parameter server or a ring all-reduce,
  whichever the simulator finds faster, stage by stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deepcee.cluster import Cluster
from deepcee.errors import PlanError
from deepcee.plan import Estimate, Plan, ReplicaPlan, StagePlan, Strategy
from deepcee.planner.baselines import (
    BaselineResult,
    _NoFit,
    data_parallel,
    even_layer_split,
    even_pipeline,
    even_shares,
    memory_shortfall,
    microbatch_counts,
    proportional_shares,
)
from deepcee.planner.efficiency import StatisticalEfficiency
from deepcee.planner.objective import PlanFigures, plan_figures
from deepcee.planner.replicas import servers_for
from deepcee.profile import ModelProfile
from deepcee.simulator.replicas import ReplicaSimResult, simulate_replicas
from deepcee.units import GIB

log = logging.getLogger(__name__)

RELAXED_BASELINE_NAMES: tuple[str, ...] = ("cloudless-ps-ma", "cloudless-ps-asgd", "sdpipe-partial", "heterog")
MA_PERIODS = (4, 16, 64, 256)
ASGD_ACCUMULATIONS = (1, 4, 16)
FULL_SYNCS = (1, 4, 16)
_DESCRIPTIONS = {
    "cloudless-ps-ma": "Cloudless-Training-style: a parameter server per region, model averaging across regions",
    "cloudless-ps-asgd": "Cloudless-Training-style: a parameter server per region, ASGD with gradient accumulation",
    "sdpipe-partial": "SDPipe-style: pipeline replicas, partial averaging among ready replicas",
    "heterog": "HeteroG-style: uneven replicas, parameter server or all-reduce chosen per stage (exact)",
}


Found = tuple[Plan, PlanFigures, ReplicaSimResult]
"""A system's plan (with its estimate), its figures and the simulation behind them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RelaxedBaseline:
    """One baseline: the synchronous baselines' record and the plan's figures."""

    result: BaselineResult
    figures: PlanFigures | None = None
    simulation: ReplicaSimResult | None = None
    """The simulation the figures come from (enough steps for two synchronisations)."""


class _Builder:
    def __init__(self, cluster: Cluster, model: ModelProfile, global_batch: int,
                 efficiency: StatisticalEfficiency) -> None:
        from deepcee.planner.grouping import group_devices

        self.cluster, self.model, self.global_batch, self.efficiency = cluster, model, global_batch, efficiency
        self.islands = [isl.devices for isl in group_devices(cluster).islands]
        if len(self.islands) < 2:
            raise _NoFit("one network island: nothing to join across regions")
        speeds = [sum(cluster.effective_flops_per_s(d) for d in devs) for devs in self.islands]
        self.batches = proportional_shares(global_batch, speeds)

    def simulate(self, plan: Plan) -> tuple[ReplicaSimResult, PlanFigures]:
        steps = {"exact": 2, "model-averaging": 2 * plan.strategy.period, "asgd-ga": 4 * plan.strategy.accumulation_steps,
                 "partial": 2 * plan.strategy.full_sync_every}[plan.strategy.kind]
        result = simulate_replicas(plan, self.cluster, self.model, steps=max(8, steps))
        over = [(b, d) for d, b in result.peak_memory_bytes.items() if b > self.cluster.memory_bytes(d)]
        if over:
            b, d = max(over)
            raise _NoFit(f"OOM: needs {b / GIB:.1f} GiB on {d}, has {self.cluster.memory_bytes(d) / GIB:.0f} GiB")
        return result, plan_figures(plan, result, self.cluster, self.model, self.efficiency)

    def join(self, system: str, replicas: Sequence[Plan], strategy: Strategy, sync: str = "allreduce-ring") -> Plan:
        devices = tuple(d for p in replicas for d in p.devices)
        needs = strategy.kind == "asgd-ga" or sync == "ps" or any(st.sync == "ps" for p in replicas
                                                                   for st in p.stages)
        return Plan(system=system, cluster=self.cluster.name, model=self.model.name, global_batch=self.global_batch,
                    replicas=tuple(p.replicas[0] for p in replicas), sync=sync, strategy=strategy,
                    servers=servers_for(self.cluster, devices) if needs else (),
                    excluded_devices=tuple(d for d in self.cluster.device_names if d not in devices))

    def best(self, system: str, replicas: Sequence[Plan], strategies: Sequence[Strategy],
             sync: str = "allreduce-ring") -> Found:
        """The setting with the lowest predicted time to target."""
        found: list[tuple[float, int, Plan, ReplicaSimResult, PlanFigures]] = []
        miss = ""
        for i, s in enumerate(strategies):
            plan = self.join(system, replicas, s, sync)
            try:
                result, fig = self.simulate(plan)
            except (_NoFit, PlanError) as exc:
                miss = str(exc)
                continue
            found.append((fig.time_to_target.seconds_per_sync_sample, i, plan, result, fig))
        if not found:
            raise _NoFit(miss or "no setting fits")
        _, _, plan, result, fig = min(found, key=lambda x: x[:2])
        return _with_estimate(plan, result, f"{system}: {plan.strategy.describe()}"), fig, result

    # -- the systems ------------------------------------------------------------------------------
    def regions_dp(self) -> list[Plan]:
        return [data_parallel(self.cluster, self.model, b, devs, system="region")
                for devs, b in zip(self.islands, self.batches, strict=True)]

    def cloudless_ma(self) -> Found:
        return self.best("cloudless-ps-ma", self.regions_dp(),
                         [Strategy(kind="model-averaging", period=h) for h in MA_PERIODS], sync="ps")

    def cloudless_asgd(self) -> Found:
        n = len(self.islands)
        return self.best("cloudless-ps-asgd", self.regions_dp(),
                         [Strategy(kind="asgd-ga", accumulation_steps=k, staleness_bound=n)
                          for k in ASGD_ACCUMULATIONS], sync="ps")

    def sdpipe(self) -> Found:
        reps = [even_pipeline(self.cluster, self.model, b, devs, schedule="1f1b", system="region")
                for devs, b in zip(self.islands, self.batches, strict=True)]
        step_s = sum(p.estimate.iteration_s for p in reps) / len(reps)
        return self.best("sdpipe-partial", reps, [Strategy(kind="partial", window_s=0.5 * step_s, min_group=2,
                                                           full_sync_every=p) for p in FULL_SYNCS])

    def heterog(self) -> Found:
        s_count = min(min(len(d) for d in self.islands), self.model.num_layers)
        reps = [self._even_stages(devs, b, s_count) for devs, b in zip(self.islands, self.batches, strict=True)]
        syncs: list[str] = ["allreduce-ring"] * s_count
        best = self.best("heterog", self._with_syncs(reps, syncs), [Strategy()])
        for s in range(s_count):
            trial = [*syncs[:s], "ps", *syncs[s + 1:]]
            try:
                got = self.best("heterog", self._with_syncs(reps, trial), [Strategy()])
            except _NoFit:
                continue
            if got[1].samples_per_s > best[1].samples_per_s:
                best, syncs = got, trial
        what = ", ".join(f"stage {s} {k}" for s, k in enumerate(syncs))
        return best[0].replace(explanation=(f"heterog: {s_count} stages per region, {what}",)), best[1], best[2]

    def _even_stages(self, devs: Sequence[str], batch: int, s_count: int) -> Plan:
        groups = [tuple(devs[s::s_count]) for s in range(s_count)]
        split = even_layer_split(self.model.num_layers, s_count)
        widest = max(len(g) for g in groups)
        short = ""
        for m in microbatch_counts(batch, widest, 4 * s_count):
            stages = tuple(StagePlan(layer_start=a, layer_stop=b, devices=g, shares=even_shares(batch // m, len(g)))
                           for (a, b), g in zip(split, groups, strict=True))
            plan = Plan(system="region", cluster=self.cluster.name, model=self.model.name, global_batch=batch,
                        stages=stages, microbatch_size=batch // m, num_microbatches=m, schedule="1f1b")
            short = memory_shortfall(plan, self.cluster, self.model) or ""
            if not short:
                return plan
        raise _NoFit(f"OOM: {short}" if short else f"a batch of {batch} cannot give every device a sample")

    def _with_syncs(self, reps: Sequence[Plan], syncs: Sequence[str]) -> list[Plan]:
        out = []
        for p in reps:
            stages = tuple(StagePlan(layer_start=st.layer_start, layer_stop=st.layer_stop, devices=st.devices,
                                     shares=st.shares, sync=k) for st, k in zip(p.stages, syncs, strict=True))
            rep = ReplicaPlan(stages=stages, microbatch_size=p.microbatch_size, num_microbatches=p.num_microbatches,
                              schedule=p.schedule)
            out.append(Plan(system="region", cluster=p.cluster, model=p.model, global_batch=p.global_batch,
                            replicas=(rep,), servers=servers_for(self.cluster, rep.devices) if "ps" in syncs else ()))
        return out


def _with_estimate(plan: Plan, result: ReplicaSimResult, line: str) -> Plan:
    est = Estimate(iteration_s=result.iteration_s, samples_per_s=result.samples_per_s,
                   peak_memory_bytes=dict(result.peak_memory_bytes), bottleneck=result.bottleneck, source="simulator")
    return plan.replace(estimate=est, explanation=(line,))


def build_relaxed_baselines(cluster: Cluster, model: ModelProfile, global_batch: int, *,
                            efficiency: StatisticalEfficiency) -> list[RelaxedBaseline]:
    """Every baseline of :data:`RELAXED_BASELINE_NAMES`, in that order. See the module docstring."""
    try:
        builder = _Builder(cluster, model, global_batch, efficiency)
    except _NoFit as exc:
        return [RelaxedBaseline(result=BaselineResult(name=n, plan=None, reason=str(exc), description=_DESCRIPTIONS[n]))
                for n in RELAXED_BASELINE_NAMES]
    makers: dict[str, Callable[[], Found]] = {
        "cloudless-ps-ma": builder.cloudless_ma, "cloudless-ps-asgd": builder.cloudless_asgd,
        "sdpipe-partial": builder.sdpipe, "heterog": builder.heterog}
    out = []
    for name in RELAXED_BASELINE_NAMES:
        try:
            plan, fig, sim = makers[name]()
            out.append(RelaxedBaseline(result=BaselineResult(name=name, plan=plan, description=_DESCRIPTIONS[name]),
                                       figures=fig, simulation=sim))
        except _NoFit as exc:
            out.append(RelaxedBaseline(result=BaselineResult(name=name, plan=None, reason=str(exc),
                                                             description=_DESCRIPTIONS[name])))
        log.debug("relaxed baseline %s: %s", name, out[-1].result.samples_per_s or out[-1].result.reason)
    return out


__all__ = ["ASGD_ACCUMULATIONS", "FULL_SYNCS", "MA_PERIODS", "RELAXED_BASELINE_NAMES", "RelaxedBaseline",
           "build_relaxed_baselines"]
