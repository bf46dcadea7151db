"""Baselines: the systems deepcee is compared with, as plans on the same cost model (torch-free).

Every baseline is a :class:`deepcee.plan.Plan`, scored by the same simulator as deepcee's
plan (``Estimate.source == "simulator"``) and checked against device memory with the same
memory model (:mod:`deepcee.simulator.memory`), so every ratio is like for like. A baseline
that cannot fit anywhere has ``plan=None`` and a reason naming the shortfall.

The systems, as users run them on **all** devices (file order, no knowledge of the network):

- ``ddp``: PyTorch DDP. One stage over every device, equal shares (``global_batch / N`` each,
  as even as whole samples allow), flat ring all-reduce (``allreduce-ring``). When the
  activations do not fit, gradient accumulation: more, smaller microbatches, run
  forward-backward one microbatch at a time. (That is the ``1f1b`` schedule with one stage;
  ``gpipe`` with one stage would stash every microbatch before the first backward, which is
  not what DDP does.)
- ``fsdp-zero2``: as ``ddp`` with sharded gradients and optimizer state (``zero2``); the same
  ring bytes.
- ``gpipe-even``: a pipeline of ``S = min(N, layers)`` stages, layers split as evenly as the
  layer count allows, devices dealt round-robin to stages in file order (device ``k`` to
  stage ``k mod S``, so extra devices become data-parallel replicas inside a stage), equal
  shares, the standard ``4 x S`` microbatches (the largest divisor of the global batch not
  above it), ``gpipe`` schedule. More microbatches only when memory demands.
- ``1f1b-even``: DeepSpeed-style, the same placement with the ``1f1b`` schedule.
- ``metis-hetpipe``: a heterogeneity-aware planner in the style of Metis and HetPipe without
  network grouping or zero-bubble: devices sorted by speed (ties in file order) and cut into
  ``S`` contiguous stages of near-equal size, layers split to balance compute time against
  each stage's speed (a min-max partition over the splits that fit device memory), shares
  proportional to device speed, ``1f1b``;
  it searches its own small space (every stage count, microbatch counts near ``S``, ``2S``
  and ``4S``, more only when those do not fit memory) with the simulator and keeps its best plan that fits.

And the obvious ways to avoid slow links:

- ``ddp-best-island``: DDP on each island alone; the fastest that fits.
- ``best-single-node``: on each node alone, DDP over its devices, or, where DDP does not fit,
  ``1f1b-even`` over its devices; the fastest that fits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from deepcee.cluster import Cluster
from deepcee.errors import DeepceeError
from deepcee.plan import Plan, StagePlan
from deepcee.profile import ModelProfile
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.passes import in_flight_per_stage
from deepcee.schedule.program import stage_in_flight
from deepcee.simulator.engine import simulate, to_estimate
from deepcee.simulator.memory import device_memory_bytes
from deepcee.units import GIB

log = logging.getLogger(__name__)

BASELINE_NAMES: tuple[str, ...] = (
    "ddp", "fsdp-zero2", "gpipe-even", "1f1b-even", "metis-hetpipe", "ddp-best-island", "best-single-node",
)
ALL_DEVICE_BASELINES: tuple[str, ...] = ("ddp", "fsdp-zero2", "gpipe-even", "1f1b-even", "metis-hetpipe")
"""The baselines that use every device (the others leave slow devices out)."""
MICROBATCHES_PER_STAGE = 4
"""The usual GPipe / DeepSpeed choice: ``4 x stages`` microbatches."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineResult:
    """One baseline: its plan (with the simulator's estimate), or ``None`` and why."""

    name: str
    plan: Plan | None
    reason: str = ""
    """Why there is no plan (``OOM: needs ...``); empty when there is one."""
    description: str = ""
    """What the system does, in one line (for reports)."""

    def __post_init__(self) -> None:
        if self.plan is None and not self.reason:
            raise DeepceeError(f"baseline {self.name!r}: no plan and no reason")
        if self.plan is not None and (self.plan.estimate is None or self.plan.estimate.source != "simulator"):
            raise DeepceeError(f"baseline {self.name!r}: its plan must carry a simulator estimate")

    @property
    def samples_per_s(self) -> float:
        """Simulated samples/s, 0 when there is no plan."""
        return 0.0 if self.plan is None or self.plan.estimate is None else self.plan.estimate.samples_per_s


class _NoFit(Exception):
    """Internal: a candidate plan cannot be built or does not fit; carries the reason."""


# ---------------------------------------------------------------------------------------
# small pieces
# ---------------------------------------------------------------------------------------


def even_shares(samples: int, parts: int) -> tuple[int, ...]:
    """``samples`` split into ``parts`` whole shares differing by at most one (largest first)."""
    base, extra = divmod(samples, parts)
    return tuple(base + (1 if k < extra else 0) for k in range(parts))


def proportional_shares(samples: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Whole shares >= 1 proportional to ``weights`` (largest remainder)."""
    k = len(weights)
    if samples < k:
        raise _NoFit(f"microbatch of {samples} samples cannot give each of {k} devices a sample")
    w = np.asarray(weights, dtype=float)
    ideal = (samples - k) * w / w.sum()
    shares = np.floor(ideal).astype(int)
    left = (samples - k) - int(shares.sum())
    for j in np.argsort(-(ideal - shares), kind="stable")[:left]:
        shares[j] += 1
    return tuple(int(s) + 1 for s in shares)


def even_layer_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each stage, sizes differing by at most one layer."""
    cuts = [round(num_layers * s / stages) for s in range(stages + 1)]
    return list(zip(cuts, cuts[1:], strict=False))


def balanced_layer_split(layer_cost: Sequence[float], speeds: Sequence[float],
                         fits: Sequence[np.ndarray] | None = None) -> list[tuple[int, int]] | None:
    """Contiguous split minimising ``max over stages of cost(stage) / speed(stage)`` (DP).

    ``fits[s][a, b]`` (optional) says whether stage ``s`` can hold layers ``[a, b)``;
    ``None`` when no split fits.
    """
    n, k = len(layer_cost), len(speeds)
    prefix = np.concatenate([[0.0], np.cumsum(layer_cost)])
    span = prefix[None, :] - prefix[:, None]  # span[a, b] = cost of layers [a, b)
    # best[s, j]: least max-time placing layers [0, j) on stages [0, s)
    best = np.full((k + 1, n + 1), np.inf)
    cut = np.zeros((k + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            i = np.arange(s - 1, j)
            t = np.maximum(best[s - 1, i], span[i, j] / speeds[s - 1])
            if fits is not None:
                t = np.where(fits[s - 1][i, j], t, np.inf)
            pick = int(np.argmin(t))
            best[s, j], cut[s, j] = t[pick], i[pick]
    if not np.isfinite(best[k, n]):
        return None
    out, j = [], n
    for s in range(k, 0, -1):
        out.append((int(cut[s, j]), j))
        j = int(cut[s, j])
    return out[::-1]


def stage_fit_table(cluster: Cluster, model: ModelProfile, devices: Sequence[str], shares: Sequence[int],
                    in_flight: int) -> np.ndarray:
    """``fits[a, b]``: every device of a stage (ring sync) holds layers ``[a, b)``.

    The terms of :func:`deepcee.simulator.memory.device_memory_bytes`, on prefix sums so
    the whole table costs a few array operations.
    """
    n = model.num_layers
    params = np.concatenate([[0.0], np.cumsum([la.parameter_count for la in model.layers])])
    act = np.concatenate([[0.0], np.cumsum([la.activation_bytes for la in model.layers])])
    boundary = np.array([model.boundary_bytes(k) for k in range(n + 1)])
    state = (params[None, :] - params[:, None]) * model.state_bytes_per_parameter
    stash = act[None, :] - act[:, None]
    edges = boundary[:, None] + boundary[None, :]
    ok = np.ones((n + 1, n + 1), dtype=bool)
    for d, share in zip(devices, shares, strict=True):
        ok &= state + in_flight * share * stash + share * edges <= cluster.memory_bytes(d)
    return ok


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(global_batch: int, min_microbatch: int, preferred: int) -> list[int]:
    """Microbatch counts that divide the batch and leave ``min_microbatch`` samples each:
    the largest not above ``preferred`` first, then more, then fewer."""
    ok = [m for m in divisors(global_batch) if global_batch // m >= min_microbatch]
    if not ok:
        return []
    first = max([m for m in ok if m <= preferred] or [min(ok)])
    return [first] + [m for m in ok if m > first] + sorted((m for m in ok if m < first), reverse=True)


def memory_shortfall(plan: Plan, cluster: Cluster, model: ModelProfile) -> str | None:
    """``None`` when every device fits, else ``needs X GiB on dev, has Y GiB`` for the worst one."""
    in_flight = stage_in_flight(plan)
    worst: tuple[float, str, float] | None = None
    for s, st in enumerate(plan.stages):
        for d, share in zip(st.devices, st.shares, strict=True):
            need = device_memory_bytes(model, st.layer_start, st.layer_stop, share=share, in_flight=in_flight[s],
                                       sync=plan.sync, stage_devices=len(st.devices))
            have = cluster.memory_bytes(d)
            if need > have and (worst is None or need / have > worst[0] / worst[2]):
                worst = (need, d, have)
    if worst is None:
        return None
    return f"needs {worst[0] / GIB:.1f} GiB on {worst[1]}, has {worst[2] / GIB:.0f} GiB"


def _plan(system: str, cluster: Cluster, model: ModelProfile, global_batch: int, stages: list[StagePlan],
          num_microbatches: int, schedule: str, sync: str, explanation: str) -> Plan:
    used = {d for st in stages for d in st.devices}
    return Plan(
        system=system, cluster=cluster.name, model=model.name, global_batch=global_batch,
        microbatch_size=global_batch // num_microbatches, num_microbatches=num_microbatches,
        stages=tuple(stages), schedule=schedule, sync=sync,
        excluded_devices=tuple(d for d in cluster.device_names if d not in used),
        explanation=(explanation,),
    )


def scored(plan: Plan, cluster: Cluster, model: ModelProfile) -> Plan:
    """The plan with the simulator's estimate; raises ``_NoFit`` if the simulator sees an OOM."""
    result = simulate(plan, cluster, model, record=False)
    over = [(b, d) for d, b in result.peak_memory_bytes.items() if b > cluster.memory_bytes(d)]
    if over:
        b, d = max(over)
        raise _NoFit(f"OOM: needs {b / GIB:.1f} GiB on {d}, has {cluster.memory_bytes(d) / GIB:.0f} GiB")
    return plan.replace(estimate=to_estimate(result, plan, cluster))


def _first_fitting(candidates: Callable[[int], Plan], counts: Sequence[int], cluster: Cluster,
                   model: ModelProfile, what: str) -> Plan:
    """The first microbatch count whose plan fits, scored; ``_NoFit`` naming the last shortfall."""
    if not counts:
        raise _NoFit(f"{what}: the global batch cannot give every device a sample")
    short = ""
    for m in counts:
        plan = candidates(m)
        short = memory_shortfall(plan, cluster, model) or ""
        if not short:
            return scored(plan, cluster, model)
    raise _NoFit(f"OOM: {short} (with up to {max(counts)} microbatches)")


# ---------------------------------------------------------------------------------------
# the systems, on a given list of devices
# ---------------------------------------------------------------------------------------


def data_parallel(cluster: Cluster, model: ModelProfile, global_batch: int, devices: Sequence[str], *,
                  system: str = "ddp", sync: str = "allreduce-ring") -> Plan:
    """One stage over ``devices`` with equal shares; gradient accumulation when memory demands."""
    n = len(devices)

    def make(m: int) -> Plan:
        st = StagePlan(layer_start=0, layer_stop=model.num_layers, devices=tuple(devices),
                       shares=even_shares(global_batch // m, n))
        return _plan(system, cluster, model, global_batch, [st], m, "1f1b", sync,
                     f"{system}: {n} devices, {sync}, {m} accumulation step(s) of {global_batch // m} samples")

    return _first_fitting(make, microbatch_counts(global_batch, n, 1), cluster, model, system)


def even_pipeline(cluster: Cluster, model: ModelProfile, global_batch: int, devices: Sequence[str], *,
                  schedule: str, system: str) -> Plan:
    """``min(N, layers)`` stages, even layer split, devices round-robin in the given order."""
    s_count = min(len(devices), model.num_layers)
    groups = [tuple(devices[s::s_count]) for s in range(s_count)]
    split = even_layer_split(model.num_layers, s_count)
    widest = max(len(g) for g in groups)

    def make(m: int) -> Plan:
        mb = global_batch // m
        stages = [StagePlan(layer_start=a, layer_stop=b, devices=g, shares=even_shares(mb, len(g)))
                  for (a, b), g in zip(split, groups, strict=True)]
        return _plan(system, cluster, model, global_batch, stages, m, schedule, "allreduce-ring",
                     f"{system}: {s_count} stages, even layer split, devices round-robin in file order, "
                     f"{m} microbatches of {mb}")

    counts = microbatch_counts(global_batch, widest, MICROBATCHES_PER_STAGE * s_count)
    return _first_fitting(make, counts, cluster, model, system)


def _metis_candidates(cluster: Cluster, model: ModelProfile, global_batch: int,
                      devices: Sequence[str]) -> list[Plan]:
    """Per stage count and microbatch count, the compute-balanced split that fits memory."""
    speed = {d: cluster.effective_flops_per_s(d) for d in devices}
    order = sorted(devices, key=lambda d: -speed[d])  # stable: ties keep file order
    costs = [la.forward_flops + la.input_grad_flops + la.weight_grad_flops for la in model.layers]
    out = []
    for s_count in range(1, min(len(order), model.num_layers) + 1):
        sizes = even_shares(len(order), s_count)
        bounds = np.cumsum((0, *sizes))
        groups = [tuple(order[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        stage_speed = [sum(speed[d] for d in g) for g in groups]
        valid = [m for m in divisors(global_batch) if global_batch // m >= max(sizes)]
        # near S, 2S and 4S microbatches; more (smaller ones) only when none of those fits memory
        preferred = sorted({max([m for m in valid if m <= f * s_count], default=0) for f in (1, 2, 4)} - {0})
        more = [m for m in valid if m > max(preferred, default=0)]
        found = []
        for m in preferred + more:
            if found and m in more:
                break
            mb = global_batch // m
            shares = [proportional_shares(mb, [speed[d] for d in g]) for g in groups]
            in_flight = in_flight_per_stage(build_schedule("1f1b", s_count, m))
            fits = [stage_fit_table(cluster, model, g, sh, in_flight[s])
                    for s, (g, sh) in enumerate(zip(groups, shares, strict=True))]
            split = balanced_layer_split(costs, stage_speed, fits)
            if split is None:
                continue
            stages = [StagePlan(layer_start=a, layer_stop=b, devices=g, shares=sh)
                      for (a, b), g, sh in zip(split, groups, shares, strict=True)]
            found.append(_plan("metis-hetpipe", cluster, model, global_batch, stages, m, "1f1b", "allreduce-ring",
                               f"metis-hetpipe: {s_count} stages of speed-sorted devices, memory-aware "
                               f"compute-balanced layer split, speed-proportional shares, {m} microbatches of {mb}"))
        out += found
    return out


METIS_CONFIRM = 4
"""Metis candidates simulated, the cost model's best that fit (its own search scores with a cost
model too); at 512 devices simulating all ~70-190 of them took 20 s per call."""


def metis_hetpipe(cluster: Cluster, model: ModelProfile, global_batch: int, devices: Sequence[str]) -> Plan:
    """The best-scoring fitting plan of the Metis/HetPipe-style search (see the module docstring)."""
    from deepcee.planner.cost_model import AnalyticCostModel

    short = "OOM: no stage count and layer split fits device memory"
    fitting = []
    cost_model = AnalyticCostModel()  # one for every candidate: its memo of stage terms is shared
    for k, plan in enumerate(_metis_candidates(cluster, model, global_batch, devices)):
        miss = memory_shortfall(plan, cluster, model)
        if miss:
            short = f"OOM: {miss}"
            continue
        fitting.append((cost_model.estimate(plan, cluster, model).iteration_s, k, plan))
    confirmed = []
    for _, k, plan in sorted(fitting, key=lambda x: x[:2]):
        try:
            confirmed.append((k, scored(plan, cluster, model)))
        except _NoFit as exc:
            short = str(exc)
            continue
        if len(confirmed) >= METIS_CONFIRM:
            break
    best: Plan | None = None
    for _, plan in sorted(confirmed, key=lambda x: x[0]):  # candidate order: ties keep the first
        if best is None or plan.estimate.samples_per_s > best.estimate.samples_per_s:
            best = plan
    if best is None:
        raise _NoFit(f"{short} (every stage count tried)")
    return best


def _best_over(parts: dict[str, Sequence[str]], build: Callable[[Sequence[str]], Plan], what: str) -> Plan:
    best: Plan | None = None
    reasons = []
    for name, devs in parts.items():
        try:
            plan = build(devs)
        except _NoFit as exc:
            reasons.append(f"{name}: {exc}")
            continue
        if best is None or plan.estimate.samples_per_s > best.estimate.samples_per_s:
            best = plan
    if best is None:
        raise _NoFit(f"no {what} fits: " + "; ".join(reasons))
    return best


def distinct_nodes(cluster: Cluster, model: ModelProfile) -> dict[str, tuple[str, ...]]:
    """The first node of every set of identical nodes (same devices, and the same links and link
    sharing inside, in order): identical nodes give identical figures, and the first of equals
    wins anyway (at 512 devices the 128 nodes are a handful of kinds)."""
    out: dict[str, tuple[str, ...]] = {}
    seen: set[tuple] = set()
    for name, devs in cluster.node_devices().items():
        kinds = tuple((cluster.device(d).kind, cluster.device(d).slowdown, cluster.memory_bytes(d)) for d in devs)
        resources: dict[str, int] = {}
        links = []
        for a in devs:
            for b in devs:
                if a != b:
                    link = cluster.link(a, b)
                    links.append((link.latency_s, link.bandwidth_bytes_per_s, link.trace,
                                  resources.setdefault(link.resource, len(resources)), model.link_curve(a, b)))
        if (kinds, tuple(links)) not in seen:
            seen.add((kinds, tuple(links)))
            out[name] = devs
    return out


def _single_node(cluster: Cluster, model: ModelProfile, global_batch: int, devices: Sequence[str]) -> Plan:
    try:
        return data_parallel(cluster, model, global_batch, devices, system="best-single-node")
    except _NoFit as ddp_miss:
        if len(devices) == 1:
            raise
        try:
            return even_pipeline(cluster, model, global_batch, devices, schedule="1f1b", system="best-single-node")
        except _NoFit as pipe_miss:
            raise _NoFit(f"DDP {ddp_miss}; pipeline {pipe_miss}") from None


# ---------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------

_DESCRIPTIONS = {
    "ddp": "PyTorch DDP: every device, equal shares, flat ring all-reduce",
    "fsdp-zero2": "FSDP / ZeRO-2: as DDP with sharded gradients and optimizer state",
    "gpipe-even": "GPipe: even layer split, devices in file order, 4 x stages microbatches",
    "1f1b-even": "DeepSpeed pipeline: as GPipe with the 1F1B schedule",
    "metis-hetpipe": "Metis/HetPipe-style: speed-sorted stages, compute-balanced split, no network grouping",
    "ddp-best-island": "DDP on the best single island",
    "best-single-node": "the best single node (DDP, or a pipeline if DDP does not fit)",
}


def build_baselines(cluster: Cluster, model: ModelProfile, global_batch: int) -> list[BaselineResult]:
    """Every baseline of :data:`BASELINE_NAMES`, in that order. See the module docstring."""
    devs = cluster.device_names
    builders: dict[str, Callable[[], Plan]] = {
        "ddp": lambda: data_parallel(cluster, model, global_batch, devs),
        "fsdp-zero2": lambda: data_parallel(cluster, model, global_batch, devs, system="fsdp-zero2", sync="zero2"),
        "gpipe-even": lambda: even_pipeline(cluster, model, global_batch, devs, schedule="gpipe",
                                            system="gpipe-even"),
        "1f1b-even": lambda: even_pipeline(cluster, model, global_batch, devs, schedule="1f1b", system="1f1b-even"),
        "metis-hetpipe": lambda: metis_hetpipe(cluster, model, global_batch, devs),
        "ddp-best-island": lambda: _best_over(
            cluster.island_devices(),
            lambda d: data_parallel(cluster, model, global_batch, d, system="ddp-best-island"), "island"),
        "best-single-node": lambda: _best_over(
            distinct_nodes(cluster, model), lambda d: _single_node(cluster, model, global_batch, d), "node"),
    }
    out = []
    for name in BASELINE_NAMES:
        try:
            result = BaselineResult(name=name, plan=builders[name](), description=_DESCRIPTIONS[name])
        except _NoFit as exc:
            result = BaselineResult(name=name, plan=None, reason=str(exc), description=_DESCRIPTIONS[name])
        log.debug("baseline %s: %s", name, result.plan.estimate.samples_per_s if result.plan else result.reason)
        out.append(result)
    return out
