"""The dispatch loop with stand-ins (no process group): action order, mailbox rules, and an
in-process pipeline (one thread per stage, queues for links) that matches the reference."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from deepcee import nets
from deepcee.errors import ScheduleError
from deepcee.plan import Plan, StagePlan
from deepcee.runtime.data import dataset_for
from deepcee.runtime.emulation import DevicePacer
from deepcee.runtime.executor import Feeds, run_step
from deepcee.runtime.stage import StageRunner
from deepcee.schedule.ir import parse_schedule
from deepcee.schedule.passes import lower
from deepcee.schedule.program import lowered_schedule

torch.set_num_threads(1)


class FakeStage:
    def __init__(self):
        self.calls = []

    def forward(self, m, x, targets=None, loss_scale=1.0):
        self.calls.append(("F", m, float(x.sum())))
        return torch.tensor(float(loss_scale)) if targets is not None else x + 1

    def backward_input(self, m, g=None):
        self.calls.append(("I", m))
        return torch.full((2,), 10.0 + m)

    def backward_weight(self, m):
        self.calls.append(("W", m))

    def backward(self, m, g=None):
        self.calls.append(("B", m))
        return torch.full((2,), 20.0 + m)


class FakeTransport:
    def __init__(self):
        self.log = []

    def begin_step(self, actions):
        self.log.append(("begin", len(actions)))

    def recv_forward(self, m):
        self.log.append(("recv_f", m))
        return torch.full((2,), float(m))

    def recv_backward(self, m):
        self.log.append(("recv_b", m))
        return torch.ones(2)

    def send_forward(self, m, t):
        self.log.append(("send_f", m, t.tolist()))

    def send_backward(self, m, t):
        self.log.append(("send_b", m, t.tolist()))

    def end_step(self):
        self.log.append(("end",))


def test_middle_stage_runs_its_lowered_row_in_order():
    sched = lower(parse_schedule(["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1F1 1I1 1W0 1W1",
                                  "2F0 2B0 2F1 2B1"]))
    stage, tr = FakeStage(), FakeTransport()
    rec = run_step(sched[1], stage, tr, Feeds(), DevicePacer(slowdown=1, dilation=1, enabled=False))
    assert [c[:2] for c in stage.calls] == [("F", 0), ("I", 0), ("F", 1), ("I", 1), ("W", 0), ("W", 1)]
    assert tr.log[0] == ("begin", len(sched[1])) and tr.log[-1] == ("end",)
    assert ("send_f", 1, [2.0, 2.0]) in tr.log  # F output (x + 1) of microbatch 1 is what is sent
    assert ("send_b", 0, [10.0, 10.0]) in tr.log  # I's input gradient goes back
    assert tr.log.index(("recv_b", 0)) < tr.log.index(("send_b", 0, [10.0, 10.0]))
    assert rec.actions == len(sched[1])


def test_last_stage_sums_weighted_losses_and_first_stage_reads_feeds():
    sched = lower(parse_schedule(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]))
    last = FakeStage()
    rec = run_step(sched[1], last, FakeTransport(),
                   Feeds(targets=lambda m: torch.zeros(2), loss_scale=0.25),
                   DevicePacer(slowdown=1, dilation=1, enabled=False))
    assert rec.loss == pytest.approx(0.5)
    first, tr = FakeStage(), FakeTransport()
    run_step(sched[0], first, tr, Feeds(inputs=lambda m: torch.full((2,), 100.0 * m)),
             DevicePacer(slowdown=1, dilation=1, enabled=False))
    assert [c[2] for c in first.calls if c[0] == "F"] == [0.0, 200.0]
    assert not any(e[0] in ("recv_f", "send_b") for e in tr.log)


def test_row_without_matching_send_is_reported():
    row = lower(parse_schedule(["0F0 0B0", "1F0 1B0", "2F0 2B0"]))[1]
    without_send = tuple(a for a in row if a.kind.value != "SEND_F")
    with pytest.raises(ScheduleError, match=r"unused \{'outputs': \[0\]\}"):
        run_step(without_send, FakeStage(), FakeTransport(), Feeds(), DevicePacer(slowdown=1, dilation=1, enabled=False))


def _plan(schedule, m, actions=()):
    return Plan(system="t", cluster="c", model="gpt-tiny", global_batch=2 * m, microbatch_size=2,
                num_microbatches=m, schedule=schedule, actions=actions,
                stages=(StagePlan(layer_start=0, layer_stop=2, devices=("a",), shares=(2,)),
                        StagePlan(layer_start=2, layer_stop=4, devices=("b",), shares=(2,)),
                        StagePlan(layer_start=4, layer_stop=6, devices=("c",), shares=(2,))))


class QueueTransport:
    """Links as queues between threads: stage s -> s+1 activations, s+1 -> s gradients."""

    def __init__(self, stage, links):
        self.stage, self.links = stage, links

    def begin_step(self, actions):
        pass

    def recv_forward(self, m):
        return self.links[(self.stage - 1, self.stage, m)].get(timeout=30)

    def recv_backward(self, m):
        return self.links[(self.stage + 1, self.stage, m)].get(timeout=30)

    def send_forward(self, m, t):
        self.links[(self.stage, self.stage + 1, m)].put(t.clone())

    def send_backward(self, m, t):
        self.links[(self.stage, self.stage - 1, m)].put(t.clone())

    def end_step(self):
        pass


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_threaded_pipeline_matches_reference(schedule):
    m = 3
    plan = _plan(schedule, m)
    lowered = lowered_schedule(plan)
    blocks, loss_fn = nets.build("gpt-tiny", seed=1, dtype=torch.float64)
    batch = dataset_for("gpt-tiny").batch(0, plan.global_batch)
    links = {k: queue.Queue() for s in range(3) for k in ((s, s + 1, i) for i in range(m))}
    links.update({(s + 1, s, i): queue.Queue() for s in range(2) for i in range(m)})
    stages, records, errors = [], {}, []
    for s, st in enumerate(plan.stages):
        stages.append(StageRunner(blocks[st.layer_start:st.layer_stop], stage=s, is_first=s == 0, is_last=s == 2,
                                  loss_fn=loss_fn, dtype=torch.float64))

    def run(s):
        try:
            feeds = Feeds(inputs=(lambda i: batch.inputs[2 * i:2 * i + 2]) if s == 0 else None,
                          targets=(lambda i: batch.targets[2 * i:2 * i + 2]) if s == 2 else None,
                          loss_scale=2 / plan.global_batch)
            records[s] = run_step(lowered[s], stages[s], QueueTransport(s, links), feeds,
                                  DevicePacer(slowdown=1, dilation=1, enabled=False))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    ref_blocks, _ = nets.build("gpt-tiny", seed=1, dtype=torch.float64)
    x = batch.inputs
    for b in ref_blocks:
        x = b(x)
    loss = loss_fn(x, batch.targets)
    loss.backward()
    assert records[2].loss == pytest.approx(loss.item(), rel=1e-12)
    got = [p.grad for st in stages for p in st.module.parameters()]
    want = [p.grad for b in ref_blocks for p in b.parameters()]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
