"""The sub-commands that run nets for real (torch, processes): profile, validate, calibrate,
train, export, demo.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepcee.cli.common import (
    _check_net,
    _int_list,
    _load_cluster,
    _load_model,
)
from deepcee.errors import SpecError


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


def cmd_calibrate(args: argparse.Namespace) -> int:
    import logging

    from deepcee.calibrate import CalibrationConfig, calibrate

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cluster, ref = _load_cluster(args.cluster, args.scenario, "local-small")
    profile, _ = _load_model(args.model, args.profile)
    cfg = CalibrationConfig(model=args.model, global_batch=args.global_batch, target_loss=args.target_loss,
                            eval_every=args.eval_every, max_steps=args.steps,
                            periods=_int_list(args.periods, "--periods"),
                            outer_optimizers=tuple(x for x in args.outer.split(",") if x),
                            overlaps={"off": (False,), "on": (True,), "both": (False, True)}[args.overlap],
                            optimizer=args.optimizer,
                            lr=args.lr, seed=args.seed, out_dir=args.output, deadline_s=args.deadline)
    doc = calibrate(cluster, profile, cfg, cluster_ref=ref)
    ref_ = doc["reference"]
    print(f"reference (exact, global batch {ref_['global_batch']}): {ref_['samples_to_target']} samples "
          f"({ref_['steps_to_target']} steps) to evaluation loss {doc['target_loss']:g}")
    for e in doc["entries"]:
        s = e["strategy"]
        bound = "" if e["reached"] else "  (NOT reached: a lower bound)"
        how = ", overlapped" if s.get("overlap") else ""
        print(f"model-averaging H={s['period']} {s['outer_optimizer']}{how}: {e['samples_to_target']} samples, "
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
    if args.throughput:
        return _demo_throughput(args)
    import logging

    from deepcee.mainjob import MainJobConfig, format_report, run_main_job

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    model = args.model or "gpt-tiny"
    _check_net(model)
    periods = tuple(_whole_list(args.periods, "--periods"))
    cfg = MainJobConfig(scenario=args.scenario, model=model, global_batch=args.global_batch,
                        target_loss=args.target_loss, mode=args.links, periods=periods,
                        efficiency_file=args.efficiency, out_dir=args.out)
    print(format_report(run_main_job(cfg)))
    return 0


def _whole_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise SpecError(f"expected comma-separated whole numbers, got {text[:40]!r}", field=flag) from None
    if not vals or any(v < 1 or v > 4096 for v in vals):
        raise SpecError(f"expected whole numbers in [1, 4096], got {text[:40]!r}", field=flag)
    return vals


def _demo_throughput(args: argparse.Namespace) -> int:
    """``deepcee demo --throughput``: the former main job (samples/s over a fixed number of steps)."""
    from deepcee.demo import DemoConfig, format_report, run_demo

    model = args.model or "gpt-tiny"
    _check_net(model)
    cfg = DemoConfig(scenario=args.scenario, model=model, global_batch=args.global_batch, steps=args.steps,
                     out_dir=args.out, quick_profile=not args.full_profile)
    report = run_demo(cfg)
    print(format_report(report))
    return 0
