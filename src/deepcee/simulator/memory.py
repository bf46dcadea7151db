"""Peak memory of a device under a plan (torch-free); the planner and the simulator share it.

A device of a stage holding layers ``[a, b)`` with a share of ``n`` samples per microbatch and
``k`` microbatches in flight (from their forward until their weight-gradient, see
``deepcee.schedule.passes.in_flight_per_stage``) needs

- model state: ``parameters x state_bytes_per_parameter`` (parameters, gradients and
  optimizer state); with ``zero2`` the gradient and optimizer part is sharded over the
  stage's ``d`` devices: ``parameters x (dtype bytes + (state - dtype bytes) / d)``;
- stashed activations: ``k x n x activation_bytes_per_sample(a, b)``;
- boundary buffers: the received input and the output of one microbatch share,
  ``n x (boundary_bytes(a) + boundary_bytes(b))``.
"""

from __future__ import annotations

from deepcee.profile import ModelProfile


def state_bytes(model: ModelProfile, start: int, stop: int, *, sync: str = "allreduce-ring",
                stage_devices: int = 1) -> float:
    params = model.parameters(start, stop)
    if sync == "zero2" and stage_devices > 1:
        weight = model.gradient_bytes_per_parameter  # the parameters themselves stay replicated
        return params * (weight + (model.state_bytes_per_parameter - weight) / stage_devices)
    return params * model.state_bytes_per_parameter


def device_memory_bytes(model: ModelProfile, start: int, stop: int, *, share: int, in_flight: int,
                        sync: str = "allreduce-ring", stage_devices: int = 1) -> float:
    """Peak bytes on one device. See the module docstring for the terms."""
    activations = in_flight * share * model.activation_bytes(start, stop)
    buffers = share * (model.boundary_bytes(start) + model.boundary_bytes(stop))
    return state_bytes(model, start, stop, sync=sync, stage_devices=stage_devices) + activations + buffers
