"""Dynamic environment adapter: keep throughput when the network changes, without restarting.

- :mod:`deepcee.adapter.monitor`: link latency and bandwidth estimates, with change
  detection, from the transfer timings the runtime records anyway (torch-free).
- :mod:`deepcee.adapter.policy`: the pure decision keep / re-tune microbatches / re-plan,
  with a cost-benefit test and hysteresis (torch-free).
- :mod:`deepcee.adapter.simloop`: the same loop run in the simulator on bandwidth traces,
  with and without adaptation, against the optimum for the new conditions (torch-free).

Submodules are imported on use; importing this package imports nothing else.
"""
