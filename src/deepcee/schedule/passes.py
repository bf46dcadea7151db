"""Passes over the action IR: lowering (adds sends and receives).

Lowering rule, per stage ``s`` of ``S`` (see :mod:`deepcee.schedule.ir` for the semantics):
``RECV_F`` right before each ``F`` when ``s > 0``; ``SEND_F`` right after each ``F`` when
``s < S-1``; ``RECV_B`` right before each ``I`` or ``B`` when ``s < S-1``; ``SEND_B`` right
after each ``I`` or ``B`` when ``s > 0``. ``W`` never communicates.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepcee.schedule.ir import Action, ActionKind, Schedule

K = ActionKind


def lower(schedule: Sequence[Sequence[Action]]) -> Schedule:
    """Insert communication actions into a compute-only schedule."""
    last = len(schedule) - 1
    out = []
    for s, row in enumerate(schedule):
        lowered: list[Action] = []
        for a in row:
            if not a.kind.is_compute:
                raise ValueError(f"lower() takes compute actions only, got {a} at stage {s}")
            backward = a.kind in (K.I, K.B)
            if a.kind == K.F and s > 0:
                lowered.append(Action(s, K.RECV_F, a.microbatch))
            if backward and s < last:
                lowered.append(Action(s, K.RECV_B, a.microbatch))
            lowered.append(a)
            if a.kind == K.F and s < last:
                lowered.append(Action(s, K.SEND_F, a.microbatch))
            if backward and s > 0:
                lowered.append(Action(s, K.SEND_B, a.microbatch))
        out.append(tuple(lowered))
    return tuple(out)
