"""``deepcee calibrate``: measure the statistical efficiency of relaxed strategies by short runs.

The planner ranks relaxed plans by predicted time to target = multiplier x samples to target
/ samples per second (:mod:`deepcee.planner.efficiency`). This measures the multiplier: it
trains the model for real to a target evaluation loss ([Note: time to target] in
:mod:`deepcee.runtime.target`), once with exact synchronous training (the reference) and once
per relaxed setting, all at the same global batch, and writes the ``deepcee.efficiency`` JSON
the planner reads (``deepcee plan --sync relaxed --efficiency FILE``; format in
docs/file-formats.md). ``multiplier = samples to target (setting) / samples to target (exact)``.

[Note: calibration runs]
- The replica layout is the one the relaxed planner would use on the cluster (its best
  ``model-averaging`` candidate: which devices form which replica, and each replica's batch);
  only the strategy's setting varies. The reference is exact training of the same global batch
  on one device: every exact plan computes the single-process result, so its samples to target
  are those of any exact plan.
- Samples to target do not depend on timing for exact training and model averaging (the
  averages are deterministic: [Note: deterministic averaging] in :mod:`deepcee.runtime.replicas`),
  so the runs use mode ``real`` (no pacing): they take as long as the CPU needs, not the
  emulated cluster's time.
- Only ``model-averaging`` is calibrated (plain and outer Nesterov, each period H asked for,
  blocking and/or overlapped: ``overlaps``; an overlapped run evaluates the anchor, the model
  every replica knows at a sync point, which lags one period: [Note: overlapped averaging] in
  :mod:`deepcee.runtime.overlap`):
  evaluating needs every replica to hold the same model at one step, which ASGD-GA and partial
  averaging never give (:func:`deepcee.runtime.strategies.check_relaxed`). The planner keeps
  the conservative default for them and says so.
- The loss is evaluated every ``eval_every`` steps (relaxed runs: right after the first average
  at or after each multiple), so samples to target are measured to that granularity. A setting
  that does not reach the target within ``max_steps`` is written with ``"reached": false`` and
  the multiplier it had at least (samples run / reference samples): a lower bound, never a
  figure it did not see.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster
from deepcee.errors import DeepceeError, SpecError
from deepcee.plan import Plan, StagePlan, Strategy, save_json_atomic
from deepcee.planner.efficiency import FORMAT, SCHEMA_VERSION
from deepcee.profile import ModelProfile

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationConfig:
    """What ``deepcee calibrate`` runs. See [Note: calibration runs]."""

    model: str
    global_batch: int
    target_loss: float
    eval_every: int = 10
    max_steps: int = 600
    periods: tuple[int, ...] = (4, 16)
    outer_optimizers: tuple[str, ...] = ("average",)
    overlaps: tuple[bool, ...] = (False,)
    """Blocking (``False``) and/or overlapped (``True``) averaging."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    optimizer: str = "adamw"
    lr: float = 1e-3
    seed: int = 0
    eval_batches: int = 4
    out_dir: str = "reports/calibrate"
    deadline_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.eval_every < 1 or self.max_steps < 1:
            raise SpecError(f"global_batch, eval_every and max_steps must be >= 1, got {self.global_batch}, "
                            f"{self.eval_every}, {self.max_steps}")
        if not self.periods or any(p < 1 for p in self.periods):
            raise SpecError(f"must be periods >= 1, got {self.periods!r}", field="periods")
        for o in self.outer_optimizers:
            if o not in ("average", "nesterov"):
                raise SpecError(f"must be average or nesterov, got {o!r}", field="outer_optimizers")
        if not self.overlaps or any(not isinstance(o, bool) for o in self.overlaps):
            raise SpecError(f"must be true and/or false, got {self.overlaps!r}", field="overlaps")


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationRun:
    """One measured run: the strategy, whether it reached the target, samples and steps."""

    strategy: Strategy
    reached: bool
    samples: int
    """Samples to the target (reached), else the samples the run trained on."""
    steps: int
    final_eval_loss: float | None
    wall_s: float
    """Wall seconds of the run's training steps (mode ``real``; evaluations and start-up not counted)."""


def layout_plan(cluster: Cluster, profile: ModelProfile, global_batch: int, cluster_ref: str, model: str) -> Plan:
    """The relaxed planner's best model-averaging layout on ``cluster`` (its strategy is replaced per run)."""
    from deepcee.planner.replicas import plan_replicas

    res = plan_replicas(cluster, profile, global_batch)
    cands = [s for s in res.candidates if s.plan.strategy.kind == "model-averaging"]
    if not cands:
        raise DeepceeError(f"the relaxed planner found no model-averaging layout for {model} on {cluster.name}")
    return cands[0].plan.replace(cluster=cluster_ref, model=model, estimate=None, explanation=())


def reference_plan(layout: Plan) -> Plan:
    """Exact training of the same global batch on the layout's first device (one stage, one microbatch)."""
    from deepcee.nets import block_names

    n = len(block_names(layout.model))
    dev = layout.replicas[0].stages[0].devices[0]
    return Plan(system="calibration-reference", cluster=layout.cluster, model=layout.model,
                global_batch=layout.global_batch, microbatch_size=layout.global_batch, num_microbatches=1,
                schedule="gpipe", stages=(StagePlan(layer_start=0, layer_stop=n, devices=(dev,),
                                                    shares=(layout.global_batch,)),))


def settings(cfg: CalibrationConfig) -> list[Strategy]:
    return [Strategy(kind="model-averaging", period=h, outer_optimizer=o, outer_lr=cfg.outer_lr,
                     outer_momentum=cfg.outer_momentum, overlap=v)
            for v in cfg.overlaps for o in cfg.outer_optimizers for h in cfg.periods]


def setting_name(s: Strategy) -> str:
    """The run folder of a setting: ``average-H16``, ``nesterov-H4-overlap``."""
    return f"{s.outer_optimizer}-H{s.period}" + ("-overlap" if s.overlap else "")


def _job(plan: Plan, cluster: Cluster, cfg: CalibrationConfig, run_dir: Path) -> Any:
    from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig

    for f in ("metrics.jsonl", "result.json"):
        (run_dir / f).unlink(missing_ok=True)
    return Job(name=f"calibrate-{run_dir.name}-{time.time_ns():x}", plan=plan, cluster=cluster, model=plan.model,
               config=TrainConfig(steps=cfg.max_steps, seed=cfg.seed, mode="real", eval_every=cfg.eval_every,
                                  eval_batches=cfg.eval_batches, target_loss=cfg.target_loss,
                                  probes=False,  # samples to target are judged at evaluations only
                                  optimizer=OptimizerConfig(name=cfg.optimizer, lr=cfg.lr)),
               run_dir=str(run_dir))


def _outcome(plan: Plan, res: Any, run_dir: Path) -> CalibrationRun:
    tgt = res.target
    if tgt is None or not tgt.curve:
        raise DeepceeError(f"calibration run {run_dir} has no evaluations")
    at = tgt.reached_at or tgt.curve[-1]
    return CalibrationRun(strategy=plan.strategy, reached=tgt.reached_at is not None, samples=at.samples,
                          steps=at.steps, final_eval_loss=tgt.final_eval_loss, wall_s=float(sum(res.step_s)))


def calibrate(cluster: Cluster, profile: ModelProfile, cfg: CalibrationConfig, *, cluster_ref: str,
              ) -> dict[str, Any]:
    """Run the reference and every setting; write and return the ``deepcee.efficiency`` JSON.

    All runs share one launch (one set of processes, started once: on a small machine the
    start-up of the processes costs more than a short run)."""
    from deepcee.runtime.launch import launch_jobs

    out = Path(cfg.out_dir)
    layout = layout_plan(cluster, profile, cfg.global_batch, cluster_ref, cfg.model)
    plans = {"reference": reference_plan(layout)}
    plans.update({setting_name(s): layout.replace(strategy=s) for s in settings(cfg)})
    jobs = [_job(plan, cluster, cfg, out / name) for name, plan in plans.items()]
    results = launch_jobs(jobs, deadline_s=cfg.deadline_s * len(jobs))
    outcomes = {name: _outcome(plan, res, out / name)
                for (name, plan), res in zip(plans.items(), results, strict=True)}
    ref = outcomes.pop("reference")
    if not ref.reached:
        raise DeepceeError(f"exact training did not reach target loss {cfg.target_loss:g} within {cfg.max_steps} "
                           f"steps (last evaluation loss {ref.final_eval_loss:.4f}): raise --steps or the target")
    log.info("reference: %d samples (%d steps) to %g", ref.samples, ref.steps, cfg.target_loss)
    for name, r in outcomes.items():
        log.info("%s: %s %d samples", name, "reached in" if r.reached else "NOT reached in", r.samples)
    doc = efficiency_document(cfg, layout, ref, list(outcomes.values()))
    save_json_atomic(out / "efficiency.json", doc)
    return doc


def efficiency_document(cfg: CalibrationConfig, layout: Plan, ref: CalibrationRun,
                        runs: Sequence[CalibrationRun]) -> dict[str, Any]:
    """The ``deepcee.efficiency`` JSON of measured runs (docs/file-formats.md)."""
    replicas = " | ".join("+".join(d for st in r.stages for d in st.devices) + f" (batch {r.batch})"
                          for r in layout.replicas)
    entries = [{"strategy": r.strategy.to_dict(), "multiplier": r.samples / ref.samples, "replicas":
                layout.num_replicas, "reached": r.reached, "samples_to_target": r.samples, "steps": r.steps,
                "final_eval_loss": r.final_eval_loss, "wall_s": r.wall_s} for r in runs]
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "model": cfg.model, "target_loss": cfg.target_loss,
            "source": (f"deepcee calibrate: runs to evaluation loss {cfg.target_loss:g} (every {cfg.eval_every} "
                       f"steps, {cfg.eval_batches} held-out batches), {cfg.optimizer} lr {cfg.lr:g}, seed {cfg.seed}; "
                       f"replicas {replicas}; entries with reached=false are lower bounds"),
            "reference": {"global_batch": cfg.global_batch, "steps_to_target": ref.steps,
                          "samples_to_target": ref.samples, "wall_s": ref.wall_s},
            "entries": entries}


__all__ = ["CalibrationConfig", "CalibrationRun", "calibrate", "efficiency_document", "layout_plan", "reference_plan",
           "setting_name", "settings"]
