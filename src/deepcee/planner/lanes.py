"""Sample lanes of a plan for the cost model (torch-free): which device chains to time, and
timing many of them at once on the stage-level tables.

See [Note: sample lanes] and [Note: lanes at once]; :mod:`deepcee.planner.cost_model` uses both.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from deepcee.cluster import Cluster
from deepcee.errors import ScheduleError
from deepcee.plan import Plan, StagePlan, share_overlaps
from deepcee.profile import ModelProfile
from deepcee.schedule.interpreter import LinkCost
from deepcee.schedule.ir import ActionKind, Schedule
from deepcee.simulator.engine import wire_bytes
from deepcee.simulator.runtime_model import RuntimeModel

Lane = tuple[tuple[float, ...], ...]
"""Per stage, ``(F, I, W, B)`` of one microbatch on the lane's device."""

# [Note: sample lanes]
# In the simulator every device of a stage runs on its own: a device waits only for the pieces
# of its own samples, from the devices of the neighbouring stages that hold them (see [Note:
# share-based resharding] in :mod:`deepcee.plan`). Sample position ``x`` of a microbatch goes
# through one device per stage: its lane. Where stages mix device kinds with one sample each
# (the best plans at 256 and 512 devices: 16-64 devices of three kinds per stage, a microbatch
# of one sample per device), the fast lanes finish early and the iteration is the slowest lane's
# pipeline, fill and drain included; timing every stage by its slowest device instead (one
# pipeline of the stages' maxima) made the model 2-3.6% pessimistic at 256 devices, by an
# amount that depended on how the kinds lined up across stages, and ranked the top 20 with
# Kendall tau 0.47. The pipeline is timed for every lane that no other lane dominates (every
# pass at every stage at most the other's: the interpreter is monotone in its durations, so a
# dominated lane cannot end later; all at once, [Note: lanes at once]), with the boundary-wide
# link costs of the cost model; a stage ends when its last lane ends. With one device per
# stage, or one lane through every stage's slowest device, this is the single pipeline of the
# stages' maxima, and lanes whose pieces share a pipe start late by their lag ([Note: pipe
# lag]). What it leaves out: a device that waits for pieces of two lanes (shares that do not
# line up) waits for both; lanes are coupled through a shared pipe only by that lag.

# [Note: pipe lag]
# Two devices of a node sending to two devices of another node share one pipe: the simulator
# serves their pieces first in, first out, ties in device order. During the fill a pipe that is
# slower than the stages' forward passes is busy without a gap, so the second lane gets every
# piece one piece later than the first (at 512 devices: 67 ms, 1.2% of the iteration, the whole
# remaining error of the lane model there). That lag is paid once, not at every hop: the late
# lane also sends late on the next shared pipe, after the earlier lane's piece went. Charging
# the whole pipe at every hop was 6-17% pessimistic, the same lag at every hop as well; a lane
# here starts late by the largest, over its boundaries and directions, of the serialisation of
# the pieces ahead of its own on its pipe in device order. Measured on the top 20 at 512
# devices: max error 1.9% -> 0.7%; at 256 devices (pipes less often the bottleneck) it moves
# errors within +-0.5% both ways.


def undominated_lanes(plan: Plan, per_stage: Sequence[Sequence[tuple[float, ...]]],
                      ahead: Mapping[tuple[int, int, int, int], float] | None = None) -> list[tuple[Lane, float]]:
    """Per lane that no other lane dominates, each stage's ``(F, I, W, B)`` on the lane's device
    (``per_stage``: per stage and device) and the lane's lag (``ahead``: per ``(boundary,
    direction, sender-stage device index, receiver-stage device index)``, the pieces ahead on
    its pipe, see [Note: pipe lag]; default none), the largest summed passes first ([Note: sample lanes])."""
    lanes: dict[Lane, float] = {}
    starts = sorted({a for st in plan.stages for a in itertools.accumulate(st.shares[:-1], initial=0)})
    index = [0] * plan.num_stages
    ends = [st.shares[0] for st in plan.stages]
    for x in starts:  # a lane per sample position where some stage's device changes
        for s, st in enumerate(plan.stages):
            while ends[s] <= x:
                index[s] += 1
                ends[s] += st.shares[index[s]]
        lane = tuple(per_stage[s][index[s]] for s in range(plan.num_stages))
        lag = max((ahead.get((s, d, index[s], index[s + 1]), 0.0) for s in range(plan.num_stages - 1)
                   for d in (0, 1)), default=0.0) if ahead else 0.0
        lanes[lane] = max(lanes.get(lane, 0.0), lag)
    order = list(lanes.items())
    if len(order) == 1:
        return order
    mat = np.array([[x for stage in lane for x in stage] + [lag] for lane, lag in order])
    ge = (mat[:, None, :] >= mat[None, :, :]).all(axis=2)  # ge[a, b]: lane a at least lane b everywhere
    dominated = (ge & ~np.eye(len(mat), dtype=bool)).any(axis=0)
    keep = sorted(np.flatnonzero(~dominated), key=lambda k: (-mat[k].sum(), k))
    return [order[k] for k in keep]


PASSES = (ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B)
_PASS = {kind: k for k, kind in enumerate(PASSES)}
_SEND = {ActionKind.SEND_F: 0, ActionKind.SEND_B: 1}
_RECV = {ActionKind.RECV_F: 0, ActionKind.RECV_B: 1}

# [Note: lanes at once]
# The stage-level tables give every link resource one sender (a boundary direction), so each
# resource serves its pieces in the sender's program order, and the interpreter's times are a
# fixed recursion over the actions: a stage's clock moves on by its compute, a send's piece
# starts at the later of the sender's clock and the end of the resource's previous piece (and,
# with the receive handshake, the piece's latency after the pass start), a receive waits for
# its piece, a blocking send for its delivery. :func:`lanes_at_once` walks the actions once in
# an order where every send precedes its receive and runs that recursion on numpy vectors, one
# entry per lane: the same additions and maxima as the interpreter's, so each lane's times are
# the interpreter's to the bit, for the cost of one pass over the schedule.


def lanes_at_once(lowered: Schedule, dur: np.ndarray, comm_forward: Sequence[LinkCost],
                   comm_backward: Sequence[LinkCost], runtime: RuntimeModel | None) -> np.ndarray:
    """Each lane's end of each stage's list (lane x stage), see [Note: lanes at once]."""
    num_lanes, n = dur.shape[0], len(lowered)
    blocking = runtime is not None and runtime.sends == "blocking"
    handshake = runtime is not None and runtime.receive_handshake
    cols = [[dur[:, s, k].copy() for k in range(len(PASSES))] for s in range(n)]  # per stage and pass
    clock = [np.zeros(num_lanes) for _ in range(n)]
    free = {(d, s): np.zeros(num_lanes) for d in (0, 1) for s in range(n)}  # per direction and sender
    arrived: dict[tuple[int, int, int], np.ndarray] = {}  # (direction, receiving stage, microbatch)
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
                    lat, ser = comm_forward[s] if d == 0 else comm_backward[s - 1]
                    go = np.maximum(t, lat) if handshake else t
                    done = np.maximum(go, free[d, s]) + ser
                    free[d, s] = done
                    arrive = done + lat
                    arrived[d, s + 1 if d == 0 else s - 1, a.microbatch] = arrive
                    if blocking:
                        t = np.maximum(t, arrive)
                pc += 1
            progress |= pc != pcs[s]
            pcs[s], clock[s] = pc, t
    if any(pc < len(row) for pc, row in zip(pcs, lowered, strict=True)):
        raise ScheduleError("lanes: the schedule deadlocks (a receive without its send)")
    return np.stack(clock, axis=1)


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
        rows.append((snd, rcv, link.latency_s, wire_bytes(model, a, b, (hi - lo) * per_sample) / link.bandwidth_bytes_per_s,
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
    grouped = np.argsort(res, kind="stable")
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank_pos = tuple(first[counts > r] + r for r in range(int(counts.max())))
    n_recv = len(dst.devices) if direction == 0 else len(src.devices)
    n_send = len(src.devices) if direction == 0 else len(dst.devices)
    del grouped
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
                    arrive = np.append(_serve(p, go, free[d, b]) + p.latency_s, -np.inf)
                    arrived[d, s + 1 if d == 0 else s - 1, a.microbatch] = arrive[p.to_receiver].max(axis=1)
                    if blocking:
                        t = np.maximum(t, arrive[p.to_sender].max(axis=1))
                pc += 1
            progress |= pc != pcs[s]
            pcs[s], clock[s] = pc, t
    if any(pc < len(row) for pc, row in zip(pcs, lowered, strict=True)):
        raise ScheduleError("devices at once: the schedule deadlocks (a receive without its send)")
    return clock
