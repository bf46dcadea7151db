"""What the device probe is asked and what it returns: config, records, line fits, JSON.

Torch-free (numpy and scipy only), so probe records can be read, fitted and turned into a
profile (:mod:`deepcee.profiler.model`) without torch. The probe itself, which fills these
records, is :func:`deepcee.profiler.device.probe_device` (per-layer timings:
:mod:`deepcee.profiler.layer_probe`; the clock and the compute score:
:mod:`deepcee.profiler.timing`). Times in seconds, memory in bytes. [Note: probe timers] is in
:mod:`~deepcee.profiler.timing`; [Note: probe memory], [Note: first-stage timings] and
[Note: call overhead] are in :mod:`~deepcee.profiler.layer_probe`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
from scipy.optimize import nnls

from deepcee.errors import ProfileError, SpecError
from deepcee.inputs import Fields, read_json
from deepcee.inputs.limits import (
    BYTES,
    COUNT,
    DURATION,
    GLOBAL_BATCH,
    LAYER_INDEX,
    MAX_LAYERS,
    MEASURED_RATIO,
    MEASURED_TIME,
    PEAK_FLOPS,
    SLOWDOWN,
)
from deepcee.profile import LayerTiming, Pass

CpuTimer = Literal["thread", "wall"]
"""How a CPU device is timed; see [Note: probe timers]."""
TimerName = Literal["cuda-events", "thread-cpu", "wall"]
"""The clock a probe used (recorded in :attr:`DeviceProbe.timer`)."""
PASSES: tuple[Pass, ...] = get_args(Pass)
"""Forward, input gradient, weight gradient (split backward), and the fused backward ``B``."""
# how peak memory was found (DeviceProbe.memory_method); see [Note: probe memory]
MEMORY_CUDA = "cuda max_memory_allocated over one F/I/W of the largest microbatch (+ parameters)"
MEMORY_CPU = "estimate from tensor sizes: parameters, gradients, saved tensors, output and its gradient"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeConfig:
    """How long and how carefully to probe one device."""

    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    warmup: int = 2
    """Rounds run and discarded first (allocator, caches, lazy initialisation)."""
    repeats: int = 7
    """Rounds measured; the figure per size is their median."""
    time_budget_s: float = 120.0
    """Soft limit on the layer probes' wall time: later layers get fewer rounds (never < 3)."""
    cpu_timer: CpuTimer = "thread"
    """See [Note: probe timers]."""
    score_repeats: int = 5
    first_stage: bool = True
    """Also time every layer as part of a first stage; see [Note: first-stage timings]."""
    stage_ranges: bool = True
    """Also time layers ``[1, L)`` and ``[0, L)`` each as one stage; see [Note: call overhead]."""

    def __post_init__(self) -> None:
        sizes = self.microbatch_sizes
        if len(sizes) < 2 or len(set(sizes)) != len(sizes) or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise SpecError(f"need >= 2 distinct microbatch sizes >= 1, got {sizes!r}", field="microbatch_sizes")
        if self.warmup < 0 or self.repeats < 1 or self.score_repeats < 1:
            raise SpecError(f"need warmup >= 0 and repeats >= 1, got {self.warmup!r}, {self.repeats!r}")
        if self.time_budget_s <= 0:
            raise SpecError(f"must be > 0, got {self.time_budget_s!r}", field="time_budget_s")
        if self.cpu_timer not in ("thread", "wall"):
            raise SpecError(f"must be 'thread' or 'wall', got {self.cpu_timer!r}", field="cpu_timer")


@dataclass(frozen=True, slots=True, kw_only=True)
class PassFit:
    """One pass of one layer: the median time per microbatch size and the fitted line."""

    median_s: tuple[float, ...]
    """Median over rounds, per size (same order as the probe's sizes)."""
    iqr_s: tuple[float, ...]
    """Inter-quartile range over rounds, per size."""
    fixed_s: float
    per_sample_s: float
    max_residual_fraction: float
    """Largest ``|fit - median| / median`` over the sizes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerProbe:
    """What the probe measured for one layer."""

    name: str
    microbatch_sizes: tuple[int, ...]
    passes: dict[Pass, PassFit]
    """``F``, ``I``, ``W`` of the layer inside a stage (its input needs a gradient)."""
    first_stage: dict[Pass, PassFit] | None
    """The same in a first stage (input without gradient); ``None`` when not probed.
    See [Note: first-stage timings]."""
    rounds: int
    peak_memory_bytes: float
    """At the largest microbatch size; see [Note: probe memory]."""
    activation_bytes_per_sample: float
    """Bytes autograd saved for the backward pass, per sample (largest size)."""
    pacing_ratio: float | None = None
    """Median over passes of achieved ``(wall / D) / (CPU x slowdown)``; ``None`` unless paced."""
    optimizer_s: float | None = None
    """The optimizer step over this layer's parameters alone (median; ``None``: not probed).
    See [Note: optimizer probe]."""

    @property
    def timing(self) -> LayerTiming:
        return _timing(self.passes)

    @property
    def first_stage_timing(self) -> LayerTiming | None:
        return None if self.first_stage is None else _timing(self.first_stage)


def _timing(passes: dict[Pass, PassFit]) -> LayerTiming:
    """The single-layer lines as measured (call overhead included; see [Note: call overhead])."""
    f, i, w, b = (passes[p] for p in PASSES)
    return LayerTiming(forward=(f.fixed_s, f.per_sample_s), input_grad=(i.fixed_s, i.per_sample_s),
                       weight_grad=(w.fixed_s, w.per_sample_s), backward=(b.fixed_s, b.per_sample_s))


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeProbe:
    """Layers ``[start, stop)`` timed as one stage (a first stage when ``start == 0``).

    Set against the same layers' single-layer probes it gives the per-call overhead of a stage
    action; see [Note: call overhead].
    """

    start: int
    stop: int
    passes: dict[Pass, PassFit]
    """``F``, ``I``, ``W``, ``B`` of the whole range, per size as for a layer."""
    rounds: int
    pacing_ratio: float | None = None
    optimizer_s: float | None = None
    """The optimizer step over the range's parameters (median; ``None``: not probed)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryProbe:
    """What a device needs beyond the plan's tensors; see [Note: fixed memory] in
    :mod:`deepcee.profiler.run`."""

    fixed_bytes: float
    fragmentation_fraction: float
    method: str
    peak_bytes: float = 0.0
    """Peak held over the fragmentation probe (resident set or CUDA reservation)."""
    live_bytes: float = 0.0
    """Peak live tensor bytes of the same work (the estimate it is held against)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeScore:
    """Achieved FLOP/s on a fixed benchmark set (geometric mean over the benchmarks)."""

    flops_per_s: float
    benchmarks: dict[str, float]
    """Benchmark name -> achieved FLOP/s (median over repeats)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProbe:
    """Everything measured on one device."""

    device: str
    """The cluster's device name."""
    torch_device: str
    kind: str
    timer: TimerName
    """``cuda-events``, ``thread-cpu`` or ``wall``; see [Note: probe timers]."""
    memory_method: str
    """:data:`MEMORY_CUDA` or :data:`MEMORY_CPU`."""
    slowdown: float
    """Emulated slowdown applied (1.0 when not emulated)."""
    dilation: float
    emulated: bool
    layers: tuple[LayerProbe, ...]
    score: ComputeScore
    wall_s: float
    """Wall time the probe took."""
    ranges: tuple[RangeProbe, ...] = ()
    """Several layers as one stage (empty when not probed); see [Note: call overhead]."""
    memory: MemoryProbe | None = None
    """The device's fixed memory overhead and allocator margin (``None``: not probed)."""

    @property
    def timings(self) -> tuple[LayerTiming, ...]:
        return tuple(layer.timing for layer in self.layers)


# -- fitting ---------------------------------------------------------------------------


def fit_line(sizes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """``(fixed_s, per_sample_s)`` minimising squared error of ``fixed + per_sample x n``, both >= 0.

    Non-negative least squares (scipy ``nnls``): a negative slope or intercept from noise
    would predict negative or shrinking times for other sizes.
    """
    if len(sizes) != len(times_s) or len(sizes) < 2:
        raise ProfileError(f"need >= 2 (size, time) points of equal count, got {len(sizes)} and {len(times_s)}")
    a = np.column_stack([np.ones(len(sizes)), np.asarray(sizes, dtype=float)])
    coef, _ = nnls(a, np.asarray(times_s, dtype=float))
    return float(coef[0]), float(coef[1])


def pass_fit(sizes: Sequence[int], samples: Sequence[Sequence[float]]) -> PassFit:
    """Medians, spreads and the fitted line of one pass; ``samples[k]``: the rounds' times at ``sizes[k]``."""
    med = [statistics.median(s) for s in samples]
    iqr = [float(np.subtract(*np.percentile(s, [75, 25]))) if len(s) > 1 else 0.0 for s in samples]
    fixed, slope = fit_line(sizes, med)
    resid = max(abs(fixed + slope * n - m) / m for n, m in zip(sizes, med, strict=True) if m > 0) if any(med) else 0.0
    return PassFit(median_s=tuple(med), iqr_s=tuple(iqr), fixed_s=fixed, per_sample_s=slope,
                   max_residual_fraction=float(resid))


# -- JSON ------------------------------------------------------------------------------


def probe_to_dict(p: DeviceProbe) -> dict[str, Any]:
    return {
        "device": p.device, "torch_device": p.torch_device, "kind": p.kind, "timer": p.timer,
        "memory_method": p.memory_method, "slowdown": p.slowdown, "dilation": p.dilation, "emulated": p.emulated,
        "wall_s": p.wall_s,
        "score": {"flops_per_s": p.score.flops_per_s, "benchmarks": dict(p.score.benchmarks)},
        "layers": [
            {"name": la.name, "microbatch_sizes": list(la.microbatch_sizes), "rounds": la.rounds,
             "peak_memory_bytes": la.peak_memory_bytes, "activation_bytes_per_sample": la.activation_bytes_per_sample,
             "pacing_ratio": la.pacing_ratio, "passes": _passes_to_dict(la.passes),
             "first_stage": None if la.first_stage is None else _passes_to_dict(la.first_stage),
             "optimizer_s": la.optimizer_s}
            for la in p.layers
        ],
        "ranges": [{"start": r.start, "stop": r.stop, "rounds": r.rounds, "pacing_ratio": r.pacing_ratio,
                    "passes": _passes_to_dict(r.passes), "optimizer_s": r.optimizer_s} for r in p.ranges],
        "memory": None if p.memory is None else {f: getattr(p.memory, f) for f in p.memory.__dataclass_fields__},
    }


def _passes_to_dict(passes: dict[Pass, PassFit]) -> dict[str, Any]:
    return {k: {"median_s": list(f.median_s), "iqr_s": list(f.iqr_s), "fixed_s": f.fixed_s,
                "per_sample_s": f.per_sample_s, "max_residual_fraction": f.max_residual_fraction}
            for k, f in passes.items()}


def _pass_fit(f: Fields, sizes: int) -> PassFit:
    fit = PassFit(median_s=f.numbers("median_s", MEASURED_TIME, max_len=sizes, min_len=sizes),
                  iqr_s=f.numbers("iqr_s", MEASURED_TIME, max_len=sizes, min_len=sizes),
                  fixed_s=f.number("fixed_s", MEASURED_TIME), per_sample_s=f.number("per_sample_s", MEASURED_TIME),
                  max_residual_fraction=f.number("max_residual_fraction", MEASURED_RATIO))
    f.done()
    return fit


def _passes_from(f: Fields | None, sizes: int) -> dict[Pass, PassFit] | None:
    if f is None:
        return None
    passes = {p: _pass_fit(f.record_of(p), sizes) for p in PASSES if f.has(p)}
    f.done()
    return passes


def _layer_probe(f: Fields) -> LayerProbe:
    sizes = f.numbers("microbatch_sizes", GLOBAL_BATCH, max_len=64, min_len=2)
    first = f.record_of("first_stage", None) if f.raw("first_stage", None) is not None else None
    probe = LayerProbe(name=f.name("name"), microbatch_sizes=sizes, rounds=f.integer("rounds", COUNT),
                       peak_memory_bytes=f.number("peak_memory_bytes", BYTES),
                       activation_bytes_per_sample=f.number("activation_bytes_per_sample", BYTES),
                       pacing_ratio=f.number("pacing_ratio", MEASURED_RATIO, None),
                       passes=_passes_from(f.record_of("passes"), len(sizes)),
                       first_stage=_passes_from(first, len(sizes)),
                       optimizer_s=f.number("optimizer_s", MEASURED_TIME, None))
    f.done()
    return probe


def _range_probe(f: Fields, sizes: int) -> RangeProbe:
    probe = RangeProbe(start=f.integer("start", LAYER_INDEX), stop=f.integer("stop", LAYER_INDEX),
                       rounds=f.integer("rounds", COUNT), pacing_ratio=f.number("pacing_ratio", MEASURED_RATIO, None),
                       passes=_passes_from(f.record_of("passes"), sizes),
                       optimizer_s=f.number("optimizer_s", MEASURED_TIME, None))
    f.done()
    return probe


def probe_from_dict(d: Any, *, file: str = "<device probe>") -> DeviceProbe:
    """A device probe record (:func:`probe_to_dict`), every field checked by the input layer."""
    f = Fields(d, file=file, error=ProfileError)
    layers = tuple(_layer_probe(x) for x in f.records("layers", max_len=MAX_LAYERS, min_len=1))
    sizes = len(layers[0].microbatch_sizes)
    score = f.record_of("score")
    benchmarks = {k: score.check(f"benchmarks.{k}", PEAK_FLOPS, v)
                  for k, v in score.mapping("benchmarks", max_len=64).items()}
    probe = DeviceProbe(device=f.name("device"), torch_device=f.name("torch_device"), kind=f.name("kind"),
                        timer=f.choice("timer", get_args(TimerName)), memory_method=f.text("memory_method"),
                        slowdown=f.number("slowdown", SLOWDOWN), dilation=f.number("dilation", MEASURED_RATIO),
                        emulated=f.flag("emulated"), layers=layers, wall_s=f.number("wall_s", DURATION),
                        ranges=tuple(_range_probe(x, sizes) for x in f.records("ranges", [], max_len=MAX_LAYERS)),
                        score=ComputeScore(flops_per_s=score.number("flops_per_s", PEAK_FLOPS), benchmarks=benchmarks),
                        memory=_memory_probe(f.record_of("memory", None) if f.raw("memory", None) else None))
    score.done()
    f.done()
    return probe


def _memory_probe(f: Fields | None) -> MemoryProbe | None:
    if f is None:
        return None
    probe = MemoryProbe(fixed_bytes=f.number("fixed_bytes", BYTES),
                        fragmentation_fraction=f.number("fragmentation_fraction", MEASURED_RATIO),
                        method=f.text("method"), peak_bytes=f.number("peak_bytes", BYTES, 0.0),
                        live_bytes=f.number("live_bytes", BYTES, 0.0))
    f.done()
    return probe


def load_probe(path: str | Path) -> DeviceProbe:
    """The device probe record a profiler rank wrote to ``path``."""
    return probe_from_dict(read_json(path, ProfileError), file=str(path))
