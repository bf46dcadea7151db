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
