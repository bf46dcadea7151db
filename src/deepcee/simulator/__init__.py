"""Discrete-event simulator of lowered schedules on a cluster (torch-free).

:func:`simulate` runs a plan and returns a :class:`SimResult`; :mod:`.trace` exports its
timeline (Chrome trace JSON, PNG Gantt chart); :mod:`.memory` holds the memory model the planner
shares. The link and collective models live in the core (:mod:`deepcee.comm`), the timing
interpreter of lowered schedules in :mod:`deepcee.schedule.interpreter`.
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
