"""A target loss stops a run at the first evaluation at or below it, on every rank, exact and
model averaging (evaluated after an average); one that is never reached runs every step. ONE
launch of 2 processes under a hard deadline."""

from __future__ import annotations

import time

import pytest
from _runtime_helpers import make_plan, make_replicas_plan

from deepcee.plan import Strategy
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.records import read_step_metrics
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 240
C0, N0 = "cloud0:0", "end0:0"
ALL = [(0, 5, (C0,), (8,))]


def test_target_loss_stops_exact_and_model_averaging_runs(tmp_path):
    cluster = load_scenario("local-small")
    exact = make_plan("convnet-tiny", ALL, 1, "gpipe")
    averaging = make_replicas_plan("convnet-tiny", [([(0, 5, (C0,), (4,))], 1, "gpipe"),
                                                    ([(0, 5, (N0,), (4,))], 1, "gpipe")],
                                   strategy=Strategy(kind="model-averaging", period=3))
    opt = OptimizerConfig(name="sgd", lr=0.05)

    def job(name, plan, target, mode="real"):
        return Job(name=name, plan=plan, cluster=cluster, model="convnet-tiny", run_dir=str(tmp_path / name),
                   config=TrainConfig(steps=9, eval_every=2, eval_batches=1, target_loss=target, optimizer=opt,
                                      mode=mode))

    jobs = [job("exact-hit", exact, 100.0, "emulated"), job("exact-miss", exact, 1e-6),
            job("averaging-hit", averaging, 100.0)]
    t0 = time.monotonic()
    hit, miss, avg = launch_jobs(jobs, deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S

    # exact: the first evaluation (after step 2) reaches any loss under 100
    assert len(hit.losses) == 2 and hit.target.reached and hit.target.clock == "emulated"
    at = hit.target.reached_at
    assert (at.steps, at.samples) == (2, 16) and at.time_s == pytest.approx(sum(hit.step_s))
    assert len(read_step_metrics(tmp_path / "exact-hit" / "metrics.jsonl")) == 2
    # never reached: every step, every evaluation recorded, no time to target
    assert len(miss.losses) == 9 and not miss.target.reached and miss.target.clock == "wall"
    assert [p.steps for p in miss.target.curve] == [2, 4, 6, 8, 9]
    # model averaging: evaluated right after the first average at or after step 2 (step 3), both replicas stop
    assert avg.semantics == "relaxed" and avg.replicas.local_steps == (3, 3)
    assert avg.target.reached and avg.target.reached_at.steps == 3 and avg.target.reached_at.samples == 24
    # its probe of the average after step 2 (below any loss of 100) did not stop it: only evaluations do
    assert [(p.steps, p.samples) for p in avg.target.probes] == [(2, 16)] and len(avg.probe_losses) == 1
