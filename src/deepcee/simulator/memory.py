"""Peak memory of a device under a plan (torch-free); the planner and the simulator share it.

The model is meant never to under-predict (a memory filter that under-predicts accepts plans
that run out of memory; ``deepcee validate`` checks it against each rank's measured peak). A
device of a stage holding layers ``[a, b)`` with a share of ``n`` samples per microbatch,
``k`` microbatches in flight (from their forward until their weight-gradient, see
``deepcee.schedule.passes.in_flight_per_stage``) and ``M`` microbatches per step needs
(:func:`device_memory`):

*Plan terms* (:func:`device_memory_bytes`; the planner's range tables use the same formulas):

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
(:func:`deepcee.schedule.passes.recomputed_live`; 1 for every fixed schedule, whose ``W`` follows its ``I`` directly).

*Runtime terms* (what the runtime running the plan adds,
:class:`~deepcee.simulator.runtime_model.RuntimeModel`, and what the profiler measured):

- communication buffers beyond that one pair: with receives posted at the step start
  (deepcee) every receive of the step is allocated at once and every send buffer is held
  until the step ends, ``(2 M - 1) x n x (in + out)`` more, where ``in`` / ``out`` are the
  boundary bytes the stage receives and sends (none at the pipeline's ends); with receives
  posted as the schedule reaches them and send buffers freed as their sends complete
  (deepcee on CUDA, ``deepcee-cuda``: [Note: in-order receives] in :mod:`deepcee.runtime.p2p`),
  ``(k - 1) x n x (in + out)`` more, the microbatches in flight only; on a stage of
  several devices the all-reduce's flat gradient buffer, ``parameters x gradient bytes``
  (not with ``zero2``, whose reduce-scatter runs in buckets);
- the other layers' parameters when the runtime builds every layer on every rank's host
  (``holds_whole_model``; deepcee's runtime does, then trains its stage's) and the device's
  memory is the host's (``DeviceMemory.host_memory``: a measured CPU device);
- the allocator's fragmentation margin on all the terms above, and the device's fixed
  overhead (process, framework, communication library), both measured per device kind by the
  profiler (:class:`deepcee.profile.DeviceMemory`; 0 when the profile has none: a profile
  without measurements gives the plan's tensors only, and reports say so).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepcee.profile import ModelProfile
from deepcee.simulator.runtime_model import DEFAULT_RUNTIME, RuntimeModel


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """The terms of one device's predicted peak (bytes). See the module docstring."""

    state_bytes: float
    activation_bytes: float
    boundary_bytes: float
    runtime_buffer_bytes: float
    other_layers_bytes: float
    fragmentation_bytes: float
    fixed_bytes: float

    @property
    def plan_bytes(self) -> float:
        """The plan terms (:func:`device_memory_bytes`)."""
        return self.state_bytes + self.activation_bytes + self.boundary_bytes

    @property
    def total_bytes(self) -> float:
        return (self.plan_bytes + self.runtime_buffer_bytes + self.other_layers_bytes + self.fragmentation_bytes
                + self.fixed_bytes)


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


def activation_bytes(model: ModelProfile, start: int, stop: int, *, share: int, in_flight: int,
                     recompute: bool = False, recompute_live: int = 1) -> float:
    """The stashed-activation term (see the module docstring), with or without recomputation."""
    out = in_flight * share * stashed_bytes_per_sample(model, start, stop, recompute=recompute)
    if recompute:
        out += min(recompute_live, in_flight) * share * model.activation_bytes(start, stop)
    return out


def runtime_buffer_bytes(model: ModelProfile, start: int, stop: int, *, share: int, in_flight: int,
                         num_microbatches: int, stage_devices: int, runtime: RuntimeModel,
                         sync: str = "allreduce-ring") -> float:
    """Communication buffers beyond one input/output pair (see the module docstring)."""
    moved = share * ((model.boundary_bytes(start) if start > 0 else 0.0)
                     + (model.boundary_bytes(stop) if stop < model.num_layers else 0.0))
    held = 2 * num_microbatches if runtime.receives == "at-step-start" else in_flight
    flat = model.gradient_bytes(start, stop) if stage_devices > 1 and sync != "zero2" else 0.0
    return max(0, held - 1) * moved + flat


def device_memory(model: ModelProfile, start: int, stop: int, *, share: int, in_flight: int,
                  num_microbatches: int, kind: str | None, sync: str = "allreduce-ring", stage_devices: int = 1,
                  runtime: RuntimeModel | None = None, recompute: bool = False,
                  recompute_live: int = 1) -> MemoryBreakdown:
    """Every term of one device's peak (plan and runtime terms). ``kind``: the device's kind
    (``None``: the largest measured overhead of any kind, never fewer bytes than the device's)."""
    rt = runtime or DEFAULT_RUNTIME
    state = state_bytes(model, start, stop, sync=sync, stage_devices=stage_devices)
    activations = activation_bytes(model, start, stop, share=share, in_flight=in_flight, recompute=recompute,
                                   recompute_live=recompute_live)
    boundary = share * (model.boundary_bytes(start) + model.boundary_bytes(stop))
    buffers = runtime_buffer_bytes(model, start, stop, share=share, in_flight=in_flight,
                                   num_microbatches=num_microbatches, stage_devices=stage_devices, runtime=rt,
                                   sync=sync)
    overhead = model.memory_overhead(kind)
    # the runtime builds every layer on the host, then moves its stage's to the device: the
    # other layers count where the device's memory is the host's (a measured CPU device)
    on_host = overhead is not None and overhead.host_memory
    others = (model.gradient_bytes(0, model.num_layers) - model.gradient_bytes(start, stop)
              if rt.holds_whole_model and on_host else 0.0)
    fraction = overhead.fragmentation_fraction if overhead is not None else 0.0
    return MemoryBreakdown(state_bytes=state, activation_bytes=activations, boundary_bytes=boundary,
                           runtime_buffer_bytes=buffers, other_layers_bytes=others,
                           fragmentation_bytes=fraction * (state + activations + boundary + buffers + others),
                           fixed_bytes=overhead.fixed_bytes if overhead is not None else 0.0)


def device_memory_bytes(model: ModelProfile, start: int, stop: int, *, share: int, in_flight: int,
                        sync: str = "allreduce-ring", stage_devices: int = 1, recompute: bool = False,
                        recompute_live: int = 1) -> float:
    """The plan terms of one device's peak (see the module docstring; :func:`device_memory`
    adds the runtime's)."""
    activations = activation_bytes(model, start, stop, share=share, in_flight=in_flight, recompute=recompute,
                                   recompute_live=recompute_live)
    buffers = share * (model.boundary_bytes(start) + model.boundary_bytes(stop))
    return state_bytes(model, start, stop, sync=sync, stage_devices=stage_devices) + activations + buffers
