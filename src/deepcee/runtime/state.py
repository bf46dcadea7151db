"""A model's state under its own names: what checkpoints, export and pretrained weights are keyed by.

[Note: state names]
A run splits the model into blocks and each stage holds a slice of them, so a tensor's key
inside a stage (``0.weight`` of the stage's ``nn.Sequential``) says nothing once the split
changes. Checkpoints therefore key every tensor by its name in the *plain model*, the object
a user would ``load_state_dict`` into:

- a user's module (an ``nn.Sequential``, ``nn.ModuleList``, or any module that
  :func:`deepcee.nets.as_blocks` splits): the module's own ``state_dict`` names, found by
  object identity between the blocks' tensors and the module's, so wrappers that a splitter
  puts around a module's parts keep the module's names;
- a list of blocks: ``nn.ModuleList(blocks)``'s names (``<i>.<name>``);
- a built-in net: block-qualified names, ``<block name>.<name>`` (``embed.tok.weight``,
  ``block0.attn.qkv.weight``), the keys of :func:`builtin_model`.

A tensor held under several names (a tied embedding and LM head) is stored once, under its
*primary* name (the first in the plain model's ``state_dict`` order), and carries its other
names as aliases, so an export writes every key and loads with ``strict=True``. Parameters
and persistent buffers are both state (a ResNet's running statistics). :class:`StateNames`
is computed where the user's object is (before a model is packed for the ranks) and travels
with the blocks.
"""

from __future__ import annotations

import logging
import pickle
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepcee import nets
from deepcee.errors import RuntimeSetupError

log = logging.getLogger(__name__)

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


@dataclass(frozen=True, slots=True, kw_only=True)
class StateNames:
    """Every block's state keys mapped to their primary names. See [Note: state names]."""

    blocks: tuple[tuple[tuple[str, str], ...], ...]
    """Per block: ``(key in the block's state_dict, primary name)``."""
    aliases: tuple[tuple[str, tuple[str, ...]], ...]
    """Per tensor, in the plain model's order: ``(primary name, every name, primary first)``."""

    def block(self, i: int) -> dict[str, str]:
        return dict(self.blocks[i])

    def names_of(self, primary: str) -> tuple[str, ...]:
        return dict(self.aliases)[primary]

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every key of the plain model's ``state_dict``."""
        return tuple(n for _, names in self.aliases for n in names)

    def owner_blocks(self) -> dict[str, tuple[int, ...]]:
        """Primary name -> the blocks that hold the tensor."""
        out: dict[str, set[int]] = defaultdict(set)
        for i, entries in enumerate(self.blocks):
            for _, primary in entries:
                out[primary].add(i)
        return {k: tuple(sorted(v)) for k, v in out.items()}


def builtin_model(name: str, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """A built-in net as one plain module whose ``state_dict`` keys are the checkpoints' names."""
    blocks, _ = nets.build(name, seed, dtype=dtype)
    return nn.Sequential(OrderedDict(zip(nets.block_names(name), blocks, strict=True)))


def state_names(model: Any, blocks: Sequence[nn.Module] | None = None) -> StateNames:
    """The names of ``model``'s state (a built-in net's name with its ``blocks``, a user's
    module, or a list of blocks). See [Note: state names]."""
    if isinstance(model, str):
        if blocks is None:
            blocks = nets.build(model)[0]
        root: nn.Module = nn.Sequential(OrderedDict(zip(nets.block_names(model), blocks, strict=True)))
    elif isinstance(model, nn.Module):
        root, blocks = model, nets.as_blocks(model) if blocks is None else blocks
    else:
        blocks = nets.as_blocks(model) if blocks is None else blocks
        root = nn.ModuleList(blocks)
    return _names(root, blocks)


def _names(root: nn.Module, blocks: Sequence[nn.Module]) -> StateNames:
    names_of: dict[int, list[str]] = defaultdict(list)
    keep = []  # holds every tensor while ids are compared (an id is unique only while alive)
    for name, t in root.state_dict(keep_vars=True).items():
        names_of[id(t)].append(name)
        keep.append(t)
    per_block, extra = [], {}
    for i, block in enumerate(blocks):
        entries = []
        for local, t in block.state_dict(keep_vars=True).items():
            found = names_of.get(id(t))
            if found is None:  # a tensor the splitter created: no name in the user's module
                extra.setdefault(id(t), [f"{i}.{local}"])
                keep.append(t)
                found = extra[id(t)]
            entries.append((local, found[0]))
        per_block.append(tuple(entries))
    if extra:
        log.warning("%d tensors of the blocks are not in the model's state_dict; named by block: %s",
                    len(extra), ", ".join(v[0] for v in list(extra.values())[:3]))
    used = {p for entries in per_block for _, p in entries}
    aliases = [(v[0], tuple(v)) for v in [*names_of.values(), *extra.values()] if v[0] in used]
    return StateNames(blocks=tuple(per_block), aliases=tuple(aliases))


# -- one stage's state, by name ---------------------------------------------------------


def stage_tensors(blocks: Sequence[nn.Module], names: StateNames, start: int, stop: int) -> dict[str, torch.Tensor]:
    """Primary name -> tensor (detached, sharing storage) of blocks ``start..stop-1``, each once."""
    out: dict[str, torch.Tensor] = {}
    for b in range(start, stop):
        local = names.block(b)
        for key, t in blocks[b].state_dict(keep_vars=True).items():
            out.setdefault(local[key], t.detach())
    return out


def param_names(blocks: Sequence[nn.Module], names: StateNames, start: int, stop: int,
                params: Iterable[nn.Parameter]) -> list[str]:
    """The primary name of each of ``params`` (parameters of blocks ``start..stop-1``)."""
    by_id = {}
    for b in range(start, stop):
        local = names.block(b)
        for key, t in blocks[b].state_dict(keep_vars=True).items():
            by_id.setdefault(id(t), local[key])
    try:
        return [by_id[id(p)] for p in params]
    except KeyError:
        raise RuntimeSetupError("a parameter of the stage is not in its blocks' state_dict") from None


def optimizer_tensors(optimizer: torch.optim.Optimizer, pnames: Sequence[str]) -> dict[str, torch.Tensor]:
    """``<primary>/<state key>`` -> tensor of every per-parameter optimizer state tensor."""
    state = optimizer.state_dict()["state"]
    out = {}
    for i, name in enumerate(pnames):
        for key, v in state.get(i, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"{name}/{key}"] = v
    return out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, pnames: Sequence[str],
                           flat: Mapping[str, torch.Tensor]) -> int:
    """Give ``optimizer`` the state in ``flat`` (``<primary>/<state key>`` -> tensor); returns
    how many parameters got state. Hyper-parameters stay the optimizer's own."""
    grouped: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for k, v in flat.items():
        name, key = k.rsplit("/", 1)
        grouped[name][key] = v
    sd = optimizer.state_dict()
    sd["state"] = {i: grouped[name] for i, name in enumerate(pnames) if name in grouped}
    optimizer.load_state_dict(sd)
    return len(sd["state"])


# -- a whole model's weights from a file (pretrained weights, an export) ------------------


def read_state_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A full ``state_dict`` from a ``.safetensors`` file or a ``torch.save`` file (a plain
    ``state_dict``, or one under a ``model`` / ``state_dict`` key)."""
    p = Path(path)
    if p.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise RuntimeSetupError(f"{p}: reading .safetensors needs the safetensors package "
                                    "(pip install safetensors)") from None
        try:
            return load_file(str(p))
        except (OSError, ValueError, RuntimeError) as exc:
            raise RuntimeSetupError(f"{p}: cannot read weights: {str(exc).splitlines()[0][:200]}") from None
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        raise RuntimeSetupError(f"{p}: cannot read weights: {str(exc).splitlines()[0][:200]}") from None
    for key in ("model", "state_dict"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            data = data[key]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise RuntimeSetupError(f"{p}: expected a state_dict (names -> tensors), got {type(data).__name__}")
    return data


def check_names(names: StateNames, available: Iterable[str], *, source: str) -> None:
    """``strict=True`` for pretrained weights: every name of the model present, nothing else."""
    have = set(available)
    want = set(names.all_names)
    primaries = {p for p, _ in names.aliases}
    missing = sorted(p for p, every in names.aliases if not have & set(every))
    unexpected = sorted(have - want - primaries)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} names ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        if unexpected:
            parts.append(f"{len(unexpected)} names the model does not have "
                         f"({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''})")
        raise RuntimeSetupError(f"{source}: weights do not match the model: {'; '.join(parts)}")


def copy_into(targets: Mapping[str, torch.Tensor], names: StateNames, weights: Mapping[str, torch.Tensor], *,
              source: str) -> None:
    """Copy ``weights`` (any name of a tensor) into this stage's ``targets`` (primary name ->
    tensor), converting dtype; shapes must match."""
    for primary, t in targets.items():
        src = next((weights[n] for n in names.names_of(primary) if n in weights), None)
        if src is None:
            raise RuntimeSetupError(f"{source}: no weights for {primary}")
        if tuple(src.shape) != tuple(t.shape):
            raise RuntimeSetupError(f"{source}: {primary} has shape {tuple(src.shape)}, the model {tuple(t.shape)}")
        with torch.no_grad():
            t.copy_(src)
