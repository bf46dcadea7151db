"""HuggingFace ``transformers`` models as blocks: embeddings, each layer, final norm, head.

:func:`hf_blocks` splits GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``), the Llama family
(``LlamaForCausalLM``, ``LlamaModel`` and models built the same way: ``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) and BERT encoders
(``BertModel``, ``BertForMaskedLM``). The blocks hold the model's own submodules (no copies),
so a tied embedding and LM head stay one ``nn.Parameter`` (kept in sync across stages by
:mod:`deepcee.runtime.params`) and the trained weights load back into the model by name.

Inputs: ``input_ids`` as a tensor, or a dict with ``input_ids`` and optionally
``attention_mask`` (1 = a real token; padding otherwise) and, for BERT, ``token_type_ids``.

[Note: what an HF boundary carries]
Between blocks the value is a dict: ``hidden`` (the hidden states, the only tensor that gets a
gradient), ``attention_mask`` (the 2-D padding mask, when the input had one), and for the
Llama family ``position_ids`` and the rotary ``cos``/``sin`` the model computes once and every
layer uses (carried as HF's model-level ``forward`` passes them to each layer; they get no
gradient). The 4-D attention mask is not carried: each layer block rebuilds it from the 2-D
mask with the model's own ``create_causal_mask``/``create_bidirectional_mask``, which costs
far less than sending ``T x T`` values per sample (and is ``None`` for unpadded input on sdpa).
Everything carried holds the samples first, so a device's share is a slice of each tensor.
The final norm (or, for BERT, the head) returns the hidden states alone.

Losses (:func:`token_loss`): cross-entropy per token, ignoring targets of ``-100``, averaged
over each sample's tokens and then over samples, so the runtime's weighting by samples
([Note: loss weighting] in :mod:`deepcee.runtime.trainer`) is exact even when samples have
different numbers of counted tokens. Targets are the tokens to predict at each position (the
next tokens for a causal LM: deepcee's text data gives them shifted; HF's ``labels =
input_ids`` convention must be shifted first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepcee.errors import SpecError


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per token (targets ``-100`` ignored), mean per sample, then over samples."""
    n = logits.shape[0]
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                                reduction="none").view(n, -1)
    counted = (targets.reshape(n, -1) != -100).sum(dim=1).clamp(min=1)
    return (per_token.sum(dim=1) / counted).mean()


def _unpack(x: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(input_ids, other inputs)`` of a block-0 input (a tensor or a dict)."""
    if isinstance(x, torch.Tensor):
        return x, {}
    if isinstance(x, dict) and "input_ids" in x:
        return x["input_ids"], {k: v for k, v in x.items() if k != "input_ids"}
    raise SpecError(f"a HuggingFace model's input must be input_ids or a dict with 'input_ids', got "
                    f"{type(x).__name__}", field="data")


def _layer_out(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _hidden(x: Any) -> torch.Tensor:
    return x["hidden"] if isinstance(x, dict) else x


def _with_mask(state: dict[str, torch.Tensor], mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if mask is not None:
        state["attention_mask"] = mask
    return state


# -- GPT-2 -----------------------------------------------------------------------------------


class GPT2Embed(nn.Module):
    """Token + position embeddings and dropout of a ``GPT2Model``."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = base.wte, base.wpe, base.drop

    def forward(self, x: Any) -> dict[str, torch.Tensor]:
        ids, other = _unpack(x)
        pos = other.get("position_ids")
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        hidden = self.drop(self.wte(ids) + self.wpe(pos))
        return _with_mask({"hidden": hidden}, other.get("attention_mask"))


class GPT2Layer(nn.Module):
    """One ``GPT2Block``, its causal mask rebuilt from the carried padding mask."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer, self.config = layer, config

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from transformers.masking_utils import create_causal_mask

        hidden, mask2d = x["hidden"], x.get("attention_mask")
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask2d,
                                  past_key_values=None)
        return _with_mask({"hidden": _layer_out(self.layer(hidden, attention_mask=mask))}, mask2d)


class Norm(nn.Module):
    """The final norm; returns the hidden states alone."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Any) -> torch.Tensor:
        return self.norm(_hidden(x))


class Head(nn.Module):
    """The output head (logits from the hidden states)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, x: Any) -> torch.Tensor:
        return self.head(_hidden(x))


def _gpt2(model: nn.Module) -> tuple[list[nn.Module], list[str]]:
    base = getattr(model, "transformer", model)
    blocks: list[nn.Module] = [GPT2Embed(base), *(GPT2Layer(h, base.config) for h in base.h), Norm(base.ln_f)]
    names = ["embed", *(f"layer{i}" for i in range(len(base.h))), "norm"]
    if hasattr(model, "lm_head"):
        blocks.append(Head(model.lm_head))
        names.append("head")
    return blocks, names


# -- the Llama family -----------------------------------------------------------------------


class LlamaEmbed(nn.Module):
    """Token embedding, position ids and the rotary ``cos``/``sin`` every layer uses."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.embed_tokens, self.rotary_emb = base.embed_tokens, base.rotary_emb

    def forward(self, x: Any) -> dict[str, torch.Tensor]:
        ids, other = _unpack(x)
        hidden = self.embed_tokens(ids)
        pos = other.get("position_ids")
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        cos, sin = self.rotary_emb(hidden, position_ids=pos)
        state = {"hidden": hidden, "position_ids": pos, "cos": cos, "sin": sin}
        return _with_mask(state, other.get("attention_mask"))


class LlamaLayer(nn.Module):
    """One decoder layer, with the carried position ids and rotary embeddings."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer, self.config = layer, config

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from transformers.masking_utils import create_causal_mask

        hidden, pos, mask2d = x["hidden"], x["position_ids"], x.get("attention_mask")
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask2d,
                                  past_key_values=None, position_ids=pos)
        out = _layer_out(self.layer(hidden, attention_mask=mask, position_ids=pos,
                                    position_embeddings=(x["cos"], x["sin"])))
        return _with_mask({"hidden": out, "position_ids": pos, "cos": x["cos"], "sin": x["sin"]}, mask2d)


def _llama(model: nn.Module) -> tuple[list[nn.Module], list[str]]:
    base = getattr(model, "model", model)
    blocks: list[nn.Module] = [LlamaEmbed(base), *(LlamaLayer(h, base.config) for h in base.layers),
                               Norm(base.norm)]
    names = ["embed", *(f"layer{i}" for i in range(len(base.layers))), "norm"]
    if hasattr(model, "lm_head"):
        blocks.append(Head(model.lm_head))
        names.append("head")
    return blocks, names


# -- BERT -----------------------------------------------------------------------------------


class BertEmbed(nn.Module):
    """``BertEmbeddings`` (word, position, token type, LayerNorm, dropout)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.embeddings = base.embeddings

    def forward(self, x: Any) -> dict[str, torch.Tensor]:
        ids, other = _unpack(x)
        hidden = self.embeddings(input_ids=ids, token_type_ids=other.get("token_type_ids"),
                                 position_ids=other.get("position_ids"))
        return _with_mask({"hidden": hidden}, other.get("attention_mask"))


class BertLayer(nn.Module):
    """One encoder layer, its bidirectional mask rebuilt from the carried padding mask; the last
    layer of a ``BertModel`` returns the hidden states alone."""

    def __init__(self, layer: nn.Module, config: Any, *, last: bool) -> None:
        super().__init__()
        self.layer, self.config, self.last = layer, config, last

    def forward(self, x: dict[str, torch.Tensor]) -> Any:
        from transformers.masking_utils import create_bidirectional_mask

        hidden, mask2d = x["hidden"], x.get("attention_mask")
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask2d)
        out = _layer_out(self.layer(hidden, attention_mask=mask))
        return out if self.last else _with_mask({"hidden": out}, mask2d)


def _bert(model: nn.Module) -> tuple[list[nn.Module], list[str]]:
    base = getattr(model, "bert", model)
    layers = base.encoder.layer
    head = getattr(model, "cls", None)
    blocks: list[nn.Module] = [BertEmbed(base), *(BertLayer(h, base.config, last=head is None and i == len(layers) - 1)
                                                  for i, h in enumerate(layers))]
    names = ["embed", *(f"layer{i}" for i in range(len(layers)))]
    if head is not None:
        blocks.append(Head(head))
        names.append("head")
    return blocks, names


# -- dispatch -------------------------------------------------------------------------------


def _family(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    base_llama = getattr(model, "model", model)
    if kind == "gpt2":
        return "gpt2"
    if kind == "bert":
        return "bert"
    if all(hasattr(base_llama, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "llama"
    return None


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a ``transformers`` model (without importing transformers)."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def hf_blocks(model: nn.Module) -> tuple[list[nn.Module], list[str], str]:
    """``(blocks, names, family)`` of a supported HuggingFace model. See the module docstring."""
    family = _family(model)
    if family is None:
        raise SpecError(f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r}) "
                        "is not a supported HuggingFace model (GPT-2, the Llama family, BERT); give split points "
                        "(deepcee.nets.split_model(model, points=[...])) or your own blocks", field="model")
    blocks, names = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}[family](model)
    return blocks, names, family
