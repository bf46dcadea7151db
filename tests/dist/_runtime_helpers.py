"""Helpers for the runtime's multi-process tests: plans, a float64 single-process reference,
user models written in plain torch (an MLP; a GPT-2-style model whose token embedding and LM
head share one parameter), and small importable targets (spawned processes import this
module by name)."""

from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from deepcee import nets
from deepcee.plan import EXACT, Plan, ReplicaPlan, StagePlan, Strategy
from deepcee.runtime import boundary
from deepcee.runtime import dist as rdist
from deepcee.runtime.data import Batch, dataset_for
from deepcee.runtime.job import OptimizerConfig
from deepcee.runtime.p2p import P2P, TensorMeta
from deepcee.runtime.partition import Topology

RTOL, ATOL = 1e-10, 1e-12
"""Float64 closeness of a distributed run to its single-process reference."""
SGD = OptimizerConfig(name="sgd", lr=0.05, momentum=0.9)
ADAM = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.01)
C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"
"""The devices of the local-small scenario."""


def make_plan(model: str, stages: list[tuple[int, int, tuple[str, ...], tuple[int, ...]]], num_microbatches: int,
              schedule: str, actions: tuple[tuple[str, ...], ...] = ()) -> Plan:
    mb = sum(stages[0][3])
    return Plan(
        system="test", cluster="local-small", model=model, global_batch=mb * num_microbatches, microbatch_size=mb,
        num_microbatches=num_microbatches, schedule=schedule, actions=actions,
        stages=tuple(StagePlan(layer_start=a, layer_stop=b, devices=d, shares=s) for a, b, d, s in stages),
    )


def make_replicas_plan(model: str, replicas: list[tuple[list[tuple[int, int, tuple[str, ...], tuple[int, ...]]], int, str]],
                       *, sync: str = "allreduce-ring", strategy: Strategy = EXACT, servers: tuple[str, ...] = (),
                       stage_syncs: dict[tuple[int, int], str] | None = None) -> Plan:
    """A plan of several replicas: each ``(stages, num_microbatches, schedule)``; ``stage_syncs``
    gives (replica, stage) its own sync."""
    reps = []
    for r, (stages, m, schedule) in enumerate(replicas):
        sts = tuple(StagePlan(layer_start=a, layer_stop=b, devices=d, shares=sh,
                              sync=(stage_syncs or {}).get((r, i)))
                    for i, (a, b, d, sh) in enumerate(stages))
        reps.append(ReplicaPlan(stages=sts, microbatch_size=sum(stages[0][3]), num_microbatches=m, schedule=schedule))
    return Plan(system="test", cluster="local-small", model=model, global_batch=sum(r.batch for r in reps),
                replicas=tuple(reps), sync=sync, strategy=strategy, servers=servers)


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
              dtype: torch.dtype = torch.float64, clip_grad_norm: float | None = None):
    """Single process, full global batch, ``dtype`` (float64 by default): (losses, step-0 grads,
    final params) keyed ``"<block>.<name>"`` (a tied parameter under each of its names). A
    user's model is copied first (whole, so ties stay ties), never trained in place.
    ``clip_grad_norm``: torch's ``clip_grad_norm_`` over the whole model before each update."""
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
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list({id(p): p for p in named.values()}.values()), clip_grad_norm)
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


# -- single-process re-enactment of the relaxed update rules ----------------------------------


class _Device:
    """One device of a replica's stage in the re-enactment: its own copy of the blocks and optimizer."""

    def __init__(self, blocks, start, stop, opt):
        self.blocks = copy.deepcopy(blocks)
        self.start, self.stop = start, stop
        self.params = [p for b in self.blocks[start:stop] for p in b.parameters() if p.requires_grad]
        self.optimizer = opt.build(self.params) if opt is not None else None

    def named(self):
        return {f"{i}.{n}": p for i in range(self.start, self.stop) for n, p in self.blocks[i].named_parameters()}


class _Replica:
    """A replica's devices, stage by stage, and its forward/backward exactly as the runtime runs it
    with a fused-backward schedule (gpipe, 1f1b): microbatches in order, each device on its share."""

    def __init__(self, blocks, rep, offset, opt, loss_fn, dtype):
        self.rep, self.offset, self.loss_fn, self.dtype = rep, offset, loss_fn, dtype
        self.stages = [[_Device(blocks, st.layer_start, st.layer_stop, opt) for _ in st.devices] for st in rep.stages]

    def zero_grad(self):
        for devs in self.stages:
            for d in devs:
                for p in d.params:
                    p.grad = None

    def accumulate(self, batch):
        """One local step's gradients of this replica's samples of ``batch``, added to ``.grad``."""
        rep, mb = self.rep, self.rep.microbatch_size
        for m in range(rep.num_microbatches):
            lo = self.offset + m * mb
            x = batch.inputs[lo:lo + mb]
            x = x.to(self.dtype) if x.is_floating_point() else x
            y = batch.targets[lo:lo + mb]
            y = y.to(self.dtype) if y.is_floating_point() else y
            saved = []
            for s, (st, devs) in enumerate(zip(rep.stages, self.stages, strict=True)):
                outs, ins = [], []
                for (a, b), d in zip(_ranges(st.shares), devs, strict=True):
                    xin = x[a:b].detach()
                    if s and xin.is_floating_point():
                        xin.requires_grad_(True)
                    out = xin
                    for blk in d.blocks[d.start:d.stop]:
                        out = blk(out)
                    if s == len(rep.stages) - 1:
                        out = self.loss_fn(out, y[a:b]) * ((b - a) / rep.batch)
                    ins.append(xin)
                    outs.append(out)
                saved.append((ins, outs))
                x = torch.cat([o.detach() for o in outs]) if s < len(rep.stages) - 1 else None
            grad = None
            for s in reversed(range(len(rep.stages))):
                ins, outs = saved[s]
                back = []
                for (a, b), xin, out in zip(_ranges(rep.stages[s].shares), ins, outs, strict=True):
                    out.backward(torch.ones_like(out) if grad is None else grad[a:b])
                    back.append(xin.grad if xin.requires_grad else None)
                grad = torch.cat(back) if s else None

    def sum_in_stages(self):
        """The in-stage SUM all-reduce: every device copy gets the sum (two devices at most here: exact)."""
        for devs in self.stages:
            if len(devs) > 1:
                for ps in zip(*(d.params for d in devs), strict=True):
                    total = ps[0].grad.clone()
                    for p in ps[1:]:
                        total.add_(p.grad)
                    for p in ps:
                        p.grad = total.clone()

    def step(self):
        for devs in self.stages:
            for d in devs:
                d.optimizer.step()

    def delegates(self):
        """Name -> the parameter of the first device of the stage holding it."""
        out = {}
        for devs in self.stages:
            out.update(devs[0].named())
        return out

    def set_values(self, values):
        with torch.no_grad():
            for devs in self.stages:
                for d in devs:
                    for name, p in d.named().items():
                        p.copy_(values[name])


def _ranges(shares):
    out, lo = [], 0
    for s in shares:
        out.append((lo, lo + s))
        lo += s
    return out


def _mean(xs):
    acc = xs[0].clone()
    for x in xs[1:]:
        acc.add_(x)
    return acc.div_(len(xs))


def relaxed_reference(model: str, plan: Plan, steps: int, opt: OptimizerConfig, *, seed: int = 0,
                      dtype: torch.dtype = torch.float64, previews: dict | None = None):
    """Re-enact ``plan``'s relaxed rule in one process, with the runtime's arithmetic (model
    averaging: plain or outer Nesterov; asgd-ga: pushes taken in turn, the fixed arrival
    order). Returns ``(per replica its losses, per replica name -> final parameter)``.
    ``previews`` (blocking model averaging): filled with local step index -> the model an
    average after that step would give, for every step not followed by one (what a probe
    evaluates), the outer state left as it is."""
    blocks, loss_fn = nets.build(model, seed, dtype=dtype)
    dataset = dataset_for(model, seed)
    s = plan.strategy
    offsets = plan.replica_offsets()
    reps = [_Replica(blocks, rep, off, None if s.kind == "asgd-ga" else opt, loss_fn, dtype)
            for rep, off in zip(plan.replicas, offsets, strict=True)]
    losses = [[] for _ in reps]
    initial = {f"{i}.{n}": p.detach().clone() for i, b in enumerate(blocks) for n, p in b.named_parameters()}

    def local_step(r, k, zero=True):
        if zero:
            reps[r].zero_grad()
        batch = dataset.batch(k, plan.global_batch)
        before = _loss_sum(reps[r], batch)
        reps[r].accumulate(batch)
        losses[r].append(before)

    if s.kind == "model-averaging":
        anchor, buf = dict(initial), {}

        def outer(thetas, commit=True):
            """The combined model of ``thetas`` (one per replica, in order); updates the Nesterov
            state unless ``commit`` is false."""
            new = {}
            for name in thetas[0]:
                if s.outer_optimizer == "average":
                    new[name] = _mean([th[name].detach() for th in thetas])
                    continue
                delta = _mean([anchor[name] - th[name].detach() for th in thetas])
                b = buf.get(name)
                b = delta.clone() if b is None else b.mul(s.outer_momentum).add_(delta)
                new[name] = anchor[name] - s.outer_lr * (delta + s.outer_momentum * b)
                if commit:
                    buf[name], anchor[name] = b, new[name]
            return new

        snaps = None
        for k in range(steps):
            for r in range(len(reps)):
                local_step(r, k)
                reps[r].sum_in_stages()
                reps[r].step()
            at_sync, last = (k + 1) % s.period == 0, k + 1 == steps
            if not s.overlap:
                if previews is not None and not at_sync:
                    previews[k] = {n: v.clone() for n, v in outer([rep.delegates() for rep in reps],
                                                                  commit=False).items()}
                if at_sync:
                    new = outer([rep.delegates() for rep in reps])
                    for rep in reps:
                        rep.set_values(new)
                continue
            # [Note: overlapped averaging]: round k-1's result lands at sync point k with each
            # replica's progress kept; the run ends with a blocking sync point
            if not (at_sync or last):
                continue
            if snaps is not None:
                got = outer(snaps)
                for rep, snap in zip(reps, snaps, strict=True):
                    rep.set_values({n: got[n] + (p.detach() - snap[n]) for n, p in rep.delegates().items()})
            snaps = [{n: p.detach().clone() for n, p in rep.delegates().items()} for rep in reps]
            if last:
                got = outer(snaps)
                for rep in reps:
                    rep.set_values(got)
    elif s.kind == "asgd-ga":
        server = {n: torch.nn.Parameter(v.clone()) for n, v in initial.items()}
        server_opt = opt.build(list(server.values()))
        k_acc = s.accumulation_steps
        rounds = -(-steps // k_acc)
        for c in range(rounds):
            for r in range(len(reps)):
                ks = range(c * k_acc, min(steps, (c + 1) * k_acc))
                for i, k in enumerate(ks):
                    local_step(r, k, zero=i == 0)
                reps[r].sum_in_stages()
                for name, p in reps[r].delegates().items():
                    server[name].grad = p.grad.clone().div_(len(ks))
                server_opt.step()
                reps[r].set_values({n: p.detach() for n, p in server.items()})
    else:
        raise ValueError(f"no re-enactment for {s.kind!r}")
    return losses, [rep.delegates() for rep in reps]


def held_out_loss(model: str, values: dict, global_batch: int, *, seed: int = 0, batches: int = 1,
                  dtype: torch.dtype = torch.float64) -> float:
    """The mean loss of the whole model with parameters ``values`` (name -> tensor) on the
    dataset's first ``batches`` held-out global batches, in one process."""
    blocks, loss_fn = nets.build(model, seed, dtype=dtype)
    with torch.no_grad():
        for i, b in enumerate(blocks):
            for n, p in b.named_parameters():
                p.copy_(values[f"{i}.{n}"])
            b.eval()
        total = 0.0
        held = list(itertools.islice(dataset_for(model, seed).eval_batches(global_batch), batches))
        for batch in held:
            x = batch.inputs.to(dtype) if batch.inputs.is_floating_point() else batch.inputs
            y = batch.targets.to(dtype) if batch.targets.is_floating_point() else batch.targets
            for b in blocks:
                x = b(x)
            total += float(loss_fn(x, y)) / len(held)
    return total


def _loss_sum(rep: _Replica, batch) -> float:
    """The replica's loss on ``batch`` as the runtime reports it (the sum of its weighted losses),
    computed without touching gradients."""
    with torch.no_grad():
        total = 0.0
        r, mb = rep.rep, rep.rep.microbatch_size
        for m in range(r.num_microbatches):
            lo = rep.offset + m * mb
            x = batch.inputs[lo:lo + mb]
            x = x.to(rep.dtype) if x.is_floating_point() else x
            y = batch.targets[lo:lo + mb]
            y = y.to(rep.dtype) if y.is_floating_point() else y
            for blk in (blk for devs in rep.stages for blk in devs[0].blocks[devs[0].start:devs[0].stop]):
                x = blk(x)
            total += float(rep.loss_fn(x, y))
        return total / r.num_microbatches
