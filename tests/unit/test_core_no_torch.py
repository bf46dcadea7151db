"""The torch-free core must import without torch (fast CLI, fast tests)."""

from __future__ import annotations

import subprocess
import sys

CORE = [
    "deepcee.cluster", "deepcee.cluster.parts", "deepcee.cluster.routing", "deepcee.cluster.model",
    "deepcee.cluster.files", "deepcee.profile", "deepcee.plan", "deepcee.schedule", "deepcee.schedule.builders",
    "deepcee.schedule.passes", "deepcee.schedule.program", "deepcee.schedule.interpreter", "deepcee.simulator",
    "deepcee.comm", "deepcee.simulator.memory", "deepcee.cluster.stragglers", "deepcee.simulator.network",
    "deepcee.simulator.pipelines", "deepcee.simulator.replicas", "deepcee.simulator.strategies",
    "deepcee.simulator.replica_trace", "deepcee.planner.efficiency", "deepcee.planner.objective",
    "deepcee.planner.replicas", "deepcee.planner.relaxed_baselines",
    "deepcee.scenarios", "deepcee.units", "deepcee.errors", "deepcee.jsonio", "deepcee.inputs",
    "deepcee.inputs.work", "deepcee.planfile", "deepcee.cliargs",
]
OPTIONAL = [
    "deepcee.models", "deepcee.schedule.compact", "deepcee.simulator.engine", "deepcee.simulator.trace",
    "deepcee.planner", "deepcee.planner.search", "deepcee.planner.grouping", "deepcee.planner.cost_model",
    "deepcee.planner.baselines", "deepcee.planner.bound", "deepcee.planner.compare", "deepcee.adapter.policy", "deepcee.adapter.monitor", "deepcee.adapter.simloop", "deepcee.traces",
    "deepcee.profiler.probes", "deepcee.cli", "deepcee.train", "deepcee.api", "deepcee.userref", "deepcee._callable",
    "deepcee.jobconfig", "deepcee.runtime.machines",
    "deepcee.runtime.lr", "deepcee.runtime.runlock", "deepcee.runtime.checkpoint",
]


def test_core_never_imports_torch() -> None:
    code = (
        "import importlib, importlib.util, sys\n"
        f"mods = {CORE!r}\n"
        f"for m in {OPTIONAL!r}:\n"
        "    if importlib.util.find_spec(m) is not None: mods.append(m)\n"
        "for m in mods: importlib.import_module(m)\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "print(len(mods), bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert int(out.stdout.split()[0]) >= len(CORE)
