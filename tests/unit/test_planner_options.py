"""Every search budget and count of :class:`PlannerOptions` is checked up front: an integer >= 0,
else a one-line :class:`PlanError` naming the field (the options are reachable from the Python
API, ``deepcee.api``'s ``**options``, where a string once raised a bare TypeError and NaN or 2.5
were taken)."""

from __future__ import annotations

import numpy as np
import pytest

from deepcee.errors import PlanError
from deepcee.planner.options import PlannerOptions

COUNTS = ("sweep_top", "model_top", "refine_top", "compact_top", "confirm_top", "exhaustive_islands",
          "chain_budget", "walk_budget", "refine_best_guides", "grain_budget", "grain_chains", "screen_top",
          "screen_keep", "polish_budget", "polish_restarts", "polish_max_devices", "recompute_variant_budget",
          "compact_budget", "refine_budget", "score_budget", "screen_budget", "confirm_max_work",
          "compact_max_actions")


@pytest.mark.parametrize("bad", [-1, 2.5, float("nan"), "600", True, None])
@pytest.mark.parametrize("field", COUNTS)
def test_a_bad_budget_is_a_plan_error_naming_its_field(field: str, bad) -> None:
    with pytest.raises(PlanError, match=f"{field}: must be an integer >= 0") as err:
        PlannerOptions(**{field: bad})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field", COUNTS)
def test_a_good_budget_is_taken_as_given(field: str) -> None:
    default = getattr(PlannerOptions(), field)
    assert isinstance(default, int) and default >= 0
    assert getattr(PlannerOptions(**{field: np.int64(default + 1)}), field) == default + 1
    if field != "exhaustive_islands":  # at least one island is searched exactly
        assert getattr(PlannerOptions(**{field: 0}), field) == 0


@pytest.mark.parametrize("field", ["compact_budget", "refine_budget", "score_budget", "screen_budget",
                                   "confirm_max_work", "compact_max_actions", "walk_budget"])
def test_a_zero_budget_still_plans_and_the_plan_is_simulated(field: str) -> None:
    import random

    from conftest import random_cluster, toy_model

    from deepcee.planner.search import plan_training
    from deepcee.simulator import simulate

    c, m = random_cluster(random.Random(3), name="r3"), toy_model(8, params=20_000_000)
    plan = plan_training(c, m, 32, options=PlannerOptions(**{field: 0})).plan
    assert plan.estimate is not None and plan.estimate.iteration_s > 0
    assert simulate(plan, c, m, record=False).iteration_s > 0
