"""Where the work limits of :mod:`deepcee.inputs.limits` come from: time and memory of one
command at growing sizes.

Each case runs in its own process (memory capped at ``--memory-gib``, CPU time at ``--cpu-s``)
and reports wall seconds, CPU seconds and peak resident memory:

- planning (:func:`~deepcee.planner.search.plan_training` without the work check, ``gpt2``
  unless stated) against the device count (16 islands; one island; one node), the global batch
  and the layer count (``llama-1b`` with ``num_layers`` overridden), giving ``MAX_DEVICES``,
  ``MAX_DEVICES_PER_NODE``, ``MAX_GLOBAL_BATCH`` and ``PLANNER_BYTES_PER_CELL`` (peak memory
  over devices x (layers + 1)**2);
- simulation of the ``cee-testbed`` ``gpt2`` plan for growing iteration counts, giving the
  seconds and bytes per unit of simulator work (``MAX_SIMULATION_WORK``);
- ``deepcee schedule show`` sizes (stages x microbatches, ``MAX_SCHEDULE_CELLS``);
- TOML and JSON parse throughput (``MAX_TOML_BYTES``, ``MAX_JSON_BYTES``).

The project machine has 2 cores shared with other work: compare CPU seconds (one process is
single-threaded, so on an idle machine its wall time is its CPU time), and read wall times as
orders of magnitude. Run: ``python benchmarks/input_limits.py [--quick]
[--out reports/input_limits.json]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
    resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
    sys.path.insert(0, {bench!r})
    from unittest import mock
    w0, c0 = time.perf_counter(), time.process_time()
    with mock.patch("deepcee.planner.search.check_planning"):  # measure past the limits
        out = ({expr})
    print(json.dumps({{"wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "result": out}}))
""")

SETUP = {
    "plan": "from planning_time import synthetic_cluster; from deepcee.models import get_model; "
            "from deepcee.planner.search import plan_training; from deepcee.scenarios import load_scenario; "
            "from input_limits import one_node",
    "simulate": "from deepcee.models import get_model; from deepcee.planner.search import plan_training; "
                "from deepcee.scenarios import load_scenario; from deepcee.simulator.engine import simulate; "
                "from deepcee.inputs.work import simulation_work",
    "schedule": "from deepcee.schedule.builders import build_schedule; "
                "from deepcee.schedule.passes import dry_run, format_table, validate",
}


def one_node(num_devices: int):
    """One node of ``num_devices`` GPUs in one island (the ``MAX_DEVICES_PER_NODE`` case)."""
    from deepcee.cluster import Cluster, Device, Island, LinkSpec, Node
    from planning_time import KINDS

    names = tuple(f"n0:{j}" for j in range(num_devices))
    return Cluster(name=f"one-node-{num_devices}", kinds=KINDS,
                   islands=(Island(name="site", intra=LinkSpec(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9)),),
                   nodes=(Node(name="n0", island="site", kind="rtx3090", devices=names,
                               intra=LinkSpec(latency_s=10e-6, bandwidth_bytes_per_s=12.5e9)),),
                   devices=tuple(Device(name=d, kind="rtx3090", node="n0", island="site") for d in names))


def plan_case(cluster: str, model: str, batch: int) -> str:
    return (f"(lambda c, m: {{'devices': len(c.devices), 'layers': m.num_layers, "
            f"'plan': plan_training(c, m, {batch}).plan.system}})({cluster}, {model})")


def cases(quick: bool) -> list[tuple[str, str, str]]:
    """(name, kind, expression)."""
    gpt2 = "get_model('gpt2')"
    out = [
        ("plan 1,024 devices / 16 islands", "plan", plan_case("synthetic_cluster(1024, 16)", gpt2, 1024)),
        ("plan 4,096 devices / 16 islands", "plan", plan_case("synthetic_cluster(4096, 16)", gpt2, 1024)),
        ("plan 4,096 devices / 1 island", "plan", plan_case("synthetic_cluster(4096, 1)", gpt2, 1024)),
        ("plan 1,024 devices / 1 node", "plan", plan_case("one_node(1024)", gpt2, 1024)),
        ("plan cee-testbed batch 2**20", "plan", plan_case("load_scenario('cee-testbed')", gpt2, 2**20)),
        ("plan 1,024 devices batch 2**20", "plan", plan_case("synthetic_cluster(1024, 16)", gpt2, 2**20)),
        ("plan cee-testbed llama 130 layers", "plan",
         plan_case("load_scenario('cee-testbed')", "get_model('llama-1b', num_layers=128)", 64)),
        ("plan 1,024 devices llama 34 layers", "plan",
         plan_case("synthetic_cluster(1024, 16)", "get_model('llama-1b', num_layers=32)", 1024)),
        ("simulate cee-testbed gpt2 x 100", "simulate", _simulate(100)),
        ("simulate cee-testbed gpt2 x 300", "simulate", _simulate(300)),
        ("schedule zb-h1 4 x 4,000", "schedule", _schedule(4, 4000)),
        ("schedule zb-h1 16 x 1,000", "schedule", _schedule(16, 1000)),
    ]
    if not quick:
        out += [
            ("plan 2,048 devices / 1 node", "plan", plan_case("one_node(2048)", gpt2, 1024)),
            ("plan 1,024 devices / 1 island", "plan", plan_case("synthetic_cluster(1024, 1)", gpt2, 1024)),
            ("plan 2,048 devices / 1 island", "plan", plan_case("synthetic_cluster(2048, 1)", gpt2, 1024)),
            ("plan 4,096 devices / 4 islands", "plan", plan_case("synthetic_cluster(4096, 4)", gpt2, 1024)),
            ("plan 16,384 devices / 16 islands", "plan", plan_case("synthetic_cluster(16384, 16)", gpt2, 1024)),
            ("plan cee-testbed batch 2**24", "plan", plan_case("load_scenario('cee-testbed')", gpt2, 2**24)),
            ("plan cee-testbed llama 258 layers", "plan",
             plan_case("load_scenario('cee-testbed')", "get_model('llama-1b', num_layers=256)", 64)),
            ("plan 1,024 devices llama 66 layers", "plan",
             plan_case("synthetic_cluster(1024, 16)", "get_model('llama-1b', num_layers=64)", 1024)),
            ("simulate cee-testbed gpt2 x 1,000", "simulate", _simulate(1000)),
            ("schedule zb-h1 16 x 3,000", "schedule", _schedule(16, 3000)),
        ]
    return out


def _simulate(iterations: int) -> str:
    return (f"(lambda c, m: (lambda p: {{'work': simulation_work(p, {iterations}), "
            f"'iteration_s': simulate(p, c, m, iterations={iterations}).iteration_s}})"
            "(plan_training(c, m, 64).plan))(load_scenario('cee-testbed'), get_model('gpt2'))")


def _schedule(stages: int, microbatches: int) -> str:
    return (f"(lambda s: (validate(s), len(format_table(s)), dry_run(s, forward_s=[1.0]*{stages}, "
            f"input_grad_s=[1.0]*{stages}, weight_grad_s=[1.0]*{stages}, comm_forward=[(0.0, 0.0)]*{stages - 1}, "
            f"comm_backward=[(0.0, 0.0)]*{stages - 1}).makespan_s, {{'cells': {stages * microbatches}}})[-1])"
            f"(build_schedule('zb-h1', {stages}, {microbatches}))")


def run_case(kind: str, expr: str, *, memory_gib: float, cpu_s: float) -> dict:
    """One case in its own process, capped at ``memory_gib`` of address space and ``cpu_s`` CPU
    seconds (CPU, not wall: on a shared machine wall time measures the neighbours too)."""
    cap = int(memory_gib * 2**30)
    code = SETUP[kind] + "\n" + _CHILD.format(cap=cap, cpu=int(cpu_s), bench=str(HERE), expr=expr)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE)
    if proc.returncode < 0:
        return {"error": f"over {cpu_s:.0f} CPU s (signal {-proc.returncode})"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": last[:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_rates() -> dict:
    """TOML and JSON parse throughput on files of the sizes the limits allow."""
    import time
    import tomllib

    toml = "".join(f'[[nodes]]\nname = "n{i}"\nisland = "a"\nkind = "k"\ndevices = 4\n' for i in range(20_000))
    data = json.dumps({"times_s": [i * 0.5 for i in range(500_000)],
                       "bandwidth_mbit_per_s": [100.0 + i % 7 for i in range(500_000)]})
    t0 = time.perf_counter()
    tomllib.loads(toml)
    t1 = time.perf_counter()
    json.loads(data)
    t2 = time.perf_counter()
    return {"toml_mb_per_s": len(toml) / 1e6 / (t1 - t0), "json_mb_per_s": len(data) / 1e6 / (t2 - t1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the cases beyond the limits (minutes each)")
    ap.add_argument("--memory-gib", type=float, default=8.0)
    ap.add_argument("--cpu-s", type=float, default=120.0, help="CPU-time cap per case")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--out", default="reports/input_limits.json")
    args = ap.parse_args()
    rows = []
    print(f"{'case':38s} {'wall s':>8s} {'cpu s':>8s} {'peak MiB':>9s}  result")
    for name, kind, expr in (c for c in cases(args.quick) if args.only in c[0]):
        r = run_case(kind, expr, memory_gib=args.memory_gib, cpu_s=args.cpu_s)
        rows.append({"case": name, **r})
        if "error" in r:
            print(f"{name:38s} {'-':>8s} {'-':>8s} {'-':>9s}  {r['error']}")
        else:
            print(f"{name:38s} {r['wall_s']:8.1f} {r['cpu_s']:8.1f} {r['peak_rss_bytes'] / 2**20:9.0f}  {r['result']}")
    rates = parse_rates()
    print(f"parse: TOML {rates['toml_mb_per_s']:.2f} MB/s, JSON {rates['json_mb_per_s']:.0f} MB/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cases": rows, "parse": rates}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
