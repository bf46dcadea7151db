"""The runtime against a single-process float64 reference: loss and every gradient after one
step, and parameters after three, for every schedule and for multi-device stages with uneven
shares. All jobs run in ONE launch of 4 processes (one start-up), under a hard deadline."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from _runtime_helpers import RegressionData, load_captures, make_plan, reference, user_model

from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 200
RTOL, ATOL = 1e-10, 1e-12
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
ADAM = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01)

C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"

CASES = {
    "gpipe-gpt": (make_plan("gpt-tiny", [(0, 2, (C0,), (2,)), (2, 6, (E0,), (2,))], 2, "gpipe"), SGD),
    "1f1b-gpt-uneven": (make_plan("gpt-tiny", [(0, 2, (C0, C1), (3, 1)), (2, 4, (E0,), (4,)), (4, 6, (N0,), (4,))],
                                  3, "1f1b"), ADAM),
    "zbh1-resnet-4stages": (make_plan("resnet-tiny", [(0, 2, (C0,), (2,)), (2, 4, (C1,), (2,)), (4, 6, (E0,), (2,)),
                                                      (6, 8, (N0,), (2,))], 4, "zb-h1"), ADAM),
    "zbh2-resnet-uneven": (make_plan("resnet-tiny", [(0, 3, (N0,), (3,)), (3, 8, (E0, E1), (1, 2))], 3, "zb-h2"), SGD),
    "compact-gpt-2x2": (make_plan("gpt-tiny", [(0, 3, (C0, C1), (1, 2)), (3, 6, (E0, E1), (2, 1))], 2, "compact",
                                  actions=(("0F0", "0F1", "0I0", "0I1", "0W1", "0W0"),
                                           ("1F0", "1I0", "1F1", "1I1", "1W0", "1W1"))), ADAM),
}


def _recomputing(plan, stages):
    """``plan`` with activation recomputation on ``stages`` (see [Note: recompute] in runtime/stage.py)."""
    return plan.replace(stages=tuple(dataclasses.replace(st, recompute=s in stages)
                                     for s, st in enumerate(plan.stages)))


CASES |= {
    # recomputation: split backward (zb-h1, compact with delayed W) and fused B (1f1b), mixed stages
    "recompute-zbh1-gpt": (_recomputing(CASES["1f1b-gpt-uneven"][0].replace(schedule="zb-h1"), {0, 2}), ADAM),
    "recompute-compact-gpt-2x2": (_recomputing(CASES["compact-gpt-2x2"][0], {0, 1}), ADAM),
    "recompute-1f1b-resnet": (_recomputing(CASES["zbh1-resnet-4stages"][0].replace(schedule="1f1b"), {1, 3}), SGD),
}
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cluster = load_scenario("local-small")
    root = tmp_path_factory.mktemp("runtime-exact")
    jobs = []
    for name, (plan, opt) in CASES.items():
        cfg = TrainConfig(steps=STEPS, dtype="float64", optimizer=opt, mode="real", timeout_s=40, capture=True)
        jobs.append(Job(name=name, plan=plan, cluster=cluster, model=plan.model, config=cfg,
                        run_dir=str(root / name)))
    # emulated devices and links must not change a single number
    emu_plan = make_plan("resnet-tiny", [(0, 4, (C0, C1), (2, 1)), (4, 8, (E1,), (3,))], 2, "1f1b")
    jobs.append(Job(name="emulated-1f1b", plan=emu_plan, cluster=cluster, model="resnet-tiny",
                    config=TrainConfig(steps=STEPS, dtype="float64", optimizer=SGD, mode="emulated", timeout_s=40,
                                       capture=True), run_dir=str(root / "emulated-1f1b")))
    # a user's nn.Sequential with its own loss and data, split 2 | 3 modules
    user_plan = make_plan("user", [(0, 2, (C0,), (2,)), (2, 5, (E0, N0), (1, 1))], 3, "zb-h1")
    jobs.append(Job(name="user-sequential", plan=user_plan, cluster=cluster, model=user_model(),
                    loss_fn=torch.nn.functional.mse_loss, dataset=RegressionData(),
                    config=TrainConfig(steps=STEPS, dtype="float64", optimizer=SGD, mode="real", timeout_s=40,
                                       capture=True), run_dir=str(root / "user-sequential")))
    # checkpoint / resume: 4 steps straight vs 2 steps, then resume to 4
    ck_plan = CASES["1f1b-gpt-uneven"][0]
    for name, steps, resume in (("ckpt-straight", 4, False), ("ckpt-first-half", 2, False), ("ckpt-resumed", 4, True)):
        cdir = root / ("ckpt-a" if name == "ckpt-straight" else "ckpt-b")
        jobs.append(Job(name=name, plan=ck_plan, cluster=cluster, model="gpt-tiny",
                        config=TrainConfig(steps=steps, dtype="float64", optimizer=ADAM, mode="real", timeout_s=40,
                                           capture=True, checkpoint_every=2, resume=resume),
                        run_dir=str(root / name), checkpoint_dir=str(cdir)))
    t0 = time.monotonic()
    results = launch_jobs(jobs, world_size=4, deadline_s=DEADLINE_S)
    elapsed = time.monotonic() - t0
    assert elapsed < DEADLINE_S
    return {j.name: (j, r) for j, r in zip(jobs, results, strict=True)}, {"emulated-1f1b": emu_plan, "user-sequential": user_plan}


def _check_against_reference(job, result, plan, opt, **ref_kwargs):
    losses, grads0, params = reference(job.model, plan, STEPS, opt, **ref_kwargs)
    assert len(result.losses) == STEPS
    for got, want in zip(result.losses, losses, strict=True):
        assert got == pytest.approx(want, rel=RTOL)
    caps = load_captures(job.run_dir)
    assert sorted(caps) == list(range(len(plan.devices)))  # every active rank captured
    seen = set()
    for rank, cap in caps.items():
        for key, g in cap["grads"].items():
            torch.testing.assert_close(g, grads0[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key, r=rank: f"rank {r} grad {k}: {m}")
            torch.testing.assert_close(cap["params"][key], params[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} param {k}: {m}")
            seen.add(key)
    assert seen == set(grads0), f"parameters never checked: {sorted(set(grads0) - seen)[:5]}"


@pytest.mark.parametrize("case", list(CASES))
def test_schedule_matches_reference(runs, case):
    jobs, _ = runs
    job, result = jobs[case]
    plan, opt = CASES[case]
    _check_against_reference(job, result, plan, opt)


def test_emulated_run_is_exact_and_labelled(runs):
    jobs, plans = runs
    job, result = jobs["emulated-1f1b"]
    _check_against_reference(job, result, plans["emulated-1f1b"], SGD)
    assert result.mode == "emulated" and result.dilation > 1 and result.emulated
    for rec in result.metrics:
        assert rec.mode == "emulated" and rec.dilation == result.dilation and rec.emulated
        # boundary after block2 is 32x16x16 float64; cloud0:0 holds 2 samples, cloud0:1 one, 2 microbatches
        assert rec.link_bytes["cloud0:0->edge0:1"] == 2 * 2 * 32 * 16 * 16 * 8
        assert rec.link_bytes["edge0:1->cloud0:1"] == 2 * 1 * 32 * 16 * 16 * 8
    # a 20 ms (emulated) cloud->edge link each way bounds an emulated step from below
    assert min(result.step_s) > 0.04
    # device pacing: stage 1 runs on edge0:1 (slowdown 2): its emulated compute time is at
    # least its CPU time x 2 (padding never shortens, load can only lengthen)
    for rec in result.metrics:
        assert rec.stages[1].compute_s >= 0.99 * 2.0 * rec.cpu_s["edge0:1"]
        assert rec.stages[0].compute_s >= 0.99 * max(rec.cpu_s["cloud0:0"], rec.cpu_s["cloud0:1"])


def test_user_sequential_matches_reference(runs):
    jobs, plans = runs
    job, result = jobs["user-sequential"]
    _check_against_reference(job, result, plans["user-sequential"], SGD,
                             loss_fn=torch.nn.functional.mse_loss, dataset=RegressionData())


def test_resume_from_checkpoint_continues_exactly(runs):
    jobs, _ = runs
    straight, resumed, half = jobs["ckpt-straight"], jobs["ckpt-resumed"], jobs["ckpt-first-half"]
    assert resumed[1].losses == straight[1].losses[2:]
    assert half[1].losses == straight[1].losses[:2]
    a, b = load_captures(straight[0].run_dir), load_captures(resumed[0].run_dir)
    for rank in a:
        for key, p in a[rank]["params"].items():
            assert torch.equal(p, b[rank]["params"][key]), f"rank {rank} {key} differs after resume"
