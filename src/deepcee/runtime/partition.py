"""Placement of a plan on ranks, and which samples go where (torch-free arithmetic).

:class:`Topology` is the one object that maps ``(stage, device index)`` to a rank and back;
nothing else in the runtime does rank arithmetic. Rank ``r`` runs the ``r``-th device of
``plan.devices`` (stages in order, devices of a stage in plan order); ranks beyond the
plan's devices (a launch shared by several plans) are idle for that plan.

Sample bookkeeping follows [Note: share-based resharding] in :mod:`deepcee.plan`: device
``k`` of a stage owns samples ``[lo_k, hi_k)`` of every microbatch; microbatch ``m`` is
samples ``[m * microbatch_size, (m + 1) * microbatch_size)`` of the global batch. A
:class:`Piece` is one transfer's sample range, with the slice it occupies in the local
tensor (whose first dimension is the device's share).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepcee.errors import PlanError
from deepcee.plan import Plan, share_overlaps, share_ranges


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where one rank sits: stage, index in the stage's devices, device name, sample range."""

    rank: int
    stage: int
    index: int
    device: str
    lo: int
    """First sample of every microbatch this device processes."""
    hi: int
    """One past the last sample."""

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


class Topology:
    """Ranks of a plan's devices and the pieces each rank sends and receives."""

    def __init__(self, plan: Plan, world_size: int | None = None) -> None:
        self.plan = plan
        self.world_size = len(plan.devices) if world_size is None else world_size
        if self.world_size < len(plan.devices):
            raise PlanError(f"plan has {len(plan.devices)} devices, only {self.world_size} ranks were started")
        self._placements: list[Placement] = []
        for s, st in enumerate(plan.stages):
            for k, (dev, (lo, hi)) in enumerate(zip(st.devices, share_ranges(st.shares), strict=True)):
                self._placements.append(Placement(rank=len(self._placements), stage=s, index=k, device=dev, lo=lo, hi=hi))
        self._by_stage = {s: [p.rank for p in self._placements if p.stage == s] for s in range(plan.num_stages)}

    @property
    def num_active(self) -> int:
        return len(self._placements)

    def is_active(self, rank: int) -> bool:
        return rank < self.num_active

    def placement(self, rank: int) -> Placement:
        if not 0 <= rank < self.num_active:
            raise PlanError(f"rank {rank} runs no device of the plan ({self.num_active} devices)")
        return self._placements[rank]

    def rank_of(self, stage: int, index: int) -> int:
        return self._by_stage[stage][index]

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return tuple(self._by_stage[stage])

    def device_of(self, rank: int) -> str:
        return self.placement(rank).device

    def describe(self, rank: int) -> str:
        """``rank 3 (device edge0:1, stage 1)``, for error messages."""
        if not self.is_active(rank):
            return f"rank {rank} (idle)"
        p = self.placement(rank)
        return f"rank {rank} (device {p.device}, stage {p.stage})"

    def _pieces(self, rank: int, other_stage: int, sending_forward: bool) -> list[Piece]:
        me = self.placement(rank)
        src_stage, dst_stage = (me.stage, other_stage) if sending_forward else (other_stage, me.stage)
        if not 0 <= other_stage < self.plan.num_stages:
            return []
        overlaps = share_overlaps(self.plan.stages[src_stage].shares, self.plan.stages[dst_stage].shares)
        out = []
        for i, j, lo, hi in overlaps:
            mine, theirs = (i, j) if sending_forward else (j, i)
            if mine != me.index:
                continue
            peer = self.rank_of(other_stage, theirs)
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
        base = microbatch * self.plan.microbatch_size
        return base + p.lo, base + p.hi

    def loss_scale(self, rank: int) -> float:
        """Weight of this rank's per-microbatch mean loss: ``share / global_batch``."""
        return self.placement(rank).share / self.plan.global_batch
