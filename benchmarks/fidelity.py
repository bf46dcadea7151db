"""Simulator fidelity: measured step times and peak memory of real runs against the simulator.

Profiles the emulated ``local-small`` cluster for gpt-tiny (``deepcee.profiler.run.profile_cluster``:
one process per device; device probes paced as the runs are; in mode ``realnet`` the network
probe crosses the shaping relay as the runs do), then runs ``deepcee validate``'s library
function (``deepcee.profiler.fidelity.validate_cluster`` on that profile): twelve plans (the
ten curated ones: GPipe, 1F1B, ZB-H1, ZB-H2 and compact schedules, 2-4 stages through the
20-40 ms / 100 Mbit/s links, uneven shares and layer splits, 3-8 microbatches; then generated
ones), each a few steps with the runtime, the median step time (first step discarded) and each
rank's peak resident set against the simulator's prediction from ``cluster.json`` and
``profile.json`` alone, with deepcee's runtime behaviour in that mode. Baselines measured in
the same runs: the simulator on the declared cluster with the analytic (FLOP-based) profile,
and two ablations of the measured one: the per-call overhead of a stage action counted once
per layer, and the simulator without the runtime behaviours and per-step costs (no
handshakes, optimizer from FLOPs, no bookkeeping: the model before issue 14). One plan is run
three times for the measurement's own spread.

Mode ``realnet`` (default where the host allows it: root and ``/dev/net/tun``): real TCP
through the relay, real gloo collectives, nothing modelled. ``--also-emulated`` adds the same
plans in mode ``emulated``, reported apart and marked partly modelled (the runtime's all-reduce
waits for deepcee.comm's formula and the link shaper uses its serialisation).

Prints the tables, writes JSON (``--out``, default ``reports/fidelity.json``) and replaces the
table in ``docs/profiler.md`` between its fidelity markers (``--no-docs`` to skip). Takes about
15-25 minutes on a 2-core machine in mode realnet; ``--reuse-profile`` reuses ``--profile-dir``.

    python benchmarks/fidelity.py
    python benchmarks/fidelity.py --reuse-profile --steps 8 --also-emulated
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from pathlib import Path

from deepcee.plan import save_json_atomic
from deepcee.planfile import plan_from_dict
from deepcee.profile import LayerTiming, ModelProfile
from deepcee.profiler.fidelity import (
    FidelityReport,
    format_table,
    predict,
    read_profile_dir,
    validate_cluster,
)
from deepcee.profiler.network import NetworkBudget
from deepcee.profiler.probes import ProbeConfig
from deepcee.profiler.run import profile_cluster
from deepcee.runtime.emulation import choose_dilation
from deepcee.runtime.realnet import realnet_unavailable
from deepcee.scenarios import load_scenario
from deepcee.simulator.engine import simulate
from deepcee.simulator.runtime_model import RuntimeModel

START, END = "<!-- fidelity-table:start -->", "<!-- fidelity-table:end -->"
TARGETS = {"mean_abs_error": 0.05, "max_abs_error": 0.10, "memory_under": 0, "memory_mean_over": 0.10}
BEFORE = RuntimeModel(name="before issue 14: async sends, no handshakes, no per-step costs",
                      receive_handshake=False, allreduce_handshake_latencies=0.0, step_barrier=True)


def _profile(args: argparse.Namespace, declared) -> float:
    """Profile into ``--profile-dir`` unless reusing it; seconds spent."""
    out = Path(args.profile_dir)
    if args.reuse_profile and all((out / f).exists() for f in ("cluster.json", "profile.json")):
        return 0.0
    t0 = time.monotonic()
    # links are not shared with other traffic here, so the probe runs back to back (duty 1);
    # the device probe paces with the same cores setting as the runs it must predict
    profile_cluster(
        declared, "gpt-tiny", out, cores=args.cores, deadline_s=900, realnet=args.mode == "realnet",
        device_config=ProbeConfig(repeats=5),
        network_budget=NetworkBudget(duty_cycle=1.0, repeats=2, min_transfer_s=0.015),
        network_dilation=None if args.mode == "realnet" else args.network_dilation,
    )
    return time.monotonic() - t0


def _plus(t: LayerTiming, c: LayerTiming) -> LayerTiming:
    """``t`` carrying ``c`` in its own fixed costs and points (``first_stage`` likewise)."""
    def add(a: tuple[float, float] | None, b: tuple[float, float] | None) -> tuple[float, float] | None:
        return None if a is None else (a[0] + (b or (0.0, 0.0))[0], a[1])
    first = None if t.first_stage is None else _plus(t.first_stage, c.first_stage or c)
    fields = {"F": "forward", "I": "input_grad", "W": "weight_grad", "B": "backward"}
    points = {p: tuple(x + (getattr(c, fields[p]) or (0.0, 0.0))[0] for x in v) for p, v in t.points.items()}
    return dataclasses.replace(t, forward=add(t.forward, c.forward), input_grad=add(t.input_grad, c.input_grad),
                               weight_grad=add(t.weight_grad, c.weight_grad), backward=add(t.backward, c.backward),
                               first_stage=first, points=points)


def per_layer_sums(profile: ModelProfile) -> ModelProfile:
    """Ablation: every layer pays the call overhead (the single-layer figures summed)."""
    measured = {kind: tuple(_plus(t, profile.measured_call_overhead[kind]) for t in ts)
                if kind in profile.measured_call_overhead else ts for kind, ts in profile.measured.items()}
    return dataclasses.replace(profile, measured=measured, measured_call_overhead={})


def without_runtime_terms(profile: ModelProfile) -> ModelProfile:
    """Ablation: the profile as schema 1 held it (lines, no optimizer step, no memory, no link
    curves, no bookkeeping)."""
    def line_only(t: LayerTiming) -> LayerTiming:
        first = None if t.first_stage is None else line_only(t.first_stage)
        return dataclasses.replace(t, sizes=(), points={}, optimizer_s=None, first_stage=first)
    measured = {k: tuple(line_only(t) for t in ts) for k, ts in profile.measured.items()}
    calls = {k: line_only(c) for k, c in profile.measured_call_overhead.items()}
    return dataclasses.replace(profile, measured=measured, measured_call_overhead=calls, measured_memory={}, links={},
                               step_overhead_wall_s={})


def _errors(report: FidelityReport, times: dict[str, float]) -> dict:
    errors = {r.name: times[r.name] / r.measured_s - 1 for r in report.rows}
    return {"errors": errors, "mean_abs_error": statistics.fmean(abs(e) for e in errors.values()),
            "max_abs_error": max(abs(e) for e in errors.values())}


def ablations(report: FidelityReport, plans: list, measured, profile: ModelProfile) -> dict:
    """The same runs against the two ablated predictions (see the module docstring)."""
    sums = per_layer_sums(profile)
    by = {p.system: p for p in plans}
    rows = {r.name: r for r in report.rows}
    summed = {n: predict(p, measured, sums, mode=report.mode, dilation=rows[n].dilation)[0] for n, p in by.items()}
    bare = without_runtime_terms(profile)
    before = {n: statistics.fmean(simulate(p, measured, bare, iterations=5, record=False,
                                           runtime=BEFORE).iteration_times_s[1:]) for n, p in by.items()}
    return {"per_layer_sums": _errors(report, summed), "before_issue_14": _errors(report, before)}


def _write_docs(path: Path, table: str) -> None:
    text = path.read_text()
    if START not in text or END not in text:
        print(f"{path}: no fidelity markers, table not written", file=sys.stderr)
        return
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def _summary(report: FidelityReport, extra: dict) -> str:
    a, b = extra["per_layer_sums"], extra["before_issue_14"]
    return (f"Ablations, same runs: call overhead counted once per layer: mean / max |error| "
            f"{a['mean_abs_error']:.1%} / {a['max_abs_error']:.1%}; without the runtime behaviours and per-step "
            f"costs (the simulator before issue 14): {b['mean_abs_error']:.1%} / {b['max_abs_error']:.1%}.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/fidelity.json")
    ap.add_argument("--profile-dir", default="reports/fidelity-profile")
    ap.add_argument("--run-dir", default="reports/fidelity-run", help="validate.json and the runs' metrics")
    ap.add_argument("--reuse-profile", action="store_true", help="use cluster.json/profile.json in --profile-dir")
    ap.add_argument("--mode", choices=("realnet", "emulated"), default=None,
                    help="default: realnet where the host allows it")
    ap.add_argument("--also-emulated", action="store_true", help="also run the plans in mode emulated (apart)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--plans", type=int, default=12)
    ap.add_argument("--cores", type=float, default=0.6, help="CPU cores the emulated devices may use (sets D)")
    ap.add_argument("--dilation", type=float, default=None,
                    help="every run's time dilation (default: the profile's, from --cores over all devices; "
                         "0: each plan's own from --cores)")
    ap.add_argument("--network-dilation", type=float, default=2.0, help="mode emulated's network probe")
    ap.add_argument("--docs", default="docs/profiler.md")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    args.mode = args.mode or ("emulated" if realnet_unavailable() else "realnet")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    t0 = time.monotonic()
    declared = load_scenario("local-small")
    profile_s = _profile(args, declared)
    measured, profile = read_profile_dir(Path(args.profile_dir))
    # one D for every plan, the profile's: the runs keep the pacing the profile saw, and a
    # larger D leaves a loaded host room to keep it ([Note: pacing check] in fidelity_report)
    dilation = (choose_dilation([d.slowdown for d in declared.devices], args.cores) if args.dilation is None
                else args.dilation or None)
    data, tables = {"profile_s": profile_s, "dilation": dilation, "profile_dir": args.profile_dir, "targets": TARGETS,
                    "slowdowns": {d.name: d.slowdown for d in measured.devices}}, []
    for mode in [args.mode] + (["emulated"] if args.also_emulated and args.mode != "emulated" else []):
        report = validate_cluster(declared, "gpt-tiny", num_plans=args.plans, steps=args.steps,
                                  out_dir=f"{args.run_dir}-{mode}", profile_dir=args.profile_dir, cores=args.cores,
                                  mode=mode, dilation=dilation)
        plans = [plan_from_dict(d) for d in report.extra["plans"]]
        extra = ablations(report, plans, measured, profile) if mode == "realnet" else {}
        data[mode] = {**report.to_dict(), **extra}
        tables.append(format_table(report) + (f"\n{_summary(report, extra)}" if extra else ""))
        print(tables[-1])
    data["total_s"] = time.monotonic() - t0
    save_json_atomic(args.out, data)
    print(f"\nprofile {profile_s:.0f} s, total {data['total_s']:.0f} s; wrote {args.out}")
    if not args.no_docs:
        _write_docs(Path(args.docs), "\n\n".join(tables) + f"\n\n(`python benchmarks/fidelity.py`: profile "
                    f"{profile_s:.0f} s, total {data['total_s']:.0f} s on a 2-core host shared with other work.)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
