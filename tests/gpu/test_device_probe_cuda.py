"""Device probe on CUDA: CUDA-event timings, allocator memory, a GPU-sized compute score.
Skipped when torch.cuda.is_available() is False."""

from __future__ import annotations

import pytest
import torch

from deepcee.errors import SpecError
from deepcee.models import get_model
from deepcee.profiler.device import net_source, probe_device
from deepcee.profiler.model import measured_profile
from deepcee.profiler.probes import MEMORY_CUDA, PASSES, ProbeConfig
from deepcee.profiler.timing import compute_score
from deepcee.runtime.emulation import DevicePacer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_probe_gpt_tiny_on_cuda():
    cfg = ProbeConfig(microbatch_sizes=(1, 8, 64), warmup=2, repeats=5, score_repeats=3)
    probe = probe_device(net_source("gpt-tiny"), device_name="gpu0:0", kind="gpu", device="cuda", config=cfg)
    assert probe.timer == "cuda-events" and probe.memory_method == MEMORY_CUDA
    assert probe.torch_device.startswith("cuda") and not probe.emulated
    params = {name: sum(p.numel() * 4 for p in b.parameters())
              for name, b in zip(net_source("gpt-tiny").block_names, net_source("gpt-tiny").blocks, strict=True)}
    for la in probe.layers:
        for p in PASSES:
            assert all(t >= 0 for t in la.passes[p].median_s)
        assert sum(la.passes["F"].median_s) > 0
        # the allocator saw at least the parameters and, for the blocks, some activations
        assert la.peak_memory_bytes >= params[la.name]
    blocks = [la for la in probe.layers if la.name.startswith("block")]
    for la in blocks:  # 64 samples take longer than 1 (fixed launch costs dominate small sizes)
        assert la.passes["F"].median_s[-1] > la.passes["F"].median_s[0]
    prof = measured_profile(get_model("gpt-tiny"), [probe], source="cuda test")
    assert len(prof.measured["gpu"]) == 6


def test_cuda_compute_score_beats_a_cpu_core_and_pacing_is_refused():
    gpu = compute_score("cuda", repeats=3)
    assert set(gpu.benchmarks) == {"matmul1024", "matmul4096", "matmul8192", "conv3x3-64x64x56"}
    assert gpu.flops_per_s > 1e11  # any CUDA GPU of the last decade; one CPU core reaches ~1e10
    with pytest.raises(SpecError, match="paces CPU workers"):
        compute_score("cuda", repeats=1, pacer=DevicePacer(slowdown=2.0, dilation=1.0))
