"""Time to target, measured: four plans trained for real to the same target loss, with predictions.

Used by ``benchmarks/time_to_target.py`` (and meant for the main job). On an emulated cluster:

1. the systems ([Note: time-to-target systems]): deepcee's relaxed plan using devices in
   every island, deepcee's synchronous plan, the best single island (synchronous), and DDP on
   all devices;
2. the predictions: predicted time to target = multiplier x reference samples to target /
   simulated samples per second (:mod:`deepcee.planner.efficiency`), with the multiplier of
   the calibration given (``deepcee calibrate``) or the conservative default, each labelled;
3. every plan trained for real (mode ``emulated``: one process per device, paced devices,
   emulated links) until its evaluation loss reaches the target ([Note: time to target] in
   :mod:`deepcee.runtime.target`): emulated seconds, samples, steps, the evaluation curve;
4. the report: measured vs predicted per system, ratios, final evaluation losses side by side
   (and at the same number of samples: [Note: same-samples comparison]), which runs were
   synchronous and which relaxed, and ``loss_vs_time.png``.

[Note: time-to-target systems]
- ``deepcee-relaxed``: of the relaxed planner's candidates whose replicas use every island,
  the best by predicted time to target among those that can be evaluated mid-run
  (``model-averaging``: see [Note: calibration runs] in :mod:`deepcee.calibrate`). Where the
  planner's overall choice differs (an exact plan, or another rule), the report says so.
- ``deepcee-sync``: the exact planner's plan (the single-process result every step).
- ``single-island``: the exact planner on each island alone; the one with the best simulated
  samples per second.
- ``ddp-all``: the DDP baseline on every device (exact).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster
from deepcee.errors import DeepceeError
from deepcee.plan import Plan, save_json_atomic
from deepcee.planner.efficiency import (
    CalibratedEfficiency,
    DefaultEfficiency,
    StatisticalEfficiency,
)
from deepcee.profile import ModelProfile
from deepcee.runtime.emulation import DEFAULT_CORES
from deepcee.ttt_samples import (
    EVALUATION,
    PROBE,
    SAME_SAMPLES_TOLERANCE,
    eval_at_common_text,
    eval_at_samples,
    loss_at_samples,
    same_samples,
    same_samples_text,
)

log = logging.getLogger(__name__)

TASKS: dict[str, dict[str, Any]] = {
    # convnet-tiny: well below chance (ln 6 = 1.79): most held-out shapes classified right
    "convnet-tiny": {"target_loss": 0.5, "lr": 1e-2, "eval_every": 10, "max_steps": 800},
    # gpt-tiny: nats per byte of held-out text, well below the untrained ln 256 = 5.5 (about 40-50
    # synchronous steps of 32 samples)
    "gpt-tiny": {"target_loss": 2.3, "lr": 3e-3, "eval_every": 5, "max_steps": 200},
}
"""The tasks' targets and settings (AdamW, global batch 32) used by the benchmark and the demo."""

FORMAT = "deepcee.time-to-target"
SCHEMA_VERSION = 1
SYSTEMS = ("deepcee-relaxed", "deepcee-sync", "single-island", "ddp-all")


@dataclass(frozen=True, slots=True, kw_only=True)
class TttConfig:
    model: str
    global_batch: int
    target_loss: float
    eval_every: int = 10
    max_steps: int = 800
    optimizer: str = "adamw"
    lr: float = 1e-3
    seed: int = 0
    eval_batches: int = 4
    mode: str = "emulated"
    out_dir: str = "reports/time-to-target"
    deadline_s: float = 1800.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A system's plan and its prediction (before training)."""

    system: str
    plan: Plan
    simulated_samples_per_s: float
    multiplier: float
    multiplier_source: str
    islands: int
    note: str = ""

    def predicted_s(self, reference_samples: float | None) -> float | None:
        if reference_samples is None:
            return None
        return self.multiplier * reference_samples / self.simulated_samples_per_s


def _islands_used(cluster: Cluster, plan: Plan) -> int:
    isl = {dev: name for name, devs in cluster.island_devices().items() for dev in devs}
    return len({isl[d] for d in plan.devices})


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """The systems' plans and predictions, and what the relaxed planner said."""

    systems: dict[str, Candidate]
    explanation: tuple[str, ...]
    """The relaxed planner's explanation of its overall choice."""
    planner_choice: Plan
    """The relaxed planner's overall choice (``deepcee plan --sync relaxed``)."""


def candidates(cluster: Cluster, profile: ModelProfile, global_batch: int, model: str, cluster_ref: str,
               efficiency: StatisticalEfficiency, relaxed_options: Any = None) -> Planned:
    """The four systems' plans and predictions ([Note: time-to-target systems]).
    ``relaxed_options``: the relaxed search's settings (a
    :class:`~deepcee.planner.replicas.RelaxedOptions`; default: all of them)."""
    from deepcee.planner.baselines import build_baselines
    from deepcee.planner.replicas import RelaxedOptions, plan_replicas
    from deepcee.planner.search import plan_training
    from deepcee.simulator.engine import simulate

    # every replica layout planned in full: the systems need the one-replica-per-island layout's
    # model averaging, whether or not the search's screen of the layouts would plan it in full
    # ([Note: layout screen] in deepcee.planner.replicas)
    relaxed_options = (relaxed_options or RelaxedOptions()).every_layout()

    def exact(system: str, plan: Plan, c: Cluster = cluster, note: str = "") -> Candidate:
        plan = plan.replace(cluster=cluster_ref, model=model, system=system)
        return Candidate(system=system, plan=plan, simulated_samples_per_s=simulate(plan, c, profile,
                                                                                    record=False).samples_per_s,
                         multiplier=1.0, multiplier_source=efficiency.source(plan),
                         islands=_islands_used(cluster, plan), note=note)

    out: dict[str, Candidate] = {}
    sync = plan_training(cluster, profile, global_batch).plan
    res = plan_replicas(cluster, profile, global_batch, efficiency=efficiency, exact_plan=sync,
                        options=relaxed_options)
    n_isl = len(cluster.island_devices())
    every = [s for s in res.candidates if s.plan.strategy.kind == "model-averaging"
             and _islands_used(cluster, s.plan) == n_isl]
    if not every:
        raise DeepceeError(f"the relaxed planner has no model-averaging plan over every island of {cluster.name}")
    best = every[0]  # candidates are ranked by predicted time to target
    chosen = res.plan.strategy.describe()
    note = "" if res.plan.strategy == best.plan.strategy and res.plan.num_replicas > 1 else \
        f"the relaxed planner's overall choice is another plan ({res.plan.num_replicas} replica(s), {chosen})"
    plan = best.plan.replace(cluster=cluster_ref, model=model, system="deepcee-relaxed", estimate=None)
    out["deepcee-relaxed"] = Candidate(system="deepcee-relaxed", plan=plan, simulated_samples_per_s=best.samples_per_s,
                                       multiplier=efficiency.multiplier(plan), multiplier_source=efficiency.source(plan),
                                       islands=n_isl, note=note)
    out["deepcee-sync"] = exact("deepcee-sync", sync)
    singles = []
    for name, devs in cluster.island_devices().items():
        sub = cluster.subset(devs)
        try:
            singles.append(exact("single-island", plan_training(sub, profile, global_batch).plan, sub,
                                 note=f"island {name}"))
        except DeepceeError as exc:
            log.info("island %s has no plan: %s", name, exc)
    out["single-island"] = max(singles, key=lambda c: c.simulated_samples_per_s)
    ddp = next(b for b in build_baselines(cluster, profile, global_batch) if b.name == "ddp")
    if ddp.plan is None:
        raise DeepceeError(f"DDP has no plan: {ddp.reason}")
    out["ddp-all"] = exact("ddp-all", ddp.plan)
    return Planned(systems=out, explanation=tuple(res.explanation), planner_choice=res.plan)


def _same_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans train the same way (names, estimates, explanations and the devices
    they list as left out aside: a plan on a sub-cluster lists none)."""
    def bare(p: Plan) -> dict[str, Any]:
        return p.replace(system="", estimate=None, explanation=(), excluded_devices=()).to_dict()

    return bare(a) == bare(b)


def step_caps(cands: Mapping[str, Candidate], reference_samples: float | None, factor: float,
              eval_every: int) -> dict[str, int]:
    """Most steps for the exact systems predicted to need more than ``factor`` x the fastest
    system's predicted time to target: enough for ``factor`` x that time at their simulated
    speed (at least two evaluations). Exact plans all need the reference's samples to the
    target, so a capped run's time to target can be projected from its measured speed."""
    preds = {n: c.predicted_s(reference_samples) for n, c in cands.items()}
    if reference_samples is None or any(p is None for p in preds.values()):
        return {}
    budget = factor * min(p for p in preds.values() if p is not None)
    caps = {}
    for name, c in cands.items():
        if c.plan.semantics == "exact" and (preds[name] or 0.0) > budget:
            step_s = c.plan.global_batch / c.simulated_samples_per_s
            caps[name] = max(2 * eval_every, math.ceil(budget / step_s / eval_every) * eval_every)
    return caps


def train_all(cands: Mapping[str, Candidate], cluster: Cluster, cfg: TttConfig,
              trace: tuple[str, ...] = (), max_steps: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Train every candidate to the target in one launch; ``{system: TrainResult}``. Systems
    with the same plan (deepcee's synchronous plan is often the best single island) train once
    and share the result; ``trace``: systems whose runs keep per-action records (timelines);
    ``max_steps``: a system's own step limit (else ``cfg.max_steps``; see :func:`step_caps`)."""
    from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
    from deepcee.runtime.launch import launch_jobs

    out = Path(cfg.out_dir)
    stamp = f"{time.time_ns():x}"
    unique: dict[str, str] = {}  # system -> the system whose run it shares
    for name, c in cands.items():
        unique[name] = next((u for u in dict.fromkeys(unique.values()) if _same_plan(cands[u].plan, c.plan)), name)
    runs = list(dict.fromkeys(unique.values()))
    jobs = [Job(name=f"ttt-{name}-{stamp}", plan=cands[name].plan, cluster=cluster, model=cfg.model,
                config=TrainConfig(steps=(max_steps or {}).get(name, cfg.max_steps), seed=cfg.seed, mode=cfg.mode,
                                   eval_every=cfg.eval_every,
                                   eval_batches=cfg.eval_batches, target_loss=cfg.target_loss, trace=name in trace,
                                   optimizer=OptimizerConfig(name=cfg.optimizer, lr=cfg.lr)),
                run_dir=str(out / "runs" / name)) for name in runs]
    for j in jobs:
        for f in ("metrics.jsonl", "result.json"):
            (Path(j.run_dir) / f).unlink(missing_ok=True)
    # a realnet launch runs one device set in one rank order (its relay's namespaces): one launch
    # per set there; otherwise one launch for all (one start-up)
    groups: dict[Any, list[int]] = {}
    for i, j in enumerate(jobs):
        groups.setdefault(tuple(j.rank_devices()) if cfg.mode == "realnet" else 0, []).append(i)
    got: dict[str, Any] = {}
    for idx in groups.values():
        for i, res in zip(idx, launch_jobs([jobs[i] for i in idx], deadline_s=cfg.deadline_s), strict=True):
            got[runs[i]] = res
    return {name: got[unique[name]] for name in cands}


def host_load() -> dict[str, float]:
    """The machine's load averages and cores: emulated figures hold only while the emulated
    devices get the cores they were given (``DEFAULT_CORES`` of them, PLATFORM.md)."""
    one, five, _ = os.getloadavg()
    return {"load_1m": one, "load_5m": five, "cores": float(os.cpu_count() or 1)}


def busy_warning(before: Mapping[str, float], after: Mapping[str, float], cores_used: float) -> str | None:
    """A line when other work shared the cores during the runs (their pacing then fell behind)."""
    # the runs themselves keep about ``cores_used`` cores busy; anything well above is someone else
    extra = max(before["load_1m"], after["load_1m"] - cores_used)
    if extra > 0.5 * before["cores"]:
        return (f"the machine was busy (load average {before['load_1m']:.1f} before, {after['load_1m']:.1f} after, "
                f"{before['cores']:.0f} cores): emulated devices fall behind their pacing and links look faster "
                "than they are, so measured times are distorted; run again on an idle machine")
    return None


def report(cands: Mapping[str, Candidate], results: Mapping[str, Any], cfg: TttConfig,
           reference_samples: float | None, efficiency_file: str | None,
           host: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON report (see the module docstring)."""
    rows = []
    first_run: dict[str, str] = {}
    for name in cands:
        first_run.setdefault(results[name].run_dir, name)
    # the samples every run that reached the target got to (a capped baseline would pin it low)
    ends = {n: results[n].target.curve[-1].samples for n in cands if results[n].target.curve}
    reached_ends = [v for n, v in ends.items() if results[n].target.reached]
    common = min(reached_ends or ends.values(), default=0)
    for name, c in cands.items():
        res = results[name]
        tgt = res.target
        pred = c.predicted_s(reference_samples)
        # a capped run stopped short of the common samples has no figure there
        short = not tgt.curve or tgt.curve[-1].samples < common
        at_common = None if short else eval_at_samples(tgt.curve, common)
        any_common = None if short else loss_at_samples(tgt, common)
        meas = tgt.reached_at.time_s if tgt.reached_at else None
        rows.append({
            "system": name, "semantics": c.plan.semantics, "strategy": c.plan.strategy.describe(),
            "islands": c.islands, "devices": list(c.plan.devices), "replicas": c.plan.num_replicas,
            "note": "; ".join(x for x in (c.note, "" if first_run[res.run_dir] == name else
                                          f"same plan as {first_run[res.run_dir]}: trained once") if x),
            "simulated_samples_per_s": c.simulated_samples_per_s,
            "measured_samples_per_s": res.samples_per_s, "multiplier": c.multiplier,
            "multiplier_source": c.multiplier_source, "predicted_time_to_target_s": pred,
            "measured_time_to_target_s": meas, "reached": tgt.reached,
            "samples_to_target": tgt.reached_at.samples if tgt.reached_at else None,
            "steps_to_target": tgt.reached_at.steps if tgt.reached_at else None,
            "final_eval_loss": tgt.final_eval_loss,
            "eval_loss_at_common_samples": None if at_common is None else at_common[1],
            "eval_samples_at_common": None if at_common is None else at_common[0],
            # the same with the run's probes of the average ([Note: probe evaluations]), labelled
            "loss_at_common_samples": None if any_common is None else any_common[2],
            "samples_at_common": None if any_common is None else any_common[1],
            "kind_at_common": None if any_common is None else any_common[0],
            "predicted_vs_measured": None if pred is None or meas is None else pred / meas - 1.0,
            "projected_time_to_target_s": _projected(c, res, reference_samples, meas),
            "steps_run": len(res.step_s),
            "curve": [p.to_list() for p in tgt.curve], "probes": [p.to_list() for p in tgt.probes],
            "run_dir": res.run_dir, "clock": tgt.clock,
            "dilation": res.dilation})
    by = {r["system"]: r for r in rows}
    ratio = None
    if by["deepcee-relaxed"]["measured_time_to_target_s"] and by["single-island"]["measured_time_to_target_s"]:
        ratio = by["single-island"]["measured_time_to_target_s"] / by["deepcee-relaxed"]["measured_time_to_target_s"]
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "model": cfg.model, "target_loss": cfg.target_loss,
            "global_batch": cfg.global_batch, "eval_every": cfg.eval_every, "mode": cfg.mode,
            "clock": "emulated seconds (wall / dilation)" if cfg.mode != "real" else "wall seconds",
            "efficiency": efficiency_file or "default (conservative, not measured)",
            "reference_samples_to_target": reference_samples, "common_samples": common,
            "same_samples": same_samples(cands, results),
            "relaxed_vs_single_island_speedup": ratio, "host": dict(host or {}), "systems": rows}


def _projected(c: Candidate, res: Any, reference_samples: float | None, measured: float | None) -> float | None:
    """An exact run stopped by its step cap before the target: the reference's samples to the
    target at the run's measured speed (every exact plan computes the single-process result)."""
    if measured is not None or c.plan.semantics != "exact" or not reference_samples or not res.samples_per_s:
        return None
    return reference_samples / res.samples_per_s


def plot(doc: Mapping[str, Any], path: Path) -> None:
    """``loss_vs_time.png``: evaluation loss against emulated time, one curve per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in doc["systems"]:
        label = f"{r['system']} ({r['semantics']})"
        style = "--" if r["semantics"] == "relaxed" else "-"
        line = a.plot([p[1] for p in r["curve"]], [p[3] for p in r["curve"]], style, marker=".", label=label)[0]
        b.plot([p[2] for p in r["curve"]], [p[3] for p in r["curve"]], style, marker=".", label=label)
        if r.get("probes"):  # probes of the average: hollow, apart from the evaluations
            for ax, x in ((a, 1), (b, 2)):
                ax.plot([p[x] for p in r["probes"]], [p[3] for p in r["probes"]], "o", fillstyle="none", ms=4,
                        color=line.get_color(), label=f"{r['system']}: probes of the average" if ax is a else None)
    for ax in (a, b):
        ax.axhline(doc["target_loss"], color="grey", lw=0.8)
        ax.set_ylabel("evaluation loss")
    a.set_xlabel(f"time ({doc['clock']})")
    b.set_xlabel("samples seen")
    a.set_title(f"{doc['model']}: time to target {doc['target_loss']:g}")
    b.set_title("statistical efficiency")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def efficiency_of(path: str | None) -> tuple[StatisticalEfficiency, float | None]:
    """The efficiency model (calibration file, else the default) and its reference samples."""
    if not path:
        return DefaultEfficiency(), None
    from deepcee.planner.efficiency import load_efficiency

    eff: CalibratedEfficiency = load_efficiency(path)
    ref = None if eff.reference_steps is None or eff.reference_global_batch is None else \
        eff.reference_steps * eff.reference_global_batch
    return eff, ref


QUICK_DEVICES = {"warmup": 1, "repeats": 3, "score_repeats": 2}
"""The main job's device probe budget (ProbeConfig fields): medians of 3 rounds instead of 7."""


def quick_profile(cluster: Cluster, model: str, out: Path) -> Any:
    """Measured devices and links of the emulated cluster, with the main job's quick budget.

    Links are probed at network dilation 1: while links are probed the devices are idle (two
    processes run), so there is no CPU contention for a dilation to absorb, and the emulated
    links deliver by their declared model either way; this makes the probes ~3.75x shorter on
    ``local-small``. Devices keep the launch's dilation (five busy processes on two cores)."""
    from deepcee.profiler.network import NetworkBudget
    from deepcee.profiler.probes import ProbeConfig
    from deepcee.profiler.run import profile_cluster

    budget = NetworkBudget(max_full_ranks=1, min_bytes=256 << 10, max_bytes=1 << 20, growth=4, repeats=2,
                           max_s_per_pair=8.0)
    return profile_cluster(cluster, model, out / "profile", emulated=True, network_budget=budget,
                           device_config=ProbeConfig(**QUICK_DEVICES), network_dilation=1.0, deadline_s=900)


def run(cluster: Cluster, cfg: TttConfig, *, cluster_ref: str, efficiency_file: str | None = None,
        profile: ModelProfile | None = None) -> dict[str, Any]:
    """Profile (unless ``profile`` is given: then plan on it and ``cluster``), plan on the
    measurements, train every system on ``cluster`` to the target; write ``report.json``, the
    plans and ``loss_vs_time.png``."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    planned_on = cluster
    if profile is None:
        prof = quick_profile(cluster, cfg.model, out)
        planned_on, profile = prof.cluster, prof.profile
    t_prof = time.monotonic() - t0
    eff, ref = efficiency_of(efficiency_file)
    cands = candidates(planned_on, profile, cfg.global_batch, cfg.model, cluster_ref, eff).systems
    for name, c in cands.items():
        save_json_atomic(out / f"plan-{name}.json", c.plan.to_dict())
    before = host_load()
    results = train_all(cands, cluster, cfg)
    after = host_load()
    host = {"before": before, "after": after,
            "warning": busy_warning(before, after, DEFAULT_CORES)}
    doc = report(cands, results, cfg, ref, efficiency_file, host)
    doc["timings_s"] = {"profile_and_plan": t_prof, "train": time.monotonic() - t0 - t_prof}
    save_json_atomic(out / "report.json", doc)
    plot(doc, out / "loss_vs_time.png")
    return doc


def format_table(doc: Mapping[str, Any]) -> str:
    """The report as a table (times in the report's clock)."""
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [f"{doc['model']}: target evaluation loss {doc['target_loss']:g}; times in {doc['clock']}; "
             f"multipliers: {doc['efficiency']}",
             f"{'system':16s} {'sync':8s} {'isl':>3s} {'pred s':>8s} {'meas s':>8s} {'pred err':>8s} "
             f"{'samples':>7s} {'final eval':>10s} {'eval@' + str(doc['common_samples']):>12s} {'meas sps':>8s}"]
    for r in doc["systems"]:
        lines.append(f"{r['system']:16s} {r['semantics']:8s} {r['islands']:3d} "
                     f"{f(r['predicted_time_to_target_s'], '8.2f')} {f(r['measured_time_to_target_s'], '8.2f')} "
                     f"{f(r['predicted_vs_measured'], '+8.0%')} {f(r['samples_to_target'], '7d')} "
                     f"{f(r['final_eval_loss'], '10.4f')} {eval_at_common_text(r, doc['common_samples']):>12s} "
                     f"{r['measured_samples_per_s']:8.0f}")
        if r["note"]:
            lines.append(f"  note: {r['note']}")
        if r.get("projected_time_to_target_s") is not None:
            lines.append(f"  not reached: stopped by its step cap after {r['steps_run']} steps (evaluation loss "
                         f"{f(r['final_eval_loss'], '.4f')}); PROJECTED time to target "
                         f"{r['projected_time_to_target_s']:.2f} s = the exact reference's samples at its measured "
                         "samples/s (exact plans need the same samples)")
    if doc.get("host", {}).get("warning"):
        lines.append(f"  WARNING: {doc['host']['warning']}")
    lines.append(f"  deepcee-relaxed: {doc['systems'][0]['strategy']}; multiplier x{doc['systems'][0]['multiplier']:.2f} "
                 f"({doc['systems'][0]['multiplier_source']})")
    sp = doc["relaxed_vs_single_island_speedup"]
    lines.append("relaxed all-island vs best single island (measured time to target): "
                 + ("not both reached" if sp is None else f"{sp:.2f}x"))
    if "same_samples" in doc:
        lines.extend(same_samples_text(doc))
    return "\n".join(lines)


__all__ = ["EVALUATION", "PROBE", "SAME_SAMPLES_TOLERANCE", "SYSTEMS", "TASKS", "Candidate", "Planned", "TttConfig",
           "busy_warning", "candidates", "efficiency_of", "eval_at_common_text", "eval_at_samples", "format_table", "host_load", "loss_at_samples", "plot",
           "quick_profile", "report", "run", "same_samples", "same_samples_text", "step_caps", "train_all"]
