"""Fidelity harness, pure parts: the plan set, per-plan measured lines, the report and its table."""

from __future__ import annotations

import pytest

from deepcee.cluster import DeviceKind
from deepcee.models import get_model
from deepcee.plan import SCHEDULES
from deepcee.profiler.fidelity import (
    FidelityReport,
    FidelityRow,
    default_plans,
    format_table,
    lines_from_probes,
    plan_profile,
)
from deepcee.scenarios import load_scenario
from deepcee.simulator.engine import simulate

KIND = DeviceKind(name="cpu-worker", peak_flops_per_s=5e10, memory_bytes=2**31)


def _lines() -> dict:
    """Layer i: F 1 ms, I 2 ms, W 3 ms, B 4 ms (fixed) + i x 0.1 ms per sample; first stage: I 0, W 5, B 4.5."""
    inner = tuple({"F": (1e-3, i * 1e-4), "I": (2e-3, i * 1e-4), "W": (3e-3, i * 1e-4), "B": (4e-3, i * 1e-4)}
                  for i in range(6))
    first = tuple({"F": (1e-3, i * 1e-4), "I": (0.0, 0.0), "W": (5e-3, i * 1e-4), "B": (4.5e-3, i * 1e-4)}
                  for i in range(6))
    return {"cpu-worker": (inner, first)}


def test_default_plans_cover_every_schedule_and_run_in_the_simulator():
    cluster, model = load_scenario("local-small"), get_model("gpt-tiny")
    plans = default_plans(cluster, model)
    assert len(plans) >= 8 and len({p.system for p in plans}) == len(plans)
    assert {p.schedule for p in plans} == set(SCHEDULES)
    assert {p.num_stages for p in plans} == {2, 3, 4}
    assert any(len(set(st.shares)) > 1 for p in plans for st in p.stages)  # uneven shares
    assert len({p.num_microbatches for p in plans}) >= 3
    for p in plans:
        assert (p.schedule == "compact") == bool(p.actions)
        assert simulate(p, cluster, model, record=False).iteration_s > 0


def test_plan_profile_gives_each_plan_the_lines_of_the_passes_it_runs():
    cluster, model = load_scenario("local-small"), get_model("gpt-tiny")
    plans = {p.system: p for p in default_plans(cluster, model)}
    lines = _lines()
    gpipe = plans["gpipe-2"]  # stages [0, 3) and [3, 6), fused backward
    view = plan_profile(model, lines, gpipe)
    # first stage: first-stage B lines, as I (W is 0); second stage: inner B
    assert view.time_s(0, 3, "B", 4, KIND) == pytest.approx(sum(4.5e-3 + i * 4e-4 for i in range(3)))
    assert view.time_s(0, 3, "W", 4, KIND) == 0
    assert view.time_s(3, 6, "B", 4, KIND) == pytest.approx(sum(4e-3 + i * 4e-4 for i in range(3, 6)))
    zb = plans["zbh1-3"]  # stages [0, 2), [2, 4), [4, 6), split backward
    view = plan_profile(model, lines, zb)
    assert view.time_s(0, 2, "I", 4, KIND) == 0
    assert view.time_s(0, 2, "W", 4, KIND) == pytest.approx(sum(5e-3 + i * 4e-4 for i in range(2)))
    assert view.time_s(2, 4, "I", 4, KIND) == pytest.approx(sum(2e-3 + i * 4e-4 for i in range(2, 4)))
    assert view.time_s(4, 6, "F", 2, KIND) == pytest.approx(sum(1e-3 + i * 2e-4 for i in range(4, 6)))
    probes = {"kind_lines": {k: {"layers": [{p: list(v) for p, v in la.items()} for la in inner],
                                 "first_stage": [{p: list(v) for p, v in la.items()} for la in first]}
                             for k, (inner, first) in lines.items()}}
    assert lines_from_probes(probes) == lines


def test_report_summary_json_and_table():
    rows = tuple(FidelityRow(name=f"p{k}", schedule="gpipe", num_stages=2, microbatch_size=4, num_microbatches=4,
                             layout="x", dilation=3.0, measured_s=0.1, measured_steps_s=(0.2, 0.1, 0.1),
                             simulated_s=0.1 * (1 + e), lines_s=0.1 * (1 + e / 2), analytic_s=0.08)
                 for k, e in enumerate((0.1, -0.3)))
    rep = FidelityReport(rows=rows, spread_plan="p0", spread_medians_s=(0.1, 0.11, 0.09), cluster="c", model="m",
                         cores=0.6, steps=3, warmup_steps=1, emulation="emulated", wall_s=1.0)
    assert rep.mean_abs_error == pytest.approx(0.2) and rep.max_abs_error == pytest.approx(0.3)
    assert rep.lines_mean_abs_error == pytest.approx(0.1) and rep.analytic_max_abs_error == pytest.approx(0.2)
    assert rep.spread == pytest.approx(0.2)
    d = rep.to_dict()
    assert d["format"] == "deepcee.fidelity" and d["rows"][1]["error"] == pytest.approx(-0.3)
    table = format_table(rep)
    assert "| p1 | gpipe | 2 | 4 x 4 | 3.00 | 100.0 | 85.0 | -15.0% | 70.0 | -30.0% |" in table
    assert "spread (p0, 3 runs): 20.0%" in table
