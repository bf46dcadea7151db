"""Splitting a user's model into blocks (a pipeline stage is a contiguous run of them).

:func:`split_model` takes

- a list or tuple of modules: the blocks as given;
- an ``nn.Sequential`` or ``nn.ModuleList``: its children (a ``ModuleList`` as a chain, each
  child taking the previous one's output);
- a supported HuggingFace model (GPT-2, the Llama family, BERT): embeddings, each layer,
  final norm and head (:mod:`deepcee.nets.hf`);
- any other module with split points: ``points`` names the submodules where a new block
  begins (a point naming an ``nn.ModuleList``/``nn.Sequential`` begins a block at each of its
  children), and ``x = pipe_split(x)`` inside ``forward`` begins a block there; the model is
  traced with ``torch.fx`` and cut ([Note: traced split]);
- any other module without split points: one block.

In the spirit of ``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING`` and
``pipe_split()``, but the blocks form a *chain* (block ``i + 1`` takes block ``i``'s output),
which is what a pipeline of stages with several devices each needs.

Every way keeps the model's own submodules and parameters (no copies): a parameter that two
blocks use is one ``nn.Parameter``, found and kept in sync by :mod:`deepcee.runtime.params`.

[Note: traced split]
``torch.fx`` records ``forward`` as a graph; each node's ``nn_module_stack`` says which
submodules it ran in. A block begins at the first node inside each point's submodule (points
must come in ``forward`` order) and at each :func:`pipe_split` call. Block ``b`` is a
``GraphModule`` over the nodes of ``b``: block 0 takes the model's input (a dict of the
``forward`` arguments when there are several), block ``b > 0`` a dict of the values computed
before it and used at or after it (skip connections travel along the chain), and returns the
dict of values used after it (the last block returns the model's output). Parameters are read
where they are used (``get_attr`` repeated in each block that reads them), so nothing but
activations crosses a boundary. Values crossing a boundary must be tensors with the samples
first; a Python number computed in one block and used in a later one is an error at start-up
naming it (move the split point, or compute it from a tensor where it is used). Tracing needs
``forward`` without data-dependent Python control flow (``torch.fx``'s limits).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from deepcee.errors import SpecError
from deepcee.nets import hf
from deepcee.userref import import_object

log = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]


def pipe_split(x: Any) -> Any:
    """``x = pipe_split(x)`` in ``forward``: a new block begins here (when the model is split);
    returns ``x`` unchanged. Import it by name (``from deepcee.nets import pipe_split``) so the
    tracer sees the call; ``x`` must be a value the tracer follows (a tensor computed from the input)."""
    return x


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitModel:
    """A model as blocks, with names and, where the split knows one, a default loss."""

    blocks: tuple[nn.Module, ...]
    names: tuple[str, ...]
    how: str
    """``list``, ``sequential``, ``modulelist``, ``hf-gpt2``, ``hf-llama``, ``hf-bert``, ``traced``, ``whole``."""
    loss_fn: LossFn | None = None

    def __post_init__(self) -> None:
        if not self.blocks:
            raise SpecError("a model needs at least one block", field="model")
        if len(self.names) != len(self.blocks):
            raise SpecError(f"{len(self.names)} names for {len(self.blocks)} blocks", field="model")
        for i, b in enumerate(self.blocks):
            if not isinstance(b, nn.Module):
                raise SpecError(f"block {i} is a {type(b).__name__}, not a torch.nn.Module", field="model")


def split_model(model: Any, *, points: Sequence[str] = ()) -> SplitModel:
    """The blocks of ``model``. See the module docstring."""
    if isinstance(model, SplitModel):
        return model
    if isinstance(model, (list, tuple)):
        blocks = tuple(model)
        return SplitModel(blocks=blocks, names=tuple(f"layer{i}" for i in range(len(blocks))), how="list")
    if not isinstance(model, nn.Module):
        raise SpecError(f"expected a torch.nn.Module or a list of them, got {type(model).__name__}", field="model")
    if hf.is_hf_model(model) and not points:
        blocks, names, family = hf.hf_blocks(model)
        loss = hf.token_loss if names[-1] == "head" else None
        return SplitModel(blocks=tuple(blocks), names=tuple(names), how=f"hf-{family}", loss_fn=loss)
    if isinstance(model, (nn.Sequential, nn.ModuleList)) and not points:
        named = list(model.named_children())
        return SplitModel(blocks=tuple(m for _, m in named), names=tuple(n for n, _ in named),
                          how="sequential" if isinstance(model, nn.Sequential) else "modulelist")
    if points or _calls_pipe_split(model):
        return traced_split(model, points)
    log.info("%s has no split points: one block (data parallel only)", type(model).__name__)
    return SplitModel(blocks=(model,), names=(type(model).__name__,), how="whole")


def _calls_pipe_split(model: nn.Module) -> bool:
    """Whether some ``forward`` of the model refers to :func:`pipe_split` by name."""
    for m in model.modules():
        code = getattr(type(m).forward, "__code__", None)
        if code is not None and "pipe_split" in code.co_names:
            return True
    return False


# -- [Note: traced split] ----------------------------------------------------------------------


def _expand(model: nn.Module, points: Sequence[str]) -> list[str]:
    """Points with containers expanded to their children."""
    out = []
    for p in points:
        try:
            sub = model.get_submodule(p)
        except AttributeError:
            raise SpecError(f"split point {p!r} names no submodule of {type(model).__name__}", field="points") from None
        if isinstance(sub, (nn.ModuleList, nn.Sequential)):
            out += [f"{p}.{name}" for name, _ in sub.named_children()]
        else:
            out.append(p)
    return out


def _block_of_nodes(graph: fx.Graph, points: Sequence[str]) -> tuple[dict[fx.Node, int], list[str]]:
    """Each node's block, and each block's name: a new block at each point's first node and at
    each pipe_split call (never an empty one)."""
    pending = list(points)
    out: dict[fx.Node, int] = {}
    names, busy, marks = ["start"], False, []
    for node in list(graph.nodes):
        begin = None
        if node.op == "call_function" and node.target is pipe_split:
            begin = f"pipe_split{sum(n.startswith('pipe_split') for n in names)}"
        else:
            stack = list((node.meta.get("nn_module_stack") or {}).keys())
            if pending and any(k == pending[0] or k.startswith(pending[0] + ".") for k in stack):
                begin = pending.pop(0)
        if begin is not None:
            if busy:
                names.append(begin)
                busy = False
            else:
                names[-1] = begin
        if node.op == "call_function" and node.target is pipe_split:
            marks.append(node)
            continue
        out[node] = len(names) - 1
        busy = busy or node.op not in ("placeholder", "get_attr")
    for node in marks:  # the marks are identities: their users take their argument
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
    if pending:
        raise SpecError(f"split points {pending} were not reached in forward order (points must follow the order "
                        "forward runs the submodules in)", field="points")
    return out, names


def _cut(gm: fx.GraphModule, block_of: dict[fx.Node, int]) -> list[nn.Module]:
    """One GraphModule per block; see [Note: traced split]."""
    nodes = [n for n in gm.graph.nodes if n in block_of]
    last_use = {n: max((block_of[u] for u in n.users if u in block_of), default=block_of[n]) for n in nodes}
    num = max(block_of.values()) + 1
    return [fx.GraphModule(gm, _block_graph(b, num, nodes, block_of, last_use), class_name=f"Block{b}")
            for b in range(num)]


def _block_graph(b: int, num: int, nodes: Sequence[fx.Node], block_of: dict[fx.Node, int],
                 last_use: dict[fx.Node, int]) -> fx.Graph:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    carried = [n for n in nodes if n.op not in ("get_attr", "output")]
    if b == 0:
        placeholders = [n for n in nodes if n.op == "placeholder"]
        if len(placeholders) == 1:
            env[placeholders[0]] = g.placeholder(placeholders[0].name)
        else:
            args = g.placeholder("inputs")
            for p in placeholders:
                env[p] = g.call_function(operator.getitem, (args, p.name))
    else:
        live = g.placeholder("live")
        for n in carried:
            if block_of[n] < b <= last_use[n]:
                env[n] = g.call_function(operator.getitem, (live, n.name))
    for n in nodes:
        # parameters are read in every block that uses them, never carried
        if n.op == "get_attr" and any(block_of.get(u) == b for u in n.users) or (
                n.op not in ("placeholder", "output", "get_attr") and block_of[n] == b):
            env[n] = g.node_copy(n, env.__getitem__)
    if b == num - 1:
        (output,) = [n for n in nodes if n.op == "output"]
        g.output(fx.map_arg(output.args[0], env.__getitem__))
    else:
        g.output({n.name: env[n] for n in carried if block_of[n] <= b < last_use[n]})
    return g


class _Tracer(fx.Tracer):
    def __init__(self) -> None:
        super().__init__(autowrap_functions=(pipe_split,))


def traced_split(model: nn.Module, points: Sequence[str] = ()) -> SplitModel:
    """Cut ``model`` at ``points`` and :func:`pipe_split` calls. See [Note: traced split]."""
    expanded = _expand(model, points)
    try:
        graph = _Tracer().trace(model)
    except Exception as exc:  # fx's errors are of many kinds; all mean "cannot trace this forward"
        raise SpecError(f"cannot trace {type(model).__name__}.forward with torch.fx to split it ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]}); give the blocks yourself (a list of modules)",
                        field="model") from None
    gm = fx.GraphModule(model, graph)
    block_of, names = _block_of_nodes(gm.graph, expanded)
    return SplitModel(blocks=tuple(_cut(gm, block_of)), names=tuple(names), how="traced")


# -- a model named by an import path -------------------------------------------------------------


def build_user_model(obj: Any, *, seed: int = 0, points: Sequence[str] = ()) -> SplitModel:
    """A user's model from a module, a list of blocks, an import path or a builder.

    A builder (a callable; from an import path too) returns a module or blocks, or ``(model,
    loss_fn)``; it runs with torch's RNG seeded from ``seed`` (and the caller's RNG state left
    as it was), so every process that builds it gets the same weights."""
    if isinstance(obj, str):
        obj = import_object(obj, what="model")
    loss = None
    if callable(obj) and not isinstance(obj, nn.Module):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            obj = obj()
        if isinstance(obj, tuple) and len(obj) == 2 and callable(obj[1]) and not isinstance(obj[1], nn.Module):
            obj, loss = obj
    split = split_model(obj, points=points)
    if loss is not None:
        split = SplitModel(blocks=split.blocks, names=split.names, how=split.how, loss_fn=loss)
    return split

