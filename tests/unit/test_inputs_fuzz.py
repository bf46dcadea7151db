"""Fuzz suite: every reader and CLI number, through the real entry points, under a time limit.

The cases (``fuzz_cases.py``, deterministic) mutate files deepcee ships or writes and the
command-line numbers of every sub-command. A bad case must end with exit code 2, exactly one
line on stderr naming the file (when there is one) and the field, no traceback, within
:data:`LIMIT_S`, and leave no output file; a valid mutation must be accepted (exit code 0).
Entry points: ``deepcee.cli.main(argv)`` and ``deepcee.train.main(argv)`` in-process, the
device-probe reader, and ``python -m deepcee.cli`` / ``python -m deepcee.train`` in a
subprocess for a few.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from fuzz_cases import Case, Ctx, all_cases, load_static_bases

from deepcee import cli, train
from deepcee.errors import DeepceeError

CASES = all_cases()
LIMIT_S = 20.0
"""Per in-process case; the slowest valid case (a planner run) takes about 1 s."""
SUBPROCESS_LIMIT_S = 60.0


class Hang(BaseException):
    """Raised by the timer: a case ran past :data:`LIMIT_S` (BaseException: no handler in the
    code under test swallows it)."""


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = load_static_bases()
    plan = tmp_path_factory.mktemp("fuzz-bases") / "plan.json"
    plan.write_text(json.dumps(out["plan"]))
    out["plan_path"] = str(plan)
    tiny = plan.with_name("tiny-plan.json")
    tiny.write_text(json.dumps(out["tiny_plan"]))
    out["tiny_plan_path"] = str(tiny)
    return out


def _probe_main(argv: list[str]) -> int:
    """The profiler's reader of a rank's device-probe record, as a command."""
    from deepcee.profiler.probes import load_probe

    try:
        load_probe(argv[0])
    except DeepceeError as exc:
        print(f"probe: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


def _alarm(signum: int, frame: object) -> None:
    raise Hang(f"still running after {LIMIT_S} s")


def run_in_process(entry: str, argv: list[str]) -> int:
    main = {"cli": cli.main, "train": train.main, "probe": _probe_main}[entry]
    handlers, level = logging.root.handlers[:], logging.root.level
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    try:
        return main(argv)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        logging.root.handlers[:], logging.root.level = handlers, level  # `train` configures logging


def run_subprocess(entry: str, argv: list[str]) -> tuple[int, str]:
    module = "deepcee.train" if entry == "subprocess-train" else "deepcee.cli"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          timeout=SUBPROCESS_LIMIT_S, env=env)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(case: Case, bases: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # default outputs (plan.json, compare.json) land here
    entry, argv, needles = case.build(Ctx(tmp=tmp_path, bases=bases))
    t0 = time.monotonic()
    if entry.startswith("subprocess"):
        rc, err = run_subprocess(entry, argv)
    else:
        rc = run_in_process(entry, argv)
        err = capsys.readouterr().err
    took = time.monotonic() - t0
    # a needle must be in the message itself, not only in the folder name pytest made for the case
    lines = [line.replace(str(tmp_path), "<tmp>") for line in err.splitlines() if line.strip()]
    needles = tuple(n.replace(str(tmp_path), "<tmp>") for n in needles)
    if case.accept:
        assert rc == 0, f"valid input refused ({took:.1f} s): {err}"
        return
    assert "Traceback" not in err, err
    assert rc == 2, f"exit code {rc}, stderr: {err}"
    assert len(lines) == 1, f"{len(lines)} lines on stderr: {err}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in: {lines[0]}"
    assert not (tmp_path / "out.json").exists(), "a refused command wrote its output"


def test_enough_cases_in_every_family() -> None:
    by_family = Counter(c.family.removesuffix("-random") for c in CASES if not c.accept)
    assert sum(by_family.values()) >= 300
    for family in ("cluster-toml", "cluster-json", "plan", "profile", "probe", "trace", "model-spec", "cli-numbers",
                   "job-config", "efficiency", "subprocess"):
        assert by_family[family] >= 6, by_family
    assert sum(c.accept for c in CASES) >= 10
