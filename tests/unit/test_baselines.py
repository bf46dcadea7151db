"""Baselines: valid plans scored by the simulator, memory respected or a reason given."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from conftest import random_cluster, toy_model

from deepcee.models import get_model
from deepcee.planner.baselines import (
    ALL_DEVICE_BASELINES,
    BASELINE_NAMES,
    balanced_layer_split,
    build_baselines,
    even_layer_split,
    even_shares,
    microbatch_counts,
    proportional_shares,
)
from deepcee.planner.bound import upper_bound
from deepcee.scenarios import load_scenario
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.passes import in_flight_per_stage
from deepcee.simulator.memory import device_memory
from deepcee.simulator.runtime_model import runtime_for


def check_result(results, cluster, model, batch) -> None:
    assert [r.name for r in results] == list(BASELINE_NAMES)
    for r in results:
        if r.plan is None:
            assert r.reason, r.name
            continue
        p = r.plan
        p.check_against(num_layers=model.num_layers, device_names=cluster.device_names)
        assert p.system == r.name and p.global_batch == batch
        assert p.estimate is not None and p.estimate.source == "simulator"
        assert p.estimate.samples_per_s == pytest.approx(batch / p.estimate.iteration_s)
        assert set(p.excluded_devices) == set(cluster.device_names) - set(p.devices)
        in_flight = in_flight_per_stage(build_schedule(p.schedule, p.num_stages, p.num_microbatches))
        for s, st in enumerate(p.stages):
            for d, share in zip(st.devices, st.shares, strict=True):
                need = device_memory(model, st.layer_start, st.layer_stop, share=share, in_flight=in_flight[s],
                                     num_microbatches=p.num_microbatches, kind=cluster.device(d).kind, sync=p.sync,
                                     stage_devices=len(st.devices), runtime=runtime_for(cluster, model)).total_bytes
                assert need <= cluster.memory_bytes(d), (r.name, d)
                assert p.estimate.peak_memory_bytes[d] == pytest.approx(need)


@pytest.mark.parametrize("name", ["gpt2", "resnet50", "bert-small"])
def test_baselines_on_the_testbed_are_valid_and_fit(name: str) -> None:
    cluster, model = load_scenario("cee-testbed"), get_model(name)
    results = build_baselines(cluster, model, 32)
    check_result(results, cluster, model, 32)
    by = {r.name: r for r in results}
    ddp = by["ddp"].plan
    assert ddp.num_stages == 1 and set(ddp.devices) == set(cluster.device_names)
    assert ddp.sync == "allreduce-ring" and max(ddp.stages[0].shares) - min(ddp.stages[0].shares) <= 1
    assert by["fsdp-zero2"].plan.sync == "zero2"
    for pipe in ("gpipe-even", "1f1b-even"):
        p = by[pipe].plan
        assert p.num_stages == min(15, model.num_layers)
        assert p.schedule == pipe.split("-")[0]
        sizes = [st.layer_stop - st.layer_start for st in p.stages]
        assert max(sizes) - min(sizes) <= 1
        # round-robin in file order: device k on stage k mod S
        for k, d in enumerate(cluster.device_names):
            assert p.stage_of(d) == k % p.num_stages
    island = by["ddp-best-island"].plan
    assert len({cluster.device(d).island for d in island.devices}) == 1 and island.excluded_devices
    node = by["best-single-node"].plan
    assert len({cluster.device(d).node for d in node.devices}) == 1
    # the slow links make flat DDP over every device far slower than DDP on one island
    assert by["ddp"].samples_per_s < by["ddp-best-island"].samples_per_s / 10
    # metis searches a space that contains a 1-stage data-parallel plan, so it is never worse than ddp
    assert by["metis-hetpipe"].samples_per_s >= by["ddp"].samples_per_s * 0.999


def test_models_too_big_for_a_device_report_oom_with_numbers() -> None:
    cluster, model = load_scenario("cee-testbed"), get_model("gpt2-xl")
    results = build_baselines(cluster, model, 32)
    check_result(results, cluster, model, 32)
    by = {r.name: r for r in results}
    assert by["ddp"].plan is None
    assert by["ddp"].reason.startswith("OOM: needs ") and "GiB on cloud0:0, has 22 GiB" in by["ddp"].reason
    assert by["ddp-best-island"].plan is None and "no island fits" in by["ddp-best-island"].reason
    # ZeRO-2 shards the optimizer state: it fits where DDP does not
    assert by["fsdp-zero2"].plan is not None
    # a single 4-GPU node falls back to a pipeline (deepcee's runtime builds every layer on the
    # host and moves only its stage's to a GPU, so the other layers do not count there)
    assert by["best-single-node"].plan is not None and by["best-single-node"].plan.num_stages > 1


def test_bound_is_never_beaten_by_a_baseline_on_random_clusters() -> None:
    rng = random.Random(3)
    for trial in range(12):
        cluster = random_cluster(rng, f"r{trial}")
        model = toy_model(rng.randint(2, 8), params=rng.choice([1_000_000, 20_000_000]),
                          out=rng.choice([1e4, 1e6]), act=rng.choice([1e5, 1e7]))
        batch = rng.choice([8, 32, 64])
        bound = upper_bound(cluster, model, batch)
        results = build_baselines(cluster, model, batch)
        check_result(results, cluster, model, batch)
        for r in results:
            assert r.samples_per_s <= bound.samples_per_s * (1 + 1e-9), (trial, r.name, bound)


def test_bound_is_never_beaten_on_the_testbed() -> None:
    cluster = load_scenario("cee-testbed-500m")
    for name in ("gpt2", "efficientnet-b0-cifar"):
        model = get_model(name)
        bound = upper_bound(cluster, model, 64)
        for r in build_baselines(cluster, model, 64):
            assert r.samples_per_s <= bound.samples_per_s, (name, r.name)


def test_all_device_baselines_use_every_device() -> None:
    cluster, model = load_scenario("local-small"), get_model("resnet-tiny")
    results = {r.name: r for r in build_baselines(cluster, model, 16)}
    for name in ALL_DEVICE_BASELINES:
        assert results[name].plan is not None, results[name].reason
        assert set(results[name].plan.devices) == set(cluster.device_names), name


# ---------------------------------------------------------------------------------------
# the small pieces, against brute force
# ---------------------------------------------------------------------------------------


def test_even_and_proportional_shares() -> None:
    assert even_shares(32, 15) == (3, 3) + (2,) * 13
    assert even_shares(7, 7) == (1,) * 7
    # 3 samples go one each; the other 7 by weight 2:1:1 -> 3.5, 1.75, 1.75, largest remainders win
    assert proportional_shares(10, [2.0, 1.0, 1.0]) == (4, 3, 3)
    assert proportional_shares(3, [100.0, 1.0, 1.0]) == (1, 1, 1)
    assert even_layer_split(14, 4) == [(0, 4), (4, 7), (7, 10), (10, 14)]
    # divisors of 128 leaving >= 4 samples: the largest <= 60 first, then more, then fewer
    assert microbatch_counts(128, 4, 60) == [32, 16, 8, 4, 2, 1]
    assert microbatch_counts(128, 4, 8) == [8, 16, 32, 4, 2, 1]
    assert microbatch_counts(8, 16, 4) == []


def test_balanced_split_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, k = int(rng.integers(2, 9)), int(rng.integers(1, 5))
        k = min(k, n)
        cost = rng.uniform(0.1, 5.0, n)
        speed = rng.uniform(0.5, 3.0, k)
        fits = [rng.uniform(size=(n + 1, n + 1)) < 0.8 for _ in range(k)]
        got = balanced_layer_split(cost, speed, fits)
        best = None
        for cuts in itertools.combinations(range(1, n), k - 1):
            b = (0, *cuts, n)
            parts = list(zip(b, b[1:], strict=False))
            if not all(fits[s][a, c] for s, (a, c) in enumerate(parts)):
                continue
            t = max(cost[a:c].sum() / speed[s] for s, (a, c) in enumerate(parts))
            best = t if best is None else min(best, t)
        if best is None:
            assert got is None
        else:
            assert got is not None
            assert max(cost[a:c].sum() / speed[s] for s, (a, c) in enumerate(got)) == pytest.approx(best)
