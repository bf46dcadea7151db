"""Device probe: everything measured on the local device for one net.

:func:`probe_device` probes every layer (:func:`~deepcee.profiler.layer_probe.probe_blocks`:
forward / input-gradient / weight-gradient / fused-backward lines through the runtime's own
stage runner, and memory) and the device's compute score
(:func:`~deepcee.profiler.timing.compute_score`), and returns them as one
:class:`~deepcee.profiler.probes.DeviceProbe`. :func:`net_source` says what to probe: a
built-in net by name or a user's blocks with a loss and a dataset.

The parts, each with its notes:

- :mod:`deepcee.profiler.probes` (torch-free): :class:`~deepcee.profiler.probes.ProbeConfig`,
  the probe records, the non-negative line fits and their JSON form.
- :mod:`deepcee.profiler.timing`: the probe's clock ([Note: probe timers]) and the compute score.
- :mod:`deepcee.profiler.layer_probe`: the per-layer and range probes ([Note: probe memory],
  [Note: first-stage timings], [Note: call overhead]).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepcee.errors import SpecError
from deepcee.profiler.layer_probe import probe_blocks
from deepcee.profiler.probes import MEMORY_CPU, MEMORY_CUDA, DeviceProbe, ProbeConfig
from deepcee.profiler.timing import compute_score
from deepcee.runtime.emulation import DevicePacer


@dataclass(frozen=True, slots=True, kw_only=True)
class NetSource:
    """What to probe: a net's blocks with a batch source and loss (built-in nets: :func:`net_source`)."""

    name: str
    blocks: Sequence[nn.Module]
    block_names: tuple[str, ...]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch: Callable[[int], tuple[Any, Any]]
    """``n -> (inputs, targets)`` with ``n`` samples (tensors or structures of tensors)."""
    extra: dict[str, Any] = field(default_factory=dict)


def net_source(model: Any, *, loss_fn: Callable | None = None, dataset: Any = None,
               seed: int = 0, name: str | None = None) -> NetSource:
    """A built-in net by name, or a user's model: blocks, an ``nn.Sequential``, a
    :class:`~deepcee.nets.split.SplitModel` (its names and loss) or anything
    :func:`deepcee.nets.split_model` splits; ``dataset`` anything :func:`deepcee.runtime.sources.as_source` takes."""
    from deepcee import nets
    from deepcee.runtime.data import dataset_for
    from deepcee.runtime.sources import as_source

    if isinstance(model, str):
        blocks, default_loss = nets.build(model, seed)
        ds = dataset if dataset is not None else dataset_for(model, seed)
        names = nets.block_names(model)
        loss = loss_fn or default_loss
        label = model
    else:
        split = nets.split_model(model if isinstance(model, nn.Module | nets.SplitModel) else list(model))
        blocks, names, loss = list(split.blocks), split.names, loss_fn or split.loss_fn
        if loss is None or dataset is None:
            raise SpecError("a user's blocks need a loss_fn and a dataset", field="model")
        ds, label = dataset, name or "user"
    source = as_source(ds, seed=seed)

    def batch(n: int) -> tuple[Any, Any]:
        b = source.batch(0, n)
        return b.inputs, b.targets

    return NetSource(name=label, blocks=blocks, block_names=tuple(names), loss_fn=loss, batch=batch)


def probe_device(source: NetSource, *, device_name: str, kind: str, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, config: ProbeConfig | None = None,
                 pacer: DevicePacer | None = None) -> DeviceProbe:
    """Layer probes and compute score of this device for ``source``'s net.

    ``pacer`` (CPU only) emulates a slower device: its ``slowdown`` multiplies every figure
    and its padding is checked (see [Note: probe timers]).
    """
    cfg = config or ProbeConfig()
    t0 = time.monotonic()
    inputs, targets = source.batch(max(cfg.microbatch_sizes))
    layers, ranges, timer = probe_blocks(source.blocks, inputs=inputs, targets=targets, loss_fn=source.loss_fn,
                                         names=source.block_names, device=device, dtype=dtype, config=cfg,
                                         pacer=pacer)
    score = compute_score(device, dtype=dtype, repeats=cfg.score_repeats, cpu_timer=cfg.cpu_timer, pacer=pacer)
    dev = torch.device(device)
    emulated = pacer is not None and pacer.enabled
    return DeviceProbe(
        device=device_name, torch_device=str(dev), kind=kind, timer=timer,
        memory_method=MEMORY_CUDA if dev.type == "cuda" else MEMORY_CPU,
        slowdown=pacer.slowdown if emulated else 1.0, dilation=pacer.dilation if emulated else 1.0,
        emulated=emulated, layers=layers, ranges=ranges, score=score, wall_s=time.monotonic() - t0,
    )
