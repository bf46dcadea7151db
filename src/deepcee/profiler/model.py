"""From device probes to a measured model profile and measured device kinds.

- :func:`base_profile`: the layer costs (FLOPs, parameters, activation and boundary bytes)
  that measurements are attached to: the analytic profile of :func:`deepcee.models.get_model`
  for a built-in net, or, for a user's blocks, one counted from the blocks themselves
  (:func:`profile_from_blocks`: ``torch.utils.flop_counter`` around the runtime's own ``F``,
  ``I`` and ``W`` actions, so the input/weight-gradient split is the runtime's).
- :func:`measured_slowdowns`: each device's time relative to the fastest device of its kind
  (total of every layer's, pass's and size's median time).
- :func:`kind_timings`: per kind, the mean over its devices of each device's fitted
  per-layer lines divided by its slowdown; so ``slowdown x kind timing`` reproduces each
  device and measurement noise averages out over devices of a kind.
- :func:`measured_profile`: the base profile with ``measured`` timings per kind
  (:meth:`deepcee.profile.ModelProfile.with_measured`).
- :func:`measured_kind`: a :class:`deepcee.cluster.DeviceKind` whose peak is the kind's
  compute score (fastest device) and whose achievable fraction is the FLOP/s the model
  actually reached there, so FLOP-based estimates agree with the measurement.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from deepcee.cluster import DeviceKind
from deepcee.errors import ProfileError
from deepcee.models import get_model, model_names
from deepcee.profile import LayerProfile, LayerTiming, ModelProfile
from deepcee.profiler.device import PASSES, DeviceProbe, NetSource
from deepcee.runtime.stage import StageRunner

_FIELDS = {"F": "forward", "I": "input_grad", "W": "weight_grad"}


def probe_total_s(probe: DeviceProbe) -> float:
    """Sum over layers, passes and sizes of the median times (the slowdown's yardstick)."""
    return sum(sum(la.passes[p].median_s) for la in probe.layers for p in PASSES)


def measured_slowdowns(probes: Sequence[DeviceProbe]) -> dict[str, float]:
    """Device -> its total time / the fastest total of its kind (>= 1)."""
    totals = {p.device: probe_total_s(p) for p in probes}
    fastest: dict[str, float] = {}
    for p in probes:
        fastest[p.kind] = min(fastest.get(p.kind, float("inf")), totals[p.device])
    out = {}
    for p in probes:
        if fastest[p.kind] <= 0:
            raise ProfileError(f"device {p.device!r}: probe measured no time at all")
        out[p.device] = totals[p.device] / fastest[p.kind]
    return out


Line = tuple[float, float]
"""``(fixed_s, per_sample_s)``."""


def kind_lines(probes: Sequence[DeviceProbe], slowdowns: Mapping[str, float], *,
               first_stage: bool = False) -> dict[str, tuple[dict[str, Line], ...]]:
    """Kind -> per layer, pass (``F``, ``I``, ``W``, ``B``) -> line at slowdown 1: the mean of its
    devices' fitted lines, each divided by the device's slowdown.

    ``first_stage``: the layers' lines as part of a first stage (see [Note: first-stage
    timings] in :mod:`deepcee.profiler.device`); kinds whose probes lack them are left out.
    """
    by_kind: dict[str, list[DeviceProbe]] = defaultdict(list)
    for p in probes:
        by_kind[p.kind].append(p)
    out = {}
    for kind, ps in by_kind.items():
        if first_stage and any(la.first_stage is None for p in ps for la in p.layers):
            continue
        names = [la.name for la in ps[0].layers]
        if any([la.name for la in p.layers] != names for p in ps):
            raise ProfileError(f"devices of kind {kind!r} probed different layers")
        layers = []
        for i in range(len(names)):
            line = {}
            for pas in PASSES:
                fits = [(p.layers[i].first_stage if first_stage else p.layers[i].passes)[pas] for p in ps]
                scale = [1 / slowdowns[p.device] for p in ps]
                line[pas] = (statistics.fmean(f.fixed_s * c for f, c in zip(fits, scale, strict=True)),
                             statistics.fmean(f.per_sample_s * c for f, c in zip(fits, scale, strict=True)))
            layers.append(line)
        out[kind] = tuple(layers)
    return out


def kind_timings(probes: Sequence[DeviceProbe], slowdowns: Mapping[str, float], *,
                 first_stage: bool = False) -> dict[str, tuple[LayerTiming, ...]]:
    """:func:`kind_lines` as the profile's :class:`~deepcee.profile.LayerTiming` (``F``, ``I``, ``W``)."""
    return {kind: tuple(LayerTiming(**{fld: lines[p] for p, fld in _FIELDS.items()}) for lines in layers)
            for kind, layers in kind_lines(probes, slowdowns, first_stage=first_stage).items()}


def measured_profile(base: ModelProfile, probes: Sequence[DeviceProbe], *, source: str) -> ModelProfile:
    """``base`` with measured per-layer timings for every probed kind."""
    if not probes:
        raise ProfileError("no device probes to build a measured profile from")
    for p in probes:
        if len(p.layers) != base.num_layers:
            raise ProfileError(f"device {p.device!r} probed {len(p.layers)} layers, model {base.name!r} has "
                               f"{base.num_layers}")
    timings = kind_timings(probes, measured_slowdowns(probes))
    prof = base
    for kind, t in sorted(timings.items()):
        prof = prof.with_measured(kind, t, source=source)
    return prof


def measured_kind(declared: DeviceKind, probes: Sequence[DeviceProbe], profile: ModelProfile) -> DeviceKind:
    """The kind as measured: peak = fastest device's score, achievable = the model's achieved share of it."""
    own = [p for p in probes if p.kind == declared.name]
    if not own:
        return declared
    slow = measured_slowdowns(own)
    ref = min(own, key=lambda p: slow[p.device])
    peak = ref.score.flops_per_s
    timings = profile.measured[declared.name]
    n = max(ref.layers[0].microbatch_sizes)
    per_sample_s = sum(t.time_s(p, n) for t in timings for p in ("F", "I", "W")) / n
    achieved = profile.flops_per_sample() / per_sample_s if per_sample_s > 0 else peak
    fixed = [getattr(t, f)[0] for t in timings for f in _FIELDS.values()]
    how = "emulated " if ref.emulated else ""
    return DeviceKind(
        name=declared.name, peak_flops_per_s=peak, memory_bytes=declared.memory_bytes,
        achievable_fraction=min(1.0, max(achieved / peak, 1e-6)),
        per_layer_overhead_s=statistics.median(fixed),
        source=(f"measured by deepcee profile on {how}device {ref.device} ({ref.timer}): benchmark "
                f"{peak / 1e9:.3g} GFLOP/s, {profile.name} reached {achieved / 1e9:.3g} GFLOP/s at microbatch {n}; "
                f"memory as declared"),
    )


# -- profiles of a user's blocks ----------------------------------------------------------


def _flops(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(FLOPs counted while running fn, its result)``."""
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return float(counter.get_total_flops()), out


def profile_from_blocks(source: NetSource, *, samples: int = 2, dtype: torch.dtype = torch.float32) -> ModelProfile:
    """Layer costs counted on the blocks: FLOPs of the runtime's F, I and W actions
    (``FlopCounterMode``), saved-tensor bytes and output bytes, all per sample."""
    inputs, targets = source.batch(samples)
    x = inputs.to(dtype) if inputs.is_floating_point() else inputs
    layers = []
    for i, (name, block) in enumerate(zip(source.block_names, source.blocks, strict=True)):
        last = i == len(source.blocks) - 1
        runner = StageRunner([block], stage=i, is_first=i == 0, is_last=last, loss_fn=source.loss_fn, dtype=dtype)
        saved: dict[int, int] = {}
        params = {p.data_ptr() for p in runner.module.parameters()}

        def pack(t: torch.Tensor, saved=saved, params=params) -> torch.Tensor:
            if t.data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            f, out = _flops(partial(runner.forward, 0, x, targets if last else None))
        fi, _ = _flops(partial(runner.backward_input, 0, None if last else torch.ones_like(out)))
        fw, _ = _flops(partial(runner.backward_weight, 0))
        layers.append(LayerProfile(
            name=name, forward_flops=f / samples, input_grad_flops=fi / samples, weight_grad_flops=fw / samples,
            parameter_count=sum(p.numel() for p in runner.params),
            activation_bytes=sum(saved.values()) / samples,
            output_bytes=out.numel() * out.element_size() / samples,
        ))
        runner.zero_grad()
        with torch.no_grad():
            x = runner.module(x)
    nbytes = torch.empty((), dtype=dtype).element_size()
    return ModelProfile(
        name=source.name, layers=tuple(layers), input_bytes=inputs[:1].numel() * inputs.element_size(),
        dtype={4: "fp32", 8: "fp64", 2: "fp16"}.get(nbytes, str(dtype)), gradient_bytes_per_parameter=float(nbytes),
        state_bytes_per_parameter=16.0, hyper={"counted_from": "torch.utils.flop_counter on the blocks"},
        source="counted from the blocks",
    )


def base_profile(source: NetSource) -> ModelProfile:
    """The analytic profile of a built-in net, else one counted from the blocks."""
    if source.name in model_names():
        prof = get_model(source.name)
        if prof.num_layers == len(source.blocks):
            return prof
    return profile_from_blocks(source)
