"""References to a user's objects on a command line: ``package.module:name`` (torch-free).

``--model mypkg.models:build``, ``--data mypkg.data:train_set``, ``--loss mypkg.losses:fn``: the
module is imported (from ``sys.path``: the working folder, ``PYTHONPATH``, installed packages)
and the attribute (which may be dotted) is taken from it. A built-in model reference such as
``gpt2:seq_len=512`` is not an import path (its part after the colon holds ``=``).
"""

from __future__ import annotations

import importlib
from typing import Any

from deepcee.errors import SpecError


def is_import_path(ref: str) -> bool:
    """``pkg.mod:name`` (not a built-in ``name:key=value`` reference, not a file). A built-in
    model's name before the colon wins: ``gpt2:seq_len`` is a malformed built-in reference."""
    from deepcee.models import model_names  # torch-free, and it imports nothing of this module

    module, sep, attr = ref.partition(":")
    return bool(sep) and module not in model_names() and "=" not in attr and all(p.isidentifier() for p in (*module.split("."), *attr.split(".")))


def import_object(ref: str, *, what: str) -> Any:
    """``package.module:attribute`` -> the object; errors name ``what`` (the option) and the value."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise SpecError(f"expected package.module:name, got {ref!r}", field=what)
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise SpecError(f"cannot import {module!r} ({exc})", field=what) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SpecError(f"module {module!r} has no {attr!r}", field=what) from None
    return obj
