"""Hold the simulator to the runtime: run plans for real on an emulated cluster and compare.

For each plan, :func:`run_fidelity` trains a few steps with the runtime
(:func:`deepcee.runtime.launch.launch_jobs`: every plan in one launch, one process per
device, emulated devices and links as the runtime does them), takes the median step time
after discarding the first ``warmup_steps`` steps, and compares it with the simulator's
iteration time (:func:`deepcee.simulator.engine.simulate`) for the same plan
(``error = simulated / measured - 1``):

- ``simulated``: the *measured* cluster and ``profile.json`` as written (per-layer F/I/W and
  fused B lines, first-stage lines, the per-call overhead of a stage action);
- ``analytic`` (baseline measured in the same run): the declared cluster and the same model's
  layer costs without measurements (FLOP-based), what planning without a profile sees.

Emulation noise is reported apart: one plan is run ``spread_repeats`` times in the same launch
and the spread of its medians, ``(max - min) / median``, is the run-to-run variation of the
emulation itself on this host; no simulator can be held to less.

The runtime's emulated figures are wall time / ``D`` (see :mod:`deepcee.runtime.emulation`);
the runs use ``cores`` to choose ``D`` per plan. Every report states this.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster, load_cluster
from deepcee.errors import DeepceeError, ProfileError
from deepcee.plan import SCHEDULES, Plan, StagePlan, save_json_atomic
from deepcee.profile import ModelProfile, load_profile
from deepcee.runtime.job import Job, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.schedule.compact import build_compact
from deepcee.schedule.ir import format_schedule
from deepcee.simulator.engine import simulate

log = logging.getLogger(__name__)

FIDELITY_SCHEMA_VERSION = 2
FIDELITY_CORES = 0.6
"""Cores the fidelity runs let the emulated devices use: below the 1.2 of ``DEFAULT_CORES`` (an
upper bound for honest pacing), leaving room for the host's other work and the link shaping."""


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
    analytic_s: float
    """Simulator, declared cluster and analytic profile (the baseline)."""

    @property
    def error(self) -> float:
        return self.simulated_s / self.measured_s - 1

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
            "analytic_mean_abs_error": self.analytic_mean_abs_error,
            "analytic_max_abs_error": self.analytic_max_abs_error,
            "spread": {"plan": self.spread_plan, "medians_s": list(self.spread_medians_s), "spread": self.spread},
            "rows": [{"name": r.name, "schedule": r.schedule, "num_stages": r.num_stages,
                      "microbatch_size": r.microbatch_size, "num_microbatches": r.num_microbatches,
                      "layout": r.layout, "dilation": r.dilation, "measured_s": r.measured_s,
                      "measured_steps_s": list(r.measured_steps_s), "simulated_s": r.simulated_s,
                      "error": r.error, "analytic_s": r.analytic_s, "analytic_error": r.analytic_error}
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


def generated_plans(cluster: Cluster, profile: ModelProfile, count: int, *,
                    taken: Sequence[Plan] = ()) -> list[Plan]:
    """``count`` plans for any cluster and model, each different from the others and from ``taken``.

    Plan ``k`` takes the ``k``-th schedule in turn (``SCHEDULES``), 2, 3 or 4 stages in turn (as
    many as the layers and devices allow; 1 when there is one), one device per stage taken
    across islands in turn (so stages meet over the links between them) starting at device ``k``,
    every other plan a first stage of two devices of one island with uneven shares, every third
    plan an uneven layer split, microbatch sizes 2-4 and 3-8 microbatches (at least one per
    stage). Plans the simulator rejects are skipped.
    """
    order = _across_islands(cluster)
    pairs = [devs[:2] for devs in cluster.island_devices().values() if len(devs) >= 2]
    stage_counts = [n for n in (2, 3, 4) if n <= min(profile.num_layers, len(order))] or [1]
    seen = {_key(p) for p in taken}
    names = {p.system for p in taken}
    plans: list[Plan] = []
    for k in range(max(50, 20 * count)):
        if len(plans) >= count:
            break
        n = stage_counts[k % len(stage_counts)]
        mb, m = (2, 3, 4)[k % 3], max(n, (4, 6, 3, 8)[k % 4])
        sched = SCHEDULES[k % len(SCHEDULES)]
        devices = [[order[(k + j) % len(order)]] for j in range(n)]
        shares = [[mb] for _ in range(n)]
        dp = k % 2 == 1 and pairs and len(order) > n
        if dp:
            pair = list(pairs[k // 2 % len(pairs)])
            rest = [d for d in order[k % len(order):] + order[:k % len(order)] if d not in pair]
            devices = [pair] + [[d] for d in rest[:n - 1]]
            shares = [[mb - max(1, mb // 3), max(1, mb // 3)]] + [[mb] for _ in range(n - 1)]
        cuts = [profile.num_layers * j // n for j in range(n + 1)]
        uneven = k % 3 == 2 and n > 1 and cuts[1] + 1 < cuts[2]
        if uneven:
            cuts[1] += 1
        name = f"{sched}-{n}{'-dp' if dp else ''}{'-uneven' if uneven else ''}"
        name = name if name not in names else f"{name}-{k}"
        stages = [(cuts[j], cuts[j + 1], devices[j], shares[j]) for j in range(n)]
        try:
            plan = make_plan(name, profile.name, cluster.name, "gpipe" if sched == "compact" else sched, m, stages)
            plan = compact_version(plan, cluster, profile) if sched == "compact" else plan
            simulate(plan, cluster, profile, record=False)
        except DeepceeError as exc:
            log.info("plan %s skipped: %s", name, exc)
            continue
        if _key(plan) not in seen:
            seen.add(_key(plan))
            names.add(name)
            plans.append(plan)
    if len(plans) < count:
        raise ProfileError(f"could build only {len(plans)} different plans of {count} for {profile.name} on "
                           f"{cluster.name} ({len(order)} devices, {profile.num_layers} layers)")
    return plans


def _across_islands(cluster: Cluster) -> list[str]:
    """Devices taking one from each island in turn."""
    lists = [list(v) for v in cluster.island_devices().values()]
    return [lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)]


def _key(plan: Plan) -> tuple:
    return (plan.schedule, plan.microbatch_size, plan.num_microbatches,
            tuple((s.layer_start, s.layer_stop, s.devices, s.shares) for s in plan.stages))


def validation_plans(cluster: Cluster, profile: ModelProfile, num_plans: int) -> list[Plan]:
    """``num_plans`` different plans: :func:`default_plans` first where they apply (``local-small``'s
    devices, a 6-layer model), then :func:`generated_plans`."""
    if num_plans < 1:
        raise ProfileError(f"num_plans must be >= 1, got {num_plans!r}")
    try:
        plans = default_plans(cluster, profile)[:num_plans]
    except ProfileError:
        plans = []
    return plans + generated_plans(cluster, profile, num_plans - len(plans), taken=plans)


def layout(plan: Plan) -> str:
    return " | ".join(f"[{s.layer_start},{s.layer_stop}) " + ",".join(f"{d}({n})" for d, n in
                                                                    zip(s.devices, s.shares, strict=True))
                      for s in plan.stages)


# -- runs ---------------------------------------------------------------------------------


def without_measurements(profile: ModelProfile) -> ModelProfile:
    """``profile``'s layer costs alone (FLOPs, bytes): the analytic baseline."""
    return dataclasses.replace(profile, measured={}, measured_call_overhead={},
                               source=f"layer costs of {profile.name} without measurements")


def run_fidelity(declared: Cluster, measured: Cluster, profile: ModelProfile, analytic: ModelProfile,
                 plans: Sequence[Plan], *, steps: int = 8, warmup_steps: int = 1, cores: float = FIDELITY_CORES,
                 spread_plan: str | None = None, spread_repeats: int = 3, deadline_s: float | None = None,
                 run_dir: str | Path | None = None, timeout_s: float = 60.0) -> FidelityReport:
    """Run ``plans`` on ``declared`` (emulated) and compare with the simulator; see the module docstring.

    ``deadline_s``: for the whole launch; default 120 s plus 60 s per job.
    """
    if steps <= warmup_steps:
        raise ProfileError(f"steps ({steps}) must exceed warmup_steps ({warmup_steps})")
    if not plans:
        raise ProfileError("no plans to run")
    t0 = time.monotonic()
    root = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="deepcee-fidelity-"))
    spread_plan = spread_plan or plans[0].system
    by_name = {p.system: p for p in plans}
    cfg = TrainConfig(steps=steps, mode="emulated", cores=cores, timeout_s=timeout_s)
    names = [p.system for p in plans] + [f"{spread_plan}#{k}" for k in range(1, spread_repeats)]
    jobs = [Job(name=n, plan=by_name[n.split("#")[0]], cluster=declared, model=profile.name,
                config=cfg, run_dir=str(root / n.replace("#", "-"))) for n in names]
    log.info("running %d jobs (%d plans + %d repeats of %s), %d steps each", len(jobs), len(plans),
             spread_repeats - 1, spread_plan, steps)
    deadline = 120.0 + 60.0 * len(jobs) if deadline_s is None else deadline_s
    results = dict(zip(names, launch_jobs(jobs, deadline_s=deadline), strict=True))
    medians = {n: statistics.median(res.step_s[warmup_steps:]) for n, res in results.items()}
    rows = []
    for p in plans:
        res = results[p.system]
        rows.append(FidelityRow(
            name=p.system, schedule=p.schedule, num_stages=p.num_stages, microbatch_size=p.microbatch_size,
            num_microbatches=p.num_microbatches, layout=layout(p), dilation=res.dilation,
            measured_s=medians[p.system], measured_steps_s=tuple(res.step_s),
            simulated_s=simulate(p, measured, profile, record=False).iteration_s,
            analytic_s=simulate(p, declared, analytic, record=False).iteration_s,
        ))
    spread = tuple(medians[n] for n in names if n.split("#")[0] == spread_plan)
    emulation = (f"devices and links emulated by the runtime on this host (time dilation per plan from "
                 f"cores={cores:g}: {', '.join(f'{r.dilation:.3g}' for r in rows)}); measured times are wall / D")
    return FidelityReport(rows=tuple(rows), spread_plan=spread_plan, spread_medians_s=spread, cluster=declared.name,
                          model=profile.name, cores=cores, steps=steps, warmup_steps=warmup_steps,
                          emulation=emulation, wall_s=time.monotonic() - t0)


def validate_cluster(cluster: Cluster, model_name: str, *, num_plans: int = 8, steps: int = 6,
                     out_dir: str | Path, profile_dir: str | Path | None = None, cores: float = FIDELITY_CORES,
                     profile_cores: float | None = None, spread_repeats: int = 3,
                     profile_options: Mapping[str, Any] | None = None, deadline_s: float | None = None,
                     say: Callable[[str], None] = print) -> FidelityReport:
    """``deepcee validate``: the simulator's iteration times against real emulated runs of ``cluster``.

    Profiles ``cluster`` for ``model_name`` into ``out_dir/profile`` (or reads ``cluster.json``
    and ``profile.json`` from ``profile_dir``), builds ``num_plans`` different plans
    (:func:`validation_plans`), runs each for ``steps`` steps with the runtime on ``cluster``
    emulated with ``cores`` (:func:`run_fidelity`; the first step is warm-up, the first plan is
    run ``spread_repeats`` times for the emulation's own spread), compares with the simulator on
    the measured cluster and profile and with the analytic baseline, writes
    ``out_dir/validate.json`` (``deepcee.fidelity``, with the plans) and returns the report.
    ``say`` gets progress lines and the table. The device probe paces with ``profile_cores``
    (default ``cores``): the same pacing as the runs it has to predict; ``profile_options`` are
    further keyword arguments of :func:`deepcee.profiler.run.profile_cluster` (``device_config``,
    ``network_budget``, ``deadline_s``, ...). ``deadline_s`` bounds the runs' launch (see
    :func:`run_fidelity`).
    """
    from deepcee.profiler.run import profile_cluster

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if profile_dir is None:
        say(f"profiling {cluster.name} for {model_name} ({len(cluster.devices)} devices, emulated) into "
            f"{out / 'profile'}")
        res = profile_cluster(cluster, model_name, out / "profile", cores=profile_cores or cores,
                              **dict(profile_options or {}))
        measured, profile, source = res.cluster, res.profile, str(out / "profile")
        say(f"profiled in {res.wall_s:.0f} s")
    else:
        measured, profile = _read_profile_dir(Path(profile_dir))
        source = str(profile_dir)
        if profile.name != model_name:
            raise ProfileError(f"profile in {profile_dir} is for {profile.name!r}, not {model_name!r}")
        say(f"using the profile in {profile_dir}")
    profile_s = time.monotonic() - t0
    plans = validation_plans(measured, profile, num_plans)
    say(f"running {len(plans)} plans ({', '.join(p.system for p in plans)}), {steps} steps each, "
        f"{spread_repeats} runs of {plans[0].system} for the emulation spread")
    report = run_fidelity(cluster, measured, profile, without_measurements(profile), plans, steps=steps, cores=cores,
                          spread_plan=plans[0].system, spread_repeats=spread_repeats, run_dir=out / "runs",
                          deadline_s=deadline_s)
    report = dataclasses.replace(report, extra={
        "profile_dir": source, "profile_s": profile_s, "total_s": time.monotonic() - t0,
        "plans": [p.to_dict() for p in plans]})
    save_json_atomic(out / "validate.json", report.to_dict())
    say(format_table(report))
    say(f"written {out / 'validate.json'}")
    return report


def _read_profile_dir(path: Path) -> tuple[Cluster, ModelProfile]:
    missing = [f for f in ("cluster.json", "profile.json") if not (path / f).exists()]
    if missing:
        raise ProfileError(f"profile directory lacks {', '.join(missing)} (run deepcee profile first)", file=str(path))
    return load_cluster(path / "cluster.json"), load_profile(path / "profile.json")


def format_table(report: FidelityReport) -> str:
    """Markdown table of the rows, then the summary and the emulation spread."""
    lines = ["| plan | schedule | stages | mb x M | D | measured (ms) | simulated (ms) | error | analytic (ms) | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        lines.append(f"| {r.name} | {r.schedule} | {r.num_stages} | {r.microbatch_size} x {r.num_microbatches} | "
                     f"{r.dilation:.2f} | {r.measured_s * 1e3:.1f} | {r.simulated_s * 1e3:.1f} | {r.error:+.1%} | "
                     f"{r.analytic_s * 1e3:.1f} | {r.analytic_error:+.1%} |")
    lines += [
        "",
        f"Mean / max |error| over {len(report.rows)} plans: simulator with the measured profile "
        f"{report.mean_abs_error:.1%} / {report.max_abs_error:.1%}; analytic baseline "
        f"{report.analytic_mean_abs_error:.1%} / {report.analytic_max_abs_error:.1%}.",
        f"Emulation run-to-run spread ({report.spread_plan}, {len(report.spread_medians_s)} runs): "
        f"{report.spread:.1%} (medians " + ", ".join(f"{m * 1e3:.1f}" for m in report.spread_medians_s) + " ms).",
        f"Emulated: {report.emulation}.",
    ]
    return "\n".join(lines)
