"""A rank's peak memory, as the memory model predicts it (:mod:`deepcee.simulator.memory`).

- CPU: the process's peak resident set (``VmHWM`` of ``/proc/self/status``), reset with
  ``/proc/self/clear_refs`` (``5``: the peak becomes the current resident set), so each job of
  a launch that runs several reports its own peak;
- CUDA: ``torch.cuda.max_memory_reserved`` (what the caching allocator held; the context and
  the communication library's buffers are not in it, see :class:`deepcee.profile.DeviceMemory`),
  reset with ``torch.cuda.reset_peak_memory_stats``.

Where ``/proc`` does not offer them (not Linux) the CPU figures are 0 and nothing is reset.
"""

from __future__ import annotations

import re
from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> float:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return 0.0
    return float(m.group(1)) * 1024 if m else 0.0


def resident_bytes() -> float:
    """This process's resident set now (0 where unknown)."""
    return _status_bytes("VmRSS")


def reset_peak(device: object = None) -> None:
    """Start a new peak from now (``device``: a ``torch.device``; CUDA resets its allocator's peak)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        pass


def peak_bytes(device: object = None) -> float:
    """The peak since :func:`reset_peak` (0 where unknown)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return float(torch.cuda.max_memory_reserved(device))
    return _status_bytes("VmHWM")
