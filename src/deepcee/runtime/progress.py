"""What rank 0 tells the user while a run goes (a progress line every N steps, TensorBoard scalars)
and records about it (where every rank ran: :func:`gather_rank_infos`).

The progress line goes through ``logging`` (logger ``deepcee.runtime.progress``, level INFO;
``deepcee train`` shows it on stderr)::

    step 40/200  loss 2.3456  eval 2.4012  lr 1.00e-03  |g| 0.813  123.4 samples/s  ETA 1m23s

``samples/s`` is the global batch over the mean step time of the steps since the last line, in
the run's own seconds (emulated seconds in modes ``emulated`` and ``realnet``, like the metrics);
``ETA`` is wall-clock: the wall time per step since the last line (evaluations and checkpoints
included) times the steps left. TensorBoard (``tensorboard=True``): ``loss``, ``lr``,
``grad_norm``, ``samples_per_s`` and ``eval_loss`` per step under ``<run_dir>/tensorboard``, when
``torch.utils.tensorboard`` works (the ``tensorboard`` package).
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from deepcee.errors import RuntimeSetupError
from deepcee.runtime.job import TrainConfig
from deepcee.runtime.records import RankInfo, StepMetrics

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can work here (its ``tensorboard`` dependency is installed)."""
    return importlib.util.find_spec("tensorboard") is not None


def open_tensorboard(run_dir: str | Path) -> Any:
    """A ``SummaryWriter`` on ``<run_dir>/tensorboard``; a clear error when the package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise RuntimeSetupError(f"TensorBoard logs need the tensorboard package (pip install tensorboard): {exc}") from None
    return SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))


def fmt_eta(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class RunLog:
    """Rank 0's progress lines and TensorBoard scalars, fed one step record at a time."""

    def __init__(self, *, every: int, total_steps: int, global_batch: int, writer: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.total, self.global_batch = every, total_steps, global_batch
        self.writer, self.clock = writer, clock
        self._since: list[float] = []
        self._t0 = clock()
        self._last_eval: float | None = None

    @staticmethod
    def for_run(cfg: TrainConfig, run_dir: str | Path, *, global_batch: int) -> RunLog:
        writer = open_tensorboard(run_dir) if cfg.tensorboard else None
        return RunLog(every=cfg.log_every, total_steps=cfg.steps, global_batch=global_batch, writer=writer)

    def step(self, rec: StepMetrics) -> str | None:
        """Record step ``rec``; returns the progress line when one is due (it is also logged)."""
        self._since.append(rec.step_s)
        if rec.eval_loss is not None:
            self._last_eval = rec.eval_loss
        if self.writer is not None:
            self._scalars(rec)
        done = rec.step + 1
        if not self.every or (done % self.every and done != self.total):
            return None
        line = self._line(rec, done)
        log.info("%s", line)
        self._since, self._t0 = [], self.clock()
        return line

    def _line(self, rec: StepMetrics, done: int) -> str:
        parts = [f"step {done}/{self.total}", f"loss {rec.loss:.4f}"]
        if self._last_eval is not None:
            parts.append(f"eval {self._last_eval:.4f}")
        if rec.lr is not None:
            parts.append(f"lr {rec.lr:.2e}")
        if rec.grad_norm is not None:
            parts.append(f"|g| {rec.grad_norm:.3g}")
        mean_s = sum(self._since) / len(self._since)
        parts.append(f"{self.global_batch / mean_s:.1f} samples/s" if mean_s > 0 else "- samples/s")
        wall_per_step = (self.clock() - self._t0) / len(self._since)
        parts.append(f"ETA {fmt_eta(wall_per_step * (self.total - done))}")
        return "  ".join(parts)

    def _scalars(self, rec: StepMetrics) -> None:
        w, k = self.writer, rec.step + 1
        w.add_scalar("loss", rec.loss, k)
        w.add_scalar("samples_per_s", rec.samples_per_s, k)
        for name in ("lr", "grad_norm", "eval_loss"):
            v = getattr(rec, name)
            if v is not None:
                w.add_scalar(name, v, k)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def gather_rank_infos(t: Trainer) -> list[RankInfo] | None:
    """Where every rank of trainer ``t``'s job group runs (device, stage, backend, torch device,
    host), on rank 0 (``None`` elsewhere); collective over the job group."""
    p = t.placement if t.active else None
    mine = RankInfo(rank=t.w.rank, device=t.hooks.device(t), stage=None if p is None else p.stage,
                    backend=dist.get_backend(), torch_device=str(t.w.device), host=socket.gethostname(),
                    node=t.w.node, launcher_rank=t.w.launcher_rank)
    out = [None] * dist.get_world_size(group=t.job_group) if t.w.rank == 0 else None
    dist.gather_object(mine, out, dst=0, group=t.job_group)
    return out
