"""Time to target: the stop rule, the outcome from step records, its JSON, the config checks,
the calibration's efficiency JSON (read back by the planner) and the convnet-tiny task."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from deepcee import nets
from deepcee.calibrate import (
    CalibrationConfig,
    CalibrationRun,
    efficiency_document,
    reference_plan,
    setting_name,
    settings,
)
from deepcee.errors import SpecError
from deepcee.jobconfig import read_job_config
from deepcee.models import get_model
from deepcee.plan import Plan, ReplicaPlan, StagePlan, Strategy
from deepcee.planner.efficiency import DEFAULT_SOURCE, DefaultEfficiency, efficiency_from_dict
from deepcee.runtime.data import SHAPES, dataset_for
from deepcee.runtime.job import TrainConfig
from deepcee.runtime.target import TargetOutcome, check_target_loss, clock_of, outcome, reached
from deepcee.train import add_train_arguments


def test_reached_needs_both_and_is_inclusive():
    assert reached(0.5, 0.5) and reached(0.4, 0.5)
    assert not reached(0.51, 0.5) and not reached(None, 0.5) and not reached(0.1, None)


def test_outcome_sums_step_times_and_samples_up_to_the_first_evaluation_at_target():
    steps = [(0, 0.5, 32, None), (1, 0.25, 32, 1.2), (2, 0.25, 16, None), (3, 1.0, 32, 0.8), (4, 1.0, 32, 0.7)]
    out = outcome(steps, target_loss=0.9, clock="emulated")
    assert [p.steps for p in out.curve] == [2, 4, 5]
    assert out.reached_at is not None
    assert (out.reached_at.steps, out.reached_at.samples, out.reached_at.time_s) == (4, 112, 2.0)
    assert out.final_eval_loss == 0.7
    assert "reached in 2.000 s (emulated clock), 112 samples, 4 steps" in out.describe()
    back = TargetOutcome.from_dict(out.to_dict())
    assert back == out and out.to_dict()["time_to_target_s"] == 2.0


def test_outcome_not_reached_says_so_and_has_no_time():
    out = outcome([(0, 1.0, 8, 2.0), (1, 1.0, 8, 1.5)], target_loss=1.0, clock="wall")
    assert not out.reached and "NOT reached" in out.describe() and "time_to_target_s" not in out.to_dict()
    assert clock_of("real") == "wall" and clock_of("emulated") == clock_of("realnet") == "emulated"


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "1"])
def test_target_loss_must_be_a_positive_finite_number(bad):
    with pytest.raises(SpecError):
        check_target_loss(bad)


def test_train_config_target_needs_evaluations():
    with pytest.raises(SpecError, match="eval_every"):
        TrainConfig(steps=10, target_loss=1.0)
    assert TrainConfig(steps=10, target_loss=1.0, eval_every=5).target_loss == 1.0


def test_probes_are_kept_apart_from_evaluations_and_never_reach_the_target():
    steps = [(0, 0.5, 32, None), (1, 0.25, 32, 1.2), (2, 0.25, 32, None), (3, 1.0, 32, 0.8)]
    out = outcome(steps, target_loss=0.9, clock="emulated", probes={0: 0.1, 2: 0.5})
    assert [(p.steps, p.samples, p.time_s, p.eval_loss) for p in out.probes] == [(1, 32, 0.5, 0.1), (3, 96, 1.0, 0.5)]
    assert [p.steps for p in out.curve] == [2, 4] and out.reached_at.steps == 4  # not the probe below it at 1
    assert TargetOutcome.from_dict(out.to_dict()) == out and "probes" in out.to_dict()
    assert "probes" not in outcome(steps, target_loss=0.9, clock="wall").to_dict()


def test_train_config_probes_need_evaluations():
    with pytest.raises(SpecError, match="eval_every") as err:
        TrainConfig(steps=10, probes=True)
    assert err.value.field == "probes"
    with pytest.raises(SpecError):
        TrainConfig(steps=10, eval_every=5, probes="yes")
    assert TrainConfig(steps=10).probes is None and TrainConfig(steps=10, eval_every=5, probes=False).probes is False


def test_probes_flag_and_job_config_key(tmp_path):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert parser.parse_args(["--no-probes"]).probes is False and parser.parse_args([]).probes is None
    f = tmp_path / "job.toml"
    f.write_text("[eval]\nevery = 5\nprobes = false\n")
    assert read_job_config(f, parser) == {"eval_every": 5, "probes": False}
    f.write_text("[eval]\nprobes = 1\n")
    with pytest.raises(SpecError, match="eval.probes"):
        read_job_config(f, parser)


def test_job_config_key_maps_to_the_flag(tmp_path):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    f = tmp_path / "job.toml"
    f.write_text("[eval]\nevery = 5\ntarget_loss = 0.5\n")
    assert read_job_config(f, parser) == {"eval_every": 5, "target_loss": 0.5}
    f.write_text("[eval]\ntarget_loss = \"low\"\n")
    with pytest.raises(SpecError, match="eval.target_loss"):
        read_job_config(f, parser)


def _layout() -> Plan:
    def rep(devs, shares):
        return ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=5, devices=devs, shares=shares),),
                           microbatch_size=sum(shares), num_microbatches=1, schedule="gpipe")
    return Plan(system="t", cluster="local-small", model="convnet-tiny", global_batch=32,
                replicas=(rep(("cloud0:0", "cloud0:1"), (10, 10)), rep(("end0:0",), (12,))),
                strategy=Strategy(kind="model-averaging", period=4))


def test_calibration_document_is_read_back_by_the_planner():
    layout = _layout()
    cfg = CalibrationConfig(model="convnet-tiny", global_batch=32, target_loss=0.5)
    ref = CalibrationRun(strategy=Strategy(), reached=True, samples=3200, steps=100, final_eval_loss=0.49, wall_s=1.0)
    h4 = Strategy(kind="model-averaging", period=4)
    h16 = Strategy(kind="model-averaging", period=16)
    runs = [CalibrationRun(strategy=h4, reached=True, samples=4000, steps=125, final_eval_loss=0.48, wall_s=2.0),
            CalibrationRun(strategy=h16, reached=False, samples=9600, steps=300, final_eval_loss=0.9, wall_s=3.0)]
    doc = efficiency_document(cfg, layout, ref, runs)
    assert doc["schema_version"] == 2 and doc["entries"][1]["reached"] is False
    eff = efficiency_from_dict(doc, file="eff.json")
    assert eff.reference_steps == 100 and eff.reference_global_batch == 32 and eff.target_loss == 0.5
    plan = layout.replace(strategy=h4)
    assert eff.multiplier(plan) == pytest.approx(1.25) and "calibrated" in eff.source(plan)
    assert eff.reference_samples(plan) == 3200
    # H=8 lies between the measured settings: log-linear interpolation
    assert eff.multiplier(layout.replace(strategy=Strategy(kind="model-averaging", period=8))) == pytest.approx(2.125)
    # another rule was not measured: the default, labelled
    asgd = layout.replace(strategy=Strategy(kind="asgd-ga", accumulation_steps=4, staleness_bound=1),
                          servers=("cloud0:0",))
    assert DEFAULT_SOURCE in eff.source(asgd)


def test_overlapped_settings_are_a_variant_of_their_own():
    layout = _layout()
    cfg = CalibrationConfig(model="convnet-tiny", global_batch=32, target_loss=0.5, overlaps=(False, True))
    assert [(s.period, s.overlap) for s in settings(cfg)] == [(4, False), (16, False), (4, True), (16, True)]
    assert setting_name(settings(cfg)[2]) == "average-H4-overlap"
    ref = CalibrationRun(strategy=Strategy(), reached=True, samples=1000, steps=100, final_eval_loss=0.49, wall_s=1.0)

    def run(period, overlap, samples):
        return CalibrationRun(strategy=Strategy(kind="model-averaging", period=period, overlap=overlap),
                              reached=True, samples=samples, steps=1, final_eval_loss=0.4, wall_s=1.0)

    def plan(period, overlap):
        return layout.replace(strategy=Strategy(kind="model-averaging", period=period, overlap=overlap))

    # no overlapped figure: the larger of the default and the blocking one at 2H, labelled
    costly = efficiency_from_dict(efficiency_document(cfg, layout, ref, [run(4, False, 1200), run(8, False, 2500)]))
    assert costly.multiplier(plan(4, True)) == pytest.approx(2.5) and "H=8" in costly.source(plan(4, True))
    cheap = efficiency_from_dict(efficiency_document(cfg, layout, ref, [run(4, False, 1200), run(8, False, 1500)]))
    default = DefaultEfficiency().multiplier(plan(4, True))
    assert cheap.multiplier(plan(4, True)) == default > 1.5 and "not calibrated" in cheap.source(plan(4, True))
    assert default == DefaultEfficiency().multiplier(plan(8, False))
    both = efficiency_from_dict(efficiency_document(cfg, layout, ref, [run(4, False, 1200), run(4, True, 1300)]))
    assert both.multiplier(plan(4, True)) == pytest.approx(1.3) and both.multiplier(plan(4, False)) == pytest.approx(1.2)
    # version 1 files (no overlap anywhere) still load
    old = efficiency_document(cfg, layout, ref, [run(4, False, 1200)]) | {"schema_version": 1}
    assert efficiency_from_dict(old).multiplier(plan(4, False)) == pytest.approx(1.2)


def test_reference_plan_is_one_device_exact():
    ref = reference_plan(_layout())
    assert ref.devices == ("cloud0:0",) and ref.strategy.kind == "exact" and ref.global_batch == 32
    assert ref.num_stages == 1 and ref.stages[0].layer_stop == len(nets.block_names("convnet-tiny"))


def test_convnet_tiny_matches_its_profile_and_data():
    blocks, loss_fn = nets.build("convnet-tiny", seed=0)
    prof = get_model("convnet-tiny")
    assert [la.name for la in prof.layers] == list(nets.block_names("convnet-tiny"))
    assert [la.parameter_count for la in prof.layers] == [sum(p.numel() for p in b.parameters()) for b in blocks]
    ds = dataset_for("convnet-tiny")
    b = ds.batch(0, 8)
    assert b.inputs.shape == (8, 3, 16, 16) and b.inputs.dtype == torch.float32
    assert torch.equal(b.inputs, ds.batch(0, 8).inputs)  # deterministic
    x = b.inputs
    for blk in blocks:
        x = blk(x)
    assert x.shape == (8, len(SHAPES))
    assert abs(loss_fn(x, b.targets).item() - math.log(len(SHAPES))) < 0.5  # untrained: near chance
    held = next(iter(ds.eval_batches(8)))
    assert not torch.equal(held.inputs, b.inputs)
