"""Fidelity harness, pure parts: the plan sets (curated and generated for any cluster), the
analytic baseline, the report and its table."""

from __future__ import annotations

import pytest

from deepcee.errors import ProfileError
from deepcee.models import get_model
from deepcee.plan import SCHEDULES
from deepcee.profile import LayerTiming
from deepcee.profiler.fidelity import (
    FidelityReport,
    FidelityRow,
    MemoryRow,
    default_plans,
    format_table,
    generated_plans,
    validation_plans,
    without_measurements,
)
from deepcee.profiler.fidelity_report import ranking
from deepcee.scenarios import load_scenario
from deepcee.simulator.engine import simulate


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


def _layouts(plans):
    return {(p.schedule, p.microbatch_size, p.num_microbatches,
             tuple((s.layer_start, s.layer_stop, s.devices, s.shares) for s in p.stages)) for p in plans}


@pytest.mark.parametrize("scenario,model,count", [("cee-testbed", "gpt-tiny", 12), ("local-small", "resnet-tiny", 9)])
def test_generated_plans_are_different_and_varied_on_any_cluster(scenario, model, count):
    cluster, prof = load_scenario(scenario), get_model(model)
    plans = generated_plans(cluster, prof, count)
    assert len(plans) == count and len({p.system for p in plans}) == count and len(_layouts(plans)) == count
    assert {p.schedule for p in plans} == set(SCHEDULES)
    assert {p.num_stages for p in plans} >= {2, 3}
    assert any(len(st.devices) == 2 and len(set(st.shares)) == 2 for p in plans for st in p.stages)
    for p in plans:
        assert [s.layer_start for s in p.stages][0] == 0 and p.stages[-1].layer_stop == prof.num_layers
        assert p.num_microbatches >= p.num_stages
        assert simulate(p, cluster, prof, record=False).iteration_s > 0
    # stages meet across islands: consecutive single-device stages sit on different islands
    islands = {d.name: d.island for d in cluster.devices}
    first = next(p for p in plans if all(len(s.devices) == 1 for s in p.stages))
    assert islands[first.stages[0].devices[0]] != islands[first.stages[1].devices[0]]


def test_validation_plans_start_with_the_curated_set_and_extend_it():
    cluster, model = load_scenario("local-small"), get_model("gpt-tiny")
    curated = [p.system for p in default_plans(cluster, model)]
    assert [p.system for p in validation_plans(cluster, model, 4)] == curated[:4]
    plans = validation_plans(cluster, model, 13)
    assert [p.system for p in plans[:10]] == curated and len(_layouts(plans)) == 13
    assert len({p.system for p in plans}) == 13
    with pytest.raises(ProfileError, match="num_plans"):
        validation_plans(cluster, model, 0)


def test_analytic_baseline_drops_measurements():
    model = get_model("gpt-tiny")
    t = LayerTiming(forward=(1e-3, 1e-4), input_grad=(1e-3, 1e-4), weight_grad=(1e-3, 1e-4))
    measured = model.with_measured("cpu-worker", (t,) * model.num_layers, source="m", call_overhead=t)
    bare = without_measurements(measured)
    assert bare.measured == {} and bare.measured_call_overhead == {} and bare.layers == model.layers


def test_report_summary_json_and_table():
    mem = (MemoryRow(device="a", predicted_bytes=110e6, measured_bytes=100e6),)
    rows = tuple(FidelityRow(name=f"p{k}", schedule="gpipe", num_stages=2, microbatch_size=4, num_microbatches=4,
                             layout="x", dilation=3.0, measured_s=0.1, measured_steps_s=(0.2, 0.1, 0.1),
                             simulated_s=0.1 * (1 + e), analytic_s=0.08, memory=mem, pacing=pace)
                 for k, (e, pace) in enumerate(((0.1, 1.0), (-0.3, 1.5))))
    rep = FidelityReport(rows=rows, spread_plan="p0", spread_medians_s=(0.1, 0.11, 0.09), cluster="c", model="m",
                         cores=0.6, steps=3, warmup_steps=1, emulation="emulated", wall_s=1.0, mode="realnet",
                         runtime="deepcee (mode realnet)")
    assert rep.mean_abs_error == pytest.approx(0.2) and rep.max_abs_error == pytest.approx(0.3)
    assert rep.analytic_mean_abs_error == pytest.approx(0.2) and rep.analytic_max_abs_error == pytest.approx(0.2)
    assert rep.spread == pytest.approx(0.2) and rep.memory_under == []
    d = rep.to_dict()
    assert d["format"] == "deepcee.fidelity" and d["rows"][1]["error"] == pytest.approx(-0.3)
    assert d["memory"]["mean_over"] == pytest.approx(0.1) and d["memory"]["under"] == 0
    assert "real TCP" in d["labels"]["measured_mode"] and "datasheet" in d["labels"]["analytic"]
    table = format_table(rep)
    assert "| p1 | gpipe | 2 | 4 x 4 | 3.00 | 1.50! | 100.0 | 70.0 | -30.0% | 80.0 | -20.0% | 105 / 95 |" in table
    assert [r.name for r in rep.paced_rows] == ["p0"] and d["pacing"]["behind"] == ["p1"]
    assert "Host behind the emulated pace (pacing > 1.10, marked !): p1." in table
    assert "spread (p0, 3 runs): 20.0%" in table and "0 under the measured peak" in table


def _row(name, measured, simulated):
    return FidelityRow(name=name, schedule="gpipe", num_stages=2, microbatch_size=1, num_microbatches=2, layout="",
                       dilation=1.0, measured_s=measured, measured_steps_s=(measured,), simulated_s=simulated,
                       analytic_s=simulated)


def test_ranking_holds_pairs_apart_by_more_than_the_margin():
    rows = [_row("a", 1.00, 1.2), _row("b", 1.03, 1.1), _row("c", 1.50, 1.0), _row("d", 2.0, 3.0)]
    held, wrong = ranking(rows)
    # a-b differ by 3%: not held; a-c, a-d, b-c, b-d, c-d are, and c is ranked faster than a and b
    assert held == 5 and sorted(wrong) == [("a", "c"), ("b", "c")]
