"""Fault injection at a chosen point of a rank's run (imported by the spawned ranks of test_faults).

:class:`StopInSave` is an adaptive job's hooks factory (:class:`deepcee.adapter.hooks.AdaptSpec`)
whose device ``stop_device`` stops itself (SIGSTOP, a hang: its process and heartbeat stand
still) when it reaches its part of checkpoint ``at_step``'s save, after writing the wall time
to ``<run_dir>/stopped``. Its peers are then inside that save's collectives, waiting on it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from deepcee.adapter.hooks import AdaptiveHooks, AdaptSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class StopInSave(AdaptSpec):
    stop_device: str
    at_step: int

    def hooks(self, job, worker) -> AdaptiveHooks:
        return _StoppingHooks(self, job, worker)


class _StoppingHooks(AdaptiveHooks):
    def prepare(self, t) -> None:
        super().prepare(t)
        if self.devices[t.w.rank] != self.spec.stop_device:
            return
        save = t._checkpoint

        def stopping(step_done: int) -> None:
            if step_done == self.spec.at_step:
                (Path(t.run_dir) / "stopped").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            save(step_done)

        t._checkpoint = stopping


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldForRejoin(AdaptSpec):
    """Rank 0 holds every step boundary from ``from_step`` on until some device asks to rejoin
    (then takes it in there, as at any boundary), until one has come back: a run of few steps
    still sees the restarted process (imports, warm-up: seconds) come back, however loaded the
    machine. It watches for faults while it holds."""

    from_step: int
    hold_s: float = 45.0
    """Per boundary; below the run's timeout (60 s), which the others' wait for rank 0's decision has."""

    def hooks(self, job, worker) -> AdaptiveHooks:
        return _HoldingHooks(self, job, worker)


class _HoldingHooks(AdaptiveHooks):
    def decide(self, t, step, gathered):
        if t.w.rank == 0 and step >= self.spec.from_step and not any(e["kind"] == "device-rejoin" for e in self.events):
            s = t.w.waiter
            t_end = time.monotonic() + self.spec.hold_s
            while not s.rejoin_requests() and time.monotonic() < t_end:
                s.check()
                time.sleep(0.02)
        return super().decide(t, step, gathered)
