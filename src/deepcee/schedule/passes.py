"""Passes over the action IR: lowering, validation, in-flight counts, dry run, text table.

Lowering rule, per stage ``s`` of ``S`` (see :mod:`deepcee.schedule.ir` for the semantics):
``RECV_F`` right before each ``F`` when ``s > 0``; ``SEND_F`` right after each ``F`` when
``s < S-1``; ``RECV_B`` right before each ``I`` or ``B`` when ``s < S-1``; ``SEND_B`` right
after each ``I`` or ``B`` when ``s > 0``. ``W`` never communicates.

Validity (:func:`validate`): with ``M = 1 + the largest microbatch id``, every stage runs, for
every microbatch ``m < M``, ``F`` once and either ``B`` once or ``I`` and ``W`` once each, with
``F`` before ``I``/``B`` and ``I`` before ``W``; every action sits in its own stage's row; a
lowered schedule must equal ``lower()`` of its compute actions; and the schedule must not
deadlock (checked by executing it with zero costs).

The dry run (:func:`dry_run`) is the simulator's interpreter
(:mod:`deepcee.schedule.interpreter`) run with given per-stage costs.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from deepcee.errors import ScheduleError
from deepcee.schedule.interpreter import Deadlock, Execution, LinkCost, Tables, stage_tables
from deepcee.schedule.ir import COMPUTE_KINDS, Action, ActionKind, Schedule, make_action

K = ActionKind
_F, _I, _W, _B = K.F, K.I, K.W, K.B
_SEND_F, _SEND_B, _RECV_F, _RECV_B = K.SEND_F, K.SEND_B, K.RECV_F, K.RECV_B

_WINDOW = 12
"""Columns shown on each side of a marked action in an error table."""


def lower(schedule: Sequence[Sequence[Action]]) -> Schedule:
    """Insert communication actions into a compute-only schedule."""
    last = len(schedule) - 1
    out = []
    for s, row in enumerate(schedule):
        lowered: list[Action] = []
        add = lowered.append
        for a in row:
            k, m = a.kind, a.microbatch
            if k == _F:
                if s > 0:
                    add(make_action(s, _RECV_F, m))
                add(a)
                if s < last:
                    add(make_action(s, _SEND_F, m))
            elif k == _W:
                add(a)
            elif k == _I or k == _B:
                if s < last:
                    add(make_action(s, _RECV_B, m))
                add(a)
                if s > 0:
                    add(make_action(s, _SEND_B, m))
            else:
                raise ScheduleError(f"lower() takes compute actions only, got {a} at stage {s}")
        out.append(tuple(lowered))
    return tuple(out)


def compute_only(schedule: Sequence[Sequence[Action]]) -> Schedule:
    """Drop communication actions (the inverse of :func:`lower` on a valid schedule)."""
    return tuple(tuple(a for a in row if a.kind in COMPUTE_KINDS) for row in schedule)


# --------------------------------------------------------------------------- text tables


def format_table(
    schedule: Sequence[Sequence[Action]],
    *,
    marks: Collection[tuple[int, int]] = (),
    columns: tuple[int, int] | None = None,
    timing: DryRun | None = None,
    step_s: float | None = None,
    max_columns: int = 200,
) -> str:
    """Step-by-stage text table: one row per stage, one column per step.

    Without ``timing`` a step is an action index in the stage's list; ``marks`` are
    ``(stage, index)`` cells shown as ``*1W3*``; ``columns`` restricts to the index range
    ``[start, stop)``. With ``timing`` (a :class:`DryRun` of this schedule) a step is a time
    slot of ``step_s`` seconds (default: the shortest compute action, widened so that at most
    ``max_columns`` slots are shown) and each cell shows the compute action running at the
    slot's start, ``.`` when the stage is idle.
    """
    if timing is not None:
        return _format_timed(schedule, timing, step_s, max_columns)
    n = max((len(r) for r in schedule), default=0)
    lo, hi = columns if columns is not None else (0, n)
    lo, hi = max(0, lo), min(n, hi)
    marked = set(marks)
    cells = [
        [
            (f"*{row[i]}*" if (s, i) in marked else str(row[i])) if i < len(row) else ""
            for i in range(lo, hi)
        ]
        for s, row in enumerate(schedule)
    ]
    header = [str(i) for i in range(lo, hi)]
    lines = _grid("step", header, cells)
    if lo > 0 or hi < n:
        lines.append(f"(steps {lo}..{hi - 1} of 0..{n - 1})")
    if marked:
        lines.append("(* marks the failing action)")
    return "\n".join(lines)


def _grid(corner: str, header: list[str], cells: list[list[str]]) -> list[str]:
    width = max([len(h) for h in header] + [len(c) for row in cells for c in row] + [1])
    label = max(len(corner), len(f"stage {len(cells) - 1}"))
    lines = [corner.ljust(label) + " " + " ".join(h.ljust(width) for h in header)]
    for s, row in enumerate(cells):
        lines.append(f"stage {s}".ljust(label) + " " + " ".join(c.ljust(width) for c in row).rstrip())
    return [ln.rstrip() for ln in lines]


def _format_timed(schedule: Sequence[Sequence[Action]], timing: DryRun,
                  step_s: float | None, max_columns: int) -> str:
    spans = [
        [(timing.start_s[a], timing.end_s[a], a) for a in row if a.kind.is_compute]
        for row in schedule
    ]
    durations = [e - b for row in spans for b, e, _ in row if e > b]
    if timing.makespan_s <= 0 or not durations:
        return format_table(schedule)
    step = step_s if step_s is not None else min(durations)
    step = max(step, timing.makespan_s / max(1, max_columns))
    n = math.ceil(timing.makespan_s / step - 1e-9)
    cells = []
    for row in spans:
        out, j = [], 0
        for c in range(n):
            t = c * step
            while j < len(row) and row[j][1] <= t + 1e-12:
                j += 1
            out.append(str(row[j][2]) if j < len(row) and row[j][0] <= t + 1e-12 else ".")
        cells.append(out)
    lines = _grid("t/step", [str(c) for c in range(n)], cells)
    lines.append(f"(step = {step:.6g} s, makespan = {timing.makespan_s:.6g} s)")
    return "\n".join(lines)


def _fail(message: str, schedule: Sequence[Sequence[Action]], marks: Collection[tuple[int, int]]) -> ScheduleError:
    """A ScheduleError whose message ends with the table around the marked actions."""
    if marks:
        lo = max(0, min(i for _, i in marks) - _WINDOW)
        hi = max(i for _, i in marks) + _WINDOW + 1
        table = format_table(schedule, marks=marks, columns=(lo, hi))
    else:
        table = format_table(schedule, columns=(0, 2 * _WINDOW))
    return ScheduleError(f"{message}\n{table}")


# --------------------------------------------------------------------------- validation


def validate(schedule: Sequence[Sequence[Action]]) -> None:
    """Raise :class:`ScheduleError` (with a marked table) unless the schedule is valid.

    Accepts compute-only and lowered schedules; see the module docstring for the rules.
    """
    lower_validated(schedule)


def lower_validated(schedule: Sequence[Sequence[Action]], *, deadlocks: bool = True) -> Schedule:
    """:func:`validate` the schedule and return it lowered (lowering it once for both).

    ``deadlocks=False`` skips the deadlock check (running the schedule with zero costs, by far
    the dearest check) for schedules that cannot deadlock by construction: the builders'.
    """
    if len(schedule) == 0:
        raise ScheduleError("schedule has no stages")
    _check_rows(schedule)
    compute = compute_only(schedule)
    lowered = None
    if any(len(c) != len(r) for c, r in zip(compute, schedule, strict=True)):
        lowered = _check_lowering(schedule, compute)
    num_microbatches = 1 + max((a.microbatch for row in compute for a in row), default=-1)
    if num_microbatches == 0:
        raise _fail("schedule has no compute actions", schedule, ())
    for s in range(len(schedule)):
        _check_stage(schedule, s, num_microbatches)
    lowered = lowered or lower(compute)
    if not deadlocks:
        return lowered
    zeros = (0.0,) * len(schedule)
    links = ((0.0, 0.0),) * (len(schedule) - 1)
    _run(lowered, stage_tables(lowered, zeros, zeros, zeros, links, links, num_microbatches=num_microbatches), record=False)
    return lowered


def _check_rows(schedule: Sequence[Sequence[Action]]) -> None:
    for s, row in enumerate(schedule):
        for i, a in enumerate(row):
            if not isinstance(a, Action):
                raise _fail(f"stage {s}, step {i}: {a!r} is not an Action", schedule, ())
            if a.stage != s:
                raise _fail(f"stage {s}, step {i}: {a} belongs to stage {a.stage}", schedule, [(s, i)])


def _check_lowering(schedule: Sequence[Sequence[Action]], compute: Schedule) -> Schedule:
    expected = lower(compute)
    for s, (row, want) in enumerate(zip(schedule, expected, strict=True)):
        for i in range(max(len(row), len(want))):
            got = row[i] if i < len(row) else None
            exp = want[i] if i < len(want) else None
            if got != exp:
                raise _fail(
                    f"stage {s}, step {i}: communication is not placed as lower() places it "
                    f"(expected {exp if exp is not None else 'end of list'}, got {got if got is not None else 'end of list'})",
                    schedule, [(s, i)] if got is not None else [(s, len(row) - 1)],
                )
    return expected


def _check_stage(schedule: Sequence[Sequence[Action]], s: int, num_microbatches: int) -> None:
    row = schedule[s]
    # step of each compute action, per kind and microbatch (every id is < num_microbatches)
    steps: dict[ActionKind, list[int | None]] = {k: [None] * num_microbatches for k in COMPUTE_KINDS}
    for i, a in enumerate(row):
        slots = steps.get(a.kind)
        if slots is None:
            continue
        seen = slots[a.microbatch]
        if seen is not None:
            raise _fail(f"stage {s}: {a} appears twice (steps {seen} and {i})", schedule, [(s, seen), (s, i)])
        slots[a.microbatch] = i
    for m, f, b, i_, w in zip(range(num_microbatches), steps[_F], steps[_B], steps[_I], steps[_W], strict=True):
        if f is None:
            raise _fail(f"stage {s}: no {s}F{m} (the schedule has {num_microbatches} microbatches, 0..{num_microbatches - 1})",
                        schedule, [])
        if b is not None and (i_ is not None or w is not None):
            other = i_ if i_ is not None else w
            raise _fail(f"stage {s}: microbatch {m} has both a full backward {s}B{m} and a split one",
                        schedule, [(s, b), (s, other)])
        if b is None and (i_ is None or w is None):
            missing = "B, or I and W" if i_ is None and w is None else ("I" if i_ is None else "W")
            present = [x for x in (i_, w) if x is not None]
            raise _fail(f"stage {s}: microbatch {m} has no {missing}", schedule, [(s, x) for x in present])
        first_back = b if b is not None else i_
        if first_back < f:
            raise _fail(f"stage {s}: {row[first_back]} (step {first_back}) comes before its forward {s}F{m} (step {f})",
                        schedule, [(s, first_back), (s, f)])
        if w is not None and w < i_:
            raise _fail(f"stage {s}: {s}W{m} (step {w}) comes before {s}I{m} (step {i_})", schedule, [(s, w), (s, i_)])


# --------------------------------------------------------------------------- memory


def in_flight_per_stage(schedule: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Per stage, the peak number of microbatches whose stashed activations are held.

    A microbatch holds its stash from its ``F`` until its ``W`` (or ``B``): the count is
    the maximum, over the stage's action order, of ``#F done - #(W or B) done``.
    """
    out = []
    for row in schedule:
        held = peak = 0
        for a in row:
            k = a.kind
            if k == _F:
                held += 1
                peak = held if held > peak else peak
            elif k == _W or k == _B:
                held -= 1
        out.append(peak)
    return tuple(out)


def recomputed_live(schedule: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Per stage, the most microbatches whose recomputed activations are live at once: from the
    start of their ``I`` (or ``B``) until the end of their ``W`` (or ``B``). Compute actions only
    are read, so a lowered schedule works too (:mod:`deepcee.simulator.memory` uses it; the
    cached road is :func:`deepcee.schedule.program.stage_recomputed_live`)."""
    out = []
    for row in schedule:
        live = peak = 0
        for a in row:
            k = a.kind
            if k is _I or k is _B:
                live += 1
                if live > peak:
                    peak = live
            if k is _W or k is _B:
                live -= 1
        out.append(peak)
    return tuple(out)


# --------------------------------------------------------------------------- dry run


@dataclass(frozen=True, slots=True, kw_only=True)
class DryRun:
    """Timing of one schedule under the dry-run model (see :func:`dry_run`)."""

    makespan_s: float
    """Time from 0 until the last stage finishes its lowered list."""
    start_s: Mapping[Action, float]
    """Start of every lowered action. A ``RECV`` starts when the stage reaches it."""
    end_s: Mapping[Action, float]
    """End of every lowered action. A ``RECV`` ends at delivery (or when reached, if
    later); a ``SEND`` ends when issued (it never blocks the stage)."""
    delivered_s: Mapping[Action, float]
    """For every ``SEND``: when the transfer is delivered to the peer stage."""
    busy_s: tuple[float, ...]
    """Per stage, the sum of its compute durations."""
    bubble_fraction: float
    """``1 - sum(busy_s) / (S x makespan_s)`` (0 when the makespan is 0)."""
    schedule: Schedule
    """The lowered schedule that was executed."""


def dry_run(
    schedule: Sequence[Sequence[Action]],
    *,
    forward_s: float | Sequence[float],
    input_grad_s: float | Sequence[float],
    weight_grad_s: float | Sequence[float],
    comm_forward: LinkCost | Sequence[LinkCost] = (0.0, 0.0),
    comm_backward: LinkCost | Sequence[LinkCost] = (0.0, 0.0),
) -> DryRun:
    """Execute ``schedule`` on one device per stage and time every action.

    Costs: ``forward_s``, ``input_grad_s``, ``weight_grad_s`` give per stage (a sequence of
    length ``S``, or one number for all stages) the duration of ``F``, ``I`` and ``W``; a
    ``B`` costs ``I + W``. ``comm_forward[b]`` is ``(latency_s, serialization_s)`` of one
    activation transfer on the directed link from stage ``b`` to ``b+1``;
    ``comm_backward[b]`` the same for one gradient transfer from ``b+1`` to ``b`` (a
    sequence of length ``S-1``, or one pair for all boundaries).

    Model: the schedule is validated, lowered with :func:`lower` (an already lowered schedule
    is used as it is) and run by the simulator's interpreter
    (:mod:`deepcee.schedule.interpreter`) on :func:`~deepcee.schedule.interpreter.stage_tables`:
    stage ``s`` is one device, and each direction of a boundary is one link. So:

    1. Every stage executes its lowered list strictly in order, starting at time 0.
    2. A compute action starts as soon as the stage finished its previous action and
       occupies the stage for its duration.
    3. ``SEND`` takes no stage time. A transfer issued at ``t`` on a directed link starts
       serialising at ``max(t, link free)`` (first in, first out per link), keeps the link
       busy for ``serialization_s`` and is delivered ``latency_s`` after its serialisation
       ends. The two directions of a boundary are independent links.
    4. ``RECV`` takes no stage time but blocks until its transfer is delivered: the stage
       continues at ``max(reached, delivered)``.
    5. If at some point no stage can continue and some have actions left, the schedule
       deadlocks: :class:`ScheduleError` with the blocked actions marked.

    ``makespan_s`` is the latest end over all stages; ``bubble_fraction`` is
    ``1 - sum(busy_s) / (S x makespan_s)``.
    """
    lowered = lower_validated(schedule)
    n = len(schedule)
    f = per_stage("forward_s", forward_s, n)
    i = per_stage("input_grad_s", input_grad_s, n)
    w = per_stage("weight_grad_s", weight_grad_s, n)
    cf = per_boundary("comm_forward", comm_forward, n - 1)
    cb = per_boundary("comm_backward", comm_backward, n - 1)
    run, ends = _run(lowered, stage_tables(lowered, f, i, w, cf, cb), record=True)
    start, end, delivered = {}, {}, {}
    for row, stamps in zip(lowered, run.stamps, strict=True):
        for a, (begin, finish, arrive) in zip(row, stamps, strict=True):
            start[a], end[a] = begin, finish
            if a.kind in (K.SEND_F, K.SEND_B):
                delivered[a] = arrive
    makespan = max(ends, default=0.0)
    bubble = 1.0 - sum(run.busy_s) / (n * makespan) if makespan > 0 else 0.0
    return DryRun(makespan_s=makespan, start_s=start, end_s=end, delivered_s=delivered,
                  busy_s=tuple(run.busy_s), bubble_fraction=bubble, schedule=lowered)


def per_stage(name: str, value: float | Sequence[float], n: int) -> tuple[float, ...]:
    """``n`` finite values >= 0 from one number or a sequence; errors name ``name[index]``."""
    values = (value,) * n if isinstance(value, int | float) else tuple(value)
    if len(values) != n:
        raise ScheduleError(f"{name}: need {n} per-stage values, got {len(values)}")
    for s, v in enumerate(values):
        if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ScheduleError(f"{name}[{s}] must be a finite number >= 0, got {v!r}")
    return tuple(float(v) for v in values)


def per_boundary(name: str, value: LinkCost | Sequence[LinkCost], n: int) -> tuple[LinkCost, ...]:
    """``n`` ``(latency_s, serialization_s)`` pairs from one pair or a sequence of pairs."""
    is_pair = len(value) == 2 and all(isinstance(x, int | float) for x in value)  # type: ignore[arg-type]
    pairs = (value,) * n if is_pair else tuple(value)  # type: ignore[assignment]
    if len(pairs) != n:
        raise ScheduleError(f"{name}: need {n} (latency_s, serialization_s) pairs, one per boundary, got {len(pairs)}")
    out = []
    for b, pair in enumerate(pairs):
        if len(pair) != 2 or any(not isinstance(x, int | float) or not math.isfinite(x) or x < 0 for x in pair):
            raise ScheduleError(f"{name}[{b}] must be (latency_s, serialization_s), finite and >= 0, got {pair!r}")
        out.append((float(pair[0]), float(pair[1])))
    return tuple(out)


def _run(lowered: Schedule, tables: Tables, *, record: bool) -> tuple[Execution, list[float]]:
    """One pass of the interpreter from time 0 and each stage's finish; a deadlock becomes a marked table."""
    run = Execution(tables, record=record)
    try:
        ends, _ = run.pipeline(0.0)
    except Deadlock as err:
        waits = ", ".join(f"stage {s} at {lowered[s][p]}" for s, p in err.stuck)
        raise _fail(f"schedule deadlocks: every unfinished stage waits for a transfer that is never sent ({waits})",
                    lowered, err.stuck) from None
    return run, ends
