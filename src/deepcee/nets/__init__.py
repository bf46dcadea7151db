"""Small torch models as lists of blocks (a pipeline stage is a contiguous slice).

``build(name, seed)`` returns ``(blocks, loss_fn)`` for a built-in net (``gpt-tiny``,
``resnet-tiny``, ``convnet-tiny``); :func:`split_model` (:mod:`deepcee.nets.split`) turns a user's model into
blocks: an ``nn.Sequential``/``nn.ModuleList``'s children, a list of modules, a HuggingFace
GPT-2/Llama/BERT model (:mod:`deepcee.nets.hf`), or any module cut at split points
(``points=[...]`` or :func:`pipe_split` in its ``forward``); ``as_blocks(obj)`` is its block list. A ``loss_fn(output, targets)`` must return the *mean* loss over the samples
it is given: the runtime weights each slice by ``samples / global_batch`` so that the sum
over devices and microbatches is the mean over the global batch.

Block ``i`` of a built-in net is initialised from its own seed (``seed``, ``i``), so any
rank that builds the net gets bit-identical blocks whatever else it builds, and the
caller's global RNG state is left untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from deepcee.errors import SpecError
from deepcee.nets import convnet_tiny, gpt_tiny, resnet_tiny
from deepcee.nets.split import SplitModel, build_user_model, pipe_split, split_model

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True)
class NetSpec:
    """A built-in net: its block names, block factory and loss."""

    name: str
    block_names: tuple[str, ...]
    make_block: Callable[[str], nn.Module]
    loss_fn: LossFn


NETS: dict[str, NetSpec] = {
    "gpt-tiny": NetSpec(name="gpt-tiny", block_names=gpt_tiny.BLOCK_NAMES,
                        make_block=gpt_tiny.make_block, loss_fn=gpt_tiny.loss_fn),
    "resnet-tiny": NetSpec(name="resnet-tiny", block_names=resnet_tiny.BLOCK_NAMES,
                           make_block=resnet_tiny.make_block, loss_fn=resnet_tiny.loss_fn),
    "convnet-tiny": NetSpec(name="convnet-tiny", block_names=convnet_tiny.BLOCK_NAMES,
                            make_block=convnet_tiny.make_block, loss_fn=convnet_tiny.loss_fn),
}
NET_NAMES: tuple[str, ...] = tuple(NETS)


def net_spec(name: str) -> NetSpec:
    try:
        return NETS[name]
    except KeyError:
        raise SpecError(f"unknown net {name!r} (known: {', '.join(NET_NAMES)})", field="model") from None


def block_names(name: str) -> tuple[str, ...]:
    return net_spec(name).block_names


def build(name: str, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> tuple[list[nn.Module], LossFn]:
    """All blocks of net ``name`` (deterministic in ``seed``) and its loss function."""
    spec = net_spec(name)
    blocks = []
    for i, block in enumerate(spec.block_names):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + i)
            blocks.append(spec.make_block(block).to(dtype))
    return blocks, spec.loss_fn


def as_blocks(obj: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    """Blocks of a user model (:func:`split_model`): an ``nn.Sequential``/``nn.ModuleList``'s
    children, a list of modules, a supported HuggingFace model's blocks, a module cut at its
    :func:`pipe_split` calls, or the module itself."""
    if not isinstance(obj, (nn.Module, SplitModel)):
        obj = list(obj)
    return list(split_model(obj).blocks)


__all__ = ["NET_NAMES", "NETS", "LossFn", "NetSpec", "SplitModel", "as_blocks", "block_names", "build",
           "build_user_model", "net_spec", "pipe_split", "split_model"]
