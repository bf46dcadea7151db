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
   (and at the same number of samples), which runs were synchronous and which relaxed, and
   ``loss_vs_time.png``.

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


def candidates(cluster: Cluster, profile: ModelProfile, global_batch: int, model: str, cluster_ref: str,
               efficiency: StatisticalEfficiency) -> dict[str, Candidate]:
    """The four systems' plans and predictions ([Note: time-to-target systems])."""
    from deepcee.planner.baselines import build_baselines
    from deepcee.planner.replicas import plan_replicas
    from deepcee.planner.search import plan_training
    from deepcee.simulator.engine import simulate

    def exact(system: str, plan: Plan, c: Cluster = cluster, note: str = "") -> Candidate:
        plan = plan.replace(cluster=cluster_ref, model=model, system=system)
        return Candidate(system=system, plan=plan, simulated_samples_per_s=simulate(plan, c, profile,
                                                                                    record=False).samples_per_s,
                         multiplier=1.0, multiplier_source=efficiency.source(plan),
                         islands=_islands_used(cluster, plan), note=note)

    out: dict[str, Candidate] = {}
    sync = plan_training(cluster, profile, global_batch).plan
    res = plan_replicas(cluster, profile, global_batch, efficiency=efficiency, exact_plan=sync)
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
    return out


def train_all(cands: Mapping[str, Candidate], cluster: Cluster, cfg: TttConfig) -> dict[str, Any]:
    """Train every candidate to the target in one launch; ``{system: TrainResult}``."""
    from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
    from deepcee.runtime.launch import launch_jobs

    out = Path(cfg.out_dir)
    stamp = f"{time.time_ns():x}"
    jobs = [Job(name=f"ttt-{name}-{stamp}", plan=c.plan, cluster=cluster, model=cfg.model,
                config=TrainConfig(steps=cfg.max_steps, seed=cfg.seed, mode=cfg.mode, eval_every=cfg.eval_every,
                                   eval_batches=cfg.eval_batches, target_loss=cfg.target_loss,
                                   optimizer=OptimizerConfig(name=cfg.optimizer, lr=cfg.lr)),
                run_dir=str(out / "runs" / name)) for name, c in cands.items()]
    for j in jobs:
        for f in ("metrics.jsonl", "result.json"):
            (Path(j.run_dir) / f).unlink(missing_ok=True)
    return dict(zip(cands, launch_jobs(jobs, deadline_s=cfg.deadline_s), strict=True))


def eval_at_samples(curve: Any, samples: int) -> float | None:
    """The last evaluation loss at or before ``samples`` samples (``None``: none yet)."""
    pts = [p for p in curve if p.samples <= samples]
    return pts[-1].eval_loss if pts else None


def report(cands: Mapping[str, Candidate], results: Mapping[str, Any], cfg: TttConfig,
           reference_samples: float | None, efficiency_file: str | None) -> dict[str, Any]:
    """The JSON report (see the module docstring)."""
    rows = []
    common = min((results[n].target.curve[-1].samples for n in cands if results[n].target.curve), default=0)
    for name, c in cands.items():
        res = results[name]
        tgt = res.target
        pred = c.predicted_s(reference_samples)
        meas = tgt.reached_at.time_s if tgt.reached_at else None
        rows.append({
            "system": name, "semantics": c.plan.semantics, "strategy": c.plan.strategy.describe(),
            "islands": c.islands, "devices": list(c.plan.devices), "replicas": c.plan.num_replicas,
            "note": c.note, "simulated_samples_per_s": c.simulated_samples_per_s,
            "measured_samples_per_s": res.samples_per_s, "multiplier": c.multiplier,
            "multiplier_source": c.multiplier_source, "predicted_time_to_target_s": pred,
            "measured_time_to_target_s": meas, "reached": tgt.reached,
            "samples_to_target": tgt.reached_at.samples if tgt.reached_at else None,
            "steps_to_target": tgt.reached_at.steps if tgt.reached_at else None,
            "final_eval_loss": tgt.final_eval_loss, "eval_loss_at_common_samples": eval_at_samples(tgt.curve, common),
            "predicted_vs_measured": None if pred is None or meas is None else pred / meas - 1.0,
            "curve": [p.to_list() for p in tgt.curve], "run_dir": res.run_dir, "clock": tgt.clock,
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
            "relaxed_vs_single_island_speedup": ratio, "systems": rows}


def plot(doc: Mapping[str, Any], path: Path) -> None:
    """``loss_vs_time.png``: evaluation loss against emulated time, one curve per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in doc["systems"]:
        label = f"{r['system']} ({r['semantics']})"
        style = "--" if r["semantics"] == "relaxed" else "-"
        a.plot([p[1] for p in r["curve"]], [p[3] for p in r["curve"]], style, marker=".", label=label)
        b.plot([p[2] for p in r["curve"]], [p[3] for p in r["curve"]], style, marker=".", label=label)
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


def quick_profile(cluster: Cluster, model: str, out: Path) -> Any:
    """Measured devices and links of the emulated cluster, with the main job's quick budget."""
    from deepcee.profiler.network import NetworkBudget
    from deepcee.profiler.run import profile_cluster

    budget = NetworkBudget(max_full_ranks=1, min_bytes=256 << 10, max_bytes=1 << 20, growth=4, repeats=2,
                           max_s_per_pair=8.0)
    return profile_cluster(cluster, model, out / "profile", emulated=True, network_budget=budget, deadline_s=900)


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
    cands = candidates(planned_on, profile, cfg.global_batch, cfg.model, cluster_ref, eff)
    for name, c in cands.items():
        save_json_atomic(out / f"plan-{name}.json", c.plan.to_dict())
    results = train_all(cands, cluster, cfg)
    doc = report(cands, results, cfg, ref, efficiency_file)
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
             f"{'samples':>7s} {'final eval':>10s} {'eval@' + str(doc['common_samples']):>10s} {'meas sps':>8s}"]
    for r in doc["systems"]:
        lines.append(f"{r['system']:16s} {r['semantics']:8s} {r['islands']:3d} "
                     f"{f(r['predicted_time_to_target_s'], '8.2f')} {f(r['measured_time_to_target_s'], '8.2f')} "
                     f"{f(r['predicted_vs_measured'], '+8.0%')} {f(r['samples_to_target'], '7d')} "
                     f"{f(r['final_eval_loss'], '10.4f')} {f(r['eval_loss_at_common_samples'], '10.4f')} "
                     f"{r['measured_samples_per_s']:8.0f}")
        if r["note"]:
            lines.append(f"  note: {r['note']}")
    lines.append(f"  deepcee-relaxed: {doc['systems'][0]['strategy']}; multiplier x{doc['systems'][0]['multiplier']:.2f} "
                 f"({doc['systems'][0]['multiplier_source']})")
    sp = doc["relaxed_vs_single_island_speedup"]
    lines.append("relaxed all-island vs best single island (measured time to target): "
                 + ("not both reached" if sp is None else f"{sp:.2f}x"))
    return "\n".join(lines)


__all__ = ["SYSTEMS", "TASKS", "Candidate", "quick_profile", "TttConfig", "candidates", "efficiency_of", "format_table", "plot", "report", "run",
           "train_all"]
