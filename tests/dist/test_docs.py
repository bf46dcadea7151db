"""The documentation's examples run as written: every Python block of ``docs/api.md``, and
``docs/walkthrough.md`` from its files and commands, in order, in a fresh folder (the plan the
walk-through quotes is the plan deepcee makes: it does not depend on the machine).

Blocks that start ranks (``if __name__ == "__main__":``: spawned ranks import the script again)
run as scripts in a subprocess; the others, and the ``deepcee`` commands (through
:func:`deepcee.cli.main`), run in this process, which has paid for ``import torch`` already.
Every subprocess and launch has a hard deadline."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from deepcee import cli

pytestmark = pytest.mark.dist

DOCS = Path(__file__).resolve().parents[2] / "docs"
DEADLINE_S = 300
HAVE_HF = importlib.util.find_spec("transformers") is not None
BLOCK = re.compile(r"(?:<!-- file: (?P<file>\S+) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```", re.S)


def blocks(doc: str) -> list[tuple[str, str | None, str]]:
    """``(language, file name or None, body)`` of every fenced block, in order."""
    return [(m["lang"], m["file"], m["body"]) for m in BLOCK.finditer((DOCS / doc).read_text())]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A fresh working folder, importable here and by spawned ranks (as a user's files would be)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def _python(body: str, folder: Path, name: str, capsys) -> str:
    """Run a Python block: as a script when it starts ranks, else in this process."""
    if '__name__ == "__main__"' not in body:
        exec(compile(body, name, "exec"), {"__name__": name})  # noqa: S102 - the documentation's own code
        return capsys.readouterr().out
    (folder / name).write_text(body)
    try:
        proc = subprocess.run([sys.executable, name], cwd=folder, capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not finish within {DEADLINE_S} s")
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _deepcee(line: str, capsys) -> str:
    args = shlex.split(line)
    assert args[0] == "deepcee", line
    capsys.readouterr()
    rc = cli.main(args[1:])
    out, err = capsys.readouterr()
    assert rc == 0, f"{line}: exit {rc}\n{out[-2000:]}\n{err[-2000:]}"
    return out


def test_api_examples_run(folder, capsys):
    python = [body for lang, _, body in blocks("api.md") if lang == "python"]
    assert len(python) >= 4
    for i, body in enumerate(python):
        if "# requires transformers" in body and not HAVE_HF:
            continue
        _python(body, folder, f"api_example_{i}.py", capsys)


def test_walkthrough_runs_as_written(folder, capsys):
    outputs: list[tuple[str, str]] = []
    texts = []
    for lang, file, body in blocks("walkthrough.md"):
        if file is not None:
            (folder / file).write_text(body)
        elif lang == "bash":
            outputs += [(line, _deepcee(line, capsys)) for line in filter(None, map(str.strip, body.splitlines()))]
        elif lang == "python":
            outputs.append(("python", _python(body, folder, f"walk_{len(outputs)}.py", capsys)))
        elif lang == "text":
            texts.append(body)
    plan_out = next(out for cmd, out in outputs if cmd.startswith("deepcee plan --cluster three-sites.toml"))
    for line in texts[0].splitlines():  # the plan the page explains is the plan deepcee makes
        assert line in plan_out.splitlines(), f"the walk-through quotes {line!r}; deepcee printed:\n{plan_out}"
    train_out = next(out for cmd, out in outputs if cmd.startswith("deepcee train"))
    assert re.search(r"^steps 10  loss 1\.3847 -> \d\.\d{4}  [\d.]+ samples/s \(emulated", train_out, re.M), train_out
    assert (folder / "measured" / "profile.json").exists() and (folder / "plan-measured.json").exists()
