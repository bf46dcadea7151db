"""Local multi-process launch on one machine, with a hard overall deadline.

:func:`launch_jobs` starts one process per rank (``spawn``; one thread each and :data:`deepcee.runtime.dist.WORKER_ENV`; a ``FileStore``
in a fresh temporary directory, so no ports are involved and nothing collides with other
runs), runs :func:`deepcee.runtime.trainer.run_jobs_on_rank` in each, and waits. If a rank
fails, the others are stopped after a short grace period and the *first* failure (by time:
later ones are usually timeouts it caused) is raised again in the parent, as the same
:mod:`deepcee.errors` class, naming the rank. If the deadline passes, every process is
killed and :class:`RuntimeSetupError` says which ranks were still running: a hang is a
failure, never a stuck test.

:func:`run_training` is the one-call public entry: plan + cluster + model -> :class:`TrainResult`.
For many machines use ``torchrun`` with :mod:`deepcee.train` instead.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepcee import errors
from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError
from deepcee.plan import Plan, plan_from_dict
from deepcee.runtime import dist as rdist
from deepcee.runtime.checkpoint import read_metrics
from deepcee.runtime.trainer import Job, TrainConfig, run_jobs_on_rank, write_error

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainResult:
    """What a run measured (times already divided by the dilation in emulated mode)."""

    job: str
    losses: tuple[float, ...]
    """Mean loss over the global batch, per step."""
    step_s: tuple[float, ...]
    samples_per_s: float
    """Global batch / median step time, first step (warm-up) excluded when there are more."""
    median_step_s: float
    mode: str
    dilation: float
    emulated: tuple[str, ...]
    """Which figures come from emulation (empty in real mode)."""
    run_dir: str
    metrics: tuple[dict[str, Any], ...]
    """The per-step records of ``metrics.jsonl``."""

    @staticmethod
    def from_run_dir(run_dir: str | Path) -> TrainResult:
        d = json.loads((Path(run_dir) / "result.json").read_text())
        return TrainResult(
            job=d["job"], losses=tuple(d["losses"]), step_s=tuple(d["step_s"]), samples_per_s=d["samples_per_s"],
            median_step_s=d["median_step_s"], mode=d["mode"], dilation=d["dilation"], emulated=tuple(d["emulated"]),
            run_dir=str(run_dir), metrics=tuple(read_metrics(Path(run_dir) / "metrics.jsonl")),
        )


def _child(target: Callable[..., None], rank: int, world_size: int, store_path: str, args: tuple[Any, ...],
           error_dir: str) -> None:
    try:
        target(rank, world_size, store_path, *args)
    except BaseException as exc:  # report every failure to the parent, then exit non-zero
        write_error(error_dir, rank, exc)
        raise SystemExit(1) from None


def _first_error(error_dir: Path) -> RuntimeSetupError | errors.DeepceeError | None:
    found = [json.loads(p.read_text()) for p in error_dir.glob("error-rank*.json")]
    if not found:
        return None
    first = min(found, key=lambda e: e["time"])
    cls = getattr(errors, first["type"], None) if first["domain"] else None
    others = f" ({len(found) - 1} other rank(s) failed after it)" if len(found) > 1 else ""
    if isinstance(cls, type) and issubclass(cls, errors.DeepceeError):
        return cls(f"rank {first['rank']}: {first['message']}{others}")
    return RuntimeSetupError(
        f"rank {first['rank']} failed: {first['type']}: {first['message']}{others}\n{first['traceback']}"
    )


def launch(target: Callable[..., None], args: tuple[Any, ...], *, world_size: int, deadline_s: float,
           grace_s: float = 2.0) -> None:
    """Run ``target(rank, world_size, store_path, *args)`` in ``world_size`` processes under a deadline.

    ``target`` must be importable (a module-level function); ``store_path`` is a fresh
    ``FileStore`` path. A rank's exception is re-raised here (see the module docstring).
    """
    tmp = Path(tempfile.mkdtemp(prefix="deepcee-launch-"))
    ctx = mp.get_context("spawn")
    procs = []
    try:
        with rdist.worker_env():
            for rank in range(world_size):
                p = ctx.Process(target=_child, args=(target, rank, world_size, str(tmp / "store"), args, str(tmp)),
                                name=f"deepcee-rank{rank}")
                p.start()
                procs.append(p)
        _supervise(procs, tmp, deadline_s=deadline_s, grace_s=grace_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def _supervise(procs: list, error_dir: Path, *, deadline_s: float, grace_s: float) -> None:
    t_end = time.monotonic() + deadline_s
    failed_at = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > grace_s:
            break
        if now > t_end:
            running = [i for i, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                p.kill()
            err = _first_error(error_dir)
            raise RuntimeSetupError(
                f"launch deadline of {deadline_s:g} s passed; ranks {running} still running"
                + (f"; first failure: {err}" if err else "")
            )
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
    err = _first_error(error_dir)
    if err is not None:
        raise err
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (0, None)]
    if bad:
        raise RuntimeSetupError(f"ranks exited abnormally without an error record: {bad} (killed by a signal?)")


def _jobs_entry(rank: int, world_size: int, store_path: str, jobs: Sequence[Job], timeout_s: float) -> None:
    run_jobs_on_rank(jobs, rank, world_size, rdist.file_store(store_path, world_size, timeout_s))


def launch_jobs(jobs: Sequence[Job], *, world_size: int | None = None, deadline_s: float = 600.0) -> list[TrainResult]:
    """Run several jobs, in order, in one set of processes (one start-up for all of them)."""
    if not jobs:
        return []
    need = max(j.adapter.ranks(j) if j.adapter is not None else len(plan_from_dict(j.plan).devices) for j in jobs)
    world = need if world_size is None else world_size
    if world < need:
        raise RuntimeSetupError(f"a job needs {need} ranks, world_size is {world}")
    timeout = max(j.config.timeout_s for j in jobs)
    launch(_jobs_entry, (list(jobs), timeout), world_size=world, deadline_s=deadline_s)
    return [TrainResult.from_run_dir(j.run_dir) for j in jobs]


def run_training(plan: Plan, cluster: Cluster, *, model: Any = "gpt-tiny", steps: int, run_dir: str | Path | None = None,
                 loss_fn: Callable | None = None, dataset: Any = None, deadline_s: float = 600.0,
                 checkpoint_dir: str | Path | None = None, **config: Any) -> TrainResult:
    """Train ``model`` for ``steps`` steps following ``plan`` on local processes (one per device).

    ``config`` holds :class:`TrainConfig` fields (``mode``, ``dtype``, ``optimizer``,
    ``checkpoint_every``, ``resume``, ...). Metrics go to ``<run_dir>/metrics.jsonl``.
    """
    cfg = TrainConfig(steps=steps, **config)
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="deepcee-run-"))
    job = Job(name=f"job-{uuid.uuid4().hex[:8]}", plan=plan.to_dict(), cluster=cluster.to_dict(), model=model,
              config=cfg, run_dir=str(run_dir), loss_fn=loss_fn, dataset=dataset,
              checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir))
    return launch_jobs([job], deadline_s=deadline_s)[0]
