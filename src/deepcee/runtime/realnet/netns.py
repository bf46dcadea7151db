"""Network namespaces with one TUN device each, for the real-network emulation mode.

:class:`WanNamespaces` creates, for ranks ``0..n-1``, a namespace ``dcee-<owner pid>-<token>-<rank>``
holding a TUN device ``dc<token>r<rank>`` with address :func:`rank_address` (``10.77.x.y/16``),
loopback up, IPv6 address generation off (so the only traffic is the ranks' own) and a
stated TCP congestion control ([Note: congestion control in the namespaces]). The
TUN devices are created in this (the host) namespace, so this process holds their file
descriptors, and then moved into the namespaces: every packet a rank sends to another rank
comes out of its descriptor, and whatever is written to a descriptor is received by that
rank. The relay (:mod:`deepcee.runtime.realnet.relay`) inherits the descriptors and moves the packets.

Clean-up, always: :meth:`WanNamespaces.close` kills the processes left in the namespaces (by
pid, from ``ip netns pids``), deletes the namespaces and closes the descriptors; it runs on
any failure during set-up too. TUN devices are not persistent, so they vanish with the last
descriptor or with their namespace. :func:`cleanup_stale` removes what a crashed run left
(namespaces, relays and temporary run directories of a dead owner pid) and runs before
every set-up.

Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN), ``/dev/net/tun`` and iproute2's ``ip``;
:func:`realnet_unavailable` says in one line what is missing, :func:`require_realnet` raises
:class:`RuntimeSetupError` with that line.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.runtime.realnet.relay import OWNER_MARKER

log = logging.getLogger(__name__)

PREFIX = "dcee"
"""Namespaces are ``dcee-<owner pid>-<token>-<rank>``; nothing else on the host uses it."""
RUN_DIR_PREFIX = "deepcee-realnet-"
"""Temporary directories of realnet runs are ``<tmp>/deepcee-realnet-<owner pid>-<random>``."""
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUNSETOFFLOAD = 0x400454D0
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HDR_BYTES = 10
"""``struct virtio_net_hdr`` before every packet when offloads are on (the default size)."""
DEFAULT_CONGESTION_CONTROL = "cubic"
"""See [Note: congestion control in the namespaces]."""
SUBNET = "10.77"
"""Each namespace holds only its own TUN device, so one fixed /16 never collides across runs."""
MAX_RANKS = 250 * 250


def rank_address(rank: int) -> str:
    """IPv4 address of ``rank``'s TUN device (in ``10.77.0.0/16``)."""
    if not 0 <= rank < MAX_RANKS:
        raise SpecError(f"rank must be in 0..{MAX_RANKS - 1}, got {rank!r}", field="rank")
    return f"{SUBNET}.{rank // 250}.{rank % 250 + 1}"


# [Note: congestion control in the namespaces]
# A new network namespace takes the host's default TCP congestion control, a property of
# whatever machine runs the emulation (BBR on the project's machines), not of the emulated
# deployment. BBR paces every send at its bandwidth estimate, and short bursts separated by
# idle time (a pipeline's activations) keep that estimate low: one 64 kB gloo message over
# 20 ms / 100 Mbit/s took 40-70 ms with BBR (medians of 5 runs) against 26.4-27.7 ms with
# CUBIC (2 runs) and 26.0-26.9 ms with reno (4 runs) (link model 25.4 ms: latency + wire bytes / rate;
# benchmarks/realnet_link.py part ``cc``).
# So the route to the other ranks names the algorithm (``ip route ... congctl``), CUBIC by
# default, Linux's own default. A route's algorithm applies to both ends of a connection and,
# unlike the namespace's default (net.ipv4.tcp_congestion_control), is not limited to the
# host's net.ipv4.tcp_allowed_congestion_control (which here allows only reno and bbr).
# ``None`` keeps the host's default.
#
# [Note: slow start after idle in the namespaces]
# Linux restarts a connection's congestion window from its initial 10 segments after an
# idle time above the retransmission timeout (net.ipv4.tcp_slow_start_after_idle, default 1).
# A pipeline's connections idle for most of a step, so every step's first activation on each
# link paid two to three round trips instead of one transfer: gpt-tiny, 3 stages across the
# 20-40 ms links of local-small (gpipe-3-uneven, D = 5.83) stepped in 467 ms with it against
# 154 ms without it (simulated 150 ms), and a 3-stage 1F1B with a data-parallel first stage in
# 355 ms against 280 ms (simulated 278 ms). Long-lived training connections over a WAN are
# run without it (the sysctl is per network namespace), so the namespaces turn it off;
# ``slow_start_after_idle=True`` keeps the kernel's default.


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """Where one rank lives."""

    rank: int
    namespace: str
    ifname: str
    address: str


def _ip(args: Sequence[str], *, timeout_s: float, stdin: str | None = None, check: bool = True) -> str:
    try:
        out = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeSetupError(f"'ip {' '.join(args)}' did not finish within {timeout_s:g} s") from None
    except FileNotFoundError:
        raise RuntimeSetupError("iproute2's 'ip' command not found") from None
    if check and out.returncode != 0:
        raise RuntimeSetupError(f"'ip {' '.join(args)}' failed: {out.stderr.strip() or out.returncode}")
    return out.stdout


def open_tun(ifname: str, *, offload: bool = False) -> int:
    """Create a (non-persistent) TUN device ``ifname``, no packet-info header; returns its descriptor.

    ``offload``: the device advertises checksum and TCP segmentation offload, so TCP hands
    it segments of up to 64 kB with a :data:`VNET_HDR_BYTES` header saying how to cut them
    (see [Note: TUN offload] in :mod:`deepcee.runtime.realnet.relay`).
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        flags = IFF_TUN | IFF_NO_PI | (IFF_VNET_HDR if offload else 0)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", ifname.encode(), flags))
        if offload:
            fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    except OSError:
        os.close(fd)
        raise
    return fd


def realnet_unavailable(*, timeout_s: float = 10.0) -> str | None:
    """``None`` when namespaces and TUN devices can be made here, else the reason in one line."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "not root: network namespaces and TUN devices need CAP_NET_ADMIN and CAP_SYS_ADMIN"
    if shutil.which("ip") is None:
        return "iproute2's 'ip' command not found"
    token = secrets.token_hex(3)
    try:
        os.close(open_tun(f"dc{token}pr"))
    except OSError as exc:
        return f"cannot create a TUN device via /dev/net/tun: {exc.strerror or exc}"
    probe = f"{PREFIX}-{os.getpid()}-{token}-probe"
    try:
        _ip(["netns", "add", probe], timeout_s=timeout_s)
        _ip(["netns", "del", probe], timeout_s=timeout_s)
    except RuntimeSetupError as exc:
        return f"cannot create a network namespace: {exc}"
    return None


def require_realnet() -> None:
    """Raise :class:`RuntimeSetupError` with a one-line reason when realnet cannot run here."""
    reason = realnet_unavailable()
    if reason is not None:
        raise RuntimeSetupError(f"real-network emulation unavailable: {reason}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces(prefix: str = PREFIX, *, timeout_s: float = 10.0) -> list[str]:
    """Names of the namespaces starting with ``prefix-``."""
    out = _ip(["netns", "list"], timeout_s=timeout_s, check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def _kill_namespace_processes(namespace: str, timeout_s: float) -> list[int]:
    out = _ip(["netns", "pids", namespace], timeout_s=timeout_s, check=False)
    pids = [int(x) for x in out.split() if x.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def delete_namespace(namespace: str, *, timeout_s: float = 10.0) -> None:
    """Kill the processes in ``namespace`` (by pid), then delete it; missing is fine."""
    pids = _kill_namespace_processes(namespace, timeout_s)
    if pids:
        log.warning("killed %d process(es) still in namespace %s: %s", len(pids), namespace, pids)
    _ip(["netns", "del", namespace], timeout_s=timeout_s, check=False)


def _stale_relays() -> list[int]:
    """Pids of relay processes whose owner pid is dead (found by :data:`OWNER_MARKER` in argv)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in argv:
            if arg.startswith(OWNER_MARKER.encode()):
                owner = int(arg[len(OWNER_MARKER):] or b"0")
                if not _pid_alive(owner):
                    found.append(int(proc.name))
    return found


def cleanup_stale(prefix: str = PREFIX, *, timeout_s: float = 10.0) -> list[str]:
    """Remove namespaces, relays and run directories left by runs whose owner process is dead;
    returns what went."""
    removed = []
    for name in list_namespaces(prefix, timeout_s=timeout_s):
        parts = name.split("-")
        if len(parts) >= 2 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            delete_namespace(name, timeout_s=timeout_s)
            removed.append(name)
    for d in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        owner = d.name.removeprefix(RUN_DIR_PREFIX).split("-")[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    for pid in _stale_relays():
        try:
            os.kill(pid, signal.SIGKILL)
            removed.append(f"relay pid {pid}")
        except ProcessLookupError:
            pass
    if removed:
        log.warning("removed stale realnet leftovers: %s", removed)
    return removed


class WanNamespaces:
    """``world_size`` namespaces with a TUN device each; a context manager that always cleans up.

    After :meth:`create`, :attr:`tun_fds` are the host-side descriptors in rank order; hand
    them to the relay (``pass_fds``) and call :meth:`release_fds` so that the relay holds the
    only copies (then the devices die with the relay).
    """

    def __init__(self, world_size: int, *, mtu_bytes: int = 1500, offload: bool = True, timeout_s: float = 10.0,
                 prefix: str = PREFIX, congestion_control: str | None = DEFAULT_CONGESTION_CONTROL,
                 slow_start_after_idle: bool = False) -> None:
        if world_size < 1 or world_size > MAX_RANKS:
            raise SpecError(f"world_size must be in 1..{MAX_RANKS}, got {world_size!r}", field="world_size")
        if not 576 <= mtu_bytes <= 65535:
            raise SpecError(f"mtu_bytes must be in 576..65535, got {mtu_bytes!r}", field="mtu_bytes")
        self.world_size, self.mtu_bytes, self.timeout_s, self.prefix = world_size, mtu_bytes, timeout_s, prefix
        if congestion_control is not None and not congestion_control.isalnum():
            raise SpecError(f"must be an algorithm name such as 'cubic', got {congestion_control!r}",
                            field="congestion_control")
        self.offload, self.congestion_control = offload, congestion_control
        self.slow_start_after_idle = slow_start_after_idle
        """See [Note: slow start after idle in the namespaces]."""
        self.token = secrets.token_hex(3)
        self.endpoints = tuple(
            Endpoint(rank=r, namespace=f"{prefix}-{os.getpid()}-{self.token}-{r}", ifname=f"dc{self.token}r{r}",
                     address=rank_address(r))
            for r in range(world_size)
        )
        self.tun_fds: list[int] = []
        self._made: list[str] = []

    def __enter__(self) -> WanNamespaces:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        try:
            for ep in self.endpoints:
                _ip(["netns", "add", ep.namespace], timeout_s=self.timeout_s)
                self._made.append(ep.namespace)
            for ep in self.endpoints:
                try:
                    self.tun_fds.append(open_tun(ep.ifname, offload=self.offload))
                except OSError as exc:
                    raise RuntimeSetupError(f"cannot create TUN device {ep.ifname}: {exc.strerror or exc}") from None
            moves = "".join(f"link set dev {ep.ifname} netns {ep.namespace}\n" for ep in self.endpoints)
            _ip(["-batch", "-"], stdin=moves, timeout_s=self.timeout_s)
            for ep in self.endpoints:
                _ip(["-n", ep.namespace, "-batch", "-"], timeout_s=self.timeout_s, stdin=(
                    f"link set dev lo up\n"
                    f"link set dev {ep.ifname} addrgenmode none\n"
                    f"link set dev {ep.ifname} mtu {self.mtu_bytes}\n"
                    f"addr add {ep.address}/16 dev {ep.ifname}\n"
                    f"link set dev {ep.ifname} up\n"
                    + self._route_congestion_control(ep)))
                if not self.slow_start_after_idle:
                    self._sysctl(ep, "net.ipv4.tcp_slow_start_after_idle=0")
        except BaseException:
            self.close()
            raise
        log.debug("created %d namespaces (token %s)", self.world_size, self.token)

    def _sysctl(self, ep: Endpoint, setting: str) -> None:
        """Set one per-namespace sysctl inside ``ep``'s namespace."""
        argv = self.exec_argv(ep.rank, ["sysctl", "-qw", setting])
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s)
        except (subprocess.TimeoutExpired, FileNotFoundError) as exc:
            raise RuntimeSetupError(f"cannot set {setting} in namespace {ep.namespace}: {exc}") from None
        if out.returncode != 0:
            raise RuntimeSetupError(f"cannot set {setting} in namespace {ep.namespace}: {out.stderr.strip()}")

    def _route_congestion_control(self, ep: Endpoint) -> str:
        """``ip`` batch line: the route to the other ranks names the TCP congestion control
        ([Note: congestion control in the namespaces]); empty when ``None`` (the host's default)."""
        if self.congestion_control is None:
            return ""
        return (f"route replace {SUBNET}.0.0/16 dev {ep.ifname} proto kernel scope link src {ep.address} "
                f"congctl {self.congestion_control}\n")

    def release_fds(self) -> None:
        """Close this process's copies of the TUN descriptors (after the relay inherited them)."""
        for fd in self.tun_fds:
            os.close(fd)
        self.tun_fds = []

    def exec_argv(self, rank: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.endpoints[rank].namespace, *argv]

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them, close descriptors. Idempotent."""
        for name in reversed(self._made):
            try:
                delete_namespace(name, timeout_s=self.timeout_s)
            except RuntimeSetupError as exc:
                log.error("could not delete namespace %s: %s", name, exc)
        self._made = []
        self.release_fds()
