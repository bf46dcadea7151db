"""The field validator every reader uses: one record (JSON object, TOML table) at a time.

Torch-free. :class:`Fields` wraps a parsed record with where it sits (``replicas[0].stages[1]``)
and the file it came from, and reads its keys with a type and, for numbers, a
:class:`~deepcee.inputs.limits.Limit`. Every error is the reader's
:class:`~deepcee.errors.SpecError` subclass naming file, field and value, in one line.
Unknown keys are errors (:meth:`Fields.done`): a misspelt key would otherwise be ignored and
silently change what the file means.

A reader looks like::

    f = Fields(data, file=path, error=PlanError)
    batch = f.integer("global_batch", GLOBAL_BATCH)
    for i, stage in enumerate(f.records("stages", max_len=MAX_DEVICES)):
        devices = stage.names("devices", max_len=MAX_DEVICES)
        stage.done()
    f.done()
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

from deepcee.errors import SpecError
from deepcee.inputs.limits import MAX_NAME_CHARS, MAX_TEXT_CHARS, Limit, show

MISSING: Any = object()
"""Default of the getters: the key is required."""


class Fields:
    """Strict reader of one record; see the module docstring."""

    def __init__(self, record: Any, where: str = "", *, file: str | None, error: type[SpecError] = SpecError):
        self.where, self.file, self.error = where, file, error
        if not isinstance(record, dict):
            raise error(f"expected an object (a table of keys), got {_kind(record)}", file=file, field=where or None)
        self.record: dict[str, Any] = record
        self.used: set[str] = set()

    # -- naming --------------------------------------------------------------------------
    def path(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.where}[{key}]"
        return f"{self.where}.{key}" if self.where else key

    def err(self, key: str | int, message: str) -> SpecError:
        """The reader's error for ``key`` of this record."""
        return self.error(message, file=self.file, field=self.path(key))

    def whole(self, message: str) -> SpecError:
        """The reader's error for this record as a whole."""
        return self.error(message, file=self.file, field=self.where or None)

    # -- getters -------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.record

    def raw(self, key: str, default: Any = MISSING) -> Any:
        """The value of ``key`` unchecked (or ``default``); marks the key as known."""
        self.used.add(key)
        if key not in self.record:
            if default is MISSING:
                raise self.err(key, "missing required value")
            return default
        return self.record[key]

    def text(self, key: str, default: Any = MISSING, *, max_chars: int = MAX_TEXT_CHARS) -> str:
        v = self.raw(key, default)
        return v if v is default else check_text(v, max_chars, lambda m: self.err(key, m))

    def name(self, key: str, default: Any = MISSING, *, known: Collection[str] | None = None) -> str:
        """A non-empty name without control characters, one of ``known`` when given."""
        v = self.raw(key, default)
        return v if v is default else check_name(v, lambda m: self.err(key, m), known=known)

    def choice(self, key: str, choices: Collection[str], default: Any = MISSING) -> str:
        v = self.raw(key, default)
        if v is default:
            return v
        if not isinstance(v, str) or v not in choices:
            raise self.err(key, f"expected one of {', '.join(map(str, choices))}; got {show(v)}")
        return v

    def flag(self, key: str, default: Any = MISSING) -> bool:
        v = self.raw(key, default)
        if v is not default and not isinstance(v, bool):
            raise self.err(key, f"expected true or false, got {show(v)}")
        return v

    def number(self, key: str, limit: Limit, default: Any = MISSING) -> float:
        v = self.raw(key, default)
        return v if v is default else self.check(key, limit, v)

    def integer(self, key: str, limit: Limit, default: Any = MISSING) -> int:
        v = self.raw(key, default)
        return v if v is default else self.check(key, limit, v)

    def check(self, key: str | int, limit: Limit, value: Any) -> Any:
        """``value`` checked against ``limit``; errors name ``key`` of this record."""
        try:
            return limit.check(value)
        except ValueError as exc:
            raise self.err(key, str(exc)) from None

    def items(self, key: str, default: Any = MISSING, *, max_len: int, min_len: int = 0) -> list[Any]:
        """A JSON array / TOML array of at most ``max_len`` raw values."""
        v = self.raw(key, default)
        if v is default:
            return v
        if not isinstance(v, list):
            raise self.err(key, f"expected a list, got {_kind(v)}")
        if not min_len <= len(v) <= max_len:
            want = f"exactly {min_len:,}" if min_len == max_len else f"{min_len} to {max_len:,}"
            raise self.err(key, f"needs {want} entries, got {len(v):,}")
        return v

    def numbers(self, key: str, limit: Limit, default: Any = MISSING, *, max_len: int,
                min_len: int = 0) -> tuple[Any, ...]:
        v = self.items(key, default, max_len=max_len, min_len=min_len)
        if v is default:
            return v
        sub = self.path(key)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(limit.check(x))
            except ValueError as exc:
                raise self.error(str(exc), file=self.file, field=f"{sub}[{i}]") from None
        return tuple(out)

    def names(self, key: str, default: Any = MISSING, *, max_len: int, min_len: int = 0,
              known: Collection[str] | None = None) -> tuple[str, ...]:
        v = self.items(key, default, max_len=max_len, min_len=min_len)
        if v is default:
            return v
        sub = self.path(key)
        return tuple(check_name(x, lambda m, i=i: self.error(m, file=self.file, field=f"{sub}[{i}]"), known=known)
                     for i, x in enumerate(v))

    def texts(self, key: str, default: Any = MISSING, *, max_len: int) -> tuple[str, ...]:
        v = self.items(key, default, max_len=max_len)
        if v is default:
            return v
        sub = self.path(key)
        return tuple(check_text(x, MAX_TEXT_CHARS, lambda m, i=i: self.error(m, file=self.file, field=f"{sub}[{i}]"))
                     for i, x in enumerate(v))

    def record_of(self, key: str, default: Any = MISSING) -> Fields:
        """The object under ``key`` as a :class:`Fields` (``default`` when absent)."""
        v = self.raw(key, default)
        return v if v is default else Fields(v, self.path(key), file=self.file, error=self.error)

    def records(self, key: str, default: Any = MISSING, *, max_len: int, min_len: int = 0) -> Iterator[Fields]:
        """Each object of the list under ``key`` as a :class:`Fields` named ``key[i]``."""
        sub = self.path(key)
        for i, v in enumerate(self.items(key, default, max_len=max_len, min_len=min_len)):
            yield Fields(v, f"{sub}[{i}]", file=self.file, error=self.error)

    def table(self, key: str, default: Any = MISSING, *, max_len: int) -> Iterator[tuple[str, Fields]]:
        """``(name, Fields)`` for each entry of the object under ``key`` (``kinds.<name>``)."""
        v = self.raw(key, default)
        if v is default:
            return
        if not isinstance(v, dict):
            raise self.err(key, f"expected an object (a table of keys), got {_kind(v)}")
        if len(v) > max_len:
            raise self.err(key, f"at most {max_len:,} entries, got {len(v):,}")
        for name, entry in v.items():
            check_name(name, lambda m, n=name: self.err(key, f"entry name: {m}"))
            yield name, Fields(entry, f"{self.path(key)}.{name}", file=self.file, error=self.error)

    def mapping(self, key: str, default: Any = MISSING, *, max_len: int) -> dict[str, Any]:
        """The object under ``key`` as a dict of raw values, its keys checked as names."""
        v = self.raw(key, default)
        if v is default:
            return v
        if not isinstance(v, dict):
            raise self.err(key, f"expected an object (a table of keys), got {_kind(v)}")
        if len(v) > max_len:
            raise self.err(key, f"at most {max_len:,} entries, got {len(v):,}")
        for name in v:
            check_name(name, lambda m: self.err(key, f"entry name: {m}"))
        return v

    def done(self) -> None:
        """Raise on the first key no getter asked for (a misspelling or a key of another format)."""
        extra = [k for k in self.record if k not in self.used]
        if extra:
            raise self.err(extra[0], f"unknown key (value {show(self.record[extra[0]])}); "
                                     f"known: {', '.join(sorted(self.used))}")


def check_format(f: Fields, name: str, versions: Collection[int]) -> int:
    """The ``format`` (must be ``name``) and ``schema_version`` (one of ``versions``) of a
    machine-written file; returns the version."""
    fmt, version = f.raw("format", None), f.raw("schema_version", None)
    if fmt != name or isinstance(version, bool) or version not in versions:
        want = " or ".join(map(str, versions))
        raise f.err("schema_version", f"expected format {name!r} schema_version {want}, got {show(fmt)} "
                                      f"{show(version)}")
    return version


def check_text(value: Any, max_chars: int, err: Any) -> str:
    if not isinstance(value, str):
        raise err(f"expected a string, got {show(value)} ({type(value).__name__})")
    if len(value) > max_chars:
        raise err(f"at most {max_chars:,} characters, got {len(value):,}")
    return value


def check_name(value: Any, err: Any, *, known: Collection[str] | None = None) -> str:
    """A non-empty name of at most :data:`MAX_NAME_CHARS` printable characters (``known``: one of them)."""
    if not isinstance(value, str):
        raise err(f"expected a name (a string), got {show(value)} ({type(value).__name__})")
    if not value or len(value) > MAX_NAME_CHARS or not value.isprintable():
        raise err(f"a name needs 1 to {MAX_NAME_CHARS} printable characters, got {show(value)}")
    if known is not None and value not in known:
        names = sorted(known)
        listed = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise err(f"unknown name {value!r} (known: {listed or 'none'})")
    return value


def _kind(value: Any) -> str:
    """What a JSON/TOML value is, in a user's words."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", type(None): "null",
             int: "a number", float: "a number"}
    return f"{names.get(type(value), type(value).__name__)} {show(value, 40)}"
