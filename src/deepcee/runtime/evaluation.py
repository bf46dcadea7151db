"""The evaluation loss: the dataset's held-out batches through the pipeline, forward only.

[Note: evaluation data]
A dataset offers held-out data by an optional method ``eval_batches(batch_size)`` returning an
iterable of :class:`~deepcee.runtime.data.Batch` (global batches of exactly ``batch_size``
samples, the same on every rank and at every call, like ``batch(step, n)``); the shipped
datasets hold out data the training batches never contain (see :mod:`deepcee.runtime.data`).
A dataset without it cannot be evaluated, which the run says once (``eval_every`` set).

Each evaluation runs the first ``eval_batches`` of them through the plan in force, as a training
step would place them (same microbatches, shares and stages: a forward-only row of the lowered
schedule, modules in ``eval()`` mode, no autograd), and sums the last stage's weighted losses
over the plan's ranks: the mean loss over the held-out samples. Devices are paced and links
emulated as in training; the time is not counted in any step.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepcee.errors import RuntimeSetupError
from deepcee.runtime import boundary
from deepcee.runtime.boundary import num_samples
from deepcee.runtime.data import Batch
from deepcee.runtime.executor import Feeds, run_step
from deepcee.schedule.ir import Action, ActionKind
from deepcee.schedule.passes import lower

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer

log = logging.getLogger(__name__)


def eval_source(dataset: Any) -> Callable[[int], Sequence[Batch]] | None:
    """The dataset's ``eval_batches`` (see [Note: evaluation data]), or ``None`` (also for a
    :class:`~deepcee.runtime.sources.Data` without evaluation data)."""
    if not getattr(dataset, "has_eval", True):
        return None
    fn = getattr(dataset, "eval_batches", None)
    return fn if callable(fn) else None


def forward_schedule(num_stages: int, num_microbatches: int, stage: int) -> tuple[Action, ...]:
    """The lowered forward-only row of ``stage`` (F of every microbatch, with its transfers)."""
    compute = [[Action(s, ActionKind.F, m) for m in range(num_microbatches)] for s in range(num_stages)]
    return lower(compute)[stage]


def _feeds(t: Trainer, batch: Batch) -> Feeds:
    r = t.w.rank

    def piece(x: Any) -> Callable[[int], Any]:
        return lambda m: boundary.take(x, *t.topo.global_samples(r, m))  # a tensor or a structure

    return Feeds(inputs=piece(batch.inputs) if t.stage.is_first else None,
                 targets=piece(batch.targets) if t.stage.is_last else None,
                 # share of the whole global batch under every strategy (a relaxed step weighs by its
                 # replica's batch), so the sum over all ranks is the mean over the held-out batch
                 loss_scale=t.topo.placement(r).share / t.plan.global_batch)


def _check(batch: Any, want: int) -> Batch:
    if not isinstance(batch, Batch) or num_samples(batch.inputs) != want or num_samples(batch.targets) != want:
        got = type(batch).__name__ if not isinstance(batch, Batch) else f"{num_samples(batch.inputs)} samples"
        raise RuntimeSetupError(f"dataset.eval_batches({want}) must yield Batch objects of {want} samples, got {got}")
    return batch


def evaluate(t: Trainer) -> float:
    """Mean held-out loss under the plan in force (every rank of the job group calls it)."""
    total = 0.0
    if t.active:
        source = eval_source(t.dataset)
        n = t.plan.global_batch
        batches = [_check(b, n) for b in itertools.islice(source(n), t.cfg.eval_batches)] if source else []
        if not batches:
            raise RuntimeSetupError("eval_every is set but the dataset has no held-out batches "
                                    "(it needs eval_batches(batch_size); see docs/running.md)")
        row = forward_schedule(t.pipeline.num_stages, t.pipeline.num_microbatches, t.placement.stage)
        t.stage.module.eval()
        try:
            with torch.no_grad():
                for batch in batches:
                    rec = run_step(row, t.stage, t.p2p, _feeds(t, batch), t.pacer)
                    t.stage.discard()  # forward-only: nothing waits for a backward
                    total += rec.loss / len(batches)
        finally:
            t.stage.module.train()
            t.stage.discard()
    box = torch.tensor(total, dtype=torch.float64, device=t.w.device)
    work = dist.all_reduce(box, group=t.job_group, async_op=True)
    t.w.waiter.wait(work, timeout_s=t.cfg.timeout_s, what="the evaluation all-reduce")
    return float(box)
