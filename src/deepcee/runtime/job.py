"""A training job: what every rank of a run gets (pickled to spawned processes as is).

:class:`Job` carries the :class:`~deepcee.plan.Plan` and :class:`~deepcee.cluster.Cluster`
objects themselves (frozen dataclasses pickle as they are; nothing is turned into a dict and
parsed again on the way to the ranks), the model, a :class:`TrainConfig` and, for a run
whose plan changes while it runs, a :class:`~deepcee.runtime.hooks.HooksFactory` (the
adapter's). Launchers: :func:`deepcee.runtime.launch.launch_jobs` (local processes) and
:func:`deepcee.runtime.rank.run_jobs_on_rank` (each rank, e.g. under ``torchrun``).

Torch is imported only to build an optimizer or to send a job to its ranks, so the entry points
can build jobs cheaply.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from deepcee.cluster import Cluster
from deepcee.cluster.outages import LinkOutage
from deepcee.cluster.stragglers import Straggler
from deepcee.errors import SpecError
from deepcee.plan import Plan
from deepcee.runtime.emulation import DEFAULT_CORES, MODES, PACED_MODES, Mode
from deepcee.runtime.lr import LRSchedule
from deepcee.runtime.partition import rank_devices
from deepcee.runtime.target import check_target_loss

if TYPE_CHECKING:
    import torch
    from torch import nn

    from deepcee.runtime.data import Dataset
    from deepcee.runtime.hooks import HooksFactory
    from deepcee.runtime.params import PackedModel


Autocast = Literal["bfloat16", "float16"]
AUTOCASTS: tuple[str, ...] = ("bfloat16", "float16")


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerConfig:
    """Per-parameter optimizers only (no global norms), so per-stage optimizers equal a whole-model one."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    momentum: float = 0.0
    """SGD only."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise SpecError(f"unknown optimizer {self.name!r} (known: adamw, sgd)", field="optimizer")
        if self.lr <= 0:
            raise SpecError(f"must be > 0, got {self.lr!r}", field="optimizer.lr")

    def build(self, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """How to train (the plan says where and in what order)."""

    steps: int
    seed: int = 0
    dtype: Literal["float32", "float64"] = "float32"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mode: Mode = "emulated"
    """``emulated``: devices and links emulated on this machine; ``realnet``: devices emulated,
    links real TCP through the shaping relay between network namespaces (ranks started by
    :func:`deepcee.runtime.realnet.launch_realnet`, which :func:`deepcee.runtime.launch.launch_jobs`
    does for this mode); ``real``: run as fast as it goes."""
    cores: float = DEFAULT_CORES
    """CPU cores the emulated devices may use together (sets the dilation)."""
    dilation: float | None = None
    """Force the time dilation ``D`` (default: from ``cores``)."""
    timeout_s: float = 60.0
    """Limit on every receive, collective and start-up wait."""
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    capture: bool = False
    """Save step-0 gradients and final parameters of every rank (tests compare them)."""
    trace: bool = False
    """Record every action's start and end in the metrics."""
    use_cuda: bool = False
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    clip_grad_norm: float | None = None
    """Clip the gradient to this global norm (over every stage, device and replica, as one
    process would: :mod:`deepcee.runtime.optstep`); ``None``: no clipping."""
    autocast: Autocast | None = None
    """``bfloat16`` / ``float16`` mixed precision (CUDA only; float16 adds a dynamic loss scale)."""
    eval_every: int = 0
    """Evaluation loss on the dataset's held-out batches every this many steps (0: never)."""
    eval_batches: int = 4
    """Held-out global batches per evaluation (at most)."""
    probes: bool | None = None
    """Model averaging: at every multiple of ``eval_every`` that is not right after an average,
    evaluate the model the replicas would hold if they averaged then, training left untouched
    ([Note: probe evaluations] in :mod:`deepcee.runtime.strategies`); recorded as
    ``probe_loss``, never as ``eval_loss``, and never judged against the target. ``None``: on
    for blocking model averaging with ``eval_every``, off otherwise (overlapped averaging
    refuses them); other strategies ignore it."""
    target_loss: float | None = None
    """Stop at the first evaluation whose loss is at or below this (needs ``eval_every``;
    :mod:`deepcee.runtime.target`); ``None``: run every step."""
    log_every: int = 0
    """A progress line (step, loss, samples/s, ETA) through ``logging`` every this many steps (0: none)."""
    tensorboard: bool = False
    """Write TensorBoard scalars to ``<run_dir>/tensorboard`` (needs the ``tensorboard`` package)."""
    init_from: str | None = None
    """Start from these weights: a state-dict file (``.pt``/``.safetensors``, the model's own names)
    or a checkpoint folder (model only; the optimizer starts fresh). Ignored when resuming."""
    stragglers: tuple[Straggler, ...] = ()
    """Devices slowed down for a stretch of the run (emulated modes; see :class:`Straggler`)."""
    link_outages: tuple[LinkOutage, ...] = ()
    """Links between two nodes down for a stretch of the run (:mod:`deepcee.cluster.outages`):
    mode ``emulated``: the link shaper holds transfers; ``realnet``: the relay drops every packet
    of the link's pairs."""
    receives: Literal["auto", "at-step-start", "in-order"] = "auto"
    """When the transport posts its receives ([Note: in-order receives] in
    :mod:`deepcee.runtime.p2p`): ``at-step-start`` (every receive of a step when it starts,
    send buffers held to its end: the CPU/gloo default), ``in-order`` (each receive when the
    schedule reaches it, send buffers freed as their sends complete: what CUDA/NCCL needs);
    ``auto``: in order on CUDA, at the step start on CPU."""
    fixed_arrival_order: bool = False
    """``asgd-ga``: servers take pushes from the replicas in turn instead of as they arrive
    (reproducible bit for bit; [Note: asgd-ga] in :mod:`deepcee.runtime.ps`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise SpecError(f"must be an integer >= 1, got {self.steps!r}", field="steps")
        if self.dtype not in ("float32", "float64"):
            raise SpecError(f"must be float32 or float64, got {self.dtype!r}", field="dtype")
        if self.mode not in MODES:
            raise SpecError(f"must be one of {', '.join(MODES)}, got {self.mode!r}", field="mode")
        if self.timeout_s <= 0 or self.cores <= 0:
            raise SpecError(f"timeout_s and cores must be > 0, got {self.timeout_s!r}, {self.cores!r}")
        if self.dilation is not None and self.dilation < 1:
            raise SpecError(f"must be >= 1, got {self.dilation!r}", field="dilation")
        if any(not isinstance(s, Straggler) for s in self.stragglers):
            raise SpecError(f"must be Straggler records, got {self.stragglers!r}", field="stragglers")
        if self.stragglers and self.mode not in PACED_MODES:
            raise SpecError(f"stragglers are emulated device slowdowns; mode {self.mode!r} does not pace devices",
                            field="stragglers")
        if any(not isinstance(o, LinkOutage) for o in self.link_outages):
            raise SpecError(f"must be LinkOutage records, got {self.link_outages!r}", field="link_outages")
        if self.link_outages and self.mode not in ("emulated", "realnet"):
            raise SpecError(f"link outages are injected by the emulated link shaper or the realnet relay; mode "
                            f"{self.mode!r} has neither", field="link-down")
        if self.receives not in ("auto", "at-step-start", "in-order"):
            raise SpecError(f"must be auto, at-step-start or in-order, got {self.receives!r}", field="receives")
        if self.receives == "at-step-start" and self.use_cuda:
            raise SpecError("NCCL runs a pair's sends and receives in order on one stream: receives posted at the "
                            "step start would deadlock; use in-order (or auto) with CUDA", field="receives")
        if self.mode in PACED_MODES and self.use_cuda:
            raise SpecError(f"mode {self.mode!r} paces CPU workers as emulated devices; use mode 'real' with CUDA",
                            field="mode")
        self._check_essentials()

    def _check_essentials(self) -> None:
        for name in ("eval_every", "log_every", "checkpoint_every", "keep_checkpoints"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SpecError(f"must be an integer >= 0, got {v!r}", field=name)
        check_target_loss(self.target_loss)
        if self.probes is not None and not isinstance(self.probes, bool):
            raise SpecError(f"must be true, false or unset, got {self.probes!r}", field="probes")
        if self.probes and not self.eval_every:
            raise SpecError("probes are taken at multiples of eval_every: set eval_every (--eval-every) too",
                            field="probes")
        if self.target_loss is not None and not self.eval_every:
            raise SpecError("a target loss is checked at evaluations: set eval_every (--eval-every) too",
                            field="target_loss")
        if isinstance(self.eval_batches, bool) or not isinstance(self.eval_batches, int) or self.eval_batches < 1:
            raise SpecError(f"must be an integer >= 1, got {self.eval_batches!r}", field="eval_batches")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise SpecError("TensorBoard logs need the tensorboard package, which is not installed "
                            "(pip install tensorboard)", field="tensorboard")
        if self.init_from is not None and not Path(self.init_from).exists():
            raise SpecError(f"no such file or folder: {self.init_from!r}", field="init_from")
        c = self.clip_grad_norm
        if c is not None and not (isinstance(c, int | float) and math.isfinite(c) and c > 0):
            raise SpecError(f"must be a finite number > 0, got {c!r}", field="clip_grad_norm")
        if self.autocast is not None:
            if self.autocast not in AUTOCASTS:
                raise SpecError(f"must be one of {', '.join(AUTOCASTS)}, got {self.autocast!r}", field="autocast")
            if not self.use_cuda:
                raise SpecError(f"{self.autocast} autocast runs on CUDA only (add --cuda, mode real); "
                                "on CPU train in float32 or float64", field="autocast")
            if self.dtype != "float32":
                raise SpecError(f"autocast keeps float32 master weights, got dtype {self.dtype!r}", field="autocast")


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One training run of a plan."""

    name: str
    """Namespaces the run's keys in the shared store; the same on every rank."""
    plan: Plan
    cluster: Cluster
    model: str | Sequence[nn.Module] | PackedModel
    """A built-in net's name, or the user's blocks (see :func:`deepcee.nets.as_blocks`), which
    travel packed and are copied on every rank ([Note: private copies] in :mod:`deepcee.runtime.params`)."""
    config: TrainConfig
    run_dir: str
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    dataset: Dataset | None = None
    checkpoint_dir: str | None = None
    hooks: HooksFactory | None = None
    """Builds each rank's :class:`~deepcee.runtime.hooks.TrainerHooks` (the adapter's, for a run
    whose plan changes); ``None``: the plan is fixed. Must pickle."""

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Plan):
            raise SpecError(f"job {self.name!r}: plan must be a deepcee.plan.Plan, got {type(self.plan).__name__} "
                            "(load a plan file with deepcee.planfile.load_plan)", field="plan")
        if not isinstance(self.cluster, Cluster):
            raise SpecError(f"job {self.name!r}: cluster must be a deepcee.cluster.Cluster, got "
                            f"{type(self.cluster).__name__}", field="cluster")
        if not isinstance(self.config, TrainConfig):
            raise SpecError(f"job {self.name!r}: config must be a TrainConfig, got {type(self.config).__name__}",
                            field="config")

    def __reduce__(self) -> tuple[Any, ...]:
        from deepcee.runtime import params  # torch, loaded anyway where jobs are sent to ranks

        return params.reduce_job(self)  # a user model must not reach the ranks as shared memory

    def rank_devices(self) -> tuple[str, ...]:
        """The device of each rank: the hooks' fixed devices, else the plan's devices in rank order
        followed by its parameter servers ([Note: server ranks] in :mod:`deepcee.runtime.partition`)."""
        return rank_devices(self.plan) if self.hooks is None else tuple(self.hooks.rank_devices(self))


def plan_digest(plan: Plan) -> str:
    """A plan's identity: its content without the estimate and explanation (16 hex digits)."""
    d = plan.to_dict()
    d.pop("estimate", None)
    d.pop("explanation", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def job_name(plan: Plan, model: str, *, run_id: str = "") -> str:
    """The name of a run's job, from what it trains (plan content, model, the launcher's run id),
    never from how a path is spelled: every node of a torchrun launch computes the same name
    whatever its paths look like, so they meet under one store prefix."""
    key = json.dumps([plan_digest(plan), model, run_id])
    return "train-" + hashlib.sha256(key.encode()).hexdigest()[:8]
