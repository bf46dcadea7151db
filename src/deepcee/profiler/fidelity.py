"""Hold the simulator to the runtime: run plans for real on an emulated cluster and compare.

For each plan, :func:`run_fidelity` trains a few steps with the runtime
(:func:`deepcee.runtime.launch.launch_jobs`: every plan in one launch, one process per
device, emulated devices and links as the runtime does them), takes the median step time
after discarding the first ``warmup_steps`` steps, and compares it with the simulator's
iteration time (:func:`deepcee.simulator.engine.simulate`) for the same plan on the
*measured* cluster, in three ways (``error = simulated / measured - 1``):

- ``simulated``: with the measured ``profile.json`` as written (one F/I/W line per layer);
- ``per-plan lines``: with :func:`plan_profile`, the measured lines of the passes *this* plan
  runs: the fused backward ``B`` for GPipe/1F1B (the runtime runs ``B``; the data model's ``B``
  is ``I + W``, which costs more), and the first-stage lines for the layers of the first stage
  (see [Note: first-stage timings] in :mod:`deepcee.profiler.device`). This isolates the
  simulator's own modelling from the data model's two gaps;
- ``analytic`` (baseline measured in the same run): the declared cluster and the analytic,
  FLOP-based profile, what planning without a profile sees.

Emulation noise is reported apart: one plan is run ``spread_repeats`` times in the same launch
and the spread of its medians, ``(max - min) / median``, is the run-to-run variation of the
emulation itself on this host; no simulator can be held to less.

The runtime's emulated figures are wall time / ``D`` (see :mod:`deepcee.runtime.emulation`);
the runs use ``cores`` to choose ``D`` per plan. Every report states this.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster
from deepcee.errors import ProfileError
from deepcee.plan import Plan, StagePlan
from deepcee.profile import LayerTiming, ModelProfile
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.trainer import Job, TrainConfig
from deepcee.schedule.compact import build_compact
from deepcee.schedule.ir import ActionKind, format_schedule
from deepcee.simulator.engine import simulate, stage_schedule

log = logging.getLogger(__name__)

FIDELITY_SCHEMA_VERSION = 1
KindLines = tuple[tuple[dict[str, tuple[float, float]], ...], tuple[dict[str, tuple[float, float]], ...]]
"""``(inner, first_stage)``: per layer, pass -> ``(fixed_s, per_sample_s)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FidelityRow:
    """One plan: measured iteration time against the simulator's."""

    name: str
    schedule: str
    num_stages: int
    microbatch_size: int
    num_microbatches: int
    layout: str
    """Stages as ``[layers) devices(shares)``."""
    dilation: float
    measured_s: float
    """Median step time after warm-up (emulated seconds)."""
    measured_steps_s: tuple[float, ...]
    simulated_s: float
    """Simulator, measured cluster and profile."""
    lines_s: float
    """Simulator, measured cluster, :func:`plan_profile` (the lines of the passes the plan runs)."""
    analytic_s: float
    """Simulator, declared cluster and analytic profile (the baseline)."""

    @property
    def error(self) -> float:
        return self.simulated_s / self.measured_s - 1

    @property
    def lines_error(self) -> float:
        return self.lines_s / self.measured_s - 1

    @property
    def analytic_error(self) -> float:
        return self.analytic_s / self.measured_s - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class FidelityReport:
    rows: tuple[FidelityRow, ...]
    spread_plan: str
    spread_medians_s: tuple[float, ...]
    """Median step time of each repeated run of ``spread_plan``."""
    cluster: str
    model: str
    cores: float
    steps: int
    warmup_steps: int
    emulation: str
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_abs_error(self) -> float:
        return statistics.fmean(abs(r.error) for r in self.rows)

    @property
    def max_abs_error(self) -> float:
        return max(abs(r.error) for r in self.rows)

    @property
    def lines_mean_abs_error(self) -> float:
        return statistics.fmean(abs(r.lines_error) for r in self.rows)

    @property
    def lines_max_abs_error(self) -> float:
        return max(abs(r.lines_error) for r in self.rows)

    @property
    def analytic_mean_abs_error(self) -> float:
        return statistics.fmean(abs(r.analytic_error) for r in self.rows)

    @property
    def analytic_max_abs_error(self) -> float:
        return max(abs(r.analytic_error) for r in self.rows)

    @property
    def spread(self) -> float:
        m = self.spread_medians_s
        return (max(m) - min(m)) / statistics.median(m) if m else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "deepcee.fidelity", "schema_version": FIDELITY_SCHEMA_VERSION, "cluster": self.cluster,
            "model": self.model, "cores": self.cores, "steps": self.steps, "warmup_steps": self.warmup_steps,
            "emulation": self.emulation, "wall_s": self.wall_s,
            "mean_abs_error": self.mean_abs_error, "max_abs_error": self.max_abs_error,
            "lines_mean_abs_error": self.lines_mean_abs_error, "lines_max_abs_error": self.lines_max_abs_error,
            "analytic_mean_abs_error": self.analytic_mean_abs_error,
            "analytic_max_abs_error": self.analytic_max_abs_error,
            "spread": {"plan": self.spread_plan, "medians_s": list(self.spread_medians_s), "spread": self.spread},
            "rows": [{"name": r.name, "schedule": r.schedule, "num_stages": r.num_stages,
                      "microbatch_size": r.microbatch_size, "num_microbatches": r.num_microbatches,
                      "layout": r.layout, "dilation": r.dilation, "measured_s": r.measured_s,
                      "measured_steps_s": list(r.measured_steps_s), "simulated_s": r.simulated_s,
                      "error": r.error, "lines_s": r.lines_s, "lines_error": r.lines_error,
                      "analytic_s": r.analytic_s, "analytic_error": r.analytic_error}
                     for r in self.rows],
            **self.extra,
        }


# -- plans -------------------------------------------------------------------------------


def make_plan(name: str, model: str, cluster: str, schedule: str, num_microbatches: int,
              stages: Sequence[tuple[int, int, Sequence[str], Sequence[int]]]) -> Plan:
    """A plan from ``(layer_start, layer_stop, devices, shares)`` per stage (``compact``: see
    :func:`compact_version`, which needs the cluster and profile)."""
    sts = tuple(StagePlan(layer_start=a, layer_stop=b, devices=tuple(d), shares=tuple(s)) for a, b, d, s in stages)
    mb = sts[0].microbatch_size
    return Plan(system=name, cluster=cluster, model=model, global_batch=mb * num_microbatches, microbatch_size=mb,
                num_microbatches=num_microbatches, stages=sts, schedule=schedule)


def compact_version(plan: Plan, cluster: Cluster, profile: ModelProfile) -> Plan:
    """``plan`` with a compact schedule built from its stage times and boundary links."""
    f, i, w = [], [], []
    for st in plan.stages:
        for pas, out in (("F", f), ("I", i), ("W", w)):
            out.append(max(profile.time_s(st.layer_start, st.layer_stop, pas, share, cluster.kind_of(d),
                                          cluster.device(d).slowdown)
                           for d, share in zip(st.devices, st.shares, strict=True)))
    cf, cb = [], []
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        nbytes = plan.microbatch_size * profile.boundary_bytes(a.layer_stop)
        for out, pairs in ((cf, [(x, y) for x in a.devices for y in b.devices]),
                           (cb, [(y, x) for x in a.devices for y in b.devices])):
            links = [cluster.link(s, d) for s, d in pairs]
            out.append((max(lk.latency_s for lk in links), max(nbytes / lk.bandwidth_bytes_per_s for lk in links)))
    sched = build_compact(num_microbatches=plan.num_microbatches, forward_s=f, input_grad_s=i, weight_grad_s=w,
                          comm_forward=cf, comm_backward=cb)
    return plan.replace(schedule="compact", actions=format_schedule(sched))


def default_plans(cluster: Cluster, profile: ModelProfile) -> list[Plan]:
    """Ten plans on ``local-small``-shaped clusters (2 cloud, 2 edge of which one slow, 1 end device):
    every schedule, 2-4 stages, uneven shares, microbatch counts 3-8."""
    c0, c1, e0, e1, n0 = ("cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0")
    missing = [d for d in (c0, c1, e0, e1, n0) if d not in cluster.device_names]
    if missing or profile.num_layers != 6:
        raise ProfileError(f"default plans need local-small's devices and a 6-layer model; missing {missing}, "
                           f"model {profile.name!r} has {profile.num_layers} layers")
    specs = [
        ("gpipe-2", "gpipe", 4, [(0, 3, [c0], [4]), (3, 6, [e0], [4])]),
        ("1f1b-3-dp", "1f1b", 4, [(0, 2, [c0, c1], [2, 2]), (2, 4, [e0], [4]), (4, 6, [n0], [4])]),
        ("zbh1-2", "zb-h1", 6, [(0, 3, [c0], [2]), (3, 6, [n0], [2])]),
        ("zbh2-4", "zb-h2", 4, [(0, 2, [c0], [2]), (2, 3, [c1], [2]), (3, 5, [e0], [2]), (5, 6, [n0], [2])]),
        ("compact-2-uneven", "compact", 3, [(0, 3, [c0, c1], [3, 1]), (3, 6, [e0, e1], [3, 1])]),
        ("gpipe-3-uneven", "gpipe", 3, [(0, 2, [c0], [3]), (2, 4, [e0, e1], [2, 1]), (4, 6, [n0], [3])]),
        ("1f1b-2-slow", "1f1b", 8, [(0, 4, [c0, c1], [1, 1]), (4, 6, [e1], [2])]),
        ("zbh1-3", "zb-h1", 4, [(0, 2, [e0], [4]), (2, 4, [c0], [4]), (4, 6, [c1], [4])]),
        ("compact-3", "compact", 6, [(0, 2, [c0], [2]), (2, 4, [e0], [2]), (4, 6, [n0], [2])]),
        ("zbh2-2-dp", "zb-h2", 4, [(0, 3, [e0, e1], [2, 1]), (3, 6, [c0, c1], [1, 2])]),
    ]
    plans = []
    for name, sched, m, stages in specs:
        plan = make_plan(name, profile.name, cluster.name, "gpipe" if sched == "compact" else sched, m, stages)
        plans.append(compact_version(plan, cluster, profile) if sched == "compact" else plan)
    return plans


def plan_profile(profile: ModelProfile, lines: Mapping[str, KindLines], plan: Plan) -> ModelProfile:
    """``profile`` with, per kind, the measured lines of the passes ``plan`` runs.

    ``lines``: kind -> ``(inner, first_stage)`` per-layer pass lines (:func:`deepcee.profiler.model.kind_lines`).
    Every layer belongs to one stage of the plan, so one line per layer and pass is enough for
    this plan: layers of the first stage take their first-stage lines; a plan whose schedule
    runs the fused backward (no ``I``/``W`` actions) gets ``I := B`` and ``W := 0``, so the
    data model's ``B = I + W`` is the measured fused backward.
    """
    split = any(a.kind in (ActionKind.I, ActionKind.W) for row in stage_schedule(plan) for a in row)
    first_stop = plan.stages[0].layer_stop
    out = profile
    for kind, (inner, first) in lines.items():
        rows = []
        for i, layer in enumerate(inner):
            ln = first[i] if first and i < first_stop else layer
            backward = (ln["I"], ln["W"]) if split else (ln["B"], (0.0, 0.0))
            rows.append(LayerTiming(forward=ln["F"], input_grad=backward[0], weight_grad=backward[1]))
        out = out.with_measured(kind, tuple(rows), source=f"{profile.source}; lines for plan {plan.system}")
    return out


def lines_from_probes(probes: Mapping[str, Any]) -> dict[str, KindLines]:
    """The ``kind_lines`` of a ``probes.json`` (see ``docs/profiler.md``)."""
    def rows(layers: Sequence[Mapping[str, Sequence[float]]]) -> tuple[dict[str, tuple[float, float]], ...]:
        return tuple({p: (float(v[0]), float(v[1])) for p, v in layer.items()} for layer in layers)

    try:
        return {kind: (rows(d["layers"]), rows(d["first_stage"])) for kind, d in probes["kind_lines"].items()}
    except (KeyError, TypeError, IndexError) as exc:
        raise ProfileError(f"probes record without usable kind_lines: {exc!r}") from None


def layout(plan: Plan) -> str:
    return " | ".join(f"[{s.layer_start},{s.layer_stop}) " + ",".join(f"{d}({n})" for d, n in
                                                                    zip(s.devices, s.shares, strict=True))
                      for s in plan.stages)


# -- runs ---------------------------------------------------------------------------------


def run_fidelity(declared: Cluster, measured: Cluster, profile: ModelProfile, analytic: ModelProfile,
                 plans: Sequence[Plan], *, lines: Mapping[str, KindLines], steps: int = 8, warmup_steps: int = 1, cores: float = 0.6,
                 spread_plan: str | None = None, spread_repeats: int = 3, deadline_s: float = 400.0,
                 run_dir: str | Path | None = None, timeout_s: float = 60.0) -> FidelityReport:
    """Run ``plans`` on ``declared`` (emulated) and compare with the simulator; see the module docstring."""
    if steps <= warmup_steps:
        raise ProfileError(f"steps ({steps}) must exceed warmup_steps ({warmup_steps})")
    t0 = time.monotonic()
    root = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="deepcee-fidelity-"))
    spread_plan = spread_plan or plans[0].system
    by_name = {p.system: p for p in plans}
    cfg = TrainConfig(steps=steps, mode="emulated", cores=cores, timeout_s=timeout_s)
    names = [p.system for p in plans] + [f"{spread_plan}#{k}" for k in range(1, spread_repeats)]
    jobs = [Job(name=n, plan=by_name[n.split("#")[0]].to_dict(), cluster=declared.to_dict(), model=profile.name,
                config=cfg, run_dir=str(root / n.replace("#", "-"))) for n in names]
    log.info("running %d jobs (%d plans + %d repeats), %d steps each", len(jobs), len(plans), spread_repeats - 1, steps)
    results = dict(zip(names, launch_jobs(jobs, deadline_s=deadline_s), strict=True))
    rows, medians = [], {}
    for n, res in results.items():
        steady = res.step_s[warmup_steps:]
        medians[n] = statistics.median(steady)
    for p in plans:
        res = results[p.system]
        sim = simulate(p, measured, profile, record=False).iteration_s
        view = simulate(p, measured, plan_profile(profile, lines, p), record=False).iteration_s
        base = simulate(p, declared, analytic, record=False).iteration_s
        rows.append(FidelityRow(
            name=p.system, schedule=p.schedule, num_stages=p.num_stages, microbatch_size=p.microbatch_size,
            num_microbatches=p.num_microbatches, layout=layout(p), dilation=res.dilation,
            measured_s=medians[p.system], measured_steps_s=tuple(res.step_s), simulated_s=sim, lines_s=view,
            analytic_s=base,
        ))
    spread = tuple(medians[n] for n in names if n.split("#")[0] == spread_plan)
    emulation = (f"devices and links emulated by the runtime on this host (time dilation per plan from "
                 f"cores={cores:g}: {', '.join(f'{r.dilation:.3g}' for r in rows)}); measured times are wall / D")
    return FidelityReport(rows=tuple(rows), spread_plan=spread_plan, spread_medians_s=spread, cluster=declared.name,
                          model=profile.name, cores=cores, steps=steps, warmup_steps=warmup_steps,
                          emulation=emulation, wall_s=time.monotonic() - t0)


def format_table(report: FidelityReport) -> str:
    """Markdown table of the rows, then the summary and the emulation spread."""
    lines = ["| plan | schedule | stages | mb x M | D | measured (ms) | per-plan lines (ms) | error | "
             "profile.json (ms) | error | analytic (ms) | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        lines.append(f"| {r.name} | {r.schedule} | {r.num_stages} | {r.microbatch_size} x {r.num_microbatches} | "
                     f"{r.dilation:.2f} | {r.measured_s * 1e3:.1f} | {r.lines_s * 1e3:.1f} | {r.lines_error:+.1%} | "
                     f"{r.simulated_s * 1e3:.1f} | {r.error:+.1%} | {r.analytic_s * 1e3:.1f} | "
                     f"{r.analytic_error:+.1%} |")
    lines += [
        "",
        f"Mean / max |error| over {len(report.rows)} plans: per-plan measured lines "
        f"{report.lines_mean_abs_error:.1%} / {report.lines_max_abs_error:.1%}; profile.json as written "
        f"{report.mean_abs_error:.1%} / {report.max_abs_error:.1%}; analytic baseline "
        f"{report.analytic_mean_abs_error:.1%} / {report.analytic_max_abs_error:.1%}.",
        f"Emulation run-to-run spread ({report.spread_plan}, {len(report.spread_medians_s)} runs): "
        f"{report.spread:.1%} (medians " + ", ".join(f"{m * 1e3:.1f}" for m in report.spread_medians_s) + " ms).",
        f"Emulated: {report.emulation}.",
    ]
    return "\n".join(lines)
