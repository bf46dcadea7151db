"""Parameter servers as ranks: synchronous gradient combining (``ps`` sync) and ASGD-GA.

Server ranks are placed by :class:`~deepcee.runtime.partition.Topology` ([Note: server ranks]).
Every message goes through :class:`~deepcee.runtime.replicas.Messenger`, so on emulated links
a push or pull pays its link's latency and bandwidth, queued per link resource.

[Note: ps sync]
Exact strategy, a segment synchronised by ``ps``: every holder pushes its gradient of the
segment to its server (its island's, [Note: server ranks]); each server sums what it got,
in rank order; the servers exchange their partial sums and each adds all of them up in plan
order of ``servers`` (so every server holds the same bits); each server sends the total back
to its holders. The total is the sum over all holders, as an all-reduce would give
([Note: loss weighting] in :mod:`deepcee.runtime.trainer`). Segments go in layer order.

[Note: asgd-ga]
The ``asgd-ga`` strategy (Cloudless-Training's asynchronous SGD with gradient accumulation):
the global model lives on the servers, each segment's flat parameters split into ``S``
even element ranges, range ``i`` on server ``i`` (``S`` = number of servers), each server
with its own copy of the job's optimizer over its ranges. A replica runs ``k`` local steps
(``accumulation_steps``) on its copy of the model, summing the gradients, then its delegate
of each segment ([Note: deterministic averaging] in :mod:`deepcee.runtime.replicas`) pushes
``sum / k`` to every server and every holder pulls the servers' ranges back; it waits for
nobody else. A server applies a push (gradient -> optimizer step -> version + 1) and answers
with its new ranges. Order: the order pushes arrive (emulated delivery time), or, with
``TrainConfig.fixed_arrival_order``, replicas in turn (0, 1, ..., R-1, 0, ...), which makes
a run reproducible bit for bit. Staleness bound ``s``: a replica never computes on a model
more than ``s`` server updates old, i.e. a server holds back a push (and the pusher's pull)
while applying it would make the model of a replica that is still computing more than ``s``
updates old; replicas whose own push is waiting are not computing, so this never deadlocks.
The last round of a replica may hold fewer than ``k`` steps (``steps`` not a multiple of
``k``): it pushes the sum over the steps it ran divided by their number.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError
from deepcee.plan import Strategy
from deepcee.runtime.partition import Segment, Topology
from deepcee.runtime.replicas import (
    TAG_PULL,
    TAG_PUSH,
    TAG_SEGMENT_PUSH,
    TAG_SERVERS,
    Messenger,
    SegmentParams,
)

log = logging.getLogger(__name__)

POLL_S = 2e-4
"""How often an ``asgd-ga`` server looks for completed pushes."""


def server_rank_of(topo: Topology, cluster: Cluster, device: str) -> int:
    """The rank of the server ``device`` pushes to. See [Note: server ranks] in :mod:`deepcee.runtime.partition`."""
    island_of = {d: cluster.device(d).island for d in (device, *topo.server_ranks)}
    latency = {s: 0.0 if s == device else cluster.link(device, s).latency_s for s in topo.server_ranks}
    return topo.server_of(device, island_of, latency)


# -- exact: ps sync ---------------------------------------------------------------------------


def push_pull_gradients(m: Messenger, seg: SegmentParams, server: int) -> None:
    """A holder's side of [Note: ps sync] for one segment."""
    flat = seg.flat_grads()
    m.send(flat, server, TAG_PUSH)
    total, _ = m.recv(flat, src=server, tag=TAG_PULL)
    m.flush()
    seg.set_grads(total)


def serve_ps_segment(m: Messenger, seg: SegmentParams, holders: Sequence[int], servers: Sequence[int]) -> None:
    """A server's side of [Note: ps sync] for one segment: ``holders`` are its own (rank order)."""
    zero = torch.zeros(seg.numel, dtype=seg.params[0].dtype)
    acc = zero.clone()
    # all receives posted before any is waited for (gloo sends only into a posted receive);
    # the sum is still taken in holder order
    for p in [m.post_recv(zero, src=h, tag=TAG_PUSH) for h in holders]:
        acc.add_(m.wait(p)[0])
    parts = {m.rank: acc}
    for s in servers:
        if s != m.rank:
            m.send(acc, s, TAG_SERVERS)
    posted = {s: m.post_recv(zero, src=s, tag=TAG_SERVERS) for s in servers if s != m.rank}
    for s, p in posted.items():
        parts[s] = m.wait(p)[0]
    total = zero.clone()
    for s in servers:
        total.add_(parts[s])
    for h in holders:
        m.send(total, h, TAG_PULL)
    m.flush()


# -- relaxed: asgd-ga ---------------------------------------------------------------------------


def shard_bounds(numel: int, num_servers: int, i: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a segment's flat tensor that server ``i`` holds. See [Note: asgd-ga]."""
    return numel * i // num_servers, numel * (i + 1) // num_servers


def push_key(job: str, replica: int, round_: int, segment: int) -> str:
    """Store key a delegate sets once it has sent its push of ``segment`` (the servers poll these)."""
    return f"{job}/asgd/push/{replica}/{round_}/{segment}"


def asgd_push_pull(m: Messenger, segs: Sequence[SegmentParams], replica: int, topo: Topology, steps_run: int, *,
                   store: Any, job: str, round_: int) -> None:
    """A replica rank's side of one ``asgd-ga`` round: push (delegates), then pull every range."""
    servers = list(topo.server_ranks.values())
    for j, seg in _indexed(segs, topo):
        if seg.segment.holders[replica][0] == m.rank:
            flat = seg.flat_grads().div_(steps_run)
            for i, s in enumerate(servers):
                lo, hi = shard_bounds(flat.numel(), len(servers), i)
                m.send(flat[lo:hi], s, TAG_SEGMENT_PUSH + j)
            store.set(push_key(job, replica, round_, j), "")
    for _, seg in _indexed(segs, topo):
        flat = seg.flat_values()
        posted = [m.post_recv(flat[slice(*shard_bounds(flat.numel(), len(servers), i))], src=s, tag=TAG_PULL)
                  for i, s in enumerate(servers)]
        seg.set_values(torch.cat([m.wait(p)[0] for p in posted]))
    m.flush()


def _indexed(segs: Sequence[SegmentParams], topo: Topology) -> list[tuple[int, SegmentParams]]:
    index = {(s.start, s.stop): j for j, s in enumerate(topo.segments())}
    return [(index[(seg.segment.start, seg.segment.stop)], seg) for seg in segs]


@dataclass(frozen=True, slots=True, kw_only=True)
class AppliedPush:
    """One push a server applied (what the run records)."""

    replica: int
    version: int
    """Server version before the push."""
    staleness: int
    """Server updates since the replica pulled the model it computed the gradient on."""
    applied_s: float
    """Wall time."""


@dataclass(slots=True)
class _Push:
    grads: list[torch.Tensor] = field(default_factory=list)
    deliver: float = float("-inf")


class AsgdServer:
    """One server rank's loop for ``asgd-ga``. See [Note: asgd-ga]."""

    def __init__(self, m: Messenger, topo: Topology, blocks: Sequence[nn.Module], optimizer_factory: Any,
                 strategy: Strategy, rounds: int, *, fixed_order: bool, timeout_s: float, store: Any, job: str) -> None:
        self.m, self.topo, self.strategy, self.rounds = m, topo, strategy, rounds
        self.store, self.job = store, job
        self.fixed_order, self.timeout_s = fixed_order, timeout_s
        self.segments = topo.segments()
        servers = list(topo.server_ranks.values())
        self.index = servers.index(m.rank)
        self.shards: list[nn.Parameter] = []
        for seg in self.segments:
            flat = SegmentParams.of(seg, blocks).flat_values()
            lo, hi = shard_bounds(flat.numel(), len(servers), self.index)
            self.shards.append(nn.Parameter(flat[lo:hi].clone()))
        self.optimizer = optimizer_factory(self.shards)
        self.num_replicas = topo.plan.num_replicas
        self.version = 0
        self.pulled = [0] * self.num_replicas
        self.pushed = [0] * self.num_replicas
        self.log: list[AppliedPush] = []

    def _receive(self, r: int) -> _Push | None:
        """Replica ``r``'s next push, when every segment of it has been sent (else ``None``)."""
        keys = [push_key(self.job, r, self.pushed[r], j) for j in range(len(self.segments))]
        if not self.store.check(keys):
            return None
        push = _Push()
        for j, seg in enumerate(self.segments):
            g, at = self.m.recv(self.shards[j].detach(), src=seg.holders[r][0], tag=TAG_SEGMENT_PUSH + j,
                                wait_delivery=False)
            push.grads.append(g)
            push.deliver = max(push.deliver, at)
        return push  # the keys stay: every server reads them

    def _allowed(self, r: int, pending: dict[int, _Push]) -> bool:
        """The staleness rule: no replica still computing may end up more than ``s`` updates behind."""
        for q in range(self.num_replicas):
            computing = q != r and q not in pending and self.pushed[q] < self.rounds
            if computing and self.version + 1 - self.pulled[q] > self.strategy.staleness_bound:
                return False
        return True

    def _apply(self, r: int, push: _Push) -> None:
        for j, p in enumerate(self.shards):
            p.grad = push.grads[j].view_as(p)
        self.optimizer.step()
        self.log.append(AppliedPush(replica=r, version=self.version, staleness=self.version - self.pulled[r],
                                    applied_s=self.m.clock.wall()))
        self.version += 1
        self.pulled[r] = self.version
        self.pushed[r] += 1
        for j, seg in enumerate(self.segments):
            for h in seg.holders[r]:
                self.m.send(self.shards[j].detach(), h, TAG_PULL)

    def _choose(self, ready: dict[int, _Push], arrived: dict[int, _Push]) -> int | None:
        """The push to apply now (``None``: wait). Replicas whose push arrived are not computing."""
        if self.fixed_order:
            turn = min(range(self.num_replicas), key=lambda q: (self.pushed[q], q))
            return turn if turn in ready and self._allowed(turn, arrived) else None
        for r in sorted(ready, key=lambda q: (ready[q].deliver, q)):
            if self._allowed(r, arrived):
                return r
        return None

    def serve(self) -> list[AppliedPush]:
        """Apply every replica's ``rounds`` pushes; returns what was applied, in order."""
        arrived: dict[int, _Push] = {}
        deadline = time.monotonic() + self.timeout_s
        while min(self.pushed) < self.rounds:
            for r in range(self.num_replicas):
                if r not in arrived and self.pushed[r] < self.rounds:
                    push = self._receive(r)
                    if push is not None:
                        arrived[r] = push
            now = self.m.clock.wall()
            ready = {r: p for r, p in arrived.items() if self.m.shaper is None or p.deliver <= now}
            r = self._choose(ready, arrived)
            if r is None:
                if time.monotonic() > deadline:
                    raise RuntimeSetupError(f"{self.topo.describe(self.m.rank)}: no applicable push within "
                                            f"{self.timeout_s:g} s (pushes applied per replica: {self.pushed})")
                time.sleep(POLL_S)
                continue
            self._apply(r, arrived.pop(r))
            deadline = time.monotonic() + self.timeout_s
        self.m.flush()
        return self.log


def segment_holders_of_server(topo: Topology, cluster: Cluster, seg: Segment, server: int) -> list[int]:
    """The holders of ``seg`` that push to ``server`` (rank order). See [Note: ps sync]."""
    return sorted(h for h in seg.ranks if server_rank_of(topo, cluster, topo.device_of(h)) == server)
