"""Typed step records and results: what rank 0 writes reads back equal, files written before the
records were typed still load, and a step's record is the right summary of its ranks' records."""

from __future__ import annotations

import json

import pytest

from deepcee.errors import SpecError
from deepcee.plan import EXACT, Plan, StagePlan
from deepcee.runtime.emulation import emulation_info
from deepcee.runtime.job import Job, TrainConfig
from deepcee.runtime.records import (
    AdapterRun,
    AppliedChange,
    BoundaryMetrics,
    LinkEstimateRecord,
    PlanChange,
    RankChange,
    RankMetrics,
    StepMetrics,
    TrainResult,
    step_metrics,
    train_result,
)
from deepcee.scenarios import load_scenario

PLAN = Plan(system="t", cluster="local-small", model="gpt-tiny", global_batch=8, microbatch_size=4,
            num_microbatches=2, schedule="1f1b",
            stages=(StagePlan(layer_start=0, layer_stop=3, devices=("cloud0:0", "cloud0:1"), shares=(3, 1)),
                    StagePlan(layer_start=3, layer_stop=6, devices=("edge0:0",), shares=(4,))))
INFO = emulation_info("emulated", 2.0)

# a line of metrics.jsonl as the runtime wrote it before the records were typed (no schema_version)
OLD_LINE = {
    "step": 3, "loss": 5.25, "step_s": 0.125, "samples_per_s": 64.0, "mode": "emulated", "dilation": 2.0,
    "cores": 1.2, "emulated": list(INFO.emulated),
    "stages": [{"stage": 0, "compute_s": 0.05, "wait_s": 0.01, "sync_s": 0.02},
               {"stage": 1, "compute_s": 0.06, "wait_s": 0.03, "sync_s": 0.0}],
    "link_bytes": {"cloud0:0->edge0:0": 3000, "edge0:0->cloud0:0": 3000}, "cpu_s": {"cloud0:0": 0.02, "edge0:0": 0.03},
    "change": "replan", "change_s": 0.5, "moved_bytes": 1234.0,
    "plan_version": 1, "end_s": 2.5,
    "link_estimates": {"cloud0->edge0": {"latency_s": 0.02, "bandwidth_bytes_per_s": 1.25e7, "changed": False, "n": 4}},
    "changed_links": [], "change_by_device": {"edge0:0": {"change_s": 0.4, "move_s": 0.1}},
    "decision": "keep", "reason": "no gain", "control_s": 0.003,
    "trace": {"cloud0:0": [["0F0", 0.0, 0.01], ["0SEND_F0", 0.01, 0.011]]},
}


EXACT_KEYS = {"semantics": "exact", "strategy": EXACT.describe()}


def test_an_old_metrics_line_loads_and_writes_back_with_the_same_keys() -> None:
    rec = StepMetrics.from_dict(OLD_LINE)
    assert rec.step == 3 and rec.mode == "emulated" and rec.dilation == 2.0
    assert rec.stages[1].compute_s == 0.06 and rec.link_bytes["cloud0:0->edge0:0"] == 3000
    assert rec.change == AppliedChange(kind="replan", change_s=0.5, moved_bytes=1234.0)
    assert rec.boundary.link_estimates["cloud0->edge0"] == LinkEstimateRecord(
        latency_s=0.02, bandwidth_bytes_per_s=1.25e7, changed=False, n=4)
    assert rec.boundary.change_by_device == {"edge0:0": RankChange(change_s=0.4, move_s=0.1)}
    assert rec.trace["cloud0:0"][1] == ("0SEND_F0", 0.01, 0.011)
    back = json.loads(json.dumps(rec.to_dict()))
    # a line written before semantics and strategy were recorded was an exact run; it says so now
    assert back == {"schema_version": 1, **OLD_LINE, **EXACT_KEYS}
    assert StepMetrics.from_dict(back) == rec


def test_a_fixed_plan_line_has_no_adapter_keys() -> None:
    plain = {k: v for k, v in OLD_LINE.items()
             if k in ("step", "loss", "step_s", "samples_per_s", "mode", "dilation", "cores", "emulated", "stages",
                      "link_bytes", "cpu_s")}
    rec = StepMetrics.from_dict(plain)
    assert rec.boundary is None and rec.change is None and rec.trace is None
    assert rec.to_dict() == {"schema_version": 1, **plain, **EXACT_KEYS}
    last = BoundaryMetrics(plan_version=0, end_s=1.0)  # the last step of an adaptive run: no decision
    assert "decision" not in last.to_dict() and "change_by_device" not in last.to_dict()


def _rank(rank, stage, device, compute_s, **kw) -> RankMetrics:
    return RankMetrics(rank=rank, stage=stage, device=device, loss=kw.get("loss", 0.0), compute_s=compute_s,
                       cpu_s=compute_s / 2, wait_s=0.2, sync_s=kw.get("sync_s", 0.0), peak_in_flight=2,
                       bytes_sent=kw.get("bytes_sent", {}), trace=kw.get("trace", ()))


def test_a_step_record_summarises_its_ranks() -> None:
    epoch = 100.0
    ranks = [_rank(0, 0, "cloud0:0", 1.0, bytes_sent={"cloud0:0->edge0:0": 30}, sync_s=0.4,
                   trace=(("0F0", 101.0, 101.5),)),
             _rank(1, 0, "cloud0:1", 1.6, bytes_sent={"cloud0:1->edge0:0": 10}, sync_s=0.2),
             _rank(2, 1, "edge0:0", 0.8, loss=5.0, bytes_sent={"edge0:0->cloud0:0": 30, "edge0:0->cloud0:1": 10})]
    rec = step_metrics(4, ranks, 3.0, global_batch=8, emulation=INFO, epoch=epoch)
    assert rec.step_s == 1.5 and rec.samples_per_s == pytest.approx(8 / 1.5) and rec.loss == 5.0
    # each stage: its slowest device, divided by the dilation (2)
    assert [(s.compute_s, s.sync_s) for s in rec.stages] == [(0.8, 0.2), (0.4, 0.0)]
    assert sum(rec.link_bytes.values()) == 80 and rec.cpu_s == {"cloud0:0": 0.5, "cloud0:1": 0.8, "edge0:0": 0.4}
    assert rec.trace["cloud0:0"] == (("0F0", 0.5, 0.75),)  # emulated seconds since the epoch
    assert step_metrics(4, ranks, 3.0, global_batch=8, emulation=INFO).trace is None


def _adaptive_result(run_dir: str, steps: int = 3) -> TrainResult:
    records = [step_metrics(k, [_rank(0, 0, "cloud0:0", 1.0, loss=6.0 - k)], 1.0 + (k == 0), global_batch=8,
                            emulation=INFO, boundary=BoundaryMetrics(plan_version=0, end_s=float(k)))
               for k in range(steps)]
    change = PlanChange(start_step=1, kind="retune", reason="r", change_s=0.1, moved_bytes=0.0,
                        predicted_current_s=0.2, predicted_new_s=0.1)
    return train_result(records, job="j", plan=PLAN, plan_digest="abc", start_step=0, steps=steps, sync="none",
                        emulation=INFO, run_dir=run_dir,
                        adapter=AdapterRun(adapt=True, devices=("cloud0:0", "cloud0:1", "edge0:0"),
                                           plans=(PLAN, PLAN), changes=(change,)))


def test_result_round_trips_through_its_files(tmp_path) -> None:
    res = _adaptive_result(str(tmp_path))
    assert res.losses == (6.0, 5.0, 4.0) and res.median_step_s == 0.5 and res.samples_per_s == 16.0
    (tmp_path / "result.json").write_text(json.dumps(res.to_dict()))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m.to_dict()) + "\n" for m in res.metrics))
    assert TrainResult.from_run_dir(tmp_path) == res
    d = res.to_dict()
    assert d["format"] == "deepcee.train-result" and d["schema_version"] == 1 and "metrics" not in d
    assert d["adapter"]["changes"][0]["kind"] == "retune" and d["mode"] == "emulated"


def test_a_resumed_runs_result_holds_its_own_steps(tmp_path) -> None:
    earlier = _adaptive_result(str(tmp_path), steps=4)  # a run that crashed after writing 4 lines
    res = _adaptive_result(str(tmp_path), steps=2)
    (tmp_path / "result.json").write_text(json.dumps(res.to_dict()))
    lines = [*earlier.metrics, *res.metrics]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m.to_dict()) + "\n" for m in lines))
    assert TrainResult.from_run_dir(tmp_path).metrics == res.metrics


def test_job_takes_objects_not_dicts(tmp_path) -> None:
    cluster = load_scenario("local-small")
    cfg = TrainConfig(steps=1)
    job = Job(name="j", plan=PLAN, cluster=cluster, model="gpt-tiny", config=cfg, run_dir=str(tmp_path))
    assert job.rank_devices() == ("cloud0:0", "cloud0:1", "edge0:0")
    with pytest.raises(SpecError, match="plan must be a deepcee.plan.Plan"):
        Job(name="j", plan=PLAN.to_dict(), cluster=cluster, model="gpt-tiny", config=cfg, run_dir=str(tmp_path))
    with pytest.raises(SpecError, match="cluster must be"):
        Job(name="j", plan=PLAN, cluster=cluster.to_dict(), model="gpt-tiny", config=cfg, run_dir=str(tmp_path))


def test_peak_memory_per_rank_travels_in_the_step_records(tmp_path) -> None:
    ranks = [RankMetrics(rank=r, stage=0, device=d, loss=0.0, compute_s=1.0, cpu_s=0.5, wait_s=0.0, sync_s=0.0,
                         peak_in_flight=1, bytes_sent={}, peak_memory_bytes=b)
             for r, (d, b) in enumerate((("cloud0:0", 3e8), ("cloud0:1", 0.0)))]
    recs = [step_metrics(k, ranks, 1.0, global_batch=8, emulation=INFO) for k in range(2)]
    assert recs[0].peak_memory_bytes == {"cloud0:0": 3e8}  # 0: not measured (no /proc), left out
    assert StepMetrics.from_dict(json.loads(json.dumps(recs[0].to_dict()))) == recs[0]
    res = train_result(recs, job="j", plan=PLAN, plan_digest="a", start_step=0, steps=2, sync="none", emulation=INFO,
                       run_dir=str(tmp_path))
    assert res.peak_memory_bytes == {"cloud0:0": 3e8}


def test_peak_memory_of_this_process_resets_and_grows() -> None:
    from deepcee.runtime import peak_memory

    if peak_memory.resident_bytes() == 0:
        pytest.skip("no /proc/self/status here")
    import mmap

    peak_memory.reset_peak()
    before = peak_memory.peak_bytes()
    # fresh pages, each written once: a bytearray may come from heap memory the allocator
    # already holds resident (freed by earlier tests in this process), and the peak not move
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    assert peak_memory.peak_bytes() >= before + 60 * 2**20
    block.close()
    peak_memory.reset_peak()
    assert peak_memory.peak_bytes() < before + 32 * 2**20
