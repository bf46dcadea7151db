"""``python -m deepcee.train`` under torchrun (env://) reproduces the float64 reference."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from _runtime_helpers import make_plan, reference

from deepcee.plan import save_json_atomic
from deepcee.runtime.job import OptimizerConfig

pytestmark = pytest.mark.dist

DEADLINE_S = 150


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_entry_matches_reference(tmp_path):
    plan = make_plan("resnet-tiny", [(0, 3, ("cloud0:0", "cloud0:1"), (1, 2)), (3, 8, ("edge0:0",), (3,))], 2, "zb-h1")
    save_json_atomic(tmp_path / "plan.json", plan.to_dict())
    run_dir = tmp_path / "run"
    cmd = [shutil.which("torchrun"), "--standalone", "--nproc-per-node", "3", "-m", "deepcee.train",
           "--plan", str(tmp_path / "plan.json"), "--steps", "2", "--dtype", "float64", "--mode", "real",
           "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--timeout", "60", "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE_S, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish within {DEADLINE_S} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    losses, _, _ = reference("resnet-tiny", plan, 2, OptimizerConfig(name="sgd", lr=0.05, momentum=0.9))
    assert result["losses"] == pytest.approx(losses, rel=1e-10)
    assert result["mode"] == "real" and result["emulated"] == []
    assert "steps 2" in proc.stdout
