"""Process supervision: one target per rank in child processes, watched under a deadline.

Both launchers use it: the local one (:func:`deepcee.runtime.launch.launch`: ``multiprocessing``
spawn, :func:`spawn_ranks`) and the real-network one
(:class:`deepcee.runtime.realnet.RealNetwork`: ``subprocess.Popen`` inside network namespaces,
:func:`write_payload` + :func:`rank_argv`). In the child, :func:`run_rank` calls
``target(rank, world_size, store_path, *args)``; in the parent, :func:`supervise` watches the
children through the :class:`Worker` protocol (``subprocess.Popen`` fits it as it is,
:class:`SpawnedWorker` adapts a ``multiprocessing.Process``) and raises the first failure.

[Note: first failure]
A rank that raises writes ``error-rank<r>.json`` (rank, wall time, exception type, whether it
is a :class:`deepcee.errors.DeepceeError`, message, traceback) into the launch's directory
and exits with code 1 (:func:`write_error`). A rank that dies without a record (a signal, an
abort in native code, a failed start) is noted by the supervisor with the wall time it saw
the exit (within one poll, :data:`POLL_S`). After the first failure the other ranks get
``grace_s`` to fail on their own (usually timeouts the first one caused), then all are
killed; :func:`first_error` names the *earliest* failure, record or not, and counts the
others. A record-less death is dated one poll before the supervisor saw it (the earliest it
can have happened), so the records its peers write right after it (a closed connection) never
come first. A domain error comes back as the same :mod:`deepcee.errors` class, anything else as
:class:`RuntimeSetupError` with the rank's traceback. Past ``deadline_s`` every rank is
killed and :class:`RuntimeSetupError` names those still running: a hang is a failure,
never a stuck caller.

[Note: no orphans]
Every child asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), then
checks that the parent is still the supervisor (it may have died before the request), so a
supervisor killed by SIGKILL, which runs no clean-up, leaves no rank behind. Popen children
get the signal set before ``exec`` as well (:func:`death_signal_preexec`); it survives the
``exec`` of ``ip netns exec`` and of Python. The kernel sends it when the *thread* that
started the child exits, so start ranks from the thread that waits for them (both launchers
do). Linux only; elsewhere the supervisor's own kill on every exit path remains.

[Note: elastic supervision]
An elastic launch (:class:`Elastic`; ranks run :func:`deepcee.runtime.elastic_rank.run_elastic_job`)
outlives a rank: a rank that dies is only noted (its survivors re-form without it), and, with
``restart_after_s``, started again that long after its death (``restart(rank)``; it asks to
rejoin). The launch ends when every rank has exited, or ``finish_grace_s`` after the first
rank finished (exit code 0: the run is over; a rank still stopped or waiting is killed then).
It succeeds when some rank finished; otherwise the first failure is raised as above.

Standard library and :mod:`deepcee.errors` only (a realnet rank imports this module before
anything else).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from deepcee import errors
from deepcee.errors import DeepceeError, RuntimeSetupError
from deepcee.jsonio import save_json_atomic

POLL_S = 0.05
"""How often the supervisor looks at its children (also the resolution of record-less failure times)."""
STOP_WAIT_S = 5.0
"""How long to wait for a killed child to be reaped before giving up on it."""
PR_SET_PDEATHSIG = 1
ERROR_GLOB = "error-rank*.json"

Target = Callable[..., None]
"""``target(rank, world_size, store_path, *args)``; importable by module name (children unpickle it)."""


class Worker(Protocol):
    """One supervised child process, as the supervisor sees it (``subprocess.Popen`` fits)."""

    pid: int

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or ``None`` while it runs."""

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


# -- in the child -----------------------------------------------------------------------


def write_error(error_dir: str | Path, rank: int, exc: BaseException) -> None:
    """Record a rank's failure for the supervisor ([Note: first failure])."""
    domain = isinstance(exc, DeepceeError)
    save_json_atomic(Path(error_dir) / f"error-rank{rank}.json", {
        "rank": rank, "time": time.time(), "type": type(exc).__name__, "domain": domain,
        "message": str(exc), "traceback": "" if domain else traceback.format_exc(),
    })


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux/glibc
        return None


def die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when the parent dies; exit now if ``parent_pid`` is no longer the parent
    ([Note: no orphans])."""
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)  # the supervisor died while this process started: nobody waits for it


def death_signal_preexec() -> Callable[[], object] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when this process dies.
    Resolved here, in the parent, so that the forked child makes no library look-ups (safe
    with other threads running)."""
    prctl = _prctl()
    return None if prctl is None else functools.partial(prctl, PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def _recorded(error_dir: str | Path, rank: int) -> Iterator[None]:
    try:
        yield
    except BaseException as exc:  # report every failure to the supervisor, then exit non-zero
        write_error(error_dir, rank, exc)
        raise SystemExit(1) from None


def run_rank(target: Target, rank: int, world_size: int, store_path: str, args: tuple[Any, ...], error_dir: str,
             parent_pid: int) -> None:
    """What a child runs: ``target(rank, world_size, store_path, *args)``, failures recorded."""
    die_with_parent(parent_pid)
    with _recorded(error_dir, rank):
        target(rank, world_size, store_path, *args)
    leave_after_success()


# Run by ``python -c`` in a child started by command line (e.g. inside a network namespace):
# the payload's outer pickle holds only built-in types, so it loads before ``sys.path`` (the
# parent's, as multiprocessing's spawn restores it) makes deepcee and the target importable.
_BOOTSTRAP = """
import pickle, sys
with open(sys.argv[1], "rb") as f:
    payload = pickle.load(f)
sys.path[:] = payload["sys_path"]
from deepcee.runtime.supervise import run_payload
run_payload(payload, int(sys.argv[2]))
"""


def write_payload(path: Path, target: Target, args: tuple[Any, ...], *, world_size: int, store_path: str,
                  error_dir: str) -> Path:
    """Write what :func:`rank_argv` children run; ``path``."""
    path.write_bytes(pickle.dumps({
        "sys_path": list(sys.path), "call": pickle.dumps((target, args)), "world_size": world_size,
        "store_path": store_path, "error_dir": error_dir, "parent_pid": os.getpid(),
    }))
    return path


def rank_argv(payload: Path, rank: int) -> list[str]:
    """Command line of rank ``rank`` of the run in ``payload`` (:func:`write_payload`); the
    process that starts it must be its parent (``ip netns exec`` replaces itself by it)."""
    return [sys.executable, "-c", _BOOTSTRAP, str(payload), str(rank)]


def run_payload(payload: Mapping[str, Any], rank: int) -> None:
    """The child's side of :func:`rank_argv`."""
    die_with_parent(payload["parent_pid"])
    with _recorded(payload["error_dir"], rank):
        target, args = pickle.loads(payload["call"])  # a target that does not import is recorded too
        target(rank, payload["world_size"], payload["store_path"], *args)
    leave_after_success()


def leave_after_success() -> None:
    """End a rank whose target returned: logs and streams flushed, then ``os._exit(0)``.

    The target's work is done and written (outputs closed, process group left). Native
    destructors at interpreter exit were seen to abort such a rank ("terminate called without
    an active exception", exit -6), and the supervisor then reports a run that succeeded as a
    failure: first for elastic training ranks, which hold the process groups of earlier
    generations; then for a plain training run's rank 1 (session 19: 2 of 5 runs of
    tests/dist/test_docs.py's walkthrough under pytest); then, after that was fixed in the
    training entry alone, for rank 1 of ``deepcee profile`` (the CI run of session 19). So every
    child leaves here, whatever its target, without running them.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- in the parent ----------------------------------------------------------------------


class SpawnedWorker:
    """A ``multiprocessing.Process`` seen as a :class:`Worker`."""

    def __init__(self, process: mp.process.BaseProcess) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode


def spawn_rank(target: Target, args: tuple[Any, ...], *, rank: int, world_size: int, run_dir: Path) -> SpawnedWorker:
    """Start rank ``rank`` (``spawn``: a fresh interpreter) running :func:`run_rank`; ``store_path``
    is ``run_dir/store``, error records go to ``run_dir``."""
    p = mp.get_context("spawn").Process(target=run_rank, name=f"deepcee-rank{rank}", args=(
        target, rank, world_size, str(run_dir / "store"), args, str(run_dir), os.getpid()))
    p.start()
    return SpawnedWorker(p)


def spawn_ranks(target: Target, args: tuple[Any, ...], *, world_size: int, run_dir: Path) -> list[SpawnedWorker]:
    """Start ``world_size`` ranks with :func:`spawn_rank`."""
    workers: list[SpawnedWorker] = []
    try:
        for rank in range(world_size):
            workers.append(spawn_rank(target, args, rank=rank, world_size=world_size, run_dir=run_dir))
    except BaseException:
        stop(workers)
        raise
    return workers


def stop(workers: Sequence[Worker]) -> None:
    """Kill the workers still running and reap them all. Idempotent."""
    for w in workers:
        if w.poll() is None:
            w.kill()
    for w in workers:
        with contextlib.suppress(Exception):  # one that will not die must not hide the others
            w.wait(timeout=STOP_WAIT_S)


def first_error(error_dir: Path, exits: Mapping[int, tuple[float, int]] | None = None, *,
                explain: Callable[[int], str] | None = None) -> DeepceeError | None:
    """The earliest failure of a run ([Note: first failure]), or ``None``.

    ``exits``: rank -> (wall time seen, exit code) of ranks that exited non-zero; those without
    an error record count as failing at that time. ``explain(rank)`` adds to the message of a
    record-less failure (e.g. the end of the rank's stderr)."""
    records = {r["rank"]: r for r in (json.loads(p.read_text()) for p in error_dir.glob(ERROR_GLOB))}
    silent = {rank: seen for rank, seen in (exits or {}).items() if rank not in records}
    # a silent death happened at most one poll before it was seen (see [Note: first failure])
    failures = sorted([(r["time"], rank) for rank, r in records.items()]
                      + [(t - 2 * POLL_S, rank) for rank, (t, _) in silent.items()])
    if not failures:
        return None
    rank = failures[0][1]
    others = f" ({len(failures) - 1} other rank(s) failed after it)" if len(failures) > 1 else ""
    if rank in silent:
        code = silent[rank][1]
        return RuntimeSetupError(f"rank {rank} exited abnormally with code {code} and no error record (killed by a "
                                 f"signal?){others}" + (explain(rank) if explain else ""))
    first = records[rank]
    cls = getattr(errors, first["type"], None) if first["domain"] else None
    if isinstance(cls, type) and issubclass(cls, DeepceeError):
        said = first["message"]  # a message naming its rank already (a peer's description) is not prefixed again
        return cls(f"{said if said.startswith(f'rank {rank} ') else f'rank {rank}: {said}'}{others}")
    return RuntimeSetupError(f"rank {rank} failed: {first['type']}: {first['message']}{others}\n{first['traceback']}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Elastic:
    """How an elastic launch is supervised ([Note: elastic supervision])."""

    restart_after_s: float | None = None
    """Start a rank that died again this many seconds later (``None``: never)."""
    max_restarts: int = 1
    """Restarts per rank at most."""
    finish_grace_s: float = 30.0
    """Once a rank has finished, how long the others may take before they are killed."""

    def __post_init__(self) -> None:
        if self.restart_after_s is not None and not 0 <= self.restart_after_s < 3600:
            raise errors.SpecError(f"must be in [0, 3600) seconds, got {self.restart_after_s!r}", field="restart_after_s")
        if self.max_restarts < 0 or self.finish_grace_s <= 0:
            raise errors.SpecError(f"max_restarts must be >= 0 and finish_grace_s > 0, got {self.max_restarts!r}, "
                                   f"{self.finish_grace_s!r}", field="elastic")


def supervise(workers: Sequence[Worker], error_dir: Path, *, deadline_s: float, grace_s: float = 2.0,
              label: str = "launch", check: Callable[[], None] | None = None,
              explain: Callable[[int], str] | None = None, elastic: Elastic | None = None,
              restart: Callable[[int], Worker] | None = None) -> None:
    """Wait for ``workers`` (rank ``r`` is ``workers[r]``); raise the first failure, or
    :class:`RuntimeSetupError` past ``deadline_s`` naming the ranks still running.

    ``check()`` runs at every poll and may raise to abort (e.g. a helper process died).
    ``elastic``: rank deaths do not end the launch ([Note: elastic supervision]; ``restart``
    starts a rank again). Every worker is dead and reaped when this returns or raises.
    """
    if elastic is not None:
        return _supervise_elastic(list(workers), error_dir, deadline_s=deadline_s, label=label, check=check,
                                  explain=explain, elastic=elastic, restart=restart)
    t_end = time.monotonic() + deadline_s
    exits: dict[int, tuple[float, int]] = {}
    failed_at = None
    try:
        while True:
            codes = [w.poll() for w in workers]  # poll every worker: reaps and stamps each exit
            for rank, code in enumerate(codes):
                if code not in (None, 0) and rank not in exits:
                    exits[rank] = (time.time(), code)
                    if failed_at is None:
                        failed_at = time.monotonic()
            if None not in codes or (failed_at is not None and time.monotonic() - failed_at > grace_s):
                break
            if check is not None:
                check()
            if time.monotonic() > t_end:
                running = [r for r, code in enumerate(codes) if code is None]
                stop(workers)
                err = first_error(error_dir, exits, explain=explain)
                raise RuntimeSetupError(f"{label} deadline of {deadline_s:g} s passed; ranks {running} still running"
                                        + (f"; first failure: {err}" if err else ""))
            time.sleep(POLL_S)
    finally:
        stop(workers)
    err = first_error(error_dir, exits, explain=explain)
    if err is not None:
        raise err


def _supervise_elastic(workers: list[Worker], error_dir: Path, *, deadline_s: float, label: str,
                       check: Callable[[], None] | None, explain: Callable[[int], str] | None, elastic: Elastic,
                       restart: Callable[[int], Worker] | None) -> None:
    """[Note: elastic supervision]. ``workers[r]`` is replaced when rank ``r`` is restarted."""
    t_end = time.monotonic() + deadline_s
    exits: dict[int, tuple[float, int]] = {}
    dead_since: dict[int, float] = {}
    restarts = dict.fromkeys(range(len(workers)), 0)
    finished_at = None
    try:
        while True:
            now = time.monotonic()
            for rank, code in enumerate(w.poll() for w in workers):
                if code not in (None, 0) and rank not in dead_since:
                    exits[rank] = (time.time(), code)
                    dead_since[rank] = now
                if code == 0 and finished_at is None:
                    finished_at = now
            for rank in [r for r, t in dead_since.items() if _restart_due(elastic, restart, restarts[r], now - t)]:
                if finished_at is None:
                    workers[rank] = restart(rank)
                    restarts[rank] += 1
                    del dead_since[rank]
            waiting = finished_at is None and any(_restart_due(elastic, restart, restarts[r], None)
                                                  for r in dead_since)
            codes = [w.poll() for w in workers]
            if (None not in codes and not waiting) or (
                    finished_at is not None and now - finished_at > elastic.finish_grace_s):
                break
            if check is not None:
                check()
            if now > t_end:
                running = [r for r, code in enumerate(codes) if code is None]
                err = first_error(error_dir, exits, explain=explain)
                raise RuntimeSetupError(f"{label} deadline of {deadline_s:g} s passed; ranks {running} still running"
                                        + (f"; first failure: {err}" if err else ""))
            time.sleep(POLL_S)
    finally:
        stop(workers)
    if finished_at is None:
        err = first_error(error_dir, exits, explain=explain)
        raise err or RuntimeSetupError(f"{label}: no rank finished")


def _restart_due(elastic: Elastic, restart: Callable[[int], Worker] | None, done: int, dead_s: float | None) -> bool:
    """Whether a rank dead for ``dead_s`` seconds is to be restarted now (``None``: ever)."""
    return (restart is not None and elastic.restart_after_s is not None and done < elastic.max_restarts
            and (dead_s is None or dead_s >= elastic.restart_after_s))
