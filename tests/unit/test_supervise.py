"""The supervisor's rules with stand-in workers (no processes): which failure is first, the
grace period, the deadline, an aborting check; every worker is dead when it returns."""

from __future__ import annotations

import json
import time

import pytest

from deepcee.errors import PlanError, RuntimeSetupError
from deepcee.runtime.supervise import first_error, supervise, write_error


class FakeWorker:
    """Exits with ``code`` ``after_s`` seconds after creation (never, when ``after_s`` is None)."""

    def __init__(self, after_s: float | None, code: int = 0) -> None:
        self.t_exit = None if after_s is None else time.monotonic() + after_s
        self.code, self.killed, self.pid = code, False, 0

    def poll(self) -> int | None:
        if self.killed:
            return -9
        return self.code if self.t_exit is not None and time.monotonic() >= self.t_exit else None

    def kill(self) -> None:
        if self.poll() is None:
            self.killed = True

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()


def record(tmp_path, rank: int, exc: BaseException, at: float) -> None:
    """The record a rank writes, stamped at wall time ``at``."""
    write_error(tmp_path, rank, exc)
    path = tmp_path / f"error-rank{rank}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "time": at}))


def test_first_error_is_the_earliest_record_or_silent_exit(tmp_path):
    assert first_error(tmp_path) is None
    record(tmp_path, 0, PlanError("bad plan"), at=200.0)
    record(tmp_path, 2, ValueError("later"), at=300.0)
    err = first_error(tmp_path)
    assert isinstance(err, PlanError) and str(err) == "rank 0: bad plan (1 other rank(s) failed after it)"
    # rank 1 died by a signal before rank 0's record: it is the first failure
    err = first_error(tmp_path, {1: (100.0, -6), 0: (201.0, 1)}, explain=lambda r: f"; see log {r}")
    assert isinstance(err, RuntimeSetupError)
    assert str(err) == ("rank 1 exited abnormally with code -6 and no error record (killed by a signal?) "
                        "(2 other rank(s) failed after it); see log 1")
    # a rank's exit after its own record does not count twice; a non-domain record keeps its traceback
    err = first_error(tmp_path, {2: (50.0, 1)})
    assert str(err).startswith("rank 0: bad plan (1 other")
    (tmp_path / "error-rank0.json").unlink()
    assert str(first_error(tmp_path)).startswith("rank 2 failed: ValueError: later\n")


def test_all_succeed(tmp_path):
    workers = [FakeWorker(0.05), FakeWorker(0.1)]
    supervise(workers, tmp_path, deadline_s=5)
    assert [w.poll() for w in workers] == [0, 0] and not any(w.killed for w in workers)


def test_a_failure_stops_the_others_after_the_grace(tmp_path):
    workers = [FakeWorker(None), FakeWorker(0.05, code=-11), FakeWorker(None)]
    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"^rank 1 exited abnormally with code -11 "):
        supervise(workers, tmp_path, deadline_s=30, grace_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert workers[0].killed and workers[2].killed


def test_the_deadline_names_the_ranks_still_running(tmp_path):
    workers = [FakeWorker(0.01), FakeWorker(None), FakeWorker(None)]
    t0 = time.monotonic()
    with pytest.raises(RuntimeSetupError, match=r"^relay-test deadline of 0.3 s passed; ranks \[1, 2\] still running$"):
        supervise(workers, tmp_path, deadline_s=0.3, label="relay-test")
    assert time.monotonic() - t0 < 5
    assert workers[1].killed and workers[2].killed


def test_a_failing_check_aborts_and_kills(tmp_path):
    workers = [FakeWorker(None), FakeWorker(None)]

    def check() -> None:
        raise RuntimeSetupError("relay exited")

    with pytest.raises(RuntimeSetupError, match="relay exited"):
        supervise(workers, tmp_path, deadline_s=30, check=check)
    assert all(w.killed for w in workers)
