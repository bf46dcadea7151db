"""The profiler (torch): measure devices, layers and links; build measured profiles and clusters.

- :mod:`~deepcee.profiler.device`: per-layer F/I/W times (through the runtime's stage runner),
  memory and a compute score on the local device; its parts are
  :mod:`~deepcee.profiler.probes` (config, records, line fits, JSON; torch-free),
  :mod:`~deepcee.profiler.timing` (the clock, the compute score) and
  :mod:`~deepcee.profiler.layer_probe` (per-layer and range probes, memory).
- :mod:`~deepcee.profiler.network`: ping-pong alpha-beta fits of every directed device pair.
- :mod:`~deepcee.profiler.model`: measured model profile, device slowdowns and kinds.
- :mod:`~deepcee.profiler.run`: ``deepcee profile`` (one process per device, files, grouping).
- :mod:`~deepcee.profiler.fidelity`: the simulator's predictions against real emulated runs.

Submodules are imported on use (``from deepcee.profiler.run import profile_cluster``), so
importing this package does not import torch.
"""
