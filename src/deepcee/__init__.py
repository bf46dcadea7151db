"""deepcee: asymmetric pipeline + data-parallel training across cloud, edge and end devices.

The torch-free core (``cluster``, ``profile``, ``plan``, ``schedule``, ``simulator``,
``planner``, ``adapter.policy``) imports without torch; ``profiler``, ``runtime`` and
``nets`` need torch.
"""

__version__ = "0.1.0"
