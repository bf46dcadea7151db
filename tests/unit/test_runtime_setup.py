"""Start-up metadata exchange (in-process store, no process group) and checkpoint files."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deepcee.errors import RuntimeSetupError
from deepcee.plan import Plan, StagePlan
from deepcee.runtime import checkpoint as ckpt
from deepcee.runtime.p2p import TensorMeta, exchange_metadata
from deepcee.runtime.partition import Topology

META = TensorMeta(shape=(64, 64), dtype="float32")


def _topo():
    plan = Plan(system="t", cluster="c", model="m", global_batch=4, microbatch_size=4, num_microbatches=1,
                schedule="gpipe", stages=(StagePlan(layer_start=0, layer_stop=1, devices=("a", "b"), shares=(3, 1)),
                                          StagePlan(layer_start=1, layer_stop=2, devices=("c",), shares=(4,))))
    return Topology(plan)


def _store(**entries):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    for k, v in entries.items():
        store.set(k.replace("__", "/"), v)
    return store


def _hello(device, digest="d1"):
    return json.dumps({"plan": digest, "device": device})


def test_receiver_takes_agreed_meta_and_publishes_its_own():
    store = _store(j__hello__0=_hello("a"), j__hello__1=_hello("b"), j__meta__0=META.to_json(), j__meta__1=META.to_json())
    seen = []
    in_meta, out_meta = exchange_metadata(store, _topo(), 2, job="j", plan_digest="d1", timeout_s=1,
                                          output_meta=lambda m: seen.append(m) or None)
    assert in_meta == META and out_meta is None and seen == [META]
    hello = json.loads(store.get("j/hello/2"))
    assert hello["plan"] == "d1" and hello["device"] == "c"


def test_emulation_requires_one_host():
    store = _store(j__hello__0=json.dumps({"plan": "d1", "device": "a", "host": "elsewhere"}), j__hello__1=_hello("b"))
    with pytest.raises(RuntimeSetupError, match=r"emulation needs every rank on one machine.*rank 0 \(device a"):
        exchange_metadata(store, _topo(), 2, job="j", plan_digest="d1", timeout_s=1, output_meta=lambda m: None,
                          same_host=True)


def test_different_plan_names_the_peer():
    store = _store(j__hello__0=_hello("a", digest="other"), j__hello__1=_hello("b"))
    with pytest.raises(RuntimeSetupError, match=r"rank 0 \(device a, stage 0\) runs a different plan"):
        exchange_metadata(store, _topo(), 2, job="j", plan_digest="d1", timeout_s=1, output_meta=lambda m: None)


def test_senders_disagreeing_on_shape_is_an_error_naming_the_sender():
    other = TensorMeta(shape=(64, 32), dtype="float32")
    store = _store(j__hello__0=_hello("a"), j__hello__1=_hello("b"), j__meta__0=META.to_json(), j__meta__1=other.to_json())
    with pytest.raises(RuntimeSetupError, match=r"rank 1 \(device b, stage 0\) sends per-sample"):
        exchange_metadata(store, _topo(), 2, job="j", plan_digest="d1", timeout_s=1, output_meta=lambda m: None)


def test_stage_that_cannot_take_the_input_names_its_senders():
    store = _store(j__hello__0=_hello("a"), j__hello__1=_hello("b"), j__meta__0=META.to_json(), j__meta__1=META.to_json())

    def boom(meta):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeSetupError, match=r"rank 2 \(device c, stage 1\) cannot run on the output of "
                                                r"rank 0 \(device a, stage 0\), rank 1 \(device b, stage 0\)"):
        exchange_metadata(store, _topo(), 2, job="j", plan_digest="d1", timeout_s=1, output_meta=boom)


def test_missing_peer_times_out_naming_it():
    store = _store(j__hello__0=_hello("a"))
    with pytest.raises(RuntimeSetupError, match=r"no start-up message from rank 1 \(device b, stage 0\) to rank 2"):
        exchange_metadata(store, _topo(), 2, job="j", plan_digest="d1", timeout_s=0.3, output_meta=lambda m: None)


def test_tensor_meta_sizes():
    assert META.bytes_per_sample == 64 * 64 * 4
    assert TensorMeta.of(torch.zeros(3, 5, 7, dtype=torch.float64)) == TensorMeta(shape=(5, 7), dtype="float64")
    assert TensorMeta.from_json(META.to_json()) == META


def test_metrics_writer_appends_lines(tmp_path):
    w = ckpt.MetricsWriter(tmp_path / "m.jsonl")
    w.write({"step": 0, "loss": 1.0})
    w.close()
    w = ckpt.MetricsWriter(tmp_path / "m.jsonl", append=True)
    w.write({"step": 1, "loss": 0.5})
    w.close()
    assert [r["step"] for r in ckpt.read_metrics(tmp_path / "m.jsonl")] == [0, 1]
