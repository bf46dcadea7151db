"""Measured profile: slowdowns, per-kind lines, first-stage composition, call overheads from range
probes, JSON round trip and use by ModelProfile.time_s, measured kinds, and layer costs counted
from a user's blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepcee.cluster import DeviceKind
from deepcee.errors import ProfileError
from deepcee.models import get_model
from deepcee.profile import profile_from_dict
from deepcee.profiler.device import net_source
from deepcee.profiler.model import (
    base_profile,
    call_overheads,
    first_stage_rows,
    kind_lines,
    kind_timings,
    measured_kind,
    measured_profile,
    measured_slowdowns,
    profile_from_blocks,
)
from deepcee.profiler.probes import (
    MEMORY_CPU,
    PASSES,
    ComputeScore,
    DeviceProbe,
    LayerProbe,
    PassFit,
    RangeProbe,
)
from deepcee.runtime.data import Batch

SIZES = (1, 2, 4, 8)
KIND = DeviceKind(name="cpu-worker", peak_flops_per_s=5e10, memory_bytes=2**31)


def _pass(fixed: float, slope: float) -> PassFit:
    return PassFit(median_s=tuple(fixed + slope * n for n in SIZES), iqr_s=(0.0,) * 4, fixed_s=fixed,
                   per_sample_s=slope, max_residual_fraction=0.0)


def _line(layer: int, pas: str, *, first: bool = False) -> tuple[float, float]:
    """The synthetic single-layer line of :func:`synthetic_probe` at factor 1."""
    f = ((1 + layer) * 1e-4, 2e-4)
    k = ({"F": 1, "I": 0.1, "W": 2, "B": 1.8} if first else {"F": 1, "I": 1.5, "W": 1.2, "B": 2})[pas]
    return (k * f[0], 0.0 if first and pas == "I" else k * f[1])


def synthetic_probe(device: str, factor: float, *, layers: int = 6, kind: str = "cpu-worker",
                    score: float = 4e10, overhead: tuple[dict[str, float], dict[str, float]] | None = None
                    ) -> DeviceProbe:
    """Layer i: F = (1 + i) x 0.1 ms fixed + 0.2 ms per sample, I = 1.5 F, W = 1.2 F, fused B = 2 F
    (first stage: I = 0.1 F fixed only, W = B / 0.9 = 2 F), all times ``factor``."""
    out = []
    for i in range(layers):
        f = ((1 + i) * 1e-4 * factor, 2e-4 * factor)
        out.append(LayerProbe(name=f"l{i}", microbatch_sizes=SIZES, rounds=5, peak_memory_bytes=1e6,
                              activation_bytes_per_sample=1e4,
                              passes={"F": _pass(*f), "I": _pass(1.5 * f[0], 1.5 * f[1]),
                                      "W": _pass(1.2 * f[0], 1.2 * f[1]), "B": _pass(2 * f[0], 2 * f[1])},
                              first_stage={"F": _pass(*f), "I": _pass(0.1 * f[0], 0.0),
                                           "W": _pass(2 * f[0], 2 * f[1]), "B": _pass(1.8 * f[0], 1.8 * f[1])}))
    ranges = ()
    if overhead is not None:  # ranges [1, L) and [0, L): the sum of their single-layer figures less (k - 1) calls
        def span(start: int, c: dict[str, float]) -> RangeProbe:
            rows = [la.passes for la in out[start:]]
            if start == 0:
                rows = first_stage_rows([la.passes for la in out], [la.first_stage for la in out], [1] * layers)
            passes = {}
            for p in PASSES:
                fixed = sum(r[p].fixed_s for r in rows) - (len(rows) - 1) * c[p] * factor
                passes[p] = _pass(fixed, sum(r[p].per_sample_s for r in rows))
            return RangeProbe(start=start, stop=layers, passes=passes, rounds=5)
        ranges = (span(1, overhead[0]), span(0, overhead[1]))
    return DeviceProbe(device=device, torch_device="cpu", kind=kind, timer="thread-cpu", memory_method=MEMORY_CPU,
                       slowdown=1.0, dilation=1.0, emulated=False, layers=tuple(out), ranges=ranges,
                       score=ComputeScore(flops_per_s=score / factor, benchmarks={}), wall_s=1.0)


def test_slowdowns_are_relative_to_the_fastest_device_of_each_kind():
    probes = [synthetic_probe("a", 1.0), synthetic_probe("b", 2.0), synthetic_probe("c", 3.0, kind="other"),
              synthetic_probe("d", 1.5, kind="other")]
    slow = measured_slowdowns(probes)
    assert slow == pytest.approx({"a": 1.0, "b": 2.0, "c": 2.0, "d": 1.0})
    lines = kind_lines(probes, slow)
    # every device, divided by its slowdown, is the kind's reference: the mean reproduces it exactly
    assert lines["cpu-worker"][0]["F"] == pytest.approx((1e-4, 2e-4))
    assert lines["other"][0]["F"] == pytest.approx((1.5e-4, 3e-4))
    assert lines["cpu-worker"][1]["B"] == pytest.approx((4e-4, 4e-4))
    first = kind_lines(probes, slow, first_stage=True)
    assert first["cpu-worker"][0]["I"] == pytest.approx((1e-5, 0.0))
    assert first["other"][1]["B"] == pytest.approx((1.8 * 3e-4, 1.8 * 3e-4))
    # no range probes: no call overhead, the layer lines keep the single-layer figures
    t, call = kind_timings(probes, slow, [1] * 6)["cpu-worker"]
    assert call is None and t[2].backward == pytest.approx(_line(2, "B"))


def test_first_stage_composition_follows_the_parameters_below():
    inner = [{"F": f"F{i}", "I": f"I{i}", "W": f"W{i}", "B": f"B{i}"} for i in range(4)]
    first = [{"F": f"f{i}", "I": f"i{i}", "W": f"w{i}", "B": f"b{i}"} for i in range(3)] + [None]
    rows = first_stage_rows(inner, first, [0, 5, 5, 5])
    # layers 0 and 1 have nothing with parameters below them: their own first-stage figures
    assert rows[0] == first[0] and rows[1] == first[1]
    # layer 2 sits above layer 1's parameters: inner F, first-stage I, fused inner B for W and B
    assert rows[2] == {"F": "F2", "I": "i2", "W": "B2", "B": "B2"}
    assert rows[3] is None


def test_measured_profile_round_trips_and_drives_time_s():
    base = get_model("gpt-tiny")
    probes = [synthetic_probe("cloud0:0", 1.0), synthetic_probe("edge0:1", 2.0)]
    prof = measured_profile(base, probes, source="test")
    back = profile_from_dict(prof.to_dict())
    assert back.measured == prof.measured and back.layers == base.layers and back.source == "test"
    # layers [1, 4), 4 samples, slowdown 2: 2 x sum over layers of (fixed + per-sample x 4)
    want_f = 2 * sum((1 + i) * 1e-4 + 2e-4 * 4 for i in range(1, 4))
    assert back.time_s(1, 4, "F", 4, KIND, slowdown=2.0) == pytest.approx(want_f)
    assert back.time_s(1, 4, "I", 4, KIND, slowdown=2.0) == pytest.approx(1.5 * want_f)
    assert back.time_s(1, 4, "B", 4, KIND, slowdown=2.0) == pytest.approx(2 * want_f)  # the fused line
    # a first stage: layer 0's own first-stage lines, then (parameters below) inner F, fused B as W
    want_w = 2 * 1e-4 + 2 * 2e-4 * 4 + sum(2 * ((1 + i) * 1e-4 + 2e-4 * 4) for i in (1, 2))
    assert back.time_s(0, 3, "W", 4, KIND) == pytest.approx(want_w)
    assert back.time_s(0, 3, "I", 4, KIND) == pytest.approx(0.1 * sum((1 + i) * 1e-4 for i in range(3)))
    # a kind without measurements still uses the analytic FLOP-based estimate
    other = DeviceKind(name="gpu", peak_flops_per_s=1e14, memory_bytes=1e10)
    assert back.time_s(1, 4, "F", 4, other) == pytest.approx(
        base.time_s(1, 4, "F", 4, other))
    with pytest.raises(ProfileError, match="probed 4 layers"):
        measured_profile(base, [synthetic_probe("x", 1.0, layers=4)], source="test")


def test_call_overhead_from_ranges_makes_the_profile_reproduce_the_ranges():
    """Ranges that cost (k - 1) calls less than their layers: the profile then predicts the single
    layers and both ranges exactly, at every size, on both devices."""
    base = get_model("gpt-tiny")
    c_inner = {"F": 0.5e-4, "I": 1e-4, "W": 0.2e-4, "B": 0.8e-4}
    c_first = {"F": 0.3e-4, "I": 0.05e-4, "W": 1e-4, "B": 1e-4}
    probes = [synthetic_probe(d, f, overhead=(c_inner, c_first)) for d, f in (("a", 1.0), ("b", 2.0))]
    slow = measured_slowdowns(probes)
    assert call_overheads(probes, slow, [la.parameter_count for la in base.layers])["cpu-worker"] == (
        pytest.approx(c_inner), pytest.approx(c_first))
    prof = profile_from_dict(measured_profile(base, probes, source="test").to_dict())
    call = prof.measured_call_overhead["cpu-worker"]
    assert call.time_s("I", 8) == pytest.approx(1e-4) and call.first_stage.time_s("W", 8) == pytest.approx(1e-4)
    for probe in probes:
        s = slow[probe.device]
        inner, first = probe.ranges
        for k, n in enumerate(SIZES):
            for p in PASSES:
                assert prof.time_s(1, 6, p, n, KIND, s) == pytest.approx(inner.passes[p].median_s[k])
                assert prof.time_s(0, 6, p, n, KIND, s) == pytest.approx(first.passes[p].median_s[k])
                assert prof.time_s(3, 4, p, n, KIND, s) == pytest.approx(probe.layers[3].passes[p].median_s[k])
    # an estimate above the smallest fixed cost it comes out of is clamped there (no negative line)
    big = [synthetic_probe("a", 1.0, overhead=({**c_inner, "I": 1.0}, c_first))]
    t, call = kind_timings(big, measured_slowdowns(big), [1] * 6)["cpu-worker"]
    assert call.input_grad == pytest.approx((1.5 * 2e-4, 0.0)) and t[1].input_grad[0] == 0.0


def test_measured_kind_reproduces_the_measured_speed():
    base = get_model("gpt-tiny")
    probes = [synthetic_probe("a", 1.0), synthetic_probe("b", 2.0)]
    prof = measured_profile(base, probes, source="test")
    kind = measured_kind(KIND, probes, prof)
    assert kind.peak_flops_per_s == pytest.approx(4e10)  # the fastest device's benchmark score
    per_sample_s = sum(t.time_s(p, 8) for t in prof.measured[KIND.name] for p in "FIW") / 8
    assert kind.effective_flops_per_s * per_sample_s == pytest.approx(base.flops_per_sample())
    assert kind.memory_bytes == KIND.memory_bytes and "measured by deepcee profile" in kind.source
    assert kind.per_layer_overhead_s > 0


class _Data:
    def batch(self, step: int, n: int) -> Batch:
        g = torch.Generator().manual_seed(step)
        return Batch(inputs=torch.randn(n, 16, generator=g), targets=torch.randn(n, 3, generator=g))


def test_user_blocks_are_counted_with_the_runtime_split():
    torch.manual_seed(0)
    blocks = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3)]
    src = net_source(blocks, loss_fn=nn.functional.mse_loss, dataset=_Data(), name="mlp")
    prof = profile_from_blocks(src, samples=2)
    first, act, last = prof.layers
    assert prof.name == "mlp" and prof.num_layers == 3 and prof.input_bytes == 16 * 4
    assert first.forward_flops == pytest.approx(2 * 16 * 32)
    assert first.input_grad_flops == 0  # the first stage never computes an input gradient
    assert first.weight_grad_flops == pytest.approx(2 * 16 * 32)
    assert last.input_grad_flops == pytest.approx(2 * 32 * 3) and last.weight_grad_flops == pytest.approx(2 * 32 * 3)
    assert first.parameter_count == 16 * 32 + 32 and act.parameter_count == 0
    assert first.output_bytes == 32 * 4 and act.activation_bytes > 0
    assert base_profile(net_source("gpt-tiny")).source == "analytic"
