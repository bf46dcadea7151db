"""Rank targets of the supervision and real-network tests (``tests/dist/test_launch_supervision.py``,
``tests/dist/test_realnet.py``), run by spawned processes or inside the namespaces.

The rank processes import this module by name to find their target, so it imports only the
standard library at module level (pytest, torch and the runtime package would each add
seconds to every rank's start-up).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

MBIT = 1e6 / 8
PORT = 5123


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
    for _ in range(3):
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
        from deepcee.errors import RuntimeSetupError

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


def pid_sleeping_target(rank: int, world_size: int, store_path: str, out_dir: str, seconds: float) -> None:
    """Write ``pid-rank<r>`` (this process's pid), then sleep."""
    tmp = Path(out_dir, f".pid-rank{rank}")
    tmp.write_text(str(os.getpid()))
    tmp.replace(Path(out_dir, f"pid-rank{rank}"))
    time.sleep(seconds)


def abort_then_fail_target(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """Rank 1 dies without an error record; rank 0 raises a second later (the failure it caused)."""
    if rank == 1:
        Path(out_dir, "aborting").touch()
        os.abort()
    wait_for(Path(out_dir, "aborting"), 30)
    time.sleep(1.0)  # ample for the supervisor to see rank 1's exit first (it polls every 50 ms)
    from deepcee.errors import RuntimeSetupError

    raise RuntimeSetupError("receiving from rank 1 timed out")


def aborts_at_exit_target(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """Every rank writes its result, then registers an abort for interpreter exit: like a native
    destructor that aborts ("terminate called without an active exception") after a run that
    succeeded."""
    import atexit

    Path(out_dir, f"done-rank{rank}").write_text("ok")
    atexit.register(os.abort)


def _timed_send(sock: socket.socket, nbytes: int) -> float:
    """Send ``nbytes`` and wait for the receiver's 1-byte acknowledgement of all of them."""
    t0 = time.monotonic()
    sock.sendall(bytes(nbytes))
    sock.recv(1)
    return time.monotonic() - t0


def wait_for(path: Path, timeout_s: float = 20.0) -> None:
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
    wait_for(out / "changed")
    slow = _timed_send(sock, nbytes)
    (out / "rates.json").write_text(json.dumps({"warm_s": warm, "fast_s": fast, "slow_s": slow}))
