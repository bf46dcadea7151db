"""Learning-rate schedules: the factor each step's learning rate is multiplied by (torch-free).

:class:`LRSchedule` is a pure function of the step, so every rank computes the same rate
without talking to the others, and a resumed run (under the same or another plan) continues
the curve with nothing saved in the checkpoint: the rate of step ``k`` is
``OptimizerConfig.lr x factor(k)``.

- warm-up (``warmup_steps`` W > 0): ``factor(k) = (k + 1) / W`` for ``k < W``, so the first step
  already trains and step ``W - 1`` reaches the full rate (as torch's ``LinearLR`` with
  ``start_factor = 1 / W`` over ``W - 1`` iterations);
- after it, over ``decay_steps`` D steps (default: the rest of the run), with progress
  ``p = min(1, (k - W) / D)`` and floor ``r = min_lr_ratio``:
  ``constant``: 1; ``linear``: ``1 - (1 - r) p``; ``cosine``: ``r + (1 - r) (1 + cos(pi p)) / 2``
  (torch's ``CosineAnnealingLR`` with ``T_max = D``, ``eta_min = r x lr``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from deepcee.errors import SpecError

LRKind = Literal["constant", "linear", "cosine"]
LR_KINDS: tuple[str, ...] = ("constant", "linear", "cosine")


@dataclass(frozen=True, slots=True, kw_only=True)
class LRSchedule:
    """A warm-up then a decay. See the module docstring for the formulas."""

    kind: LRKind = "constant"
    """What follows the warm-up."""
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """Floor of ``linear`` and ``cosine`` as a fraction of the base rate."""
    decay_steps: int | None = None
    """Steps of the decay after the warm-up; ``None``: until the run's last step."""

    def __post_init__(self) -> None:
        if self.kind not in LR_KINDS:
            raise SpecError(f"must be one of {', '.join(LR_KINDS)}, got {self.kind!r}", field="lr_schedule")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise SpecError(f"must be an integer >= 0, got {self.warmup_steps!r}", field="warmup_steps")
        if not (isinstance(self.min_lr_ratio, int | float) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise SpecError(f"must be in [0, 1], got {self.min_lr_ratio!r}", field="min_lr_ratio")
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int) or self.decay_steps < 1):
            raise SpecError(f"must be an integer >= 1, got {self.decay_steps!r}", field="decay_steps")

    def factor(self, step: int, total_steps: int) -> float:
        """Multiplier of the base learning rate at ``step`` (0-based) of a ``total_steps`` run."""
        w = self.warmup_steps
        if step < w:
            return (step + 1) / w
        if self.kind == "constant":
            return 1.0
        span = self.decay_steps if self.decay_steps is not None else max(total_steps - w, 1)
        p = min(1.0, (step - w) / span)
        r = self.min_lr_ratio
        if self.kind == "linear":
            return 1.0 - (1.0 - r) * p
        return r + (1.0 - r) * (1.0 + math.cos(math.pi * p)) / 2.0

    def describe(self) -> str:
        parts = [f"{self.warmup_steps} warm-up steps"] if self.warmup_steps else []
        if self.kind != "constant":
            parts.append(f"{self.kind} decay to {self.min_lr_ratio:g} x lr"
                         + (f" over {self.decay_steps} steps" if self.decay_steps else ""))
        return ", ".join(parts) or "constant"
