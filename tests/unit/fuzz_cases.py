"""Generated malformed (and a few valid) inputs for every reader and CLI number.

Used by ``test_inputs_fuzz.py``. Each :class:`Case` writes its files into a temporary folder
and names the entry point and arguments it runs; bad cases expect exit code 2 and one line on
stderr holding every ``needle`` (the file and the field), good cases exit code 0. Mutations
start from files deepcee ships or writes: the built-in scenarios, a cluster JSON written by
``cluster_to_dict``, a plan written by ``deepcee plan``, the recorded measured profile, the
built-in traces and a device probe record. The random families draw leaves and bad values from
``random.Random(SEED)``, so the cases are the same on every run.

``python tests/unit/fuzz_cases.py`` prints the number of cases by family.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src" / "deepcee"
SEED = 12
RANDOM_PER_BASE = 24
MISSING = object()


@dataclass
class Ctx:
    """Where a case writes its files, and the base files it mutates (built once per session)."""

    tmp: Path
    bases: dict[str, Any]

    def write(self, name: str, content: str | bytes | Any) -> str:
        p = self.tmp / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif isinstance(content, str):
            p.write_text(content)
        else:
            p.write_text(json.dumps(content))
        return str(p)


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    build: Callable[[Ctx], tuple[str, list[str], tuple[str, ...]]]
    """ctx -> (entry, argv, needles). entry: ``cli`` (deepcee main), ``train`` (python -m
    deepcee.train main), ``probe`` (the device-probe reader), ``subprocess`` (``python -m
    deepcee.cli`` in a new process)."""
    accept: bool = False
    slow: bool = field(default=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.family}/{self.name}"


# -- mutation helpers -----------------------------------------------------------------------


def at(d: Any, path: tuple) -> Any:
    for k in path:
        d = d[k]
    return d


def mutate(base: Any, path: tuple, value: Any) -> Any:
    """A deep copy of ``base`` with ``path`` set to ``value`` (deleted for :data:`MISSING`)."""
    d = copy.deepcopy(base)
    parent = at(d, path[:-1])
    if value is MISSING:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return d


def dotted(path: tuple) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def leaves(d: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from leaves(v, (*path, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from leaves(v, (*path, i))
    else:
        yield path, d


def toml_set(text: str, section: str, key: str, value: str) -> str:
    """``text`` with ``key = ...`` in the first ``section`` header's block set to ``value``
    (``section`` is a header line such as ``[kinds.cpu-worker]`` or ``[[nodes]]#1`` for the 2nd)."""
    header, _, nth = section.partition("#")
    starts = [m.end() for m in re.finditer(re.escape(header) + r"\n", text)]
    start = starts[int(nth or 0)]
    nxt = re.search(r"^\[", text[start:], re.M)
    end = start + nxt.start() if nxt else len(text)
    block = text[start:end]
    line = re.compile(rf"^{re.escape(key)} = .*$", re.M)
    block = line.sub(f"{key} = {value}", block, count=1) if line.search(block) else f"{key} = {value}\n" + block
    return text[:start] + block + text[end:]


def deep_json(depth: int) -> str:
    return '{"a": ' + "[" * depth + "]" * depth + "}"


# junk every reader must refuse, with what the message must say
JUNK: dict[str, tuple[bytes, str]] = {
    "binary": (bytes(range(256)) * 4, "binary file"),
    "latin-1": ("name = 'caf\u00e9'\n".encode("latin-1"), "not UTF-8"),
    "utf-16": ("{}".encode("utf-16"), "not UTF-8 text but UTF-16"),
    "empty": (b"", ""),
    "whitespace": (b"  \n\n ", ""),
}


# -- families ---------------------------------------------------------------------------------

BAD_POSITIVE = ("-1", "0", "nan", "inf", "-inf", "1e308", '"fast"', "true", "[1]")
BAD_NONNEG = ("-1", "nan", "inf", "1e308", '"10"', "true")


def cluster_toml_cases() -> Iterator[Case]:
    fam = "cluster-toml"
    keys = [
        ("[kinds.cpu-worker]", "peak_tflops", BAD_POSITIVE),
        ("[kinds.cpu-worker]", "memory_gib", BAD_POSITIVE),
        ("[kinds.cpu-worker]", "achievable_fraction", ("0", "1.5", "nan", '"half"')),
        ("[kinds.cpu-worker]", "per_layer_overhead_us", BAD_NONNEG),
        ("[islands.cloud]", "latency_us", BAD_NONNEG),
        ("[islands.edge]", "bandwidth_gbit_per_s", BAD_POSITIVE),
        ("[[nodes]]", "devices", ("0", "-1", "100000", "2000", "1.5", '"4"', "true")),
        ("[[nodes]]#1", "slowdown", ("[1.0]", '["a", 1.0]', "[1.0, nan]", "0", "-2", "inf", '"slow"')),
        ("[[links]]", "latency_ms", ("nan", "-5", "1e308")),
        ("[islands.edge]", "data_gb", ("-1", "nan", "1e308", '"lots"')),
        ("[islands.edge]", "price_usd_per_device_hour", ("-1", "inf", '"cheap"')),
        ("[islands.edge]", "egress_usd_per_gb", ("-0.1", "1e308")),
        ("[[links]]#2", "bandwidth_mbit_per_s", ("0", "inf", '"100 Mbit"', "1e-300")),
    ]
    fields = {"[kinds.cpu-worker]": "kinds.cpu-worker", "[islands.cloud]": "islands.cloud",
              "[islands.edge]": "islands.edge", "[[nodes]]": "nodes[0]", "[[nodes]]#1": "nodes[1]",
              "[[links]]": "links[0]", "[[links]]#2": "links[2]"}
    for section, key, values in keys:
        for v in values:
            yield Case(fam, f"{key}={v}", _toml_case(section, key, v, f"{fields[section]}.{key}"))
    named = [
        ("[[nodes]]", "island", '"nowhere"', "nodes[0].island"), ("[[nodes]]", "island", "3", "nodes[0].island"),
        ("[[nodes]]", "kind", '"ghost"', "nodes[0].kind"), ("[[nodes]]", "name", "12", "nodes[0].name"),
        ("[[nodes]]", "name", '""', "nodes[0].name"), ("[[nodes]]#1", "name", '"cloud0"', "nodes[1].name"),
        ("[[nodes]]", "colour", '"red"', "nodes[0].colour"), ("[kinds.cpu-worker]", "speed", "3", "speed"),
        ("[[links]]", "between", '["cloud"]', "links[0].between"),
        ("[[links]]", "between", '["cloud", "cloud"]', "links[0].between"),
        ("[[links]]", "between", '["cloud", "mars"]', "links[0].between"),
        ("[[links]]", "between", "[1, 2]", "links[0].between[0]"),
        ("[[links]]", "directed", '"yes"', "links[0].directed"),
        ("[[links]]", "trace", '"missing-trace.json"', "missing-trace.json"),
    ]
    for section, key, v, needle in named:
        yield Case(fam, f"{key}={v}", _toml_case(section, key, v, needle))
    yield Case(fam, "latency_fortnights", _toml_text(lambda t: t.replace("latency_ms = 20", "latency_fortnights = 1"),
                                                     "links[0].latency_fortnights: unknown unit"))
    yield Case(fam, "ambiguous-link-end", _toml_text(lambda t: t.replace('name = "end0"', 'name = "end"'),
                                                     "links[1].between: link end 'end' names an island and a node"))
    yield Case(fam, "name=5", _toml_text(lambda t: t.replace('name = "local-small"', "name = 5"), "name"))
    yield Case(fam, "no-name", _toml_text(lambda t: t.replace('name = "local-small"', ""), "name"))
    yield Case(fam, "no-nodes", _toml_text(lambda t: t.split("[[nodes]]")[0], "nodes"))
    yield Case(fam, "no-path-between-islands", _toml_text(lambda t: t.split("[[links]]")[0], "links"))
    yield Case(fam, "invalid-toml", _toml_text(lambda t: t + "\n[[nodes]\n", "invalid TOML"))
    yield Case(fam, "deep-nesting", _toml_text(lambda t: "deep = " + "[" * 3000 + "]" * 3000 + "\n" + t, "nested"))
    yield Case(fam, "depth-40", _toml_text(lambda t: "deep = " + "[" * 40 + "]" * 40 + "\n" + t, "nested"))
    yield Case(fam, "too-large", _toml_text(lambda t: t + "#" * (5 * 2**20) + "\n", "limit"))
    yield Case(fam, "total-devices", _toml_text(
        lambda t: t + "".join(f'\n[[nodes]]\nname = "big{i}"\nisland = "cloud"\nkind = "cpu-worker"\ndevices = 1000\n'
                              for i in range(5)), "nodes[5].devices"))
    for junk, (data, needle) in JUNK.items():
        yield Case(fam, junk, _raw_file("cluster.toml", data, needle))
    yield Case(fam, "directory", lambda ctx: ("cli", ["group", str(ctx.tmp)], (str(ctx.tmp),)))
    yield Case(fam, "missing-file", lambda ctx: ("cli", ["group", str(ctx.tmp / "nope.toml")], ("nope.toml",)))
    yield Case(fam, "plan-entry-bad-memory", _toml_case("[kinds.cpu-worker]", "memory_gib", "nan",
                                                        "memory_gib", entry="plan"))
    # valid mutations
    yield Case(fam, "renamed-node", _toml_text(lambda t: t.replace('name = "cloud0"', 'name = "cloud9"'), ""),
               accept=True)
    yield Case(fam, "other-bandwidth", _toml_case("[[links]]", "bandwidth_mbit_per_s", "250", ""), accept=True)
    yield Case(fam, "big-node", _toml_case("[[nodes]]", "devices", "1024", ""), accept=True)
    yield Case(fam, "plan-entry-renamed", _toml_text(lambda t: t.replace('"edge0"', '"edge7"'), "", entry="plan"),
               accept=True)


def _scenario_text() -> str:
    return (SRC / "scenarios" / "local-small.toml").read_text()


def _toml_argv(ctx: Ctx, path: str, entry: str) -> list[str]:
    if entry == "plan":
        return ["plan", "--cluster", path, "--model", "gpt-tiny", "--global-batch", "8", "-o",
                str(ctx.tmp / "out.json")]
    return ["group", path]


def _toml_case(section: str, key: str, value: str, needle: str, entry: str = "group"):
    return _toml_text(lambda t: toml_set(t, section, key, value), needle, entry=entry)


def _toml_text(edit: Callable[[str], str], needle: str, entry: str = "group"):
    def build(ctx: Ctx):
        path = ctx.write("cluster.toml", edit(_scenario_text()))
        return "cli", _toml_argv(ctx, path, entry), (path, needle) if needle else (path,)
    return build


def _raw_file(name: str, data: bytes, needle: str):
    def build(ctx: Ctx):
        path = ctx.write(name, data)
        return "cli", ["group", path], (path, needle) if needle else (path,)
    return build


# -- JSON families: handwritten mutations plus seeded random leaves ----------------------------


def json_case(fam: str, name: str, base: str, path: tuple, value: Any, needle: str | None = None, *,
              argv: Callable[[Ctx, str], list[str]], entry: str = "cli", accept: bool = False) -> Case:
    def build(ctx: Ctx):
        data = mutate(ctx.bases[base], path, value) if path else value
        p = ctx.write(f"{fam}.json", data)
        n = dotted(path) if needle is None else needle
        return entry, argv(ctx, p), (p, n) if n else (p,)
    return Case(fam, name, build, accept=accept)


def text_case(fam: str, name: str, text: Callable[[Ctx], str | bytes], needle: str, *,
              argv: Callable[[Ctx, str], list[str]], entry: str = "cli") -> Case:
    def build(ctx: Ctx):
        p = ctx.write(f"{fam}.json", text(ctx))
        return entry, argv(ctx, p), (p, needle) if needle else (p,)
    return Case(fam, name, build)


def common_json_junk(fam: str, argv: Callable[[Ctx, str], list[str]], entry: str = "cli") -> Iterator[Case]:
    for top in ([], "text", 3, None, True):
        yield text_case(fam, f"top-{type(top).__name__}", lambda ctx, t=top: json.dumps(t), "top level"
                        if top is not None else "", argv=argv, entry=entry)
    for junk, (data, needle) in JUNK.items():
        yield text_case(fam, junk, lambda ctx, d=data: d, needle, argv=argv, entry=entry)
    yield text_case(fam, "invalid-json", lambda ctx: '{"a": 1,,}', "invalid JSON", argv=argv, entry=entry)
    yield text_case(fam, "deep-100000", lambda ctx: deep_json(100_000), "nested", argv=argv, entry=entry)
    yield text_case(fam, "deep-40", lambda ctx: deep_json(40), "nested", argv=argv, entry=entry)
    yield text_case(fam, "duplicate-key", lambda ctx: '{"a": 1, "a": 2}', "duplicate key", argv=argv, entry=entry)
    yield text_case(fam, "nan-literal", lambda ctx: '{"x": NaN}', "x: must be a finite", argv=argv, entry=entry)
    yield text_case(fam, "huge-literal", lambda ctx: '{"x": 1e999}', "x: must be a finite", argv=argv, entry=entry)
    yield text_case(fam, "long-int", lambda ctx: '{"x": ' + "9" * 5000 + "}", "invalid JSON", argv=argv, entry=entry)
    yield text_case(fam, "lone-surrogate", lambda ctx: '{"x": "\\ud800"}', "x: not valid Unicode", argv=argv,
                    entry=entry)


def random_leaf_cases(fam: str, base: str, base_value: Any, argv: Callable[[Ctx, str], list[str]], *,
                      skip: Callable[[tuple], bool], entry: str = "cli", rng: random.Random) -> Iterator[Case]:
    """:data:`RANDOM_PER_BASE` leaves of ``base_value`` (seeded), each set to a value its field refuses."""
    cands = [(p, v) for p, v in leaves(base_value) if p and not skip(p) and "actions" not in p]
    for path, v in rng.sample(cands, min(RANDOM_PER_BASE, len(cands))):
        if isinstance(v, bool):
            pool: list[Any] = ["yes", 1, [True]]
        elif isinstance(v, (int, float)):
            pool = [float("nan"), float("inf"), -1, 1e308, "x", [], {"v": 1}, True]
        elif isinstance(v, str):
            pool = [5, [], {"v": "x"}, True, ""]
        else:  # null
            pool = [-1, "x"] if v is None else [5]
        bad = rng.choice(pool)
        if isinstance(bad, float) and bad != bad:
            bad_text = "NaN"
        else:
            bad_text = repr(bad)
        needle = "schema_version" if path[-1] in ("format", "schema_version") else dotted(path)
        yield json_case(f"{fam}-random", f"{dotted(path)}={bad_text}", base, path, bad, needle, argv=argv,
                        entry=entry)


def cluster_json_cases(bases: dict[str, Any], rng: random.Random) -> Iterator[Case]:
    fam = "cluster-json"

    def argv(ctx: Ctx, p: str) -> list[str]:
        return ["group", p]

    b = bases["cluster_json"]
    kind = next(iter(b["kinds"]))
    for path, value, needle in [
        (("schema_version",), 2, "schema_version"), (("format",), "deepcee.plan", "schema_version"),
        (("kinds", kind, "peak_flops_per_s"), 1e30, None), (("kinds", kind, "peak_flops_per_s"), -5, None),
        (("kinds", kind, "peak_flops_per_s"), "fast", None), (("kinds", kind, "memory_bytes"), 0, None),
        (("devices", 0, "island"), "nowhere", None), (("devices", 0, "island"), 7, None),
        (("devices", 0, "kind"), "ghost", None), (("devices", 0, "node"), "ghost", None),
        (("devices", 0, "slowdown"), 0, None), (("islands", 0, "latency_s"), -1, None),
        (("islands", 0, "bandwidth_bytes_per_s"), "100 Mbit", None), (("nodes", 0, "devices"), [], None),
        (("nodes", 0, "devices"), "cloud0:0", None), (("links", 0, "between"), ["cloud"], None),
        (("links", 0, "between"), [1, 2], "links[0].between[0]"), (("devices",), MISSING, "devices"),
        (("colour",), "red", "colour"), (("islands", 1, "name"), b["islands"][0]["name"], "islands[1].name"),
        (("devices", 0, "name"), "stranger:0", "devices[0].name"),
        (("nodes", 1, "devices", 0), "cloud0:0", "devices[2].name"),
        (("nodes", 0, "devices"), ["cloud0:0", "cloud0:1", "cloud0:2"], "nodes[0].devices[2]"),
    ]:
        yield json_case(fam, f"{dotted(path)}={value if value is not MISSING else 'missing'}", "cluster_json",
                        path, value, needle, argv=argv)
    yield from common_json_junk(fam, argv)
    renamed = copy.deepcopy(b)
    renamed["devices"][0]["name"] = renamed["nodes"][0]["devices"][0] = "cloud0:renamed"
    yield json_case(fam, "renamed-device", "cluster_json", (), renamed, "", argv=argv, accept=True)
    yield from random_leaf_cases(fam, "cluster_json", b, argv, rng=rng,
                                 skip=lambda p: p[-1] in ("description", "emulation", "source"))


def plan_cases(bases: dict[str, Any], rng: random.Random) -> Iterator[Case]:
    fam = "plan"

    def argv(ctx: Ctx, p: str) -> list[str]:
        return ["simulate", p]

    b = bases["plan"]
    st = ("replicas", 0, "stages", 0)
    for path, value, needle in [
        (("global_batch",), 0, None), (("global_batch",), -1, None), (("global_batch",), 10**12, None),
        (("global_batch",), "8", None), (("global_batch",), 8.5, None), (("global_batch",), None, None),
        (("replicas", 0, "num_microbatches"), 10**9, None), (("replicas", 0, "num_microbatches"), 0, None),
        (("replicas", 0, "schedule"), "fast", None), (("replicas", 0, "schedule"), 3, None),
        ((*st, "devices"), ["ghost:0"], "replicas[0].stages[0].devices[0]"), ((*st, "devices"), [], None),
        ((*st, "devices", 0), 5, None), ((*st, "shares", 0), 0, None), ((*st, "shares", 0), "a", None),
        ((*st, "shares", 0), 1.5, None), ((*st, "layer_start"), -1, None), ((*st, "layer_stop"), 10**6, None),
        ((*st, "layer_stop"), 2, "stages[1].layer_start"), ((*st, "recompute"), "yes", None), ((*st, "sync"), "smoke", None),
        (("strategy", "kind"), "gossip", None), (("strategy", "outer_lr"), float("nan"), None),
        (("estimate", "iteration_s"), -1, None), (("estimate", "iteration_s"), "fast", None),
        (("estimate", "peak_memory_bytes", "cloud0:0"), -1, None), (("cluster",), "nowhere", "cluster"),
        (("cluster",), "", "cluster"), (("model",), "gpt2:seq_len=abc", "model"),
        (("model",), "nonexistent-model", "model"), (("model",), 5, "model"), (("explanation",), 5, None),
        (("explanation", 0), 3, None), (("semantics",), "relaxed", None), (("colour",), "red", None),
        (("replicas",), MISSING, "replicas"), (("replicas", 0, "actions"), [["0X0"]], "actions[0][0]"),
        (("replicas", 0, "actions"), [["5F0"]], "actions[0][0]"), (("schema_version",), 3, None),
    ]:
        yield json_case(fam, f"{dotted(path)}={value if value is not MISSING else 'missing'}", "plan", path,
                        value, needle, argv=argv)
    yield from common_json_junk(fam, argv)
    for name, path, value in (("renamed-system", ("system",), "mine"), ("no-estimate", ("estimate",), None),
                              ("other-explanation", ("explanation",), ["hand-edited"])):
        yield json_case(fam, name, "plan", path, value, "", argv=argv, accept=True)
    yield json_case(fam, "train-global-batch-0", "plan", ("global_batch",), 0, "global_batch",
                    argv=lambda ctx, p: ["--plan", p, "--dry-run"], entry="train")
    yield json_case(fam, "train-unknown-cluster", "plan", ("cluster",), "nowhere", "cluster",
                    argv=lambda ctx, p: ["train", "--plan", p, "--dry-run"])
    yield json_case(fam, "train-unknown-device", "plan", (*st, "devices"), ["ghost:0"],
                    "replicas[0].stages[0].devices[0]", argv=lambda ctx, p: ["train", "--plan", p, "--steps", "1"])
    yield Case(fam, "train-unknown-net", lambda ctx: ("cli", ["train", "--plan", ctx.bases["plan_path"], "--model",
                                                              "ghost-net", "--steps", "1"], ("--model", "ghost-net")))
    yield json_case(fam, "train-net-layers", "plan", ("model",), "resnet-tiny", "model",
                    argv=lambda ctx, p: ["train", "--plan", p, "--steps", "1"])
    yield from random_leaf_cases(fam, "plan", b, argv, rng=rng,
                                 skip=lambda p: p[-1] in ("bottleneck",) or p[:1] == ("explanation",))


def profile_cases(bases: dict[str, Any], rng: random.Random) -> Iterator[Case]:
    fam = "profile"

    def argv(ctx: Ctx, p: str) -> list[str]:
        return ["plan", "--scenario", "local-small", "--profile", p, "--global-batch", "8", "-o",
                str(ctx.tmp / "out.json")]

    b = bases["profile"]
    kind = next(iter(b["measured"]))
    m0 = ("measured", kind, 0)
    for path, value, needle in [
        (("layers", 0, "forward_flops"), float("nan"), None), (("layers", 0, "forward_flops"), -1, None),
        (("layers", 0, "forward_flops"), "x", None), (("layers", 0, "forward_flops"), 1e30, None),
        (("layers", 0, "parameter_count"), 1.5, None), (("layers", 0, "parameter_count"), True, None),
        (("layers", 0, "activation_bytes"), float("inf"), None), ((*m0, "forward"), [float("nan"), 0], None),
        ((*m0, "forward"), [-1, 0], "forward[0]"), ((*m0, "forward"), [0], None), ((*m0, "forward"), "x", None),
        ((*m0, "forward"), [0, 1e9], "forward[1]"), (("measured", kind), [], None),
        (("measured_call_overhead", "ghost"), b["measured_call_overhead"][kind], "ghost"),
        (("input_bytes",), -1, None), (("gradient_bytes_per_parameter",), 1e9, None),
        (("optimizer",), "lion", None), (("dtype",), 5, None), (("hyper", "x"), {"y": 1}, None),
        (("layers",), [], None), (("layers", 0, "colour"), "red", None), (("name",), MISSING, "name"),
        (("schema_version",), 3, None),
    ]:
        yield json_case(fam, f"{dotted(path)}={value if value is not MISSING else 'missing'}", "profile", path,
                        value, needle, argv=argv)
    yield json_case(fam, "5000-layers", "profile", ("layers",), [b["layers"][1]] * 5000, "layers", argv=argv)
    yield from common_json_junk(fam, argv)
    yield json_case(fam, "renamed-layer", "profile", ("layers", 0, "name"), "embedding", "", argv=argv, accept=True)
    yield from random_leaf_cases(fam, "profile", b, argv, rng=rng,
                                 skip=lambda p: p[0] in ("hyper", "source") or p[-1] == "name")
    pargs = lambda ctx, p: [p]  # noqa: E731
    for path, value, needle in [
        (("layers", 0, "passes", "F", "median_s", 0), -1, None), (("wall_s",), float("nan"), None),
        (("timer",), "sundial", None), (("layers", 0, "microbatch_sizes"), [1], None),
        (("score", "flops_per_s"), 0 - 1, None), (("layers",), MISSING, "layers"),
    ]:
        yield json_case("probe", f"{dotted(path)}={value if value is not MISSING else 'missing'}", "probe", path,
                        value, needle, argv=pargs, entry="probe")
    yield from common_json_junk("probe", pargs, entry="probe")


def trace_cases(bases: dict[str, Any]) -> Iterator[Case]:
    fam = "trace"

    def argv(ctx: Ctx, p: str) -> list[str]:
        return ["simulate", ctx.bases["plan_path"], "--link-trace", p]

    for path, value, needle in [
        (("times_s",), [0, float("nan")], "times_s[1]"), (("times_s",), [0, -5], "times_s[1]"),
        (("times_s",), [20, 0], "times_s"), (("times_s",), [0, 1e308], "times_s[1]"),
        (("times_s",), ["0", 20], "times_s[0]"), (("times_s",), [], "times_s"),
        (("times_s",), [0], "bandwidth_mbit_per_s"),
        (("bandwidth_mbit_per_s",), [100, 0], "bandwidth_mbit_per_s[1]"),
        (("bandwidth_mbit_per_s",), [100, -20], "bandwidth_mbit_per_s[1]"),
        (("bandwidth_mbit_per_s",), [100, float("nan")], "bandwidth_mbit_per_s[1]"),
        (("bandwidth_mbit_per_s",), [100, "20"], "bandwidth_mbit_per_s[1]"),
        (("bandwidth_mbit_per_s",), [1e308, 20], "bandwidth_mbit_per_s[0]"),
        (("bandwidth_bytes_per_s",), [1e7, 2e6], "bandwidth_mbit_per_s"),
        (("bandwidth_mbit_per_s",), MISSING, "bandwidth_mbit_per_s"), (("colour",), 1, None),
        (("schema_version",), 2, None), (("description",), 5, None), (("times_s",), "0, 20", None),
    ]:
        yield json_case(fam, f"{dotted(path)}={value if value is not MISSING else 'missing'}", "trace", path,
                        value, needle, argv=argv)
    yield from common_json_junk(fam, argv)
    yield text_case(fam, "1000001-points", lambda ctx: json.dumps(
        {"times_s": list(range(1_000_001)), "bandwidth_mbit_per_s": [100] * 1_000_001}), "times_s", argv=argv)
    yield text_case(fam, "too-large", lambda ctx: json.dumps({"description": "x" * (33 * 2**20)}), "limit",
                    argv=argv)
    yield Case(fam, "unknown-name", lambda ctx: ("cli", ["simulate", ctx.bases["plan_path"], "--link-trace", "nope"],
                                                 ("--link-trace", "nope")))
    yield Case(fam, "in-cluster-file", _trace_in_cluster)
    yield json_case(fam, "shifted", "trace", ("times_s",), [5, 25], "", argv=argv, accept=True)
    yield json_case(fam, "slower", "trace", ("bandwidth_mbit_per_s",), [50, 10], "", argv=argv, accept=True)


def _trace_in_cluster(ctx: Ctx) -> tuple[str, list[str], tuple[str, ...]]:
    trace = ctx.write("t.json", mutate(ctx.bases["trace"], ("times_s",), [0, float("nan")]))
    cluster = ctx.write("c.toml", toml_set(_scenario_text(), "[[links]]", "trace", '"t.json"'))
    return "cli", ["group", cluster], (cluster, "links[0].trace", trace, "times_s[1]")


def model_spec_cases() -> Iterator[Case]:
    fam = "model-spec"

    def spec(ref: str, needle: str = "--model", *, scenario: str = "local-small", accept: bool = False,
             extra: tuple[str, ...] = ()) -> Case:
        def build(ctx: Ctx):
            return "cli", ["plan", "--scenario", scenario, "--model", ref, "--global-batch", "8", "-o",
                           str(ctx.tmp / "out.json"), *extra], (needle,) if needle else ()
        return Case(fam, ref + "".join(extra) or "(empty)", build, accept=accept)

    for ref in ("gpt2:seq_len=abc", "gpt2:seq_len=-1", "gpt2:seq_len=0", "gpt2:seq_len=1e9",
                "gpt2:seq_len=1000000000", "gpt2:seq_len=2000", "gpt2:seq_len", "gpt2:=5", ":seq_len=5",
                "gpt2:colour=red", "gpt2:dtype=fp8", "gpt2:optimizer=lion", "gpt2:seq_len=512,seq_len=256",
                "llama:hidden_size=0", "llama:hidden_size=nan", "llama:num_layers=100000", "llama:num_layers=2000",
                "llama:num_heads=3", "llama:num_kv_heads=5", "llama:vocab_size=1000000000", "resnet50:image_size=0",
                "resnet50:seq_len=5", "gpt2:image_size=32", "nonexistent", "gpt2:hidden_size=10", "",
                "gpt2:seq_len=\u0661\u0662"):
        yield spec(ref)
    yield spec("gpt2", "--seq-len", extra=("--seq-len", "0"))
    yield spec("gpt2", "--seq-len", extra=("--seq-len", "abc"))
    yield spec("resnet50", "--image-size", extra=("--image-size", "-5"))
    yield spec("llama:num_layers=1000", "PLANNER_MEMORY_BYTES", scenario="cee-testbed")
    yield spec("gpt2:seq_len=512", "", accept=True)
    yield spec("llama:hidden_size=256,num_layers=2,num_heads=4,ffn_size=512,vocab_size=1000", "", accept=True)


def cli_number_cases() -> Iterator[Case]:
    fam = "cli-numbers"
    cases: list[tuple[str, list[str], tuple[str, ...]]] = []
    for v in ("0", "-1", "1000000000000", "nan", "abc", "1.5"):
        cases.append((f"plan --global-batch {v}", ["plan", "--scenario", "local-small", "--model", "gpt-tiny",
                                                    "--global-batch", v], ("--global-batch",)))
    for v in ("0", "1000000000000"):
        cases.append((f"compare --global-batch {v}", ["compare", "--scenario", "local-small", "--model", "gpt-tiny",
                                                       "--global-batch", v], ("--global-batch",)))
    for v in ("0", "-1", "nan", "10000000", "abc", "2.5"):
        cases.append((f"simulate --iterations {v}", ["simulate", "@plan", "--iterations", v], ("--iterations",)))
    cases.append(("simulate work limit", ["simulate", "@plan", "--iterations", "1000000"], ("MAX_SIMULATION_WORK",)))
    cases.append(("simulate --adapt work limit", ["simulate", "@plan", "--iterations", "600000", "--adapt",
                                                  "--link-trace", "drop-5x"], ("MAX_SIMULATION_WORK",)))
    cases.append(("simulate --trace-links", ["simulate", "@plan", "--link-trace", "drop-5x", "--trace-links", "cloud"],
                  ("--trace-links",)))
    for flag, v in (("--stages", "0"), ("--microbatches", "0"), ("--microbatches", "1000000"), ("--stages", "2000"),
                    ("--stages", "nan")):
        cases.append((f"schedule show {flag} {v}", ["schedule", "show", "1f1b", flag, v], (flag,)))
    cases.append(("schedule cells", ["schedule", "show", "1f1b", "--stages", "16", "--microbatches", "10000"],
                  ("MAX_SCHEDULE_CELLS",)))
    train = [("--steps", ("0", "-5", "abc", "10000000000")), ("--cores", ("nan", "0", "-1", "inf")),
             ("--checkpoint-every", ("-1", "1.5")), ("--timeout", ("nan", "0", "-1", "inf")),
             ("--deadline", ("-1", "0", "nan")), ("--lr", ("nan", "-1", "inf")), ("--momentum", ("1.5", "-0.1", "1")),
             ("--seed", ("-1", "abc", "1e20")), ("--trace-time-scale", ("0", "nan"))]
    for flag, values in train:
        for v in values:
            cases.append((f"train {flag} {v}", ["train", "--plan", "@plan", flag, v], (flag, v)))
    for flag, v in (("--timeout", "nan"), ("--deadline", "-1"), ("--cores", "nan"), ("--checkpoint-every", "-1")):
        cases.append((f"python -m deepcee.train {flag} {v}", ["@train", "--plan", "@plan", flag, v], (flag, v)))
    for v in ("-1", "nan", "0"):
        cases.append((f"profile --deadline {v}", ["profile", "--scenario", "local-small", "--deadline", v],
                      ("--deadline",)))
    for flag, v in (("--island-threshold-ms", "-1"), ("--island-threshold-ms", "nan"), ("--speed-ratio", "0.5"),
                    ("--speed-ratio", "nan"), ("--speed-ratio", "inf")):
        cases.append((f"group {flag} {v}", ["group", "--scenario", "local-small", flag, v], (flag,)))
    for flag, v in (("--plans", "0"), ("--plans", "-1"), ("--plans", "1000000"), ("--steps", "0"), ("--steps", "1")):
        cases.append((f"validate {flag} {v}", ["validate", "--scenario", "local-small", flag, v], (flag,)))
    for flag, v in (("--global-batch", "0"), ("--steps", "1"), ("--steps", "1000000000")):
        cases.append((f"demo {flag} {v}", ["demo", flag, v], (flag,)))
    for v in ("foo", ",", "gpipe,foo"):
        cases.append((f"plan --schedules {v}", ["plan", "--model", "gpt2", "--global-batch", "8", "--schedules", v],
                      ("--schedules",)))
    cases.append(("simulate --trace-links x,y", ["simulate", "@plan", "--link-trace", "drop-5x", "--trace-links",
                                                 "x,y"], ("--trace-links", "'x'")))
    cases.append(("--scenario and --cluster", ["plan", "--scenario", "local-small", "--cluster", "c.toml", "--model",
                                               "gpt2", "--global-batch", "8"], ("--cluster", "--scenario")))
    cases.append(("schedule show foo", ["schedule", "show", "foo"], ("foo",)))
    cases.append(("group --scenario nowhere", ["group", "--scenario", "nowhere"], ("--scenario", "nowhere")))
    for v in ("ghost:2", "cloud0:0:abc", "cloud0:0:1e308", "cloud0:0:0", "cloud0:0:2:nan", "cloud0:0:2:5:1"):
        cases.append((f"simulate --straggler {v}", ["simulate", "@plan", "--straggler", v], ("--straggler",)))
    for v in ("ghost:2", "cloud0:0:1e308"):
        cases.append((f"train --straggler {v}", ["train", "--plan", "@tinyplan", "--straggler", v], ("--straggler",)))
    for flag, v in (("--budget", "-5"), ("--budget", "nan"), ("--epochs", "0"), ("--dataset-samples", "inf"),
                    ("--sync", "loose"), ("--objective", "fame")):
        cases.append((f"plan {flag} {v}", ["plan", "--model", "gpt2", "--global-batch", "8", flag, v], (flag,)))
    for command in ("profile", "validate", "demo"):
        cases.append((f"{command} --model foo", [command, "--model", "foo"], ("--model", "'foo'")))
    cases.append(("unknown flag", ["plan", "--model", "gpt2", "--global-batch", "8", "--colour", "red"],
                  ("--colour",)))
    cases.append(("missing required", ["plan", "--scenario", "local-small", "--model", "gpt2"], ("--global-batch",)))
    cases.append(("no model", ["plan", "--scenario", "local-small", "--global-batch", "8"], ("--model",)))
    for name, argv, needles in cases:
        yield Case(fam, name, _cli(argv, needles))
    yield Case(fam, "schedule show valid", _cli(["schedule", "show", "1f1b", "--stages", "2", "--microbatches", "4"],
                                                ()), accept=True)
    yield Case(fam, "group valid ratio", _cli(["group", "--scenario", "local-small", "--speed-ratio", "2"], ()),
               accept=True)


def _cli(argv: list[str], needles: tuple[str, ...]):
    def build(ctx: Ctx):
        paths = {"@plan": ctx.bases["plan_path"], "@tinyplan": ctx.bases["tiny_plan_path"]}
        args = [paths.get(a, a) for a in argv]
        if args and args[0] == "@train":
            return "train", args[1:], needles
        return "cli", args, needles
    return build


CALIBRATION = {"format": "deepcee.efficiency", "schema_version": 1, "model": "gpt2", "target_loss": 3.0,
               "source": "fuzz base", "reference": {"global_batch": 8, "steps_to_target": 500},
               "entries": [{"strategy": {"kind": "model-averaging", "period": 4}, "multiplier": 1.2, "replicas": 2}]}


def efficiency_cases() -> Iterator[Case]:
    """``deepcee plan --sync relaxed --efficiency e.json``: a calibration file, refused before planning."""
    fam = "efficiency"

    def argv(ctx: Ctx, p: str) -> list[str]:
        return ["plan", "--scenario", "local-small", "--model", "gpt2", "--global-batch", "8", "--sync", "relaxed",
                "--efficiency", p, "-o", str(ctx.tmp / "out.json")]

    e0 = ("entries", 0)
    for path, value, needle in [
        ((*e0, "multiplier"), -1, None), ((*e0, "multiplier"), 0, None), ((*e0, "multiplier"), float("nan"), None),
        ((*e0, "multiplier"), "x", None), ((*e0, "strategy", "kind"), "gossip", None),
        ((*e0, "strategy", "period"), 0, None), ((*e0, "strategy", "colour"), 1, None), ((*e0, "replicas"), -2, None),
        (("reference", "steps_to_target"), -5, None), (("reference", "global_batch"), 0, None),
        (("target_loss",), "low", None), (("entries",), {"a": 1}, None), (("format",), "x", "schema_version"),
        (("colour",), 1, None),
    ]:
        yield json_case(fam, f"{dotted(path)}={value if value is not MISSING else 'missing'}", "efficiency", path,
                        value, needle, argv=argv)
    yield from common_json_junk(fam, argv)


def job_config_cases() -> Iterator[Case]:
    """``deepcee train --config job.toml``: mutations of the shipped example, refused before any process."""
    fam = "job-config"
    for section, key, value, needle in [
        ("[training]", "steps", '"ten"', "training.steps"), ("[training]", "steps", "-3", "training.steps"),
        ("[training]", "steps", "nan", "training.steps"), ("[training]", "cores", "inf", "training.cores"),
        ("[training]", "clip_grad_norm", "0", "training.clip_grad_norm"),
        ("[optimizer]", "lr", "1e308", "optimizer.lr"), ("[optimizer]", "weight_decay", "-1", "optimizer.weight_decay"),
        ("[lr_schedule]", "min_lr_ratio", "1.5", "lr_schedule.min_lr_ratio"),
        ("[lr_schedule]", "warmup_steps", "-5", "lr_schedule.warmup_steps"),
        ("[checkpoint]", "every", "-1", "checkpoint.every"), ("[eval]", "batches", "0", "eval.batches"),
        ("[plan]", "global_batch", "1000000000000", "plan.global_batch"),
        ("[plan]", "schedules", '["gpipe", "warp"]', "plan.schedules"), ("[plan]", "schedules", "[1, 2]", "plan.schedules"),
        ("[model]", "name", "3", "model.name"), ("[training]", "stepz", "3", "training.stepz"),
        ("[training]", "timeout_s", "-1", "training.timeout_s"),
    ]:
        yield Case(fam, f"{section}{key}={value}", _job_text(lambda t, a=section, k=key, v=value: toml_set(t, a, k, v),
                                                            needle))
    yield Case(fam, "unknown-section", _job_text(lambda t: t + "\n[trainin]\nsteps = 3\n", "[trainin]"))
    yield Case(fam, "deep-nesting", _job_text(lambda t: "x = " + "[" * 3000 + "]" * 3000 + "\n" + t, "nested"))
    for junk, (data, needle) in JUNK.items():
        if junk not in ("empty", "whitespace"):  # an empty job config is valid: every option at its default
            yield Case(fam, junk, lambda ctx, d=data, n=needle: ("cli", ["train", "--config", ctx.write("job.toml", d),
                                                                         "--run-dir", str(ctx.tmp / "run")],
                                                                 (str(ctx.tmp / "job.toml"), n)))


def _job_text(edit: Callable[[str], str], needle: str):
    def build(ctx: Ctx):
        path = ctx.write("job.toml", edit((HERE.parents[1] / "examples" / "job.toml").read_text()))
        return "cli", ["train", "--config", path, "--run-dir", str(ctx.tmp / "run")], (path, needle)
    return build


def subprocess_cases() -> Iterator[Case]:
    fam = "subprocess"
    yield Case(fam, "binary cluster", lambda ctx: ("subprocess", ["group", ctx.write("c.toml", bytes(range(256)))],
                                                    ("binary",)))
    yield Case(fam, "nan trace time", lambda ctx: ("subprocess", ["simulate", ctx.bases["plan_path"], "--link-trace",
                                                                  ctx.write("t.json", '{"times_s": [0, NaN], '
                                                                            '"bandwidth_mbit_per_s": [100, 20]}')],
                                                   ("times_s[1]",)))
    yield Case(fam, "plan top-level list", lambda ctx: ("subprocess", ["simulate", ctx.write("p.json", "[1, 2]")],
                                                        ("top level",)))
    yield Case(fam, "global batch 0", lambda ctx: ("subprocess", ["plan", "--model", "gpt2", "--global-batch", "0"],
                                                   ("--global-batch",)))
    yield Case(fam, "torchrun entry timeout nan", lambda ctx: ("subprocess-train", ["--plan", ctx.bases["plan_path"],
                                                                                    "--timeout", "nan"],
                                                               ("--timeout", "nan")))
    yield Case(fam, "deep JSON profile", lambda ctx: ("subprocess", ["plan", "--profile", ctx.write(
        "p.json", deep_json(100_000)), "--global-batch", "8", "--model", "gpt-tiny"], ("nested",)))


def all_cases() -> list[Case]:
    """Every case, in a fixed order (the seeded families draw from one ``random.Random(SEED)``)."""
    bases = load_static_bases()
    rng = random.Random(SEED)
    out = [*cluster_toml_cases(), *cluster_json_cases(bases, rng), *plan_cases(bases, rng),
           *profile_cases(bases, rng), *trace_cases(bases), *model_spec_cases(), *cli_number_cases(),
           *job_config_cases(), *efficiency_cases(), *subprocess_cases()]
    ids = Counter(c.id for c in out)
    dup = [i for i, n in ids.items() if n > 1]
    assert not dup, dup
    return out


# -- base files -------------------------------------------------------------------------------

PLAN_BASE = HERE / "golden" / "fuzz-plan-local-small-gpt2.json"
"""Written by ``deepcee plan --scenario local-small --model gpt2 --global-batch 8`` (5 stages, compact)."""


def load_static_bases() -> dict[str, Any]:
    """The base files that need no planner run (read at collection time)."""
    from deepcee.cluster import cluster_to_dict
    from deepcee.scenarios import load_scenario

    return {
        "cluster_json": json.loads(json.dumps(cluster_to_dict(load_scenario("local-small")))),
        "plan": json.loads(PLAN_BASE.read_text()),
        "profile": json.loads((HERE / "golden" / "local-small-measured-gpt-tiny.json").read_text()),
        "trace": json.loads((SRC / "traces" / "drop-5x.json").read_text()),
        "probe": probe_record(),
        "efficiency": CALIBRATION,
        "tiny_plan": tiny_plan(),
    }


def tiny_plan() -> dict[str, Any]:
    """A two-stage ``gpt-tiny`` plan on ``local-small`` (a net the runtime builds)."""
    from deepcee.plan import Plan, StagePlan

    return Plan(system="fuzz", cluster="local-small", model="gpt-tiny", global_batch=4, microbatch_size=2,
                num_microbatches=2, schedule="1f1b",
                stages=(StagePlan(layer_start=0, layer_stop=3, devices=("cloud0:0",), shares=(2,)),
                        StagePlan(layer_start=3, layer_stop=6, devices=("edge0:0",), shares=(2,)))).to_dict()


def probe_record() -> dict[str, Any]:
    """A device probe record as a profiler rank writes it (two layers, made-up medians)."""
    from deepcee.profiler.probes import (
        PASSES,
        ComputeScore,
        DeviceProbe,
        LayerProbe,
        pass_fit,
        probe_to_dict,
    )

    sizes = (1, 2, 4)
    fit = {p: pass_fit(sizes, [[1e-3 * n, 1.1e-3 * n] for n in sizes]) for p in PASSES}
    layers = tuple(LayerProbe(name=f"l{i}", microbatch_sizes=sizes, passes=fit, first_stage=None, rounds=3,
                              peak_memory_bytes=1e6, activation_bytes_per_sample=1e3) for i in range(2))
    probe = DeviceProbe(device="cloud0:0", torch_device="cpu", kind="cpu-worker", timer="thread-cpu",
                        memory_method="estimate", slowdown=1.0, dilation=1.0, emulated=True, layers=layers,
                        score=ComputeScore(flops_per_s=1e10, benchmarks={"matmul": 1e10}), wall_s=3.0)
    return json.loads(json.dumps(probe_to_dict(probe)))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(HERE))
    cases = all_cases()
    by = Counter((c.family, "valid" if c.accept else "bad") for c in cases)
    for fam in sorted({c.family for c in cases}):
        print(f"{fam:20s} bad {by[(fam, 'bad')]:4d}  valid {by[(fam, 'valid')]:3d}")
    print(f"{'total':20s} {len(cases)}")
