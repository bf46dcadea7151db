"""What a run leaves on disk: checkpoints (``torch.distributed.checkpoint``) and per-step metrics.

[Note: checkpoint layout]
A checkpoint is one folder ``<dir>/step-<N>/`` (``N`` = steps completed, 8 digits) in the
format of ``torch.distributed.checkpoint`` (DCP): ``.metadata`` and one ``__<rank>_0.distcp``
per rank, holding

- ``model/<name>``: every parameter and persistent buffer, keyed by its name in the plain
  model ([Note: state names] in :mod:`deepcee.runtime.state`), written once (by device 0 of
  the first stage that holds it);
- ``optim/<name>/<key>``: the optimizer's per-parameter state (AdamW ``exp_avg``,
  ``exp_avg_sq``, ``step``; SGD ``momentum_buffer``) under the same names.

Nothing in it depends on the plan, so any plan (another split, other devices, after a
re-plan) loads it: each rank asks DCP for the names of its own stage. The learning rate
follows the step (:mod:`deepcee.runtime.lr`) and the data position *is* the step (batches
depend only on the step, :mod:`deepcee.runtime.data`), so a checkpoint needs nothing else.

Integrity: after every rank has written, rank 0 writes ``manifest.json`` (format
``deepcee.checkpoint``, schema 2: step, plan digest, model, every file's size and SHA-256,
every tensor's names) to a temporary name and renames it. The manifest is the commit point:
a folder without one is an interrupted write and is never loaded. On resume rank 0 checks the
newest folder's files against its manifest; a missing, truncated or altered file is named and
the next older checkpoint is tried (:func:`choose`). Old checkpoints (one file per stage,
``latest.json``, schema 1) are refused with a one-line error naming the file. Folders must be on
a file system every rank sees (DCP lets any rank read any file when the split changes).

Metrics: rank 0 appends one JSON object per step to ``metrics.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepcee.errors import RuntimeSetupError
from deepcee.plan import save_json_atomic

log = logging.getLogger(__name__)

FORMAT = "deepcee.checkpoint"
SCHEMA_VERSION = 2
MANIFEST = "manifest.json"
LEGACY_LATEST = "latest.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class FileSum:
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """``manifest.json`` of one checkpoint folder. See [Note: checkpoint layout]."""

    step: int
    """Steps completed; training resumes with batch ``step``."""
    plan_digest: str
    """The plan that wrote it (any plan may read it)."""
    model: str
    dtype: str
    optimizer: str
    files: Mapping[str, FileSum]
    """File name in the folder -> size and checksum."""
    names: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Per tensor: primary name and every name (ties), in the plain model's order."""

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "step": self.step,
                "plan_digest": self.plan_digest, "model": self.model, "dtype": self.dtype,
                "optimizer": self.optimizer,
                "files": {k: {"bytes": v.bytes, "sha256": v.sha256} for k, v in sorted(self.files.items())},
                "names": [[p, list(a)] for p, a in self.names]}

    @staticmethod
    def from_dict(d: Mapping[str, Any], *, file: str) -> Manifest:
        if not isinstance(d, Mapping) or d.get("format") != FORMAT or d.get("schema_version") != SCHEMA_VERSION:
            got = (d.get("format"), d.get("schema_version")) if isinstance(d, Mapping) else type(d).__name__
            raise RuntimeSetupError(f"{file}: not a {FORMAT} schema {SCHEMA_VERSION} manifest (got {got})")
        try:
            return Manifest(step=int(d["step"]), plan_digest=str(d["plan_digest"]), model=str(d["model"]),
                            dtype=str(d["dtype"]), optimizer=str(d["optimizer"]),
                            files={k: FileSum(bytes=int(v["bytes"]), sha256=str(v["sha256"]))
                                   for k, v in d["files"].items()},
                            names=tuple((str(p), tuple(a)) for p, a in d.get("names", ())))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RuntimeSetupError(f"{file}: malformed manifest: {type(exc).__name__} {exc}") from None


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def checksum_folder(folder: Path) -> dict[str, FileSum]:
    """Every file of a written checkpoint folder but the manifest and temporary files."""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"):
            out[p.name] = FileSum(bytes=p.stat().st_size, sha256=sha256_file(p))
    return out


def commit(folder: Path, manifest: Manifest) -> None:
    """Publish a written folder: the manifest, atomically, last."""
    save_json_atomic(folder / MANIFEST, manifest.to_dict())


def prune(root: str | Path, keep: int, newest: int) -> None:
    """Keep the ``keep`` newest committed checkpoints (0: all); drop older and interrupted folders."""
    steps = _step_folders(root)
    committed = [s for s, d in steps if (d / MANIFEST).exists()]
    doomed = {s for s, d in steps if s < newest and not (d / MANIFEST).exists()}
    if keep > 0:
        doomed |= set(committed[:-keep])
    for s in sorted(doomed - {newest}):
        shutil.rmtree(step_dir(root, s), ignore_errors=True)


def _step_folders(root: str | Path) -> list[tuple[int, Path]]:
    r = Path(root)
    if not r.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in r.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(found)


# -- choosing what to resume from ---------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Skipped:
    """A checkpoint passed over on resume, and why."""

    step: int
    reason: str
    """Names the file and what is wrong with it."""
    committed: bool = True
    """``False``: no manifest (a write that never finished), not damage."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """The checkpoint a run resumes from (see :func:`choose`)."""

    folder: str
    manifest: Manifest
    skipped: tuple[Skipped, ...] = field(default_factory=tuple)
    """Newer checkpoints that were damaged or incomplete, newest first."""

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def steps_lost(self) -> int:
        """Steps the damaged newer checkpoints held beyond this one (redone by the run)."""
        return max((s.step for s in self.skipped), default=self.step) - self.step


def verify(folder: Path) -> Manifest:
    """The folder's manifest after checking every file it lists; raises naming the bad file."""
    mpath = folder / MANIFEST
    if not mpath.exists():
        raise RuntimeSetupError(f"{mpath}: missing (the write of this checkpoint did not finish)")
    try:
        raw = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RuntimeSetupError(f"{mpath}: unreadable: {str(exc)[:160]}") from None
    man = Manifest.from_dict(raw, file=str(mpath))
    for name, want in man.files.items():
        p = folder / name
        if not p.is_file():
            raise RuntimeSetupError(f"{p}: missing")
        size = p.stat().st_size
        if size != want.bytes:
            raise RuntimeSetupError(f"{p}: {size} bytes, the manifest says {want.bytes} (truncated or replaced)")
        if sha256_file(p) != want.sha256:
            raise RuntimeSetupError(f"{p}: checksum differs from the manifest (the file is corrupt)")
    return man


def choose(root: str | Path) -> Choice | None:
    """The newest intact checkpoint under ``root`` (``None``: no checkpoint at all).

    Damaged or incomplete newer ones are logged (file and reason) and recorded in the choice;
    when every checkpoint is damaged, or ``root`` holds only old-format checkpoints, raises."""
    skipped: list[Skipped] = []
    for step, folder in reversed(_step_folders(root)):
        try:
            man = verify(folder)
        except RuntimeSetupError as exc:
            committed = (folder / MANIFEST).exists()
            if committed or not _legacy_files(folder):
                skipped.append(Skipped(step=step, reason=str(exc), committed=committed))
                log.warning("checkpoint step %d skipped: %s", step, exc)
            continue
        if man.step != step:
            skipped.append(Skipped(step=step, reason=f"{folder / MANIFEST}: records step {man.step}"))
            continue
        return Choice(folder=str(folder), manifest=man, skipped=tuple(skipped))
    damaged = [s for s in skipped if s.committed]
    if damaged:
        raise RuntimeSetupError(f"{root}: no intact checkpoint to resume from; newest: {damaged[0].reason}")
    _refuse_legacy(Path(root))
    return None  # nothing committed: the run starts from step 0


def resolve(path: str | Path) -> Choice:
    """A checkpoint named by the user: a ``step-N`` folder, a checkpoint root or a run folder
    (its ``checkpoints``): the folder itself, verified, or the newest intact one under it."""
    p = Path(path)
    if (p / MANIFEST).exists() or _STEP_RE.match(p.name):
        return Choice(folder=str(p), manifest=verify(p))
    for root in (p, p / "checkpoints"):
        if _step_folders(root) or (root / LEGACY_LATEST).exists():
            found = choose(root)
            if found is not None:
                return found
    raise RuntimeSetupError(f"{p}: no checkpoint here (expected step-<N> folders with {MANIFEST})")


def _legacy_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("stage*.pt"))


def _refuse_legacy(root: Path) -> None:
    old = [root / LEGACY_LATEST] if (root / LEGACY_LATEST).exists() else []
    old += [f for _, d in _step_folders(root) for f in _legacy_files(d)]
    if old:
        raise RuntimeSetupError(f"{old[0]}: checkpoint in the old per-stage format (schema 1, keyed by one plan's "
                                f"stages); this version reads only {FORMAT} schema {SCHEMA_VERSION} folders: start "
                                "without --resume, or resume with the deepcee version that wrote it")


def clear_for_write(folder: Path) -> None:
    """Remove what an interrupted write of the same step left (rank 0, before the collective save)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)


# -- metrics --------------------------------------------------------------------------------


class MetricsWriter:
    """Appends one JSON object per line; each line is flushed so a crash loses at most one step.

    ``start_step`` given (a resumed run): lines of steps at or after it, left by the run that
    wrote the checkpoint, are dropped first, so each step appears once."""

    def __init__(self, path: str | Path, *, append: bool = False, start_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append and start_step is not None and self.path.exists():
            self._truncate(start_step)
        self._f = self.path.open("a" if append else "w")

    def _truncate(self, start_step: int) -> None:
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", -1) < start_step]
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def skipped_to_dicts(skipped: Sequence[Skipped]) -> list[dict[str, Any]]:
    return [{"step": s.step, "reason": s.reason} for s in skipped]
