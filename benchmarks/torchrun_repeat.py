"""Single-node torchrun reliability: N consecutive runs of ``python -m deepcee.train``, every exit code.

Each run is the command of ``tests/dist/test_runtime_torchrun.py`` (3 processes, resnet-tiny,
a 2-stage plan with 2 devices on stage 0, float64, 2 steps, mode ``real``) under
``torchrun --standalone``, with a fresh run folder. A run passes when torchrun exits 0 *and*
the summary line was printed; the table lists every run's exit code, wall time, and any
abort marker found in its output (``terminate called``, ``Aborted``, ``SIGABRT``, a signal
exit of a worker). Writes JSON (``--out``). About 20-40 s per run on 2 loaded cores.

    python benchmarks/torchrun_repeat.py --runs 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepcee.plan import Plan, StagePlan, save_json_atomic

MARKERS = ("terminate called", "Aborted", "SIGABRT", "exitcode: -", "Signal 6")


def plan() -> Plan:
    stages = (StagePlan(layer_start=0, layer_stop=3, devices=("cloud0:0", "cloud0:1"), shares=(1, 2)),
              StagePlan(layer_start=3, layer_stop=8, devices=("edge0:0",), shares=(3,)))
    return Plan(system="test", cluster="local-small", model="resnet-tiny", global_batch=6, microbatch_size=3,
                num_microbatches=2, schedule="zb-h1", stages=stages)


def one_run(torchrun: str, folder: Path, i: int, timeout_s: float) -> dict:
    cmd = [torchrun, "--standalone", "--nproc-per-node", "3", "-m", "deepcee.train", "--plan",
           str(folder / "plan.json"), "--steps", "2", "--dtype", "float64", "--mode", "real", "--optimizer", "sgd",
           "--lr", "0.05", "--momentum", "0.9", "--timeout", "60", "--run-dir", str(folder / f"run{i}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=folder)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = None, f"timed out after {timeout_s:g} s\n{exc.stdout or ''}{exc.stderr or ''}"
    wall = time.monotonic() - t0
    (folder / f"out{i}.txt").write_text(out if isinstance(out, str) else str(out))
    markers = [m for m in MARKERS if m in out]
    summary = "steps 2 " in out
    return {"run": i, "exit_code": code, "wall_s": round(wall, 1), "summary_printed": summary, "markers": markers,
            "ok": code == 0 and summary and not markers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    ap.add_argument("--out", default="reports/torchrun_repeat.json")
    args = ap.parse_args()
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        print("torchrun not on PATH", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="deepcee-torchrun-"))
    save_json_atomic(folder / "plan.json", plan().to_dict())
    rows = []
    print(f"{'run':>4} {'exit':>5} {'wall s':>7} {'summary':>8}  markers")
    for i in range(1, args.runs + 1):
        r = one_run(torchrun, folder, i, args.timeout)
        rows.append(r)
        print(f"{r['run']:>4} {r['exit_code']!s:>5} {r['wall_s']:>7.1f} {r['summary_printed']!s:>8}  "
              f"{', '.join(r['markers']) or '-'}", flush=True)
    ok = sum(r["ok"] for r in rows)
    print(f"{ok} of {len(rows)} consecutive runs exited 0 with a summary and no abort (outputs in {folder})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_json_atomic(args.out, {"schema_version": 1, "benchmark": "torchrun_repeat", "runs": rows, "passed": ok,
                                "total": len(rows), "outputs": str(folder)})
    print(json.dumps({"passed": ok, "total": len(rows)}))
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
