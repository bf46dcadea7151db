"""Emulated devices and links on one machine (honest, visible, dilated time).

Devices: one process per emulated device, one thread, real computation. After each compute
action the process sleeps until ``wall = start + cpu_s x slowdown x D``, where ``cpu_s`` is
the action's CPU time (``time.thread_time``, which stays put when other processes compete
for the cores) and ``D`` is a global *time dilation*. ``D`` is chosen so that the emulated
devices together need at most ``cores`` CPU cores (``sum(1 / (slowdown x D)) <= cores``,
about 1.2 on a 2-core machine; see PLATFORM.md), so contention does not distort them.

Links: a transfer of ``n`` bytes on link ``src -> dst`` is delivered at
``start + D x n / bandwidth + D x latency`` with ``start = max(send time, resource free)``,
and occupies the link's *resource* (:attr:`deepcee.cluster.Link.resource`, shared by
transfers between the same two nodes) for ``D x n / bandwidth``, first come first served. The sender sends the real tensor
at once with its delivery time in a header; the receiver does not hand it over before that
time. Transfers of several processes on one resource share a :class:`FileLedger` (an
``flock``-ed file per resource), so queueing is global; unit tests use :class:`MemoryLedger`
and an injected clock. On a link with a bandwidth trace, ``n / bandwidth`` is integrated
over the trace from ``start`` (after any queueing), in emulated time, exactly as the
simulator does (:func:`deepcee.comm.serialise_end_s`): a transfer that straddles
a bandwidth change pays the old rate before it and the new one after.

Intra-stage gradient all-reduce: the real all-reduce runs, and each rank then waits until
``D x`` the simulator's all-reduce time on the emulated links
(:func:`deepcee.comm.allreduce_s`) has passed since it started: a model-based
delay rather than per-message shaping; reports say so.

Every figure reported from an emulated run is wall time divided by ``D``.

Mode ``realnet`` (:mod:`deepcee.runtime.realnet`) paces devices the same way, with the same
``D``, but its links are real TCP through a user-space relay between network namespaces,
which applies each link's latency x ``D``, bandwidth / ``D`` and a drop-tail queue per link
resource: no :class:`LinkShaper`, and the all-reduce runs for real over the relay (no
modelled delay). Its times are divided by ``D`` too.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from deepcee.cluster import Link
from deepcee.cluster.outages import LinkOutage, up_again_s
from deepcee.cluster.stragglers import (
    Straggler,  # the one slowdown trace record (simulator and runtime)
)
from deepcee.comm import serialise_end_s
from deepcee.errors import SpecError

Mode = Literal["emulated", "real", "realnet"]
MODES: tuple[str, ...] = ("emulated", "real", "realnet")
PACED_MODES: tuple[str, ...] = ("emulated", "realnet")
"""Modes whose devices are emulated CPU workers (pacing, a time dilation, one host)."""
DEFAULT_CORES = 1.2

EMULATED_FIGURES: tuple[str, ...] = (
    "device compute speed (CPU time x slowdown x D)",
    "link latency and bandwidth (delivery delayed, FIFO per link resource)",
    "intra-stage all-reduce time (the simulator's ring/hierarchical model on the emulated links)",
)
REALNET_FIGURES: tuple[str, ...] = (
    "device compute speed (CPU time x slowdown x D)",
    "links: real TCP (gloo) through a user-space relay between network namespaces "
    "(latency, rate, drop-tail queue per link resource)",
)


def choose_dilation(slowdowns: Iterable[float], cores: float = DEFAULT_CORES) -> float:
    """Smallest ``D >= 1`` with ``sum(1 / (slowdown x D)) <= cores``."""
    if cores <= 0:
        raise SpecError(f"cores must be > 0, got {cores!r}", field="cores")
    demand = sum(1.0 / s for s in slowdowns)
    return max(1.0, demand / cores)


def padded_wall_s(cpu_s: float, slowdown: float, dilation: float) -> float:
    """Wall time an emulated compute action must take: ``cpu_s x slowdown x D``."""
    return cpu_s * slowdown * dilation


@dataclass(frozen=True, slots=True, kw_only=True)
class Clock:
    """Time sources, injectable for tests. ``wall`` must be shared by all processes of a run."""

    wall: Callable[[], float] = time.monotonic
    """``CLOCK_MONOTONIC`` is system-wide on Linux, so it is comparable across local processes."""
    cpu: Callable[[], float] = time.thread_time
    sleep: Callable[[float], None] = time.sleep

    def sleep_until(self, t: float) -> float:
        """Sleep until wall time ``t``; returns the seconds slept."""
        delay = t - self.wall()
        if delay > 0:
            self.sleep(delay)
            return delay
        return 0.0


@dataclass(slots=True)
class ComputeTiming:
    cpu_s: float = 0.0
    wall_s: float = 0.0


class DevicePacer:
    """Runs compute at an emulated device's speed (``slowdown x D`` slower than this core),
    times the factor of any :class:`Straggler` in force (emulated time from ``epoch``)."""

    def __init__(self, *, slowdown: float, dilation: float, enabled: bool = True, clock: Clock | None = None,
                 stragglers: Sequence[Straggler] = (), epoch: float | None = None) -> None:
        if slowdown <= 0 or dilation < 1:
            raise SpecError(f"need slowdown > 0 and dilation >= 1, got {slowdown!r}, {dilation!r}")
        self.slowdown, self.dilation, self.enabled = slowdown, dilation, enabled
        self.clock = clock or Clock()
        self.stragglers, self.epoch = tuple(stragglers), epoch

    def factor_at(self, wall: float) -> float:
        """The device's slowdown at wall time ``wall`` (its own x every straggler factor in force)."""
        f = self.slowdown
        if self.stragglers and self.epoch is not None:
            t = (wall - self.epoch) / self.dilation
            for s in self.stragglers:
                f *= s.factor_at(t)
        return f

    def run(self, fn: Callable[[], object]) -> tuple[object, ComputeTiming]:
        """Call ``fn``; when enabled, pad its wall time to ``cpu time x slowdown x D``."""
        c = self.clock
        wall0, cpu0 = c.wall(), c.cpu()
        result = fn()
        cpu_s = c.cpu() - cpu0
        if self.enabled:
            c.sleep_until(wall0 + padded_wall_s(cpu_s, self.factor_at(wall0), self.dilation))
        return result, ComputeTiming(cpu_s=cpu_s, wall_s=c.wall() - wall0)


# -- links ------------------------------------------------------------------------------


Busy = float | Callable[[float], float]
"""Seconds a booking occupies a resource: a number, or a function of the booking's start
(wall seconds), for links whose bandwidth depends on when a transfer gets them."""


def _busy_s(busy: Busy, start: float) -> float:
    return busy(start) if callable(busy) else busy


class Ledger(Protocol):
    """When each link resource is next free (wall seconds); ``reserve`` is atomic."""

    def reserve(self, resource: str, ready_at: float, busy_s: Busy) -> float:
        """Book ``busy_s`` on ``resource`` at or after ``ready_at``; returns the start time."""
        ...


@dataclass(slots=True)
class MemoryLedger:
    """In-process ledger (one process, or tests)."""

    free_at: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reserve(self, resource: str, ready_at: float, busy_s: Busy) -> float:
        with self._lock:
            start = max(ready_at, self.free_at.get(resource, float("-inf")))
            self.free_at[resource] = start + _busy_s(busy_s, start)
            return start


class FileLedger:
    """Ledger shared by the processes of one machine: one ``flock``-ed 8-byte file per resource."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, resource: str) -> Path:
        # a stable name (str hash() differs between processes)
        return self.dir / f"{hashlib.sha1(resource.encode()).hexdigest()[:16]}.link"

    def reserve(self, resource: str, ready_at: float, busy_s: Busy) -> float:
        fd = os.open(self._path(resource), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 8, 0)
            free_at = struct.unpack("d", raw)[0] if len(raw) == 8 else float("-inf")
            start = max(ready_at, free_at)
            os.pwrite(fd, struct.pack("d", start + _busy_s(busy_s, start)), 0)
            return start
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class LinkShaper:
    """Delivery times of transfers on emulated links. See the module docstring."""

    def __init__(self, *, dilation: float, ledger: Ledger, epoch: float, clock: Clock | None = None,
                 outages: Mapping[tuple[str, str], tuple[LinkOutage, ...]] | None = None) -> None:
        self.dilation, self.ledger, self.epoch = dilation, ledger, epoch
        self.clock = clock or Clock()
        self.outages = dict(outages or {})
        """``(src device, dst device) -> the outages that cut it`` (:mod:`deepcee.cluster.outages`)."""

    def emulated_now_s(self, wall: float | None = None) -> float:
        """Emulated seconds since the run's epoch (for bandwidth traces and reports)."""
        return ((self.clock.wall() if wall is None else wall) - self.epoch) / self.dilation

    def serialise_s(self, link: Link, nbytes: float, start_wall: float) -> float:
        """Wall seconds ``nbytes`` occupy ``link`` when they get it at ``start_wall`` (trace integrated)."""
        if link.trace is None:
            return self.dilation * nbytes / link.bandwidth_bytes_per_s
        t = self.emulated_now_s(start_wall)
        return self.dilation * (serialise_end_s(t, nbytes, link.bandwidth_bytes_per_s, link.trace) - t)

    def deliver_at(self, link: Link, nbytes: int, ready_at: float | None = None) -> float:
        """Book a transfer of ``nbytes`` ready at wall time ``ready_at``; returns its delivery wall time."""
        ready = self.clock.wall() if ready_at is None else ready_at
        cut = self.outages.get((link.src, link.dst))
        if cut:  # a transfer ready while the link is down waits for it to come back (inf: never)
            up = up_again_s(cut, self.emulated_now_s(ready))
            if math.isinf(up):
                return math.inf
            ready = max(ready, self.epoch + up * self.dilation)
        start = self.ledger.reserve(link.resource, ready, lambda t: self.serialise_s(link, nbytes, t))
        return start + self.serialise_s(link, nbytes, start) + self.dilation * link.latency_s


@dataclass(frozen=True, slots=True, kw_only=True)
class EmulationInfo:
    """What every report of a run states about emulation."""

    mode: Mode
    dilation: float
    cores: float
    emulated: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "dilation": self.dilation, "cores": self.cores, "emulated": list(self.emulated)}


def emulation_info(mode: Mode, dilation: float, cores: float = DEFAULT_CORES) -> EmulationInfo:
    """What a run in ``mode`` reports: the dilation (1 in mode ``real``) and which figures are emulated."""
    if mode not in MODES:
        raise SpecError(f"must be one of {', '.join(MODES)}, got {mode!r}", field="mode")
    figures = {"emulated": EMULATED_FIGURES, "realnet": REALNET_FIGURES, "real": ()}[mode]
    return EmulationInfo(mode=mode, dilation=dilation if mode in PACED_MODES else 1.0, cores=cores, emulated=figures)
