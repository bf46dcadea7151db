"""Elastic training: when a device is lost, the survivors leave the broken process group and go on.

One :class:`Session` per rank of an elastic job (:func:`deepcee.runtime.elastic_rank.run_elastic_job`
is what such a rank runs; settings, errors and records are :mod:`deepcee.runtime.elastic_types`,
re-exported here). The decisions (which plan the survivors train, which state moves, whether a checkpoint
must be restored) belong to the run's hooks (the adapter's, :mod:`deepcee.adapter.elastic`);
this module is the mechanism under them.

[Note: elastic process groups]
torch.distributed cannot drop a rank from a gloo group, and an operation on a group with a lost
member may never finish: a receive posted to a killed peer stays pending, a collective with a
stopped one waits out the group's timeout, and a gloo wait that times out closes its pair,
poisoning the group. So an elastic run trains in *generations*. Generation ``g`` is a fresh
default process group over its members (devices in launch order; rank = position), formed
through the launch's store under ``<job>/elastic/g<g>/pg``. On a fault every survivor leaves
generation ``g`` (``destroy_process_group``, keeping a reference to each old group object,
whose destructor would otherwise join gloo's threads, still blocked on the lost peer until the
old timeout) and forms ``g+1``, renumbered ``0..n-1``. Everything else goes out of band,
through the store, which outlives any member:

- heartbeats: a thread per rank writes ``hb/<device>`` (a counter, pid, host) every
  ``heartbeat_s`` and reads the other members'; a member whose process is gone (same host:
  ``/proc``) or whose counter stood still for ``lost_after_s`` is reported lost;
- the fault flag ``g<g>/fault``, set once (compare-and-set) by whoever saw a fault first (an
  error or a timeout of its own operation, or a lost member). Every wait of an elastic rank
  polls its operation and this flag (an in-process event the heartbeat thread sets), so no
  survivor stays blocked on the lost: each raises :class:`PeerLost` within a heartbeat;
- the commit point: a step's optimizer update is applied only once every member has reached
  it (``g<g>/commit/<step>``, whose outcome is decided once, by compare-and-set), so the
  survivors of a fault hold the same step: every update of it, or none;
- agreement: survivors write join records (steps applied, layers held); the first to arrive
  leads (compare-and-set ``g<g>/leader``): it waits until every member has joined or is lost,
  asks the hooks for the next generation (a :class:`Transition`) and publishes it
  (``g<g>/decision``); a member left out of it (e.g. one end of a dead link) must rejoin;
- rejoin: a device that comes back (a restarted process finds its own heartbeat key; a stopped
  one finds it was left out) writes ``rejoin/<device>``; rank 0 takes it in at a step boundary
  with a transition like a fault's, handed over as ``admit/<device>``; ``done`` ends waiting,
  and so does an error once no device of the run is left that could admit it (every other one
  lost, finished or waiting to rejoin itself, for ``lost_after_s``).

Every wait here ends: with the awaited key, with a fault, or with a one-line error naming this
device and what it waited for (the operation's timeout; for the leader's decision, its roll call
and its deciding; for an admission, the run's end or nobody left to admit).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from deepcee.errors import DeepceeError, RuntimeSetupError
from deepcee.runtime.elastic_types import (
    Decide,
    ElasticConfig,
    Excluded,
    Fault,
    JoinRecord,
    LostDevice,
    PeerLost,
    Transition,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_MAX_S = 1e-3
"""Longest sleep between two looks at a pending operation (the first ones are shorter)."""


def _proc_alive(pid: int) -> bool:
    """Running (a zombie counts as dead) on this host."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _loads(raw: bytes) -> Any:
    return pickle.loads(raw)  # noqa: S301  (written by this run's own ranks)


class Session:
    """One rank's part in an elastic run. See [Note: elastic process groups]."""

    out_of_band = True
    """Step records and decisions travel through the store (:class:`deepcee.runtime.dist.Waiter`)."""

    def __init__(self, store: dist.Store, config: ElasticConfig, *, device: str, launch_devices: Sequence[str],
                 timeout_s: float, torch_device: torch.device) -> None:
        self.store, self.cfg, self.me = store, config, device
        self.launch_devices = tuple(launch_devices)
        self.timeout_s, self.torch_device = timeout_s, torch_device
        self.gen, self.members = 0, self.launch_devices
        self.applied = 0
        self.fault = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[str, tuple[str, float]] = {}  # device -> (heartbeat value, when it last changed)
        self._host = socket.gethostname()
        self._graveyard: list[Any] = []
        self.returning = self.store.check([f"hb/{device}"])
        """A process of this device ran in this launch before (it was restarted): it must rejoin."""

    # -- heartbeats and the fault flag ----------------------------------------------------------
    def start(self) -> None:
        self._beat(0)
        self._thread = threading.Thread(target=self._run, name="deepcee-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.cfg.heartbeat_s + 1)

    def _beat(self, n: int) -> None:
        self.store.set(f"hb/{self.me}", f"{n} {os.getpid()} {self._host}")

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.cfg.heartbeat_s):
            n += 1
            try:
                self._beat(n)
                self._watch()
            except Exception as exc:  # the store went away (the launch ended): nothing left to watch
                log.debug("heartbeat of %s stopped: %s", self.me, exc)
                return

    # [Note: one generation's fault flag]
    # The flag ``fault`` stands for ``g<gen>/fault`` of the generation in force. The heartbeat
    # thread reads the generation, then looks at the store; meanwhile the main thread may enter
    # the next one (clearing the flag). Setting the flag for the old generation's fault then
    # started the new one with a fault nobody had reported: the rank's recovery, finding the flag
    # set, wrote nothing to the store, the other members waited out their timeout, and the run
    # fell apart (with the window widened on purpose: a rejoin test's 300 s hang). So the flag is
    # set only under the lock and for the generation in force (:meth:`_flag`), a fault the thread
    # finds is reported in the generation it watched, and :meth:`recover` publishes a fault
    # whenever the store has none.
    def _watch(self) -> None:
        with self._lock:
            gen, members = self.gen, self.members
        if self.store.check([f"g{gen}/fault"]):
            self._flag(gen)
            return
        for d in members:
            # a member never heard from is still starting (imports take seconds): a start that
            # fails shows as the process group not forming
            reason = None if d == self.me else self.lost_reason(d, started=True)
            if reason is not None:
                self.report(f"device {d} is lost: {reason}", suspect=d, gen=gen)
                return

    def _flag(self, gen: int) -> None:
        """Set the fault flag if generation ``gen`` is still this rank's ([Note: one generation's fault flag])."""
        with self._lock:
            if gen == self.gen:
                self.fault.set()

    def lost_reason(self, device: str, *, started: bool = False) -> str | None:
        """Why ``device`` counts as lost now, or ``None`` while it lives (``started``: only once
        it has written a heartbeat)."""
        if self.store.check([f"finished/{device}"]):
            return None  # it trained every step and left: the records it owed are written
        now = time.monotonic()
        key = f"hb/{device}"
        value = self.store.get(key).decode() if self.store.check([key]) else ""
        seen = self._seen.get(device)
        if seen is None or seen[0] != value:
            self._seen[device] = seen = (value, now)
        if not value and started:
            return None
        if value:
            _, pid, host = value.split()
            if host == self._host and not _proc_alive(int(pid)):
                return f"its process (pid {pid}) is gone"
        if now - seen[1] > self.cfg.lost_after_s:
            return f"no heartbeat for {now - seen[1]:.1f} s"
        return None

    def report(self, reason: str, *, suspect: str | None = None, gen: int | None = None) -> Fault:
        """Flag generation ``gen``'s fault (default: this one's; the first report wins); returns the one that stands."""
        gen = self.gen if gen is None else gen
        mine = Fault(by=self.me, suspect=suspect, reason=reason, at_s=time.time())
        raw = self.store.compare_set(f"g{gen}/fault", "", pickle.dumps(mine))
        self._flag(gen)
        return _loads(raw)

    def first_fault(self) -> Fault | None:
        key = f"g{self.gen}/fault"
        return _loads(self.store.get(key)) if self.store.check([key]) else None

    def check(self) -> None:
        """Raise :class:`PeerLost` if this generation has a fault."""
        if self.fault.is_set():
            f = self.first_fault()
            raise PeerLost(f"generation {self.gen}: {f.reason if f else 'fault'} (reported by {f.by if f else '?'})",
                           suspect=f.suspect if f else None)

    # -- waiting on operations of the generation ------------------------------------------------
    def wait(self, work: dist.Work, *, timeout_s: float, what: str, peer: str | None = None) -> None:
        """Wait for ``work`` while watching the fault flag; an error or timeout is reported as a fault.

        gloo's point-to-point works never say they are complete before ``wait()`` is called
        (``is_completed()`` stays false), so the blocking wait runs in a thread of its own while
        this one watches the flag ([Note: watched calls])."""
        if work.is_completed():  # collectives do say so
            try:
                work.wait()
                return None
            except RuntimeError as exc:
                return self._finish_wait(exc, what, peer)
        box = self._watched(lambda: work.wait(timedelta(seconds=timeout_s)))
        # a second wait() on a gloo receive would wait for another message: never call it again
        return self._finish_wait(box[1], what, peer) if box[1] is not None else None

    def call(self, fn: Callable[[], T], *, what: str, peer: str | None = None) -> T:
        """``fn()`` in a thread of its own while this one watches the fault flag ([Note: watched
        calls]): :class:`PeerLost` within a poll of a fault; its failure (but a domain error of
        its own, e.g. no checkpoint to restore) is reported as one."""
        value, exc = self._watched(fn)
        if exc is None:
            return value
        if isinstance(exc, DeepceeError) and not isinstance(exc, PeerLost):
            raise exc
        return self._finish_wait(exc, what, peer)

    # [Note: watched calls]
    # A blocking torch.distributed operation (a gloo wait, a collective inside a DCP save or
    # load, an object send) cannot be interrupted: with a peer stopped or cut off, it returns
    # only at the group's timeout, and with a peer killed it may too (a ring collective's rank
    # waits on a live neighbour that has already failed out of it). So an elastic rank runs such
    # an operation in a helper thread and watches the fault flag, which the heartbeat thread
    # sets within a heartbeat of a lost peer, from its own: detection is bounded by the
    # heartbeat (a process gone) or ``lost_after_s`` (a hang), not by ``timeout_s``. On a fault
    # the helper thread is left behind, blocked on the old generation's group, which stays
    # referenced until the thread ends ([Note: elastic process groups]); whatever it writes
    # after (a checkpoint's files) is never committed: rank 0 commits a checkpoint only once
    # its save returned on this thread.
    def _watched(self, fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        """``(fn(), None)`` or ``(None, its exception)``; :class:`PeerLost` on a fault meanwhile."""
        done = threading.Event()
        box: list[Any] = [None, None]

        def run() -> None:
            try:
                box[0] = fn()
            except BaseException as exc:  # noqa: BLE001  (handed to the watching thread)
                box[1] = exc
            finally:
                done.set()

        threading.Thread(target=run, name="deepcee-watched", daemon=True).start()
        pause = 1e-4
        while not done.wait(pause):
            self.check()
            pause = min(2 * pause, POLL_MAX_S)
        return box[0], box[1]

    def _finish_wait(self, exc: BaseException, what: str, peer: str | None) -> None:
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        verb = "did not complete in time" if "imed out" in first or "timeout" in first.lower() else "failed"
        raise self._fail(f"{what} {verb}: {first}", peer) from None

    def sleep_until(self, clock: Any, wall: float, *, timeout_s: float, what: str, peer: str | None = None) -> None:
        """Sleep until ``wall`` on ``clock`` (an emulated delivery) while watching the fault flag."""
        t_end = clock.wall() + timeout_s
        while (now := clock.wall()) < wall:
            self.check()
            if now > t_end:
                raise self._fail(f"{what} was not delivered within {timeout_s:g} s (the link is dead)", peer)
            clock.sleep(min(wall - now, self.cfg.heartbeat_s))

    def _fail(self, reason: str, peer: str | None) -> PeerLost:
        self.check()  # a fault already flagged is the cause; this error is its consequence
        f = self.report(f"{self.me}: {reason}", suspect=peer)
        return PeerLost(f"generation {self.gen}: {f.reason}", suspect=f.suspect)

    def wait_key(self, key: str, what: str) -> bytes:
        """The value of ``key`` once some rank has set it, watching the fault flag."""
        t_end = time.monotonic() + self.timeout_s
        while not self.store.check([key]):
            self.check()
            if time.monotonic() > t_end:
                raise self._fail(f"no {what} within {self.timeout_s:g} s", None)
            time.sleep(POLL_MAX_S)
        return self.store.get(key)

    # -- the commit point and out-of-band messages ----------------------------------------------
    def commit(self, step: int, *, parties: int) -> None:
        """Return once all ``parties`` (the members that hold a stage) have reached step
        ``step``'s update; :class:`PeerLost` if it must not happen (one outcome for all)."""
        key = f"g{self.gen}/commit/{step}"
        outcome_key = f"{key}/outcome"
        self.store.add(key, 1)
        t_end = time.monotonic() + self.timeout_s
        pause = 1e-5
        while True:
            if self.store.check([outcome_key]):
                outcome = self.store.get(outcome_key)
                break
            if self.store.add(key, 0) >= parties:
                outcome = self.store.compare_set(outcome_key, "", "commit")
                break
            if self.fault.is_set() or time.monotonic() > t_end:
                outcome = self.store.compare_set(outcome_key, "", "abort")
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        if outcome != b"commit":
            self.check()
            raise self._fail(f"step {step}: not every member reached its update within {self.timeout_s:g} s", None)
        self.applied = step + 1

    def gate(self, name: str) -> None:
        """Return once every member has reached ``name``; :class:`PeerLost` on a fault or timeout."""
        key = f"g{self.gen}/gate/{name}"
        self.store.add(key, 1)
        t_end = time.monotonic() + self.timeout_s
        while self.store.add(key, 0) < len(self.members):
            self.check()
            if time.monotonic() > t_end:
                raise self._fail(f"not every member reached {name} within {self.timeout_s:g} s", None)
            time.sleep(POLL_MAX_S)

    def publish(self, key: str, obj: Any) -> None:
        self.store.set(f"g{self.gen}/{key}", pickle.dumps(obj))

    def receive(self, key: str, what: str) -> Any:
        return _loads(self.wait_key(f"g{self.gen}/{key}", what))

    # -- agreement ------------------------------------------------------------------------------
    def recover(self, join: JoinRecord, decide: Decide) -> Transition:
        """Agree with the other survivors on the next generation (see the module's note)."""
        gen = self.gen
        if self.first_fault() is None:  # the flag alone tells no other member ([Note: one generation's fault flag])
            self.report(f"{self.me}: its step failed", suspect=None)
        self.store.set(f"g{gen}/join/{self.me}", pickle.dumps(join))
        leader = self.store.compare_set(f"g{gen}/leader", "", self.me).decode()
        if leader == self.me:
            self._lead(decide)
        raw = self._await_decision(gen, leader)
        return _loads(raw)

    def _lead(self, decide: Decide) -> None:
        gen = self.gen
        joins, lost = self._roll_call()
        rejoining = self.rejoin_requests()
        try:
            tr = decide(gen, joins, lost, rejoining, self.first_fault())
        except DeepceeError as exc:  # every survivor fails with the leader's reason
            self.store.set(f"g{gen}/decision", pickle.dumps(exc))
            raise
        self.admit(tr)
        self.store.set(f"g{gen}/decision", pickle.dumps(tr))

    def _roll_call(self) -> tuple[list[JoinRecord], list[LostDevice]]:
        """Wait until every member of this generation has joined or is lost."""
        t_end = time.monotonic() + self.timeout_s
        joins: dict[str, JoinRecord] = {}
        lost: dict[str, LostDevice] = {}
        while True:
            for r, d in enumerate(self.members):
                if d in joins or d in lost:
                    continue
                key = f"g{self.gen}/join/{d}"
                if self.store.check([key]):
                    joins[d] = _loads(self.store.get(key))
                elif (why := self.lost_reason(d)) is not None:
                    lost[d] = LostDevice(device=d, rank=r, reason=why)
                elif time.monotonic() > t_end:
                    lost[d] = LostDevice(device=d, rank=r, reason=f"alive but did not join within {self.timeout_s:g} s")
            if len(joins) + len(lost) == len(self.members):
                return [joins[d] for d in self.members if d in joins], [lost[d] for d in self.members if d in lost]
            time.sleep(self.cfg.heartbeat_s / 5)

    def decision(self, gen: int) -> Transition | None:
        """The transition decided after generation ``gen``'s fault, if one was (a rejoin's is not kept here)."""
        key = f"g{gen}/decision"
        verdict = _loads(self.store.get(key)) if self.store.check([key]) else None
        return verdict if isinstance(verdict, Transition) else None

    def _await_decision(self, gen: int, leader: str) -> bytes:
        key = f"g{gen}/decision"
        # the leader's roll call takes up to timeout_s, its deciding (a re-plan) as long again at most
        bound_s = 2 * self.timeout_s + self.cfg.lost_after_s
        t_end = time.monotonic() + bound_s
        while not self.store.check([key]):
            if leader != self.me and self.lost_reason(leader) is not None:
                raise RuntimeSetupError(f"{self.me}: the leader of the recovery of generation {gen}, {leader}, "
                                        f"was lost too ({self.lost_reason(leader)})")
            if time.monotonic() > t_end:
                raise RuntimeSetupError(f"{self.me}: no decision from {leader}, the leader of the recovery of "
                                        f"generation {gen}, within {bound_s:g} s (it is alive)")
            time.sleep(self.cfg.heartbeat_s / 5)
        raw = self.store.get(key)
        verdict = _loads(raw)
        if isinstance(verdict, BaseException):
            raise verdict
        return raw

    # -- forming and leaving process groups -----------------------------------------------------
    def leave(self, groups: Sequence[Any] = ()) -> None:
        """Leave the current generation's process groups without waiting for their operations."""
        if dist.is_initialized():
            self._graveyard.extend([dist.group.WORLD, *groups])
            dist.destroy_process_group()

    def enter(self, tr: Transition) -> int:
        """Form generation ``tr.gen`` with its members; returns this rank's new rank."""
        with self._lock:  # [Note: one generation's fault flag]
            self.gen, self.members = tr.gen, tr.devices
            self.fault.clear()
            self._seen.clear()
        rank = tr.devices.index(self.me)
        kwargs = {"device_id": self.torch_device} if self.torch_device.type == "cuda" else {}
        try:
            dist.init_process_group("nccl" if self.torch_device.type == "cuda" else "gloo",
                                    store=dist.PrefixStore(f"g{tr.gen}/pg", self.store), rank=rank,
                                    world_size=len(tr.devices), timeout=timedelta(seconds=self.timeout_s), **kwargs)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise self._fail(f"generation {tr.gen} did not form: {str(exc)[:160]}", None) from None
        return rank

    def release(self) -> None:
        """Drop the old generations' groups (their destructors may wait out an old timeout)."""
        self._graveyard.clear()

    # -- rejoining ------------------------------------------------------------------------------
    def rejoin_requests(self) -> list[str]:
        """Devices of the launch, not members now, that asked to come back."""
        if not self.cfg.rejoin:
            return []
        return [d for d in self.launch_devices if d not in self.members and self.store.check([f"rejoin/{d}"])
                and self.lost_reason(d) is None]

    def admit(self, tr: Transition) -> None:
        """Hand ``tr`` to the devices it takes back in."""
        for d in tr.joined:
            self.store.set(f"admit/{d}/{self._request_id(d)}", pickle.dumps(tr))
            self.store.delete_key(f"rejoin/{d}")

    def _request_id(self, device: str) -> str:
        return self.store.get(f"rejoin/{device}").decode()

    def await_admission(self) -> Transition | None:
        """Ask to come back and wait until a transition takes this device in (``None``: the run
        ended); :class:`RuntimeSetupError` once no device of the run could admit it for
        ``lost_after_s`` (each lost, finished, or waiting to rejoin itself)."""
        rid = f"{os.getpid()}-{time.time():.6f}"
        with self._lock:
            self.members = ()  # in no generation while it waits: its heartbeat watches nobody
        self.store.set(f"rejoin/{self.me}", rid)
        key = f"admit/{self.me}/{rid}"
        alone_since = None
        while not self.store.check([key]):
            if self.store.check(["done"]):
                return None
            why = self._none_to_admit()
            now = time.monotonic()
            if why is None:
                alone_since = None
            elif alone_since is None:
                alone_since = now
            elif now - alone_since > self.cfg.lost_after_s:
                raise RuntimeSetupError(f"{self.me}: waited to rejoin, but for {self.cfg.lost_after_s:g} s no device "
                                        f"of the run could admit it ({why})")
            time.sleep(self.cfg.heartbeat_s)
        return _loads(self.store.get(key))

    def _none_to_admit(self) -> str | None:
        """Why no other device of the launch can admit this one now (``None``: some device may)."""
        why = []
        for d in self.launch_devices:
            if d == self.me:
                continue
            if self.store.check([f"rejoin/{d}"]):
                why.append(f"{d}: waits to rejoin too")
            elif self.store.check([f"finished/{d}"]):
                why.append(f"{d}: finished")
            elif (lost := self.lost_reason(d)) is not None:
                why.append(f"{d}: {lost}")
            else:
                return None
        return "; ".join(why) if why else "it is the only device"

    def finish(self) -> None:
        """The run is over: a device still waiting to rejoin stops waiting."""
        self.store.set("done", "1")


__all__ = ["POLL_MAX_S", "Decide", "ElasticConfig", "Excluded", "Fault", "JoinRecord", "LostDevice", "PeerLost",
           "Session", "Transition"]
