"""Split backward (I then W) against the fused backward B on the tiny nets.

For each net, stage (``middle``: every block but the first and last; ``last``: every block
but the first, loss included) and microbatch size, one process with one thread runs ``F``
then either ``B`` or ``I`` + ``W`` (:class:`deepcee.runtime.stage.StageRunner`), alternating,
``--repeats`` times, and reports median CPU seconds (``time.thread_time``: stable when other
processes compete for the cores, unlike wall time). The baseline is the fused ``B`` measured
in the same run; the claim checked is ``I + W ~ B`` (the split recomputes nothing; it adds a
graph walk, one autograd call per weight group, and runs ``W`` later on colder caches).
Gradients of both paths are compared.

Each configuration runs twice, in fresh subprocesses: with glibc's default allocator
settings, and with ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` raised (what the
runtime's workers use, :data:`deepcee.runtime.dist.WORKER_ENV`): by default every large
tensor is a fresh ``mmap`` whose page faults are charged to the thread, and split backward,
which keeps the graph alive longer, pays more of them. Run::

    python benchmarks/split_backward.py --out reports/split_backward.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from deepcee import nets
from deepcee.plan import save_json_atomic
from deepcee.runtime.data import dataset_for
from deepcee.runtime.dist import WORKER_ENV
from deepcee.runtime.stage import StageRunner


def _cpu(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def measure(net: str, stage: str, microbatch: int, repeats: int) -> dict[str, float]:
    blocks, loss_fn = nets.build(net, seed=0)
    body = blocks[1:-1] if stage == "middle" else blocks[1:]
    runner = StageRunner(body, stage=1, is_first=False, is_last=stage == "last", loss_fn=loss_fn)
    batch = dataset_for(net).batch(0, microbatch)
    with torch.no_grad():
        x = blocks[0](batch.inputs)
        out_shape = runner.module(x).shape
    grad = None if stage == "last" else torch.randn(out_shape, generator=torch.Generator().manual_seed(0))
    targets = batch.targets if stage == "last" else None
    t: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    grads = {}
    for r in range(repeats + 1):  # the first round warms up and is dropped
        for path in ("fused", "split"):
            runner.zero_grad()
            f = _cpu(lambda: runner.forward(0, x, targets))
            if path == "fused":
                b = _cpu(lambda: runner.backward(0, grad))
                times = {"F": f, "B": b}
            else:
                i = _cpu(lambda: runner.backward_input(0, grad))
                w = _cpu(lambda: runner.backward_weight(0))
                times = {"F": f, "I": i, "W": w}
            grads[path] = [p.grad.clone() for p in runner.params]
            if r:
                for k, v in times.items():
                    t[k].append(v)
    max_rel = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                  for a, b in zip(grads["fused"], grads["split"], strict=True))
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"net": net, "stage": stage, "microbatch": microbatch, "F_s": med["F"], "B_s": med["B"], "I_s": med["I"],
            "W_s": med["W"], "I_plus_W_over_B": (med["I"] + med["W"]) / med["B"],
            "max_rel_grad_diff": max_rel, "repeats": repeats}


ALLOCATORS = {"default": {}, "no-mmap": {k: v for k, v in WORKER_ENV.items() if k.startswith("MALLOC")}}


def _worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rows = [measure(net, stage, mb, args.repeats)
            for net in nets.NET_NAMES for stage in ("middle", "last") for mb in args.microbatches]
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="reports/split_backward.json")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    rows = []
    for alloc, extra in ALLOCATORS.items():
        cmd = [sys.executable, __file__, "--worker", "--repeats", str(args.repeats), "--microbatches",
               *map(str, args.microbatches)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        rows += [{**r, "allocator": alloc} for r in json.loads(out.strip().splitlines()[-1])]
    print(f"{'allocator':9} {'net':12} {'stage':6} {'mb':>3} {'F ms':>7} {'B ms':>7} {'I ms':>7} {'W ms':>7} "
          f"{'(I+W)/B':>8} {'grad diff':>10}")
    for r in rows:
        print(f"{r['allocator']:9} {r['net']:12} {r['stage']:6} {r['microbatch']:>3} {1e3 * r['F_s']:7.2f} "
              f"{1e3 * r['B_s']:7.2f} {1e3 * r['I_s']:7.2f} {1e3 * r['W_s']:7.2f} {r['I_plus_W_over_B']:8.3f} "
              f"{r['max_rel_grad_diff']:10.1e}")
    summary = {}
    for alloc in ALLOCATORS:
        for mb in args.microbatches:
            ratios = [r["I_plus_W_over_B"] for r in rows if r["allocator"] == alloc and r["microbatch"] == mb]
            summary[f"{alloc}/mb{mb}"] = statistics.median(ratios)
            print(f"(I+W)/B {alloc:8} microbatch {mb:3}: median {statistics.median(ratios):.3f} "
                  f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"CPU time of one thread, median of {args.repeats}; baseline: fused B in the same process")
    save_json_atomic(Path(args.out), {"format": "deepcee.bench.split_backward", "schema_version": 1,
                                      "timing": "median thread CPU seconds", "rows": rows,
                                      "median_ratio": summary})


if __name__ == "__main__":
    main()
