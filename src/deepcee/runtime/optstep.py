"""The optimizer step of a pipeline: the step's learning rate, the global gradient norm, clipping,
and the float16 loss scale.

[Note: global gradient norm]
When the optimizer steps, every device of a stage holds the full-batch gradient of its stage's
parameters (the in-stage SUM all-reduce, [Note: loss weighting] in
:mod:`deepcee.runtime.trainer`) and every copy of a tied parameter holds the whole gradient
([Note: tied parameters] in :mod:`deepcee.runtime.params`). The single-process norm counts each
parameter once, so each rank adds up the squares of the gradients it *owns* only: device 0 of
its stage (the others hold the same numbers), of the first replica (an exact strategy gives
every replica the same gradient), and a tied parameter only on the first stage that holds it.
One SUM all-reduce of that float64 scalar over the plan's ranks gives every rank the same
norm, which equals ``torch.nn.utils.clip_grad_norm_`` over the whole model in one process up to
the order of the additions; every rank then scales its gradients by the same
``min(1, max_norm / (norm + 1e-6))`` (torch's coefficient), so the copies stay equal.

With ``float16`` autocast the last stage multiplies its loss by a dynamic scale (as
``torch.amp.GradScaler``): the norm of the scaled gradients, divided by the scale, is the true
norm; a non-finite norm (an overflow anywhere, on any rank) makes every rank skip the step and
halve the scale; after ``growth_interval`` good steps in a row the scale doubles. Every rank sees
the same norm, so every rank makes the same decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from deepcee.runtime.dist import BlockingWaiter, Waiter
from deepcee.runtime.job import TrainConfig
from deepcee.runtime.params import stage_of_blocks

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer

CLIP_EPS = 1e-6
"""Added to the norm before dividing (torch's ``clip_grad_norm_``)."""


@dataclass(slots=True)
class LossScale:
    """A dynamic loss scale for float16 (the update rule of ``torch.amp.GradScaler``)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0

    def update(self, finite: bool) -> bool:
        """After a step whose gradient norm was (not) finite; returns whether to apply the step."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    lr: float
    grad_norm: float | None
    """Global norm before clipping (``None``: not measured)."""
    skipped: bool = False
    """A float16 overflow: the optimizer did not step."""


def global_grad_norm(owned: Sequence[torch.Tensor], group: Any, *, device: torch.device, timeout_s: float,
                     waiter: Waiter | None = None) -> float:
    """The norm over every rank's ``owned`` gradients (a SUM all-reduce over ``group``, waited
    for by ``waiter``: an elastic run's watches for lost peers)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in owned:
        sq += g.detach().double().pow(2).sum()
    work = dist.all_reduce(sq, group=group, async_op=True)
    (waiter or BlockingWaiter()).wait(work, timeout_s=timeout_s, what="the gradient-norm all-reduce")
    return math.sqrt(float(sq))


def scale_gradients(params: Sequence[nn.Parameter], factor: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


class OptimizerStep:
    """Sets the step's learning rate, measures and clips the global norm, handles the float16
    scale, steps the optimizer. See [Note: global gradient norm]."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.scaler = LossScale() if cfg.autocast == "float16" else None

    @property
    def loss_scale(self) -> float:
        """What the last stage multiplies its loss by (1 unless float16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def measures_norm(self) -> bool:
        return self.cfg.clip_grad_norm is not None or self.scaler is not None

    def lr(self, step: int) -> float:
        return self.cfg.optimizer.lr * self.cfg.lr_schedule.factor(step, self.cfg.steps)

    def measure(self, params: Sequence[nn.Parameter], owned: Sequence[nn.Parameter], group: Any,
                waiter: Waiter | None = None) -> float | None:
        """The global norm of the scaled gradients when the step needs it (clipping, float16), else
        ``None``: a collective over ``group``, so an elastic run measures it before the step's
        commit point (after it, every rank must be able to apply the update on its own)."""
        if not self.measures_norm:
            return None
        device = params[0].device if params else torch.device("cpu")
        grads = [p.grad for p in owned if p.grad is not None]
        return global_grad_norm(grads, group, device=device, timeout_s=self.cfg.timeout_s, waiter=waiter)

    def __call__(self, step: int, optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter],
                 scaled_norm: float | None, pace: Callable[[Callable[[], Any]], Any] | None = None) -> StepOutcome:
        """Apply step ``step`` on this rank alone (no collective): ``scaled_norm`` is
        :meth:`measure`'s; ``pace`` runs the optimizer's step (an emulated device's pacer: it
        steps at the device's speed, as the simulator counts it)."""
        lr = self.lr(step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        norm = None
        if scaled_norm is not None:
            norm = scaled_norm / self.loss_scale
            if self.scaler is not None:
                scale = self.scaler.scale
                if not self.scaler.update(math.isfinite(norm)):
                    return StepOutcome(lr=lr, grad_norm=norm, skipped=True)
                scale_gradients(params, 1.0 / scale)
            clip = self.cfg.clip_grad_norm
            if clip is not None and clip / (norm + CLIP_EPS) < 1.0:
                scale_gradients(params, clip / (norm + CLIP_EPS))
        if pace is None:
            optimizer.step()
        else:
            pace(optimizer.step)
        return StepOutcome(lr=lr, grad_norm=norm)


def owned_parameters(stage_params: Sequence[nn.Parameter], *, index: int, replica: int, stage: int,
                     cross_stage_ties: Sequence[tuple[int, Sequence[nn.Parameter]]]) -> list[nn.Parameter]:
    """The parameters whose gradient this rank counts in the global norm: none unless it is
    device 0 of its stage in the first replica; then its stage's, less the tied ones whose
    first holding stage is earlier (``cross_stage_ties``: (first stage, this stage's copies))."""
    if index != 0 or replica != 0:
        return []
    skip = {id(p) for first, copies in cross_stage_ties if first < stage for p in copies}
    return [p for p in stage_params if id(p) not in skip]


def norm_owned(t: Trainer) -> list[nn.Parameter]:
    """What trainer ``t``'s rank counts in the global norm ([Note: global gradient norm])."""
    p = t.placement
    stage_of = stage_of_blocks(t.pipeline)  # this replica's stages
    ties = []
    for tie in t.ties:
        stages = {stage_of[b] for b in tie.blocks}
        if tie.kind == "parameter" and p.stage in stages and len(stages) > 1:
            ties.append((min(stages), [t.blocks[b].get_parameter(n) for b, n in tie.uses if stage_of[b] == p.stage]))
    return owned_parameters(t.stage.params, index=p.index, replica=getattr(p, "replica", 0), stage=p.stage,
                            cross_stage_ties=ties)
