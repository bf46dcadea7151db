"""The main job (``deepcee demo``): cross-region training that pays, judged by time to target.

On the built-in emulated cluster (default ``local-small``: 3 islands, 5 CPU devices, 100
Mbit/s and 20-40 ms between islands; ``--scenario cee-small``: 6 single-device islands, the
cloud a quarter of the compute, the DeepCEE shape) it

1. profiles every emulated device and one link per node pair (quick budget) and groups the
   devices from the measurements;
2. calibrates statistical efficiency: short real runs of model averaging at a few periods H
   against exact training, to the task's target (:mod:`deepcee.calibrate`, mode ``real``:
   samples to target do not depend on timing), so the planner weighs measured multipliers,
   not the conservative default;
3. plans with ``--sync relaxed`` on the measured profile (predicted time to target =
   multiplier x samples to target / simulated samples/s) and prints why;
4. trains four systems for real to the same target evaluation loss ([Note: time-to-target
   systems] in :mod:`deepcee.ttt`): deepcee's relaxed plan with devices in every island,
   synchronous deepcee, the best single island, DDP on every device; links are real TCP
   through the shaping relay (mode ``realnet``) where the host allows it, else emulated
   (mode ``emulated``, whose all-reduce waits for the simulator's own formula), and the report
   says which;
5. reports time to target (predicted and measured), the ratios, final evaluation losses side by
   side (and at the same number of samples), which runs were synchronous and which relaxed,
   ``loss_vs_time.png``, and ``timeline-relaxed.json`` (one traced step window of the relaxed
   run, with the cross-island averages) for Perfetto.

The former main job (samples/s of deepcee vs DDP vs 1F1B over a fixed number of steps) is
``deepcee demo --throughput`` (:mod:`deepcee.demo`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster
from deepcee.errors import SpecError
from deepcee.plan import Plan, save_json_atomic

log = logging.getLogger(__name__)

DEFAULT_PERIODS = (4, 16, 64)
"""Model-averaging periods calibrated by default (the planner's others keep the conservative
default multiplier, or the loosest calibrated one where that is larger)."""
MODES = ("auto", "realnet", "emulated")


@dataclass(frozen=True, slots=True, kw_only=True)
class MainJobConfig:
    """What ``deepcee demo`` runs; the defaults are the no-argument main job."""

    scenario: str = "local-small"
    model: str = "gpt-tiny"
    global_batch: int = 32
    target_loss: float | None = None
    """Default: the task's (:data:`deepcee.ttt.TASKS`)."""
    mode: str = "auto"
    """``auto``: ``realnet`` where the host allows it (root, network namespaces, TUN), else ``emulated``."""
    periods: tuple[int, ...] = DEFAULT_PERIODS
    efficiency_file: str | None = None
    """A ``deepcee calibrate`` JSON to use instead of calibrating."""
    out_dir: str = "reports/demo"
    baseline_cap: float = 4.0
    """Exact systems predicted to need more than this x the fastest prediction train only that
    long (0: no cap); their time to target is projected, labelled (:func:`deepcee.ttt.step_caps`)."""
    seed: int = 0
    deadline_s: float = 900.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SpecError(f"unknown links mode {self.mode!r} (known: {', '.join(MODES)})", field="--links")
        if not (self.baseline_cap == 0 or self.baseline_cap >= 1):
            raise SpecError(f"must be 0 (no cap) or >= 1, got {self.baseline_cap!r}", field="--baseline-cap")
        if not self.periods or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in self.periods):
            raise SpecError(f"need whole periods >= 1, got {self.periods!r}", field="--periods")


def resolve_mode(mode: str) -> tuple[str, str]:
    """The links' mode to train in and why (``auto``: realnet where possible)."""
    if mode == "emulated":
        return "emulated", "asked for (--links emulated)"
    from deepcee.runtime.realnet.netns import realnet_unavailable

    why = realnet_unavailable()
    if why is None:
        return "realnet", "real TCP through the shaping relay (this host allows network namespaces and TUN)"
    if mode == "realnet":
        raise SpecError(f"realnet is not available here: {why}", field="--links")
    return "emulated", f"FALLBACK: realnet unavailable ({why}); links emulated, all-reduce waits for the model"


def relaxed_timeline(result: Any, plan: Plan, cluster: Cluster, *, steps: int = 24) -> dict[str, Any]:
    """Chrome trace (Perfetto) of ``steps`` local steps of the relaxed run (those just before and
    after its first cross-replica exchange): one process per device (named by replica, island and device), compute
    and transfers as recorded by the runtime, and each replica's cross-island average as a
    ``SYNC`` span; emulated seconds."""
    island = {d: name for name, devs in cluster.island_devices().items() for d in devs}
    traced = [m for m in result.metrics if m.trace is not None]
    # the window ends a few steps after the first cross-replica exchange (when there is one)
    first = next((i for i, m in enumerate(traced)
                  if any(a.startswith("SYNC") for acts in m.trace.values() for a, _, _ in acts)), None)
    lo = 0 if first is None else max(0, first + 4 - steps)
    recs = traced[lo:lo + steps]
    events: list[dict[str, Any]] = []
    devices = list(plan.devices)
    for pid, dev in enumerate(devices):
        rep = next((r for r, rp in enumerate(plan.replicas) if dev in rp.devices), 0)
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"replica {rep} {island.get(dev, '?')} {dev}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    t0 = min((t for m in recs for acts in m.trace.values() for _, t, _ in acts), default=0.0)
    cross = 0
    for m in recs:
        for dev, acts in m.trace.items():
            if dev not in devices:
                continue
            for action, start, end in acts:
                sync = action.startswith("SYNC")
                comm = sync or "SEND" in action or "RECV" in action
                cross += sync
                events.append({"ph": "X", "name": action, "pid": devices.index(dev), "tid": 1 if comm else 0,
                               "ts": (start - t0) * 1e6, "dur": max(0.0, end - start) * 1e6,
                               "cat": "cross-island" if sync else "comm" if comm else "compute",
                               "args": {"step": m.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": f"measured relaxed run ({result.mode}), local steps {recs[0].step if recs else 0}-"
                                    f"{recs[-1].step if recs else 0}, "
                                    "times divided by the dilation", "cross_island_spans": cross}}


@contextmanager
def _progress(label: str, run_dirs: Callable[[], Sequence[Path]]) -> Iterator[None]:
    """A live line while long work runs: steps recorded so far in ``run_dirs``' metrics, elapsed time."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from deepcee.demo import watch_progress

    stop = threading.Event()
    with Progress(SpinnerColumn(), TextColumn(f"    {label}: {{task.completed}} steps recorded"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(label, total=None)
        watcher = threading.Thread(target=watch_progress, daemon=True,
                                   args=(list(run_dirs()), 10**9, lambda n: bar.update(task, completed=n), stop))
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()


def _say_table(say: Callable[[str], None], lines: Sequence[str]) -> None:
    for line in lines:
        say(f"    {line}")


def run_main_job(cfg: MainJobConfig | None = None, *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the main job (see the module docstring); write the report folder; return the report."""
    from deepcee import ttt
    from deepcee.calibrate import CalibrationConfig, calibrate
    from deepcee.planner.replicas import RelaxedOptions
    from deepcee.scenarios import load_scenario

    cfg = cfg or MainJobConfig()
    if cfg.model not in ttt.TASKS:
        raise SpecError(f"no time-to-target task for {cfg.model!r} (known: {', '.join(ttt.TASKS)})", field="--model")
    task = ttt.TASKS[cfg.model]
    target = cfg.target_loss if cfg.target_loss is not None else task["target_loss"]
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cluster = load_scenario(cfg.scenario)
    mode, mode_why = resolve_mode(cfg.mode)
    timings: dict[str, float] = {}
    say(f"cluster {cluster.name}: {cluster.description}")
    say(f"emulation: {cluster.emulation}")
    say(f"task: {cfg.model}, global batch {cfg.global_batch}, AdamW lr {task['lr']:g}, to evaluation loss {target:g} "
        f"(held-out data, every {task['eval_every']} steps)")
    say(f"links while training: {mode}: {mode_why}")

    t = time.monotonic()
    say("1/4 profiling every device (per-layer F/I/W) and one link per node pair ...")
    prof = ttt.quick_profile(cluster, cfg.model, out)
    timings["profile_s"] = time.monotonic() - t
    say(f"    measured in {timings['profile_s']:.0f} s; files in {out / 'profile'}")
    _say_table(say, prof.grouping.explain())

    t = time.monotonic()
    eff_file = cfg.efficiency_file
    if eff_file is None:
        say(f"2/4 calibrating statistical efficiency: model averaging H = {', '.join(map(str, cfg.periods))} vs "
            f"exact training, each to loss {target:g} (mode real: samples to target do not depend on timing) ...")
        ccfg = CalibrationConfig(model=cfg.model, global_batch=cfg.global_batch, target_loss=target,
                                 eval_every=task["eval_every"], max_steps=task["max_steps"], periods=cfg.periods,
                                 lr=task["lr"], seed=cfg.seed, out_dir=str(out / "calibrate"),
                                 deadline_s=cfg.deadline_s)
        names = ["reference", *(f"average-H{h}" for h in cfg.periods)]
        with _progress("calibrating", lambda: [out / "calibrate" / n for n in names]):
            doc = calibrate(prof.cluster, prof.profile, ccfg, cluster_ref=cfg.scenario)
        eff_file = str(out / "calibrate" / "efficiency.json")
        ref = doc["reference"]
        say(f"    exact: {ref['samples_to_target']} samples ({ref['steps_to_target']} steps); " + ", ".join(
            f"H={e['strategy']['period']} x{e['multiplier']:.2f}{'' if e['reached'] else ' (not reached: at least)'}"
            for e in doc["entries"]) + f" (measured in {time.monotonic() - t:.0f} s)")
    else:
        say(f"2/4 statistical efficiency from {eff_file} (not re-measured)")
    timings["calibrate_s"] = time.monotonic() - t

    t = time.monotonic()
    eff, ref_samples = ttt.efficiency_of(eff_file)
    # model averaging within what was measured: the calibrated periods, plain blocking averaging (other
    # settings would be judged by the conservative default, which a run may contradict: convnet-tiny's
    # H=256 with the outer Nesterov step, default x2.20, did not reach the target in 800 steps)
    options = None if cfg.efficiency_file else RelaxedOptions(periods=cfg.periods, outer_optimizers=("average",),
                                                              overlaps=(False,))
    planned = ttt.candidates(prof.cluster, prof.profile, cfg.global_batch, cfg.model, cfg.scenario, eff, options)
    timings["plan_s"] = time.monotonic() - t
    cands = planned.systems
    say(f"3/4 planned with --sync relaxed in {timings['plan_s']:.1f} s (predicted time to target = multiplier x "
        "samples to target / simulated samples/s):")
    _say_table(say, planned.explanation)
    for name, c in cands.items():
        save_json_atomic(out / f"plan-{name}.json", c.plan.to_dict())
    save_json_atomic(out / "plan-deepcee.json", planned.planner_choice.to_dict())

    t = time.monotonic()
    say(f"4/4 training every system to evaluation loss {target:g} (one process per emulated device, links {mode}) ...")
    tcfg = ttt.TttConfig(model=cfg.model, global_batch=cfg.global_batch, target_loss=target,
                         eval_every=task["eval_every"], max_steps=task["max_steps"], lr=task["lr"], seed=cfg.seed,
                         mode=mode, out_dir=str(out), deadline_s=cfg.deadline_s)
    caps = {} if not cfg.baseline_cap else ttt.step_caps(cands, ref_samples, cfg.baseline_cap, task["eval_every"])
    for name, n in caps.items():
        say(f"    {name}: predicted {cands[name].predicted_s(ref_samples):.1f} s to the target, over "
            f"{cfg.baseline_cap:g}x the fastest prediction: capped at {n} steps (its time to target is then "
            "projected from its measured samples/s, labelled)")
    before = ttt.host_load()
    with _progress("training", lambda: [out / "runs" / n for n in cands]):
        results = ttt.train_all(cands, cluster, tcfg, trace=("deepcee-relaxed",), max_steps=caps)
    after = ttt.host_load()
    timings["train_s"] = time.monotonic() - t
    host = {"before": before, "after": after, "warning": ttt.busy_warning(before, after, _cores(results))}
    report = ttt.report(cands, results, tcfg, ref_samples, eff_file, host)
    report.update({"links": {"mode": mode, "why": mode_why}, "timings_s": timings,
                   "planner_explanation": list(planned.explanation),
                   "planner_choice": planned.planner_choice.strategy.describe()})
    relaxed = results["deepcee-relaxed"]
    save_json_atomic(out / "timeline-relaxed.json", relaxed_timeline(relaxed, cands["deepcee-relaxed"].plan, cluster))
    ttt.plot(report, out / "loss_vs_time.png")
    report["files"] = {"report": str(out / "report.json"), "loss_vs_time": str(out / "loss_vs_time.png"),
                       "timeline": str(out / "timeline-relaxed.json"), "profile": str(out / "profile"),
                       "efficiency": eff_file}
    save_json_atomic(out / "report.json", report)
    return report


def _cores(results: Mapping[str, Any]) -> float:
    """Cores the runs' paced devices were given (the launch's emulation record)."""
    return max((r.emulation.cores for r in results.values()), default=1.0)


def format_report(doc: Mapping[str, Any]) -> str:
    """The closing table: time to target per system, ratios, losses side by side, labels."""
    from deepcee import ttt

    by = {r["system"]: r for r in doc["systems"]}
    lines = ["", ttt.format_table(doc)]
    ours = by["deepcee-relaxed"]["measured_time_to_target_s"]
    for other in ("deepcee-sync", "single-island", "ddp-all"):
        theirs = by[other]["measured_time_to_target_s"]
        projected = by[other].get("projected_time_to_target_s")
        if ours and theirs is None and projected:
            lines.append(f"deepcee relaxed (every island) vs {other}: {projected / ours:.2f}x faster to the target "
                         f"(against {other}'s PROJECTED time: it was stopped by its step cap)")
        if ours and theirs:
            lines.append(f"deepcee relaxed (every island) vs {other}: {theirs / ours:.2f}x faster to the target "
                         "(measured)" if theirs >= ours else
                         f"deepcee relaxed (every island) vs {other}: {ours / theirs:.2f}x SLOWER to the target "
                         "(measured)")
    lines.append("final evaluation loss (each run stops at its first evaluation at or below the target; relaxed runs "
                 "evaluate right after an average): " + ", ".join(
                     f"{r['system']} {r['final_eval_loss']:.4f}" for r in doc["systems"]
                     if r["final_eval_loss"] is not None))
    lines.append(f"evaluation loss at {doc['common_samples']} samples (every run got there; loss@N: its last "
                 "evaluation was at N samples, a relaxed run evaluates only after an average; a trailing p: a probe "
                 "of the average, the model the replicas would hold had they averaged there): " + ", ".join(
        f"{r['system']} {ttt.eval_at_common_text(r, doc['common_samples'])}" for r in doc["systems"]
        if r.get("loss_at_common_samples", r["eval_loss_at_common_samples"]) is not None))
    lines.append(f"planner's own choice (deepcee plan --sync relaxed): {doc['planner_choice']}")
    lines.append(f"links: {doc['links']['mode']}: {doc['links']['why']}")
    lines.append("devices: emulated (CPU time x slowdown x D, one process each); times are emulated seconds "
                 "(wall / D); 'sync' says which runs were synchronous (exact: the single-process result every "
                 "step) and which relaxed")
    if doc["host"].get("warning"):
        lines.append(f"WARNING: {doc['host']['warning']}")
    lines.append("timings: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in doc["timings_s"].items()))
    lines.append("wrote " + ", ".join(v for v in doc["files"].values()))
    return "\n".join(lines)


__all__ = ["DEFAULT_PERIODS", "MainJobConfig", "format_report", "relaxed_timeline", "resolve_mode", "run_main_job"]
