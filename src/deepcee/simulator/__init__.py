"""Discrete-event simulator of lowered schedules on a cluster (torch-free).

:func:`simulate` runs a plan and returns a :class:`SimResult`; :mod:`.trace` exports its
timeline (Chrome trace JSON, PNG Gantt chart); :mod:`.collectives` and :mod:`.memory` hold the
analytic all-reduce and memory models the planner shares.
"""

from deepcee.simulator.engine import (
    Event,
    Segment,
    SimResult,
    optimizer_step_s,
    simulate,
    to_estimate,
)

__all__ = ["Event", "Segment", "SimResult", "optimizer_step_s", "simulate", "to_estimate"]
