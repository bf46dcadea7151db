"""Process-group set-up: the only module of the library that reads environment variables.

Two ways in:

- a local launch (:mod:`deepcee.runtime.launch`): the parent passes rank, world size and a
  ``FileStore`` path in a temporary directory (no ports, nothing left behind);
- ``torchrun`` (env://): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``; under torchrun's agent
  (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent hosts the TCP store and every worker is a
  client, otherwise rank 0 hosts it. The process-group rank is *not* torchrun's ``RANK``: each
  process reports its machine through the store and takes the rank of the plan device mapped
  to it (:func:`map_torchrun_rank`, [Note: machine mapping] in :mod:`deepcee.runtime.machines`).

In mode ``realnet`` (:mod:`deepcee.runtime.realnet`) every rank's environment also names the
relay's control socket (:data:`RELAY_CONTROL_ENV`, read by :func:`relay_control_path`).

Either way the runtime holds the store itself (a ``PrefixStore`` per use) to exchange
start-up metadata with timeouts. Backend: ``gloo`` on CPU, ``nccl`` when the run uses CUDA.

How a rank waits for its communication is a :class:`Waiter`: :class:`BlockingWaiter` (every
run but an elastic one: one blocking wait with the run's timeout) or an elastic run's
:class:`deepcee.runtime.elastic.Session`, which polls and watches for lost peers ([Note:
elastic process groups] there). :func:`shutdown` ends a rank's process group cleanly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError
from deepcee.runtime.machines import Assignment, Report, assign

log = logging.getLogger(__name__)

WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # glibc otherwise mmaps every large tensor afresh and unmaps it on free; the page faults
    # are charged to the computing thread (measured: about 40% of a tiny net's step, and
    # more for split backward, which keeps the graph alive longer; benchmarks/split_backward.py).
    "MALLOC_MMAP_THRESHOLD_": "1000000000",
    "MALLOC_TRIM_THRESHOLD_": "1000000000",
}


RELAY_CONTROL_ENV = "DEEPCEE_RELAY_CONTROL"
"""Set by :mod:`deepcee.runtime.realnet` in every rank's environment: the relay's control socket."""


def relay_control_path() -> str | None:
    """The control socket of the relay this rank's traffic crosses, or ``None`` outside a realnet launch."""
    return os.environ.get(RELAY_CONTROL_ENV) or None


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchrunEnv:
    """What ``torchrun`` tells a worker."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool
    group_rank: int = 0
    """The node's rank (``GROUP_RANK``): with c10d rendezvous, the order nodes joined in."""
    run_id: str = ""
    """``TORCHELASTIC_RUN_ID`` (``--rdzv-id``): the same on every node of one launch."""
    restart_count: int = 0


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun environment, or ``None`` when this process was not started by torchrun."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        return TorchrunEnv(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", "29500")),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            group_rank=int(env.get("GROUP_RANK", "0")), run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
    except ValueError as exc:
        raise RuntimeSetupError(f"bad torchrun environment: {exc}") from None


def child_env() -> dict[str, str]:
    """Environment for worker subprocesses: the parent's plus :data:`WORKER_ENV`."""
    return {**os.environ, **WORKER_ENV}


@contextlib.contextmanager
def worker_env() -> Iterator[None]:
    """While starting worker processes that inherit ``os.environ``: :data:`WORKER_ENV`; restored after."""
    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def single_thread() -> None:
    """One intra-op thread: on a shared 2-core machine more threads only slow everyone down."""
    torch.set_num_threads(1)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def pick_device(use_cuda: bool, local_rank: int) -> torch.device:
    """``cuda:<local rank>`` when asked (an error when this host has no CUDA device), else CPU."""
    if not use_cuda:
        return torch.device("cpu")
    check_cuda()
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def check_cuda() -> None:
    """Raise unless CUDA can be used here (``--cuda`` never falls back to the CPU silently)."""
    if not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA device is visible"
        raise RuntimeSetupError(f"--cuda: CUDA is not available on host {socket.gethostname()} ({why}; "
                                f"torch {torch.__version__}); run without --cuda to train on the CPU")


def file_store(path: str, world_size: int, timeout_s: float) -> dist.Store:
    store = dist.FileStore(path, world_size)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def tcp_store(env: TorchrunEnv, timeout_s: float) -> dist.Store:
    is_master = env.rank == 0 and not env.agent_store
    try:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise RuntimeSetupError(
            f"rank {env.rank}: cannot reach the store at {env.master_addr}:{env.master_port}: {exc}"
        ) from None


def host_names() -> tuple[str, tuple[str, ...]]:
    """This machine's host name and its other names (short, full, addresses), for host checks."""
    host = socket.gethostname()
    names = {host, host.split(".")[0]}
    try:
        names.add(socket.getfqdn())
        names.update(socket.gethostbyname_ex(host)[2])
    except OSError:
        pass
    return host, tuple(sorted(names - {host}))


def map_torchrun_rank(env: TorchrunEnv, store: dist.Store, cluster: Cluster, devices: Sequence[str], *,
                      nodes: Sequence[str] = (), source: str = "the cluster file", timeout_s: float,
                      ) -> tuple[Assignment, tuple[Assignment, ...]]:
    """This process's device and rank under torchrun, from every process's report through the
    store ([Note: machine mapping] in :mod:`deepcee.runtime.machines`); also the whole table."""
    host, aliases = host_names()
    me = Report(launcher_rank=env.rank, local_rank=env.local_rank, group_rank=env.group_rank, host=host,
                aliases=aliases, nodes=tuple(nodes))
    prefix = f"deepcee/machines/{env.restart_count}"
    store.set(f"{prefix}/{env.rank}", json.dumps(me.to_dict()))
    keys = [f"{prefix}/{r}" for r in range(env.world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError):
        late = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeSetupError(f"torchrun rank {env.rank}: torchrun ranks {late} did not report their machine "
                                f"within {timeout_s:g} s") from None
    reports = [Report.from_dict(json.loads(store.get(k).decode())) for k in keys]
    table = assign(reports, cluster, devices, source=source)
    return table[env.rank], table


def init_process_group(*, store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float,
                       device: torch.device) -> None:
    """Join the default process group through ``store`` (prefix ``pg``)."""
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise RuntimeSetupError(f"rank {rank}: process group ({backend}, {world_size} ranks) did not form: {exc}") from None
    log.debug("rank %d/%d joined (%s)", rank, world_size, backend)


T = TypeVar("T")


class Waiter(Protocol):
    """How a rank waits for its point-to-point transfers and collectives."""

    out_of_band: bool
    """Whether step records and decisions travel through the store instead of collectives."""

    def wait(self, work: dist.Work, *, timeout_s: float, what: str, peer: str | None = None) -> None:
        """Return when ``work`` is done; raise :class:`RuntimeSetupError` naming ``what`` (and the
        ``peer`` device) when it failed or took longer than ``timeout_s``."""

    def sleep_until(self, clock: Any, wall: float, *, timeout_s: float, what: str, peer: str | None = None) -> None:
        """Sleep until ``wall`` on ``clock`` (a :class:`deepcee.runtime.emulation.Clock`; an
        emulated delivery); a delivery further away than ``timeout_s`` is a dead link."""

    def check(self) -> None:
        """Raise if the run's communication is known to be broken (polled by out-of-band waits)."""

    def call(self, fn: Callable[[], T], *, what: str, peer: str | None = None) -> T:
        """``fn()``: a blocking operation with collectives inside (a checkpoint's save or load,
        an object send); an elastic run watches for lost peers meanwhile, so a rank in it never
        waits out the group's timeout for a peer known to be gone ([Note: watched calls] in
        :mod:`deepcee.runtime.elastic`)."""

    def gate(self, name: str) -> None:
        """Before collectives the trainer makes outside any step (checkpoints, evaluations): an
        elastic run's ranks meet here first, watching for faults, so an idle rank never blocks in
        such a collective with peers whose step failed. Elsewhere nothing (the collective waits)."""


class BlockingWaiter:
    """One blocking wait per operation, with the run's timeout (every run but an elastic one)."""

    out_of_band = False

    def wait(self, work: dist.Work, *, timeout_s: float, what: str, peer: str | None = None) -> None:
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise RuntimeSetupError(f"{what} {_failure(exc, timeout_s)}") from None

    def sleep_until(self, clock: Any, wall: float, *, timeout_s: float, what: str, peer: str | None = None) -> None:
        if wall - clock.wall() > timeout_s:
            raise RuntimeSetupError(f"{what} would not be delivered within {timeout_s:g} s (the link is dead)")
        clock.sleep_until(wall)

    def check(self) -> None:
        return None

    def call(self, fn: Callable[[], T], *, what: str, peer: str | None = None) -> T:
        return fn()

    def gate(self, name: str) -> None:
        return None


def _failure(exc: BaseException, timeout_s: float) -> str:
    """How an operation ended, in words: a timeout is one, a lost connection is not."""
    first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
    if "imed out" in first or "timeout" in first.lower():
        return f"did not complete within {timeout_s:g} s ({first})"
    return f"failed: {first}"


def shutdown(*, clean: bool = False) -> None:
    """Leave the process group. ``clean`` (the run succeeded): first wait until every rank is
    here, so no rank tears down its connections while a peer still talks on them."""
    if not dist.is_initialized():
        return
    if clean:
        try:
            dist.barrier()
        except RuntimeError as exc:  # a peer already gone: nothing left to wait for
            log.debug("barrier before shutdown: %s", exc)
    dist.destroy_process_group()
