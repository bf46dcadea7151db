"""Elastic training on the local emulated cluster: kill one worker mid-training, measure the recovery.

gpt-tiny on four devices of ``local-small`` (the planner's plan for them), an elastic adaptive
job ([Note: elastic process groups] in :mod:`deepcee.runtime.elastic`): once rank 0 has
recorded ``--kill-after`` steps, the process of ``--device`` gets SIGKILL; the launch starts
it again ``--restart-after`` seconds later and it rejoins. From ``elastic.json`` and the step
records: time to detect (kill -> first fault report), to decide (the survivors' leader
re-plans), to resume (kill -> the survivors' first step can start), steps redone, samples/s
before, between and after (median of the recorded steps) against the planner's prediction
for each device set. Losses are checked to continue (one record per step, no restart).

    python benchmarks/elastic.py --steps 60 --kill-after 10 --out reports/elastic.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from deepcee.adapter.controller import ScriptedPolicy, adaptive_job
from deepcee.models import get_model
from deepcee.plan import save_json_atomic
from deepcee.planner.search import plan_training
from deepcee.runtime.elastic import ElasticConfig
from deepcee.runtime.job import OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.supervise import Elastic
from deepcee.scenarios import load_scenario

DEVICES = ("cloud0:0", "cloud0:1", "edge0:0", "end0:0")


def _killer(run_dir: Path, device: str, after: int, out: dict) -> None:
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after):
        time.sleep(0.01)
    pid = int((run_dir / "pids" / device).read_text())
    out["kill_at"] = time.time()
    os.kill(pid, signal.SIGKILL)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-after", type=int, default=10)
    ap.add_argument("--device", default=None, help="device to kill (default: one of a stage with several)")
    ap.add_argument("--mode", default="emulated", choices=("emulated", "real"))
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--restart-after", type=float, default=0.5)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--lost-after", type=float, default=10.0,
                    help="seconds without a heartbeat before a live process counts as lost (a kill is seen sooner)")
    ap.add_argument("--out", default="reports/elastic.json")
    args = ap.parse_args()
    cluster = load_scenario("local-small")
    plan = plan_training(cluster.subset(DEVICES), get_model("gpt-tiny"), args.global_batch).plan
    plan = plan.replace(cluster="local-small")
    multi = [st for st in plan.stages if len(st.devices) > 1]
    device = args.device or (multi[0].devices[-1] if multi else plan.stages[-1].devices[0])
    run_dir = Path(tempfile.mkdtemp(prefix="deepcee-elastic-"))
    cfg = TrainConfig(steps=args.steps, dtype="float32", optimizer=OptimizerConfig(name="adamw", lr=1e-3),
                      mode=args.mode, timeout_s=60, checkpoint_every=args.checkpoint_every)
    job = adaptive_job(plan, cluster, model="gpt-tiny", config=cfg, run_dir=run_dir, name="elastic",
                       devices=DEVICES, policy=ScriptedPolicy(changes=()),
                       elastic=ElasticConfig(heartbeat_s=0.25, lost_after_s=args.lost_after))
    kill: dict = {}
    threading.Thread(target=_killer, args=(run_dir, device, args.kill_after, kill), daemon=True).start()
    t0 = time.monotonic()
    (result,) = launch_jobs([job], deadline_s=600, elastic=Elastic(restart_after_s=args.restart_after))
    wall = time.monotonic() - t0
    events = json.loads((run_dir / "elastic.json").read_text())["events"]
    steps = [m.step for m in result.metrics]
    # the kill's events (a heartbeat stall under load can exclude a device earlier: counted apart)
    ours = [e for e in events if (e["fault_reported_at"] or e["decided_at"]) >= kill["kill_at"]]
    lost = next(e for e in ours if e["kind"] == "device-lost")
    back = next((e for e in ours if e["kind"] == "device-rejoin"), None)
    rate = {m.step: m.samples_per_s for m in result.metrics}
    skip = {lost["resume_step"], back["resume_step"] if back else -1}  # a change's step pays for it
    end_mid = back["resume_step"] if back else args.steps
    phases = {
        "before": ([s for s in range(1, args.kill_after - 1) if not any(e["resume_step"] == s for e in events)], plan.estimate.samples_per_s if plan.estimate else None),
        "survivors": ([s for s in range(lost["resume_step"], end_mid) if s not in skip], lost["predicted_samples_per_s"]),
        "rejoined": ([s for s in range(end_mid, args.steps) if s not in skip] if back else [],
                     back["predicted_samples_per_s"] if back else None),
    }
    row = {
        "mode": args.mode, "plan_devices": list(plan.devices), "killed": device,
        "detect_s": lost["fault_reported_at"] - kill["kill_at"],
        "decide_s": lost["decided_at"] - lost["fault_reported_at"],
        "resume_s": lost["resumed_at"] - kill["kill_at"],
        "steps_redone": lost["steps_redone"], "restored_from": lost["restored_from"],
        "survivor_devices": lost["devices"], "rejoined_at_step": back["resume_step"] if back else None,
        "rejoin_after_kill_s": (back["resumed_at"] - kill["kill_at"]) if back else None,
        "one_record_per_step": steps == list(range(args.steps)),
        "transitions_before_the_kill": len(events) - len(ours),
        "losses_first_last": [result.losses[0], result.losses[-1]], "wall_s": wall,
        "samples_per_s": {k: {"measured_median": _median([rate[s] for s in ss if s in rate]), "predicted": pred,
                              "steps": len(ss)} for k, (ss, pred) in phases.items()},
    }
    print(f"killed {device} after {args.kill_after} steps ({args.mode}); survivors {lost['devices']}")
    print(f"detect {row['detect_s']:.2f} s, decide {row['decide_s']:.2f} s, resume {row['resume_s']:.2f} s after "
          f"the kill; steps redone {row['steps_redone']}; rejoined at step {row['rejoined_at_step']} "
          f"({row['rejoin_after_kill_s'] or float('nan'):.1f} s after the kill); one record per step: "
          f"{row['one_record_per_step']}")
    print(f"{'phase':<10} {'measured samples/s':>19} {'predicted':>10} {'steps':>6}")
    for k, v in row["samples_per_s"].items():
        m, p = v["measured_median"], v["predicted"]
        print(f"{k:<10} {m if m is None else round(m, 1)!s:>19} {p if p is None else round(p, 1)!s:>10} "
              f"{v['steps']:>6}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_json_atomic(args.out, {"schema_version": 1, "benchmark": "elastic", **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
