"""Per-layer probe: forward / input-gradient / weight-gradient times of every layer, and memory.

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
non-negative least squares (:func:`~deepcee.profiler.probes.fit_line`); the records are in
:mod:`deepcee.profiler.probes`, and :mod:`deepcee.profiler.model` turns the lines into the
profile's :class:`deepcee.profile.LayerTiming` objects. The clock is
:class:`~deepcee.profiler.timing.ProbeTimer` (see [Note: probe timers] there).

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

[Note: optimizer probe]
After the passes, the optimizer the runtime builds (:class:`deepcee.runtime.job.OptimizerConfig`,
AdamW by default) steps every layer's parameters alone and every range's together, with
gradients in place, ``warmup`` then ``repeats`` rounds interleaved, through the same clock
and pacing as the passes (the runtime paces its optimizer step as compute); the median per
subject is its step time, and the ranges give the step's own per-call cost as for the passes.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from deepcee.errors import ProfileError
from deepcee.profile import Pass
from deepcee.profiler.probes import (
    PASSES,
    LayerProbe,
    PassFit,
    ProbeConfig,
    RangeProbe,
    TimerName,
    pass_fit,
)
from deepcee.profiler.timing import ProbeTimer
from deepcee.runtime import boundary
from deepcee.runtime.emulation import DevicePacer
from deepcee.runtime.stage import StageRunner

log = logging.getLogger(__name__)


def _layer_inputs(blocks: Sequence[nn.Module], inputs: Any) -> tuple[list[Any], list[tuple[bool, ...] | None]]:
    """The input of every block for ``inputs`` (detached), and which of its tensors get a gradient
    in a pipeline ([Note: boundary gradients]: the previous block's outputs autograd tracks)."""
    xs: list[Any] = []
    masks: list[tuple[bool, ...] | None] = []
    x, mask = inputs, None
    with torch.enable_grad():
        for i, b in enumerate(blocks):
            xs.append(boundary.map_tensors(torch.Tensor.detach, x))
            masks.append(mask)
            it = iter(mask or ())
            x = b(boundary.map_tensors(
                lambda t, it=it, first=i == 0: t.detach().requires_grad_(not first and next(it, False)), x))
            mask = tuple(t.requires_grad for t in boundary.tensors(x))
    return xs, masks


def _fresh_grad(out: Any, seed: int, mask: tuple[bool, ...] | None) -> Any:
    """A random gradient for the tensors of ``out`` that get one."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if mask is None:  # a plain floating tensor (the nets probed before boundaries had structure)
        mask = tuple(t.is_floating_point() for t in boundary.tensors(out))
    return boundary.grads_for(out, mask, lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device))


def _bytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in boundary.tensors(x))


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _memory(runner: StageRunner, x: Any, targets: Any, n: int, out_mask: tuple[bool, ...] | None) -> tuple[float, float]:
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
        out = runner.forward(-1, boundary.take(x, 0, n), None if targets is None else boundary.take(targets, 0, n))
    g = None if runner.is_last else _fresh_grad(out, 0, out_mask)
    dx = runner.backward_input(-1, g)
    runner.backward_weight(-1)
    act = float(sum(saved.values()))
    if cuda:
        torch.cuda.synchronize(runner.device)
        peak = float(torch.cuda.max_memory_allocated(runner.device) - base + params)
    else:
        extra = _bytes(out) * (1 if runner.is_last else 2)
        extra += 0 if dx is None else _bytes(dx)
        peak = float(2 * params + act + extra)
    runner.zero_grad()
    return peak, act / n


@dataclass(slots=True)
class _Subject:
    """One runner the probe times: a layer inside a stage, a layer in a first stage, or a range."""

    runner: StageRunner
    x: Any
    """Its input at the largest size."""
    targets: Any
    key: object
    """Pacing key (the layer index, or the range)."""
    times: dict[Pass, list[list[float]]]
    """Pass -> per size -> the measured rounds' times."""
    out_mask: tuple[bool, ...] | None = None
    """Which output tensors get a gradient."""
    grads: dict[int, Any] = field(default_factory=dict)
    """Output gradient per size, made once."""


def _subject(runner: StageRunner, x: Any, targets: Any, key: object, sizes: Sequence[int],
             out_mask: tuple[bool, ...] | None) -> _Subject:
    return _Subject(runner=runner, x=x, targets=targets if runner.is_last else None, key=key,
                    times={p: [[] for _ in sizes] for p in PASSES}, out_mask=out_mask)


def _microbatches(s: _Subject, timer: ProbeTimer, mb: int, n: int) -> dict[Pass, list[float]]:
    """Two microbatches of ``n`` samples through ``s``: ``F, I, W`` (split) and ``F, B`` (fused); their times."""
    runner, x = s.runner, boundary.take(s.x, 0, n)
    targets = None if s.targets is None else boundary.take(s.targets, 0, n)
    out, tf = timer.run(partial(runner.forward, mb, x, targets), s.key)
    if runner.is_last:
        grad = None
    elif s.grads.get(n) is None:
        grad = s.grads[n] = _fresh_grad(out, n, s.out_mask)
    else:
        grad = s.grads[n]
    _, ti = timer.run(partial(runner.backward_input, mb, grad), s.key)
    _, tw = timer.run(partial(runner.backward_weight, mb), s.key)
    _, tf2 = timer.run(partial(runner.forward, mb + 1, x, targets), s.key)
    _, tb = timer.run(partial(runner.backward, mb + 1, grad), s.key)
    return {"F": [tf, tf2], "I": [ti], "W": [tw], "B": [tb]}


def _time_subjects(subjects: Sequence[_Subject], timer: ProbeTimer, cfg: ProbeConfig) -> int:
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


def _time_optimizer(subjects: Sequence[_Subject], timer: ProbeTimer, cfg: ProbeConfig) -> list[float]:
    """Median optimizer step time per subject ([Note: optimizer probe]); 0 without parameters."""
    from deepcee.runtime.job import OptimizerConfig

    steps = []
    for s in subjects:
        params = list(s.runner.params)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        steps.append(OptimizerConfig().build(params).step if params else None)
    times: list[list[float]] = [[] for _ in subjects]
    for rnd in range(cfg.warmup + cfg.repeats):
        for k, step in enumerate(steps):
            if step is not None:
                _, t = timer.run(step, ("optimizer", k))
                if rnd >= cfg.warmup:
                    times[k].append(t)
    for s in subjects:
        s.runner.zero_grad()
    return [statistics.median(t) if t else 0.0 for t in times]


def _fits(s: _Subject, sizes: Sequence[int]) -> dict[Pass, PassFit]:
    return {p: pass_fit(sizes, s.times[p]) for p in PASSES}


def probe_blocks(blocks: Sequence[nn.Module], *, inputs: Any, targets: Any,
                 loss_fn: Callable[[Any, Any], torch.Tensor],
                 names: Sequence[str] | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, config: ProbeConfig | None = None,
                 pacer: DevicePacer | None = None) -> tuple[tuple[LayerProbe, ...], tuple[RangeProbe, ...], TimerName]:
    """Probe each block (and the ranges of [Note: call overhead]); ``inputs``/``targets`` hold at
    least ``max(sizes)`` samples.

    Returns the layer probes, the range probes and the timer's name. The blocks are moved to
    ``device`` and ``dtype`` (the caller's modules are modified, as by ``Module.to``).
    """
    cfg = config or ProbeConfig()
    device = torch.device(device)
    sizes, n_max = cfg.microbatch_sizes, max(cfg.microbatch_sizes)
    have = (boundary.num_samples(inputs), boundary.num_samples(targets))
    if min(have) < n_max:
        raise ProfileError(f"need >= {n_max} samples of inputs and targets, got {have[0]}, {have[1]}")
    names = list(names) if names is not None else [f"layer{i}" for i in range(len(blocks))]
    if len(names) != len(blocks):
        raise ProfileError(f"{len(names)} names for {len(blocks)} blocks")
    timer = ProbeTimer(device, cfg.cpu_timer, pacer)
    x0 = boundary.to_device(boundary.take(inputs, 0, n_max), device, dtype)
    moved = [b.to(device=device, dtype=dtype) for b in blocks]
    (xs, masks), tg = _layer_inputs(moved, x0), boundary.to_device(boundary.take(targets, 0, n_max), device)
    num = len(moved)
    masks.append(None)  # after the last block: the loss

    def runner(a: int, b: int, first: bool) -> StageRunner:
        r = StageRunner(moved[a:b], stage=a, is_first=first, is_last=b == num, loss_fn=loss_fn, device=device,
                        dtype=dtype)
        r.input_grads = masks[a]
        return r

    layers = [[_subject(runner(i, i + 1, i == 0), xs[i], tg, i, sizes, masks[i + 1])] for i in range(num)]
    if cfg.first_stage:
        for i in range(1, num):
            layers[i].append(_subject(runner(i, i + 1, True), xs[i], tg, i, sizes, masks[i + 1]))
    ranges = [_subject(runner(a, num, a == 0), xs[a], tg, (a, num), sizes, None)
              for a in ((1, 0) if cfg.stage_ranges else ()) if num - a >= 2]
    rounds = _time_subjects([s for subs in layers for s in subs] + ranges, timer, cfg)
    opt = _time_optimizer([subs[0] for subs in layers] + ranges, timer, cfg)
    out = []
    for i, (name, subs) in enumerate(zip(names, layers, strict=True)):
        fits = [_fits(s, sizes) for s in subs]
        peak, act = _memory(subs[0].runner, xs[i], subs[0].targets, n_max, masks[i + 1])
        log.debug("layer %d %s: F %s", i, name, fits[0]["F"])
        out.append(LayerProbe(name=name, microbatch_sizes=tuple(sizes), passes=fits[0],
                              first_stage=fits[-1] if len(fits) > 1 or i == 0 else None, rounds=rounds,
                              peak_memory_bytes=peak, activation_bytes_per_sample=act,
                              pacing_ratio=timer.take_pacing(i), optimizer_s=opt[i]))
    spans = tuple(RangeProbe(start=s.runner.stage, stop=num, passes=_fits(s, sizes), rounds=rounds,
                             pacing_ratio=timer.take_pacing(s.key), optimizer_s=opt[num + k])
                  for k, s in enumerate(ranges))
    return tuple(out), spans, timer.name

