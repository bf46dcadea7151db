"""What a device needs beyond a plan's tensors: its fixed overhead and the allocator's margin.

[Note: fixed memory]
The memory model (:mod:`deepcee.simulator.memory`) adds to the plan's tensors a fixed overhead
per device and a fragmentation margin, both measured here on every profiled device, on the
path the runtime takes:

- **fixed** (:func:`deepcee.profiler.baseline.fixed_bytes`), measured in a launch of its own
  whose ranks import what a training rank imports (the runtime, not the profiler: scipy and the
  probes alone took 20-30 MB more), right after the process group formed and before any model
  exists. CPU: the resident set after importing torch, joining the process group,
  warming gloo up (a barrier and a small all-reduce over every rank) and building and
  stepping the runtime's optimizer once on a one-element parameter (its first step imports
  and initialises more of torch). CUDA: the device memory in use (``torch.cuda.mem_get_info``)
  after creating the context, an all-reduce in an NCCL group over every rank, and one warm-up
  allocation (the caching allocator's first reservation);
- **fragmentation** (:func:`fragmentation`): the whole net run as one first stage at the
  largest probed microbatch (``F``, ``I``, ``W`` and an optimizer step), what the process
  newly held at its peak (CPU: peak resident set, from ``/proc/self/status`` after resetting
  it; CUDA: ``max_memory_reserved``) against the peak live tensor bytes of the same work
  (gradients, optimizer state, saved activations, output; CUDA: ``max_memory_allocated``):
  ``held / live - 1``, at least 0. On CPU it also holds what the first backward and step
  initialise lazily, which the runtime pays too.

The model's own parameters are not in either figure: the memory model counts them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from deepcee.profiler.probes import MemoryProbe
from deepcee.runtime import peak_memory
from deepcee.runtime.job import OptimizerConfig
from deepcee.runtime.stage import StageRunner

log = logging.getLogger(__name__)

CPU_METHOD = ("resident set after torch, the process group, gloo's warm-up and one optimizer step (fixed); "
              "peak resident set over the whole net's F/I/W and optimizer step against its live tensor bytes "
              "(fragmentation)")
CUDA_METHOD = ("device memory in use after the context, an NCCL all-reduce and one warm-up allocation (fixed); "
               "max_memory_reserved against max_memory_allocated over the whole net's F/I/W and optimizer step "
               "(fragmentation)")


def _live_bytes(runner: StageRunner, saved: dict[int, int], out: torch.Tensor) -> float:
    """Gradients, the optimizer's state (two tensors per parameter for Adam), saved tensors, output."""
    grads = sum(p.numel() * p.element_size() for p in runner.params)
    return 3.0 * grads + sum(saved.values()) + out.numel() * out.element_size()


def fragmentation(blocks: Sequence[nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                  dtype: torch.dtype = torch.float32) -> tuple[float, float, float]:
    """``(fraction, held bytes, live bytes)`` of the whole net as one stage (see [Note: fixed memory])."""
    runner = StageRunner(list(blocks), stage=0, is_first=True, is_last=True, loss_fn=loss_fn, device=device,
                         dtype=dtype)
    params = {p.data_ptr() for p in runner.params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = inputs.to(device)
    x = x.to(dtype) if x.is_floating_point() else x
    cuda = device.type == "cuda"
    before = float(torch.cuda.memory_reserved(device)) if cuda else peak_memory.resident_bytes()
    peak_memory.reset_peak(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = runner.forward(0, x, targets.to(device))
    runner.backward_input(0, None)
    runner.backward_weight(0)
    OptimizerConfig().build(runner.params).step()
    if cuda:
        torch.cuda.synchronize(device)
        held, live = float(torch.cuda.max_memory_reserved(device)), float(torch.cuda.max_memory_allocated(device))
    else:
        held, live = peak_memory.peak_bytes(device) - before, _live_bytes(runner, saved, out)
    runner.zero_grad()
    fraction = max(0.0, held / live - 1.0) if live > 0 else 0.0
    log.info("memory probe: %.1f MB held for %.1f MB live tensors (margin %.0f%%)", held / 2**20, live / 2**20,
             100 * fraction)
    return fraction, held, live


def memory_probe(fixed: float, blocks: Sequence[nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                 loss_fn: Callable, device: torch.device, dtype: torch.dtype = torch.float32) -> MemoryProbe:
    """The device's :class:`MemoryProbe` from its fixed bytes and a fragmentation run on ``blocks``."""
    fraction, held, live = fragmentation(blocks, inputs, targets, loss_fn, device, dtype)
    return MemoryProbe(fixed_bytes=fixed, fragmentation_fraction=fraction, peak_bytes=held, live_bytes=live,
                       method=CUDA_METHOD if device.type == "cuda" else CPU_METHOD)
