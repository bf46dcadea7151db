"""Writing the machine-written JSON files atomically (torch-free); reading is :mod:`deepcee.inputs`.

Writes are atomic (temp file + rename), so a reader never sees a half-written file and a failed
command leaves no partial output behind. :func:`read_json` is the input layer's reader
(:func:`deepcee.inputs.read_json`), re-exported here for existing callers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepcee.inputs import read_json

__all__ = ["read_json", "save_json_atomic"]


def save_json_atomic(path: str | Path, data: Mapping[str, Any]) -> None:
    """Write JSON so a reader never sees a half-written file (temp file + rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        tmp.replace(p)
    except BaseException:  # a full disk, a folder at ``path``, Ctrl-C: no partial file stays behind
        tmp.unlink(missing_ok=True)
        raise
