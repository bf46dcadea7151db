"""User-space WAN relay: real IP packets between network namespaces, shaped per link.

Each rank runs in its own network namespace (:mod:`deepcee.runtime.realnet.netns`) whose only
route to the other ranks is a TUN device. The relay process holds the other end of every
TUN device (a file descriptor per rank), reads each IPv4 packet a rank sends, finds the
destination rank from the packet's destination address (bytes 16-20 of the IPv4 header), and
writes the packet into the destination's TUN device at the release time the shaping rule
gives it (:class:`deepcee.runtime.realnet.shaping.WanQueue`: FIFO and rate per link
resource, then the pair's latency; drop-tail past ``queue_limit_s``). Rates and latencies
change live through a control socket (:class:`RelayControl`, usable from any process on the
machine) and bandwidth traces apply at their change times (seconds after ``epoch_s``, which a
control request can move to the training run's start).

:func:`serve` is the I/O loop around the pure core, and this file is also the relay
process's entry::

    python -c "import json, runpy, sys; sys.path[:] = json.loads(sys.argv.pop(1)); \\
        runpy.run_path(sys.argv.pop(1), run_name='__main__')" SYS_PATH_JSON RELAY_FILE \\
        --config relay.json --fds 5,6 --owner deepcee-relay-owner=PID

It is started that way by :mod:`deepcee.runtime.realnet.launcher`: with the parent's
``sys.path``, so that it imports the same tree whatever its environment says, and by file, so
that it loads nothing but the standard library, :mod:`deepcee.errors` and
:mod:`deepcee.runtime.realnet.shaping` (no torch: 2-3 s, ~220 MB); the package ``__init__``
files on the way import nothing eagerly. It logs (``logging``, set
up by :func:`main`) to its stderr, which the launcher keeps in ``relay.log``.

CPU cost. The loop does one ``select`` per wake-up and one ``read`` and one ``write`` system
call per packet; the ``write`` also runs the receiving namespace's IP/TCP input path, which
the kernel charges to the relay. With TUN offload ([Note: TUN offload]) TCP hands over about
12 kB per packet at 100 Mbit/s instead of 1500 B. Measured by ``benchmarks/realnet_link.py``
(20 ms / 100 Mbit/s, one TCP stream saturating the link, 2-core machine at load average 3-7
from other work; five runs): 16-18% of one core with offload (0.015-0.016 CPU-seconds per
MB, about a third in the kernel), 36-45% without; idle, the relay wakes twice a second. Its
ceiling on an unshaped pipe was 1.7-3.3 Gbit/s at 43-56% of a core. It runs at nice -10 with a 1 us
timer slack so that contention delays its releases less. The smallest round trip it adds
over the configured latencies is about 0.5 ms (40.5 ms measured for 2 x 20 ms).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import secrets
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.runtime.realnet.shaping import RelayConfig, RelayStats, WanQueue

log = logging.getLogger(__name__)

RELAY_FILE = str(Path(__file__).resolve())
RELEASE_SLACK_S = 1e-4
"""Packets due this soon are released in the same wake-up (0.1 ms, well under any WAN latency)."""
MAX_WAIT_S = 0.5
"""Longest sleep of the loop without I/O (bounds the reaction to a dead owner)."""
READ_BURST = 64
"""Packets read from one TUN device per wake-up before serving the others (fairness)."""
PACKET_MAX_BYTES = 65536
RELAY_NICE = -10
"""Scheduling priority change of the relay process (root only)."""
OWNER_MARKER = "deepcee-relay-owner="
"""Part of the relay's command line: stale-cleanup finds relays whose owner died by it."""


# -- the relay process ------------------------------------------------------------------


# [Note: TUN offload]
# With IFF_VNET_HDR and TUNSETOFFLOAD(CSUM | TSO4 | TSO6) the TUN device looks like a NIC
# with segmentation offload: TCP hands the relay "super-packets" of up to 64 kB, each behind
# a 10-byte virtio-net header (flags, gso_type, hdr_len, gso_size, csum_start, csum_offset;
# little-endian), and the relay writes the same bytes into the destination device, whose
# kernel accepts them like a GRO-merged packet. TCP still runs with the MTU's segment size
# (its windows, slow start and ACK clocking are those of MSS-sized segments), but the relay
# moves several segments per system call, which cuts its CPU per byte several-fold. The
# shaping charges the bytes the segments would put on the wire: every segment after the
# first repeats the IP and TCP headers (:func:`wire_bytes`).


def ipv4_destination(packet: bytes, offset: int = 0) -> bytes | None:
    """The 4-byte destination address of the IPv4 packet at ``offset``, or ``None`` for anything else."""
    if len(packet) < offset + 20 or packet[offset] >> 4 != 4:
        return None
    return packet[offset + 16:offset + 20]


def wire_bytes(packet: bytes, vnet_hdr_bytes: int) -> int:
    """Bytes the packet occupies on the wire once cut into MSS-sized segments ([Note: TUN offload])."""
    n = len(packet) - vnet_hdr_bytes
    if vnet_hdr_bytes == 0 or packet[1] == 0:  # no header, or gso_type NONE: one segment
        return n
    gso_size = packet[4] | packet[5] << 8
    ip = vnet_hdr_bytes
    if gso_size == 0 or len(packet) < ip + 40 or packet[ip] >> 4 != 4:
        return n
    headers = (packet[ip] & 0x0F) * 4 + (packet[ip + (packet[ip] & 0x0F) * 4 + 12] >> 4) * 4
    segments = -(-(n - headers) // gso_size)
    return n + max(0, segments - 1) * headers


def _handle_control(sock: socket.socket, queue: WanQueue, stats: Callable[[], RelayStats]) -> bool:
    """Serve the pending control requests; returns False on ``stop``."""
    keep = True
    while True:
        try:
            data, addr = sock.recvfrom(65536)
        except BlockingIOError:
            return keep
        reply: dict[str, Any] = {"ok": True}
        try:
            msg = json.loads(data)
            op = msg.get("op")
            if op == "set_bandwidth":
                queue.set_bandwidth(msg["resource"], float(msg["bandwidth_bytes_per_s"]))
            elif op == "set_latency":
                queue.set_latency(int(msg["src"]), int(msg["dst"]), float(msg["latency_s"]))
            elif op == "set_down":
                queue.set_down(int(msg["src"]), int(msg["dst"]), bool(msg["down"]))
            elif op == "set_epoch":
                queue.set_epoch(float(msg["epoch_s"]), time.monotonic())
            elif op == "stop":
                keep = False
            elif op not in ("ping", "stats"):
                raise SpecError(f"unknown op {op!r}")
            reply["stats"] = stats().to_dict()
        except (SpecError, KeyError, ValueError, TypeError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if addr:
            try:
                sock.sendto(json.dumps(reply).encode(), addr)
            except OSError:
                pass  # the client gave up waiting; nothing to tell it


def serve(config: RelayConfig, tun_fds: Sequence[int], *, owner_pid: int | None = None,
          stop: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.monotonic) -> RelayStats:
    """Move packets between ``tun_fds`` (rank order) until a ``stop`` request, ``stop()`` or the owner's death."""
    if len(tun_fds) != len(config.addresses):
        raise SpecError(f"{len(config.addresses)} addresses but {len(tun_fds)} TUN descriptors", field="fds")
    t0, times0 = clock(), os.times()
    queue = WanQueue(config.pairs, config.resources, queue_limit_s=config.queue_limit_s,
                     epoch_s=t0 if config.epoch_s is None else config.epoch_s, down_armed=config.epoch_s is not None)
    rank_of_addr = {socket.inet_aton(a): i for i, a in enumerate(config.addresses)}
    rank_of_fd = {fd: i for i, fd in enumerate(tun_fds)}
    hdr = config.vnet_hdr_bytes
    for fd in tun_fds:
        os.set_blocking(fd, False)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ctl.bind(config.control_path)
    ctl.setblocking(False)
    write_errors = 0
    stopping = []

    def stats() -> RelayStats:
        s = queue.stats()
        t = os.times()
        return RelayStats(resources=s.resources, unroutable=s.unroutable, queued=s.queued, wall_s=clock() - t0,
                          cpu_s=t.user + t.system - times0.user - times0.system, system_s=t.system - times0.system,
                          write_errors=write_errors)

    watch = [*tun_fds, ctl.fileno()]
    try:
        while not stopping and not stop():
            now = clock()
            nxt = queue.next_event_s()
            wait = MAX_WAIT_S if nxt is None else min(MAX_WAIT_S, max(0.0, nxt - now))
            ready, _, _ = select.select(watch, [], [], wait)
            now = clock()
            queue.advance(now)
            for fd in ready:
                src = rank_of_fd.get(fd)
                if src is None:
                    if not _handle_control(ctl, queue, stats):
                        stopping.append(True)
                    continue
                for _ in range(READ_BURST):
                    try:
                        pkt = os.read(fd, PACKET_MAX_BYTES)
                    except BlockingIOError:
                        break
                    dst = rank_of_addr.get(ipv4_destination(pkt, hdr) or b"")
                    if dst is None:
                        queue.unroutable += 1
                    else:
                        queue.offer(src, dst, wire_bytes(pkt, hdr), now, pkt)
            for dst, pkt in queue.pop_due(clock() + RELEASE_SLACK_S):
                try:
                    os.write(tun_fds[dst], pkt)
                except OSError:
                    write_errors += 1  # the receiving stack's backlog is full: the packet is lost
            if owner_pid is not None and not ready and os.getppid() != owner_pid:
                log.warning("relay owner %d is gone; stopping", owner_pid)
                break
    finally:
        final = stats()
        ctl.close()
        Path(config.control_path).unlink(missing_ok=True)
    return final


# -- the client side --------------------------------------------------------------------


class RelayControl:
    """Talks to a running relay over its control socket (from any process on this machine)."""

    def __init__(self, control_path: str | Path, *, timeout_s: float = 5.0) -> None:
        self.control_path = str(control_path)
        self.timeout_s = timeout_s

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        # The reply needs a bound client address; a path next to the control socket, removed after.
        client = str(Path(self.control_path).parent / f"c-{os.getpid()}-{secrets.token_hex(4)}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.bind(client)
            try:
                s.settimeout(self.timeout_s)
                s.sendto(json.dumps(msg).encode(), self.control_path)
                reply = json.loads(s.recv(1 << 20))
            except (OSError, TimeoutError) as exc:
                raise RuntimeSetupError(f"relay at {self.control_path} did not answer {msg.get('op')!r} "
                                        f"within {self.timeout_s:g} s: {exc}") from None
            finally:
                Path(client).unlink(missing_ok=True)
        if not reply.get("ok"):
            raise SpecError(f"relay refused {msg}: {reply.get('error')}")
        return reply

    def ping(self) -> RelayStats:
        return RelayStats.from_dict(self._call({"op": "ping"})["stats"])

    def stats(self) -> RelayStats:
        return RelayStats.from_dict(self._call({"op": "stats"})["stats"])

    def set_bandwidth(self, resource: str, bandwidth_bytes_per_s: float) -> None:
        """Change ``resource``'s rate now (a live bandwidth change; queued packets keep their times)."""
        self._call({"op": "set_bandwidth", "resource": resource, "bandwidth_bytes_per_s": bandwidth_bytes_per_s})

    def set_latency(self, src: int, dst: int, latency_s: float) -> None:
        self._call({"op": "set_latency", "src": src, "dst": dst, "latency_s": latency_s})

    def set_down(self, src: int, dst: int, down: bool) -> None:
        """Cut the directed pair ``src -> dst`` (ranks) now, or bring it back: a dead link."""
        self._call({"op": "set_down", "src": src, "dst": dst, "down": down})

    def set_epoch(self, epoch_s: float) -> None:
        """Restart the bandwidth traces and link-down windows at ``epoch_s`` (a ``time.monotonic()``
        value of this machine)."""
        self._call({"op": "set_epoch", "epoch_s": epoch_s})

    def stop(self) -> RelayStats:
        """Ask the relay to exit; returns its final counters."""
        return RelayStats.from_dict(self._call({"op": "stop"})["stats"])


PR_SET_PDEATHSIG = 1
PR_SET_TIMERSLACK = 29
TIMER_SLACK_NS = 1000


def _tune_process(die_with_parent: bool) -> None:
    """PR_SET_TIMERSLACK: wake within 1 us of a release time instead of the default 50 us;
    PR_SET_PDEATHSIG: the kernel sends SIGTERM if the parent dies (belt to the owner check)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return  # not Linux/glibc: default timer slack; the loop's owner check still ends the relay
    prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS)
    if die_with_parent:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deepcee-relay", description="user-space WAN relay between TUN devices")
    ap.add_argument("--config", required=True)
    ap.add_argument("--fds", required=True, help="TUN file descriptors in rank order, comma-separated")
    ap.add_argument("--owner", default="", help=f"{OWNER_MARKER}PID: exit when that parent is gone")
    ap.add_argument("--stats-out", default="", help="write the final counters here (JSON)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="relay: %(message)s")
    owner = int(a.owner.removeprefix(OWNER_MARKER)) if a.owner else None
    _tune_process(die_with_parent=owner is not None)
    if owner is not None:
        if os.getppid() != owner:
            return 1  # the owner died before we armed the signal
    try:
        # Its wake-ups are the links' timing: under CPU contention a normal-priority relay releases
        # packets late. It uses a small fraction of a core, so a higher priority costs others little.
        os.nice(RELAY_NICE)
    except OSError:
        log.info("cannot raise the relay's priority (not root?); packet timing may lag under load")
    terminated: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: terminated.append(signum))
    try:
        config = RelayConfig.from_dict(json.loads(Path(a.config).read_text()))
        fds = [int(x) for x in a.fds.split(",")]
        final = serve(config, fds, owner_pid=owner, stop=lambda: bool(terminated))
    except (SpecError, OSError, ValueError, KeyError) as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    if a.stats_out:
        tmp = Path(a.stats_out + ".tmp")
        tmp.write_text(json.dumps(final.to_dict()))
        tmp.replace(a.stats_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
