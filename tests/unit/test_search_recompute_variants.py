"""Compact schedules with more recomputation for the best fixed-schedule pipelines ([Note: compact
recomputation] in deepcee.planner.search): which flags are built, within what budget, and
that each figure is the cost model's own figure of a valid compact plan."""

from __future__ import annotations

import pytest
from test_search_polish import _cluster, _model, _scored  # noqa: I001  (tests/unit is on the path)

from deepcee.errors import PlanError
from deepcee.planner.search import PlannerOptions, _recompute_variants, new_search
from deepcee.planner.space import StageLayout, schedule_in_flight


def _fixed_plan(options: PlannerOptions | None = None):
    search = new_search(_cluster(), _model(), 64, options or PlannerOptions())
    cand = _scored(search, [(0, search.grouping.islands[0].devices, 2), (2, search.grouping.islands[2].devices, 2)],
                   2, "zb-h1")
    return search, cand.plan


def test_builds_zb_h2_every_stage_and_own_flags_as_compact_plans() -> None:
    search, plan = _fixed_plan()
    got = _recompute_variants(search, [plan])
    lay = StageLayout(slots=tuple(st.devices for st in plan.stages), islands=(), label="")
    tab = search.dp_inputs(lay, plan.microbatch_size)
    split = [st.layer_start for st in plan.stages] + [plan.num_layers]
    want = {tab.recompute_flags(split, schedule_in_flight("zb-h2", plan.num_stages, tab.m)),
            (True,) * plan.num_stages, tuple(st.recompute for st in plan.stages)}
    assert len(want) >= 2
    # a compact schedule was built for every distinct choice (the search keeps each it built) ...
    built = {tuple(st.recompute for st in stages) for stages, n, _, _ in search.compacts if n == plan.microbatch_size}
    assert want <= built
    # ... and those that fit memory come back, one plan per choice, own flags among them
    flags = {tuple(st.recompute for st in c.plan.stages) for c in got}
    assert flags <= want and tuple(st.recompute for st in plan.stages) in flags
    assert len(flags) == len(got)
    for c in got:
        assert c.plan.schedule == "compact" and c.plan.actions
        assert [(st.layer_start, st.layer_stop, st.devices) for st in c.plan.stages] == \
            [(st.layer_start, st.layer_stop, st.devices) for st in plan.stages]
        again = search.cost_model.estimate(c.plan, search.cluster, search.model)
        assert again.iteration_s == c.estimate.iteration_s
        assert not again.exceeds_memory(search.cluster.memory_bytes)


def test_budget_bounds_the_builds_and_zero_switches_them_off() -> None:
    search, plan = _fixed_plan(PlannerOptions(recompute_variant_budget=0))
    assert _recompute_variants(search, [plan]) == []
    one = plan.num_stages * plan.num_microbatches
    search, plan = _fixed_plan(PlannerOptions(recompute_variant_budget=one))
    assert len(_recompute_variants(search, [plan])) == 1  # the first choice only (ZB-H2's flags)
    with pytest.raises(PlanError, match="recompute_variant_budget"):
        PlannerOptions(recompute_variant_budget=-1)
