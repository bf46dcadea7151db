"""What a run leaves on disk: atomic checkpoints and per-step metrics (JSON lines).

Checkpoints: every ``N`` steps, device 0 of each stage writes
``<dir>/step-<N>/stage<s>.pt`` (model and optimizer state of the stage; the stage's devices
hold identical copies after the gradient all-reduce) to a temporary name and renames it;
after a barrier, rank 0 writes ``<dir>/latest.json`` (step, plan digest, data position) the
same way. A reader therefore sees either the previous complete checkpoint or the new one,
never a half-written one. Resuming loads ``latest.json``, checks the plan digest and
continues at the recorded step: data batches depend only on the step (see
:mod:`deepcee.runtime.data`), so the data position *is* the step.

Metrics: rank 0 appends one JSON object per step to ``metrics.jsonl``; every record carries
the emulation facts (mode, dilation, which figures are emulated) and times already divided by
the dilation.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepcee.errors import RuntimeSetupError
from deepcee.plan import save_json_atomic

LATEST = "latest.json"
FORMAT = "deepcee.checkpoint"


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """Contents of ``latest.json``."""

    step: int
    """Steps completed; training resumes with batch ``step``."""
    plan_digest: str
    num_stages: int

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "schema_version": 1, "step": self.step, "plan_digest": self.plan_digest,
                "num_stages": self.num_stages, "data_position": self.step}


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def save_stage(root: str | Path, step: int, stage: int, state: dict[str, Any]) -> Path:
    """Write one stage's state atomically (temporary file + rename)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"stage{stage}.pt"
    tmp = d / f".stage{stage}.pt.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, final)
    return final


def commit(root: str | Path, info: CheckpointInfo, keep: int = 2) -> None:
    """Publish a complete checkpoint (after every stage file is written) and prune old ones."""
    save_json_atomic(Path(root) / LATEST, info.to_dict())
    steps = sorted(int(p.name.removeprefix("step-")) for p in Path(root).glob("step-*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        if old != info.step:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)


def latest(root: str | Path) -> CheckpointInfo | None:
    p = Path(root) / LATEST
    if not p.exists():
        return None
    try:
        d = json.loads(p.read_text())
        return CheckpointInfo(step=int(d["step"]), plan_digest=d["plan_digest"], num_stages=int(d["num_stages"]))
    except (OSError, ValueError, KeyError) as exc:
        raise RuntimeSetupError(f"{p}: unreadable checkpoint record: {exc}") from None


def load_stage(root: str | Path, info: CheckpointInfo, stage: int, plan_digest: str) -> dict[str, Any]:
    if info.plan_digest != plan_digest:
        raise RuntimeSetupError(
            f"{Path(root) / LATEST}: checkpoint is for plan {info.plan_digest}, this run's plan is {plan_digest}"
        )
    path = step_dir(root, info.step) / f"stage{stage}.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except OSError as exc:
        raise RuntimeSetupError(f"{path}: cannot read checkpoint: {exc.strerror}") from None


class MetricsWriter:
    """Appends one JSON object per line; each line is flushed so a crash loses at most one step."""

    def __init__(self, path: str | Path, *, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a" if append else "w")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
