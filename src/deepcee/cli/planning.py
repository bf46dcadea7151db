"""The sub-commands that plan and simulate (no torch): scenarios, models, plan, simulate, compare,
schedule show, group.
"""

from __future__ import annotations

import argparse

from deepcee.cli.common import (
    _efficiency,
    _figures,
    _fmt_est,
    _load_cluster,
    _load_model,
    _progress,
    _progress_printer,
    _write_json,
)
from deepcee.cliargs import (
    split_name_pair,
    straggler_flag,
)
from deepcee.errors import SpecError


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


def cmd_plan(args: argparse.Namespace) -> int:
    cluster, cluster_ref = _load_cluster(args.cluster, args.scenario)
    model, model_ref = _load_model(args.model, args.profile, args, seq_len=args.seq_len, image_size=args.image_size)
    from deepcee.planner.options import PlannerOptions
    from deepcee.planner.replicas import plan_with_sync

    if args.budget is not None and args.objective != "cost":
        raise SpecError("--budget needs --objective cost", field="--budget")
    looks_off = {"polish_budget": 0, "second_look": False, "walk_budget": 0, "count_look": False}
    options = PlannerOptions(progress=_progress_printer(), **(looks_off if args.no_polish else {}),
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
    from deepcee.simulator.runtime_model import on_gpus, runtime_model

    # default: deepcee's runtime on the cluster's devices, as the planner planned it
    name = args.runtime or ("deepcee-cuda" if on_gpus(cluster, model) else "deepcee")
    runtime = runtime_model(name, mode=args.mode)
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


def _trace_links(cluster, text: str | None) -> list[tuple[str, str]] | None:
    """``--trace-links a,b`` as one pair of island, node or device names of ``cluster`` (a name
    may hold a comma: the pair is split where both sides are names)."""
    if text is None:
        return None
    names = {d.name for d in cluster.devices} | {n.name for n in cluster.nodes} | {i.name for i in cluster.islands}
    try:
        between = split_name_pair(text, names)
    except ValueError as err:
        raise SpecError(str(err), field="--trace-links") from None
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
                         efficiency=_efficiency(args.efficiency), progress=_progress_printer())
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


def cmd_group(args: argparse.Namespace) -> int:
    from deepcee.planner.grouping import group_devices

    cluster, _ = _load_cluster(args.cluster_file, args.scenario)
    grouping = group_devices(cluster, island_threshold_s=args.island_threshold_ms * 1e-3,
                             speed_ratio=args.speed_ratio)
    print(grouping.describe(), end="")
    return 0
