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

With activation recomputation (:attr:`deepcee.plan.StagePlan.recompute`) a microbatch in
flight keeps only its stage input, ``n x boundary_bytes(a)``, and its activations exist only
from the re-run forward (just before its ``I`` or ``B``) until its ``W`` (or the end of its
``B``): ``k x n x boundary_bytes(a) + r x n x activation_bytes_per_sample(a, b)``, where ``r``
is the most microbatches between their ``I`` and their ``W`` at once
(:func:`recomputed_live`; 1 for every fixed schedule, whose ``W`` follows its ``I`` directly).
"""

from __future__ import annotations

from collections.abc import Sequence

from deepcee.profile import ModelProfile
from deepcee.schedule.ir import Action, ActionKind


def state_bytes(model: ModelProfile, start: int, stop: int, *, sync: str = "allreduce-ring",
                stage_devices: int = 1) -> float:
    params = model.parameters(start, stop)
    if sync == "zero2" and stage_devices > 1:
        weight = model.gradient_bytes_per_parameter  # the parameters themselves stay replicated
        return params * (weight + (model.state_bytes_per_parameter - weight) / stage_devices)
    return params * model.state_bytes_per_parameter


def stashed_bytes_per_sample(model: ModelProfile, start: int, stop: int, *, recompute: bool = False) -> float:
    """Bytes one sample of one microbatch in flight keeps: its activations, or with recomputation
    its stage input only."""
    return model.boundary_bytes(start) if recompute else model.activation_bytes(start, stop)


def recomputed_live(schedule: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Per stage, the most microbatches whose recomputed activations are live at once: from the
    start of their ``I`` (or ``B``) until the end of their ``W`` (or ``B``). Compute actions only
    are read, so a lowered schedule works too."""
    i, w, b = ActionKind.I, ActionKind.W, ActionKind.B
    out = []
    for row in schedule:
        live = peak = 0
        for a in row:
            k = a.kind
            if k is i or k is b:
                live += 1
                if live > peak:
                    peak = live
            if k is w or k is b:
                live -= 1
        out.append(peak)
    return tuple(out)


def device_memory_bytes(model: ModelProfile, start: int, stop: int, *, share: int, in_flight: int,
                        sync: str = "allreduce-ring", stage_devices: int = 1, recompute: bool = False,
                        recompute_live: int = 1) -> float:
    """Peak bytes on one device. See the module docstring for the terms."""
    activations = in_flight * share * stashed_bytes_per_sample(model, start, stop, recompute=recompute)
    if recompute:
        activations += min(recompute_live, in_flight) * share * model.activation_bytes(start, stop)
    buffers = share * (model.boundary_bytes(start) + model.boundary_bytes(stop))
    return state_bytes(model, start, stop, sync=sync, stage_devices=stage_devices) + activations + buffers
