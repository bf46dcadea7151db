"""Typed command-line numbers: argparse types with ranges, shared by every sub-command.

Torch-free. ``deepcee`` (:mod:`deepcee.cli`) and ``python -m deepcee.train`` (:mod:`deepcee.train`)
build their parsers with :class:`OneLineParser` and give every numeric option a type from here
(:func:`number` over a :class:`~deepcee.inputs.limits.Limit`), so a bad number is refused before
any work starts, in one line naming the flag and the value, with exit code 2::

    deepcee simulate: error: argument --iterations: must be in [1, 1,000,000], got 0

The ranges of files and flags live in :mod:`deepcee.inputs.limits`; the ones only flags have are
below (:data:`CLI_LIMITS`, listed in ``docs/file-formats.md``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, NoReturn

from deepcee.inputs.limits import (
    GLOBAL_BATCH,
    IMAGE_SIZE,
    MAX_SCHEDULE_CELLS,
    MAX_SIMULATION_WORK,
    SEQ_LEN,
    Limit,
    show,
)

__all__ = [
    "BUDGET", "DATASET_SAMPLES", "EPOCHS", "CLIP_NORM", "CLI_LIMITS", "CORES", "DEADLINE", "EVAL_BATCHES", "EVERY", "GLOBAL_BATCH", "IMAGE_SIZE", "ITERATIONS",
    "KEEP", "LR", "MICROBATCHES", "MIN_LR_RATIO", "MOMENTUM", "PLANS", "RATIO", "SCALE", "SEED", "SEQ_LEN", "STAGES",
    "STEPS", "TARGET_LOSS", "THRESHOLD_MS", "TIMEOUT", "WEIGHT_DECAY",
    "OneLineParser", "link_down_flag", "name_list", "name_pair", "number", "out_path", "split_name_pair",
    "straggler_flag",
]

STEPS = Limit(name="training steps", lo=1, hi=10**9, integer=True, fields="--steps, --decay-steps",
              why="runs with progress and stops on Ctrl-C or --deadline; 10**9 is beyond any run")
ITERATIONS = Limit(name="simulated iterations", lo=1, hi=MAX_SIMULATION_WORK, integer=True, fields="--iterations",
                   why="work: with the plan's size, at most MAX_SIMULATION_WORK (measured)")
STAGES = Limit(name="schedule stages", lo=1, hi=1024, integer=True, fields="schedule show --stages",
               why="work: stages x microbatches at most MAX_SCHEDULE_CELLS (measured)")
MICROBATCHES = Limit(name="schedule microbatches", lo=1, hi=MAX_SCHEDULE_CELLS, integer=True,
                     fields="schedule show --microbatches", why="as --stages")
DEADLINE = Limit(name="deadline", lo=0, lo_open=True, hi=1e7, unit="s", fields="--deadline",
                 why="a positive time; 1e7 s is 116 days")
TIMEOUT = Limit(name="timeout", lo=0, lo_open=True, hi=1e6, unit="s", fields="--timeout",
                why="a positive time; a wait of 11 days is a hang")
CORES = Limit(name="cores", lo=0, lo_open=True, hi=4096, fields="--cores", why="CPU cores, a positive share")
EVERY = Limit(name="step interval", lo=0, hi=10**9, integer=True,
              fields="--checkpoint-every, --eval-every, --log-every, --warmup-steps", why="steps; 0 = never")
LR = Limit(name="learning rate", lo=0, lo_open=True, hi=1e3, fields="--lr", why="a finite positive step size")
WEIGHT_DECAY = Limit(name="weight decay", lo=0, hi=1e3, fields="--weight-decay", why="a finite decay factor")
MIN_LR_RATIO = Limit(name="learning-rate floor", lo=0, hi=1, fields="--min-lr-ratio", why="a fraction of --lr")
CLIP_NORM = Limit(name="gradient norm", lo=0, lo_open=True, hi=1e12, fields="--clip-grad-norm",
                  why="a finite positive norm")
KEEP = Limit(name="checkpoints kept", lo=0, hi=10**6, integer=True, fields="--keep-checkpoints", why="0 = all")
EVAL_BATCHES = Limit(name="evaluation batches", lo=1, hi=10**6, integer=True, fields="--eval-batches",
                     why="held-out global batches per evaluation")
TARGET_LOSS = Limit(name="target loss", lo=0, lo_open=True, hi=1e6, fields="--target-loss, [eval] target_loss",
                    why="a finite positive evaluation loss")
MOMENTUM = Limit(name="momentum", lo=0, hi=1, hi_open=True, fields="--momentum", why="a momentum is below 1")
SEED = Limit(name="seed", lo=0, hi=2**32 - 1, integer=True, fields="--seed", why="numpy and torch seeds")
SCALE = Limit(name="time scale", lo=0, lo_open=True, hi=1e6, fields="--trace-time-scale",
              why="stretches a trace; a positive factor")
THRESHOLD_MS = Limit(name="island threshold", lo=0, lo_open=True, hi=60_000, unit="ms",
                     fields="group --island-threshold-ms", why="a positive time per MB; a minute per MB at most")
RATIO = Limit(name="speed ratio", lo=1, hi=1e6, fields="group --speed-ratio", why="a ratio of speeds, >= 1")
PLANS = Limit(name="validation plans", lo=1, hi=100, integer=True, fields="validate --plans",
              why="each plan is a real emulated run of tens of seconds")
BUDGET = Limit(name="budget", lo=0, lo_open=True, hi=1e12, unit="USD", fields="plan --budget",
               why="dollars per sync-equivalent epoch; positive and finite")
DATASET_SAMPLES = Limit(name="dataset samples", lo=1, hi=1e15, fields="plan --dataset-samples",
                        why="samples per epoch; 1e15 is beyond any data set")
EPOCHS = Limit(name="epochs", lo=1, hi=10**6, integer=True, fields="plan --epochs", why="a count of passes")
DEMO_STEPS = Limit(name="demo steps", lo=2, hi=10**6, integer=True, fields="demo --steps, validate --steps",
                   why="the first step is warm-up; runs with progress and stops on Ctrl-C")
BASELINE_CAP = Limit(name="baseline cap", lo=0, hi=1e3, fields="demo --baseline-cap",
                     why="x the fastest predicted time to target; 0 = no cap (values in (0, 1) are refused)")

CLI_LIMITS: tuple[Limit, ...] = (STEPS, ITERATIONS, STAGES, MICROBATCHES, DEADLINE, TIMEOUT, CORES, EVERY, LR,
                                 WEIGHT_DECAY, MIN_LR_RATIO, CLIP_NORM, KEEP, EVAL_BATCHES, TARGET_LOSS, MOMENTUM,
                                 SEED, SCALE,
                                 THRESHOLD_MS, RATIO, PLANS, BUDGET, DATASET_SAMPLES, EPOCHS, DEMO_STEPS,
                                 BASELINE_CAP)


def number(limit: Limit) -> Callable[[str], int | float]:
    """An argparse ``type``: the text as an integer or a finite number inside ``limit``."""
    def parse(text: str) -> int | float:
        value: int | float
        try:
            value = int(text) if limit.integer else float(text)
        except ValueError:
            kind = "an integer" if limit.integer else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind} in {limit.describe()}, got {show(text)}") from None
        try:
            return limit.check(value, shown=text.strip()[:40])  # it parsed as a number: quote it as typed
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = limit.name
    return parse


def name_list(choices: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse ``type``: comma-separated names, each one of ``choices``; returns the text."""
    def parse(text: str) -> str:
        bad = [n for n in text.split(",") if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"expected comma-separated names from {', '.join(choices)}; got "
                                             f"{show(bad[0])} in {show(text)}")
        return text

    parse.__name__ = "names"
    return parse


def name_pair(text: str) -> str:
    """An argparse ``type``: two names as ``a,b``, split later against the names that exist
    (:func:`split_name_pair`), since a name may itself hold a comma."""
    if "," not in text.strip(",") or not text.strip():
        raise argparse.ArgumentTypeError(f"expected two different names as a,b, got {show(text)}")
    return text


def split_name_pair(text: str, names: Collection[str]) -> tuple[str, str]:
    """``a,b`` as two different names of ``names``, at the one comma where both sides are names;
    else the first comma (the caller's check of the names then says which is unknown). Raises
    ``ValueError`` when two commas both split ``text`` into known names."""
    from deepcee.cluster.outages import name_cuts

    known = name_cuts(text, ",", names)
    if len(known) > 1:
        raise ValueError(f"{show(text)} splits into two known names in {len(known)} ways: "
                         f"{' or '.join(repr(a) + ' and ' + repr(b) for a, b in known)}")
    a, b = known[0] if known else text.split(",", 1)
    if a == b:
        raise ValueError(f"expected two different names as a,b, got {show(text)}")
    return a, b


def _writable_at(path: Path, folder: bool) -> str:
    """Why nothing can be written at ``path`` (a file, or a folder when ``folder``), or ""."""
    if path.exists() and path.is_dir() != folder:
        return "is a folder, not a file" if path.is_dir() else "is a file, not a folder"
    for parent in path.parents:  # the nearest existing ancestor must be a folder (the rest is created)
        if parent.exists():
            return "" if parent.is_dir() else f"cannot be created: {str(parent)!r} is a file"
    return ""


def out_path(folder: bool = False) -> Callable[[str], str]:
    """An argparse ``type``: where a command writes a file (or a ``folder``): refused before any
    work when it is a folder where a file goes (or the reverse), or below a file; returns the text."""
    def parse(text: str) -> str:
        why = _writable_at(Path(text), folder) if text else "is empty"
        if why:
            raise argparse.ArgumentTypeError(f"{text[:300]!r} {why}")
        return text

    parse.__name__ = "folder" if folder else "file"
    return parse


def _window_flag(text: str, flag: str, make: Callable[[], Any], check: Callable[[Any], None] = lambda r: None) -> Any:
    """A record parsed from a flag's text with a ``start_s`` / ``stop_s`` window in the trace-time
    range (and ``check``'s own test); errors name the flag and the value."""
    from deepcee.errors import SpecError
    from deepcee.inputs.limits import TRACE_TIME

    try:
        r = make()
        check(r)
        TRACE_TIME.check(r.start_s)
        if r.stop_s != float("inf"):
            TRACE_TIME.check(r.stop_s)
    except (SpecError, ValueError) as exc:
        field = getattr(exc, "field", None)
        msg = str(exc).removeprefix(f"{field}: ") if field else str(exc)
        raise SpecError(f"{text!r}: {msg}"[:300], field=flag) from None
    return r


def link_down_flag(text: str, nodes: Sequence[str]) -> Any:
    """One ``--link-down NODE_A:NODE_B@START[:STOP]`` (:mod:`deepcee.cluster.outages`): both nodes
    of the cluster, the times in the trace-time range; errors name the flag and the value."""
    from deepcee.cluster.outages import LinkOutage

    return _window_flag(text, "--link-down", lambda: LinkOutage.parse(text, nodes))


def straggler_flag(text: str, devices: Sequence[str], parse: Callable[[str, Sequence[str]], Any] | None = None) -> Any:
    """One ``--straggler DEVICE:FACTOR[:START[:STOP]]``: ``DEVICE`` one of ``devices``, the factor in
    the slowdown range, the window in the trace-time range; errors name the flag and the value.
    ``parse`` makes the record (default :meth:`deepcee.cluster.stragglers.Straggler.parse`; the
    runtime passes its own). Not an argparse ``type``: the devices are known once the cluster is loaded."""
    from deepcee.inputs.limits import SLOWDOWN

    if parse is None:
        from deepcee.cluster.stragglers import Straggler

        parse = Straggler.parse
    return _window_flag(text, "--straggler", lambda: parse(text, devices), lambda s: SLOWDOWN.check(s.factor))


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit code 2), like every
    other deepcee error; ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {one_line} (see {self.prog} --help)\n")
