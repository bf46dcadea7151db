"""Command-line interface: thin. Each subcommand parses, loads, calls one library function, writes.

Run ``deepcee --help``. Any :class:`deepcee.errors.DeepceeError` becomes one line on stderr
and exit code 2; nothing is written when a command fails (outputs are written atomically
after the work succeeded).

The parser and ``main`` live here; the sub-commands in :mod:`deepcee.cli.planning` (plan and
simulate, torch-free) and :mod:`deepcee.cli.running` (run nets), their shared loading in
:mod:`deepcee.cli.common`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from deepcee.cli.planning import (
    cmd_compare,
    cmd_group,
    cmd_models,
    cmd_plan,
    cmd_scenarios,
    cmd_schedule_show,
    cmd_simulate,
)
from deepcee.cli.running import (
    cmd_calibrate,
    cmd_demo,
    cmd_export,
    cmd_profile,
    cmd_train,
    cmd_validate,
)
from deepcee.cliargs import (
    BASELINE_CAP,
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
    out_path,
)
from deepcee.errors import DeepceeError
from deepcee.mainjob import DEFAULT_PERIODS
from deepcee.plan import SCHEDULES


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

    p = sub.add_parser("demo", help="the main job: profile, calibrate, plan (--sync relaxed) and train four systems "
                       "to one target loss on an emulated cross-region cluster; --throughput: the samples/s demo")
    p.add_argument("--scenario", default="local-small")
    p.add_argument("--model", help="gpt-tiny (default) or convnet-tiny; with --throughput: gpt-tiny (default) or "
                   "resnet-tiny")
    p.add_argument("--global-batch", type=number(GLOBAL_BATCH), default=32)
    p.add_argument("--out", type=out_path(folder=True), default="reports/demo", help="report folder")
    p.add_argument("--target-loss", type=number(TARGET_LOSS), help="the target evaluation loss (default: the task's)")
    p.add_argument("--links", choices=("auto", "realnet", "emulated"), default="auto",
                   help="links while training: auto (default) = realnet (real TCP through the shaping relay) where "
                        "the host allows it, else emulated (labelled as the fallback)")
    p.add_argument("--periods", default=",".join(map(str, DEFAULT_PERIODS)),
                   help="model-averaging periods H to calibrate (comma-separated)")
    p.add_argument("--efficiency", help="a `deepcee calibrate` JSON to use instead of calibrating")
    p.add_argument("--baseline-cap", type=number(BASELINE_CAP), default=4.0,
                   help="exact systems predicted to need more than this x the fastest prediction stop after that "
                        "long and their time to target is projected (labelled); 0: train every system to the target")
    p.add_argument("--throughput", action="store_true",
                   help="the former main job: samples/s of deepcee vs DDP vs 1F1B over --steps steps")
    p.add_argument("--steps", type=number(DEMO_STEPS), default=20, help="with --throughput: steps per system")
    p.add_argument("--full-profile", action="store_true",
                   help="with --throughput: probe every device pair with the full budget")
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
    p.add_argument("--overlap", choices=("off", "on", "both"), default="off",
                   help="blocking averages (off), overlapped ones applied one period late (on), or both")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=number(LR), default=1e-3)
    p.add_argument("--seed", type=number(SEED), default=0)
    p.add_argument("--deadline", type=number(DEADLINE), default=1800.0, help="seconds one run may take")
    p.add_argument("-o", "--output", type=out_path(folder=True), default="reports/calibrate", help="folder for the runs and efficiency.json")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("export", help="write a checkpoint as one plain state_dict (.pt, and .safetensors when "
                       "installed) that loads into the model with strict=True")
    p.add_argument("checkpoint", help="run folder, checkpoint folder, or one step-N folder (default: the newest intact)")
    p.add_argument("-o", "--output", type=out_path(), default="model.pt", help="state_dict file (torch.save); .safetensors beside it")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("profile", help="measure every device (per-layer F/I/W) and link of a cluster")
    _add_cluster_args(p)
    from deepcee.train import add_model_data_arguments

    add_model_data_arguments(p, model_help="net to time per layer: gpt-tiny, resnet-tiny (default), or your own "
                             "(package.module:name, with --data)")
    p.set_defaults(model="gpt-tiny", seed=0)
    p.add_argument("-o", "--output", type=out_path(folder=True), default="measured", help="output folder (cluster.json, profile.json, ...)")
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
    p.add_argument("-o", "--output", type=out_path(folder=True), default="reports/validate")
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
    p.add_argument("--no-polish", action="store_true", help="skip the layout polish (a local search over the best "
                   "plan's islands, stage counts and microbatch size), the second look (the granularity climbs "
                   "with two-island moves, searched on their own), the chain walk (islands and their order, "
                   "searched on their own) and the count look (a second island search with stages in proportion "
                   "to speed, searched on its own); faster, sometimes a slower plan")
    p.add_argument("-o", "--output", type=out_path(), default="plan.json")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="simulate a plan: iteration time, bubbles, memory, timeline")
    p.add_argument("plan")
    p.add_argument("--cluster", help="cluster file (default: the plan's scenario)")
    p.add_argument("--profile", help="measured profile JSON (default: the plan's model)")
    p.add_argument("--data", help="when the plan's model is your own (package.module:name): data to count its "
                   "profile on, as for `deepcee plan`")
    p.add_argument("--loss", help="with a model of your own: its loss function, package.module:name")
    p.add_argument("--split-at", help="with a model of your own: comma-separated split points")
    p.add_argument("--seq-len", type=number(SEQ_LEN), help="with a model of your own: the sequence length of --data")
    p.add_argument("--iterations", type=number(ITERATIONS), default=1)
    p.add_argument("--link-trace", help="bandwidth trace (built-in name such as drop-5x, or a JSON file) "
                   "applied to the inter-island links")
    p.add_argument("--adapt", action="store_true",
                   help="simulate iteration by iteration with and without the adapter (needs --link-trace)")
    p.add_argument("--json", type=out_path(), help="with --adapt: write the per-iteration results as JSON")
    p.add_argument("--trace-links", type=name_pair, help="apply the trace only between these two islands: a,b")
    p.add_argument("--timeline", type=out_path(), help="write a Chrome-trace JSON timeline")
    p.add_argument("--plot", type=out_path(), help="write a PNG timeline")
    p.add_argument("--straggler", action="append", default=[], metavar="DEVICE:FACTOR[:START[:STOP]]",
                   help="slow DEVICE down FACTOR times from START to STOP (simulated seconds; default the whole "
                        "run); repeatable")
    p.add_argument("--runtime", choices=("deepcee", "deepcee-cuda", "deepspeed"), default=None,
                   help="simulate the plan as run by deepcee's runtime on CPU/gloo, on CUDA (receives in order), or "
                   "a DeepSpeed-style one (blocking in-stream sends, gradient clipping, a collective at every "
                   "step's end); default: deepcee's on the cluster's devices (CUDA for GPUs)")
    p.add_argument("--mode", choices=("realnet", "emulated", "real"), default="realnet",
                   help="deepcee's launch mode whose behaviour to assume (default realnet: records out of band)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("compare", help="deepcee vs baselines vs the upper bound on one cluster")
    _add_cluster_args(p)
    _add_model_args(p)
    p.add_argument("--global-batch", type=number(GLOBAL_BATCH), required=True)
    p.add_argument("--json", type=out_path(), default="compare.json")
    p.add_argument("--plot", type=out_path(), default="crossover.png", help="crossover PNG (written when leaving devices out wins)")
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
