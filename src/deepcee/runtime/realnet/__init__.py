"""Real-network emulation: one network namespace per rank, real TCP through a shaping relay.

Public API:

- :func:`launch_realnet` (target, args, cluster, devices, ...) -> :class:`RelayStats`: run
  ``target`` on every rank as :func:`deepcee.runtime.launch.launch` does, with real networking;
- :class:`RealNetwork`: the same set-up as a context manager (own processes in the
  namespaces, live rate changes through :class:`RelayControl`);
- :func:`relay_config`: the relay's pairs and resources for a cluster's devices;
- :func:`realnet_unavailable` / :func:`require_realnet` (can it run here?) and
  :func:`cleanup_stale` (remove what a killed run left).

Modules: ``launcher`` (set-up, tear-down, rank processes; torch through
:mod:`deepcee.runtime.dist`), ``netns`` (namespaces and TUN devices), ``relay`` (the relay
process and its control client), ``shaping`` (the relay's pure timing core, configuration
and counters). Rank processes are supervised by :mod:`deepcee.runtime.supervise`, shared
with the local launcher.

The names above are imported on first use (module ``__getattr__``): the relay process imports
``relay`` and ``shaping`` through this package and must not load torch (2-3 s, ~220 MB);
``relay``, ``shaping`` and ``netns`` use the standard library and :mod:`deepcee.errors` only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepcee.runtime.realnet.launcher import (
        DEFAULT_QUEUE_LIMIT_S,
        RealNetwork,
        launch_realnet,
        relay_config,
    )
    from deepcee.runtime.realnet.netns import cleanup_stale, realnet_unavailable, require_realnet
    from deepcee.runtime.realnet.relay import RelayControl
    from deepcee.runtime.realnet.shaping import RelayConfig, RelayStats

_HOME = {
    "DEFAULT_QUEUE_LIMIT_S": "launcher", "RealNetwork": "launcher", "launch_realnet": "launcher",
    "relay_config": "launcher", "cleanup_stale": "netns", "realnet_unavailable": "netns", "require_realnet": "netns",
    "RelayControl": "relay", "RelayConfig": "shaping", "RelayStats": "shaping",
}

__all__ = [
    "DEFAULT_QUEUE_LIMIT_S", "RealNetwork", "RelayConfig", "RelayControl", "RelayStats", "cleanup_stale",
    "launch_realnet", "realnet_unavailable", "relay_config", "require_realnet",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'deepcee.runtime.realnet' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"deepcee.runtime.realnet.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
