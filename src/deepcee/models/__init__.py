"""Built-in analytic model profiles, torch-free: ``get_model(name) -> ModelProfile``.

Names (see :func:`model_names`): GPT-2 ``gpt2`` / ``gpt2-medium`` / ``gpt2-xl`` (seq_len 1024),
BERT ``bert-small`` / ``bert-base`` (seq_len 128), a Llama-style decoder ``llama`` (LLaMA-7B
shape unless overridden) with presets ``llama-7b`` and ``llama-1b`` (TinyLlama-1.1B shape;
seq_len 2048), ``resnet50`` / ``resnet101`` / ``efficientnet-b0`` (224x224, 1000 classes) and
their ``-cifar`` variants (32x32, 10 classes; only the classifier's parameters differ), and the
three tiny models that deepcee.nets also builds, ``gpt-tiny``, ``resnet-tiny`` and ``convnet-tiny`` (fp32 by
default). How FLOPs, stashed activations and tied embeddings are counted is described in
:mod:`deepcee.models.transformer` (see [Note: tied embeddings]) and :mod:`deepcee.models.cnn`.

Training dtype and optimizer set the per-parameter bytes (``ModelProfile``):

- ``gradient_bytes_per_parameter`` = bytes of the dtype (fp16/bf16: 2, fp32: 4);
- ``state_bytes_per_parameter``: Adam 16 in both cases (mixed precision: 2-byte parameter and
  gradient + fp32 master copy, m and v; fp32: parameter, gradient, m, v); SGD with momentum 12
  (2 + 2 + fp32 master 4 + momentum 4; or fp32 parameter, gradient, momentum).

``ModelProfile.hyper`` holds the shape parameters and ``published_parameter_count`` with
``published_parameter_count_source`` (``None`` where no published figure applies: overridden
shapes, CIFAR variants, tiny models).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from deepcee.errors import ProfileError
from deepcee.inputs.limits import IMAGE_SIZE, MAX_LAYERS, SEQ_LEN, VOCAB, WIDTH, Limit
from deepcee.models.cnn import cnn_layers
from deepcee.models.transformer import (
    LLAMA_OVERRIDES,
    PRESETS,
    TOKEN_ID_BYTES,
    TransformerSpec,
    llama_spec,
    transformer_layers,
)
from deepcee.profile import ModelProfile

__all__ = ["DTYPE_BYTES", "MODEL_OPTIONS", "STATE_BYTES_PER_PARAMETER", "get_model", "model_names", "parse_model_ref"]

logger = logging.getLogger(__name__)

DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}
"""Training dtype -> bytes per element."""

STATE_BYTES_PER_PARAMETER: dict[tuple[str, int], float] = {
    ("adam", 2): 16.0,  # 2-byte param + 2-byte grad + fp32 master, m, v
    ("adam", 4): 16.0,  # fp32 param, grad, m, v
    ("sgd", 2): 12.0,  # 2-byte param + 2-byte grad + fp32 master + fp32 momentum
    ("sgd", 4): 12.0,  # fp32 param, grad, momentum
}
"""(optimizer, dtype bytes) -> parameter + gradient + optimizer-state bytes per parameter."""


@dataclass(frozen=True, slots=True)
class _Cnn:
    arch: str
    num_classes: int
    image_size: int


_CNNS: dict[str, _Cnn] = {
    "resnet50": _Cnn("resnet50", 1000, 224),
    "resnet101": _Cnn("resnet101", 1000, 224),
    "efficientnet-b0": _Cnn("efficientnet-b0", 1000, 224),
    "resnet50-cifar": _Cnn("resnet50", 10, 32),
    "resnet101-cifar": _Cnn("resnet101", 10, 32),
    "efficientnet-b0-cifar": _Cnn("efficientnet-b0", 10, 32),
    "resnet-tiny": _Cnn("resnet-tiny", 10, 32),
    "convnet-tiny": _Cnn("convnet-tiny", 6, 16),
}

_DEFAULT_DTYPE: dict[str, str] = {"gpt-tiny": "fp32", "resnet-tiny": "fp32", "convnet-tiny": "fp32"}
"""Models whose default dtype is not fp16 (the tiny models train in fp32 on CPU)."""

PUBLISHED_PARAMETER_COUNTS: dict[str, tuple[int, str]] = {
    "gpt2": (124_000_000, "OpenAI gpt-2 release, model '124M' (HF model card: 124M)"),
    "gpt2-medium": (355_000_000, "OpenAI gpt-2 release, model '355M'"),
    "gpt2-xl": (1_558_000_000, "OpenAI gpt-2 release, model '1558M'"),
    "bert-small": (29_100_000, "Turc et al. 2019, arXiv:1908.08962 (BERT-Small, 29.1M)"),
    "bert-base": (110_000_000, "Devlin et al. 2019, BERT paper (BERT-BASE, 110M)"),
    "llama-7b": (6_700_000_000, "Touvron et al. 2023, LLaMA paper Table 2 (6.7B)"),
    "llama-1b": (1_100_000_000, "Zhang et al. 2024, TinyLlama (1.1B)"),
    "resnet50": (25_557_032, "torchvision ResNet50_Weights.IMAGENET1K_V1 num_params"),
    "resnet101": (44_549_160, "torchvision ResNet101_Weights.IMAGENET1K_V1 num_params"),
    "efficientnet-b0": (5_288_548, "torchvision EfficientNet_B0_Weights.IMAGENET1K_V1 num_params"),
}
"""Model name -> (published parameter count, source), for the shapes as built by default."""


def model_names() -> list[str]:
    """Every name :func:`get_model` accepts."""
    return [*PRESETS, *_CNNS]


def _resolve_dtype(name: str, dtype: str | None, optimizer: str) -> tuple[str, int, float]:
    dtype = _DEFAULT_DTYPE.get(name, "fp16") if dtype is None else dtype
    if dtype not in DTYPE_BYTES:
        raise ProfileError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    nbytes = DTYPE_BYTES[dtype]
    if (optimizer, nbytes) not in STATE_BYTES_PER_PARAMETER:
        raise ProfileError(f"unknown optimizer {optimizer!r}; known: adam, sgd")
    return dtype, nbytes, STATE_BYTES_PER_PARAMETER[(optimizer, nbytes)]


def _transformer_spec(name: str, overrides: dict[str, Any]) -> TransformerSpec:
    base = PRESETS[name]
    if not overrides:
        return base
    if not name.startswith("llama"):
        raise ProfileError(
            f"model {name!r} takes no shape overrides, got {sorted(overrides)}; "
            f"only the llama family does ({', '.join(LLAMA_OVERRIDES)})"
        )
    unknown = sorted(set(overrides) - set(LLAMA_OVERRIDES))
    if unknown:
        raise ProfileError(
            f"unknown override(s) {unknown} for model {name!r}; known: {', '.join(LLAMA_OVERRIDES)}"
        )
    shape = {key: getattr(base, key) for key in LLAMA_OVERRIDES} | overrides
    return llama_spec(**shape, default_seq_len=base.default_seq_len)


def _published(name: str, unchanged: bool) -> dict[str, Any]:
    count, source = (
        PUBLISHED_PARAMETER_COUNTS.get(name, (None, None)) if unchanged else (None, None)
    )
    return {"published_parameter_count": count, "published_parameter_count_source": source}


MODEL_OPTIONS: dict[str, Limit | tuple[str, ...]] = {
    "seq_len": SEQ_LEN,
    "image_size": IMAGE_SIZE,
    "dtype": tuple(DTYPE_BYTES),
    "optimizer": ("adam", "sgd"),
    "hidden_size": WIDTH,
    "num_layers": Limit(name="transformer blocks", lo=1, hi=MAX_LAYERS - 2, integer=True),
    "num_heads": WIDTH,
    "num_kv_heads": WIDTH,
    "ffn_size": WIDTH,
    "vocab_size": VOCAB,
}
"""Options of a model reference (``llama:hidden_size=1024,num_layers=8``) and their ranges
(:mod:`deepcee.inputs.limits`); which model takes which is checked by :func:`get_model`."""


def parse_model_ref(ref: str, *, field: str = "--model") -> tuple[str, dict[str, Any]]:
    """``gpt2`` or ``gpt2:seq_len=512,dtype=fp32`` -> ``(name, keyword arguments)`` for
    :func:`get_model`; each option's value checked (one-line :class:`ProfileError` naming ``field``)."""
    name, _, rest = ref.partition(":")
    if not name:
        raise ProfileError(f"expected a model name before ':' in {ref!r}", field=field)
    kwargs: dict[str, Any] = {}
    for item in rest.split(",") if rest else ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ProfileError(f"expected key=value after {name}:, got {item!r}", field=field)
        if key in kwargs:
            raise ProfileError(f"{key} given twice in {ref!r}", field=field)
        kwargs[key] = _option(key, value, field)
    return name, kwargs


def _option(key: str, text: str, field: str) -> Any:
    rule = MODEL_OPTIONS.get(key)
    if rule is None:
        raise ProfileError(f"unknown option {key!r} (known: {', '.join(MODEL_OPTIONS)})", field=field)
    if isinstance(rule, tuple):
        if text not in rule:
            raise ProfileError(f"{key}: expected one of {', '.join(rule)}; got {text!r}", field=field)
        return text
    try:
        return rule.check(int(text) if text.isascii() and text.lstrip("-").isdigit() else text)
    except ValueError as exc:
        raise ProfileError(f"{key}: {exc}", field=field) from None


def _check_options(values: dict[str, Any]) -> None:
    """The options :func:`get_model` was called with, against :data:`MODEL_OPTIONS`."""
    for key, value in values.items():
        rule = MODEL_OPTIONS.get(key)
        if value is None or rule is None or isinstance(rule, tuple):
            continue
        try:
            rule.check(value)
        except ValueError as exc:
            raise ProfileError(f"{key}: {exc}", field=key) from None


def get_model(
    name: str,
    *,
    seq_len: int | None = None,
    image_size: int | None = None,
    dtype: str | None = None,
    optimizer: str = "adam",
    **overrides: int,
) -> ModelProfile:
    """Analytic profile of a built-in model.

    ``seq_len`` (transformers) and ``image_size`` (CNNs) default to the model's own; ``dtype``
    is fp16, bf16 or fp32 (default fp16, fp32 for the tiny models); ``optimizer`` is adam or
    sgd (with momentum). ``overrides`` set Llama shape fields (``hidden_size``, ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``ffn_size``, ``vocab_size``). Raises ProfileError naming
    the bad value.
    """
    if name not in PRESETS and name not in _CNNS:
        raise ProfileError(f"unknown model {name!r}; known: {', '.join(model_names())}")
    _check_options({"seq_len": seq_len, "image_size": image_size, **overrides})
    dtype, nbytes, state_bytes = _resolve_dtype(name, dtype, optimizer)
    if name in PRESETS:
        if image_size is not None:
            raise ProfileError(f"model {name!r} takes seq_len, not image_size={image_size!r}")
        spec = _transformer_spec(name, overrides)
        s = spec.default_seq_len if seq_len is None else seq_len
        layers = transformer_layers(spec, seq_len=s, dtype_bytes=nbytes)
        input_bytes = float(s * TOKEN_ID_BYTES)
        hyper = {
            "seq_len": s,
            "hidden_size": spec.hidden_size,
            "num_layers": spec.num_layers,
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads or spec.num_heads,
            "ffn_size": spec.ffn_size,
            "vocab_size": spec.vocab_size,
            "max_positions": spec.max_positions,
            "tied_head": spec.tied_head,
            "input": f"{s} int64 token ids ({TOKEN_ID_BYTES} bytes each)",
            **_published(name, spec == PRESETS[name]),
        }
    else:
        if seq_len is not None:
            raise ProfileError(f"model {name!r} takes image_size, not seq_len={seq_len!r}")
        if overrides:
            raise ProfileError(f"model {name!r} takes no shape overrides, got {sorted(overrides)}")
        cnn = _CNNS[name]
        size = cnn.image_size if image_size is None else image_size
        layers = cnn_layers(
            cnn.arch, image_size=size, num_classes=cnn.num_classes, dtype_bytes=nbytes
        )
        input_bytes = float(nbytes * 3 * size * size)
        hyper = {
            "architecture": cnn.arch,
            "image_size": size,
            "num_classes": cnn.num_classes,
            "input": f"3x{size}x{size} image in {dtype}",
            **_published(name, True),
        }
    logger.debug("built analytic profile %s (%d layers, %s)", name, len(layers), dtype)
    return ModelProfile(
        name=name,
        layers=layers,
        input_bytes=input_bytes,
        dtype=dtype,
        gradient_bytes_per_parameter=float(nbytes),
        state_bytes_per_parameter=state_bytes,
        optimizer=optimizer,
        hyper=hyper,
        source="analytic",
    )
