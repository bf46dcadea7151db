"""Which process runs which device of a plan when ``torchrun`` starts them on several machines.

[Note: machine mapping]
``torchrun`` numbers processes by node, and with ``--rdzv-backend c10d`` the node order is the
order in which the nodes joined: start the machines in another order and the same global rank
lands on another machine. deepcee therefore does not take a device from the global rank. Each
process says which cluster nodes (the ``[[nodes]]`` of the cluster file) its machine is:

1. the nodes named by ``--cluster-node NAME[,NAME]`` on its command line, else
2. the nodes whose ``host`` equals this machine's host name (or its short name, full name or an
   address of it), when the cluster file gives hosts, else
3. the nodes whose ``node_rank`` equals torchrun's node rank (``GROUP_RANK``; only the static
   rendezvous keeps ``--node-rank``), when the cluster file gives node ranks;

then takes, by its local rank, one of those nodes' devices in the plan's device order. Its
process-group rank is that device's rank in the plan (:class:`~deepcee.runtime.partition.Topology`
order), so the same devices run the same stages however the machines were started. Every
process checks the result before joining the process group: a node whose ``host`` is not the
machine the process runs on, a device no process runs, or a node claimed by two machines
fails at once, naming the device, the expected host and the actual host. Without any mapping
(no ``--cluster-node``, no ``host``, no ``node_rank``) devices follow torchrun's global rank as before,
with a warning. Torch-free: every process computes the same table from the same reports.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from deepcee.cluster import Cluster
from deepcee.errors import RuntimeSetupError


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """What one torchrun process says about itself before ranks are mapped."""

    launcher_rank: int
    """torchrun's global rank (``RANK``)."""
    local_rank: int
    group_rank: int
    """torchrun's node rank (``GROUP_RANK``)."""
    host: str
    aliases: tuple[str, ...] = ()
    """Other names of its machine (short and full host name, addresses)."""
    nodes: tuple[str, ...] = ()
    """Cluster nodes named by ``--cluster-node`` (empty: not given)."""

    def to_dict(self) -> dict[str, object]:
        return {"launcher_rank": self.launcher_rank, "local_rank": self.local_rank, "group_rank": self.group_rank,
                "host": self.host, "aliases": list(self.aliases), "nodes": list(self.nodes)}

    @staticmethod
    def from_dict(d: dict[str, object]) -> Report:
        return Report(launcher_rank=int(d["launcher_rank"]), local_rank=int(d["local_rank"]),
                      group_rank=int(d["group_rank"]), host=str(d["host"]), aliases=tuple(d["aliases"]),
                      nodes=tuple(d["nodes"]))

    def is_host(self, name: str) -> bool:
        return name == self.host or name in self.aliases


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """One process's place in the run."""

    launcher_rank: int
    rank: int
    """Its process-group rank: the plan rank of its device (idle processes after the devices)."""
    device: str | None
    node: str
    """Its device's cluster node (empty when idle)."""
    host: str
    mapped_by: str
    """``--cluster-node``, ``host``, ``node_rank`` or ``rank order``."""


def _describe(r: Report) -> str:
    return f"torchrun rank {r.launcher_rank} (node rank {r.group_rank}, local rank {r.local_rank}, host {r.host!r})"


def _nodes_of(r: Report, cluster: Cluster, source: str) -> tuple[tuple[str, ...], str]:
    """The cluster nodes process ``r`` serves and how they were found."""
    known = {n.name for n in cluster.nodes}
    if r.nodes:
        bad = [n for n in r.nodes if n not in known]
        if bad:
            raise RuntimeSetupError(f"{_describe(r)}: --cluster-node {bad[0]!r} is not a node of {source} "
                                    f"(nodes: {', '.join(sorted(known))})")
        return r.nodes, "--cluster-node"
    if any(n.host for n in cluster.nodes):
        mine = tuple(n.name for n in cluster.nodes if n.host and r.is_host(n.host))
        if not mine:
            hosts = sorted({n.host for n in cluster.nodes if n.host})
            raise RuntimeSetupError(f"{_describe(r)}: no node of {source} has host {r.host!r} (hosts there: "
                                    f"{', '.join(hosts)}); set host, or pass --cluster-node on this machine")
        return mine, "host"
    if any(n.node_rank is not None for n in cluster.nodes):
        mine = tuple(n.name for n in cluster.nodes if n.node_rank == r.group_rank)
        if not mine:
            raise RuntimeSetupError(f"{_describe(r)}: no node of {source} has node_rank {r.group_rank}")
        return mine, "node_rank"
    return (), "rank order"


def assign(reports: Sequence[Report], cluster: Cluster, devices: Sequence[str], *,
           source: str = "the cluster file") -> tuple[Assignment, ...]:
    """Every process's device and rank, in launcher-rank order. See [Note: machine mapping]."""
    reports = sorted(reports, key=lambda r: r.launcher_rank)
    if len(reports) < len(devices):
        raise RuntimeSetupError(f"the plan has {len(devices)} devices, torchrun started {len(reports)} processes")
    found = [_nodes_of(r, cluster, source) for r in reports]
    if all(how == "rank order" for _, how in found):
        return tuple(_by_rank_order(reports, cluster, devices))
    if any(how == "rank order" for _, how in found):
        r = reports[next(i for i, (_, how) in enumerate(found) if how == "rank order")]
        raise RuntimeSetupError(f"{_describe(r)} gave no --cluster-node while other processes did: give it on every machine")
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, (nodes, _) in enumerate(found):
        groups[nodes].append(i)
    _check_disjoint(groups, reports)
    placed: dict[int, str | None] = {}
    for nodes, members in groups.items():
        mine = [d for d in devices if cluster.device(d).node in nodes]
        members.sort(key=lambda i: reports[i].local_rank)
        if len(mine) > len(members):
            d = mine[len(members)]
            raise RuntimeSetupError(f"device {d} (node {cluster.device(d).node}) has no process: the machine of "
                                    f"nodes {', '.join(nodes)} started {len(members)} processes, the plan uses "
                                    f"{len(mine)} devices there")
        for k, i in enumerate(members):
            placed[i] = mine[k] if k < len(mine) else None
    missing = [d for d in devices if d not in placed.values()]
    if missing:
        raise RuntimeSetupError(f"device {missing[0]} (node {cluster.device(missing[0]).node}) has no process: no "
                                "machine serves its node (check --cluster-node, host or node_rank)")
    out = _ranked(reports, found, placed, cluster, devices)
    _check_hosts(out, reports, cluster, source)
    return out


def _check_disjoint(groups: dict[tuple[str, ...], list[int]], reports: Sequence[Report]) -> None:
    seen: dict[str, tuple[str, ...]] = {}
    for nodes in groups:
        for n in nodes:
            if n in seen and seen[n] != nodes:
                a, b = reports[groups[seen[n]][0]], reports[groups[nodes][0]]
                raise RuntimeSetupError(f"node {n} is claimed by two machines: {_describe(a)} and {_describe(b)}")
            seen[n] = nodes


def _ranked(reports: Sequence[Report], found: Sequence[tuple[tuple[str, ...], str]], placed: dict[int, str | None],
            cluster: Cluster, devices: Sequence[str]) -> tuple[Assignment, ...]:
    idle = iter(range(len(devices), len(reports)))
    out = []
    for i, r in enumerate(reports):
        d = placed[i]
        out.append(Assignment(launcher_rank=r.launcher_rank, rank=devices.index(d) if d is not None else next(idle),
                              device=d, node=cluster.device(d).node if d is not None else "", host=r.host,
                              mapped_by=found[i][1]))
    return tuple(out)


def _by_rank_order(reports: Sequence[Report], cluster: Cluster, devices: Sequence[str]) -> list[Assignment]:
    out = []
    for r in reports:
        d = devices[r.launcher_rank] if r.launcher_rank < len(devices) else None
        out.append(Assignment(launcher_rank=r.launcher_rank, rank=r.launcher_rank, device=d,
                              node=cluster.device(d).node if d else "", host=r.host, mapped_by="rank order"))
    return out


def _check_hosts(table: Sequence[Assignment], reports: Sequence[Report], cluster: Cluster, source: str) -> None:
    for a, r in zip(table, reports, strict=True):
        if a.device is None:
            continue
        want = cluster.node(a.node).host
        if want and not r.is_host(want):
            raise RuntimeSetupError(f"{_describe(r)} was mapped (by {a.mapped_by}) to device {a.device} of node "
                                    f"{a.node}, which {source} puts on host {want!r}; this process runs on host "
                                    f"{r.host!r}")


def format_table(table: Sequence[Assignment], stage_of: dict[str, int]) -> list[str]:
    """The mapping as lines: device, stage, rank, node, host, torchrun rank."""
    lines = [f"{'device':<14} {'stage':>5} {'rank':>4}  {'node':<10} {'host':<20} torchrun rank  (mapped by)"]
    for a in sorted(table, key=lambda a: a.rank):
        stage = "idle" if a.device is None else str(stage_of[a.device])
        lines.append(f"{a.device or '-':<14} {stage:>5} {a.rank:>4}  {a.node or '-':<10} {a.host:<20} "
                     f"{a.launcher_rank:>13}  ({a.mapped_by})")
    return lines
