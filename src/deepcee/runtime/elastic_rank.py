"""What a rank of an elastic launch runs: :func:`run_elastic_job` (and a returning device's rejoin).

Generation 0 from the start, or, for a device that comes back (a restarted process, or one
left out), the generation that admits it; the :class:`~deepcee.runtime.elastic.Session` under
it is [Note: elastic process groups] in :mod:`deepcee.runtime.elastic`. The job's hooks factory
says how (:class:`ElasticFactory`, :class:`JoiningHooks`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from deepcee.errors import RuntimeSetupError
from deepcee.runtime.elastic import Session
from deepcee.runtime.elastic_types import ElasticConfig, Excluded, Transition

if TYPE_CHECKING:
    from deepcee.runtime.job import Job
    from deepcee.runtime.records import TrainResult
    from deepcee.runtime.trainer import Trainer

log = logging.getLogger(__name__)

PIDS_DIR = "pids"
"""``<run_dir>/pids/<device>``: the pid of the process running the device now."""




class JoiningHooks(Protocol):
    """What an elastic job's hooks do beyond :class:`deepcee.runtime.hooks.TrainerHooks`."""

    def admitted(self, tr: Transition) -> None:
        """Before the trainer of a device that comes back exists: the members and plan of ``tr``."""

    def join(self, trainer: Trainer, tr: Transition) -> None:
        """Take part in ``tr`` as a device that comes back (the trainer is in generation ``tr.gen``)."""


class ElasticFactory(Protocol):
    """:attr:`deepcee.runtime.job.Job.hooks` of an elastic job."""

    elastic: ElasticConfig

    def warm(self, job: Job, device: torch.device) -> None:
        """One-off costs of a process that comes back (imports, first passes), paid before it asks."""


def elastic_config(job: Job) -> ElasticConfig | None:
    """The job's elastic settings (its hooks factory's ``elastic``), or ``None``."""
    return getattr(job.hooks, "elastic", None)


def run_elastic_job(job: Job, rank: int, world_size: int, store: dist.Store, *, device: torch.device,
                    node: str = "", launcher_rank: int | None = None) -> TrainResult | None:
    """One rank of an elastic launch: generation 0 from the start, or, for a device that comes
    back, the generation that admits it; trains until the end (rank 0 returns the result)."""
    from deepcee.runtime import runlock
    from deepcee.runtime.trainer import Trainer, Worker

    cfg = elastic_config(job)
    devices = tuple(job.hooks.rank_devices(job))
    if world_size != len(devices):
        raise RuntimeSetupError(f"an elastic job runs one rank per device of {list(devices)}, the launch has "
                                f"{world_size}")
    s = Session(dist.PrefixStore(f"{job.name}/elastic", store), cfg, device=devices[rank], launch_devices=devices,
                timeout_s=job.config.timeout_s, torch_device=device)
    returning = s.returning
    s.start()
    pids = Path(job.run_dir) / PIDS_DIR
    pids.mkdir(parents=True, exist_ok=True)
    (pids / devices[rank]).write_text(str(os.getpid()))  # who runs which device (operators, fault tests)
    try:
        while True:
            try:
                if not returning:
                    s.enter(Transition(gen=0, devices=devices, resume_step=0))
                    w = Worker(rank=rank, world_size=world_size, store=store, device=device, node=node,
                               launcher_rank=launcher_rank, waiter=s)
                    with runlock.agree(job.run_dir, job=job.name, rank=rank, store=store,
                                       timeout_s=job.config.timeout_s) as lock:
                        t = Trainer(job, w, job.hooks.hooks(job, w))
                        t.run_lock = lock
                        t.setup()
                        result = t.train()
                else:
                    result = _rejoin(job, s, store, device, node)
                s.store.set(f"finished/{s.me}", "1")  # its process ends now: not a lost member
                if result is not None:
                    s.finish()
                return result
            except Excluded as exc:
                log.warning("%s: %s; asking to rejoin", s.me, exc)
                s.leave()
                returning = True
    finally:
        s.close()
        s.leave()
        s.release()


def _rejoin(job: Job, s: Session, store: dist.Store, device: torch.device, node: str) -> TrainResult | None:
    from deepcee.runtime.trainer import Trainer, Worker

    job.hooks.warm(job, device)
    tr = s.await_admission()
    if tr is None:
        log.info("%s: the run ended before it could rejoin", s.me)
        return None
    rank = s.enter(tr)
    w = Worker(rank=rank, world_size=len(tr.devices), store=store, device=device, node=node, waiter=s)
    hooks = job.hooks.hooks(job, w)
    hooks.admitted(tr)
    t = Trainer(replace(job, plan=tr.detail.plan), w, hooks)  # the new plan's groups, as every member makes them
    hooks.join(t, tr)
    return t.train(joining=True)


__all__ = ["PIDS_DIR", "ElasticFactory", "JoiningHooks", "elastic_config", "run_elastic_job"]
