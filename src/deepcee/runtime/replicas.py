"""Combining the copies of a layer across replicas and devices: the messages and collectives.

- :class:`Messenger`: tensors between any two ranks outside the pipeline (parameter-server
  pushes and pulls, averaging), shaped on emulated links exactly as pipeline transfers are
  (:class:`deepcee.runtime.emulation.LinkShaper`: a header carries the delivery time, the
  receiver hands the tensor over no earlier; same device: local, no delay);
- :class:`SegmentParams`: a rank's parameters of one layer segment ([Note: layer segments]
  in :mod:`deepcee.runtime.partition`), flattened in one fixed order on every rank;
- :func:`allreduce_gradients`: SUM all-reduce of a segment's gradients over a process group
  (ring or hierarchical on the emulated links: the real collective runs, then the rank waits
  for the :mod:`deepcee.comm`-style model time, as for an in-stage all-reduce);
- :func:`star_mean`: the mean of one tensor over a set of replicas, in a fixed order, at
  one root ([Note: deterministic averaging]).

[Note: deterministic averaging]
The relaxed strategies average parameters (or, with an outer optimizer, their change) across
replicas. Floating-point sums depend on their order, and a collective's order is the
library's business, so they are computed at one *root* in replica order instead: the
segment's first holder in the lowest replica of the group receives one copy per other
replica (from that replica's *delegate*, its first holder of the segment: every holder of a
stage has the same parameters), computes ``acc = x[r0].clone(); acc += x[r1]; ...;
acc /= n`` and sends the result to each replica's delegate (and to its own replica's other
holders), and each delegate hands it on to the other holders of its replica: one copy per
replica crosses the slow links (sending it to every holder put two or more copies on the same
WAN link at once). The result is the same bits as a single process doing those operations in
that order, which the tests check. Cost: a gather to the root, a scatter to the delegates and
a hand-on inside each replica, alpha-beta per link, FIFO per link resource (what the
simulator must assume for these strategies).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError
from deepcee.runtime.emulation import Clock, LinkShaper
from deepcee.runtime.paced import ChunkedWork, Pacer, chunk_bounds
from deepcee.runtime.partition import Segment, Topology

HEADER_BYTES = 16
TAG_BASE = 1 << 22
"""Tags of these messages start here, far above the pipeline's ``2m``/``2m+1``."""
TAG_PUSH, TAG_PULL, TAG_SERVERS, TAG_GATHER, TAG_SCATTER, TAG_ROUND_GATHER, TAG_ROUND_SCATTER = (
    TAG_BASE + i for i in range(7))
"""``TAG_ROUND_*``: overlapped averaging's rounds ([Note: overlapped averaging] in :mod:`deepcee.runtime.overlap`)."""
TAG_SEGMENT_PUSH = TAG_BASE + 1000
"""``asgd-ga`` pushes: one tag per segment (``+ segment index``), so a server can wait for each separately."""


@dataclass(slots=True)
class Messenger:
    """Point-to-point tensors between ranks, shaped like pipeline transfers. See the module docstring."""

    rank: int
    topo: Topology
    cluster: Cluster
    torch_device: torch.device
    timeout_s: float
    shaper: LinkShaper | None = None
    clock: Clock = field(default_factory=Clock)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    pace: bool = False
    """Pace messages to peers on other nodes at the link's rate ([Note: paced messages over
    slow links] in :mod:`deepcee.runtime.paced`; mode ``realnet``)."""
    dilation: float = 1.0
    epoch: float | None = None
    _sends: list[Any] = field(default_factory=list)
    _pacer: Pacer | None = None

    @property
    def device(self) -> str:
        return self.topo.device_of(self.rank)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Send ``tensor`` (any shape, contiguous bytes) to rank ``dst``; completes by :meth:`flush`."""
        payload = tensor.detach().contiguous().view(-1).view(torch.uint8)
        peer = self.topo.device_of(dst)
        now = self.clock.wall()
        deliver = now
        if self.shaper is not None and peer != self.device:
            deliver = self.shaper.deliver_at(self.cluster.link(self.device, peer), payload.numel(), now)
        header = torch.tensor([deliver, now], dtype=torch.float64).view(torch.uint8)
        buf = torch.cat([payload.cpu(), header]).to(self.torch_device)
        link = self._paced_link(self.device, peer)
        if link is None:
            work = dist.isend(buf, dst=dst, tag=tag)
        else:
            if self._pacer is None:
                self._pacer = Pacer(wall=self.clock.wall, dilation=self.dilation, epoch=self.epoch,
                                    timeout_s=self.timeout_s)
            work = self._pacer.schedule(buf, dst, tag, link)
        self._sends.append((work, dst, buf))
        key = f"{self.device}->{peer}"
        self.bytes_sent[key] = self.bytes_sent.get(key, 0) + payload.numel()

    def recv(self, like: torch.Tensor, src: int, tag: int, *, wait_delivery: bool = True) -> tuple[torch.Tensor, float]:
        """A tensor shaped like ``like`` from rank ``src``; with ``wait_delivery``, not before its
        emulated delivery. Returns it and its delivery (wall) time."""
        return self.wait(self.post_recv(like, src, tag), wait_delivery=wait_delivery)

    def post_recv(self, like: torch.Tensor, src: int, tag: int) -> PendingRecv:
        """Start receiving a tensor shaped like ``like`` from ``src`` (the transfer goes on in the
        background); :meth:`wait` or :meth:`arrived` it later, in posting order per ``src`` and ``tag``."""
        nbytes = like.numel() * like.element_size()
        buf = torch.empty(nbytes + HEADER_BYTES, dtype=torch.uint8, device=self.torch_device)
        bounds = chunk_bounds(buf.numel(), self._paced_link(self.topo.device_of(src), self.device))
        works = [dist.irecv(buf[lo:hi], src=src, tag=tag) for lo, hi in bounds]
        return PendingRecv(work=works[0] if len(works) == 1 else ChunkedWork(works), buf=buf, like=like, src=src)

    def _paced_link(self, src: str, dst: str) -> Any:
        """The link a message from device ``src`` to ``dst`` is paced on; ``None``: not paced."""
        if not self.pace or src == dst or self.cluster.device(src).node == self.cluster.device(dst).node:
            return None
        return self.cluster.link(src, dst)

    def arrived(self, pending: PendingRecv) -> bool:
        """Whether ``pending`` is here: received, and on an emulated link its delivery time passed."""
        if not pending.work.is_completed():
            return False
        return self.shaper is None or pending.delivery_wall() <= self.clock.wall()

    def wait(self, pending: PendingRecv, *, wait_delivery: bool = True) -> tuple[torch.Tensor, float]:
        """``pending``'s tensor and its delivery (wall) time; blocks until it is here (see :meth:`recv`)."""
        self._wait(pending.work, f"receiving from {self.topo.describe(pending.src)}")
        at = pending.delivery_wall()
        if wait_delivery and self.shaper is not None:
            if at - self.clock.wall() > self.timeout_s:  # a link down past the timeout (deepcee.cluster.outages)
                raise RuntimeSetupError(f"{self.topo.describe(self.rank)}: receiving from {self.topo.describe(pending.src)} "
                                        f"would not be delivered within {self.timeout_s:g} s (the link is dead)")
            self.clock.sleep_until(at)
        return pending.value(), at

    def flush(self) -> None:
        """Wait for every send so far (their receivers have them then)."""
        for work, dst, _buf in self._sends:
            self._wait(work, f"sending to {self.topo.describe(dst)}")
        self._sends.clear()

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RuntimeSetupError(f"{self.topo.describe(self.rank)}: {what} did not complete within "
                                    f"{self.timeout_s:g} s ({str(exc).splitlines()[0][:160]})") from None


@dataclass(slots=True, kw_only=True)
class PendingRecv:
    """A receive posted by :meth:`Messenger.post_recv`: the buffer holds the payload, then the header."""

    work: Any
    buf: torch.Tensor
    like: torch.Tensor
    src: int

    @property
    def nbytes(self) -> int:
        return self.like.numel() * self.like.element_size()

    def delivery_wall(self) -> float:
        """The emulated delivery time the sender wrote in the header (call once received)."""
        return float(self.buf[self.nbytes:].cpu().clone().view(torch.float64)[0])

    def value(self) -> torch.Tensor:
        return self.buf[:self.nbytes].view(self.like.dtype).view(self.like.shape).clone()


# -- a segment's parameters on one rank ------------------------------------------------------


@dataclass(slots=True)
class SegmentParams:
    """This rank's parameters of layers ``[segment.start, segment.stop)``, in block order."""

    segment: Segment
    params: list[nn.Parameter]

    @staticmethod
    def of(segment: Segment, blocks: Sequence[nn.Module]) -> SegmentParams:
        seen: set[int] = set()
        params = []
        for b in blocks[segment.start:segment.stop]:
            for p in b.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return SegmentParams(segment=segment, params=params)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def flat_grads(self) -> torch.Tensor:
        if not self.params:  # layers without parameters (a lone activation)
            return torch.zeros(0)
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def set_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def flat_values(self) -> torch.Tensor:
        if not self.params:
            return torch.zeros(0)
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set_values(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def allreduce_gradients(seg: SegmentParams, group: Any, *, timeout_s: float, describe: str,
                        pace: Callable[[int, float], None] | None, clock: Clock, waiter: Any = None) -> None:
    """SUM all-reduce of ``seg``'s gradients over ``group`` ([Note: loss weighting] in
    :mod:`deepcee.runtime.trainer`); ``pace(nbytes, t0)`` then waits for the modelled time.
    ``waiter``: an elastic run's (:class:`deepcee.runtime.dist.Waiter`), which watches for lost peers."""
    if not seg.params:  # every holder of parameter-less layers skips it alike
        return
    t0 = clock.wall()
    flat = seg.flat_grads()
    work = dist.all_reduce(flat, group=group, async_op=True)
    if waiter is not None:
        waiter.wait(work, timeout_s=timeout_s,
                    what=f"{describe}: gradient all-reduce of layers [{seg.segment.start}, {seg.segment.stop})")
    else:
        _wait_allreduce(work, seg, timeout_s=timeout_s, describe=describe)
    seg.set_grads(flat)
    if pace is not None:
        pace(flat.numel() * flat.element_size(), t0)


def _wait_allreduce(work: Any, seg: SegmentParams, *, timeout_s: float, describe: str) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise RuntimeSetupError(f"{describe}: gradient all-reduce of layers [{seg.segment.start}, "
                                f"{seg.segment.stop}) did not complete within {timeout_s:g} s: "
                                f"{str(exc)[:160]}") from None


# -- deterministic averaging over replicas ----------------------------------------------------


def group_holders(segment: Segment, replicas: Sequence[int]) -> list[tuple[int, ...]]:
    """The holders of ``segment`` in each replica of ``replicas`` (in that order)."""
    return [segment.holders[r] for r in replicas]


def star_mean(m: Messenger, segment: Segment, replicas: Sequence[int], mine: torch.Tensor,
              combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None) -> torch.Tensor:
    """Combine one tensor per replica of ``replicas`` (sorted) at the root and hand every holder
    the result. See [Note: deterministic averaging].

    ``mine``: this rank's tensor (only the delegates' are used). ``combine`` maps the tensors,
    in replica order, to the result (default: their mean, summed in order). Call on every
    holder of ``segment`` in ``replicas``, segments in layer order."""
    holders = group_holders(segment, replicas)
    root = holders[0][0]
    delegates = [h[0] for h in holders]
    if m.rank == root:
        # every receive posted before any is waited for: gloo transmits a message only once its
        # receive is posted, so waiting for one replica's copy first would hold the others back
        pending = [m.post_recv(mine, src=d, tag=TAG_GATHER) for d in delegates[1:]]
        xs = [mine] + [m.wait(p)[0] for p in pending]
        out = (combine or mean_in_order)(xs)
        for h in holders:  # one copy per replica crosses the WAN: to its delegate
            for r in (h if h[0] == root else h[:1]):
                if r != root:
                    m.send(out, r, TAG_SCATTER)
        m.flush()
        return out
    mine_h = next(h for h in holders if m.rank in h)
    if m.rank in delegates:
        m.send(mine, root, TAG_GATHER)
        out, _ = m.recv(mine, src=root, tag=TAG_SCATTER)
        if mine_h[0] != root:  # the delegate hands it on inside its replica (same island, fast links)
            for r in mine_h[1:]:
                m.send(out, r, TAG_SCATTER)
    else:
        out, _ = m.recv(mine, src=root if mine_h[0] == root else mine_h[0], tag=TAG_SCATTER)
    m.flush()
    return out


def mean_in_order(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(x0 + x1 + ... ) / n``, added left to right (the reference does exactly this)."""
    acc = xs[0].clone()
    for x in xs[1:]:
        acc.add_(x)
    return acc.div_(len(xs))
