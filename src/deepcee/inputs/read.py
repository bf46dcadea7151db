"""One reader per file format: bytes, text, JSON, JSON lines, TOML.

Torch-free. Every reader checks, before any format-specific code sees the content:

- the file can be read and is not larger than the format's limit (:data:`MAX_JSON_BYTES`,
  :data:`MAX_TOML_BYTES`; read at most one byte past it, so a huge file or a device is not
  slurped);
- it is UTF-8 text (a NUL byte means a binary file);
- it parses, nests at most :data:`MAX_DEPTH` deep (never a ``RecursionError``), has no
  duplicate JSON keys, and every number in it is finite (``NaN``, ``Infinity`` and ``1e999``
  are refused wherever they sit, with their path);
- its top level is what the format needs (an object for every deepcee file).

Errors are the caller's :class:`~deepcee.errors.SpecError` subclass naming the file (and the
field, where there is one), in one line. Writing stays in :mod:`deepcee.jsonio`.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from deepcee.errors import SpecError
from deepcee.inputs.limits import MAX_DEPTH, MAX_JSON_BYTES, MAX_TOML_BYTES, show


def read_bytes(path: str | Path, error: type[SpecError], *, max_bytes: int, what: str = "file") -> bytes:
    """The content of ``path``: at most ``max_bytes`` (a larger file is an error naming the limit)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read: {exc.strerror or exc}", file=str(p)) from None
    if len(data) > max_bytes:
        limit = f"{max_bytes / 2**20:g} MiB" if max_bytes >= 2**20 else f"{max_bytes:,} bytes"
        raise error(f"{what} larger than the limit of {limit}", file=str(p))
    return data


def decode_text(data: bytes, error: type[SpecError], *, file: str | None) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark is dropped); binary or other encodings refused."""
    for bom, name in ((b"\xff\xfe\0\0", "UTF-32"), (b"\0\0\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                      (b"\xfe\xff", "UTF-16")):
        if data.startswith(bom):
            raise error(f"not UTF-8 text but {name} (byte-order mark {bom.hex()}): save it as UTF-8", file=file)
    nul = data.find(b"\0")
    if nul >= 0:
        raise error(f"binary file (a NUL byte at offset {nul}), expected UTF-8 text", file=file)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start}", file=file) from None
    return text.removeprefix("\ufeff")


def read_text(path: str | Path, error: type[SpecError], *, max_bytes: int = MAX_JSON_BYTES,
              what: str = "file") -> str:
    return decode_text(read_bytes(path, error, max_bytes=max_bytes, what=what), error, file=str(path))


def read_json(path: str | Path, error: type[SpecError], *, expect: type = dict,
              max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The parsed JSON file at ``path``, checked as the module docstring says."""
    text = read_text(path, error, max_bytes=max_bytes, what="JSON file")
    return parse_json(text, error, file=str(path), expect=expect)


def parse_json(text: str, error: type[SpecError], *, file: str | None, expect: type = dict,
               field: str | None = None) -> Any:
    """``text`` parsed as JSON, checked as the module docstring says (``field``: where it sits)."""
    if not text.strip():
        raise error(f"empty, expected a JSON {_TYPE_WORD.get(expect, 'value')}", file=file, field=field)
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise error(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", file=file,
                    field=field) from None
    except RecursionError:
        raise error(f"nested deeper than {MAX_DEPTH} levels", file=file, field=field) from None
    except ValueError as exc:  # a duplicate key, or an integer of thousands of digits
        why = "a number of more than 4,300 digits" if "digits" in str(exc) else str(exc)
        raise error(f"invalid JSON: {why}", file=file, field=field) from None
    check_tree(value, error, file=file, root=field or "")
    if not isinstance(value, expect):
        raise error(f"expected a JSON {_TYPE_WORD.get(expect, expect.__name__)} at the top level, got "
                    f"{_TYPE_WORD.get(type(value), type(value).__name__)} {json.dumps(value)[:40]}", file=file,
                    field=field)
    return value


def read_json_lines(path: str | Path, error: type[SpecError], *, max_bytes: int = MAX_JSON_BYTES) -> list[dict]:
    """Every non-empty line of a JSON-lines file, each an object; errors name ``line N``."""
    text = read_text(path, error, max_bytes=max_bytes, what="JSON-lines file")
    return [parse_json(line, error, file=str(path), field=f"line {n}")
            for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def read_toml(path: str | Path, error: type[SpecError], *, max_bytes: int = MAX_TOML_BYTES) -> dict[str, Any]:
    """The parsed TOML file at ``path``, checked as the module docstring says."""
    text = read_text(path, error, max_bytes=max_bytes, what="TOML file")
    try:
        value = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"invalid TOML: {exc}", file=str(path)) from None
    except RecursionError:
        raise error(f"nested deeper than {MAX_DEPTH} levels", file=str(path)) from None
    check_tree(value, error, file=str(path))
    return value


def check_tree(value: Any, error: type[SpecError], *, file: str | None, root: str = "") -> None:
    """Every number in ``value`` finite, every string valid Unicode, nesting at most :data:`MAX_DEPTH`.

    Iterative (an explicit stack), so no input can exhaust Python's recursion."""
    stack: list[tuple[Any, str, int]] = [(value, root, 0)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise error(f"must be a finite number, got {v!r}", file=file, field=where or None)
        if isinstance(v, str):
            _check_unicode(v, error, file, where)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise error(f"nested deeper than {MAX_DEPTH} levels", file=file, field=where or None)
            if isinstance(v, dict):
                for k, x in v.items():
                    _check_unicode(k, error, file, where)
                    stack.append((x, f"{where}.{k}" if where else str(k), depth + 1))
            elif not _finite_numbers(v):
                stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))


def _finite_numbers(values: list[Any]) -> bool:
    """Whether ``values`` holds only finite numbers: checked in C (``set(map(type))``, ``fsum``),
    so a trace of a million points costs milliseconds, not a Python loop per point."""
    if not values or not set(map(type, values)) <= {int, float}:
        return False
    try:
        return math.isfinite(math.fsum(values))
    except OverflowError:  # an intermediate sum beyond float range: look at each value
        return False


def _check_unicode(s: str, error: type[SpecError], file: str | None, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"not valid Unicode text (an unpaired surrogate escape): {show(s)}", file=file,
                    field=where or None) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


_TYPE_WORD: dict[type, str] = {dict: "object", list: "list", str: "string", int: "number", float: "number",
                               bool: "true/false", type(None): "null"}
