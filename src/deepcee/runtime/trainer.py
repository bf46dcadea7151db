"""One rank's training run: composes topology, stage, transport, executor, sync, optimizer.

:func:`run_jobs_on_rank` is what every process runs (local launch or torchrun): it joins the
process group once and runs one or more :class:`Job`\\ s in order (tests batch several plans
into one launch). For each job, :class:`Trainer` builds this rank's stage from the plan,
agrees boundary shapes with its peers, then per step: runs its row of the lowered schedule
(:mod:`deepcee.runtime.executor`), combines gradients as the plan's strategy says
(:mod:`deepcee.runtime.strategies`: under ``exact``, each layer's over all its holders in
every replica; the relaxed rules run their own loop there), sums the gradients of parameters
tied across stages (:mod:`deepcee.runtime.params`, which also gives every rank its private
copy of a user's model), steps the optimizer, gathers metrics on rank 0 and checkpoints.

A run whose plan changes while it runs (the adapter) plugs in through
:class:`~deepcee.runtime.hooks.TrainerHooks` (built on each rank by :attr:`Job.hooks`; see
[Note: trainer hooks]); without it, :class:`~deepcee.runtime.hooks.FixedPlan`. The hooks act on
the trainer through its public methods: :meth:`Trainer.set_plan` (a new plan's topology and
stage groups), :meth:`Trainer.build_stage` (this rank's stage, schedule row and optimizer for
the plan in force), :meth:`Trainer.reshard` (same stage, new sample ranges) and
:meth:`Trainer.make_p2p`. Step records and the result are :mod:`deepcee.runtime.records`,
gathered and written by :mod:`deepcee.runtime.outputs`; emulated time (the epoch, link shaping,
paced all-reduces) is :mod:`deepcee.runtime.pacing`; checkpoints are :mod:`deepcee.runtime.persist`.

[Note: loss weighting]
Each device scales its per-microbatch mean loss by ``share / global_batch``
(:meth:`Topology.loss_scale`), so the sum over devices and microbatches is the mean over the
global batch, and so are the gradients. The all-reduce over a layer's holders (the devices
of its stage, in every replica) is therefore a plain SUM, which gives every holder exactly the
full-batch gradient of its layers.
DDP's hooks are not used: they do not fire with split backward (PLATFORM.md).
"""

from __future__ import annotations

import functools
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepcee import nets
from deepcee.cluster import Cluster
from deepcee.errors import DeepceeError, RuntimeSetupError, SpecError
from deepcee.plan import Plan, save_json_atomic
from deepcee.runtime import checkpoint as ckpt
from deepcee.runtime import dist as rdist
from deepcee.runtime import outputs, pacing, peak_memory, persist, runlock
from deepcee.runtime import params as rparams
from deepcee.runtime import state as rstate
from deepcee.runtime import strategies as rstrat
from deepcee.runtime.boundary import BoundaryMeta, num_samples
from deepcee.runtime.data import dataset_for
from deepcee.runtime.emulation import (
    PACED_MODES,
    Clock,
    DevicePacer,
    choose_dilation,
    emulation_info,
)
from deepcee.runtime.evaluation import eval_source, evaluate
from deepcee.runtime.executor import Feeds, StepRecord, run_step
from deepcee.runtime.hooks import FixedPlan, TrainerHooks
from deepcee.runtime.job import Job, plan_digest
from deepcee.runtime.optstep import OptimizerStep, StepOutcome, norm_owned
from deepcee.runtime.p2p import P2P, Meta, TensorMeta, exchange_metadata, prepost_receives
from deepcee.runtime.partition import replica_plan
from deepcee.runtime.progress import RunLog, gather_rank_infos
from deepcee.runtime.records import (
    AppliedChange,
    RankMetrics,
    ResumeRecord,
    StepMetrics,
    TrainResult,
    train_result,
)
from deepcee.runtime.replicas import SegmentParams
from deepcee.runtime.sources import as_source
from deepcee.runtime.stage import StageRunner
from deepcee.runtime.target import reached
from deepcee.schedule.program import lowered_schedule

log = logging.getLogger(__name__)

__all__ = ["Trainer", "Worker", "plan_digest", "write_error"]


@dataclass(slots=True)
class Worker:
    """This process: its rank, the world, the store and the torch device."""

    rank: int
    world_size: int
    store: dist.Store
    device: torch.device
    node: str = ""
    """The cluster node this rank's machine runs (torchrun with a host mapping), else empty."""
    launcher_rank: int | None = None
    """The rank torchrun gave this process, before it was mapped to a device."""
    waiter: rdist.Waiter = field(default_factory=rdist.BlockingWaiter)
    """How this rank waits for its transfers and collectives (an elastic run's session watches
    for lost peers while it waits)."""


class Trainer:
    """Runs one job on one rank. See the module docstring."""

    def __init__(self, job: Job, w: Worker, hooks: TrainerHooks | None = None) -> None:
        self.job, self.w, self.cfg = job, w, job.config
        self.hooks: TrainerHooks = hooks or FixedPlan()
        self.cluster: Cluster = job.cluster
        self.clock = Clock()
        self.run_dir = Path(job.run_dir)
        self._groups: dict[tuple[int, ...], Any] = {}
        self.records_sent = 0
        self.records_key = job.name
        """Store prefix of the out-of-band step records (an elastic run's generation changes it)."""
        self.run_lock: runlock.RunLock | None = None
        self.writer: ckpt.MetricsWriter | None = None
        self.runlog: RunLog | None = None
        self.records: list[StepMetrics] = []
        self.rank_infos: list[Any] | None = None
        self.start_step = self.first_step = 0
        self.ties = rparams.model_ties(job.model)
        self.optstep = OptimizerStep(job.config)
        self.resumed: ResumeRecord | None = None
        self.unrecorded: tuple[int, Any, float, AppliedChange | None] | None = None
        """Rank 0: the last step trained, gathered and not yet written (:meth:`record_step`)."""
        # Every rank creates every group, in the same order (torch.distributed requires it).
        self.set_plan(job.plan, make_job_group=True)

    def set_plan(self, plan: Plan, *, make_job_group: bool = False) -> None:
        """Make ``plan`` the one in force: topology and stage groups (a collective over the world)."""
        self.plan, self.digest = plan, plan_digest(plan)
        self.topo = self.hooks.topology(plan, self.w.world_size)
        if make_job_group:
            self.job_group = self._make_job_group()
        self.sync_groups = rstrat.make_sync_groups(plan, self.topo, self._group)
        if self.ties and plan.num_replicas > 1:
            raise SpecError(f"the model has parameters tied across blocks ({self.ties[0].describe()}); plans with "
                            "several replicas do not support ties yet", field="model")
        self.tie_groups = rparams.tie_groups(self.ties, plan, self.topo, self._group) if plan.num_replicas == 1 else ()
        active = [r for r in range(self.w.world_size) if self.topo.is_active(r)]
        self.active_group = self._group(active) if len(active) < self.w.world_size else None

    def _group(self, ranks: Sequence[int]) -> Any:
        """A process group over ``ranks``, created once per set (every rank calls this in the same order)."""
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), timeout=timedelta(seconds=self.cfg.timeout_s))
        return self._groups[key]

    def forget_groups(self) -> list[Any]:
        """Every process group this trainer made, forgotten (an elastic run's next generation
        makes its own); returned so the caller can keep them from being destroyed mid-operation."""
        groups = list(self._groups.values())
        self._groups.clear()
        self.records_sent = 0
        return groups

    def _make_job_group(self) -> Any:
        """The group metrics are gathered over: the plan's ranks (``None``: the world)."""
        if self.hooks.gathers_over_world():
            return None
        active = list(range(self.topo.num_ranks))
        return self._group(active) if len(active) < self.w.world_size else None

    @property
    def active(self) -> bool:
        return self.topo.is_active(self.w.rank)

    @property
    def is_server(self) -> bool:
        """Whether this rank is a parameter server of the plan ([Note: server ranks] in :mod:`deepcee.runtime.partition`)."""
        return self.topo.is_server(self.w.rank)

    @property
    def takes_part(self) -> bool:
        """Whether this rank runs :meth:`setup` and :meth:`train` (idle ranks of a fixed plan do not)."""
        return self.hooks.takes_part(self)

    # -- set-up --------------------------------------------------------------------------
    def _blocks(self) -> tuple[list[nn.Module], Callable]:
        dtype = getattr(torch, self.cfg.dtype)
        if isinstance(self.job.model, str):
            blocks, loss_fn = nets.build(self.job.model, self.cfg.seed, dtype=dtype)
            loss_fn = self.job.loss_fn or loss_fn
        else:
            blocks, loss_fn = [b.to(dtype) for b in rparams.private_blocks(self.job.model)], self.job.loss_fn
        return blocks, loss_fn

    def _check_sync(self) -> None:
        rstrat.check_sync(self.plan, self.topo)
        if self.plan.sync == "zero2" and self.w.rank == self.topo.rank_of(0, 0):
            # Same gradients and parameters as an all-reduce; only memory and traffic differ.
            log.warning("sync 'zero2' runs as a plain gradient all-reduce (optimizer states are not sharded)")

    def _state_names(self) -> rstate.StateNames:
        """The plain model's names of every block's state ([Note: state names])."""
        m = self.job.model
        if isinstance(m, rparams.PackedModel):
            return m.names
        return rstate.state_names(m, self.blocks if isinstance(m, str) else None)

    def setup(self) -> None:
        """Model blocks (and weights to start from), data, emulation (dilation, pacing, link
        shaping or the relay's trace epoch, the shared epoch) and, on an active rank, its stage
        (resumed from the newest intact checkpoint when asked)."""
        self.setup_local()
        if self.cfg.init_from:
            persist.init_weights(self, self.cfg.init_from)
        if self.active:
            self.build_stage(self.job.name)
        # an adaptive run's idle ranks take part in the checkpoint collectives (they may hold a stage later)
        resumes = self.active or self.is_server or self.hooks.gathers_over_world()
        self.start_step = self.first_step = self._resume() if resumes else 0
        self.hooks.prepare(self)
        warm_s = rstrat.warm_up_averaging(self)
        if warm_s:
            log.info("%s: averaging connections warmed up in %.2f s (wall, before the clock starts)",
                     self.topo.describe(self.w.rank), warm_s)
        # emulated time (and every bandwidth trace and straggler) starts when all ranks are ready to train
        self._barrier()
        self.start_clock(self._epoch())
        if self.active:
            self.p2p = self.make_p2p()

    def setup_local(self) -> None:
        """What this rank sets up on its own (no collective): blocks, data, dilation and pacing."""
        peak_memory.reset_peak(self.w.device)  # this job's peak, not an earlier job's of the launch
        self.blocks, self.loss_fn = self._blocks()
        self.model_digest = rparams.model_digest(self.blocks)
        self.state_names = self._state_names()
        # [Note: data by step] in deepcee.runtime.sources: every rank fetches only its rows
        self.dataset = as_source(self.job.dataset if self.job.dataset is not None
                                 else dataset_for(self.job.model, self.cfg.seed), seed=self.cfg.seed)
        if self.cfg.eval_every and eval_source(self.dataset) is None:
            raise SpecError("the dataset has no held-out batches (an eval_batches(batch_size) method, or "
                            "evaluation data; see docs/running.md)", field="eval_every")
        paced = self.cfg.mode in PACED_MODES
        self.relay = pacing.relay_control(self.cfg.timeout_s) if self.cfg.mode == "realnet" else None
        if self.plan.strategy.kind != "exact":
            rstrat.check_relaxed(self)
        slowdowns = [self.cluster.device(d).slowdown for d in self.hooks.paced_devices(self)]
        self.dilation = (self.cfg.dilation or choose_dilation(slowdowns, self.cfg.cores)) if paced else 1.0
        self.info = emulation_info(self.cfg.mode, self.dilation, self.cfg.cores)
        device = self.hooks.device(self)
        self.pacer = DevicePacer(slowdown=self.cluster.device(device).slowdown, dilation=self.dilation,
                                 enabled=paced, clock=self.clock,
                                 stragglers=[s for s in self.cfg.stragglers if s.device == device])

    def start_clock(self, epoch: float) -> None:
        """Emulated time counts from ``epoch`` (:func:`deepcee.runtime.pacing.start_clock`)."""
        pacing.start_clock(self, epoch)

    def build_stage(self, key: str, metas: tuple[Meta | None, Meta | None] | None = None) -> None:
        """This rank's stage of the plan in force, its schedule row and optimizer; boundary shapes
        agreed with its peers under store prefix ``key`` unless ``metas`` are given."""
        self._check_sync()
        self.plan.check_against(num_layers=len(self.blocks), device_names=self.cluster.device_names)
        p = self.placement = self.topo.placement(self.w.rank)
        self.pipeline = replica_plan(self.plan, p.replica)
        st = self.pipeline.stages[p.stage]
        last = p.stage == self.pipeline.num_stages - 1
        if last and self.loss_fn is None:
            raise SpecError("a user model needs a loss_fn", field="loss_fn")
        self.stage = StageRunner(self.blocks[st.layer_start:st.layer_stop], stage=p.stage, is_first=p.stage == 0,
                                 is_last=last, loss_fn=self.loss_fn, device=self.w.device,
                                 dtype=getattr(torch, self.cfg.dtype),
                                 autocast=getattr(torch, self.cfg.autocast) if self.cfg.autocast else None,
                                 recompute=st.recompute)
        self.schedule = lowered_schedule(self.pipeline)
        self.actions = self.schedule[p.stage]
        self.my_segments = [(j, SegmentParams.of(seg, self.blocks)) for j, seg in enumerate(self.topo.segments())
                            if self.w.rank in seg.ranks]
        self.initial_values = {j: seg.flat_values().clone() for j, seg in self.my_segments}
        self.metas = metas or exchange_metadata(
            self.w.store, self.topo, self.w.rank, job=key, plan_digest=self.digest,
            output_meta=self._dry_run, timeout_s=self.cfg.timeout_s, same_host=self.cfg.mode in PACED_MODES,
            agree={"data": self.dataset.digest(self.plan.global_batch), "model": self.model_digest},
        )
        if self.metas[0] is not None:
            self.stage.input_grads = BoundaryMeta.coerce(self.metas[0]).grad_mask
        # a stage of parameter-less blocks (a lone activation): one empty group, since torch
        # refuses an empty parameter list; the optimizer then steps nothing
        self.optimizer = self.cfg.optimizer.build(self.stage.params or [{"params": []}])

    def reshard(self) -> None:
        """Same stage, other sample ranges, microbatches or schedule (a re-tune of the plan in
        force): new placement, schedule row and transport; the stage module and optimizer stay."""
        self.placement = self.topo.placement(self.w.rank)
        self.pipeline = replica_plan(self.plan, self.placement.replica)
        self.schedule = lowered_schedule(self.pipeline)
        self.actions = self.schedule[self.placement.stage]
        self.p2p = self.make_p2p()

    def make_p2p(self) -> P2P:
        in_meta, out_meta = self.metas
        return P2P(topology=self.topo, rank=self.w.rank, device=self.w.device, timeout_s=self.cfg.timeout_s,
                   in_meta=in_meta, out_meta=out_meta, cluster=self.cluster, shaper=self.shaper, clock=self.clock,
                   prepost=prepost_receives(self.cfg.receives, self.w.device), waiter=self.w.waiter)

    def _dry_run(self, in_meta: TensorMeta | BoundaryMeta | None) -> TensorMeta | BoundaryMeta | None:
        """Per-sample output meta of this stage (``None`` on the last), from a forward of two
        samples with autograd on ([Note: boundary gradients] in :mod:`deepcee.runtime.boundary`)."""
        n = min(2, self.plan.global_batch)
        if self.stage.is_first:
            x = self.dataset.rows(0, self.plan.global_batch, 0, n).inputs
        else:
            meta = BoundaryMeta.coerce(in_meta)
            for t in meta.tensors:
                if t.torch_dtype.is_floating_point and t.torch_dtype != self.stage.dtype:
                    raise RuntimeSetupError(f"receives {t.dtype}, runs {self.stage.dtype}")
            self.stage.input_grads = meta.grad_mask
            x = meta.zeros(n)
        out = self.stage.module(self.stage.prepare_input(x))
        if self.stage.is_last:
            return None
        if num_samples(out) != n:  # a tensor without the samples first would be sliced wrongly
            raise RuntimeSetupError(f"stage output holds {num_samples(out)} samples for {n} inputs")
        return BoundaryMeta.of(out)

    def _epoch(self, *, read: bool = False) -> float:
        """The run's shared epoch: rank 0 sets it (``read``: only read the one set)."""
        key = f"{self.job.name}/epoch"
        if self.w.rank == 0 and not read:
            self.w.store.set(key, repr(self.clock.wall()))
        self.w.store.wait([key], timedelta(seconds=self.cfg.timeout_s))
        return float(self.w.store.get(key).decode())

    def ckpt_root(self) -> Path:
        return Path(self.job.checkpoint_dir) if self.job.checkpoint_dir else self.run_dir / "checkpoints"

    def _resume(self) -> int:
        """Load the newest intact checkpoint (under any plan; see :mod:`deepcee.runtime.persist`)."""
        if not self.cfg.resume:
            return 0
        self.resumed = persist.resume(self)
        return 0 if self.resumed is None else self.resumed.step

    # -- steps ---------------------------------------------------------------------------
    def feeds(self, step: int) -> Feeds:
        """This rank's rows (its replica's samples) of every microbatch of batch ``step``, fetched
        before the step's actions (so data loading is not timed as compute)."""
        r, first, last = self.w.rank, self.stage.is_first, self.stage.is_last
        rows = {m: self.dataset.rows(step, self.plan.global_batch, *self.topo.global_samples(r, m))
                for m in range(self.pipeline.num_microbatches)} if first or last else {}
        return Feeds(inputs=(lambda m: rows[m].inputs) if first else None,
                     targets=(lambda m: rows[m].targets) if last else None,
                     loss_scale=self.topo.loss_scale(r) * self.optstep.loss_scale)

    def pace_for(self, devices: Sequence[str], sync: str) -> Callable[[int, float], None] | None:
        """``pace(nbytes, t0)`` for an all-reduce over ``devices`` (mode ``emulated``), else ``None``."""
        if self.cfg.mode != "emulated":
            return None
        return lambda nbytes, t0: pacing.pace_allreduce(self, devices, nbytes, t0, sync)

    def _sum_tied_gradients(self) -> float:
        """Tied parameters across stages ([Note: tied parameters] in :mod:`deepcee.runtime.params`)."""
        return rparams.sum_tied_gradients(self.tie_groups, self.blocks, self.plan, self.placement,
                                          timeout_s=self.cfg.timeout_s, clock=self.clock,
                                          pace=functools.partial(pacing.pace_allreduce, self)
                                          if self.cfg.mode == "emulated" else None)

    def emulated_s(self, wall: float | None = None) -> float:
        """Seconds since the run's shared epoch, divided by the dilation (emulated time)."""
        return ((self.clock.wall() if wall is None else wall) - self.epoch) / self.dilation

    def named_tensors(self, tensors: Callable[[nn.Parameter], torch.Tensor | None]) -> dict[str, torch.Tensor]:
        start = self.pipeline.stages[self.placement.stage].layer_start
        out = {}
        for name, p in self.stage.module.named_parameters(remove_duplicate=False):  # every name of a tie
            idx, rest = name.split(".", 1)
            t = tensors(p)
            out[f"{start + int(idx)}.{rest}"] = None if t is None else t.detach().cpu().clone()
        return out

    def _checkpoint(self, step_done: int) -> None:
        persist.save(self, step_done)

    def _barrier(self) -> None:
        if self.w.device.type == "cpu":
            dist.monitored_barrier(group=self.job_group, timeout=timedelta(seconds=self.cfg.timeout_s), wait_all_ranks=True)
        else:
            dist.barrier(group=self.job_group)

    def _due(self, every: int, done: int) -> bool:
        """Whether something done every ``every`` steps is due after ``done`` steps (and after the last)."""
        return bool(every) and (done % every == 0 or done == self.cfg.steps)

    def open_outputs(self, step: int) -> None:
        """Rank 0's outputs for the run going on at ``step`` (:func:`deepcee.runtime.outputs.open_outputs`)."""
        outputs.open_outputs(self, step)

    def close_outputs(self) -> None:
        outputs.close_outputs(self)

    def train(self, *, joining: bool = False) -> TrainResult | None:
        """Run the steps; rank 0 returns the result (also written to ``result.json``).

        A failed step goes to the hooks' :meth:`~deepcee.runtime.hooks.TrainerHooks.recover`
        (re-raised, unless the run is elastic: then the run goes on at the step it returns).
        ``joining``: a device that comes back mid-run (its hooks set it up; no start-up collective)."""
        if self.plan.strategy.kind != "exact":
            return self._train_relaxed()
        self.rank_infos = None if joining else gather_rank_infos(self)
        self.capture: dict[str, Any] = {}
        self.open_outputs(self.start_step)
        if not joining:
            self._barrier()
        step, carried = self.start_step, None
        t_prev = self.clock.wall()
        while step < self.cfg.steps:
            try:
                carried, t_prev, stop = self._step(step, carried, t_prev)
                step += 1
                if stop:
                    break  # every rank has the same (all-reduced) evaluation loss: all stop here
            except Exception as exc:  # noqa: BLE001  (the hooks decide; FixedPlan re-raises)
                if self.unrecorded is not None and self.unrecorded[0] == step:
                    outputs.record_step(self, )  # the step was applied everywhere; its boundary failed
                step, carried = self.hooks.recover(self, step, exc)
                t_prev = self.clock.wall()
        return outputs.finish(self)

    def _step(self, step: int, carried: AppliedChange | None,
              t_prev: float) -> tuple[AppliedChange | None, float, bool]:
        """Step ``step`` and its boundary; returns the change applied for the next step, when it
        started, and whether the run stops here (the target loss reached)."""
        mine = self._train_step(step, self.capture) if self.active else self._serve_step()
        gathered = outputs.gather(self, mine)
        step_s = self.clock.wall() - t_prev
        self.unrecorded = (step, gathered, step_s, carried)
        # evaluations and checkpoints are not part of any step's time
        if self._due(self.cfg.eval_every, step + 1) or self._due(self.cfg.checkpoint_every, step + 1):
            self.w.waiter.gate(f"boundary/{step}")
        eval_loss = evaluate(self) if self._due(self.cfg.eval_every, step + 1) else None
        if self._due(self.cfg.checkpoint_every, step + 1):
            self._checkpoint(step + 1)
        boundary = self.hooks.decide(self, step, gathered)
        t_prev = self.clock.wall()  # the decision is not part of any step; applying it is
        outputs.record_step(self, boundary=boundary, eval_loss=eval_loss)
        if reached(eval_loss, self.cfg.target_loss):
            return None, t_prev, True
        return self.hooks.apply(self), t_prev, False

    def _train_relaxed(self) -> TrainResult | None:
        """A relaxed strategy's run: its own loop, one gather at the end (no per-step barrier)."""
        self._barrier()
        run = rstrat.run_relaxed(self)
        outputs.save_capture(self, {})
        gathered = outputs.gather(self, run)
        if self.w.rank != 0:
            return None
        records, replicas = rstrat.relaxed_records(gathered, self)
        writer = ckpt.MetricsWriter(self.run_dir / "metrics.jsonl")
        for rec in records:
            writer.write(rec.to_dict())
        writer.close()
        result = train_result(
            records, job=self.job.name, plan=self.plan, plan_digest=self.digest, start_step=0, steps=self.cfg.steps,
            emulation=self.info, run_dir=str(self.run_dir), sync=rstrat.describe_sync(self.plan, self.topo),
            replicas=replicas, target_loss=self.cfg.target_loss)
        save_json_atomic(self.run_dir / "result.json", result.to_dict())
        return result

    def _serve_step(self) -> None:
        """A server rank's part of an exact step (``ps`` segments); other idle ranks do nothing."""
        if self.is_server:
            rstrat.serve_exact_step(self)

    def _train_step(self, step: int, capture: dict[str, Any]) -> RankMetrics:
        """One step of this (active) rank: schedule row, gradient sync, optimizer step (learning
        rate, global norm and clipping: :mod:`deepcee.runtime.optstep`); its metrics."""
        self.stage.zero_grad()
        loss_scale = self.optstep.loss_scale
        rec = run_step(self.actions, self.stage, self.p2p, self.feeds(step), self.pacer, trace=self.cfg.trace)
        sync_s = rstrat.sync_exact(self) + self._sum_tied_gradients()
        if self.cfg.capture and step == self.start_step:
            capture["grads"] = self.named_tensors(lambda p: p.grad)
        owned = norm_owned(self) if self.optstep.measures_norm else []
        norm = self.optstep.measure(self.stage.params, owned, self.active_group, self.w.waiter)
        self.hooks.before_update(self, step)  # an elastic run's commit point: no collective after it
        outcome = self.optstep(step, self.optimizer, self.stage.params, norm,
                               pace=self.pacer.run)  # the emulated device steps at its own speed too
        return self.rank_metrics(rec, sync_s, outcome, loss_scale)

    def rank_metrics(self, rec: StepRecord, sync_s: float, outcome: StepOutcome | None = None,
                     loss_scale: float = 1.0) -> RankMetrics:
        """This rank's record of a step (``sync_s``: its gradient synchronisation)."""
        stats = self.p2p.stats
        return RankMetrics(
            rank=self.w.rank, replica=self.placement.replica, stage=self.placement.stage, device=self.placement.device,
            loss=rec.loss / loss_scale,
            compute_s=rec.compute_s, cpu_s=rec.cpu_s, wait_s=rec.wait_s, sync_s=sync_s,
            peak_in_flight=rec.peak_in_flight, bytes_sent=dict(stats.bytes_sent), trace=tuple(rec.trace),
            transfers=tuple((res, n, self.emulated_s(t0), self.emulated_s(t1)) for res, n, t0, t1 in stats.transfers),
            change=self.hooks.rank_change(), grad_norm=None if outcome is None else outcome.grad_norm,
            peak_memory_bytes=peak_memory.peak_bytes(self.w.device))


def write_error(run_dir: str | Path, rank: int, exc: BaseException) -> None:
    """Record a rank's failure for the launcher (first failure by time is the likely cause)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    domain = isinstance(exc, DeepceeError)
    save_json_atomic(Path(run_dir) / f"error-rank{rank}.json", {
        "rank": rank, "time": time.time(), "type": type(exc).__name__, "domain": domain,
        "message": str(exc), "traceback": "" if domain else traceback.format_exc(),
    })
