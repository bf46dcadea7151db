"""The dispatch loop: one rank interprets its stage's row of the *lowered* schedule.

The schedule comes from :func:`deepcee.schedule.program.lowered_schedule` (the plan's
validated, lowered action lists): the same lists the simulator and the cost model time, so
there is no second schedule implementation.
Transport lives in :mod:`deepcee.runtime.p2p`, autograd state in
:mod:`deepcee.runtime.stage`; this module only moves tensors between them in action order.
Both are :class:`typing.Protocol`\\ s, so the loop is testable with stand-ins and no process group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from deepcee.errors import ScheduleError
from deepcee.runtime.emulation import DevicePacer
from deepcee.schedule.ir import Action, ActionKind

K = ActionKind


class StageLike(Protocol):
    def forward(self, microbatch: int, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                loss_scale: float = 1.0) -> torch.Tensor: ...
    def backward_input(self, microbatch: int, output_grad: torch.Tensor | None = None) -> torch.Tensor | None: ...
    def backward_weight(self, microbatch: int) -> None: ...
    def backward(self, microbatch: int, output_grad: torch.Tensor | None = None) -> torch.Tensor | None: ...


class TransportLike(Protocol):
    def begin_step(self, actions: Sequence[Action]) -> None: ...
    def recv_forward(self, m: int) -> torch.Tensor: ...
    def recv_backward(self, m: int) -> torch.Tensor: ...
    def send_forward(self, m: int, tensor: torch.Tensor) -> None: ...
    def send_backward(self, m: int, tensor: torch.Tensor) -> None: ...
    def end_step(self) -> object: ...


@dataclass(slots=True)
class StepRecord:
    """What one rank did in one step (wall seconds, not yet divided by the dilation)."""

    loss: float = 0.0
    """Sum of this rank's weighted losses (last stage only; summed over ranks = batch mean)."""
    compute_s: float = 0.0
    cpu_s: float = 0.0
    wait_s: float = 0.0
    """Time blocked in receives."""
    actions: int = 0
    peak_in_flight: int = 0
    trace: list[tuple[str, float, float]] = field(default_factory=list)
    """``(action, start, end)`` wall times of every action, when tracing."""


@dataclass(slots=True)
class Feeds:
    """Where the first stage's inputs and the last stage's targets come from."""

    inputs: Callable[[int], torch.Tensor] | None = None
    targets: Callable[[int], torch.Tensor] | None = None
    loss_scale: float = 1.0


def run_step(actions: Sequence[Action], stage: StageLike, transport: TransportLike, feeds: Feeds,
             pacer: DevicePacer, *, trace: bool = False, clock: Callable[[], float] | None = None) -> StepRecord:
    """Execute one rank's lowered actions for one step."""
    rec = StepRecord()
    wall = clock or pacer.clock.wall
    acts: dict[int, torch.Tensor] = {}  # microbatch -> received activation (RECV_F .. F)
    outs: dict[int, torch.Tensor] = {}  # microbatch -> output to send (F .. SEND_F)
    grads_in: dict[int, torch.Tensor] = {}  # microbatch -> output gradient (RECV_B .. I/B)
    grads_out: dict[int, torch.Tensor] = {}  # microbatch -> input gradient (I/B .. SEND_B)
    transport.begin_step(actions)
    for a in actions:
        m, t0 = a.microbatch, wall()
        if a.kind == K.RECV_F:
            acts[m] = transport.recv_forward(m)
            rec.wait_s += wall() - t0
        elif a.kind == K.RECV_B:
            grads_in[m] = transport.recv_backward(m)
            rec.wait_s += wall() - t0
        elif a.kind == K.SEND_F:
            transport.send_forward(m, _take(outs, m, a))
        elif a.kind == K.SEND_B:
            transport.send_backward(m, _take(grads_out, m, a))
        else:
            result, timing = pacer.run(lambda a=a: _compute(a, stage, feeds, acts, grads_in))
            rec.compute_s += timing.wall_s
            rec.cpu_s += timing.cpu_s
            if a.kind == K.F:
                if feeds.targets is not None:
                    rec.loss += float(result)
                else:
                    outs[m] = result
            elif a.kind in (K.I, K.B) and feeds.inputs is None:
                # the first stage has nobody to send its input gradient to; a later stage sends
                # it even when it is None (an input that gets no gradient: a header-only message)
                grads_out[m] = result
            rec.peak_in_flight = max(rec.peak_in_flight, getattr(stage, "in_flight", 0))
        rec.actions += 1
        if trace:
            rec.trace.append((str(a), t0, wall()))
    transport.end_step()
    left = {k: sorted(v) for k, v in (("activations", acts), ("outputs", outs), ("output grads", grads_in),
                                      ("input grads", grads_out)) if v}
    if left:
        raise ScheduleError(f"step ended with unused {left} (a schedule row lacks the matching actions)")
    return rec


def _take(box: dict[int, torch.Tensor], m: int, a: Action) -> torch.Tensor:
    try:
        return box.pop(m)
    except KeyError:
        raise ScheduleError(f"{a}: nothing to send (no preceding compute action produced it)") from None


def _compute(a: Action, stage: StageLike, feeds: Feeds, acts: dict[int, torch.Tensor],
             grads_in: dict[int, torch.Tensor]) -> torch.Tensor | None:
    m = a.microbatch
    if a.kind == K.F:
        x = feeds.inputs(m) if feeds.inputs is not None else _take(acts, m, a)
        targets = feeds.targets(m) if feeds.targets is not None else None
        return stage.forward(m, x, targets, feeds.loss_scale)
    if a.kind == K.W:
        stage.backward_weight(m)
        return None
    if feeds.targets is None and m not in grads_in:
        raise ScheduleError(f"{a}: no output gradient received (missing RECV_B before it)")
    g = grads_in.pop(m, None)
    if a.kind == K.I:
        return stage.backward_input(m, g)
    return stage.backward(m, g)
