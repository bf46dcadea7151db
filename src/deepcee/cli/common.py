"""What every sub-command shares: names and paths turned into clusters and model profiles (the CLI
is the one place that maps them to objects), atomic JSON output, progress lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from deepcee.errors import SpecError
from deepcee.planfile import referenced_path


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
    if scenario is None and fallback is not None and (beside := referenced_path(name, plan_file)) != name:
        return load_cluster(beside), beside
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
        return load_profile(referenced_path(ref, plan_file)), ref
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


# subcommands


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


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecError(f"must be comma-separated integers, got {text!r}", field=flag) from None
