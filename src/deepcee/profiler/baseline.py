"""A device's fixed memory overhead, measured on the path a training rank takes (torch).

See [Note: fixed memory] in :mod:`deepcee.profiler.memory_probe`. :func:`measure_fixed` runs
:func:`baseline_main` on one process per device, launched as the runtime launches its ranks
(local processes, or network namespaces behind the relay in mode ``realnet``). This module
imports what a training rank imports (:mod:`deepcee.runtime.launch`, whose ranks run the
trainer) and nothing of the profiler's own (scipy, the probes), so the resident set it
measures is a training rank's before its model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from deepcee.cluster import Cluster
from deepcee.runtime import dist as rdist
from deepcee.runtime import launch as rlaunch
from deepcee.runtime import peak_memory
from deepcee.runtime.job import OptimizerConfig

log = logging.getLogger(__name__)


def fixed_bytes(device: torch.device) -> float:
    """The device's memory before any model (see [Note: fixed memory]). Collective: every rank
    of the default process group calls it."""
    dist.barrier()
    dist.all_reduce(torch.ones(1024))
    weight = nn.Parameter(torch.zeros(1, device=device))
    weight.grad = torch.zeros_like(weight)
    OptimizerConfig().build([weight]).step()
    if device.type != "cuda":
        return peak_memory.resident_bytes()
    group = dist.new_group(backend="nccl")
    dist.all_reduce(torch.ones(1024, device=device), group=group)
    torch.empty(1 << 20, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return float(total - free)


def baseline_main(rank: int, world_size: int, store_path: str, out_dir: str, use_cuda: bool, timeout_s: float) -> None:
    """One rank: join the group as a training rank does, measure, write ``baseline-<rank>.json``."""
    rdist.single_thread()
    device = rdist.pick_device(use_cuda, rank)
    store = rdist.file_store(store_path, world_size, timeout_s)
    rdist.init_process_group(store=store, rank=rank, world_size=world_size, backend="gloo", timeout_s=timeout_s,
                             device=torch.device("cpu"))
    try:
        fixed = fixed_bytes(device)
        (Path(out_dir) / f"baseline-{rank}.json").write_text(json.dumps({"rank": rank, "fixed_bytes": fixed}))
    finally:
        rdist.shutdown()


def measure_fixed(cluster: Cluster, out_dir: str | Path, *, realnet: bool, dilation: float = 1.0,
                  use_cuda: bool = False, deadline_s: float = 120.0, timeout_s: float = 60.0) -> list[float]:
    """Every device's fixed overhead (rank ``r`` is ``cluster.devices[r]``), in bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    devices = cluster.device_names
    args = (str(out), use_cuda, timeout_s)
    if realnet:
        from deepcee.runtime.realnet import launch_realnet

        launch_realnet(baseline_main, args, cluster=cluster, devices=devices, deadline_s=deadline_s, dilation=dilation)
    else:
        rlaunch.launch(baseline_main, args, world_size=len(devices), deadline_s=deadline_s)
    return [json.loads((out / f"baseline-{r}.json").read_text())["fixed_bytes"] for r in range(len(devices))]
