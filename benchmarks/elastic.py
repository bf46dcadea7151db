"""Elastic training on the local emulated cluster: a lost worker or a dead link mid-training, the recovery measured.

gpt-tiny on four devices of ``local-small``, an elastic adaptive job ([Note: elastic process
groups] in :mod:`deepcee.runtime.elastic`).

- ``--fault kill`` (the planner's plan for the four devices): once rank 0 has recorded
  ``--kill-after`` steps, the process of ``--device`` gets SIGKILL; the launch starts it again
  ``--restart-after`` seconds later and it rejoins. Time to detect is kill -> first fault report.
- ``--fault dead-link`` (stages {cloud0:0, cloud0:1} | {edge0:0, end0:0}, so activations cross
  the cloud0-end0 link): that link goes down for good ``--link-down-at`` emulated seconds into
  training (mode emulated: the link shaper; realnet: the relay drops its packets), timeout
  ``--timeout``; one end is left out, no rejoin. Time to detect is counted from the last step
  recorded before the fault report (the link's outage is noticed when a transfer over it is
  overdue by the timeout).

From ``elastic.json`` and the step records: time to detect, to decide (the survivors' leader
re-plans), to resume (-> the survivors' first step can start), steps redone, samples/s before,
between and after (median of the recorded steps) against the planner's prediction for each
device set (the simulator's, for a plan the leader composed). Losses are checked to continue
(one record per step, no restart).

    python benchmarks/elastic.py --steps 60 --kill-after 10 --out reports/elastic.json
    python benchmarks/elastic.py --fault dead-link --steps 30 --out reports/elastic-dead-link.json
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
from deepcee.cluster.outages import LinkOutage
from deepcee.models import get_model
from deepcee.plan import Plan, StagePlan, save_json_atomic
from deepcee.planner.baselines import scored
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


def _record_times(run_dir: Path, out: list[float], stop: threading.Event) -> None:
    """Wall time at which each line of ``metrics.jsonl`` appeared (polled every 10 ms)."""
    metrics = run_dir / "metrics.jsonl"
    while not stop.is_set():
        n = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        while len(out) < n:
            out.append(time.time())
        time.sleep(0.01)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fault", default="kill", choices=("kill", "dead-link"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-after", type=int, default=10)
    ap.add_argument("--device", default=None, help="device to kill (default: one of a stage with several)")
    ap.add_argument("--mode", default="emulated", choices=("emulated", "real", "realnet"))
    ap.add_argument("--link-down-at", type=float, default=1.0, help="dead-link: emulated seconds into training")
    ap.add_argument("--timeout", type=float, default=None, help="seconds (default: 4 for dead-link, 60 for kill)")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--restart-after", type=float, default=0.5)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--lost-after", type=float, default=10.0,
                    help="seconds without a heartbeat before a live process counts as lost (a kill is seen sooner)")
    ap.add_argument("--out", default="reports/elastic.json")
    args = ap.parse_args()
    cluster = load_scenario("local-small")
    dead = args.fault == "dead-link"
    if dead:  # activations cross cloud0-end0
        plan = Plan(system="elastic-bench", cluster="local-small", model="gpt-tiny", global_batch=args.global_batch,
                    microbatch_size=args.global_batch // 2, num_microbatches=2, schedule="1f1b", stages=(
                        StagePlan(layer_start=0, layer_stop=3, devices=DEVICES[:2], shares=(args.global_batch // 4,) * 2),
                        StagePlan(layer_start=3, layer_stop=6, devices=DEVICES[2:], shares=(args.global_batch // 4,) * 2)))
        plan = scored(plan, cluster.subset(DEVICES), get_model("gpt-tiny"))
    else:
        plan = plan_training(cluster.subset(DEVICES), get_model("gpt-tiny"), args.global_batch).plan
        plan = plan.replace(cluster="local-small")
    multi = [st for st in plan.stages if len(st.devices) > 1]
    device = args.device or (multi[0].devices[-1] if multi else plan.stages[-1].devices[0])
    run_dir = Path(tempfile.mkdtemp(prefix="deepcee-elastic-"))
    timeout = args.timeout or (4.0 if dead else 60.0)
    cfg = TrainConfig(steps=args.steps, dtype="float32", optimizer=OptimizerConfig(name="adamw", lr=1e-3),
                      mode=args.mode, timeout_s=timeout, checkpoint_every=args.checkpoint_every,
                      link_outages=(LinkOutage(a="cloud0", b="end0", start_s=args.link_down_at),) if dead else ())
    job = adaptive_job(plan, cluster, model="gpt-tiny", config=cfg, run_dir=run_dir, name="elastic",
                       devices=DEVICES, policy=ScriptedPolicy(changes=()),
                       elastic=ElasticConfig(heartbeat_s=0.25, lost_after_s=args.lost_after, rejoin=not dead))
    kill: dict = {}
    seen: list[float] = []
    stop = threading.Event()
    threading.Thread(target=_record_times, args=(run_dir, seen, stop), daemon=True).start()
    if not dead:
        threading.Thread(target=_killer, args=(run_dir, device, args.kill_after, kill), daemon=True).start()
    t0 = time.monotonic()
    (result,) = launch_jobs([job], deadline_s=600,
                            elastic=Elastic(restart_after_s=None if dead else args.restart_after, finish_grace_s=5.0))
    wall = time.monotonic() - t0
    stop.set()
    events = json.loads((run_dir / "elastic.json").read_text())["events"]
    steps = [m.step for m in result.metrics]
    if dead:
        lost = next(e for e in events if e["kind"] == "device-lost")
        ours = [lost]
        fault_at = lost["fault_reported_at"]
        # the last step recorded before the report (records are written in step order)
        since = max((t for t in seen if t <= fault_at), default=fault_at)
        device = lost["lost"][0]["device"]
    else:
        # the kill's events (a heartbeat stall under load can exclude a device earlier: counted apart)
        ours = [e for e in events if (e["fault_reported_at"] or e["decided_at"]) >= kill["kill_at"]]
        lost = next(e for e in ours if e["kind"] == "device-lost")
        since = kill["kill_at"]
    back = next((e for e in ours if e["kind"] == "device-rejoin"), None)
    fault_step = lost["steps_applied"]
    rate = {m.step: m.samples_per_s for m in result.metrics}
    skip = {lost["resume_step"], back["resume_step"] if back else -1}  # a change's step pays for it
    end_mid = back["resume_step"] if back else args.steps
    phases = {
        "before": ([s for s in range(1, fault_step - 1) if not any(e["resume_step"] == s for e in events)],
                   plan.estimate.samples_per_s if plan.estimate else None),
        "survivors": ([s for s in range(lost["resume_step"], end_mid) if s not in skip], lost["predicted_samples_per_s"]),
        "rejoined": ([s for s in range(end_mid, args.steps) if s not in skip] if back else [],
                     back["predicted_samples_per_s"] if back else None),
    }
    row = {
        "fault": args.fault, "mode": args.mode, "timeout_s": timeout, "plan_devices": list(plan.devices),
        "lost": device, "fault_reason": lost["reason"][:300],
        "link_down_at_emulated_s": args.link_down_at if dead else None,
        "detect_s": lost["fault_reported_at"] - since,
        "decide_s": lost["decided_at"] - lost["fault_reported_at"],
        "resume_s": lost["resumed_at"] - since,
        "steps_redone": lost["steps_redone"], "restored_from": lost["restored_from"],
        "survivor_devices": lost["devices"], "rejoined_at_step": back["resume_step"] if back else None,
        "rejoin_after_fault_s": (back["resumed_at"] - since) if back else None,
        "one_record_per_step": steps == list(range(args.steps)),
        "transitions_before_the_kill": len(events) - len(ours),
        "losses_first_last": [result.losses[0], result.losses[-1]], "wall_s": wall,
        "samples_per_s": {k: {"measured_median": _median([rate[s] for s in ss if s in rate]), "predicted": pred,
                              "steps": len(ss)} for k, (ss, pred) in phases.items()},
    }
    what = (f"link cloud0-end0 down at {args.link_down_at:g} emulated s, {device} left out" if dead
            else f"killed {device} after {args.kill_after} steps")
    since_what = "the last step recorded before the report" if dead else "the kill"
    print(f"{what} ({args.mode}, timeout {timeout:g} s); survivors {lost['devices']}")
    print(f"detect {row['detect_s']:.2f} s, decide {row['decide_s']:.2f} s, resume {row['resume_s']:.2f} s after "
          f"{since_what}; steps redone {row['steps_redone']}; rejoined at step {row['rejoined_at_step']} "
          f"({row['rejoin_after_fault_s'] or float('nan'):.1f} s after); one record per step: "
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
