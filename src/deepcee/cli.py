"""Command-line interface: thin. Each subcommand parses, loads, calls one library function, writes.

Run ``deepcee --help``. Any :class:`deepcee.errors.DeepceeError` becomes one line on stderr
and exit code 2; nothing is written when a command fails (outputs are written atomically
after the work succeeded).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deepcee.cliargs import (
    BUDGET,
    DATASET_SAMPLES,
    DEADLINE,
    DEMO_STEPS,
    EPOCHS,
    EVERY,
    GLOBAL_BATCH,
    IMAGE_SIZE,
    ITERATIONS,
    LR,
    MICROBATCHES,
    PLANS,
    RATIO,
    SEED,
    SEQ_LEN,
    STAGES,
    STEPS,
    TARGET_LOSS,
    THRESHOLD_MS,
    OneLineParser,
    name_list,
    name_pair,
    number,
    straggler_flag,
)
from deepcee.errors import DeepceeError, SpecError
from deepcee.plan import SCHEDULES

# ---------------------------------------------------------------------------------------
# loading helpers (the CLI is the one place that maps names and paths to objects)
# ---------------------------------------------------------------------------------------


def _load_cluster(ref: str | None, scenario: str | None, fallback: str | None = None, *,
                  plan_file: str | None = None):
    """A cluster from ``--cluster``, ``--scenario`` or (``fallback``) the plan's ``cluster`` field,
    whose errors then name the plan file and that field."""
    from deepcee.cluster import load_cluster
    from deepcee.scenarios import DEFAULT_SCENARIO, load_scenario, scenario_names

    if ref:
        return load_cluster(ref), ref
    name = scenario or fallback or DEFAULT_SCENARIO
    if name in scenario_names():
        return load_scenario(name), name
    if Path(name).exists():
        return load_cluster(name), name
    known = f"scenarios: {', '.join(scenario_names())}"
    if scenario is None and fallback is not None:
        raise SpecError(f"unknown scenario or cluster file {name!r} ({known}; or give --cluster)", file=plan_file,
                        field="cluster")
    raise SpecError(f"unknown scenario or cluster file {name!r} ({known})", field="--scenario")


def _load_model(ref: str | None, profile: str | None = None, args: argparse.Namespace | None = None, *,
                plan_file: str | None = None, **shape: Any):
    """A model profile: measured JSON if given, a user's model (``package.module:name``) counted
    from its blocks on ``--data``, else a built-in analytic profile. With ``plan_file``, ``ref``
    is that plan's ``model`` field and errors name it."""
    from deepcee.errors import ProfileError
    from deepcee.profile import load_profile
    from deepcee.userref import is_import_path

    if profile:  # the plan names a model of your own by its import path, which `deepcee train` builds
        return load_profile(profile), ref if ref and is_import_path(ref) else profile
    if not ref:
        raise SpecError("give a model (a built-in name, see `deepcee models`), your own as package.module:name, "
                        "or a measured --profile", field="--model")
    if ref.endswith(".json"):
        return load_profile(ref), ref
    if is_import_path(ref):
        return _counted_profile(ref, args), ref
    from deepcee.models import get_model, parse_model_ref

    field = "model" if plan_file else "--model"
    try:
        name, kwargs = parse_model_ref(ref, field=field)
        kwargs.update({k: v for k, v in shape.items() if v is not None})
        full = name + (":" + ",".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "")
        return get_model(name, **kwargs), full
    except ProfileError as exc:  # name where the reference came from, and the reference
        message = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
        raise ProfileError(f"{ref!r}: {message}", file=plan_file, field=field) from None


def _counted_profile(ref: str, args: argparse.Namespace | None):
    """The profile of a user's model counted from its blocks (:func:`deepcee.train.counted_profile`)."""
    from deepcee.train import counted_profile

    with _progress(f"counting the profile of {ref}"):
        return counted_profile(ref, args)


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
    model, model_ref = _load_model(args.model, args.profile, args, seq_len=args.seq_len, image_size=args.image_size)
    from deepcee.planner.options import PlannerOptions
    from deepcee.planner.replicas import plan_with_sync

    if args.budget is not None and args.objective != "cost":
        raise SpecError("--budget needs --objective cost", field="--budget")
    options = PlannerOptions(progress=_progress_printer(),
                             **({"schedules": tuple(args.schedules.split(","))} if args.schedules else {}))
    searched = args.sync == "relaxed" or args.objective == "cost"
    with _progress(f"planning {model.name} on {cluster.name}"):
        result = plan_with_sync(cluster, model, args.global_batch, options=options, sync=args.sync, **(dict(
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
    from deepcee.inputs.work import check_simulation
    from deepcee.planfile import load_plan
    from deepcee.simulator.engine import simulate
    from deepcee.simulator.trace import chrome_trace, plot_timeline

    plan = load_plan(args.plan)
    cluster, _ = _load_cluster(args.cluster, None, fallback=plan.cluster, plan_file=args.plan)
    model, _ = _load_model(plan.model, args.profile, args, plan_file=args.plan)
    plan.check_against(num_layers=model.num_layers, device_names=cluster.device_names, file=args.plan)
    if args.adapt:
        return _simulate_adaptive(args, plan, cluster, model)
    check_simulation(plan, args.iterations)
    if args.link_trace:
        cluster = _apply_trace(cluster, args.link_trace, args.trace_links)
    if plan.num_replicas > 1 or args.straggler:
        return _simulate_replicas(args, plan, cluster, model)
    from deepcee.simulator.runtime_model import runtime_model

    runtime = runtime_model(args.runtime, mode=args.mode)
    result = simulate(plan, cluster, model, iterations=args.iterations, runtime=runtime)
    print(f"plan {args.plan}: {plan.system}, {plan.num_stages} stages, schedule {plan.schedule}, "
          f"{plan.num_microbatches} x {plan.microbatch_size} samples")
    print(f"simulated: {result.iteration_s * 1e3:.2f} ms per iteration, {result.samples_per_s:.2f} samples/s, "
          f"bubble {result.bubble_fraction:.1%}")
    if len(result.iteration_times_s) > 1:
        print("iteration times (ms): " + " ".join(f"{t * 1e3:.1f}" for t in result.iteration_times_s))
    print(f"bottleneck: {result.bottleneck}")
    print("peak memory (GiB): " + ", ".join(f"{d} {b / 2**30:.2f}" for d, b in result.peak_memory_bytes.items()))
    for line in simulated_labels(model, cluster, runtime.name, args.profile):
        print(line)
    if args.timeline:
        _write_json(args.timeline, chrome_trace(result, plan))
        print(f"wrote {args.timeline} (Chrome trace; open in Perfetto)")
    if args.plot:
        plot_timeline(result, plan, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _simulate_replicas(args: argparse.Namespace, plan, cluster, model) -> int:
    """Plans with several replicas, or with stragglers: every strategy over time."""
    from deepcee.simulator.replica_trace import replica_chrome_trace
    from deepcee.simulator.replicas import describe_result, simulate_replicas

    stragglers = [straggler_flag(text, cluster.device_names) for text in args.straggler]
    result = simulate_replicas(plan, cluster, model, steps=args.iterations, stragglers=stragglers,
                               record=bool(args.timeline))
    print(f"plan {args.plan}: {plan.system}")
    for line in describe_result(result, plan, stragglers):
        print(line)
    for line in simulated_labels(model, cluster, "as the replica simulator models it", None):
        print(line)
    if args.timeline:
        _write_json(args.timeline, replica_chrome_trace(result, plan))
        print(f"wrote {args.timeline} (Chrome trace; open in Perfetto)")
    if args.plot:
        print("note: --plot draws one pipeline; use --timeline for plans with replicas or stragglers")
    return 0


def simulated_labels(model, cluster, runtime: str, profile_ref: str | None) -> list[str]:
    """What simulated figures rest on: a measured profile or datasheet figures, the memory terms,
    the runtime whose behaviour was assumed (every simulated figure says so)."""
    if model.is_measured:
        where = f"a measured profile ({profile_ref or model.source})"
    else:
        where = "datasheet figures (declared device speeds, FLOP-based layer costs)"
    memory = ("memory with the measured fixed overhead and allocator margin" if model.measured_memory
              else "memory of the plan's tensors and the runtime's buffers only (no measured device overhead)")
    lines = [f"all figures simulated on {where}; {memory}; runtime: {runtime}"]
    if cluster.emulation:
        lines.append(f"cluster figures from emulation: {cluster.emulation}")
    return lines


def _apply_trace(cluster, trace_ref: str, between: tuple[str, str] | None):
    """Put a bandwidth trace (built-in name or file) on the wide-area links, rescaled to each
    link's nominal speed (or only on the ``--trace-links a,b`` island pair)."""
    from deepcee.traces import load_named_trace, with_trace

    return with_trace(cluster, load_named_trace(trace_ref, field="--link-trace"), between=_trace_links(cluster, between))


def _trace_links(cluster, between: tuple[str, str] | None) -> list[tuple[str, str]] | None:
    """``--trace-links a,b`` as one pair of island, node or device names of ``cluster``."""
    if between is None:
        return None
    names = {d.name for d in cluster.devices} | {n.name for n in cluster.nodes} | {i.name for i in cluster.islands}
    for name in between:
        if name not in names:
            raise SpecError(f"no island, node or device called {name!r} in cluster {cluster.name!r} (islands: "
                            f"{', '.join(i.name for i in cluster.islands)})", field="--trace-links")
    return [between]


def _simulate_adaptive(args: argparse.Namespace, plan, cluster, model) -> int:
    from deepcee.adapter.simloop import compare_adaptation, plot_adaptation
    from deepcee.traces import load_named_trace

    if not args.link_trace:
        raise SpecError("--adapt needs --link-trace (a built-in trace name or a trace file)", field="--adapt")
    from deepcee.inputs.work import check_simulation

    trace = load_named_trace(args.link_trace, field="--link-trace")
    between = _trace_links(cluster, args.trace_links)
    iterations = max(args.iterations, 2)
    check_simulation(plan, iterations, runs=2)  # with and without the adapter
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
    model, _ = _load_model(args.model, args.profile, args, seq_len=args.seq_len, image_size=args.image_size)
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
    from deepcee.inputs.work import check_schedule
    from deepcee.schedule.builders import build_schedule
    from deepcee.schedule.passes import dry_run, format_table, in_flight_per_stage, validate

    check_schedule(args.stages, args.microbatches)
    sched = build_schedule(args.name, args.stages, args.microbatches)
    validate(sched)
    print(format_table(sched))
    s = args.stages
    dr = dry_run(sched, forward_s=[1.0] * s, input_grad_s=[1.0] * s, weight_grad_s=[1.0] * s,
                 comm_forward=[(0.0, 0.0)] * (s - 1), comm_backward=[(0.0, 0.0)] * (s - 1))
    print(f"unit costs (F = I = W = 1, no communication): makespan {dr.makespan_s:g}, "
          f"bubble {dr.bubble_fraction:.1%}, in-flight microbatches per stage {list(in_flight_per_stage(sched))}")
    return 0


def _check_net(name: str, *, own: bool = False) -> None:
    """``--model`` of the commands that run a net for real: a built-in one, or with ``own`` a
    model of your own as ``package.module:name`` (built and checked where it is loaded);
    checked before any worker starts."""
    from deepcee.nets import NET_NAMES
    from deepcee.userref import is_import_path

    if name in NET_NAMES or (own and is_import_path(name)):
        return
    own_too = ", or your own as package.module:name" if own else ""
    raise SpecError(f"unknown net {name!r} (known: {', '.join(NET_NAMES)}{own_too})", field="--model")


def cmd_profile(args: argparse.Namespace) -> int:
    import logging

    cluster, _ = _load_cluster(args.cluster, args.scenario)
    _check_net(args.model, own=True)
    from deepcee.profiler.run import profile_cluster
    from deepcee.train import model_and_data

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mode = "real devices and network" if args.real else f"emulated ({cluster.emulation or 'declared speeds'})"
    print(f"profiling {len(cluster.devices)} devices of {cluster.name} for {args.model}: {mode}")
    fields = model_and_data(args, args.model)
    quick = {}
    if args.quick:
        from deepcee.profiler.network import NetworkBudget
        from deepcee.profiler.probes import ProbeConfig

        # one device pair per node pair, two message sizes large enough to resolve a 100 Mbit/s
        # link's bandwidth; two microbatch sizes and three rounds per layer
        quick = {"network_budget": NetworkBudget(max_full_ranks=1, min_bytes=256 << 10, max_bytes=1 << 20, growth=4,
                                                 repeats=2, max_s_per_pair=8.0),
                 "device_config": ProbeConfig(microbatch_sizes=(1, 4), warmup=1, repeats=3, score_repeats=1)}
    result = profile_cluster(cluster, fields["model"], args.output, emulated=not args.real, deadline_s=args.deadline,
                             loss_fn=fields["loss_fn"], dataset=fields["dataset"], name=args.model, realnet=args.realnet, **quick)
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
    _check_net(args.model)
    from deepcee.profiler.fidelity import validate_cluster

    mode = args.mode
    if mode == "auto":
        from deepcee.runtime.realnet import realnet_unavailable

        mode = "emulated" if realnet_unavailable() else "realnet"
        print(f"mode {mode}" + (" (realnet unavailable here: figures partly modelled)" if mode == "emulated" else ""))
    validate_cluster(cluster, args.model, num_plans=args.plans, steps=args.steps, out_dir=args.output,
                     profile_dir=args.profile_dir, mode=mode)
    print(f"wrote {Path(args.output) / 'validate.json'}")
    return 0


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecError(f"must be comma-separated integers, got {text!r}", field=flag) from None


def cmd_calibrate(args: argparse.Namespace) -> int:
    import logging

    from deepcee.calibrate import CalibrationConfig, calibrate

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cluster, ref = _load_cluster(args.cluster, args.scenario, "local-small")
    profile, _ = _load_model(args.model, args.profile)
    cfg = CalibrationConfig(model=args.model, global_batch=args.global_batch, target_loss=args.target_loss,
                            eval_every=args.eval_every, max_steps=args.steps,
                            periods=_int_list(args.periods, "--periods"),
                            outer_optimizers=tuple(x for x in args.outer.split(",") if x), optimizer=args.optimizer,
                            lr=args.lr, seed=args.seed, out_dir=args.output, deadline_s=args.deadline)
    doc = calibrate(cluster, profile, cfg, cluster_ref=ref)
    ref_ = doc["reference"]
    print(f"reference (exact, global batch {ref_['global_batch']}): {ref_['samples_to_target']} samples "
          f"({ref_['steps_to_target']} steps) to evaluation loss {doc['target_loss']:g}")
    for e in doc["entries"]:
        s = e["strategy"]
        bound = "" if e["reached"] else "  (NOT reached: a lower bound)"
        print(f"model-averaging H={s['period']} {s['outer_optimizer']}: {e['samples_to_target']} samples, "
              f"multiplier x{e['multiplier']:.2f}{bound}")
    print(f"wrote {Path(args.output) / 'efficiency.json'} (use: deepcee plan --sync relaxed --efficiency ...)")
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
    if args.time_to_target:
        return _demo_time_to_target(args)
    from deepcee.demo import DemoConfig, format_report, run_demo

    model = args.model or "gpt-tiny"
    _check_net(model)
    cfg = DemoConfig(scenario=args.scenario, model=model, global_batch=args.global_batch, steps=args.steps,
                     out_dir=args.out, quick_profile=not args.full_profile)
    report = run_demo(cfg)
    print(format_report(report))
    return 0


def _demo_time_to_target(args: argparse.Namespace) -> int:
    """``deepcee demo --time-to-target``: the four systems trained to one target loss (:mod:`deepcee.ttt`)."""
    import logging

    from deepcee import ttt
    from deepcee.scenarios import load_scenario

    logging.basicConfig(level=logging.WARNING)
    model = args.model or "convnet-tiny"
    if model not in ttt.TASKS:
        raise SpecError(f"no time-to-target task for {model!r} (known: {', '.join(ttt.TASKS)})", field="--model")
    task = ttt.TASKS[model]
    cfg = ttt.TttConfig(model=model, global_batch=args.global_batch, target_loss=args.target_loss or
                        task["target_loss"], eval_every=task["eval_every"], max_steps=task["max_steps"],
                        lr=task["lr"], out_dir=args.out)
    print(f"time to target: {model} to evaluation loss {cfg.target_loss:g} on {args.scenario} (emulated): profile, "
          "plan (--sync relaxed), then train deepcee relaxed, deepcee sync, best single island, DDP ...")
    doc = ttt.run(load_scenario(args.scenario), cfg, cluster_ref=args.scenario, efficiency_file=args.efficiency)
    print(ttt.format_table(doc))
    print(f"wrote {Path(args.out) / 'report.json'}, {Path(args.out) / 'loss_vs_time.png'}")
    return 0


# ---------------------------------------------------------------------------------------


def _add_model_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--model", default=default,
                   help="built-in model name (see `deepcee models`), optionally name:key=value,..., or your own "
                   "model as package.module:name (with --data); needed unless --profile is given")
    p.add_argument("--profile", help="measured profile JSON (from `deepcee profile`) instead of the analytic one")
    p.add_argument("--seq-len", type=number(SEQ_LEN), help="sequence length for transformer models")
    p.add_argument("--image-size", type=number(IMAGE_SIZE), help="image side for convolutional models")
    p.add_argument("--data", help="with a model of your own (package.module:name): data to count its profile on "
                   "(a file or package.module:name, as for `deepcee train`)")
    p.add_argument("--loss", help="with a model of your own: its loss function, package.module:name")
    p.add_argument("--split-at", help="with a model of your own: comma-separated split points")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    one = p.add_mutually_exclusive_group()
    one.add_argument("--scenario", help="built-in cluster name (see `deepcee scenarios`)")
    one.add_argument("--cluster", help="cluster file (TOML, or JSON written by `deepcee profile`)")


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
    parser = OneLineParser(
        prog="deepcee",
        description="deepcee: plan, simulate and run training across cloud, edge and end devices over slow links.",
        epilog="Start with `deepcee demo` (the main job) or `deepcee scenarios`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the main job: profile, group, plan and train on an emulated cluster "
                       "(deepcee vs DDP vs 1F1B)")
    p.add_argument("--scenario", default="local-small")
    p.add_argument("--model", help="gpt-tiny (default) or resnet-tiny; with --time-to-target: convnet-tiny "
                   "(default) or gpt-tiny")
    p.add_argument("--global-batch", type=number(GLOBAL_BATCH), default=32)
    p.add_argument("--steps", type=number(DEMO_STEPS), default=20)
    p.add_argument("--out", default="reports/demo", help="report folder")
    p.add_argument("--full-profile", action="store_true", help="probe every device pair with the full budget")
    p.add_argument("--time-to-target", action="store_true",
                   help="train deepcee's relaxed all-island plan, synchronous deepcee, the best single island and "
                        "DDP to one target loss (default model convnet-tiny); report predicted vs measured")
    p.add_argument("--target-loss", type=number(TARGET_LOSS),
                   help="with --time-to-target: the target (default: the task's)")
    p.add_argument("--efficiency", help="with --time-to-target: a `deepcee calibrate` JSON (default: the "
                   "conservative default, not measured)")
    p.set_defaults(func=cmd_demo)

    from deepcee.train import DESCRIPTION, add_train_arguments

    p = sub.add_parser("train", help="train with a plan on local processes (torchrun: python -m deepcee.train)",
                       description=DESCRIPTION)
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("calibrate", help="measure relaxed strategies' samples to a target loss against exact "
                       "training (short real runs); writes the efficiency JSON the planner reads")
    _add_cluster_args(p)
    p.add_argument("--model", default="convnet-tiny", help="built-in net: gpt-tiny, resnet-tiny or convnet-tiny")
    p.add_argument("--profile", help="measured profile JSON for the layout search (default: the analytic one)")
    p.add_argument("--global-batch", type=number(GLOBAL_BATCH), default=32)
    p.add_argument("--target-loss", type=number(TARGET_LOSS), required=True,
                   help="evaluation loss every run trains to")
    p.add_argument("--eval-every", type=number(EVERY), default=10, help="evaluate every N steps (the granularity)")
    p.add_argument("--steps", type=number(STEPS), default=600, help="most steps of one run")
    p.add_argument("--periods", default="4,16", help="model-averaging periods H to measure (comma-separated)")
    p.add_argument("--outer", default="average", help="outer optimizers: average, nesterov or both (comma-separated)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=number(LR), default=1e-3)
    p.add_argument("--seed", type=number(SEED), default=0)
    p.add_argument("--deadline", type=number(DEADLINE), default=1800.0, help="seconds one run may take")
    p.add_argument("-o", "--output", default="reports/calibrate", help="folder for the runs and efficiency.json")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("export", help="write a checkpoint as one plain state_dict (.pt, and .safetensors when "
                       "installed) that loads into the model with strict=True")
    p.add_argument("checkpoint", help="run folder, checkpoint folder, or one step-N folder (default: the newest intact)")
    p.add_argument("-o", "--output", default="model.pt", help="state_dict file (torch.save); .safetensors beside it")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("profile", help="measure every device (per-layer F/I/W) and link of a cluster")
    _add_cluster_args(p)
    from deepcee.train import add_model_data_arguments

    add_model_data_arguments(p, model_help="net to time per layer: gpt-tiny, resnet-tiny (default), or your own "
                             "(package.module:name, with --data)")
    p.set_defaults(model="gpt-tiny", seed=0)
    p.add_argument("-o", "--output", default="measured", help="output folder (cluster.json, profile.json, ...)")
    p.add_argument("--real", action="store_true", help="measure the real transport instead of emulated links "
                   "and devices")
    p.add_argument("--deadline", type=number(DEADLINE), default=900.0, help="hard limit for the whole profile, seconds")
    p.add_argument("--quick", action="store_true", help="a small probe budget (two microbatch sizes, three rounds; "
                   "one device pair per node pair, two message sizes): a first look in about a minute")
    p.add_argument("--realnet", action="store_true", help="probe the links as real TCP through the shaping relay "
                   "(emulated devices; root and /dev/net/tun)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("group", help="print the two-level groups (islands by network, groups by speed)")
    p.add_argument("cluster_file", nargs="?", help="cluster file (TOML, or cluster.json from `deepcee profile`)")
    p.add_argument("--scenario", help="built-in cluster instead of a file")
    p.add_argument("--island-threshold-ms", type=number(THRESHOLD_MS), default=10.0,
                   help="devices whose 1 MB transfer takes longer than this are in different islands")
    p.add_argument("--speed-ratio", type=number(RATIO), default=1.5,
                   help="a speed gap above this ratio separates groups inside an island")
    p.set_defaults(func=cmd_group)

    p = sub.add_parser("validate", help="run several plans for real on the emulated cluster and compare "
                       "with the simulator")
    _add_cluster_args(p)
    p.add_argument("--model", default="gpt-tiny", help="gpt-tiny or resnet-tiny")
    p.add_argument("--plans", type=number(PLANS), default=8, help="number of different plans to run")
    p.add_argument("--steps", type=number(DEMO_STEPS), default=6, help="steps per plan (the first is warm-up)")
    p.add_argument("--profile-dir", help="reuse cluster.json/profile.json from `deepcee profile` instead of "
                   "profiling first")
    p.add_argument("--mode", choices=("auto", "realnet", "emulated"), default="auto",
                   help="realnet: real TCP through the shaping relay (needs root and /dev/net/tun); emulated: the "
                   "runtime's link shaper and modelled all-reduce (partly modelled); auto: realnet where possible")
    p.add_argument("-o", "--output", default="reports/validate")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("scenarios", help="list built-in clusters")
    p.set_defaults(func=cmd_scenarios)
    p = sub.add_parser("models", help="list built-in model profiles")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("plan", help="plan training of a model on a cluster")
    _add_cluster_args(p)
    _add_model_args(p)
    p.add_argument("--global-batch", type=number(GLOBAL_BATCH), required=True)
    p.add_argument("--schedules", type=name_list(SCHEDULES),
                   help="comma-separated schedules the planner may use (default: all)")
    _add_sync_args(p)
    p.add_argument("--objective", choices=("time", "cost"), default="time",
                   help="time: fastest predicted time to target; cost: fewest dollars per sync-equivalent epoch "
                        "(needs prices in the cluster file)")
    p.add_argument("--budget", type=number(BUDGET), help="with --objective cost: the fastest plan within this many "
                   "dollars per sync-equivalent epoch")
    p.add_argument("--dataset-samples", type=number(DATASET_SAMPLES), help="samples per epoch (default: the data the "
                   "cluster file states over the model's input bytes per sample)")
    p.add_argument("--epochs", type=number(EPOCHS), default=1, help="epochs the one-time data movement is spread over")
    p.add_argument("-o", "--output", default="plan.json")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="simulate a plan: iteration time, bubbles, memory, timeline")
    p.add_argument("plan")
    p.add_argument("--cluster", help="cluster file (default: the plan's scenario)")
    p.add_argument("--profile", help="measured profile JSON (default: the plan's model)")
    p.add_argument("--iterations", type=number(ITERATIONS), default=1)
    p.add_argument("--link-trace", help="bandwidth trace (built-in name such as drop-5x, or a JSON file) "
                   "applied to the inter-island links")
    p.add_argument("--adapt", action="store_true",
                   help="simulate iteration by iteration with and without the adapter (needs --link-trace)")
    p.add_argument("--json", help="with --adapt: write the per-iteration results as JSON")
    p.add_argument("--trace-links", type=name_pair, help="apply the trace only between these two islands: a,b")
    p.add_argument("--timeline", help="write a Chrome-trace JSON timeline")
    p.add_argument("--plot", help="write a PNG timeline")
    p.add_argument("--straggler", action="append", default=[], metavar="DEVICE:FACTOR[:START[:STOP]]",
                   help="slow DEVICE down FACTOR times from START to STOP (simulated seconds; default the whole "
                        "run); repeatable")
    p.add_argument("--runtime", choices=("deepcee", "deepspeed"), default="deepcee",
                   help="simulate the plan as run by deepcee's runtime or a DeepSpeed-style one (blocking in-stream "
                   "sends, gradient clipping, a collective at every step's end)")
    p.add_argument("--mode", choices=("realnet", "emulated", "real"), default="realnet",
                   help="deepcee's launch mode whose behaviour to assume (default realnet: records out of band)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("compare", help="deepcee vs baselines vs the upper bound on one cluster")
    _add_cluster_args(p)
    _add_model_args(p)
    p.add_argument("--global-batch", type=number(GLOBAL_BATCH), required=True)
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
    q.add_argument("--stages", type=number(STAGES), default=4)
    q.add_argument("--microbatches", type=number(MICROBATCHES), default=8)
    q.set_defaults(func=cmd_schedule_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``deepcee`` with ``argv``; returns the exit code (2 for any bad input, one line on stderr)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error, already printed in one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if getattr(args, "config", None):  # a job config: its values become defaults, flags override them
            from deepcee.jobconfig import parse_with_config

            args = parse_with_config(parser, argv, train_parser=_subparser(parser, args.command))
        return func(args)
    except SystemExit as exc:  # a usage error on the second parse (with a job config's defaults)
        return exc.code if isinstance(exc.code, int) else 2
    except DeepceeError as exc:
        print(f"deepcee {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"deepcee {args.command}: interrupted", file=sys.stderr)
        return 130


def one_line(exc: BaseException) -> str:
    """An error's message on one line (messages quote values with repr; this is the last guard)."""
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
