"""The main job's pieces for real, small: the calibration's runs share one launch and give a
document the planner reads; the four systems train in one launch to a (loose) target, identical
plans train once, an exact baseline stops at its step cap with a projected (labelled) time, and
the relaxed run's timeline carries its cross-island averages. Hard deadlines."""

from __future__ import annotations

import time

import pytest

from deepcee import ttt
from deepcee.calibrate import CalibrationConfig, calibrate
from deepcee.mainjob import relaxed_timeline
from deepcee.models import get_model
from deepcee.plan import Strategy
from deepcee.planner.efficiency import DefaultEfficiency, efficiency_from_dict
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 300
TARGET = 4.6  # gpt-tiny nats per byte: untrained ln 256 = 5.5; a few steps of AdamW 3e-3 reach it


def test_calibration_runs_share_one_launch_and_are_read_back(tmp_path):
    cluster = load_scenario("local-small")
    cfg = CalibrationConfig(model="gpt-tiny", global_batch=32, target_loss=TARGET, eval_every=2, max_steps=12,
                            periods=(2,), lr=3e-3, out_dir=str(tmp_path / "cal"), deadline_s=DEADLINE_S)
    t0 = time.monotonic()
    doc = calibrate(cluster, get_model("gpt-tiny"), cfg, cluster_ref="local-small")
    assert time.monotonic() - t0 < DEADLINE_S
    ref = doc["reference"]
    assert ref["steps_to_target"] % 2 == 0 and ref["samples_to_target"] == 32 * ref["steps_to_target"]
    (entry,) = doc["entries"]
    assert entry["strategy"]["period"] == 2 and entry["multiplier"] == entry["samples_to_target"] / \
        ref["samples_to_target"]
    eff = efficiency_from_dict(doc, file="efficiency.json")
    assert eff.reference_steps == ref["steps_to_target"]


def test_four_systems_train_once_each_with_caps_and_a_relaxed_timeline(tmp_path):
    cluster = load_scenario("local-small")
    profile = get_model("gpt-tiny")
    planned = ttt.candidates(cluster, profile, 32, "gpt-tiny", "local-small", DefaultEfficiency())
    cands = dict(planned.systems)
    # average often enough that the short run holds averages (the planner's H is larger)
    relaxed = cands["deepcee-relaxed"]
    cands["deepcee-relaxed"] = ttt.Candidate(
        system=relaxed.system, plan=relaxed.plan.replace(strategy=Strategy(kind="model-averaging", period=2)),
        simulated_samples_per_s=relaxed.simulated_samples_per_s, multiplier=relaxed.multiplier,
        multiplier_source=relaxed.multiplier_source, islands=relaxed.islands)
    cfg = ttt.TttConfig(model="gpt-tiny", global_batch=32, target_loss=TARGET, eval_every=2, max_steps=16, lr=3e-3,
                        mode="emulated", out_dir=str(tmp_path), deadline_s=DEADLINE_S)
    caps = ttt.step_caps(cands, 32 * 8.0, factor=2.0, eval_every=2)
    assert "ddp-all" in caps and "deepcee-sync" not in caps  # DDP is predicted ~10x slower on local-small
    caps["ddp-all"] = 2  # one evaluation: it stops before the target
    t0 = time.monotonic()
    results = ttt.train_all(cands, cluster, cfg, trace=("deepcee-relaxed",), max_steps=caps)
    assert time.monotonic() - t0 < DEADLINE_S
    same = ttt._same_plan(cands["deepcee-sync"].plan, cands["single-island"].plan)
    assert (results["deepcee-sync"].run_dir == results["single-island"].run_dir) == same
    doc = ttt.report(cands, results, cfg, 32 * 8.0, None, {"warning": None})
    by = {r["system"]: r for r in doc["systems"]}
    assert by["deepcee-relaxed"]["semantics"] == "relaxed" and by["deepcee-sync"]["semantics"] == "exact"
    assert by["deepcee-sync"]["reached"] and by["deepcee-relaxed"]["reached"]
    if same:
        assert "trained once" in by["single-island"]["note"]
    ddp = by["ddp-all"]
    assert ddp["steps_run"] == 2 and not ddp["reached"] and ddp["measured_time_to_target_s"] is None
    assert ddp["projected_time_to_target_s"] == pytest.approx(32 * 8.0 / ddp["measured_samples_per_s"])
    assert "PROJECTED" in ttt.format_table(doc)
    trace = relaxed_timeline(results["deepcee-relaxed"], cands["deepcee-relaxed"].plan, cluster)
    spans = [e for e in trace["traceEvents"] if e.get("cat") == "cross-island"]
    assert spans and trace["otherData"]["cross_island_spans"] == len(spans)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert any("edge" in n for n in names) and any("cloud" in n for n in names)
