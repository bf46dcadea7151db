"""Real-network emulation: one network namespace per rank, real TCP through a shaping relay.

:func:`launch_realnet` is :func:`deepcee.runtime.launch.launch` with real networking: rank
``r`` runs ``target(r, world_size, store_path, *args)`` in its own network namespace
(:mod:`deepcee.runtime.realnet.netns`), and every packet between two ranks crosses the user-space
relay (:mod:`deepcee.runtime.realnet.relay`), which delays it by the link's latency and serialises
it at the link's bandwidth, pairs sharing a link *resource* sharing one queue and rate, all
taken from ``cluster.link(devices[src], devices[dst])`` (latencies, trace times and the
queue limit x ``dilation``, bandwidths and trace rates / ``dilation``). gloo binds to the
rank's TUN device (``GLOO_SOCKET_IFNAME``), so collectives and point-to-point messages are
real TCP over an emulated WAN: slow start, ACK clocking, losses at the relay's drop-tail
queue, and gloo's own handshakes all pay the link's latency (e.g. a gloo send waits for the
receiver's "ready" notice unless the receive was posted earlier: one more one-way latency
per step of a ring all-reduce than the simulator's alpha-beta ring). The namespaces use a
stated TCP congestion control, CUBIC by default ([Note: congestion control in the
namespaces] in :mod:`deepcee.runtime.realnet.netns`). The rendezvous is a
``FileStore`` on the shared filesystem (namespaces do not isolate files), so it does not
travel over the emulated links.

:class:`RealNetwork` is the same set-up as a context manager, for callers that start their
own processes in the namespaces (:meth:`RealNetwork.popen`) or change rates live while ranks
run (:attr:`RealNetwork.control`, a :class:`deepcee.runtime.realnet.relay.RelayControl`; any process
on the machine can open one on :attr:`RealNetwork.control_path`).

Everything is torn down on every exit path (normal, exception, deadline): rank processes
killed by pid, relay stopped (then killed), namespaces deleted, TUN devices gone with the
relay's descriptors, temporary directory removed. Rank processes and the relay also get a
parent-death signal ([Note: no orphans] in :mod:`deepcee.runtime.supervise`), and
:func:`deepcee.runtime.realnet.netns.cleanup_stale` removes what a killed parent left before
each new set-up.

Processes: ``world_size`` ranks + 1 relay (standard library only, no torch). Ranks are
started as ``ip netns exec NS python -c <bootstrap>`` (:func:`deepcee.runtime.supervise.rank_argv`:
the bootstrap restores the parent's ``sys.path``, like ``multiprocessing``'s spawn, and
unpickles ``(target, args)``, so ``target`` must be importable by module name) and watched by
:func:`deepcee.runtime.supervise.supervise`, as the local launcher's ranks are.

Limits: the relay is one Python process, so a link faster than its ceiling (2-3 Gbit/s
measured, see :mod:`deepcee.runtime.realnet.relay`) is capped by it, e.g. the 10 Gbit/s intra-node
links of ``local-small`` (a ``dilation`` > 1 brings them closer). Same-node
devices still get separate namespaces and cross the relay. IPv4 only. Every rank's
environment holds :data:`RELAY_CONTROL_ENV` (the control socket path).

Use::

    stats = launch_realnet(my_module.entry, (arg,), cluster=cluster, devices=plan.devices, deadline_s=300)

    with RealNetwork(cluster, devices) as net:         # or: keep the network, steer it live
        ...start a thread that calls net.control.set_bandwidth(resource, bytes_per_s)...
        net.run(my_module.entry, (arg,), deadline_s=300)

Needs root and ``/dev/net/tun`` (:func:`deepcee.runtime.realnet.netns.require_realnet`); without them
:class:`RuntimeSetupError` says why, and the in-process link emulation
(:mod:`deepcee.runtime.emulation`) remains the fallback.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster
from deepcee.cluster.outages import LinkOutage
from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.runtime import dist as rdist
from deepcee.runtime.realnet.netns import (
    DEFAULT_CONGESTION_CONTROL,
    RUN_DIR_PREFIX,
    VNET_HDR_BYTES,
    Endpoint,
    WanNamespaces,
    cleanup_stale,
    rank_address,
    require_realnet,
)
from deepcee.runtime.realnet.relay import OWNER_MARKER, RELAY_FILE, RelayControl
from deepcee.runtime.realnet.shaping import PairSpec, RelayConfig, RelayStats, ResourceSpec
from deepcee.runtime.supervise import (
    Elastic,
    Worker,
    death_signal_preexec,
    rank_argv,
    stop,
    supervise,
    write_payload,
)

log = logging.getLogger(__name__)

DEFAULT_QUEUE_LIMIT_S = 0.05
"""Relay buffer per resource, in emulated seconds of serialisation at the link's rate (50 ms:
625 kB at 100 Mbit/s). The relay gets ``queue_limit_s x dilation`` wall seconds at the
dilated rate, so the buffer in bytes does not depend on the dilation: unscaled, it shrank by
``D``, below the queue TCP builds up on a 20 ms / 100 Mbit/s link (39 emulated ms measured):
a 0.95 MB gloo all-reduce repeated at D = 1.67 lost 19-20 packets per direction and took
363 ms instead of 268 ms (wall), and gpt-tiny training (benchmarks/realnet_link.py part
``train``) lost 37-46 packets per launch, none since."""
RELAY_START_S = 10.0

# The relay runs by file with the parent's sys.path, so that it imports this tree's deepcee whatever
# the child's environment says (see the module docstring of deepcee.runtime.realnet.relay).
_RELAY_BOOTSTRAP = ("import json, runpy, sys; sys.path[:] = json.loads(sys.argv.pop(1)); "
                    "runpy.run_path(sys.argv.pop(1), run_name='__main__')")


def relay_config(cluster: Cluster, devices: Sequence[str], *, control_path: str, dilation: float = 1.0,
                 queue_limit_s: float = DEFAULT_QUEUE_LIMIT_S, epoch_s: float | None = None,
                 vnet_hdr_bytes: int = 0, outages: Sequence[LinkOutage] = ()) -> RelayConfig:
    """The relay's pairs and resources for ranks running ``devices`` (rank ``r`` = ``devices[r]``).

    Emulated figures become wall figures: latencies, trace times, ``queue_limit_s`` and the
    windows of ``outages`` (links between nodes down: every pair of their devices drops every
    packet) x ``dilation``, rates / ``dilation``."""
    if dilation < 1:
        raise SpecError(f"must be >= 1, got {dilation!r}", field="dilation")
    if len(set(devices)) != len(devices):
        raise SpecError(f"a device appears twice: {list(devices)}", field="devices")
    pairs, resources = [], {}
    for i, a in enumerate(devices):
        for j, b in enumerate(devices):
            if i == j:
                continue
            link = cluster.link(a, b)
            down = tuple((o.start_s * dilation, None if math.isinf(o.stop_s) else o.stop_s * dilation)
                         for o in outages if o.joins(cluster.device(a).node, cluster.device(b).node))
            pairs.append(PairSpec(src=i, dst=j, latency_s=link.latency_s * dilation, resource=link.resource,
                                  down_s=down))
            trace = link.trace
            spec = ResourceSpec(
                name=link.resource, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s / dilation,
                trace_times_s=tuple(t * dilation for t in trace.times_s) if trace else (),
                trace_bandwidth_bytes_per_s=tuple(bw / dilation for bw in trace.bandwidth_bytes_per_s) if trace else (),
            )
            known = resources.setdefault(link.resource, spec)
            if known != spec:
                # cluster.py gives one resource one spec; two differing would make the FIFO ambiguous
                raise SpecError(f"links {a}->{b} and another share resource {link.resource!r} with different "
                                f"bandwidth or trace ({spec.bandwidth_bytes_per_s} vs {known.bandwidth_bytes_per_s} B/s)")
    return RelayConfig(addresses=tuple(rank_address(r) for r in range(len(devices))), pairs=tuple(pairs),
                       resources=tuple(resources.values()), control_path=control_path,
                       queue_limit_s=queue_limit_s * dilation, epoch_s=epoch_s, vnet_hdr_bytes=vnet_hdr_bytes)


RELAY_CONTROL_ENV = rdist.RELAY_CONTROL_ENV
"""Set in every rank's environment: the relay's control socket (for :class:`RelayControl`)."""


class RealNetwork:
    """Namespaces + relay for ``devices`` of ``cluster``; enter to set up, exit to tear down.

    Rank ``r`` is ``devices[r]``; its namespace, TUN device and address are
    ``endpoints[r]`` (:class:`deepcee.runtime.realnet.netns.Endpoint`).
    """

    def __init__(self, cluster: Cluster, devices: Sequence[str], *, dilation: float = 1.0, mtu_bytes: int = 1500,
                 offload: bool = True, queue_limit_s: float = DEFAULT_QUEUE_LIMIT_S,
                 congestion_control: str | None = DEFAULT_CONGESTION_CONTROL, setup_timeout_s: float = 20.0,
                 outages: Sequence[LinkOutage] = ()) -> None:
        for d in devices:
            cluster.device(d)  # names the unknown device
        if len(devices) < 1:
            raise SpecError("need at least one device", field="devices")
        self.cluster, self.devices = cluster, tuple(devices)
        self.dilation, self.mtu_bytes, self.queue_limit_s = dilation, mtu_bytes, queue_limit_s
        self.setup_timeout_s, self.offload, self.congestion_control = setup_timeout_s, offload, congestion_control
        self.outages = tuple(outages)
        """Links down for a stretch of the run (:mod:`deepcee.cluster.outages`; from the relay's epoch)."""
        self.tmp: Path | None = None
        self.namespaces: WanNamespaces | None = None
        self.relay: subprocess.Popen | None = None
        self.control: RelayControl | None = None
        self.final_stats: RelayStats | None = None
        self._procs: list[subprocess.Popen] = []

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self.namespaces.endpoints

    @property
    def control_path(self) -> str:
        return str(self.tmp / "relay.sock")

    # -- set-up and tear-down ------------------------------------------------------------
    def __enter__(self) -> RealNetwork:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))
        try:
            cleanup_stale(timeout_s=self.setup_timeout_s)
            require_realnet()
            config = relay_config(self.cluster, self.devices, control_path=self.control_path, dilation=self.dilation,
                                  queue_limit_s=self.queue_limit_s, outages=self.outages,
                                  vnet_hdr_bytes=VNET_HDR_BYTES if self.offload else 0)
            self.namespaces = WanNamespaces(self.world_size, mtu_bytes=self.mtu_bytes, offload=self.offload,
                                            congestion_control=self.congestion_control,
                                            timeout_s=self.setup_timeout_s)
            self.namespaces.create()
            self._start_relay(config)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_relay(self, config: RelayConfig) -> None:
        cfg_path = self.tmp / "relay.json"
        cfg_path.write_text(json.dumps(config.to_dict()))
        fds = self.namespaces.tun_fds
        with open(self.tmp / "relay.log", "wb") as logf:
            self.relay = subprocess.Popen(
                [sys.executable, "-c", _RELAY_BOOTSTRAP, json.dumps(sys.path), RELAY_FILE, "--config", str(cfg_path),
                 "--fds", ",".join(map(str, fds)), "--owner", f"{OWNER_MARKER}{os.getpid()}",
                 "--stats-out", str(self.tmp / "relay-stats.json")],
                pass_fds=fds, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        self.namespaces.release_fds()  # the relay now holds the only copies
        self.control = RelayControl(self.control_path, timeout_s=2.0)
        t_end = time.monotonic() + min(RELAY_START_S, self.setup_timeout_s)
        while True:
            if self.relay.poll() is not None:
                raise RuntimeSetupError(f"relay exited with code {self.relay.returncode} at start: {self._relay_log()}")
            if Path(self.control_path).exists():
                self.control.ping()
                return
            if time.monotonic() > t_end:
                raise RuntimeSetupError(f"relay did not open its control socket within {RELAY_START_S:g} s: "
                                        f"{self._relay_log()}")
            time.sleep(0.02)

    def _relay_log(self) -> str:
        try:
            return (self.tmp / "relay.log").read_text(errors="replace").strip()[-800:] or "(no output)"
        except OSError:
            return "(no log)"

    def _stop_relay(self) -> None:
        if self.relay is None:
            return
        if self.relay.poll() is None:
            try:
                self.final_stats = self.control.stop()
            except (RuntimeSetupError, SpecError) as exc:
                log.warning("relay did not stop on request (%s); killing pid %d", exc, self.relay.pid)
            try:
                self.relay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait(timeout=5)
        self.relay = None

    def close(self) -> None:
        """Kill ranks, stop the relay, delete namespaces, remove the temporary directory. Idempotent."""
        stop(self._procs)
        for p in self._procs:
            if p.poll() is None:
                log.error("rank process %d did not die after SIGKILL", p.pid)
        self._procs = []
        try:
            self._stop_relay()
        finally:
            if self.namespaces is not None:
                self.namespaces.close()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)

    # -- processes -----------------------------------------------------------------------
    def rank_env(self, rank: int) -> dict[str, str]:
        """Environment of a rank process: one thread (:data:`deepcee.runtime.dist.WORKER_ENV`), gloo on
        the TUN device, and :data:`RELAY_CONTROL_ENV`."""
        return {**rdist.child_env(), "GLOO_SOCKET_IFNAME": self.endpoints[rank].ifname,
                RELAY_CONTROL_ENV: self.control_path}

    def popen(self, rank: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``rank``'s namespace; killed (by pid) when the network closes."""
        kwargs.setdefault("env", self.rank_env(rank))
        p = subprocess.Popen(self.namespaces.exec_argv(rank, argv), preexec_fn=death_signal_preexec(), **kwargs)
        self._procs.append(p)
        return p

    def run(self, target: Callable[..., None], args: tuple[Any, ...], *, deadline_s: float,
            grace_s: float = 2.0, elastic: Elastic | None = None) -> RelayStats:
        """Run ``target(rank, world_size, store_path, *args)`` on every rank; the relay's counters after.

        Supervised as :func:`deepcee.runtime.launch.launch` is (:func:`deepcee.runtime.supervise.supervise`:
        first failure by time, same error class; past ``deadline_s`` every rank is killed and
        :class:`RuntimeSetupError` names the ranks still running); the relay's death ends the run too.
        """
        run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self.tmp))
        payload = write_payload(run_dir / "payload.pkl", target, args, world_size=self.world_size,
                                store_path=str(run_dir / "store"), error_dir=str(run_dir))
        workers: list[Worker] = []

        def start(r: int) -> Worker:
            # stderr to a file: a rank that dies in native code (abort, segfault) leaves no error
            # record, and its last words are the only clue; they are echoed here after the run.
            with open(run_dir / f"stderr-rank{r}.log", "ab") as err:
                return self.popen(r, rank_argv(payload, r), stderr=err)

        try:
            for r in range(self.world_size):
                workers.append(start(r))
            supervise(workers, run_dir, deadline_s=deadline_s, grace_s=grace_s, label="realnet",
                      check=self._check_relay, elastic=elastic, restart=start,
                      explain=lambda r: f"; rank {r}'s stderr ends: {_tail(run_dir / f'stderr-rank{r}.log', 1500)}")
        finally:
            stop(workers)
            _echo_stderr(run_dir, len(workers))
        return self.control.stats()

    def _check_relay(self) -> None:
        if self.relay.poll() is not None:
            raise RuntimeSetupError(f"relay exited with code {self.relay.returncode} while ranks ran: {self._relay_log()}")


def _tail(path: Path, nbytes: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
            return f.read().decode(errors="replace").strip() or "(empty)"
    except OSError:
        return "(no log)"


def _echo_stderr(run_dir: Path, world_size: int) -> None:
    """Copy each rank's captured stderr to ours, prefixed by the rank (as if inherited)."""
    for r in range(world_size):
        try:
            text = (run_dir / f"stderr-rank{r}.log").read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            sys.stderr.write(f"[rank {r}] {line}\n")


def launch_realnet(target: Callable[..., None], args: tuple[Any, ...], *, cluster: Cluster, devices: Sequence[str],
                   deadline_s: float, dilation: float = 1.0, mtu_bytes: int = 1500, offload: bool = True,
                   queue_limit_s: float = DEFAULT_QUEUE_LIMIT_S,
                   congestion_control: str | None = DEFAULT_CONGESTION_CONTROL, grace_s: float = 2.0,
                   elastic: Elastic | None = None, outages: Sequence[LinkOutage] = ()) -> RelayStats:
    """Run ``target(rank, world_size, store_path, *args)`` with rank ``r`` on ``devices[r]`` over real TCP.

    ``deadline_s`` bounds everything (set-up, run, tear-down excluded). Returns the relay's
    counters (packets, bytes, drops per link resource; the relay's CPU seconds).
    """
    t_end = time.monotonic() + deadline_s
    with RealNetwork(cluster, devices, dilation=dilation, mtu_bytes=mtu_bytes, offload=offload, queue_limit_s=queue_limit_s,
                     congestion_control=congestion_control, outages=outages,
                     setup_timeout_s=min(20.0, deadline_s)) as net:
        left = t_end - time.monotonic()
        if left <= 0:
            raise RuntimeSetupError(f"realnet deadline of {deadline_s:g} s passed during set-up")
        return net.run(target, args, deadline_s=left, grace_s=grace_s, elastic=elastic)
