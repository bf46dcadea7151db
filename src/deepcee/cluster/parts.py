"""The parts a cluster is made of: device kinds, devices, nodes, islands, link specs, traces.

Torch-free. Frozen records, each validated when made; SI units inside (seconds, bytes,
bytes/s, FLOP/s). :class:`~deepcee.cluster.model.Cluster` puts them together and
:mod:`deepcee.cluster.routing` resolves device pairs to :class:`Link` objects (see
[Note: link resources] in :mod:`deepcee.cluster`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from deepcee.errors import ClusterSpecError


def _positive(value: float, what: str, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterSpecError(f"{what} must be a number {bound}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceKind:
    """One model of accelerator, from its datasheet or from measurement."""

    name: str
    peak_flops_per_s: float
    """Peak dense FLOP/s in the training dtype (datasheet)."""
    memory_bytes: float
    """Device memory usable by training."""
    achievable_fraction: float = 0.4
    """Fraction of peak that training kernels reach; compute time = FLOPs / (peak x this)."""
    per_layer_overhead_s: float = 20e-6
    """Fixed cost per layer per pass (kernel launches), independent of microbatch size."""
    source: str = ""
    """Where the numbers come from (shown in reports)."""

    def __post_init__(self) -> None:
        _positive(self.peak_flops_per_s, f"kind {self.name!r}: peak_flops_per_s")
        _positive(self.memory_bytes, f"kind {self.name!r}: memory_bytes")
        _positive(self.per_layer_overhead_s, f"kind {self.name!r}: per_layer_overhead_s", allow_zero=True)
        if not 0 < self.achievable_fraction <= 1:
            raise ClusterSpecError(
                f"kind {self.name!r}: achievable_fraction must be in (0, 1], got {self.achievable_fraction!r}"
            )

    @property
    def effective_flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.achievable_fraction


@dataclass(frozen=True, slots=True, kw_only=True)
class BandwidthTrace:
    """Piecewise-constant bandwidth over time: from ``times_s[i]`` on, ``bandwidth_bytes_per_s[i]``.

    Before ``times_s[0]`` the link's nominal bandwidth holds.
    """

    times_s: tuple[float, ...]
    bandwidth_bytes_per_s: tuple[float, ...]
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.times_s) != len(self.bandwidth_bytes_per_s) or not self.times_s:
            raise ClusterSpecError(
                f"trace {self.name!r}: times_s and bandwidth_bytes_per_s need the same non-zero length, "
                f"got {len(self.times_s)} and {len(self.bandwidth_bytes_per_s)}"
            )
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:], strict=False)):
            raise ClusterSpecError(f"trace {self.name!r}: times_s must increase, got {self.times_s}")
        for bw in self.bandwidth_bytes_per_s:
            _positive(bw, f"trace {self.name!r}: bandwidth_bytes_per_s")

    def bandwidth_at(self, t_s: float, nominal_bytes_per_s: float) -> float:
        i = bisect.bisect_right(self.times_s, t_s) - 1
        return nominal_bytes_per_s if i < 0 else self.bandwidth_bytes_per_s[i]

    def next_change_after(self, t_s: float) -> float | None:
        i = bisect.bisect_right(self.times_s, t_s)
        return self.times_s[i] if i < len(self.times_s) else None

    def scaled(self, factor: float) -> BandwidthTrace:
        """The same trace with every bandwidth multiplied by ``factor``."""
        return BandwidthTrace(
            times_s=self.times_s,
            bandwidth_bytes_per_s=tuple(b * factor for b in self.bandwidth_bytes_per_s),
            name=self.name,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """Latency and bandwidth of one pipe (one direction)."""

    latency_s: float
    bandwidth_bytes_per_s: float
    trace: BandwidthTrace | None = None

    def __post_init__(self) -> None:
        _positive(self.latency_s, "latency_s", allow_zero=True)
        _positive(self.bandwidth_bytes_per_s, "bandwidth_bytes_per_s")


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A resolved directed device-to-device path. See [Note: link resources]."""

    src: str
    dst: str
    latency_s: float
    bandwidth_bytes_per_s: float
    resource: str
    """Identity of the shared pipe; transfers with the same resource share its bandwidth."""
    trace: BandwidthTrace | None = None

    def transfer_time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def bandwidth_at(self, t_s: float) -> float:
        if self.trace is None:
            return self.bandwidth_bytes_per_s
        return self.trace.bandwidth_at(t_s, self.bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One accelerator (or emulated CPU worker): one pipeline rank's device."""

    name: str
    """Unique name; files written by hand name devices ``<node>:<index>``."""
    kind: str
    """Name of its :class:`DeviceKind` in the cluster's ``kinds``."""
    node: str
    """Name of the node (server) it sits in."""
    island: str
    """Name of the island (region, site) of its node."""
    slowdown: float = 1.0
    """Compute time multiplier relative to the kind (emulated or measured); 2.0 = half speed."""

    def __post_init__(self) -> None:
        _positive(self.slowdown, f"device {self.name!r}: slowdown")


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """A server: devices of one kind that share the node's uplinks."""

    name: str
    island: str
    kind: str
    devices: tuple[str, ...]
    """Names of its devices, in file order."""
    intra: LinkSpec
    """Link between two devices of this node."""
    host: str = ""
    """The machine it is (host name or address), checked when ``torchrun`` starts a run; empty: not mapped."""
    node_rank: int | None = None
    """The ``torchrun`` node rank that runs it (static rendezvous); ``None``: not mapped."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str):
            raise ClusterSpecError(f"node {self.name!r}: host must be a string, got {self.host!r}", field="host")
        r = self.node_rank
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ClusterSpecError(f"node {self.name!r}: node_rank must be an integer >= 0, got {r!r}", field="node_rank")


@dataclass(frozen=True, slots=True, kw_only=True)
class Island:
    """A region or site: nodes joined by one fast network; optionally the training data held
    there and what its devices and its outgoing traffic cost (``None``: not stated)."""

    name: str
    intra: LinkSpec
    """Link between two nodes of this island."""
    data_bytes: float | None = None
    """Training data stored in this island."""
    device_usd_per_s: float | None = None
    """Price of one of its devices per second of use."""
    egress_usd_per_byte: float | None = None
    """Price of every byte that leaves the island."""

    def __post_init__(self) -> None:
        for name in ("data_bytes", "device_usd_per_s", "egress_usd_per_byte"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0):
                raise ClusterSpecError(f"island {self.name!r}: {name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkEntry:
    """An explicit link between two islands, nodes or devices (both directions unless directed)."""

    a: str
    """One end: an island, node or device name."""
    b: str
    """The other end, of any of the three levels."""
    spec: LinkSpec
    directed: bool = False
    """``True``: only ``a -> b``; the other direction resolves as if this entry were absent."""

