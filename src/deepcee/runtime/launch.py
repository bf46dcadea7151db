"""Local multi-process launch on one machine, with a hard overall deadline.

:func:`launch_jobs` starts one process per rank (``spawn``; one thread each and :data:`deepcee.runtime.dist.WORKER_ENV`; a ``FileStore``
in a fresh temporary directory, so no ports are involved and nothing collides with other
runs), runs :func:`deepcee.runtime.rank.run_jobs_on_rank` in each, and waits. If a rank
fails, the others are stopped after a short grace period and the *first* failure (by time:
later ones are usually timeouts it caused) is raised again in the parent, as the same
:mod:`deepcee.errors` class, naming the rank. If the deadline passes, every process is
killed and :class:`RuntimeSetupError` says which ranks were still running: a hang is a
failure, never a stuck test. An elastic launch (a job with elastic settings, option
``elastic``) outlives a rank instead ([Note: elastic supervision] in
:mod:`deepcee.runtime.supervise`): its survivors train on, and a rank that died may be
started again to rejoin.

:func:`run_training` is the one-call public entry: plan + cluster + model -> :class:`TrainResult`
(:mod:`deepcee.runtime.records`; ``launch_jobs`` returns the same, read back from each job's
run folder). For many machines use ``torchrun`` with :mod:`deepcee.train` instead.

Jobs in mode ``realnet`` run under :func:`deepcee.runtime.realnet.launch_realnet` instead of
:func:`launch`: rank ``r`` in its own network namespace as device ``devices[r]``, every
message through the shaping relay. The relay is set up once per launch, for one device
order and one time dilation, so every job of such a launch must be in mode ``realnet``, use
the same devices in the same rank order (a plan's devices, or an adaptive job's device
list) and the same dilation, and the world is exactly those devices. The relay's counters (packets,
bytes, drops, queueing per link resource) go to ``<run_dir>/relay.json`` of every job.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.plan import Plan, save_json_atomic
from deepcee.runtime import dist as rdist
from deepcee.runtime import runlock
from deepcee.runtime.elastic_rank import elastic_config
from deepcee.runtime.emulation import choose_dilation
from deepcee.runtime.job import Job, TrainConfig
from deepcee.runtime.rank import run_jobs_on_rank
from deepcee.runtime.realnet import launch_realnet
from deepcee.runtime.records import TrainResult
from deepcee.runtime.supervise import Elastic, spawn_rank, spawn_ranks, supervise

log = logging.getLogger(__name__)


def launch(target: Callable[..., None], args: tuple[Any, ...], *, world_size: int, deadline_s: float,
           grace_s: float = 2.0, elastic: Elastic | None = None) -> None:
    """Run ``target(rank, world_size, store_path, *args)`` in ``world_size`` processes under a deadline.

    ``target`` must be importable (a module-level function); ``store_path`` is a fresh
    ``FileStore`` path. A rank's failure is raised here, the first one by time
    ([Note: first failure] in :mod:`deepcee.runtime.supervise`); no rank outlives the caller.
    ``elastic``: rank deaths do not end the launch ([Note: elastic supervision]).
    """
    run_dir = Path(tempfile.mkdtemp(prefix="deepcee-launch-"))

    def restart(rank: int) -> Any:
        log.warning("starting rank %d again (elastic launch)", rank)
        with rdist.worker_env():
            return spawn_rank(target, args, rank=rank, world_size=world_size, run_dir=run_dir)

    try:
        with rdist.worker_env():
            workers = spawn_ranks(target, args, world_size=world_size, run_dir=run_dir)
        supervise(workers, run_dir, deadline_s=deadline_s, grace_s=grace_s, label="launch", elastic=elastic,
                  restart=restart)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _jobs_entry(rank: int, world_size: int, store_path: str, jobs: Sequence[Job], timeout_s: float,
                log_level: int = logging.WARNING) -> None:
    _log_like_parent(log_level)
    # an elastic launch's ranks come and go: the store file must not be removed when a count of
    # them has closed it (FileStore's clean-up), only with the launch's folder
    elastic = any(elastic_config(j) is not None for j in jobs)
    run_jobs_on_rank(jobs, rank, world_size, rdist.file_store(store_path, -1 if elastic else world_size, timeout_s))
    # the child then leaves without native destructors at exit (supervise.leave_after_success)


def _log_like_parent(level: int) -> None:
    """A spawned rank logs ``deepcee`` records at the level the launching process shows them
    (``deepcee train``: INFO, so rank 0's progress lines reach the terminal)."""
    logger = logging.getLogger("deepcee")
    if level < logging.WARNING and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)


def _realnet_jobs(jobs: Sequence[Job], world_size: int | None) -> tuple[list[Job], Cluster, tuple[str, ...], float]:
    """Check a realnet launch (see the module docstring); the jobs with the launch's dilation set,
    the cluster, the rank devices and the dilation."""
    other = [j.name for j in jobs if j.config.mode != "realnet"]
    if other:
        raise SpecError(f"jobs {other} are not in mode 'realnet' but others of the launch are; the relay shapes "
                        "every message of a realnet launch, so run them in a separate launch", field="mode")
    devices = jobs[0].rank_devices()
    for j in jobs[1:]:
        if j.rank_devices() != devices:
            raise SpecError(f"job {j.name!r} runs devices {list(j.rank_devices())}, job {jobs[0].name!r} runs "
                            f"{list(devices)}: a realnet launch has one device per rank, in one order",
                            field="devices")
    if world_size is not None and world_size != len(devices):
        raise RuntimeSetupError(f"mode 'realnet' runs one rank per device ({len(devices)}: {list(devices)}), "
                                f"world_size is {world_size}")
    cluster = jobs[0].cluster
    if any(j.cluster != cluster for j in jobs[1:]):
        raise SpecError("jobs of a realnet launch must share one cluster (the relay's links)", field="cluster")
    slowdowns = [cluster.device(d).slowdown for d in devices]
    dilations = {j.config.dilation or choose_dilation(slowdowns, j.config.cores) for j in jobs}
    if len(dilations) > 1:
        raise SpecError(f"jobs of a realnet launch need one time dilation (the relay's), got {sorted(dilations)}",
                        field="dilation")
    (dilation,) = dilations
    # every rank then uses exactly the relay's dilation, whatever its own arithmetic would give
    return [replace(j, config=replace(j.config, dilation=dilation)) for j in jobs], cluster, devices, dilation


def _parent_level() -> int:
    return logging.getLogger("deepcee").getEffectiveLevel()


def launch_jobs(jobs: Sequence[Job], *, world_size: int | None = None, deadline_s: float = 600.0,
                elastic: Elastic | None = None) -> list[TrainResult]:
    """Run several jobs, in order, in one set of processes (one start-up for all of them).

    Mode ``realnet`` jobs run in network namespaces through the relay (see the module docstring).
    A job with elastic settings runs alone, supervised as ``elastic`` says (default: no restarts)."""
    if not jobs:
        return []
    if any(elastic_config(j) is not None for j in jobs):
        elastic = elastic or Elastic()
    if any(j.config.mode == "realnet" for j in jobs):
        shaped, cluster, devices, dilation = _realnet_jobs(jobs, world_size)
        timeout = max(j.config.timeout_s for j in shaped)
        stats = launch_realnet(_jobs_entry, (shaped, timeout, _parent_level()), cluster=cluster, devices=devices,
                               deadline_s=deadline_s, dilation=dilation, elastic=elastic,
                               outages=tuple({o for j in shaped for o in j.config.link_outages}))
        log.info("relay: %s", stats.to_dict())
        for j in shaped:  # drops and queueing are part of what a realnet run measured
            save_json_atomic(Path(j.run_dir) / "relay.json", {
                "note": f"counters of the relay over the whole launch ({len(shaped)} job(s)); wall seconds",
                "dilation": dilation, **stats.to_dict()})
        return [TrainResult.from_run_dir(j.run_dir) for j in shaped]
    need = max(len(j.rank_devices()) for j in jobs)
    world = need if world_size is None else world_size
    if world < need:
        raise RuntimeSetupError(f"a job needs {need} ranks, world_size is {world}")
    timeout = max(j.config.timeout_s for j in jobs)
    for j in jobs:
        runlock.check_free(j.run_dir, job=j.name)  # fail before starting processes
    launch(_jobs_entry, (list(jobs), timeout, _parent_level()), world_size=world, deadline_s=deadline_s,
           elastic=elastic)
    return [TrainResult.from_run_dir(j.run_dir) for j in jobs]


def run_training(plan: Plan, cluster: Cluster, *, model: Any = "gpt-tiny", steps: int, run_dir: str | Path | None = None,
                 loss_fn: Callable | None = None, dataset: Any = None, deadline_s: float = 600.0,
                 checkpoint_dir: str | Path | None = None, **config: Any) -> TrainResult:
    """Train ``model`` for ``steps`` steps following ``plan`` on local processes (one per device).

    ``model`` is a built-in net's name or your own blocks (an ``nn.Sequential``, an
    ``nn.ModuleList`` or a list of modules; pass ``loss_fn`` and ``dataset`` with them). Every
    rank trains its own copy: the object you pass is never modified (not trained, not
    converted to ``dtype``, not moved to shared memory); the trained weights are in the
    checkpoints (``checkpoint_every``). A parameter that several blocks hold (an embedding
    tied to an LM head) stays one parameter: on one stage it is one tensor, and its copies on
    different stages get the summed gradient every step, as in one process. See
    ``docs/running.md`` ("Your own model").

    A convenience over :class:`Job` and :func:`launch_jobs`: ``config`` holds the other
    :class:`TrainConfig` fields (``mode``, ``dtype``, ``optimizer``, ``checkpoint_every``,
    ``resume``, ...). Metrics go to ``<run_dir>/metrics.jsonl`` (default: a new temporary folder).
    """
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="deepcee-run-"))
    job = Job(name=f"job-{uuid.uuid4().hex[:8]}", plan=plan, cluster=cluster, model=model,
              config=TrainConfig(steps=steps, **config), run_dir=str(run_dir), loss_fn=loss_fn, dataset=dataset,
              checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir))
    return launch_jobs([job], deadline_s=deadline_s)[0]
