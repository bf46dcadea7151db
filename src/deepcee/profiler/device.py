"""Device probe: per-layer forward / input-gradient / weight-gradient times on the local device.

What is timed is what runs: every layer (block) of the net is wrapped in the runtime's own
:class:`deepcee.runtime.stage.StageRunner` and driven through its ``F``
(:meth:`~deepcee.runtime.stage.StageRunner.forward`), ``I``
(:meth:`~deepcee.runtime.stage.StageRunner.backward_input`) and ``W``
(:meth:`~deepcee.runtime.stage.StageRunner.backward_weight`) actions, so the split-backward
graph analysis the runtime pays in ``I`` is in the figures.

Each round runs two microbatches per size: ``F``, ``I``, ``W`` (the split backward of the
zero-bubble schedules) and ``F``, ``B`` (the fused backward,
:meth:`~deepcee.runtime.stage.StageRunner.backward`, that GPipe and 1F1B run; cheaper than
``I + W``, which walks the graph and calls autograd once per weight group). ``warmup``
rounds, then ``repeats`` rounds; every round runs every layer (and every range of [Note: call
overhead]) at every microbatch size (default 1, 2, 4, 8), interleaved, so slow drift of the
host moves all figures alike instead of bending one fit or one difference; the figure per
size is the median over rounds. A line ``fixed_s + per_sample_s x n`` is fitted per pass by
non-negative least squares (:func:`fit_line`); :mod:`deepcee.profiler.model` turns the lines
into the profile's :class:`deepcee.profile.LayerTiming` objects.

[Note: probe timers]
- **CUDA**: CUDA events around each pass (``elapsed_time``), the device's own clock, so host
  jitter does not enter; passes are synchronised once per round.
- **CPU**: ``time.thread_time`` (CPU time of the calling thread). Torch runs single-threaded
  here as in the runtime's workers (:func:`deepcee.runtime.dist.single_thread`), so the
  thread's CPU time is the whole computation. On shared cores it is the stable figure: a
  process that waits for a core accumulates wall time but not CPU time (PLATFORM.md). It is
  also exactly what the emulation paces on: an emulated device pads each action's wall time
  to ``CPU time x slowdown x D`` and reports wall time / ``D``, so the figure an emulated
  device delivers is ``CPU time x slowdown``. That product is what the probe records for an
  emulated device; the probe runs its passes through the same
  :class:`deepcee.runtime.emulation.DevicePacer` and also records the achieved
  ``(wall / D) / (CPU time x slowdown)`` (``pacing_ratio``: 1.0 when the host keeps up, above
  1 when the cores are over-committed and the emulation runs slower than stated).
  ``cpu_timer="wall"`` uses ``time.perf_counter`` instead (a dedicated multi-threaded CPU).

[Note: probe memory]
- CUDA: ``torch.cuda.max_memory_allocated`` over one F/I/W of the largest microbatch, minus
  what was allocated before it, plus the layer's parameter bytes (resident throughout).
- CPU: torch has no allocator statistics on CPU, so it is an *estimate from tensor sizes*:
  parameters + gradients + the tensors autograd saves for the backward pass (counted with
  ``saved_tensors_hooks``, each storage once, parameters excluded) + the output and its
  gradient. The saved bytes per sample are also reported (``activation_bytes_per_sample``),
  to compare with the analytic profile's ``activation_bytes``.

[Note: first-stage timings]
A stage whose input needs no gradient (the first stage: its input is the data) skips the
input-gradient computation: its ``I`` only walks the graph, and its ``W`` is one backward for
all its parameters, cheaper than the ``I`` + ``W`` of the same layers inside a later stage
(gpt-tiny on one CPU core: 1.4-2x). With ``first_stage`` (default) the probe also times
every layer run as a first stage (``StageRunner(is_first=True)``, including layers without
parameters, whose first-stage backward is empty); ``probes.json`` keeps both sets and
:func:`deepcee.profiler.model.first_stage_rows` composes the profile's ``first_stage`` timings.

[Note: call overhead]
A stage action pays some costs once per call, whatever the number of layers: the Python of the
action, one ``autograd.grad``/``backward`` call with its engine start-up, hook registration. A
single-layer probe includes them, so summing layers counts them once per layer. With
``stage_ranges`` (default) the probe also times layers ``[1, L)`` (inside a stage) and
``[0, L)`` (a first stage) each as one stage, interleaved with the single layers;
:func:`deepcee.profiler.model.call_overheads` takes the per-call cost from the difference:
``(sum of the k single-layer times - the range's time) / (k - 1)``.

A compute score per device (:func:`compute_score`) times a fixed benchmark set (three
square matmuls and a 3x3 convolution, sizes per device type) through the same timer, so
unlike devices can be ranked before a model is chosen.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from scipy.optimize import nnls
from torch import nn

from deepcee.errors import ProfileError, SpecError
from deepcee.profile import LayerTiming
from deepcee.runtime.emulation import DevicePacer
from deepcee.runtime.stage import StageRunner

log = logging.getLogger(__name__)

CpuTimer = Literal["thread", "wall"]
PASSES: tuple[str, ...] = ("F", "I", "W", "B")
"""Forward, input gradient, weight gradient (split backward), and the fused backward ``B``."""
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
    passes: dict[str, PassFit]
    """``F``, ``I``, ``W`` of the layer inside a stage (its input needs a gradient)."""
    first_stage: dict[str, PassFit] | None
    """The same in a first stage (input without gradient); ``None`` when not probed.
    See [Note: first-stage timings]."""
    rounds: int
    peak_memory_bytes: float
    """At the largest microbatch size; see [Note: probe memory]."""
    activation_bytes_per_sample: float
    """Bytes autograd saved for the backward pass, per sample (largest size)."""
    pacing_ratio: float | None = None
    """Median over passes of achieved ``(wall / D) / (CPU x slowdown)``; ``None`` unless paced."""

    @property
    def timing(self) -> LayerTiming:
        return _timing(self.passes)

    @property
    def first_stage_timing(self) -> LayerTiming | None:
        return None if self.first_stage is None else _timing(self.first_stage)


def _timing(passes: dict[str, PassFit]) -> LayerTiming:
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
    passes: dict[str, PassFit]
    """``F``, ``I``, ``W``, ``B`` of the whole range, per size as for a layer."""
    rounds: int
    pacing_ratio: float | None = None


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
    timer: str
    """``cuda-events``, ``thread-cpu`` or ``wall``; see [Note: probe timers]."""
    memory_method: str
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


def _pass_fit(sizes: Sequence[int], samples: Sequence[Sequence[float]]) -> PassFit:
    """``samples[k]``: the rounds' times at ``sizes[k]``."""
    med = [statistics.median(s) for s in samples]
    iqr = [float(np.subtract(*np.percentile(s, [75, 25]))) if len(s) > 1 else 0.0 for s in samples]
    fixed, slope = fit_line(sizes, med)
    resid = max(abs(fixed + slope * n - m) / m for n, m in zip(sizes, med, strict=True) if m > 0) if any(med) else 0.0
    return PassFit(median_s=tuple(med), iqr_s=tuple(iqr), fixed_s=fixed, per_sample_s=slope,
                   max_residual_fraction=float(resid))


# -- timers ----------------------------------------------------------------------------


class _Timer:
    """Times one callable on the probe's device. See [Note: probe timers]."""

    def __init__(self, device: torch.device, cpu_timer: CpuTimer, pacer: DevicePacer | None) -> None:
        self.device, self.cpu_timer, self.pacer = device, cpu_timer, pacer
        self.cuda = device.type == "cuda"
        if self.cuda and pacer is not None and pacer.enabled:
            raise SpecError("device emulation paces CPU workers; probe CUDA devices without it", field="emulated")
        self.pacing: dict[object, list[float]] = {}

    @property
    def name(self) -> str:
        return "cuda-events" if self.cuda else ("thread-cpu" if self.cpu_timer == "thread" else "wall")

    def run(self, fn: Callable[[], Any], key: object = None) -> tuple[Any, float]:
        """``(result, seconds)``: the device's time for ``fn`` (emulated: CPU time x slowdown);
        the pacing ratio is recorded under ``key``."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) * 1e-3
        if self.pacer is not None and self.pacer.enabled:
            out, t = self.pacer.run(fn)
            figure = t.cpu_s * self.pacer.slowdown
            if figure > 0:
                self.pacing.setdefault(key, []).append(t.wall_s / self.pacer.dilation / figure)
            return out, figure if self.cpu_timer == "thread" else t.wall_s / self.pacer.dilation
        clock = time.thread_time if self.cpu_timer == "thread" else time.perf_counter
        t0 = clock()
        out = fn()
        return out, clock() - t0

    def take_pacing(self, key: object = None) -> float | None:
        ratios = self.pacing.pop(key, None)
        return statistics.median(ratios) if ratios else None


# -- layers ----------------------------------------------------------------------------


def _layer_inputs(blocks: Sequence[nn.Module], inputs: torch.Tensor) -> list[torch.Tensor]:
    """The input of every block for ``inputs`` (no autograd)."""
    xs, x = [], inputs
    with torch.no_grad():
        for b in blocks:
            xs.append(x)
            x = b(x)
    return xs


def _fresh_grad(out: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _memory(runner: StageRunner, x: torch.Tensor, targets: torch.Tensor | None, n: int) -> tuple[float, float]:
    """``(peak bytes, saved activation bytes per sample)`` for one F/I/W at ``n`` samples."""
    params = _param_bytes(runner.module)
    param_ptrs = {p.data_ptr() for p in runner.module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in param_ptrs:
            st = t.untyped_storage()
            saved[st.data_ptr()] = st.nbytes()
        return t

    runner.zero_grad()
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        base = torch.cuda.memory_allocated(runner.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = runner.forward(-1, x[:n], None if targets is None else targets[:n])
    g = None if runner.is_last else _fresh_grad(out, 0)
    dx = runner.backward_input(-1, g)
    runner.backward_weight(-1)
    act = float(sum(saved.values()))
    if cuda:
        torch.cuda.synchronize(runner.device)
        peak = float(torch.cuda.max_memory_allocated(runner.device) - base + params)
    else:
        extra = out.numel() * out.element_size() * (1 if runner.is_last else 2)
        extra += 0 if dx is None else dx.numel() * dx.element_size()
        peak = float(2 * params + act + extra)
    runner.zero_grad()
    return peak, act / n


@dataclass(slots=True)
class _Subject:
    """One runner the probe times: a layer inside a stage, a layer in a first stage, or a range."""

    runner: StageRunner
    x: torch.Tensor
    """Its input at the largest size."""
    targets: torch.Tensor | None
    key: object
    """Pacing key (the layer index, or the range)."""
    times: dict[str, list[list[float]]]
    """Pass -> per size -> the measured rounds' times."""
    grads: dict[int, torch.Tensor | None] = field(default_factory=dict)
    """Output gradient per size, made once."""


def _subject(runner: StageRunner, x: torch.Tensor, targets: torch.Tensor | None, key: object,
             sizes: Sequence[int]) -> _Subject:
    return _Subject(runner=runner, x=x, targets=targets if runner.is_last else None, key=key,
                    times={p: [[] for _ in sizes] for p in PASSES})


def _microbatches(s: _Subject, timer: _Timer, mb: int, n: int) -> dict[str, list[float]]:
    """Two microbatches of ``n`` samples through ``s``: ``F, I, W`` (split) and ``F, B`` (fused); their times."""
    runner, x, targets = s.runner, s.x[:n], None if s.targets is None else s.targets[:n]
    out, tf = timer.run(partial(runner.forward, mb, x, targets), s.key)
    if runner.is_last:
        grad = None
    elif s.grads.get(n) is None:
        grad = s.grads[n] = _fresh_grad(out, n)
    else:
        grad = s.grads[n]
    _, ti = timer.run(partial(runner.backward_input, mb, grad), s.key)
    _, tw = timer.run(partial(runner.backward_weight, mb), s.key)
    _, tf2 = timer.run(partial(runner.forward, mb + 1, x, targets), s.key)
    _, tb = timer.run(partial(runner.backward, mb + 1, grad), s.key)
    return {"F": [tf, tf2], "I": [ti], "W": [tw], "B": [tb]}


def _time_subjects(subjects: Sequence[_Subject], timer: _Timer, cfg: ProbeConfig) -> int:
    """Time every subject at every size, interleaved in each round (so slow drift of the host
    moves all of them alike); returns the number of measured rounds."""
    t_start, rounds, mb = time.monotonic(), 0, 0
    for rnd in range(cfg.warmup + cfg.repeats):
        measured = rnd >= cfg.warmup
        if measured and rounds >= 3 and time.monotonic() - t_start > cfg.time_budget_s:
            log.info("probe budget of %.3g s spent after %d rounds", cfg.time_budget_s, rounds)
            break
        for k, n in enumerate(cfg.microbatch_sizes):
            for s in subjects:
                ts = _microbatches(s, timer, mb, n)
                mb += 2
                if measured:
                    for p, t in ts.items():
                        s.times[p][k] += t
        rounds += measured
        for s in subjects:
            s.runner.zero_grad()
    return rounds


def _fits(s: _Subject, sizes: Sequence[int]) -> dict[str, PassFit]:
    return {p: _pass_fit(sizes, s.times[p]) for p in PASSES}


def probe_blocks(blocks: Sequence[nn.Module], *, inputs: torch.Tensor, targets: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 names: Sequence[str] | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, config: ProbeConfig | None = None,
                 pacer: DevicePacer | None = None) -> tuple[tuple[LayerProbe, ...], tuple[RangeProbe, ...], str]:
    """Probe each block (and the ranges of [Note: call overhead]); ``inputs``/``targets`` hold at
    least ``max(sizes)`` samples.

    Returns the layer probes, the range probes and the timer's name. The blocks are moved to
    ``device`` and ``dtype`` (the caller's modules are modified, as by ``Module.to``).
    """
    cfg = config or ProbeConfig()
    device = torch.device(device)
    sizes, n_max = cfg.microbatch_sizes, max(cfg.microbatch_sizes)
    if inputs.shape[0] < n_max or targets.shape[0] < n_max:
        raise ProfileError(f"need >= {n_max} samples of inputs and targets, got {inputs.shape[0]}, {targets.shape[0]}")
    names = list(names) if names is not None else [f"layer{i}" for i in range(len(blocks))]
    if len(names) != len(blocks):
        raise ProfileError(f"{len(names)} names for {len(blocks)} blocks")
    timer = _Timer(device, cfg.cpu_timer, pacer)
    x0 = inputs[:n_max].to(device)
    if x0.is_floating_point():
        x0 = x0.to(dtype)
    moved = [b.to(device=device, dtype=dtype) for b in blocks]
    xs, tg = _layer_inputs(moved, x0), targets[:n_max].to(device)
    num = len(moved)

    def runner(a: int, b: int, first: bool) -> StageRunner:
        return StageRunner(moved[a:b], stage=a, is_first=first, is_last=b == num, loss_fn=loss_fn, device=device,
                           dtype=dtype)

    layers = [[_subject(runner(i, i + 1, i == 0), xs[i], tg, i, sizes)] for i in range(num)]
    if cfg.first_stage:
        for i in range(1, num):
            layers[i].append(_subject(runner(i, i + 1, True), xs[i], tg, i, sizes))
    ranges = [_subject(runner(a, num, a == 0), xs[a], tg, (a, num), sizes)
              for a in ((1, 0) if cfg.stage_ranges else ()) if num - a >= 2]
    rounds = _time_subjects([s for subs in layers for s in subs] + ranges, timer, cfg)
    out = []
    for i, (name, subs) in enumerate(zip(names, layers, strict=True)):
        fits = [_fits(s, sizes) for s in subs]
        peak, act = _memory(subs[0].runner, xs[i], subs[0].targets, n_max)
        log.debug("layer %d %s: F %s", i, name, fits[0]["F"])
        out.append(LayerProbe(name=name, microbatch_sizes=tuple(sizes), passes=fits[0],
                              first_stage=fits[-1] if len(fits) > 1 or i == 0 else None, rounds=rounds,
                              peak_memory_bytes=peak, activation_bytes_per_sample=act,
                              pacing_ratio=timer.take_pacing(i)))
    spans = tuple(RangeProbe(start=s.runner.stage, stop=num, passes=_fits(s, sizes), rounds=rounds,
                             pacing_ratio=timer.take_pacing(s.key)) for s in ranges)
    return tuple(out), spans, timer.name


# -- compute score ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Bench:
    name: str
    flops: float
    make: Callable[[torch.device, torch.dtype], Callable[[], Any]]


def _matmul(n: int) -> _Bench:
    def make(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
        g = torch.Generator(device="cpu").manual_seed(n)
        a = torch.randn(n, n, generator=g, dtype=dtype).to(device)
        b = torch.randn(n, n, generator=g, dtype=dtype).to(device)
        return lambda: torch.mm(a, b)
    return _Bench(f"matmul{n}", 2.0 * n**3, make)


def _conv(batch: int, channels: int, size: int) -> _Bench:
    def make(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
        g = torch.Generator(device="cpu").manual_seed(batch)
        x = torch.randn(batch, channels, size, size, generator=g, dtype=dtype).to(device)
        w = torch.randn(channels, channels, 3, 3, generator=g, dtype=dtype).to(device)
        return lambda: torch.nn.functional.conv2d(x, w, padding=1)
    return _Bench(f"conv3x3-{batch}x{channels}x{size}", 2.0 * batch * channels * channels * 9 * size * size,
                  make)


BENCHMARKS: dict[str, tuple[_Bench, ...]] = {
    "cpu": (_matmul(128), _matmul(256), _matmul(512), _conv(8, 32, 32)),
    "cuda": (_matmul(1024), _matmul(4096), _matmul(8192), _conv(64, 64, 56)),
}
"""The fixed benchmark set per device type (sizes that take milliseconds there)."""


def compute_score(device: torch.device | str = "cpu", *, dtype: torch.dtype = torch.float32, repeats: int = 5,
                  cpu_timer: CpuTimer = "thread", pacer: DevicePacer | None = None) -> ComputeScore:
    """Achieved FLOP/s of this device on :data:`BENCHMARKS` (geometric mean; see the module docstring)."""
    device = torch.device(device)
    timer = _Timer(device, cpu_timer, pacer)
    rates = {}
    for bench in BENCHMARKS["cuda" if device.type == "cuda" else "cpu"]:
        fn = bench.make(device, dtype)
        timer.run(fn)  # warm-up
        times = [timer.run(fn)[1] for _ in range(repeats)]
        rates[bench.name] = bench.flops / max(statistics.median(times), 1e-9)
    score = math.exp(statistics.fmean(math.log(r) for r in rates.values()))
    return ComputeScore(flops_per_s=score, benchmarks=rates)


# -- whole device ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class NetSource:
    """What to probe: a net's blocks with a batch source and loss (built-in nets: :func:`net_source`)."""

    name: str
    blocks: Sequence[nn.Module]
    block_names: tuple[str, ...]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    """``n -> (inputs, targets)`` with ``n`` samples."""
    extra: dict[str, Any] = field(default_factory=dict)


def net_source(model: str | Sequence[nn.Module], *, loss_fn: Callable | None = None, dataset: Any = None,
               seed: int = 0, name: str | None = None) -> NetSource:
    """A built-in net by name, or a user's blocks (then ``loss_fn`` and ``dataset`` are required)."""
    from deepcee import nets
    from deepcee.runtime.data import dataset_for

    if isinstance(model, str):
        blocks, default_loss = nets.build(model, seed)
        ds = dataset if dataset is not None else dataset_for(model, seed)
        names = nets.block_names(model)
        loss = loss_fn or default_loss
        label = model
    else:
        blocks = nets.as_blocks(model)
        if loss_fn is None or dataset is None:
            raise SpecError("a user's blocks need a loss_fn and a dataset (batch(step, n))", field="model")
        ds, loss, label = dataset, loss_fn, name or "user"
        names = tuple(f"layer{i}" for i in range(len(blocks)))

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = ds.batch(0, n)
        return b.inputs, b.targets

    return NetSource(name=label, blocks=blocks, block_names=tuple(names), loss_fn=loss, batch=batch)


def probe_device(source: NetSource, *, device_name: str, kind: str, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, config: ProbeConfig | None = None,
                 pacer: DevicePacer | None = None) -> DeviceProbe:
    """Layer probes and compute score of this device for ``source``'s net.

    ``pacer`` (CPU only) emulates a slower device: its ``slowdown`` multiplies every figure
    and its padding is checked (see [Note: probe timers]).
    """
    cfg = config or ProbeConfig()
    t0 = time.monotonic()
    inputs, targets = source.batch(max(cfg.microbatch_sizes))
    layers, ranges, timer = probe_blocks(source.blocks, inputs=inputs, targets=targets, loss_fn=source.loss_fn,
                                         names=source.block_names, device=device, dtype=dtype, config=cfg,
                                         pacer=pacer)
    score = compute_score(device, dtype=dtype, repeats=cfg.score_repeats, cpu_timer=cfg.cpu_timer, pacer=pacer)
    dev = torch.device(device)
    emulated = pacer is not None and pacer.enabled
    return DeviceProbe(
        device=device_name, torch_device=str(dev), kind=kind, timer=timer,
        memory_method=MEMORY_CUDA if dev.type == "cuda" else MEMORY_CPU,
        slowdown=pacer.slowdown if emulated else 1.0, dilation=pacer.dilation if emulated else 1.0,
        emulated=emulated, layers=layers, ranges=ranges, score=score, wall_s=time.monotonic() - t0,
    )


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
             "first_stage": None if la.first_stage is None else _passes_to_dict(la.first_stage)}
            for la in p.layers
        ],
        "ranges": [{"start": r.start, "stop": r.stop, "rounds": r.rounds, "pacing_ratio": r.pacing_ratio,
                    "passes": _passes_to_dict(r.passes)} for r in p.ranges],
    }


def _passes_to_dict(passes: dict[str, PassFit]) -> dict[str, Any]:
    return {k: {"median_s": list(f.median_s), "iqr_s": list(f.iqr_s), "fixed_s": f.fixed_s,
                "per_sample_s": f.per_sample_s, "max_residual_fraction": f.max_residual_fraction}
            for k, f in passes.items()}


def _passes_from_dict(d: dict[str, Any]) -> dict[str, PassFit]:
    return {k: PassFit(median_s=tuple(f["median_s"]), iqr_s=tuple(f["iqr_s"]), fixed_s=f["fixed_s"],
                       per_sample_s=f["per_sample_s"], max_residual_fraction=f["max_residual_fraction"])
            for k, f in d.items()}


def probe_from_dict(d: dict[str, Any]) -> DeviceProbe:
    try:
        layers = tuple(
            LayerProbe(name=la["name"], microbatch_sizes=tuple(la["microbatch_sizes"]), rounds=la["rounds"],
                       peak_memory_bytes=la["peak_memory_bytes"],
                       activation_bytes_per_sample=la["activation_bytes_per_sample"], pacing_ratio=la["pacing_ratio"],
                       passes=_passes_from_dict(la["passes"]),
                       first_stage=None if la.get("first_stage") is None else _passes_from_dict(la["first_stage"]))
            for la in d["layers"]
        )
        ranges = tuple(RangeProbe(start=r["start"], stop=r["stop"], rounds=r["rounds"], pacing_ratio=r["pacing_ratio"],
                                  passes=_passes_from_dict(r["passes"])) for r in d.get("ranges", ()))
        return DeviceProbe(device=d["device"], torch_device=d["torch_device"], kind=d["kind"], timer=d["timer"],
                           memory_method=d["memory_method"], slowdown=d["slowdown"], dilation=d["dilation"],
                           emulated=d["emulated"], layers=layers, ranges=ranges, wall_s=d["wall_s"],
                           score=ComputeScore(flops_per_s=d["score"]["flops_per_s"],
                                              benchmarks=dict(d["score"]["benchmarks"])))
    except (KeyError, TypeError) as exc:
        raise ProfileError(f"malformed device probe record: {exc!r}") from None
