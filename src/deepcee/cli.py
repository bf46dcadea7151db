"""Command-line interface: thin. Each subcommand parses, loads, calls one library function, writes.

Run ``deepcee --help``. Any :class:`deepcee.errors.DeepceeError` becomes one line on stderr
and exit code 2; nothing is written when a command fails (outputs are written atomically
after the work succeeded).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deepcee.errors import DeepceeError, SpecError

# ---------------------------------------------------------------------------------------
# loading helpers (the CLI is the one place that maps names and paths to objects)
# ---------------------------------------------------------------------------------------


def _load_cluster(ref: str | None, scenario: str | None, fallback: str | None = None):
    from deepcee.cluster import load_cluster
    from deepcee.scenarios import DEFAULT_SCENARIO, load_scenario, scenario_names

    if ref:
        return load_cluster(ref), ref
    name = scenario or fallback or DEFAULT_SCENARIO
    if name in scenario_names():
        return load_scenario(name), name
    if Path(name).exists():
        return load_cluster(name), name
    raise SpecError(f"unknown scenario or cluster file {name!r} (scenarios: {', '.join(scenario_names())})",
                    field="--scenario")


def parse_model_ref(ref: str) -> tuple[str, dict[str, Any]]:
    """``gpt2`` or ``gpt2:seq_len=512,dtype=fp32`` -> (name, keyword arguments)."""
    name, _, rest = ref.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SpecError(f"expected key=value in model reference {ref!r}, got {item!r}", field="--model")
        kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
    return name, kwargs


def _load_model(ref: str, profile: str | None = None, **shape: Any):
    """A model profile: measured JSON if given, else a built-in analytic profile."""
    from deepcee.profile import load_profile

    if profile:
        return load_profile(profile), profile
    if ref.endswith(".json"):
        return load_profile(ref), ref
    from deepcee.models import get_model

    name, kwargs = parse_model_ref(ref)
    kwargs.update({k: v for k, v in shape.items() if v is not None})
    full = name + (":" + ",".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "")
    return get_model(name, **kwargs), full


def _write_json(path: str | Path, data: dict[str, Any]) -> None:
    from deepcee.plan import save_json_atomic

    save_json_atomic(path, data)


def _progress(message: str):
    """A spinner on stderr for long work (silent when stderr is not a terminal)."""
    from contextlib import nullcontext

    if not sys.stderr.isatty():
        return nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message)


def _progress_printer(after_s: float = 2.0):
    """A planner progress callback that prints ``step NN%`` to stderr once work has run for more
    than ``after_s`` seconds (at most once a second, and at every new step)."""
    import time

    start, last = time.monotonic(), {"t": 0.0, "step": ""}

    def report(step: str, fraction: float) -> None:
        now = time.monotonic()
        if now - start < after_s or (step == last["step"] and now - last["t"] < 1.0):
            return
        last.update(t=now, step=step)
        print(f"  [{now - start:5.1f} s] {step}: {100 * fraction:3.0f}%", file=sys.stderr, flush=True)

    return report


def _fmt_est(est) -> str:
    from deepcee.units import fmt_time

    return f"{fmt_time(est.iteration_s)} per iteration, {est.samples_per_s:.2f} samples/s ({est.source})"


# ---------------------------------------------------------------------------------------
# subcommands
# ---------------------------------------------------------------------------------------


def cmd_scenarios(args: argparse.Namespace) -> int:
    from deepcee.scenarios import load_scenario, scenario_names

    for name in scenario_names():
        c = load_scenario(name)
        islands = ", ".join(f"{k}:{len(v)}" for k, v in c.island_devices().items())
        print(f"{name:18s} {len(c.devices):3d} devices  islands {islands}")
        print(f"{'':18s} {c.description}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from deepcee.models import get_model, model_names

    for name in model_names():
        m = get_model(name)
        print(f"{name:24s} {m.num_layers:4d} layers {m.parameter_count / 1e6:10.1f} M parameters "
              f"{m.flops_per_sample() / 1e9:12.2f} GFLOP/sample")
    return 0


def _efficiency(path: str | None):
    from deepcee.planner.efficiency import DefaultEfficiency, load_efficiency

    return load_efficiency(path) if path else DefaultEfficiency()


def _figures(plan, cluster, model, args: argparse.Namespace):
    """The plan's speed, time to target and cost (simulated a few steps)."""
    from deepcee.planner.objective import plan_figures
    from deepcee.simulator.replicas import simulate_replicas

    result = simulate_replicas(plan, cluster, model, steps=2)
    return plan_figures(plan, result, cluster, model, _efficiency(args.efficiency),
                        dataset_samples=args.dataset_samples, epochs=args.epochs)


def cmd_plan(args: argparse.Namespace) -> int:
    cluster, cluster_ref = _load_cluster(args.cluster, args.scenario)
    model, model_ref = _load_model(args.model, args.profile, seq_len=args.seq_len, image_size=args.image_size)
    from deepcee.planner.options import PlannerOptions
    from deepcee.planner.search import plan_training

    if args.budget is not None and args.objective != "cost":
        raise SpecError("--budget needs --objective cost", field="--budget")
    options = PlannerOptions(progress=_progress_printer(),
                             **({"schedules": tuple(args.schedules.split(","))} if args.schedules else {}))
    searched = args.sync == "relaxed" or args.objective == "cost"
    with _progress(f"planning {model.name} on {cluster.name}"):
        result = plan_training(cluster, model, args.global_batch, options=options, sync=args.sync, **(dict(
            efficiency=_efficiency(args.efficiency), objective=args.objective, budget_usd=args.budget,
            dataset_samples=args.dataset_samples, epochs=args.epochs) if searched else {}))
    plan = result.plan.replace(cluster=cluster_ref, model=model_ref)
    for line in result.explanation:
        print(line)
    if plan.estimate is not None:
        print(f"estimate: {_fmt_est(plan.estimate)}; bottleneck: {plan.estimate.bottleneck}")
    if not searched:
        for line in _figures(result.plan, cluster, model, args).lines():
            print(line)
    print(f"planning took {result.planning_s:.2f} s over {result.candidates_evaluated} candidates")
    if cluster.emulation:
        print(f"note: cluster {cluster.name!r} is emulated: {cluster.emulation}")
    _write_json(args.output, plan.to_dict())
    print(f"wrote {args.output}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from deepcee.plan import load_plan
    from deepcee.simulator.engine import simulate
    from deepcee.simulator.trace import chrome_trace, plot_timeline

    plan = load_plan(args.plan)
    cluster, _ = _load_cluster(args.cluster, None, fallback=plan.cluster)
    model, _ = _load_model(plan.model, args.profile)
    plan.check_against(num_layers=model.num_layers, device_names=cluster.device_names, file=args.plan)
    if args.adapt:
        return _simulate_adaptive(args, plan, cluster, model)
    if args.link_trace:
        cluster = _apply_trace(cluster, args.link_trace, args.trace_links)
    if plan.num_replicas > 1 or args.straggler:
        return _simulate_replicas(args, plan, cluster, model)
    result = simulate(plan, cluster, model, iterations=args.iterations)
    print(f"plan {args.plan}: {plan.system}, {plan.num_stages} stages, schedule {plan.schedule}, "
          f"{plan.num_microbatches} x {plan.microbatch_size} samples")
    print(f"simulated: {result.iteration_s * 1e3:.2f} ms per iteration, {result.samples_per_s:.2f} samples/s, "
          f"bubble {result.bubble_fraction:.1%}")
    if len(result.iteration_times_s) > 1:
        print("iteration times (ms): " + " ".join(f"{t * 1e3:.1f}" for t in result.iteration_times_s))
    print(f"bottleneck: {result.bottleneck}")
    print("peak memory (GiB): " + ", ".join(f"{d} {b / 2**30:.2f}" for d, b in result.peak_memory_bytes.items()))
    source = "emulated cluster" if cluster.emulation else "datasheet device speeds, analytic cost model"
    print(f"all figures simulated ({source})")
    if args.timeline:
        _write_json(args.timeline, chrome_trace(result, plan))
        print(f"wrote {args.timeline} (Chrome trace; open in Perfetto)")
    if args.plot:
        plot_timeline(result, plan, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _simulate_replicas(args: argparse.Namespace, plan, cluster, model) -> int:
    """Plans with several replicas, or with stragglers: every strategy over time."""
    from deepcee.cluster.stragglers import Straggler
    from deepcee.simulator.replica_trace import replica_chrome_trace
    from deepcee.simulator.replicas import describe_result, simulate_replicas

    stragglers = [Straggler.parse(text, cluster.device_names) for text in args.straggler]
    result = simulate_replicas(plan, cluster, model, steps=args.iterations, stragglers=stragglers,
                               record=bool(args.timeline))
    print(f"plan {args.plan}: {plan.system}")
    for line in describe_result(result, plan, stragglers):
        print(line)
    source = "emulated cluster" if cluster.emulation else "datasheet device speeds, analytic cost model"
    print(f"all figures simulated ({source})")
    if args.timeline:
        _write_json(args.timeline, replica_chrome_trace(result, plan))
        print(f"wrote {args.timeline} (Chrome trace; open in Perfetto)")
    if args.plot:
        print("note: --plot draws one pipeline; use --timeline for plans with replicas or stragglers")
    return 0


def _apply_trace(cluster, trace_ref: str, between: str | None):
    """Put a bandwidth trace (built-in name or file) on the wide-area links, rescaled to each
    link's nominal speed (or only on the ``--trace-links a,b`` island pair)."""
    from deepcee.traces import load_named_trace, with_trace

    pairs = None
    if between:
        a, _, b = between.partition(",")
        pairs = [(a, b)]
    return with_trace(cluster, load_named_trace(trace_ref), between=pairs)


def _simulate_adaptive(args: argparse.Namespace, plan, cluster, model) -> int:
    from deepcee.adapter.simloop import compare_adaptation, plot_adaptation
    from deepcee.traces import load_named_trace

    if not args.link_trace:
        raise SpecError("--adapt needs --link-trace (a built-in trace name or a trace file)", field="--adapt")
    trace = load_named_trace(args.link_trace)
    between = [tuple(args.trace_links.split(",", 1))] if args.trace_links else None
    iterations = max(args.iterations, 2)
    with _progress(f"simulating {iterations} iterations with and without the adapter"):
        cmp = compare_adaptation(plan, cluster, model, trace, iterations=iterations, between=between)
    for run in (cmp.static, cmp.adaptive):
        label = "with adapter   " if run.adapt else "without adapter"
        print(f"{label}: mean {run.samples_per_s:.2f} samples/s over {iterations} iterations, "
              f"{len(run.decisions)} plan changes")
        for d in run.decisions:
            print(f"    at {d.at_s:.1f} s: {d.kind.value}: {d.reason}")
    if cmp.adaptive.optimum is not None:
        print(f"optimum for the final conditions: {cmp.adaptive.optimum.samples_per_s:.2f} samples/s")
    print("all figures simulated (link trace applied in the simulator)")
    if args.json:
        _write_json(args.json, cmp.to_dict())
        print(f"wrote {args.json}")
    if args.plot:
        plot_adaptation([cmp.static, cmp.adaptive], args.plot, title=f"{plan.model} on {plan.cluster}")
        print(f"wrote {args.plot}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    cluster, _ = _load_cluster(args.cluster, args.scenario)
    model, _ = _load_model(args.model, args.profile, seq_len=args.seq_len, image_size=args.image_size)
    from deepcee.planner.compare import compare, format_table, plot_crossover

    with _progress(f"planning deepcee and baselines for {model.name} on {cluster.name}"):
        report = compare(cluster, model, args.global_batch, relaxed=not args.no_relaxed, sync=args.sync,
                         efficiency=_efficiency(args.efficiency))
    print(format_table(report))
    _write_json(args.json, report.to_dict())
    print(f"wrote {args.json}")
    if getattr(report, "crossover", None) is not None and args.plot:
        plot_crossover(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_schedule_show(args: argparse.Namespace) -> int:
    from deepcee.schedule.builders import build_schedule
    from deepcee.schedule.passes import dry_run, format_table, in_flight_per_stage, validate

    sched = build_schedule(args.name, args.stages, args.microbatches)
    validate(sched)
    print(format_table(sched))
    s = args.stages
    dr = dry_run(sched, forward_s=[1.0] * s, input_grad_s=[1.0] * s, weight_grad_s=[1.0] * s,
                 comm_forward=[(0.0, 0.0)] * (s - 1), comm_backward=[(0.0, 0.0)] * (s - 1))
    print(f"unit costs (F = I = W = 1, no communication): makespan {dr.makespan_s:g}, "
          f"bubble {dr.bubble_fraction:.1%}, in-flight microbatches per stage {list(in_flight_per_stage(sched))}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import logging

    cluster, _ = _load_cluster(args.cluster, args.scenario)
    from deepcee.profiler.run import profile_cluster

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mode = "real devices and network" if args.real else f"emulated ({cluster.emulation or 'declared speeds'})"
    print(f"profiling {len(cluster.devices)} devices of {cluster.name} for {args.model}: {mode}")
    result = profile_cluster(cluster, args.model, args.output, emulated=not args.real, deadline_s=args.deadline)
    print(result.grouping.describe(), end="")
    for name, path in result.files.items():
        print(f"wrote {path} ({name})")
    print(f"profiled in {result.wall_s:.0f} s")
    return 0


def cmd_group(args: argparse.Namespace) -> int:
    from deepcee.planner.grouping import group_devices

    cluster, _ = _load_cluster(args.cluster_file, args.scenario)
    grouping = group_devices(cluster, island_threshold_s=args.island_threshold_ms * 1e-3,
                             speed_ratio=args.speed_ratio)
    print(grouping.describe(), end="")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    cluster, _ = _load_cluster(args.cluster, args.scenario)
    from deepcee.profiler.fidelity import validate_cluster

    validate_cluster(cluster, args.model, num_plans=args.plans, steps=args.steps, out_dir=args.output,
                     profile_dir=args.profile_dir)
    print(f"wrote {Path(args.output) / 'validate.json'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from deepcee.train import train

    return train(args)


def cmd_export(args: argparse.Namespace) -> int:
    from deepcee.runtime.export import export_checkpoint

    res = export_checkpoint(args.checkpoint, args.output)
    print(f"checkpoint {res.folder} (step {res.step}): {res.tensors} tensors under {res.names} names")
    for f in res.files:
        print(f"wrote {f}")
    if len(res.files) == 1 and not args.output.endswith(".safetensors"):
        print("no .safetensors: the safetensors package is not installed")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from deepcee.demo import DemoConfig, format_report, run_demo

    cfg = DemoConfig(scenario=args.scenario, model=args.model, global_batch=args.global_batch, steps=args.steps,
                     out_dir=args.out, quick_profile=not args.full_profile)
    report = run_demo(cfg)
    print(format_report(report))
    return 0


# ---------------------------------------------------------------------------------------


def _add_model_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--model", default=default, required=default is None,
                   help="built-in model name (see `deepcee models`), optionally name:key=value,...")
    p.add_argument("--profile", help="measured profile JSON (from `deepcee profile`) instead of the analytic one")
    p.add_argument("--seq-len", type=int, help="sequence length for transformer models")
    p.add_argument("--image-size", type=int, help="image side for convolutional models")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", help="built-in cluster name (see `deepcee scenarios`)")
    p.add_argument("--cluster", help="cluster file (TOML, or JSON written by `deepcee profile`)")


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _add_sync_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sync", choices=("exact", "relaxed"), default="exact",
                   help="exact: synchronous plans only (the single-process result); relaxed: also replicas joined "
                        "by model averaging, ASGD-GA or partial averaging, judged by predicted time to target")
    p.add_argument("--efficiency", help="calibrated statistical efficiency (deepcee.efficiency JSON) instead of "
                   "the conservative default, which is not measured")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepcee",
        description="deepcee: plan, simulate and run training across cloud, edge and end devices over slow links.",
        epilog="Start with `deepcee demo` (the main job) or `deepcee scenarios`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the main job: profile, group, plan and train on an emulated cluster "
                       "(deepcee vs DDP vs 1F1B)")
    p.add_argument("--scenario", default="local-small")
    p.add_argument("--model", default="gpt-tiny", help="gpt-tiny or resnet-tiny")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="reports/demo", help="report folder")
    p.add_argument("--full-profile", action="store_true", help="probe every device pair with the full budget")
    p.set_defaults(func=cmd_demo)

    from deepcee.train import DESCRIPTION, add_train_arguments

    p = sub.add_parser("train", help="train with a plan on local processes (torchrun: python -m deepcee.train)",
                       description=DESCRIPTION)
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="write a checkpoint as one plain state_dict (.pt, and .safetensors when "
                       "installed) that loads into the model with strict=True")
    p.add_argument("checkpoint", help="run folder, checkpoint folder, or one step-N folder (default: the newest intact)")
    p.add_argument("-o", "--output", default="model.pt", help="state_dict file (torch.save); .safetensors beside it")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("profile", help="measure every device (per-layer F/I/W) and link of a cluster")
    _add_cluster_args(p)
    p.add_argument("--model", default="gpt-tiny", help="net to time per layer: gpt-tiny or resnet-tiny")
    p.add_argument("-o", "--output", default="measured", help="output folder (cluster.json, profile.json, ...)")
    p.add_argument("--real", action="store_true", help="measure the real transport instead of emulated links "
                   "and devices")
    p.add_argument("--deadline", type=float, default=900.0, help="hard limit for the whole profile, seconds")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("group", help="print the two-level groups (islands by network, groups by speed)")
    p.add_argument("cluster_file", nargs="?", help="cluster file (TOML, or cluster.json from `deepcee profile`)")
    p.add_argument("--scenario", help="built-in cluster instead of a file")
    p.add_argument("--island-threshold-ms", type=float, default=10.0,
                   help="devices whose 1 MB transfer takes longer than this are in different islands")
    p.add_argument("--speed-ratio", type=float, default=1.5,
                   help="a speed gap above this ratio separates groups inside an island")
    p.set_defaults(func=cmd_group)

    p = sub.add_parser("validate", help="run several plans for real on the emulated cluster and compare "
                       "with the simulator")
    _add_cluster_args(p)
    p.add_argument("--model", default="gpt-tiny", help="gpt-tiny or resnet-tiny")
    p.add_argument("--plans", type=int, default=8, help="number of different plans to run")
    p.add_argument("--steps", type=int, default=6, help="steps per plan (the first is warm-up)")
    p.add_argument("--profile-dir", help="reuse cluster.json/profile.json from `deepcee profile` instead of "
                   "profiling first")
    p.add_argument("-o", "--output", default="reports/validate")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("scenarios", help="list built-in clusters")
    p.set_defaults(func=cmd_scenarios)
    p = sub.add_parser("models", help="list built-in model profiles")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("plan", help="plan training of a model on a cluster")
    _add_cluster_args(p)
    _add_model_args(p)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--schedules", help="comma-separated schedules the planner may use (default: all)")
    _add_sync_args(p)
    p.add_argument("--objective", choices=("time", "cost"), default="time",
                   help="time: fastest predicted time to target; cost: fewest dollars per sync-equivalent epoch "
                        "(needs prices in the cluster file)")
    p.add_argument("--budget", type=float, help="with --objective cost: the fastest plan within this many dollars "
                   "per sync-equivalent epoch")
    p.add_argument("--dataset-samples", type=float, help="samples per epoch (default: the data the cluster file "
                   "states over the model's input bytes per sample)")
    p.add_argument("--epochs", type=int, default=1, help="epochs the one-time data movement is spread over")
    p.add_argument("-o", "--output", default="plan.json")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="simulate a plan: iteration time, bubbles, memory, timeline")
    p.add_argument("plan")
    p.add_argument("--cluster", help="cluster file (default: the plan's scenario)")
    p.add_argument("--profile", help="measured profile JSON (default: the plan's model)")
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--link-trace", help="bandwidth trace (built-in name such as drop-5x, or a JSON file) "
                   "applied to the inter-island links")
    p.add_argument("--adapt", action="store_true",
                   help="simulate iteration by iteration with and without the adapter (needs --link-trace)")
    p.add_argument("--json", help="with --adapt: write the per-iteration results as JSON")
    p.add_argument("--trace-links", help="apply the trace only between these two islands: a,b")
    p.add_argument("--timeline", help="write a Chrome-trace JSON timeline")
    p.add_argument("--plot", help="write a PNG timeline")
    p.add_argument("--straggler", action="append", default=[], metavar="DEVICE:FACTOR[:START[:STOP]]",
                   help="slow DEVICE down FACTOR times from START to STOP (simulated seconds; default the whole "
                        "run); repeatable")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("compare", help="deepcee vs baselines vs the upper bound on one cluster")
    _add_cluster_args(p)
    _add_model_args(p)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--json", default="compare.json")
    p.add_argument("--plot", default="crossover.png", help="crossover PNG (written when leaving devices out wins)")
    _add_sync_args(p)
    p.add_argument("--no-relaxed", action="store_true", help="leave out the related systems' relaxed strategies "
                   "(Cloudless-Training, SDPipe, HeteroG)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("schedule", help="inspect pipeline schedules")
    ssub = p.add_subparsers(dest="schedule_command", required=True)
    q = ssub.add_parser("show", help="print a schedule as a step-by-stage table")
    q.add_argument("name", help="gpipe, 1f1b, zb-h1 or zb-h2")
    q.add_argument("--stages", type=int, default=4)
    q.add_argument("--microbatches", type=int, default=8)
    q.set_defaults(func=cmd_schedule_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if getattr(args, "config", None):  # a job config: its values become defaults, flags override them
            from deepcee.jobconfig import parse_with_config

            args = parse_with_config(parser, argv, train_parser=_subparser(parser, args.command))
        return func(args)
    except DeepceeError as exc:
        print(f"deepcee {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"deepcee {args.command}: interrupted", file=sys.stderr)
        return 130
    except json.JSONDecodeError as exc:
        print(f"deepcee {args.command}: error: invalid JSON: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
