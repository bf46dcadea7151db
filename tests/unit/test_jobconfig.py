"""The job config: the shipped example becomes one Job, flags override the file, every train
option has a key, bad values are one line naming file, field and value; train flags never
collide with torchrun's own options (torchrun's parser sees the script's arguments too)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deepcee import cli, jobconfig, train
from deepcee.errors import SpecError
from deepcee.runtime.lr import LRSchedule

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "job.toml"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    train.add_train_arguments(p)
    return p


def test_every_train_option_has_a_key_in_the_job_config():
    assert jobconfig.unmapped_options(_parser()) == []


def test_shipped_example_becomes_one_job_and_flags_override_it(tmp_path):
    args = jobconfig.parse_with_config(_parser(), ["--config", str(EXAMPLE), "--steps", "7", "--lr", "0.01"])
    assert args.steps == 7 and args.lr == 0.01  # flags win
    assert args.global_batch == 16 and args.schedules == "gpipe,1f1b,zb-h1" and args.run_dir == "runs/job-example"
    cfg = train._config(args)
    assert cfg.lr_schedule == LRSchedule(kind="cosine", warmup_steps=5, min_lr_ratio=0.1)
    assert (cfg.clip_grad_norm, cfg.checkpoint_every, cfg.eval_every, cfg.log_every) == (1.0, 20, 20, 10)
    assert cfg.optimizer.weight_decay == 0.01 and cfg.optimizer.lr == 0.01
    args.run_dir = str(tmp_path)  # planning writes <run dir>/plan.json
    plan, cluster = train._load(args)
    assert cluster.name == "local-small" and plan.model == "gpt-tiny" and plan.global_batch == 16
    assert (tmp_path / "plan.json").exists()


def test_the_cli_takes_the_config_and_dry_runs_it(tmp_path, capsys):
    assert cli.main(["train", "--config", str(EXAMPLE), "--run-dir", str(tmp_path), "--dry-run"]) == 0
    assert "stage 0" in capsys.readouterr().out
    assert train.main(["--config", str(EXAMPLE), "--run-dir", str(tmp_path), "--dry-run"]) == 0


def test_paths_read_are_relative_to_the_config_and_names_stay_names(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "job.toml").write_text('[plan]\nfile = "p.json"\n[cluster]\nname = "local-small"\n'
                                               '[checkpoint]\ninit_from = "w.pt"\ndir = "ck"\n'
                                               '[adapter]\nlink_trace = "drop-5x"\n')
    values = jobconfig.read_job_config(tmp_path / "sub" / "job.toml", _parser())
    assert values == {"plan": str(tmp_path / "sub" / "p.json"), "cluster": "local-small",
                      "init_from": str(tmp_path / "sub" / "w.pt"), "checkpoint_dir": "ck", "link_trace": "drop-5x"}


@pytest.mark.parametrize("text, message", [
    ('[training]\nsteps = "ten"', "training.steps: expected an integer in [1, 1,000,000,000], got 'ten' (flag --steps)"),
    ("[training]\nsteps = 2.5", "training.steps: expected an integer in [1, 1,000,000,000], got '2.5' (flag --steps)"),
    ('[training]\ndtype = "float16"', "training.dtype: must be one of float32, float64, got 'float16'"),
    ("[training]\ncuda = 1", "training.cuda: must be true or false, got 1"),
    ("[optimizer]\nlr = nan", "optimizer.lr: must be a finite number, got nan"),
    ('[optimizer]\nlr = "fast"', "optimizer.lr: expected a number in (0, 1,000], got 'fast' (flag --lr)"),
    ("[model]\nname = 3", "model.name: must be a string, got 3"),
    ("[plan]\nschedules = [1, 2]", "plan.schedules: must be a list of schedule names, got [1, 2]"),
    ("[training]\nstepz = 3", "training.stepz: unknown key (value 3; known in [training]: steps,"),
    ("[trainin]\nsteps = 3", "[trainin]: unknown section (known: cluster, model,"),
    ("training = 3", "training: must be a table, got 3"),
    ("[training\nsteps = 3", "invalid TOML"),
])
def test_bad_values_name_file_field_and_value(tmp_path, text, message):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as err:
        jobconfig.read_job_config(path, _parser())
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_bad_config_through_the_cli_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text("[training]\nsteps = -3\n[plan]\nglobal_batch = 4\n[model]\nname = 'gpt-tiny'\n")
    assert cli.main(["train", "--config", str(path), "--run-dir", str(tmp_path)]) == 2  # checked before any process
    assert cli.main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    path.write_bytes(b"\xff\xfe[training]")
    assert train.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "steps: must be in [1, 1,000,000,000], got -3" in err[0]
    assert "missing.toml: cannot read" in err[1] and "job.toml: not UTF-8 text" in err[2]


def test_train_flags_are_not_prefixes_of_torchrun_options():
    from torch.distributed.run import get_args_parser

    theirs = [s for a in get_args_parser()._actions for s in a.option_strings if s.startswith("--")]
    ours = [s for a in _parser()._actions for s in a.option_strings if s.startswith("--")]
    clashes = [(o, t) for o in ours for t in theirs if t != o and t.replace("_", "-").startswith(o)]
    assert clashes == [], f"torchrun would read these as its own options: {clashes}"


def test_plan_or_global_batch_is_required(tmp_path, capsys):
    assert cli.main(["train", "--run-dir", str(tmp_path)]) == 2
    assert "--plan: give --plan (a plan file), or --global-batch to plan first" in capsys.readouterr().err


def test_own_model_and_data_keys(tmp_path):
    """``[model]``/``[data]``: a data file relative to the config when it is there, an import
    path as written; a numeric ``eval`` is a fraction held out."""
    (tmp_path / "d.pt").write_bytes(b"")
    cfg = tmp_path / "job.toml"
    cfg.write_text('[model]\nname = "mypkg.models:build"\nsplit_at = "layer1,fc"\nloss = "mypkg.losses:ce"\n'
                   '[data]\ntrain = "d.pt"\neval = 0.1\nseq_len = 32\nno_shuffle = true\n')
    a = jobconfig.parse_with_config(_parser(), ["--config", str(cfg)])
    assert (a.model, a.split_at, a.loss) == ("mypkg.models:build", "layer1,fc", "mypkg.losses:ce")
    assert (a.data, a.eval_data, a.seq_len, a.no_shuffle) == (str(tmp_path / "d.pt"), "0.1", 32, True)
    cfg.write_text('[data]\ntrain = "mypkg.data:train_set"\neval = "mypkg.data:eval_set"\n')
    a = jobconfig.parse_with_config(_parser(), ["--config", str(cfg)])
    assert (a.data, a.eval_data) == ("mypkg.data:train_set", "mypkg.data:eval_set")
