"""The compare report: rows, JSON round trip, the leave-out line and the crossover."""

from __future__ import annotations

import json
import math

import pytest
from conftest import measured_model, random_cluster, toy_model

from deepcee.cluster import Cluster, cluster_from_toml_dict
from deepcee.planner import compare as compare_mod
from deepcee.planner import crossover as crossover_mod
from deepcee.planner.baselines import build_baselines
from deepcee.planner.compare import (
    SWEEP_BANDWIDTHS_BYTES_PER_S,
    compare,
    find_crossover,
    format_table,
    plot_crossover,
    report_from_dict,
    slow_link_entries,
)
from deepcee.profile import LayerProfile, ModelProfile
from deepcee.scenarios import load_scenario
from deepcee.schedule.ir import ActionKind

EFF_FLOPS = 10e12 * 0.5
FLOPS_PER_SAMPLE = 6e12
PARAMS = 50_000_000
LATENCY_S = 0.01


def pair(bandwidth_mbit_per_s: float = 100.0) -> Cluster:
    """Two islands of one device each, joined by one link."""
    return cluster_from_toml_dict({
        "name": "pair",
        "kinds": {"k": {"peak_tflops": 10.0, "memory_gib": 16.0, "achievable_fraction": 0.5,
                        "per_layer_overhead_us": 0}},
        "islands": {"a": {"latency_us": 10, "bandwidth_gbit_per_s": 10},
                    "b": {"latency_us": 10, "bandwidth_gbit_per_s": 10}},
        "nodes": [{"name": "na", "island": "a", "kind": "k", "devices": 1},
                  {"name": "nb", "island": "b", "kind": "k", "devices": 1}],
        "links": [{"between": ["a", "b"], "latency_ms": LATENCY_S * 1e3, "bandwidth_mbit_per_s": bandwidth_mbit_per_s}],
    })


def one_layer_model() -> ModelProfile:
    """One layer: every plan is data parallel, so the crossover has a closed form."""
    f = FLOPS_PER_SAMPLE / 3
    return ModelProfile(
        name="one-layer",
        layers=(LayerProfile(name="l0", forward_flops=f, input_grad_flops=f, weight_grad_flops=f,
                             parameter_count=PARAMS, activation_bytes=1e5, output_bytes=1e3),),
        input_bytes=1e3,
    )


def best_baseline_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand in for deepcee's search: the fastest baseline (keeps these tests about compare).

    The baselines of one (cluster, model, batch) are built once: a crossover point asks for
    them four times (three planner calls and the sweep's own baselines)."""
    built: dict[tuple[int, int, int], tuple] = {}

    def baselines(cluster, model, batch):
        key = (id(cluster), id(model), batch)
        if key not in built:  # the objects are kept alive with the result, so ids are not reused
            built[key] = (cluster, model, build_baselines(cluster, model, batch))
        return built[key][2]

    def plan(cluster, model, batch, *, use_all_devices=False, light=False, progress=None):
        fits = [b.plan for b in baselines(cluster, model, batch) if b.plan is not None
                and (not use_all_devices or set(b.plan.devices) == set(cluster.device_names))]
        if not fits:
            raise compare_mod.InfeasiblePlanError("nothing fits")
        best = max(fits, key=lambda p: p.estimate.samples_per_s)
        return best.replace(system="deepcee"), 0.0

    monkeypatch.setattr(compare_mod, "_deepcee", plan)
    monkeypatch.setattr(crossover_mod, "build_baselines", baselines)
    monkeypatch.setattr(compare_mod, "build_baselines", baselines)


def test_fixed_cost_of_an_action_is_the_share_independent_part_of_time_s() -> None:
    c, m = pair(), measured_model("k", 5)
    lines, call = m.measured["k"], m.measured_call_overhead["k"]
    fixed = compare_mod._fixed_s
    # a middle range: its layers' fixed parts and one call overhead
    assert fixed(m, c, "na:0", 1, 4, ActionKind.F) == pytest.approx(
        sum(t.forward[0] for t in lines[1:4]) + call.forward[0])
    # from layer 0 with the fused backward: the first-stage lines
    assert fixed(m, c, "na:0", 0, 3, ActionKind.B) == pytest.approx(
        sum(t.first_stage.backward[0] for t in lines[:3]) + call.first_stage.backward[0])
    # analytic: the kind's per-layer overhead, twice for B, times the slowdown
    ls, toy = load_scenario("local-small"), toy_model(5)
    d = max(ls.device_names, key=lambda x: ls.device(x).slowdown)
    want = 2 * 3 * ls.kind_of(d).per_layer_overhead_s * ls.device(d).slowdown
    assert want > 0 and fixed(toy, ls, d, 1, 4, ActionKind.B) == pytest.approx(want)


def test_find_crossover_interpolates_on_log_scales() -> None:
    assert find_crossover([1, 2, 4], [1, 1, 4], [2, 2, 2]) == pytest.approx(2 * 2 ** (math.log(2) / math.log(4)))
    assert find_crossover([1, 2, 4], [1, 1, 1], [2, 2, 2]) is None
    assert find_crossover([1, 2], [0, 5], [1, 0]) == 2.0


def test_slow_link_entries_override_the_links_to_left_out_devices() -> None:
    c = load_scenario("cee-testbed")
    kept = [d for d in c.device_names if c.device(d).island == "cloud"]
    entries, names = slow_link_entries(c, kept, 1e9 / 8)
    assert sorted(names) == ["cloud<->edge", "cloud<->end", "edge<->end"]
    fast = c.with_links(entries)
    assert fast.link("cloud0:0", "edge1:1").bandwidth_bytes_per_s == pytest.approx(125e6)
    assert fast.link("cloud0:0", "edge1:1").latency_s == pytest.approx(0.02)
    assert fast.link("edge0:0", "end0:0").latency_s == pytest.approx(0.005)
    assert fast.link("edge0:0", "edge1:0").bandwidth_bytes_per_s == pytest.approx(125e6)  # LAN, untouched
    # a single kept node: its links to the other nodes of its island are swept, not the island's LAN
    _, names = slow_link_entries(c, ["cloud0:0", "cloud0:1", "cloud0:2", "cloud0:3"], 1e6)
    assert sorted(names) == ["cloud0<->cloud1", "cloud<->edge", "cloud<->end", "edge<->end"]


def test_crossover_found_where_the_closed_form_puts_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    best_baseline_planner(monkeypatch)
    model, batch = one_layer_model(), 64
    # one device: t(B); two devices data parallel: t(B/2) + ring of 2 = 2 (latency + G/2 / bw)
    grad_bytes = PARAMS * 2.0
    t = lambda n: n * FLOPS_PER_SAMPLE / EFF_FLOPS  # noqa: E731
    bw_star = grad_bytes / (t(batch) - t(batch / 2) - 2 * LATENCY_S)
    report = compare(pair(10.0), model, batch)
    assert "Leaving devices out" in report.leave_out
    c = report.crossover
    assert c is not None and c.left_out_devices == ("nb:0",) and c.slow_links == ("a<->b",)
    grid = list(SWEEP_BANDWIDTHS_BYTES_PER_S)
    k = next(i for i, v in enumerate(grid) if v > bw_star)
    assert grid[k - 1] <= c.bandwidth.crossover <= grid[k], (bw_star, c.bandwidth)
    # over the batch at 10 Mbit/s: the two devices win once t(B) - t(B/2) > 2 latency + G / bw
    b_star = 2 * (2 * LATENCY_S + grad_bytes / (10e6 / 8)) * EFF_FLOPS / FLOPS_PER_SAMPLE
    assert c.batch.crossover is not None
    assert b_star / 2 <= c.batch.crossover <= b_star * 2, (b_star, c.batch)
    text = format_table(report)
    assert "crossover" in text and "Leaving devices out" in text
    png = tmp_path / "x.png"
    plot_crossover(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_json_round_trips_and_names_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    best_baseline_planner(monkeypatch)
    report = compare(load_scenario("local-small"), one_layer_model(), 16, crossover=False)
    d = json.loads(json.dumps(report.to_dict()))
    assert report_from_dict(d) == report.to_dict()
    assert d["format"] == "deepcee.compare" and d["schema_version"] == 1
    assert d["source"].startswith("simulated on the analytic cost model / emulated cluster")
    assert all(r["source"] == d["source"] for r in d["rows"])
    assert [r["system"] for r in d["rows"]][0] == "deepcee"
    assert d["bound"]["samples_per_s"] >= max(r["samples_per_s"] for r in d["rows"])
    with pytest.raises(compare_mod.DeepceeError, match="deepcee.compare"):
        report_from_dict({**d, "format": "other"})
    datasheet = compare_mod.figure_source(load_scenario("cee-testbed"), one_layer_model())
    assert datasheet == "simulated on the analytic cost model / datasheet device speeds"


# ---------------------------------------------------------------------------------------
# with deepcee's real search
# ---------------------------------------------------------------------------------------


def test_deepcee_beats_ddp_on_the_testbed_and_stays_under_the_bound() -> None:
    pytest.importorskip("deepcee.planner.search")
    from deepcee.models import get_model

    cluster = load_scenario("cee-testbed")
    report = compare(cluster, get_model("gpt2"), 32, crossover=False)
    dc, ddp = report.deepcee, report.row("ddp")
    assert dc.plan is not None and dc.plan.estimate.source == "simulator"
    assert ddp.plan is not None and dc.samples_per_s > 2.8 * ddp.samples_per_s
    assert ddp.speedup == pytest.approx(dc.samples_per_s / ddp.samples_per_s)
    assert 0 < report.fraction_of_bound <= 1.0
    for row in report.rows:
        assert row.samples_per_s <= report.bound.samples_per_s
        if row.plan is not None:
            assert row.peak_memory_bytes <= cluster.memory_bytes(row.peak_memory_device)
    assert set(report.deepcee_breakdown) == {"bubble", "sync", "receive_wait", "per_layer_overhead"}
    text = format_table(report)
    assert "upper bound" in text and "deepcee" in text and "ddp" in text


@pytest.mark.parametrize(("scenario", "name", "batch"), [
    ("cee-testbed-500m", "bert-small", 128), ("local-small", "gpt-tiny", 16), ("scale-4", "resnet50", 64),
])
def test_bound_is_never_beaten_by_deepcee(scenario: str, name: str, batch: int) -> None:
    pytest.importorskip("deepcee.planner.search")
    from deepcee.models import get_model

    report = compare(load_scenario(scenario), get_model(name), batch, crossover=False)
    assert not report.notes, report.notes
    assert report.deepcee.samples_per_s <= report.bound.samples_per_s
    assert max(r.samples_per_s for r in report.rows) <= report.bound.samples_per_s


def test_bound_is_never_beaten_by_deepcee_on_random_clusters() -> None:
    """Every plan the search confirmed with the simulator (the chosen one and the runners-up) stays
    under the bound, on six seeded random clusters."""
    pytest.importorskip("deepcee.planner.search")
    import random

    from deepcee.planner.bound import upper_bound
    from deepcee.planner.search import plan_training

    rng = random.Random(11)
    checked = 0
    for trial in range(6):
        cluster = random_cluster(rng, f"r{trial}")
        model = toy_model(rng.randint(2, 8), params=rng.choice([1_000_000, 20_000_000]),
                          out=rng.choice([1e4, 1e6]), act=rng.choice([1e5, 1e7]))
        batch = rng.choice([8, 32, 64])
        bound = upper_bound(cluster, model, batch)
        result = plan_training(cluster, model, batch)
        assert result.plan.estimate.source == "simulator"
        for cand in result.top:
            assert cand.simulated is not None
            assert cand.simulated.samples_per_s <= bound.samples_per_s * (1 + 1e-9), (trial, bound, cand.plan)
            checked += 1
    assert checked >= 20


def test_deepcee_without_a_plan_is_a_row_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(cluster, model, batch, **_):
        raise compare_mod.InfeasiblePlanError("needs 30 GiB on n:0, has 16 GiB")

    monkeypatch.setattr(compare_mod, "_deepcee", fail)
    report = compare(pair(100.0), one_layer_model(), 16)
    dc = report.deepcee
    assert dc.plan is None and "needs 30 GiB on n:0" in dc.reason
    assert report.fraction_of_bound == 0.0 and report.crossover is None and not report.leave_out
    assert report.row("ddp").plan is not None and report.row("ddp").speedup == 0.0
    assert "deepcee found no plan" in format_table(report)
    assert json.loads(json.dumps(report.to_dict()))["rows"][0]["plan"] is None


def test_crossover_curves_pass_through_the_planned_point() -> None:
    """At the planned batch the sweep shows at least the plan's own figure ("without") and its best
    simulated counterfactual with a left-out device ("with"), whatever the lighter sweep search finds."""
    c, model = pair(10.0), one_layer_model()
    study = crossover_mod.crossover_study(c, model, 48, ["na:0"], planner=lambda *a, **k: None,
                                          batches=(16, 64), bandwidths_bytes_per_s=(1e6,), planned=(7.0, 1e9))
    point = next(p for p in study.batch.points if p.value == 48)
    assert point.without_samples_per_s == 1e9 and point.with_samples_per_s >= 7.0
    assert [p.value for p in study.batch.points] == [16, 48, 64]


def test_compare_reports_progress_through_each_phase() -> None:
    """``compare(progress=...)`` (what ``deepcee compare`` prints after 2 s): deepcee's search with
    its own steps, the baselines, the related systems, then each crossover point, in that order."""
    seen: list[tuple[str, float]] = []
    report = compare(pair(10.0), one_layer_model(), 64, relaxed=True,
                     progress=lambda step, f: seen.append((step, f)))
    assert report.crossover is not None
    steps = list(dict.fromkeys(step for step, _ in seen))
    assert "baselines" in steps and "related systems' strategies" in steps
    k = steps.index("baselines")
    assert "island chains" in steps[:k] and "layer splits" in steps[:k]  # the search's own steps come first
    # then the sweeps re-scoring the search's layouts, the new searches that check them ([Note:
    # crossover]) and, where those found new layouts, the sweeps again with them
    sweeps = ["crossover sweep of the global batch", "crossover sweep of the bandwidth"]
    searches = ["crossover search of the global batch", "crossover search of the bandwidth"]
    again = [f"{s}, searched layouts added" for s in sweeps]
    assert steps[k + 1:k + 4] == ["related systems' strategies", *sweeps]
    assert set(steps[k + 4:]) <= {*searches, *again} and steps[k + 4] == searches[0] and searches[1] in steps
    for name, points in (("global batch", report.crossover.batch.points),
                         ("bandwidth", report.crossover.bandwidth.points)):
        fractions = [f for step, f in seen if step == f"crossover sweep of the {name}"]
        assert len(fractions) == len(points) and fractions == sorted(fractions) and fractions[0] == 0.0
        assert all(0.0 <= f < 1.0 for f in fractions)


def _fake_plan(devices: tuple[str, ...], samples_per_s: float):
    from types import SimpleNamespace
    return SimpleNamespace(devices=devices, estimate=SimpleNamespace(samples_per_s=samples_per_s))


def test_new_searches_overrule_a_pool_that_says_leaving_out_stays_best() -> None:
    """[Note: crossover], last paragraph: where the re-scoring planner never sees the left-out
    devices pay off, a new search at the top of each sweep checks it; its layout joins the pool,
    the sweep is re-scored with it, and a search just below the first point that pays checks the
    crossover's lower side. (On a 4-region cluster the pool's 17.4 samples/s at 10 Gbit/s hid a
    29.3 samples/s plan, and ``compare`` said leaving the devices out stays best.)"""
    c, model = pair(10.0), one_layer_model()
    grid = list(SWEEP_BANDWIDTHS_BYTES_PER_S)
    pays_from_bw, pays_from_batch = grid[6], 1024  # 1 Gbit/s; the batch sweep keeps the 10 Mbit/s link

    def pays(cluster, batch) -> bool:
        return cluster.link("na:0", "nb:0").bandwidth_bytes_per_s >= pays_from_bw or batch >= pays_from_batch

    class Pool:
        """Re-scores: the kept plan at 10 samples/s, the all-devices plan at 1; once the searches'
        layouts are added, a plan on both devices at 15 wherever they pay."""

        def __init__(self, learns: bool) -> None:
            self.learned, self.learns = False, learns

        def __call__(self, cluster, model, batch, *, use_all_devices=False):
            both = len(cluster.device_names) == 2
            return _fake_plan(("na:0", "nb:0"), 1.0) if both and use_all_devices else _fake_plan(("na:0",), 10.0)

        def best_using(self, cluster, model, batch, devices):
            return _fake_plan(("na:0", "nb:0"), 15.0 if self.learned and pays(cluster, batch) else 1.0)

        def add(self, plans) -> bool:
            new = self.learns and not self.learned
            self.learned = self.learned or self.learns
            return new

    asked: list[tuple[float, int]] = []

    def search(cluster, model, batch, *, use_all_devices=False):
        assert not use_all_devices and len(cluster.device_names) == 2  # one search of the whole cluster
        asked.append((cluster.link("na:0", "nb:0").bandwidth_bytes_per_s, batch))
        return _fake_plan(("na:0", "nb:0"), 20.0) if pays(cluster, batch) else _fake_plan(("na:0",), 10.0)

    study = crossover_mod.crossover_study(c, model, 64, ["na:0"], planner=Pool(learns=True), confirm=search,
                                          baselines=False)
    bw = study.bandwidth
    assert grid[5] < bw.crossover <= grid[6], bw
    assert [p.with_samples_per_s for p in bw.points] == [1.0] * 6 + [15.0] * 3 + [20.0]
    assert bw.note.endswith("(searched anew at 500 Mbit/s, 10.0 Gbit/s)"), bw.note
    assert study.batch.crossover is not None and 512 < study.batch.crossover <= 1024
    # a pool that learns nothing from the searches: they walk down from the top, at most
    # CONFIRM_SEARCHES_MAX of them per sweep, and every point searched carries the search's figure
    asked.clear()
    blind = crossover_mod.crossover_study(c, model, 64, ["na:0"], planner=Pool(learns=False), confirm=search,
                                          baselines=False)
    searched = [p.value for p in blind.bandwidth.points if p.with_samples_per_s == 20.0]
    assert searched == grid[-crossover_mod.CONFIRM_SEARCHES_MAX:]
    assert len({b for b, n in asked if n == 64}) == crossover_mod.CONFIRM_SEARCHES_MAX
    assert grid[-crossover_mod.CONFIRM_SEARCHES_MAX - 1] < blind.bandwidth.crossover <= searched[0]
    # searches that agree with the pool: one per sweep, at its top, and the pool's verdict
    agree = crossover_mod.crossover_study(c, model, 64, ["na:0"], planner=Pool(learns=False), baselines=False,
                                          confirm=lambda cl, m, b, **k: _fake_plan(("na:0",), 10.0))
    assert agree.bandwidth.crossover is None and "stays best" in agree.bandwidth.note
    assert agree.bandwidth.note.endswith("(searched anew at 10.0 Gbit/s)")
    assert agree.batch.note.endswith("(searched anew at 4096)")
