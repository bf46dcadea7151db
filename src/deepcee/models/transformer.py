"""Analytic per-layer costs of transformer language models (GPT-2, BERT, Llama, gpt-tiny).

Torch-free. One :class:`TransformerSpec` describes a family member; :func:`transformer_layers`
turns it into ``embed``, ``block0`` .. ``block{L-1}``, ``head`` layer profiles, per sample of
``seq_len`` tokens (``s`` tokens, hidden size ``h``, ``a`` heads, FFN size ``f``, vocab ``V``).

FLOPs (2 per multiply-add; elementwise ops such as norms, softmax, GELU and residual adds
are not counted):

- matmuls with a weight operand: forward ``2 x MACs``, input gradient ``2 x MACs``, weight
  gradient ``2 x MACs``;
- the attention score ``Q K^T`` and context ``P V`` matmuls (``2 s^2 h`` MACs per block; the
  causal mask is not exploited, as in kernels without flash attention): forward ``2 x MACs``;
  both operands are activations, so their backward (``4 x MACs``) is all input gradient and
  nothing is weight gradient.

Per block this gives ``72 s h^2 + 12 s^2 h`` FLOPs for forward + backward when ``f = 4h``, the
count of Narayanan et al. 2021 (Megatron-LM, SC'21). The embedding lookup counts 0 FLOPs.

Stashed activations per block (elements of the training dtype, plus 1-byte dropout masks):
inputs of both norms, of the QKV, output and MLP projections, ``Q``, ``K``, ``V``, the
softmax output (``a s^2``), the MLP's intermediate tensors; with dropout also the dropped
attention probabilities and the masks. For GPT-2/BERT in a 2-byte dtype this is exactly
Korthikanti et al. 2022 (arXiv:2205.05198) ``s h (34 + 5 a s / h)`` bytes; in fp32 the
tensors double and the 1-byte masks do not. The head stashes its inputs and the logits
(``s V`` elements, needed by the softmax cross-entropy backward).

[Note: tied embeddings] GPT-2 and BERT use the word-embedding matrix as the LM-head
(decoder) weight. It is counted once, in ``embed``; the ``head`` layer's parameter count holds
only its own tensors (final norm; for BERT the MLM transform, decoder bias, pooler and NSP
classifier), while its FLOPs include the ``s h V`` head matmul and its weight gradient. This is
how the published counts (and ``sum(p.numel())`` in PyTorch) count them. A pipeline that puts
``embed`` and ``head`` on different stages must keep a second copy of the matrix and all-reduce
its gradient (as Megatron-LM does); that extra ``V h`` is not in these profiles. Llama and
gpt-tiny have untied heads whose ``V h`` weights belong to ``head``.

Inputs are token ids as int64 (8 bytes per token); BERT's segment ids and attention mask are
not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deepcee.errors import ProfileError
from deepcee.profile import LayerProfile

TOKEN_ID_BYTES = 8
"""Bytes per input token id (int64, PyTorch's default index dtype)."""

MASK_BYTES = 1
"""Bytes per element of a stashed dropout mask (bool)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerSpec:
    """Shape and flavour of a transformer; the defaults describe a GPT-2-style model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    vocab_size: int
    default_seq_len: int
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` means ``num_heads``."""
    max_positions: int | None = None
    """Rows of a learned position table (also the longest sequence); ``None``: rotary."""
    token_types: int = 0
    """Rows of a segment (token type) embedding table (BERT: 2)."""
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True
    """Linear layers inside the blocks carry biases."""
    embed_norm: bool = False
    """A norm after the embedding sum (BERT)."""
    final_norm: bool = True
    """A norm before the head (pre-norm models)."""
    tied_head: bool = True
    """The head reuses the word-embedding matrix; see [Note: tied embeddings]."""
    head_bias: bool = False
    bert_heads: bool = False
    """BERT pre-training heads: MLM transform (dense + GELU + norm), pooler and NSP classifier."""
    dropout: bool = True

    def __post_init__(self) -> None:
        for key in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "ffn_size",
            "vocab_size",
            "default_seq_len",
        ):
            _check_positive_int(key, getattr(self, key))
        if self.num_kv_heads is not None:
            _check_positive_int("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise ProfileError(
                    f"num_heads={self.num_heads} must be a multiple of "
                    f"num_kv_heads={self.num_kv_heads}"
                )
        if self.hidden_size % self.num_heads:
            raise ProfileError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )
        if self.max_positions is not None:
            _check_positive_int("max_positions", self.max_positions)

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection output."""
        kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        return self.hidden_size // self.num_heads * kv_heads

    def check_seq_len(self, seq_len: int) -> None:
        _check_positive_int("seq_len", seq_len)
        if self.max_positions is not None and seq_len > self.max_positions:
            raise ProfileError(
                f"seq_len={seq_len} exceeds the model's {self.max_positions} learned positions"
            )


def _check_positive_int(key: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ProfileError(f"{key} must be a positive integer, got {value!r}")


def _layer(
    name: str,
    *,
    weight_macs: float,
    activation_macs: float = 0.0,
    parameter_count: int,
    activation_bytes: float,
    output_bytes: float,
) -> LayerProfile:
    """A layer whose matmuls are ``weight_macs`` (weight operand) + ``activation_macs`` (both
    operands activations) multiply-adds per sample."""
    return LayerProfile(
        name=name,
        forward_flops=2.0 * (weight_macs + activation_macs),
        input_grad_flops=2.0 * weight_macs + 4.0 * activation_macs,
        weight_grad_flops=2.0 * weight_macs,
        parameter_count=parameter_count,
        activation_bytes=activation_bytes,
        output_bytes=output_bytes,
    )


def _norm_params(spec: TransformerSpec) -> int:
    # LayerNorm has a weight and a bias per feature, RMSNorm only a weight.
    return spec.hidden_size * (2 if spec.norm == "layernorm" else 1)


def _embed(spec: TransformerSpec, s: int, dtype_bytes: int) -> LayerProfile:
    h = spec.hidden_size
    params = (spec.vocab_size + (spec.max_positions or 0) + spec.token_types) * h
    params += _norm_params(spec) if spec.embed_norm else 0
    # The token ids are kept for the embedding's weight gradient (a scatter-add, ~0 FLOPs).
    stash = s * TOKEN_ID_BYTES
    stash += s * h * dtype_bytes if spec.embed_norm else 0
    stash += s * h * MASK_BYTES if spec.dropout else 0
    return LayerProfile(
        name="embed",
        forward_flops=0.0,
        input_grad_flops=0.0,
        weight_grad_flops=0.0,
        parameter_count=params,
        activation_bytes=stash,
        output_bytes=s * h * dtype_bytes,
    )


def _block(spec: TransformerSpec, index: int, s: int, dtype_bytes: int) -> LayerProfile:
    h, f, kv, a = spec.hidden_size, spec.ffn_size, spec.kv_size, spec.num_heads
    up = 2 if spec.mlp == "swiglu" else 1  # matrices h -> f (gate and up for SwiGLU)
    attn_weights = 2 * h * h + 2 * h * kv  # Q and output projections; K and V projections
    mlp_weights = (up + 1) * h * f
    biases = (2 * h + 2 * kv) + (up * f + h) if spec.bias else 0
    params = attn_weights + mlp_weights + biases + 2 * _norm_params(spec)
    # Stashed elements: attention: norm input, QKV input, Q, K, V, softmax output, output-
    # projection input; MLP: norm input, MLP input, the `up` h->f outputs, down-projection input.
    elements = 4 * s * h + 2 * s * kv + a * s * s + 2 * s * h + (up + 1) * s * f
    stash = elements * dtype_bytes
    if spec.dropout:
        # Attention dropout keeps its output and mask; two residual dropouts keep their masks.
        stash += a * s * s * (dtype_bytes + MASK_BYTES) + 2 * s * h * MASK_BYTES
    return _layer(
        f"block{index}",
        weight_macs=s * (attn_weights + mlp_weights),
        activation_macs=2 * s * s * h,
        parameter_count=params,
        activation_bytes=stash,
        output_bytes=s * h * dtype_bytes,
    )


def _head(spec: TransformerSpec, s: int, dtype_bytes: int) -> LayerProfile:
    h, v = spec.hidden_size, spec.vocab_size
    params = _norm_params(spec) if spec.final_norm else 0
    params += 0 if spec.tied_head else h * v
    params += v if spec.head_bias else 0
    macs = s * h * v
    input_elements = s * h * (2 if spec.final_norm else 1)  # final-norm and LM-head inputs
    outputs = s * v
    if spec.bert_heads:
        # MLM transform (dense h->h + norm) on every token; pooler (dense h->h) and NSP
        # classifier (h->2) on the first token only.
        params += (h * h + h) + _norm_params(spec) + (h * h + h) + (2 * h + 2)
        macs += s * h * h + h * h + 2 * h
        input_elements += 3 * s * h + 2 * h  # dense, GELU and norm inputs; pooler, NSP inputs
        outputs += 2
    # The logits are kept for the softmax cross-entropy backward.
    return _layer(
        "head",
        weight_macs=macs,
        parameter_count=params,
        activation_bytes=(input_elements + s * v) * dtype_bytes,
        output_bytes=outputs * dtype_bytes,
    )


def transformer_layers(
    spec: TransformerSpec, *, seq_len: int, dtype_bytes: int
) -> tuple[LayerProfile, ...]:
    """Per-sample layer profiles of ``spec`` at ``seq_len`` tokens; see the module docstring."""
    spec.check_seq_len(seq_len)
    blocks = [_block(spec, i, seq_len, dtype_bytes) for i in range(spec.num_layers)]
    return (_embed(spec, seq_len, dtype_bytes), *blocks, _head(spec, seq_len, dtype_bytes))


def _gpt2(hidden_size: int, num_layers: int, num_heads: int) -> TransformerSpec:
    # HF GPT2Config: n_positions 1024, vocab 50257, n_inner 4h, tied LM head.
    return TransformerSpec(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        ffn_size=4 * hidden_size,
        vocab_size=50257,
        max_positions=1024,
        default_seq_len=1024,
    )


def _bert(hidden_size: int, num_layers: int, num_heads: int) -> TransformerSpec:
    # Google BERT (BertForPreTraining): post-norm blocks, 512 learned positions, 2 segment
    # types, embedding norm, tied MLM decoder with its own bias, pooler + NSP.
    return TransformerSpec(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        ffn_size=4 * hidden_size,
        vocab_size=30522,
        max_positions=512,
        token_types=2,
        embed_norm=True,
        final_norm=False,
        head_bias=True,
        bert_heads=True,
        default_seq_len=128,
    )


def llama_spec(
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    ffn_size: int,
    vocab_size: int,
    num_kv_heads: int | None = None,
    default_seq_len: int = 2048,
) -> TransformerSpec:
    """A Llama-style decoder: RMSNorm, SwiGLU MLP, rotary positions, no biases, untied head."""
    return TransformerSpec(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        ffn_size=ffn_size,
        vocab_size=vocab_size,
        num_kv_heads=num_kv_heads,
        mlp="swiglu",
        norm="rmsnorm",
        bias=False,
        tied_head=False,
        dropout=False,
        default_seq_len=default_seq_len,
    )


LLAMA_7B = {
    "hidden_size": 4096,
    "num_layers": 32,
    "num_heads": 32,
    "ffn_size": 11008,
    "vocab_size": 32000,
}
"""LLaMA-7B (Touvron et al. 2023, Table 2; HF config intermediate_size 11008)."""

LLAMA_1B = {
    "hidden_size": 2048,
    "num_layers": 22,
    "num_heads": 32,
    "num_kv_heads": 4,
    "ffn_size": 5632,
    "vocab_size": 32000,
}
"""TinyLlama-1.1B (Zhang et al. 2024; its HF config.json), a Llama-2-style 1B decoder."""

GPT_TINY = TransformerSpec(
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    ffn_size=256,
    vocab_size=256,
    max_positions=64,
    default_seq_len=64,
    tied_head=False,
    head_bias=True,
    dropout=False,
)
"""Byte-level model that the torch runtime also builds (deepcee.nets); must match it exactly."""

PRESETS: dict[str, TransformerSpec] = {
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-xl": _gpt2(1600, 48, 25),
    # BERT-small is Turc et al. 2019's L=4/H=512/A=8 miniature; FFN 4h as in all of them.
    "bert-small": _bert(512, 4, 8),
    "bert-base": _bert(768, 12, 12),
    "llama": llama_spec(**LLAMA_7B),
    "llama-7b": llama_spec(**LLAMA_7B),
    "llama-1b": llama_spec(**LLAMA_1B),
    "gpt-tiny": GPT_TINY,
}
"""Built-in transformer shapes by model name."""

LLAMA_OVERRIDES = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "ffn_size",
    "vocab_size",
)
"""Shape fields a caller may override on the Llama family."""
