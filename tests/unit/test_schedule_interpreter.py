"""The one timing interpreter: free run vs time order, stage tables, deadlocks."""

from __future__ import annotations

import random

import pytest

from deepcee.errors import ScheduleError
from deepcee.schedule.builders import build_schedule
from deepcee.schedule.interpreter import Deadlock, Execution, Tables, stage_tables
from deepcee.schedule.ir import parse_schedule
from deepcee.schedule.passes import lower


def test_free_run_equals_time_order_bit_for_bit():
    # Without recording, stage tables let each stage run until it blocks; with recording the
    # interpreter keeps time order. Every finish, busy and wait time must agree exactly.
    rng = random.Random(5)
    for _ in range(300):
        s, m = rng.randint(1, 6), rng.randint(1, 7)
        rows = lower(build_schedule(rng.choice(["gpipe", "1f1b", "zb-h1", "zb-h2"]), s, m))
        f, i, w = ([rng.uniform(0.1, 2) for _ in range(s)] for _ in range(3))
        links = [(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(s - 1)]
        tables = stage_tables(rows, f, i, w, links, links[::-1])
        free, ordered = Execution(tables), Execution(tables, record=True)
        assert free.free_run and not ordered.free_run
        assert free.pipeline(0.0)[0] == ordered.pipeline(0.0)[0]
        assert (free.busy_s, free.wait_s) == (ordered.busy_s, ordered.wait_s)
        assert free.compute_s == pytest.approx(ordered.compute_s, rel=1e-12)  # summed in another order


def test_link_queues_carry_over_between_passes():
    rows = lower(build_schedule("gpipe", 2, 2))
    run = Execution(stage_tables(rows, [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [(0.0, 5.0)], [(0.0, 0.0)]))
    first = run.pipeline(0.0)[0]
    # F0 is sent at 1 and delivered at 6; F1, sent at 2, waits for the link until 6: delivered 11;
    # stage 1 runs F1 at 11 and B0, B1 until 16; stage 0 gets B0 at 14 and ends B1 at 18
    assert first == [18.0, 16.0]
    second = run.pipeline(0.0)[0]  # the link is still busy from the first pass
    assert second[1] > first[1]


def test_deadlock_names_each_stuck_action():
    rows = lower(parse_schedule(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"]))
    with pytest.raises(Deadlock, match=r"stage 0 at 0RECV_B0 \(0 of 1 pieces arrived\); stage 1 at 1RECV_F1") as err:
        Execution(stage_tables(rows, [1.0] * 2, [1.0] * 2, [1.0] * 2, [(0.0, 0.0)], [(0.0, 0.0)])).pipeline(0.0)
    assert err.value.stuck == ((0, 2), (1, 0))


def test_tables_are_checked():
    with pytest.raises(ScheduleError, match="lower"):
        stage_tables(build_schedule("1f1b", 2, 2), [1.0] * 2, [1.0] * 2, [1.0] * 2, [(0.0, 0.0)], [(0.0, 0.0)])
    rows = lower(build_schedule("1f1b", 1, 1))
    with pytest.raises(ScheduleError, match="durations has 0 entries for 1 devices"):
        Tables(rows=rows, stage_of=(0,), durations=(), pieces=((), ()), expected=((0, 0),), num_resources=0,
               names=("d",), num_microbatches=1)
