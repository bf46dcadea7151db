"""The explanation of a plan: why these stages and devices, what was left out and what it costs.

Torch-free. :func:`explain` writes the lines of :attr:`~deepcee.planner.search.PlanResult.explanation`:
the grouping, the choice with its simulated and estimated time, each stage's layers, devices and
costs, the bottleneck by both models, how the island chains were searched, and the
counterfactuals.

[Note: counterfactuals]
Every alternative the explanation prints ("adding island X (N devices)", "leaving out island Y
(N devices used)", "using K pipeline stages instead of S") says what was changed and what the best
plan found under that change uses and gives. Each is a plan found by the same search under that
one constraint and scored by the simulator, like the chosen plan, and the percentage compares
the two simulated iteration times. The plans are kept in :attr:`~deepcee.planner.search.PlanResult.counterfactuals` (a test
re-simulates them). The constrained search: the chosen chain of islands with the island added
at every position (or removed), every layout and microbatch size of those chains by the
closed form (pruned by the layout lower bound against the best closed form that meets the
constraint, as the main search prunes), the best configurations through the in-flight-aware
split and the cost model, the best of them simulated (the main search's candidates that meet
the constraint compete with it, at their simulated figure where they have one: the answer is
never worse than a plan the search already had); for stage counts, the best scored candidate
with that many stages. Counterfactuals are simulated within ``confirm_max_work``;
those beyond it are not printed (a note says how many). When a counterfactual beats the plan,
it is taken and explained in turn; the second explanation reuses what the first computed (the
search state memoises layouts, sweeps, compact schedules and simulations), so it costs only
the constrained searches on chains not seen before.

[Note: counterfactual counts]
The constrained search laid its chains out with one granularity per chain (powers of two), so
"adding island X" was the best plan of X's uniform layouts, far from the chosen plan's own stage
counts. On WAN seed 118 of ``benchmarks/planner_at_scale.py`` the plan ran uk-south, eu-central,
af-south and sa-east in 9, 4, 7 and 6 stages (126.98 s, simulated) and said "adding island
me-central: +2.0%" (129.6 s); the independent reference's plan adds me-central's 4 devices as 2
stages there, with af-south and sa-east in 6 and 4 stages: 117.9 s. So where the count look runs
(clusters of at most ``polish_max_devices`` devices), each chain of an "adding" or "leaving out"
counterfactual also gets the count search of [Note: stage counts] in
:mod:`deepcee.planner.grains` (per microbatch size within 4 of the plan's, [Note: counts per size]
there), from the chosen plan's stage count per island, an added island with one stage per
device. On seed 118 "adding island me-central" then finds 121.28 s (me-central in 2 stages),
which is taken as the plan (the rescue above).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deepcee.plan import Plan
from deepcee.planner.grains import climb_counts, island_sets
from deepcee.planner.grouping import distance_s
from deepcee.planner.polish import segments_of
from deepcee.planner.space import Chain, chain_layouts
from deepcee.planner.steps import Candidate, SearchState, plan_key, rank_key
from deepcee.units import fmt_rate

_INF = math.inf
MAX_ADDED = 2
"""Left-out islands (nearest first) whose "adding" counterfactual is planned and simulated, and
used islands (least compute first) whose "leaving out" one is."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Counterfactual:
    """One alternative the explanation prints: a plan found under one constraint, simulated."""

    label: str
    """What was changed from the chosen plan, in words (``adding island b (2 devices)``,
    ``using 3 pipeline stages instead of 2``)."""
    plan: Plan
    """The plan, its estimate from the simulator."""
    change: float
    """Simulated iteration time over the chosen plan's, minus 1."""
    stages: int | None = None
    """For a stage-count counterfactual, the stage count it was constrained to (else ``None``)."""

    def line(self) -> str:
        """``<what was changed>: <what the best plan found then gives>``, both in plain words."""
        est = self.plan.estimate
        assert est is not None
        verdict = "slower" if self.change > 5e-4 else "faster" if self.change < -5e-4 else "about the same"
        return (f"{self.label}: the best plan found then uses {_count(len(self.plan.devices), 'device')} in "
                f"{_count(self.plan.num_stages, 'stage')} and takes {est.iteration_s:.4g} s per iteration "
                f"({est.samples_per_s:.4g} samples/s, simulated): {100 * self.change:+.1f}% time per iteration, "
                f"{verdict} than the chosen plan")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def chosen_chain(search: SearchState, plan: Plan) -> Chain:
    """The chain of islands (with groups kept) that ``plan``'s stages use, in pipeline order."""
    g, used = search.grouping, set(plan.devices)
    order: list[int] = []
    for st in plan.stages:
        for d in st.devices:
            i = next(k for k, isl in enumerate(g.islands) if d in isl.devices)
            if i not in order:
                order.append(i)
    out = []
    for i in order:
        groups = g.islands[i].groups
        kept = max(k + 1 for k, grp in enumerate(groups) if used & set(grp.devices))
        out.append((i, kept))
    return tuple(out)


class _Counterfactuals:
    """Finds and simulates the counterfactual plans of [Note: counterfactuals]."""

    def __init__(self, search: SearchState, best: Candidate, known: list[Candidate]) -> None:
        self.search, self.best = search, best
        self.known = known
        """The main search's candidates: a constrained search's answer is never worse than the
        best of these that meets its constraint."""
        self.work_left = search.options.confirm_max_work
        self.skipped = 0
        base = best.simulated or best.estimate
        self.base_s = base.iteration_s
        opts, n = search.options, best.plan.microbatch_size
        self.climb_counts = (opts.count_look and opts.count_budget > 0
                             and len(search.cluster.device_names) <= opts.polish_max_devices)
        """Whether the constrained searches climb stage counts ([Note: counterfactual counts])."""
        self.sizes = [x for x in search.sizes if n / 4 <= x <= 4 * n]
        """The microbatch sizes they climb at: within 4 of the chosen plan's, as the count look's."""

    def simulate(self, label: str, cand: Candidate | None, stages: int | None = None) -> Counterfactual | None:
        if cand is None:
            return None
        work = 6 * len(cand.plan.devices) * cand.plan.num_microbatches
        if work > self.work_left:
            self.skipped += 1
            return None
        if self.search.options.progress is not None:  # each one a search and a simulation
            self.search.options.progress(f"counterfactual: {label}", 0.0)
        self.work_left -= work
        est = self.search.confirm(cand.plan)
        if est.exceeds_memory(self.search.cluster.memory_bytes):
            return None
        return Counterfactual(label=label, plan=cand.plan.replace(estimate=est), change=est.iteration_s / self.base_s - 1,
                              stages=stages)

    def best_on_chains(self, chains: list[Chain], wanted: Callable[[frozenset[str]], bool],
                       counts: Sequence[tuple[int, ...] | None] = ()) -> Candidate | None:
        """The constrained search: lay out ``chains`` (a layout whose lower bound cannot beat the
        best closed form meeting the constraint is skipped, as in the main search), sweep and
        score the best configurations whose devices satisfy ``wanted``. ``counts``: per chain,
        the chosen plan's stage counts per island under the change, where known; the stage-count
        search climbs from them ([Note: counterfactual counts])."""
        s = self.search
        # pruned as the main search prunes, against the best closed form that meets the constraint
        incumbent = min((c.closed_form_s for c in s.configs.values() if wanted(c.layout.devices)), default=_INF)
        saved, s.best_closed_form = s.best_closed_form, incumbent
        try:
            for chain in chains:
                for lay in chain_layouts(s.grouping, chain, s.max_stages, s.pieces):
                    s.evaluate_layout(lay)
            if self.climb_counts:
                for chain, start in zip(chains, counts, strict=False):
                    if start is not None:
                        climb_counts(s, chain, [start], self.sizes, per_size=True)
        finally:
            s.best_closed_form = saved
        configs = sorted((c for c in s.configs.values() if wanted(c.layout.devices)), key=lambda c: c.key)
        for cfg in configs[:2]:
            s.sweep(cfg)
        configs = sorted((c for c in s.configs.values() if wanted(c.layout.devices)), key=lambda c: c.key)
        found = [c for cfg in configs[:4] for c in s.plans_for(cfg, full=False)]
        best = min(found, key=rank_key, default=None)
        if best is not None and best.plan.num_stages > 1 and "compact" in s.options.schedules:
            built = s.compact(best.plan.replace(schedule="zb-h1", actions=()), force=True)
            got = s.score(built) if built is not None else None
            if got is not None and rank_key(got) < rank_key(best):
                best = got
        if best is not None:  # its other syncs ([Note: sync variants] in deepcee.planner.steps)
            best = min([best, *s.sync_variants(best)], key=rank_key)
        # the main search's candidates that meet the constraint count too: without them "the best
        # plan found then" could be worse than a plan the search had scored (512 devices in 8
        # islands: adding the left-out island read 5.357 s beside a simulated 5.193 s plan with it)
        pool = ([best] if best is not None else []) + [c for c in self.known if wanted(frozenset(c.plan.devices))]
        return min(pool, key=lambda c: (self._value_s(c), rank_key(c)), default=None)

    def _value_s(self, c: Candidate) -> float:
        """``c``'s simulated iteration time where the search has simulated it, else the cost model's."""
        got = self.search.confirmed.get(plan_key(c.plan))
        return (got or c.simulated or c.estimate).iteration_s


def _island_counterfactuals(cf: _Counterfactuals, plan: Plan) -> list[Counterfactual]:
    s = cf.search
    g, chain = s.grouping, chosen_chain(s, plan)
    used = set(plan.devices)
    out = []
    # the left-out islands nearest the plan first (1 MB transfer time to its devices), at most MAX_ADDED
    near = sorted(range(len(g.islands)), key=lambda i: min(
        (distance_s(s.cluster.link(d, g.islands[i].devices[-1])) for d in plan.devices
         if d != g.islands[i].devices[-1]), default=0.0))
    added = 0
    for i in near:
        isl = g.islands[i]
        missing = frozenset(d for d in isl.devices if d not in used)
        if not missing or added >= MAX_ADDED:
            continue
        added += 1
        whole = len(missing) == len(isl.devices)
        rest = tuple(x for x in chain if x[0] != i)
        full = (i, len(isl.groups))
        chains = [rest[:k] + (full,) + rest[k:] for k in range(len(rest) + 1)] if whole else \
            [tuple(full if x[0] == i else x for x in chain)]
        # "slower" only where it is so: a node look's plan leaves out devices as fast as its own
        speed = s.cluster.effective_flops_per_s
        slower = not whole and max(map(speed, missing)) < min(speed(d) for d in isl.devices if d in used)
        label = (f"adding island {isl.name} ({_count(len(missing), 'device')})" if whole else
                 f"adding the {_count(len(missing), 'slower device' if slower else 'device')} of island "
                 f"{isl.name} left out")
        starts = [_counts_with(s, plan, ch) for ch in chains] if whole else []
        got = cf.simulate(label, cf.best_on_chains(chains, lambda devs, m=missing: bool(devs & m), starts))
        if got is not None:
            out.append(got)
    if len(chain) > 1 and s.options.allow_exclusion:
        # the used islands with the least compute first, at most MAX_ADDED
        weakest = sorted(range(len(chain)), key=lambda k: (sum(s.cluster.effective_flops_per_s(d)
                                                               for d in g.islands[chain[k][0]].devices), k))
        for k in sorted(weakest[:MAX_ADDED]):
            i = chain[k][0]
            isl = g.islands[i]
            devs = frozenset(isl.devices)
            rest = chain[:k] + chain[k + 1:]
            got = cf.simulate(f"leaving out island {isl.name} ({_count(len(devs & used), 'device')} used)",
                              cf.best_on_chains([rest], lambda d, x=devs: not (d & x), [_counts_with(s, plan, rest)]))
            if got is not None:
                out.append(got)
    return out


def _counts_with(search: SearchState, plan: Plan, chain: Chain) -> tuple[int, ...] | None:
    """``plan``'s stage count per island on ``chain`` (a chain of the plan's islands with one
    added or left out), an added island with one stage per device; ``None`` where a stage of the
    plan spans islands or the plan's count exceeds the island's kept devices ([Note:
    counterfactual counts])."""
    segs = segments_of(search, plan)
    if segs is None:
        return None
    had = {x.island: x.stages for x in segs}
    sets = island_sets(search, chain)
    out = tuple(had.get(i, len(devs)) for (i, _), devs in zip(chain, sets, strict=True))
    return out if all(1 <= c <= len(devs) for c, devs in zip(out, sets, strict=True)) else None


def _stage_counterfactuals(cf: _Counterfactuals, plan: Plan, cands: list[Candidate]) -> list[Counterfactual]:
    by_stages: dict[int, Candidate] = {}
    # by the simulator's figure where the search has one, like the island counterfactuals
    for c in sorted(cands, key=lambda c: (cf._value_s(c), rank_key(c))):
        by_stages.setdefault(c.plan.num_stages, c)
    fewer = [k for k in by_stages if k < plan.num_stages]
    more = [k for k in by_stages if k > plan.num_stages]
    near = ([max(fewer)] if fewer else []) + ([min(more)] if more else [])
    return [x for k in near if (x := cf.simulate(
        f"using {_count(k, 'pipeline stage')} instead of {plan.num_stages}", by_stages[k], stages=k)) is not None]


def explain(search: SearchState, best: Candidate, cands: list[Candidate]) -> tuple[list[str], list[Counterfactual]]:
    """The explanation of ``best`` among ``cands``, and its counterfactuals (module docstring)."""
    plan, cluster = best.plan, search.cluster
    est = best.simulated or best.estimate
    out = [f"grouping: {line}" for line in search.grouping.explain()]
    out.append(f"chose {plan.num_stages} stage(s), microbatch {plan.microbatch_size} x {plan.num_microbatches}, "
               f"schedule {plan.schedule}, sync {plan.sync}: {est.iteration_s:.4g} s per iteration "
               f"({est.samples_per_s:.4g} samples/s, {est.source}; cost model {best.estimate.iteration_s:.4g} s)")
    cost = search.analytic().breakdown(plan, cluster, search.model)
    for s, st in enumerate(plan.stages):
        isl = sorted({search.grouping.island_of(d) for d in st.devices})
        out.append(f"stage {s}: layers {st.layer_start}-{st.layer_stop - 1} on {len(st.devices)} device(s) "
                   f"in {'+'.join(isl)} ({st.devices[0]}{'...' if len(st.devices) > 1 else ''}), shares "
                   f"{_shares(st.shares)}{', recomputes activations' if st.recompute else ''}; F+I+W "
                   f"{1e3 * (cost.forward_s[s] + cost.input_grad_s[s] + cost.weight_grad_s[s]):.4g} ms per "
                   f"microbatch, all-reduce {1e3 * cost.allreduce_s[s]:.4g} ms; holds {cost.in_flight[s]} "
                   f"microbatch(es)")
    out.append(f"bottleneck (cost model): {cost.bottleneck}")
    if best.simulated is not None:
        out.append(f"bottleneck (simulator): {best.simulated.bottleneck}")
    out += _chain_lines(search, est.iteration_s)
    cf = _Counterfactuals(search, best, cands)
    counter: list[Counterfactual] = []
    if search.options.explain_counterfactuals and best.simulated is not None:
        counter = _island_counterfactuals(cf, plan) + _stage_counterfactuals(cf, plan, cands)
    out += [c.line() for c in counter]
    out += _left_out_links(search, plan)
    if cf.skipped:
        out.append(f"note: {cf.skipped} counterfactual plan(s) not printed: simulating them exceeds "
                   f"confirm_max_work {search.options.confirm_max_work}")
    out += [f"note: {n}" for n in search.notes]
    return out, counter


def _shares(shares: tuple[int, ...]) -> str:
    """A stage's per-device samples: the list up to 8 devices, above that runs of equal shares
    (``[1 x 64]``: a 64-device stage printed 64 ones)."""
    if len(shares) <= 8:
        return str(list(shares))
    runs = [(v, len(list(g))) for v, g in itertools.groupby(shares)]
    return "[" + ", ".join(f"{v} x {k}" if k > 1 else str(v) for v, k in runs) + "]"


def chain_gap(search: SearchState, best_s: float) -> float:
    """Proven gap of the chain search against the simulated best ``best_s`` ([Note: chain search])."""
    r = search.chain_result
    if r is None or not math.isfinite(r.open_bound) or r.open_bound <= 0:
        return 0.0
    return max(0.0, best_s / r.open_bound - 1.0)


def _chain_lines(search: SearchState, best_s: float) -> list[str]:
    r = search.chain_result
    if r is None:
        return []
    if not r.exact:
        how = (f"ordered subsets of {search.options.exhaustive_islands} merged island clusters, then local search "
               f"on single islands ({search.chain_moves} more chains)")
    elif search.chain_moves:
        how = f"every ordered subset of islands, then local search over the devices used ({search.chain_moves} more chains)"
    else:
        how = "every ordered subset of islands"
    if r.exact and search.chain_walk:
        how += f", then a walk over islands and orders ({search.chain_walk} more chains)"
    gap = chain_gap(search, best_s)
    budget = f" (stopped at chain_budget {search.options.chain_budget})" if r.gap > 0 else ""
    proof = ("no chain left unevaluated can beat the simulated best" if gap == 0 else
             f"a chain left unevaluated{budget} is at most {100 * gap:.1f}% faster than the simulated best "
             f"(proven gap: its lower bound)")
    return [f"island chains: {how}; {r.evaluated} evaluated in full of {r.considered} bounded; {proof}"]


def _left_out_links(search: SearchState, plan: Plan) -> list[str]:
    """For each island left out, its best link to the plan (the number the choice turned on)."""
    cluster, used, out = search.cluster, set(plan.devices), []
    for isl in search.grouping.islands:
        missing = [d for d in isl.devices if d not in used]
        if not missing or len(missing) != len(isl.devices) or not plan.devices:
            continue
        near = min(plan.devices, key=lambda d: distance_s(cluster.link(d, missing[0])))
        link = cluster.link(near, missing[0])
        out.append(f"left out island {isl.name} ({len(missing)} device(s)); its best link to the plan, "
                   f"{near}->{missing[0]}: {fmt_rate(link.bandwidth_bytes_per_s)}, {link.latency_s * 1e3:.3g} ms")
    return out
