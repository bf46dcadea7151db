"""The planner (torch-free): groups devices, scores plans, searches the plan space.

- :mod:`deepcee.planner.grouping`: two-level grouping (islands by link cost, groups by speed).
- :mod:`deepcee.planner.cost_model`: the analytic cost model and the :class:`CostModel`
  protocol (the simulator plugs in through :class:`SimulatorCostModel`).
- :mod:`deepcee.planner.ranges`: the same costs for every contiguous layer range at once.
- :mod:`deepcee.planner.search`: :func:`plan_training`, the search over the plan space, run
  on :mod:`~deepcee.planner.space` (the plan space), :mod:`~deepcee.planner.split` (the
  layer-split DP), :mod:`~deepcee.planner.steps` (the search state and its steps) and
  :mod:`~deepcee.planner.explain` (the explanation).
- :mod:`deepcee.planner.baselines`, :mod:`deepcee.planner.bound`, :mod:`deepcee.planner.compare`:
  baseline plans on the same cost model, an upper bound, comparisons (with the crossover
  study of :mod:`deepcee.planner.crossover`).

The names below are imported on first use, so importing one submodule does not load the rest.

Example::

    from deepcee.models import get_model
    from deepcee.planner import plan_training
    from deepcee.scenarios import load_scenario

    result = plan_training(load_scenario("cee-testbed"), get_model("gpt2"), 64)
    print("\\n".join(result.explanation))
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "group_devices": "grouping",
    "Grouping": "grouping",
    "AnalyticCostModel": "cost_model",
    "CostModel": "cost_model",
    "PlanCost": "cost_model",
    "SimulatorCostModel": "cost_model",
    "Candidate": "search",
    "PlannerOptions": "options",
    "PlanResult": "search",
    "plan_training": "search",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
