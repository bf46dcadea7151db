"""Two ``torchrun`` nodes on this host (c10d rendezvous), started in either order: each node's
processes run the devices of the cluster node it names, the same devices run the same stages,
and the losses equal the float64 single-process reference.

c10d numbers nodes by how they join, so the node started first gets torchrun ranks 0 and 1;
deepcee maps ranks by machine instead ([Note: machine mapping] in deepcee.runtime.machines).
The two launches (edge0 first, cloud0 first) run at the same time on different ports."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from _runtime_helpers import make_plan, reference

from deepcee.plan import save_json_atomic
from deepcee.runtime.job import OptimizerConfig

pytestmark = [pytest.mark.dist, pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")]

DEADLINE_S = 240
STAGE_OF = {"cloud0:0": 0, "cloud0:1": 0, "edge0:0": 1, "edge0:1": 1}
PLAN = make_plan("gpt-tiny", [(0, 3, ("cloud0:0", "cloud0:1"), (1, 1)), (3, 6, ("edge0:0", "edge0:1"), (1, 1))],
                 2, "1f1b")
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(tmp: Path, order: str, node: str, port: int) -> subprocess.Popen:
    cmd = [shutil.which("torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", order, "-m", "deepcee.train",
           "--plan", str(tmp / "plan.json"), "--steps", "2", "--dtype", "float64", "--mode", "real",
           "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--timeout", "90",
           "--run-dir", str(tmp / order), "--cluster-node", node]
    log = (tmp / f"{order}-{node}.log").open("w")
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT,
                            cwd=tmp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-nodes")
    save_json_atomic(tmp / "plan.json", PLAN.to_dict())
    orders = {"edge-first": ("edge0", "cloud0"), "cloud-first": ("cloud0", "edge0")}
    procs = {}
    t0 = time.monotonic()
    for order, (first, _) in orders.items():
        procs[(order, first)] = _node(tmp, order, first, port := _free_port())
        orders[order] = (first, orders[order][1], port)
    time.sleep(3)  # the first node has joined the rendezvous before the second starts
    for order, (_, second, port) in orders.items():
        procs[(order, second)] = _node(tmp, order, second, port)
    try:
        for (order, node), p in procs.items():
            rc = p.wait(timeout=max(1.0, DEADLINE_S - (time.monotonic() - t0)))
            assert rc == 0, f"{order}/{node} exited {rc}: {(tmp / f'{order}-{node}.log').read_text()[-3000:]}"
    except subprocess.TimeoutExpired:
        pytest.fail(f"two-node torchrun did not finish within {DEADLINE_S} s")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return tmp, {order: json.loads((tmp / order / "result.json").read_text()) for order in orders}


def test_same_devices_run_the_same_stages_in_either_start_order(runs):
    tmp, results = runs
    seen_launcher_ranks = {}
    for order, res in results.items():
        ranks = res["ranks"]
        assert {r["device"]: r["stage"] for r in ranks} == STAGE_OF
        for r in ranks:
            assert r["node"] == r["device"].split(":")[0]  # the node that named it runs it
            assert r["rank"] == list(STAGE_OF).index(r["device"])  # plan order, whatever torchrun said
            assert r["backend"] == "gloo" and r["torch_device"] == "cpu" and r["host"] == socket.gethostname()
        seen_launcher_ranks[order] = {r["device"]: r["launcher_rank"] for r in ranks}
        log = (tmp / f"{order}-cloud0.log").read_text()
        assert "devices of 4 torchrun processes" in log and "(--cluster-node)" in log
    # c10d gave the nodes different torchrun ranks in the two orders; the plan ranks stayed
    assert seen_launcher_ranks["edge-first"] != seen_launcher_ranks["cloud-first"]


def test_both_orders_equal_the_reference(runs):
    _, results = runs
    losses, _, _ = reference("gpt-tiny", PLAN, 2, SGD)
    for res in results.values():
        assert res["losses"] == pytest.approx(losses, rel=1e-10)
