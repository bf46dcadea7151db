"""Hold the simulator to the runtime: run plans for real and compare time, memory and ranking.

For each plan, :func:`run_fidelity` trains a few steps with the runtime
(:func:`deepcee.runtime.launch.launch_jobs`, one process per device), takes the median step
time after discarding the first ``warmup_steps`` steps and each device's peak memory, and
compares them with the simulator's prediction for the same plan (:func:`predict`;
``error = simulated / measured - 1``):

- ``simulated``: the *measured* cluster and ``profile.json`` (per-size F/I/W/B times, call
  overheads, optimizer steps, memory overheads, link curves, per-step bookkeeping), timed as
  deepcee's runtime runs the plan in that mode
  (:func:`deepcee.simulator.runtime_model.deepcee_runtime`): the mean of iterations 2..N of
  an N-iteration simulation, as the measured median leaves the first step out;
- ``analytic`` (baseline measured in the same run): the declared cluster and the same model's
  layer costs without measurements (FLOP-based), what planning without a profile sees.

Modes (``mode``):

- ``realnet`` (the default where the host allows it: root and ``/dev/net/tun``): links are
  real TCP through the shaping relay between network namespaces, the gradient all-reduce is
  gloo's over them, nothing waits for a model. One launch per plan (the relay serves one
  device order). The profile should be measured the same way
  (``deepcee profile``/:func:`deepcee.profiler.run.profile_cluster` with ``realnet=True``);
- ``emulated``: the runtime's in-process link shaper and its modelled all-reduce wait, the
  simulator's own formulas: figures from it are *partly modelled* and reported apart (see
  [Note: figure labels] in :mod:`deepcee.profiler.fidelity_report`). All plans in one launch;
  the simulator gets the declared links (what the shaper emulates) and no link curves.

Noise is reported apart: one plan is run ``spread_repeats`` times and the spread of its
medians, ``(max - min) / median``, is the run-to-run variation of the measurement itself on
this host. The runs' figures are wall time / ``D`` (:mod:`deepcee.runtime.emulation`); the runs
use ``cores`` to choose ``D`` per plan. Every report states this.

:func:`validate_cluster` is ``deepcee validate``: profile (or reuse a profile), build
:func:`validation_plans`, run and compare, write ``validate.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster, load_cluster
from deepcee.errors import ProfileError
from deepcee.plan import Plan, save_json_atomic
from deepcee.profile import ModelProfile, load_profile
from deepcee.profiler.fidelity_plans import compact_version as compact_version
from deepcee.profiler.fidelity_plans import default_plans as default_plans
from deepcee.profiler.fidelity_plans import generated_plans as generated_plans
from deepcee.profiler.fidelity_plans import layout, validation_plans
from deepcee.profiler.fidelity_plans import make_plan as make_plan
from deepcee.profiler.fidelity_report import FidelityReport, FidelityRow, MemoryRow, format_table
from deepcee.runtime.job import Job, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.records import TrainResult
from deepcee.simulator.engine import SimResult, simulate
from deepcee.simulator.runtime_model import LaunchMode, deepcee_runtime

__all__ = ["FIDELITY_CORES", "FidelityReport", "FidelityRow", "MemoryRow", "compact_version", "default_plans",
           "format_table", "generated_plans", "make_plan", "predict", "run_fidelity", "validate_cluster",
           "validation_plans", "without_measurements"]

log = logging.getLogger(__name__)

FIDELITY_CORES = 0.6
"""Cores the fidelity runs let the emulated devices use: below the 1.2 of ``DEFAULT_CORES`` (an
upper bound for honest pacing), leaving room for the host's other work and the link shaping."""
SIM_ITERATIONS = 5
"""Iterations :func:`predict` simulates (the first is left out, as the runs' first step is)."""


def without_measurements(profile: ModelProfile) -> ModelProfile:
    """``profile``'s layer costs alone (FLOPs, bytes): the analytic baseline."""
    return dataclasses.replace(profile, measured={}, measured_call_overhead={}, measured_memory={}, links={},
                               step_overhead_wall_s={},
                               source=f"layer costs of {profile.name} without measurements")


def emulated_view(measured: Cluster, declared: Cluster, profile: ModelProfile) -> tuple[Cluster, ModelProfile]:
    """What the simulator gets for a run in mode ``emulated``: the measured devices with the
    declared links (the link shaper emulates exactly those) and no measured link curves."""
    cluster = dataclasses.replace(measured, links=declared.links, nodes=declared.nodes, islands=declared.islands)
    return cluster, dataclasses.replace(profile, links={})


def predict(plan: Plan, cluster: Cluster, profile: ModelProfile, *, mode: LaunchMode, dilation: float = 1.0,
            iterations: int = SIM_ITERATIONS) -> tuple[float, SimResult]:
    """``(steady iteration seconds, the simulation)`` of ``plan`` as deepcee's runtime runs it in
    ``mode`` at time dilation ``dilation`` (the profile's per-step bookkeeping for that mode is
    wall seconds, which a paced run reports divided by ``D``)."""
    overhead = profile.step_overhead_wall_s.get(mode, 0.0) / dilation
    result = simulate(plan, cluster, profile, iterations=iterations, record=False,
                      runtime=deepcee_runtime(mode, step_overhead_s=overhead))
    times = result.iteration_times_s[1:] or result.iteration_times_s
    return statistics.fmean(times), result


def _launch(jobs: Sequence[Job], mode: LaunchMode, deadline_s: float | None) -> list[TrainResult]:
    """Every job; in mode ``realnet`` one launch per job (each plan its own device order)."""
    if mode != "realnet":
        return launch_jobs(jobs, deadline_s=120.0 + 60.0 * len(jobs) if deadline_s is None else deadline_s)
    out = []
    for job in jobs:
        log.info("realnet launch of %s", job.name)
        out.append(launch_jobs([job], deadline_s=180.0 if deadline_s is None else deadline_s)[0])
    return out


def pacing_ratio(res: TrainResult, plan: Plan, cluster: Cluster) -> float:
    """Median over steps (the first left out) of the largest stage's compute (emulated seconds)
    over its devices' CPU time x slowdown (see [Note: pacing check] in
    :mod:`deepcee.profiler.fidelity_report`)."""
    ratios = []
    for m in res.metrics[1:] or res.metrics:
        worst = 0.0
        for st in m.stages:
            cpu = max(m.cpu_s.get(d, 0.0) * cluster.device(d).slowdown for d in plan.stages[st.stage].devices)
            worst = max(worst, st.compute_s / cpu if cpu > 0 else 0.0)
        ratios.append(worst)
    return statistics.median(ratios) if ratios else 1.0


def _row(plan: Plan, res: TrainResult, measured_s: float, simulated: tuple[float, SimResult],
         analytic_s: float, declared: Cluster) -> FidelityRow:
    sim_s, sim = simulated
    peaks = res.peak_memory_bytes
    memory = tuple(MemoryRow(device=d, predicted_bytes=sim.peak_memory_bytes[d], measured_bytes=peaks[d])
                   for d in plan.devices if d in peaks)
    return FidelityRow(name=plan.system, schedule=plan.schedule, num_stages=plan.num_stages,
                       microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
                       layout=layout(plan), dilation=res.dilation, measured_s=measured_s,
                       measured_steps_s=tuple(res.step_s), simulated_s=sim_s, analytic_s=analytic_s, memory=memory,
                       pacing=pacing_ratio(res, plan, declared))


def run_fidelity(declared: Cluster, measured: Cluster, profile: ModelProfile, analytic: ModelProfile,
                 plans: Sequence[Plan], *, mode: LaunchMode = "emulated", steps: int = 8, warmup_steps: int = 1,
                 cores: float = FIDELITY_CORES, spread_plan: str | None = None, spread_repeats: int = 3,
                 deadline_s: float | None = None, run_dir: str | Path | None = None,
                 timeout_s: float = 60.0, dilation: float | None = None) -> FidelityReport:
    """Run ``plans`` on ``declared`` in ``mode`` and compare with the simulator; see the module docstring.

    ``dilation``: every run's time dilation (default: each plan's from ``cores``); one for all
    plans, the profile's, keeps the pacing the profile saw.

    ``deadline_s``: per launch; default 120 s plus 60 s per job (mode ``emulated``, one launch),
    180 s (mode ``realnet``, one launch per job).
    """
    if steps <= warmup_steps:
        raise ProfileError(f"steps ({steps}) must exceed warmup_steps ({warmup_steps})")
    if not plans:
        raise ProfileError("no plans to run")
    t0 = time.monotonic()
    root = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="deepcee-fidelity-"))
    spread_plan = spread_plan or plans[0].system
    by_name = {p.system: p for p in plans}
    cfg = TrainConfig(steps=steps, mode=mode, cores=cores, timeout_s=timeout_s, dilation=dilation)
    names = [p.system for p in plans] + [f"{spread_plan}#{k}" for k in range(1, spread_repeats)]
    jobs = [Job(name=n, plan=by_name[n.split("#")[0]], cluster=declared, model=profile.name,
                config=cfg, run_dir=str(root / n.replace("#", "-"))) for n in names]
    log.info("running %d jobs in mode %s (%d plans + %d repeats of %s), %d steps each", len(jobs), mode,
             len(plans), spread_repeats - 1, spread_plan, steps)
    results = dict(zip(names, _launch(jobs, mode, deadline_s), strict=True))
    medians = {n: statistics.median(res.step_s[warmup_steps:]) for n, res in results.items()}
    cluster, prof = emulated_view(measured, declared, profile) if mode == "emulated" else (measured, profile)
    rows = []
    for p in plans:
        res = results[p.system]
        rt = deepcee_runtime(mode)
        analytic_s = simulate(p, declared, analytic, iterations=SIM_ITERATIONS, record=False, runtime=rt)
        rows.append(_row(p, res, medians[p.system], predict(p, cluster, prof, mode=mode, dilation=res.dilation),
                         statistics.fmean(analytic_s.iteration_times_s[1:]), declared))
    spread = tuple(medians[n] for n in names if n.split("#")[0] == spread_plan)
    links = ("real TCP through the shaping relay between network namespaces" if mode == "realnet"
             else "emulated by the runtime's link shaper")
    how = f"D = {dilation:g} for every plan" if dilation else f"per plan from cores={cores:g}"
    emulation = (f"devices paced on this host, links {links} (time dilation {how}: "
                 f"{', '.join(f'{r.dilation:.3g}' for r in rows)}); measured times are wall / D")
    return FidelityReport(rows=tuple(rows), spread_plan=spread_plan, spread_medians_s=spread, cluster=declared.name,
                          model=profile.name, cores=cores, steps=steps, warmup_steps=warmup_steps,
                          emulation=emulation, wall_s=time.monotonic() - t0, mode=mode,
                          runtime=deepcee_runtime(mode).name)


def validate_cluster(cluster: Cluster, model_name: str, *, num_plans: int = 8, steps: int = 6,
                     out_dir: str | Path, profile_dir: str | Path | None = None, cores: float = FIDELITY_CORES,
                     profile_cores: float | None = None, spread_repeats: int = 3,
                     profile_options: Mapping[str, Any] | None = None, deadline_s: float | None = None,
                     mode: LaunchMode = "emulated", dilation: float | None = None,
                     say: Callable[[str], None] = print) -> FidelityReport:
    """``deepcee validate``: the simulator's step times and peak memory against real runs of ``cluster``.

    Profiles ``cluster`` for ``model_name`` into ``out_dir/profile`` (links over the relay in
    mode ``realnet``; or reads ``cluster.json`` and ``profile.json`` from ``profile_dir``),
    builds ``num_plans`` different plans (:func:`validation_plans`), runs each for ``steps``
    steps with the runtime on ``cluster`` in ``mode`` with ``cores`` (:func:`run_fidelity`; the
    first step is warm-up, the first plan is run ``spread_repeats`` times for the measurement's
    own spread), compares with the simulator on the measured cluster and profile and with the
    analytic baseline, writes ``out_dir/validate.json`` (``deepcee.fidelity``, with the plans)
    and returns the report. ``say`` gets progress lines and the table. The device probe paces
    with ``profile_cores`` (default ``cores``): the same pacing as the runs it has to predict;
    ``profile_options`` are further keyword arguments of
    :func:`deepcee.profiler.run.profile_cluster` (``device_config``, ``network_budget``,
    ``deadline_s``, ...). ``deadline_s`` bounds each launch and ``dilation`` forces every run's
    (see :func:`run_fidelity`).
    """
    from deepcee.profiler.run import profile_cluster

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if profile_dir is None:
        say(f"profiling {cluster.name} for {model_name} ({len(cluster.devices)} devices, links "
            f"{'over the relay' if mode == 'realnet' else 'emulated'}) into {out / 'profile'}")
        res = profile_cluster(cluster, model_name, out / "profile", cores=profile_cores or cores,
                              realnet=mode == "realnet", **dict(profile_options or {}))
        measured, profile, source = res.cluster, res.profile, str(out / "profile")
        say(f"profiled in {res.wall_s:.0f} s")
    else:
        measured, profile = read_profile_dir(Path(profile_dir))
        source = str(profile_dir)
        if profile.name != model_name:
            raise ProfileError(f"profile in {profile_dir} is for {profile.name!r}, not {model_name!r}")
        say(f"using the profile in {profile_dir}")
    profile_s = time.monotonic() - t0
    plans = validation_plans(measured, profile, num_plans)
    say(f"running {len(plans)} plans ({', '.join(p.system for p in plans)}) in mode {mode}, {steps} steps each, "
        f"{spread_repeats} runs of {plans[0].system} for the spread")
    report = run_fidelity(cluster, measured, profile, without_measurements(profile), plans, mode=mode, steps=steps,
                          cores=cores, spread_plan=plans[0].system, spread_repeats=spread_repeats,
                          run_dir=out / f"runs-{mode}", deadline_s=deadline_s, dilation=dilation)
    report = dataclasses.replace(report, extra={
        "profile_dir": source, "profile_s": profile_s, "total_s": time.monotonic() - t0,
        "plans": [p.to_dict() for p in plans]})
    save_json_atomic(out / "validate.json", report.to_dict())
    say(format_table(report))
    say(f"written {out / 'validate.json'}")
    return report


def read_profile_dir(path: Path) -> tuple[Cluster, ModelProfile]:
    """``cluster.json`` and ``profile.json`` of a ``deepcee profile`` folder."""
    missing = [f for f in ("cluster.json", "profile.json") if not (path / f).exists()]
    if missing:
        raise ProfileError(f"profile directory lacks {', '.join(missing)} (run deepcee profile first)", file=str(path))
    return load_cluster(path / "cluster.json"), load_profile(path / "profile.json")
