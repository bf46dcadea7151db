"""Model profile data model: per-layer costs, analytic (FLOPs) or measured (seconds).

Torch-free. Every per-layer cost is *per sample* except parameters. A layer's compute time
on a device for ``n`` samples and one pass (``F`` forward, ``I`` input-gradient, ``W``
weight-gradient, ``B = I + W``) is

- analytic: ``flops_per_sample x n / (peak_flops_per_s x achievable_fraction) x slowdown
  + per_layer_overhead_s``;
- measured (when the profile holds timings for the device's kind): the layer's time at ``n``
  samples, interpolated between the times measured at several microbatch sizes (piecewise
  linear; beyond the measured sizes the fitted line's slope; schema-1 profiles hold only the
  line ``fixed_s + per_sample_s x n``), times ``slowdown``, summed over the layers, plus,
  once per call, the kind's ``measured_call_overhead`` (what one stage action costs beyond its
  layers: the autograd call, hooks, bookkeeping).

Schema 2 adds what the profiler measures beside the layers (every part optional, schema-1
files still load):

- per layer and kind the optimizer step's time (``LayerTiming.optimizer_s``; the call
  overhead's ``optimizer_s`` once per step): :meth:`ModelProfile.optimizer_step_s`;
- per kind a fixed memory overhead and the allocator's fragmentation margin
  (:class:`DeviceMemory`), which :mod:`deepcee.simulator.memory` adds to a device's peak;
- per directed device pair a transfer-time curve over message sizes from the network probe
  (:class:`LinkCurve`), which the simulator uses for pieces of that size;
- per launch mode the runtime's measured per-step bookkeeping (``step_overhead_wall_s``).

Memory of a device holding layers ``[a, b)`` with ``k`` microbatch shares of ``n`` samples in
flight: see :mod:`deepcee.simulator.memory`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from deepcee.cluster import DeviceKind
from deepcee.errors import ProfileError
from deepcee.inputs import Fields, read_json
from deepcee.inputs.fields import check_format
from deepcee.inputs.limits import (
    BYTES,
    BYTES_PER_PARAMETER,
    FLOPS,
    MAX_DEVICES,
    MAX_LAYERS,
    MAX_TEXT_CHARS,
    MEASURED_TIME,
    PARAMETERS,
)

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
Pass = Literal["F", "I", "W", "B"]
"""Forward, input gradient, weight gradient, and the fused backward (``I + W`` in one walk)."""
OptimizerName = Literal["adam", "sgd"]
"""Optimizers whose state size :mod:`deepcee.models` knows."""
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)


def _check_nonneg(owner: str, **values: float) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ProfileError(f"{owner}: {k} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerProfile:
    """Costs of one layer (a block of the model), per sample unless stated."""

    name: str
    forward_flops: float
    input_grad_flops: float
    weight_grad_flops: float
    parameter_count: int
    """Number of trainable parameters of the layer (not per sample)."""
    activation_bytes: float
    """Bytes stashed by the forward pass for the backward pass, per sample."""
    output_bytes: float
    """Bytes of the layer's output (what crosses a stage boundary after it), per sample."""

    def __post_init__(self) -> None:
        _check_nonneg(
            f"layer {self.name!r}",
            forward_flops=self.forward_flops,
            input_grad_flops=self.input_grad_flops,
            weight_grad_flops=self.weight_grad_flops,
            parameter_count=self.parameter_count,
            activation_bytes=self.activation_bytes,
            output_bytes=self.output_bytes,
        )

    def flops(self, pass_: Pass) -> float:
        if pass_ == "F":
            return self.forward_flops
        if pass_ == "I":
            return self.input_grad_flops
        if pass_ == "W":
            return self.weight_grad_flops
        return self.input_grad_flops + self.weight_grad_flops


_FIELDS: dict[str, str] = {"F": "forward", "I": "input_grad", "W": "weight_grad", "B": "backward"}


def interpolate(sizes: tuple[int, ...], times: tuple[float, ...], slope: float, samples: float) -> float:
    """Piecewise-linear through ``(sizes, times)``; beyond either end the line of ``slope``
    through the end point; never below 0."""
    if samples <= sizes[0]:
        v = times[0] + slope * (samples - sizes[0])
    elif samples >= sizes[-1]:
        v = times[-1] + slope * (samples - sizes[-1])
    else:
        k = bisect.bisect_right(sizes, samples)
        a, b = sizes[k - 1], sizes[k]
        v = times[k - 1] + (times[k] - times[k - 1]) * (samples - a) / (b - a)
    return max(0.0, v)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerTiming:
    """Measured time of one layer on one device kind, per pass.

    Each pass has a fitted line ``fixed_s + per_sample_s x n``; with ``sizes`` and ``points``
    (schema 2) the pass's time is interpolated between the times measured at those sizes
    instead, the line giving the slope beyond them (see the module docstring).
    ``backward`` is the fused backward (``B``) when it was measured: it costs less than I + W
    run separately (one autograd walk instead of two). ``first_stage`` holds the layer's
    timings when it runs in a stage that starts at layer 0, where no input gradient is needed.
    """

    forward: tuple[float, float]
    input_grad: tuple[float, float]
    weight_grad: tuple[float, float]
    backward: tuple[float, float] | None = None
    first_stage: LayerTiming | None = None
    sizes: tuple[int, ...] = ()
    """Microbatch sizes of ``points`` (increasing)."""
    points: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Pass (``F``, ``I``, ``W``, ``B``) -> its time at each of ``sizes``."""
    optimizer_s: float | None = None
    """The optimizer step over this layer's parameters (``None``: not measured)."""

    def __post_init__(self) -> None:
        if list(self.sizes) != sorted(set(self.sizes)) or any(n < 1 for n in self.sizes):
            raise ProfileError(f"timing sizes must increase from >= 1, got {list(self.sizes)}", field="sizes")
        for pas, pts in self.points.items():
            if pas not in _FIELDS or len(pts) != len(self.sizes):
                raise ProfileError(f"timing points {pas!r}: {len(pts)} times for sizes {list(self.sizes)}",
                                   field="points")
        if self.optimizer_s is not None:
            _check_nonneg("layer timing", optimizer_s=self.optimizer_s)
        for name in ("forward", "input_grad", "weight_grad", "backward"):
            line = getattr(self, name)
            if line is None and name == "backward":
                continue
            if not isinstance(line, tuple) or len(line) != 2:
                raise ProfileError(f"measured {name}: expected (fixed_s, per_sample_s), got {line!r}")
            _check_nonneg(f"measured {name}", fixed_s=line[0], per_sample_s=line[1])

    def time_s(self, pass_: Pass, samples: float) -> float:
        pts = self.points.get(pass_) if self.points else None
        if pts is None and pass_ == "B" and self.backward is None:
            return self.time_s("I", samples) + self.time_s("W", samples)
        a, b = getattr(self, _FIELDS[pass_]) or (0.0, 0.0)
        if pts is not None:
            return interpolate(self.sizes, pts, b, samples)
        return max(0.0, a + b * samples)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"forward": list(self.forward), "input_grad": list(self.input_grad),
                             "weight_grad": list(self.weight_grad)}
        if self.backward is not None:
            d["backward"] = list(self.backward)
        if self.first_stage is not None:
            d["first_stage"] = self.first_stage.to_dict()
        if self.sizes:
            d["sizes"] = list(self.sizes)
            d["points"] = {p: list(v) for p, v in self.points.items()}
        if self.optimizer_s is not None:
            d["optimizer_s"] = self.optimizer_s
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> LayerTiming:
        return LayerTiming(
            forward=tuple(d["forward"]), input_grad=tuple(d["input_grad"]), weight_grad=tuple(d["weight_grad"]),
            backward=tuple(d["backward"]) if d.get("backward") is not None else None,
            first_stage=LayerTiming.from_dict(d["first_stage"]) if d.get("first_stage") else None,
            sizes=tuple(d.get("sizes", ())), points={p: tuple(v) for p, v in d.get("points", {}).items()},
            optimizer_s=d.get("optimizer_s"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemory:
    """Memory a device of one kind needs beyond the plan's tensors (measured by the profiler)."""

    fixed_bytes: float
    """The process before any model: on CPU the resident set after importing torch, joining the
    process group, warming gloo up and stepping an optimizer once; on CUDA the memory taken after
    the context, NCCL's warm-up and the allocator's first reservation."""
    fragmentation_fraction: float = 0.0
    """The allocator's margin on the plan's tensors: peak held / peak live bytes - 1."""
    method: str = ""
    """How both were measured."""
    host_memory: bool = False
    """The device's memory is the process's host memory (a CPU device: its resident set), which
    also holds what a rank keeps on the host (deepcee's runtime builds every layer there)."""

    def __post_init__(self) -> None:
        _check_nonneg("device memory", fixed_bytes=self.fixed_bytes,
                      fragmentation_fraction=self.fragmentation_fraction)

    def to_dict(self) -> dict[str, Any]:
        return {"fixed_bytes": self.fixed_bytes, "fragmentation_fraction": self.fragmentation_fraction,
                "method": self.method, "host_memory": self.host_memory}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> DeviceMemory:
        method = d.get("method", "")
        # files written before the field: the CPU probe's method names the resident set
        return DeviceMemory(fixed_bytes=d["fixed_bytes"], fragmentation_fraction=d.get("fragmentation_fraction", 0.0),
                            method=method, host_memory=bool(d.get("host_memory", method.startswith("resident set"))))


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkCurve:
    """Serialisation time over message sizes of one directed link, from the network probe.

    ``serialisation_s[k]``: how much longer a round trip with a message of ``sizes_bytes[k]``
    took than one with the smallest message. A transfer of ``n`` bytes then takes
    ``latency + serialisation(n)``, interpolated between the sizes and beyond them at
    ``bandwidth_bytes_per_s`` (the probe's alpha-beta fit of the same samples).
    """

    sizes_bytes: tuple[int, ...]
    serialisation_s: tuple[float, ...]
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if len(self.sizes_bytes) < 2 or len(self.sizes_bytes) != len(self.serialisation_s) or \
                list(self.sizes_bytes) != sorted(set(self.sizes_bytes)):
            raise ProfileError(f"link curve needs >= 2 increasing sizes with one time each, got "
                               f"{list(self.sizes_bytes)} and {list(self.serialisation_s)}", field="links")
        if self.bandwidth_bytes_per_s <= 0:
            raise ProfileError(f"link curve bandwidth must be > 0, got {self.bandwidth_bytes_per_s!r}", field="links")

    def serialise_s(self, nbytes: float) -> float:
        return interpolate(self.sizes_bytes, self.serialisation_s, 1.0 / self.bandwidth_bytes_per_s, nbytes)

    def to_dict(self) -> dict[str, Any]:
        return {"sizes_bytes": list(self.sizes_bytes), "serialisation_s": list(self.serialisation_s),
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> LinkCurve:
        return LinkCurve(sizes_bytes=tuple(d["sizes_bytes"]), serialisation_s=tuple(d["serialisation_s"]),
                         bandwidth_bytes_per_s=d["bandwidth_bytes_per_s"])


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """A model as a sequence of layers with costs. Built by :mod:`deepcee.models` or measured."""

    name: str
    layers: tuple[LayerProfile, ...]
    input_bytes: float
    """Bytes of one input sample (what the first stage reads)."""
    dtype: str = "fp16"
    """Training dtype, a label for reports (``fp16``, ``bf16``, ``fp32``; a measured profile may
    name another torch dtype): the byte counts above and below already hold its size."""
    gradient_bytes_per_parameter: float = 2.0
    """Bytes per parameter sent by gradient synchronisation (the training dtype)."""
    state_bytes_per_parameter: float = 16.0
    """Parameter + gradient + optimizer state bytes per parameter (mixed-precision Adam: 16)."""
    optimizer: OptimizerName = "adam"
    hyper: Mapping[str, Any] = field(default_factory=dict)
    """Shape parameters (sequence length, image size, ...) for reports."""
    measured: Mapping[str, tuple[LayerTiming, ...]] = field(default_factory=dict)
    """Device kind name -> measured per-layer timings (replace the analytic estimate)."""
    measured_call_overhead: Mapping[str, LayerTiming] = field(default_factory=dict)
    """Device kind name -> the fixed cost of one stage action beyond its layers' lines, paid once
    per call whatever the number of layers (its ``first_stage`` for stages starting at layer 0;
    its ``optimizer_s`` once per optimizer step). A kind without an entry pays none (each layer
    line then carries its own share)."""
    measured_memory: Mapping[str, DeviceMemory] = field(default_factory=dict)
    """Device kind name -> its fixed memory overhead and fragmentation margin."""
    links: Mapping[str, LinkCurve] = field(default_factory=dict)
    """``"src->dst"`` device pair -> its measured transfer-time curve."""
    step_overhead_wall_s: Mapping[str, float] = field(default_factory=dict)
    """Launch mode (``emulated``, ``realnet``) -> wall seconds of the runtime's per-step bookkeeping
    per device (its step records' gather or publication), measured by the profiler."""
    source: str = "analytic"

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError(f"model {self.name!r}: needs at least one layer")
        if self.optimizer not in OPTIMIZERS:
            raise ProfileError(f"model {self.name!r}: unknown optimizer {self.optimizer!r} "
                               f"(known: {', '.join(OPTIMIZERS)})", field="optimizer")
        _check_nonneg(
            f"model {self.name!r}",
            input_bytes=self.input_bytes,
            gradient_bytes_per_parameter=self.gradient_bytes_per_parameter,
            state_bytes_per_parameter=self.state_bytes_per_parameter,
        )
        for kind, timings in self.measured.items():
            if len(timings) != len(self.layers):
                raise ProfileError(
                    f"model {self.name!r}: measured timings for kind {kind!r} cover "
                    f"{len(timings)} layers, the model has {len(self.layers)}"
                )
        for kind in self.measured_call_overhead:
            if kind not in self.measured:
                raise ProfileError(f"model {self.name!r}: call overhead for kind {kind!r} without measured timings "
                                   f"(measured kinds: {sorted(self.measured)})")
        for key in self.links:
            if "->" not in key:
                raise ProfileError(f"model {self.name!r}: link key {key!r} is not 'src->dst'", field="links")
        for mode, v in self.step_overhead_wall_s.items():
            _check_nonneg(f"model {self.name!r} step overhead of mode {mode!r}", step_overhead_wall_s=v)

    @property
    def is_measured(self) -> bool:
        """Whether any device kind has measured timings (else every time is FLOP-based)."""
        return bool(self.measured)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def parameter_count(self) -> int:
        return sum(layer.parameter_count for layer in self.layers)

    def parameters(self, start: int, stop: int) -> int:
        return sum(layer.parameter_count for layer in self.layers[start:stop])

    def gradient_bytes(self, start: int, stop: int) -> float:
        return self.parameters(start, stop) * self.gradient_bytes_per_parameter

    def state_bytes(self, start: int, stop: int) -> float:
        return self.parameters(start, stop) * self.state_bytes_per_parameter

    def activation_bytes(self, start: int, stop: int) -> float:
        """Stashed bytes per sample for layers ``[start, stop)``."""
        return sum(layer.activation_bytes for layer in self.layers[start:stop])

    def boundary_bytes(self, stop: int) -> float:
        """Bytes per sample crossing the boundary after layer ``stop - 1`` (input for stop=0)."""
        return self.input_bytes if stop == 0 else self.layers[stop - 1].output_bytes

    def flops_per_sample(self, start: int = 0, stop: int | None = None) -> float:
        """Forward + input-gradient + weight-gradient FLOPs per sample."""
        return sum(
            la.forward_flops + la.input_grad_flops + la.weight_grad_flops
            for la in self.layers[start:stop]
        )

    # -- time ----------------------------------------------------------------------------
    def time_s(
        self, start: int, stop: int, pass_: Pass, samples: float, kind: DeviceKind,
        slowdown: float = 1.0,
    ) -> float:
        """Compute time of layers ``[start, stop)`` for one pass over ``samples`` samples."""
        if samples <= 0 or stop <= start:
            return 0.0
        timings = self.measured.get(kind.name)
        if timings is not None:
            lines = list(timings[start:stop])
            call = self.measured_call_overhead.get(kind.name)
            if call is not None:
                lines.append(call)
            if start == 0:  # a first stage computes no gradient for its input
                lines = [t.first_stage or t for t in lines]
            return slowdown * sum(t.time_s(pass_, samples) for t in lines)
        flops = sum(layer.flops(pass_) for layer in self.layers[start:stop])
        passes = 2 if pass_ == "B" else 1
        return slowdown * (
            flops * samples / kind.effective_flops_per_s
            + passes * (stop - start) * kind.per_layer_overhead_s
        )

    def optimizer_step_s(self, start: int, stop: int, kind: str, slowdown: float = 1.0) -> float | None:
        """Measured optimizer step over layers ``[start, stop)`` on ``kind`` (the layers' times plus
        the call overhead's, times ``slowdown``); ``None`` when ``kind`` has no measured step."""
        timings = self.measured.get(kind)
        if timings is None or stop <= start or any(t.optimizer_s is None for t in timings[start:stop]):
            return None
        call = self.measured_call_overhead.get(kind)
        fixed = call.optimizer_s if call is not None and call.optimizer_s is not None else 0.0
        return slowdown * (fixed + sum(t.optimizer_s for t in timings[start:stop]))

    def memory_overhead(self, kind: str | None = None) -> DeviceMemory | None:
        """``kind``'s measured :class:`DeviceMemory`; for ``None`` the largest of any kind's (a
        caller that does not know the kind must not under-count); ``None`` when not measured."""
        if kind is not None:
            return self.measured_memory.get(kind)
        return max(self.measured_memory.values(), key=lambda m: (m.fixed_bytes, m.fragmentation_fraction),
                   default=None)

    def link_curve(self, src: str, dst: str) -> LinkCurve | None:
        return self.links.get(f"{src}->{dst}") if self.links else None

    # -- JSON ----------------------------------------------------------------------------
    def with_measured(self, kind: str, timings: tuple[LayerTiming, ...], source: str,
                      call_overhead: LayerTiming | None = None) -> ModelProfile:
        """This profile with ``kind``'s measured timings (and call overhead) set or replaced."""
        measured = dict(self.measured)
        measured[kind] = timings
        overhead = {k: v for k, v in self.measured_call_overhead.items() if k != kind}
        if call_overhead is not None:
            overhead[kind] = call_overhead
        return replace(self, hyper=dict(self.hyper), measured=measured, measured_call_overhead=overhead,
                       source=source)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "format": "deepcee.profile",
            "name": self.name,
            "source": self.source,
            "dtype": self.dtype,
            "input_bytes": self.input_bytes,
            "gradient_bytes_per_parameter": self.gradient_bytes_per_parameter,
            "state_bytes_per_parameter": self.state_bytes_per_parameter,
            "optimizer": self.optimizer,
            "hyper": dict(self.hyper),
            "layers": [
                {
                    "name": la.name,
                    "forward_flops": la.forward_flops,
                    "input_grad_flops": la.input_grad_flops,
                    "weight_grad_flops": la.weight_grad_flops,
                    "parameter_count": la.parameter_count,
                    "activation_bytes": la.activation_bytes,
                    "output_bytes": la.output_bytes,
                }
                for la in self.layers
            ],
            "measured": {kind: [t.to_dict() for t in timings] for kind, timings in self.measured.items()},
            **({"measured_call_overhead": {kind: t.to_dict() for kind, t in self.measured_call_overhead.items()}}
               if self.measured_call_overhead else {}),
            **({"measured_memory": {kind: m.to_dict() for kind, m in self.measured_memory.items()}}
               if self.measured_memory else {}),
            **({"links": {k: c.to_dict() for k, c in self.links.items()}} if self.links else {}),
            **({"step_overhead_wall_s": dict(self.step_overhead_wall_s)} if self.step_overhead_wall_s else {}),
        }


def profile_from_dict(d: Any, *, file: str = "<profile.json>") -> ModelProfile:
    """A profile from its ``deepcee.profile`` JSON form (:meth:`ModelProfile.to_dict`): every
    field checked by the input layer (:mod:`deepcee.inputs`), errors name file, field and value."""
    f = Fields(d, file=file, error=ProfileError)
    check_format(f, "deepcee.profile", READABLE_SCHEMAS)
    layers = tuple(_layer(x) for x in f.records("layers", max_len=MAX_LAYERS, min_len=1))
    measured = {kind: tuple(_timing(Fields(t, f"measured.{kind}[{i}]", file=file, error=ProfileError))
                            for i, t in enumerate(_rows(f, kind, rows, len(layers))))
                for kind, rows in f.mapping("measured", {}, max_len=MAX_DEVICES).items()}
    overhead = {kind: _timing(Fields(t, f"measured_call_overhead.{kind}", file=file, error=ProfileError))
                for kind, t in f.mapping("measured_call_overhead", {}, max_len=MAX_DEVICES).items()}
    values = dict(
        name=f.name("name"), source=f.text("source", file), dtype=f.name("dtype", "fp16"),
        input_bytes=f.number("input_bytes", BYTES),
        gradient_bytes_per_parameter=f.number("gradient_bytes_per_parameter", BYTES_PER_PARAMETER),
        state_bytes_per_parameter=f.number("state_bytes_per_parameter", BYTES_PER_PARAMETER),
        optimizer=f.choice("optimizer", OPTIMIZERS, "adam"), hyper=_hyper(f), layers=layers, measured=measured,
        measured_call_overhead=overhead, measured_memory=_schema2(f, "measured_memory", DeviceMemory.from_dict),
        links=_schema2(f, "links", LinkCurve.from_dict), step_overhead_wall_s=_schema2(f, "step_overhead_wall_s", float),
    )
    f.done()
    try:
        return ModelProfile(**values)
    except ProfileError as exc:
        raise ProfileError(str(exc), file=file) from None


def _layer(f: Fields) -> LayerProfile:
    layer = LayerProfile(name=f.name("name"), forward_flops=f.number("forward_flops", FLOPS),
                         input_grad_flops=f.number("input_grad_flops", FLOPS),
                         weight_grad_flops=f.number("weight_grad_flops", FLOPS),
                         parameter_count=f.integer("parameter_count", PARAMETERS),
                         activation_bytes=f.number("activation_bytes", BYTES),
                         output_bytes=f.number("output_bytes", BYTES))
    f.done()
    return layer


def _rows(f: Fields, kind: str, rows: Any, num_layers: int) -> list[Any]:
    if not isinstance(rows, list) or len(rows) != num_layers:
        got = f"{len(rows)} entries" if isinstance(rows, list) else repr(rows)[:40]
        raise f.err(f"measured.{kind}", f"needs one timing per layer ({num_layers}), got {got}")
    return rows


def _timing(f: Fields, *, nested: bool = False) -> LayerTiming:
    """One layer's measured lines: ``[fixed_s, per_sample_s]`` per pass, never negative."""
    def line(key: str, default: Any = ...) -> Any:
        if default is not ... and f.raw(key, None) is None:
            return default
        return f.numbers(key, MEASURED_TIME, max_len=2, min_len=2)

    first = None if nested else f.record_of("first_stage", None) if f.raw("first_stage", None) is not None else None
    points: dict[str, tuple[float, ...]] = {}
    if f.raw("points", None) is not None:  # schema 2: each pass's time at every probed size
        pf = f.record_of("points")
        points = {p: pf.numbers(p, MEASURED_TIME, max_len=MAX_LAYERS) for p in _FIELDS if pf.has(p)}
        pf.done()
    sizes = f.raw("sizes", ())
    if not isinstance(sizes, list | tuple) or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        raise f.err("sizes", f"expected a list of whole microbatch sizes, got {str(sizes)[:40]!r}")
    timing = LayerTiming(forward=line("forward"), input_grad=line("input_grad"), weight_grad=line("weight_grad"),
                         backward=line("backward", None),
                         first_stage=None if first is None else _timing(first, nested=True),
                         sizes=tuple(sizes), points=points,
                         optimizer_s=f.number("optimizer_s", MEASURED_TIME, None))
    f.done()
    return timing


def _schema2(f: Fields, key: str, build: Any) -> dict[str, Any]:
    """A schema-2 table (``measured_memory``, ``links``, ``step_overhead_wall_s``): each entry
    through ``build``; a bad entry is a one-line error naming its field."""
    table = f.raw(key, {})
    if not isinstance(table, dict):
        raise f.err(key, f"expected an object (a table of keys), got {str(table)[:40]!r}")
    out = {}
    for name, entry in table.items():
        try:
            out[str(name)] = build(entry)
        except (KeyError, TypeError, ValueError, AttributeError, ProfileError) as exc:
            raise f.err(f"{key}.{name}", f"bad entry ({exc}): {str(entry)[:60]!r}") from None
    return out


def _hyper(f: Fields) -> dict[str, Any]:
    """Shape parameters for reports: names to scalars (strings, numbers, true/false, null)."""
    hyper = f.mapping("hyper", {}, max_len=256)
    for key, v in hyper.items():
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise f.err(f"hyper.{key}", f"expected a string, number, true/false or null, got {str(v)[:40]!r}")
        if isinstance(v, str) and len(v) > MAX_TEXT_CHARS:
            raise f.err(f"hyper.{key}", f"at most {MAX_TEXT_CHARS:,} characters, got {len(v):,}")
    return dict(hyper)


def load_profile(path: str | Path) -> ModelProfile:
    """The profile in the JSON file at ``path``; see :func:`profile_from_dict`."""
    return profile_from_dict(read_json(path, ProfileError), file=str(path))


from deepcee._callable import make_callable  # noqa: E402  [Note: callable modules]

make_callable(__name__)
