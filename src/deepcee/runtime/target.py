"""Time to a target loss: when a run stops, and what it took to get there.

``deepcee train --target-loss X --eval-every N`` evaluates the held-out loss every ``N`` steps
([Note: evaluation data] in :mod:`deepcee.runtime.evaluation`) and stops the run at the first
evaluation whose loss is ``<= X``. Every rank sees the same evaluation loss (it is all-reduced
over the job's ranks), so every rank stops after the same step without a further message.

[Note: time to target]
The time to target is the sum of the step times of the steps run until the evaluation that
reached the target, in the clock of the run's records: *emulated* seconds (wall divided by the
dilation) in modes ``emulated`` and ``realnet``, wall seconds in mode ``real``. Evaluations are
not counted (they run between steps, as in training without a target); a relaxed run's step
time is the time between the ends of consecutive local steps of the replicas that ran it
(:func:`deepcee.runtime.strategies.relaxed_records`). Samples are the samples the steps
trained on (the global batch per exact step; the batches of the replicas that ran a relaxed
local step). The evaluation points give the curve: evaluation loss against time and samples.

Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepcee.errors import SpecError


def check_target_loss(value: float | None) -> None:
    """A target loss is a finite number > 0 (``None``: no target)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"must be a finite number > 0, got {value!r}", field="target_loss")


def reached(eval_loss: float | None, target_loss: float | None) -> bool:
    """Whether an evaluation loss reaches the target (``<=``); never without both."""
    return eval_loss is not None and target_loss is not None and eval_loss <= target_loss


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalPoint:
    """One evaluation: after ``steps`` steps, ``time_s`` seconds and ``samples`` samples of training."""

    steps: int
    time_s: float
    samples: int
    eval_loss: float

    def to_list(self) -> list[float]:
        return [self.steps, self.time_s, self.samples, self.eval_loss]

    @staticmethod
    def from_list(v: Sequence[Any]) -> EvalPoint:
        return EvalPoint(steps=int(v[0]), time_s=float(v[1]), samples=int(v[2]), eval_loss=float(v[3]))


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetOutcome:
    """Whether and when a run reached its target loss. See [Note: time to target]."""

    target_loss: float | None
    """``None``: the run had no target (the curve is still recorded)."""
    clock: str
    """``"emulated"`` (emulated seconds) or ``"wall"``."""
    curve: tuple[EvalPoint, ...]
    reached_at: EvalPoint | None
    """The first evaluation at or below the target (``None``: not reached)."""
    probes: tuple[EvalPoint, ...] = ()
    """Model averaging between averages: probes of the average ([Note: probe evaluations] in
    :mod:`deepcee.runtime.strategies`), on the same clock; never judged against the target."""

    @property
    def reached(self) -> bool:
        return self.reached_at is not None

    @property
    def final_eval_loss(self) -> float | None:
        return self.curve[-1].eval_loss if self.curve else None

    def describe(self) -> str:
        if self.target_loss is None:
            return "no target loss"
        if self.reached_at is None:
            last = f"; last evaluation loss {self.final_eval_loss:.4f}" if self.curve else ""
            return f"target loss {self.target_loss:g} NOT reached{last}"
        p = self.reached_at
        return (f"target loss {self.target_loss:g} reached in {p.time_s:.3f} s ({self.clock} clock), "
                f"{p.samples} samples, {p.steps} steps; evaluation loss {p.eval_loss:.4f}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"target_loss": self.target_loss, "clock": self.clock, "reached": self.reached,
                               "curve": [p.to_list() for p in self.curve],
                               "curve_columns": ["steps", "time_s", "samples", "eval_loss"]}
        if self.probes:
            out["probes"] = [p.to_list() for p in self.probes]
        if self.reached_at is not None:
            out.update(time_to_target_s=self.reached_at.time_s, samples_to_target=self.reached_at.samples,
                       steps_to_target=self.reached_at.steps, eval_loss_at_target=self.reached_at.eval_loss)
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> TargetOutcome:
        curve = tuple(EvalPoint.from_list(v) for v in d.get("curve", ()))
        target = d.get("target_loss")
        return TargetOutcome(target_loss=None if target is None else float(target), clock=str(d["clock"]),
                             curve=curve, reached_at=first_reaching(curve, target),
                             probes=tuple(EvalPoint.from_list(v) for v in d.get("probes", ())))


def first_reaching(curve: Sequence[EvalPoint], target_loss: float | None) -> EvalPoint | None:
    return next((p for p in curve if reached(p.eval_loss, target_loss)), None)


def outcome(points: Sequence[tuple[int, float, int, float | None]], *, target_loss: float | None,
            clock: str, probes: Mapping[int, float] | None = None) -> TargetOutcome:
    """From per-step ``(step index, step_s, samples, eval_loss or None)``, in order;
    ``probes``: step index -> probe loss (kept apart from the evaluations)."""
    time_s, samples, curve, probed = 0.0, 0, [], []
    for step, step_s, n, ev in points:
        time_s += step_s
        samples += n
        if ev is not None:
            curve.append(EvalPoint(steps=step + 1, time_s=time_s, samples=samples, eval_loss=ev))
        if probes and step in probes:
            probed.append(EvalPoint(steps=step + 1, time_s=time_s, samples=samples, eval_loss=probes[step]))
    return TargetOutcome(target_loss=target_loss, clock=clock, curve=tuple(curve),
                         reached_at=first_reaching(curve, target_loss), probes=tuple(probed))


def clock_of(mode: str) -> str:
    """The clock of a run's records in ``mode`` (see [Note: time to target])."""
    return "wall" if mode == "real" else "emulated"


__all__ = ["EvalPoint", "TargetOutcome", "check_target_loss", "clock_of", "first_reaching", "outcome", "reached"]
