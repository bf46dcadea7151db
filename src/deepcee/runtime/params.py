"""A user's model on the ranks: private copies of its blocks and its tied parameters.

:class:`PackedModel` is how a user's blocks travel to the ranks (``torch.save`` bytes);
:func:`private_blocks` gives a rank its own copy; :func:`find_ties` finds the parameters and
buffers that several blocks share; :func:`tie_groups` and :func:`sum_tied_gradients` keep the
copies of a tied parameter on different stages equal, step after step.

[Note: private copies]
Every rank trains its own copy of the user's blocks; the object the user passed is never
touched (not trained, not converted, not moved to shared memory). Two things would break
this otherwise. (1) ``multiprocessing``'s spawn pickles a job with torch's ``ForkingPickler``,
whose tensor reduction moves each storage to shared memory *in place*: every rank, and the
parent, would then see one storage, so the devices of a data-parallel stage each applied
their optimizer step to it (parameters moved twice as far) and the user's model was trained
behind their back; a later ``.to(dtype)`` copies only when the dtype changes, which is why a
float32 model run in float64 looked right. So a job pickles its user model as
:class:`PackedModel`: ``torch.save`` bytes (the standard pickler, which copies storages into
the byte string), made in the parent; nothing there is shared. (2) A rank started in the
caller's own process (``run_jobs_on_rank`` under torchrun, or in a test) holds the live
object, so :func:`private_blocks` deep-copies it. Both copy the whole block list in one go
(the pickle memo, the ``deepcopy`` memo), so a parameter shared by several blocks is still
one ``nn.Parameter`` on the rank: within a stage it stays tied (one optimizer entry).

[Note: tied parameters]
A parameter used by blocks on different stages (a token embedding and an LM head) is held
by the ranks of each of those stages. The single-process gradient of such a parameter is the
sum of every use's contribution, and after the in-stage SUM all-reduce ([Note: loss
weighting] in :mod:`deepcee.runtime.trainer`) every device of a stage already holds its
stage's full-batch part. So, each step, one SUM all-reduce over all ranks of the owning
stages, in which only device 0 of each stage contributes its gradient and the others
contribute zeros, gives every copy exactly the whole gradient (adding zeros is exact; the
collective hands every rank the same bits), and since every copy starts equal and takes the
same optimizer step, the copies stay equal. Ties with the same owning stages share one
all-reduce; the groups are created on every rank in one sorted order (``new_group`` is
collective over the world) and re-created whenever the plan changes. Checkpoints need
nothing more: every stage saves its copy, and the copies are equal. Buffers are copied, not
synchronised: a buffer shared across stages (a causal mask, a rotary table) stays correct
as long as the forward does not update it in place.
"""

from __future__ import annotations

import copy
import hashlib
import io
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from deepcee import nets
from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.plan import Plan
from deepcee.runtime.emulation import Clock
from deepcee.runtime.partition import Placement, Topology
from deepcee.runtime.state import StateNames, state_names

log = logging.getLogger(__name__)

Use = tuple[int, str]
"""(block index, the tensor's name inside that block)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tie:
    """One parameter (or buffer) object used by several blocks."""

    kind: Literal["parameter", "buffer"]
    uses: tuple[Use, ...]
    """Every (block, name) it appears under, in block order."""

    def __post_init__(self) -> None:
        if self.kind not in ("parameter", "buffer"):
            raise SpecError(f"must be parameter or buffer, got {self.kind!r}", field="tie.kind")
        if len(self.blocks) < 2:
            raise SpecError(f"a tie spans at least 2 blocks, got uses {list(self.uses)}", field="tie.uses")

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(sorted({b for b, _ in self.uses}))

    def describe(self) -> str:
        return " = ".join(f"{b}.{n}" for b, n in self.uses)


def _shared(named: Callable[[nn.Module], Iterable[tuple[str, torch.Tensor]]],
            blocks: Sequence[nn.Module]) -> list[tuple[Use, ...]]:
    uses: dict[int, list[Use]] = defaultdict(list)
    keep = {}  # holds every tensor while ids are compared (an id is only unique while alive)
    for i, block in enumerate(blocks):
        for name, t in named(block):
            uses[id(t)].append((i, name))
            keep[id(t)] = t
    return [tuple(u) for u in uses.values() if len({b for b, _ in u}) > 1]


def find_ties(blocks: Sequence[nn.Module]) -> tuple[Tie, ...]:
    """Parameters and buffers that more than one block holds, found by object identity."""
    params = _shared(lambda b: b.named_parameters(remove_duplicate=False), blocks)
    buffers = _shared(lambda b: b.named_buffers(remove_duplicate=False), blocks)
    return (*(Tie(kind="parameter", uses=u) for u in params), *(Tie(kind="buffer", uses=u) for u in buffers))


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class PackedModel:
    """A user's blocks as ``torch.save`` bytes, with their ties. See [Note: private copies]."""

    data: bytes
    num_blocks: int
    ties: tuple[Tie, ...]
    """Found on the user's own blocks, before packing."""
    names: StateNames
    """The names of the blocks' state in the user's model ([Note: state names] in
    :mod:`deepcee.runtime.state`), found on the user's own object."""

    @staticmethod
    def pack(model: nn.Module | Iterable[nn.Module]) -> PackedModel:
        blocks = nets.as_blocks(model)
        buf = io.BytesIO()
        torch.save(blocks, buf)  # the standard pickler: storages are copied into the bytes
        return PackedModel(data=buf.getvalue(), num_blocks=len(blocks), ties=find_ties(blocks),
                           names=state_names(model, blocks))

    def __repr__(self) -> str:
        return f"PackedModel({self.num_blocks} blocks, {len(self.data)} bytes, {len(self.ties)} ties)"

    def unpack(self) -> list[nn.Module]:
        """A fresh copy of the blocks (every call), on the CPU."""
        return torch.load(io.BytesIO(self.data), map_location="cpu", weights_only=False)


def model_digest(blocks: Sequence[nn.Module]) -> str:
    """A digest of every parameter and buffer of the blocks (names, dtypes, shapes, values): ranks
    that build a user's model themselves (under torchrun) compare it at start-up."""
    h = hashlib.sha256()
    for i, block in enumerate(blocks):
        for name, t in (*block.named_parameters(), *block.named_buffers()):
            h.update(f"{i}.{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def model_ties(model: str | PackedModel | nn.Module | Iterable[nn.Module]) -> tuple[Tie, ...]:
    """Ties of a job's model (none for a built-in net: each block is built on its own)."""
    if isinstance(model, str):
        return ()
    if isinstance(model, PackedModel):
        return model.ties
    return find_ties(nets.as_blocks(model))


def private_blocks(model: PackedModel | nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    """This rank's own copy of a user's blocks, ties kept. See [Note: private copies]."""
    if isinstance(model, PackedModel):
        return model.unpack()
    return copy.deepcopy(nets.as_blocks(model))  # one deepcopy of the whole list: its memo keeps ties


def reduce_job(job: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``__reduce__`` of a :class:`~deepcee.runtime.job.Job`: its user model travels packed."""
    values = {f.name: getattr(job, f.name) for f in fields(job)}
    if not isinstance(values["model"], str | PackedModel):
        values["model"] = PackedModel.pack(values["model"])
    return _rebuild_job, (type(job), values)


def _rebuild_job(cls: type, values: dict[str, Any]) -> Any:
    return cls(**values)


# -- tied parameters across stages ------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TieGroup:
    """Parameter ties owned by the same stages, summed by one all-reduce over their ranks."""

    stages: tuple[int, ...]
    ranks: tuple[int, ...]
    devices: tuple[str, ...]
    ties: tuple[Tie, ...]
    group: Any
    """The process group over ``ranks``."""


def stage_of_blocks(plan: Plan) -> dict[int, int]:
    return {b: s for s, st in enumerate(plan.stages) for b in range(st.layer_start, st.layer_stop)}


def tie_groups(ties: Sequence[Tie], plan: Plan, topo: Topology,
               make_group: Callable[[Sequence[int]], Any]) -> tuple[TieGroup, ...]:
    """The cross-stage parameter ties of ``plan``, grouped by owning stages; creates their
    process groups, in one order on every rank (every rank must call this)."""
    stage_of = stage_of_blocks(plan)
    by_stages: dict[tuple[int, ...], list[Tie]] = defaultdict(list)
    for tie in ties:
        if tie.kind != "parameter":
            continue
        try:
            stages = tuple(sorted({stage_of[b] for b in tie.blocks}))
        except KeyError:
            raise RuntimeSetupError(f"tie {tie.describe()} uses a block outside the plan's layers "
                                    f"0..{len(stage_of) - 1}") from None
        if len(stages) > 1:
            by_stages[stages].append(tie)
    out = []
    for stages in sorted(by_stages):
        ranks = tuple(sorted(r for s in stages for r in topo.stage_ranks(s)))
        devices = tuple(d for s in stages for d in plan.stages[s].devices)
        out.append(TieGroup(stages=stages, ranks=ranks, devices=devices, ties=tuple(by_stages[stages]),
                            group=make_group(ranks)))
        log.debug("tied across stages %s: %s", stages, "; ".join(t.describe() for t in by_stages[stages]))
    return tuple(out)


def _local_params(group: TieGroup, blocks: Sequence[nn.Module], plan: Plan, stage: int) -> list[nn.Parameter]:
    """This rank's copy of each tie of ``group``, taken from a use on its own stage."""
    stage_of = stage_of_blocks(plan)
    out = []
    for tie in group.ties:
        b, name = next(u for u in tie.uses if stage_of[u[0]] == stage)
        out.append(blocks[b].get_parameter(name))
    return out


Pace = Callable[[Sequence[str], int, float], None]
"""``pace(devices, nbytes, t0)``: wait until an all-reduce over ``devices`` started at wall time
``t0`` has taken its emulated time (mode ``emulated``)."""


def sum_tied_gradients(groups: Sequence[TieGroup], blocks: Sequence[nn.Module], plan: Plan, placement: Placement, *,
                       timeout_s: float, clock: Clock, pace: Pace | None = None) -> float:
    """Give every copy of a tied parameter the whole gradient. See [Note: tied parameters].

    Call after the in-stage all-reduce, on every active rank, every step; returns wall seconds."""
    start = clock.wall()
    for g in groups:
        if placement.rank not in g.ranks:
            continue
        params = [p for p in _local_params(g, blocks, plan, placement.stage) if p.requires_grad]
        if not params:
            continue
        mine = placement.index == 0
        grads = [p.grad if mine and p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([x.reshape(-1) for x in grads])
        t0 = clock.wall()
        work = dist.all_reduce(flat, group=g.group, async_op=True)
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise RuntimeSetupError(f"rank {placement.rank} ({placement.device}): tied-gradient all-reduce with "
                                    f"ranks {list(g.ranks)} did not complete within {timeout_s:g} s: "
                                    f"{str(exc)[:160]}") from None
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        if pace is not None:
            pace(g.devices, flat.numel() * flat.element_size(), t0)
    return clock.wall() - start
