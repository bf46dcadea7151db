"""Point-to-point transport of activations and input gradients between adjacent stages.

Who sends what follows [Note: share-based resharding] (:class:`deepcee.runtime.partition.Topology`
computes the pieces): for microbatch ``m``, sender ``i`` of stage ``s`` sends receiver ``j``
of stage ``s+1`` exactly the samples they share, and the gradients go back the same way.

A boundary is a tensor or a small fixed structure of tensors (:mod:`deepcee.runtime.boundary`);
forward messages carry every tensor of it, backward messages the gradients of the tensors that
get one ([Note: boundary gradients]). Wire format: one ``uint8`` message per piece, each
carried tensor's bytes of the piece's samples (each starting at a multiple of
:data:`ALIGN_BYTES`) followed by a 16-byte header (``float64`` delivery time, ``float64`` send
time, both wall seconds of the run's shared clock). The receiver hands the piece over no earlier than its delivery time, which
is "now" for real links and the emulated arrival for emulated links
(:class:`deepcee.runtime.emulation.LinkShaper`). Shapes and dtypes are agreed once at
start-up through the store (:func:`exchange_metadata`), so buffers are sized without
per-message metadata, and a mismatch is a :class:`RuntimeSetupError` naming the peer.

Every received piece is also timed, for the adapter's link monitor (no probe traffic: only
the pipeline's own transfers): :attr:`LinkStats.transfers` holds ``(link resource, bytes,
send start, delivery)`` per piece, wall seconds of the shared clock. Delivery is the
emulated arrival for emulated links (exact: the shaper's, whatever the receiver was doing);
for real links it is when the receiver's wait returned, which is late when the receiver was
busy, and the send start is only comparable on one host (one ``CLOCK_MONOTONIC``).

Receives are tagged ``2m`` (forward) / ``2m+1`` (backward). On CPU/gloo they are posted
when the step starts by default (a gloo send waits for the receiver's ready notice,
PLATFORM.md) and every send buffer is kept until the step ends; on CUDA/NCCL, which
serialises a pair's sends and receives on one stream, and on CPU when the launch asks for it
(:attr:`deepcee.runtime.job.TrainConfig.receives`), each receive is posted when the schedule
reaches it and each send buffer is dropped once its send completed ([Note: in-order
receives]). Every wait has a timeout naming the peer rank and device;
how it waits is the rank's :class:`~deepcee.runtime.dist.Waiter` (an elastic run's watches for
lost peers). An emulated delivery further away than the timeout is a dead link.

[Note: in-order receives]
With ``prepost=False`` a rank posts each receive when its action list reaches it and waits
for it at once; it never waits for a send before :meth:`P2P.end_step`, and at every send and
receive it drops the sends that completed (:meth:`P2P._reap`: their buffers are freed, an
error they carry is raised). No rank therefore blocks on anything but a receive its own
schedule reached, in the schedule's order, and every send it depends on was issued without
waiting: a schedule the simulator runs without deadlock (async sends) runs here too, the
zero-bubble ones included. The number of sends kept is deliberately not bounded: waiting
for the oldest send once a bound is reached would make a rank wait for its peer to reach a
receive, and a peer's schedule may reach that receive only after this rank's later sends
(zero-bubble schedules reorder forwards and input gradients per stage), a cycle. What is kept
is what the peers did not yet receive: a forward send of microbatch ``m`` completes no later
than the next stage's receive of ``m``, which comes before that stage's backward of ``m``,
which this stage needs before ``m`` leaves flight here, so at most the stage's in-flight count
of forward sends is kept; a backward send completes at the previous stage's receive of it,
which that stage posts in its own backward of ``m``. The memory model counts communication
buffers for the microbatches in flight (:func:`deepcee.simulator.memory.runtime_buffer_bytes`,
runtime ``deepcee-cuda``).
"""

from __future__ import annotations

import json
import logging
import socket
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.runtime.boundary import BoundaryMeta, TensorMeta
from deepcee.runtime.dist import BlockingWaiter, Waiter
from deepcee.runtime.emulation import Clock, LinkShaper
from deepcee.runtime.partition import Piece, Topology
from deepcee.schedule.ir import Action, ActionKind

log = logging.getLogger(__name__)
K = ActionKind
HEADER_BYTES = 16
ALIGN_BYTES = 16
"""Each tensor's bytes in a message start at a multiple of this (so they view as any dtype)."""
Meta = TensorMeta | BoundaryMeta
AGREE_HINTS = {
    "data": "a data stream must give every rank the same samples (seed its shuffling)",
    "model": "every rank must build the same model (a builder must be deterministic: deepcee seeds torch's RNG "
             "from the run's seed before calling it)",
}
"""Why each digest of :func:`exchange_metadata`'s ``agree`` must be the same on every rank."""


def _store_get(store: dist.Store, key: str, timeout_s: float, what: str) -> str:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return store.get(key).decode()
    except (RuntimeError, dist.DistStoreError) as exc:
        raise RuntimeSetupError(f"no {what} within {timeout_s:g} s ({type(exc).__name__})") from None


def exchange_metadata(store: dist.Store, topology: Topology, rank: int, *, job: str, plan_digest: str,
                      output_meta: Callable[[Meta | None], Meta | None],
                      timeout_s: float, same_host: bool = False,
                      agree: Mapping[str, str | None] | None = None) -> tuple[Meta | None, Meta | None]:
    """Agree on the plan and on boundary shapes; returns ``(input meta, output meta)`` of this rank.

    Every active rank publishes the digest of its plan; then, stage by stage, each rank takes
    the per-sample output meta of its forward peers, checks they agree, dry-runs its stage
    (``output_meta``) and publishes its own. Problems name the peer rank and device. With
    ``same_host`` (emulation: one shared clock), every rank must run on this machine. Every
    digest in ``agree`` must be the same on every rank (:data:`AGREE_HINTS` says why each matters).
    """
    me = topology.describe(rank)
    host = socket.gethostname()
    store.set(f"{job}/hello/{rank}", json.dumps({"plan": plan_digest, "device": topology.device_of(rank), "host": host,
                                                  "agree": dict(agree or {})}))
    # the plan's ranks through the topology (not 0..n-1: an adaptive run keeps each device's
    # rank whatever plan is in force)
    peers = list(topology.active_ranks)  # every replica's computing ranks
    for peer in peers:
        hello = json.loads(_store_get(store, f"{job}/hello/{peer}", timeout_s, f"start-up message from {topology.describe(peer)} to {me}"))
        if hello["plan"] != plan_digest or hello["device"] != topology.device_of(peer):
            raise RuntimeSetupError(
                f"{me}: {topology.describe(peer)} runs a different plan (digest {hello['plan']} device "
                f"{hello['device']!r}, mine {plan_digest})"
            )
        for key, mine in (agree or {}).items():
            theirs = hello.get("agree", {}).get(key)
            if theirs != mine:
                raise RuntimeSetupError(f"{me}: {topology.describe(peer)} has another {key} (digest {theirs}, mine "
                                        f"{mine}): {AGREE_HINTS.get(key, 'every rank must have the same')}")
        if same_host and hello.get("host", host) != host:
            raise RuntimeSetupError(
                f"{me}: emulation needs every rank on one machine (one clock), but {topology.describe(peer)} "
                f"runs on {hello['host']!r} and this rank on {host!r}; use mode 'real'"
            )
    in_meta = None
    for piece in topology.forward_recvs(rank):
        text = _store_get(store, f"{job}/meta/{piece.peer_rank}", timeout_s,
                          f"output shape from {topology.describe(piece.peer_rank)} to {me}")
        meta = TensorMeta.from_json(text)
        if in_meta is not None and meta != in_meta:
            raise RuntimeSetupError(
                f"{me}: {topology.describe(piece.peer_rank)} sends per-sample {meta}, another sender sends {in_meta}"
            )
        in_meta = meta
    peers = ", ".join(topology.describe(p.peer_rank) for p in topology.forward_recvs(rank))
    try:
        out_meta = output_meta(in_meta)
    except Exception as exc:  # the stage cannot take what the previous stage (or the data) produces
        source = f"the output of {peers} (per-sample {in_meta})" if peers else "a sample of the data"
        raise RuntimeSetupError(f"{me} cannot run on {source}: {type(exc).__name__}: {exc}") from None
    store.set(f"{job}/meta/{rank}", json.dumps(None) if out_meta is None else out_meta.to_json())
    return in_meta, out_meta


@dataclass(slots=True)
class LinkStats:
    """What one rank saw on its transfers in one step (wall seconds)."""

    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """``"src->dst"`` device pair -> bytes."""
    recv_wait_s: float = 0.0
    """Time the device waited in receives (data not there yet or emulated delivery pending)."""
    transfers: list[tuple[str, int, float, float]] = field(default_factory=list)
    """``(link resource, bytes, send start, delivery)`` of every piece received (wall seconds)."""


@dataclass(slots=True)
class _Pending:
    work: dist.Work | None
    buf: torch.Tensor
    piece: Piece
    what: str


def prepost_receives(receives: str, device: torch.device) -> bool:
    """Whether to post a step's receives when it starts (``receives``: the launch's
    :attr:`~deepcee.runtime.job.TrainConfig.receives`; ``auto``: on CPU only)."""
    if receives == "auto":
        return device.type != "cuda"
    return receives == "at-step-start"


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True, slots=True)
class _Wire:
    """The tensors one direction's messages carry: forward, every tensor of the boundary;
    backward, the gradients of those that get one ([Note: boundary gradients] in
    :mod:`deepcee.runtime.boundary`)."""

    meta: BoundaryMeta
    carried: tuple[int, ...]
    """Indices (among the boundary's tensors) of the tensors in each message, in order."""

    def message_bytes(self, samples: int) -> int:
        """Padded payload bytes of a piece of ``samples`` samples (without the header)."""
        return sum(_aligned(samples * self.meta.tensors[i].bytes_per_sample) for i in self.carried)


class P2P:
    """Sends and receives the pieces of one rank. See the module docstring.

    A message holds each carried tensor's bytes of the piece's samples, each starting at a
    multiple of :data:`ALIGN_BYTES`, then the header."""

    def __init__(self, *, topology: Topology, rank: int, device: torch.device, timeout_s: float,
                 in_meta: Meta | None, out_meta: Meta | None, cluster: Cluster | None = None,
                 shaper: LinkShaper | None = None, clock: Clock | None = None, prepost: bool = True,
                 waiter: Waiter | None = None) -> None:
        self.topo, self.rank, self.device, self.timeout_s = topology, rank, device, timeout_s
        self.waiter = waiter or BlockingWaiter()
        self.in_meta, self.out_meta = in_meta, out_meta
        self.cluster, self.shaper, self.clock, self.prepost = cluster, shaper, clock or Clock(), prepost
        self.me = topology.placement(rank)
        self.pieces = {
            K.RECV_F: topology.forward_recvs(rank), K.SEND_F: topology.forward_sends(rank),
            K.RECV_B: topology.backward_recvs(rank), K.SEND_B: topology.backward_sends(rank),
        }
        self._recvs: dict[tuple[ActionKind, int], list[_Pending]] = {}
        self._sends: list[_Pending] = []
        self.stats = LinkStats()

    # -- receives ------------------------------------------------------------------------
    def _wire(self, kind: ActionKind) -> _Wire:
        # Forward pieces carry the previous stage's output; backward pieces carry the
        # gradient of this stage's output, which has this stage's output meta.
        meta = self.in_meta if kind in (K.RECV_F, K.SEND_B) else self.out_meta
        if meta is None:
            raise RuntimeSetupError(f"{self.topo.describe(self.rank)}: no agreed shape for {kind} pieces")
        meta = BoundaryMeta.coerce(meta)
        forward = kind in (K.RECV_F, K.SEND_F)
        return _Wire(meta=meta, carried=tuple(i for i, t in enumerate(meta.tensors) if forward or t.gets_grad))

    def _post(self, kind: ActionKind, m: int) -> list[_Pending]:
        wire = self._wire(kind)
        tag = 2 * m + (kind == K.RECV_B)
        out = []
        for p in self.pieces[kind]:
            buf = torch.empty(wire.message_bytes(p.samples) + HEADER_BYTES, dtype=torch.uint8, device=self.device)
            work = dist.irecv(buf, src=p.peer_rank, tag=tag)
            what = "activation" if kind == K.RECV_F else "gradient"
            out.append(_Pending(work=work, buf=buf, piece=p, what=f"{what} of microbatch {m}"))
        return out

    def begin_step(self, actions: Sequence[Action]) -> None:
        """Post every receive of this step's (lowered) actions, when pre-posting."""
        self.stats = LinkStats()
        if not self.prepost:
            return
        for a in actions:
            if a.kind in (K.RECV_F, K.RECV_B):
                self._recvs[(a.kind, a.microbatch)] = self._post(a.kind, a.microbatch)

    def _what(self, pending: _Pending, verb: str) -> str:
        return (f"{self.topo.describe(self.rank)}: {verb} {pending.what} {'from' if verb == 'receiving' else 'to'} "
                f"{self.topo.describe(pending.piece.peer_rank)}")

    def _wait(self, pending: _Pending, verb: str) -> None:
        self.waiter.wait(pending.work, timeout_s=self.timeout_s, what=self._what(pending, verb),
                         peer=pending.piece.peer_device)

    def _reap(self) -> None:
        """In order: drop the sends that completed (their buffers go; [Note: in-order receives])."""
        if self.prepost or not self._sends:
            return
        kept = []
        for p in self._sends:
            if p.work is not None and p.work.is_completed():
                self._wait(p, "sending")  # returns at once; raises what the send failed with
            else:
                kept.append(p)
        self._sends = kept

    def _receive(self, kind: ActionKind, m: int) -> Any:
        self._reap()
        pending = self._recvs.pop((kind, m), None) or self._post(kind, m)
        wire = self._wire(kind)
        t0 = self.clock.wall()
        outs = {i: torch.empty((self.me.share, *wire.meta.tensors[i].shape), dtype=wire.meta.tensors[i].torch_dtype,
                               device=self.device) for i in wire.carried}
        deliver = float("-inf")
        for p in pending:
            self._wait(p, "receiving")
            n, off = 0, 0
            for i in wire.carried:
                meta = wire.meta.tensors[i]
                size = p.piece.samples * meta.bytes_per_sample
                outs[i][p.piece.local] = p.buf[off:off + size].view(meta.torch_dtype).view(p.piece.samples, *meta.shape)
                n, off = n + size, off + _aligned(size)
            at, sent = (float(v) for v in p.buf[off:].cpu().view(torch.float64))
            deliver = max(deliver, at)
            arrived = at if self.shaper is not None else self.clock.wall()
            self.stats.transfers.append((self._resource(p.piece.peer_device), n, sent, arrived))
        if self.shaper is not None:  # only emulated runs share one clock across processes
            self.waiter.sleep_until(self.clock, deliver, timeout_s=self.timeout_s,
                                    what=self._what(pending[-1], "receiving"), peer=pending[-1].piece.peer_device)
        self.stats.recv_wait_s += self.clock.wall() - t0
        return wire.meta.build([outs.get(i) for i in range(len(wire.meta.tensors))])

    def _resource(self, src_device: str) -> str:
        """The link resource a piece from ``src_device`` to this device travels on."""
        if self.cluster is None:
            return f"{src_device}->{self.me.device}"
        return self.cluster.link(src_device, self.me.device).resource

    def recv_forward(self, m: int) -> Any:
        return self._receive(K.RECV_F, m)

    def recv_backward(self, m: int) -> Any:
        return self._receive(K.RECV_B, m)

    # -- sends ---------------------------------------------------------------------------
    def _payload(self, wire: _Wire, value: Any, kind: ActionKind) -> list[torch.Tensor]:
        """The carried tensors of ``value`` (a boundary value or its gradient structure)."""
        try:
            leaves = wire.meta.pick(value)
        except SpecError as exc:
            raise RuntimeSetupError(f"{self.topo.describe(self.rank)}: {kind} of a value that is not the agreed "
                                    f"boundary: {exc}") from None
        missing = [i for i in wire.carried if leaves[i] is None]
        if missing:
            raise RuntimeSetupError(f"{self.topo.describe(self.rank)}: {kind} lacks boundary tensors {missing} "
                                    f"({wire.meta.describe()})")
        return [leaves[i] for i in wire.carried]

    def _send(self, kind: ActionKind, m: int, value: Any) -> None:
        tag = 2 * m + (kind == K.SEND_B)
        wire = self._wire(kind)
        carried = self._payload(wire, value, kind)
        for p in self.pieces[kind]:
            parts, n = [], 0
            for t in carried:
                payload = t[p.local].detach().contiguous().view(-1).view(torch.uint8)
                n += payload.numel()
                parts.append(payload)
                pad = _aligned(payload.numel()) - payload.numel()
                if pad:
                    parts.append(torch.zeros(pad, dtype=torch.uint8, device=payload.device))
            now = self.clock.wall()
            deliver = now
            if self.shaper is not None and self.cluster is not None:
                link = self.cluster.link(self.me.device, p.peer_device)
                deliver = self.shaper.deliver_at(link, n, now)
            header = torch.tensor([deliver, now], dtype=torch.float64).view(torch.uint8).to(self.device)
            buf = torch.cat([*parts, header])
            work = dist.isend(buf, dst=p.peer_rank, tag=tag)
            what = "activation" if kind == K.SEND_F else "gradient"
            self._sends.append(_Pending(work=work, buf=buf, piece=p, what=f"{what} of microbatch {m}"))
            self.stats.bytes_sent[f"{self.me.device}->{p.peer_device}"] += n
        self._reap()

    def send_forward(self, m: int, value: Any) -> None:
        self._send(K.SEND_F, m, value)

    def send_backward(self, m: int, value: Any) -> None:
        self._send(K.SEND_B, m, value)

    def end_step(self) -> LinkStats:
        """Wait for this step's sends (their receivers have them by then); returns the step's stats."""
        for p in self._sends:
            self._wait(p, "sending")
        self._sends.clear()
        if self._recvs:
            left = sorted(f"{k}{m}" for k, m in self._recvs)
            raise RuntimeSetupError(f"{self.topo.describe(self.rank)}: receives posted but never used: {left}")
        return self.stats

