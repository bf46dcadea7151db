"""Shared builders for the planner tests: random clusters, toy models, measured profiles.

Plain functions (tests call them with their own sizes and seeds): ``from conftest import
random_cluster, toy_model, measured_model``.
"""

from __future__ import annotations

import itertools
import random

from deepcee.cluster import Cluster, cluster_from_toml_dict
from deepcee.profile import LayerProfile, LayerTiming, ModelProfile


def toy_model(layers: int = 6, *, params: int = 10_000_000, flops: float = 3e9, act: float = 4e6,
              out: float = 1e6, state: float = 16.0, name: str = "toy") -> ModelProfile:
    """An analytic model of ``layers`` equal layers (boundary bytes vary with the layer)."""
    return ModelProfile(
        name=name,
        layers=tuple(
            LayerProfile(name=f"l{i}", forward_flops=flops / 3, input_grad_flops=flops / 3,
                         weight_grad_flops=flops / 3, parameter_count=params, activation_bytes=act,
                         output_bytes=out * (1 + (i % 3)))
            for i in range(layers)
        ),
        input_bytes=1e5,
        state_bytes_per_parameter=state,
    )


def random_cluster(rng: random.Random, name: str = "rand") -> Cluster:
    """2-4 islands, 1-2 nodes each, 1-3 devices per node, random speeds and links."""
    n_islands = rng.randint(2, 4)
    islands = [f"i{k}" for k in range(n_islands)]
    data: dict = {
        "name": name,
        "kinds": {
            "fast": {"peak_tflops": rng.uniform(10, 40), "memory_gib": rng.choice([4.0, 8.0, 16.0]),
                     "achievable_fraction": 0.5},
            "slow": {"peak_tflops": rng.uniform(1, 10), "memory_gib": rng.choice([2.0, 4.0, 8.0]),
                     "achievable_fraction": 0.5},
        },
        "islands": {i: {"latency_us": rng.uniform(10, 500), "bandwidth_gbit_per_s": rng.choice([1, 10])}
                    for i in islands},
        "nodes": [],
        "links": [],
    }
    for i in islands:
        for n in range(rng.randint(1, 2)):
            data["nodes"].append({
                "name": f"{i}n{n}", "island": i, "kind": rng.choice(["fast", "slow"]),
                "devices": rng.randint(1, 3), "slowdown": rng.choice([1.0, 1.0, 2.0]),
            })
    for a, b in itertools.combinations(islands, 2):
        data["links"].append({"between": [a, b], "latency_ms": rng.uniform(1, 50),
                              "bandwidth_mbit_per_s": rng.choice([10, 50, 100, 500, 1000])})
    return cluster_from_toml_dict(data)


def _line(rng: random.Random, fixed_s: float, per_sample_s: float) -> tuple[float, float]:
    return fixed_s * rng.uniform(0.5, 1.5), per_sample_s * rng.uniform(0.5, 1.5)


def measured_model(kind: str, layers: int = 6, *, seed: int = 0, **analytic: float) -> ModelProfile:
    """:func:`toy_model` with measured timings for ``kind`` in the profiler's shape: per-layer
    lines with a fused backward cheaper than ``I + W`` and first-stage lines (no input
    gradient), and a call overhead (with its own first-stage line) paid once per action."""
    rng = random.Random(seed)
    timings = []
    for _ in range(layers):
        f, i, w = (_line(rng, 2e-4, 1e-3) for _ in range(3))
        fused = (0.6 * (i[0] + w[0]), 0.8 * (i[1] + w[1]))
        first = LayerTiming(forward=f, input_grad=(0.0, 0.0), weight_grad=w, backward=(0.7 * w[0], w[1]))
        timings.append(LayerTiming(forward=f, input_grad=i, weight_grad=w, backward=fused, first_stage=first))
    call = LayerTiming(forward=(3e-3, 1e-5), input_grad=(2e-3, 1e-5), weight_grad=(2e-3, 0.0),
                       backward=(3e-3, 1e-5),
                       first_stage=LayerTiming(forward=(3e-3, 1e-5), input_grad=(1e-3, 0.0),
                                               weight_grad=(2e-3, 0.0), backward=(2.5e-3, 0.0)))
    return toy_model(layers, name="measured", **analytic).with_measured(kind, tuple(timings), source="test",
                                                                         call_overhead=call)


def benchmark_module(name: str):
    """The module ``benchmarks/<name>.py`` (loaded once; the benchmarks import each other by name,
    so their folder is on the path while one loads)."""
    import importlib.util
    import sys
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location(name, root / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
        return mod
    finally:
        sys.path.remove(str(root))


def planner_at_scale():
    """The module ``benchmarks/planner_at_scale.py`` (loaded once)."""
    return benchmark_module("planner_at_scale")


def wan_seed(seed: int):
    """``benchmarks/planner_at_scale.py``'s random WAN instance ``seed``: (cluster, model, batch)."""
    return planner_at_scale().wan_instance(seed)
