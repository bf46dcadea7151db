"""Network probe: latency and bandwidth of every directed device pair (alpha-beta fits).

Every rank of a process group runs :func:`probe_network` with the same arguments; rank ``r``
is device ``devices[r]``. Pairs are probed **one at a time** (a barrier between sessions), so
no probe shares a pipe with another probe; for each unordered pair ``{a, b}`` there are two
*sessions*, ``a -> b`` then ``b -> a``.

[Note: ping-pong probe]
A session is a ping-pong: the sender sends a message of ``n`` bytes, the echo answers with an
8-byte acknowledgement, the sender times the round trip. Receives are posted before the
matching send (gloo's blocking send waits for the receiver, PLATFORM.md). Message sizes climb
a ladder (``min_bytes``, x ``growth`` .. ``max_bytes``, ``repeats`` messages each); each level
opens with a 16-byte control message (it tells the echo the level's size and count, and is a
near-zero-size sample). Two messages of ``warmup_bytes`` (256 KiB) open every session and are
not recorded: over real TCP a connection's congestion window starts at 10 segments and grows
with traffic, so without them the ladder measured a fresh connection's first round trips
(realnet, 20 ms / 100 Mbit/s at D = 7.5: 16 kB messages 21 ms slower than 4 kB ones, fitted
as 5.9 Mbit/s), not the open window a training connection has after its first step. The
ladder stops once a level's median round trip exceeds the control
messages' by ``min_transfer_s`` (the bandwidth term then dominates jitter), or the pair's byte
or time allowance is spent. Then per directed pair ``src -> dst``:

    round_trip(n) = (latency(src->dst) + latency(dst->src)) + n / bandwidth(src->dst)  (+ 8 ack bytes)

fitted by non-negative least squares on the per-size medians (:func:`fit_alpha_beta`):
bandwidth is ``1 / slope``, and the one-way latency is **half the intercept**, because
without clocks shared between the two hosts a round trip cannot be split into its two
directions (the symmetric-latency assumption; asymmetric bandwidth is measured). Spread is
reported two ways: the fit of each repeat alone (min and max of latency and bandwidth over
the repeats) and the inter-quartile range of the relative residuals of all samples.

Over emulated links (:class:`deepcee.runtime.emulation.LinkShaper`, the runtime's in-process
link shaper) each message carries the runtime's 16-byte header (delivery time, send time) and
the receiver holds it until its emulated delivery, exactly as :mod:`deepcee.runtime.p2p`
does, so an emulated 100 Mbit/s, 20 ms link measures as one. Times are wall time divided by
the shaper's dilation ``D``; the real software cost of a transfer (0.1-0.3 ms on idle
loopback gloo, about 1 ms on a busy 2-core host) is in the figures divided by ``D``, as it is
in a runtime run with the same ``D``.

[Note: probe budget]
Defaults (:class:`NetworkBudget`): at most 32 MiB and 6 s per directed pair, 180 s in total
(each session gets the remaining time / remaining sessions, at least enough for its first
two levels), and a duty cycle of 0.5: after every round trip the sender idles as long as the
round trip took, so the probe occupies a link at most half the time and leaves at least half
its capacity to traffic already using it. With more than ``max_full_ranks`` ranks (64) the
probe samples: all pairs of the nodes' representative ranks (first device of each node) and
one pair inside every node with several devices; the other pairs are inferred from their
nodes (:func:`link_entries`).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

from deepcee.cluster import Cluster, LinkEntry, LinkSpec
from deepcee.errors import ProfileError, RuntimeSetupError, SpecError
from deepcee.runtime.emulation import Clock, LinkShaper
from deepcee.units import MIB

log = logging.getLogger(__name__)

HEADER_BYTES = 16
"""Delivery and send time (float64 each), as in :mod:`deepcee.runtime.p2p`."""
ACK_BYTES = 8
CONTROL_BYTES = 16
PairMode = Literal["all", "sampled"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkBudget:
    """Message ladder and limits of the network probe. See [Note: probe budget]."""

    min_bytes: int = 1024
    max_bytes: int = 4 * MIB
    warmup_bytes: int = 256 * 1024
    """Two messages of this size open every session, not recorded (0: none); see [Note: ping-pong probe]."""
    growth: int = 4
    repeats: int = 3
    min_transfer_s: float = 0.03
    max_bytes_per_pair: int = 32 * MIB
    max_s_per_pair: float = 6.0
    total_s: float = 180.0
    duty_cycle: float = 0.5
    """Fraction of the time the probe may keep a link busy (1.0: back to back)."""
    max_full_ranks: int = 64
    timeout_s: float = 60.0
    """Limit on every single transfer and barrier."""

    def __post_init__(self) -> None:
        if not 0 < self.min_bytes <= self.max_bytes:
            raise SpecError(f"need 0 < min_bytes <= max_bytes, got {self.min_bytes!r}, {self.max_bytes!r}")
        if self.growth < 2 or self.repeats < 1:
            raise SpecError(f"need growth >= 2 and repeats >= 1, got {self.growth!r}, {self.repeats!r}")
        if not 0 < self.duty_cycle <= 1:
            raise SpecError(f"duty_cycle must be in (0, 1], got {self.duty_cycle!r}", field="duty_cycle")
        for name in ("min_transfer_s", "max_s_per_pair", "total_s", "timeout_s"):
            if getattr(self, name) <= 0:
                raise SpecError(f"must be > 0, got {getattr(self, name)!r}", field=name)

    @property
    def ladder(self) -> tuple[int, ...]:
        sizes, n = [], self.min_bytes
        while n <= self.max_bytes:
            sizes.append(n)
            n *= self.growth
        return tuple(sizes)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    """Measured alpha-beta model of one directed pair. See [Note: ping-pong probe]."""

    src: str
    dst: str
    latency_s: float
    bandwidth_bytes_per_s: float
    bandwidth_resolved: bool
    """False when transfer time stayed below the noise: then the bandwidth is a lower bound."""
    latency_range_s: tuple[float, float]
    """Min and max over the per-repeat fits."""
    bandwidth_range_bytes_per_s: tuple[float, float]
    residual_iqr_fraction: float
    """Inter-quartile range of ``(sample - fit) / fit`` over all samples."""
    sizes_bytes: tuple[int, ...]
    median_round_trip_s: tuple[float, ...]
    messages: int
    bytes_sent: int
    seconds: float
    inferred_from: str = ""
    """Empty when measured; else the measured pair it was copied from (sampled mode)."""

    @property
    def spec(self) -> LinkSpec:
        return LinkSpec(latency_s=self.latency_s, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s)

    def to_dict(self) -> dict[str, Any]:
        return {f: (list(v) if isinstance(v, tuple) else v) for f in self.__dataclass_fields__
                for v in (getattr(self, f),)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> LinkFit:
        try:
            return LinkFit(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        except TypeError as exc:
            raise ProfileError(f"malformed link fit record: {exc}") from None


# -- fitting (pure) ------------------------------------------------------------------------


def _line(sizes: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    a = np.column_stack([np.ones(len(sizes)), sizes.astype(float)])
    coef, _ = nnls(a, times.astype(float))
    return float(coef[0]), float(coef[1])


def _alpha_beta(sizes: np.ndarray, times: np.ndarray) -> tuple[float, float, bool]:
    """``(latency, bandwidth, resolved)`` from round trips (medians per size)."""
    uniq = np.unique(sizes)
    med = np.array([np.median(times[sizes == s]) for s in uniq])
    c0, c1 = _line(uniq, med)
    if c1 > 0:
        return c0 / 2, 1.0 / c1, True
    # The transfer term is lost in the noise: the bandwidth is at least the largest size over the
    # spread of its round trips (any slower and the fit would have seen it).
    top = times[sizes == uniq[-1]]
    spread = max(float(np.ptp(top)), 1e-6)
    return c0 / 2, float(uniq[-1]) / spread, False


def fit_alpha_beta(src: str, dst: str, sizes_bytes: Sequence[int], round_trips_s: Sequence[float], *,
                   repeat_index: Sequence[int], bytes_sent: int = 0, seconds: float = 0.0) -> LinkFit:
    """Fit ``round_trip = 2 latency + n / bandwidth`` (see [Note: ping-pong probe]).

    ``repeat_index[k]`` says which repeat sample ``k`` was (control messages: every repeat),
    for the per-repeat fits that give the spread.
    """
    sizes, times = np.asarray(sizes_bytes, dtype=float), np.asarray(round_trips_s, dtype=float)
    if len(sizes) != len(times) or len(np.unique(sizes)) < 2:
        raise ProfileError(f"{src}->{dst}: need samples at >= 2 message sizes, got sizes {sorted(set(sizes_bytes))}")
    lat, bw, resolved = _alpha_beta(sizes, times)
    reps = np.asarray(repeat_index)
    lats, bws = [], []
    for r in np.unique(reps[reps >= 0]):
        keep = (reps == r) | (reps < 0)
        if len(np.unique(sizes[keep])) >= 2:
            la, ba, _ = _alpha_beta(sizes[keep], times[keep])
            lats.append(la)
            bws.append(ba)
    pred = 2 * lat + sizes / bw
    resid = (times - pred) / pred
    iqr = float(np.subtract(*np.percentile(resid, [75, 25])))
    uniq = np.unique(sizes)
    return LinkFit(
        src=src, dst=dst, latency_s=lat, bandwidth_bytes_per_s=bw, bandwidth_resolved=resolved,
        latency_range_s=(min(lats, default=lat), max(lats, default=lat)),
        bandwidth_range_bytes_per_s=(min(bws, default=bw), max(bws, default=bw)),
        residual_iqr_fraction=iqr, sizes_bytes=tuple(int(s) for s in uniq),
        median_round_trip_s=tuple(float(np.median(times[sizes == s])) for s in uniq),
        messages=len(sizes), bytes_sent=bytes_sent, seconds=seconds,
    )


# -- which pairs (pure) --------------------------------------------------------------------


def probe_pairs(cluster: Cluster, devices: Sequence[str], *, max_full_ranks: int = 64
                ) -> tuple[list[tuple[int, int]], PairMode]:
    """Unordered rank pairs to probe, and whether that is all pairs or a sample by node."""
    n = len(devices)
    if n <= max_full_ranks:
        return [(a, b) for a in range(n) for b in range(a + 1, n)], "all"
    by_node: dict[str, list[int]] = {}
    for r, d in enumerate(devices):
        by_node.setdefault(cluster.device(d).node, []).append(r)
    reps = [ranks[0] for ranks in by_node.values()]
    pairs = [(a, b) for i, a in enumerate(reps) for b in reps[i + 1:]]
    pairs += [(ranks[0], ranks[1]) for ranks in by_node.values() if len(ranks) > 1]
    return pairs, "sampled"


def link_entries(cluster: Cluster, fits: Sequence[LinkFit], mode: PairMode) -> tuple[tuple[LinkEntry, ...], dict[str, LinkSpec]]:
    """Link entries for a measured cluster, and measured node-internal links (sampled mode).

    ``all``: one directed device-to-device entry per fit. ``sampled``: fits between devices of
    two nodes become directed node-to-node entries; a fit inside a node becomes that node's
    intra link (returned separately: :class:`deepcee.cluster.Node` holds it). Either way each
    pair of islands also gets a directed island-to-island entry, the median latency and
    bandwidth of the fits between them: the cluster needs island-level links to check that
    islands are connected, and the more specific entries override them for every measured pair.
    """
    entries, intra = [], {}
    for f in fits:
        a, b = cluster.device(f.src).node, cluster.device(f.dst).node
        if mode == "all":
            entries.append(LinkEntry(a=f.src, b=f.dst, spec=f.spec, directed=True))
        elif a == b:
            intra[a] = f.spec
        else:
            entries.append(LinkEntry(a=a, b=b, spec=f.spec, directed=True))
    between: dict[tuple[str, str], list[LinkFit]] = {}
    for f in fits:
        ia, ib = cluster.device(f.src).island, cluster.device(f.dst).island
        if ia != ib:
            between.setdefault((ia, ib), []).append(f)
    for (ia, ib), fs in sorted(between.items()):
        spec = LinkSpec(latency_s=statistics.median(f.latency_s for f in fs),
                        bandwidth_bytes_per_s=statistics.median(f.bandwidth_bytes_per_s for f in fs))
        entries.append(LinkEntry(a=ia, b=ib, spec=spec, directed=True))
    return tuple(entries), intra


# -- transport (torch) -----------------------------------------------------------------------


class _Channel:
    """Ping-pong messages of one rank: gloo, plus emulated delivery when a shaper is given."""

    def __init__(self, *, rank: int, devices: Sequence[str], cluster: Cluster | None, shaper: LinkShaper | None,
                 clock: Clock, timeout_s: float) -> None:
        self.rank, self.devices, self.cluster, self.shaper = rank, devices, cluster, shaper
        self.clock, self.timeout = clock, timedelta(seconds=timeout_s)

    def post(self, nbytes: int, src: int, tag: int) -> tuple[dist.Work, torch.Tensor]:
        buf = torch.empty(nbytes + HEADER_BYTES, dtype=torch.uint8)
        return dist.irecv(buf, src=src, tag=tag), buf

    def finish(self, pending: tuple[dist.Work, torch.Tensor], what: str) -> torch.Tensor:
        work, buf = pending
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise RuntimeSetupError(f"rank {self.rank}: {what} did not arrive within "
                                    f"{self.timeout.total_seconds():g} s ({str(exc)[:120]})") from None
        n = buf.numel() - HEADER_BYTES
        if self.shaper is not None:
            self.clock.sleep_until(float(buf[n:].view(torch.float64)[0]))
        return buf[:n]

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> None:
        now = self.clock.wall()
        deliver = now
        if self.shaper is not None and self.cluster is not None:
            link = self.cluster.link(self.devices[self.rank], self.devices[dst])
            deliver = self.shaper.deliver_at(link, payload.numel(), now)
        header = torch.tensor([deliver, now], dtype=torch.float64).view(torch.uint8)
        work = dist.isend(torch.cat([payload, header]), dst=dst, tag=tag)
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise RuntimeSetupError(f"rank {self.rank}: send to rank {dst} did not complete within "
                                    f"{self.timeout.total_seconds():g} s ({str(exc)[:120]})") from None


def _control(size: int, count: int) -> torch.Tensor:
    return torch.tensor([size, count], dtype=torch.int64).view(torch.uint8)


@dataclass(slots=True)
class _Session:
    sizes: list[int]
    rtts: list[float]
    reps: list[int]
    bytes_sent: int = 0


def _sender(ch: _Channel, peer: int, budget: NetworkBudget, allowance_s: float, dilation: float) -> _Session:
    """Sender side of one session (see [Note: ping-pong probe])."""
    s = _Session(sizes=[], rtts=[], reps=[])
    tag, t_start = 0, ch.clock.wall()

    def round_trip(payload: torch.Tensor, rep: int) -> float:
        nonlocal tag
        t0 = ch.clock.wall()
        ack = ch.post(ACK_BYTES, peer, tag + 1)
        ch.send(payload, peer, tag)
        ch.finish(ack, f"acknowledgement {tag + 1} from rank {peer}")
        wall = ch.clock.wall() - t0
        tag += 2
        s.sizes.append(payload.numel())
        s.rtts.append(wall / dilation)
        s.reps.append(rep)
        s.bytes_sent += payload.numel()
        if budget.duty_cycle < 1:  # rate cap: idle so the link is busy at most duty_cycle of the time
            ch.clock.sleep(wall * (1 / budget.duty_cycle - 1))
        return wall / dilation

    if budget.warmup_bytes:  # open the connection's congestion window first (see the note); not recorded
        round_trip(_control(budget.warmup_bytes, 2), -1)
        for _ in range(2):
            round_trip(torch.zeros(budget.warmup_bytes, dtype=torch.uint8), -1)
        s.sizes.clear(), s.rtts.clear(), s.reps.clear()
    for level, size in enumerate(budget.ladder):
        base = statistics.median(t for n, t in zip(s.sizes, s.rtts, strict=True) if n == CONTROL_BYTES) if level else 0.0
        spent = ch.clock.wall() - t_start
        over = level >= 2 and (spent > allowance_s or s.bytes_sent + size * budget.repeats > budget.max_bytes_per_pair)
        if over:
            break
        round_trip(_control(size, budget.repeats), -1)
        payload = torch.zeros(size, dtype=torch.uint8)
        times = [round_trip(payload, r) for r in range(budget.repeats)]
        if level >= 1 and statistics.median(times) - base >= budget.min_transfer_s:
            break
    round_trip(_control(0, 0), -1)
    return s


def _echo(ch: _Channel, peer: int) -> None:
    """Echo side of one session: acknowledge every message until the closing control message."""
    tag = 0
    ack = torch.zeros(ACK_BYTES, dtype=torch.uint8)
    pending = ch.post(CONTROL_BYTES, peer, tag)
    while True:
        size, count = (int(v) for v in ch.finish(pending, f"control message {tag} from rank {peer}").view(torch.int64))
        plan = [size] * count
        if size:
            pending = ch.post(plan[0], peer, tag + 2)
        ch.send(ack, peer, tag + 1)
        tag += 2
        if not size:
            return
        for k in range(count):
            got = ch.finish(pending, f"message {tag} from rank {peer}")
            if got.numel() != size:
                raise RuntimeSetupError(f"rank {ch.rank}: expected {size} bytes from rank {peer}, got {got.numel()}")
            pending = ch.post(plan[k + 1] if k + 1 < count else CONTROL_BYTES, peer, tag + 2)
            ch.send(ack, peer, tag + 1)
            tag += 2


def probe_network(rank: int, devices: Sequence[str], *, cluster: Cluster | None = None,
                  shaper: LinkShaper | None = None, clock: Clock | None = None,
                  budget: NetworkBudget | None = None, dilation: float | None = None) -> tuple[list[LinkFit], PairMode]:
    """Probe every directed pair (or a sample, see [Note: probe budget]) in the default process group.

    Collective: every rank calls it with the same ``devices`` (rank ``r`` is ``devices[r]``).
    Returns the fits of the sessions this rank sent in (``src`` is this rank's device), and the
    pair mode. ``shaper`` (with ``cluster``) emulates the cluster's links; without one, times are
    divided by ``dilation`` (the relay's, in mode ``realnet``; default 1).
    """
    budget = budget or NetworkBudget()
    clock = clock or Clock()
    if shaper is not None and cluster is None:
        raise SpecError("an emulated probe needs the cluster whose links it emulates", field="cluster")
    if cluster is not None:
        pairs, mode = probe_pairs(cluster, devices, max_full_ranks=budget.max_full_ranks)
    else:  # no node information: every pair
        pairs, mode = [(a, b) for a in range(len(devices)) for b in range(a + 1, len(devices))], "all"
    sessions = [(a, b) for a, b in pairs] + [(b, a) for a, b in pairs]
    sessions.sort(key=lambda s: (min(s), max(s), s[0] != min(s)))
    ch = _Channel(rank=rank, devices=devices, cluster=cluster, shaper=shaper, clock=clock, timeout_s=budget.timeout_s)
    dilation = shaper.dilation if shaper is not None else (dilation or 1.0)
    fits, t0 = [], clock.wall()
    for k, (src, dst) in enumerate(sessions):
        if rank == src:
            left = budget.total_s - (clock.wall() - t0)
            allowance = min(budget.max_s_per_pair, max(left, 0.0) / (len(sessions) - k))
            t_pair = clock.wall()
            s = _sender(ch, dst, budget, allowance, dilation)
            fit = fit_alpha_beta(devices[src], devices[dst], s.sizes, s.rtts, repeat_index=s.reps,
                                 bytes_sent=s.bytes_sent, seconds=clock.wall() - t_pair)
            log.info("link %s -> %s: %.3g ms, %.4g Mbit/s (%d messages, %.2f s)", fit.src, fit.dst,
                     fit.latency_s * 1e3, fit.bandwidth_bytes_per_s * 8e-6, fit.messages, fit.seconds)
            fits.append(fit)
        elif rank == dst:
            _echo(ch, src)
        dist.barrier()
    return fits, mode

