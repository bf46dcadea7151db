"""Simulator fidelity: measured iteration times of real (emulated) runs against the simulator.

Profiles the emulated ``local-small`` cluster for gpt-tiny (``deepcee.profiler.run.profile_cluster``:
one process per device, device and network probes), runs ten plans (GPipe, 1F1B, ZB-H1, ZB-H2
and compact schedules; 2-4 stages; uneven shares; 3-8 microbatches) for a few steps each with
the runtime, and compares the median step time (first step discarded) with the simulator's
prediction on the measured cluster and profile. Baseline measured in the same run: the
simulator on the declared cluster with the analytic (FLOP-based) profile. One plan is run three
times to give the emulation's own run-to-run spread on this host.

Prints the table, writes JSON (``--out``, default ``reports/fidelity.json``) and replaces the
table in ``docs/profiler.md`` between its fidelity markers (``--no-docs`` to skip). Takes about
4-6 minutes on a 2-core machine; ``--profile-dir`` reuses an earlier profile.

    python benchmarks/fidelity.py
    python benchmarks/fidelity.py --profile-dir reports/fidelity-profile --steps 6
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from deepcee.cluster import load_cluster
from deepcee.models import get_model
from deepcee.plan import save_json_atomic
from deepcee.profile import load_profile
from deepcee.profiler.device import ProbeConfig
from deepcee.profiler.fidelity import default_plans, format_table, lines_from_probes, run_fidelity
from deepcee.profiler.network import NetworkBudget
from deepcee.profiler.run import profile_cluster
from deepcee.scenarios import load_scenario

START, END = "<!-- fidelity-table:start -->", "<!-- fidelity-table:end -->"


def _profile(args: argparse.Namespace, declared):
    """``(measured cluster, profile, kind lines, seconds)``, measured now or read back."""
    out = Path(args.profile_dir)
    if args.reuse_profile and all((out / f).exists() for f in ("cluster.json", "profile.json", "probes.json")):
        lines = lines_from_probes(json.loads((out / "probes.json").read_text()))
        return load_cluster(out / "cluster.json"), load_profile(out / "profile.json"), lines, 0.0
    t0 = time.monotonic()
    # links are not shared with other traffic here, so the probe runs back to back (duty 1);
    # the device probe paces with the same cores setting as the runs it must predict
    res = profile_cluster(
        declared, "gpt-tiny", out, cores=args.cores, deadline_s=360,
        device_config=ProbeConfig(repeats=5),
        network_budget=NetworkBudget(duty_cycle=1.0, repeats=2, min_transfer_s=0.015),
        network_dilation=args.network_dilation,
    )
    lines = lines_from_probes(json.loads(Path(res.files["probes"]).read_text()))
    return res.cluster, res.profile, lines, time.monotonic() - t0


def _write_docs(path: Path, table: str) -> None:
    text = path.read_text()
    if START not in text or END not in text:
        print(f"{path}: no fidelity markers, table not written", file=sys.stderr)
        return
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/fidelity.json")
    ap.add_argument("--profile-dir", default="reports/fidelity-profile")
    ap.add_argument("--reuse-profile", action="store_true", help="use cluster.json/profile.json in --profile-dir")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cores", type=float, default=0.6, help="CPU cores the emulated devices may use (sets D)")
    ap.add_argument("--network-dilation", type=float, default=2.0)
    ap.add_argument("--docs", default="docs/profiler.md")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    t0 = time.monotonic()
    declared = load_scenario("local-small")
    measured, profile, lines, profile_s = _profile(args, declared)
    plans = default_plans(measured, profile)
    report = run_fidelity(declared, measured, profile, get_model("gpt-tiny"), plans, lines=lines, steps=args.steps,
                          cores=args.cores, spread_plan="gpipe-2", spread_repeats=3)
    table = format_table(report)
    total = time.monotonic() - t0
    print(table)
    print(f"\nprofile {profile_s:.0f} s, runs {report.wall_s:.0f} s, total {total:.0f} s")
    data = report.to_dict()
    data.update(profile_s=profile_s, total_s=total, profile_dir=args.profile_dir,
                slowdowns={d.name: d.slowdown for d in measured.devices},
                target={"mean_abs_error": 0.10, "max_abs_error": 0.20})
    save_json_atomic(args.out, data)
    if not args.no_docs:
        _write_docs(Path(args.docs), table + f"\n\n(`python benchmarks/fidelity.py`: profile {profile_s:.0f} s, "
                                             f"runs {report.wall_s:.0f} s on a 2-core host shared with other work.)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
