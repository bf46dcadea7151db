"""deepcee: asymmetric pipeline + data-parallel training across cloud, edge and end devices.

The torch-free core (``cluster``, ``profile``, ``plan``, ``schedule``, ``simulator``,
``planner``, ``adapter.policy``) imports without torch; ``profiler``, ``runtime`` and
``nets`` need torch.

The Python API (``docs/api.md``, :mod:`deepcee.api`): ``deepcee.profile(model, data)``,
``deepcee.plan(profile, cluster, global_batch=...)``, ``deepcee.train(model, data, plan,
steps=...)`` (the modules of those names are callable, [Note: callable modules] in
:mod:`deepcee._callable`), with ``deepcee.Data`` (a run's data), ``deepcee.load_data`` (data from
a file or an import path), ``deepcee.split_model`` and ``deepcee.pipe_split`` (a model as
blocks). All are imported on first use, so ``import deepcee`` stays cheap and torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("profile", "plan", "train", "api")
_HOME = {"Data": "deepcee.runtime.sources", "load_data": "deepcee.runtime.datafiles",
         "split_model": "deepcee.nets.split", "pipe_split": "deepcee.nets.split", "SplitModel": "deepcee.nets.split"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"deepcee.{name}")  # binds the attribute: no second call here
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'deepcee' has no attribute {name!r}")
