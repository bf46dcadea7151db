"""Adapter controller: train with the plan changing while it runs, on local processes (entry point).

:func:`run_adaptive_training` is what ``deepcee train --plan plan.json --adapt --link-trace
drop-5x`` runs; :func:`adaptive_job` builds the :class:`~deepcee.runtime.job.Job` for
:func:`~deepcee.runtime.launch.launch_jobs` (several adaptive runs in one launch: tests,
benchmarks). The parts, by concern:

- :mod:`deepcee.adapter.messages`: ranks tied to devices (:class:`DeviceTopology`), which layer
  state moves where (:func:`state_moves`), the decision rank 0 broadcasts
  (:class:`DecisionMessage`); torch-free;
- :mod:`deepcee.adapter.coordinator`: rank 0's link monitor and policy
  (:class:`~deepcee.adapter.coordinator.Coordinator`), the policy factories
  (:class:`DefaultPolicy`, :class:`ScriptedPolicy`); torch-free;
- :mod:`deepcee.adapter.hooks`: the :class:`~deepcee.runtime.hooks.TrainerHooks` that apply a
  change on every rank (:class:`AdaptiveHooks`, built from the job's :class:`AdaptSpec`), with
  [Note: adapter step boundary].

The names of those modules that users need are importable from here too.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from deepcee.adapter.coordinator import DefaultPolicy, PolicyContext, PolicyFactory, ScriptedPolicy
from deepcee.adapter.hooks import AdaptiveHooks, AdaptSpec, layer_state_bytes
from deepcee.adapter.messages import (
    DecisionMessage,
    DeviceTopology,
    Move,
    decision_message,
    state_moves,
    transfers_of,
)
from deepcee.adapter.monitor import MonitorConfig
from deepcee.cluster import BandwidthTrace, Cluster
from deepcee.plan import Plan
from deepcee.profile import ModelProfile
from deepcee.runtime.elastic import ElasticConfig
from deepcee.runtime.job import Job, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.records import TrainResult
from deepcee.traces import load_named_trace, snapshot, with_trace


def traced_cluster(cluster: Cluster, link_trace: BandwidthTrace | str | Path | None, *,
                   between: Iterable[tuple[str, str]] | None = None, time_scale: float = 1.0) -> Cluster:
    """``cluster`` with ``link_trace`` (a trace, a built-in name such as ``drop-5x``, or a file)
    rescaled onto the links ``between`` (default: the wide-area links); see :func:`deepcee.traces.with_trace`."""
    if link_trace is None:
        return cluster
    trace = link_trace if isinstance(link_trace, BandwidthTrace) else load_named_trace(link_trace)
    return with_trace(cluster, trace, between=between, time_scale=time_scale)


def adaptive_job(plan: Plan, cluster: Cluster, *, config: TrainConfig, run_dir: str | Path, model: Any = "gpt-tiny",
                 adapt: bool = True, devices: Sequence[str] | None = None, policy: PolicyFactory | None = None,
                 profile: ModelProfile | None = None, link_trace: BandwidthTrace | str | Path | None = None,
                 between: Iterable[tuple[str, str]] | None = None, trace_time_scale: float = 1.0,
                 monitor: MonitorConfig | None = None, planning_cluster: Cluster | None = None,
                 name: str | None = None, elastic: ElasticConfig | None = None, **job_fields: Any) -> Job:
    """A :class:`~deepcee.runtime.job.Job` whose ranks run :class:`AdaptiveHooks` (for :func:`launch_jobs`).

    Rank ``r`` runs ``devices[r]`` (default: every device of ``cluster``). ``link_trace`` (see
    :func:`traced_cluster`) plays on the emulated links, stretched by ``trace_time_scale``
    (emulated seconds: the built-in ``drop-5x`` drops at 20 s x ``trace_time_scale``). The
    policy is ``policy`` or :class:`DefaultPolicy` with ``profile`` (default: the model's
    analytic profile); it plans on ``planning_cluster`` (default: ``cluster`` without any trace,
    at time 0, restricted to ``devices``). ``elastic``: survive lost devices and take them back
    ([Note: elastic re-plan] in :mod:`deepcee.adapter.elastic`; launch it alone, with
    ``launch_jobs(..., elastic=Elastic(...))`` to restart lost ranks). ``job_fields``: further
    :class:`Job` fields.
    """
    devices = tuple(devices or cluster.device_names)
    if link_trace is not None and planning_cluster is None:
        planning_cluster = snapshot(cluster, 0.0).subset(devices)
    spec = AdaptSpec(devices=devices, adapt=adapt, policy=policy or DefaultPolicy(profile=profile),
                     monitor=monitor or MonitorConfig(), planning_cluster=planning_cluster, elastic=elastic)
    traced = traced_cluster(cluster, link_trace, between=between, time_scale=trace_time_scale)
    return Job(name=name or f"adapt-{uuid.uuid4().hex[:8]}", plan=plan, cluster=traced, model=model, config=config,
               run_dir=str(run_dir), hooks=spec, **job_fields)


def run_adaptive_training(plan: Plan, cluster: Cluster, *, model: Any = "gpt-tiny", steps: int,
                          run_dir: str | Path | None = None, deadline_s: float = 600.0, adapt: bool = True,
                          link_trace: BandwidthTrace | str | Path | None = None,
                          between: Iterable[tuple[str, str]] | None = None, trace_time_scale: float = 1.0,
                          devices: Sequence[str] | None = None, policy: PolicyFactory | None = None,
                          profile: ModelProfile | None = None, monitor: MonitorConfig | None = None,
                          planning_cluster: Cluster | None = None, **config: Any) -> TrainResult:
    """Train ``plan`` on local processes (one per device of ``devices``) with ``link_trace`` playing
    on the emulated links, adapting when ``adapt`` (see :func:`adaptive_job`).

    A convenience over :func:`adaptive_job` and :func:`launch_jobs`: ``config`` holds the other
    :class:`~deepcee.runtime.job.TrainConfig` fields. The result's
    :attr:`~deepcee.runtime.records.TrainResult.adapter` holds every plan and change.
    """
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="deepcee-adapt-"))
    job = adaptive_job(plan, cluster, config=TrainConfig(steps=steps, **config), run_dir=run_dir, model=model,
                       adapt=adapt, devices=devices, policy=policy, profile=profile, link_trace=link_trace,
                       between=between, trace_time_scale=trace_time_scale, monitor=monitor,
                       planning_cluster=planning_cluster)
    return launch_jobs([job], deadline_s=deadline_s)[0]


__all__ = [
    "AdaptSpec", "AdaptiveHooks", "DecisionMessage", "DefaultPolicy", "DeviceTopology", "Move", "PolicyContext",
    "PolicyFactory", "ScriptedPolicy", "adaptive_job", "decision_message", "layer_state_bytes",
    "run_adaptive_training", "state_moves", "traced_cluster", "transfers_of",
]
