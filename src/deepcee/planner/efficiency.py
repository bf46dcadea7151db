"""Statistical efficiency: how many more samples a relaxed strategy needs to reach a target loss.

Torch-free. Samples per second alone would crown the loosest strategy: a step on a stale or
partially averaged model is worth less than a synchronous one. The planner therefore ranks
plans by **predicted time to target** = ``multiplier x reference samples to target /
samples_per_s``, where the *multiplier* of a plan is the samples it needs to reach the target
loss over the samples exact synchronous training at the same global batch needs (1 for every
exact plan, whatever its layout). Without a measured reference the planner compares
``multiplier / samples_per_s`` (seconds per sync-equivalent sample), which ranks the same.

Two implementations of the :class:`StatisticalEfficiency` protocol:

- :class:`DefaultEfficiency`: a **conservative default that is NOT measured**. It assumes
  every doubling of the synchronisation interval costs a fixed share more samples:
  ``1 + slope x log2(interval)`` with the interval ``H`` (model averaging; slope
  :attr:`~DefaultEfficiency.average_slope` for plain averaging,
  :attr:`~DefaultEfficiency.nesterov_slope` with DiLoCo's outer Nesterov step), ``P``
  (partial: :attr:`~DefaultEfficiency.partial_slope`), and, for ASGD-GA, the product of the
  accumulation term ``1 + asgd_slope x log2(k)`` and the staleness term ``1 + asgd_slope x
  log2(1 + staleness_bound)``. Overlapped model averaging ([Note: overlapped averaging] in
  :mod:`deepcee.runtime.overlap`) gets the figure of blocking averaging at period ``2H``: each
  average lands one period late, so a replica's copy holds the others' progress of up to two
  periods before, as with blocking averages every ``2H`` steps (a rule, NOT measured). The slopes are chosen to be pessimistic against what the
  literature reports (local SGD matching synchronous accuracy at tens of local steps;
  DiLoCo at hundreds with an outer Nesterov step): they make relaxed plans win only when
  their throughput gain is large. They ignore the replica count, the model and the data.
- :class:`CalibratedEfficiency`: multipliers measured by short runs (``deepcee calibrate``),
  read from a ``deepcee.efficiency`` JSON file (see docs/file-formats.md). A setting that was
  measured uses its figure; one between two measured settings of the same rule gets the
  log-linear interpolation; a looser one than any measured gets the larger of the default and
  the loosest measured figure; a tighter one the tightest measured figure. Plans of another
  model, and rules the file does not cover, fall back to the default, and say so. Overlapped
  settings are a variant of their own; a file without overlapped figures gives an overlapped
  setting the larger of the default and the blocking figure at ``2H`` (calibrated or
  interpolated where it can): on gpt-tiny the measured overlapped settings needed more samples
  than blocking ones at ``2H`` (docs/results.md), so the blocking figure alone is not conservative.

Every figure carries its source (:meth:`StatisticalEfficiency.source`), shown next to every
predicted time to target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from deepcee.errors import SpecError
from deepcee.inputs import Fields, read_json
from deepcee.inputs.fields import check_format
from deepcee.inputs.limits import COUNT, GLOBAL_BATCH, MAX_NAME_CHARS, Limit
from deepcee.plan import Plan, Strategy
from deepcee.planfile import strategy_from_fields

FORMAT = "deepcee.efficiency"
SCHEMA_VERSION = 2
"""2: strategies may carry ``overlap`` (overlapped model averaging); version 1 files still load."""
EXACT_SOURCE = "exact (synchronous: no loss of statistical efficiency)"
DEFAULT_SOURCE = "default (conservative, not measured)"


class StatisticalEfficiency(Protocol):
    """How much statistical efficiency a plan's strategy costs. See the module docstring."""

    def multiplier(self, plan: Plan) -> float:
        """Samples to the target under ``plan`` over those of exact synchronous training (>= 1)."""
        ...

    def source(self, plan: Plan) -> str:
        """Where :meth:`multiplier`'s figure for ``plan`` comes from."""
        ...

    def reference_samples(self, plan: Plan) -> float | None:
        """Samples exact synchronous training needs to reach the target, when measured."""
        ...


def _log2(x: float) -> float:
    return math.log2(max(1.0, x))


@dataclass(frozen=True, slots=True, kw_only=True)
class DefaultEfficiency:
    """The conservative default; NOT measured. See the module docstring for the formula."""

    average_slope: float = 0.25
    """Model averaging with plain averaging: extra share of samples per doubling of H."""
    nesterov_slope: float = 0.15
    """Model averaging with DiLoCo's outer Nesterov optimizer."""
    partial_slope: float = 0.20
    """Partial averaging: per doubling of the full-sync interval P."""
    asgd_slope: float = 0.25
    """ASGD-GA: per doubling of the accumulation steps k and of 1 + the staleness bound."""

    def __post_init__(self) -> None:
        for name in ("average_slope", "nesterov_slope", "partial_slope", "asgd_slope"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise SpecError(f"must be a finite number >= 0, got {v!r}", field=name)

    def multiplier(self, plan: Plan) -> float:
        return self.of(plan.strategy)

    def of(self, s: Strategy) -> float:
        if s.kind == "exact":
            return 1.0
        if s.kind == "model-averaging":
            slope = self.nesterov_slope if s.outer_optimizer == "nesterov" else self.average_slope
            return 1.0 + slope * _log2(s.period * (2 if s.overlap else 1))
        if s.kind == "partial":
            return 1.0 + self.partial_slope * _log2(s.full_sync_every)
        return (1.0 + self.asgd_slope * _log2(s.accumulation_steps)) * (
            1.0 + self.asgd_slope * _log2(1 + s.staleness_bound))

    def source(self, plan: Plan) -> str:
        return EXACT_SOURCE if plan.strategy.kind == "exact" else DEFAULT_SOURCE

    def reference_samples(self, plan: Plan) -> float | None:
        return None


def variant(s: Strategy) -> tuple[str, str, float]:
    """``(kind, variant, interval)``: settings of one variant are interpolated over the interval."""
    if s.kind == "model-averaging":
        return s.kind, s.outer_optimizer + (" overlapped" if s.overlap else ""), float(s.period)
    if s.kind == "partial":
        return s.kind, "", float(s.full_sync_every)
    if s.kind == "asgd-ga":
        return s.kind, f"staleness {s.staleness_bound}", float(s.accumulation_steps)
    return s.kind, "", 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """One measured setting: its strategy and the multiplier a calibration run found."""

    strategy: Strategy
    multiplier: float
    replicas: int = 0
    """Replicas of the calibration run (0: not stated)."""

    def __post_init__(self) -> None:
        if isinstance(self.multiplier, bool) or not isinstance(self.multiplier, (int, float)) or not (
                math.isfinite(self.multiplier) and self.multiplier > 0):
            raise SpecError(f"must be a finite number > 0, got {self.multiplier!r}", field="entries.multiplier")


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibratedEfficiency:
    """Measured multipliers, with the default where nothing was measured. See the module docstring."""

    model: str
    """The model the runs trained (``""``: any)."""
    entries: tuple[Measured, ...]
    file: str = ""
    target_loss: float | None = None
    reference_global_batch: int | None = None
    reference_steps: float | None = None
    """Steps of exact synchronous training at ``reference_global_batch`` to the target."""
    default: DefaultEfficiency = field(default_factory=DefaultEfficiency)

    def _applies(self, plan: Plan) -> bool:
        return not self.model or plan.model.partition(":")[0] == self.model.partition(":")[0]

    def _lookup(self, s: Strategy) -> tuple[float, str]:
        kind, var, x = variant(s)
        points = sorted((variant(m.strategy)[2], m.multiplier) for m in self.entries
                        if variant(m.strategy)[:2] == (kind, var))
        label = f"calibrated ({self.file or 'calibration'})"
        if not points and s.overlap:
            m, src = self._lookup(replace(s, overlap=False, period=2 * s.period))
            if self.default.of(s) > m:
                return self.default.of(s), f"{DEFAULT_SOURCE} (overlap not calibrated)"
            return m, f"{src}, as blocking averaging at H={2 * s.period} (overlap not calibrated)"
        if not points:
            return self.default.of(s), f"{DEFAULT_SOURCE}; {self.file or 'the calibration'} has no {kind} {var}".rstrip()
        for px, py in points:
            if px == x:
                return py, label
        if x > points[-1][0]:
            return max(self.default.of(s), points[-1][1]), f"{DEFAULT_SOURCE} or the loosest calibrated, the larger"
        if x < points[0][0]:
            return points[0][1], f"tightest calibrated setting ({self.file or 'calibration'})"
        (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points, points[1:], strict=False) if a[0] < x < b[0])
        w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + w * (y1 - y0), f"interpolated between calibrated settings ({self.file or 'calibration'})"

    def multiplier(self, plan: Plan) -> float:
        if plan.strategy.kind == "exact":
            return 1.0
        return self._lookup(plan.strategy)[0] if self._applies(plan) else self.default.multiplier(plan)

    def source(self, plan: Plan) -> str:
        if plan.strategy.kind == "exact":
            return EXACT_SOURCE
        if not self._applies(plan):
            return f"{DEFAULT_SOURCE}; the calibration is for {self.model!r}"
        return self._lookup(plan.strategy)[1]

    def reference_samples(self, plan: Plan) -> float | None:
        if self.reference_steps is None or self.reference_global_batch is None or not self._applies(plan):
            return None
        return self.reference_steps * self.reference_global_batch


def efficiency_from_dict(d: Any, *, file: str = "<efficiency.json>") -> CalibratedEfficiency:
    """A calibration from its ``deepcee.efficiency`` JSON form; every field checked by the input
    layer's validator (:class:`deepcee.inputs.Fields`), errors name the file and the field."""
    f = Fields(d, file=file, error=SpecError)
    check_format(f, FORMAT, (1, SCHEMA_VERSION))
    entries = [_measured(e) for e in f.records("entries", [], max_len=MAX_ENTRIES)]
    ref = f.record_of("reference", None) if f.raw("reference", None) is not None else None
    target = f.number("target_loss", LOSS, None)
    model = f.text("model", "", max_chars=MAX_NAME_CHARS)
    f.text("source", "")
    ref_batch = None if ref is None else ref.integer("global_batch", GLOBAL_BATCH, None)
    ref_steps = None if ref is None else ref.number("steps_to_target", STEPS_TO_TARGET, None)
    if ref is not None:
        _run_details(ref)
        ref.done()
    f.done()
    return CalibratedEfficiency(model=model, entries=tuple(entries), file=file, target_loss=target,
                                reference_global_batch=ref_batch, reference_steps=ref_steps)


MAX_ENTRIES = 10_000
"""Measured settings in one calibration file."""
MULTIPLIER = Limit(name="efficiency multiplier", lo=0, lo_open=True, hi=1e6, fields="entries[].multiplier",
                   why="samples to target over exact training's; positive and finite")
LOSS = Limit(name="target loss", lo=-1e12, hi=1e12, fields="target_loss", why="a finite loss")
STEPS_TO_TARGET = Limit(name="steps to target", lo=0, lo_open=True, hi=1e12, fields="reference.steps_to_target",
                        why="a positive count")


SAMPLES = Limit(name="samples to target", lo=0, hi=1e15, integer=True,
                fields="entries[].samples_to_target, reference.samples_to_target", why="a count of samples")
RUN_STEPS = Limit(name="calibration steps", lo=0, hi=1e12, integer=True, fields="entries[].steps", why="a count")
WALL_S = Limit(name="calibration wall time", lo=0, hi=1e9, unit="s", fields="entries[].wall_s, reference.wall_s",
               why="seconds a run took")


def _run_details(f: Fields) -> None:
    """What ``deepcee calibrate`` writes beside each figure (checked; the planner does not use it)."""
    f.integer("samples_to_target", SAMPLES, None)
    f.number("wall_s", WALL_S, None)


def _measured(f: Fields) -> Measured:
    m = Measured(strategy=strategy_from_fields(f.record_of("strategy")), multiplier=f.number("multiplier", MULTIPLIER),
                 replicas=f.integer("replicas", COUNT, 0))
    _run_details(f)
    f.flag("reached", True)
    f.integer("steps", RUN_STEPS, None)
    if f.raw("final_eval_loss", None) is not None:
        f.number("final_eval_loss", LOSS)
    f.done()
    return m


def load_efficiency(path: str | Path) -> CalibratedEfficiency:
    return efficiency_from_dict(read_json(path, SpecError), file=str(path))


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeToTarget:
    """A plan's predicted time to the target loss (see the module docstring)."""

    multiplier: float
    source: str
    seconds_per_sync_sample: float
    """``multiplier / samples_per_s``: ranks plans even without a measured reference."""
    seconds: float | None
    """``multiplier x reference samples / samples_per_s`` when the reference was measured."""

    def describe(self) -> str:
        head = f"{self.seconds:.4g} s" if self.seconds is not None else \
            f"{self.seconds_per_sync_sample * 1e3:.4g} ms per sync-equivalent sample"
        return f"{head} (x{self.multiplier:.2f} samples: {self.source})"


def time_to_target(plan: Plan, samples_per_s: float, efficiency: StatisticalEfficiency) -> TimeToTarget:
    m = efficiency.multiplier(plan)
    per = m / samples_per_s if samples_per_s > 0 else math.inf
    ref = efficiency.reference_samples(plan)
    return TimeToTarget(multiplier=m, source=efficiency.source(plan), seconds_per_sync_sample=per,
                        seconds=None if ref is None else ref * per)


__all__ = ["DEFAULT_SOURCE", "EXACT_SOURCE", "FORMAT", "SCHEMA_VERSION", "CalibratedEfficiency", "DefaultEfficiency",
           "Measured", "StatisticalEfficiency", "TimeToTarget", "efficiency_from_dict", "load_efficiency",
           "time_to_target", "variant"]
