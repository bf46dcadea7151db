"""Failures are reported, never hung on: shape mismatch at start-up, a silent peer, a hung rank."""

from __future__ import annotations

import time

import pytest
import torch
from _runtime_helpers import RegressionData, make_plan, silent_sender_target, sleeper_target
from torch import nn

from deepcee.errors import RuntimeSetupError
from deepcee.runtime.launch import launch, run_training
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist


def test_boundary_shape_mismatch_names_the_peer(tmp_path):
    # stage 0 emits 16 features per sample, stage 1 expects 12
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(12, 3))
    plan = make_plan("user", [(0, 1, ("cloud0:0",), (2,)), (1, 2, ("edge0:0",), (2,))], 1, "gpipe")
    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"rank 1 \(device edge0:0, stage 1\) cannot run on the output of "
                                                r"rank 0 \(device cloud0:0, stage 0\)"):
        run_training(plan, load_scenario("local-small"), model=model, loss_fn=torch.nn.functional.mse_loss,
                     dataset=RegressionData(), steps=1, mode="real", timeout_s=20, deadline_s=60, run_dir=tmp_path)
    assert time.monotonic() - t0 < 60


def test_receive_timeout_names_peer_rank_and_device():
    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"receiving activation of microbatch 0 from rank 0 "
                                                r"\(device cloud0:0, stage 0\) did not complete within 1.5 s"):
        launch(silent_sender_target, (1.5,), world_size=2, deadline_s=60)
    assert time.monotonic() - t0 < 60


def test_launch_deadline_kills_hung_ranks():
    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"deadline of 4 s passed; ranks \[0, 1\] still running"):
        launch(sleeper_target, (120.0,), world_size=2, deadline_s=4)
    assert time.monotonic() - t0 < 15
