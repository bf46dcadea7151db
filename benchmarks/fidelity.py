"""Simulator fidelity: measured iteration times of real (emulated) runs against the simulator.

Profiles the emulated ``local-small`` cluster for gpt-tiny (``deepcee.profiler.run.profile_cluster``:
one process per device, device and network probes), then runs ``deepcee validate``'s library
function (``deepcee.profiler.fidelity.validate_cluster`` on that profile): ten plans (GPipe,
1F1B, ZB-H1, ZB-H2 and compact schedules; 2-4 stages; uneven shares; 3-8 microbatches), a few
steps each with the runtime, the median step time (first step discarded) against the
simulator's prediction from the measured cluster and ``profile.json`` alone. Baselines measured
in the same run: the simulator on the declared cluster with the analytic (FLOP-based) profile,
and, as an ablation, the measured profile with the per-call overhead of a stage action counted
once per layer (the single-layer figures summed). One plan is run three times to give the
emulation's own run-to-run spread on this host.

Prints the table, writes JSON (``--out``, default ``reports/fidelity.json``) and replaces the
table in ``docs/profiler.md`` between its fidelity markers (``--no-docs`` to skip). Takes about
6-8 minutes on a 2-core machine; ``--reuse-profile`` reuses the profile in ``--profile-dir``.

    python benchmarks/fidelity.py
    python benchmarks/fidelity.py --reuse-profile --steps 6
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from pathlib import Path

from deepcee.cluster import load_cluster
from deepcee.plan import save_json_atomic
from deepcee.planfile import plan_from_dict
from deepcee.profile import LayerTiming, ModelProfile, load_profile
from deepcee.profiler.fidelity import FidelityReport, format_table, validate_cluster
from deepcee.profiler.network import NetworkBudget
from deepcee.profiler.probes import ProbeConfig
from deepcee.profiler.run import profile_cluster
from deepcee.scenarios import load_scenario
from deepcee.simulator.engine import simulate

START, END = "<!-- fidelity-table:start -->", "<!-- fidelity-table:end -->"


def _profile(args: argparse.Namespace, declared) -> float:
    """Profile into ``--profile-dir`` unless reusing it; seconds spent."""
    out = Path(args.profile_dir)
    if args.reuse_profile and all((out / f).exists() for f in ("cluster.json", "profile.json")):
        return 0.0
    t0 = time.monotonic()
    # links are not shared with other traffic here, so the probe runs back to back (duty 1);
    # the device probe paces with the same cores setting as the runs it must predict
    profile_cluster(
        declared, "gpt-tiny", out, cores=args.cores, deadline_s=480,
        device_config=ProbeConfig(repeats=5),
        network_budget=NetworkBudget(duty_cycle=1.0, repeats=2, min_transfer_s=0.015),
        network_dilation=args.network_dilation,
    )
    return time.monotonic() - t0


def _plus(t: LayerTiming, c: LayerTiming) -> LayerTiming:
    """``t`` carrying ``c`` in its own fixed costs (``first_stage`` likewise)."""
    def add(a: tuple[float, float] | None, b: tuple[float, float] | None) -> tuple[float, float] | None:
        return None if a is None else (a[0] + (b or (0.0, 0.0))[0], a[1])
    first = None if t.first_stage is None else _plus(t.first_stage, c.first_stage or c)
    return LayerTiming(forward=add(t.forward, c.forward), input_grad=add(t.input_grad, c.input_grad),
                       weight_grad=add(t.weight_grad, c.weight_grad), backward=add(t.backward, c.backward),
                       first_stage=first)


def per_layer_sums(profile: ModelProfile) -> ModelProfile:
    """The ablation: every layer pays the call overhead (the single-layer figures summed)."""
    measured = {kind: tuple(_plus(t, profile.measured_call_overhead[kind]) for t in ts)
                if kind in profile.measured_call_overhead else ts for kind, ts in profile.measured.items()}
    return dataclasses.replace(profile, measured=measured, measured_call_overhead={})


def _ablation(report: FidelityReport, plans: list, measured, profile: ModelProfile) -> dict:
    sums = per_layer_sums(profile)
    errors = {r.name: simulate(p, measured, sums, record=False).iteration_s / r.measured_s - 1
              for r, p in zip(report.rows, plans, strict=True)}
    return {"errors": errors, "mean_abs_error": statistics.fmean(abs(e) for e in errors.values()),
            "max_abs_error": max(abs(e) for e in errors.values())}


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
    ap.add_argument("--run-dir", default="reports/fidelity-run", help="validate.json and the runs' metrics")
    ap.add_argument("--reuse-profile", action="store_true", help="use cluster.json/profile.json in --profile-dir")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--plans", type=int, default=10)
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
    profile_s = _profile(args, declared)
    report = validate_cluster(declared, "gpt-tiny", num_plans=args.plans, steps=args.steps, out_dir=args.run_dir,
                              profile_dir=args.profile_dir, cores=args.cores)
    measured = load_cluster(Path(args.profile_dir) / "cluster.json")
    profile = load_profile(Path(args.profile_dir) / "profile.json")
    plans = [plan_from_dict(d) for d in report.extra["plans"]]
    ablation = _ablation(report, plans, measured, profile)
    total = time.monotonic() - t0
    note = (f"Ablation, same runs: the measured profile with the per-call overhead counted once per layer "
            f"(single-layer figures summed): mean / max |error| {ablation['mean_abs_error']:.1%} / "
            f"{ablation['max_abs_error']:.1%}.")
    print(note)
    print(f"\nprofile {profile_s:.0f} s, runs {report.wall_s:.0f} s, total {total:.0f} s")
    data = report.to_dict()
    data.update(profile_s=profile_s, total_s=total, profile_dir=args.profile_dir,
                slowdowns={d.name: d.slowdown for d in measured.devices}, per_layer_sums=ablation,
                target={"mean_abs_error": 0.10, "max_abs_error": 0.20})
    save_json_atomic(args.out, data)
    if not args.no_docs:
        _write_docs(Path(args.docs), format_table(report) + f"\n{note}\n\n(`python benchmarks/fidelity.py`: profile "
                                                            f"{profile_s:.0f} s, runs {report.wall_s:.0f} s on a "
                                                            f"2-core host shared with other work.)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
