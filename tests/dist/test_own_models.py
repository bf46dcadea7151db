"""Users' own models, split by deepcee, on 3-stage plans with multi-device stages, against a
single-process float64 reference: loss every step, every gradient at step 0, every parameter
after the last step.

One launch of 4 processes under a hard deadline runs: an MLP from a builder whose second block
is a lone activation placed as a whole stage on two devices, its ``TensorDataset`` crossing an
epoch (reshuffled); a HuggingFace GPT-2 (tied embedding and LM head on the first and last
stages) on right-padded text whose attention mask travels between stages; a Llama (position
ids and rotary cos/sin carried, no gradient for them); a BERT masked LM; and a hand-written
ResNet cut at split points; and on plans of two replicas (each its share of every global batch),
the MLP and the Llama. The HuggingFace cases need ``transformers`` and are left out
without it. ``python -m deepcee.train`` under torchrun with ``--model`` and ``--data`` from an
import path and a file is checked the same way.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import _own_models as own
import pytest
import torch
from _runtime_helpers import load_captures, make_plan, make_replicas_plan, reference

from deepcee import api
from deepcee.plan import save_json_atomic
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.sources import Data
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 240
RTOL, ATOL = 1e-10, 1e-12
STEPS = 3
SGD = OptimizerConfig(name="sgd", lr=0.1, momentum=0.9)
ADAM = OptimizerConfig(name="adamw", lr=1e-2)
C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"
HAVE_HF = importlib.util.find_spec("transformers") is not None

# name: (builder, data, plan, optimizer, split points, needs transformers)
CASES = {
    "mlp": (own.build_mlp, lambda: Data(own.mlp_data(16), seed=3),
            make_plan("user", [(0, 1, (C0,), (4,)), (1, 2, (E0, E1), (3, 1)), (2, 5, (N0,), (4,))], 2, "zb-h1"),
            ADAM, (), False),
    "hf-gpt2": (own.build_gpt2, lambda: Data(own.padded_text()),
                make_plan("user", [(0, 2, (C0, C1), (1, 3)), (2, 4, (E0,), (4,)), (4, 5, (N0,), (4,))], 2, "1f1b"),
                SGD, (), True),
    "hf-llama": (own.build_llama, lambda: Data(own.token_rows()),
                 make_plan("user", [(0, 1, (C0,), (4,)), (1, 3, (E0,), (4,)), (3, 5, (E1, N0), (2, 2))], 2, "zb-h2"),
                 ADAM, (), True),
    "hf-bert": (own.build_bert, lambda: Data(own.masked_lm()),
                make_plan("user", [(0, 1, (C0, C1), (2, 2)), (1, 3, (E0,), (4,)), (3, 4, (N0,), (4,))], 2, "gpipe"),
                SGD, (), True),
    "resnet": (own.build_resnet, lambda: Data(own.images()),
               make_plan("user", [(0, 1, (C0,), (4,)), (1, 2, (C1, E0), (1, 3)), (2, 4, (N0,), (4,))], 2, "1f1b"),
               ADAM, ("layer1", "layer2", "fc"), False),
    # two replicas (exact strategy): each takes its own share of every global batch (4 + 3 samples)
    "mlp-2-replicas": (own.build_mlp, lambda: Data(own.mlp_data(16), seed=3), make_replicas_plan("user", [
        ([(0, 2, (C0,), (2,)), (2, 5, (C1,), (2,))], 2, "1f1b"),
        ([(0, 1, (E0,), (3,)), (1, 5, (E1,), (3,))], 1, "gpipe")]), SGD, (), False),
    "hf-llama-2-replicas": (own.build_llama, lambda: Data(own.token_rows()), make_replicas_plan("user", [
        ([(0, 2, (C0,), (2,)), (2, 5, (C1,), (2,))], 2, "zb-h1"),
        ([(0, 5, (E0, E1), (1, 2))], 1, "gpipe")]), ADAM, (), True),
}
RUN = [name for name, case in CASES.items() if HAVE_HF or not case[5]]


def _split(name: str):
    builder, _, _, _, points, _ = CASES[name]
    return api.user_model(builder, points=points)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("own-models")
    cluster = load_scenario("local-small")
    jobs = []
    for name in RUN:
        _, data, plan, opt, _, _ = CASES[name]
        split = _split(name)
        jobs.append(Job(name=name, plan=plan, cluster=cluster, model=[b.double() for b in split.blocks],
                        loss_fn=split.loss_fn, dataset=data(), run_dir=str(root / name),
                        config=TrainConfig(steps=STEPS, dtype="float64", optimizer=opt, mode="real", timeout_s=60,
                                           capture=True)))
    t0 = time.monotonic()
    results = launch_jobs(jobs, world_size=4, deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S
    return {j.name: (j, r) for j, r in zip(jobs, results, strict=True)}


@pytest.mark.parametrize("name", RUN)
def test_own_model_matches_reference(runs, name):
    job, result = runs[name]
    _, data, plan, opt, _, _ = CASES[name]
    split = _split(name)
    losses, grads0, params = reference(list(split.blocks), plan, STEPS, opt, loss_fn=split.loss_fn, dataset=data())
    for step, (got, want) in enumerate(zip(result.losses, losses, strict=True)):
        assert got == pytest.approx(want, rel=RTOL, abs=ATOL), f"{name} step {step}: loss {got!r}, reference {want!r}"
    caps = load_captures(job.run_dir)
    assert sorted(caps) == list(range(len(plan.devices)))
    seen, seen_grads = set(), set()
    for rank, cap in caps.items():
        for key, p in cap["params"].items():
            torch.testing.assert_close(p, params[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key, r=rank: f"{r} {k}: {m}")
            seen.add(key)
        for key, g in cap["grads"].items():
            torch.testing.assert_close(g, grads0[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key, r=rank: f"{r} {k}: {m}")
            seen_grads.add(key)
    assert seen == set(params) and seen_grads == set(grads0), f"{name}: parameters never compared"


@pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed")
def test_tied_embedding_and_head_stay_equal_across_stages(runs):
    for name, names in (("hf-gpt2", ("0.wte.weight", "4.head.weight")),
                        ("hf-bert", ("0.embeddings.word_embeddings.weight", "3.head.predictions.decoder.weight"))):
        caps = load_captures(runs[name][0].run_dir)
        copies = [cap["params"][n] for cap in caps.values() for n in names if n in cap["params"]]
        assert len(copies) >= 3 and all(torch.equal(c, copies[0]) for c in copies), name


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_with_model_and_data_from_the_command_line(tmp_path):
    """Each rank builds the model from the import path (seeded) and reads the data file itself."""
    plan = make_plan("user", [(0, 2, (C0,), (4,)), (2, 5, (E0,), (4,))], 2, "1f1b")
    save_json_atomic(tmp_path / "plan.json", plan.to_dict())
    torch.save(own.mlp_data(16).tensors, tmp_path / "reg.pt")
    cmd = [shutil.which("torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "deepcee.train",
           "--plan", str(tmp_path / "plan.json"), "--model", "_own_models:build_mlp", "--data",
           str(tmp_path / "reg.pt"), "--seed", "3", "--steps", str(STEPS), "--dtype", "float64", "--mode", "real",
           "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--timeout", "60", "--run-dir",
           str(tmp_path / "run")]
    here = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE_S, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun did not finish within {DEADLINE_S} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    split = api.user_model(own.build_mlp, seed=3)
    losses, _, _ = reference(list(split.blocks), plan, STEPS, SGD, loss_fn=split.loss_fn,
                             dataset=Data(own.mlp_data(16), seed=3))
    assert result["losses"] == pytest.approx(losses, rel=RTOL)
