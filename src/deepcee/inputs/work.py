"""Bounded work: whole jobs checked against the work limits before they start.

Torch-free. Each field of a file or flag is in range on its own (:mod:`deepcee.inputs.limits`),
but sizes multiply: a plan with many microbatches simulated for many iterations, a model with
many layers planned on many devices. These checks estimate the work from the sizes, with the
per-unit costs measured by ``benchmarks/input_limits.py``, and raise
:class:`~deepcee.errors.WorkLimitError` naming the limit when it is above what one command may
take (about a minute, or more memory than the project machine has).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepcee.errors import WorkLimitError
from deepcee.inputs.limits import (
    MAX_DEVICES,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_SCHEDULE_CELLS,
    MAX_SIMULATION_WORK,
    PLANNER_BYTES_PER_CELL,
    PLANNER_MEMORY_BYTES,
)

if TYPE_CHECKING:
    from deepcee.cluster import Cluster
    from deepcee.plan import Plan
    from deepcee.profile import ModelProfile

COMPUTE_ACTIONS_PER_MICROBATCH = 3
"""``F``, ``I`` and ``W`` (a fused ``B`` makes two): the most compute actions a device runs per
microbatch, the unit of :data:`~deepcee.inputs.limits.MAX_SIMULATION_WORK`."""


def simulation_work(plan: Plan, iterations: int) -> int:
    """Simulator work units of ``iterations`` iterations of ``plan``: every device's compute
    actions (its stage's microbatches x :data:`COMPUTE_ACTIONS_PER_MICROBATCH`) per iteration."""
    per_iteration = sum(len(st.devices) * rep.num_microbatches * COMPUTE_ACTIONS_PER_MICROBATCH
                        for rep in plan.replicas for st in rep.stages)
    return iterations * per_iteration


def check_simulation(plan: Plan, iterations: int, *, runs: int = 1, field: str = "--iterations") -> None:
    """Refuse simulating ``plan`` ``runs`` x ``iterations`` times above :data:`MAX_SIMULATION_WORK`."""
    work = runs * simulation_work(plan, iterations)
    if work > MAX_SIMULATION_WORK:
        per = simulation_work(plan, 1) * runs
        most = MAX_SIMULATION_WORK // per
        hint = f"at most {most:,} iteration(s) of this plan" if most else "a plan with fewer microbatches or devices"
        raise WorkLimitError(
            f"{runs} x {iterations:,} iteration(s) of a plan with {per // runs:,} device compute actions each is "
            f"{work:,} units of simulator work, above the limit of {MAX_SIMULATION_WORK:,} "
            f"(MAX_SIMULATION_WORK, about 17 s); use {hint}", field=field)


def check_schedule(stages: int, microbatches: int, *, field: str = "--microbatches") -> None:
    """Refuse a schedule of more than :data:`MAX_SCHEDULE_CELLS` stages x microbatches."""
    if stages * microbatches > MAX_SCHEDULE_CELLS:
        raise WorkLimitError(f"{stages} stages x {microbatches:,} microbatches = {stages * microbatches:,}, above "
                             f"the limit of {MAX_SCHEDULE_CELLS:,} (MAX_SCHEDULE_CELLS, about 5 s)", field=field)


def planner_memory_bytes(num_devices: int, num_layers: int) -> int:
    """Estimated peak memory of planning ``num_layers`` layers on ``num_devices`` devices."""
    return PLANNER_BYTES_PER_CELL * num_devices * (num_layers + 1) ** 2


def check_planning(cluster: Cluster, model: ModelProfile, global_batch: int) -> None:
    """Refuse planning that would run for more than about a minute or exhaust memory.

    Device count, layer count and global batch are each bounded (:data:`MAX_DEVICES`,
    :data:`MAX_LAYERS`, :data:`MAX_GLOBAL_BATCH`); together, the planner's range tables must fit
    :data:`PLANNER_MEMORY_BYTES` (see :func:`planner_memory_bytes`)."""
    devices, layers = len(cluster.devices), model.num_layers
    for what, value, limit, name in (("devices", devices, MAX_DEVICES, "MAX_DEVICES"),
                                     ("layers", layers, MAX_LAYERS, "MAX_LAYERS"),
                                     ("global batch", global_batch, MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH")):
        if value > limit:
            raise WorkLimitError(f"{what} {value:,} above the planner's limit of {limit:,} ({name})",
                                 field="global_batch" if what == "global batch" else what)
    need = planner_memory_bytes(devices, layers)
    if need > PLANNER_MEMORY_BYTES:
        raise WorkLimitError(
            f"planning {layers:,} layers on {devices:,} devices needs about {need / 2**30:.1f} GiB "
            f"({PLANNER_BYTES_PER_CELL} bytes x devices x (layers + 1)**2), above the limit of "
            f"{PLANNER_MEMORY_BYTES / 2**30:g} GiB (PLANNER_MEMORY_BYTES); plan fewer layers (merge blocks) or "
            f"fewer devices", field="layers")
