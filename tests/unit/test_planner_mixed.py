"""``benchmarks/planner_mixed.py``: its instances, its row checks and its command line."""

from __future__ import annotations

import json

import pytest
from conftest import benchmark_module


def test_instances_are_seeded_and_vary_what_the_wan_benchmark_does_not() -> None:
    mixed = benchmark_module("planner_mixed")
    a, b = mixed.mixed_instance(7), mixed.mixed_instance(7)
    assert a[0].to_dict() == b[0].to_dict() and a[1].name == b[1].name and a[2] == b[2]
    kinds_per_region, batches, regions = set(), set(), set()
    for seed in range(30):
        cluster, _, batch = mixed.mixed_instance(seed)
        batches.add(batch)
        regions.add(len(cluster.islands))
        for isl in cluster.islands:
            kinds_per_region.add(len({n.kind for n in cluster.nodes if n.island == isl.name}))
    assert max(kinds_per_region) > 1 and min(regions) == 1 and max(regions) > 6
    assert batches & {3, 17, 100, 1000} and batches & {256, 2048}


def test_a_run_writes_its_table_and_json(tmp_path, capsys) -> None:
    mixed = benchmark_module("planner_mixed")
    out = tmp_path / "mixed.json"
    assert mixed.main(["--instances", "1", "--first", "7", "--jobs", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 1 and doc["format"] == "deepcee.planner_mixed" and "simulated" in doc["source"]
    (row,) = doc["instances"]
    assert row["seed"] == 7 and row["faster_baselines"] == [] and row["deepcee_s"] > 0
    assert doc["summary"]["planned"] == 1 and doc["summary"]["below_a_baseline"] == 0
    assert "every figure simulated" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--out", "{tmp}"], ["--instances", "0"], ["--reference-budget-s", "nan"]])
def test_bad_arguments_are_one_line_errors_before_the_run(argv, tmp_path, capsys) -> None:
    mixed = benchmark_module("planner_mixed")
    with pytest.raises(SystemExit) as exc:
        mixed.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert exc.value.code == 2
    assert ": error: " in capsys.readouterr().err.strip().splitlines()[-1]
