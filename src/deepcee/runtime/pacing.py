"""A trainer's emulated time: the run's epoch, the link shaper, the relay, and paced all-reduces.

Functions of a :class:`~deepcee.runtime.trainer.Trainer`: :func:`start_clock` makes emulated
time (bandwidth traces, stragglers, link outages) count from the run's shared instant and builds
what delivers on the emulated links (mode ``emulated``: :class:`~deepcee.runtime.emulation.LinkShaper`
with the run's :mod:`link outages <deepcee.cluster.outages>`) or restarts the relay's traces
(mode ``realnet``); :func:`pace_allreduce` holds a real all-reduce until the simulator's
all-reduce model says it ends on the emulated links, one model for both, and a link of the
group that is down holds it until the link is back (a dead link: past the run's timeout, a
fault the waiter reports).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deepcee.cluster.outages import outages_by_devices, up_again_s
from deepcee.comm import allreduce_s
from deepcee.errors import RuntimeSetupError
from deepcee.runtime import dist as rdist
from deepcee.runtime.emulation import FileLedger, LinkShaper
from deepcee.runtime.realnet.relay import RelayControl
from deepcee.runtime.replicas import Messenger

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer


def start_clock(t: Trainer, epoch: float) -> None:
    """Emulated time (and every bandwidth trace and straggler) counts from ``epoch`` (the run's
    shared instant): pacing, link shaping, messages, the relay."""
    t.epoch = t.pacer.epoch = epoch
    t.shaper = None
    if t.cfg.mode == "emulated":
        t.shaper = LinkShaper(dilation=t.dilation, ledger=FileLedger(t.run_dir / "links"), epoch=t.epoch,
                              clock=t.clock, outages=outages_by_devices(
                                  t.cfg.link_outages, {d.name: d.node for d in t.cluster.devices}))
    t.messenger = Messenger(rank=t.w.rank, topo=t.topo, cluster=t.cluster, torch_device=t.w.device,
                            timeout_s=t.cfg.timeout_s, shaper=t.shaper, clock=t.clock,
                            pace=t.cfg.mode == "realnet", dilation=t.dilation, epoch=t.epoch)
    if t.relay is not None and t.w.rank == 0:
        # the relay's traces count from the same instant as emulated time (CLOCK_MONOTONIC
        # is one clock for every namespace of this machine)
        t.relay.set_epoch(t.epoch)


def relay_control(timeout_s: float) -> RelayControl:
    """The relay of a realnet launch; a clear error when this rank was not started by one."""
    path = rdist.relay_control_path()
    if path is None:
        raise RuntimeSetupError("mode 'realnet' needs ranks started in network namespaces by "
                                "deepcee.runtime.launch.launch_jobs (launch_realnet); no relay control "
                                f"socket in the environment ({rdist.RELAY_CONTROL_ENV})")
    return RelayControl(path, timeout_s=timeout_s)


def pace_allreduce(t: Trainer, devices: Sequence[str], nbytes: int, t0: float, sync: str | None = None) -> None:
    """Hold an all-reduce of ``nbytes`` over ``devices`` begun at wall time ``t0`` until it ends on the emulated links."""
    # The simulator's all-reduce model on the emulated links (one model for both), counted
    # from the start of the real all-reduce, which overlaps it; traced links read at its start.
    sync = sync or (t.plan.sync if t.plan.sync not in ("none", "ps") else "allreduce-ring")
    at_s = t.emulated_s(t0)
    cut = {} if t.shaper is None else {
        pair: outs for pair, outs in t.shaper.outages.items() if pair[0] in devices and pair[1] in devices}
    up_s = max((up_again_s(outs, at_s) for outs in cut.values()), default=at_s)
    if up_s > at_s:  # a link of the group is down: the all-reduce waits for it (forever: a dead link)
        me = t.hooks.device(t)
        peer = next((b for a, b in cut if a == me), next(iter(cut))[1])
        end = math.inf if math.isinf(up_s) else t.epoch + (up_s + allreduce_s(
            t.cluster, devices, nbytes, sync, at_s=up_s)) * t.dilation
        t.w.waiter.sleep_until(t.clock, end, timeout_s=t.cfg.timeout_s,
                               what=f"the all-reduce of {len(devices)} devices", peer=peer)
        return
    model_s = allreduce_s(t.cluster, devices, nbytes, sync, at_s=at_s)
    t.clock.sleep_until(t0 + model_s * t.dilation)


__all__ = ["pace_allreduce", "relay_control", "start_clock"]
