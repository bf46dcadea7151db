"""The machine-written JSON form of a cluster (``deepcee.cluster``), read back by
:func:`deepcee.cluster.files.cluster_from_dict`.

Its own module so that :meth:`Cluster.to_dict <deepcee.cluster.model.Cluster.to_dict>` can
write without importing the readers (which build Clusters, so import the model): the model
imports this module, this module imports neither (the types below are for checkers only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepcee.cluster.model import Cluster
    from deepcee.cluster.parts import Island, LinkSpec

SCHEMA_VERSION = 1
FORMAT = "deepcee.cluster"


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The ``deepcee.cluster`` JSON form of ``cluster`` (SI values); read back by :func:`cluster_from_dict`."""
    c = cluster
    return {
        "schema_version": SCHEMA_VERSION,
        "format": FORMAT,
        "name": c.name,
        "description": c.description,
        "emulation": c.emulation,
        "kinds": {
            k.name: {
                "peak_flops_per_s": k.peak_flops_per_s,
                "memory_bytes": k.memory_bytes,
                "achievable_fraction": k.achievable_fraction,
                "per_layer_overhead_s": k.per_layer_overhead_s,
                "source": k.source,
            }
            for k in c.kinds.values()
        },
        "islands": [{"name": i.name, **_spec_to_json(i.intra), **_island_extras(i)} for i in c.islands],
        "nodes": [
            {"name": n.name, "island": n.island, "kind": n.kind, "devices": list(n.devices), **_spec_to_json(n.intra),
             **({"host": n.host} if n.host else {}),
             **({"node_rank": n.node_rank} if n.node_rank is not None else {})}
            for n in c.nodes
        ],
        "devices": [
            {"name": d.name, "kind": d.kind, "node": d.node, "island": d.island, "slowdown": d.slowdown}
            for d in c.devices
        ],
        "links": [
            {"between": [e.a, e.b], "directed": e.directed, **_spec_to_json(e.spec)} for e in c.links
        ],
    }


ISLAND_EXTRAS = ("data_bytes", "device_usd_per_s", "egress_usd_per_byte")
"""Optional island fields (data held, prices), written when stated."""


def _island_extras(i: Island) -> dict[str, float]:
    return {k: getattr(i, k) for k in ISLAND_EXTRAS if getattr(i, k) is not None}


def _spec_to_json(s: LinkSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "latency_s": s.latency_s,
        "bandwidth_bytes_per_s": s.bandwidth_bytes_per_s,
    }
    if s.trace is not None:
        out["trace"] = {
            "name": s.trace.name,
            "times_s": list(s.trace.times_s),
            "bandwidth_bytes_per_s": list(s.trace.bandwidth_bytes_per_s),
        }
    return out
