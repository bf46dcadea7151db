"""Placement of a plan on ranks, and which samples go where (torch-free arithmetic).

:class:`Topology` is the one object that maps ``(replica, stage, device index)`` to a rank
and back; nothing else in the runtime does rank arithmetic. Ranks, in order:

- computing ranks: rank ``r`` runs the ``r``-th device of ``plan.devices`` (replicas in plan
  order, then stages, then the devices of a stage in plan order);
- server ranks ([Note: server ranks]): one per device of ``plan.servers`` when the plan
  needs parameter servers (a stage synchronised by ``ps``, or the ``asgd-ga`` strategy);
- ranks beyond those (a launch shared by several plans) are idle for that plan.

Sample bookkeeping follows [Note: share-based resharding] and [Note: replica batches] in
:mod:`deepcee.plan`: device ``k`` of a stage of replica ``r`` owns samples ``[lo_k, hi_k)``
of every microbatch of its replica; microbatch ``m`` of replica ``r`` is samples
``[off_r + m * mb_r, off_r + (m + 1) * mb_r)`` of the global batch (``off_r``: the replica's
first sample). A :class:`Piece` is one transfer's sample range, with the slice it occupies in
the local tensor (whose first dimension is the device's share). Pieces never cross replicas.

[Note: server ranks]
A parameter server is always a rank of its own, placed after the computing ranks, even when
its device also computes (then two processes share that device: the server's work is
receiving, summing and sending, which is not paced as device compute). Traffic between a
server and a rank on the same device is local (no link, no delay); every other message
travels on ``cluster.link(src device, dst device)`` like pipeline traffic. A computing device
talks to the server of its own island, or, when its island has none, to the server with the
lowest link latency from it (:meth:`Topology.server_of`). The simulator assumes the same.

[Note: layer segments]
Replicas may split layers differently, so gradients (and parameters, for the averaging
strategies) are combined per *segment*: a maximal run of layers held by the same devices in
every replica (the cuts are the union of all replicas' stage boundaries). A segment's holders
are, in every replica, the devices of the stage that holds it; with one replica the segments
are the stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepcee.errors import PlanError
from deepcee.plan import Plan, share_overlaps, share_ranges


def needs_servers(plan: Plan) -> bool:
    """Whether ``plan`` runs parameter servers (``ps`` sync on some stage, or ``asgd-ga``)."""
    return plan.strategy.kind == "asgd-ga" or "ps" in plan.syncs_used


def rank_devices(plan: Plan) -> tuple[str, ...]:
    """The device of every rank of a launch of ``plan``: its computing devices, then its servers."""
    return plan.devices + (plan.servers if needs_servers(plan) else ())


def replica_plan(plan: Plan, replica: int) -> Plan:
    """Replica ``replica`` of ``plan`` as a one-pipeline plan (its own batch as global batch):
    what schedule builders and per-pipeline code read."""
    if plan.num_replicas == 1:
        return plan
    rep = plan.replicas[replica]
    return Plan(system=plan.system, cluster=plan.cluster, model=plan.model, global_batch=rep.batch,
                replicas=(rep,), sync=plan.sync, servers=plan.servers)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where one computing rank sits: replica, stage, index in the stage's devices, device, samples."""

    rank: int
    stage: int
    index: int
    device: str
    lo: int
    """First sample of every microbatch (of its replica) this device processes."""
    hi: int
    """One past the last sample."""
    replica: int = 0

    @property
    def share(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """Samples ``[lo, hi)`` of a microbatch exchanged with ``peer_rank``."""

    peer_rank: int
    peer_device: str
    lo: int
    hi: int
    local_lo: int
    """Offset of the piece in this rank's local tensor (``lo - own lo``)."""

    @property
    def samples(self) -> int:
        return self.hi - self.lo

    @property
    def local(self) -> slice:
        return slice(self.local_lo, self.local_lo + self.samples)


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """Layers ``[start, stop)`` held by the same devices in every replica. See [Note: layer segments]."""

    start: int
    stop: int
    holders: tuple[tuple[int, ...], ...]
    """Per replica, the ranks that hold the segment (its stage's devices, in stage order)."""
    stages: tuple[int, ...]
    """Per replica, the stage that holds the segment."""

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every holder, replicas in order."""
        return tuple(r for rs in self.holders for r in rs)


class Topology:
    """Ranks of a plan's devices and servers, and the pieces each rank sends and receives."""

    def __init__(self, plan: Plan, world_size: int | None = None) -> None:
        self.plan = plan
        self._placements: list[Placement] = []
        for r, rep in enumerate(plan.replicas):
            for s, st in enumerate(rep.stages):
                for k, (dev, (lo, hi)) in enumerate(zip(st.devices, share_ranges(st.shares), strict=True)):
                    self._placements.append(Placement(rank=len(self._placements), replica=r, stage=s, index=k,
                                                      device=dev, lo=lo, hi=hi))
        self._by_stage = {(p.replica, p.stage): [q.rank for q in self._placements
                                                 if (q.replica, q.stage) == (p.replica, p.stage)]
                          for p in self._placements}
        servers = plan.servers if needs_servers(plan) else ()
        self.server_ranks: dict[str, int] = {d: len(self._placements) + i for i, d in enumerate(servers)}
        """Server device -> its rank. See [Note: server ranks]."""
        needed = len(self._placements) + len(self.server_ranks)
        self.world_size = needed if world_size is None else world_size
        if self.world_size < needed:
            raise PlanError(f"plan has {len(plan.devices)} devices and {len(self.server_ranks)} parameter servers, "
                            f"only {self.world_size} ranks were started")

    # -- ranks ----------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        """Computing ranks (they run a stage)."""
        return len(self._placements)

    @property
    def active_ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self._placements)

    @property
    def num_ranks(self) -> int:
        """Ranks that take part in the plan: computing ranks and server ranks."""
        return len(self._placements) + len(self.server_ranks)

    def is_active(self, rank: int) -> bool:
        """Whether ``rank`` runs a stage."""
        return 0 <= rank < len(self._placements)

    def is_server(self, rank: int) -> bool:
        return rank in self.server_ranks.values()

    def placement(self, rank: int) -> Placement:
        if not self.is_active(rank):
            raise PlanError(f"rank {rank} runs no device of the plan ({self.num_active} devices)")
        return self._placements[rank]

    def rank_of(self, stage: int, index: int, replica: int = 0) -> int:
        return self._by_stage[(replica, stage)][index]

    def stage_ranks(self, stage: int, replica: int = 0) -> tuple[int, ...]:
        return tuple(self._by_stage[(replica, stage)])

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        return tuple(p.rank for p in self._placements if p.replica == replica)

    def device_of(self, rank: int) -> str:
        for d, r in self.server_ranks.items():
            if r == rank:
                return d
        return self.placement(rank).device

    def describe(self, rank: int) -> str:
        """``rank 3 (device edge0:1, stage 1)``, for error messages."""
        if self.is_server(rank):
            return f"rank {rank} (parameter server on {self.device_of(rank)})"
        if not self.is_active(rank):
            return f"rank {rank} (idle)"
        p = self.placement(rank)
        where = f"replica {p.replica}, stage {p.stage}" if self.plan.num_replicas > 1 else f"stage {p.stage}"
        return f"rank {rank} (device {p.device}, {where})"

    def server_of(self, device: str, island_of: dict[str, str], latency_s: dict[str, float]) -> int:
        """Rank of the server ``device`` talks to: its island's, else the lowest latency
        (``latency_s``: server device -> latency from ``device``). See [Note: server ranks]."""
        if not self.server_ranks:
            raise PlanError(f"device {device!r}: the plan has no parameter servers", field="servers")
        same = [d for d in self.server_ranks if island_of[d] == island_of[device]]
        if same:
            return self.server_ranks[same[0]]
        return self.server_ranks[min(self.server_ranks, key=lambda d: (latency_s[d], list(self.server_ranks).index(d)))]

    # -- layers -----------------------------------------------------------------------------
    def segments(self) -> tuple[Segment, ...]:
        """The plan's layer segments, in layer order. See [Note: layer segments]."""
        cuts = sorted({st.layer_start for rep in self.plan.replicas for st in rep.stages} | {self.plan.num_layers})
        out = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            stages = tuple(next(s for s, st in enumerate(rep.stages) if st.layer_start <= a < st.layer_stop)
                           for rep in self.plan.replicas)
            holders = tuple(self.stage_ranks(s, r) for r, s in enumerate(stages))
            out.append(Segment(start=a, stop=b, holders=holders, stages=stages))
        return tuple(out)

    # -- samples -----------------------------------------------------------------------------
    def _pieces(self, rank: int, other_stage: int, sending_forward: bool) -> list[Piece]:
        me = self.placement(rank)
        stages = self.plan.replicas[me.replica].stages
        src_stage, dst_stage = (me.stage, other_stage) if sending_forward else (other_stage, me.stage)
        if not 0 <= other_stage < len(stages):
            return []
        out = []
        for i, j, lo, hi in share_overlaps(stages[src_stage].shares, stages[dst_stage].shares):
            mine, theirs = (i, j) if sending_forward else (j, i)
            if mine != me.index:
                continue
            peer = self.rank_of(other_stage, theirs, me.replica)
            out.append(Piece(peer_rank=peer, peer_device=self.device_of(peer), lo=lo, hi=hi, local_lo=lo - me.lo))
        return out

    def forward_sends(self, rank: int) -> list[Piece]:
        """Activation pieces this rank sends to the next stage."""
        return self._pieces(rank, self.placement(rank).stage + 1, sending_forward=True)

    def forward_recvs(self, rank: int) -> list[Piece]:
        """Activation pieces this rank receives from the previous stage."""
        return self._pieces(rank, self.placement(rank).stage - 1, sending_forward=False)

    def backward_sends(self, rank: int) -> list[Piece]:
        """Input-gradient pieces this rank sends to the previous stage (same ranges as forward_recvs)."""
        return self.forward_recvs(rank)

    def backward_recvs(self, rank: int) -> list[Piece]:
        """Output-gradient pieces this rank receives from the next stage."""
        return self.forward_sends(rank)

    def global_samples(self, rank: int, microbatch: int) -> tuple[int, int]:
        """``[lo, hi)`` of this rank's samples of ``microbatch`` in the global batch."""
        p = self.placement(rank)
        base = self.plan.replica_offsets()[p.replica] + microbatch * self.plan.replicas[p.replica].microbatch_size
        return base + p.lo, base + p.hi

    def loss_scale(self, rank: int) -> float:
        """Weight of this rank's per-microbatch mean loss: ``share / global_batch`` under the
        exact strategy ([Note: loss weighting] in :mod:`deepcee.runtime.trainer`), ``share /
        replica batch`` under a relaxed one (each replica takes steps on its own batch's mean)."""
        p = self.placement(rank)
        whole = self.plan.global_batch if self.plan.strategy.kind == "exact" else self.plan.replicas[p.replica].batch
        return p.share / whole

