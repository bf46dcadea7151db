"""Model profile: analytic vs measured time, fused backward, first-stage timings, JSON round trip."""

from __future__ import annotations

import json

import pytest

from deepcee.cluster import DeviceKind
from deepcee.errors import ProfileError
from deepcee.profile import LayerProfile, LayerTiming, ModelProfile, profile_from_dict

KIND = DeviceKind(name="k", peak_flops_per_s=1e12, memory_bytes=1e9, achievable_fraction=0.5,
                  per_layer_overhead_s=1e-3)


def layers(n: int = 3) -> tuple[LayerProfile, ...]:
    return tuple(
        LayerProfile(name=f"l{i}", forward_flops=1e9, input_grad_flops=1e9, weight_grad_flops=2e9,
                     parameter_count=1000, activation_bytes=10.0, output_bytes=4.0)
        for i in range(n)
    )


def test_analytic_time_is_flops_over_effective_rate_plus_overhead() -> None:
    m = ModelProfile(name="m", layers=layers(), input_bytes=8.0)
    # 2 layers x 1e9 FLOPs x 4 samples / 5e11 + 2 x 1 ms
    assert m.time_s(0, 2, "F", 4, KIND) == pytest.approx(2 * 1e9 * 4 / 5e11 + 2e-3)
    # B = I + W: two passes of overhead
    assert m.time_s(1, 2, "B", 1, KIND, slowdown=2.0) == pytest.approx(2 * (3e9 / 5e11 + 2e-3))
    assert m.flops_per_sample() == pytest.approx(3 * 4e9)
    assert m.boundary_bytes(0) == 8.0 and m.boundary_bytes(2) == 4.0


def test_measured_timings_replace_flops_with_fused_backward_and_first_stage() -> None:
    first = LayerTiming(forward=(0.001, 0.01), input_grad=(0.0, 0.0), weight_grad=(0.001, 0.02))
    t = LayerTiming(forward=(0.001, 0.01), input_grad=(0.001, 0.01), weight_grad=(0.001, 0.02),
                    backward=(0.001, 0.025), first_stage=first)
    m = ModelProfile(name="m", layers=layers(2), input_bytes=8.0).with_measured("k", (t, t), source="test")
    assert m.time_s(1, 2, "F", 2, KIND) == pytest.approx(0.021)
    assert m.time_s(1, 2, "B", 2, KIND) == pytest.approx(0.051)  # fused, not I + W = 0.072
    assert m.time_s(1, 2, "I", 2, KIND, slowdown=2.0) == pytest.approx(0.042)
    assert m.time_s(0, 1, "I", 2, KIND) == 0.0  # first stage: no input gradient
    assert m.time_s(0, 2, "B", 2, KIND) == pytest.approx(2 * 0.041)  # first_stage has no fused line: I + W
    again = profile_from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m


def test_validation_names_the_value() -> None:
    with pytest.raises(ProfileError, match=r"layer 'x': forward_flops must be a finite number >= 0, got -1"):
        LayerProfile(name="x", forward_flops=-1, input_grad_flops=0, weight_grad_flops=0, parameter_count=0,
                     activation_bytes=0, output_bytes=0)
    t = LayerTiming(forward=(0, 0), input_grad=(0, 0), weight_grad=(0, 0))
    with pytest.raises(ProfileError, match="cover 1 layers, the model has 2"):
        ModelProfile(name="m", layers=layers(2), input_bytes=1.0, measured={"k": (t,)})
    with pytest.raises(ProfileError, match="schema_version"):
        profile_from_dict({"format": "deepcee.profile", "schema_version": 7})
    d = ModelProfile(name="m", layers=layers(2), input_bytes=1.0).to_dict()
    with pytest.raises(ProfileError, match=r"^p\.json: optimizer: expected one of adam, sgd; got 'lion'"):
        profile_from_dict({**d, "optimizer": "lion"}, file="p.json")


def test_call_overhead_is_paid_once_per_stage_action() -> None:
    t = LayerTiming(forward=(0.001, 0.01), input_grad=(0.001, 0.01), weight_grad=(0.002, 0.02),
                    backward=(0.002, 0.025),
                    first_stage=LayerTiming(forward=(0.001, 0.01), input_grad=(0.0, 0.0), weight_grad=(0.002, 0.03)))
    call = LayerTiming(forward=(0.0005, 0.0), input_grad=(0.003, 0.0), weight_grad=(0.0001, 0.0), backward=(0.001, 0.0),
                       first_stage=LayerTiming(forward=(0.0004, 0.0), input_grad=(0.0, 0.0), weight_grad=(0.002, 0.0)))
    m = ModelProfile(name="m", layers=layers(3), input_bytes=8.0).with_measured("k", (t, t, t), source="test",
                                                                              call_overhead=call)
    # two layers of an inner stage, 2 samples: the layers' lines plus one call
    assert m.time_s(1, 3, "F", 2, KIND) == pytest.approx(2 * 0.021 + 0.0005)
    assert m.time_s(1, 3, "I", 2, KIND, slowdown=2.0) == pytest.approx(2 * (2 * 0.021 + 0.003))
    assert m.time_s(1, 3, "B", 2, KIND) == pytest.approx(2 * 0.052 + 0.001)
    # a first stage: first-stage lines and the first-stage call (no fused line there: I + W)
    assert m.time_s(0, 2, "W", 1, KIND) == pytest.approx(2 * 0.032 + 0.002)
    assert m.time_s(0, 3, "B", 1, KIND) == pytest.approx(3 * 0.032 + 0.002)
    # one layer per stage: every layer pays the call (the single-layer figure the probe measures)
    per_layer = sum(m.time_s(i, i + 1, "I", 4, KIND) for i in (1, 2))
    assert per_layer == pytest.approx(m.time_s(1, 3, "I", 4, KIND) + 0.003)
    again = profile_from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m and again.measured_call_overhead["k"] == call
    # replacing a kind's timings without an overhead drops its old overhead
    assert m.with_measured("k", (t, t, t), source="x").measured_call_overhead == {}
    with pytest.raises(ProfileError, match="call overhead for kind 'gpu' without measured timings"):
        ModelProfile(name="m", layers=layers(1), input_bytes=1.0, measured_call_overhead={"gpu": call})


def test_schema_2_interpolates_between_measured_sizes() -> None:
    t = LayerTiming(forward=(0.001, 0.01), input_grad=(0.0, 0.01), weight_grad=(0.0, 0.01), backward=(0.0, 0.02),
                    sizes=(1, 2, 4), points={"F": (0.010, 0.014, 0.030), "B": (0.02, 0.03, 0.05)})
    assert t.time_s("F", 2) == pytest.approx(0.014)
    assert t.time_s("F", 3) == pytest.approx(0.022)  # between 2 and 4, not the line's 0.031
    assert t.time_s("F", 6) == pytest.approx(0.030 + 2 * 0.01)  # beyond: the line's slope from the last point
    assert t.time_s("F", 0.5) == pytest.approx(0.010 - 0.5 * 0.01)
    assert t.time_s("I", 3) == pytest.approx(0.03)  # no points for I: the line
    assert t.time_s("B", 3) == pytest.approx(0.04)
    with pytest.raises(ProfileError, match="3 times for sizes"):
        LayerTiming(forward=(0, 0), input_grad=(0, 0), weight_grad=(0, 0), sizes=(1, 2), points={"F": (1, 2, 3)})


def test_schema_2_measurements_round_trip_and_schema_1_still_loads() -> None:
    from deepcee.profile import DeviceMemory, LinkCurve

    t = LayerTiming(forward=(0.001, 0.01), input_grad=(0.001, 0.01), weight_grad=(0.002, 0.02), sizes=(1, 2),
                    points={"F": (0.011, 0.021)}, optimizer_s=0.003)
    call = LayerTiming(forward=(0.0005, 0.0), input_grad=(0.0, 0.0), weight_grad=(0.0, 0.0), optimizer_s=0.001)
    m = ModelProfile(name="m", layers=layers(2), input_bytes=8.0).with_measured("k", (t, t), source="x",
                                                                              call_overhead=call)
    m = m.__class__(**{**{f: getattr(m, f) for f in m.__dataclass_fields__},
                       "measured_memory": {"k": DeviceMemory(fixed_bytes=3e8, fragmentation_fraction=0.2, method="m"),
                                           "g": DeviceMemory(fixed_bytes=5e8)},
                       "links": {"a->b": LinkCurve(sizes_bytes=(16, 1024), serialisation_s=(0.0, 1e-3),
                                                   bandwidth_bytes_per_s=1e6)},
                       "step_overhead_wall_s": {"realnet": 0.002}})
    d = json.loads(json.dumps(m.to_dict()))
    assert d["schema_version"] == 2 and profile_from_dict(d) == m
    assert m.optimizer_step_s(0, 2, "k", slowdown=2.0) == pytest.approx(2 * (0.001 + 2 * 0.003))
    assert m.optimizer_step_s(0, 2, "gpu") is None
    assert m.memory_overhead("k").fixed_bytes == 3e8 and m.memory_overhead(None).fixed_bytes == 5e8
    assert m.link_curve("a", "b").serialise_s(520) == pytest.approx(0.5e-3)
    old = ModelProfile(name="m", layers=layers(2), input_bytes=8.0).with_measured("k", (t, t), source="x").to_dict()
    for key in ("sizes", "points", "optimizer_s"):
        for layer in old["measured"]["k"]:
            layer.pop(key, None)
    v1 = profile_from_dict({**old, "schema_version": 1})
    assert v1.measured["k"][0].points == {} and v1.measured_memory == {} and v1.optimizer_step_s(0, 1, "k") is None
