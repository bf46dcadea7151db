"""``deepcee profile``: one process per device of a cluster; each probes its device and the network.

:func:`profile_cluster` launches one process per device with the runtime's launcher
(:func:`deepcee.runtime.launch.launch`: ``FileStore`` in a temporary directory, one thread per
process, hard deadline, the first failing rank's error re-raised). Rank ``r`` is device
``cluster.devices[r]``. Every rank

1. takes its fixed memory overhead, measured before the launch in one of its own that imports
   what a training rank imports (:func:`deepcee.profiler.baseline.measure_fixed`, [Note: fixed
   memory] in :mod:`deepcee.profiler.memory_probe`), then probes its device for the model (:func:`deepcee.profiler.device.probe_device`, after the
   allocator-margin run of :func:`~deepcee.profiler.memory_probe.memory_probe`); in emulated
   and realnet modes through a :class:`~deepcee.runtime.emulation.DevicePacer` with the
   device's stated slowdown and the dilation the runtime would choose for all devices
   (:func:`~deepcee.runtime.emulation.choose_dilation`), so the figures are what the emulated
   device delivers (reported as emulated);
2. joins the collective network probe (:func:`deepcee.profiler.network.probe_network`), over
   the cluster's declared links emulated by the runtime's link shaper in emulated mode (with
   the devices' time dilation unless ``network_dilation`` says otherwise, so the real software
   cost of a transfer shrinks by the same factor as in the runtime), in mode ``realnet`` over
   real TCP through the shaping relay between network namespaces
   (:func:`deepcee.runtime.realnet.launch_realnet`, the links the runtime's realnet runs
   cross), over the real transport otherwise;
3. times the runtime's per-step bookkeeping (:func:`step_overhead_wall_s`: the step records'
   gloo gather, or in mode ``realnet`` their publication through the store);
4. writes its raw results to ``<out_dir>/raw/``.

The parent then builds the measured profile and cluster and groups the devices
(:func:`deepcee.planner.grouping.group_devices`), and writes (formats in ``docs/profiler.md``):

- ``cluster.json``: ``deepcee.cluster`` v1 with explicit per-device-pair links and measured
  slowdowns and kinds (:func:`measured_cluster`);
- ``profile.json``: ``deepcee.profile`` v2 with measured per-layer timings (lines and the
  times at every probed size), optimizer steps, memory overheads per device kind, the
  links' transfer curves and the per-step bookkeeping (:func:`deepcee.profiler.model.measured_profile`);
- ``probes.json``: ``deepcee.probes`` v1, every raw figure behind the two (medians, spreads,
  pacing ratios, memory, compute scores, link fits with their spread);
- ``groups.txt``: islands and groups, one line per cut.

The network probe runs over gloo between host processes (CPU tensors) even when the devices
are GPUs: it measures host-to-host paths, not NVLink/PCIe peer copies.
"""

from __future__ import annotations

import logging
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepcee.cluster import Cluster, Device, DeviceKind, Node
from deepcee.errors import ProfileError
from deepcee.inputs import Fields, read_json
from deepcee.inputs.limits import BYTES, MAX_DEVICES, MEASURED_TIME
from deepcee.nets.split import SplitModel
from deepcee.plan import save_json_atomic
from deepcee.planner.grouping import (
    DEFAULT_ISLAND_THRESHOLD_S,
    DEFAULT_SPEED_RATIO,
    Grouping,
    group_devices,
)
from deepcee.profile import ModelProfile
from deepcee.profiler.baseline import measure_fixed
from deepcee.profiler.device import net_source, probe_device
from deepcee.profiler.memory_probe import memory_probe
from deepcee.profiler.model import (
    base_profile,
    call_overheads,
    kind_lines,
    measured_kind,
    measured_profile,
    measured_slowdowns,
)
from deepcee.profiler.network import LinkFit, NetworkBudget, PairMode, link_entries, probe_network
from deepcee.profiler.probes import DeviceProbe, ProbeConfig, load_probe, probe_to_dict
from deepcee.runtime import dist as rdist
from deepcee.runtime.emulation import (
    DEFAULT_CORES,
    Clock,
    DevicePacer,
    FileLedger,
    LinkShaper,
    choose_dilation,
)
from deepcee.runtime.launch import launch
from deepcee.runtime.realnet import launch_realnet

log = logging.getLogger(__name__)

PROBES_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileJob:
    """What every rank of a profiling run needs (pickled to the spawned processes)."""

    cluster: Cluster
    model: str | Sequence[nn.Module] | SplitModel
    raw_dir: str
    emulated: bool
    dilation: float
    network_dilation: float
    device_config: ProbeConfig
    network_budget: NetworkBudget
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    dataset: Any = None
    use_cuda: bool = False
    log_level: int = logging.WARNING
    probe_devices: bool = True
    """False: links only (:func:`probe_links`)."""
    realnet: bool = False
    """Links are real TCP through the relay (ranks started by :func:`deepcee.runtime.realnet.launch_realnet`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileResult:
    """What :func:`profile_cluster` measured and wrote."""

    cluster: Cluster
    profile: ModelProfile
    grouping: Grouping
    probes: tuple[DeviceProbe, ...]
    links: tuple[LinkFit, ...]
    pair_mode: PairMode
    files: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0


def _rank_main(rank: int, world_size: int, store_path: str, job: ProfileJob) -> None:
    """What every profiling process runs (see the module docstring)."""
    logging.basicConfig(level=job.log_level, format=f"%(asctime)s rank {rank} %(name)s: %(message)s")
    rdist.single_thread()
    cluster = job.cluster
    devices = cluster.device_names
    me = cluster.device(devices[rank])
    device = rdist.pick_device(job.use_cuda, rank)
    timeout = job.network_budget.timeout_s
    store = rdist.file_store(store_path, world_size, timeout)
    # gloo even for GPUs: the network probe moves host tensors (see the module docstring)
    rdist.init_process_group(store=store, rank=rank, world_size=world_size, backend="gloo", timeout_s=timeout,
                             device=torch.device("cpu"))
    raw = Path(job.raw_dir)
    try:
        if job.probe_devices:
            _device_phase(rank, me, device, job, raw, _fixed(raw, rank))
            dist.barrier()
        clock = Clock()
        shaper = None
        if job.emulated and not job.realnet:
            shaper = LinkShaper(dilation=job.network_dilation, ledger=FileLedger(raw / "link-ledger"),
                                epoch=_epoch(store, rank, clock), clock=clock)
        fits, mode = probe_network(rank, devices, cluster=cluster, shaper=shaper, clock=clock,
                                   budget=job.network_budget, dilation=job.network_dilation)
        overhead = step_overhead_wall_s(store, rank, world_size, realnet=job.realnet)
        save_json_atomic(raw / f"links-{rank}.json", {"mode": mode, "fits": [f.to_dict() for f in fits],
                                                      "step_overhead_wall_s": overhead})
    finally:
        rdist.shutdown()


def _fixed(raw: Path, rank: int) -> float:
    """This rank's fixed memory overhead, measured by :func:`deepcee.profiler.baseline.measure_fixed`
    before the profiling launch (0 when it was not)."""
    path = raw / f"baseline-{rank}.json"
    if not path.exists():
        return 0.0
    f = Fields(read_json(path, ProfileError), file=str(path), error=ProfileError)
    return f.number("fixed_bytes", BYTES)


STEP_RECORD_BYTES = 2048
"""Size of the stand-in step record :func:`step_overhead_wall_s` moves (a gpt-tiny rank's pickled
record, without traces, is 1-2 kB)."""


def step_overhead_wall_s(store: Any, rank: int, world_size: int, *, realnet: bool, repeats: int = 15) -> float:
    """Median wall seconds this rank spends per step on the runtime's step records: a gloo
    ``gather_object`` to rank 0 over loopback (mode ``emulated``), or, in mode ``realnet``,
    publishing its record in the store (rank 0 also reads every rank's, timed once they are all
    there: waiting for the last rank is the step's own time, not bookkeeping). Collective."""
    record = {"rank": rank, "pad": bytes(STEP_RECORD_BYTES)}
    times = []
    for k in range(repeats):
        dist.barrier()
        prefix = f"profile/records/{k}"
        t0 = time.perf_counter()
        if realnet:
            store.set(f"{prefix}/{rank}", pickle.dumps(record))
            spent = time.perf_counter() - t0
            if rank == 0:
                keys = [f"{prefix}/{r}" for r in range(world_size)]
                store.wait(keys, timedelta(seconds=30))
                t1 = time.perf_counter()
                [pickle.loads(store.get(key)) for key in keys]
                spent += time.perf_counter() - t1
        else:
            out = [None] * world_size if rank == 0 else None
            dist.gather_object(record, out, dst=0)
            spent = time.perf_counter() - t0
        times.append(spent)
    return statistics.median(times)


def _device_phase(rank: int, me: Device, device: torch.device, job: ProfileJob, raw: Path, fixed: float) -> None:
    pacer = None
    if job.emulated and device.type == "cpu":
        pacer = DevicePacer(slowdown=me.slowdown, dilation=job.dilation)
    source = net_source(job.model, loss_fn=job.loss_fn, dataset=job.dataset)
    inputs, targets = source.batch(max(job.device_config.microbatch_sizes))
    memory = memory_probe(fixed, source.blocks, inputs, targets, source.loss_fn, device)
    log.info("probing device %s (%s%s)", me.name, device, f", emulated slowdown {me.slowdown:g}" if pacer else "")
    probe = probe_device(source, device_name=me.name, kind=me.kind, device=device, config=job.device_config,
                         pacer=pacer)
    probe = replace(probe, memory=memory)
    save_json_atomic(raw / f"device-{rank}.json", probe_to_dict(probe))
    log.info("device %s probed in %.1f s; probing links", me.name, probe.wall_s)


def _epoch(store: Any, rank: int, clock: Clock) -> float:
    if rank == 0:
        store.set("profile/epoch", repr(clock.wall()))
    store.wait(["profile/epoch"], timedelta(seconds=30))
    return float(store.get("profile/epoch").decode())


# -- assembly (parent) ---------------------------------------------------------------------


def measured_cluster(cluster: Cluster, probes: Sequence[DeviceProbe], fits: Sequence[LinkFit], mode: PairMode,
                     profile: ModelProfile, *, emulated: bool) -> Cluster:
    """``cluster`` with measured kinds, device slowdowns and links (see the module docstring)."""
    slow = measured_slowdowns(probes)
    kinds = {name: measured_kind(k, probes, profile) for name, k in cluster.kinds.items()}
    entries, intra = link_entries(cluster, fits, mode)
    nodes = tuple(Node(name=n.name, island=n.island, kind=n.kind, devices=n.devices, intra=intra.get(n.name, n.intra))
                  for n in cluster.nodes)
    devices = tuple(Device(name=d.name, kind=d.kind, node=d.node, island=d.island,
                                slowdown=slow.get(d.name, d.slowdown)) for d in cluster.devices)
    note = ("measured by deepcee profile: device speeds on emulated devices (CPU time x stated slowdown), links "
            "over the in-process link shaper emulating the declared links" if emulated else "")
    desc = f"{cluster.description} (measured by deepcee profile)".strip()
    return Cluster(name=cluster.name, kinds=kinds, islands=cluster.islands, nodes=nodes, devices=devices,
                   links=entries, description=desc, emulation=note)


def _read_raw(raw: Path, world: int, *, devices: bool = True
              ) -> tuple[list[DeviceProbe], list[LinkFit], PairMode, float]:
    """Every rank's records: device probes, link fits, the pair mode and the slowest rank's
    per-step bookkeeping (wall seconds)."""
    probes, fits, modes, overhead = [], [], set(), 0.0
    for r in range(world):
        for name in ([f"device-{r}.json"] if devices else []) + [f"links-{r}.json"]:
            if not (raw / name).exists():
                raise ProfileError(f"rank {r} left no result ({name})", file=str(raw))
        if devices:
            probes.append(load_probe(raw / f"device-{r}.json"))
        links = Fields(read_json(raw / f"links-{r}.json", ProfileError), file=str(raw / f"links-{r}.json"),
                       error=ProfileError)
        modes.add(links.text("mode"))
        fits += [LinkFit.from_dict(f) for f in links.items("fits", max_len=MAX_DEVICES**2)]
        overhead = max(overhead, float(links.number("step_overhead_wall_s", MEASURED_TIME, 0.0)))
        links.done()
    if len(modes) != 1:
        raise ProfileError(f"ranks disagree on the pair mode: {sorted(modes)}")
    return probes, fits, modes.pop(), overhead


def groups_text(grouping: Grouping) -> str:
    """What ``groups.txt`` holds: :meth:`Grouping.describe`."""
    return grouping.describe()


def _kind_lines_dict(probes: Sequence[DeviceProbe], parameter_counts: Sequence[int]) -> dict[str, Any]:
    """Per kind, the single-layer ``F``/``I``/``W``/``B`` lines inside a stage and in a first stage,
    and the raw per-call overhead estimates (before :mod:`deepcee.profiler.model` clamps them)."""
    slow = measured_slowdowns(probes)
    inner, first = kind_lines(probes, slow), kind_lines(probes, slow, first_stage=True)
    overheads = call_overheads(probes, slow, parameter_counts)

    def rows(layers: Sequence[dict[str, tuple[float, float]]]) -> list[dict[str, list[float]]]:
        return [{p: list(v) for p, v in layer.items()} for layer in layers]

    return {kind: {"layers": rows(layers), "first_stage": rows(first.get(kind, ())),
                   "call_overhead": dict(zip(("inner", "first_stage"), overheads.get(kind, ({}, {})), strict=True))}
            for kind, layers in inner.items()}


def probes_dict(cluster: Cluster, model: ModelProfile, probes: Sequence[DeviceProbe], fits: Sequence[LinkFit],
                mode: PairMode, *, emulated: bool, dilation: float, network_dilation: float, cores: float,
                config: ProbeConfig, budget: NetworkBudget) -> dict[str, Any]:
    return {
        "format": "deepcee.probes", "schema_version": PROBES_SCHEMA_VERSION, "cluster": cluster.name, "model": model.name,
        "emulated": emulated, "dilation": dilation, "network_dilation": network_dilation, "cores": cores,
        "device_config": asdict(config), "network_budget": asdict(budget),
        "slowdowns": measured_slowdowns(probes),
        "kind_lines": _kind_lines_dict(probes, [la.parameter_count for la in model.layers]),
        "devices": [probe_to_dict(p) for p in probes],
        "links": {"mode": mode, "fits": [f.to_dict() for f in fits]},
    }


def profile_cluster(cluster: Cluster, model: str | Sequence[nn.Module] | SplitModel = "gpt-tiny",
                    out_dir: str | Path = "profile",
                    *, emulated: bool = True, cores: float = DEFAULT_CORES, device_config: ProbeConfig | None = None,
                    network_budget: NetworkBudget | None = None, network_dilation: float | None = None,
                    deadline_s: float = 600.0,
                    loss_fn: Callable | None = None, dataset: Any = None, use_cuda: bool = False,
                    island_threshold_s: float = DEFAULT_ISLAND_THRESHOLD_S,
                    speed_ratio: float = DEFAULT_SPEED_RATIO, name: str | None = None, realnet: bool = False) -> ProfileResult:
    """Profile every device and link of ``cluster`` for ``model``; write the files into ``out_dir``.

    ``model``: a built-in net's name or a user's model (blocks, a
    :class:`~deepcee.nets.split.SplitModel`, ...; with ``loss_fn`` unless the split has one, and
    ``dataset``), named ``name`` in the profile. ``realnet``: devices emulated as in ``emulated`` mode, links
    real TCP through the shaping relay (root and ``/dev/net/tun`` needed), as ``deepcee train
    --mode realnet`` runs them."""
    t0 = time.monotonic()
    out = Path(out_dir)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for stale in raw.glob("*.json"):
        stale.unlink()
    config = device_config or ProbeConfig()
    budget = network_budget or NetworkBudget()
    dilation = choose_dilation([d.slowdown for d in cluster.devices], cores) if emulated else 1.0
    net_dilation = (dilation if network_dilation is None else network_dilation) if emulated else 1.0
    if realnet and not emulated:
        raise ProfileError("realnet profiling paces emulated devices: pass emulated=True with realnet=True")
    job = ProfileJob(cluster=cluster, model=model, raw_dir=str(raw), emulated=emulated, dilation=dilation,
                     network_dilation=net_dilation,
                     device_config=config, network_budget=budget, loss_fn=loss_fn, dataset=dataset,
                     use_cuda=use_cuda, log_level=logging.getLogger("deepcee").getEffectiveLevel(), realnet=realnet)
    world = len(cluster.devices)
    links = "realnet" if realnet else "emulated" if emulated else "real"
    log.info("profiling %d devices of %s for %s (links %s, dilation %.3g), deadline %g s", world, cluster.name,
             model if isinstance(model, str) else "user blocks", links, dilation, deadline_s)
    measure_fixed(cluster, raw, realnet=realnet, dilation=net_dilation, use_cuda=use_cuda,
                  deadline_s=min(180.0, deadline_s))  # [Note: fixed memory]
    if realnet:
        launch_realnet(_rank_main, (job,), cluster=cluster, devices=cluster.device_names, deadline_s=deadline_s,
                       dilation=net_dilation)
    else:
        launch(_rank_main, (job,), world_size=world, deadline_s=deadline_s)
    probes, fits, mode, overhead = _read_raw(raw, world)
    log.info("%d devices and %d directed links probed in %.1f s; building the measured profile and cluster",
             len(probes), len(fits), time.monotonic() - t0)
    source = net_source(model, loss_fn=loss_fn, dataset=dataset, name=name)
    how = ("emulated devices" if emulated else "real devices") + f", {links} links"
    profile = measured_profile(base_profile(source), probes,
                               source=f"measured by deepcee profile on {cluster.name} ({how}, {probes[0].timer})",
                               fits=fits, step_overhead_wall_s={links: overhead})
    _log_profile(profile)
    measured = measured_cluster(cluster, probes, fits, mode, profile, emulated=emulated)
    log.info("measured slowdowns: %s", ", ".join(f"{d.name} {d.slowdown:.3g}" for d in measured.devices))
    grouping = group_devices(measured, island_threshold_s=island_threshold_s, speed_ratio=speed_ratio)
    log.info("grouping: %s", "; ".join(grouping.explain()[:1]))
    files = {"cluster": str(out / "cluster.json"), "profile": str(out / "profile.json"),
             "probes": str(out / "probes.json"), "groups": str(out / "groups.txt")}
    save_json_atomic(files["cluster"], measured.to_dict())
    save_json_atomic(files["profile"], profile.to_dict())
    save_json_atomic(files["probes"], probes_dict(measured, profile, probes, fits, mode, emulated=emulated,
                                                  dilation=dilation, network_dilation=net_dilation, cores=cores,
                                                  config=config, budget=budget))
    Path(files["groups"]).write_text(groups_text(grouping))
    wall = time.monotonic() - t0
    log.info("profile of %s written to %s in %.1f s", cluster.name, out, wall)
    return ProfileResult(cluster=measured, profile=profile, grouping=grouping, probes=tuple(probes), links=tuple(fits),
                         pair_mode=mode, files=files, wall_s=wall)



def _log_profile(profile: ModelProfile) -> None:
    for kind in profile.measured:
        whole = {p: profile.time_s(0, profile.num_layers, p, 1, _named(kind), 1.0) for p in ("F", "I", "W", "B")}
        call = profile.measured_call_overhead.get(kind)
        log.info("kind %s: whole model as one stage, 1 sample: %s; per-call overhead %s", kind,
                 ", ".join(f"{p} {t * 1e3:.3g} ms" for p, t in whole.items()),
                 "not measured" if call is None else ", ".join(
                     f"{p} {call.time_s(p, 0.0) * 1e3:.3g} ms" for p in ("F", "I", "W", "B")))


def _named(kind: str) -> DeviceKind:
    """A stand-in kind of that name (``ModelProfile.time_s`` looks measured timings up by name)."""
    return DeviceKind(name=kind, peak_flops_per_s=1.0, memory_bytes=1.0)


def probe_links(cluster: Cluster, *, emulated: bool = True, dilation: float = 1.0,
                budget: NetworkBudget | None = None, deadline_s: float = 300.0) -> tuple[tuple[LinkFit, ...], PairMode]:
    """The network probe alone: one process per device of ``cluster``, no device probe, no files kept.

    ``emulated``: the cluster's declared links are emulated by the runtime's link shaper with
    time dilation ``dilation``; otherwise the real transport between the processes is measured.
    """
    budget = budget or NetworkBudget()
    with tempfile.TemporaryDirectory(prefix="deepcee-links-") as tmp:
        job = ProfileJob(cluster=cluster, model="", raw_dir=tmp, emulated=emulated, dilation=dilation,
                         network_dilation=dilation if emulated else 1.0, device_config=ProbeConfig(),
                         network_budget=budget, log_level=logging.getLogger("deepcee").getEffectiveLevel(),
                         probe_devices=False)
        launch(_rank_main, (job,), world_size=len(cluster.devices), deadline_s=deadline_s)
        _, fits, mode, _ = _read_raw(Path(tmp), len(cluster.devices), devices=False)
    return tuple(fits), mode
