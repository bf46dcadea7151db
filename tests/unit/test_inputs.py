"""The input layer: readers per format, the field validator, the limits table, work checks."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from deepcee import cli
from deepcee.cliargs import CLI_LIMITS, number
from deepcee.cluster import cluster_from_toml_dict, load_cluster
from deepcee.errors import ClusterSpecError, SpecError, WorkLimitError
from deepcee.inputs import Fields, read_json, read_json_lines, read_toml
from deepcee.inputs.limits import GLOBAL_BATCH, LATENCY, LIMITS, markdown_table
from deepcee.inputs.work import (
    check_planning,
    check_schedule,
    check_simulation,
    planner_memory_bytes,
)
from deepcee.models import get_model, parse_model_ref
from deepcee.planfile import load_plan
from deepcee.profile import load_profile
from deepcee.scenarios import load_scenario, scenario_names
from deepcee.traces import BUILTIN_TRACES, load_named_trace

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "unit" / "golden"


def test_docs_list_every_limit() -> None:
    docs = (ROOT / "docs" / "file-formats.md").read_text()
    assert markdown_table(LIMITS) in docs
    assert markdown_table(CLI_LIMITS) in docs


def test_limit_checks_type_finiteness_and_range() -> None:
    assert GLOBAL_BATCH.check(8) == 8 and GLOBAL_BATCH.check(8.0) == 8 and isinstance(GLOBAL_BATCH.check(8.0), int)
    assert LATENCY.check(0) == 0.0 and LATENCY.check(60) == 60.0
    for bad, words in ((True, "expected an integer"), ("8", "expected an integer"), (8.5, "expected an integer"),
                       (0, "must be in [1, 1,048,576], got 0"), (10**400, "must be in"),
                       (float("nan"), "finite"), (float("inf"), "finite")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            GLOBAL_BATCH.check(bad)
    ms = LATENCY.scaled(1e-3, "ms")
    assert ms.describe() == "[0, 60,000] ms" and ms.check(20) == 20.0
    with pytest.raises(ValueError, match="got 61000"):
        ms.check(61000)


@pytest.mark.parametrize(("content", "words"), [
    (b"\x00\x01binary", "binary file (a NUL byte at offset 0)"),
    ("{}".encode("utf-16"), "not UTF-8 text but UTF-16"),
    (b'{"name": "caf\xe9"}', "not UTF-8 text: byte 0xe9 at offset 13"),
    (b"", "empty, expected a JSON object"),
    (b"[1, 2]", "expected a JSON object at the top level, got list [1, 2]"),
    (b'"text"', "got string"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'{"a": {"b": [1, NaN]}}', "a.b[1]: must be a finite number, got nan"),
    (b'{"a": [1e999]}', "a[0]: must be a finite number, got inf"),
    (b'{"a": "\\udc80"}', "a: not valid Unicode"),
    (("[" * 5000 + "]" * 5000).encode(), "nested deeper than 32 levels"),
    (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than 32 levels"),
    (b'{"a": 1,}', "invalid JSON at line 1 column 9"),
])
def test_json_reader_refuses_in_one_line(tmp_path: Path, content: bytes, words: str) -> None:
    p = tmp_path / "f.json"
    p.write_bytes(content)
    with pytest.raises(SpecError) as info:
        read_json(p, SpecError)
    msg = str(info.value)
    assert msg.startswith(f"{p}: ") and words in msg and "\n" not in msg


def test_size_limit_reads_at_most_one_byte_past_it(tmp_path: Path) -> None:
    p = tmp_path / "big.json"
    p.write_text(json.dumps({"x": "y" * 2000}))
    assert read_json(p, SpecError, max_bytes=4096)["x"] == "y" * 2000
    with pytest.raises(SpecError, match="larger than the limit of 1,000 bytes"):
        read_json(p, SpecError, max_bytes=1000)


def test_utf8_byte_order_mark_is_allowed_and_toml_non_finite_is_named(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert read_json(p, SpecError) == {"a": 1}
    t = tmp_path / "f.toml"
    t.write_text("[x]\ny = [1.0, inf]\n")
    with pytest.raises(SpecError, match=r"x.y\[1\]: must be a finite number, got inf"):
        read_toml(t, SpecError)


def test_json_lines_name_the_line(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0}\n\n{"step": NaN}\n')
    with pytest.raises(SpecError, match=r"m.jsonl: line 3.step: must be a finite number"):
        read_json_lines(p, SpecError)
    p.write_text('{"step": 0}\n{"step": 1}\n')
    assert read_json_lines(p, SpecError) == [{"step": 0}, {"step": 1}]


def test_fields_name_the_path_and_refuse_unknown_keys() -> None:
    f = Fields({"a": [{"b": "x"}], "c": 3}, file="f.json", error=SpecError)
    (inner,) = f.records("a", max_len=4)
    with pytest.raises(SpecError, match=r"^f.json: a\[0\].b: expected an integer"):
        inner.integer("b", GLOBAL_BATCH)
    with pytest.raises(SpecError, match=r"^f.json: c: unknown key \(value 3\); known: a"):
        f.done()
    g = Fields({"island": "mars"}, "nodes[2]", file="c.toml", error=ClusterSpecError)
    with pytest.raises(ClusterSpecError, match=r"nodes\[2\].island: unknown name 'mars' \(known: cloud, edge\)"):
        g.name("island", known=["edge", "cloud"])
    with pytest.raises(SpecError, match="expected an object"):
        Fields([1], file="f.json", error=SpecError)


def test_valid_files_mean_what_they_meant() -> None:
    for name in scenario_names():
        assert load_scenario(name).devices
    measured = load_cluster(GOLDEN / "local-small-measured-cluster.json")
    assert len(measured.devices) == 5
    assert load_profile(GOLDEN / "local-small-measured-gpt-tiny.json").num_layers == 6
    assert load_plan(GOLDEN / "fuzz-plan-local-small-gpt2.json").num_stages == 5
    for name in BUILTIN_TRACES:
        assert load_named_trace(name).times_s[0] == 0.0


def test_json_cluster_device_in_an_unknown_island_is_named() -> None:
    """The case an earlier fuzz run found: a KeyError inside Cluster() surfaced as 'missing key'."""
    from deepcee.cluster import cluster_from_dict, cluster_to_dict

    d = cluster_to_dict(load_scenario("local-small"))
    d["devices"][2]["island"] = "mars"
    with pytest.raises(ClusterSpecError, match=r"^c.json: devices\[2\].island: device 'edge0:0' is in node 'edge0' "
                                               r"of island 'edge', got island 'mars'$"):
        cluster_from_dict(d, file="c.json")


def test_model_references_are_parsed_and_checked() -> None:
    assert parse_model_ref("gpt2") == ("gpt2", {})
    assert parse_model_ref("llama:hidden_size=256,num_layers=2,dtype=fp32") == (
        "llama", {"hidden_size": 256, "num_layers": 2, "dtype": "fp32"})
    for ref, words in (("gpt2:seq_len=abc", "seq_len: expected an integer"), ("gpt2:seq_len", "key=value"),
                       ("llama:num_layers=5000", "num_layers: must be in [1, 1,022]"),
                       ("gpt2:colour=red", "unknown option 'colour'"), ("gpt2:seq_len=1,seq_len=2", "twice")):
        with pytest.raises(SpecError) as info:
            parse_model_ref(ref)
        assert words in str(info.value) and str(info.value).startswith("--model: ")
    with pytest.raises(SpecError, match="num_layers: must be in"):
        get_model("llama", num_layers=100_000)


def _synthetic(devices: int, islands: int):
    per = devices // islands
    data = {"name": "s", "kinds": {"g": {"peak_tflops": 35.6, "memory_gib": 22.0}},
            "islands": {f"i{i}": {"latency_us": 50, "bandwidth_gbit_per_s": 10} for i in range(islands)},
            "nodes": [{"name": f"i{i}n{k}", "island": f"i{i}", "kind": "g", "devices": 4}
                      for i in range(islands) for k in range(per // 4)],
            "links": [{"between": [f"i{a}", f"i{b}"], "latency_ms": 20, "bandwidth_mbit_per_s": 100}
                      for a in range(islands) for b in range(a + 1, islands)]}
    return cluster_from_toml_dict(data)


def test_work_limits_keep_real_sizes_and_refuse_absurd_ones() -> None:
    big = _synthetic(1024, 16)  # issue 10: the planner must handle 1,024 devices in 16 islands
    for model in ("gpt2", "gpt2-xl", "llama-7b", "resnet101"):
        check_planning(big, get_model(model), 1024)
    assert planner_memory_bytes(1024, 50) < 4 * 2**30
    with pytest.raises(WorkLimitError, match=r"layers: planning 1,002 layers on 1,024 devices .*PLANNER_MEMORY_BYTES"):
        check_planning(big, get_model("llama", num_layers=1000), 64)
    with pytest.raises(WorkLimitError, match="MAX_SCHEDULE_CELLS"):
        check_schedule(16, 10_000)
    check_schedule(16, 3000)
    plan = load_plan(GOLDEN / "fuzz-plan-local-small-gpt2.json")  # 5 devices x 8 microbatches x 3
    check_simulation(plan, 1000)
    with pytest.raises(WorkLimitError, match="at most 8,333 iteration"):
        check_simulation(plan, 10_000)


def test_cli_number_types_and_one_line_usage_errors(capsys: pytest.CaptureFixture) -> None:
    rng = random.Random(0)
    parse = number(GLOBAL_BATCH)
    for _ in range(50):
        n = rng.randint(1, 2**20)
        assert parse(str(n)) == n
    assert math.isclose(number(LATENCY)("0.5"), 0.5)
    assert cli.main(["simulate", "p.json", "--iterations", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["deepcee simulate: error: argument --iterations: must be in [1, 1,000,000], got 0 "
                   "(see deepcee simulate --help)"]
    assert cli.main(["schedule", "show", "--help"]) == 0
