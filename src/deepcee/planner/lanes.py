"""Every device of a plan timed at once for the cost model (torch-free): the simulator's pipeline,
one numpy vector per stage (see [Note: devices at once]); :mod:`deepcee.planner.cost_model` uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepcee.cluster import Cluster
from deepcee.errors import ScheduleError
from deepcee.plan import StagePlan, share_overlaps
from deepcee.profile import ModelProfile
from deepcee.schedule.ir import ActionKind, Schedule
from deepcee.simulator.engine import wire_bytes
from deepcee.simulator.runtime_model import RuntimeModel

PASSES = (ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B)
_PASS = {kind: k for k, kind in enumerate(PASSES)}
_SEND = {ActionKind.SEND_F: 0, ActionKind.SEND_B: 1}
_RECV = {ActionKind.RECV_F: 0, ActionKind.RECV_B: 1}

# [Note: devices at once]
# In the simulator every device of a stage runs the stage's list on its own; a send issues one
# piece per sample overlap with the peer stage's devices ([Note: share-based resharding] in
# :mod:`deepcee.plan`), each on its link's pipe, first in first out by issue time; a receive
# waits for all of its device's pieces. Every device of a stage runs the same list, so the
# simulator's times are, up to the order of a pipe's pieces, a fixed recursion over the list's
# actions with one entry per device: :func:`devices_at_once` walks the actions once (every send
# before its receive) on one numpy vector per stage. A compute adds the devices' durations; a
# send computes its pieces' issue times (the senders' clocks; with the receive handshake no
# earlier than the piece's latency), serves each pipe's pieces of this send in issue order (ties:
# sender device order, then the sender's pieces in order, as the simulator issues them) after the
# pipe's previous pieces, and delivers each a latency later; a receive waits for the latest of
# its device's pieces; a blocking send holds its device until its own last delivery.
# What differs from the simulator: a pipe serves the pieces of one send after those of the
# sender stage's earlier sends (program order), while the simulator serves by issue time, so when
# two devices sharing a pipe run a microbatch or more apart, the ahead device's later piece goes
# first there (on the top 20 plans at 512 devices: 1-3% of pieces, up to 0.8% of the iteration);
# pipes shared by two boundaries are queued apart; a bandwidth trace is taken at time 0.
# Session 5 timed sample lanes (one device per stage, the undominated chains) apart, each on the
# boundary-wide link costs, and charged a lane queued behind another on a shared pipe a start lag
# once: errors of +-0.5% both ways on the top 20 plans at 256 and 512 devices (Kendall tau 0.80
# and 0.81 on main's top 20s before this), because the pipe's order, and so which lane lags and
# by how much, depends on the lanes' times; here it comes out of the recursion.


@dataclass(frozen=True, slots=True)
class Pieces:
    """The pieces one boundary direction's send issues, one per sample overlap of a sender and a
    receiver device (the simulator's), as arrays; see [Note: devices at once]."""

    sender: np.ndarray
    """Per piece, the sending device's index in its stage."""
    latency_s: np.ndarray
    serialization_s: np.ndarray
    resource: np.ndarray
    """Per piece, its pipe (numbered from 0 within the boundary direction)."""
    num_resources: int
    order: np.ndarray | None
    """``None`` when every pipe carries one piece; else per piece its rank among simultaneous
    sends (the simulator's: sender device order, then its pieces in order)."""
    rank_pos: tuple[np.ndarray, ...]
    """Per rank ``r`` inside a pipe's pieces, the positions (in pipe-major order) of the pipes' ``r``-th
    piece (pipes with more than ``r`` pieces)."""
    first_res: np.ndarray
    """Per pipe, its first position in pipe-major order; ``last_pos`` its last."""
    last_pos: np.ndarray
    to_receiver: np.ndarray
    """Per receiver device, its pieces' indices (padded with the index of an always-earliest slot)."""
    to_sender: np.ndarray
    """Per sender device, its pieces' indices (padded likewise)."""


def boundary_pieces(cluster: Cluster, model: ModelProfile, src: StagePlan, dst: StagePlan, direction: int) -> Pieces:
    """:class:`Pieces` of one direction (0: ``src -> dst``, 1: back) of the boundary between two stages."""
    per_sample = model.boundary_bytes(src.layer_stop)
    rows = []
    for i, j, lo, hi in share_overlaps(src.shares, dst.shares):
        a, b, snd, rcv = (src.devices[i], dst.devices[j], i, j) if direction == 0 else (dst.devices[j], src.devices[i], j, i)
        link = cluster.link(a, b)
        rows.append((snd, rcv, link.latency_s, wire_bytes(model, a, b, (hi - lo) * per_sample) / link.bandwidth_at(0.0),
                     link.resource))
    names: dict[str, int] = {}
    res = np.array([names.setdefault(r[4], len(names)) for r in rows])
    sender = np.array([r[0] for r in rows])
    receiver = np.array([r[1] for r in rows])
    p = len(rows)
    order = None
    counts = np.bincount(res, minlength=len(names))
    if counts.max() > 1:
        order = np.empty(p, dtype=np.int64)
        order[np.lexsort((np.arange(p), sender))] = np.arange(p)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank_pos = tuple(first[counts > r] + r for r in range(int(counts.max())))
    n_recv = len(dst.devices) if direction == 0 else len(src.devices)
    n_send = len(src.devices) if direction == 0 else len(dst.devices)
    return Pieces(sender=sender, latency_s=np.array([r[2] for r in rows]), serialization_s=np.array([r[3] for r in rows]),
                  resource=res, num_resources=len(names), order=order, rank_pos=rank_pos, first_res=first,
                  last_pos=first + counts - 1, to_receiver=_padded(receiver, n_recv, p), to_sender=_padded(sender, n_send, p))


def _padded(owner: np.ndarray, n: int, pad: int) -> np.ndarray:
    """Per owner ``0..n-1``, the indices of its entries in ``owner``, padded with ``pad``."""
    lists: list[list[int]] = [[] for _ in range(n)]
    for k, o in enumerate(owner):
        lists[o].append(k)
    width = max(len(x) for x in lists)
    return np.array([x + [pad] * (width - len(x)) for x in lists], dtype=np.int64)


def _serve(pc: Pieces, go: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Each piece's end of serialisation: pipes first in, first out from ``free`` (updated), pieces
    of one send served in the order they were issued (ties: sender device order)."""
    ser = pc.serialization_s
    if pc.order is None:
        done = np.maximum(go, free[pc.resource]) + ser
        free[pc.resource] = done
        return done
    idx = np.lexsort((pc.order, go, pc.resource))  # pipe-major, then issue time, then device order
    g, s = go[idx], ser[idx]
    done_s = np.empty_like(g)
    prev = free
    for r, pos in enumerate(pc.rank_pos):
        before = prev[pc.resource[idx[pos]]] if r == 0 else done_s[pos - 1]
        done_s[pos] = np.maximum(g[pos], before) + s[pos]
    free[pc.resource[idx[pc.last_pos]]] = done_s[pc.last_pos]
    done = np.empty_like(done_s)
    done[idx] = done_s
    return done


MAX_PASSES = 3
"""Passes of :func:`devices_at_once` at most (each pass re-serves the pipes in the issue order of
the previous one; see [Note: pipe order])."""

# [Note: pipe order]
# One pass serves a shared pipe's pieces send by send (program order). Where two devices of a
# stage that share a pipe run a microbatch or more apart, the simulator serves the ahead
# device's later piece first (it was issued first). After a pass, each shared pipe's pieces are
# sorted by their issue times (ties: program order, then device order) into one sequence per
# pipe, each piece's predecessor there; where that differs from the order the pass served, the
# next pass serves every piece after its predecessor in that sequence: a predecessor from a
# later send (not yet reached in this pass) with its end from the previous pass, one from this
# or an earlier send with this pass's. The passes stop when a pass's issue order is the order it
# served and no piece's end changed: then each pipe serves in issue order, the simulator's own
# rule, and the times are the simulator's. Otherwise :data:`MAX_PASSES` ends it.


@dataclass(slots=True)
class _Order:
    """One boundary direction's pipe order: per piece (flat index ``microbatch x pieces + piece``)
    its predecessor on its pipe (``-1``: the first), which predecessors are in the same send, and
    per microbatch with such, those pieces in the order to serve them with their predecessor."""

    pred: np.ndarray
    inside: np.ndarray
    """Microbatch x piece: the predecessor is a piece of the same send."""
    chains: dict[int, list[tuple[int, int]]]
    """Sends whose pieces on some pipe are not one run of that pipe's order: the pieces after one
    of the same send, in the order to serve them, each with that one."""
    first_pred: np.ndarray
    """Microbatch x pipe, for the other sends: the flat index of the piece before the send's run
    on the pipe (``-1``: none)."""


def _pipe_preds(pc: Pieces, go: np.ndarray, rank: np.ndarray, by_time: bool) -> np.ndarray:
    """Each piece's predecessor on its pipe (flat indices) for issue times ``go`` (microbatch x
    piece), serving in issue order (``by_time``) or send by send in program order (``rank``: a
    microbatch's position among its stage's sends)."""
    m, p = go.shape
    res = np.tile(pc.resource, m)
    tie = np.tile(pc.order, m)
    occ = np.repeat(rank, p)
    flat = go.ravel()
    keys = (tie, occ, flat, res) if by_time else (tie, flat, occ, res)
    idx = np.lexsort(keys)
    pred = np.full(m * p, -1, dtype=np.int64)
    same = res[idx[1:]] == res[idx[:-1]]
    pred[idx[1:][same]] = idx[:-1][same]
    return pred


def _order(pred: np.ndarray, m: int, p: int, res: np.ndarray, num_res: int) -> _Order:
    """:class:`_Order` of predecessors ``pred``."""
    flat = np.arange(m * p)
    inside = (pred >= 0) & (pred // p == flat // p)
    level = np.zeros(m * p, dtype=np.int64)
    while True:
        nxt = np.where(inside, level[np.maximum(pred, 0)] + 1, 0)
        if np.array_equal(nxt, level):
            break
        level = nxt
    group = (flat // p) * num_res + np.tile(res, m)  # (send, pipe)
    heads = np.bincount(group[~inside], minlength=m * num_res)  # runs per (send, pipe)
    first_pred = np.full(m * num_res, -1, dtype=np.int64)
    first_pred[group[~inside]] = pred[~inside]
    chains = {}
    for mb in np.flatnonzero((heads.reshape(m, num_res) > 1).any(axis=1)):
        row = level[mb * p:(mb + 1) * p]
        ids = np.flatnonzero(row)
        ids = ids[np.argsort(row[ids], kind="stable")]
        chains[int(mb)] = [(int(i), int(pred[mb * p + i] - mb * p)) for i in ids]
    return _Order(pred=pred, inside=inside.reshape(m, p), chains=chains, first_pred=first_pred.reshape(m, num_res))


def devices_at_once(lowered: Schedule, dur: Sequence[np.ndarray], pieces: Sequence[tuple[Pieces, Pieces]],
                    runtime: RuntimeModel | None, *, max_passes: int = MAX_PASSES) -> list[np.ndarray]:
    """Each device's end of its stage's list (per stage, one entry per device), see [Note: devices at
    once] and [Note: pipe order]. ``dur``: per stage, device x (F, I, W, B); ``pieces``: per
    boundary, forward and backward."""
    n = len(lowered)
    m = 1 + max((a.microbatch for row in lowered for a in row), default=0)
    shared = [(b, d) for b in range(n - 1) for d in (0, 1) if pieces[b][d].order is not None]
    rank = {}
    for b, d in shared:
        sends = [a.microbatch for a in lowered[b if d == 0 else b + 1] if a.kind in _SEND and _SEND[a.kind] == d]
        rank[b, d] = np.zeros(m, dtype=np.int64)
        rank[b, d][sends] = np.arange(len(sends))
    orders: dict[tuple[int, int], _Order] = {}
    clock: list[np.ndarray] = []
    go: dict[tuple[int, int], np.ndarray] = {}
    for _ in range(max_passes):
        before = go
        clock, go, _ = _one_pass(lowered, dur, pieces, runtime, orders, before, m)
        new = {}
        for b, d in shared:
            pc = pieces[b][d]
            pred = _pipe_preds(pc, go[b, d], rank[b, d], by_time=True)
            served = orders[b, d].pred if (b, d) in orders else _pipe_preds(pc, go[b, d], rank[b, d], by_time=False)
            if not np.array_equal(pred, served):
                new[b, d] = _order(pred, m, len(pc.sender), pc.resource, pc.num_resources)
            elif (b, d) in orders and not np.array_equal(before[b, d], go[b, d]):
                new[b, d] = orders[b, d]  # same order, but a piece ahead was served at a stale issue time
        if not new:
            break
        orders.update(new)
    return clock


def _one_pass(lowered: Schedule, dur: Sequence[np.ndarray], pieces: Sequence[tuple[Pieces, Pieces]],
              runtime: RuntimeModel | None, orders: dict[tuple[int, int], _Order],
              go_before: dict[tuple[int, int], np.ndarray], m: int,
              ) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray], dict[tuple[int, int], np.ndarray]]:
    """One pass of :func:`devices_at_once`: the devices' clocks, and per shared boundary direction
    its pieces' issue times and ends of serialisation (microbatch x piece)."""
    n = len(lowered)
    blocking = runtime is not None and runtime.sends == "blocking"
    handshake = runtime is not None and runtime.receive_handshake
    cols = [[np.ascontiguousarray(dur[s][:, k]) for k in range(len(PASSES))] for s in range(n)]
    clock = [np.zeros(len(dur[s])) for s in range(n)]
    free = {(b, d): np.zeros(pieces[b][d].num_resources) for b in range(n - 1) for d in (0, 1)}
    go_all = {(b, d): np.zeros((m, len(pieces[b][d].sender))) for b in range(n - 1) for d in (0, 1)
              if pieces[b][d].order is not None}
    done_all = {k: np.full_like(v, np.nan) for k, v in go_all.items()}  # nan: not served yet in this pass
    arrived: dict[tuple[int, int, int], np.ndarray] = {}
    pcs, progress = [0] * n, True
    while progress:
        progress = False
        for s, row in enumerate(lowered):
            pc, t, col = pcs[s], clock[s], cols[s]
            while pc < len(row):
                a = row[pc]
                k = _PASS.get(a.kind)
                if k is not None:
                    t = t + col[k]
                elif a.kind in _RECV:
                    got = arrived.pop((_RECV[a.kind], s, a.microbatch), None)
                    if got is None:
                        break
                    t = np.maximum(t, got)
                else:
                    d = _SEND[a.kind]
                    b = s if d == 0 else s - 1
                    p = pieces[b][d]
                    go = t[p.sender]
                    if handshake:
                        go = np.maximum(go, p.latency_s)
                    order = orders.get((b, d))
                    if order is None:
                        ends = _serve(p, go, free[b, d])
                    else:
                        ends = _serve_after(p, go, done_all[b, d], go_before[b, d], order, a.microbatch)
                    if (b, d) in go_all:
                        go_all[b, d][a.microbatch] = go
                        done_all[b, d][a.microbatch] = ends
                    arrive = ends + p.latency_s
                    arrived[d, s + 1 if d == 0 else s - 1, a.microbatch] = _latest(arrive, p.to_receiver)
                    if blocking:
                        t = np.maximum(t, _latest(arrive, p.to_sender))
                pc += 1
            progress |= pc != pcs[s]
            pcs[s], clock[s] = pc, t
    if any(pc < len(row) for pc, row in zip(pcs, lowered, strict=True)):
        raise ScheduleError("devices at once: the schedule deadlocks (a receive without its send)")
    return clock, go_all, done_all


def _latest(arrive: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """Per owner (a row of ``owners``: its pieces, padded past the end), its latest piece."""
    if owners.shape[1] == 1:
        return arrive[owners[:, 0]]
    return np.append(arrive, -np.inf)[owners].max(axis=1)


def _serve_after(pc: Pieces, go: np.ndarray, done: np.ndarray, go_before: np.ndarray, order: _Order,
                 mb: int) -> np.ndarray:
    """Each piece's end of serialisation, every piece after its predecessor on its pipe ([Note: pipe
    order]); ``done`` (microbatch x piece, nan where not served yet in this pass) takes this send's.
    A predecessor not served yet is served at its previous issue time (``go_before``) after its own
    predecessor, if that one was."""
    flat, pred, p, ser = done.reshape(-1), order.pred, len(pc.sender), pc.serialization_s
    chain = order.chains.get(mb)
    if chain is None:  # each pipe's pieces of this send are one run: served in issue order after its predecessor
        free = _ends(flat, go_before, pred, ser, order.first_pred[mb], p)
        done[mb] = _serve(pc, go, free)
        return done[mb].copy()
    row = done[mb]
    pf = pred[mb * p:(mb + 1) * p]
    prev = _ends(flat, go_before, pred, ser, np.where(order.inside[mb], -1, pf), p)
    row[:] = np.maximum(go, prev) + ser
    for i, j in chain:
        row[i] = max(go[i], row[j]) + ser[i]
    return row.copy()


def _ends(flat: np.ndarray, go_before: np.ndarray, pred: np.ndarray, ser: np.ndarray, at: np.ndarray,
          p: int) -> np.ndarray:
    """Ends of serialisation of the pieces ``at`` (flat indices; ``-1``: none, 0), those not served yet
    in this pass at their previous issue time after their own predecessor if that one was."""
    out = np.where(at >= 0, flat[np.maximum(at, 0)], 0.0)
    ahead = np.isnan(out)
    if ahead.any():
        y = at[ahead]
        yp = pred[y]
        before = np.where(yp >= 0, flat[np.maximum(yp, 0)], np.nan)
        start = go_before.reshape(-1)[y]
        out[ahead] = np.where(np.isnan(before), start, np.maximum(start, before)) + ser[y % p]
    return out
