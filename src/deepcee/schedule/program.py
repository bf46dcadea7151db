"""A plan's program: the validated, lowered action list of each of its stages (torch-free).

:func:`lowered_schedule` is the one road from a :class:`~deepcee.plan.Plan` to the actions
its devices run: the simulator, the runtime's executor, the planner's cost model,
``compare`` and ``deepcee train --dry-run`` all take their schedule from it, so they cannot
disagree about what a plan runs or about which plans are runnable.

The compute actions are the plan's explicit ``actions`` when it has them (``compact``), else
the named builder's (:func:`deepcee.schedule.builders.build_schedule`). They must have one
row per stage, pass :func:`deepcee.schedule.passes.validate` (every action once, in order,
in its own stage's row; explicit actions are also run to prove they cannot deadlock, which
the builders guarantee by construction: see [Note: builders cannot deadlock]) and cover
exactly ``plan.num_microbatches`` microbatches; then :func:`deepcee.schedule.passes.lower`
adds the communication. Every device of stage ``s`` runs row ``s``.

Results are cached by (schedule name, stages, microbatches, explicit actions): validating a
schedule of thousands of actions takes a while, and the planner asks for the same few
shapes for thousands of candidate plans.
"""

from __future__ import annotations

from functools import lru_cache

from deepcee.errors import ScheduleError
from deepcee.plan import Plan
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.ir import Schedule, parse_schedule
from deepcee.schedule.passes import in_flight_per_stage, lower_validated, recomputed_live


def lowered_schedule(plan: Plan) -> Schedule:
    """The validated, lowered action list of each stage of ``plan`` (see the module docstring).

    Raises :class:`ScheduleError` naming what is wrong (with a marked table for invalid or
    deadlocking actions).
    """
    return _program(plan.schedule, plan.num_stages, plan.num_microbatches, plan.actions)[0]


def stage_in_flight(plan: Plan) -> tuple[int, ...]:
    """Per stage, the most microbatches whose stashed activations ``plan``'s schedule holds
    at once (:func:`deepcee.schedule.passes.in_flight_per_stage` of :func:`lowered_schedule`)."""
    return _program(plan.schedule, plan.num_stages, plan.num_microbatches, plan.actions)[1]


def stage_recomputed_live(plan: Plan) -> tuple[int, ...]:
    """Per stage, the most microbatches whose recomputed activations ``plan``'s schedule keeps
    live at once (:func:`deepcee.schedule.passes.recomputed_live`; a pass over every action,
    asked for each plan the planner scores that recomputes, so cached with the program)."""
    return _program(plan.schedule, plan.num_stages, plan.num_microbatches, plan.actions)[2]


@lru_cache(maxsize=128)
def _program(name: str, num_stages: int, num_microbatches: int,
             actions: tuple[tuple[str, ...], ...]) -> tuple[Schedule, tuple[int, ...], tuple[int, ...]]:
    compute = parse_schedule(actions) if actions else build_schedule(name, num_stages, num_microbatches)
    if len(compute) != num_stages:
        raise ScheduleError(f"schedule has {len(compute)} stage rows, the plan {num_stages} stages")
    # [Note: builders cannot deadlock] the builders are the textbook schedules (GPipe, 1F1B and
    # its zero-bubble splits), deadlock-free for any number of stages and microbatches, and
    # tests/unit/test_schedule.py runs the deadlock check on each over a grid of sizes. Running
    # every new shape the planner tries (up to 32 stages x 2,048 microbatches) to prove it again
    # cost about a tenth of its planning time. Explicit actions get every check.
    lowered = lower_validated(compute, deadlocks=bool(actions))
    used = 1 + max(a.microbatch for row in compute for a in row)
    if used != num_microbatches:
        raise ScheduleError(f"schedule covers {used} microbatches, the plan has {num_microbatches}")
    return lowered, in_flight_per_stage(compute), recomputed_live(compute)
