"""The torch runtime: executes a plan for real, one process per device.

Public API:

- :func:`run_training` (plan, cluster, model, steps, ...) -> :class:`TrainResult`: local
  processes on this machine, emulated devices and links by default (``mode="realnet"``: real
  TCP through a shaping relay between network namespaces);
- :func:`launch_jobs` / :class:`Job` / :class:`TrainConfig` / :class:`OptimizerConfig`: several
  runs in one set of processes;
- :func:`run_jobs_on_rank`: what each rank runs (``python -m deepcee.train`` under torchrun);
- :class:`Topology` (ranks of a plan), :class:`StageRunner` (F/I/W/B of one stage). The
  lowered schedule a plan runs comes from :func:`deepcee.schedule.program.lowered_schedule`.

Modules: ``dist`` (process group; the only place that reads the environment), ``partition``
(topology, sample ranges), ``stage``, ``p2p``, ``executor``, ``emulation``, ``job`` (what every
rank gets), ``trainer`` (one rank's run), ``hooks`` (what a run whose plan changes plugs into
the trainer), ``records`` (step records and the result), ``checkpoint`` (the checkpoint format:
DCP folders, manifest, integrity; the metrics file), ``persist`` (a trainer's saves, resumes and
starting weights), ``state`` (a model's state under its own names), ``export`` (a checkpoint as
one ``state_dict``), ``runlock`` (one run per run folder), ``lr`` (learning-rate schedules),
``optstep`` (learning rate, global gradient norm, clipping, float16 loss scale),
``evaluation`` (held-out loss), ``outputs`` (a trainer's step records, metrics file and result),
``pacing`` (a trainer's emulated time: epoch, link shaper, relay, paced all-reduces),
``elastic`` / ``elastic_types`` / ``elastic_rank`` (a rank's part in an elastic run: its session
of heartbeats, watched waits and agreement; the settings and records; what such a rank runs),
``progress`` (progress lines, TensorBoard), ``machines``
(torchrun processes to devices by machine), ``data`` (shipped datasets), ``params`` (a user
model's private copies on the ranks and its tied parameters), ``launch``, ``supervise``
(starting and watching rank processes, torch-free), and the real-network mode's package
``realnet``.

The names above are imported on first use (module ``__getattr__``), so that a process that
imports only a torch-free submodule, such as the relay (``deepcee.runtime.realnet.relay``) or
a rank's bootstrap (``deepcee.runtime.supervise``), does not load torch (2-3 s and ~220 MB per
process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
    from deepcee.runtime.launch import launch_jobs, run_training
    from deepcee.runtime.partition import Topology
    from deepcee.runtime.rank import run_jobs_on_rank
    from deepcee.runtime.records import TrainResult
    from deepcee.runtime.stage import StageRunner

_HOME = {
    "TrainResult": "records", "launch_jobs": "launch", "run_training": "launch",
    "Topology": "partition", "StageRunner": "stage", "Job": "job", "OptimizerConfig": "job",
    "TrainConfig": "job", "run_jobs_on_rank": "rank",
}

__all__ = [
    "Job", "OptimizerConfig", "StageRunner", "Topology", "TrainConfig", "TrainResult", "launch_jobs",
    "run_jobs_on_rank", "run_training",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'deepcee.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"deepcee.runtime.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
