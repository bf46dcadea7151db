"""Train a plan for real: ``python -m deepcee.train`` (local processes) or under ``torchrun``.

One machine, emulated devices and links (the default; one process per device of the plan)::

    deepcee plan --model gpt-tiny --scenario local-small -o plan.json
    python -m deepcee.train --plan plan.json --steps 50 --run-dir runs/gpt
    deepcee train --plan plan.json --steps 60 --adapt --link-trace drop-5x   # links change mid-run

Several machines (``mode real``; every rank needs the same plan and cluster files; ``nnodes``
x ``nproc-per-node`` must equal the plan's device count, ranks follow the plan's device order)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m deepcee.train --plan plan.json --cluster cluster.toml --mode real --cuda --steps 1000

``--dry-run`` prints the lowered schedule each stage will run and exits. Metrics go to
``<run-dir>/metrics.jsonl`` (one JSON object per step), the summary to ``<run-dir>/result.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from deepcee.errors import DeepceeError


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deepcee train", description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, help="plan.json written by `deepcee plan`")
    p.add_argument("--cluster", help="cluster file or scenario name (default: the plan's cluster scenario)")
    p.add_argument("--model", help="built-in net (default: the plan's model): gpt-tiny, resnet-tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mode", choices=("emulated", "real", "realnet"), default="emulated",
                   help="emulated: devices and links emulated in-process; realnet: devices emulated, each in its "
                   "own network namespace, links shaped by a user-space relay carrying real TCP (needs root and "
                   "/dev/net/tun; local processes only); real: as fast as the hardware goes (torchrun, CUDA)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cores", type=float, default=1.2, help="CPU cores the emulated devices may use together")
    p.add_argument("--run-dir", default="runs/train")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any receive or collective may wait")
    p.add_argument("--deadline", type=float, default=3600.0, help="local launch: hard limit for the whole run")
    p.add_argument("--cuda", action="store_true", help="use CUDA + NCCL when available (mode real)")
    p.add_argument("--trace", action="store_true", help="record every action's start and end in the metrics")
    p.add_argument("--dry-run", action="store_true", help="print each stage's lowered schedule and exit")
    p.add_argument("--link-trace", help="bandwidth trace on the emulated wide-area links: a built-in name "
                   "(drop-5x, drop-recover, periodic, ramp, noisy-stationary) or a trace file")
    p.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="stretch the trace's times by this factor (emulated seconds)")
    p.add_argument("--adapt", action="store_true",
                   help="watch link speed from the runtime's own transfers and re-tune or re-plan when it changes")
    p.add_argument("--profile", help="measured profile.json for the adapter's predictions (default: analytic)")
    return p.parse_args(argv)


def _load(args: argparse.Namespace):
    from deepcee.cluster import load_cluster
    from deepcee.plan import load_plan
    from deepcee.scenarios import load_scenario, scenario_names

    plan = load_plan(args.plan)
    ref = args.cluster or plan.cluster
    cluster = load_cluster(ref) if Path(ref).exists() or ref not in scenario_names() else load_scenario(ref)
    return plan, cluster


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        plan, cluster = _load(args)
        model = args.model or plan.model
        if args.dry_run:
            from deepcee.runtime.executor import schedule_for
            from deepcee.schedule.passes import format_table

            print(format_table(schedule_for(plan)))
            return 0
        from deepcee.runtime import dist as rdist
        from deepcee.runtime.trainer import Job, OptimizerConfig, TrainConfig, run_jobs_on_rank

        cfg = TrainConfig(
            steps=args.steps, seed=args.seed, dtype=args.dtype, mode=args.mode, cores=args.cores,
            optimizer=OptimizerConfig(name=args.optimizer, lr=args.lr, momentum=args.momentum),
            timeout_s=args.timeout, checkpoint_every=args.checkpoint_every, resume=args.resume,
            trace=args.trace, use_cuda=args.cuda,
        )
        env = rdist.torchrun_env()
        if args.adapt or args.link_trace:
            if env is not None:
                raise DeepceeError("--adapt and --link-trace run on local emulated processes, not under torchrun")
            return _adaptive(args, plan, cluster, model, cfg)
        if env is None:
            from deepcee.runtime.launch import run_training

            res = run_training(plan, cluster, model=model, steps=args.steps, run_dir=args.run_dir,
                               deadline_s=args.deadline, **{f: getattr(cfg, f) for f in cfg.__dataclass_fields__
                                                             if f != "steps"})
            _summary(res.losses, res.samples_per_s, res.mode, res.dilation, args.run_dir)
            return 0
        # Same job name on every rank: it namespaces the start-up keys in the shared store.
        name = "train-" + hashlib.sha256(f"{args.plan}:{args.run_dir}".encode()).hexdigest()[:8]
        job = Job(name=name, plan=plan.to_dict(), cluster=cluster.to_dict(), model=model, config=cfg,
                  run_dir=args.run_dir)
        store = rdist.tcp_store(env, args.timeout)
        (result,) = run_jobs_on_rank([job], env.rank, env.world_size, store, local_rank=env.local_rank)
        if result is not None:
            _summary(result["losses"], result["samples_per_s"], result["mode"], result["dilation"], args.run_dir)
        return 0
    except DeepceeError as exc:
        print(f"deepcee.train: {exc}", file=sys.stderr)
        return 2


def _adaptive(args: argparse.Namespace, plan, cluster, model: str, cfg) -> int:
    from deepcee.adapter.controller import run_adaptive_training
    from deepcee.profile import load_profile

    res = run_adaptive_training(
        plan, cluster, model=model, steps=args.steps, adapt=args.adapt, link_trace=args.link_trace,
        trace_time_scale=args.trace_time_scale, profile=load_profile(args.profile) if args.profile else None,
        run_dir=args.run_dir, deadline_s=args.deadline,
        **{f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "steps"},
    )
    t = res.train
    _summary(t.losses, t.samples_per_s, t.mode, t.dilation, args.run_dir)
    per_step = " ".join(f"{x:.0f}" for x in res.samples_per_s)
    print(f"samples/s per step: {per_step}")
    if not args.adapt:
        print("adapter off: the plan was kept whatever the links did")
    for ch in res.changes:
        print(f"step {ch.get('start_step')}: {ch.get('kind')}: {ch.get('reason')}")
    if args.adapt and not res.changes:
        print("adapter on: no change paid for itself")
    return 0


def _summary(losses: Sequence[float], samples_per_s: float, mode: str, dilation: float, run_dir: str) -> None:
    note = (f" ({mode}, time dilation {dilation:.2f}; times divided by it)" if mode in ("emulated", "realnet")
            else "")
    print(f"steps {len(losses)}  loss {losses[0]:.4f} -> {losses[-1]:.4f}  {samples_per_s:.1f} samples/s{note}")
    print(f"metrics: {Path(run_dir) / 'metrics.jsonl'}")


if __name__ == "__main__":
    sys.exit(main())
