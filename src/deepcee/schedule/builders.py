"""Schedule builders: compute-only per-stage action lists.

``gpipe``: all forwards, then all full backwards. ``1f1b``: ``S-1-s`` warm-up forwards,
then alternate one forward / one full backward, then drain.
"""

from __future__ import annotations

from deepcee.errors import ScheduleError
from deepcee.schedule.ir import Action, ActionKind, Schedule

K = ActionKind


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(f"need >= 1 stage and microbatch, got {num_stages} stages, {num_microbatches} microbatches")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    _check(num_stages, num_microbatches)
    return tuple(
        tuple(Action(s, K.F, m) for m in range(num_microbatches))
        + tuple(Action(s, K.B, m) for m in range(num_microbatches))
        for s in range(num_stages)
    )


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    _check(num_stages, num_microbatches)
    out = []
    for s in range(num_stages):
        warm = min(num_stages - 1 - s, num_microbatches)
        row = [Action(s, K.F, m) for m in range(warm)]
        f, b = warm, 0
        while f < num_microbatches:
            row += [Action(s, K.F, f), Action(s, K.B, b)]
            f, b = f + 1, b + 1
        row += [Action(s, K.B, m) for m in range(b, num_microbatches)]
        out.append(tuple(row))
    return tuple(out)


BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build a named fixed schedule (``compact`` needs costs: see ``build_compact``)."""
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r} (known: {', '.join(BUILDERS)})") from None
    return builder(num_stages, num_microbatches)
