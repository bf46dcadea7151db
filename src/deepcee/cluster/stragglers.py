"""Stragglers: a device slowed down over a stretch of time (torch-free).

A :class:`Straggler` is to a device what a :class:`~deepcee.cluster.BandwidthTrace` is to a
link: a change of speed over time, on the same clock (seconds since the run or simulation
started). The simulator of replicated plans (:mod:`deepcee.simulator.replicas`) reads them;
the text form ``DEVICE:FACTOR[:START[:STOP]]`` is the one ``deepcee train --straggler`` and
``deepcee simulate --straggler`` take.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from deepcee.errors import ClusterSpecError


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggler:
    """``device`` runs ``factor`` times slower (on top of its own slowdown) from ``start_s``
    until ``stop_s``. A piece of work takes the factor in force when it starts."""

    device: str
    factor: float
    start_s: float = 0.0
    stop_s: float = math.inf

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device:
            raise ClusterSpecError(f"needs a device name, got {self.device!r}", field="straggler.device")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not (
                math.isfinite(self.factor) and self.factor > 0):
            raise ClusterSpecError(f"must be a finite number > 0, got {self.factor!r}", field="straggler.factor")
        if not (0 <= self.start_s < self.stop_s):
            raise ClusterSpecError(f"needs 0 <= start < stop, got {self.start_s!r}, {self.stop_s!r}",
                                   field="straggler")

    def factor_at(self, t_s: float) -> float:
        return self.factor if self.start_s <= t_s < self.stop_s else 1.0

    @staticmethod
    def parse(text: str, devices: Sequence[str]) -> Straggler:
        """``DEVICE:FACTOR[:START[:STOP]]`` with ``DEVICE`` one of ``devices`` (names hold
        colons): ``edge0:1:3`` slows ``edge0:1`` 3x for the whole run, ``edge0:1:3:5:20`` from
        5 s to 20 s."""
        parts = text.split(":")
        for cut in range(len(parts) - 1, 0, -1):
            device, rest = ":".join(parts[:cut]), parts[cut:]
            if device in devices and len(rest) <= 3:
                try:
                    factor, *window = (float(x) for x in rest)
                except ValueError:
                    break
                return Straggler(device=device, factor=factor, start_s=window[0] if window else 0.0,
                                 stop_s=window[1] if len(window) > 1 else math.inf)
        raise ClusterSpecError(f"expected DEVICE:FACTOR[:START[:STOP]] with DEVICE one of {list(devices)}, "
                               f"got {text!r}", field="straggler")


def slowdown_at(stragglers: Iterable[Straggler], device: str, t_s: float) -> float:
    """The product of the factors of every straggler of ``device`` in force at ``t_s``."""
    f = 1.0
    for s in stragglers:
        if s.device == device:
            f *= s.factor_at(t_s)
    return f


__all__ = ["Straggler", "slowdown_at"]
