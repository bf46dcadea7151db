"""A pipeline stage: a contiguous slice of blocks and its per-microbatch state.

Actions (the compute kinds of :mod:`deepcee.schedule.ir`):

- ``F`` :meth:`StageRunner.forward` runs the blocks on this device's share of a microbatch
  and stashes input and output (on the last stage the output is the *weighted* loss);
- ``I`` :meth:`StageRunner.backward_input` computes only the gradient of the stage input;
- ``W`` :meth:`StageRunner.backward_weight` computes the parameter gradients, reusing the
  gradients ``I`` already computed (see [Note: split backward]);
- ``B`` :meth:`StageRunner.backward` does both in one autograd pass.

Parameter gradients accumulate in ``.grad`` over microbatches; the caller zeroes them.

[Note: split backward]
``I`` walks the autograd graph of the microbatch once: the *input closure* is every node
from which the stage input is reachable (the nodes ``I`` must run). For each parameter,
walking from its gradient accumulator towards the output, the first input-closure nodes met
are its *intermediates*: the gradient flowing into them is all the parameter needs.
Parameters that share an intermediate form one group (union-find). During ``I`` a pre-hook
on every intermediate saves the gradient it receives. ``W`` then runs, per group, autograd
from those intermediates (``GradientEdge``) to the group's parameters, seeded with the
saved gradients; when a group has several intermediates, each one's pre-hook *replaces*
whatever flows into it by its saved gradient, so a path through two intermediates is not
counted twice. Parameters no intermediate reaches (all of them on the first stage, whose
input needs no gradient) get their gradient in ``W`` by autograd from the output. This
matches ``torch.distributed.pipelining``'s ``stage_backward_input``/``stage_backward_weight``
(``I + W`` costs about one fused backward); the graph is kept (``retain_graph``) until
``W`` is done because groups may pass through each other's nodes, and is freed with the
microbatch's state.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from deepcee.errors import ScheduleError
from deepcee.runtime import boundary

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node that receives ``t``'s gradient (its accumulator for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    # A leaf's AccumulateGrad node is created lazily; a view makes autograd create it.
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reverse_edges(roots: Iterable[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots``: the nodes that pass gradient into it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    queue = deque(seen)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _closure_up(starts: Iterable[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """Nodes from which one of ``starts`` is reachable (walking from ``starts`` towards the output)."""
    seen = set(starts)
    queue = deque(seen)
    while queue:
        for up in parents.get(queue.popleft(), ()):
            if up not in seen:
                seen.add(up)
                queue.append(up)
    return seen


def _params_below(node: Node, closure: set[Node], param_nodes: dict[Node, int]) -> set[int]:
    """Parameters reached from ``node`` through nodes outside the input closure."""
    found: set[int] = set()
    seen: set[Node] = set()
    stack = [child for child, _ in node.next_functions if child is not None and child not in closure]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in param_nodes:
            found.add(param_nodes[n])
        stack.extend(c for c, _ in n.next_functions if c is not None and c not in closure)
    return found


@dataclass(slots=True)
class WeightGroup:
    """Parameters whose gradients follow from the same intermediates. See [Note: split backward]."""

    params: list[nn.Parameter]
    intermediates: list[Node]
    saved: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


def _weight_groups(params: Sequence[nn.Parameter], input_nodes: Sequence[Node],
                   parents: dict[Node, list[Node]]) -> tuple[list[WeightGroup], list[nn.Parameter]]:
    """Group parameters by shared intermediates (union-find); also the parameters no intermediate reaches.

    One pass: every input-closure node looks down (outside the closure) for the parameters
    it feeds; those parameters have it as an intermediate. See [Note: split backward].
    """
    closure = _closure_up(input_nodes, parents)
    param_nodes = {grad_node(p): i for i, p in enumerate(params)}
    link = list(range(len(params)))

    def find(i: int) -> int:
        while link[i] != i:
            link[i] = link[link[i]]
            i = link[i]
        return i

    inter_params: dict[Node, list[int]] = {}
    for node in closure:
        below = _params_below(node, closure, param_nodes)
        if below:
            first, *rest = sorted(below)
            for j in rest:
                link[find(j)] = find(first)
            inter_params[node] = [first, *rest]
    groups: dict[int, WeightGroup] = {}
    covered: set[int] = set()
    for node, idx in inter_params.items():
        g = groups.setdefault(find(idx[0]), WeightGroup(params=[], intermediates=[]))
        g.intermediates.append(node)
        covered.update(idx)
    for i in sorted(covered):
        groups[find(i)].params.append(params[i])
    uncovered = [p for i, p in enumerate(params) if i not in covered and grad_node(p) in parents]
    return list(groups.values()), uncovered


@dataclass(slots=True)
class MicrobatchState:
    """What a microbatch leaves on a stage between its actions."""

    input: Any
    """The prepared input (a tensor or a structure, :mod:`deepcee.runtime.boundary`)."""
    output: Any
    """Stage output, or the weighted loss on the last stage (autograd graph attached); ``None``
    while a recomputing stage holds only the input (see [Note: recompute])."""
    replay: tuple | None = None
    """Recomputing stage: ``(targets, loss_scale, random state)`` to run the forward again."""
    outs: list[torch.Tensor] = field(default_factory=list)
    """The output tensors that get a gradient, and :attr:`output_grads` their gradients (set by I/B)."""
    output_grads: list[torch.Tensor] = field(default_factory=list)
    groups: list[WeightGroup] | None = None
    uncovered: list[nn.Parameter] = field(default_factory=list)
    input_grad_done: bool = False

    @property
    def ins(self) -> list[torch.Tensor]:
        """The input tensors that get a gradient."""
        return [t for t in boundary.tensors(self.input) if t.requires_grad]


class StageRunner:
    """Runs ``F``/``I``/``W``/``B`` for one device of a stage. See the module docstring.

    Inputs, outputs and their gradients may be structures of tensors ([Note: boundary
    gradients] in :mod:`deepcee.runtime.boundary`): the gradient of a structure has a tensor
    where the value gets a gradient and ``None`` elsewhere."""

    def __init__(self, blocks: Sequence[nn.Module], *, stage: int, is_first: bool, is_last: bool,
                 loss_fn: LossFn | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
                 recompute: bool = False) -> None:
        if is_last and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn")
        self.stage, self.is_first, self.is_last = stage, is_first, is_last
        self.autocast = autocast
        """Mixed-precision compute dtype (CUDA autocast); boundaries stay in ``dtype``."""
        self.recompute = recompute
        """Keep only the stage input between F and the backward ([Note: recompute])."""
        self.module = nn.Sequential(*blocks).to(device=device, dtype=dtype)
        self.loss_fn = loss_fn
        self.device, self.dtype = torch.device(device), dtype
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.input_grads: tuple[bool, ...] | None = None
        """Per input tensor, whether it gets a gradient (the agreed input meta's
        :attr:`~deepcee.runtime.boundary.BoundaryMeta.grad_mask`); ``None``: every floating one."""
        self._state: dict[int, MicrobatchState] = {}

    # -- helpers -------------------------------------------------------------------------
    def _get(self, microbatch: int, action: str) -> MicrobatchState:
        try:
            return self._state[microbatch]
        except KeyError:
            raise ScheduleError(f"stage {self.stage}: {action} of microbatch {microbatch} before its F") from None

    def prepare_input(self, x: Any) -> Any:
        """``x`` on this stage's device and dtype, detached; unless on the first stage, floating
        tensors that get a gradient are leaves requiring it."""
        spec, leaves = boundary.flatten(x)
        out, k = [], 0
        for t in leaves:
            if t is not None:
                t = t.to(self.device)
                t = (t.to(self.dtype) if t.is_floating_point() else t).detach()
                wanted = self.input_grads is None or (k < len(self.input_grads) and self.input_grads[k])
                if not self.is_first and t.is_floating_point() and wanted:
                    t.requires_grad_(True)
                k += 1
            out.append(t)
        return boundary.unflatten(spec, out)

    @property
    def in_flight(self) -> int:
        """Microbatches whose state is still held (forward done, weight gradient not yet)."""
        return len(self._state)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def output_grad_mask(self, microbatch: int) -> tuple[bool, ...]:
        """Per output tensor of a microbatch in flight, whether it gets a gradient (autograd tracks
        it); on a recomputing stage this runs the forward again now ([Note: recompute])."""
        st = self._rebuilt(self._get(microbatch, "mask"))
        return tuple(t.requires_grad for t in boundary.tensors(st.output))

    def discard(self) -> None:
        """Drop every microbatch's state (after forward-only work such as an evaluation)."""
        self._state.clear()

    # -- actions -------------------------------------------------------------------------
    def forward(self, microbatch: int, inputs: Any, targets: Any = None, loss_scale: float = 1.0) -> Any:
        """``F``: returns the output to send (detached), or the weighted loss on the last stage."""
        if microbatch in self._state:
            raise ScheduleError(f"stage {self.stage}: F of microbatch {microbatch} twice")
        x = self.prepare_input(inputs)
        if self.is_last and targets is None:
            raise ScheduleError(f"stage {self.stage}: last stage F of microbatch {microbatch} without targets")
        if not self.recompute:
            out = self._run(x, targets, loss_scale)
            self._state[microbatch] = MicrobatchState(input=x, output=out)
            return boundary.map_tensors(torch.Tensor.detach, out)
        rng = _rng_state(self.device)
        with torch.no_grad():
            out = self._run(x, targets, loss_scale)
        self._state[microbatch] = MicrobatchState(input=x, output=None, replay=(targets, loss_scale, rng))
        return out

    def _run(self, x: Any, targets: Any, loss_scale: float) -> Any:
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            out = self.module(x)
            if self.is_last:
                out = self.loss_fn(out, boundary.to_device(targets, self.device)) * loss_scale
        if self.autocast is not None:  # boundaries in the stage dtype: the shapes agreed at start-up
            out = boundary.map_tensors(lambda t: t.to(self.dtype) if t.is_floating_point() else t, out)
        return out

    def _rebuilt(self, st: MicrobatchState) -> MicrobatchState:
        """``st`` with its graph: the forward run again from the kept input and random state
        (see [Note: recompute]); unchanged when the stage does not recompute."""
        if st.output is None:
            targets, scale, rng = st.replay
            with _replaying(self.device, rng):
                st.output = self._run(st.input, targets, scale)
        return st

    def _take_output_grad(self, st: MicrobatchState, output_grad: Any) -> None:
        """Pair the output tensors that get a gradient with theirs (``st.outs``, ``st.output_grads``)."""
        if self.is_last:
            st.outs, st.output_grads = [st.output], [torch.ones_like(st.output)]
            return
        outs = boundary.flatten(st.output)[1]
        grads = [None] * len(outs) if output_grad is None else boundary.flatten(output_grad)[1]
        if len(grads) != len(outs):
            raise ScheduleError(f"stage {self.stage}: output gradient has {len(grads)} values, the output {len(outs)}")
        for o, g in zip(outs, grads, strict=True):
            if o is None or not o.requires_grad:
                continue
            if g is None:
                raise ScheduleError(f"stage {self.stage}: backward without the output gradient")
            st.outs.append(o)
            st.output_grads.append(g.to(device=self.device, dtype=o.dtype))

    def _input_grad(self, st: MicrobatchState, grads: Sequence[torch.Tensor | None]) -> Any:
        """The gradient of the stage input as a structure ([Note: boundary gradients]); zeros where
        the input gets a gradient the output does not depend on; ``None`` on the first stage."""
        if self.is_first:
            return None
        spec, leaves = boundary.flatten(st.input)
        it = iter(grads)
        out = []
        for t in leaves:
            if t is None or not t.requires_grad:
                out.append(None)
                continue
            g = next(it, None)
            out.append(torch.zeros_like(t) if g is None else g)
        return boundary.unflatten(spec, out)

    def backward_input(self, microbatch: int, output_grad: Any = None) -> Any:
        """``I``: the gradient of the stage input (``None`` on the first stage)."""
        st = self._get(microbatch, "I")
        if st.input_grad_done:
            raise ScheduleError(f"stage {self.stage}: I of microbatch {microbatch} twice")
        st = self._rebuilt(st)
        self._take_output_grad(st, output_grad)
        st.input_grad_done = True
        ins = st.ins
        if not any(o.requires_grad for o in st.outs):
            # Nothing the stage computed needs a gradient (parameter-less layers on an input
            # without gradient): no graph to walk, nothing for W.
            st.groups, st.uncovered = [], []
            return self._input_grad(st, [])
        parents = _reverse_edges([grad_node(o) for o in st.outs])
        st.groups, st.uncovered = _weight_groups(self.params, [grad_node(t) for t in ins], parents)
        if not ins:
            return None
        handles = []
        for g in st.groups:
            g.saved = [None] * len(g.intermediates)
            for i, node in enumerate(g.intermediates):
                handles.append(node.register_prehook(_saver(g.saved, i)))
        try:
            dinputs = torch.autograd.grad(st.outs, ins, st.output_grads, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        return self._input_grad(st, dinputs)

    def backward_weight(self, microbatch: int) -> None:
        """``W``: accumulate parameter gradients from what ``I`` saved; frees the microbatch."""
        st = self._get(microbatch, "W")
        if not st.input_grad_done:
            raise ScheduleError(f"stage {self.stage}: W of microbatch {microbatch} before its I")
        if st.uncovered:
            # Without groups (the first stage) this is the whole backward: let autograd free
            # the graph as it goes, exactly like B.
            torch.autograd.backward(st.outs, st.output_grads, inputs=st.uncovered, retain_graph=bool(st.groups))
        for g in st.groups or ():
            _group_backward(g)
        del self._state[microbatch]

    def backward(self, microbatch: int, output_grad: Any = None) -> Any:
        """``B``: input and parameter gradients in one pass; frees the microbatch."""
        st = self._get(microbatch, "B")
        if st.input_grad_done:
            raise ScheduleError(f"stage {self.stage}: B of microbatch {microbatch} after its I")
        st = self._rebuilt(st)
        self._take_output_grad(st, output_grad)
        live = [(o, g) for o, g in zip(st.outs, st.output_grads, strict=True) if o.requires_grad]
        if live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        del self._state[microbatch]
        return self._input_grad(st, [t.grad for t in st.ins])


def _rng_state(device: torch.device) -> tuple:
    """The random state a forward starts from (CPU, and the device's own on CUDA)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class _replaying:
    """Run a block of code from a saved random state, then put the current one back."""

    def __init__(self, device: torch.device, state: tuple) -> None:
        self.device, self.state = device, state

    def __enter__(self) -> None:
        self.saved = _rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)


def _saver(saved: list, i: int) -> Callable:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        saved[i] = grad_outputs
    return hook


def _replacer(grads: tuple[torch.Tensor | None, ...]) -> Callable:
    def hook(_grad_outputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return grads
    return hook


def _accumulate(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g.detach().clone() if g.requires_grad else g
        else:
            p.grad += g


def _group_backward(g: WeightGroup) -> None:
    edges, seeds = [], []
    for node, grads in zip(g.intermediates, g.saved, strict=True):
        for k, grad in enumerate(grads or ()):
            if grad is not None:
                edges.append(GradientEdge(node, k))
                seeds.append(grad)
    if not edges:
        return
    # Clamp: a path from one intermediate through another must not count twice.
    handles = [node.register_prehook(_replacer(grads)) for node, grads in zip(g.intermediates, g.saved, strict=True)
               if grads is not None and len(g.intermediates) > 1]
    try:
        weight_edges = [GradientEdge(grad_node(p), 0) for p in g.params]
        grads = torch.autograd.grad(edges, weight_edges, seeds, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    _accumulate(g.params, grads)
