"""Elastic training's settings, its errors, and the records the survivors of a fault exchange.

The mechanism that uses them is :mod:`deepcee.runtime.elastic` ([Note: elastic process groups]
there); the decisions are the hooks' (:mod:`deepcee.adapter.elastic`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from deepcee.errors import RuntimeSetupError, SpecError


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticConfig:
    """How an elastic run notices a lost device and takes a returning one back."""

    heartbeat_s: float = 0.25
    """How often each rank writes its heartbeat and looks at the others'."""
    lost_after_s: float = 5.0
    """A member whose heartbeat stood still this long is lost (a hung process or host). A
    process gone from this machine is lost at the next heartbeat."""
    rejoin: bool = True
    """Take a device that comes back in again at the next step boundary."""

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "lost_after_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and 0 < v < 3600):
                raise SpecError(f"must be a number of seconds in (0, 3600), got {v!r}", field=name)
        if self.lost_after_s < 4 * self.heartbeat_s:
            raise SpecError(f"must be at least 4 heartbeats ({4 * self.heartbeat_s:g} s), got {self.lost_after_s!r}",
                            field="lost_after_s")


class PeerLost(RuntimeSetupError):
    """This rank's generation has a fault: a member is lost, or an operation failed or timed out."""

    def __init__(self, message: str, *, suspect: str | None = None) -> None:
        super().__init__(message)
        self.suspect = suspect


class Excluded(RuntimeSetupError):
    """This rank was left out of the next generation (it was thought lost): it must rejoin."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LostDevice:
    device: str
    rank: int
    """Its rank in the generation it was lost from."""
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinRecord:
    """What a survivor tells the leader."""

    device: str
    rank: int
    applied: int
    """Steps whose update this rank holds (the next step it would run)."""
    version: int
    """The plan version in force on this rank."""
    layers: tuple[int, ...]
    """The layers whose current state this rank holds (its stage's, if it has one)."""
    detected_s: float
    """Wall time (``time.time()``) it noticed the fault."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition:
    """The next generation, as the leader (or rank 0, for a rejoin) decided it."""

    gen: int
    devices: tuple[str, ...]
    """Members in rank order."""
    resume_step: int
    lost: tuple[LostDevice, ...] = ()
    joined: tuple[str, ...] = ()
    """Devices that come back."""
    detail: Any = None
    """The hooks' part: plan, state moves or checkpoint, version."""
    fault_s: float | None = None
    """Wall time of the first fault report (``None``: a rejoin)."""
    decided_s: float = 0.0
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """The first report of a generation's fault."""

    by: str
    suspect: str | None
    reason: str
    at_s: float


class Decide(Protocol):
    """The leader's call into the hooks: the next generation from the survivors' records."""

    def __call__(self, gen: int, joins: Sequence[JoinRecord], lost: Sequence[LostDevice],
                 rejoining: Sequence[str], fault: Fault | None) -> Transition: ...


__all__ = ["Decide", "ElasticConfig", "Excluded", "Fault", "JoinRecord", "LostDevice", "PeerLost", "Transition"]
