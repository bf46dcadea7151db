"""The relaxed search, statistical efficiency, data placement and cost, and the related systems' baselines.

A toy cluster of three one-device islands joined by 100 Mbit/s links and a two-layer model
whose parameters are large next to its compute: synchronising every step across islands
costs more than it gives, averaging every 16 local steps does not.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest

from deepcee.cluster import cluster_from_dict, cluster_from_toml_dict
from deepcee.errors import ClusterSpecError, PlanError, SpecError
from deepcee.plan import Plan, Strategy
from deepcee.planner.compare import compare, format_table
from deepcee.planner.efficiency import (
    DEFAULT_SOURCE,
    CalibratedEfficiency,
    DefaultEfficiency,
    Measured,
    efficiency_from_dict,
    load_efficiency,
    time_to_target,
)
from deepcee.planner.objective import data_move, plan_figures, rank_key
from deepcee.planner.relaxed_baselines import RELAXED_BASELINE_NAMES, build_relaxed_baselines
from deepcee.planner.replicas import (
    RelaxedOptions,
    blocks_of,
    partitions,
    plan_replicas,
    plan_with_sync,
)
from deepcee.planner.search import plan_training
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.simulator.replicas import simulate_replicas

SMALL = RelaxedOptions(periods=(1, 4, 16), accumulations=(1, 4), staleness_bounds=(1,), full_syncs=(1, 4))
"""A smaller grid than the CLI's, to keep these tests cheap."""


def trio(mbit: float = 100.0, *, priced: bool = True):
    islands = {}
    for name, data_gb, price in (("a", 2, 3.0), ("b", 1, 1.0), ("c", 1, 1.0)):
        islands[name] = {"latency_us": 10, "bandwidth_gbit_per_s": 10}
        if priced:
            islands[name] |= {"data_gb": data_gb, "price_usd_per_device_hour": price, "egress_usd_per_gb": 0.1}
    return cluster_from_toml_dict({
        "name": "trio",
        "kinds": {"k": {"peak_tflops": 10.0, "memory_gib": 16.0, "achievable_fraction": 0.5,
                        "per_layer_overhead_us": 0}},
        "islands": islands,
        "nodes": [{"name": f"n{x}", "island": x, "kind": "k", "devices": 1} for x in "abc"],
        "links": [{"between": [x, y], "latency_ms": 10, "bandwidth_mbit_per_s": mbit}
                  for x, y in (("a", "b"), ("a", "c"), ("b", "c"))],
    }, file="trio.toml")


def toy(params: int = 1_500_000) -> ModelProfile:
    f = 1e11 / 2 / 3
    return ModelProfile(name="toy", input_bytes=1e5, layers=tuple(
        LayerProfile(name=f"l{i}", forward_flops=f, input_grad_flops=f, weight_grad_flops=f, parameter_count=params,
                     activation_bytes=1e5, output_bytes=1e6) for i in range(2)))


@pytest.fixture(scope="module")
def searched():
    return plan_replicas(trio(), toy(), 48, options=SMALL)


# -- statistical efficiency ----------------------------------------------------------------------------


def _plan(strategy: Strategy, model: str = "toy") -> Plan:
    from deepcee.plan import ReplicaPlan, StagePlan

    reps = tuple(ReplicaPlan(stages=(StagePlan(layer_start=0, layer_stop=2, devices=(d,), shares=(1,)),),
                             microbatch_size=1, num_microbatches=1, schedule="1f1b") for d in ("na:0", "nb:0"))
    return Plan(system="t", cluster="trio", model=model, global_batch=2, replicas=reps, strategy=strategy,
                servers=("na:0",) if strategy.kind == "asgd-ga" else ())


def test_default_efficiency_is_the_documented_formula() -> None:
    eff = DefaultEfficiency()
    assert eff.multiplier(_plan(Strategy())) == 1.0
    assert eff.multiplier(_plan(Strategy(kind="model-averaging", period=16))) == pytest.approx(2.0)
    assert eff.multiplier(_plan(Strategy(kind="model-averaging", period=16, outer_optimizer="nesterov",
                                         outer_lr=0.7, outer_momentum=0.9))) == pytest.approx(1.6)
    assert eff.multiplier(_plan(Strategy(kind="partial", full_sync_every=4))) == pytest.approx(1.4)
    assert eff.multiplier(_plan(Strategy(kind="asgd-ga", accumulation_steps=4, staleness_bound=1))) == \
        pytest.approx(1.5 * 1.25)
    looser = [eff.multiplier(_plan(Strategy(kind="model-averaging", period=h))) for h in (1, 4, 64, 256)]
    assert looser == sorted(looser) and looser[0] == 1.0
    assert eff.source(_plan(Strategy(kind="partial"))) == DEFAULT_SOURCE
    assert "not measured" in DEFAULT_SOURCE


CALIBRATION = {
    "format": "deepcee.efficiency", "schema_version": 1, "model": "toy", "target_loss": 3.0,
    "reference": {"global_batch": 2, "steps_to_target": 500},
    "entries": [{"strategy": {"kind": "model-averaging", "period": 4}, "multiplier": 1.2, "replicas": 2},
                {"strategy": {"kind": "model-averaging", "period": 64}, "multiplier": 1.8, "replicas": 2}],
}


def test_calibration_plugs_in_and_says_where_each_figure_comes_from(tmp_path) -> None:
    path = tmp_path / "eff.json"
    path.write_text(json.dumps(CALIBRATION))
    eff = load_efficiency(path)

    def ma(h: int, **kw) -> Plan:
        return _plan(Strategy(kind="model-averaging", period=h, **kw))

    assert eff.multiplier(ma(4)) == 1.2 and "calibrated" in eff.source(ma(4))
    assert eff.multiplier(ma(16)) == pytest.approx(1.5)  # half-way in log(H)
    assert "interpolated" in eff.source(ma(16))
    assert eff.multiplier(ma(256)) == pytest.approx(DefaultEfficiency().multiplier(ma(256)))  # > 1.8: conservative
    assert eff.multiplier(ma(1)) == 1.2
    nesterov = ma(16, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    assert eff.multiplier(nesterov) == DefaultEfficiency().multiplier(nesterov)
    assert DEFAULT_SOURCE in eff.source(nesterov)
    other = _plan(Strategy(kind="model-averaging", period=4), model="gpt2")
    assert eff.multiplier(other) == DefaultEfficiency().multiplier(other) and "'toy'" in eff.source(other)
    t = time_to_target(ma(4), 10.0, eff)
    assert t.seconds == pytest.approx(500 * 2 * 1.2 / 10.0)
    assert time_to_target(ma(4), 10.0, DefaultEfficiency()).seconds is None


@pytest.mark.parametrize(("change", "field"), [
    ({"format": "other"}, "schema_version"),
    ({"entries": [{"strategy": {"kind": "nope"}, "multiplier": 1.0}]}, "entries[0]"),
    ({"entries": [{"strategy": {"kind": "partial"}, "multiplier": -1}]}, "entries[0]"),
    ({"entries": [{"multiplier": 1.0}]}, "entries[0]"),
])
def test_bad_calibration_files_name_file_and_field(change: dict, field: str) -> None:
    with pytest.raises(SpecError, match=rf"eff.json: {re_escape(field)}"):
        efficiency_from_dict({**CALIBRATION, **change}, file="eff.json")


def re_escape(text: str) -> str:
    return re.escape(text)


# -- cluster files: data and prices ----------------------------------------------------------------------


def test_islands_state_data_and_prices_and_round_trip_through_json() -> None:
    c = trio()
    a = c.islands[0]
    assert a.data_bytes == 2e9 and a.device_usd_per_s == pytest.approx(3.0 / 3600)
    assert a.egress_usd_per_byte == pytest.approx(0.1 / 1e9)
    assert cluster_from_dict(c.to_dict()).islands == c.islands
    assert trio(priced=False).islands[0].data_bytes is None


@pytest.mark.parametrize(("extra", "message"), [
    ({"data_gb": -1}, "islands.a.data_gb: must be in [0, 1e+12] GB, got -1"),
    ({"data_pb": 1}, "islands.a.data_pb: unknown unit"),
    ({"price_usd_per_device_hour": "x"}, "islands.a.price_usd_per_device_hour: expected a number, got 'x'"),
    ({"egress_usd_per_gb": math.inf}, "islands.a.egress_usd_per_gb: must be a finite number in [0, 1,000,000] USD/GB, got inf"),
])
def test_bad_island_fields_name_file_field_and_value(extra: dict, message: str) -> None:
    base = {"name": "x", "kinds": {"k": {"peak_tflops": 1.0, "memory_gib": 1.0}},
            "islands": {"a": {"latency_us": 1, "bandwidth_gbit_per_s": 1, **extra}},
            "nodes": [{"name": "n", "island": "a", "kind": "k", "devices": 1}]}
    with pytest.raises(ClusterSpecError, match=re_escape(f"c.toml: {message}")):
        cluster_from_toml_dict(base, file="c.toml")


# -- objective: data, cost ------------------------------------------------------------------------------


def test_an_island_alone_pulls_the_data_it_lacks_once_and_pays_for_it() -> None:
    c, m = trio(), toy()
    plan = plan_training(c.subset(["nb:0"]), m, 48).plan.replace(cluster="trio")
    result = simulate_replicas(plan, c, m, steps=2)
    move = data_move(plan, result, c)
    assert sorted(move.moves) == [("a", "b", pytest.approx(2e9)), ("c", "b", pytest.approx(1e9))]
    assert move.usd == pytest.approx(3e9 * 0.1 / 1e9)
    assert move.seconds == pytest.approx(0.01 + 2e9 / 12.5e6)  # the larger pair, links in parallel
    fig = plan_figures(plan, result, c, m, DefaultEfficiency())
    assert fig.epoch_samples == pytest.approx(4e9 / m.input_bytes)
    assert fig.compute_usd_per_epoch == pytest.approx(fig.epoch_s * 1.0 / 3600)
    assert fig.egress_usd_per_epoch == 0.0  # one device: nothing leaves an island while training
    assert fig.usd_per_epoch == pytest.approx(fig.compute_usd_per_epoch + move.usd)
    assert fig.usd_per_sync_epoch == fig.usd_per_epoch
    spread = plan_figures(plan, result, c, m, DefaultEfficiency(), epochs=4)
    assert spread.usd_per_epoch == pytest.approx(fig.compute_usd_per_epoch + move.usd / 4)
    unpriced = plan_figures(plan, result, trio(priced=False), m, DefaultEfficiency(), dataset_samples=100)
    assert unpriced.usd_per_epoch is None and unpriced.epoch_samples == 100


def test_budget_ranks_the_fastest_within_it_first(searched) -> None:
    figs = [s.figures for s in searched.candidates]
    costs = sorted(f.usd_per_sync_epoch for f in figs)
    budget = costs[len(costs) // 2]
    best = min(figs, key=lambda f: rank_key(f, "cost", budget))
    within = [f for f in figs if f.usd_per_sync_epoch <= budget]
    assert best.usd_per_sync_epoch <= budget
    assert best.time_to_target.seconds_per_sync_sample == min(f.time_to_target.seconds_per_sync_sample
                                                               for f in within)
    assert min(figs, key=lambda f: rank_key(f, "cost")).usd_per_sync_epoch == costs[0]


# -- the relaxed search ---------------------------------------------------------------------------------


def test_layout_enumeration() -> None:
    assert [len(list(partitions(list(range(n))))) for n in range(1, 6)] == [1, 2, 5, 15, 52]  # Bell numbers
    assert len(blocks_of([("a",), ("b",), ("c",)], 4)) == 7
    assert len(blocks_of([(str(i),) for i in range(6)], 4)) == 6 + 1 + 6


def test_only_the_layouts_the_screen_rates_best_are_planned_in_full(searched) -> None:
    """[Note: layout screen]: every layout is screened on its rough pipelines, and only the best
    ``full_layouts`` within ``screen_within`` of the screen's best are planned in full and become
    candidates; with every layout planned in full the best plan is the same here."""
    text = "\n".join(searched.explanation)
    # {a|b}, {a|c}, {b|c} and the four partitions of {a, b, c} into two or three blocks
    assert "replica layouts: 7 listed, 7 with a plan that fits on their rough pipelines, the best 1 of those " \
           "planned in full" in text, text
    assert {s.layout for s in searched.candidates} == {"exact search", "{a} | {b} | {c}"}
    every = plan_replicas(trio(), toy(), 48, options=replace(SMALL, full_layouts=10, screen_within=100.0))
    # two of the seven have the pipelines of another (a block's best pipeline leaves an island out)
    assert len({s.layout for s in every.candidates}) == 6
    assert "the best 7 of those planned in full" in "\n".join(every.explanation)
    assert every.best.layout == searched.best.layout and every.best.plan == searched.best.plan
    two = plan_replicas(trio(), toy(), 48, options=replace(SMALL, full_layouts=2, screen_within=100.0))
    assert len({s.layout for s in two.candidates}) == 3


@pytest.mark.parametrize("field, value", [("full_layouts", 0), ("full_layouts", True), ("screen_within", -0.1),
                                          ("screen_within", float("nan")), ("screen_within", True)])
def test_bad_screen_settings_are_refused(field: str, value: object) -> None:
    with pytest.raises(PlanError, match=field):
        RelaxedOptions(**{field: value})


def test_relaxed_search_picks_averaging_where_it_pays(searched) -> None:
    best, exact = searched.best, searched.exact
    assert best.plan.semantics == "relaxed" and best.plan.strategy.kind == "model-averaging"
    assert best.plan.num_replicas == 3 and searched.plan.estimate.source == "simulator"
    assert best.figures.time_to_target.seconds_per_sync_sample < exact.figures.time_to_target.seconds_per_sync_sample
    assert best.samples_per_s > exact.samples_per_s * best.figures.time_to_target.multiplier
    text = "\n".join(searched.explanation)
    assert "semantics relaxed" in text and "not measured" in text and "not comparable" in text
    kinds = {s.plan.strategy.kind for s in searched.candidates}
    assert kinds == {"exact", "model-averaging", "asgd-ga", "partial"}
    assert searched.candidates == tuple(sorted(searched.candidates, key=lambda s: s.figures.time_to_target
                                               .seconds_per_sync_sample))


def test_overlapped_averaging_is_tried_beside_blocking_and_judged_one_period_late(searched) -> None:
    ma = {(s.layout, s.plan.strategy.period, s.plan.strategy.outer_optimizer, s.plan.strategy.overlap): s
          for s in searched.candidates if s.plan.strategy.kind == "model-averaging"}
    twins = [(ma[k], ma[(*k[:3], True)]) for k in ma if not k[3] and (*k[:3], True) in ma]
    assert len(twins) == len(ma) // 2 > 0
    # nothing waits at a sync point: never slower than blocking, faster where the averages cost
    assert all(o.samples_per_s >= b.samples_per_s * 0.99 for b, o in twins)
    assert any(o.samples_per_s > b.samples_per_s * 1.05 for b, o in twins)
    # each average lands one period late: the default charges the samples of blocking at 2H
    for b, o in twins:
        twice = b.plan.replace(strategy=replace(b.plan.strategy, period=2 * b.plan.strategy.period))
        assert o.figures.time_to_target.multiplier == pytest.approx(DefaultEfficiency().multiplier(twice))
        assert "overlapped (applied one period late)" in o.plan.strategy.describe()


def test_a_calibration_that_measured_averaging_as_costly_keeps_the_exact_plan() -> None:
    settings = (("model-averaging", {"period": 1}), ("model-averaging", {"period": 1, "outer_optimizer": "nesterov"}),
                ("partial", {}), ("asgd-ga", {"staleness_bound": 1}))
    entries = tuple(Measured(strategy=Strategy(kind=k, **kw), multiplier=50.0) for k, kw in settings)
    eff = CalibratedEfficiency(model="toy", entries=entries, file="costly.json")
    got = plan_replicas(trio(), toy(), 48, options=SMALL, efficiency=eff)
    assert got.best.plan.semantics == "exact"
    assert all(s.figures.time_to_target.multiplier >= 50 for s in got.candidates if s.plan.semantics == "relaxed")


def test_plan_with_sync_switch() -> None:
    with pytest.raises(PlanError, match="unknown sync 'loose'"):
        plan_with_sync(trio(), toy(), 48, sync="loose")
    exact = plan_with_sync(trio(), toy(), 48)
    assert exact.plan == plan_training(trio(), toy(), 48).plan
    assert exact.plan.num_replicas == 1 and exact.plan.semantics == "exact"
    cheapest = plan_with_sync(trio(), toy(), 48, objective="cost")  # exact plans only, the cheapest
    assert cheapest.plan.semantics == "exact"
    assert any("dollars per sync-equivalent epoch" in line for line in cheapest.explanation)


def test_the_relaxed_search_reports_progress_through_plan_with_sync() -> None:
    """``deepcee plan --sync relaxed`` printed nothing for minutes after the exact search: the
    relaxed search now reports each layout through the planner options' ``progress``, as the
    exact search reports its steps, and the plan is the same with or without it."""
    from deepcee.planner.options import PlannerOptions

    seen: list[tuple[str, float]] = []
    got = plan_with_sync(trio(), toy(), 48, sync="relaxed", objective="cost",
                         options=PlannerOptions(progress=lambda step, f: seen.append((step, f))))
    steps = list(dict.fromkeys(step for step, _ in seen))
    assert "island chains" in steps  # the exact search's own steps come first
    relaxed = ["island blocks alone", "replica layouts: rough pipelines", "replica layouts: planned in full"]
    assert [x for x in steps if x in relaxed] == relaxed
    assert steps.index(relaxed[0]) > steps.index("island chains")
    for step in relaxed:
        fractions = [f for x, f in seen if x == step]
        assert fractions[0] == 0.0 and fractions == sorted(fractions) and all(0.0 <= f < 1.0 for f in fractions)
    quiet = plan_with_sync(trio(), toy(), 48, sync="relaxed", objective="cost")
    assert got.plan == quiet.plan


# -- the related systems as baselines, in compare --------------------------------------------------------


def test_related_systems_are_plans_on_the_same_simulator() -> None:
    got = {b.result.name: b for b in build_relaxed_baselines(trio(), toy(), 48, efficiency=DefaultEfficiency())}
    assert tuple(got) == RELAXED_BASELINE_NAMES
    for b in got.values():
        assert b.result.plan is not None, b.result.reason
        assert b.result.plan.estimate.source == "simulator" and b.result.plan.num_replicas == 3
    assert got["cloudless-ps-ma"].result.plan.strategy.kind == "model-averaging"
    assert got["cloudless-ps-ma"].result.plan.servers == ("na:0", "nb:0", "nc:0")
    assert got["cloudless-ps-asgd"].result.plan.strategy.kind == "asgd-ga"
    assert got["sdpipe-partial"].result.plan.strategy.kind == "partial"
    heterog = got["heterog"].result.plan
    assert heterog.semantics == "exact" and {st.sync for rep in heterog.replicas for st in rep.stages} <= {
        "ps", "allreduce-ring"}


def test_compare_labels_relaxed_rows_and_predicts_their_time_to_target() -> None:
    plain = compare(trio(), toy(), 48, crossover=False)
    assert all("semantics" not in r for r in plain.to_dict()["rows"])  # unchanged without relaxed rows
    rep = compare(trio(), toy(), 48, crossover=False, relaxed=True)
    rows = {r["system"]: r for r in rep.to_dict()["rows"]}
    assert set(RELAXED_BASELINE_NAMES) <= set(rows)
    assert rows["cloudless-ps-ma"]["semantics"] == "relaxed" and rows["ddp"]["semantics"] == "exact"
    t = rows["cloudless-ps-ma"]["time_to_target"]
    assert t["predicted"] and t["source"] == DEFAULT_SOURCE and t["multiplier"] > 1
    table = format_table(rep)
    assert "to target" in table and "not comparable" in table and "PREDICTED" in table
