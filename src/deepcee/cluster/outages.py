"""Link outages: the link between two nodes carries nothing over a stretch of time (torch-free).

A :class:`LinkOutage` is the fault-injection form of a dead wide-area link: from ``start_s``
until ``stop_s`` (seconds since the run started, the clock of bandwidth traces and
stragglers; ``stop_s`` infinite: it never comes back) no transfer between a device of one node
and a device of the other starts; one that is ready meanwhile waits for the link to come back.
The emulated runtime's link shaper applies it (``deepcee train --link-down``): a receiver whose
delivery would come later than its timeout sees a dead link, which an elastic run handles like
a lost device ([Note: elastic process groups] in :mod:`deepcee.runtime.elastic`). The text
form is ``NODE_A:NODE_B@START[:STOP]``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from deepcee.errors import ClusterSpecError


def name_cuts(text: str, sep: str, names: Collection[str]) -> list[tuple[str, str]]:
    """Every way to cut ``text`` at one ``sep`` into two names of ``names`` (names may hold
    ``sep`` themselves), first cut first."""
    parts = text.split(sep)
    return [(a, b) for k in range(1, len(parts))
            if (a := sep.join(parts[:k])) in names and (b := sep.join(parts[k:])) in names]


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkOutage:
    """The link between nodes ``a`` and ``b`` (both directions) is down from ``start_s`` to ``stop_s``."""

    a: str
    b: str
    start_s: float = 0.0
    stop_s: float = math.inf

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ClusterSpecError(f"needs a node name, got {v!r}", field=f"link_outage.{name}")
        if self.a == self.b:
            raise ClusterSpecError(f"needs two different nodes, got {self.a!r} twice", field="link_outage")
        for name in ("start_s", "stop_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ClusterSpecError(f"must be a number, got {v!r}", field=f"link_outage.{name}")
        if not (0 <= self.start_s < self.stop_s and math.isfinite(self.start_s)):
            raise ClusterSpecError(f"needs 0 <= start < stop, got {self.start_s!r}, {self.stop_s!r}",
                                   field="link_outage")

    def joins(self, node_x: str, node_y: str) -> bool:
        return {node_x, node_y} == {self.a, self.b}

    @staticmethod
    def parse(text: str, nodes: Sequence[str]) -> LinkOutage:
        """``NODE_A:NODE_B@START[:STOP]`` with both nodes among ``nodes``: ``cloud0:end0@5`` cuts
        the link from 5 s on for good, ``cloud0:end0@5:20`` from 5 s to 20 s. Node names may hold
        colons and ``@`` (the times hold neither): the pair is cut where both halves are nodes."""
        pair, _, window = text.rpartition("@")
        cuts = name_cuts(pair, ":", nodes)
        names = list(cuts[0]) if len(cuts) == 1 else []
        try:
            times = [float(x) for x in window.split(":")] if window else []
        except ValueError:
            times = []
        if len(names) != 2 or not 1 <= len(times) <= 2:
            raise ClusterSpecError(f"expected NODE_A:NODE_B@START[:STOP] with nodes among {list(nodes)}, got {text!r}",
                                   field="link-down")
        return LinkOutage(a=names[0], b=names[1], start_s=times[0], stop_s=times[1] if len(times) > 1 else math.inf)


def up_again_s(outages: Iterable[LinkOutage], t_s: float) -> float:
    """When a transfer over a link cut by ``outages`` (those of its node pair) that is ready at
    ``t_s`` can start: ``t_s`` when the link is up, else the end of the outage (``inf``: never)."""
    outs = tuple(outages)
    t, moved = t_s, True
    while moved and math.isfinite(t):  # outages may follow each other
        moved = False
        for o in outs:
            if o.start_s <= t < o.stop_s:
                t, moved = o.stop_s, True
    return t


def outages_by_devices(outages: Iterable[LinkOutage], node_of: Mapping[str, str]) -> dict[tuple[str, str], tuple]:
    """``(src device, dst device) -> outages`` of every device pair a listed outage cuts."""
    outs = tuple(outages)
    return {(x, y): tuple(o for o in outs if o.joins(nx, ny))
            for x, nx in node_of.items() for y, ny in node_of.items()
            if x != y and any(o.joins(nx, ny) for o in outs)}


__all__ = ["LinkOutage", "outages_by_devices", "up_again_s"]
