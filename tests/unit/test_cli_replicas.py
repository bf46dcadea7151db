"""``deepcee plan --sync relaxed / --objective cost``, ``simulate`` of replicated plans and stragglers, ``compare``."""

from __future__ import annotations

import json

import pytest
from test_planner_replicas import toy, trio

from deepcee.cli import main
from deepcee.planfile import load_plan


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "trio.json").write_text(json.dumps(trio().to_dict()))
    (tmp_path / "toy.json").write_text(json.dumps(toy().to_dict()))
    return tmp_path


def _args(files, *more: str) -> list[str]:
    return ["--cluster", str(files / "trio.json"), "--profile", str(files / "toy.json"), "--model", "toy",
            "--global-batch", "48", *more]


def test_plan_relaxed_writes_a_replicated_plan_that_states_its_semantics(files, capsys) -> None:
    out = files / "plan.json"
    assert main(["plan", *_args(files, "--sync", "relaxed", "-o", str(out))]) == 0
    text = capsys.readouterr().out
    assert "semantics relaxed" in text and "time to target" in text and "not measured" in text
    assert "cost: $" in text and "data moved before training" in text
    plan = load_plan(out)
    assert plan.semantics == "relaxed" and plan.num_replicas == 3
    assert json.loads(out.read_text())["semantics"] == "relaxed"

    timeline = files / "trace.json"
    assert main(["simulate", str(out), "--cluster", str(files / "trio.json"), "--profile", str(files / "toy.json"),
                 "--iterations", "20", "--straggler", "nb:0:3:1:5", "--timeline", str(timeline)]) == 0
    text = capsys.readouterr().out
    assert "replica 2:" in text and "nb:0 x3 from 1 s to 5 s" in text and "not comparable" in text
    assert json.loads(timeline.read_text())["otherData"]["semantics"] == "relaxed"


def test_plan_default_is_todays_exact_plan_with_its_figures(files, capsys) -> None:
    out = files / "plan.json"
    assert main(["plan", *_args(files, "-o", str(out))]) == 0
    assert "semantics exact" in capsys.readouterr().out
    assert load_plan(out).num_replicas == 1


def test_plan_refuses_a_budget_without_the_cost_objective(files, capsys) -> None:
    assert main(["plan", *_args(files, "--budget", "3", "-o", str(files / "p.json"))]) == 2
    assert "--budget: --budget needs --objective cost" in capsys.readouterr().err
    assert not (files / "p.json").exists()


def test_simulate_names_an_unknown_straggler(files, capsys) -> None:
    out = files / "plan.json"
    assert main(["plan", *_args(files, "-o", str(out))]) == 0
    assert main(["simulate", str(out), "--cluster", str(files / "trio.json"), "--profile", str(files / "toy.json"),
                 "--straggler", "nx:0:3"]) == 2
    assert "DEVICE:FACTOR" in capsys.readouterr().err

