"""Timeline export of a simulation (or an emulated run): Chrome trace JSON and a PNG Gantt chart.

Chrome trace (open in https://ui.perfetto.dev or chrome://tracing): one process per device,
named ``stage s: device`` and sorted by stage, with a ``compute`` thread (F/I/W/B, optimizer
step) and a ``communication`` thread (receive waits, all-reduce, one instant per piece sent);
one process per link resource (see [Note: link resources]) with a ``serialise`` thread
(serialisation spans; FIFO, so they never overlap) and each transfer from issue to delivery
as an async span. Timestamps are microseconds since the simulation's ``start_s``; every
event's ``args`` carry the action string and, for communication, the bytes.

The PNG chart (matplotlib, Agg canvas, no global backend switch) has one row per device,
grouped by stage, then one row per link resource; colours tell F/I/W/B, all-reduce,
optimizer, transfers and receive waits apart.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

from deepcee.plan import Plan, save_json_atomic
from deepcee.schedule.ir import parse_action
from deepcee.simulator.engine import Event, SimResult

log = logging.getLogger(__name__)

COLOURS = {
    "F": "#4C72B0", "I": "#DD8452", "W": "#55A868", "B": "#C44E52", "allreduce": "#8172B3",
    "optimizer": "#937860", "transfer": "#64B5CD", "latency": "#BFE3EF", "wait": "#E0E0E0",
}
_LEGEND = {"F": "forward", "I": "backward (inputs)", "W": "backward (weights)", "B": "backward (full)",
           "allreduce": "all-reduce", "optimizer": "optimizer step", "transfer": "transfer (serialise)",
           "latency": "transfer (in flight)", "wait": "receive wait"}


def _need_events(result: SimResult) -> None:
    if not result.events:
        raise ValueError("the result has no recorded events: simulate with record=True")


def _device_event(e: Event, pid: int, us: Any) -> dict[str, Any]:
    """A device's compute, wait, all-reduce or optimizer interval as a complete (X) event."""
    tid = 0 if e.kind in ("compute", "optimizer") else 1
    name = f"wait {e.action}" if e.kind == "wait" else e.action
    args: dict[str, Any] = {"action": e.action, "iteration": e.iteration}
    if e.kind == "allreduce":
        args["bytes"] = e.nbytes
    return {"ph": "X", "name": name, "cat": e.kind, "pid": pid, "tid": tid, "ts": us(e.start_s),
            "dur": us(e.end_s) - us(e.start_s), "args": args}


def _transfer_events(e: Event, k: int, link_pid: int, src_pid: int, us: Any) -> list[dict[str, Any]]:
    args = {"action": e.action, "bytes": e.nbytes, "src": e.src, "dst": e.dst, "iteration": e.iteration,
            "queued_us": us(e.start_s) - us(e.issued_s), "latency_us": us(e.end_s) - us(e.serialized_s)}
    name = f"{e.action} {e.src}->{e.dst}"
    return [
        {"ph": "X", "name": name, "cat": "transfer", "pid": link_pid, "tid": 0, "ts": us(e.start_s),
         "dur": us(e.serialized_s) - us(e.start_s), "args": args},
        {"ph": "b", "name": name, "cat": "transfer", "id": k, "pid": link_pid, "tid": 1,
         "ts": us(e.issued_s), "args": args},
        {"ph": "e", "name": name, "cat": "transfer", "id": k, "pid": link_pid, "tid": 1, "ts": us(e.end_s)},
        {"ph": "i", "s": "t", "name": f"send {e.action} to {e.dst}", "cat": "send", "pid": src_pid, "tid": 1,
         "ts": us(e.issued_s), "args": {"action": e.action, "bytes": e.nbytes, "dst": e.dst}},
    ]


def _meta(pid: int, name: str, sort: int, threads: dict[int, str]) -> list[dict[str, Any]]:
    out = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
           {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort}}]
    out += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": n}}
            for t, n in threads.items()]
    return out


def chrome_trace(result: SimResult, plan: Plan) -> dict[str, Any]:
    """The result's timeline as Chrome trace event JSON (see the module docstring)."""
    _need_events(result)

    def us(t: float) -> float:
        return round((t - result.start_s) * 1e6, 3)

    pids = {d: k + 1 for k, d in enumerate(plan.devices)}
    events: list[dict[str, Any]] = []
    for d, pid in pids.items():
        events += _meta(pid, f"stage {plan.stage_of(d)}: {d}", pid, {0: "compute", 1: "communication"})
    links: dict[str, int] = {}
    for k, e in enumerate(result.events):
        if e.kind != "transfer":
            events.append(_device_event(e, pids[e.where], us))
            continue
        if e.where not in links:
            links[e.where] = len(pids) + len(links) + 1
            events += _meta(links[e.where], f"link {e.where}", links[e.where], {0: "serialise", 1: "transfers"})
        events += _transfer_events(e, k, links[e.where], pids[e.src], us)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "deepcee.simulator", "system": plan.system, "schedule": plan.schedule,
            "start_s": result.start_s, "iteration_s": result.iteration_s,
            "samples_per_s": result.samples_per_s, "bubble_fraction": result.bubble_fraction,
            "bottleneck": result.bottleneck,
        },
    }


def write_chrome_trace(path: str | Path, result: SimResult, plan: Plan) -> None:
    """Write :func:`chrome_trace` to ``path`` atomically."""
    save_json_atomic(path, chrome_trace(result, plan))
    log.info("wrote Chrome trace %s (%d events)", path, len(result.events))


def _rows(result: SimResult, plan: Plan) -> tuple[list[str], dict[str, int]]:
    labels = [f"s{s} {d}" for s, st in enumerate(plan.stages) for d in st.devices]
    row = {d: i for i, d in enumerate(plan.devices)}
    for e in result.events:
        if e.kind == "transfer" and e.where not in row:
            row[e.where] = len(labels)
            labels.append(f"link {e.where}")
    return labels, row


def _bars(result: SimResult, row: dict[str, int]) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """(row, colour key) -> (start, width) spans in seconds since ``start_s``."""
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    t0 = result.start_s
    for e in result.events:
        if e.kind == "compute":
            key = parse_action(e.action).kind.value
        elif e.kind == "transfer":
            bars[(row[e.where], "latency")].append((e.serialized_s - t0, e.end_s - e.serialized_s))
            bars[(row[e.where], "transfer")].append((e.start_s - t0, e.serialized_s - e.start_s))
            continue
        else:
            key = e.kind
        bars[(row[e.where], key)].append((e.start_s - t0, e.end_s - e.start_s))
    return bars


def plot_timeline(result: SimResult, plan: Plan, path: str | Path, *,
                  caption: Literal["simulated", "emulated"] = "simulated") -> None:
    """Gantt chart of the result as a PNG at ``path``; ``caption`` says where the figures come from."""
    if caption not in ("simulated", "emulated"):
        raise ValueError(f"caption must be 'simulated' or 'emulated', got {caption!r}")
    _need_events(result)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    labels, row = _rows(result, plan)
    fig = Figure(figsize=(14, 1.2 + 0.32 * len(labels)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bars = _bars(result, row)
    for (r, key), spans in bars.items():
        height = 0.35 if key == "wait" else 0.8
        ax.broken_barh(spans, (r - height / 2, height), facecolors=COLOURS[key], linewidth=0)
    first = 0
    for s, st in enumerate(plan.stages):  # separate the stages' device groups
        first += len(st.devices)
        ax.axhline(first - 0.5, color="black", linewidth=0.6 if s < plan.num_stages - 1 else 1.2)
    for t in accumulate(result.iteration_times_s[:-1]):  # iteration boundaries
        ax.axvline(t, color="grey", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, result.end_s - result.start_s)
    ax.set_xlabel("time since start (s)")
    used = {key for _, key in bars}
    ax.legend(handles=[Patch(color=COLOURS[k], label=_LEGEND[k]) for k in COLOURS if k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(labels)), ncol=5, fontsize=7,
              frameon=False)
    ax.set_title(f"{plan.system}: {plan.schedule}, {plan.num_stages} stages x {plan.num_microbatches} "
                 f"microbatches of {plan.microbatch_size} - iteration {result.iteration_s:.4g} s, "
                 f"{result.samples_per_s:.4g} samples/s, bubble {result.bubble_fraction:.0%}", fontsize=9)
    fig.text(0.01, 0.005, f"{caption} | bottleneck: {result.bottleneck}", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(p)
    log.info("wrote timeline plot %s", p)
