"""One run per run folder: an exclusive lock on ``<run_dir>/.deepcee.lock`` (torch-free).

Two runs writing one folder would interleave their metrics and checkpoints, so the run takes
an exclusive ``flock`` on the folder's lock file for as long as it trains and writes into the
file who holds it (pid, host, job, start time). A second run on the same folder fails at once
with a message naming that holder. The kernel drops a ``flock`` when its process dies, however
it dies, so the lock of a killed run is simply taken over by the next one (its stale holder
record is overwritten); nothing needs cleaning up by hand. A ``flock`` is per machine: across
machines, give each run its own folder (the lock is taken by rank 0 only).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from deepcee.errors import RuntimeSetupError

LOCK_FILE = ".deepcee.lock"


@dataclass(slots=True)
class RunLock:
    """The held lock of one run folder; :meth:`release` (or process exit) frees it."""

    path: Path
    handle: IO[str] | None

    def release(self) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _holder(handle: IO[str]) -> str:
    handle.seek(0)
    try:
        d = json.loads(handle.read() or "{}")
    except ValueError:
        return "another process (unreadable holder record)"
    if not d:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.get("since", 0)))
    return f"job {d.get('job', '?')}, pid {d.get('pid', '?')} on host {d.get('host', '?')} (since {since})"


def acquire(run_dir: str | Path, *, job: str) -> RunLock:
    """Lock ``run_dir`` for this process; raises naming the holder when another run has it."""
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(handle)
        handle.close()
        raise RuntimeSetupError(f"run folder {folder} is in use by {holder}; wait for that run to end "
                                "or choose another run folder") from None
    except OSError as exc:
        handle.close()
        raise RuntimeSetupError(f"{path}: cannot lock the run folder: {exc.strerror}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": job, "since": time.time()}))
    handle.flush()
    return RunLock(path=path, handle=handle)


def check_free(run_dir: str | Path, *, job: str) -> None:
    """Raise now if another run holds ``run_dir`` (a launcher's check before it starts processes)."""
    if (Path(run_dir) / LOCK_FILE).exists():
        acquire(run_dir, job=job).release()


def agree(run_dir: str | Path, *, job: str, rank: int, store: Any, timeout_s: float) -> RunLock:
    """Rank 0 locks ``run_dir``; every rank learns the outcome through the launch's ``store``
    (``set``/``wait``/``get``), so when another run holds the folder every rank fails at once
    with rank 0's message instead of waiting for it in a collective."""
    key = f"{job}/run-lock"
    lock, message = RunLock(path=Path(run_dir) / LOCK_FILE, handle=None), ""
    if rank == 0:
        try:
            lock = acquire(run_dir, job=job)
        except RuntimeSetupError as exc:
            message = str(exc)
        store.set(key, message)
    else:
        store.wait([key], timedelta(seconds=timeout_s))
        message = store.get(key).decode()
    if message:
        raise RuntimeSetupError(message)
    return lock
