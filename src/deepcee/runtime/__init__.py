"""The torch runtime: executes a plan for real, one process per device.

Public API:

- :func:`run_training` (plan, cluster, model, steps, ...) -> :class:`TrainResult`: local
  processes on this machine, emulated devices and links by default;
- :func:`launch_jobs` / :class:`Job` / :class:`TrainConfig` / :class:`OptimizerConfig`: several
  runs in one set of processes;
- :func:`run_jobs_on_rank`: what each rank runs (``python -m deepcee.train`` under torchrun);
- :class:`Topology` (ranks of a plan), :class:`StageRunner` (F/I/W/B of one stage),
  :func:`schedule_for` (the lowered schedule a plan runs).

Modules: ``dist`` (process group; the only place that reads the environment), ``partition``
(topology, sample ranges), ``stage``, ``p2p``, ``executor``, ``emulation``, ``trainer``,
``checkpoint`` (checkpoints and metrics), ``data`` (shipped datasets), ``launch``.
"""

from __future__ import annotations

from deepcee.runtime.executor import schedule_for
from deepcee.runtime.launch import TrainResult, launch_jobs, run_training
from deepcee.runtime.partition import Topology
from deepcee.runtime.stage import StageRunner
from deepcee.runtime.trainer import Job, OptimizerConfig, TrainConfig, run_jobs_on_rank

__all__ = [
    "Job", "OptimizerConfig", "StageRunner", "Topology", "TrainConfig", "TrainResult", "launch_jobs",
    "run_jobs_on_rank", "run_training", "schedule_for",
]
