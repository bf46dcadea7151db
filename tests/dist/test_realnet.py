"""Real-network mode: ranks in network namespaces, real TCP (gloo and plain sockets) through
the shaping relay; failures and deadlines leave no namespace, TUN device or relay behind.

Each test starts at most 3 processes (2 ranks + the relay). The rank processes import this
module to find their target, so it imports neither torch nor the runtime package at module
level (each would cost a rank 2-3 s of start-up).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.errors import RuntimeSetupError

pytestmark = pytest.mark.dist

MBIT = 1e6 / 8
LATENCY_S = 0.020
BANDWIDTH = 100 * MBIT
PORT = 5123


@pytest.fixture(scope="module", autouse=True)
def _realnet_available():
    from deepcee.runtime.netns import realnet_unavailable

    reason = realnet_unavailable()
    if reason is not None:
        pytest.skip(f"real-network emulation unavailable: {reason}")


def wan_pair(latency_s: float = LATENCY_S, bandwidth: float = BANDWIDTH) -> Cluster:
    """Two single-device nodes on two islands joined by one WAN link."""
    fast = LinkSpec(latency_s=1e-5, bandwidth_bytes_per_s=1e10)
    return Cluster(
        name="wan-pair", kinds={"cpu": DeviceKind(name="cpu", peak_flops_per_s=1e11, memory_bytes=1e9)},
        islands=(Island(name="a", intra=fast), Island(name="b", intra=fast)),
        nodes=(Node(name="na", island="a", kind="cpu", devices=("na:0",), intra=fast),
               Node(name="nb", island="b", kind="cpu", devices=("nb:0",), intra=fast)),
        devices=(Device(name="na:0", kind="cpu", node="na", island="a"),
                 Device(name="nb:0", kind="cpu", node="nb", island="b")),
        links=(LinkEntry(a="a", b="b", spec=LinkSpec(latency_s=latency_s, bandwidth_bytes_per_s=bandwidth)),),
    )


def leftovers() -> dict[str, list]:
    """What this test process's realnet runs left on the host (must be empty)."""
    from deepcee.runtime.netns import list_namespaces
    from deepcee.runtime.relay import OWNER_MARKER

    mine = str(os.getpid())
    marker = f"{OWNER_MARKER}{mine}".encode()
    relays = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes():
                relays.append(int(proc.name))
        except OSError:
            continue
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    return {"namespaces": [n for n in list_namespaces() if n.split("-")[1] == mine], "relays": relays,
            "tun_devices": [ln.split(":")[1].strip() for ln in links.splitlines() if ln.split(":")[1].strip().startswith("dc")]}


def assert_clean() -> None:
    assert leftovers() == {"namespaces": [], "relays": [], "tun_devices": []}


# -- targets (run inside the namespaces; importable by module name) -----------------------

def gloo_target(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from deepcee.runtime import dist as rdist

    torch.set_num_threads(1)
    store = rdist.file_store(store_path, world_size, 30)
    rdist.init_process_group(store=store, rank=rank, world_size=world_size, backend="gloo", timeout_s=30,
                             device=torch.device("cpu"))
    small, big = torch.zeros(16), torch.zeros(1_000_000)  # 64 B and 4 MB
    rtts, big_s = [], []
    for i in range(6):
        t0 = time.monotonic()
        if rank == 0:
            dist.send(small + i, 1)
            dist.recv(small, 1)
        else:
            dist.recv(small, 0)
            dist.send(small, 0)
        rtts.append(time.monotonic() - t0)
    for _ in range(2):
        dist.barrier()
        t0 = time.monotonic()
        if rank == 0:
            dist.send(big + 1, 1)
            dist.recv(small, 1)  # the receiver's "done" bounds the transfer time
        else:
            req = dist.irecv(big, 0)
            req.wait()
            dist.send(small, 0)
        big_s.append(time.monotonic() - t0)
    x = torch.full((250_000,), float(rank + 1))
    dist.all_reduce(x)
    dist.barrier()
    dist.destroy_process_group()
    result = {"rtt_s": rtts, "big_s": big_s, "big_ok": bool((big == 1).all()) if rank == 1 else True,
              "allreduce_ok": bool((x == 3.0).all()), "device_ok": small.shape == (16,)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def failing_target(rank: int, world_size: int, store_path: str) -> None:
    if rank == 1:
        raise RuntimeSetupError("stage 1 found no weights")
    time.sleep(30)


def aborting_target(rank: int, world_size: int, store_path: str) -> None:
    if rank == 1:
        sys.stderr.write("native library gave up\n")
        sys.stderr.flush()
        os.abort()  # dies like a C++ std::terminate: no Python error record
    time.sleep(30)


def sleeping_target(rank: int, world_size: int, store_path: str, seconds: float) -> None:
    time.sleep(seconds)


def _timed_send(sock: socket.socket, nbytes: int) -> float:
    """Send ``nbytes`` and wait for the receiver's 1-byte acknowledgement of all of them."""
    t0 = time.monotonic()
    sock.sendall(bytes(nbytes))
    sock.recv(1)
    return time.monotonic() - t0


def _wait_for(path: Path, timeout_s: float = 20.0) -> None:
    t_end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > t_end:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def rate_change_target(rank: int, world_size: int, store_path: str, server: str, out_dir: str) -> None:
    """Rank 1 sends 1.25 MB three times to rank 0; between the 2nd and 3rd the parent changes the rate."""
    nbytes, out = 1_250_000, Path(out_dir)
    if rank == 0:  # receiver: acknowledge each block
        srv = socket.create_server((server, PORT))
        srv.settimeout(20)
        conn, _ = srv.accept()
        for _ in range(3):
            got = 0
            while got < nbytes:
                got += len(conn.recv(1 << 20))
            conn.sendall(b"k")
        return
    for _ in range(200):
        try:
            sock = socket.create_connection((server, PORT), timeout=20)
            break
        except OSError:
            time.sleep(0.05)
    warm = _timed_send(sock, nbytes)  # slow start, then the link's 100 Mbit/s
    fast = _timed_send(sock, nbytes)
    (out / "ready").touch()
    _wait_for(out / "changed")
    slow = _timed_send(sock, nbytes)
    (out / "rates.json").write_text(json.dumps({"warm_s": warm, "fast_s": fast, "slow_s": slow}))


# -- tests --------------------------------------------------------------------------------

def test_gloo_point_to_point_and_allreduce_pay_the_emulated_link(tmp_path):
    from deepcee.runtime.realnet import launch_realnet

    stats = launch_realnet(gloo_target, (str(tmp_path),), cluster=wan_pair(), devices=["na:0", "nb:0"], deadline_s=50)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    print(json.dumps({"rank0": r0, "relay": stats.to_dict()}))
    assert r0["allreduce_ok"] and r1["allreduce_ok"] and r1["big_ok"]
    rtt = statistics.median(r0["rtt_s"][1:])
    # a small message's round trip is two one-way latencies (plus microseconds of serialisation)
    assert 2 * LATENCY_S <= rtt < 2 * LATENCY_S * 1.3, r0["rtt_s"]
    # 4 MB at 100 Mbit/s: 320 ms of serialisation + latency; TCP's window growth costs a few RTTs
    ideal = LATENCY_S + 4e6 / BANDWIDTH + 2 * LATENCY_S
    assert ideal * 0.97 <= min(r0["big_s"]) < ideal * 1.6, (r0["big_s"], ideal)
    ab = stats.resource("na->nb")
    assert ab.bytes > 2 * 4e6 and ab.packets > 100  # the transfers crossed the relay
    assert_clean()


def test_live_rate_change_while_ranks_run(tmp_path):
    import threading

    from deepcee.runtime.realnet import RealNetwork

    cluster = wan_pair()
    resource = cluster.link("nb:0", "na:0").resource
    with RealNetwork(cluster, ["na:0", "nb:0"]) as net:
        def change() -> None:
            _wait_for(tmp_path / "ready", 30)
            net.control.set_bandwidth(resource, 10 * MBIT)
            (tmp_path / "changed").touch()

        changer = threading.Thread(target=change, daemon=True)
        changer.start()
        net.run(rate_change_target, (net.endpoints[0].address, str(tmp_path)), deadline_s=30)
        changer.join(timeout=5)
        stats = net.control.stats()
    assert_clean()
    r = json.loads((tmp_path / "rates.json").read_text())
    print(json.dumps(r))
    assert stats.resource(resource).bandwidth_bytes_per_s == pytest.approx(10 * MBIT)
    # 1.25 MB: 0.1 s at 100 Mbit/s, 1.0 s at 10 Mbit/s (plus an acknowledgement's round trip)
    assert 1.0 <= r["slow_s"] < 1.35, r
    assert r["fast_s"] < r["slow_s"] / 2, r


def test_failing_rank_is_reported_and_everything_is_removed():
    from deepcee.runtime.realnet import launch_realnet

    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match="rank 1: stage 1 found no weights"):
        launch_realnet(failing_target, (), cluster=wan_pair(), devices=["na:0", "nb:0"], deadline_s=30, grace_s=0.5)
    assert time.monotonic() - t0 < 20
    assert_clean()


def test_native_crash_is_reported_with_the_ranks_stderr():
    from deepcee.runtime.realnet import launch_realnet

    with pytest.raises(RuntimeSetupError, match=r"exited abnormally .*\[\(1, -6\)\].*native library gave up"):
        launch_realnet(aborting_target, (), cluster=wan_pair(), devices=["na:0", "nb:0"], deadline_s=30, grace_s=0.5)
    assert_clean()


def test_deadline_kills_hung_ranks_and_everything_is_removed():
    from deepcee.runtime.realnet import launch_realnet

    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"deadline of .* passed; ranks \[0, 1\] still running"):
        launch_realnet(sleeping_target, (60.0,), cluster=wan_pair(), devices=["na:0", "nb:0"], deadline_s=4)
    assert time.monotonic() - t0 < 15
    assert_clean()


_ORPHAN_PARENT = """
import json, sys, time
from deepcee.runtime.realnet import RealNetwork
from deepcee.scenarios import load_scenario
net = RealNetwork(load_scenario("local-small"), ["cloud0:0", "edge0:0"]).__enter__()
print(json.dumps({"relay": net.relay.pid, "namespaces": [e.namespace for e in net.endpoints]}), flush=True)
time.sleep(60)
"""


def test_killed_parent_leaves_nothing_after_the_next_set_up():
    from deepcee.runtime.netns import cleanup_stale, list_namespaces

    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT], stdout=subprocess.PIPE, text=True)
    try:
        made = json.loads(parent.stdout.readline())
    finally:
        parent.kill()  # SIGKILL: no clean-up code of the parent runs
        parent.wait(timeout=10)
    assert made["namespaces"], "the parent did not set up"
    t0 = time.monotonic()
    while Path(f"/proc/{made['relay']}").exists() and time.monotonic() - t0 < 5:
        time.sleep(0.05)  # the relay's parent-death signal ends it (its TUN devices go with it)
    assert not Path(f"/proc/{made['relay']}").exists()
    assert set(made["namespaces"]) <= set(cleanup_stale())
    assert not set(made["namespaces"]) & set(list_namespaces())


def test_stale_namespaces_of_a_dead_owner_are_removed():
    from deepcee.runtime.netns import PREFIX, cleanup_stale, list_namespaces

    child = subprocess.Popen(["true"])  # its pid is that of an owner that has exited
    child.wait()
    name = f"{PREFIX}-{child.pid}-stale0-0"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        assert name in list_namespaces()
        assert name in cleanup_stale()
        assert name not in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
