"""Compact link-aware zero-bubble builder: order F/I/W per stage to minimise the dry-run makespan.

Inputs are per-stage compute times (``F``, ``I``, ``W``), per-boundary transfer costs
``(latency_s, serialization_s)`` in each direction, and a per-stage memory limit: the most
microbatches a stage may hold in flight (stash held from ``F`` until ``W``; see
:func:`deepcee.schedule.passes.in_flight_per_stage`).

Method (all candidates are timed by the model of :func:`deepcee.schedule.passes.dry_run`):

1. **Greedy list scheduling**, event-driven. The stage with the earliest decision time picks
   its next action among the next ``F`` (microbatch order; allowed while in flight < cap), the
   ``I`` of its oldest forwarded microbatch, and the ``W`` of its oldest ``I``'d microbatch:
   a ready ``I`` comes first (it is on the backward critical path) unless the next stage is
   about to starve of forwards; a ready ``F`` next; a ``W`` fills idle time when it ends
   before the next input can arrive (known deliveries, or a lower bound that includes the
   link's latency and serialisation), or within a slack. Otherwise the stage waits. The
   timing follows the dry-run model exactly (a stage runs its list in order; sends go FIFO
   per link), so the greedy's makespan is the dry run's.
2. The greedy runs over a small grid of rule parameters (:data:`RULE_GRID`): how many
   forwards to keep queued downstream before preferring ``F`` over ``I``, the ``W`` slack,
   and the in-flight cap (the memory limit, or the latency-aware need from Little's law,
   ``ceil(round trip / bottleneck cycle)``, or that plus one).
3. Coordinate descent on the per-stage caps of the best greedy setting (one stage's cap
   up or down by one at a time, kept when the makespan drops).
4. The fixed templates (:data:`TEMPLATES`: GPipe and 1F1B with split backward, i.e. GPipe-split
   and ZB-H1, ZB-H2, and ZB-H2's shape with per-stage warm-up ``min(limit, need + 1)``,
   :func:`capped_zero_bubble`, which always fits the limit) that satisfy the memory limit are
   timed too (with ``rules=()`` only they are: the fast path for long pipelines); the best candidate
   wins (ties: fewer microbatches in flight, then the order tried). The result is therefore
   never slower than an admissible GPipe, 1F1B, ZB-H1 or ZB-H2, and it is deterministic.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from deepcee.errors import ScheduleError
from deepcee.schedule.builders import BUILDERS, split_backward
from deepcee.schedule.interpreter import Execution, LinkCost, stage_tables
from deepcee.schedule.ir import Action, ActionKind, Schedule, make_action
from deepcee.schedule.passes import dry_run, in_flight_per_stage, lower, per_boundary, per_stage

log = logging.getLogger(__name__)
K = ActionKind


@dataclass(frozen=True, slots=True, kw_only=True)
class Rules:
    """One parameter setting of the greedy list scheduler."""

    feed_downstream: int | None
    """When both ``F`` and ``I`` are ready, run ``F`` while the next stage has fewer than this
    many forwards queued (sent here, not yet run there); ``None``: always ``F`` first."""
    w_slack: float | None
    """Run a ``W`` while waiting if it ends no later than the next possible arrival plus
    ``w_slack`` x its own duration; ``None``: whenever nothing else is ready."""
    cap: str
    """In-flight cap: ``"limit"`` (the memory limit), ``"need"`` (the latency-aware need,
    see :func:`in_flight_need`), ``"need+1"``."""

    def __post_init__(self) -> None:
        if self.cap not in ("limit", "need", "need+1"):
            raise ScheduleError(f"Rules.cap must be 'limit', 'need' or 'need+1', got {self.cap!r}")

    def __str__(self) -> str:
        return f"greedy(feed={self.feed_downstream}, w_slack={self.w_slack}, cap={self.cap})"


RULE_GRID: tuple[Rules, ...] = tuple(
    Rules(feed_downstream=q, w_slack=a, cap=c)
    for c in ("limit", "need", "need+1")
    for q in (0, 1, 2, None)
    for a in (0.0, 1.0, None)
)
"""The rule settings tried by :func:`build_compact`, in tie-break order."""

TEMPLATES: tuple[str, ...] = ("gpipe-split", "zb-h1", "zb-h2", "zb-capped")
"""Fixed templates tried by :func:`build_compact`: GPipe with ``B`` split into ``I, W``,
ZB-H1 (which is 1F1B split so) and ZB-H2. A split form is never slower than its ``B`` form
under the dry-run model: the stage's timeline is the same but each input gradient leaves
one ``W`` earlier, and every dry-run time is a non-decreasing function of arrival times."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactResult:
    """The chosen schedule and how it was found."""

    schedule: Schedule
    makespan_s: float
    """Dry-run makespan of ``schedule``."""
    source: str
    """The winning candidate: a template name or a :class:`Rules` string."""
    best_template: str | None
    """The fastest admissible template (``None`` when none fits the memory limit)."""
    best_template_makespan_s: float
    """Its makespan (``inf`` when none fits)."""
    candidates: int
    """How many candidates were timed."""


@dataclass(frozen=True, slots=True)
class _Costs:
    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    cf: tuple[LinkCost, ...]
    cb: tuple[LinkCost, ...]
    m: int

    @property
    def s(self) -> int:
        return len(self.f)


def build_compact(
    *,
    num_microbatches: int,
    forward_s: Sequence[float],
    input_grad_s: Sequence[float],
    weight_grad_s: Sequence[float],
    comm_forward: Sequence[LinkCost],
    comm_backward: Sequence[LinkCost],
    memory_limit: int | Sequence[int] | None = None,
) -> Schedule:
    """Best F/I/W order found for these costs under the memory limit (see the module docstring).

    ``forward_s`` etc. are per stage (length ``S``); ``comm_forward[b]`` /
    ``comm_backward[b]`` are ``(latency_s, serialization_s)`` for stage ``b -> b+1`` /
    ``b+1 -> b``; ``memory_limit`` is per stage (or one value for all) the most microbatches
    in flight, ``None`` for unlimited. Raises :class:`ScheduleError` for a limit below 1.
    """
    return search_compact(
        num_microbatches=num_microbatches, forward_s=forward_s, input_grad_s=input_grad_s,
        weight_grad_s=weight_grad_s, comm_forward=comm_forward, comm_backward=comm_backward,
        memory_limit=memory_limit,
    ).schedule


def search_compact(
    *,
    num_microbatches: int,
    forward_s: Sequence[float],
    input_grad_s: Sequence[float],
    weight_grad_s: Sequence[float],
    comm_forward: Sequence[LinkCost],
    comm_backward: Sequence[LinkCost],
    memory_limit: int | Sequence[int] | None = None,
    rules: Sequence[Rules] = RULE_GRID,
) -> CompactResult:
    """:func:`build_compact` with the search details (and a choice of rule settings)."""
    costs = _costs(num_microbatches, forward_s, input_grad_s, weight_grad_s, comm_forward, comm_backward)
    limits = _limits(memory_limit, costs.s, costs.m)
    timing = {"forward_s": costs.f, "input_grad_s": costs.i, "weight_grad_s": costs.w,
              "comm_forward": costs.cf, "comm_backward": costs.cb}
    # (makespan, total in flight, order) ranks candidates; order keeps ties deterministic.
    best: tuple[float, int, int, Schedule, str] | None = None
    best_template: tuple[float, str] = (math.inf, "")
    count = 0
    need = in_flight_need(costs)
    warm = tuple(min(lim, n + 1) for lim, n in zip(limits, need, strict=True))
    for name in TEMPLATES:
        sched = _template(name, costs.s, costs.m, warm)
        held = in_flight_per_stage(sched)
        if any(h > lim for h, lim in zip(held, limits, strict=True)):
            continue
        span = _makespan(sched, costs)
        count += 1
        best_template = min(best_template, (span, name))
        key = (span, sum(held), count, sched, f"template {name}")
        best = key if best is None or key[:3] < best[:3] else best
    seen: set[Schedule] = set()
    greedy_best: tuple[float, int, Rules, tuple[int, ...]] | None = None
    for r in rules:
        caps = _caps(r.cap, limits, need)
        sched, span = _greedy(costs, caps, r)
        if greedy_best is None or span < greedy_best[0]:
            greedy_best = (span, len(seen), r, caps)
        if sched in seen:
            continue
        seen.add(sched)
        count += 1
        key = (span, sum(in_flight_per_stage(sched)), count, sched, str(r))
        if best is None or key[:3] < best[:3]:
            best = key
    if greedy_best is not None:
        for sched, span, label in _cap_descent(costs, limits, greedy_best[2], greedy_best[3], greedy_best[0]):
            count += 1
            key = (span, sum(in_flight_per_stage(sched)), count, sched, label)
            if best is None or key[:3] < best[:3]:
                best = key
    if best is None:
        raise ScheduleError("no schedule: no template fits the memory limit and no greedy rule was given")
    span, _, _, sched, source = best
    checked = _makespan(sched, costs) if source.startswith("template") else dry_run(sched, **timing).makespan_s
    if not math.isclose(checked, span, rel_tol=1e-9, abs_tol=1e-12):
        raise ScheduleError(f"internal: greedy timing {span!r} disagrees with the dry run {checked!r} ({source})")
    log.debug("compact: %s, makespan %.6g s (best template %s %.6g s, %d candidates)",
              source, span, best_template[1] or None, best_template[0], count)
    return CompactResult(schedule=sched, makespan_s=span, source=source,
                         best_template=best_template[1] or None,
                         best_template_makespan_s=best_template[0], candidates=count)


def _makespan(sched: Schedule, costs: _Costs) -> float:
    """The dry run's makespan of a valid (template) schedule, without recording every action."""
    run = Execution(stage_tables(lower(sched), costs.f, costs.i, costs.w, costs.cf, costs.cb))
    return max(run.pipeline(0.0)[0])


def _cap_descent(costs: _Costs, limits: tuple[int, ...], rules: Rules, caps: tuple[int, ...],
                 span: float) -> list[tuple[Schedule, float, str]]:
    """Coordinate descent on the per-stage caps of the best greedy setting.

    One stage's cap at a time moves by one (within ``[1, limit]``); a move is kept when it
    shortens the makespan. Two sweeps over the stages. Returns the improving schedules.
    """
    found = []
    caps = list(caps)
    for _ in range(2):
        moved = False
        for s in range(costs.s):
            for delta in (-1, 1):
                trial = caps.copy()
                trial[s] += delta
                if not 1 <= trial[s] <= limits[s]:
                    continue
                sched, t_span = _greedy(costs, tuple(trial), rules)
                if t_span < span * (1 - 1e-12):
                    caps, span, moved = trial, t_span, True
                    found.append((sched, t_span, f"{rules} caps={tuple(caps)}"))
        if not moved:
            break
    return found


def capped_zero_bubble(num_stages: int, num_microbatches: int, warmup: Sequence[int]) -> Schedule:
    """ZB-H2's shape with per-stage warm-up forwards ``w_s`` (made non-increasing along the
    pipeline and at least 1, which keeps it deadlock-free: a stage never waits for more
    forwards than the one before it sends before its first ``I``): ``w_s`` forwards, then
    ``I_k, W_k, F_{w_s+k}`` cycles, then ``I, W`` to drain. Stage ``s`` holds ``w_s`` microbatches."""
    m, out, prev = num_microbatches, [], num_microbatches
    for s in range(num_stages):
        w = max(1, min(warmup[s], m, prev))
        prev = w
        row = [Action(s, K.F, k) for k in range(w)]
        for k in range(m - w):
            row += [Action(s, K.I, k), Action(s, K.W, k), Action(s, K.F, w + k)]
        for k in range(m - w, m):
            row += [Action(s, K.I, k), Action(s, K.W, k)]
        out.append(tuple(row))
    return tuple(out)


def _template(name: str, num_stages: int, num_microbatches: int, warmup: Sequence[int] = ()) -> Schedule:
    if name == "zb-capped":
        return capped_zero_bubble(num_stages, num_microbatches, warmup)
    if name.endswith("-split"):
        return split_backward(BUILDERS[name.removesuffix("-split")](num_stages, num_microbatches))
    return BUILDERS[name](num_stages, num_microbatches)


def _costs(m: int, f: Sequence[float], i: Sequence[float], w: Sequence[float],
           cf: Sequence[LinkCost], cb: Sequence[LinkCost]) -> _Costs:
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ScheduleError(f"num_microbatches must be an integer >= 1, got {m!r}")
    n = len(f) if not isinstance(f, int | float) else 0
    if n < 1:
        raise ScheduleError(f"forward_s must be a non-empty per-stage sequence, got {f!r}")
    fs, is_, ws = per_stage("forward_s", f, n), per_stage("input_grad_s", i, n), per_stage("weight_grad_s", w, n)
    for name, values in (("forward_s", fs), ("input_grad_s", is_)):
        for s, v in enumerate(values):
            # Positive F and I keep every lower bound on a future arrival strictly ahead of
            # the producer's clock, which is what makes the event loop advance.
            if v <= 0:
                raise ScheduleError(f"{name}[{s}] must be > 0 for the compact builder, got {v!r}")
    return _Costs(fs, is_, ws, per_boundary("comm_forward", cf, n - 1), per_boundary("comm_backward", cb, n - 1), m)


def _limits(memory_limit: int | Sequence[int] | None, n: int, m: int) -> tuple[int, ...]:
    if memory_limit is None:
        return (m,) * n
    values = (memory_limit,) * n if isinstance(memory_limit, int) else tuple(memory_limit)
    if len(values) != n:
        raise ScheduleError(f"memory_limit: need {n} per-stage values, got {len(values)}")
    for s, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ScheduleError(f"memory_limit[{s}] (stage {s}) must be an integer >= 1 microbatch in flight, got {v!r}")
    return tuple(min(v, m) for v in values)


def in_flight_need(costs: _Costs) -> tuple[int, ...]:
    """Per stage, the microbatches in flight that keep the pipeline at its bottleneck rate.

    Little's law: a microbatch is held on stage ``s`` for its round trip (forwards and
    transfers down to the last stage, input gradients and transfers back) plus ``I + W``
    on ``s``; one microbatch leaves per bottleneck cycle (the slowest stage's ``F+I+W`` or
    the slowest link's serialisation), so ``ceil(hold / cycle)`` keep it busy.
    """
    n = costs.s
    cycle = max(max(a + b + c for a, b, c in zip(costs.f, costs.i, costs.w, strict=True)),
                max((ser for _, ser in costs.cf + costs.cb), default=0.0))
    out = []
    for s in range(n):
        hold = sum(costs.f[s:]) + sum(costs.i[s:]) + costs.w[s]
        hold += sum(lat + ser for lat, ser in costs.cf[s:]) + sum(lat + ser for lat, ser in costs.cb[s:])
        out.append(max(1, math.ceil(hold / cycle - 1e-9)))
    return tuple(out)


def _caps(kind: str, limits: tuple[int, ...], need: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "limit":
        return limits
    extra = 1 if kind == "need+1" else 0
    return tuple(min(lim, n + extra) for lim, n in zip(limits, need, strict=True))


def _greedy(costs: _Costs, caps: tuple[int, ...], rules: Rules) -> tuple[Schedule, float]:
    """Event-driven list scheduling (module docstring, step 1); returns (schedule, makespan).

    Every stage keeps ``free`` (when its last chosen action ends, the dry-run time) and
    ``clock`` (when it decides next, >= free). The stage with the smallest clock decides, so
    every other stage will only start actions at or after this clock: deliveries not yet
    known arrive later than the lower bounds used here.
    """
    n, m = costs.s, costs.m
    f, i, w = costs.f, costs.i, costs.w
    KF, KI, KW = K.F, K.I, K.W  # noqa: N806 (enum members looked up once: class attribute access is slow)
    pop, push = heapq.heappop, heapq.heappush
    nf, ni, nw = [0] * n, [0] * n, [0] * n
    free, clock = [0.0] * n, [0.0] * n
    arr_f: list[list[float | None]] = [[0.0] * m if s == 0 else [None] * m for s in range(n)]
    arr_b: list[list[float | None]] = [[None] * m for _ in range(n)]
    link_f, link_b = [0.0] * (n - 1), [0.0] * (n - 1)
    rows: list[list[Action]] = [[] for _ in range(n)]
    heap = [(0.0, s) for s in range(n)]
    while heap:
        t, s = pop(heap)
        can_f = nf[s] < m and nf[s] - nw[s] < caps[s]
        can_i = ni[s] < nf[s]
        can_w = nw[s] < ni[s]
        if not (can_f or can_i or can_w):
            continue  # finished: 3M actions chosen
        r_f = arr_f[s][nf[s]] if can_f else None
        r_i = (0.0 if s == n - 1 else arr_b[s][ni[s]]) if can_i else None
        ready_f = r_f is not None and r_f <= t
        ready_i = r_i is not None and r_i <= t
        if ready_f and ready_i:
            q = rules.feed_downstream
            feed = q is None or (s < n - 1 and nf[s] - nf[s + 1] < q)
            kind = KF if feed else KI
        elif ready_i:
            kind = KI
        elif ready_f:
            kind = KF
        else:
            nxt = math.inf
            floor = None  # [Note: no one acts before the first known event]
            if can_f:
                if r_f is None:
                    floor = _first_event(costs, caps, nf, ni, nw, arr_f, arr_b, clock)
                    nxt = max(clock[s - 1], floor) + f[s - 1] + sum(costs.cf[s - 1])
                else:
                    nxt = r_f
            if can_i:
                if r_i is None:
                    if floor is None:
                        floor = _first_event(costs, caps, nf, ni, nw, arr_f, arr_b, clock)
                    nxt = min(nxt, max(clock[s + 1], floor) + i[s + 1] + sum(costs.cb[s]))
                else:
                    nxt = min(nxt, r_i)
            slack = rules.w_slack
            if can_w and (slack is None or math.isinf(nxt) or t + w[s] <= nxt + slack * w[s]):
                kind = KW
            else:
                clock[s] = nxt
                push(heap, (nxt, s))
                continue
        if kind is KF:
            mb, ready = nf[s], r_f
            nf[s] += 1
        elif kind is KI:
            mb, ready = ni[s], r_i
            ni[s] += 1
        else:
            mb, ready = nw[s], 0.0
            nw[s] += 1
        start = max(free[s], ready)  # type: ignore[type-var]
        end = start + (f[s] if kind is KF else i[s] if kind is KI else w[s])
        free[s] = end
        clock[s] = max(t, end)
        rows[s].append(make_action(s, kind, mb))
        if kind is KF and s < n - 1:
            lat, ser = costs.cf[s]
            begin = max(end, link_f[s])
            link_f[s] = begin + ser
            arr_f[s + 1][mb] = begin + ser + lat
        elif kind is KI and s > 0:
            lat, ser = costs.cb[s - 1]
            begin = max(end, link_b[s - 1])
            link_b[s - 1] = begin + ser
            arr_b[s - 1][mb] = begin + ser + lat
        push(heap, (clock[s], s))
    return tuple(tuple(r) for r in rows), max(free)


# [Note: no one acts before the first known event]
# A waiting stage bounds a delivery not yet known by its neighbour's clock plus the neighbour's
# pass and the link. When stages wait on each other (stage 0 at its in-flight cap waits for a
# backward from stage 1, which waits for stage 0's next forward or a backward from further on),
# those bounds only lift each other by one pass at a time; behind a link whose transfer takes
# 1,000 s of 5 ms passes that was ~350,000 turns of the loop per greedy run (planning a cluster
# with a 10 kbit/s link took 80 s). Nothing can be sent before some stage acts, and no stage
# acts before the first event known now (a delivery it may use, or a W it may run): the
# neighbour's clock is lifted to that time first. Plans whose stages never wait on one another
# like this are unchanged (the golden plans are the same bit for bit).


def _first_event(costs: _Costs, caps: tuple[int, ...], nf: list[int], ni: list[int], nw: list[int],
                 arr_f: list[list[float | None]], arr_b: list[list[float | None]], clock: list[float]) -> float:
    """The earliest time any stage can act on what is known now ([Note: no one acts before the
    first known event]).

    A stage can act at its clock if a ``W`` is open to it, else at the first of its known
    deliveries it may use (at or after its clock); a stage with neither can act only after
    another stage has acted.
    """
    n, m, first = costs.s, costs.m, math.inf
    for q in range(n):
        if nw[q] < ni[q]:
            first = min(first, clock[q])
            continue
        if nf[q] < m and nf[q] - nw[q] < caps[q] and arr_f[q][nf[q]] is not None:
            first = min(first, max(clock[q], arr_f[q][nf[q]]))  # type: ignore[type-var]
        if ni[q] < nf[q]:
            r = 0.0 if q == n - 1 else arr_b[q][ni[q]]
            if r is not None:
                first = min(first, max(clock[q], r))
    return first
