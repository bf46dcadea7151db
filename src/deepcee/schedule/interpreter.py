"""The one timing interpreter of lowered schedules (torch-free).

Three programs time a lowered schedule, and all three run it here, on different cost tables
(:class:`Tables`):

- the simulator (:mod:`deepcee.simulator.engine`): per-device compute times from the cluster
  and the model, every send split into one piece per sample overlap with the peer stage's
  devices, over the cluster's real links (shared resources, bandwidth traces);
- the dry run (:func:`deepcee.schedule.passes.dry_run`) and the validator's deadlock check:
  given per-stage costs, one device per stage, one FIFO link per boundary direction
  (:func:`stage_tables`);
- the planner's cost model (:mod:`deepcee.planner.cost_model`): the dry run's tables filled
  with its stage-level costs, without recording.

Model (times in seconds on one clock):

- Every device of stage ``s`` runs the lowered row ``s`` in order, starting at ``t0``; it
  never reorders or skips ahead. ``F``/``I``/``W``/``B`` occupy the device for its duration.
- ``SEND`` takes no device time: it issues every piece of that send. A piece issued at ``t``
  on a link resource starts serialising at ``max(t, resource free)`` (first in, first out per
  resource, in issue-time order), serialises for ``nbytes / bandwidth`` (integrated over a
  bandwidth trace: :func:`deepcee.comm.serialise_end_s`) and is delivered ``latency_s``
  after its serialisation ends.
- ``RECV`` takes no device time but blocks until every piece of that microbatch and
  direction arrived: the device continues at ``max(reached, last delivery)``.
- If no device can continue and some have actions left, the schedule deadlocks
  (:class:`Deadlock`, naming each stuck action).

Two runtime behaviours change this (:class:`Tables`, set by the simulator from its
:class:`~deepcee.simulator.runtime_model.RuntimeModel`; off for the dry run and the cost model):
``blocking_sends`` (the sending device waits until the send's last piece was delivered) and
``handshake`` (a piece starts serialising no earlier than its receiver's start in this pass
plus the piece's latency: the receiver posted its receives when it started, and its "ready"
notice has to cross the link first). Devices may start a pass at different times
(:meth:`Execution.pipeline` takes one start per device).

Events are processed in time order (a heap of ``(time, sequence, device)``), so pieces of
different devices that share a resource queue in the order they were issued. A device keeps
running without going through the heap while its next event is strictly earlier than every
queued one: the order of events, and so every time, is the same either way. When every
resource carries the pieces of one sending device only (always so for :func:`stage_tables`)
and nothing is recorded, the order of devices cannot change any time, and each device runs
until it blocks on a receive (the free run the dry run always had).

With ``record=True`` the interpreter keeps, for the simulator's critical path and timeline,
one segment per compute action, transfer piece and receive wait (see :data:`Segment`, each
naming the segment that released it), and for the dry run each action's ``(start, end,
delivered)`` (:attr:`Execution.stamps`).
"""

from __future__ import annotations

import gc
import heapq
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from deepcee.cluster import BandwidthTrace
from deepcee.comm import serialise_end_s
from deepcee.errors import ScheduleError
from deepcee.schedule.ir import ActionKind, Schedule

K = ActionKind
_CODE = {K.F: 0, K.I: 1, K.W: 2, K.B: 3, K.SEND_F: 4, K.SEND_B: 5, K.RECV_F: 6, K.RECV_B: 7}
"""Dispatch codes: compute kinds index a device's durations; then sends, then receives."""

COMPUTE, TRANSFER, WAIT = 0, 1, 2
"""Segment kinds recorded here (the simulator adds its own after these)."""

Piece = tuple[int, float, float, float, BandwidthTrace | None, int]
"""One transfer a send issues: ``(receiving device, nbytes, latency_s, bandwidth_bytes_per_s,
trace, resource)``. Given costs use ``nbytes = serialization_s`` and a bandwidth of 1."""

Segment = tuple
"""``(kind, where, action, start, end, pred, nbytes, extra)``: ``action`` is the
:class:`~deepcee.schedule.ir.Action` (readers ``str()`` it: formatting a label for each of
the millions of segments the planner's simulations record cost ~13% of planning at 512
devices) or a text; ``where`` is a device index (a
resource index for transfers), ``pred`` the index of the segment that released this one (-1
at the very start) and ``extra`` ``(src, dst, issued, serialised)`` for transfers."""

LinkCost = tuple[float, float]
"""``(latency_s, serialization_s)`` of one transfer over a directed boundary link."""


class Deadlock(ScheduleError):
    """No device can continue and some have actions left."""

    def __init__(self, message: str, stuck: Sequence[tuple[int, int]]) -> None:
        super().__init__(message)
        self.stuck = tuple(stuck)
        """``(device, index in its row)`` of every stuck action."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tables:
    """What the interpreter needs to time one lowered schedule on a set of devices."""

    rows: Schedule
    """The lowered action list of each stage."""
    stage_of: tuple[int, ...]
    """Stage of each device (devices are numbered ``0..n-1``)."""
    durations: tuple[tuple[float, float, float, float], ...]
    """Per device, the duration of ``F``, ``I``, ``W`` and ``B``."""
    pieces: tuple[tuple[tuple[Piece, ...], tuple[Piece, ...]], ...]
    """Per device, the pieces a ``SEND_F`` and a ``SEND_B`` issue."""
    expected: tuple[tuple[int, int], ...]
    """Per device, how many pieces a ``RECV_F`` and a ``RECV_B`` wait for."""
    num_resources: int
    """Link resources are numbered ``0..num_resources-1``."""
    names: tuple[str, ...]
    """Each device's name in error messages."""
    num_microbatches: int
    """``1 +`` the largest microbatch id in ``rows``."""
    blocking_sends: bool = False
    """A send holds its device until its last piece was delivered."""
    handshake: bool = False
    """A piece starts no earlier than its receiver's start of the pass plus the piece's latency."""

    def __post_init__(self) -> None:
        n = len(self.stage_of)
        for field, value in (("durations", self.durations), ("pieces", self.pieces),
                             ("expected", self.expected), ("names", self.names)):
            if len(value) != n:
                raise ScheduleError(f"interpreter tables: {field} has {len(value)} entries for {n} devices")
        if any(not 0 <= s < len(self.rows) for s in self.stage_of):
            raise ScheduleError(f"interpreter tables: stage_of {self.stage_of} outside 0..{len(self.rows) - 1}")


def stage_tables(rows: Schedule, forward_s: Sequence[float], input_grad_s: Sequence[float],
                 weight_grad_s: Sequence[float], comm_forward: Sequence[LinkCost],
                 comm_backward: Sequence[LinkCost], backward_s: Sequence[float] | None = None, *,
                 num_microbatches: int | None = None) -> Tables:
    """Given per-stage costs: device ``s`` is stage ``s``; boundary ``b`` has one resource per direction.

    ``B`` takes ``backward_s`` (default ``I + W``). ``rows`` must be lowered
    (:func:`deepcee.schedule.passes.lower`): the interpreter only moves data the list moves.
    ``num_microbatches`` saves a pass over ``rows`` when the caller knows it.
    """
    n = len(rows)
    if n > 1 and not any(a.kind is K.SEND_F for a in rows[0][:2]):
        raise ScheduleError("the interpreter times lowered schedules: lower() it first")
    back = backward_s if backward_s is not None else [i + w for i, w in zip(input_grad_s, weight_grad_s, strict=True)]
    durations = tuple(zip(forward_s, input_grad_s, weight_grad_s, back, strict=True))
    last = n - 1
    pieces = tuple(
        (((s + 1, comm_forward[s][1], comm_forward[s][0], 1.0, None, s),) if s < last else (),
         ((s - 1, comm_backward[s - 1][1], comm_backward[s - 1][0], 1.0, None, last + s - 1),) if s > 0 else ())
        for s in range(n))
    expected = tuple((int(s > 0), int(s < last)) for s in range(n))
    num_mb = num_microbatches or 1 + max((a.microbatch for row in rows for a in row), default=0)
    return Tables(rows=rows, stage_of=tuple(range(n)), durations=durations, pieces=pieces, expected=expected,
                  num_resources=2 * last if n > 1 else 0, names=tuple(f"stage {s}" for s in range(n)),
                  num_microbatches=num_mb)


# [Note: interpreter without collection]
# A recorded pass allocates millions of tuples that all stay alive (the segments): the cyclic
# garbage collector's passes over them cost 20-30% of a simulation at 512 devices, and can free
# nothing (a pass makes no reference cycles). It is paused for a pass (and by the simulator for
# a whole simulation, whose segments die with it) and restored after as it was, so nesting and
# callers that pause it themselves are unaffected. Only timing changes: no figure depends on it.


@contextmanager
def collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the block, see [Note: interpreter without collection]."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


class _Pass:
    """The state of one pipeline pass: receive state per (direction, device, microbatch),
    flattened, and per device its position, what released it, its finish and what it waits for."""

    __slots__ = ("cause", "got", "heap", "list_end", "pcs", "ready", "ready_seg", "tick", "wait_from", "waiting")

    def __init__(self, n: int, num_microbatches: int, starts: list[float], preds: list[int]) -> None:
        size = 2 * n * num_microbatches
        self.got, self.ready, self.ready_seg = [0] * size, [0.0] * size, [-1] * size
        self.pcs, self.cause, self.list_end = [0] * n, list(preds), list(starts)
        self.waiting, self.wait_from = [-1] * n, [0.0] * n
        self.heap = sorted((t, d, d) for d, t in enumerate(starts))
        self.tick = itertools.count(n).__next__
        """Sequence numbers that keep the heap's order of equal times first come, first served."""


class Execution:
    """Runs :class:`Tables` one pipeline pass at a time; link queues carry over between passes.

    Per device, ``busy_s`` sums compute and ``wait_s`` time blocked in receives over all
    passes; ``compute_s`` is their total compute, summed in the order actions ran (so a free
    run may differ from a time-ordered one in the last bit). With ``record``, ``segments`` and
    ``stamps`` (per device, ``(start, end, delivered)`` of every action it ran, in order;
    ``delivered`` is a send's last delivery, else ``end``) grow with every pass.
    """

    def __init__(self, tables: Tables, *, start_s: float = 0.0, record: bool = False,
                 keep_stamps: bool | None = None) -> None:
        n = len(tables.stage_of)
        self.tables, self.record = tables, record
        self.keep_stamps = record if keep_stamps is None else keep_stamps and record
        """Whether recording fills ``stamps`` too (the dry run reads them; the simulator does not)."""
        self.segments: list[Segment] = []
        self.stamps: list[list[tuple[float, float, float]]] = [[] for _ in range(n)]
        self.busy_s, self.wait_s = [0.0] * n, [0.0] * n
        self.compute_s = 0.0
        self.res_free = [start_s] * tables.num_resources
        self.res_last = [-1] * tables.num_resources
        senders: list[set[int]] = [set() for _ in range(tables.num_resources)]
        for d, (forward, backward) in enumerate(tables.pieces):
            for piece in forward + backward:
                senders[piece[5]].add(d)
        self.free_run = not record and all(len(s) <= 1 for s in senders)
        """Whether devices may run until they block (see the module docstring)."""
        self._ops: tuple[Schedule, list[list[tuple[int, int, object]]]] | None = None

    def _compiled(self) -> list[list[tuple[int, int, object]]]:
        """Per stage, each action as ``(dispatch code, microbatch, action)``, built once per ``rows``
        (a caller may swap :attr:`tables` between passes, e.g. for stragglers' durations)."""
        rows = self.tables.rows
        if self._ops is None or self._ops[0] is not rows:
            self._ops = (rows, [[(_CODE[a.kind], a.microbatch, a) for a in row] for row in rows])
        return self._ops[1]

    def pipeline(self, t0: float | Sequence[float], pred: int | Sequence[int] = -1) -> tuple[list[float], list[int]]:
        """Run every device's row from ``t0`` (one time, or one per device); returns when each
        finished and, when recording, the index of the segment that ended it (``pred``, one or
        one per device: what released the device at ``t0``, for a device that ran nothing)."""
        with collection_paused():
            return self._pipeline(t0, pred)

    def _pipeline(self, t0: float | Sequence[float], pred: int | Sequence[int]) -> tuple[list[float], list[int]]:
        tb, record, ordered = self.tables, self.record, not self.free_run
        stamping = self.keep_stamps
        stage_of, durations, pieces, expected = tb.stage_of, tb.durations, tb.pieces, tb.expected
        rows = self._compiled()
        n, m_count = len(stage_of), tb.num_microbatches
        segs, stamps, busy, wait = self.segments, self.stamps, self.busy_s, self.wait_s
        res_free, res_last = self.res_free, self.res_last
        starts = [float(t0)] * n if isinstance(t0, (int, float)) else [float(t) for t in t0]
        if len(starts) != n:
            raise ScheduleError(f"interpreter: {len(starts)} start times for {n} devices")
        st = _Pass(n, m_count, starts, [pred] * n if isinstance(pred, int) else list(pred))
        blocking, handshake = tb.blocking_sends, tb.handshake
        got, ready, ready_seg, waiting, wait_from = st.got, st.ready, st.ready_seg, st.waiting, st.wait_from
        pcs, cause, list_end, heap, tick = st.pcs, st.cause, st.list_end, st.heap, st.tick
        # a free run may take devices in any order: a stack is cheaper than the heap
        push, pop = (heapq.heappush, heapq.heappop) if ordered else (list.append, list.pop)
        append = segs.append
        nseg = len(segs)  # == len(segs) throughout: only this loop appends during a pass
        compute = 0.0
        while heap:
            t, _, d = pop(heap)
            row, pc, dur = rows[stage_of[d]], pcs[d], durations[d]
            # this device's cause and busy time are kept locally while it runs (written back below)
            cd, bz = cause[d], busy[d]
            end = len(row)
            while pc < end:
                c, mb, a = row[pc]
                if c < 4:  # F, I, W, B
                    x = dur[c]
                    if record:
                        append((COMPUTE, d, a, t, t + x, cd, 0.0, None))
                        cd = nseg
                        nseg += 1
                        if stamping:
                            stamps[d].append((t, t + x, t + x))
                    bz += x
                    compute += x
                    pc += 1
                    t += x
                    if ordered and heap and heap[0][0] <= t:
                        push(heap, (t, tick(), d))
                        break
                elif c < 6:  # SEND_F, SEND_B
                    back = c - 4
                    last, last_seg = t, -1
                    for dst, nbytes, latency, bw, trace, res in pieces[d][back]:
                        go = t
                        if handshake and starts[dst] + latency > go:  # the receiver's ready notice
                            go = starts[dst] + latency
                        if res_free[res] > go:  # queued behind the transfer ahead on this resource
                            begin, p = res_free[res], res_last[res]
                        else:
                            begin, p = go, cd
                        done = begin + nbytes / bw if trace is None else serialise_end_s(begin, nbytes, bw, trace)
                        arrive = done + latency
                        res_free[res] = done
                        if record:
                            append((TRANSFER, res, a, begin, arrive, p, nbytes, (d, dst, t, done)))
                            res_last[res] = nseg
                            nseg += 1
                        if arrive > last:
                            last, last_seg = arrive, res_last[res]
                        key = (back * n + dst) * m_count + mb
                        got[key] += 1
                        if arrive >= ready[key]:
                            ready[key], ready_seg[key] = arrive, res_last[res]
                        if waiting[dst] == key and got[key] == expected[dst][back]:
                            # release the blocked receiver at the delivery (or where it got to, in a free run)
                            waiting[dst], since = -1, wait_from[dst]
                            r = ready[key] if ready[key] > since else since
                            wait[dst] += r - since
                            if record:  # the receiver sat in its receive from ``since`` until ``r``
                                append((WAIT, dst, rows[stage_of[dst]][pcs[dst]][2], since, r, ready_seg[key],
                                        0.0, None))
                                nseg += 1
                                if stamping:
                                    stamps[dst].append((since, r, r))
                                cause[dst] = ready_seg[key]  # the wait is idle: the path runs through what ended it
                            pcs[dst] += 1
                            push(heap, (r, tick(), dst))
                    pc += 1
                    if blocking and last > t:  # the send runs in the device's own stream
                        if record:
                            if stamping:
                                stamps[d].append((t, last, last))
                            append((WAIT, d, a, t, last, last_seg, 0.0, None))
                            nseg += 1
                            cd = last_seg  # as for a receive: the path runs through the transfer
                        wait[d] += last - t
                        t = last
                        if ordered and heap and heap[0][0] <= t:
                            push(heap, (t, tick(), d))
                            break
                    elif stamping:
                        stamps[d].append((t, t, last))
                else:  # RECV_F, RECV_B
                    back = c - 6
                    key = (back * n + d) * m_count + mb
                    if got[key] < expected[d][back]:
                        waiting[d], wait_from[d] = key, t
                        break
                    pc += 1
                    r = ready[key]
                    if r <= t:
                        if stamping:
                            stamps[d].append((t, t, t))
                        continue
                    wait[d] += r - t
                    if record:
                        append((WAIT, d, a, t, r, ready_seg[key], 0.0, None))
                        nseg += 1
                        if stamping:
                            stamps[d].append((t, r, r))
                        cd = ready_seg[key]
                    if ordered and heap and heap[0][0] <= r:
                        push(heap, (r, tick(), d))
                        break
                    t = r
            pcs[d], cause[d], busy[d] = pc, cd, bz
            if pc == end:
                list_end[d] = t
        self.compute_s += compute
        self._check_finished(pcs, got)
        return list_end, cause

    def _check_finished(self, pcs: list[int], got: list[int]) -> None:
        tb = self.tables
        n, m_count = len(tb.stage_of), tb.num_microbatches
        stuck, text = [], []
        for d, pc in enumerate(pcs):
            row = tb.rows[tb.stage_of[d]]
            if pc == len(row):
                continue
            a = row[pc]
            stuck.append((d, pc))
            back = a.kind is K.RECV_B
            have, need = got[(back * n + d) * m_count + a.microbatch], tb.expected[d][back]
            text.append(f"{tb.names[d]} at {a} ({have} of {need} pieces arrived)")
        if stuck:
            raise Deadlock("schedule deadlocks; stuck actions: " + "; ".join(text), stuck)
