"""The plans ``deepcee validate`` and the fidelity benchmark run (torch-free).

:func:`validation_plans`: :func:`default_plans` first where they apply (``local-small``'s
devices, a 6-layer model: every schedule, 2-4 stages across the slow links, uneven shares,
3-8 microbatches), then :func:`generated_plans` for any cluster and model. Compact plans get
their actions from the profile's stage times and the cluster's boundary links
(:func:`compact_version`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from deepcee.cluster import Cluster
from deepcee.errors import DeepceeError, ProfileError
from deepcee.plan import SCHEDULES, Plan, StagePlan
from deepcee.profile import ModelProfile
from deepcee.schedule.compact import build_compact
from deepcee.schedule.ir import format_schedule
from deepcee.simulator.engine import simulate

log = logging.getLogger(__name__)


def make_plan(name: str, model: str, cluster: str, schedule: str, num_microbatches: int,
              stages: Sequence[tuple[int, int, Sequence[str], Sequence[int]]]) -> Plan:
    """A plan from ``(layer_start, layer_stop, devices, shares)`` per stage (``compact``: see
    :func:`compact_version`, which needs the cluster and profile)."""
    sts = tuple(StagePlan(layer_start=a, layer_stop=b, devices=tuple(d), shares=tuple(s)) for a, b, d, s in stages)
    mb = sts[0].microbatch_size
    return Plan(system=name, cluster=cluster, model=model, global_batch=mb * num_microbatches, microbatch_size=mb,
                num_microbatches=num_microbatches, stages=sts, schedule=schedule)


def compact_version(plan: Plan, cluster: Cluster, profile: ModelProfile) -> Plan:
    """``plan`` with a compact schedule built from its stage times and boundary links."""
    f, i, w = [], [], []
    for st in plan.stages:
        for pas, out in (("F", f), ("I", i), ("W", w)):
            out.append(max(profile.time_s(st.layer_start, st.layer_stop, pas, share, cluster.kind_of(d),
                                          cluster.device(d).slowdown)
                           for d, share in zip(st.devices, st.shares, strict=True)))
    cf, cb = [], []
    for a, b in zip(plan.stages, plan.stages[1:], strict=False):
        nbytes = plan.microbatch_size * profile.boundary_bytes(a.layer_stop)
        for out, pairs in ((cf, [(x, y) for x in a.devices for y in b.devices]),
                           (cb, [(y, x) for x in a.devices for y in b.devices])):
            links = [cluster.link(s, d) for s, d in pairs]
            out.append((max(lk.latency_s for lk in links), max(nbytes / lk.bandwidth_bytes_per_s for lk in links)))
    sched = build_compact(num_microbatches=plan.num_microbatches, forward_s=f, input_grad_s=i, weight_grad_s=w,
                          comm_forward=cf, comm_backward=cb)
    return plan.replace(schedule="compact", actions=format_schedule(sched))


def default_plans(cluster: Cluster, profile: ModelProfile) -> list[Plan]:
    """Ten plans on ``local-small``-shaped clusters (2 cloud, 2 edge of which one slow, 1 end device):
    every schedule, 2-4 stages, uneven shares, microbatch counts 3-8."""
    c0, c1, e0, e1, n0 = ("cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0")
    missing = [d for d in (c0, c1, e0, e1, n0) if d not in cluster.device_names]
    if missing or profile.num_layers != 6:
        raise ProfileError(f"default plans need local-small's devices and a 6-layer model; missing {missing}, "
                           f"model {profile.name!r} has {profile.num_layers} layers")
    specs = [
        ("gpipe-2", "gpipe", 4, [(0, 3, [c0], [4]), (3, 6, [e0], [4])]),
        ("1f1b-3-dp", "1f1b", 4, [(0, 2, [c0, c1], [2, 2]), (2, 4, [e0], [4]), (4, 6, [n0], [4])]),
        ("zbh1-2", "zb-h1", 6, [(0, 3, [c0], [2]), (3, 6, [n0], [2])]),
        ("zbh2-4", "zb-h2", 4, [(0, 2, [c0], [2]), (2, 3, [c1], [2]), (3, 5, [e0], [2]), (5, 6, [n0], [2])]),
        ("compact-2-uneven", "compact", 3, [(0, 3, [c0, c1], [3, 1]), (3, 6, [e0, e1], [3, 1])]),
        ("gpipe-3-uneven", "gpipe", 3, [(0, 2, [c0], [3]), (2, 4, [e0, e1], [2, 1]), (4, 6, [n0], [3])]),
        ("1f1b-2-slow", "1f1b", 8, [(0, 4, [c0, c1], [1, 1]), (4, 6, [e1], [2])]),
        ("zbh1-3", "zb-h1", 4, [(0, 2, [e0], [4]), (2, 4, [c0], [4]), (4, 6, [c1], [4])]),
        ("compact-3", "compact", 6, [(0, 2, [c0], [2]), (2, 4, [e0], [2]), (4, 6, [n0], [2])]),
        ("zbh2-2-dp", "zb-h2", 4, [(0, 3, [e0, e1], [2, 1]), (3, 6, [c0, c1], [1, 2])]),
    ]
    plans = []
    for name, sched, m, stages in specs:
        plan = make_plan(name, profile.name, cluster.name, "gpipe" if sched == "compact" else sched, m, stages)
        plans.append(compact_version(plan, cluster, profile) if sched == "compact" else plan)
    return plans


def generated_plans(cluster: Cluster, profile: ModelProfile, count: int, *,
                    taken: Sequence[Plan] = ()) -> list[Plan]:
    """``count`` plans for any cluster and model, each different from the others and from ``taken``.

    Plan ``k`` takes the ``k``-th schedule in turn (``SCHEDULES``), 2, 3 or 4 stages in turn (as
    many as the layers and devices allow; 1 when there is one), one device per stage taken
    across islands in turn (so stages meet over the links between them) starting at device ``k``,
    every other plan a first stage of two devices of one island with uneven shares, every third
    plan an uneven layer split, microbatch sizes 2-4 and 3-8 microbatches (at least one per
    stage). Plans the simulator rejects are skipped.
    """
    order = _across_islands(cluster)
    pairs = [devs[:2] for devs in cluster.island_devices().values() if len(devs) >= 2]
    stage_counts = [n for n in (2, 3, 4) if n <= min(profile.num_layers, len(order))] or [1]
    seen = {_key(p) for p in taken}
    names = {p.system for p in taken}
    plans: list[Plan] = []
    for k in range(max(50, 20 * count)):
        if len(plans) >= count:
            break
        n = stage_counts[k % len(stage_counts)]
        mb, m = (2, 3, 4)[k % 3], max(n, (4, 6, 3, 8)[k % 4])
        sched = SCHEDULES[k % len(SCHEDULES)]
        devices = [[order[(k + j) % len(order)]] for j in range(n)]
        shares = [[mb] for _ in range(n)]
        dp = k % 2 == 1 and pairs and len(order) > n
        if dp:
            pair = list(pairs[k // 2 % len(pairs)])
            rest = [d for d in order[k % len(order):] + order[:k % len(order)] if d not in pair]
            devices = [pair] + [[d] for d in rest[:n - 1]]
            shares = [[mb - max(1, mb // 3), max(1, mb // 3)]] + [[mb] for _ in range(n - 1)]
        cuts = [profile.num_layers * j // n for j in range(n + 1)]
        uneven = k % 3 == 2 and n > 1 and cuts[1] + 1 < cuts[2]
        if uneven:
            cuts[1] += 1
        name = f"{sched}-{n}{'-dp' if dp else ''}{'-uneven' if uneven else ''}"
        name = name if name not in names else f"{name}-{k}"
        stages = [(cuts[j], cuts[j + 1], devices[j], shares[j]) for j in range(n)]
        try:
            plan = make_plan(name, profile.name, cluster.name, "gpipe" if sched == "compact" else sched, m, stages)
            plan = compact_version(plan, cluster, profile) if sched == "compact" else plan
            simulate(plan, cluster, profile, record=False)
        except DeepceeError as exc:
            log.info("plan %s skipped: %s", name, exc)
            continue
        if _key(plan) not in seen:
            seen.add(_key(plan))
            names.add(name)
            plans.append(plan)
    if len(plans) < count:
        raise ProfileError(f"could build only {len(plans)} different plans of {count} for {profile.name} on "
                           f"{cluster.name} ({len(order)} devices, {profile.num_layers} layers)")
    return plans


def _across_islands(cluster: Cluster) -> list[str]:
    """Devices taking one from each island in turn."""
    lists = [list(v) for v in cluster.island_devices().values()]
    return [lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)]


def _key(plan: Plan) -> tuple:
    return (plan.schedule, plan.microbatch_size, plan.num_microbatches,
            tuple((s.layer_start, s.layer_stop, s.devices, s.shares) for s in plan.stages))


def validation_plans(cluster: Cluster, profile: ModelProfile, num_plans: int) -> list[Plan]:
    """``num_plans`` different plans: :func:`default_plans` first where they apply (``local-small``'s
    devices, a 6-layer model), then :func:`generated_plans`."""
    if num_plans < 1:
        raise ProfileError(f"num_plans must be >= 1, got {num_plans!r}")
    try:
        plans = default_plans(cluster, profile)[:num_plans]
    except ProfileError:
        plans = []
    return plans + generated_plans(cluster, profile, num_plans - len(plans), taken=plans)


def layout(plan: Plan) -> str:
    return " | ".join(f"[{s.layer_start},{s.layer_stop}) " + ",".join(f"{d}({n})" for d, n in
                                                                    zip(s.devices, s.shares, strict=True))
                      for s in plan.stages)
