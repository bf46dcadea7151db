"""The polish of ``benchmarks/wan_reference.py`` (the reference of ``planner_at_scale``): every
neighbour it tries is a valid plan of the plan space (a compact plan's neighbours get their own
compact schedule), and the plan it returns is simulated at the figure it reports."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import sys
from pathlib import Path

import pytest
from conftest import random_cluster, toy_model

from deepcee.planner.options import PlannerOptions
from deepcee.planner.search import plan_training
from deepcee.simulator import simulate


def _module():
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(root))  # wan_reference is imported by name by planner_at_scale too
    try:
        spec = importlib.util.spec_from_file_location("wan_reference", root / "wan_reference.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("wan_reference", mod)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(root))


def _instance(seed: int):
    rng = random.Random(seed)
    c = random_cluster(rng, name=f"r{seed}")
    m = toy_model(8, params=20_000_000)
    return c, m


@pytest.mark.parametrize("seed", [1, 4])
def test_neighbours_of_a_compact_plan_are_valid_plans_with_their_own_schedules(seed):
    ref_mod = _module()
    c, m = _instance(seed)
    r = plan_training(c, m, 32, options=PlannerOptions(schedules=("compact",), confirm_top=1))
    plan = r.plan
    assert plan.schedule == "compact" or plan.num_stages == 1
    ref = ref_mod._Reference(c, m, plan.global_batch, 1e9)
    labels = []
    for label, trial in ref_mod._neighbours(ref, plan):
        labels.append(label)
        assert trial.global_batch == plan.global_batch
        assert trial.num_microbatches * trial.microbatch_size == plan.global_batch
        if trial.schedule == "compact":
            # its actions are the builder's for its own stages and microbatches
            rebuilt = ref_mod._compact(trial.replace(schedule="zb-h1", actions=()), c, m)
            assert rebuilt is not None and rebuilt.actions == trial.actions
    assert any(lab.startswith("schedule") for lab in labels)
    if plan.num_stages > 1:
        assert any(lab.startswith("boundary") for lab in labels)


def test_polish_from_a_worse_plan_improves_it_and_reports_the_simulated_figure():
    ref_mod = _module()
    c, m = _instance(4)
    r = plan_training(c, m, 32, options=PlannerOptions(schedules=("zb-h1", "1f1b"), confirm_top=1))
    plan = r.plan
    if plan.num_stages < 2:
        pytest.skip("the instance's plan has one stage")
    # every boundary pushed to the end: the first stage holds all but one layer per later stage
    L, S = plan.num_layers, plan.num_stages
    cuts = [0] + [L - S + k for k in range(1, S)] + [L]
    worse = plan.replace(stages=tuple(dataclasses.replace(st, layer_start=cuts[k], layer_stop=cuts[k + 1])
                                      for k, st in enumerate(plan.stages)), estimate=None)
    start_s = simulate(worse, c, m, record=False).iteration_s
    got = ref_mod.polish(worse, c, m, simulations=40)
    assert got["moves"], "a plan with every boundary at the end has an improving neighbour"
    assert got["iteration_s"] < start_s
    assert got["iteration_s"] == pytest.approx(simulate(got["plan"], c, m, record=False).iteration_s, rel=1e-9)
    assert [s for _, s in got["moves"]] == sorted((s for _, s in got["moves"]), reverse=True)
    assert got["simulated"] <= 40 + 1


# ----------------------------------------------------------------- the global search (version 2)


def test_the_chain_bounds_are_those_of_every_permutation():
    """The chains are enumerated by a depth-first walk with running sums: the same chains and
    bounds, in the same order, as over ``itertools.permutations`` (version 1's enumeration)."""
    import itertools
    import math

    import numpy as np

    ref_mod = _module()
    for seed in (2, 5, 9):
        c, m = _instance(seed)
        ref = ref_mod._Reference(c, m, 64, 1e9)
        n = len(ref.islands)
        speed = [ref._speed(devs) for devs in ref.islands]
        mem = [sum(c.memory_bytes(d) for d in devs) for devs in ref.islands]
        state = m.parameter_count * m.state_bytes_per_parameter
        hop, lat = np.zeros((n, n)), np.zeros((n, n))
        for i, j in itertools.permutations(range(n), 2):
            hop[i, j] = 64 * ref.least_bytes / ref._pipes(ref.islands[i], ref.islands[j])
            lat[i, j] = c.link(ref.islands[i][0], ref.islands[j][0]).latency_s
        want = []
        for k in range(1, n + 1):
            for order in itertools.permutations(range(n), k):
                if sum(mem[i] for i in order) >= state:
                    worst = max((max(hop[a, b] + lat[a, b], hop[b, a] + lat[b, a])
                                 for a, b in itertools.pairwise(order)), default=0.0)
                    trip = sum(lat[a, b] + lat[b, a] for a, b in itertools.pairwise(order))
                    want.append((max(64 / sum(speed[i] for i in order), worst, trip), order))
        want.sort()
        got = ref.chain_bounds()
        assert [o for _, o in got] == [o for _, o in want]
        assert all(math.isclose(a, b, rel_tol=1e-12) for (a, _), (b, _) in zip(got, want, strict=True))


def test_chain_moves_are_the_chains_one_edit_away():
    ref_mod = _module()
    start = (0, 2, 1)
    moves = list(ref_mod._chain_moves(start, 5))
    for o in moves:
        assert len(set(o)) == len(o) and set(o) <= set(range(5)) and o
    # swaps, moves of one island, replacements, drops and additions are all there
    for want in [(1, 2, 0), (2, 0, 1), (0, 2, 4), (0, 1), (3, 0, 2, 1), (0, 2, 1, 4)]:
        assert want in moves, want
    # every chain they give differs from the start by one swap, move, replace, drop or add
    assert all(abs(len(o) - len(start)) <= 1 for o in moves)
    assert len(set(moves) - {start}) == len(set(moves)) - (start in moves)


def test_the_global_search_is_deterministic_and_reports_simulated_plans_that_fit():
    import math

    ref_mod = _module()
    for seed in (1, 4):
        c, m = _instance(seed)
        first = ref_mod.reference_search(c, m, 32, budget_s=60.0)
        again = ref_mod.reference_search(c, m, 32, budget_s=60.0)
        assert first["plan"] is not None and math.isfinite(first["iteration_s"])
        # a small instance: every chain screened and laid out and the whole pool simulated
        assert first["later_left"] == 0 and first["cpu_s"] < 60.0
        assert first["plan"] == again["plan"] and first["iteration_s"] == again["iteration_s"]
        sim = simulate(first["plan"], c, m, record=False)
        assert first["iteration_s"] == pytest.approx(sim.iteration_s, rel=1e-9)
        assert all(v <= c.memory_bytes(d) for d, v in sim.peak_memory_bytes.items())


def test_a_plan_over_memory_is_repaired_by_recomputing_its_stages():
    """``fitted`` turns recomputation on for the stages of the devices over their memory until
    the plan fits; the result is the simulated time of the repaired plan."""
    import math

    ref_mod = _module()
    c, _ = _instance(4)
    big = toy_model(8, params=2_000_000, act=2e9)  # activations dominate: the planner's plan recomputes
    r = plan_training(c, big, 32, options=PlannerOptions(schedules=("zb-h2",), confirm_top=1))
    ref = ref_mod._Reference(c, big, 32, 1e9)
    bare = r.plan.replace(stages=tuple(dataclasses.replace(st, recompute=False) for st in r.plan.stages),
                          estimate=None)
    assert not math.isfinite(ref.score(bare)), "without its recomputation the plan is over memory"
    got = ref.fitted(bare)
    assert math.isfinite(got)
    best = ref.best[1]
    assert any(st.recompute for st in best.stages) and best.stages != bare.stages
    assert got == pytest.approx(simulate(best, c, big, record=False).iteration_s, rel=1e-9)


def _cuts(layers: int, stages: int):
    """Every split of ``layers`` layers into ``stages`` non-empty ranges (as cut lists)."""
    import itertools

    for inner in itertools.combinations(range(1, layers), stages - 1):
        yield [0, *inner, layers]


@pytest.mark.parametrize("seed", range(12))
def test_the_split_dp_breaks_ties_under_a_bottleneck_link_exactly(seed):
    """``_split_cut`` against every split: least largest term; where a link binds, of those the
    least busiest stage, then the least summed load. Link terms are drawn so that a link often
    binds (every split ties)."""
    import math

    import numpy as np

    ref_mod = _module()
    rng = np.random.default_rng(seed)
    layers, stages = int(rng.integers(3, 8)), int(rng.integers(2, 4))
    size = layers + 1
    loads = []
    for _ in range(stages):
        per_layer = rng.integers(1, 5, size=layers).astype(float)  # integers: exact ties happen
        p = np.concatenate([[0.0], np.cumsum(per_layer)])
        table = p[None, :] - p[:, None]
        table[np.tril(np.ones((size, size), dtype=bool))] = np.inf
        if rng.random() < 0.3:  # some ranges do not fit
            table[0, size - 1] = np.inf
        loads.append(table)
    hops = [None] + [np.full(size, float(rng.choice([2.0, 30.0]))) for _ in range(stages - 1)]

    def terms(cut):
        stage = [loads[s][cut[s], cut[s + 1]] for s in range(stages)]
        link = [hops[s][cut[s]] for s in range(1, stages)]
        return max(stage + link), max(stage), sum(stage)

    every = [terms(cut) for cut in _cuts(layers, stages)]
    value, cut = ref_mod._split_cut(loads, hops)
    best = min(every)
    if not math.isfinite(best[0]):
        assert not math.isfinite(value)
        return
    assert value == best[0]
    assert cut[0] == 0 and cut[-1] == layers and all(a < b for a, b in zip(cut[:-1], cut[1:], strict=True))
    if best[1] < best[0]:  # a link binds: the tie-breaks apply
        assert terms(cut) == best, (cut, terms(cut), best)
    else:  # a stage binds: the least largest term
        assert terms(cut)[0] == best[0]


def test_shares_are_whole_samples_of_at_least_one_each():
    """The reference's shares: every device at least one sample, summing to the microbatch (a
    fast device beside slow ones once gave a slow one 0 samples, an invalid plan)."""
    ref_mod = _module()
    rng = random.Random(3)
    for _ in range(200):
        c = random_cluster(rng, name="shares")
        devs = tuple(c.device_names[: rng.randint(1, len(c.device_names))])
        n = rng.randint(len(devs), 4 * len(devs))
        got = ref_mod._shares(c, devs, n)
        assert sum(got) == n and min(got) >= 1 and len(got) == len(devs)


def test_the_reference_searches_both_syncs_where_they_differ():
    """The planner searches ring and hierarchical all-reduce; the reference's plans carry the
    sync whose summed all-reduce is least, and both are simulated where they differ."""
    ref_mod = _module()
    for seed in range(20):
        c, m = _instance(seed)
        ref = ref_mod._Reference(c, m, 32, 1e9)
        # one stage of every device: it spans nodes wherever the cluster has several
        slots = [tuple(c.device_names)]
        got = ref.split(slots, 32)
        if got is None:
            continue
        plans = ref.plans(slots, 32, got[1], got[2])
        syncs = {p.sync for p in plans}
        ring, hier = (ref._sync_s(plans[0].stages, s) for s in ref_mod.SYNCS)
        assert plans[0].sync == ("allreduce-hier" if hier < ring else "allreduce-ring")
        assert syncs == (set(ref_mod.SYNCS) if ring != hier else {plans[0].sync})
        if ring != hier:
            return
    pytest.fail("no seed gave a stage whose syncs differ")


def test_spread_gives_each_region_between_one_stage_and_its_devices():
    ref_mod = _module()
    rng = random.Random(5)
    for _ in range(500):
        sizes = [rng.randint(1, 16) for _ in range(rng.randint(1, 8))]
        total = rng.randint(len(sizes), sum(sizes))
        got = ref_mod._spread(total, sizes)
        assert sum(got) == total, (total, sizes, got)
        assert all(1 <= k <= n for k, n in zip(got, sizes, strict=True)), (total, sizes, got)
    assert ref_mod._spread(40, [10, 10, 43]) == [7, 6, 27]  # largest remainder


def test_group_is_the_fewest_devices_on_which_a_layer_fits():
    """``_group``: one layer fits on that many of the region's devices, and not on one fewer."""
    import math

    ref_mod = _module()
    c, _ = _instance(4)
    big = toy_model(8, params=2_000_000, act=4e9)  # activations dominate: devices share samples
    ref = ref_mod._Reference(c, big, 32, 1e9)
    checked = 0
    for region, devs in enumerate(ref.islands):
        for n in (4, 8):
            g = ref._group(region, n, 4)
            assert 1 <= g <= min(n, len(devs))

            def fits(k, devs=devs, n=n):
                load = ref._stage(devs[:k], ref_mod._shares(c, devs[:k], n), 32 // n, 4)[0]
                return all(math.isfinite(load[a, a + 1]) for a in range(1, ref.L - 1))

            if fits(g):
                assert g == 1 or not fits(g - 1)
                checked += g > 1
    assert checked, "no region needed more than one device per layer: the case is not exercised"


def test_the_kept_references_load_and_re_simulate_to_their_figures():
    """``benchmarks/references/``: the version-3 references of the 100 WAN instances (40 CPU s
    each), as ``--reference-from`` reads them; a kept plan re-simulates to the figure recorded when
    it was found (a failure here means the simulator changed: re-run ``planner_at_scale.py
    --budget-s 40 --save-reference ...`` and say so in docs/results.md)."""
    import json

    from conftest import planner_at_scale

    pas = planner_at_scale()
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "references" / "wan100_v3_budget40.json"
    data = json.loads(path.read_text())
    rows = {r["seed"]: r for r in data["instances"]}
    assert data["schema_version"] == 1 and sorted(rows) == list(range(100))
    assert all(r["reference_version"] == pas.REFERENCE_VERSION and r["reference_budget_cpu_s"] == 40.0
               and set(r) == set(pas.REFERENCE_FIELDS) for r in rows.values())
    assert sum(r["reference_plan"] is not None for r in rows.values()) >= 99
    for seed in (2, 66):  # two small ones
        cluster, model, _ = pas.wan_instance(seed)
        got = pas._cached_reference(rows[seed], cluster, model)
        assert got["cached"] and got["iteration_s"] == pytest.approx(rows[seed]["global_reference_s"], rel=1e-9)
