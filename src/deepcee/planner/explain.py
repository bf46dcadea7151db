"""The explanation of a plan: why these stages and devices, what was left out and what it costs.

Torch-free. :func:`explain` writes the lines of :attr:`~deepcee.planner.search.PlanResult.explanation`:
the grouping, the choice with its simulated and estimated time, each stage's layers, devices and
costs, the bottleneck by both models, the nearest stage counts, and for every island or slower
group left out the best plan that adds it back (scored now if the search never built one).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from deepcee.plan import Plan
from deepcee.planner.cost_model import AnalyticCostModel
from deepcee.planner.grouping import distance_s
from deepcee.planner.steps import Candidate, SearchState, rank_key
from deepcee.units import fmt_rate

_INF = math.inf


def explain(search: SearchState, best: Candidate, cands: list[Candidate]) -> list[str]:
    """The explanation of ``best`` among ``cands`` (see the module docstring)."""
    plan, cluster = best.plan, search.cluster
    est = best.simulated or best.estimate
    out = [f"grouping: {line}" for line in search.grouping.explain()]
    out.append(f"chose {plan.num_stages} stage(s), microbatch {plan.microbatch_size} x {plan.num_microbatches}, "
               f"schedule {plan.schedule}, sync {plan.sync}: {est.iteration_s:.4g} s per iteration "
               f"({est.samples_per_s:.4g} samples/s, {est.source}; cost model {best.estimate.iteration_s:.4g} s)")
    cost = AnalyticCostModel().breakdown(plan, cluster, search.model)
    for s, st in enumerate(plan.stages):
        isl = sorted({search.grouping.island_of(d) for d in st.devices})
        out.append(f"stage {s}: layers {st.layer_start}-{st.layer_stop - 1} on {len(st.devices)} device(s) "
                   f"in {'+'.join(isl)} ({st.devices[0]}{'...' if len(st.devices) > 1 else ''}), shares "
                   f"{list(st.shares)}; F+I+W {1e3 * (cost.forward_s[s] + cost.input_grad_s[s] + cost.weight_grad_s[s]):.4g} ms "
                   f"per microbatch, all-reduce {1e3 * cost.allreduce_s[s]:.4g} ms")
    out.append(f"bottleneck (cost model): {cost.bottleneck}")
    if best.simulated is not None:
        out.append(f"bottleneck (simulator): {best.simulated.bottleneck}")
    by_stages: dict[int, Candidate] = {}
    for c in cands:
        by_stages.setdefault(c.plan.num_stages, c)
    fewer = [s for s in by_stages if s < plan.num_stages]
    more = [s for s in by_stages if s > plan.num_stages]
    near = ([max(fewer)] if fewer else []) + ([min(more)] if more else [])
    alt = [f"{s} stage(s): {by_stages[s].estimate.iteration_s:.4g} s ({_pct(by_stages[s], best)})" for s in near]
    if alt:
        out.append(f"why {plan.num_stages} stage(s): best cost-model estimate with " + "; ".join(alt))
    out += _left_out(search, best, cands)
    out += [f"note: {n}" for n in search.notes]
    return out


def _pct(c: Candidate, best: Candidate) -> str:
    return f"{100 * (c.estimate.iteration_s / best.estimate.iteration_s - 1):+.1f}%"


def _best_adding(search: SearchState, plan: Plan, missing: list[str], cands: list[Candidate]) -> Candidate | None:
    """The best plan using every chosen device and some of ``missing``: among those scored, and
    the three best such configurations of step 1 (scored now with one schedule)."""
    chosen, extra = set(plan.devices), set(missing)
    def adds(devs: Iterable[str]) -> bool:
        devs = set(devs)
        return chosen <= devs and bool(devs & extra)
    found = [c for c in cands if adds(c.plan.devices)][:1]
    # layouts the lower bound pruned never got a split: give the first few one now, unpruned
    saved, search.best_closed_form = search.best_closed_form, _INF
    for lay in [x for x in search.layouts_seen.values() if adds(x.devices)][:8]:
        search.evaluate_layout(lay)
    search.best_closed_form = saved
    configs = [cfg for cfg in sorted(search.configs.values(), key=lambda c: c.key) if adds(cfg.layout.devices)]
    for cfg in configs[:3]:  # the closed form ranks configurations roughly: score a few
        found += search.plans_for(cfg, full=False)
    return min(found, key=rank_key, default=None)


def _left_out(search: SearchState, best: Candidate, cands: list[Candidate]) -> list[str]:
    plan, cluster, g = best.plan, search.cluster, search.grouping
    used = set(plan.devices)
    out = []
    for isl in g.islands:
        missing = [d for d in isl.devices if d not in used]
        if not missing:
            continue
        what = (f"island {isl.name}" if len(missing) == len(isl.devices)
                else f"{len(missing)} slower device(s) of island {isl.name}")
        line = f"left out {what} ({len(missing)} device(s): {', '.join(missing[:4])}{'...' if len(missing) > 4 else ''})"
        with_it = _best_adding(search, plan, missing, cands)
        if with_it is not None:
            line += (f": the best plan that adds them to the chosen devices estimates "
                     f"{with_it.estimate.iteration_s:.4g} s vs {best.estimate.iteration_s:.4g} s without "
                     f"({_pct(with_it, best)})")
        else:
            line += ": no plan adding them fits memory"
        if plan.devices and len(missing) == len(isl.devices):
            near = min(plan.devices, key=lambda d: distance_s(cluster.link(d, missing[0])))
            link = cluster.link(near, missing[0])
            line += (f"; its best link to the plan, {near}->{missing[0]}: {fmt_rate(link.bandwidth_bytes_per_s)}, "
                     f"{link.latency_s * 1e3:.3g} ms")
        else:
            slow = min(missing, key=cluster.effective_flops_per_s)
            fast = max(plan.devices, key=cluster.effective_flops_per_s)
            line += (f"; {slow} runs at {cluster.effective_flops_per_s(slow) / 1e12:.3g} TFLOP/s vs "
                     f"{cluster.effective_flops_per_s(fast) / 1e12:.3g} for {fast}")
        out.append(line)
    return out
