"""Reading and writing the machine-written JSON files (torch-free).

Reads turn I/O and syntax problems into the caller's :class:`~deepcee.errors.SpecError`
subclass naming the file; writes are atomic (temp file + rename), so a reader never sees a
half-written file and a failed command leaves no partial output behind.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepcee.errors import SpecError


def read_json(path: str | Path, error: type[SpecError]) -> Any:
    """The parsed content of ``path``; unreadable or invalid files raise ``error`` naming it."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror}", file=str(p)) from None
    except json.JSONDecodeError as exc:
        raise error(f"invalid JSON: {exc}", file=str(p)) from None


def save_json_atomic(path: str | Path, data: Mapping[str, Any]) -> None:
    """Write JSON so a reader never sees a half-written file (temp file + rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(p)
