"""Train a plan for real: ``deepcee train`` (local processes) or ``python -m deepcee.train`` under torchrun.

One machine, emulated devices and links (the default; one process per device of the plan)::

    deepcee plan --model gpt-tiny --scenario local-small -o plan.json
    deepcee train --plan plan.json --steps 50 --run-dir runs/gpt
    deepcee train --plan plan.json --steps 60 --adapt --link-trace drop-5x   # links change mid-run
    deepcee train --config examples/job.toml --steps 100                    # a job config; flags override

Several machines (``mode real``; every node needs the same plan and cluster files; each node's
processes run the devices of the cluster node(s) mapped to it, [Note: machine mapping] in
:mod:`deepcee.runtime.machines`)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m deepcee.train --plan plan.json --cluster cluster.toml --mode real --cuda --cluster-node cloud0

``--dry-run`` prints the lowered schedule each stage will run and exits. Metrics go to
``<run-dir>/metrics.jsonl`` (one JSON object per step), the summary to ``<run-dir>/result.json``.

This module and :mod:`deepcee.cli` are the entry points (they print; the library does not).
``deepcee train`` is the sub-command of :mod:`deepcee.cli` built from :func:`add_train_arguments`
and run by :func:`train`; ``python -m deepcee.train`` parses the same options itself, so torchrun
needs nothing else. Both build one :class:`~deepcee.runtime.job.Job` (plan, cluster and
:class:`~deepcee.runtime.job.TrainConfig` objects) and hand it to a launcher.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepcee.cliargs import (
    CLIP_NORM,
    CORES,
    DEADLINE,
    EVAL_BATCHES,
    EVERY,
    GLOBAL_BATCH,
    KEEP,
    LR,
    MIN_LR_RATIO,
    MOMENTUM,
    SCALE,
    SEED,
    STEPS,
    TARGET_LOSS,
    TIMEOUT,
    WEIGHT_DECAY,
    OneLineParser,
    link_down_flag,
    name_list,
    number,
    out_path,
    straggler_flag,
)
from deepcee.errors import DeepceeError, SpecError
from deepcee.inputs.limits import SEQ_LEN
from deepcee.plan import SCHEDULES

if TYPE_CHECKING:
    from deepcee.cluster import Cluster
    from deepcee.plan import Plan
    from deepcee.profile import ModelProfile
    from deepcee.runtime.dist import TorchrunEnv
    from deepcee.runtime.job import Job, TrainConfig
    from deepcee.runtime.records import TrainResult

DESCRIPTION = __doc__.split("\n")[0]
log = logging.getLogger("deepcee.train")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``deepcee train`` and ``python -m deepcee.train`` (one definition for both;
    each also has a ``[section] key`` in a job config, :data:`deepcee.jobconfig.FIELDS`)."""
    p.add_argument("--config", help="job config (TOML): the defaults of every option below; flags given override it "
                   "(docs/file-formats.md, examples/job.toml)")
    p.add_argument("--plan", help="plan.json written by `deepcee plan` (without it: --global-batch plans one)")
    p.add_argument("--cluster", help="cluster file or scenario name (default: the plan's cluster scenario)")
    p.add_argument("--global-batch", type=number(GLOBAL_BATCH),
                   help="no --plan: plan for this global batch first (local launch only)")
    p.add_argument("--schedules", type=name_list(SCHEDULES), help="no --plan: comma-separated schedules the planner "
                   "may use")
    p.add_argument("--steps", type=number(STEPS), default=20)
    p.add_argument("--mode", choices=("emulated", "real", "realnet"), default="emulated",
                   help="emulated: devices and links emulated in-process; realnet: devices emulated, each in its "
                   "own network namespace, links shaped by a user-space relay carrying real TCP (needs root and "
                   "/dev/net/tun; local processes only); real: as fast as the hardware goes (torchrun, CUDA)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--autocast", choices=("bfloat16", "float16"), help="mixed precision on CUDA (needs --cuda)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=number(LR), default=1e-3)
    p.add_argument("--momentum", type=number(MOMENTUM), default=0.0)
    p.add_argument("--weight-decay", type=number(WEIGHT_DECAY), default=0.0)
    p.add_argument("--lr-schedule", choices=("constant", "linear", "cosine"), default="constant",
                   help="the learning rate after the warm-up")
    p.add_argument("--warmup-steps", type=number(EVERY), default=0, help="linear warm-up from lr/W to lr over W steps")
    p.add_argument("--min-lr-ratio", type=number(MIN_LR_RATIO), default=0.0, help="floor of linear and cosine decay, x lr")
    p.add_argument("--decay-steps", type=number(STEPS), help="steps of the decay (default: the rest of the run)")
    p.add_argument("--clip-grad-norm", type=number(CLIP_NORM), help="clip the gradient to this global norm (over every stage)")
    p.add_argument("--seed", type=number(SEED), default=0)
    p.add_argument("--cores", type=number(CORES), default=1.2, help="CPU cores the emulated devices may use together")
    p.add_argument("--run-dir", type=out_path(folder=True), default="runs/train")
    p.add_argument("--checkpoint-every", type=number(EVERY), default=0, help="checkpoint every N steps (and after the last)")
    p.add_argument("--keep-checkpoints", type=number(KEEP), default=2, help="intact checkpoints kept (0: all)")
    p.add_argument("--checkpoint-dir", type=out_path(folder=True), help="checkpoint folder (default: <run-dir>/checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint, under this run's plan (any split)")
    p.add_argument("--init-from", help="start from these weights: a state_dict file (.pt, .safetensors) with the "
                   "model's own names, or a checkpoint folder")
    p.add_argument("--eval-every", type=number(EVERY), default=0, help="held-out loss every N steps (0: never)")
    p.add_argument("--eval-batches", type=number(EVAL_BATCHES), default=4, help="held-out global batches per evaluation")
    p.add_argument("--target-loss", type=number(TARGET_LOSS), default=None,
                   help="stop at the first evaluation whose loss is <= this and report the time to it "
                        "(needs --eval-every; --steps stays the cap)")
    p.add_argument("--probes", action=argparse.BooleanOptionalAction, default=None,
                   help="model averaging: also evaluate the replicas' average (off the clock, training untouched) "
                        "at multiples of --eval-every between averages, as probe_loss (default: on with "
                        "--eval-every for blocking model averaging)")
    p.add_argument("--log-every", type=number(EVERY), default=10, help="a progress line every N steps (0: none)")
    p.add_argument("--tensorboard", action="store_true", help="TensorBoard scalars in <run-dir>/tensorboard")
    p.add_argument("--timeout", type=number(TIMEOUT), default=120.0, help="seconds any receive or collective may wait")
    p.add_argument("--deadline", type=number(DEADLINE), default=3600.0, help="local launch: hard limit for the whole run")
    p.add_argument("--cuda", action="store_true", help="use CUDA + NCCL (mode real); an error without CUDA")
    p.add_argument("--cluster-node", help="torchrun: the cluster node(s) this machine runs, NAME[,NAME] (default: by the "
                   "cluster file's host or node_rank)")
    p.add_argument("--trace", action="store_true", help="record every action's start and end in the metrics")
    p.add_argument("--dry-run", action="store_true", help="print each stage's lowered schedule and exit")
    p.add_argument("--link-trace", help="bandwidth trace on the emulated wide-area links: a built-in name "
                   "(drop-5x, drop-recover, periodic, ramp, noisy-stationary) or a trace file")
    p.add_argument("--trace-time-scale", type=number(SCALE), default=1.0,
                   help="stretch the trace's times by this factor (emulated seconds)")
    p.add_argument("--adapt", action="store_true",
                   help="watch link speed from the runtime's own transfers and re-tune or re-plan when it changes")
    p.add_argument("--elastic", action="store_true",
                   help="local launches: when a device's process dies or hangs, the others re-plan without it "
                        "and go on (docs/running.md, Faults); one process per device of the plan")
    p.add_argument("--restart-after", type=float, default=None, metavar="SECONDS",
                   help="with --elastic: start a lost device's process again after SECONDS; it rejoins at a "
                        "step boundary")
    p.add_argument("--straggler", action="append", default=[], metavar="DEVICE:FACTOR[:START[:STOP]]",
                   help="emulated modes: slow DEVICE down FACTOR times from START to STOP (emulated seconds "
                        "since training started; default the whole run); repeatable")
    p.add_argument("--link-down", action="append", default=[], metavar="NODE_A:NODE_B@START[:STOP]",
                   help="mode emulated: the link between two nodes carries nothing from START to STOP (emulated "
                        "seconds since training started; no STOP: it never comes back; a fault to test "
                        "--elastic with); repeatable")
    p.add_argument("--profile", help="measured profile.json for planning and the adapter's predictions "
                   "(default: analytic)")
    add_model_data_arguments(p)


def add_model_data_arguments(p: argparse.ArgumentParser, *, model_help: str | None = None) -> None:
    """The model and data options (``deepcee train``, ``python -m deepcee.train``, ``deepcee profile``)."""
    p.add_argument("--model", help=model_help or "a built-in net (gpt-tiny, resnet-tiny; default: the plan's model) "
                   "or your own: package.module:name, a module, a list of blocks or a callable returning one (or "
                   "(model, loss_fn)); HuggingFace GPT-2, Llama and BERT models split by themselves")
    p.add_argument("--data", help="training data: package.module:name (a Dataset, IterableDataset, DataLoader or a "
                   "callable returning one) or a file: .pt/.npy/.npz (inputs and targets, or token ids), or text")
    p.add_argument("--eval-data", type=str, help="evaluation data: a fraction (0.1) or a count of samples held out of --data, "
                   "or a dataset as for --data")
    p.add_argument("--seq-len", type=number(SEQ_LEN), help="tokens per sample when --data is a token stream or text (default 64)")
    p.add_argument("--loss", help="loss function package.module:name (default: the model's, e.g. a HuggingFace LM's)")
    p.add_argument("--split-at", help="comma-separated submodule names where a new block begins (split points)")
    p.add_argument("--no-shuffle", action="store_true", help="read a map-style dataset in order every epoch")


def train(args: argparse.Namespace) -> int:
    """Run ``deepcee train`` with parsed ``args``: local processes, or this rank under torchrun.

    Raises :class:`~deepcee.errors.DeepceeError` on bad input (the callers print it)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from deepcee.runtime import dist as rdist

    env = rdist.torchrun_env()
    plan, cluster = _load(args, under_torchrun=env is not None)
    if args.dry_run:
        from deepcee.runtime.partition import replica_plan
        from deepcee.schedule.passes import format_table
        from deepcee.schedule.program import lowered_schedule

        for r in range(plan.num_replicas):
            if plan.num_replicas > 1:
                print(f"replica {r}:")
            print(format_table(lowered_schedule(replica_plan(plan, r))))
        return 0
    if args.elastic and env is not None:
        # torchrun's agent answers a worker's death by stopping and restarting every worker of the
        # job (its own elasticity), so the survivors could not go on; see docs/running.md
        raise DeepceeError("--elastic runs on local processes, not under torchrun (torchrun restarts every "
                           "worker when one dies, where --elastic keeps the survivors training)")
    if (args.adapt or args.link_trace) and env is not None:
        raise DeepceeError("--adapt and --link-trace run on local processes, not under torchrun")
    if args.restart_after is not None and not args.elastic:
        raise SpecError("--restart-after needs --elastic", field="--restart-after")
    if args.restart_after is not None and not 0 <= args.restart_after < 3600:
        raise SpecError(f"must be in [0, 3600) seconds, got {args.restart_after!r}", field="--restart-after")
    if args.cuda:
        rdist.check_cuda()
    job = _job(args, plan, cluster, run_id=env.run_id if env is not None else "")
    if env is None:
        from deepcee.runtime.launch import launch_jobs

        elastic = None
        if args.elastic:
            from deepcee.runtime.supervise import Elastic

            elastic = Elastic(restart_after_s=args.restart_after)
        result = launch_jobs([job], deadline_s=args.deadline, elastic=elastic)[0]
    else:
        result = _torchrun_rank(args, env, job)
    if result is not None:  # rank 0, or the local launcher
        _summary(result, args)
    return 0


def _torchrun_rank(args: argparse.Namespace, env: TorchrunEnv, job: Job) -> TrainResult | None:
    """This process under torchrun: map it to its device ([Note: machine mapping]), then train."""
    from deepcee.runtime import dist as rdist
    from deepcee.runtime.machines import format_table
    from deepcee.runtime.rank import run_jobs_on_rank

    store = rdist.tcp_store(env, args.timeout)
    nodes = tuple(n for n in (args.cluster_node or "").split(",") if n)
    me, table = rdist.map_torchrun_rank(env, store, job.cluster, job.rank_devices(), nodes=nodes,
                                        source=job.cluster.source or job.cluster.name, timeout_s=args.timeout)
    if me.rank == 0:
        stage_of = {d: s for s, st in enumerate(job.plan.stages) for d in st.devices}
        log.info("devices of %d torchrun processes:\n%s", len(table), "\n".join(format_table(table, stage_of)))
        if me.mapped_by == "rank order":
            log.warning("no --cluster-node, host or node_rank: devices follow torchrun's rank order, which c10d "
                        "rendezvous gives in the order machines join (docs/running.md, Several machines)")
    (result,) = run_jobs_on_rank([job], me.rank, env.world_size, store, local_rank=env.local_rank,
                                 node=me.node, launcher_rank=env.rank)
    return result


def _load(args: argparse.Namespace, *, under_torchrun: bool = False) -> tuple[Plan, Cluster]:
    from deepcee.cluster import load_cluster
    from deepcee.planfile import load_plan, referenced_path
    from deepcee.scenarios import load_scenario, scenario_names

    if args.plan:
        plan = load_plan(args.plan)
        ref = args.cluster or (plan.cluster if plan.cluster in scenario_names()
                               else referenced_path(plan.cluster, args.plan))
    elif args.global_batch is not None:
        ref = args.cluster or "local-small"
        plan = None
    else:
        raise SpecError("give --plan (a plan file), or --global-batch to plan first", field="--plan")
    if Path(ref).exists() or (args.cluster and ref not in scenario_names()):
        cluster = load_cluster(ref)
    elif ref in scenario_names():
        cluster = load_scenario(ref)
    else:  # the plan's own cluster reference
        raise SpecError(f"unknown scenario or cluster file {ref!r} (scenarios: {', '.join(scenario_names())}; "
                        "or give --cluster)", file=args.plan, field="cluster")
    if plan is None:
        plan = _plan_now(args, cluster, ref, under_torchrun=under_torchrun)
    return plan, cluster


def _plan_now(args: argparse.Namespace, cluster: Cluster, cluster_ref: str, *, under_torchrun: bool) -> Plan:
    """A plan for ``--global-batch`` on the cluster (written to ``<run-dir>/plan.json``)."""
    if under_torchrun:
        raise SpecError("under torchrun every machine must train one plan: write it with `deepcee plan` and "
                        "give the same --plan file to every node", field="--plan")
    if not args.model:
        raise SpecError("planning needs the model: give --model (or [model] name)", field="--model")
    from deepcee.models import get_model
    from deepcee.plan import save_json_atomic
    from deepcee.planner.search import PlannerOptions, plan_training
    from deepcee.profile import load_profile
    from deepcee.userref import is_import_path

    if args.profile:
        profile = load_profile(args.profile)
    elif is_import_path(args.model):
        profile = counted_profile(args.model, args)
    else:
        profile = get_model(args.model)
    options = PlannerOptions(**({"schedules": tuple(args.schedules.split(","))} if args.schedules else {}))
    plan = plan_training(cluster, profile, args.global_batch, options=options).plan
    plan = plan.replace(cluster=cluster_ref, model=args.model)
    path = Path(args.run_dir) / "plan.json"
    save_json_atomic(path, plan.to_dict())
    log.info("planned %s on %s for a global batch of %d: %d stages, schedule %s (%s)", args.model, cluster.name,
             args.global_batch, plan.num_stages, plan.schedule, path)
    return plan


def counted_profile(ref: str, args: argparse.Namespace) -> ModelProfile:
    """The profile of a user's model (``package.module:name``) counted from its blocks on
    ``--data`` (:func:`deepcee.api.profile`), for planning it."""
    if not getattr(args, "data", None):
        raise SpecError(f"a model of your own ({ref}) needs --data to count its profile on (or give --profile)",
                        field="--data")
    from deepcee import api
    from deepcee.runtime.datafiles import load_data
    from deepcee.userref import import_object

    loss = import_object(args.loss, what="--loss") if getattr(args, "loss", None) else None
    points = tuple(p for p in (getattr(args, "split_at", None) or "").split(",") if p)
    try:
        return api.profile(ref, load_data(args.data, seq_len=getattr(args, "seq_len", None)), loss_fn=loss,
                           points=points)
    except SpecError as exc:
        if exc.field != "loss_fn":
            raise
        raise SpecError(f"{ref}: {str(exc).removeprefix('loss_fn: ').replace('pass loss_fn', 'give --loss')}",
                        field="--loss") from None


def _config(args: argparse.Namespace, cluster: Cluster | None = None) -> TrainConfig:
    """The training config of ``args`` (``--straggler`` names devices of ``cluster``)."""
    from deepcee.cluster.stragglers import Straggler
    from deepcee.runtime.job import OptimizerConfig, TrainConfig
    from deepcee.runtime.lr import LRSchedule

    return TrainConfig(
        stragglers=tuple(straggler_flag(text, cluster.device_names if cluster else (), Straggler.parse)
                         for text in args.straggler),
        link_outages=tuple(link_down_flag(text, sorted({d.node for d in cluster.devices}) if cluster else ())
                           for text in args.link_down),
        steps=args.steps, seed=args.seed, dtype=args.dtype, mode=args.mode, cores=args.cores,
        optimizer=OptimizerConfig(name=args.optimizer, lr=args.lr, momentum=args.momentum,
                                  weight_decay=args.weight_decay),
        lr_schedule=LRSchedule(kind=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr_ratio=args.min_lr_ratio,
                               decay_steps=args.decay_steps),
        clip_grad_norm=args.clip_grad_norm, autocast=args.autocast,
        timeout_s=args.timeout, checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
        resume=args.resume, init_from=args.init_from, eval_every=args.eval_every, eval_batches=args.eval_batches,
        target_loss=args.target_loss, probes=args.probes,
        log_every=args.log_every, tensorboard=args.tensorboard, trace=args.trace, use_cuda=args.cuda,
    )


def model_and_data(args: argparse.Namespace, default_model: str) -> dict[str, Any]:
    """The job's ``model``, ``loss_fn`` and ``dataset`` from ``--model``, ``--data``, ``--eval-data``,
    ``--seq-len``, ``--loss``, ``--split-at``: a built-in net travels by name; a user's model is
    built here, seeded by ``--seed`` (under torchrun every rank builds it, and start-up checks they
    agree)."""
    from deepcee import nets
    from deepcee.nets.split import build_user_model
    from deepcee.runtime.datafiles import load_data
    from deepcee.userref import import_object

    ref = args.model or default_model
    data = None
    if args.data is not None:
        data = load_data(args.data, seq_len=args.seq_len, seed=args.seed, shuffle=not args.no_shuffle,
                         eval=_eval_ref(args))
    loss = import_object(args.loss, what="--loss") if args.loss else None
    if ref in nets.NET_NAMES:
        return {"model": ref, "loss_fn": loss, "dataset": data}
    if data is None:
        raise DeepceeError(f"--model {ref}: a model of your own needs --data")
    points = tuple(p for p in (args.split_at or "").split(",") if p)
    split = build_user_model(ref, seed=args.seed, points=points)
    loss = loss or split.loss_fn
    if loss is None:
        raise DeepceeError(f"--model {ref}: the model ({split.how}) has no default loss; give --loss")
    return {"model": list(split.blocks), "loss_fn": loss, "dataset": data}


def _eval_ref(args: argparse.Namespace) -> Any:
    """``--eval-data`` as a fraction, a count, or a dataset reference."""
    ref = args.eval_data
    if ref is None:
        return None
    try:
        number = float(ref)
    except ValueError:
        return ref  # a file or an import path (load_data resolves it)
    return int(number) if number >= 1 and number.is_integer() else number


def _job(args: argparse.Namespace, plan: Plan, cluster: Cluster, *, run_id: str = "") -> Job:
    """The one job every rank runs. Its name, which namespaces the start-up keys, comes from what
    is trained (:func:`~deepcee.runtime.job.job_name`), never from how a path is spelled."""
    from deepcee.runtime.job import job_name

    model = args.model or plan.model
    name = job_name(plan, model, run_id=run_id)
    _check_inputs(args, plan, cluster, model)
    fields = model_and_data(args, plan.model)
    if not (args.adapt or args.link_trace or args.elastic):
        from deepcee.runtime.job import Job

        return Job(name=name, plan=plan, cluster=cluster, config=_config(args, cluster), run_dir=args.run_dir,
                   checkpoint_dir=args.checkpoint_dir, **fields)
    from deepcee.adapter.controller import adaptive_job
    from deepcee.profile import load_profile
    from deepcee.traces import load_named_trace

    trace = load_named_trace(args.link_trace, field="--link-trace") if args.link_trace else None
    return adaptive_job(plan, cluster, config=_config(args, cluster), run_dir=args.run_dir, name=name,
                        adapt=args.adapt, link_trace=trace, trace_time_scale=args.trace_time_scale,
                        profile=load_profile(args.profile) if args.profile else None, **fields,
                        **_elastic_fields(args, plan))


def _check_inputs(args: argparse.Namespace, plan: Plan, cluster: Cluster, model: str) -> None:
    """Refuse, before any worker starts, a plan whose devices are not in the cluster, or a
    built-in net that does not exist or has another layer count than the plan."""
    from deepcee import nets

    plan.check_against(num_layers=plan.num_layers, device_names=cluster.device_names, file=args.plan)
    if ":" in model:  # an import path: the user's model, checked where it is built
        return
    where = {"field": "--model"} if args.model else {"file": args.plan, "field": "model"}
    try:
        num_layers = len(nets.block_names(model))
    except SpecError as exc:
        raise SpecError(str(exc).removeprefix("model: "), **where) from None
    if num_layers != plan.num_layers:
        raise SpecError(f"net {model!r} has {num_layers} blocks, the plan covers {plan.num_layers} layers", **where)


def _elastic_fields(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """``--elastic``: one rank per device of the plan, default elastic settings."""
    if not args.elastic:
        return {}
    from deepcee.runtime.elastic import ElasticConfig

    return {"elastic": ElasticConfig(), "devices": plan.devices}


def _summary(result: TrainResult, args: argparse.Namespace) -> None:
    losses = result.losses
    note = (f" ({result.mode}, time dilation {result.dilation:.2f}; times divided by it)"
            if result.mode in ("emulated", "realnet") else "")
    print(f"steps {len(losses)}  loss {losses[0]:.4f} -> {losses[-1]:.4f}  {result.samples_per_s:.1f} samples/s{note}")
    print(f"semantics {result.semantics}: {result.strategy}")
    if result.target is not None:
        print(result.target.describe())
    if result.replicas is not None:
        print("local steps per replica: " + " ".join(map(str, result.replicas.local_steps)))
    print(f"metrics: {Path(args.run_dir) / 'metrics.jsonl'}")
    if result.adapter is None:
        return
    print("samples/s per step: " + " ".join(f"{m.samples_per_s:.0f}" for m in result.metrics))
    if not result.adapter.adapt:
        print("adapter off: the plan was kept whatever the links did")
    for ch in result.adapter.changes:
        print(f"step {ch.start_step}: {ch.kind}: {ch.reason}")
    if result.adapter.adapt and not result.adapter.changes:
        print("adapter on: no change paid for itself")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deepcee.train``: the same options as ``deepcee train``; the entry torchrun runs."""
    from deepcee.jobconfig import parse_with_config

    parser = OneLineParser(prog="python -m deepcee.train", description=DESCRIPTION)
    add_train_arguments(parser)
    try:
        args = parse_with_config(parser, argv)
        return train(args)
    except SystemExit as exc:  # --help (0) or a usage error, already printed in one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    except DeepceeError as exc:
        print(f"deepcee.train: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


from deepcee._callable import make_callable  # noqa: E402  [Note: callable modules]

make_callable(__name__)

if __name__ == "__main__":
    sys.exit(main())
