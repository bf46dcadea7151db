"""Helpers for the runtime's multi-process tests: plans, a float64 single-process reference,
user models written in plain torch (an MLP; a GPT-2-style model whose token embedding and LM
head share one parameter), and small importable targets (spawned processes import this
module by name)."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from deepcee import nets
from deepcee.plan import Plan, StagePlan
from deepcee.runtime import boundary
from deepcee.runtime import dist as rdist
from deepcee.runtime.data import Batch, dataset_for
from deepcee.runtime.job import OptimizerConfig
from deepcee.runtime.p2p import P2P, TensorMeta
from deepcee.runtime.partition import Topology


def make_plan(model: str, stages: list[tuple[int, int, tuple[str, ...], tuple[int, ...]]], num_microbatches: int,
              schedule: str, actions: tuple[tuple[str, ...], ...] = ()) -> Plan:
    mb = sum(stages[0][3])
    return Plan(
        system="test", cluster="local-small", model=model, global_batch=mb * num_microbatches, microbatch_size=mb,
        num_microbatches=num_microbatches, schedule=schedule, actions=actions,
        stages=tuple(StagePlan(layer_start=a, layer_stop=b, devices=d, shares=s) for a, b, d, s in stages),
    )


@dataclass(frozen=True)
class RegressionData:
    """A seeded regression task for a user-supplied nn.Sequential (8 features -> 3 targets)."""

    seed: int = 0

    def batch(self, step: int, batch_size: int) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 10_007 + step)
        x = torch.randn(batch_size, 8, generator=g)
        return Batch(inputs=x, targets=torch.sin(x[:, :3]) + 0.1 * x[:, 3:6])


def user_model() -> nn.Sequential:
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def reference(model, plan: Plan, steps: int, opt: OptimizerConfig, *, loss_fn=None, dataset=None, seed: int = 0,
              dtype: torch.dtype = torch.float64):
    """Single process, full global batch, ``dtype`` (float64 by default): (losses, step-0 grads,
    final params) keyed ``"<block>.<name>"`` (a tied parameter under each of its names). A
    user's model is copied first (whole, so ties stay ties), never trained in place."""
    if isinstance(model, str):
        blocks, default_loss = nets.build(model, seed, dtype=dtype)
        loss_fn = loss_fn or default_loss
        dataset = dataset or dataset_for(model, seed)
    else:
        blocks = [b.to(dtype) for b in copy.deepcopy(nets.as_blocks(model))]
    named = {f"{i}.{n}": p for i, b in enumerate(blocks) for n, p in b.named_parameters(remove_duplicate=False)}
    optimizer = opt.build(list({id(p): p for p in named.values()}.values()))  # a tied parameter once
    losses, grads0 = [], None
    for step in range(steps):
        batch = dataset.batch(step, plan.global_batch)
        x = boundary.to_device(batch.inputs, "cpu", dtype)  # tensors or structures of them
        for b in blocks:
            x = b(x)
        loss = loss_fn(x, boundary.to_device(batch.targets, "cpu", dtype))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        if grads0 is None:
            grads0 = {k: p.grad.clone() for k, p in named.items()}
        optimizer.step()
    return losses, grads0, {k: p.detach().clone() for k, p in named.items()}


# -- a GPT-2-style model in plain torch, token embedding tied to the LM head ------------------


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Parameter(torch.randn(seq_len, dim) * 0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe[: idx.shape[1]]


class CausalBlock(nn.Module):
    """Pre-LayerNorm attention + MLP; the causal mask is a buffer that every block shares."""

    def __init__(self, dim: int, heads: int, mask: torch.Tensor) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no bias on q, k, v: the key bias gets only a rounding-noise gradient (softmax ignores
        # a shift), which AdamW would blow up to +-lr in whatever direction the noise points
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TiedLMHead(nn.Module):
    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(wte.embedding_dim)
        self.weight = wte.weight  # the embedding's own Parameter: tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(x), self.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tied_gpt(*, layers: int = 3, dim: int = 16, heads: int = 2, seq_len: int = 16, seed: int = 7) -> list[nn.Module]:
    """[embedding, ``layers`` blocks, LM head]: block 0's ``wte.weight`` is block -1's ``weight``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        embed = TokenEmbedding(256, dim, seq_len)
        nn.init.normal_(embed.wte.weight, std=0.02)  # as GPT-2: a small tied head gives logits near 0
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        return [embed, *(CausalBlock(dim, heads, mask) for _ in range(layers)), TiedLMHead(embed.wte)]


# -- a HuggingFace GPT2LMHeadModel split into blocks (a test helper, not a general splitter) ---


class HFEmbedding(nn.Module):
    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = transformer.wte, transformer.wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class HFBlock(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)  # no mask given: the sdpa attention is causal
        return out[0] if isinstance(out, tuple) else out


class HFHead(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def hf_gpt2_blocks(seq_len: int = 16):
    """A tiny random GPT2LMHeadModel (no dropout, sdpa attention) and its blocks
    [embedding, each GPT2Block, ln_f + LM head]; the head's weight is the embedding's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model = GPT2LMHeadModel(cfg)
    return model, [HFEmbedding(model.transformer), *(HFBlock(b) for b in model.transformer.h), HFHead(model)]


def load_captures(run_dir: str | Path) -> dict[int, dict]:
    return {int(p.stem.removeprefix("rank")): torch.load(p, weights_only=False)
            for p in sorted((Path(run_dir) / "capture").glob("rank*.pt"))}


def silent_sender_target(rank: int, world_size: int, store_path: str, timeout_s: float) -> None:
    """Rank 1 waits for an activation that rank 0 never sends."""
    plan = make_plan("gpt-tiny", [(0, 3, ("cloud0:0",), (2,)), (3, 6, ("edge0:0",), (2,))], 1, "gpipe")
    store = rdist.file_store(store_path, world_size, 30)
    rdist.init_process_group(store=store, rank=rank, world_size=world_size, backend="gloo", timeout_s=30,
                             device=torch.device("cpu"))
    try:
        topo = Topology(plan)
        meta = TensorMeta(shape=(64, 64), dtype="float64")
        p2p = P2P(topology=topo, rank=rank, device=torch.device("cpu"), timeout_s=timeout_s,
                  in_meta=meta if rank == 1 else None, out_meta=meta if rank == 0 else None)
        if rank == 1:
            p2p.recv_forward(0)
        else:
            time.sleep(timeout_s + 3)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def sleeper_target(rank: int, world_size: int, store_path: str, seconds: float) -> None:
    time.sleep(seconds)
