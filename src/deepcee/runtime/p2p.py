"""Point-to-point transport of activations and input gradients between adjacent stages.

Who sends what follows [Note: share-based resharding] (:class:`deepcee.runtime.partition.Topology`
computes the pieces): for microbatch ``m``, sender ``i`` of stage ``s`` sends receiver ``j``
of stage ``s+1`` exactly the samples they share, and the gradients go back the same way.

Wire format: one ``uint8`` message per piece, the tensor's bytes followed by a 16-byte
header (``float64`` delivery time, ``float64`` send time, both wall seconds of the run's
shared clock). The receiver hands the piece over no earlier than its delivery time, which
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

Receives of a step are posted before the step starts (gloo: a blocking send waits for the
receiver, PLATFORM.md), tagged ``2m`` (forward) / ``2m+1`` (backward). On NCCL, which has
no tags and serialises a pair's sends and receives on one stream, receives are posted when
the schedule reaches them instead. Every wait has a timeout naming the peer rank and device.
"""

from __future__ import annotations

import json
import logging
import socket
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError
from deepcee.runtime.emulation import Clock, LinkShaper
from deepcee.runtime.partition import Piece, Topology
from deepcee.schedule.ir import Action, ActionKind

log = logging.getLogger(__name__)
K = ActionKind
HEADER_BYTES = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    """Per-sample shape and dtype of a tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_sample(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(shape=tuple(t.shape[1:]), dtype=str(t.dtype).removeprefix("torch."))

    def to_json(self) -> str:
        return json.dumps({"shape": list(self.shape), "dtype": self.dtype})

    @staticmethod
    def from_json(text: str) -> TensorMeta | None:
        d = json.loads(text)
        return None if d is None else TensorMeta(shape=tuple(d["shape"]), dtype=d["dtype"])


def _store_get(store: dist.Store, key: str, timeout_s: float, what: str) -> str:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return store.get(key).decode()
    except (RuntimeError, dist.DistStoreError) as exc:
        raise RuntimeSetupError(f"no {what} within {timeout_s:g} s ({type(exc).__name__})") from None


def exchange_metadata(store: dist.Store, topology: Topology, rank: int, *, job: str, plan_digest: str,
                      output_meta: Callable[[TensorMeta | None], TensorMeta | None],
                      timeout_s: float, same_host: bool = False) -> tuple[TensorMeta | None, TensorMeta | None]:
    """Agree on the plan and on boundary shapes; returns ``(input meta, output meta)`` of this rank.

    Every active rank publishes the digest of its plan; then, stage by stage, each rank takes
    the per-sample output meta of its forward peers, checks they agree, dry-runs its stage
    (``output_meta``) and publishes its own. Problems name the peer rank and device. With
    ``same_host`` (emulation: one shared clock), every rank must run on this machine.
    """
    me = topology.describe(rank)
    host = socket.gethostname()
    store.set(f"{job}/hello/{rank}", json.dumps({"plan": plan_digest, "device": topology.device_of(rank), "host": host}))
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
    except Exception as exc:  # the stage cannot take what the previous stage produces
        raise RuntimeSetupError(
            f"{me} cannot run on the output of {peers} (per-sample {in_meta}): {type(exc).__name__}: {exc}"
        ) from None
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


class P2P:
    """Sends and receives the pieces of one rank. See the module docstring."""

    def __init__(self, *, topology: Topology, rank: int, device: torch.device, timeout_s: float,
                 in_meta: TensorMeta | None, out_meta: TensorMeta | None, cluster: Cluster | None = None,
                 shaper: LinkShaper | None = None, clock: Clock | None = None, prepost: bool = True) -> None:
        self.topo, self.rank, self.device, self.timeout_s = topology, rank, device, timeout_s
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
    def _meta(self, kind: ActionKind) -> TensorMeta:
        # Forward pieces carry the previous stage's output; backward pieces carry the
        # gradient of this stage's output, which has this stage's output meta.
        meta = self.in_meta if kind in (K.RECV_F, K.SEND_B) else self.out_meta
        if meta is None:
            raise RuntimeSetupError(f"{self.topo.describe(self.rank)}: no agreed shape for {kind} pieces")
        return meta

    def _post(self, kind: ActionKind, m: int) -> list[_Pending]:
        meta = self._meta(kind)
        tag = 2 * m + (kind == K.RECV_B)
        out = []
        for p in self.pieces[kind]:
            buf = torch.empty(p.samples * meta.bytes_per_sample + HEADER_BYTES, dtype=torch.uint8, device=self.device)
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

    def _wait(self, pending: _Pending, verb: str) -> None:
        try:
            pending.work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RuntimeSetupError(
                f"{self.topo.describe(self.rank)}: {verb} {pending.what} "
                f"{'from' if verb == 'receiving' else 'to'} {self.topo.describe(pending.piece.peer_rank)} "
                f"did not complete within {self.timeout_s:g} s ({str(exc).splitlines()[0][:160]})"
            ) from None

    def _receive(self, kind: ActionKind, m: int) -> torch.Tensor:
        pending = self._recvs.pop((kind, m), None) or self._post(kind, m)
        meta = self._meta(kind)
        t0 = self.clock.wall()
        out = torch.empty((self.me.share, *meta.shape), dtype=meta.torch_dtype, device=self.device)
        deliver = float("-inf")
        for p in pending:
            self._wait(p, "receiving")
            n = p.buf.numel() - HEADER_BYTES
            out[p.piece.local] = p.buf[:n].view(meta.torch_dtype).view(p.piece.samples, *meta.shape)
            at, sent = (float(v) for v in p.buf[n:].cpu().view(torch.float64))
            deliver = max(deliver, at)
            arrived = at if self.shaper is not None else self.clock.wall()
            self.stats.transfers.append((self._resource(p.piece.peer_device), n, sent, arrived))
        if self.shaper is not None:  # only emulated runs share one clock across processes
            self.clock.sleep_until(deliver)
        self.stats.recv_wait_s += self.clock.wall() - t0
        return out

    def _resource(self, src_device: str) -> str:
        """The link resource a piece from ``src_device`` to this device travels on."""
        if self.cluster is None:
            return f"{src_device}->{self.me.device}"
        return self.cluster.link(src_device, self.me.device).resource

    def recv_forward(self, m: int) -> torch.Tensor:
        return self._receive(K.RECV_F, m)

    def recv_backward(self, m: int) -> torch.Tensor:
        return self._receive(K.RECV_B, m)

    # -- sends ---------------------------------------------------------------------------
    def _send(self, kind: ActionKind, m: int, tensor: torch.Tensor) -> None:
        tag = 2 * m + (kind == K.SEND_B)
        for p in self.pieces[kind]:
            payload = tensor[p.local].detach().contiguous().view(-1).view(torch.uint8)
            now = self.clock.wall()
            deliver = now
            if self.shaper is not None and self.cluster is not None:
                link = self.cluster.link(self.me.device, p.peer_device)
                deliver = self.shaper.deliver_at(link, payload.numel(), now)
            header = torch.tensor([deliver, now], dtype=torch.float64).view(torch.uint8).to(self.device)
            buf = torch.cat([payload, header])
            work = dist.isend(buf, dst=p.peer_rank, tag=tag)
            what = "activation" if kind == K.SEND_F else "gradient"
            self._sends.append(_Pending(work=work, buf=buf, piece=p, what=f"{what} of microbatch {m}"))
            self.stats.bytes_sent[f"{self.me.device}->{p.peer_device}"] += payload.numel()

    def send_forward(self, m: int, tensor: torch.Tensor) -> None:
        self._send(K.SEND_F, m, tensor)

    def send_backward(self, m: int, tensor: torch.Tensor) -> None:
        self._send(K.SEND_B, m, tensor)

    def end_step(self) -> LinkStats:
        """Wait for this step's sends (their receivers have them by then); returns the step's stats."""
        for p in self._sends:
            self._wait(p, "sending")
        self._sends.clear()
        if self._recvs:
            left = sorted(f"{k}{m}" for k, m in self._recvs)
            raise RuntimeSetupError(f"{self.topo.describe(self.rank)}: receives posted but never used: {left}")
        return self.stats
