"""deepcee against the baselines and the upper bound on one cluster (torch-free).

:func:`compare` plans with deepcee (:func:`deepcee.planner.search.plan_training`), builds the
baselines (:func:`deepcee.planner.baselines.build_baselines`) and the bound
(:func:`deepcee.planner.bound.upper_bound`), and scores every plan with the same simulator,
so each ratio is like for like. Every figure is *simulated* on the analytic cost model with
datasheet device speeds (or on the emulated cluster / measured profile when those are
given); :attr:`CompareReport.source` says which, and the JSON carries it.

When leaving slow devices out is best (deepcee's plan excludes devices, or a baseline on one
island or one node comes within 1% of deepcee), the report says so and computes the
**crossover**: it sweeps the global batch and the bandwidth of the slow links the left-out
devices sit behind, and finds where the best plan that uses the left-out devices
starts to beat the best plan without them (:mod:`deepcee.planner.crossover`, which this
module re-exports). See [Note: crossover].
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepcee.cluster import Cluster
from deepcee.errors import DeepceeError, InfeasiblePlanError
from deepcee.inputs.work import check_planning
from deepcee.plan import Plan
from deepcee.planner.baselines import BaselineResult, build_baselines
from deepcee.planner.bound import Bound, upper_bound
from deepcee.planner.crossover import SWEEP_BANDWIDTHS_BYTES_PER_S as SWEEP_BANDWIDTHS_BYTES_PER_S
from deepcee.planner.crossover import SWEEP_BATCHES as SWEEP_BATCHES
from deepcee.planner.crossover import Crossover as Crossover
from deepcee.planner.crossover import Sweep as Sweep
from deepcee.planner.crossover import SweepPlanner as SweepPlanner
from deepcee.planner.crossover import SweepPoint as SweepPoint
from deepcee.planner.crossover import crossover_study as crossover_study
from deepcee.planner.crossover import find_crossover as find_crossover
from deepcee.planner.crossover import slow_link_entries as slow_link_entries
from deepcee.planner.crossover import with_without as with_without
from deepcee.planner.efficiency import (
    DefaultEfficiency,
    StatisticalEfficiency,
    TimeToTarget,
    time_to_target,
)
from deepcee.planner.options import PlannerOptions, Progress
from deepcee.planner.sweep_pool import PoolPlanner
from deepcee.profile import ModelProfile
from deepcee.schedule.interpreter import collection_paused
from deepcee.schedule.ir import ActionKind
from deepcee.schedule.program import lowered_schedule
from deepcee.simulator.engine import SimResult, simulate, to_estimate
from deepcee.units import GIB

if TYPE_CHECKING:
    from deepcee.planner.search import PlanResult

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
LEAVE_OUT_TOLERANCE = 0.01
"""A baseline on one island or node within 1% of deepcee counts as "leaving devices out is best"."""
SINGLE_PLACE_BASELINES = ("ddp-best-island", "best-single-node")


@dataclass(frozen=True, slots=True, kw_only=True)
class CompareRow:
    """One system's simulated figures (all 0 / empty with a reason when it has no plan)."""

    system: str
    description: str
    samples_per_s: float
    iteration_s: float
    speedup: float
    """deepcee's samples/s over this system's (``inf`` when the system has no plan, ``nan``
    when neither has one)."""
    peak_memory_bytes: float
    peak_memory_device: str
    bottleneck: str
    devices_used: int
    reason: str = ""
    plan: Plan | None = None
    semantics: str = ""
    """``exact`` or ``relaxed``; set (with ``time_to_target``) when relaxed rows are compared."""
    time_to_target: TimeToTarget | None = None

    def to_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.semantics:
            t = self.time_to_target
            extra = {"semantics": self.semantics, "time_to_target": None if t is None else {
                "multiplier": t.multiplier, "source": t.source, "seconds_per_sync_sample": t.seconds_per_sync_sample,
                "seconds": t.seconds, "predicted": True}}
        return extra | {
            "system": self.system,
            "description": self.description,
            "samples_per_s": self.samples_per_s,
            "iteration_s": self.iteration_s if self.plan is not None else None,
            "speedup_of_deepcee": self.speedup if math.isfinite(self.speedup) else None,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_device": self.peak_memory_device,
            "bottleneck": self.bottleneck,
            "devices_used": self.devices_used,
            "reason": self.reason,
            "plan": self.plan.to_dict() if self.plan is not None else None,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class CompareReport:
    cluster: str
    model: str
    global_batch: int
    source: str
    """How every figure was obtained (simulated; analytic or measured; datasheet or emulated)."""
    bound: Bound
    rows: tuple[CompareRow, ...]
    """deepcee first, then the baselines."""
    fraction_of_bound: float
    """deepcee's samples/s over the bound's."""
    leave_out: str = ""
    """A plain line when leaving slow devices out is best; empty otherwise."""
    crossover: Crossover | None = None
    planning_s: float = 0.0
    deepcee_breakdown: Mapping[str, float] = field(default_factory=dict)
    """Shares of deepcee's iteration: bubble, sync, receive_wait, per_layer_overhead (see :func:`breakdown`)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def row(self, system: str) -> CompareRow:
        for r in self.rows:
            if r.system == system:
                return r
        raise DeepceeError(f"no row {system!r} in the comparison (have {[r.system for r in self.rows]})")

    @property
    def deepcee(self) -> CompareRow:
        return self.rows[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "format": "deepcee.compare",
            "cluster": self.cluster,
            "model": self.model,
            "global_batch": self.global_batch,
            "source": self.source,
            "bound": {**self.bound.to_dict(), "source": "fluid relaxation (LP) on the same profile and cluster"},
            "fraction_of_bound": self.fraction_of_bound,
            "rows": [{**r.to_dict(), "source": self.source} for r in self.rows],
            "leave_out": self.leave_out,
            "crossover": None if self.crossover is None else {**self.crossover.to_dict(), "source": self.source},
            "planning_s": self.planning_s,
            "deepcee_breakdown": dict(self.deepcee_breakdown),
            "notes": list(self.notes),
        }


def report_from_dict(d: dict[str, Any]) -> dict[str, Any]:
    """Check a compare JSON's header and return it (the report is read back as plain data)."""
    if d.get("format") != "deepcee.compare" or d.get("schema_version") != SCHEMA_VERSION:
        raise DeepceeError(f"expected format 'deepcee.compare' schema_version {SCHEMA_VERSION}, got "
                           f"{d.get('format')!r} {d.get('schema_version')!r}")
    return d


# ---------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------


def figure_source(cluster: Cluster, model: ModelProfile) -> str:
    """The label every figure of the report carries."""
    cost = "measured profile" if model.measured else "analytic cost model"
    speeds = f"emulated cluster ({cluster.emulation})" if cluster.emulation else "datasheet device speeds"
    return f"simulated on the {cost} / {speeds}"


def _row(system: str, description: str, plan: Plan | None, reason: str, deepcee_sps: float) -> CompareRow:
    if plan is None or plan.estimate is None:
        return CompareRow(system=system, description=description, samples_per_s=0.0, iteration_s=0.0,
                          speedup=math.inf if deepcee_sps > 0 else math.nan, peak_memory_bytes=0.0,
                          peak_memory_device="", bottleneck="", devices_used=0, reason=reason or "no plan")
    est = plan.estimate
    dev, peak = max(est.peak_memory_bytes.items(), key=lambda kv: kv[1]) if est.peak_memory_bytes else ("", 0.0)
    return CompareRow(system=system, description=description, samples_per_s=est.samples_per_s,
                      iteration_s=est.iteration_s, speedup=deepcee_sps / est.samples_per_s,
                      peak_memory_bytes=peak, peak_memory_device=dev, bottleneck=est.bottleneck,
                      devices_used=len(plan.devices), reason=reason, plan=plan)


def simulated(plan: Plan, cluster: Cluster, model: ModelProfile) -> Plan:
    """``plan`` with the simulator's estimate (deepcee's plan is re-scored like the baselines)."""
    result = simulate(plan, cluster, model, record=False)
    return plan.replace(estimate=to_estimate(result, plan, cluster))


def _fixed_s(model: ModelProfile, cluster: Cluster, device: str, start: int, stop: int, kind: ActionKind) -> float:
    """Per-microbatch fixed cost of one compute action on ``device``: the part of
    ``model.time_s`` that does not grow with the share (per-layer overheads, and a measured
    kind's call overhead), ``2 t(1) - t(2)`` for a time linear in the samples."""
    dk, slow = cluster.kind_of(device), cluster.device(device).slowdown
    one, two = (model.time_s(start, stop, kind.value, n, dk, slow) for n in (1, 2))
    return max(0.0, 2 * one - two)


def breakdown(plan: Plan, cluster: Cluster, model: ModelProfile, result: SimResult | None = None) -> dict[str, float]:
    """Where a plan's iteration goes, as shares of the iteration time (the worst device each).

    ``bubble`` is the simulator's bubble fraction; ``sync`` and ``receive_wait`` the largest
    per-device time in gradient synchronisation and blocked receives; ``per_layer_overhead``
    the largest per-device sum of fixed costs per action (per-layer and per-call overheads,
    what the upper bound leaves out). ``result``: the plan's ``simulate(plan, cluster, model,
    record=False)`` when the caller has it (a plan's estimate does not enter its simulation).
    """
    result = result or simulate(plan, cluster, model, record=False)
    it = result.iteration_s
    sched = lowered_schedule(plan)
    overhead = 0.0
    for s, st in enumerate(plan.stages):
        for d in st.devices:
            overhead = max(overhead, sum(_fixed_s(model, cluster, d, st.layer_start, st.layer_stop, a.kind)
                                         for a in sched[s] if a.kind.is_compute))
    return {
        "bubble": result.bubble_fraction,
        "sync": max(result.sync_s.values(), default=0.0) / it if it > 0 else 0.0,
        "receive_wait": max(result.comm_wait_s.values(), default=0.0) / it if it > 0 else 0.0,
        "per_layer_overhead": overhead / it if it > 0 else 0.0,
    }


SWEEP_SEARCH = {"sweep_top": 4, "model_top": 3, "refine_top": 1, "compact_top": 1, "confirm_top": 1,
                "chain_budget": 24, "walk_budget": 0, "count_look": False, "score_budget": 20_000, "explain_counterfactuals": False, "refine_best_guides": 0}
"""Lighter search effort for the ~60 plans of a crossover study (PlannerOptions fields)."""


def _deepcee(cluster: Cluster, model: ModelProfile, global_batch: int, *, use_all_devices: bool = False,
             light: bool = False, progress: Progress | None = None
             ) -> tuple[Plan, float, tuple[float, float], PlanResult, SimResult]:
    """deepcee's plan, re-simulated, the planning time, (best simulated samples/s of a
    counterfactual that uses a device the plan leaves out, of one that does not), the
    search's result and the plan's simulation.

    ``use_all_devices`` forbids leaving any device out; ``light`` uses :data:`SWEEP_SEARCH`;
    ``progress``: the search's (:attr:`PlannerOptions.progress`).
    """
    from deepcee.planner.search import plan_training

    t0 = time.perf_counter()
    options = PlannerOptions(allow_exclusion=not use_all_devices, progress=progress, **(SWEEP_SEARCH if light else {}))
    result = plan_training(cluster, model, global_batch, options=options)
    sim = simulate(result.plan, cluster, model, record=False)
    plan = result.plan.replace(estimate=to_estimate(sim, result.plan, cluster))  # as :func:`simulated`
    used = set(plan.devices)
    with_ = [c.plan.estimate.samples_per_s for c in result.counterfactuals if set(c.plan.devices) - used]
    without = [c.plan.estimate.samples_per_s for c in result.counterfactuals if set(c.plan.devices) <= used]
    return (plan, time.perf_counter() - t0, (max(with_, default=0.0), max([plan.estimate.samples_per_s, *without])),
            result, sim)


def _planned(cluster: Cluster, model: ModelProfile, batch: int, *, use_all_devices: bool = False) -> Plan | None:
    """The crossover sweeps' :class:`SweepPlanner`: :func:`_deepcee` with the light search."""
    try:
        plan = _deepcee(cluster, model, batch, use_all_devices=use_all_devices, light=True)[0]
    except InfeasiblePlanError:
        return None
    return plan


# ---------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------


def _leave_out(deepcee: Plan, baselines: Sequence[BaselineResult], cluster: Cluster) -> tuple[str, tuple[str, ...]]:
    """The plain line and the devices to keep, when leaving devices out is best."""
    sps = deepcee.estimate.samples_per_s
    if deepcee.excluded_devices:
        return (f"Leaving devices out is best: deepcee's plan uses {len(deepcee.devices)} of "
                f"{len(cluster.device_names)} devices and leaves out {', '.join(deepcee.excluded_devices)}.",
                deepcee.devices)
    for b in baselines:
        if (b.name in SINGLE_PLACE_BASELINES and b.plan is not None and b.plan.excluded_devices
                and b.samples_per_s >= sps * (1 - LEAVE_OUT_TOLERANCE)):  # on one node nothing is left out
            return (f"Leaving devices out is as good: {b.name} on {len(b.plan.devices)} device(s) reaches "
                    f"{b.samples_per_s / sps:.1%} of deepcee's samples/s without the other "
                    f"{len(b.plan.excluded_devices)} devices.", b.plan.devices)
    return "", ()


def compare(cluster: Cluster, model: ModelProfile, global_batch: int, *, crossover: bool = True,
            relaxed: bool = False, sync: str = "exact", efficiency: StatisticalEfficiency | None = None,
            progress: Progress | None = None) -> CompareReport:
    """deepcee, every baseline and the upper bound on ``cluster``. See the module docstring.

    ``crossover=False`` skips the crossover sweeps (they plan ~40 more times). ``relaxed``
    adds the related systems' strategies (:mod:`deepcee.planner.relaxed_baselines`) and, for
    every row, its semantics and predicted time to target with ``efficiency`` (default:
    :class:`~deepcee.planner.efficiency.DefaultEfficiency`); ``sync="relaxed"`` also adds
    deepcee's relaxed search (:func:`deepcee.planner.replicas.plan_replicas`) as
    ``deepcee-relaxed``. ``progress(step, fraction)``: called as the work goes (deepcee's search
    with its own steps, then the baselines, the related systems and each crossover point).
    """
    with collection_paused():  # as the search: [Note: search without collection] in planner/search.py
        return _compare(cluster, model, global_batch, crossover=crossover, relaxed=relaxed, sync=sync,
                        efficiency=efficiency, progress=progress or (lambda step, fraction: None))


def _compare(cluster: Cluster, model: ModelProfile, global_batch: int, *, crossover: bool, relaxed: bool,
             sync: str, efficiency: StatisticalEfficiency | None, progress: Progress
             ) -> CompareReport:
    t0 = time.perf_counter()
    check_planning(cluster, model, global_batch)  # before the baselines, which plan too
    planned: tuple[float, float] | None = None
    result = None
    try:
        got = _deepcee(cluster, model, global_batch, progress=progress)
        plan, planning_s = got[0], got[1]
        planned = got[2] if len(got) > 2 else None
        result = got[3] if len(got) > 3 else None
        sim = got[4] if len(got) > 4 else None
        reason = ""
    except InfeasiblePlanError as exc:
        # reported as a row without a plan, like a baseline that does not fit
        plan, planning_s, reason, sim = None, time.perf_counter() - t0, f"deepcee found no plan: {exc}", None
        log.warning(reason)
    progress("baselines", 0.0)
    baselines = build_baselines(cluster, model, global_batch)
    bound = upper_bound(cluster, model, global_batch)
    sps = plan.estimate.samples_per_s if plan is not None else 0.0
    rows = [_row("deepcee", "deepcee: network-aware groups, uneven split and shares, planned schedule",
                 plan, reason, sps)]
    rows += [_row(b.name, b.description, b.plan, b.reason, sps) for b in baselines]
    notes = []
    for r in rows:  # the bound is for exact plans: relaxed rows (added below) may pass it
        if r.samples_per_s > bound.samples_per_s * (1 + 1e-9):
            # a plan above the bound means a modelling bug: say so loudly rather than hide it
            notes.append(f"BUG: {r.system}'s {r.samples_per_s:.4g} samples/s exceeds the upper bound "
                         f"{bound.samples_per_s:.4g}")
            log.error(notes[-1])
    if relaxed or sync == "relaxed":
        progress("related systems' strategies" + (" and deepcee's relaxed search" if sync == "relaxed" else ""), 0.0)
        rows, more = _with_relaxed(rows, cluster, model, global_batch, plan, sync, efficiency or DefaultEfficiency(),
                                   progress)
        notes += more
    line, kept = _leave_out(plan, baselines, cluster) if plan is not None else ("", ())
    study = None
    if line and crossover:
        if planned is not None and set(kept) != set(plan.devices):
            planned = None  # a baseline's kept devices: the plan's counterfactuals do not apply
        if result is not None:  # the sweeps re-score this search's candidates and the baselines' plans
            pool = PoolPlanner([plan, *(c.plan for c in result.counterfactuals),
                                *(b.plan for b in baselines if b.plan is not None)], [c.plan for c in result.scored])
            study = crossover_study(cluster, model, global_batch, kept, planner=pool, planned=planned, baselines=False,
                                    confirm=_planned, progress=progress)
        else:
            study = crossover_study(cluster, model, global_batch, kept, planner=_planned, planned=planned,
                                    progress=progress)
    return CompareReport(
        cluster=cluster.name, model=model.name, global_batch=global_batch, source=figure_source(cluster, model),
        bound=bound, rows=tuple(rows), fraction_of_bound=sps / bound.samples_per_s, leave_out=line,
        crossover=study, planning_s=planning_s,
        deepcee_breakdown=breakdown(plan, cluster, model, sim) if plan is not None else {}, notes=tuple(notes),
    )


def _with_relaxed(rows: list[CompareRow], cluster: Cluster, model: ModelProfile, global_batch: int,
                  plan: Plan | None, sync: str, efficiency: StatisticalEfficiency,
                  progress: Progress | None = None) -> tuple[list[CompareRow], list[str]]:
    """Every row with its semantics and time to target, the related systems' rows, and
    (``sync="relaxed"``) deepcee's relaxed plan."""
    from dataclasses import replace

    from deepcee.planner.relaxed_baselines import build_relaxed_baselines

    sps = rows[0].samples_per_s
    extra = [(b.result.name, b.result.description, b.result.plan, b.result.reason)
             for b in build_relaxed_baselines(cluster, model, global_batch, efficiency=efficiency)]
    if sync == "relaxed" and plan is not None:
        from deepcee.planner.replicas import plan_replicas

        got = plan_replicas(cluster, model, global_batch, exact_plan=plan, efficiency=efficiency, progress=progress)
        extra.insert(0, ("deepcee-relaxed", "deepcee --sync relaxed: replica layouts x strategies by predicted time "
                         "to target", got.plan.replace(system="deepcee-relaxed"), ""))
    rows = rows + [_row(name, desc, p, reason, sps) for name, desc, p, reason in extra]
    out = []
    for r in rows:
        if r.plan is None:
            out.append(replace(r, semantics="n/a"))
            continue
        t = time_to_target(r.plan, r.samples_per_s, efficiency)
        out.append(replace(r, semantics=r.plan.semantics, time_to_target=t))
    sources = sorted({r.time_to_target.source for r in out if r.time_to_target is not None and r.semantics == "relaxed"})
    notes = ["relaxed rows do not compute the single-process result: their samples/s are not comparable with the "
             "exact rows' without the steps-to-target multiplier; 'to target' is PREDICTED: multiplier / samples/s "
             "(ms per sync-equivalent sample; s when a calibration measured the reference), multiplier from: "
             + ("; ".join(sources) or "none (no relaxed row has a plan here; each row says why)")]
    return out, notes


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------


def format_table(report: CompareReport) -> str:
    """The comparison as plain text: the bound, then one line per system."""
    b = report.bound
    lines = [
        f"{report.model} on {report.cluster}, global batch {report.global_batch} "
        f"(all figures {report.source})",
        f"upper bound: {b.samples_per_s:.2f} samples/s on islands {{{', '.join(b.islands)}}}, bound by {b.binding}; "
        f"deepcee reaches {report.fraction_of_bound:.1%} of it",
    ]
    if report.deepcee_breakdown:
        lines.append("deepcee's iteration (worst device): " + ", ".join(
            f"{v:.0%} {k.replace('_', ' ')}" for k, v in report.deepcee_breakdown.items()))
    if report.leave_out:
        lines.append(report.leave_out)
    semantics = any(r.semantics for r in report.rows)
    extra = f" {'sem':<7} {'to target (predicted)':>21}" if semantics else ""
    header = (f"{'system':<18} {'iter (s)':>10} {'samples/s':>11} {'deepcee x':>10}{extra} {'peak mem':>16}  "
              "bottleneck")
    lines += [header, "-" * len(header)]
    for r in report.rows:
        cols = f" {r.semantics:<7} {_to_target(r):>21}" if semantics else ""
        if r.plan is None:
            lines.append(f"{r.system:<18} {'-':>10} {'-':>11} {'-':>10}{cols} {'-':>16}  {r.reason}")
            continue
        mem = f"{r.peak_memory_bytes / GIB:.1f} GiB {r.peak_memory_device}"
        speed = "1.00" if r.system == "deepcee" else f"{r.speedup:.2f}"
        lines.append(f"{r.system:<18} {r.iteration_s:>10.4g} {r.samples_per_s:>11.2f} {speed:>10}{cols} {mem:>16}  "
                     f"{r.bottleneck}")
    if report.crossover is not None:
        c = report.crossover
        lines.append(f"crossover (left out: {', '.join(c.left_out_devices)}; swept links: {', '.join(c.slow_links)}):")
        lines += [f"  {c.batch.note}", f"  {c.bandwidth.note}"]
    lines += list(report.notes)
    return "\n".join(lines)


def _to_target(r: CompareRow) -> str:
    t = r.time_to_target
    if t is None:
        return "-"
    return f"{t.seconds:.4g} s" if t.seconds is not None else f"{t.seconds_per_sync_sample * 1e3:.4g} ms"


def plot_crossover(report: CompareReport, path: str | Path) -> None:
    """PNG: samples/s with and without the left-out devices vs global batch and vs bandwidth."""
    if report.crossover is None:
        raise DeepceeError("this comparison has no crossover study (leaving devices out is not best)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = report.crossover
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, sweep, scale, label in (
        (axes[0], c.batch, 1.0, "global batch (samples)"),
        (axes[1], c.bandwidth, 8e-6, "bandwidth of the kept-to-left-out links (Mbit/s)"),
    ):
        xs = [p.value * scale for p in sweep.points]
        ax.plot(xs, [p.with_samples_per_s for p in sweep.points], "o-", label="with the left-out devices")
        ax.plot(xs, [p.without_samples_per_s for p in sweep.points], "s--", label="without them")
        if sweep.crossover is not None:
            ax.axvline(sweep.crossover * scale, color="k", linestyle=":", label="crossover")
        ax.set_xscale("log", base=2 if sweep.parameter == "global_batch" else 10)
        ax.set_xlabel(label)
        ax.set_ylabel("samples/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report.model} on {report.cluster}: {report.source}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
