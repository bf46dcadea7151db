"""Every device of a plan timed at once for the cost model (torch-free): the simulator's pipeline,
one numpy vector per stage (see [Note: devices at once]); :mod:`deepcee.planner.cost_model` uses it.
"""

from __future__ import annotations

import math
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
# earlier than the piece's latency) and serves them ([Note: pipe order]); a piece is delivered a
# latency after its serialisation; a receive waits for the latest of its device's pieces; a
# blocking send holds its device until its own last delivery. A stage runs until it reaches a
# receive whose pieces have not all arrived and then waits until that delivery wakes it (until
# session 18 every stage was polled in turn until none moved). The times do not depend on the
# order in which stages run: each boundary direction's sends come from one stage in program
# order, and held sends are served only when every stage waits.
# Session 5 timed sample lanes (one device per stage, the undominated chains) apart, each on the
# boundary-wide link costs, and charged a lane queued behind another on a shared pipe a start lag
# once: errors of +-0.5% both ways on the top 20 plans at 256 and 512 devices (Kendall tau 0.80
# and 0.81 on main's top 20s of session 7), because the pipe's order, and so which lane lags and
# by how much, depends on the lanes' times; here it comes out of the recursion.
# What differs from the simulator: [Note: pipe order]'s forced serving; pipes shared by two
# boundaries are queued apart; a bandwidth trace is taken at time 0.

# [Note: pipe order]
# A pipe shared by several devices of the sending stage (two devices of a node sending to two of
# another) serves by issue time, and devices that share it can run a microbatch or more apart:
# the ahead device's later piece goes before the other's earlier one (at 512 devices, 1-3% of
# the pieces of the top 20 plans). Serving each send's pieces as the send is reached (program
# order) put them the other way round there: up to 0.8% off per plan, both ways. A send's piece
# on a pipe with several senders is therefore held until no piece issued earlier can still come:
# every device on the pipe has a clock at least the piece's issue time (a device's later pieces
# are issued no earlier than its clock, which is its issue time of the newest send); held pieces
# are served by issue time (ties: program order, then the simulator's issue order of one send:
# sender device order, then the sender's pieces in order). The vectors move a stage's devices
# together, so a device ahead cannot issue its next piece while the stage waits for a receive;
# when every stage waits and some wait for a held send, that send's pieces are served (with every
# piece issued before them on their pipes) as they stand: the one place this differs from the
# simulator's order. Tried and dropped: re-running the pass with each pipe served in the previous
# pass's issue order; the orders oscillated (Kendall tau at 512 devices 0.85, 0.95, 0.88 after 2,
# 3, 4 passes, never a fixed point), each pass costing a full one.
# The held pieces of one boundary direction are one :class:`_Pool` of flat lists in program
# order (then piece order, which is the tie order): no per-send lists. A release with at most one
# piece per pipe (most of them: the forced serving of one send, and a new send's earliest piece
# on each pipe) needs no sort, since pipes do not interact. Same pieces, same order, same sums:
# the times are the bits of session 7's per-send queues (checked on every timing of `plan` at
# 256 and 512 devices). The pool was numpy arrays until session 10; a pool holds 16-100 pieces,
# where a dozen numpy calls per release cost more than a loop over floats (devices_at_once
# 0.7x at 512 devices, the same bits on every timing of `plan` and `compare` there).


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
    sends (the simulator's: sender device order, then its pieces in order), which is its index:
    the pieces are in that order."""
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
    by_pipe: np.ndarray
    """The pieces' indices in pipe-major order (each pipe's in piece order)."""
    index: np.ndarray
    """``0 .. pieces - 1``."""


def boundary_pieces(cluster: Cluster, model: ModelProfile, src: StagePlan, dst: StagePlan, direction: int) -> Pieces:
    """:class:`Pieces` of one direction (0: ``src -> dst``, 1: back) of the boundary between two stages."""
    per_sample = model.boundary_bytes(src.layer_stop)
    rows = []
    for i, j, lo, hi in share_overlaps(src.shares, dst.shares):
        a, b, snd, rcv = (src.devices[i], dst.devices[j], i, j) if direction == 0 else (dst.devices[j], src.devices[i], j, i)
        link = cluster.link(a, b)
        rows.append((snd, rcv, link.latency_s, wire_bytes(model, a, b, (hi - lo) * per_sample) / link.bandwidth_at(0.0),
                     link.resource))
    # the simulator issues a send's pieces by sender device, then each sender's in order: the
    # pieces' own order (share_overlaps is a merge, so the senders already ascend; [Note: pipe order])
    rows.sort(key=lambda r: r[0])
    names: dict[str, int] = {}
    res = np.array([names.setdefault(r[4], len(names)) for r in rows])
    sender = np.array([r[0] for r in rows])
    receiver = np.array([r[1] for r in rows])
    p = len(rows)
    counts = np.bincount(res, minlength=len(names))
    order = np.arange(p) if counts.max() > 1 else None
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank_pos = tuple(first[counts > r] + r for r in range(int(counts.max())))
    n_recv = len(dst.devices) if direction == 0 else len(src.devices)
    n_send = len(src.devices) if direction == 0 else len(dst.devices)
    return Pieces(sender=sender, latency_s=np.array([r[2] for r in rows]), serialization_s=np.array([r[3] for r in rows]),
                  resource=res, num_resources=len(names), order=order, rank_pos=rank_pos, first_res=first,
                  last_pos=first + counts - 1, to_receiver=_padded(receiver, n_recv, p), to_sender=_padded(sender, n_send, p),
                  by_pipe=np.argsort(res, kind="stable"), index=np.arange(p))


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


def devices_at_once(lowered: Schedule, dur: Sequence[np.ndarray], pieces: Sequence[tuple[Pieces, Pieces]],
                    runtime: RuntimeModel | None) -> list[np.ndarray]:
    """Each device's end of its stage's list (per stage, one entry per device), see [Note: devices at once].
    ``dur``: per stage, device x (F, I, W, B); ``pieces``: per boundary, forward and backward."""
    n = len(lowered)
    blocking = runtime is not None and runtime.sends == "blocking"
    handshake = runtime is not None and runtime.receive_handshake
    cols = [[np.ascontiguousarray(dur[s][:, k]) for k in range(len(PASSES))] for s in range(n)]
    clock = [np.zeros(len(dur[s])) for s in range(n)]
    free = {(d, b): np.zeros(pieces[b][d].num_resources) for b in range(n - 1) for d in (0, 1)}
    arrived: dict[tuple[int, int, int], np.ndarray] = {}
    held: dict[tuple[int, int], _Pool] = {}  # per (direction, boundary): sends with pieces not served yet
    rows = _compiled(lowered)
    pcs = [0] * n
    # a stage runs until a receive's pieces have not all arrived, then waits in ``waits`` (by the
    # receive's key) until a delivery wakes it ([Note: devices at once])
    waits: dict[tuple[int, int, int], int] = {}
    ready = list(range(n - 1, -1, -1))
    while True:
        while ready:
            s = ready.pop()
            row, pc, t, col = rows[s], pcs[s], clock[s], cols[s]
            end = len(row)
            while pc < end:
                op, arg = row[pc]
                if op == _COMPUTE:
                    t = t + col[arg]
                elif op == _RECEIVE:
                    got = arrived.pop(arg, None)
                    if got is None:
                        waits[arg] = s
                        break
                    t = np.maximum(t, got)
                else:
                    d, b, to = arg
                    p = pieces[b][d]
                    go = t[p.sender]
                    if handshake:
                        go = np.maximum(go, p.latency_s)
                    if p.order is None or blocking:
                        arrive = _serve(p, go, free[d, b]) + p.latency_s
                        arrived[to] = _latest(arrive, p.to_receiver)
                        woken = waits.pop(to, None)
                        if woken is not None:
                            ready.append(woken)
                        if blocking:
                            t = np.maximum(t, _latest(arrive, p.to_sender))
                    else:  # [Note: pipe order]
                        pool = held.get((d, b))
                        if pool is None:
                            pool = held[d, b] = _Pool(p, free[d, b])
                        pool.push(to, go)
                        pool.release(np.minimum.reduceat(go[p.by_pipe], p.first_res), arrived, waits, ready,
                                     every_pipe=True)
                pc += 1
            pcs[s], clock[s] = pc, t
        if not any(pool.open for pool in held.values()):
            break
        # every stage waits, some for a send held back: serve those sends' pieces (and the pieces
        # issued before them on their pipes)
        wanted = set(waits)
        served = False
        for pool in held.values():
            p = pool.pieces
            for go in [go for to, go in pool.open.values() if to in wanted]:
                pool.release(np.maximum.reduceat(go[p.by_pipe], p.first_res), arrived, waits, ready)
                served = True
        if not served:
            for pool in held.values():
                if pool.open:
                    pool.release(None, arrived, waits, ready)
    if any(pc < len(row) for pc, row in zip(pcs, rows, strict=True)):
        raise ScheduleError("devices at once: the schedule deadlocks (a receive without its send)")
    return clock


_COMPUTE, _RECEIVE, _SEND_OP = 0, 1, 2
_COMPILED: dict[int, tuple[Schedule, list[list[tuple[int, object]]]]] = {}


def _compiled(lowered: Schedule) -> list[list[tuple[int, object]]]:
    """Per stage, its actions as ``(op, argument)``: a compute's pass column, a receive's key in
    ``arrived``, a send's ``(direction, boundary, receiver's key)`` (kept for the last 64 schedules,
    which the planner's :func:`~deepcee.schedule.program.lowered_schedule` hands out again)."""
    got = _COMPILED.get(id(lowered))
    if got is not None and got[0] is lowered:
        return got[1]
    rows: list[list[tuple[int, object]]] = []
    for s, row in enumerate(lowered):
        ops: list[tuple[int, object]] = []
        for a in row:
            k = _PASS.get(a.kind)
            if k is not None:
                ops.append((_COMPUTE, k))
            elif a.kind in _RECV:
                ops.append((_RECEIVE, (_RECV[a.kind], s, a.microbatch)))
            else:
                d = _SEND[a.kind]
                ops.append((_SEND_OP, (d, s if d == 0 else s - 1, (d, s + 1 if d == 0 else s - 1, a.microbatch))))
        rows.append(ops)
    if len(_COMPILED) >= 64:
        _COMPILED.clear()
    _COMPILED[id(lowered)] = (lowered, rows)
    return rows


class _Pool:
    """The pieces not served yet of one boundary direction's sends on shared pipes ([Note: pipe order]),
    in program order (then piece order, the simulator's order in a send: :func:`boundary_pieces`),
    each ``(pipe, issue time, place in ends, serialisation)``. Plain tuples in one list: a pool holds
    a few sends' pieces (16-100 at 512 devices), where a loop over floats beats a dozen numpy calls
    per release; the arithmetic is the same (``max(issue, pipe free) + serialisation`` per piece, in
    the same order). A piece's place in ``ends`` grows with program order, so ``(pipe, issue, place)``
    orders a pipe's pieces first in first out by issue time, ties in program order."""

    __slots__ = ("ends", "free", "items", "lat_pad", "left", "open", "pieces", "res_list", "ser_list", "seq")

    def __init__(self, pieces: Pieces, free: np.ndarray) -> None:
        self.pieces = pieces
        self.free: list[float] = free.tolist()
        """Per pipe, when it is free again (this pool's pipes: no other send uses them)."""
        self.res_list: list[int] = pieces.resource.tolist()
        self.ser_list: list[float] = pieces.serialization_s.tolist()
        self.seq = 0
        self.open: dict[int, tuple[tuple[int, int, int], np.ndarray]] = {}
        """Per send not delivered yet (by program order), its receiver's key and its pieces' issue times."""
        self.ends: list[float] = []
        """Per send (``seq * pieces``), each piece's end of serialisation once served."""
        self.items: list[tuple[int, float, int, float, int]] = []
        """The pieces not served yet, in program order: pipe, issue time, place in ``ends``,
        serialisation, send."""
        self.left: list[int] = []
        """Per send, its pieces not served yet."""
        self.lat_pad = np.append(pieces.latency_s, 0.0)
        """Per piece its latency, then 0 for the padding slot of ``to_receiver`` (see :func:`_latest`)."""

    def push(self, to: tuple[int, int, int], go: np.ndarray) -> None:
        """Add a send's pieces (issued at ``go``)."""
        slot, p = self.seq, len(self.res_list)
        self.seq += 1
        self.ends += [0.0] * p
        self.left.append(p)
        self.open[slot] = (to, go)
        self.items += zip(self.res_list, go.tolist(), range(slot * p, (slot + 1) * p), self.ser_list, [slot] * p,
                          strict=True)

    def release(self, limit: np.ndarray | None, arrived: dict[tuple[int, int, int], np.ndarray],
                waits: dict[tuple[int, int, int], int], ready: list[int], *, every_pipe: bool = False) -> None:
        """Serve the pieces no later piece can precede (issued by ``limit``, per pipe the earliest
        issue time of the newest send: no device sends earlier than that from now on; ``None``: all),
        each pipe first in first out by issue time (ties: program order, then device order) from
        :attr:`free` (updated); a send whose pieces are all served is delivered to ``arrived``.
        ``every_pipe``: ``limit`` lets at least one piece of every pipe go (the newest send's own)."""
        items, free, ends, left = self.items, self.free, self.ends, self.left
        if limit is None:
            served, self.items = items, []
        else:
            lim = limit.tolist()
            served = [x for x in items if x[1] <= lim[x[0]]]
            if not served:
                return  # nothing served: nothing to deliver either (every open send still has a piece here)
            self.items = [x for x in items if x[1] > lim[x[0]]] if len(served) < len(items) else []
        if not (len(served) <= len(free) and (every_pipe or len({x[0] for x in served}) == len(served))):
            # pipe by pipe, each first in first out by issue time (ties: program order, then device
            # order: the place in ``ends``); else at most one piece per pipe (a release that lets one
            # piece of every pipe go and serves as many has one on each), in any order
            served = sorted(served)
        for r, g, k, d, slot in served:
            f = free[r]
            free[r] = ends[k] = (g if g >= f else f) + d
            left[slot] -= 1
        self._deliver(arrived, waits, ready)

    def _deliver(self, arrived: dict[tuple[int, int, int], np.ndarray], waits: dict[tuple[int, int, int], int],
                 ready: list[int]) -> None:
        """Deliver the sends with no piece left in the pool (waking the stage that waits for one)."""
        pc, p, left = self.pieces, len(self.res_list), self.left
        for slot in [k for k in self.open if not left[k]]:
            to, _ = self.open.pop(slot)
            arrived[to] = _latest(np.array(self.ends[slot * p:(slot + 1) * p] + _NEG_INF) + self.lat_pad,
                                  pc.to_receiver, padded=True)
            woken = waits.pop(to, None)
            if woken is not None:
                ready.append(woken)


_NEG_INF = [-math.inf]


def _latest(arrive: np.ndarray, owners: np.ndarray, *, padded: bool = False) -> np.ndarray:
    """Per owner (a row of ``owners``: its pieces, padded past the end), its latest piece.
    ``padded``: ``arrive`` already ends in the padding slot (``-inf``)."""
    if owners.shape[1] == 1:
        return arrive[owners[:, 0]]
    return (arrive if padded else np.append(arrive, -np.inf))[owners].max(axis=1)
