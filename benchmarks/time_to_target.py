"""Time to target loss, measured and predicted, on the emulated ``local-small`` cluster; the testbed simulated.

For each task (``convnet-tiny`` on the generated shapes, ``gpt-tiny`` on the shipped corpus),
in one run of this script (same-run baselines):

1. calibrate (``deepcee calibrate``: model averaging at each period H asked for, against exact
   training, to the task's target; mode ``real``, samples do not depend on timing), unless
   ``--efficiency-dir`` gives files from an earlier run;
2. profile the emulated devices and links (quick, as the main job does) so predictions use
   measured speeds;
3. plan and train the four systems of :mod:`deepcee.ttt` to the target, in mode ``emulated``
   (times are emulated seconds: wall / dilation): deepcee's relaxed all-island plan,
   synchronous deepcee, the best single island (synchronous), DDP on all devices;
4. report per system: predicted vs measured time to target, samples, final evaluation loss and
   the loss at the samples every run reached, measured samples/s; the relaxed vs best
   single-island ratio.

Then the testbed (``cee-testbed``, simulated only): for ResNet-50, BERT-small and GPT-2, the
relaxed planner's pick and its predicted time to target vs the best synchronous plan, with the
conservative default, and with the convnet-tiny calibration applied to the other model (a
transfer, labelled as such: the calibration was not measured on that model).

Writes ``<out>/time_to_target.json`` and per-task folders (report.json, loss_vs_time.png).

    python benchmarks/time_to_target.py [--tasks convnet-tiny,gpt-tiny] [--out reports/time-to-target]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from deepcee.calibrate import CalibrationConfig, calibrate
from deepcee.scenarios import load_scenario
from deepcee.ttt import TASKS, TttConfig, format_table, run

PERIODS = (4, 16)
GLOBAL_BATCH = 32


def _calibrate(model: str, spec: dict, cluster, out: Path) -> str:
    from deepcee.models import get_model

    cfg = CalibrationConfig(model=model, global_batch=GLOBAL_BATCH, target_loss=spec["target_loss"],
                            eval_every=spec["eval_every"], max_steps=spec["max_steps"], periods=PERIODS,
                            lr=spec["lr"], out_dir=str(out / "calibrate"))
    calibrate(cluster, get_model(model), cfg, cluster_ref="local-small")
    return str(out / "calibrate" / "efficiency.json")


def task(model: str, out: Path, efficiency: str | None) -> dict:
    spec = TASKS[model]
    cluster = load_scenario("local-small")
    t0 = time.monotonic()
    eff = efficiency or _calibrate(model, spec, cluster, out)
    t_cal = time.monotonic() - t0
    cfg = TttConfig(model=model, global_batch=GLOBAL_BATCH, target_loss=spec["target_loss"],
                    eval_every=spec["eval_every"], max_steps=spec["max_steps"], lr=spec["lr"], out_dir=str(out))
    doc = run(cluster, cfg, cluster_ref="local-small", efficiency_file=eff)
    doc["timings_s"]["calibrate"] = t_cal
    doc["efficiency_document"] = json.loads(Path(eff).read_text())
    (out / "report.json").write_text(json.dumps(doc, indent=1))
    return doc


def testbed(efficiency: str | None) -> list[dict]:
    from deepcee.models import get_model
    from deepcee.planner.efficiency import DefaultEfficiency, load_efficiency
    from deepcee.planner.replicas import plan_replicas

    cluster = load_scenario("cee-testbed")
    effs = {"default (conservative, not measured)": DefaultEfficiency()}
    if efficiency:
        cal = load_efficiency(efficiency)
        # a transfer: the calibration measured on a tiny model, applied to another model
        effs[f"convnet-tiny calibration applied to this model (transfer; {efficiency})"] = \
            type(cal)(model="", entries=cal.entries, file=cal.file)
    rows = []
    for name, batch in (("resnet50", 256), ("bert-small", 256), ("gpt2", 64)):
        for label, eff in effs.items():
            res = plan_replicas(cluster, get_model(name), batch, efficiency=eff)
            best, exact = res.best, res.exact
            rows.append({"model": name, "global_batch": batch, "efficiency": label,
                         "picked": best.plan.strategy.describe(), "replicas": best.plan.num_replicas,
                         "picked_samples_per_s": best.samples_per_s,
                         "picked_ms_per_sync_sample": best.figures.time_to_target.seconds_per_sync_sample * 1e3,
                         "sync_samples_per_s": exact.samples_per_s,
                         "sync_ms_per_sync_sample": exact.figures.time_to_target.seconds_per_sync_sample * 1e3,
                         "speedup_vs_sync": exact.figures.time_to_target.seconds_per_sync_sample
                         / best.figures.time_to_target.seconds_per_sync_sample,
                         "multiplier": best.figures.time_to_target.multiplier, "source": best.figures.time_to_target.source,
                         **_best_relaxed(res.candidates, exact)})
    return rows


def _best_relaxed(ranked, exact) -> dict:
    r = next((s for s in ranked if s.plan.strategy.kind != "exact"), None)
    if r is None:
        return {"best_relaxed": None}
    tt = r.figures.time_to_target
    return {"best_relaxed": r.plan.strategy.describe(), "best_relaxed_layout": r.layout,
            "best_relaxed_multiplier": tt.multiplier, "best_relaxed_samples_per_s": r.samples_per_s,
            "best_relaxed_vs_sync": exact.figures.time_to_target.seconds_per_sync_sample / tt.seconds_per_sync_sample}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="convnet-tiny,gpt-tiny")
    p.add_argument("--out", default="reports/time-to-target")
    p.add_argument("--efficiency-dir", help="reuse <dir>/<task>/calibrate/efficiency.json from an earlier run")
    p.add_argument("--no-testbed", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    doc: dict = {"cluster": "local-small (emulated)", "tasks": {}, "testbed": []}
    for model in args.tasks.split(","):
        eff = str(Path(args.efficiency_dir) / model / "calibrate" / "efficiency.json") if args.efficiency_dir else None
        doc["tasks"][model] = task(model, out / model, eff)
        print(format_table(doc["tasks"][model]), flush=True)
        (out / "time_to_target.json").write_text(json.dumps(doc, indent=1))
    if not args.no_testbed:
        conv = out / "convnet-tiny" / "calibrate" / "efficiency.json"
        if args.efficiency_dir:
            conv = Path(args.efficiency_dir) / "convnet-tiny" / "calibrate" / "efficiency.json"
        doc["testbed"] = testbed(str(conv) if conv.exists() else None)
        print("\ntestbed (cee-testbed, simulated): relaxed pick vs best synchronous plan, predicted")
        for r in doc["testbed"]:
            print(f"  {r['model']:10s} {r['picked'][:60]:60s} x{r['speedup_vs_sync']:.2f} vs sync "
                  f"(multiplier x{r['multiplier']:.2f}; {r['efficiency'][:40]})")
            if r["best_relaxed"]:
                print(f"    best relaxed: {r['best_relaxed'][:60]} {r['best_relaxed_layout']}: "
                      f"x{r['best_relaxed_vs_sync']:.2f} vs sync (multiplier x{r['best_relaxed_multiplier']:.2f})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "time_to_target.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out / 'time_to_target.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
