"""The local launcher's supervision with real processes: the first failure is named (even one
without an error record), a hang past the deadline is killed, and killing the supervisor
itself (SIGKILL, no clean-up code runs) leaves no rank behind.

Ranks run standard-library targets (``_rank_targets``), so each starts in a fraction of a
second; every test is bounded by the launch's deadline and its own waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _rank_targets import abort_then_fail_target, aborts_at_exit_target, failing_target, pid_sleeping_target, wait_for

from deepcee.errors import RuntimeSetupError
from deepcee.runtime.launch import launch

pytestmark = pytest.mark.dist


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_dead(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after up to ``timeout_s``."""
    t_end = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < t_end:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def rank_pids(out: Path, world_size: int, timeout_s: float) -> list[int]:
    for r in range(world_size):
        wait_for(out / f"pid-rank{r}", timeout_s)
    return [int((out / f"pid-rank{r}").read_text()) for r in range(world_size)]


def test_failing_rank_is_raised_as_its_own_class_and_the_others_are_stopped():
    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"^rank 1: stage 1 found no weights$"):
        launch(failing_target, (), world_size=2, deadline_s=60, grace_s=0.5)
    assert time.monotonic() - t0 < 30  # rank 0 would sleep 30 s: it was killed after the grace


def test_the_first_failure_is_named_even_without_an_error_record(tmp_path):
    """Rank 1 aborts (no record), rank 0 then raises: the error names rank 1, not the later record."""
    with pytest.raises(RuntimeSetupError, match=r"^rank 1 exited abnormally with code -6 and no error record "
                                                r"\(killed by a signal\?\) \(1 other rank\(s\) failed after it\)"):
        launch(abort_then_fail_target, (str(tmp_path),), world_size=2, deadline_s=60, grace_s=5)


def test_a_rank_whose_target_returned_is_not_failed_by_an_abort_at_interpreter_exit(tmp_path):
    """The children leave with ``os._exit(0)`` once the target returns (supervise.leave_after_success):
    an abort in exit-time clean-up (seen from native destructors of gloo's threads, exit -6) does
    not turn a run that succeeded into a failure."""
    launch(aborts_at_exit_target, (str(tmp_path),), world_size=2, deadline_s=60, grace_s=0.5)
    assert [(tmp_path / f"done-rank{r}").read_text() for r in range(2)] == ["ok", "ok"]


def test_hang_past_the_deadline_is_killed(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"launch deadline of 4 s passed; ranks \[0, 1\] still running$"):
        launch(pid_sleeping_target, (str(tmp_path), 120.0), world_size=2, deadline_s=4)
    assert time.monotonic() - t0 < 20
    assert wait_dead(rank_pids(tmp_path, 2, 1), 5) == []


_PARENT = """
import sys
from _rank_targets import pid_sleeping_target
from deepcee.runtime.launch import launch
launch(pid_sleeping_target, (sys.argv[1], 120.0), world_size=2, deadline_s=120)
"""


def test_killed_supervisor_leaves_no_rank_behind(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], env=env)
    pids: list[int] = []
    try:
        pids = rank_pids(tmp_path, 2, 60)
        assert all(alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)  # no clean-up code of the supervisor runs
        parent.wait(timeout=10)
        left = wait_dead(pids, 10)
        print(json.dumps({"ranks": pids, "left": left}))
        assert left == [], f"ranks {left} outlived their supervisor"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
