"""Callable modules: ``deepcee.profile(...)``, ``deepcee.plan(...)``, ``deepcee.train(...)``.

[Note: callable modules]
``deepcee.profile``, ``deepcee.plan`` and ``deepcee.train`` are modules (the profile and plan
data models, the training entry point) that the code base and its users import by those names
(``from deepcee.plan import Plan``, ``python -m deepcee.train``); the Python API wants the
same three names as functions (:mod:`deepcee.api`). Renaming the modules would break every such
import, and a package attribute cannot be both: once ``deepcee.plan`` is imported, the import
system binds the attribute ``plan`` of the package to the module. So each of the three modules
makes *itself* callable as it is imported (:func:`make_callable` at its end sets its
``__class__`` to :class:`CallableModule`, a ``types.ModuleType`` subclass whose ``__call__``
forwards to the function of the same name in :mod:`deepcee.api`). Everything else about them
is unchanged: ``from deepcee.plan import Plan`` works, ``isinstance(deepcee.plan,
types.ModuleType)`` holds, the modules stay torch-free (:mod:`deepcee.api` is imported on the
first call), and doing it in each module (rather than in ``deepcee/__init__``) makes it hold
whichever way the module was first imported, without importing ``deepcee.train`` early (which
``python -m deepcee.train`` would warn about). Type checkers do not know modules can be
called; ``deepcee.api.plan`` is the same function under a plain name.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class CallableModule(types.ModuleType):
    """A module whose call is :mod:`deepcee.api`'s function of the same name."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from deepcee import api

        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


def make_callable(name: str) -> None:
    """Make module ``name`` (``deepcee.profile``, ``deepcee.plan`` or ``deepcee.train``) callable."""
    if name.startswith("deepcee."):  # not when run as __main__ (python -m deepcee.train)
        sys.modules[name].__class__ = CallableModule
