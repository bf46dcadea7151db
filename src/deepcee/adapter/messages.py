"""What the adapter's ranks agree on: ranks tied to devices, state moves and the decision message.

- :class:`DeviceTopology`: a :class:`~deepcee.runtime.partition.Topology` whose ranks stay on
  their devices whichever plan is in force (rank ``r`` always runs ``devices[r]``), so a plan
  may leave devices idle and bring them back;
- :func:`state_moves` / :class:`Move`: which device sends which layer's parameters and
  optimizer state to which device when a re-plan moves layers between stages;
- :class:`DecisionMessage`: what rank 0 broadcasts at a step boundary (see [Note: adapter step
  boundary] in :mod:`deepcee.adapter.hooks`), built from a policy's decision by
  :func:`decision_message`.

No torch here: everything is plain data on plans and clusters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepcee.adapter.policy import Decision, DecisionKind, same_stages
from deepcee.cluster import Cluster
from deepcee.errors import PlanError
from deepcee.plan import Plan
from deepcee.planfile import plan_from_dict
from deepcee.runtime.partition import Placement, Topology, needs_servers


class DeviceTopology(Topology):
    """A :class:`Topology` whose ranks are fixed per device: rank ``r`` runs ``devices[r]``.

    Devices of ``devices`` that the plan leaves out are idle ranks (``is_active`` false). A plan
    may hold several replicas (an elastic run's); parameter servers, ranks of their own, are
    not supported (every rank here is a device).
    """

    def __init__(self, plan: Plan, devices: Sequence[str]) -> None:
        if needs_servers(plan):
            raise PlanError(f"plan {plan.system!r} needs parameter servers ({plan.sync}), ranks of their own that "
                            "ranks tied to devices do not have", field="servers")
        super().__init__(plan, len(devices))
        rank_of = {d: r for r, d in enumerate(devices)}
        missing = [d for d in plan.devices if d not in rank_of]
        if missing:
            raise PlanError(f"plan uses device(s) {missing} that no rank runs (ranks run {list(devices)})")
        self.devices = tuple(devices)
        placements = [self._plan_placement(rep.stages, q, s, k, rank_of) for q, rep in enumerate(plan.replicas)
                      for s, st in enumerate(rep.stages) for k in range(len(st.devices))]
        self._fixed = {p.rank: p for p in placements}
        self._fixed_stage = {(q, s): tuple(rank_of[d] for d in st.devices) for q, rep in enumerate(plan.replicas)
                             for s, st in enumerate(rep.stages)}

    @staticmethod
    def _plan_placement(stages: Sequence[Any], q: int, s: int, k: int, rank_of: Mapping[str, int]) -> Placement:
        st = stages[s]
        lo = sum(st.shares[:k])
        return Placement(rank=rank_of[st.devices[k]], stage=s, index=k, device=st.devices[k], lo=lo,
                         hi=lo + st.shares[k], replica=q)

    @property
    def num_active(self) -> int:
        return len(self._fixed)

    @property
    def active_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._fixed))

    def is_active(self, rank: int) -> bool:
        return rank in self._fixed

    def placement(self, rank: int) -> Placement:
        if rank not in self._fixed:
            raise PlanError(f"rank {rank} (device {self.devices[rank]!r}) runs no stage of this plan")
        return self._fixed[rank]

    def rank_of(self, stage: int, index: int, replica: int = 0) -> int:
        return self._fixed_stage[(replica, stage)][index]

    def stage_ranks(self, stage: int, replica: int = 0) -> tuple[int, ...]:
        return self._fixed_stage[(replica, stage)]

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        return tuple(sorted(r for r, p in self._fixed.items() if p.replica == replica))

    def rank_of_device(self, device: str) -> int:
        return self.devices.index(device)


def layer_holders(plan: Plan) -> dict[int, tuple[str, ...]]:
    """Layer -> the devices that hold it under ``plan`` (its stage's, in every replica)."""
    out: dict[int, tuple[str, ...]] = {}
    for rep in plan.replicas:
        for st in rep.stages:
            for layer in range(st.layer_start, st.layer_stop):
                out[layer] = out.get(layer, ()) + st.devices
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Move:
    """Layer ``layer``'s parameters and optimizer state go from device ``src`` to ``dst``."""

    layer: int
    src: str
    dst: str

    def __post_init__(self) -> None:
        if self.layer < 0 or self.src == self.dst:
            raise ValueError(f"bad move: layer {self.layer} from {self.src!r} to {self.dst!r}")


def state_moves(old: Plan, new: Plan, cluster: Cluster, layer_bytes: Sequence[float], *,
                holders: Mapping[int, Sequence[str]] | None = None) -> tuple[Move, ...]:
    """The moves that give every device of ``new`` the state of its layers.

    Per layer of ``new`` (stage order, layer order), each device of its stage that did not
    hold it under ``old`` receives it from one device that did, the one whose link would
    finish it first given what is already booked on each link resource (the rule of
    :func:`deepcee.adapter.policy.state_movement`). ``layer_bytes[i]``: bytes of layer ``i``'s
    state (parameters and optimizer state). ``holders`` (layer -> devices) replaces what
    ``old`` says, e.g. the survivors of a lost device ([Note: elastic re-plan]).
    """
    if old.num_layers != new.num_layers or len(layer_bytes) != new.num_layers:
        raise PlanError(f"plans of {old.num_layers} and {new.num_layers} layers, {len(layer_bytes)} layer sizes")
    if holders is None:
        holders = layer_holders(old)
    empty = [layer for layer in range(new.num_layers) if not holders.get(layer)]
    if empty:
        raise PlanError(f"no device holds the state of layers {empty}")
    load: dict[str, float] = {}
    out = []
    for st in (st for rep in new.replicas for st in rep.stages):
        for layer in range(st.layer_start, st.layer_stop):
            nbytes = float(layer_bytes[layer])
            for d in st.devices:
                if d in holders[layer]:
                    continue
                src = min(holders[layer], key=lambda h: _finish_s(cluster, h, d, nbytes, load))
                link = cluster.link(src, d)
                load[link.resource] = load.get(link.resource, 0.0) + nbytes
                out.append(Move(layer=layer, src=src, dst=d))
    return tuple(out)


def _finish_s(cluster: Cluster, src: str, dst: str, nbytes: float, load: Mapping[str, float]) -> float:
    link = cluster.link(src, dst)
    return link.latency_s + (load.get(link.resource, 0.0) + nbytes) / link.bandwidth_bytes_per_s


def transfers_of(moves: Iterable[Move]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Moves grouped into one message per ``(src, dst)`` pair, in order of first appearance."""
    pairs: dict[tuple[str, str], list[int]] = {}
    for m in moves:
        pairs.setdefault((m.src, m.dst), []).append(m.layer)
    return [(src, dst, tuple(layers)) for (src, dst), layers in pairs.items()]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecisionMessage:
    """What rank 0 broadcasts at a step boundary. See [Note: adapter step boundary]."""

    kind: DecisionKind
    start_step: int
    """The first step run under ``plan``."""
    plan: Plan | None = None
    """The plan from ``start_step`` on (``None`` for keep)."""
    moves: tuple[Move, ...] = ()
    reason: str = ""
    predicted_current_s: float | None = None
    predicted_new_s: float | None = None
    predicted_change_s: float = 0.0
    moved_bytes: float = 0.0
    transition: Any = None
    """Devices come back (an elastic run): the next generation, a
    :class:`deepcee.runtime.elastic.Transition` every member enters (not in :meth:`to_dict`)."""

    def __post_init__(self) -> None:
        if self.start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {self.start_step}")
        if (self.kind == DecisionKind.KEEP) != (self.plan is None):
            raise ValueError(f"a {self.kind} decision {'has' if self.plan is not None else 'needs'} a plan")
        if self.kind == DecisionKind.RETUNE and self.moves:
            raise ValueError("a re-tune moves no state")

    @property
    def changes_plan(self) -> bool:
        return self.kind != DecisionKind.KEEP

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "start_step": self.start_step,
                "plan": None if self.plan is None else self.plan.to_dict(),
                "moves": [[m.layer, m.src, m.dst] for m in self.moves], "reason": self.reason,
                "predicted_current_s": self.predicted_current_s, "predicted_new_s": self.predicted_new_s,
                "predicted_change_s": self.predicted_change_s, "moved_bytes": self.moved_bytes}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> DecisionMessage:
        return DecisionMessage(
            kind=DecisionKind(d["kind"]), start_step=int(d["start_step"]),
            plan=None if d["plan"] is None else plan_from_dict(dict(d["plan"]), file="<decision>"),
            moves=tuple(Move(layer=int(a), src=b, dst=c) for a, b, c in d["moves"]), reason=d["reason"],
            predicted_current_s=d["predicted_current_s"], predicted_new_s=d["predicted_new_s"],
            predicted_change_s=float(d["predicted_change_s"]), moved_bytes=float(d["moved_bytes"]))


def decision_message(decision: Decision, current: Plan, start_step: int, cluster: Cluster,
                     layer_bytes: Sequence[float]) -> DecisionMessage:
    """The message for a policy's ``decision`` (kind recomputed from the plans; moves for a re-plan)."""
    if not decision.changes_plan:
        return DecisionMessage(kind=DecisionKind.KEEP, start_step=start_step, reason=decision.reason)
    new = decision.plan
    if new.global_batch != current.global_batch or new.num_layers != current.num_layers:
        raise PlanError(f"a new plan must keep the global batch ({current.global_batch}) and layers "
                        f"({current.num_layers}); got {new.global_batch} and {new.num_layers}")
    kind = DecisionKind.RETUNE if same_stages(current, new) else DecisionKind.REPLAN
    moves = state_moves(current, new, cluster, layer_bytes) if kind == DecisionKind.REPLAN else ()
    return DecisionMessage(kind=kind, start_step=start_step, plan=new, moves=moves, reason=decision.reason,
                           predicted_current_s=decision.current_iteration_s,
                           predicted_new_s=decision.new_iteration_s, predicted_change_s=decision.change_cost_s,
                           moved_bytes=float(sum(layer_bytes[m.layer] for m in moves)))

