"""Timeline of a replicated plan's simulation as Chrome trace JSON (torch-free).

The layout of :func:`deepcee.simulator.trace.chrome_trace`, with replicas: one process per
device, named ``replica r stage s: device`` and sorted by replica then stage, with a
``compute`` thread (F/I/W/B, optimizer steps) and a ``communication`` thread (receive waits,
the replica's own stage all-reduces, and the cross-replica collectives the device took part
in); one process per link resource (pipeline transfers and synchronisation messages: pushes,
pulls, gathers and scatters); one process per device that did server work (parameter-server
sums and updates, averaging at a root). Timestamps are microseconds since the simulation's
start. Open it in https://ui.perfetto.dev.
"""

from __future__ import annotations

from typing import Any

from deepcee.plan import Plan
from deepcee.simulator.replicas import ReplicaSimResult
from deepcee.simulator.trace import _device_event, _meta, _transfer_events


def replica_chrome_trace(result: ReplicaSimResult, plan: Plan) -> dict[str, Any]:
    """The result's timeline as Chrome trace event JSON (see the module docstring)."""
    if not result.events and not result.sync_events:
        raise ValueError("the result has no recorded events: simulate with record=True")

    def us(t: float) -> float:
        return round((t - result.start_s) * 1e6, 3)

    pids = {d: k + 1 for k, d in enumerate(plan.devices)}
    events: list[dict[str, Any]] = []
    for d, pid in pids.items():
        r, s = plan.locate(d)
        events += _meta(pid, f"replica {r} stage {s}: {d}", pid, {0: "compute", 1: "communication"})
    extra: dict[str, int] = {}

    def pid_of(key: str, name: str, threads: dict[int, str]) -> int:
        if key not in extra:
            extra[key] = len(pids) + len(extra) + 1
            events.extend(_meta(extra[key], name, extra[key], threads))
        return extra[key]

    for k, e in enumerate(result.events):
        if e.kind != "transfer":
            events.append(_device_event(e, pids[e.where], us))
            continue
        link = pid_of("link " + e.where, f"link {e.where}", {0: "serialise", 1: "transfers"})
        events += _transfer_events(e, k, link, pids[e.src], us)
    base = len(result.events)
    for k, e in enumerate(result.sync_events):
        args = {"what": e.what, "bytes": e.nbytes}
        if e.kind == "collective":
            events += [{"ph": "X", "name": e.what, "cat": "sync", "pid": pids[d], "tid": 1, "ts": us(e.start_s),
                        "dur": us(e.end_s) - us(e.start_s), "args": args} for d in e.devices if d in pids]
        elif e.kind == "work":
            pid = pid_of("server " + e.where, f"server work on {e.where}", {0: "work"})
            events.append({"ph": "X", "name": e.what, "cat": "server", "pid": pid, "tid": 0, "ts": us(e.start_s),
                           "dur": us(e.end_s) - us(e.start_s), "args": args})
        else:
            pid = pid_of("link " + e.where, f"link {e.where}", {0: "serialise", 1: "transfers"})
            name = f"{e.what} {e.src}->{e.dst}"
            events += [{"ph": "b", "name": name, "cat": "sync", "id": base + k, "pid": pid, "tid": 1,
                        "ts": us(e.start_s), "args": {**args, "src": e.src, "dst": e.dst}},
                       {"ph": "e", "name": name, "cat": "sync", "id": base + k, "pid": pid, "tid": 1,
                        "ts": us(e.end_s)}]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "deepcee.simulator.replicas", "system": plan.system, "semantics": result.semantics,
            "strategy": result.strategy, "start_s": result.start_s, "samples_per_s": result.samples_per_s,
            "wan_fraction": result.wan_fraction, "wait_fraction": result.wait_fraction,
            "local_steps": list(result.steps),
        },
    }


__all__ = ["replica_chrome_trace"]
