"""Overlapped model averaging over time (torch-free): rounds in flight while local steps go on.

The runtime's rule is [Note: overlapped averaging] in :mod:`deepcee.runtime.overlap`; this is
its timing, on a :class:`~.replicas.Run`'s loop and shared network:

[Note: overlapped averaging (simulator)]
- At its sync point ``k`` (every ``period``-th local step) a replica takes round ``k-1``'s
  result, waiting only until it has arrived at all its devices (none at ``k = 0``), then each
  segment's first holder in the replica sends its copy to the root (the segment's first
  holder in replica 0) and the replica goes on with its next local step at once.
- The root combines a round (server work as in blocking averaging: a sum per copy, plus the
  outer Nesterov step) at the end of the first of its own local steps at which every copy has
  arrived (the runtime's root looks after each local step), or, if it reaches its next sync
  point first, as soon as the last copy arrives; then it sends the result to its own
  replica's holders and to each other replica's first holder, which hands it on inside its
  replica when it takes it (at its sync point), as the runtime does. Replica 0 resumes after
  that work.
- The last local step ends with a blocking sync point: a sync point (unless the step was one),
  then every replica waits for that round's result.

So with communication shorter than ``period`` local steps a period costs about ``period``
local steps; a longer one shows as a wait at the next sync point (counted as cross-replica
synchronisation in ``wan_s``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepcee.simulator.pipelines import StepTimes
from deepcee.simulator.strategies import OUTER_FLOPS_PER_PARAMETER, SUM_FLOPS_PER_PARAMETER

if TYPE_CHECKING:
    from deepcee.simulator.replicas import Run


@dataclass(slots=True)
class _Round:
    senders: int = 0
    ready_s: float = 0.0
    """When the last copy arrived at its root (once every replica sent)."""
    combined: bool = False
    own_s: float = 0.0
    """When replica 0's devices all have the result (the root sends to them directly)."""
    delegates_s: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    """Replica -> (segment index, when the result reached the replica's first holder of it)."""
    scheduled: bool = False
    waiters: dict[int, tuple[float, Callable[[float], None]]] = field(default_factory=dict)


class Overlapped:
    """The replicas and the root of an overlapped ``model-averaging`` run."""

    def __init__(self, run: Run, steps: int) -> None:
        self.run, self.steps = run, steps
        s = run.plan.strategy
        self.period, self.n = s.period, len(run.pipes)
        self.flops = self.n * SUM_FLOPS_PER_PARAMETER + (OUTER_FLOPS_PER_PARAMETER if s.outer_optimizer == "nesterov"
                                                         else 0.0)
        self.count = [0] * self.n
        self.sent = [0] * self.n
        self.rounds: dict[int, _Round] = {}
        self.root_blocked: int | None = None

    def begin(self) -> None:
        for r in range(self.n):
            self.run.loop.at(self.run.start_s, lambda t, r=r: self.start(r, t))

    def start(self, r: int, t: float) -> None:
        st = self.run.pipes[r].local_step(t, self.count[r])
        self.count[r] += 1
        self.run.loop.at(max(st.end), lambda t2: self.after(r, st, t2))

    def after(self, r: int, st: StepTimes, t: float) -> None:
        done = self.count[r]
        last, at_sync = done == self.steps, done % self.period == 0
        if not (at_sync or last):
            self.finish(r, self.poll(t) if r == 0 else t, t)
            return

        def sent(u: float) -> None:
            self.send(r, u)
            if last:  # the blocking end: wait for the round just sent
                self.await_result(r, self.sent[r] - 1, u, lambda v: self.run.step_done(r, v))
            else:
                self.finish(r, u, u)

        if self.sent[r] == 0:
            sent(t)
        else:
            self.await_result(r, self.sent[r] - 1, t, sent)

    def finish(self, r: int, t: float, arrived: float) -> None:
        if t > arrived:
            self.run.crossed(r, arrived, arrived, t)
        self.run.step_done(r, t)
        if self.count[r] < self.steps:
            self.start(r, t)

    def send(self, r: int, t: float) -> None:
        """Replica ``r``'s copies of round ``sent[r]`` to the roots, from ``t``."""
        k = self.sent[r]
        self.sent[r] += 1
        rnd = self.rounds.setdefault(k, _Round())
        for seg in self.run.segments:
            nbytes = self.run.model.gradient_bytes(seg.start, seg.stop)
            arrive = self.run.net.send(seg.holders[r][0], seg.holders[0][0], nbytes, t, f"round {k} replica {r} copy")
            rnd.ready_s = max(rnd.ready_s, arrive)
        rnd.senders += 1
        self._try_combine(k)

    def poll(self, t: float) -> float:
        """Replica 0 after a local step at ``t``: combine its last round if every copy is here; its resume."""
        k = self.sent[0] - 1
        rnd = self.rounds.get(k)
        if rnd is None or rnd.combined or rnd.scheduled or rnd.senders < self.n or rnd.ready_s > t:
            return t
        rnd.scheduled = True
        return self._combine(k, t)

    def await_result(self, r: int, k: int, t: float, then: Callable[[float], None]) -> None:
        """Replica ``r``, arrived at ``t``, goes on (``then``) once round ``k``'s result is at all its devices."""
        rnd = self.rounds[k]
        if rnd.combined:
            self._resume(r, t, self._result_at(rnd, r, t), then)
            return
        rnd.waiters[r] = (t, then)
        if r == 0:
            self.root_blocked = k
            self._try_combine(k)

    def _resume(self, r: int, arrived: float, at: float, then: Callable[[float], None]) -> None:
        u = max(arrived, at)
        self.run.crossed(r, arrived, arrived, u)
        self.run.loop.at(u, then)

    def _try_combine(self, k: int) -> None:
        rnd = self.rounds[k]
        if self.root_blocked == k and rnd.senders == self.n and not rnd.scheduled:
            rnd.scheduled = True
            self.run.loop.at(max(self.run.loop.now, rnd.ready_s), lambda t: self._combine(k, t))

    def _result_at(self, rnd: _Round, r: int, t: float) -> float:
        """When replica ``r``, taking the result at ``t``, has it at all its devices (call once
        per round and replica: the hand-on messages are issued here)."""
        if r == 0:
            return rnd.own_s
        run, last = self.run, t
        for j, arrived in rnd.delegates_s[r]:
            seg = run.segments[j]
            hs, nbytes = seg.holders[r], run.model.gradient_bytes(seg.start, seg.stop)
            last = max(last, arrived)
            for h in hs[1:]:
                last = max(last, run.net.send(hs[0], h, nbytes, max(t, arrived), f"replica {r} hands on"))
        return last

    def _combine(self, k: int, t: float) -> float:
        """Every segment's result at its root from ``t``, sent on; the roots' end."""
        run, rnd = self.run, self.rounds[k]
        end, rnd.own_s = t, t
        rnd.delegates_s = {r: [] for r in range(1, self.n)}
        for j, seg in enumerate(run.segments):
            root = seg.holders[0][0]
            params = run.model.parameters(seg.start, seg.stop)
            done = run.net.work(root, t, params * self.flops / run.server_flops(root, t),
                                f"round {k} layers [{seg.start}, {seg.stop}) combine")
            end = max(end, done)
            nbytes = run.model.gradient_bytes(seg.start, seg.stop)
            for h in seg.holders[0]:
                rnd.own_s = max(rnd.own_s, run.net.send(root, h, nbytes, done, f"round {k} result"))
            for r, hs in enumerate(seg.holders[1:], start=1):
                rnd.delegates_s[r].append((j, run.net.send(root, hs[0], nbytes, done, f"round {k} result")))
        rnd.combined = True
        if self.root_blocked == k:
            self.root_blocked = None
        for r, (at, then) in sorted(rnd.waiters.items()):
            self._resume(r, at, self._result_at(rnd, r, at), then)
        rnd.waiters.clear()
        return end


def run_overlapped_averaging(run: Run, steps: int) -> None:
    """Overlapped model averaging; see [Note: overlapped averaging (simulator)]."""
    Overlapped(run, steps).begin()


__all__ = ["run_overlapped_averaging"]
