"""Overlapped model averaging, one rank's side: a round of averaging in flight while local steps go on.

:class:`Rounds` holds what a rank knows of the rounds of ``model-averaging`` with
``overlap = true`` (:class:`deepcee.runtime.strategies.OverlappedAveraging` drives it):

[Note: overlapped averaging]
Streaming-DiLoCo-style: a replica does not wait for an average, it applies it one period late.
Sync point ``k`` follows every replica's local step ``(k+1) H`` (H = ``period``); ``theta_r``
is replica r's parameters, ``anchor_0`` the initial ones.

- At sync point ``k`` replica r first takes the result of round ``k-1`` (none at ``k = 0``):
  ``theta_r <- anchor_k + (theta_r - s_r^{k-1})`` (the combined model plus its own progress
  since its snapshot, computed in that order), then snapshots ``s_r^k = theta_r``, sends it
  to the segment's root (the delegates, as in [Note: deterministic averaging] in
  :mod:`deepcee.runtime.replicas`) and goes on with its next local step without waiting.
- Round ``k``'s result is ``anchor_{k+1} = outer(anchor_k, s_0^k, ..., s_{n-1}^k)`` at the
  root, in replica order: the plain mean (``mean_in_order``) or DiLoCo's Nesterov step with
  ``anchor_k`` as its anchor ([Note: outer nesterov] in :mod:`deepcee.runtime.strategies`).
  The root looks after each of its own local steps whether every copy of the round is here
  (on emulated links: delivered by the time in its header), then combines and sends the
  result as star_mean does (to each replica's delegate, which hands it on inside its replica
  when it takes it); at its next sync point it blocks for what is still missing. Each
  holder posts its receive of the result when it sends its snapshot, so transfers run in the
  background (gloo's own thread); a replica blocks at sync point ``k+1`` only for what has
  not arrived. The arithmetic is the same whenever it happens, so the result does not depend
  on timing (samples to target are calibrated in mode ``real``).
- The consistent model at sync point ``k`` is ``anchor_k``: every holder knows it there, so
  evaluations (``eval_every``, ``target_loss``) evaluate ``anchor_k`` (not the replicas' own
  copies, which differ by their progress).
- The run ends with a blocking sync point: after the last local step, a sync point (unless the
  step was one), then every replica waits for that round's result and takes it as its
  parameters: the final model is ``anchor_{K+1}``, the same on every rank. A run stopped at the
  target loss drains the round in flight and keeps the evaluated ``anchor_k``.

At most one round is in flight per rank: round ``k+1`` is sent only after round ``k``'s result
was taken. The single-process re-enactment in tests/dist does exactly these operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deepcee.runtime.replicas import (
    TAG_ROUND_GATHER,
    TAG_ROUND_SCATTER,
    Messenger,
    PendingRecv,
    SegmentParams,
    group_holders,
)

Combine = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(slots=True)
class _Round:
    """This rank's part of one round in flight."""

    index: int
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)
    gathers: dict[int, list[PendingRecv]] = field(default_factory=dict)
    """Segments this rank is the root of: the other replicas' copies, in replica order."""
    results: dict[int, PendingRecv] = field(default_factory=dict)
    """Segments this rank holds but is not the root of: the result, posted at the send."""
    combined: dict[int, torch.Tensor] = field(default_factory=dict)
    """Root segments: the result once computed."""


class Rounds:
    """The rounds of overlapped averaging on one rank. See [Note: overlapped averaging].

    ``segments``: this rank's ``(index, params)`` in layer order; ``combines(j)`` gives the
    combine of a segment this rank is the root of (the copies in replica order -> the new
    anchor); ``initial``: the segments' initial values (``anchor_0``)."""

    def __init__(self, m: Messenger, segments: Sequence[tuple[int, SegmentParams]], num_replicas: int,
                 combines: Callable[[int], Combine], initial: dict[int, torch.Tensor]) -> None:
        self.m, self.segments, self.combines = m, list(segments), combines
        self.replicas = tuple(range(num_replicas))
        self.anchor = {j: initial[j].clone() for j, _ in self.segments}
        """The newest result this rank took (``anchor_k``)."""
        self.pending: _Round | None = None
        self.sent = 0

    def _roles(self, seg: SegmentParams) -> tuple[int, list[tuple[int, ...]], tuple[int, ...]]:
        """The root, every replica's holders, and this rank's replica's holders."""
        holders = group_holders(seg.segment, self.replicas)
        return holders[0][0], holders, next(h for h in holders if self.m.rank in h)

    def send(self) -> None:
        """Snapshot every segment and start round ``sent`` (no wait)."""
        rnd = _Round(index=self.sent)
        for j, seg in self.segments:
            root, holders, mine_h = self._roles(seg)
            mine = seg.flat_values().clone()
            rnd.snapshots[j] = mine
            if self.m.rank == root:
                rnd.gathers[j] = [self.m.post_recv(mine, h[0], TAG_ROUND_GATHER) for h in holders[1:]]
                continue
            # the result comes from the root to each replica's delegate (and the root's own
            # replica), the delegate hands it on inside its replica, as star_mean's scatter
            delegate = self.m.rank == mine_h[0]
            src = root if delegate or mine_h[0] == root else mine_h[0]
            rnd.results[j] = self.m.post_recv(mine, src, TAG_ROUND_SCATTER)
            if delegate:
                self.m.send(mine, root, TAG_ROUND_GATHER)
        self.pending = rnd
        self.sent += 1

    def poll(self) -> bool:
        """Root segments of the round in flight whose copies all arrived: combine and send the
        result now. Returns whether anything was combined."""
        rnd, did = self.pending, False
        if rnd is None:
            return False
        for j, seg in self.segments:
            if j in rnd.gathers and j not in rnd.combined and all(self.m.arrived(p) for p in rnd.gathers[j]):
                self._combine(rnd, j, seg)
                did = True
        return did

    def _combine(self, rnd: _Round, j: int, seg: SegmentParams) -> None:
        copies = [self.m.wait(p)[0] for p in rnd.gathers[j]]
        out = self.combines(j)([rnd.snapshots[j], *copies])
        rnd.combined[j] = out
        root, holders, _ = self._roles(seg)
        for h in holders:  # one copy per replica crosses the WAN: to its delegate
            for r in (h if h[0] == root else h[:1]):
                if r != root:
                    self.m.send(out, r, TAG_ROUND_SCATTER)

    def take(self) -> None:
        """Wait for the round in flight (what has not arrived) and make its result the anchor."""
        rnd = self.pending
        if rnd is None:
            return
        for j, seg in self.segments:  # layer order, as every holder: a root's combine needs only the copies
            if j in rnd.gathers:
                if j not in rnd.combined:
                    self._combine(rnd, j, seg)
                self.anchor[j] = rnd.combined[j]
            else:
                self.anchor[j] = self.m.wait(rnd.results[j])[0]
                root, _, mine_h = self._roles(seg)
                if self.m.rank == mine_h[0] and mine_h[0] != root:  # hand it on inside the replica
                    for r in mine_h[1:]:
                        self.m.send(self.anchor[j], r, TAG_ROUND_SCATTER)
        self.m.flush()
        self.pending = None

    def sync_point(self) -> None:
        """Take the round in flight (keeping this replica's progress since its snapshot), then send the next."""
        rnd = self.pending
        if rnd is not None:
            self.take()
            for j, seg in self.segments:  # theta <- anchor + (theta - snapshot)
                seg.set_values(self.anchor[j] + (seg.flat_values() - rnd.snapshots[j]))
        self.send()

    def finish(self) -> None:
        """The run's last blocking step: every rank takes the round in flight as its parameters."""
        self.take()
        self.set_anchor()

    def set_anchor(self) -> None:
        for j, seg in self.segments:
            seg.set_values(self.anchor[j])


__all__ = ["Rounds"]
