"""Reading plan files (``deepcee.plan`` JSON, schema 1 and 2) through the input layer (torch-free).

:func:`plan_from_dict` reads every field with :class:`~deepcee.inputs.Fields` (types, names,
the ranges of :mod:`deepcee.inputs.limits`, unknown keys refused) and then builds the
:class:`~deepcee.plan.Plan`, whose own checks (contiguous layers, shares that sum to the
microbatch, batches that sum to the global batch, ...) name the field too. Every error names
the file. The format is described in ``docs/file-formats.md``; :meth:`Plan.to_dict` writes it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from deepcee.errors import PlanError
from deepcee.inputs import Fields, read_json
from deepcee.inputs.fields import check_format
from deepcee.inputs.limits import (
    BYTES,
    COUNT,
    DURATION,
    GLOBAL_BATCH,
    LAYER_INDEX,
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    OUTER_LR,
    OUTER_MOMENTUM,
    RATE,
)
from deepcee.plan import (
    ESTIMATE_SOURCES,
    OUTER_OPTIMIZERS,
    SCHEDULES,
    STRATEGIES,
    SYNCS,
    Estimate,
    Plan,
    ReplicaPlan,
    StagePlan,
    Strategy,
    _replica,
)

READABLE_SCHEMAS = (1, 2)
MAX_REFERENCE_CHARS = 4096
"""Characters of a plan's ``cluster`` and ``model`` references (paths or names)."""
MAX_EXPLANATION_LINES = 10_000
_COMPUTE_ACTION = re.compile(r"^(\d+)([FIWB])(\d+)$")


def plan_from_dict(d: Any, *, file: str = "<plan.json>") -> Plan:
    """A plan from its JSON form; schema 1 (one pipeline) and 2 (replicas) both load."""
    try:
        return _read(d, file)
    except PlanError as exc:  # a check of the plan's own records: add the file
        if exc.file:
            raise
        raise PlanError(str(exc), file=file) from None


def _read(d: Any, file: str) -> Plan:
    f = Fields(d, file=file, error=PlanError)
    version = check_format(f, "deepcee.plan", READABLE_SCHEMAS)
    common = dict(
        system=f.name("system"), cluster=_reference(f, "cluster"), model=_reference(f, "model"),
        global_batch=f.integer("global_batch", GLOBAL_BATCH), sync=f.choice("sync", SYNCS, "allreduce-ring"),
        excluded_devices=f.names("excluded_devices", (), max_len=MAX_DEVICES),
        estimate=_estimate(f.record_of("estimate", None)) if f.raw("estimate", None) is not None else None,
        explanation=f.texts("explanation", (), max_len=MAX_EXPLANATION_LINES),
    )
    semantics = f.choice("semantics", ("exact", "relaxed"), None)
    if version == 1:
        shape: dict[str, Any] = _pipeline(f)
    else:
        shape = dict(replicas=tuple(_replica_from(r) for r in f.records("replicas", max_len=MAX_DEVICES, min_len=1)),
                     strategy=strategy_from_fields(f.record_of("strategy")) if f.has("strategy") else Strategy(),
                     servers=f.names("servers", (), max_len=MAX_DEVICES))
    f.done()
    plan = Plan(**common, **shape)
    if semantics is not None and semantics != plan.semantics:
        raise f.err("semantics", f"says {semantics!r}, but strategy {plan.strategy.kind!r} is {plan.semantics!r}")
    return plan


def load_plan(path: str | Path) -> Plan:
    """The plan in the JSON file at ``path`` (see :func:`plan_from_dict`)."""
    return plan_from_dict(read_json(path, PlanError), file=str(path))


def referenced_path(ref: str, plan_file: str | Path | None) -> str:
    """A file a plan names (its ``cluster``, its ``model`` profile) as a path to open: as written
    when it exists from the working directory, else relative to the plan's own folder when it
    exists there (a plan written as ``-o runs/plan.json`` beside ``runs/cluster.toml`` and used
    from elsewhere), else unchanged (a scenario or model name, or a missing file)."""
    if plan_file is None or Path(ref).is_absolute() or Path(ref).exists():
        return ref
    beside = Path(plan_file).parent / ref
    return str(beside) if beside.is_file() else ref


def _reference(f: Fields, key: str) -> str:
    v = f.text(key, max_chars=MAX_REFERENCE_CHARS)
    if not v or not v.isprintable():
        what = "a scenario name or cluster file path" if key == "cluster" else "a model reference or profile path"
        raise f.err(key, f"expected {what}, got {v!r}")
    return v


def _pipeline(f: Fields) -> dict[str, Any]:
    """The one-pipeline fields of a replica (schema 2) or of a schema-1 plan's top level."""
    num_microbatches = f.integer("num_microbatches", GLOBAL_BATCH)
    stages = tuple(_stage(s) for s in f.records("stages", max_len=MAX_DEVICES, min_len=1))
    return dict(stages=stages, microbatch_size=f.integer("microbatch_size", GLOBAL_BATCH),
                num_microbatches=num_microbatches, schedule=f.choice("schedule", SCHEDULES),
                actions=_actions(f, len(stages), num_microbatches))


def _replica_from(f: Fields) -> ReplicaPlan:
    fields = _pipeline(f)
    f.done()
    return _replica(**fields, where=f.where + ".")


def _stage(f: Fields) -> StagePlan:
    values = dict(layer_start=f.integer("layer_start", LAYER_INDEX), layer_stop=f.integer("layer_stop", LAYER_INDEX),
                  devices=f.names("devices", max_len=MAX_DEVICES, min_len=1),
                  shares=f.numbers("shares", GLOBAL_BATCH, max_len=MAX_DEVICES, min_len=1),
                  recompute=f.flag("recompute", False), sync=f.choice("sync", SYNCS, None))
    f.done()
    try:
        stage = StagePlan(**values)
    except PlanError as exc:
        raise f.whole(str(exc)) from None
    return stage


def _actions(f: Fields, num_stages: int, num_microbatches: int) -> tuple[tuple[str, ...], ...]:
    """Per-stage compute actions: ``<stage>F|I|W|B<microbatch>`` of their own stage's row."""
    rows = f.items("actions", [], max_len=num_stages)
    out = []
    for s, row in enumerate(rows):
        where = f"{f.path('actions')}[{s}]"
        if not isinstance(row, list) or len(row) > 4 * MAX_GLOBAL_BATCH:
            raise PlanError(f"expected a list of actions such as '{s}F0', got {str(row)[:60]!r}", file=f.file,
                            field=where)
        for i, text in enumerate(row):
            m = _COMPUTE_ACTION.match(text) if isinstance(text, str) else None
            if m is None or int(m.group(1)) != s or int(m.group(3)) >= num_microbatches:
                raise PlanError(f"expected a compute action of stage {s} on a microbatch below {num_microbatches} "
                                f"(e.g. '{s}F0'), got {text!r}"[:200], file=f.file, field=f"{where}[{i}]")
        out.append(tuple(row))
    return tuple(out)


def strategy_from_fields(f: Fields) -> Strategy:
    """A plan's ``strategy`` object (also the strategies of a calibration file), every field checked."""
    count = {name: f.integer(name, COUNT, default) for name, default in (
        ("accumulation_steps", 1), ("staleness_bound", 0), ("period", 1), ("min_group", 2), ("max_group", 0),
        ("full_sync_every", 1))}
    values = dict(kind=f.choice("kind", STRATEGIES, "exact"), **count,
                  outer_optimizer=f.choice("outer_optimizer", OUTER_OPTIMIZERS, "average"),
                  outer_lr=f.number("outer_lr", OUTER_LR, 1.0), outer_momentum=f.number("outer_momentum", OUTER_MOMENTUM, 0.0),
                  window_s=f.number("window_s", DURATION, 0.0), overlap=f.flag("overlap", False))
    try:
        strategy = Strategy(**values)
    except PlanError as exc:  # a rule between fields (staleness for asgd-ga, ...): name it under this record
        key = (exc.field or "").removeprefix("strategy.")
        msg = str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)
        raise (f.err(key, msg) if key else f.whole(msg)) from None
    f.done()
    return strategy


def _estimate(f: Fields) -> Estimate:
    memory = {name: f.check(f"peak_memory_bytes.{name}", BYTES, v)
              for name, v in f.mapping("peak_memory_bytes", {}, max_len=MAX_DEVICES).items()}
    estimate = Estimate(iteration_s=f.number("iteration_s", DURATION), samples_per_s=f.number("samples_per_s", RATE),
                        peak_memory_bytes=memory, bottleneck=f.text("bottleneck", ""),
                        source=f.choice("source", ESTIMATE_SOURCES, "cost-model"))
    f.done()
    return estimate
