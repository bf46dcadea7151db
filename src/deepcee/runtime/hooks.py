"""The hooks a run whose plan may change plugs into the trainer, and the fixed-plan default.

:class:`~deepcee.runtime.trainer.Trainer` runs one job on one rank and asks its
:class:`TrainerHooks` at the points below; :class:`FixedPlan` is what it uses when the job has
no :attr:`~deepcee.runtime.job.Job.hooks` (the plan never changes). The adapter
(:class:`deepcee.adapter.hooks.AdaptiveHooks`) implements them to change plans at step
boundaries; it drives the trainer only through the trainer's public methods
(:meth:`~deepcee.runtime.trainer.Trainer.set_plan`, ``build_stage``, ``reshard``, ``make_p2p``).

[Note: trainer hooks]
- set-up: :meth:`TrainerHooks.topology` (which rank runs which device of a plan; called for
  the job's plan and for every later plan), :meth:`~TrainerHooks.gathers_over_world` (the
  metrics gather: the plan's ranks, or the whole world so idle ranks take part),
  :meth:`~TrainerHooks.takes_part`, :meth:`~TrainerHooks.device` and
  :meth:`~TrainerHooks.paced_devices` (pacing and the dilation), :meth:`~TrainerHooks.prepare`
  (last one-off work before the shared epoch);
- the step boundary, on every rank that takes part: after a step's records reach rank 0,
  :meth:`~TrainerHooks.decide` (its time is excluded from step times; what it returns is
  recorded with the step); then :meth:`~TrainerHooks.apply` (counted in the next step's time;
  recorded with it), and :meth:`~TrainerHooks.rank_change` adds this rank's part of a change
  to its next step record;
- the step itself, on an active rank: :meth:`~TrainerHooks.before_update` just before the
  optimizer applies the step's gradients (an elastic run's commit point);
- a failure of a step or its boundary: :meth:`~TrainerHooks.recover` re-raises it, or (an
  elastic run, [Note: elastic process groups] in :mod:`deepcee.runtime.elastic`) brings the
  run to a state every survivor shares and returns the step to go on at;
- the end: :meth:`~TrainerHooks.adapter_run` goes into the result.

Torch-free (the trainer appears in annotations only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from deepcee.plan import Plan
from deepcee.runtime.partition import Topology
from deepcee.runtime.records import (
    AdapterRun,
    AppliedChange,
    BoundaryMetrics,
    RankChange,
    RankMetrics,
)

if TYPE_CHECKING:
    from deepcee.runtime.job import Job
    from deepcee.runtime.trainer import Trainer, Worker


class TrainerHooks(Protocol):
    """What a :class:`~deepcee.runtime.trainer.Trainer` asks of its run. See [Note: trainer hooks]."""

    def topology(self, plan: Plan, world_size: int) -> Topology:
        """Which rank runs which device of ``plan``."""
        ...

    def gathers_over_world(self) -> bool:
        """Whether step records are gathered over the whole world (else over the plan's ranks)."""
        ...

    def takes_part(self, trainer: Trainer) -> bool:
        """Whether this rank runs set-up and the steps at all."""
        ...

    def device(self, trainer: Trainer) -> str:
        """This rank's device (its slowdown paces it)."""
        ...

    def paced_devices(self, trainer: Trainer) -> Sequence[str]:
        """The devices that compute at once (they set the dilation)."""
        ...

    def prepare(self, trainer: Trainer) -> None:
        """Last set-up work before the shared epoch is taken (one-off costs that must not count)."""
        ...

    def decide(self, trainer: Trainer, step: int, gathered: Sequence[RankMetrics | None] | None,
               ) -> BoundaryMetrics | None:
        """After ``step``'s records reached rank 0 (``gathered``; ``None`` on other ranks)."""
        ...

    def apply(self, trainer: Trainer) -> AppliedChange | None:
        """Before the next step: apply what :meth:`decide` agreed."""
        ...

    def rank_change(self) -> RankChange | None:
        """This rank's part of the change applied before the step it is about to record (once)."""
        ...

    def before_update(self, trainer: Trainer, step: int) -> None:
        """Just before the optimizer applies step ``step``'s gradients (may raise to stop it)."""
        ...

    def recover(self, trainer: Trainer, step: int, exc: BaseException) -> tuple[int, AppliedChange | None]:
        """Step ``step`` (or its boundary) raised ``exc``: re-raise it, or return the step to go on
        at and the change made (recorded with that step)."""
        ...

    def adapter_run(self) -> AdapterRun | None:
        """What the result records about the plans of the run (rank 0, at the end)."""
        ...


class HooksFactory(Protocol):
    """:attr:`deepcee.runtime.job.Job.hooks`: pickled to every rank, builds its hooks there."""

    def hooks(self, job: Job, worker: Worker) -> TrainerHooks:
        ...

    def rank_devices(self, job: Job) -> Sequence[str]:
        """The device of every rank (their number is the launch's world size)."""
        ...


class FixedPlan:
    """The hooks of a run whose plan never changes: ranks follow the plan's device order (then
    its parameter servers), ranks beyond those are idle and take no part, nothing happens at
    step boundaries."""

    def topology(self, plan: Plan, world_size: int) -> Topology:
        return Topology(plan, world_size)

    def gathers_over_world(self) -> bool:
        return False

    def takes_part(self, trainer: Trainer) -> bool:
        return trainer.active or trainer.is_server

    def device(self, trainer: Trainer) -> str:
        return trainer.topo.device_of(trainer.w.rank)

    def paced_devices(self, trainer: Trainer) -> Sequence[str]:
        return trainer.plan.devices

    def prepare(self, trainer: Trainer) -> None:
        return None

    def decide(self, trainer: Trainer, step: int, gathered: Sequence[RankMetrics | None] | None,
               ) -> BoundaryMetrics | None:
        return None

    def apply(self, trainer: Trainer) -> AppliedChange | None:
        return None

    def rank_change(self) -> RankChange | None:
        return None

    def before_update(self, trainer: Trainer, step: int) -> None:
        return None

    def recover(self, trainer: Trainer, step: int, exc: BaseException) -> tuple[int, AppliedChange | None]:
        raise exc

    def adapter_run(self) -> AdapterRun | None:
        return None
