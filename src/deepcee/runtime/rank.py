"""What every rank runs: join the process group and train the launch's jobs in order.

:func:`run_jobs_on_rank` is the entry of every rank process (the local launcher's and
``python -m deepcee.train`` under torchrun). It sits above both ways a rank trains: the
:class:`~deepcee.runtime.trainer.Trainer` (a fixed set of ranks) and the elastic runner
(:mod:`deepcee.runtime.elastic`, whose generations build Trainers); neither imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from deepcee.errors import SpecError
from deepcee.runtime import dist as rdist
from deepcee.runtime import elastic_rank as relastic
from deepcee.runtime import runlock
from deepcee.runtime.job import Job
from deepcee.runtime.records import TrainResult
from deepcee.runtime.trainer import Trainer, Worker


def run_jobs_on_rank(jobs: Sequence[Job], rank: int, world_size: int, store: dist.Store, *,
                     local_rank: int = 0, node: str = "", launcher_rank: int | None = None,
                     ) -> list[TrainResult | None]:
    """Join the process group and run ``jobs`` in order on this rank; rank 0 gets the results.

    Each job's run folder is locked by rank 0 while the job runs (:mod:`deepcee.runtime.runlock`);
    when another run holds it, every rank fails with rank 0's message."""
    rdist.single_thread()
    use_cuda = any(j.config.use_cuda for j in jobs)
    device = rdist.pick_device(use_cuda, local_rank)
    if any(relastic.elastic_config(j) is not None for j in jobs):
        if len(jobs) > 1:
            raise SpecError("an elastic job runs alone in its launch (its process groups change)", field="jobs")
        return [relastic.run_elastic_job(jobs[0], rank, world_size, store, device=device, node=node,
                                         launcher_rank=launcher_rank)]
    timeout = max(j.config.timeout_s for j in jobs)
    rdist.init_process_group(store=store, rank=rank, world_size=world_size, backend=rdist.backend_for(device),
                             timeout_s=timeout, device=device)
    results = []
    clean = False
    try:
        for job in jobs:
            Path(job.run_dir).mkdir(parents=True, exist_ok=True)
            worker = Worker(rank=rank, world_size=world_size, store=store, device=device, node=node,
                            launcher_rank=launcher_rank)
            with runlock.agree(job.run_dir, job=job.name, rank=rank, store=store, timeout_s=job.config.timeout_s):
                trainer = Trainer(job, worker, None if job.hooks is None else job.hooks.hooks(job, worker))
                if trainer.takes_part:
                    trainer.setup()
                    results.append(trainer.train())
                else:
                    results.append(None)
        clean = True
    finally:
        rdist.shutdown(clean=clean)
    return results


__all__ = ["run_jobs_on_rank"]
