"""Latency, throughput and CPU cost of the real-network mode's relay on one emulated WAN pair.

Two ranks, each in its own network namespace, joined through the user-space relay
(:mod:`deepcee.runtime.realnet`) by a link of ``--latency-ms`` one-way latency and
``--bandwidth-mbit`` per direction (default 20 ms / 100 Mbit/s). Measured, with real TCP:

- round-trip time of 64-byte messages (plain socket, ``TCP_NODELAY``): the link says
  ``2 x latency``;
- bulk throughput of one TCP stream (``--bulk-mb`` MB): goodput seen by the receiver over the
  steady part of the transfer (after the first 25% of the bytes, i.e. after slow start) and
  the IP rate the relay itself served; the link says ``bandwidth``, goodput at most
  ``bandwidth x MSS / MTU`` (1448 / 1500 with TCP timestamps);
- gloo (``torch.distributed``) over the same link: small-message send/recv round trip,
  a 4 MB send (timed to the receiver's reply, so the model is ``2 x latency + bytes / bandwidth``)
  and a 4 MB all-reduce (model: the simulator's ring alpha-beta time,
  :func:`deepcee.comm.ring_allreduce_s`);
- the relay's own CPU (user + system, fraction of one core) while the bulk transfer runs;
- TCP congestion control (part ``cc``): one 64 kB gloo message at a time, sent after an idle
  gap (0-300 ms, like a pipeline's activations), with the namespaces' stated default
  (CUBIC, [Note: congestion control in the namespaces] in :mod:`deepcee.runtime.realnet.netns`)
  against reno and the host's own default (BBR on the project's machines); the link says
  ``latency + wire bytes / bandwidth``.

Baselines measured in the same run: the same TCP probes through an unshaped relay pipe (no
latency, 10 Gbit/s: the relay's own overhead and ceiling), and through the shaped pipe with
TUN offload off (one packet per MTU segment: the CPU that offload saves).

Part ``train``: the same 2-device gpt-tiny plans (a 2-stage 1F1B pipeline and a 2-device
data-parallel stage; float32, AdamW) trained in mode ``emulated`` (in-process link delays, the
modelled all-reduce) and in mode ``realnet`` (real TCP through the relay), launches
interleaved ``--train-repeats`` times so that load from other processes hits both alike:
median step time over all steps but each launch's first (emulated seconds: wall / D), the
compute threads' CPU seconds per step (the devices' own work, which moves with the machine's
load), the slowest stage's compute and gradient-sync time per step, the relay's drops, and the simulator's prediction from a profile of this machine
measured in the same run (:func:`deepcee.profiler.device.probe_device`, one thread).

Figures of the ``link`` and ``cc`` parts are real wall time on this machine (no dilation).
Run as root::

    python benchmarks/realnet_link.py --out reports/realnet_link.json
    python benchmarks/realnet_link.py --parts train --train-repeats 5
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from deepcee.cluster import Cluster, Device, DeviceKind, Island, LinkEntry, LinkSpec, Node
from deepcee.comm import ring_allreduce_s
from deepcee.plan import Plan, StagePlan, save_json_atomic

MBIT = 1e6 / 8
PORT = 5301
MSS_OVER_MTU = 1448 / 1500


def wan_pair(latency_s: float, bandwidth_bytes_per_s: float) -> Cluster:
    fast = LinkSpec(latency_s=1e-5, bandwidth_bytes_per_s=1e10)
    return Cluster(
        name="wan-pair", kinds={"cpu": DeviceKind(name="cpu", peak_flops_per_s=1e11, memory_bytes=1e9)},
        islands=(Island(name="a", intra=fast), Island(name="b", intra=fast)),
        nodes=(Node(name="na", island="a", kind="cpu", devices=("na:0",), intra=fast),
               Node(name="nb", island="b", kind="cpu", devices=("nb:0",), intra=fast)),
        devices=(Device(name="na:0", kind="cpu", node="na", island="a"),
                 Device(name="nb:0", kind="cpu", node="nb", island="b")),
        links=(LinkEntry(a="a", b="b", spec=LinkSpec(latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)),),
    )


# -- rank targets (run inside the namespaces; this module is imported there by name) -------

def tcp_probe(rank: int, world_size: int, store_path: str, server: str, out: str, pings: int, bulk_bytes: int) -> None:
    """Rank 1 pings rank 0, then streams ``bulk_bytes`` to it; rank 0 logs (time, bytes received)."""
    if rank == 0:
        srv = socket.create_server((server, PORT))
        srv.settimeout(30)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(pings):
            conn.sendall(conn.recv(64))
        log, got = [], 0
        while got < bulk_bytes:
            got += len(conn.recv(1 << 20))
            log.append((time.monotonic(), got))
        conn.sendall(b"k")
        Path(out, "receiver.json").write_text(json.dumps(log))
        return
    for _ in range(300):
        try:
            sock = socket.create_connection((server, PORT), timeout=30)
            break
        except OSError:
            time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(pings):
        t0 = time.monotonic()
        sock.sendall(b"p" * 64)
        n = 0
        while n < 64:
            n += len(sock.recv(64 - n))
        rtts.append(time.monotonic() - t0)
    t0 = time.monotonic()
    sock.sendall(bytes(bulk_bytes))
    sock.recv(1)
    Path(out, "sender.json").write_text(json.dumps({"rtt_s": rtts, "bulk_start": t0, "bulk_end": time.monotonic()}))


def gloo_probe(rank: int, world_size: int, store_path: str, out: str, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from deepcee.runtime import dist as rdist

    rdist.single_thread()
    rdist.init_process_group(store=rdist.file_store(store_path, world_size, 60), rank=rank, world_size=world_size,
                             backend="gloo", timeout_s=60, device=torch.device("cpu"))
    small, big = torch.zeros(16), torch.zeros(1_000_000)
    rtt, p2p, allreduce = [], [], []
    for _ in range(3 * repeats):
        t0 = time.monotonic()
        if rank == 0:
            dist.send(small, 1)
            dist.recv(small, 1)
        else:
            dist.recv(small, 0)
            dist.send(small, 0)
        rtt.append(time.monotonic() - t0)
    for _ in range(repeats + 1):  # the first one also grows TCP's window
        dist.barrier()
        t0 = time.monotonic()
        if rank == 0:
            dist.send(big, 1)
            dist.recv(small, 1)
        else:
            dist.recv(big, 0)
            dist.send(small, 0)
        p2p.append(time.monotonic() - t0)
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.monotonic()
        dist.all_reduce(big)
        allreduce.append(time.monotonic() - t0)
    dist.destroy_process_group()
    if rank == 0:
        Path(out, "gloo.json").write_text(json.dumps({"rtt_s": rtt, "p2p_s": p2p[1:], "allreduce_s": allreduce[1:]}))


def message_probe(rank: int, world_size: int, store_path: str, out: str, nbytes: int, gaps_s: list[float],
                  repeats: int) -> None:
    """Rank 0 sends one ``nbytes`` message after each idle gap; rank 1 (its receive posted in
    advance, as the runtime does) logs ``(gap, one-way time)``: one ``CLOCK_MONOTONIC`` for both."""
    import torch
    import torch.distributed as dist

    from deepcee.runtime import dist as rdist

    rdist.single_thread()
    rdist.init_process_group(store=rdist.file_store(store_path, world_size, 60), rank=rank, world_size=world_size,
                             backend="gloo", timeout_s=60, device=torch.device("cpu"))
    buf = torch.zeros(nbytes // 8, dtype=torch.float64)
    log = []
    for i in range(repeats):
        for gap in gaps_s:
            tag = i * len(gaps_s) + gaps_s.index(gap)
            if rank == 1:
                work = dist.irecv(buf, 0, tag=tag)
                dist.barrier()
                work.wait()
                log.append((gap, time.monotonic() - float(buf[-1])))
            else:
                dist.barrier()
                time.sleep(gap)
                buf[-1] = time.monotonic()
                dist.isend(buf, 1, tag=tag).wait()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1:
        Path(out, "messages.json").write_text(json.dumps(log))


# -- measurement ------------------------------------------------------------------------------

class StatsSampler:
    """Samples the relay's counters every ``period_s`` while ranks run (for CPU during the bulk phase)."""

    def __init__(self, control: Any, period_s: float = 0.1) -> None:
        self.control, self.period_s, self.samples = control, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.control.stats()
            self.samples.append((time.monotonic(), s.cpu_s, s.system_s, sum(r.bytes for r in s.resources)))
            self._stop.wait(self.period_s)

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {"cpu_fraction": float("nan"), "system_fraction": float("nan")}
        (a, ca, sa, _), (b, cb, sb, _) = inside[0], inside[-1]
        return {"cpu_fraction": (cb - ca) / (b - a), "system_fraction": (sb - sa) / (b - a), "window_s": b - a}


def run_tcp(me: Any, cluster: Cluster, *, offload: bool, pings: int, bulk_bytes: int, work: Path) -> dict[str, Any]:
    from deepcee.runtime.realnet import RealNetwork

    out = work / f"tcp-{time.monotonic_ns()}"
    out.mkdir()
    with RealNetwork(cluster, ["na:0", "nb:0"], offload=offload) as net, StatsSampler(net.control) as sampler:
        net.run(me.tcp_probe, (net.endpoints[0].address, str(out), pings, bulk_bytes), deadline_s=120)
        relay = net.control.stats()
    sender = json.loads((out / "sender.json").read_text())
    log = json.loads((out / "receiver.json").read_text())
    steady = [(t, n) for t, n in log if n >= bulk_bytes / 4]
    (t_a, n_a), (t_b, n_b) = steady[0], steady[-1]
    rtts = sorted(sender["rtt_s"][1:])
    served = relay.resource(cluster.link("nb:0", "na:0").resource)
    cpu = sampler.between(sender["bulk_start"], sender["bulk_end"])
    return {
        "offload": offload,
        "rtt_median_s": statistics.median(rtts), "rtt_p90_s": rtts[int(0.9 * (len(rtts) - 1))], "rtt_min_s": rtts[0],
        "goodput_steady_bytes_per_s": (n_b - n_a) / (t_b - t_a),
        "goodput_whole_bytes_per_s": bulk_bytes / (sender["bulk_end"] - sender["bulk_start"]),
        "bulk_s": sender["bulk_end"] - sender["bulk_start"],
        "relay_packets": served.packets, "relay_bytes": served.bytes, "relay_dropped": served.dropped,
        "relay_mean_packet_bytes": served.bytes / max(1, served.packets),
        "relay_cpu_fraction_during_bulk": cpu["cpu_fraction"], "relay_system_fraction_during_bulk": cpu["system_fraction"],
        "relay_cpu_s_per_mb": cpu["cpu_fraction"] * (sender["bulk_end"] - sender["bulk_start"]) / (bulk_bytes / 1e6),
        "relay_cpu_fraction_whole_run": relay.cpu_fraction,
    }


def run_gloo(me: Any, cluster: Cluster, *, repeats: int, work: Path) -> dict[str, Any]:
    from deepcee.runtime.realnet import RealNetwork

    out = work / "gloo"
    out.mkdir()
    with RealNetwork(cluster, ["na:0", "nb:0"]) as net:
        net.run(me.gloo_probe, (str(out), repeats), deadline_s=180)
    g = json.loads((out / "gloo.json").read_text())
    return {"rtt_median_s": statistics.median(g["rtt_s"][1:]), "p2p_4mb_median_s": statistics.median(g["p2p_s"]),
            "allreduce_4mb_median_s": statistics.median(g["allreduce_s"]), "raw": g}


def wire_bytes(payload_bytes: int, mtu_bytes: int = 1500, headers_bytes: int = 52) -> int:
    """Bytes TCP puts on the wire for ``payload_bytes`` (IPv4 + TCP with timestamps: 52 B a segment)."""
    mss = mtu_bytes - headers_bytes
    return payload_bytes + -(-payload_bytes // mss) * headers_bytes


def run_cc(me: Any, cluster: Cluster, *, nbytes: int, repeats: int, work: Path) -> dict[str, Any]:
    from deepcee.runtime.realnet import RealNetwork
    from deepcee.runtime.realnet.netns import DEFAULT_CONGESTION_CONTROL

    host = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    gaps = [0.0, 0.05, 0.15, 0.3]
    out: dict[str, Any] = {}
    for label, cc in ((f"{DEFAULT_CONGESTION_CONTROL} (deepcee default)", DEFAULT_CONGESTION_CONTROL), ("reno", "reno"),
                      (f"{host} (host default)", None)):
        d = work / f"cc-{cc or 'host'}"
        d.mkdir()
        with RealNetwork(cluster, ["na:0", "nb:0"], congestion_control=cc) as net:
            net.run(me.message_probe, (str(d), nbytes, gaps, repeats), deadline_s=180)
            stats = net.control.stats()
        log = json.loads((d / "messages.json").read_text())[len(gaps):]  # the first round also opens the window
        by_gap = {g: statistics.median(t for gg, t in log if gg == g) for g in gaps}
        out[label] = {"median_s": statistics.median(t for _, t in log), "by_gap_median_s": by_gap,
                      "dropped": sum(r.dropped for r in stats.resources)}
    return out


# -- training: emulated vs realnet ------------------------------------------------------------

def train_plans(microbatch: int, microbatches: int) -> dict[str, Plan]:
    def plan(name: str, stages: tuple[StagePlan, ...], schedule: str) -> Plan:
        return Plan(system=name, cluster="wan-pair", model="gpt-tiny", global_batch=microbatch * microbatches,
                    microbatch_size=microbatch, num_microbatches=microbatches, schedule=schedule, stages=stages)

    return {
        "pipeline-1f1b": plan("pipeline-1f1b", (StagePlan(layer_start=0, layer_stop=3, devices=("na:0",), shares=(microbatch,)),
                                                StagePlan(layer_start=3, layer_stop=6, devices=("nb:0",), shares=(microbatch,))),
                              "1f1b"),
        "data-parallel": plan("data-parallel", (StagePlan(layer_start=0, layer_stop=6, devices=("na:0", "nb:0"),
                                                          shares=(microbatch // 2, microbatch - microbatch // 2)),),
                              "gpipe"),
    }


def predicted_step_s(cluster: Cluster, plans: dict[str, Plan]) -> tuple[dict[str, float], float]:
    """The simulator's iteration time of each plan from a profile of this machine (one thread); wall seconds spent."""
    from deepcee.profiler.device import net_source, probe_device
    from deepcee.profiler.model import base_profile, measured_kind, measured_profile
    from deepcee.profiler.probes import ProbeConfig
    from deepcee.runtime import dist as rdist
    from deepcee.simulator.engine import simulate

    t0 = time.monotonic()
    rdist.single_thread()
    source = net_source("gpt-tiny")
    probe = probe_device(source, device_name="na:0", kind="cpu", config=ProbeConfig(repeats=5, time_budget_s=60))
    profile = measured_profile(base_profile(source), [probe], source="benchmarks/realnet_link.py (this machine)")
    measured = dataclasses.replace(cluster, kinds={n: measured_kind(k, [probe], profile) for n, k in cluster.kinds.items()})
    return {name: simulate(plan, measured, profile).iteration_s for name, plan in plans.items()}, time.monotonic() - t0


def run_train(cluster: Cluster, plans: dict[str, Plan], *, steps: int, repeats: int, work: Path) -> dict[str, Any]:
    from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
    from deepcee.runtime.launch import launch_jobs

    runs: dict[str, dict[str, list]] = {m: {name: [] for name in plans} for m in ("emulated", "realnet")}
    relay_drops = []
    for rep in range(repeats):
        for mode in ("emulated", "realnet"):  # interleaved: the machine's load hits both alike
            jobs = [Job(name=f"{name}-{mode}-{rep}", plan=plan, cluster=cluster, model="gpt-tiny",
                        config=TrainConfig(steps=steps, mode=mode, optimizer=OptimizerConfig(), timeout_s=60),
                        run_dir=str(work / f"{name}-{mode}-{rep}"))
                    for name, plan in plans.items()]
            for job, res in zip(jobs, launch_jobs(jobs, deadline_s=300), strict=True):
                name = job.plan.system
                recs = res.metrics[1:]
                runs[mode][name].append({"step_s": list(res.step_s[1:]), "dilation": res.dilation,
                                         "cpu_s": [sum(r.cpu_s.values()) / len(r.cpu_s) for r in recs],
                                         "compute_s": [max(s.compute_s for s in r.stages) for r in recs],
                                         "sync_s": [max(s.sync_s for s in r.stages) for r in recs]})
            if mode == "realnet":
                relay = json.loads((Path(jobs[0].run_dir) / "relay.json").read_text())
                relay_drops.append(sum(r["dropped"] for r in relay["resources"]))
    out: dict[str, Any] = {"relay_drops_per_launch": relay_drops}
    for mode, per_plan in runs.items():
        for name, launches in per_plan.items():
            steps_s = [t for run in launches for t in run["step_s"]]
            out.setdefault(name, {})[mode] = {
                "median_step_s": statistics.median(steps_s),
                "launch_medians_s": [statistics.median(run["step_s"]) for run in launches],
                "median_cpu_s": statistics.median(c for run in launches for c in run["cpu_s"]),
                "launch_cpu_s": [statistics.median(run["cpu_s"]) for run in launches],
                "median_compute_s": statistics.median(c for run in launches for c in run["compute_s"]),
                "median_sync_s": statistics.median(c for run in launches for c in run["sync_s"]),
                "dilation": launches[0]["dilation"],
            }
    return out


def ratio(measured: float, model: float) -> float:
    return measured / model if model else float("nan")


def print_link(a: argparse.Namespace, lat: float, bw: float, shaped: Cluster, runs: dict, gloo: dict) -> list:
    s = runs["shaped"]
    rows = [
        ("TCP RTT 64 B (median)", 2 * lat, s["rtt_median_s"], "s"),
        ("TCP RTT 64 B (p90)", 2 * lat, s["rtt_p90_s"], "s"),
        ("TCP goodput, steady", bw * MSS_OVER_MTU, s["goodput_steady_bytes_per_s"], "B/s"),
        (f"TCP goodput, whole {a.bulk_mb:g} MB", bw * MSS_OVER_MTU, s["goodput_whole_bytes_per_s"], "B/s"),
        ("gloo send/recv RTT 64 B", 2 * lat, gloo["rtt_median_s"], "s"),
        ("gloo 4 MB send + reply", 2 * lat + 4e6 / bw, gloo["p2p_4mb_median_s"], "s"),
        ("gloo 4 MB all-reduce (2 ranks)", ring_allreduce_s(shaped, ["na:0", "nb:0"], 4e6),
         gloo["allreduce_4mb_median_s"], "s"),
    ]
    print(f"Relay link {a.latency_ms:g} ms / {a.bandwidth_mbit:g} Mbit/s, real TCP between two network namespaces")
    print(f"{'quantity':34s} {'link model':>12s} {'measured':>12s} {'ratio':>7s}")
    for name, model, got, unit in rows:
        scale, u = (1e3, "ms") if unit == "s" else (8 / 1e6, "Mbit/s")
        print(f"{name:34s} {model * scale:9.2f} {u:>2s} {got * scale:9.2f} {u:>2s} {ratio(got, model):7.3f}")
    print()
    print(f"{'relay (bulk phase)':34s} {'CPU frac':>9s} {'sys frac':>9s} {'CPU s/MB':>9s} {'pkts':>7s} {'B/pkt':>7s} {'drops':>6s} {'RTT ms':>7s} {'Mbit/s':>7s}")
    for name, r in runs.items():
        print(f"{name:34s} {r['relay_cpu_fraction_during_bulk']:9.3f} {r['relay_system_fraction_during_bulk']:9.3f} "
              f"{r['relay_cpu_s_per_mb']:9.4f} {r['relay_packets']:7d} {r['relay_mean_packet_bytes']:7.0f} "
              f"{r['relay_dropped']:6d} {r['rtt_median_s'] * 1e3:7.2f} {r['goodput_steady_bytes_per_s'] * 8 / 1e6:7.1f}")
    print()
    return rows


def print_cc(nbytes: int, model_s: float, cc: dict[str, Any]) -> None:
    print(f"gloo message of {nbytes / 1e3:g} kB after an idle gap; link model {model_s * 1e3:.2f} ms")
    print(f"{'congestion control':24s} {'median ms':>10s} {'ratio':>7s}  by gap (s: ms)")
    for label, r in cc.items():
        gaps = "  ".join(f"{g:g}: {t * 1e3:.1f}" for g, t in r["by_gap_median_s"].items())
        print(f"{label:24s} {r['median_s'] * 1e3:10.2f} {ratio(r['median_s'], model_s):7.3f}  {gaps}")
    print()


def print_train(train: dict[str, Any], predicted: dict[str, float], steps: int, repeats: int) -> None:
    print(f"Training gpt-tiny on the same link, {repeats} interleaved launches of {steps} steps per mode "
          "(emulated seconds: wall / D; first step of each launch excluded)")
    print(f"{'plan':16s} {'mode':9s} {'D':>5s} {'median step':>12s} {'per launch':>22s} {'CPU/step':>9s} "
          f"{'CPU per launch':>20s} {'compute':>8s} {'sync':>8s} {'simulator':>10s} {'ratio':>6s}")
    for name, pred in predicted.items():
        for mode in ("emulated", "realnet"):
            r = train[name][mode]
            launches = " ".join(f"{t * 1e3:.0f}" for t in r["launch_medians_s"])
            cpus = " ".join(f"{t * 1e3:.0f}" for t in r["launch_cpu_s"])
            print(f"{name:16s} {mode:9s} {r['dilation']:5.2f} {r['median_step_s'] * 1e3:9.1f} ms {launches:>22s} "
                  f"{r['median_cpu_s'] * 1e3:6.1f} ms {cpus:>20s} {r['median_compute_s'] * 1e3:5.1f} ms "
                  f"{r['median_sync_s'] * 1e3:5.1f} ms {pred * 1e3:7.1f} ms "
                  f"{ratio(r['median_step_s'], pred):6.3f}")
    print(f"relay drops per realnet launch: {train['relay_drops_per_launch']}")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--bandwidth-mbit", type=float, default=100.0)
    ap.add_argument("--bulk-mb", type=float, default=30.0)
    ap.add_argument("--pings", type=int, default=40)
    ap.add_argument("--gloo-repeats", type=int, default=5)
    ap.add_argument("--parts", default="link,cc,train", help="comma-separated: link, cc, train")
    ap.add_argument("--message-kb", type=float, default=65.536, help="cc part: message size")
    ap.add_argument("--cc-repeats", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=12)
    ap.add_argument("--train-repeats", type=int, default=3)
    ap.add_argument("--train-microbatch", type=int, default=4)
    ap.add_argument("--train-microbatches", type=int, default=4)
    ap.add_argument("--out", default="reports/realnet_link.json")
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    if parts - {"link", "cc", "train"}:
        ap.error(f"unknown parts {sorted(parts - {'link', 'cc', 'train'})}")

    from deepcee.runtime.realnet.netns import realnet_unavailable

    reason = realnet_unavailable()
    if reason is not None:
        print(f"realnet unavailable here: {reason}", file=sys.stderr)
        return 2
    me = importlib.import_module(Path(__file__).stem)  # targets must be importable by name in the ranks
    lat, bw = a.latency_ms / 1e3, a.bandwidth_mbit * MBIT
    shaped, unshaped = wan_pair(lat, bw), wan_pair(0.0, 10e9 / 8)
    bulk = int(a.bulk_mb * 1e6)
    result: dict[str, Any] = {"format": "deepcee.benchmark.realnet_link", "schema_version": 2,
                              "link": {"latency_s": lat, "bandwidth_bytes_per_s": bw}}
    with tempfile.TemporaryDirectory(prefix="realnet-bench-") as tmp:
        work = Path(tmp)
        if "link" in parts:
            runs = {
                "shaped": run_tcp(me, shaped, offload=True, pings=a.pings, bulk_bytes=bulk, work=work),
                "shaped_no_offload": run_tcp(me, shaped, offload=False, pings=a.pings, bulk_bytes=bulk, work=work),
                # 10x the bytes: at the relay's ceiling the transfer must last long enough to sample its CPU
                "unshaped": run_tcp(me, unshaped, offload=True, pings=a.pings, bulk_bytes=10 * bulk, work=work),
            }
            gloo = run_gloo(me, shaped, repeats=a.gloo_repeats, work=work)
            rows = print_link(a, lat, bw, shaped, runs, gloo)
            result.update({
                "note": "real wall time through the user-space relay (no dilation); CPU fractions are of one core, "
                        "user + system, sampled every 0.1 s during the bulk transfer",
                "rows": [{"quantity": n, "model": m, "measured": g, "ratio": ratio(g, m), "unit": u}
                         for n, m, g, u in rows],
                "tcp": runs, "gloo": gloo,
            })
        if "cc" in parts:
            nbytes = int(a.message_kb * 1e3) // 8 * 8
            model_s = lat + wire_bytes(nbytes) / bw
            cc = run_cc(me, shaped, nbytes=nbytes, repeats=a.cc_repeats, work=work)
            print_cc(nbytes, model_s, cc)
            result["congestion_control"] = {"message_bytes": nbytes, "link_model_s": model_s, "runs": cc}
        if "train" in parts:
            plans = train_plans(a.train_microbatch, a.train_microbatches)
            predicted, probe_s = predicted_step_s(shaped, plans)
            train = run_train(shaped, plans, steps=a.train_steps, repeats=a.train_repeats, work=work)
            print_train(train, predicted, a.train_steps, a.train_repeats)
            result["train"] = {
                "note": "emulated seconds (wall / D); median over all steps but each launch's first; CPU/step is the "
                        "mean over the two ranks of the compute thread's CPU seconds; simulator: measured profile of "
                        f"this machine ({probe_s:.0f} s probe) on the declared link",
                "plans": {name: plan.to_dict() for name, plan in plans.items()},
                "predicted_step_s": predicted, **train,
            }
    save_json_atomic(Path(a.out), result)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
