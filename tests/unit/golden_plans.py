"""A fixed set of planner instances and what the planner, simulator and baselines make of them.

Refactorings must not change behaviour: ``tests/unit/test_golden_plans.py`` checks that every
instance below still gives the same plans, estimates and explanations, bit for bit (JSON floats
round-trip exactly), as recorded in ``tests/unit/golden/plans.json``.

When a change is *meant* to alter plans (a better search, a new cost term), regenerate the
record and say so in the commit message::

    python tests/unit/golden_plans.py --write

Instances: the main job's planner call on a recorded measured profile of ``local-small``
(``golden/local-small-measured-*.json``), the built-in scenarios with analytic models, and
random clusters from ``conftest`` with analytic and measured toy models.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
RECORD = GOLDEN / "plans.json"

sys.path.insert(0, str(HERE))


@dataclass(frozen=True)
class Instance:
    name: str
    build: Callable[[], tuple[Any, Any, int]]
    """() -> (cluster, model profile, global batch)."""
    baselines: bool = False
    compare: bool = False


def _scenario(scenario: str, model: str, batch: int, **shape: Any) -> Callable[[], tuple[Any, Any, int]]:
    def build():
        from deepcee.models import get_model
        from deepcee.scenarios import load_scenario

        return load_scenario(scenario), get_model(model, **shape), batch
    return build


def _measured_main_job() -> tuple[Any, Any, int]:
    from deepcee.cluster import load_cluster
    from deepcee.profile import load_profile

    return (load_cluster(GOLDEN / "local-small-measured-cluster.json"),
            load_profile(GOLDEN / "local-small-measured-gpt-tiny.json"), 32)


def _random(seed: int, measured: bool) -> Callable[[], tuple[Any, Any, int]]:
    def build():
        from conftest import measured_model, random_cluster, toy_model

        rng = random.Random(1000 + seed)
        cluster = random_cluster(rng, name=f"rand{seed}")
        layers = rng.randint(4, 10)
        if measured:
            model = toy_model(layers)
            for i, kind in enumerate(sorted({cluster.device(d).kind for d in cluster.device_names})):
                m = measured_model(kind, layers, seed=seed * 10 + i)
                model = model.with_measured(kind, m.measured[kind], source="test",
                                            call_overhead=m.measured_call_overhead.get(kind))
        else:
            model = toy_model(layers, params=rng.choice([2_000_000, 20_000_000, 80_000_000]))
        return cluster, model, rng.choice([8, 16, 32, 64])
    return build


INSTANCES: tuple[Instance, ...] = (
    Instance("main-job-measured", _measured_main_job, baselines=True, compare=True),
    Instance("local-small/gpt-tiny/32", _scenario("local-small", "gpt-tiny", 32), baselines=True),
    Instance("local-small/resnet-tiny/64", _scenario("local-small", "resnet-tiny", 64)),
    Instance("testbed/gpt2/64", _scenario("cee-testbed", "gpt2", 64), baselines=True, compare=True),
    Instance("testbed/resnet50/64", _scenario("cee-testbed", "resnet50", 64), baselines=True),
    Instance("testbed/resnet101/128", _scenario("cee-testbed", "resnet101", 128)),
    Instance("testbed/bert-small/128", _scenario("cee-testbed", "bert-small", 128)),
    Instance("testbed/efficientnet-b0/32", _scenario("cee-testbed", "efficientnet-b0", 32)),
    Instance("testbed/gpt2-xl/128", _scenario("cee-testbed", "gpt2-xl", 128), baselines=True),
    Instance("testbed-500m/gpt2/64", _scenario("cee-testbed-500m", "gpt2", 64)),
    Instance("testbed-500m/resnet50/128", _scenario("cee-testbed-500m", "resnet50", 128)),
    Instance("scale-2/gpt2/64", _scenario("scale-2", "gpt2", 64)),
    Instance("scale-4/bert-small/64", _scenario("scale-4", "bert-small", 64)),
    Instance("scale-8/gpt2-medium/128", _scenario("scale-8", "gpt2-medium", 128)),
    Instance("scale-12/resnet50/256", _scenario("scale-12", "resnet50", 256)),
    Instance("scale-16/gpt2/256", _scenario("scale-16", "gpt2", 256)),
    *(Instance(f"random{s}/analytic", _random(s, measured=False)) for s in range(6)),
    *(Instance(f"random{s}/measured", _random(s, measured=True)) for s in range(6, 10)),
)


def snapshot(inst: Instance) -> dict[str, Any]:
    """Everything the refactorings must keep: deepcee's plan (with its estimate and explanation),
    the simulator's figures for it, the baselines' plans and the comparison table."""
    from deepcee.planner.baselines import build_baselines
    from deepcee.planner.search import plan_training
    from deepcee.simulator.engine import simulate

    cluster, model, batch = inst.build()
    result = plan_training(cluster, model, batch)
    sim = simulate(result.plan, cluster, model, record=False)
    out: dict[str, Any] = {
        "plan": result.plan.to_dict(),
        "explanation": list(result.explanation),
        "simulated": {"iteration_s": sim.iteration_s, "bubble_fraction": sim.bubble_fraction,
                      "peak_memory_bytes": dict(sim.peak_memory_bytes), "bottleneck": sim.bottleneck,
                      "busy_s": dict(sim.busy_s), "sync_s": dict(sim.sync_s)},
        "top": [c.plan.to_dict() for c in result.top],
    }
    if inst.baselines:
        out["baselines"] = {b.name: (b.plan.to_dict() if b.plan is not None else b.reason)
                            for b in build_baselines(cluster, model, batch)}
    if inst.compare:
        from deepcee.planner.compare import compare

        rep = compare(cluster, model, batch, crossover=False).to_dict()
        rep.pop("planning_s", None)
        out["compare"] = rep
    return json.loads(json.dumps(out))


def main(argv: list[str]) -> int:
    record = {inst.name: snapshot(inst) for inst in INSTANCES}
    if "--write" in argv:
        GOLDEN.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"wrote {RECORD} ({len(record)} instances)")
        return 0
    old = json.loads(RECORD.read_text())
    bad = [k for k in record if record[k] != old.get(k)]
    print(f"{len(record) - len(bad)} of {len(record)} instances unchanged" + (f"; changed: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
