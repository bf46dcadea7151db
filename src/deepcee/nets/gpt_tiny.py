"""gpt-tiny: a byte-level GPT small enough to train on one CPU core, as a list of blocks.

Byte vocabulary (256), context 64, width 64, 4 heads, 4 pre-LayerNorm blocks with a
256-wide GELU MLP, every Linear with bias, untied output head. Blocks, in order (a pipeline
stage is a contiguous slice of them):

``embed``   token Embedding(256, 64) + learned position Embedding(64, 64)
``block0``..``block3``  x + attn(ln1(x)); x + mlp(ln2(x))
``head``    LayerNorm(64) + Linear(64, 256) -> logits ``(n, T, 256)``

Loss: next-token cross-entropy, mean over every token of the slice (each sample has the
same number of tokens, so this is also the mean over samples of per-sample means).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256
SEQ_LEN = 64
D_MODEL = 64
NUM_HEADS = 4
NUM_BLOCKS = 4
FFN_DIM = 256
BLOCK_NAMES: tuple[str, ...] = ("embed", *(f"block{i}" for i in range(NUM_BLOCKS)), "head")


class Embed(nn.Module):
    """Token plus learned position embedding: ``(n, T) int64 -> (n, T, d_model)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE, D_MODEL)
        self.pos = nn.Embedding(SEQ_LEN, D_MODEL)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(positions)


class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal multi-head self-attention."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc1 = nn.Linear(D_MODEL, FFN_DIM)
        self.fc2 = nn.Linear(FFN_DIM, D_MODEL)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (n, T, d) -> (n, heads, T, d/heads)
        q, k, v = (z.view(n, t, NUM_HEADS, d // NUM_HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the (untied) output projection to byte logits."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D_MODEL)
        self.out = nn.Linear(D_MODEL, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def make_block(name: str) -> nn.Module:
    """A fresh (randomly initialised from torch's current RNG) block by name."""
    if name == "embed":
        return Embed()
    if name == "head":
        return Head()
    if name in BLOCK_NAMES:
        return Block()
    raise KeyError(name)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over all tokens of the slice."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
