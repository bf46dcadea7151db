"""Cluster data model: device kinds, devices, nodes, islands and the links between them.

Torch-free. Units are SI inside (seconds, bytes, bytes/s, FLOP/s); files use the units in
their key names (``latency_ms``, ``bandwidth_mbit_per_s``, ``peak_tflops``, ``memory_gib``)
and :mod:`deepcee.units` converts at the edge.

- :mod:`~deepcee.cluster.parts`: the validated records a cluster is made of
  (:class:`DeviceKind`, :class:`Device`, :class:`Node`, :class:`Island`, :class:`LinkSpec`,
  :class:`LinkEntry`, :class:`BandwidthTrace`, and :class:`Link`, a resolved device pair).
- :mod:`~deepcee.cluster.model`: :class:`Cluster`, its lookups and link queries, and the
  derived clusters (:meth:`Cluster.subset`, :meth:`Cluster.with_links`).
- :mod:`~deepcee.cluster.routing`: the typed lookup tables (:class:`ClusterIndex`) and the
  resolution of a device pair to its :class:`Link` (below).
- :mod:`~deepcee.cluster.files`: TOML and JSON readers, trace files.
- :mod:`~deepcee.cluster.writer`: the JSON writer (:func:`cluster_to_dict`).

Link model (alpha-beta): ``time = latency_s + bytes / bandwidth_bytes_per_s``.

[Note: link resources]
A *link* is directed and device-to-device, but the thing that is shared by concurrent
transfers is its ``resource``: inside a node each device pair has its own pipe
(NVLink/PCIe); between nodes every pair of nodes has one pipe per direction, shared by all
devices of those two nodes (a server's WAN uplink is shaped per destination). The simulator
and the upper bound share bandwidth per resource.

Link resolution, most specific first: an explicit ``[[links]]`` entry naming the two devices,
then the two nodes, then the two islands; otherwise the node's intra link (same node), or
the island's intra link (same island). Islands without a direct entry are joined through
the path with the least transfer time for 1 MB (latencies add, the narrowest hop sets the
bandwidth and the resource). Islands that no path joins are an error.

[Note: cluster views]
A plan is timed on its own devices only: the cost model and the simulator ask the cluster for
those devices, their kinds (all kinds decide the runtime, :func:`deepcee.simulator.runtime_model.on_gpus`),
the links between them and their ring order, nothing else. :meth:`Cluster.view_key` is that
part of a cluster: the devices in ring order, every kind, their nodes and islands, the
``[[links]]`` entries among those names, the island paths between their islands with each hop's
entry, and the emulation label. Link resolution above reads only these, so two clusters with
equal views of a device set give any plan on it the same links, and the same figures. The
crossover sweeps ([Note: sweep pool] in :mod:`deepcee.planner.sweep_pool`) time the same plans
on the whole cluster, on the kept devices' sub-cluster and on copies whose slow links differ,
and share a plan's figures wherever its devices' views are equal: at 512 devices in 8 islands
more than half of the sweeps' timings were such repeats.
"""

from __future__ import annotations

from deepcee.cluster.files import (
    cluster_from_dict,
    cluster_from_toml_dict,
    load_cluster,
    load_trace,
)
from deepcee.cluster.model import Cluster
from deepcee.cluster.parts import (
    BandwidthTrace,
    Device,
    DeviceKind,
    Island,
    Link,
    LinkEntry,
    LinkSpec,
    Node,
)
from deepcee.cluster.routing import ClusterIndex
from deepcee.cluster.writer import SCHEMA_VERSION, cluster_to_dict

__all__ = [
    "SCHEMA_VERSION", "BandwidthTrace", "Cluster", "ClusterIndex", "Device", "DeviceKind", "Island", "Link",
    "LinkEntry", "LinkSpec", "Node", "cluster_from_dict", "cluster_from_toml_dict", "cluster_to_dict",
    "load_cluster", "load_trace",
]
