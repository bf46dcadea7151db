"""From device probes to a measured model profile and measured device kinds.

- :func:`base_profile`: the layer costs (FLOPs, parameters, activation and boundary bytes)
  that measurements are attached to: the analytic profile of :func:`deepcee.models.get_model`
  for a built-in net, or, for a user's blocks, one counted from the blocks themselves
  (:func:`profile_from_blocks`: ``torch.utils.flop_counter`` around the runtime's own ``F``,
  ``I`` and ``W`` actions, so the input/weight-gradient split is the runtime's).
- :func:`measured_slowdowns`: each device's time relative to the fastest device of its kind
  (total of every layer's, pass's and size's median time).
- :func:`kind_lines`: per kind, the mean over its devices of each device's fitted
  per-layer lines divided by its slowdown; so ``slowdown x kind line`` reproduces each
  device and measurement noise averages out over devices of a kind.
- :func:`first_stage_rows`: what a layer costs as part of a first stage (see [Note: first-stage
  composition]).
- :func:`call_overheads`: the per-call cost of a stage action, from the range probes (see
  [Note: call overhead] in :mod:`deepcee.profiler.layer_probe`).
- :func:`kind_timings`: per kind, the profile's per-layer
  :class:`~deepcee.profile.LayerTiming` objects (``F``, ``I``, ``W``, fused ``B`` inside a stage,
  and ``first_stage``) with the call overhead taken out, and the call overhead itself.
- :func:`measured_profile`: the base profile with ``measured`` timings and
  ``measured_call_overhead`` per kind (:meth:`deepcee.profile.ModelProfile.with_measured`).
- :func:`measured_kind`: a :class:`deepcee.cluster.DeviceKind` whose peak is the kind's
  compute score (fastest device) and whose achievable fraction is the FLOP/s the model
  actually reached there, so FLOP-based estimates agree with the measurement.

[Note: first-stage composition]
A stage that starts at layer 0 wants no input gradient, but a layer above one with parameters
still has to pass a gradient down to it. So layer ``l`` of a first stage costs its own
first-stage figures (probed with an input without gradient) only while no layer before it has
parameters; after that it costs its inner ``F``, its fused inner ``B`` as ``W`` and as ``B``
(a first stage's ``W`` is one plain backward through all its layers,
:meth:`deepcee.runtime.stage.StageRunner.backward_weight`), and its first-stage ``I`` (a
first stage's ``I`` only walks the graph). Summing first-stage figures instead leaves out the
input gradients: gpt-tiny on one CPU core, 4 samples, layers [0, 6) as one stage: ``W``
11.7 ms measured, 10.5 ms summed from first-stage figures, 12.5 ms from this composition
(the rest is call overhead counted once per layer, which :func:`call_overheads` removes).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from deepcee.cluster import DeviceKind
from deepcee.errors import DeepceeError, ProfileError
from deepcee.models import get_model, model_names
from deepcee.profile import DeviceMemory, LayerProfile, LayerTiming, LinkCurve, ModelProfile
from deepcee.profiler.device import NetSource
from deepcee.profiler.memory_probe import CPU_METHOD
from deepcee.profiler.network import LinkFit
from deepcee.profiler.probes import PASSES, DeviceProbe
from deepcee.runtime import boundary
from deepcee.runtime.stage import StageRunner

_FIELDS = {"F": "forward", "I": "input_grad", "W": "weight_grad", "B": "backward"}
Line = tuple[float, float]
"""``(fixed_s, per_sample_s)``."""
Overhead = dict[str, float]
"""Pass -> seconds per call."""
T = TypeVar("T")


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


def _by_kind(probes: Sequence[DeviceProbe]) -> dict[str, list[DeviceProbe]]:
    out: dict[str, list[DeviceProbe]] = defaultdict(list)
    for p in probes:
        out[p.kind].append(p)
    for kind, ps in out.items():
        names = [la.name for la in ps[0].layers]
        if any([la.name for la in p.layers] != names for p in ps):
            raise ProfileError(f"devices of kind {kind!r} probed different layers")
    return out


def kind_lines(probes: Sequence[DeviceProbe], slowdowns: Mapping[str, float], *,
               first_stage: bool = False) -> dict[str, tuple[dict[str, Line], ...]]:
    """Kind -> per layer, pass (``F``, ``I``, ``W``, ``B``) -> single-layer line at slowdown 1: the
    mean of its devices' fitted lines, each divided by the device's slowdown.

    ``first_stage``: the layers' lines probed as a first stage (see [Note: first-stage
    timings] in :mod:`deepcee.profiler.layer_probe`); kinds whose probes lack them are left out.
    """
    out = {}
    for kind, ps in _by_kind(probes).items():
        if first_stage and any(la.first_stage is None for p in ps for la in p.layers):
            continue
        layers = []
        for i in range(len(ps[0].layers)):
            line = {}
            for pas in PASSES:
                fits = [(p.layers[i].first_stage if first_stage else p.layers[i].passes)[pas] for p in ps]
                scale = [1 / slowdowns[p.device] for p in ps]
                line[pas] = (statistics.fmean(f.fixed_s * c for f, c in zip(fits, scale, strict=True)),
                             statistics.fmean(f.per_sample_s * c for f, c in zip(fits, scale, strict=True)))
            layers.append(line)
        out[kind] = tuple(layers)
    return out


def kind_points(probes: Sequence[DeviceProbe], slowdowns: Mapping[str, float], *,
                first_stage: bool = False) -> dict[str, tuple[dict[str, tuple[float, ...]], ...]]:
    """Kind -> per layer, pass -> the single-layer median time at every probed size at
    slowdown 1 (the mean over the kind's devices of each device's medians / its slowdown);
    ``first_stage`` as for :func:`kind_lines`."""
    out = {}
    for kind, ps in _by_kind(probes).items():
        if first_stage and any(la.first_stage is None for p in ps for la in p.layers):
            continue
        layers = []
        for i in range(len(ps[0].layers)):
            fits = {pas: [((p.layers[i].first_stage if first_stage else p.layers[i].passes)[pas], slowdowns[p.device])
                          for p in ps] for pas in PASSES}
            layers.append({pas: tuple(float(np.mean([f.median_s[k] / sd for f, sd in fs]))
                                      for k in range(len(fs[0][0].median_s))) for pas, fs in fits.items()})
        out[kind] = tuple(layers)
    return out


def optimizer_times(probes: Sequence[DeviceProbe], slowdowns: Mapping[str, float]
                    ) -> dict[str, tuple[tuple[float, ...], float]]:
    """Kind -> ``(per layer, per call)``: the optimizer step's time at slowdown 1 (see [Note:
    optimizer probe] in :mod:`deepcee.profiler.layer_probe`): each layer's own step less the
    per-call cost, which the ranges give as for the passes (``(sum of the k layers' steps -
    the range's) / (k - 1)``, clamped to ``[0, the smallest layer's step]``). Kinds whose
    probes lack the optimizer are left out."""
    out = {}
    for kind, ps in _by_kind(probes).items():
        if any(la.optimizer_s is None for p in ps for la in p.layers):
            continue
        layers = [statistics.fmean(p.layers[i].optimizer_s / slowdowns[p.device] for p in ps)
                  for i in range(len(ps[0].layers))]
        calls = [(sum(p.layers[i].optimizer_s for i in range(r.start, r.stop)) - r.optimizer_s)
                 / (r.stop - r.start - 1) / slowdowns[p.device]
                 for p in ps for r in p.ranges if r.optimizer_s is not None and r.stop - r.start >= 2]
        with_params = [t for t in layers if t > 0]
        call = min(max(0.0, statistics.fmean(calls)), min(with_params)) if calls and with_params else 0.0
        out[kind] = (tuple(max(0.0, t - call) if t > 0 else 0.0 for t in layers), call)
    return out


def first_stage_rows(inner: Sequence[Mapping[str, T]], first: Sequence[Mapping[str, T] | None],
                        parameter_counts: Sequence[int]) -> list[dict[str, T] | None]:
    """Per layer, its per-pass figures as part of a first stage ([Note: first-stage composition]);
    ``None`` where the layer's first-stage figures were not probed."""
    out: list[dict[str, T] | None] = []
    gradient_below = False
    for own, fst, params in zip(inner, first, parameter_counts, strict=True):
        if fst is None:
            out.append(None)
        elif gradient_below:
            out.append({"F": own["F"], "I": fst["I"], "W": own["B"], "B": own["B"]})
        else:
            out.append(dict(fst))
        gradient_below = gradient_below or params > 0
    return out


def _range_overhead(probe: DeviceProbe, start: int, stop: int, range_medians: Mapping[str, Sequence[float]],
                    parameter_counts: Sequence[int]) -> Overhead | None:
    """Per pass, ``(sum of the single-layer figures - the range's) / (k - 1)`` averaged over sizes."""
    if start == 0:
        rows = first_stage_rows([la.passes for la in probe.layers], [la.first_stage for la in probe.layers],
                                parameter_counts)[start:stop]
    else:
        rows = [la.passes for la in probe.layers[start:stop]]
    if any(r is None for r in rows):
        return None
    out = {}
    for p in PASSES:
        summed = np.sum([r[p].median_s for r in rows], axis=0)
        out[p] = float(np.mean(summed - np.asarray(range_medians[p]))) / (stop - start - 1)
    return out


def call_overheads(probes: Sequence[DeviceProbe], slowdowns: Mapping[str, float],
                   parameter_counts: Sequence[int]) -> dict[str, tuple[Overhead, Overhead]]:
    """Kind -> ``(inside a stage, first stage)``: pass -> the per-call cost of a stage action at
    slowdown 1, the mean over the kind's devices (see [Note: call overhead] in
    :mod:`deepcee.profiler.layer_probe`). Raw estimates: noise can make one negative. An empty
    mapping where no device of the kind probed that range."""
    out = {}
    for kind, ps in _by_kind(probes).items():
        found: tuple[list[Overhead], list[Overhead]] = ([], [])
        for p in ps:
            for r in p.ranges:
                if r.stop - r.start < 2:
                    continue
                c = _range_overhead(p, r.start, r.stop, {k: f.median_s for k, f in r.passes.items()},
                                    parameter_counts)
                if c is not None:
                    found[r.start == 0].append({k: v / slowdowns[p.device] for k, v in c.items()})
        out[kind] = tuple({k: statistics.fmean(c[k] for c in cs) for k in PASSES} if cs else {} for cs in found)
    return out


def _bounded(overhead: Overhead, rows: Sequence[Mapping[str, Line] | None]) -> Overhead:
    """``overhead`` clamped to ``[0, the smallest fixed_s it is taken out of]`` per pass, so no layer
    line is left with a negative fixed cost."""
    rows = [r for r in rows if r is not None]
    return {p: min([max(0.0, overhead.get(p, 0.0)), *(r[p][0] for r in rows)]) for p in PASSES}


def _less(row: Mapping[str, Line], overhead: Overhead, points: Mapping[str, Sequence[float]] | None = None,
          sizes: Sequence[int] = (), optimizer_s: float | None = None) -> LayerTiming:
    """The layer's lines and points less the per-call ``overhead``; points made non-decreasing in
    size (a longer microbatch never takes less time; noise can say otherwise)."""
    kw = {fld: (max(0.0, row[p][0] - overhead[p]), row[p][1]) for p, fld in _FIELDS.items()}
    pts = {}
    for p in points or {}:
        pts[p] = tuple(np.maximum.accumulate([max(0.0, t - overhead[p]) for t in points[p]]).tolist())
    return LayerTiming(**kw, sizes=tuple(sizes) if pts else (), points=pts, optimizer_s=optimizer_s)


def _constant(overhead: Overhead) -> LayerTiming:
    return LayerTiming(**{fld: (overhead[p], 0.0) for p, fld in _FIELDS.items()})


def kind_timings(probes: Sequence[DeviceProbe], slowdowns: Mapping[str, float],
                 parameter_counts: Sequence[int]) -> dict[str, tuple[tuple[LayerTiming, ...], LayerTiming | None]]:
    """Kind -> ``(per-layer timings, call overhead)`` for the profile.

    Per layer: the inner ``F``/``I``/``W``/``B`` lines and, as ``first_stage``, the composed
    first-stage lines ([Note: first-stage composition]), each less the kind's call overhead
    (clamped by :func:`_bounded`); the overhead is returned apart, to be paid once per stage
    action (:attr:`deepcee.profile.ModelProfile.measured_call_overhead`). ``None`` when no
    range was probed: the layer lines then keep the whole single-layer figures.
    """
    inner, first = kind_lines(probes, slowdowns), kind_lines(probes, slowdowns, first_stage=True)
    inner_pts, first_pts = kind_points(probes, slowdowns), kind_points(probes, slowdowns, first_stage=True)
    overheads = call_overheads(probes, slowdowns, parameter_counts)
    steps = optimizer_times(probes, slowdowns)
    sizes = probes[0].layers[0].microbatch_sizes
    out = {}
    for kind, rows in inner.items():
        firsts = first_stage_rows(rows, first.get(kind, (None,) * len(rows)), parameter_counts)
        pts = inner_pts[kind]
        first_pts_rows = first_stage_rows(pts, first_pts.get(kind, (None,) * len(rows)), parameter_counts)
        c_inner, c_first = overheads.get(kind, ({}, {}))
        c_in, c_fs = _bounded(c_inner, rows[1:]), _bounded(c_first, firsts)
        opt, opt_call = steps.get(kind, ((None,) * len(rows), None))
        timings = []
        for row, fst, pt, fpt, o in zip(rows, firsts, pts, first_pts_rows, opt, strict=True):
            t = _less(row, c_in, pt, sizes, optimizer_s=o)
            timings.append(replace(t, first_stage=None if fst is None else _less(fst, c_fs, fpt, sizes)))
        call = None
        if c_inner or c_first or opt_call is not None:
            call = replace(_constant(c_in), first_stage=_constant(c_fs), optimizer_s=opt_call)
        out[kind] = (tuple(timings), call)
    return out


def kind_memory(probes: Sequence[DeviceProbe]) -> dict[str, DeviceMemory]:
    """Kind -> its devices' largest fixed overhead and fragmentation margin (never under any of them)."""
    out = {}
    for kind, ps in _by_kind(probes).items():
        mems = [p.memory for p in ps if p.memory is not None]
        if mems:
            out[kind] = DeviceMemory(fixed_bytes=max(m.fixed_bytes for m in mems),
                                     fragmentation_fraction=max(m.fragmentation_fraction for m in mems),
                                     method=f"{mems[0].method}; the largest over {len(mems)} device(s)",
                                     host_memory=any(m.method == CPU_METHOD for m in mems))
    return out


def link_curves(fits: Sequence[LinkFit]) -> dict[str, LinkCurve]:
    """``"src->dst"`` -> the pair's transfer curve: each probed size's median round trip less the
    smallest size's (made non-decreasing in size), at the fit's bandwidth beyond them. Pairs
    whose bandwidth the probe could not resolve (loopback) and inferred pairs get none."""
    out = {}
    for f in fits:
        if not f.bandwidth_resolved or f.inferred_from or len(f.sizes_bytes) < 2:
            continue
        base = f.median_round_trip_s[0]
        ser = np.maximum.accumulate([max(0.0, t - base) for t in f.median_round_trip_s]).tolist()
        out[f"{f.src}->{f.dst}"] = LinkCurve(sizes_bytes=tuple(f.sizes_bytes), serialisation_s=tuple(ser),
                                             bandwidth_bytes_per_s=f.bandwidth_bytes_per_s)
    return out


def measured_profile(base: ModelProfile, probes: Sequence[DeviceProbe], *, source: str,
                     fits: Sequence[LinkFit] = (), step_overhead_wall_s: Mapping[str, float] | None = None
                     ) -> ModelProfile:
    """``base`` with measured per-layer timings (lines, per-size points, optimizer steps), call
    overheads and memory for every probed kind; the links' transfer curves from ``fits``; the
    runtime's per-step bookkeeping per launch mode."""
    if not probes:
        raise ProfileError("no device probes to build a measured profile from")
    for p in probes:
        if len(p.layers) != base.num_layers:
            raise ProfileError(f"device {p.device!r} probed {len(p.layers)} layers, model {base.name!r} has "
                               f"{base.num_layers}")
    params = [la.parameter_count for la in base.layers]
    prof = base
    for kind, (timings, call) in sorted(kind_timings(probes, measured_slowdowns(probes), params).items()):
        prof = prof.with_measured(kind, timings, source=source, call_overhead=call)
    return replace(prof, measured_memory=kind_memory(probes), links=link_curves(fits),
                   step_overhead_wall_s=dict(step_overhead_wall_s or {}))


def measured_kind(declared: DeviceKind, probes: Sequence[DeviceProbe], profile: ModelProfile) -> DeviceKind:
    """The kind as measured: peak = fastest device's score, achievable = the model's achieved share of it.

    The yardstick is every layer run as its own stage (its line plus one call overhead), the
    same per-layer figures the FLOP-based estimate sums (``per_layer_overhead_s`` per layer).
    """
    own = [p for p in probes if p.kind == declared.name]
    if not own:
        return declared
    slow = measured_slowdowns(own)
    ref = min(own, key=lambda p: slow[p.device])
    peak = ref.score.flops_per_s
    timings = profile.measured[declared.name]
    call = profile.measured_call_overhead.get(declared.name, LayerTiming(forward=(0.0, 0.0), input_grad=(0.0, 0.0),
                                                                          weight_grad=(0.0, 0.0)))
    n = max(ref.layers[0].microbatch_sizes)
    per_sample_s = sum(t.time_s(p, n) + call.time_s(p, n) for t in timings for p in ("F", "I", "W")) / n
    achieved = profile.flops_per_sample() / per_sample_s if per_sample_s > 0 else peak
    fixed = [getattr(t, f)[0] + getattr(call, f)[0] for t in timings for f in ("forward", "input_grad", "weight_grad")]
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
    (``FlopCounterMode``), saved-tensor bytes and output bytes (every tensor crossing the
    boundary after the block), all per sample. Inputs and outputs may be structures of tensors
    (:mod:`deepcee.runtime.boundary`); a block's outputs get gradients as in a pipeline."""
    inputs, targets = source.batch(samples)
    x, mask = boundary.to_device(inputs, "cpu", dtype), None
    layers = []
    for i, (name, block) in enumerate(zip(source.block_names, source.blocks, strict=True)):
        last = i == len(source.blocks) - 1
        runner = StageRunner([block], stage=i, is_first=i == 0, is_last=last, loss_fn=source.loss_fn, dtype=dtype)
        runner.input_grads = mask
        saved: dict[int, int] = {}
        params = {p.data_ptr() for p in runner.module.parameters()}

        def pack(t: torch.Tensor, saved=saved, params=params) -> torch.Tensor:
            if t.data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        try:  # the user's block (and loss) on the data's samples: a failure is their input's
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                f, out = _flops(partial(runner.forward, 0, x, targets if last else None))
            mask = None if last else runner.output_grad_mask(0)
            grad = None if last else boundary.grads_for(out, mask, torch.ones_like)
            fi, _ = _flops(partial(runner.backward_input, 0, grad))
            fw, _ = _flops(partial(runner.backward_weight, 0))
        except DeepceeError:
            raise
        except Exception as exc:
            what = "and the loss " if last else ""
            raise ProfileError(f"block {i} ({name!r}) {what}cannot run on {samples} samples of the data "
                               f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})", field="model") from exc
        layers.append(LayerProfile(
            name=name, forward_flops=f / samples, input_grad_flops=fi / samples, weight_grad_flops=fw / samples,
            parameter_count=sum(p.numel() for p in runner.params),
            activation_bytes=sum(saved.values()) / samples,
            output_bytes=sum(t.numel() * t.element_size() for t in boundary.tensors(out)) / samples,
        ))
        runner.zero_grad()
        x = out
    nbytes = torch.empty((), dtype=dtype).element_size()
    first = boundary.take(inputs, 0, 1)
    return ModelProfile(
        name=source.name, layers=tuple(layers),
        input_bytes=sum(t.numel() * t.element_size() for t in boundary.tensors(first)),
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
