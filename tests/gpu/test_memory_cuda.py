"""Memory on CUDA: the fixed overhead after the context and an NCCL all-reduce, the allocator's
margin, the runtime's peak (``max_memory_reserved``) against the memory model.
Skipped when torch.cuda.is_available() is False."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepcee.profiler.baseline import fixed_bytes
from deepcee.profiler.device import net_source
from deepcee.profiler.memory_probe import CUDA_METHOD, memory_probe
from deepcee.runtime import dist as rdist
from deepcee.runtime import peak_memory

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def one_rank_group(tmp_path):
    store = rdist.file_store(str(tmp_path / "store"), 1, 30.0)
    rdist.init_process_group(store=store, rank=0, world_size=1, backend="gloo", timeout_s=30.0,
                             device=torch.device("cpu"))
    yield
    rdist.shutdown()


def test_fixed_overhead_and_allocator_margin_on_cuda(one_rank_group):
    device = torch.device("cuda", 0)
    fixed = fixed_bytes(device)
    assert fixed > 50 * 2**20  # a CUDA context alone takes hundreds of MB
    assert dist.is_initialized()
    source = net_source("gpt-tiny")
    inputs, targets = source.batch(16)
    probe = memory_probe(fixed, source.blocks, inputs, targets, source.loss_fn, device)
    assert probe.method == CUDA_METHOD and probe.fixed_bytes == fixed
    assert probe.peak_bytes >= probe.live_bytes > 0  # reserved never below allocated
    assert probe.fragmentation_fraction == pytest.approx(probe.peak_bytes / probe.live_bytes - 1)


def test_peak_reads_the_allocators_reservation():
    device = torch.device("cuda", 0)
    peak_memory.reset_peak(device)
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    assert peak_memory.peak_bytes(device) >= x.numel()
    del x
    torch.cuda.empty_cache()
    peak_memory.reset_peak(device)
    assert peak_memory.peak_bytes(device) < 64 * 2**20
