"""Action IR: ``2F0`` = stage 2, forward, microbatch 0 (grammar of torch.distributed.pipelining).

Compute kinds: ``F`` forward, ``I`` backward for inputs, ``W`` backward for weights, ``B``
full backward (``I`` then ``W`` fused). Communication kinds, added by lowering
(:mod:`deepcee.schedule.passes`): ``SEND_F``/``RECV_F`` (activations to/from the next/previous
stage) and ``SEND_B``/``RECV_B`` (input gradients to/from the previous/next stage).

A *schedule* is a tuple, indexed by stage, of tuples of actions executed in order by every
device of that stage. Lowered semantics (both interpreters follow them):

- ``sRECV_Fm`` blocks until all pieces of microbatch m's activation from stage s-1 arrived;
  ``sRECV_Bm`` likewise for the gradient from stage s+1.
- ``sSEND_Fm`` / ``sSEND_Bm`` start transfers and do not block the device (receives are
  pre-posted, so a send never waits for the receiver to reach its receive).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from deepcee.errors import ScheduleError


class ActionKind(StrEnum):
    F = "F"
    I = "I"  # noqa: E741
    W = "W"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS


COMPUTE_KINDS = frozenset((ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B))
"""``F``, ``I``, ``W``, ``B`` (a set: looking up an enum member by class attribute is slow)."""


_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


_new = object.__new__
_set_stage, _set_kind, _set_microbatch = Action.stage.__set__, Action.kind.__set__, Action.microbatch.__set__


def make_action(stage: int, kind: ActionKind, microbatch: int) -> Action:
    """``Action(stage, kind, microbatch)`` in half the time, for lowering long schedules (the frozen
    dataclass's ``__init__`` goes through ``object.__setattr__`` for every field; the slots'
    own setters do not). Equal and hashing alike."""
    a = _new(Action)
    _set_stage(a, stage)
    _set_kind(a, kind)
    _set_microbatch(a, microbatch)
    return a


def parse_action(text: str) -> Action:
    m = _ACTION_RE.match(text.strip())
    if not m:
        raise ScheduleError(f"cannot parse action {text!r} (expected e.g. '2F0', '1I3', '0SEND_F5')")
    return Action(int(m.group(1)), ActionKind(m.group(2)), int(m.group(3)))


Schedule = tuple[tuple[Action, ...], ...]


def parse_schedule(stages: Iterable[Iterable[str] | str]) -> Schedule:
    """Per-stage lists of action strings (or one whitespace-separated string per stage)."""
    out = []
    for row in stages:
        items = row.split() if isinstance(row, str) else row
        out.append(tuple(parse_action(a) for a in items))
    return tuple(out)


def format_schedule(schedule: Sequence[Sequence[Action]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(str(a) for a in row) for row in schedule)
