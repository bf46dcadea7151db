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
``I + W``, which walks the graph and calls autograd once per weight group). Per layer and
microbatch size (default 1, 2, 4, 8): ``warmup`` rounds, then ``repeats`` rounds; sizes are interleaved inside each round so slow drift of the host does not bend the
fit; the figure per size is the median over rounds. A line ``fixed_s + per_sample_s x n`` is
fitted per pass by non-negative least squares (:func:`fit_line`), giving a
:class:`deepcee.profile.LayerTiming`.

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
(gpt-tiny on one CPU core: 1.4-2x). One line per layer and pass cannot hold both, and the
profile data model (:class:`deepcee.profile.LayerTiming`) has one, so the profile gets the
inner-stage lines; with ``first_stage`` (default) the probe also times every layer run as a
first stage (``StageRunner(is_first=True)``) and ``probes.json`` keeps both sets.

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
SPLIT: tuple[str, ...] = ("F", "I", "W")
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
    f, i, w = (passes[p] for p in SPLIT)
    return LayerTiming(forward=(f.fixed_s, f.per_sample_s), input_grad=(i.fixed_s, i.per_sample_s),
                       weight_grad=(w.fixed_s, w.per_sample_s))


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
        self.pacing: list[float] = []

    @property
    def name(self) -> str:
        return "cuda-events" if self.cuda else ("thread-cpu" if self.cpu_timer == "thread" else "wall")

    def run(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """``(result, seconds)``: the device's time for ``fn`` (emulated: CPU time x slowdown)."""
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
                self.pacing.append(t.wall_s / self.pacer.dilation / figure)
            return out, figure if self.cpu_timer == "thread" else t.wall_s / self.pacer.dilation
        clock = time.thread_time if self.cpu_timer == "thread" else time.perf_counter
        t0 = clock()
        out = fn()
        return out, clock() - t0

    def take_pacing(self) -> float | None:
        ratio = statistics.median(self.pacing) if self.pacing else None
        self.pacing = []
        return ratio


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


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


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


def _microbatches(runner: StageRunner, timer: _Timer, mb: int, x: torch.Tensor, targets: torch.Tensor | None,
                  grad: torch.Tensor | None) -> tuple[dict[str, list[float]], torch.Tensor]:
    """Two microbatches through ``runner``: ``F, I, W`` (split) and ``F, B`` (fused); their times and
    the output (for its gradient)."""
    out, tf = timer.run(partial(runner.forward, mb, x, targets))
    if grad is None and not runner.is_last:
        grad = _fresh_grad(out, x.shape[0])
    _, ti = timer.run(partial(runner.backward_input, mb, grad))
    _, tw = timer.run(partial(runner.backward_weight, mb))
    _, tf2 = timer.run(partial(runner.forward, mb + 1, x, targets))
    _, tb = timer.run(partial(runner.backward, mb + 1, grad))
    return {"F": [tf, tf2], "I": [ti], "W": [tw], "B": [tb]}, out


def _probe_layer(i: int, name: str, runners: Sequence[StageRunner], x: torch.Tensor, targets: torch.Tensor | None,
                 timer: _Timer, cfg: ProbeConfig, budget_s: float) -> LayerProbe:
    """``runners[0]``: the layer as it runs inside a stage; ``runners[1]`` (optional): the layer in a
    first stage (input without gradient). See [Note: first-stage timings]."""
    sizes = cfg.microbatch_sizes
    grads: dict[int, torch.Tensor | None] = {n: None for n in sizes}  # output gradients, made once per size
    times = [{p: [[] for _ in sizes] for p in PASSES} for _ in runners]
    mb, t_start, rounds = 0, time.monotonic(), 0
    for rnd in range(cfg.warmup + cfg.repeats):
        measured = rnd >= cfg.warmup
        if measured and rounds >= 3 and time.monotonic() - t_start > budget_s:
            log.info("layer %s: budget of %.3g s spent after %d rounds", name, budget_s, rounds)
            break
        for k, n in enumerate(sizes):
            xn, tn = x[:n], None if targets is None else targets[:n]
            for runner, store in zip(runners, times, strict=True):
                ts, out = _microbatches(runner, timer, mb, xn, tn, grads[n])
                if grads[n] is None and not runner.is_last:
                    grads[n] = _fresh_grad(out, n)
                mb += 2
                if measured:
                    for p, t in ts.items():
                        store[p][k] += t
        rounds += measured
        runners[0].zero_grad()
    pacing = timer.take_pacing()
    peak, act = _memory(runners[0], x, targets, max(sizes))
    fits = [{p: _pass_fit(sizes, t[p]) for p in PASSES} for t in times]
    first = fits[-1] if len(fits) > 1 or i == 0 else None
    if first is None and cfg.first_stage and not runners[0].params:
        # no parameters and an input without gradient: nothing to differentiate in a first stage
        zero = PassFit(median_s=(0.0,) * len(sizes), iqr_s=(0.0,) * len(sizes), fixed_s=0.0, per_sample_s=0.0,
                       max_residual_fraction=0.0)
        first = {"F": fits[0]["F"], "I": zero, "W": zero, "B": zero}
    log.debug("layer %d %s: F %s", i, name, fits[0]["F"])
    return LayerProbe(name=name, microbatch_sizes=tuple(sizes), passes=fits[0], first_stage=first, rounds=rounds,
                      peak_memory_bytes=peak, activation_bytes_per_sample=act, pacing_ratio=pacing)


def probe_blocks(blocks: Sequence[nn.Module], *, inputs: torch.Tensor, targets: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 names: Sequence[str] | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, config: ProbeConfig | None = None,
                 pacer: DevicePacer | None = None) -> tuple[tuple[LayerProbe, ...], str]:
    """Probe each block; ``inputs``/``targets`` hold at least ``max(sizes)`` samples.

    Returns the layer probes and the timer's name. The blocks are moved to ``device`` and
    ``dtype`` (the caller's modules are modified, as by ``Module.to``).
    """
    cfg = config or ProbeConfig()
    device = torch.device(device)
    n_max = max(cfg.microbatch_sizes)
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
    xs = _layer_inputs(moved, x0)
    out = []
    for i, (name, block) in enumerate(zip(names, moved, strict=True)):
        last = i == len(moved) - 1
        runners = [StageRunner([block], stage=i, is_first=first, is_last=last, loss_fn=loss_fn, device=device,
                               dtype=dtype)
                   for first in ((i == 0, True) if cfg.first_stage and i > 0 and _trainable(block) else (i == 0,))]
        budget = cfg.time_budget_s / len(moved)
        out.append(_probe_layer(i, name, runners, xs[i], targets[:n_max].to(device) if last else None,
                                timer, cfg, budget))
    return tuple(out), timer.name


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
    layers, timer = probe_blocks(source.blocks, inputs=inputs, targets=targets, loss_fn=source.loss_fn,
                                 names=source.block_names, device=device, dtype=dtype, config=cfg, pacer=pacer)
    score = compute_score(device, dtype=dtype, repeats=cfg.score_repeats, cpu_timer=cfg.cpu_timer, pacer=pacer)
    dev = torch.device(device)
    emulated = pacer is not None and pacer.enabled
    return DeviceProbe(
        device=device_name, torch_device=str(dev), kind=kind, timer=timer,
        memory_method=MEMORY_CUDA if dev.type == "cuda" else MEMORY_CPU,
        slowdown=pacer.slowdown if emulated else 1.0, dilation=pacer.dilation if emulated else 1.0,
        emulated=emulated, layers=layers, score=score, wall_s=time.monotonic() - t0,
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
        return DeviceProbe(device=d["device"], torch_device=d["torch_device"], kind=d["kind"], timer=d["timer"],
                           memory_method=d["memory_method"], slowdown=d["slowdown"], dilation=d["dilation"],
                           emulated=d["emulated"], layers=layers, wall_s=d["wall_s"],
                           score=ComputeScore(flops_per_s=d["score"]["flops_per_s"],
                                              benchmarks=dict(d["score"]["benchmarks"])))
    except (KeyError, TypeError) as exc:
        raise ProfileError(f"malformed device probe record: {exc!r}") from None
