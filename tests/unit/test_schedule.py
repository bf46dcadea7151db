"""Schedule builders and passes: grammar, validation grid, deadlocks, dry-run closed forms."""

from __future__ import annotations

import pytest

from deepcee.errors import ScheduleError
from deepcee.schedule.builders import BUILDERS, build_schedule, split_backward
from deepcee.schedule.ir import Action, ActionKind, parse_action, parse_schedule
from deepcee.schedule.passes import (
    compute_only,
    dry_run,
    format_table,
    in_flight_per_stage,
    lower,
    lower_validated,
    validate,
)

K = ActionKind
NAMES = sorted(BUILDERS)


def unit_run(schedule, f=1.0, i=1.0, w=1.0, comm=(0.0, 0.0)):
    return dry_run(schedule, forward_s=f, input_grad_s=i, weight_grad_s=w, comm_forward=comm, comm_backward=comm)


@pytest.mark.parametrize("name", NAMES)
def test_every_action_round_trips_through_its_string(name):
    for stages in (1, 2, 3, 5):
        for microbatches in (1, 2, 4, 7):
            for row in lower(build_schedule(name, stages, microbatches)):
                for a in row:
                    assert parse_action(str(a)) == a


@pytest.mark.parametrize("name", NAMES)
def test_validate_accepts_every_builder_over_a_grid(name):
    for stages in range(1, 9):
        for microbatches in range(1, 13):
            sched = build_schedule(name, stages, microbatches)
            assert len(sched) == stages
            validate(sched)
            validate(lower(sched))
            assert compute_only(lower(sched)) == sched
    for stages, microbatches in ((16, 33), (23, 64), (32, 97)):  # the planner's larger shapes
        validate(build_schedule(name, stages, microbatches))


def test_unknown_schedule_and_bad_sizes_raise():
    with pytest.raises(ScheduleError, match="unknown schedule 'zb-x'"):
        build_schedule("zb-x", 2, 2)
    with pytest.raises(ScheduleError, match="build_compact"):
        build_schedule("compact", 2, 2)
    with pytest.raises(ScheduleError, match="num_microbatches must be an integer >= 1, got 0"):
        build_schedule("1f1b", 2, 0)


def test_lower_takes_compute_actions_only():
    with pytest.raises(ScheduleError, match=r"lower\(\) takes compute actions only, got 1SEND_B0 at stage 1"):
        lower(parse_schedule(["0F0 0B0", "1F0 1B0 1SEND_B0"]))
    sched = lower(build_schedule("1f1b", 3, 2))
    assert lower_validated(sched) == sched == lower_validated(compute_only(sched))


def test_deadlock_is_detected_with_a_marked_table():
    # Stage 1 runs microbatch 1 first; stage 0 only sends F1 after I0, which needs stage 1's I0.
    broken = parse_schedule(["0F0 0I0 0W0 0F1 0I1 0W1", "1F1 1I1 1W1 1F0 1I0 1W0"])
    with pytest.raises(ScheduleError, match="deadlocks") as err:
        validate(broken)
    text = str(err.value)
    assert "stage 0 at 0RECV_B0" in text and "stage 1 at 1RECV_F1" in text
    assert "*0RECV_B0*" in text and "*1RECV_F1*" in text
    with pytest.raises(ScheduleError, match="deadlocks"):
        unit_run(broken)


@pytest.mark.parametrize(
    ("rows", "message", "marked"),
    [
        (["0F0 0W0 0I0"], r"0W0 \(step 1\) comes before 0I0 \(step 2\)", "*0W0*"),
        (["0I0 0F0 0W0"], r"0I0 \(step 0\) comes before its forward 0F0", "*0I0*"),
        (["0F0 0I0"], "microbatch 0 has no W", "*0I0*"),
        (["0F0 0B0 0I0 0W0"], "both a full backward 0B0 and a split one", "*0B0*"),
        (["0F0 0F0 0B0"], "0F0 appears twice", "*0F0*"),
        (["0F0 0B0 0F2 0B2"], "no 0F1", None),
        (["0F0 0B0", "0F0 0B0"], "stage 1, step 0: 0F0 belongs to stage 0", "*0F0*"),
        (["0SEND_F0 0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], "expected 0F0, got 0SEND_F0", "*0SEND_F0*"),
    ],
)
def test_validate_names_and_marks_the_failing_action(rows, message, marked):
    with pytest.raises(ScheduleError, match=message) as err:
        validate(parse_schedule(rows))
    if marked:
        assert marked in str(err.value)


def test_in_flight_counts():
    for stages in range(1, 9):
        for microbatches in range(1, 13):
            one_f_one_b = in_flight_per_stage(build_schedule("1f1b", stages, microbatches))
            assert one_f_one_b == tuple(min(stages - s, microbatches) for s in range(stages))
            assert in_flight_per_stage(build_schedule("zb-h1", stages, microbatches)) == one_f_one_b
            assert in_flight_per_stage(build_schedule("gpipe", stages, microbatches)) == (microbatches,) * stages
            assert in_flight_per_stage(build_schedule("zb-h2", stages, microbatches)) == tuple(
                min(2 * (stages - s) - 1, microbatches) for s in range(stages))


@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 3.0)])
def test_closed_forms_with_uniform_stages_and_no_communication(f, i, w):
    for stages in range(1, 7):
        for microbatches in range(1, 10):
            span = {n: unit_run(build_schedule(n, stages, microbatches), f, i, w).makespan_s for n in NAMES}
            full = (microbatches + stages - 1) * (f + i + w)
            assert span["gpipe"] == pytest.approx(full)
            assert span["1f1b"] == pytest.approx(full)
            # The split backward takes W off the backward chain: (S-1) x W less.
            split = microbatches * (f + i + w) + (stages - 1) * (f + i)
            assert span["zb-h1"] == pytest.approx(split)
            # With no latency to hide, ZB-H2's extra warm-up forwards move idle time from the
            # warm-up to the drain (the last stage, 1 in flight, paces everything).
            assert span["zb-h2"] == pytest.approx(split)


def test_zb_h1_bubble_is_smaller_than_1f1b():
    for stages in range(2, 9):
        for microbatches in range(stages, 13):
            zb = unit_run(build_schedule("zb-h1", stages, microbatches))
            base = unit_run(build_schedule("1f1b", stages, microbatches))
            assert zb.bubble_fraction < base.bubble_fraction
            # 1F1B (B = 2): bubble (S-1)(F+B) of each stage's (M+S-1)(F+B).
            assert base.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_zb_h2_hides_latency_that_zb_h1_exposes():
    sched = {n: build_schedule(n, 4, 12) for n in ("zb-h1", "zb-h2")}
    spans = {n: unit_run(s, comm=(2.0, 0.2)).makespan_s for n, s in sched.items()}
    assert spans["zb-h2"] < 0.75 * spans["zb-h1"]


def test_dry_run_link_model_is_fifo_with_latency_after_serialisation():
    # Two forwards leave stage 0 at t=1 and t=2; the link serialises each for 3 s, then 0.5 s
    # of latency: deliveries at 1+3+0.5 = 4.5 and max(2, 4)+3+0.5 = 7.5.
    sched = build_schedule("gpipe", 2, 2)
    run = dry_run(sched, forward_s=[1.0, 1.0], input_grad_s=[1.0, 1.0], weight_grad_s=[0.0, 0.0],
                  comm_forward=[(0.5, 3.0)], comm_backward=[(0.25, 0.0)])
    assert run.delivered_s[Action(0, K.SEND_F, 0)] == pytest.approx(4.5)
    assert run.delivered_s[Action(0, K.SEND_F, 1)] == pytest.approx(7.5)
    assert run.start_s[Action(1, K.F, 0)] == pytest.approx(4.5)
    assert run.start_s[Action(1, K.F, 1)] == pytest.approx(7.5)
    # Stage 1: B0 [8.5, 9.5], B1 [9.5, 10.5]; gradients reach stage 0 at 9.75 and 10.75.
    assert run.start_s[Action(0, K.B, 0)] == pytest.approx(9.75)
    assert run.makespan_s == pytest.approx(11.75)
    assert run.busy_s == (pytest.approx(4.0), pytest.approx(4.0))
    assert run.bubble_fraction == pytest.approx(1 - 8.0 / (2 * 11.75))
    # SEND does not block: stage 0 starts F1 right after F0.
    assert run.start_s[Action(0, K.F, 1)] == pytest.approx(1.0)


def test_dry_run_rejects_bad_costs():
    sched = build_schedule("1f1b", 3, 4)
    with pytest.raises(ScheduleError, match="forward_s: need 3 per-stage values, got 2"):
        dry_run(sched, forward_s=[1, 1], input_grad_s=1, weight_grad_s=1)
    with pytest.raises(ScheduleError, match=r"input_grad_s\[1\] must be a finite number >= 0, got -1"):
        dry_run(sched, forward_s=1, input_grad_s=[1, -1, 1], weight_grad_s=1)
    with pytest.raises(ScheduleError, match="comm_backward: need 2"):
        dry_run(sched, forward_s=1, input_grad_s=1, weight_grad_s=1, comm_backward=[(0, 0)])


def test_split_backward_keeps_order_and_memory():
    sched = build_schedule("1f1b", 3, 5)
    split = split_backward(sched)
    assert in_flight_per_stage(split) == in_flight_per_stage(sched)
    assert [a for a in split[0] if a.kind != K.W] == [
        Action(0, K.I, a.microbatch) if a.kind == K.B else a for a in sched[0]]


def test_format_table_step_and_time_views():
    sched = build_schedule("zb-h1", 2, 2)
    text = format_table(sched)
    assert text.splitlines()[1].split() == ["stage", "0", "0F0", "0F1", "0I0", "0W0", "0I1", "0W1"]
    assert text.splitlines()[2].split() == ["stage", "1", "1F0", "1I0", "1W0", "1F1", "1I1", "1W1"]
    timed = format_table(sched, timing=unit_run(sched)).splitlines()
    # Stage 0 idles at t=2 waiting for the gradient of microbatch 0 (its I arrives at 3).
    assert timed[1].split() == ["stage", "0", "0F0", "0F1", ".", "0I0", "0W0", ".", "0I1", "0W1"]
    assert timed[2].split() == ["stage", "1", ".", "1F0", "1I0", "1W0", "1F1", "1I1", "1W1", "."]
    assert "makespan = 8 s" in timed[-1]
