"""The dynamic environment adapter on the runtime: a 5x bandwidth drop mid-training, measured.

Cluster (defined here, emulated on this machine): three sites joined by 200 Mbit/s, 5 ms
links: ``cloud`` (one node, 2 CPU workers), ``edge`` (1) and ``end`` (1); every device has
12 MiB of memory, a stand-in for a model that does not fit one device, so gpt-tiny at global
batch 64 needs a pipeline. The script

1. profiles the four emulated devices for gpt-tiny (``deepcee.profiler``; reused from
   ``--profile-dir`` when present), and plans on the declared cluster with that profile
   (``plan_training``): the plan it gets is a pipeline across sites, and the busiest
   cross-site link (most boundary bytes per iteration) is the one the trace hits;
2. puts the built-in ``drop-5x`` trace (100% then 20% of nominal, both directions) on that
   link, rescaled so the drop comes about ``--drop-iteration`` simulated iterations in;
3. trains the plan for real (one process per device, gloo, emulated devices and links;
   every run in one launch) without the adapter and with it (monitor on rank 0 fed only
   with the runtime's own transfer timings; policy with the simulator scorer and the
   planner; decisions broadcast and applied at iteration boundaries), and trains the
   planner's plan for the post-drop links (the optimum, ``plan_training`` on the cluster
   as it is after the drop) on those links, measured the same way;
4. runs the same experiment in the simulator
   (:func:`deepcee.adapter.simloop.compare_adaptation`, same plan, trace, profile, planner);
5. prints per-iteration samples/s with and without the adapter around the drop and as a
   percentage of the optimum, measured and simulated, and the recovery (iterations from the
   one during which the link dropped to the first at >= 90% of the optimum); writes JSON
   (``--out``) and a PNG (``--plot``) with measured and simulated curves side by side.

What is emulated (stated in the output too): device speed (CPU time x slowdown x D), link
latency and bandwidth (delivery delayed, FIFO per link resource, trace integrated over each
transfer), the intra-stage all-reduce time (the simulator's model on the emulated links).
Every measured time is wall time divided by the dilation D. The controller's decision time
(rank 0: monitor, policy, planner; then a broadcast) is recorded per iteration and excluded
from the iteration's time; the re-plan's state movement and rebuild are included in the
first iteration of the new plan. Takes about 2-3 minutes (1 with ``--profile-dir`` reused).

    python benchmarks/adapter.py
    python benchmarks/adapter.py --steps 24 --out reports/adapter.json --plot reports/adapter.png
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from deepcee.adapter.controller import DefaultPolicy, adaptive_job
from deepcee.adapter.policy import PolicyConfig, search_planner
from deepcee.adapter.simloop import compare_adaptation
from deepcee.cluster import Cluster, cluster_from_toml_dict
from deepcee.plan import Plan, save_json_atomic, share_overlaps
from deepcee.profile import ModelProfile, load_profile
from deepcee.runtime.job import TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.records import StepMetrics, TrainResult
from deepcee.simulator.engine import simulate
from deepcee.traces import load_named_trace, snapshot, with_trace

MODEL, GLOBAL_BATCH = "gpt-tiny", 64
# One confirming check (the default is two): the monitor's CUSUM already needs three consistent
# transfers before it flags a link (tests/dist/test_adapter_runtime.py checks that this setting
# does not flap on a noisy stationary trace). Used by the runtime and the simulated runs alike.
POLICY = PolicyConfig(confirm_checks=1)
SITE_LINK = {"latency_ms": 5, "bandwidth_mbit_per_s": 200}
CLUSTER = {
    "name": "three-sites-4",
    "description": ("three sites joined by 200 Mbit/s, 5 ms links: cloud (2 CPU workers on one node), edge (1), "
                    "end (1); 12 MiB of memory per device"),
    "emulation": "CPU worker processes, one thread each; links emulated (latency + bytes/bandwidth, FIFO, traces)",
    "kinds": {"cpu-worker": {"peak_tflops": 0.05, "memory_gib": 0.012, "achievable_fraction": 0.5,
                             "per_layer_overhead_us": 50}},
    "islands": {s: {"latency_us": 100, "bandwidth_gbit_per_s": 10} for s in ("cloud", "edge", "end")},
    "nodes": [{"name": "cloud0", "island": "cloud", "kind": "cpu-worker", "devices": 2, "latency_us": 50,
               "bandwidth_gbit_per_s": 10},
              {"name": "edge0", "island": "edge", "kind": "cpu-worker", "devices": 1},
              {"name": "end0", "island": "end", "kind": "cpu-worker", "devices": 1}],
    "links": [{"between": [a, b], **SITE_LINK} for a, b in (("cloud", "edge"), ("cloud", "end"), ("edge", "end"))],
}


def _profile(args: argparse.Namespace, cluster: Cluster) -> tuple[ModelProfile, str]:
    out = Path(args.profile_dir)
    if (out / "profile.json").exists() and not args.reprofile:
        return load_profile(out / "profile.json"), f"reused {out / 'profile.json'}"
    from deepcee.profiler.network import NetworkBudget
    from deepcee.profiler.probes import ProbeConfig
    from deepcee.profiler.run import profile_cluster

    t0 = time.monotonic()
    # the links are declared (and emulated), so the network probe is kept to a token budget
    res = profile_cluster(cluster, MODEL, out, cores=args.cores, deadline_s=300,
                          device_config=ProbeConfig(repeats=3, warmup=1, time_budget_s=30),
                          network_budget=NetworkBudget(min_bytes=64 << 10, max_bytes=256 << 10, repeats=1,
                                                       max_s_per_pair=2.0, total_s=20.0))
    return res.profile, f"measured now in {time.monotonic() - t0:.0f} s into {out}"


def busiest_cross_site_link(plan: Plan, cluster: Cluster, model: ModelProfile) -> tuple[tuple[str, str], float]:
    """The island pair whose link carries the most stage-boundary bytes per iteration."""
    load: dict[tuple[str, str], float] = {}
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        per_sample = model.boundary_bytes(a.layer_stop)
        for i, j, lo, hi in share_overlaps(a.shares, b.shares):
            ia, ib = cluster.device(a.devices[i]).island, cluster.device(b.devices[j]).island
            if ia != ib:
                pair = tuple(sorted((ia, ib)))
                # forward activations and backward gradients, every microbatch
                load[pair] = load.get(pair, 0.0) + 2 * (hi - lo) * per_sample * plan.num_microbatches
    if not load:
        raise SystemExit(f"the plan ({describe(plan)}) crosses no site boundary; nothing to drop")
    pair = max(load, key=load.get)
    return pair, load[pair]


def crosses_sites(plan: Plan, cluster: Cluster) -> bool:
    """Whether two adjacent stages sit on different sites (so the pipeline's transfers cross)."""
    return any({cluster.device(d).island for d in a.devices} != {cluster.device(d).island for d in b.devices}
               for a, b in zip(plan.stages, plan.stages[1:], strict=False))


def cross_site_pipeline(cluster: Cluster, model: ModelProfile) -> Plan:
    """The best two-stage pipeline with its first stage on a device of a small site and the rest on
    the largest site (every split, 2-16 microbatches, 1F1B and ZB-H1), by the simulator."""
    from deepcee.adapter.policy import simulator_scorer
    from deepcee.plan import StagePlan

    sites = cluster.island_devices()
    home = max(sites, key=lambda s: len(sites[s]))
    score = simulator_scorer(model)
    best, best_s = None, float("inf")
    for site, devs in sites.items():
        if site == home:
            continue
        for split in range(1, model.num_layers):
            for m in (2, 4, 8, 16):
                size = GLOBAL_BATCH // m
                if size < len(sites[home]):
                    continue
                home_shares = tuple(size // len(sites[home]) + (i < size % len(sites[home]))
                                    for i in range(len(sites[home])))
                for schedule in ("1f1b", "zb-h1"):
                    plan = Plan(system="hand", cluster=cluster.name, model=MODEL, global_batch=GLOBAL_BATCH,
                                microbatch_size=size, num_microbatches=m, schedule=schedule,
                                stages=(StagePlan(layer_start=0, layer_stop=split, devices=(devs[0],), shares=(size,)),
                                        StagePlan(layer_start=split, layer_stop=model.num_layers,
                                                  devices=sites[home], shares=home_shares)))
                    t = score(plan, cluster)
                    if t < best_s:
                        best, best_s = plan, t
    if best is None:
        raise SystemExit("no cross-site pipeline fits this cluster's memory")
    return best


def describe(plan: Plan) -> str:
    stages = " | ".join(f"layers {s.layer_start}-{s.layer_stop} on {','.join(s.devices)} {list(s.shares)}"
                        for s in plan.stages)
    return f"{plan.schedule}, {plan.num_microbatches} x {plan.microbatch_size}: {stages}"


def _control_s(r: StepMetrics) -> float:
    """The decision time after a step (none after the last)."""
    return r.boundary.control_s or 0.0


def _drop_iteration(records: list[dict[str, Any]], drop_s: float) -> int:
    """The iteration running (or about to start) when the link dropped."""
    return next((r.step for r in records if r.boundary.end_s > drop_s), records[-1].step)


def _recovery(rates: list[float | None], drop_at: int, optimum: float, fraction: float = 0.9) -> int | None:
    """Iterations from the drop's (index ``drop_at``) to the first later one at ``fraction`` of the optimum."""
    for i in range(drop_at + 1, len(rates)):
        if rates[i] is not None and rates[i] >= fraction * optimum:
            return i - drop_at
    return None


def _axis(runs: list[list[dict[str, Any]]], drops: list[int], before: int) -> list[int]:
    """Iterations since the drop that every run has (from ``-before``)."""
    return list(range(-min(before, *drops), min(len(run) - d for run, d in zip(runs, drops, strict=True))))


def _aligned(curves: list[list[Any]], drops: list[int], ks: list[int]) -> list[list[Any]]:
    """Per-run values at iterations ``ks`` since each run's own drop iteration."""
    return [[c[d + k] for k in ks] for c, d in zip(curves, drops, strict=True)]


def _plot(path: Path, report: dict[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    m, s = report["measured"], report["simulated"]
    colors = {"static": "tab:red", "adaptive": "tab:blue"}
    names = {"static": "without adapter", "adaptive": "with adapter"}
    ax = axes[0]
    for key in ("static", "adaptive"):
        for rep in m[key]["repeats"]:
            ax.plot(m["k"], rep, color=colors[key], alpha=0.25, lw=0.8)
        ax.plot(m["k"], m[key]["median"], marker=".", color=colors[key],
                label=f"{names[key]} (median of {len(m[key]['repeats'])})")
    for k, kind in m["adaptive"]["changes_k"]:
        ax.axvline(k - 0.5, color=colors["adaptive"], ls=":", lw=1)
        ax.text(k - 0.5, 0.02, f" {kind}", transform=ax.get_xaxis_transform(), color=colors["adaptive"],
                fontsize=8, rotation=90, va="bottom")
    ax.set_title(f"measured (emulated devices and links, D = {report['emulation']['dilation']:.2f})", fontsize=10)
    ax = axes[1]
    shown = [i for i, k in enumerate(s["k"]) if k >= m["k"][0]]  # the measured panel's range
    for key in ("static", "adaptive"):
        ax.plot([s["k"][i] for i in shown], [s[key]["samples_per_s"][i] for i in shown], marker=".",
                color=colors[key], label=names[key])
    for k, kind in s["adaptive"]["changes_k"]:
        ax.axvline(k - 0.5, color=colors["adaptive"], ls=":", lw=1)
        ax.text(k - 0.5, 0.02, f" {kind}", transform=ax.get_xaxis_transform(), color=colors["adaptive"],
                fontsize=8, rotation=90, va="bottom")
    ax.set_title("simulated (same plan, trace, profile, policy)", fontsize=10)
    for ax, data in ((axes[0], m), (axes[1], s)):
        ax.axhline(data["optimum"], color="k", ls="--", lw=1, label="optimum for the post-drop links")
        ax.axhline(0.9 * data["optimum"], color="k", ls=":", lw=0.8, label="90% of optimum")
        ax.axvspan(-0.5, 0.5, color="grey", alpha=0.2, label="iteration with the 5x drop")
        ax.set_xlabel("iterations since the drop")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("samples/s per iteration")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="reports/adapter.json")
    ap.add_argument("--plot", default="reports/adapter.png")
    ap.add_argument("--profile-dir", default="reports/adapter-profile")
    ap.add_argument("--reprofile", action="store_true", help="profile again even if --profile-dir has a profile")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3,
                    help="each run this many times, interleaved (load from other processes hits all alike)")
    ap.add_argument("--drop-iteration", type=float, default=6.3,
                    help="when the link drops, in (simulated) iterations of the starting plan")
    ap.add_argument("--cores", type=float, default=1.2)
    ap.add_argument("--deadline", type=float, default=420.0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    t_start = time.monotonic()
    load_before = os.getloadavg()

    cluster = cluster_from_toml_dict(CLUSTER, file="<benchmarks/adapter.py>")
    print(f"cluster {cluster.name} (defined in this script): {cluster.description}")
    model, how = _profile(args, cluster)
    print(f"profile of {MODEL}: {how}")

    planner = search_planner(model, GLOBAL_BATCH)
    start = planner(cluster)
    start_source = "the planner's plan for the nominal links"
    if not crosses_sites(start, cluster):
        print(f"the planner's plan for the nominal links ({describe(start)}, simulated "
              f"{GLOBAL_BATCH / simulate(start, cluster, model, record=False).iteration_s:.0f} samples/s) moves no "
              "activations between sites, so the link monitor would see no transfers on the wide-area links; "
              "forcing a cross-site pipeline instead")
        start = cross_site_pipeline(cluster, model)
        start_source = ("hand-built: the best two-stage cross-site pipeline by the simulator (the planner's own "
                        "plan did not cross a site boundary)")
    pair, bytes_per_it = busiest_cross_site_link(start, cluster, model)
    sim_it_s = simulate(start, cluster, model, record=False).iteration_s
    trace = load_named_trace("drop-5x")
    time_scale = args.drop_iteration * sim_it_s / trace.times_s[1]
    drop_s = trace.times_s[1] * time_scale
    traced = with_trace(cluster, trace, between=[pair], time_scale=time_scale)
    after = snapshot(traced, drop_s + 1.0)
    optimum = planner(after)
    print(f"starting plan ({start_source}): {describe(start)}")
    print(f"busiest cross-site link: {pair[0]} <-> {pair[1]} ({bytes_per_it / 1e6:.2f} MB per iteration); "
          f"trace drop-5x on it, both directions, drop at t = {drop_s:.3f} s "
          f"(~{args.drop_iteration:g} simulated iterations of {sim_it_s * 1e3:.1f} ms)")
    print(f"optimum for the post-drop links (planner): {describe(optimum)}")

    devices = cluster.device_names
    cfg = TrainConfig(steps=args.steps, mode="emulated", cores=args.cores, timeout_s=60)
    policy = DefaultPolicy(profile=model, config=POLICY)
    with tempfile.TemporaryDirectory(prefix="deepcee-adapter-bench-") as tmp:
        root = Path(tmp)
        jobs = {}
        for rep in range(args.repeats):
            jobs[("static", rep)] = adaptive_job(start, traced, model=MODEL, config=cfg, run_dir=root / f"static{rep}",
                                                 name=f"static{rep}", devices=devices, adapt=False,
                                                 planning_cluster=cluster)
            jobs[("adaptive", rep)] = adaptive_job(start, traced, model=MODEL, config=cfg,
                                                   run_dir=root / f"adaptive{rep}", name=f"adaptive{rep}",
                                                   devices=devices, policy=policy, planning_cluster=cluster)
            jobs[("optimum", rep)] = adaptive_job(optimum, after, model=MODEL, config=cfg,
                                                  run_dir=root / f"optimum{rep}", name=f"optimum{rep}",
                                                  devices=devices, adapt=False, planning_cluster=after)
        print(f"training {len(jobs)} runs of {args.steps} steps (one launch, {len(devices)} processes) ...",
              flush=True)
        t0 = time.monotonic()
        done = launch_jobs(list(jobs.values()), deadline_s=args.deadline)
        train_wall_s = time.monotonic() - t0
        runs: dict[str, list[list[StepMetrics]]] = {"static": [], "adaptive": [], "optimum": []}
        results: dict[str, list[TrainResult]] = {"static": [], "adaptive": [], "optimum": []}
        for (kind, _), res in zip(jobs, done, strict=True):
            runs[kind].append(list(res.metrics))
            results[kind].append(res)

    t0 = time.monotonic()
    sim = compare_adaptation(start, cluster, model, trace, iterations=args.steps, planner=planner, between=[pair],
                             time_scale=time_scale, policy_config=POLICY)
    sim_wall_s = time.monotonic() - t0

    report = build_report(args, cluster, start, optimum, pair, drop_s, time_scale, runs, results, sim)
    report["start_plan_source"] = start_source
    report["wall_s"] = {"total": time.monotonic() - t_start, "training": train_wall_s, "simulation": sim_wall_s}
    report["host_load_average_1min"] = {"start": load_before[0], "end": os.getloadavg()[0]}
    print_report(report)
    save_json_atomic(args.out, report)
    _plot(Path(args.plot), report,
          f"{MODEL}, global batch {GLOBAL_BATCH}, on {cluster.name}: 5x drop on {pair[0]}<->{pair[1]}")
    print(f"wrote {args.out} and {args.plot} ({report['wall_s']['total']:.0f} s; 1-min load average "
          f"{load_before[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end on this {os.cpu_count()}-core host)")


def build_report(args, cluster, start, optimum, pair, drop_s, time_scale, runs, results, sim) -> dict[str, Any]:
    gb = GLOBAL_BATCH
    opt_steps = [r.step_s for run in runs["optimum"] for r in run[1:]]
    measured_opt = gb / statistics.median(opt_steps)
    measured: dict[str, Any] = {"drop_s": drop_s, "optimum": measured_opt, "optimum_step_s": opt_steps,
                                "optimum_per_repeat": [gb / statistics.median([r.step_s for r in run[1:]])
                                                       for run in runs["optimum"]]}
    drops = {k: [_drop_iteration(run, drop_s) for run in runs[k]] for k in ("static", "adaptive")}
    both = runs["static"] + runs["adaptive"]
    ks = _axis(both, drops["static"] + drops["adaptive"], 3)
    for key in ("static", "adaptive"):
        reps = _aligned([[r.samples_per_s for r in run] for run in runs[key]], drops[key], ks)
        incl = _aligned([[gb / (r.step_s + _control_s(r)) for r in run] for run in runs[key]],
                        drops[key], ks)
        control = _aligned([[_control_s(r) for r in run] for run in runs[key]], drops[key], ks)
        median = [statistics.median(col) for col in zip(*reps, strict=True)]
        median_incl = [statistics.median(col) for col in zip(*incl, strict=True)]
        k0 = ks.index(0)
        changes = [c.to_dict() for res in results[key] for c in res.adapter.changes]
        measured[key] = {
            "drop_iteration": drops[key], "repeats": reps, "median": median,
            "median_including_control": median_incl,
            "control_s_max": [max(col) for col in zip(*control, strict=True)],
            "recovery_iterations": _recovery(median, k0, measured_opt),
            "recovery_per_repeat": [_recovery(r, k0, measured_opt) for r in reps],
            "recovery_including_control": _recovery(median_incl, k0, measured_opt),
            "mean_from_4_after_drop": statistics.mean(median[k0 + 4:]) if len(median) > k0 + 4 else None,
            "changes": changes,
            "changes_k": sorted({(c.start_step - d, c.kind) for res, d in zip(results[key], drops[key], strict=True)
                                 for c in res.adapter.changes}),
            "decisions": _aligned([[(r.boundary.decision, r.boundary.reason or "") for r in run] for run in runs[key]],
                                  drops[key], ks),
            "link_estimates_mbit_per_s": _aligned([[{lk: v.bandwidth_bytes_per_s * 8 / 1e6 for lk, v in
                                                     r.boundary.link_estimates.items()} for r in run]
                                                   for run in runs[key]], drops[key], ks),
        }
    measured["k"] = ks
    sim_opt = sim.adaptive.optimum.samples_per_s
    sim_drop = sim.adaptive.iteration_at(drop_s)
    simulated: dict[str, Any] = {"drop_iteration": sim_drop, "optimum": sim_opt,
                                 "k": [r.index - sim_drop for r in sim.adaptive.iterations],
                                 "recovery_iterations": sim.adaptive.recovery_iterations(drop_s, 0.9),
                                 "static_recovery_iterations": sim.static.recovery_iterations(drop_s, 0.9)}
    for key, run in (("static", sim.static), ("adaptive", sim.adaptive)):
        simulated[key] = {"samples_per_s": [r.samples_per_s for r in run.iterations],
                          "decision": [r.decision for r in run.iterations],
                          "changes_k": [(r.index + 1 - sim_drop, r.decision) for r in run.iterations
                                        if r.decision != "keep"],
                          "run": run.to_dict()}
    first = results["adaptive"][0]
    return {
        "format": "deepcee.bench-adapter", "schema_version": 1,
        "cluster": {"name": cluster.name, "description": cluster.description, "devices": list(cluster.device_names),
                    "definition": "benchmarks/adapter.py CLUSTER"},
        "model": MODEL, "global_batch": gb, "steps": args.steps, "repeats": args.repeats,
        "emulation": first.emulation.to_dict(),
        "measured_times": "emulated seconds (wall / D); per-iteration samples/s = global batch / step time, "
                          "step time excluding the controller's decision time (control_s) and including a "
                          "change's state movement and rebuild",
        "start_plan": start.to_dict(), "optimum_plan": optimum.to_dict(),
        "trace": {"name": "drop-5x", "link": list(pair), "time_scale": time_scale, "drop_s": drop_s,
                  "levels": "100% of nominal, then 20% from drop_s (both directions)"},
        "measured": measured, "simulated": simulated,
    }


def print_report(rep: dict[str, Any]) -> None:
    m, s = rep["measured"], rep["simulated"]
    e = rep["emulation"]
    print(f"\nmeasured: emulated, time dilation D = {e['dilation']:.3f} ({e['cores']:g} cores for the devices); "
          "every measured time is wall / D. Emulated: " + "; ".join(e["emulated"]))
    print(f"per-iteration samples/s exclude the controller's decision time (column 'control s', max over repeats) "
          f"and include a change's state movement and rebuild; measured = median of {rep['repeats']} interleaved "
          "repeats, each aligned on its own drop iteration")
    print(f"optimum for the post-drop links: measured {m['optimum']:.1f} samples/s (median step of "
          f"{rep['repeats']} runs, first steps excluded; per run "
          f"{', '.join(f'{x:.0f}' for x in m['optimum_per_repeat'])}), simulated {s['optimum']:.1f}")
    hdr = (f"{'after drop':>10} | {'without':>8} {'with':>8} {'% opt w/o':>9} {'% opt with':>10} "
           f"{'with+ctl':>8} {'control s':>9} | {'sim w/o':>8} {'sim with':>8} {'sim %opt':>8}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    sim_at = {k: i for i, k in enumerate(s["k"])}
    for i, k in enumerate(m["k"]):
        st, ad = m["static"]["median"][i], m["adaptive"]["median"][i]
        cols = ("", "", "")
        if k in sim_at:
            j = sim_at[k]
            ss, sa = s["static"]["samples_per_s"][j], s["adaptive"]["samples_per_s"][j]
            cols = (f"{ss:8.1f}", f"{sa:8.1f}", f"{sa / s['optimum']:8.0%}")
        print(f"{k:10d} | {st:8.1f} {ad:8.1f} {st / m['optimum']:9.0%} {ad / m['optimum']:10.0%} "
              f"{m['adaptive']['median_including_control'][i]:8.1f} {m['adaptive']['control_s_max'][i]:9.3f} | "
              + " ".join(cols))
    a = m["adaptive"]
    rec = a["recovery_iterations"]
    print(f"measured: with the adapter >= 90% of the optimum {rec} iteration(s) after the drop "
          f"({'meets' if rec is not None and rec <= 3 else 'misses'} the 3-iteration target; per repeat "
          f"{a['recovery_per_repeat']}; counting decision time too: {a['recovery_including_control']}); "
          f"without: {m['static']['recovery_iterations'] or 'never'}")
    rec = s["recovery_iterations"]
    print(f"simulated: with the adapter >= 90% of the optimum {rec} iteration(s) after the drop; without: "
          f"{s['static_recovery_iterations'] or 'never'}")
    for c in a["changes"]:
        print(f"change before step {c['start_step']}: {c['kind']}, measured cost {c['change_s'] * 1e3:.0f} ms "
              f"(moved {c['moved_bytes'] / 1e6:.2f} MB; the policy budgeted {c['predicted_change_s'] * 1e3:.0f} ms)"
              f": {c['reason']}")
    if a["mean_from_4_after_drop"] is not None:
        print(f"from 4 iterations after the drop on: with {a['mean_from_4_after_drop']:.1f} "
              f"({a['mean_from_4_after_drop'] / m['optimum']:.0%} of the optimum), without "
              f"{m['static']['mean_from_4_after_drop']:.1f} samples/s "
              f"({m['static']['mean_from_4_after_drop'] / m['optimum']:.0%}) (measured medians)")


if __name__ == "__main__":
    main()
