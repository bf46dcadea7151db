"""Device probe: line fits, real timings on a tiny net, the emulated (paced) path, memory, JSON."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from deepcee.errors import ProfileError, SpecError
from deepcee.profiler.device import net_source, probe_device
from deepcee.profiler.layer_probe import probe_blocks
from deepcee.profiler.probes import PASSES, ProbeConfig, fit_line, probe_from_dict, probe_to_dict
from deepcee.profiler.timing import compute_score
from deepcee.runtime.data import Batch
from deepcee.runtime.emulation import Clock, DevicePacer

WIDTH = 384


class _Data:
    def batch(self, step: int, n: int) -> Batch:
        g = torch.Generator().manual_seed(step)
        return Batch(inputs=torch.randn(n, WIDTH, generator=g), targets=torch.randn(n, 4, generator=g))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4))


def test_fit_line_recovers_a_line_and_never_goes_negative():
    fixed, slope = fit_line([1, 2, 4, 8], [0.5 + 0.25 * n for n in (1, 2, 4, 8)])
    assert fixed == pytest.approx(0.5) and slope == pytest.approx(0.25)
    # decreasing noise-only data: least squares would give a negative slope; nnls clamps it at 0
    fixed, slope = fit_line([1, 2, 4, 8], [1.0, 0.99, 0.98, 0.97])
    assert slope == 0.0 and fixed == pytest.approx(0.985)
    with pytest.raises(ProfileError):
        fit_line([1], [1.0])


def test_probe_config_rejects_bad_values():
    with pytest.raises(SpecError, match="microbatch sizes"):
        ProbeConfig(microbatch_sizes=(4,))
    with pytest.raises(SpecError, match="cpu_timer"):
        ProbeConfig(cpu_timer="cycles")


def test_probe_on_a_tiny_net_is_positive_and_grows_with_the_microbatch():
    torch.set_num_threads(1)
    sizes = (1, 16, 64)
    cfg = ProbeConfig(microbatch_sizes=sizes, warmup=1, repeats=5)
    data = _Data().batch(0, 64)
    layers, ranges, timer = probe_blocks(list(_mlp()), inputs=data.inputs, targets=data.targets,
                                         loss_fn=nn.functional.mse_loss, config=cfg)
    assert timer == "thread-cpu" and len(layers) == 4
    for la in layers:
        assert la.rounds == 5
        for p in PASSES:
            assert all(t >= 0 for t in la.passes[p].median_s)
            assert la.passes[p].fixed_s >= 0 and la.passes[p].per_sample_s >= 0
    for la in (layers[0], layers[2]):  # the 384x384 linears: 64 samples cost clearly more than 1
        f = la.passes["F"].median_s
        assert 0 < f[0] < f[2]
        totals = [sum(la.passes[p].median_s[k] for p in PASSES) for k in range(len(sizes))]
        assert totals[0] < totals[1] < totals[2]
        assert la.timing.time_s("B", 64) > la.timing.time_s("B", 1) > 0
    # the first layer has no input gradient in the runtime either: its I is only bookkeeping
    assert layers[0].passes["I"].per_sample_s < layers[0].passes["W"].per_sample_s
    assert layers[0].first_stage == layers[0].passes
    # any layer as part of a first stage: no input gradient, I shrinks to bookkeeping
    first = layers[2].first_stage
    assert first["I"].median_s[2] < 0.5 * layers[2].passes["I"].median_s[2]
    assert first["W"].median_s[2] > 0
    # a layer without parameters in a first stage has nothing to differentiate: its backward
    # costs less than the same layer's inside a stage (where it passes the gradient through)
    assert layers[1].first_stage["B"].median_s[2] < layers[1].passes["B"].median_s[2]
    assert layers[1].first_stage["W"].median_s[2] < layers[1].passes["B"].median_s[2]
    # the ranges [1, 4) inside a stage and [0, 4) as a first stage, timed in the same rounds
    assert [(r.start, r.stop, r.rounds) for r in ranges] == [(1, 4, 5), (0, 4, 5)]
    for r in ranges:
        single = sum(la.passes["F"].median_s[2] for la in layers[r.start:r.stop])
        assert 0.5 * single < r.passes["F"].median_s[2] < 2 * single
    # the fused backward (GPipe, 1F1B) is cheaper than the split one (I + W)
    for la in (layers[2], layers[3]):
        assert la.passes["B"].median_s[2] < la.passes["I"].median_s[2] + la.passes["W"].median_s[2]
    # memory: parameters + gradients at least; saved activations per sample positive for the linears
    params = sum(p.numel() * 4 for p in _mlp()[0].parameters())
    assert layers[0].peak_memory_bytes >= 2 * params
    assert layers[2].activation_bytes_per_sample >= WIDTH * 4


def test_emulated_probe_reports_cpu_time_times_slowdown_and_pacing():
    """A fake clock: every pass costs exactly 0.5 ms of CPU; slowdown 2.5 makes every figure 1.25 ms."""
    ticks = itertools.count()
    wall = [0.0]

    def cpu() -> float:
        return next(ticks) * 0.5e-3

    def sleep(s: float) -> None:
        wall[0] += s

    # each pass reads the CPU clock twice (before, after): consecutive ticks, 0.5 ms apart,
    # so cpu_s = 0.5 ms, and the wall clock advances only by the pacer's sleep
    clock = Clock(wall=lambda: wall[0], cpu=cpu, sleep=sleep)
    pacer = DevicePacer(slowdown=2.5, dilation=4.0, clock=clock)
    data = _Data().batch(0, 4)
    layers, ranges, _ = probe_blocks(list(_mlp())[:2], inputs=data.inputs, targets=data.inputs,
                                     loss_fn=nn.functional.mse_loss, pacer=pacer,
                                     config=ProbeConfig(microbatch_sizes=(1, 4), warmup=0, repeats=3))
    assert [(r.start, r.stop) for r in ranges] == [(0, 2)]  # [1, 2) is a single layer
    for la in layers:
        for p in PASSES:
            assert la.passes[p].median_s == pytest.approx((1.25e-3, 1.25e-3))
            assert la.passes[p].fixed_s == pytest.approx(1.25e-3) and la.passes[p].per_sample_s == pytest.approx(0)
        assert la.pacing_ratio == pytest.approx(1.0)
    assert ranges[0].passes["B"].median_s == pytest.approx((1.25e-3, 1.25e-3))


def test_compute_score_and_probe_json_round_trip():
    torch.set_num_threads(1)
    score = compute_score(repeats=2)
    assert score.flops_per_s > 1e8 and set(score.benchmarks) == {"matmul128", "matmul256", "matmul512",
                                                                  "conv3x3-8x32x32"}
    src = net_source(_mlp(), loss_fn=nn.functional.mse_loss, dataset=_Data(), name="mlp")
    probe = probe_device(src, device_name="n0:0", kind="cpu-worker",
                         config=ProbeConfig(microbatch_sizes=(1, 2), warmup=0, repeats=2, score_repeats=1))
    assert probe.emulated is False and probe.slowdown == 1.0 and probe.timer == "thread-cpu"
    assert "estimate from tensor sizes" in probe.memory_method
    back = probe_from_dict(probe_to_dict(probe))
    assert back == probe and len(back.ranges) == 2
    with pytest.raises(ProfileError, match="layers: missing required value"):
        probe_from_dict({"device": "x"})


def test_user_blocks_need_loss_and_data():
    with pytest.raises(SpecError, match="loss_fn and a dataset"):
        net_source(_mlp())
