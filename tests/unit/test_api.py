"""The Python API and the command line with a user's model: ``deepcee.profile``/``plan``/``train``
are callable modules that still import as modules; profiles counted from a user's blocks (also
with structured boundaries); bad input is one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import deepcee
import deepcee.plan
import deepcee.profile
import deepcee.train
from deepcee import _callable, api, cli
from deepcee.errors import SpecError
from deepcee.plan import Plan
from deepcee.planfile import load_plan
from deepcee.profile import ModelProfile

torch.set_num_threads(1)


def test_modules_are_callable_and_still_modules():
    for mod in (deepcee.profile, deepcee.plan, deepcee.train):
        assert isinstance(mod, types.ModuleType) and type(mod) is _callable.CallableModule and callable(mod)
    assert deepcee.plan.Plan is Plan and deepcee.profile.ModelProfile is ModelProfile
    assert deepcee.train.add_train_arguments is not None
    prof = deepcee.profile("gpt2")  # a built-in analytic profile, no torch work
    assert isinstance(prof, ModelProfile) and prof.name == "gpt2"


def test_python_m_train_does_not_warn_about_early_import():
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "deepcee.train", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--data" in out.stdout, out.stderr


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g))


class Pair(nn.Module):
    """Returns a dict: the hidden state and a position-like integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x):
        return {"h": self.lin(x), "pos": torch.arange(x.shape[0])}


class Take(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, s):
        return self.lin(s["h"]) + s["pos"][:, None]


def test_profile_counts_a_users_blocks():
    prof = deepcee.profile(_mlp(), _data(), loss_fn=nn.functional.mse_loss, name="mlp")
    assert prof.name == "mlp" and [la.name for la in prof.layers] == ["0", "1", "2"]
    assert [la.parameter_count for la in prof.layers] == [40, 0, 18]
    assert prof.layers[0].output_bytes == 8 * 4 and prof.layers[0].forward_flops == pytest.approx(2 * 4 * 8)
    assert prof.input_bytes == 4 * 4
    structured = deepcee.profile([Pair(), Take()], _data(), loss_fn=nn.functional.mse_loss)
    assert structured.layers[0].output_bytes == 8 * 4 + 8  # every tensor crossing the boundary counts


def test_plan_takes_a_model_and_data_and_train_checks_the_split():
    result = deepcee.plan(_mlp(), "local-small", global_batch=8, data=_data(), loss_fn=nn.functional.mse_loss)
    assert result.plan.num_layers == 3 and result.plan.model == "Sequential"
    wrong = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(SpecError, match="plan covers 3 layers, the model splits into 1 blocks"):
        api.train(wrong, _data(), result.plan, steps=1, loss_fn=nn.functional.mse_loss)
    with pytest.raises(SpecError, match="loss_fn: the model .* has no default loss"):
        api.user_model(_mlp())


def test_command_line_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["plan", "--scenario", "local-small", "--model", "no_such_pkg.models:build", "--data",
                     str(tmp_path / "x.pt"), "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "no such file, and not an import path" in err and len(err.strip().splitlines()) == 1
    torch.save(_data().tensors, tmp_path / "d.pt")
    assert cli.main(["plan", "--scenario", "local-small", "--model", "no_such_pkg.models:build", "--data",
                     str(tmp_path / "d.pt"), "--global-batch", "8"]) == 2
    assert "model: cannot import 'no_such_pkg.models'" in capsys.readouterr().err
    assert cli.main(["plan", "--scenario", "local-small", "--model", "torch.nn:Identity", "--global-batch", "8"]) == 2
    assert "needs --data" in capsys.readouterr().err


def test_train_plans_a_users_model_first(tmp_path, capsys):
    """``deepcee train --global-batch`` without a plan file counts a user's model on its data and plans it."""
    torch.save(_data().tensors, tmp_path / "d.pt")
    assert cli.main(["train", "--model", "test_api:_mlp", "--data", str(tmp_path / "d.pt"), "--loss",
                     "torch.nn.functional:mse_loss", "--global-batch", "4", "--run-dir", str(tmp_path / "run"),
                     "--dry-run"]) == 0
    assert "F0" in capsys.readouterr().out
    plan = load_plan(tmp_path / "run" / "plan.json")
    assert plan.model == "test_api:_mlp" and plan.num_layers == 3
