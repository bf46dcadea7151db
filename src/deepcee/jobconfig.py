"""A run's job config: one TOML file holding the options of ``deepcee train``; flags override it.

``deepcee train --config job.toml --steps 100`` (and ``python -m deepcee.train --config ...``,
the torchrun entry) reads the file, makes its values the defaults of the train options, then
parses the command line again, so every flag given overrides the file, as torchtitan's
``--job.config_file`` does. Each ``[section] key`` maps to one flag (:data:`FIELDS`); a value is
checked by that flag's own type and choices, so a bad value fails the same way, as one line
naming the file, the field and the value (exit code 2). Paths to files the run reads (plan,
cluster, profile, weights, link trace) are relative to the config file's folder; folders the
run writes (``run.dir``, ``checkpoint.dir``) are relative to the working directory. The format
is in docs/file-formats.md; ``examples/job.toml`` is a complete example. Torch-free.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from deepcee.errors import SpecError
from deepcee.inputs import read_toml as inputs_read_toml

PathKind = Literal["input", "output", "cluster", "trace", "data", ""]


@dataclass(frozen=True, slots=True, kw_only=True)
class Field:
    dest: str
    """The train option's ``argparse`` destination."""
    path: PathKind = ""
    """``input``: a file read, relative to the config's folder; ``output``: relative to the
    working directory; ``cluster``/``trace``: a built-in name, else an input path; ``data``: an
    input path when that file exists, else as written (an import path ``package.module:name``)."""


def _f(dest: str, path: PathKind = "") -> Field:
    return Field(dest=dest, path=path)


FIELDS: dict[str, dict[str, Field]] = {
    "cluster": {"name": _f("cluster", "cluster")},
    "model": {"name": _f("model"), "loss": _f("loss"), "split_at": _f("split_at")},
    "data": {"train": _f("data", "data"), "eval": _f("eval_data", "data"), "seq_len": _f("seq_len"),
             "no_shuffle": _f("no_shuffle")},
    "plan": {"file": _f("plan", "input"), "global_batch": _f("global_batch"),
             "schedules": _f("schedules"), "profile": _f("profile", "input")},
    "training": {"steps": _f("steps"), "seed": _f("seed"), "dtype": _f("dtype"), "mode": _f("mode"),
                 "cores": _f("cores"), "clip_grad_norm": _f("clip_grad_norm"), "autocast": _f("autocast"),
                 "cuda": _f("cuda"), "timeout_s": _f("timeout"), "deadline_s": _f("deadline"),
                 "stragglers": _f("straggler")},
    "optimizer": {"name": _f("optimizer"), "lr": _f("lr"), "momentum": _f("momentum"),
                  "weight_decay": _f("weight_decay")},
    "lr_schedule": {"kind": _f("lr_schedule"), "warmup_steps": _f("warmup_steps"),
                    "min_lr_ratio": _f("min_lr_ratio"), "decay_steps": _f("decay_steps")},
    "checkpoint": {"every": _f("checkpoint_every"), "keep": _f("keep_checkpoints"), "resume": _f("resume"),
                   "dir": _f("checkpoint_dir", "output"), "init_from": _f("init_from", "input")},
    "eval": {"every": _f("eval_every"), "batches": _f("eval_batches"), "target_loss": _f("target_loss"),
             "probes": _f("probes")},
    "logging": {"every": _f("log_every"), "tensorboard": _f("tensorboard"), "trace": _f("trace")},
    "run": {"dir": _f("run_dir", "output"), "cluster_node": _f("cluster_node")},
    "faults": {"elastic": _f("elastic"), "restart_after_s": _f("restart_after"), "link_down": _f("link_down")},
    "adapter": {"adapt": _f("adapt"), "link_trace": _f("link_trace", "trace"),
                "trace_time_scale": _f("trace_time_scale")},
}
"""``[section] key`` -> train option. Every train option but ``--config`` and ``--dry-run`` has one."""

NOT_IN_FILE = ("config", "dry_run", "help")


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed TOML file, read by the input layer (:func:`deepcee.inputs.read_toml`: size,
    encoding, nesting, finite numbers; errors name the file)."""
    return inputs_read_toml(path, SpecError)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def _flag(action: argparse.Action) -> str:
    # the first long form: ``--output`` of ``-o/--output``, ``--probes`` of ``--probes/--no-probes``
    return next((s for s in action.option_strings if s.startswith("--")), action.dest)


def _convert(value: Any, action: argparse.Action) -> Any:
    """``value`` from the file checked and converted as the flag would be; raises ValueError."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):  # a repeatable flag: a list, one entry per use
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of strings, one per {_flag(action)}, got {value!r}")
        return list(value)
    if isinstance(value, list) and action.dest == "schedules":
        if not value or not all(isinstance(v, str) for v in value):
            raise ValueError(f"must be a list of schedule names, got {value!r}")
        value = ",".join(value)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"must be a {'string' if action.type is None else 'number'}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be finite, got {value!r}")
    if action.type is None and not isinstance(value, str):
        raise ValueError(f"must be a string, got {value!r}")
    out = value
    if action.type is not None:
        try:
            out = action.type(value if isinstance(value, str) else repr(value))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        except (TypeError, ValueError):
            name = getattr(action.type, "__name__", "value")
            raise ValueError(f"must be {'an integer' if name == 'int' else 'a ' + name}, got {value!r}") from None
    if action.choices is not None and out not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return out


def _resolve(value: Any, kind: PathKind, base: Path) -> Any:
    if not isinstance(value, str) or kind in ("", "output"):
        return value
    if kind == "cluster":
        from deepcee.scenarios import scenario_names

        if value in scenario_names():
            return value
    if kind == "trace":
        from deepcee.traces import trace_names

        if value in trace_names():
            return value
    p = Path(value)
    if kind == "data" and not (base / p).exists():
        return value  # an import path, a fraction or a count, or a file relative to the working directory
    return value if p.is_absolute() else str(base / p)


def read_job_config(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's values as ``{option dest: value}`` for ``parser`` (the train options)."""
    file = str(path)
    data = read_toml(path)
    actions = _actions(parser)
    base = Path(path).parent
    out: dict[str, Any] = {}
    for section, table in data.items():
        fields = FIELDS.get(section)
        if fields is None:
            raise SpecError(f"unknown section (known: {', '.join(FIELDS)})", file=file, field=f"[{section}]")
        if not isinstance(table, Mapping):
            raise SpecError(f"must be a table, got {table!r}", file=file, field=section)
        for key, value in table.items():
            f = fields.get(key)
            if f is None:
                raise SpecError(f"unknown key (value {value!r}; known in [{section}]: {', '.join(fields)})",
                                file=file, field=f"{section}.{key}")
            action = actions[f.dest]
            try:
                out[f.dest] = _resolve(_convert(value, action), f.path, base)
            except ValueError as exc:
                raise SpecError(f"{exc} (flag {_flag(action)})", file=file, field=f"{section}.{key}") from None
    return out


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                      train_parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse ``argv``; when it names ``--config``, again with the file's values as the defaults
    of ``train_parser`` (default: ``parser``), so flags given override the file."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args
    target = train_parser or parser
    target.set_defaults(**read_job_config(path, target))
    return parser.parse_args(argv)


def unmapped_options(parser: argparse.ArgumentParser) -> list[str]:
    """Train options no ``[section] key`` maps to (a test keeps this empty)."""
    mapped = {f.dest for fields in FIELDS.values() for f in fields.values()}
    return sorted(a.dest for a in parser._actions if a.dest not in mapped and a.dest not in NOT_IN_FILE)
