"""The input layer: every file deepcee reads, and every number a user gives it, is checked here.

Torch-free. Three parts:

- :mod:`~deepcee.inputs.read`: one reader per format (:func:`read_json`, :func:`read_toml`,
  :func:`read_json_lines`, :func:`read_text`) that checks size, encoding, syntax, nesting,
  finiteness and the top-level type before a format's own code sees the content;
- :mod:`~deepcee.inputs.fields`: :class:`Fields`, the field validator every format reader
  uses (types, names, ranges, unknown keys);
- :mod:`~deepcee.inputs.limits`: every range, as :class:`Limit` objects with the reason for
  each (the table in ``docs/file-formats.md``), and the work limits (sizes that would take more
  than a minute or more memory than the machine has), with :mod:`~deepcee.inputs.work` checking
  whole jobs against them.

Every error is one line naming file, field and value (a :class:`~deepcee.errors.SpecError`
subclass chosen by the caller); the CLI prints it and exits with code 2.

Reading a new file format (for example a job config)::

    from deepcee.errors import SpecError
    from deepcee.inputs import Fields, Limit, read_toml
    from deepcee.inputs.limits import GLOBAL_BATCH

    STEPS = Limit(name="steps", lo=1, hi=10**9, integer=True, why="...")  # add it to LIMITS for the docs
    f = Fields(read_toml(path, SpecError), file=str(path), error=SpecError)  # or a SpecError subclass
    steps = f.integer("steps", STEPS, 100)                   # default 100; a bad value names file and field
    batch = f.integer("global_batch", GLOBAL_BATCH)          # required
    train = f.record_of("train", None)                       # a [train] table, or None
    f.done()                                                 # unknown keys are errors
"""

from __future__ import annotations

from deepcee.inputs.fields import MISSING, Fields, check_name, check_text
from deepcee.inputs.limits import LIMITS, Limit, show
from deepcee.inputs.read import (
    check_tree,
    decode_text,
    parse_json,
    read_bytes,
    read_json,
    read_json_lines,
    read_text,
    read_toml,
)

__all__ = [
    "LIMITS", "MISSING", "Fields", "Limit", "check_name", "check_text", "check_tree", "decode_text", "parse_json",
    "read_bytes", "read_json", "read_json_lines", "read_text", "read_toml", "show",
]
