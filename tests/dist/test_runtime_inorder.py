"""The runtime's in-order transport (CUDA's: each receive posted when the schedule reaches it,
send buffers freed as their sends complete) run on CPU/gloo through
``TrainConfig(receives="in-order")``, against the single-process float64 reference: loss and
every gradient after one step, parameters after three, on zero-bubble schedules with several
microbatches ([Note: in-order receives] in deepcee.runtime.p2p). One launch of 4 processes,
under a hard deadline."""

from __future__ import annotations

import time

import pytest
import torch
from _runtime_helpers import ATOL, ADAM, C0, C1, E0, E1, N0, RTOL, SGD, load_captures, make_plan, reference

from deepcee.errors import SpecError
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 150
STEPS = 3

CASES = {
    # 3 stages, the first on two devices with uneven shares, 6 microbatches
    "inorder-zbh1-gpt-3stages": (make_plan("gpt-tiny", [(0, 2, (C0, C1), (3, 1)), (2, 4, (E0,), (4,)),
                                                        (4, 6, (N0,), (4,))], 6, "zb-h1"), ADAM),
    # zb-h2 keeps more microbatches in flight and reorders W passes further
    "inorder-zbh2-resnet-2stages": (make_plan("resnet-tiny", [(0, 3, (N0,), (3,)), (3, 8, (E0, E1), (1, 2))], 5,
                                              "zb-h2"), SGD),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cluster = load_scenario("local-small")
    root = tmp_path_factory.mktemp("runtime-inorder")
    jobs = [Job(name=name, plan=plan, cluster=cluster, model=plan.model, run_dir=str(root / name),
                config=TrainConfig(steps=STEPS, dtype="float64", optimizer=opt, mode="real", timeout_s=40,
                                   capture=True, receives="in-order"))
            for name, (plan, opt) in CASES.items()]
    t0 = time.monotonic()
    results = launch_jobs(jobs, world_size=4, deadline_s=DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S
    return {j.name: (j, r) for j, r in zip(jobs, results, strict=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_in_order_transport_matches_reference(runs, case):
    job, result = runs[case]
    plan, opt = CASES[case]
    losses, grads0, params = reference(job.model, plan, STEPS, opt)
    assert result.losses == pytest.approx(losses, rel=RTOL)
    caps = load_captures(job.run_dir)
    assert sorted(caps) == list(range(len(plan.devices)))
    seen = set()
    for rank, cap in caps.items():
        for key, g in cap["grads"].items():
            torch.testing.assert_close(g, grads0[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} grad {k}: {m}")
            torch.testing.assert_close(cap["params"][key], params[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} param {k}: {m}")
            seen.add(key)
    assert seen == set(grads0), f"parameters never checked: {sorted(set(grads0) - seen)[:5]}"


def test_receives_option_is_checked():
    with pytest.raises(SpecError, match="receives"):
        TrainConfig(steps=1, receives="sometimes")
    with pytest.raises(SpecError, match="deadlock"):
        TrainConfig(steps=1, mode="real", use_cuda=True, receives="at-step-start")
