"""Schedule builders: compute-only per-stage action lists (``S`` stages, ``M`` microbatches).

Every builder accepts any ``S >= 1`` and ``M >= 1`` (``M < S`` included) and returns a
schedule that passes :func:`deepcee.schedule.passes.validate`. Forwards and backwards run in
microbatch order on every stage. "In flight" on a stage counts microbatches whose forward ran
and whose ``W`` (or ``B``) has not: their stashed activations are held
(:func:`deepcee.schedule.passes.in_flight_per_stage`).

- ``gpipe``: all forwards, then all full backwards. In flight: ``M`` on every stage.
- ``1f1b``: ``w = min(S-1-s, M)`` warm-up forwards on stage ``s``, then alternate one forward
  and one full backward, then drain. In flight: ``min(S-s, M)``.
- ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, handcrafted schedule 1):
  1F1B's order with each ``B`` split into ``I`` then ``W``, so the peak in flight is 1F1B's,
  ``min(S-s, M)``. The input gradient leaves after ``I`` instead of after ``I+W``, which
  shortens the backward critical path by one ``W`` per boundary, and the ``W`` passes run
  while the stage waits for the next input gradient, filling the drain bubble. With equal
  stages and no communication the makespan is ``M(F+I+W) + (S-1)(F+I)`` against the
  ``(M+S-1)(F+I+W)`` of GPipe and 1F1B, for every ``M >= 1``: the bubble shrinks from
  ``(S-1)(F+I+W)`` to ``(S-1)(F+I)``, the paper's ZB-H1 figure (tested).
- ``zb-h2`` (handcrafted schedule 2): ``w = min(2(S-s)-1, M)`` warm-up forwards, about twice
  1F1B's, which is exactly enough, with unit costs, to keep stage ``s`` busy until the input
  gradient of its first microbatch comes back (no warm-up bubble); then cycles of
  ``I_k, W_k, F_{w+k}`` (``W`` before the next ``F`` keeps the peak at ``w``), then
  ``I_k, W_k`` to drain. In flight: ``min(2(S-s)-1, M)``. With equal stages and no
  communication its makespan equals ZB-H1's: the last stage holds one microbatch either way
  and paces the pipeline, so the idle time only moves from the warm-up to the drain. Its
  gain is hiding link latency: the extra forwards keep a stage busy during the round trip
  (4 stages, 12 microbatches, unit costs, transfers of latency 2 and serialisation 0.2
  each way: makespan 56.8 against ZB-H1's 82.4 in the dry run). The paper's version also
  moves ``W`` passes to the tail, which under our memory model (a microbatch's stash is held
  until its ``W``) would raise the last stages' in-flight count; the cost-aware builder
  (:func:`deepcee.schedule.compact.build_compact`) makes such moves when the memory limit
  allows them.

``compact`` needs per-stage costs and per-link transfer times, so it is not registered here;
see :func:`deepcee.schedule.compact.build_compact`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deepcee.errors import ScheduleError
from deepcee.schedule.ir import Action, ActionKind, Schedule, make_action

K = ActionKind
_F, _I, _W, _B = K.F, K.I, K.W, K.B


def _check(num_stages: int, num_microbatches: int) -> None:
    for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ScheduleError(f"{name} must be an integer >= 1, got {v!r}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    _check(num_stages, num_microbatches)
    return tuple(
        tuple(make_action(s, _F, m) for m in range(num_microbatches))
        + tuple(make_action(s, _B, m) for m in range(num_microbatches))
        for s in range(num_stages)
    )


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    _check(num_stages, num_microbatches)
    out = []
    for s in range(num_stages):
        warm = min(num_stages - 1 - s, num_microbatches)
        row = [make_action(s, _F, m) for m in range(warm)]
        f, b = warm, 0
        while f < num_microbatches:
            row += [make_action(s, _F, f), make_action(s, _B, b)]
            f, b = f + 1, b + 1
        row += [make_action(s, _B, m) for m in range(b, num_microbatches)]
        out.append(tuple(row))
    return tuple(out)


def split_backward(schedule: Sequence[Sequence[Action]]) -> Schedule:
    """Replace every full backward ``sBm`` by ``sIm`` immediately followed by ``sWm``.

    Same order and in-flight counts; the input gradient is sent one ``W`` earlier.
    """
    out = []
    for row in schedule:
        new: list[Action] = []
        for a in row:
            if a.kind == _B:
                new += [make_action(a.stage, _I, a.microbatch), make_action(a.stage, _W, a.microbatch)]
            else:
                new.append(a)
        out.append(tuple(new))
    return tuple(out)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with split backward (see the module docstring for why that is ZB-H1 here)."""
    return split_backward(one_f_one_b(num_stages, num_microbatches))


def zb_h2(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H2: ``min(2(S-s)-1, M)`` warm-up forwards, then ``I, W, F`` cycles, then ``I, W``."""
    _check(num_stages, num_microbatches)
    m_total = num_microbatches
    out = []
    for s in range(num_stages):
        warm = min(2 * (num_stages - s) - 1, m_total)
        row = [make_action(s, _F, m) for m in range(warm)]
        for k in range(m_total - warm):
            row += [make_action(s, _I, k), make_action(s, _W, k), make_action(s, _F, warm + k)]
        for k in range(m_total - warm, m_total):
            row += [make_action(s, _I, k), make_action(s, _W, k)]
        out.append(tuple(row))
    return tuple(out)


BUILDERS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
}


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Build a named fixed schedule (``compact`` needs costs: see ``build_compact``)."""
    try:
        builder = BUILDERS[name]
    except KeyError:
        hint = " ('compact' needs costs: use deepcee.schedule.compact.build_compact)" if name == "compact" else ""
        raise ScheduleError(f"unknown schedule {name!r} (known: {', '.join(BUILDERS)}){hint}") from None
    return builder(num_stages, num_microbatches)
