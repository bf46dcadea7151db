"""The ``partial`` strategy's group scheduler (SDPipe): groups formed centrally through the store.

[Note: partial averaging]
Replicas train independently, each on its own batch with its own optimizer, and count their
own local steps. After each local step a replica announces itself (its first rank writes
``<job>/partial/arrive/<replica>/<k>`` into the store) and waits for its assignment
(``.../assign/<replica>/<k>``). The :class:`Coordinator` (a thread on rank 0 that only talks
to the store) forms numbered *rounds*, one group each, from the replicas waiting, in arrival
order:

- a round opens when a replica is waiting; it closes as soon as ``max_group`` replicas wait
  (0: no upper bound), or all replicas wait, or ``window_s`` (emulated seconds) has passed
  since it opened and at least ``min_group`` wait;
- every ``full_sync_every``-th round (rounds ``P-1, 2P-1, ...``) and the last round
  (``steps - 1``) are *full*: they close only when every replica waits, so every replica is
  connected to every other at least once every ``P`` rounds, and all end with one model;
- replicas not taken into a closed group (more than ``max_group`` waiting) wait for the next.

The members of a group then average their parameters, segment by segment, among themselves
only ([Note: deterministic averaging] in :mod:`deepcee.runtime.replicas`); a group of one
averages nothing. A replica stops after the last round. A slow replica therefore joins fewer
rounds and runs fewer local steps; the fast ones wait for it only in the full rounds, at most
one of its steps. The coordinator records every group (:class:`GroupRecord`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from deepcee.errors import RuntimeSetupError
from deepcee.plan import Strategy
from deepcee.runtime.emulation import Clock

log = logging.getLogger(__name__)

POLL_S = 1e-3
"""How often the coordinator and the waiting ranks look into the store (a check costs ~10 us)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """What a replica learns after a local step."""

    round: int
    members: tuple[int, ...]
    """Replicas of the group, sorted."""
    full: bool
    final: bool
    """The last round: stop after averaging."""

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "members": list(self.members), "full": self.full,
                           "final": self.final})

    @staticmethod
    def from_json(text: str) -> Assignment:
        d = json.loads(text)
        return Assignment(round=int(d["round"]), members=tuple(d["members"]), full=bool(d["full"]),
                          final=bool(d["final"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupRecord:
    """One round as the coordinator formed it (wall seconds of the shared clock)."""

    round: int
    members: tuple[int, ...]
    full: bool
    open_wall: float
    close_wall: float
    arrivals: tuple[tuple[int, int], ...]
    """``(replica, its local step count)`` of every member."""


def _keys(job: str) -> tuple[str, str]:
    return f"{job}/partial/arrive", f"{job}/partial/assign"


def poll_get(store: Any, key: str, timeout_s: float, what: str) -> str:
    """``store.get(key)`` once the key exists, polling every :data:`POLL_S` (a store's own wait
    polls every 10 ms, a step's worth of delay here)."""
    t_end = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > t_end:
            raise RuntimeSetupError(f"no {what} within {timeout_s:g} s (store key {key})")
        time.sleep(POLL_S)
    return store.get(key).decode()


def announce(store: Any, job: str, replica: int, k: int, clock: Clock) -> None:
    """A replica's first rank: local step ``k`` is done."""
    store.set(f"{_keys(job)[0]}/{replica}/{k}", repr(clock.wall()))


def assignment(store: Any, job: str, replica: int, k: int, timeout_s: float) -> Assignment:
    """Every rank of a replica: the group of its ``k``-th announcement."""
    return Assignment.from_json(poll_get(store, f"{_keys(job)[1]}/{replica}/{k}", timeout_s,
                                         f"group for replica {replica} after its local step {k}"))


@dataclass(slots=True)
class Coordinator:
    """Forms the rounds of a ``partial`` run. See [Note: partial averaging]."""

    store: Any
    job: str
    num_replicas: int
    steps: int
    """Rounds of the run."""
    strategy: Strategy
    dilation: float
    timeout_s: float
    clock: Clock = field(default_factory=Clock)
    groups: list[GroupRecord] = field(default_factory=list)
    error: BaseException | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="partial-coordinator", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s)
        if self.error is not None:
            raise RuntimeSetupError(f"partial-sync coordinator failed: {self.error}")

    def _run(self) -> None:
        try:
            self._form_rounds()
        except BaseException as exc:  # reported by join() on rank 0; the others time out naming the key
            self.error = exc
            log.exception("partial-sync coordinator failed")

    def full(self, j: int) -> bool:
        return (j + 1) % self.strategy.full_sync_every == 0 or j == self.steps - 1

    def _form_rounds(self) -> None:
        arrive, _ = _keys(self.job)
        next_k = [0] * self.num_replicas
        waiting: list[tuple[float, int, int]] = []  # (arrival wall, replica, k)
        opened, last_seen = None, time.monotonic()
        j = 0
        while j < self.steps:
            for r in range(self.num_replicas):
                key = f"{arrive}/{r}/{next_k[r]}"
                if self.store.check([key]):
                    waiting.append((float(self.store.get(key).decode()), r, next_k[r]))
                    next_k[r] += 1
                    last_seen = time.monotonic()
            waiting.sort()
            if waiting and opened is None:
                opened = self.clock.wall()
            take = self._closes(j, waiting, opened)
            if take:
                self._publish(j, waiting[:take], opened)
                del waiting[:take]
                opened = None if not waiting else self.clock.wall()
                j += 1
                continue
            if time.monotonic() - last_seen > self.timeout_s:
                raise RuntimeSetupError(f"round {j}: only replicas {sorted(r for _, r, _ in waiting)} announced "
                                        f"within {self.timeout_s:g} s")
            time.sleep(POLL_S)

    def _closes(self, j: int, waiting: list[tuple[float, int, int]], opened: float | None) -> int:
        """How many of the waiting replicas round ``j`` takes now (0: not closing yet)."""
        n, s = len(waiting), self.strategy
        if n == 0:
            return 0
        if n == self.num_replicas:
            return n
        if self.full(j):
            return 0
        cap = s.max_group or self.num_replicas
        if n >= cap:
            return cap
        expired = opened is not None and self.clock.wall() >= opened + s.window_s * self.dilation
        return n if expired and n >= min(s.min_group, self.num_replicas) else 0

    def _publish(self, j: int, members: list[tuple[float, int, int]], opened: float | None) -> None:
        _, assign = _keys(self.job)
        a = Assignment(round=j, members=tuple(sorted(r for _, r, _ in members)), full=self.full(j),
                       final=j == self.steps - 1)
        for _, r, k in members:
            self.store.set(f"{assign}/{r}/{k}", a.to_json())
        now = self.clock.wall()
        self.groups.append(GroupRecord(round=j, members=a.members, full=a.full, open_wall=opened or now,
                                       close_wall=now, arrivals=tuple(sorted((r, k) for _, r, k in members))))
