"""The main job: profile -> group -> plan -> train, on the built-in small emulated cluster.

``deepcee demo`` (no arguments) emulates the ``local-small`` cluster (3 islands, 5 CPU devices,
one 2x slower, 100 Mbit/s and 20-40 ms between islands) on this machine, then

1. profiles every emulated device (per-layer F/I/W times of the model) and a sample of the
   links (one pair per node pair),
2. groups the devices from those measurements (islands by link cost, groups by speed),
3. plans with deepcee and builds two baselines (DDP on all devices, 1F1B with an even split),
4. trains the model for real with all three plans (one process per device, gloo), and
5. reports measured samples/s, ratios, loss curves, simulated vs measured iteration time, and
   which figures are emulated, into a report folder (JSON, PNG plots, a Chrome-trace timeline
   of the real deepcee run).

Needs torch. Runs in a few minutes on a 2-core machine without GPU.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster
from deepcee.errors import DeepceeError
from deepcee.plan import Plan, save_json_atomic
from deepcee.profile import ModelProfile
from deepcee.runtime.records import StepMetrics

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SYSTEMS = ("deepcee", "ddp", "1f1b-even")
PARTLY_MODELLED = ("partly modelled: in mode emulated the runtime's gradient all-reduce waits for deepcee.comm's "
                   "all-reduce formula and the link shaper delivers after its serialisation, so measured and "
                   "simulated agree partly by construction (most of all for ddp, whose step is mostly that "
                   "all-reduce); `deepcee validate --mode realnet` measures real TCP and gloo collectives")


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """What the demo runs. Defaults are the no-argument main job."""

    scenario: str = "local-small"
    model: str = "gpt-tiny"
    global_batch: int = 32
    steps: int = 20
    """Training steps per system (the first is warm-up and excluded from samples/s)."""
    out_dir: str = "reports/demo"
    seed: int = 0
    quick_profile: bool = True
    """Probe one device pair per node pair with a small budget (the links of a node pair share
    one pipe, see [Note: link resources]); False probes every pair with the full budget."""
    deadline_s: float = 900.0

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.steps < 2:
            raise DeepceeError(f"demo needs global_batch >= 1 and steps >= 2, got {self.global_batch}, {self.steps}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemRun:
    system: str
    plan: Plan
    losses: tuple[float, ...]
    step_s: tuple[float, ...]
    measured_samples_per_s: float
    measured_iteration_s: float
    simulated_iteration_s: float
    simulated_samples_per_s: float

    @property
    def sim_error(self) -> float:
        return self.simulated_iteration_s / self.measured_iteration_s - 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoReport:
    config: DemoConfig
    runs: tuple[SystemRun, ...]
    emulation: dict[str, Any]
    grouping: tuple[str, ...]
    explanation: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)

    def run(self, system: str) -> SystemRun:
        return next(r for r in self.runs if r.system == system)

    def to_dict(self) -> dict[str, Any]:
        ours = self.run("deepcee")
        return {
            "schema_version": SCHEMA_VERSION,
            "format": "deepcee.demo",
            "config": {k: getattr(self.config, k) for k in self.config.__dataclass_fields__},
            "emulation": self.emulation,
            "figures": {
                "measured_samples_per_s": "measured on this machine under emulation, divided back by the dilation",
                "measured_partly_modelled": PARTLY_MODELLED,
                "simulated": "simulated on the measured profile and cluster (declared links, which the runtime's "
                             "link shaper emulates), as deepcee's runtime runs a plan in mode emulated",
            },
            "systems": [
                {
                    "system": r.system,
                    "plan": r.plan.to_dict(),
                    "losses": list(r.losses),
                    "step_s": list(r.step_s),
                    "measured_samples_per_s": r.measured_samples_per_s,
                    "measured_iteration_s": r.measured_iteration_s,
                    "simulated_iteration_s": r.simulated_iteration_s,
                    "simulated_samples_per_s": r.simulated_samples_per_s,
                    "simulated_vs_measured": r.sim_error,
                    "deepcee_speedup": ours.measured_samples_per_s / r.measured_samples_per_s,
                }
                for r in self.runs
            ],
            "grouping": list(self.grouping),
            "explanation": list(self.explanation),
            "files": self.files,
            "timings_s": self.timings_s,
        }


# ---------------------------------------------------------------------------------------


def watch_progress(run_dirs: Sequence[Path], steps: int, update: Callable[[int], None],
                    stop: threading.Event) -> None:
    """Poll the runs' metrics files and report the total number of finished steps."""
    while not stop.wait(0.5):
        done = 0
        for d in run_dirs:
            f = d / "metrics.jsonl"
            if f.exists():
                done += sum(1 for line in f.read_text().splitlines() if line.strip())
        update(min(done, steps * len(run_dirs)))


def _profile(cfg: DemoConfig, cluster: Cluster, out: Path):
    from deepcee.profiler.network import NetworkBudget
    from deepcee.profiler.run import profile_cluster

    # Quick: one pair per node pair, two message sizes large enough to resolve a 100 Mbit/s
    # link's bandwidth (small messages only see its latency), two repeats each.
    budget = (NetworkBudget(max_full_ranks=1, min_bytes=256 << 10, max_bytes=1 << 20, growth=4, repeats=2,
                            max_s_per_pair=8.0) if cfg.quick_profile else None)
    return profile_cluster(cluster, cfg.model, out / "profile", emulated=True, network_budget=budget,
                           deadline_s=cfg.deadline_s)


def _plans(cluster: Cluster, profile: ModelProfile, global_batch: int) -> tuple[dict[str, Plan], tuple[str, ...]]:
    from deepcee.planner.baselines import build_baselines
    from deepcee.planner.search import plan_training

    result = plan_training(cluster, profile, global_batch)
    plans = {"deepcee": result.plan}
    for b in build_baselines(cluster, profile, global_batch):
        if b.name in SYSTEMS:
            if b.plan is None:
                raise DeepceeError(f"baseline {b.name} has no plan: {b.reason}")
            plans[b.name] = b.plan
    return plans, result.explanation


def real_run_trace(metrics: Sequence[StepMetrics], plan: Plan, *, step: int | None = None) -> dict[str, Any]:
    """Chrome trace of one step of a real run (the runtime's per-action records, emulated
    seconds) for Perfetto: one process per device, sorted by stage."""
    recs = [m for m in metrics if m.trace is not None]
    if not recs:
        return {"traceEvents": []}
    rec = recs[-1] if step is None else next(m for m in recs if m.step == step)
    events: list[dict[str, Any]] = []
    t0 = min((t for acts in rec.trace.values() for _, t, _ in acts), default=0.0)
    for pid, dev in enumerate(plan.devices):
        stage = plan.stage_of(dev)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"s{stage} {dev}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for action, start, end in rec.trace.get(dev, ()):
            comm = "SEND" in action or "RECV" in action
            events.append({"ph": "X", "name": action, "pid": pid, "tid": 1 if comm else 0,
                           "ts": (start - t0) * 1e6, "dur": max(0.0, end - start) * 1e6,
                           "cat": "comm" if comm else "compute"})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "measured real run (emulated devices and links), step "
                          f"{rec.step}, times divided by the dilation"}}


def _plot(report: DemoReport, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    fig, ax = plt.subplots(figsize=(7, 4))
    gb = report.config.global_batch
    for r in report.runs:
        ax.plot([gb * (i + 1) for i in range(len(r.losses))], r.losses, label=r.system, marker=".")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("training loss")
    ax.set_title(f"{report.config.model} on {report.config.scenario}: loss (synchronous: same curve)")
    ax.legend()
    fig.tight_layout()
    files["loss_png"] = str(out / "loss.png")
    fig.savefig(files["loss_png"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r.system for r in report.runs]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r.measured_samples_per_s for r in report.runs], width=0.4,
           label="measured (emulated devices and links)")
    ax.bar([i + 0.2 for i in x], [r.simulated_samples_per_s for r in report.runs], width=0.4,
           label="simulated (measured profile)")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("samples/s")
    ax.set_title(f"throughput, dilation D = {report.emulation.get('dilation', 1):.2f} (times divided by D)")
    ax.legend()
    fig.tight_layout()
    files["throughput_png"] = str(out / "throughput.png")
    fig.savefig(files["throughput_png"], dpi=110)
    plt.close(fig)
    return files


def run_demo(cfg: DemoConfig | None = None, *, say: Callable[[str], None] = print) -> DemoReport:
    """Run the whole demo and write the report folder. ``say`` receives progress lines."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from deepcee.profiler.fidelity import emulated_view, predict
    from deepcee.runtime.job import Job, TrainConfig
    from deepcee.runtime.launch import launch_jobs
    from deepcee.scenarios import load_scenario

    cfg = cfg or DemoConfig()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cluster = load_scenario(cfg.scenario)
    timings: dict[str, float] = {}
    say(f"cluster {cluster.name}: {cluster.description}")
    say(f"emulation: {cluster.emulation}")

    t = time.monotonic()
    say("1/4 profiling every device (per-layer F/I/W) and one link per node pair ...")
    prof = _profile(cfg, cluster, out)
    timings["profile_s"] = time.monotonic() - t
    say(f"    measured in {timings['profile_s']:.0f} s; files in {out / 'profile'}")

    say("2/4 grouping from the measurements:")
    grouping = tuple(prof.grouping.explain())
    for line in grouping:
        say(f"    {line}")

    t = time.monotonic()
    plans, explanation = _plans(prof.cluster, prof.profile, cfg.global_batch)
    timings["plan_s"] = time.monotonic() - t
    say(f"3/4 planned in {timings['plan_s']:.2f} s:")
    for line in explanation:
        say(f"    {line}")
    for name, plan in plans.items():
        save_json_atomic(out / f"plan-{name}.json", plan.to_dict())

    say(f"4/4 training {cfg.model} for {cfg.steps} steps of {cfg.global_batch} samples with each plan "
        "(one process per emulated device) ...")
    run_dirs = {name: out / "runs" / name for name in plans}
    jobs = [
        Job(name=name, plan=plan, cluster=cluster, model=cfg.model,
            config=TrainConfig(steps=cfg.steps, seed=cfg.seed, mode="emulated", trace=name == "deepcee"),
            run_dir=str(run_dirs[name]))
        for name, plan in plans.items()
    ]
    for d in run_dirs.values():
        if (d / "metrics.jsonl").exists():
            (d / "metrics.jsonl").unlink()
    t = time.monotonic()
    stop = threading.Event()
    with Progress(TextColumn("    training"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("train", total=cfg.steps * len(jobs))
        watcher = threading.Thread(target=watch_progress, daemon=True,
                                   args=(list(run_dirs.values()), cfg.steps,
                                         lambda n: bar.update(task, completed=n), stop))
        watcher.start()
        try:
            results = dict(zip(plans, launch_jobs(jobs, deadline_s=cfg.deadline_s), strict=True))
        finally:
            stop.set()
            watcher.join()
    timings["train_s"] = time.monotonic() - t

    runs = []
    sim_cluster, sim_profile = emulated_view(prof.cluster, cluster, prof.profile)
    for name, plan in plans.items():
        res = results[name]
        # as the runtime runs it in mode emulated: optimizer step paced, records gathered over loopback
        sim_s, _ = predict(plan, sim_cluster, sim_profile, mode="emulated", dilation=res.dilation)
        steady = list(res.step_s[1:]) or list(res.step_s)
        runs.append(SystemRun(
            system=name, plan=plan, losses=res.losses, step_s=res.step_s,
            measured_samples_per_s=res.samples_per_s, measured_iteration_s=statistics.median(steady),
            simulated_iteration_s=sim_s, simulated_samples_per_s=plan.global_batch / sim_s,
        ))
    ours = results["deepcee"]
    emulation = {"mode": ours.mode, "dilation": ours.dilation, "emulated": list(ours.emulated),
                 "cluster": cluster.emulation}
    report = DemoReport(config=cfg, runs=tuple(runs), emulation=emulation, grouping=grouping,
                        explanation=tuple(explanation), timings_s=timings)
    files = {
        "report_json": str(out / "report.json"),
        "timeline_json": str(out / "timeline-real.json"),
        **{f"plan_{n}": str(out / f"plan-{n}.json") for n in plans},
        "profile_dir": str(out / "profile"),
    }
    save_json_atomic(files["timeline_json"], real_run_trace(ours.metrics, plans["deepcee"]))
    files.update(_plot(report, out))
    report = DemoReport(config=cfg, runs=report.runs, emulation=emulation, grouping=grouping,
                        explanation=report.explanation, files=files, timings_s=timings)
    save_json_atomic(files["report_json"], report.to_dict())
    return report


def format_report(report: DemoReport) -> str:
    """The demo's closing table, loss curve and emulation notes."""
    ours = report.run("deepcee")
    lines = [
        "",
        f"{'system':10s} {'stages':>6s} {'schedule':>8s} {'measured samples/s':>19s} {'deepcee x':>9s} "
        f"{'measured iter':>13s} {'simulated iter':>14s} {'sim error':>9s}",
    ]
    for r in report.runs:
        lines.append(
            f"{r.system:10s} {r.plan.num_stages:6d} {r.plan.schedule:>8s} {r.measured_samples_per_s:19.1f} "
            f"{ours.measured_samples_per_s / r.measured_samples_per_s:9.2f} {r.measured_iteration_s * 1e3:10.1f} ms "
            f"{r.simulated_iteration_s * 1e3:11.1f} ms {r.sim_error:+9.1%}"
        )
    best_baseline = max((r for r in report.runs if r.system != "deepcee"), key=lambda r: r.measured_samples_per_s)
    lines.append(f"deepcee vs the better baseline ({best_baseline.system}): "
                 f"{ours.measured_samples_per_s / best_baseline.measured_samples_per_s:.2f}x measured")
    n = len(ours.losses)
    marks = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})
    lines.append("loss after step " + " ".join(f"{m + 1:>7d}" for m in marks))
    for r in report.runs:
        lines.append(f"  {r.system:13s} " + " ".join(f"{r.losses[m]:7.4f}" for m in marks))
    em = report.emulation
    lines.append(f"emulated figures (mode {em['mode']}, time dilation D = {em['dilation']:.2f}; "
                 "reported times are divided by D):")
    lines += [f"  - {e}" for e in em["emulated"]]
    lines.append("measured: real computation and real gloo transfers between real processes; "
                 "simulated: the simulator on the measured profile")
    lines.append(f"measured figures are {PARTLY_MODELLED}")
    lines.append("wrote " + ", ".join(v for k, v in report.files.items() if not k.startswith("plan_")))
    return "\n".join(lines)
