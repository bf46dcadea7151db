"""What a run under a relaxed strategy records about its replicas (torch-free).

:class:`StrategyRun` goes into :class:`~deepcee.runtime.records.TrainResult` (key ``replicas``
of ``result.json``): each replica's local steps and samples, the groups the ``partial``
coordinator formed ([Note: partial averaging] in :mod:`deepcee.runtime.coordinator`), the
pushes the ``asgd-ga`` servers applied ([Note: asgd-ga] in :mod:`deepcee.runtime.ps`), and
the run's throughput. Seconds are emulated seconds since the run's epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaGroup:
    """One round of a ``partial`` run."""

    round: int
    members: tuple[int, ...]
    full: bool
    open_s: float
    close_s: float
    arrivals: tuple[tuple[int, int], ...]
    """``(replica, its local step)`` of every member."""

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "members": list(self.members), "full": self.full, "open_s": self.open_s,
                "close_s": self.close_s, "arrivals": [list(a) for a in self.arrivals]}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ReplicaGroup:
        return ReplicaGroup(round=int(d["round"]), members=tuple(d["members"]), full=bool(d["full"]),
                            open_s=float(d["open_s"]), close_s=float(d["close_s"]),
                            arrivals=tuple((int(a), int(b)) for a, b in d["arrivals"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerPush:
    """One push an ``asgd-ga`` server applied."""

    server: str
    replica: int
    version: int
    """The server's version before the push."""
    staleness: int
    """Server updates between the replica's pull and this push."""
    applied_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"server": self.server, "replica": self.replica, "version": self.version,
                "staleness": self.staleness, "applied_s": self.applied_s}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ServerPush:
        return ServerPush(server=d["server"], replica=int(d["replica"]), version=int(d["version"]),
                          staleness=int(d["staleness"]), applied_s=float(d["applied_s"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyRun:
    """What the replicas of a relaxed run did."""

    kind: str
    local_steps: tuple[int, ...]
    """Per replica, local steps run."""
    samples: tuple[int, ...]
    """Per replica, samples processed."""
    combines: tuple[int, ...]
    """Per replica, how often it combined with others (averages, or push-pull rounds)."""
    window_s: float
    """From the moment every replica had finished its first (warm-up) step to the last step's end."""
    samples_per_s: float
    """Samples of the local steps that ended inside that window, per emulated second."""
    groups: tuple[ReplicaGroup, ...] = ()
    pushes: tuple[ServerPush, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "local_steps": list(self.local_steps), "samples": list(self.samples),
                "combines": list(self.combines), "window_s": self.window_s, "samples_per_s": self.samples_per_s,
                "groups": [g.to_dict() for g in self.groups], "pushes": [p.to_dict() for p in self.pushes]}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> StrategyRun:
        return StrategyRun(kind=d["kind"], local_steps=tuple(d["local_steps"]), samples=tuple(d["samples"]),
                           combines=tuple(d["combines"]), window_s=float(d["window_s"]),
                           samples_per_s=float(d["samples_per_s"]),
                           groups=tuple(ReplicaGroup.from_dict(g) for g in d.get("groups", ())),
                           pushes=tuple(ServerPush.from_dict(p) for p in d.get("pushes", ())))
