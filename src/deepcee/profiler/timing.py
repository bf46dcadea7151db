"""The device probe's clock, and the compute score that times a fixed benchmark set with it.

:class:`ProbeTimer` times one callable on the probe's device (see the note);
:func:`compute_score` times a fixed benchmark set (three square matmuls and a 3x3
convolution, sizes per device type) through the same timer, so unlike devices can be ranked
before a model is chosen.

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
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepcee.errors import SpecError
from deepcee.profiler.probes import ComputeScore, CpuTimer, TimerName
from deepcee.runtime.emulation import DevicePacer


class ProbeTimer:
    """Times one callable on the probe's device. See [Note: probe timers]."""

    def __init__(self, device: torch.device, cpu_timer: CpuTimer, pacer: DevicePacer | None) -> None:
        self.device, self.cpu_timer, self.pacer = device, cpu_timer, pacer
        self.cuda = device.type == "cuda"
        if self.cuda and pacer is not None and pacer.enabled:
            raise SpecError("device emulation paces CPU workers; probe CUDA devices without it", field="emulated")
        self.pacing: dict[object, list[float]] = {}

    @property
    def name(self) -> TimerName:
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
    timer = ProbeTimer(device, cpu_timer, pacer)
    rates = {}
    for bench in BENCHMARKS["cuda" if device.type == "cuda" else "cpu"]:
        fn = bench.make(device, dtype)
        timer.run(fn)  # warm-up
        times = [timer.run(fn)[1] for _ in range(repeats)]
        rates[bench.name] = bench.flops / max(statistics.median(times), 1e-9)
    score = math.exp(statistics.fmean(math.log(r) for r in rates.values()))
    return ComputeScore(flops_per_s=score, benchmarks=rates)
