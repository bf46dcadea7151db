"""``deepcee train`` is a sub-command of the one CLI; ``python -m deepcee.train`` (the torchrun
entry) parses the same options; both turn the flags into one Job of typed objects."""

from __future__ import annotations

import argparse

import pytest

from deepcee import cli, train
from deepcee.plan import Plan, StagePlan, save_json_atomic
from deepcee.planfile import load_plan
from deepcee.runtime.job import OptimizerConfig, TrainConfig
from deepcee.scenarios import load_scenario

PLAN = Plan(system="t", cluster="local-small", model="gpt-tiny", global_batch=4, microbatch_size=2,
            num_microbatches=2, schedule="1f1b",
            stages=(StagePlan(layer_start=0, layer_stop=3, devices=("cloud0:0",), shares=(2,)),
                    StagePlan(layer_start=3, layer_stop=6, devices=("edge0:0",), shares=(2,))))


def _options(parser: argparse.ArgumentParser) -> list[tuple]:
    return [(tuple(a.option_strings), a.dest, a.default, a.help, a.choices, a.required) for a in parser._actions]


def _train_subparser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def test_both_entries_parse_the_same_options() -> None:
    module = argparse.ArgumentParser()
    train.add_train_arguments(module)
    assert _options(_train_subparser()) == _options(module)
    assert len(_options(module)) > 20


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    save_json_atomic(path, PLAN.to_dict())
    return str(path)


def test_dry_run_through_the_cli_prints_each_stages_lowered_schedule(plan_file, capsys) -> None:
    assert cli.main(["train", "--plan", plan_file, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "stage 0" in out and "stage 1" in out and "SEND_F" in out


def test_bad_input_is_one_line_and_exit_2(tmp_path, plan_file, capsys) -> None:
    missing = str(tmp_path / "missing.json")
    assert cli.main(["train", "--plan", missing]) == 2
    assert train.main(["--plan", missing]) == 2
    assert cli.main(["train", "--plan", plan_file, "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("missing.json" in line for line in err[:2])
    assert err[0].startswith("deepcee train: error:") and err[1].startswith("deepcee.train: error:")
    assert "steps" in err[2] and "0" in err[2]


def test_flags_become_one_job_of_objects(plan_file) -> None:
    args = _train_subparser().parse_args(["--plan", plan_file, "--steps", "3", "--dtype", "float64", "--mode", "real",
                                          "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--timeout", "7"])
    plan, cluster = train._load(args)
    job = train._job(args, plan, cluster)
    assert job.plan == load_plan(plan_file) and job.cluster == load_scenario("local-small") and job.hooks is None
    assert job.config == TrainConfig(steps=3, dtype="float64", mode="real", timeout_s=7.0, log_every=10,
                                     optimizer=OptimizerConfig(name="sgd", lr=0.05, momentum=0.9))


def test_adapt_flags_build_an_adaptive_job_on_traced_links(plan_file) -> None:
    from deepcee.adapter.hooks import AdaptSpec

    args = _train_subparser().parse_args(["--plan", plan_file, "--adapt", "--link-trace", "drop-5x"])
    plan, cluster = train._load(args)
    job = train._job(args, plan, cluster)
    assert isinstance(job.hooks, AdaptSpec) and job.hooks.adapt
    assert job.rank_devices() == cluster.device_names  # one rank per device of the cluster
    assert job.cluster.link("cloud0:0", "edge0:0").trace is not None
    assert job.hooks.planning_cluster == cluster  # plans on the links without the trace
