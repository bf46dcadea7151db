"""Link monitor: each used link's latency and bandwidth from the runtime's own transfer timings.

Torch-free: numbers in (link resource, bytes, seconds from send start to delivery), estimates
out. No probe traffic: only the pipeline transfers the training does anyway are timed. The
runtime (or :mod:`deepcee.adapter.simloop`) calls :meth:`LinkMonitor.observe_batch` with the
transfers of an iteration and reads :meth:`LinkMonitor.estimates` at the iteration boundary.

Per link resource (see [Note: link resources] in :mod:`deepcee.cluster`):

1. **Busy periods.** Transfers on one resource queue behind each other, so a transfer's
   time includes the bytes ahead of it. When observations carry ``start_s``, transfers of a
   batch that were issued before the resource finished serialising the previous ones (its
   delivery time minus the latency estimate) are merged into one sample: their summed bytes
   over the time from the first start to the last delivery, which the alpha-beta model
   predicts exactly (``latency + total bytes / bandwidth``).
2. **Fit.** Over a sliding window of the last ``window`` samples, weighted by an
   exponential decay with half-life ``half_life_observations`` samples (this is the EWMA
   smoothing: the newest sample weighs 1, one half-life older 1/2, ...), a weighted least
   squares line ``seconds = latency_s + bytes / bandwidth_bytes_per_s`` with one round of
   outlier rejection (residuals beyond ``outlier_mads`` robust standard deviations). It is
   used when the window holds two sizes at least ``distinct_size_ratio`` apart and the fit is
   well determined (positive slope; the intercept's standard error below half the
   intercept, else only the slope is kept). Otherwise the latency is taken as known (the
   last well-determined fit, else the baseline) and the bandwidth is the weighted median of
   ``bytes / (seconds - latency)`` over the bandwidth-dominated samples; when every sample
   is latency-dominated the bandwidth is taken as known and the latency is the weighted
   median of ``seconds - bytes / bandwidth``.
3. **Change detection.** A two-sided CUSUM on ``x = log(seconds / predicted seconds)``,
   the prediction from the reference estimate (at first the baseline: the prior from the
   cluster file, or the estimate after ``min_observations`` samples when there is none).
   ``x`` is clipped to ``+-cusum_clip`` so no single outlier can raise an alarm; with the
   defaults (drift 0.1, clip ln 2, threshold 1.5) an alarm needs at least 3 samples, a
   5x slowdown raises one after exactly 3, a 25% slowdown after about 12, and uniform
   +-15% bandwidth noise (|x| < 0.17, mean near 0) essentially never. On an alarm the window
   is cut to the samples since the CUSUM run began, so the estimate jumps to the new level
   instead of drifting there; the new estimate becomes the reference for further alarms
   (a recovery is detected the same way).
4. **Changed** is reported while an alarm is latched *and* the estimated time of the
   link's typical transfer differs from the baseline's by at least ``change_ratio``
   (default 15%). :meth:`LinkMonitor.accept` makes the current estimate the new baseline
   (the adapter calls it once it has acted on, or dismissed, a change).

Time comes from an injected clock (``clock()`` in seconds; default ``time.monotonic``); the
monitor holds no global state.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from deepcee.cluster import Cluster, LinkSpec
from deepcee.plan import Plan, share_overlaps

log = logging.getLogger(__name__)

EstimateMethod = Literal["fit", "bandwidth", "latency", "prior"]
_ROBUST_SD = 1.4826  # MAD -> standard deviation for normal noise


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorConfig:
    """Tuning of :class:`LinkMonitor`. See the module docstring for how each is used."""

    window: int = 32
    """Samples kept per link (4 half-lives: the oldest weighs 1/16)."""
    half_life_observations: float = 8.0
    """EWMA half-life in samples: long enough to average +-15% noise to a few percent."""
    distinct_size_ratio: float = 1.25
    """Largest / smallest size in the window needed to fit latency and bandwidth together."""
    outlier_mads: float = 3.5
    """Fit residuals beyond this many robust standard deviations are dropped before refitting."""
    cusum_drift: float = 0.10
    """Allowance per sample, in log time ratio (~10%): smaller deviations never accumulate."""
    cusum_threshold: float = 1.5
    """CUSUM alarm level, in log time ratio."""
    cusum_clip: float = math.log(2.0)
    """Largest contribution of one sample (log 2): an outlier counts as a 2x deviation at most."""
    min_observations: int = 8
    """Samples before a learned baseline (no prior) is fixed, and after a baseline is set
    before alarms can be raised (one half-life: enough for a line through three sizes)."""
    change_ratio: float = 0.15
    """Relative difference of the typical transfer time from the baseline needed to report a change."""

    def __post_init__(self) -> None:
        checks = {
            "window": self.window >= 2, "half_life_observations": self.half_life_observations > 0,
            "distinct_size_ratio": self.distinct_size_ratio > 1, "outlier_mads": self.outlier_mads > 0,
            "cusum_drift": self.cusum_drift >= 0, "cusum_threshold": self.cusum_threshold > 0,
            "cusum_clip": self.cusum_clip > self.cusum_drift, "min_observations": self.min_observations >= 1,
            "change_ratio": self.change_ratio > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"MonitorConfig.{name} is out of range: {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferObservation:
    """One transfer as the runtime timed it."""

    resource: str
    """Link resource the transfer used (``Link.resource``)."""
    nbytes: float
    seconds: float
    """From the send's start (issue) until delivery at the receiver."""
    start_s: float | None = None
    """When the send started, on the monitor's clock; lets queued transfers be merged."""

    def __post_init__(self) -> None:
        if not self.nbytes >= 0:
            raise ValueError(f"transfer on {self.resource!r}: nbytes must be >= 0, got {self.nbytes!r}")
        if not math.isfinite(self.seconds):
            raise ValueError(f"transfer on {self.resource!r}: seconds must be finite, got {self.seconds!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkEstimate:
    """What the monitor believes about one link resource now."""

    resource: str
    latency_s: float
    bandwidth_bytes_per_s: float
    spread: float
    """Robust relative standard deviation of the samples' times around the estimate (0.1 = 10%)."""
    n_observations: int
    """Samples behind the estimate (since the last detected change)."""
    changed: bool
    """A change against the baseline is detected and not yet accepted."""
    baseline_latency_s: float
    baseline_bandwidth_bytes_per_s: float
    method: EstimateMethod
    changed_at_s: float | None = None
    """When the detected change began (start of the CUSUM run), on the monitor's clock."""
    updated_s: float = 0.0
    """Clock time of the newest sample."""

    def transfer_time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def link_spec(self) -> LinkSpec:
        return LinkSpec(latency_s=self.latency_s, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s)


class LinkMonitor:
    """Per-link estimates from transfer timings. See the module docstring.

    ``priors`` maps link resources to their nominal :class:`LinkSpec` (see
    :func:`priors_from_cluster`); they are the first baseline and the known latency until a
    fit determines it. Resources without a prior learn their baseline from the first
    ``min_observations`` samples.
    """

    def __init__(self, *, priors: Mapping[str, LinkSpec] | None = None, config: MonitorConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or MonitorConfig()
        self._clock = clock
        self._links: dict[str, _LinkState] = {}
        for resource, spec in (priors or {}).items():
            self._state(resource).set_prior(spec.latency_s, spec.bandwidth_bytes_per_s)

    def _state(self, resource: str) -> _LinkState:
        if resource not in self._links:
            self._links[resource] = _LinkState(resource, self.config)
        return self._links[resource]

    @property
    def resources(self) -> tuple[str, ...]:
        return tuple(self._links)

    def set_prior(self, resource: str, spec: LinkSpec) -> None:
        """Nominal values for a link not seen yet (e.g. one a new plan starts to use)."""
        self._state(resource).set_prior(spec.latency_s, spec.bandwidth_bytes_per_s)

    def observe(self, resource: str, nbytes: float, seconds: float, *, start_s: float | None = None) -> None:
        self.observe_batch([TransferObservation(resource=resource, nbytes=nbytes, seconds=seconds,
                                                start_s=start_s)])

    def observe_batch(self, observations: Iterable[TransferObservation]) -> None:
        """Add the transfers of one iteration (pass them together so queued ones merge)."""
        now = self._clock()
        by_resource: dict[str, list[TransferObservation]] = {}
        for ob in observations:
            if ob.seconds <= 0:
                log.debug("ignoring a transfer on %s timed at %r s", ob.resource, ob.seconds)
                continue
            by_resource.setdefault(ob.resource, []).append(ob)
        for resource, obs in by_resource.items():
            st = self._state(resource)
            for nbytes, seconds in _busy_periods(obs, st.latency_hint()):
                st.add(nbytes, seconds, now)

    def estimate(self, resource: str) -> LinkEstimate | None:
        """The current estimate of ``resource`` (``None`` if never seen and without a prior)."""
        st = self._links.get(resource)
        return None if st is None else st.estimate()

    def estimates(self) -> dict[str, LinkEstimate]:
        out = {}
        for resource, st in self._links.items():
            est = st.estimate()
            if est is not None:
                out[resource] = est
        return out

    def changed(self) -> tuple[str, ...]:
        """Resources whose change is detected and not yet accepted."""
        return tuple(r for r, e in self.estimates().items() if e.changed)

    def accept(self, resources: Iterable[str] | None = None) -> None:
        """Make the current estimates of ``resources`` (default: all) their new baselines."""
        for r in self._links if resources is None else resources:
            if r in self._links:
                self._links[r].accept()


def _busy_periods(obs: list[TransferObservation], latency_s: float) -> list[tuple[float, float]]:
    """``(bytes, seconds)`` samples, merging transfers queued behind each other (module docstring, 1)."""
    if any(ob.start_s is None for ob in obs):
        return [(ob.nbytes, ob.seconds) for ob in obs]
    out: list[tuple[float, float]] = []
    obs = sorted(obs, key=lambda ob: ob.start_s)
    start, end, nbytes = obs[0].start_s, obs[0].start_s + obs[0].seconds, obs[0].nbytes
    for ob in obs[1:]:
        if ob.start_s < end - latency_s:  # issued while the resource was still serialising
            end, nbytes = max(end, ob.start_s + ob.seconds), nbytes + ob.nbytes
        else:
            out.append((nbytes, end - start))
            start, end, nbytes = ob.start_s, ob.start_s + ob.seconds, ob.nbytes
    out.append((nbytes, end - start))
    return out


class _LinkState:
    """Window, CUSUM and baseline of one link resource (internal, mutable)."""

    def __init__(self, resource: str, config: MonitorConfig) -> None:
        self.resource, self.cfg = resource, config
        self.window: deque[tuple[float, float, float]] = deque(maxlen=config.window)  # bytes, s, at
        self.prior: tuple[float, float] | None = None
        self.baseline: tuple[float, float] | None = None
        self.reference: tuple[float, float] | None = None  # what the CUSUM compares against
        self.known_latency_s: float | None = None  # from the last well-determined fit
        self.s_up = self.s_down = 0.0
        # samples of the current CUSUM runs (the newest ``window`` of them)
        self.run_up: deque[tuple[float, float, float]] = deque(maxlen=config.window)
        self.run_down: deque[tuple[float, float, float]] = deque(maxlen=config.window)
        self.alarm = False
        self.changed_at_s: float | None = None
        self.since_baseline = 0
        self._cache: LinkEstimate | None = None

    def set_prior(self, latency_s: float, bandwidth_bytes_per_s: float) -> None:
        self.prior = (latency_s, bandwidth_bytes_per_s)
        if self.baseline is None:
            self.baseline = self.reference = self.prior
        self._cache = None

    def latency_hint(self) -> float:
        if self.known_latency_s is not None:
            return self.known_latency_s
        return self.baseline[0] if self.baseline else 0.0

    def add(self, nbytes: float, seconds: float, at_s: float) -> None:
        sample = (nbytes, seconds, at_s)
        self.window.append(sample)
        self.since_baseline += 1
        self._cache = None
        if self.baseline is None:
            if self.since_baseline >= self.cfg.min_observations:
                est = self.estimate()
                self.baseline = self.reference = (est.latency_s, est.bandwidth_bytes_per_s)
                self.since_baseline = 0
            return
        self._cusum(sample)

    def _cusum(self, sample: tuple[float, float, float]) -> None:
        cfg = self.cfg
        lat, bw = self.reference
        x = math.log(sample[1] / (lat + sample[0] / bw))
        x = max(-cfg.cusum_clip, min(cfg.cusum_clip, x))
        self.s_up = max(0.0, self.s_up + x - cfg.cusum_drift)
        self.s_down = max(0.0, self.s_down - x - cfg.cusum_drift)
        for total, run in ((self.s_up, self.run_up), (self.s_down, self.run_down)):
            if total > 0:
                run.append(sample)
            else:
                run.clear()
        if self.since_baseline < cfg.min_observations:
            return
        run = self.run_up if self.s_up > cfg.cusum_threshold else (
            self.run_down if self.s_down > cfg.cusum_threshold else None)
        if run is None:
            return
        # cut the window to the samples of the run: the estimate jumps to the new level
        self.window = deque(run, maxlen=self.cfg.window)
        self.alarm, self.changed_at_s = True, run[0][2] if self.changed_at_s is None else self.changed_at_s
        self.known_latency_s = None if self._size_spread() else self.known_latency_s
        self._cache = None
        est = self.estimate()
        self.reference = (est.latency_s, est.bandwidth_bytes_per_s)
        self.s_up = self.s_down = 0.0
        self.run_up.clear()
        self.run_down.clear()
        log.info("link %s: change detected (%.3g ms + bytes / %.4g MB/s, was %.3g ms / %.4g MB/s)",
                 self.resource, est.latency_s * 1e3, est.bandwidth_bytes_per_s / 1e6,
                 self.baseline[0] * 1e3, self.baseline[1] / 1e6)

    def accept(self) -> None:
        est = self.estimate()
        if est is None:
            return
        self.baseline = self.reference = (est.latency_s, est.bandwidth_bytes_per_s)
        self.alarm, self.changed_at_s = False, None
        self.s_up = self.s_down = 0.0
        self.run_up.clear()
        self.run_down.clear()
        self.since_baseline = self.cfg.min_observations  # the new baseline is already informed
        self._cache = None

    def _size_spread(self) -> bool:
        sizes = [s[0] for s in self.window]
        return bool(sizes) and min(sizes) > 0 and max(sizes) / min(sizes) >= self.cfg.distinct_size_ratio

    # -- estimation ---------------------------------------------------------------------
    def estimate(self) -> LinkEstimate | None:
        if self._cache is not None:
            return self._cache
        if not self.window:
            if self.prior is None:
                return None
            lat, bw, spread, method = *self.prior, 0.0, "prior"
        else:
            lat, bw, spread, method = self._fit()
        base = self.baseline or (lat, bw)
        self._cache = LinkEstimate(
            resource=self.resource, latency_s=lat, bandwidth_bytes_per_s=bw, spread=spread,
            n_observations=len(self.window), changed=self.alarm and self._differs(lat, bw, base),
            baseline_latency_s=base[0], baseline_bandwidth_bytes_per_s=base[1], method=method,
            changed_at_s=self.changed_at_s if self.alarm else None,
            updated_s=self.window[-1][2] if self.window else 0.0,
        )
        return self._cache

    def _differs(self, lat: float, bw: float, base: tuple[float, float]) -> bool:
        typical = float(np.median([s[0] for s in self.window])) if self.window else 0.0
        now, before = lat + typical / bw, base[0] + typical / base[1]
        return abs(math.log(now / before)) >= math.log1p(self.cfg.change_ratio)

    def _fit(self) -> tuple[float, float, float, EstimateMethod]:
        x = np.array([s[0] for s in self.window], dtype=float)
        y = np.array([s[1] for s in self.window], dtype=float)
        age = np.arange(len(x) - 1, -1, -1, dtype=float)
        w = 0.5 ** (age / self.cfg.half_life_observations)
        fitted = self._line(x, y, w) if self._size_spread() else None
        if fitted is not None:
            lat, bw, method = *fitted, "fit"
        else:
            lat, bw, method = self._one_parameter(x, y, w)
        rel = np.abs(np.log(y / (lat + x / bw)))
        return lat, bw, _ROBUST_SD * _weighted_median(rel, w), method

    def _line(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float] | None:
        """Weighted least squares ``y = a + b x``, refitted once without the outliers."""
        if len(x) < 3:
            return None
        a, b, _ = _wls(x, y, w)
        resid = (y - (a + b * x)) / y
        mad = _ROBUST_SD * _weighted_median(np.abs(resid), w)
        keep = np.abs(resid) <= self.cfg.outlier_mads * max(mad, 1e-3)
        if keep.sum() < 3 or x[keep].max() < self.cfg.distinct_size_ratio * max(x[keep].min(), 1e-300):
            return None
        a, b, se_a = _wls(x[keep], y[keep], w[keep])
        if b <= 0:
            return None
        if a > 0 and se_a < 0.5 * a:
            self.known_latency_s = a
            return a, 1.0 / b
        # the intercept is not determined by these sizes: keep the known latency, refit the slope
        lat = self.latency_hint()
        xs, ys, ws = x[keep], y[keep] - lat, w[keep]
        slope = float(np.sum(ws * xs * ys) / np.sum(ws * xs * xs))
        return (lat, 1.0 / slope) if slope > 0 else None

    def _one_parameter(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float, EstimateMethod]:
        lat = self.latency_hint()
        serial = y - lat
        # a sample informs the bandwidth only if serialisation is a real part (>= 10%) of its
        # time, judged by the reference model when there is one (a wrong latency must not
        # turn a latency-bound sample into a bandwidth figure)
        share = (x / self.reference[1]) / (self.reference[0] + x / self.reference[1]) if self.reference \
            else serial / y
        useful = (share >= 0.1) & (serial > 0) & (x > 0)
        if useful.any():
            return lat, float(_weighted_median(x[useful] / serial[useful], w[useful])), "bandwidth"
        bw = self.reference[1] if self.reference else None
        if bw is None:  # nothing known: serialisation is under 10% of each time, a lower bound
            bw = float(np.median(x / (0.1 * y))) if x.max() > 0 else 1.0
        return float(max(0.0, _weighted_median(y - x / bw, w))), bw, "latency"


def _wls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float, float]:
    """Intercept, slope and the intercept's standard error of a weighted least-squares line."""
    sw = w.sum()
    xm, ym = (w * x).sum() / sw, (w * y).sum() / sw
    sxx = (w * (x - xm) ** 2).sum()
    b = (w * (x - xm) * (y - ym)).sum() / sxx
    a = ym - b * xm
    n_eff = sw**2 / (w**2).sum()
    dof = max(n_eff - 2.0, 1.0)
    sigma2 = (w * (y - a - b * x) ** 2).sum() / sw * n_eff / dof
    se_a = math.sqrt(sigma2 * (1.0 / n_eff + xm**2 / (sxx / sw * n_eff)))
    return float(a), float(b), se_a


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    v, c = values[order], np.cumsum(weights[order])
    return float(v[np.searchsorted(c, 0.5 * c[-1])])


def priors_from_cluster(cluster: Cluster, plan: Plan | None = None, *, at_s: float = 0.0) -> dict[str, LinkSpec]:
    """Nominal latency and bandwidth (at time ``at_s``) of every link resource ``plan`` sends on
    between its stages (all inter-device resources of the cluster when ``plan`` is None)."""
    if plan is None:
        names = cluster.device_names
        pairs = [(a, b) for a in names for b in names if a != b]
    else:
        pairs = []
        for rep in plan.replicas:
            for a, b in zip(rep.stages, rep.stages[1:], strict=False):
                for i, j, _, _ in share_overlaps(a.shares, b.shares):
                    pairs += [(a.devices[i], b.devices[j]), (b.devices[j], a.devices[i])]
    out: dict[str, LinkSpec] = {}
    for src, dst in pairs:
        link = cluster.link(src, dst)
        out.setdefault(link.resource, LinkSpec(latency_s=link.latency_s,
                                               bandwidth_bytes_per_s=link.bandwidth_at(at_s)))
    return out
