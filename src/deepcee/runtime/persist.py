"""A trainer's checkpoints: save its stage's state by name, resume (under any plan), start from weights.

The format is [Note: checkpoint layout] in :mod:`deepcee.runtime.checkpoint`; names are
[Note: state names] in :mod:`deepcee.runtime.state`. Every function here is collective over
the trainer's job group (every rank that trains calls it at the same point): DCP saves and
loads are, and rank 0's verdict on which checkpoint to use, or why none can be used, is
broadcast so every rank goes on, or fails, together. A rank of the group that holds no stage
(idle under an adaptive run's plan) takes part with nothing to write or load.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepcee.errors import RuntimeSetupError
from deepcee.runtime import checkpoint as ckpt
from deepcee.runtime import state as rstate
from deepcee.runtime.records import ResumeRecord

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer

log = logging.getLogger(__name__)


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported on first use: it pulls in DTensor and sympy, 1.3 s
    of the 4.6 s a rank spent importing (``python -X importtime``), which a run that never saves or
    loads a checkpoint (the default, ``checkpoint_every = 0``) does not need."""
    import torch.distributed.checkpoint as dcp

    return dcp


@dataclass(frozen=True, slots=True, kw_only=True)
class _Verdict:
    """Rank 0's answer, broadcast: a checkpoint, nothing, or the error every rank raises."""

    choice: ckpt.Choice | None = None
    error: str | None = None


def _agree(t: Trainer, decide: Any) -> ckpt.Choice | None:
    """Run ``decide()`` on rank 0 and give its result (or its error) to every rank."""
    box: list[Any] = [None]
    if t.w.rank == 0:
        try:
            box[0] = _Verdict(choice=decide())
        except RuntimeSetupError as exc:
            box[0] = _Verdict(error=str(exc))
    t.w.waiter.call(lambda: dist.broadcast_object_list(box, src=0, group=t.job_group), what="the checkpoint verdict")
    verdict: _Verdict = box[0]
    if verdict.error is not None:
        raise RuntimeSetupError(verdict.error)
    return verdict.choice


def _fail_together(t: Trainer, error: str | None) -> None:
    """Raise on every rank if any rank found ``error`` (the others would wait in a collective)."""
    errors: list[str | None] = [None] * dist.get_world_size(group=t.job_group)
    t.w.waiter.call(lambda: dist.all_gather_object(errors, error, group=t.job_group), what="the checkpoint check")
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise RuntimeSetupError(first)


def _stage_span(t: Trainer) -> tuple[int, int]:
    if not t.active:  # a parameter server: holds no stage, takes part in the collectives
        return 0, 0
    st = t.pipeline.stages[t.placement.stage]
    return st.layer_start, st.layer_stop


def _writes(t: Trainer) -> bool:
    """Whether this rank writes its stage's state: device 0 of the stage (the others hold the
    same tensors after the gradient all-reduce) of the first replica."""
    return t.active and t.placement.index == 0 and t.placement.replica == 0


def _owned(t: Trainer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors whose first holding block is on this stage (a tie is written once)."""
    start, stop = _stage_span(t)
    owners = t.state_names.owner_blocks()
    return {k: v for k, v in tensors.items() if start <= owners[k][0] < stop}


def model_label(model: Any) -> str:
    return model if isinstance(model, str) else "user model"


def save(t: Trainer, step: int) -> None:
    """Write checkpoint ``step`` (steps completed) and commit it (collective)."""
    root = t.ckpt_root()
    folder = ckpt.step_dir(root, step)
    if t.w.rank == 0:
        ckpt.clear_for_write(folder)
    # every rank waits for the clear: DCP's save makes the folder on each rank before its first
    # collective, so a rank running ahead could make it while rank 0 removes it (seen in CI:
    # FileExistsError from pathlib's mkdir on a folder removed between its mkdir and is_dir)
    t.w.waiter.call(lambda: dist.barrier(group=t.job_group), what=f"clearing checkpoint step {step}")
    state: dict[str, torch.Tensor] = {}
    if _writes(t):
        start, stop = _stage_span(t)
        model = _owned(t, rstate.stage_tensors(t.blocks, t.state_names, start, stop))
        state.update({rstate.MODEL_PREFIX + k: v for k, v in model.items()})
        pnames = rstate.param_names(t.blocks, t.state_names, start, stop, t.stage.params)
        for key, v in rstate.optimizer_tensors(t.optimizer, pnames).items():
            if key.rsplit("/", 1)[0] in model:
                state[rstate.OPTIM_PREFIX + key] = v
    # watched: a rank in the save when a peer is lost stops within a heartbeat ([Note: watched
    # calls] in deepcee.runtime.elastic); the checkpoint is committed only after it returned here
    dcp = _dcp()  # imported here, not in the watched call's thread
    t.w.waiter.call(lambda: dcp.save(state, checkpoint_id=str(folder), process_group=t.job_group),
                    what=f"saving checkpoint step {step}")
    if t.w.rank == 0:
        ckpt.commit(folder, ckpt.Manifest(
            step=step, plan_digest=t.digest, model=model_label(t.job.model), dtype=t.cfg.dtype,
            optimizer=t.cfg.optimizer.name, files=ckpt.checksum_folder(folder), names=t.state_names.aliases))
        ckpt.prune(root, t.cfg.keep_checkpoints, step)
        log.info("checkpoint step %d written to %s", step, folder)


def _stored_keys(folder: str) -> dict[str, Any]:
    """Key -> DCP storage metadata of a checkpoint folder."""
    reader = _dcp().FileSystemReader(folder)
    return dict(reader.read_metadata().state_dict_metadata)


def _load_stage(t: Trainer, choice: ckpt.Choice, *, optimizer: bool, every_block: bool = False) -> None:
    """Fill this rank's stage (and optimizer) from ``choice`` by name (collective); ``every_block``:
    every block this rank holds, model state only (before a stage exists)."""
    stored = _stored_keys(choice.folder)
    optimizer = optimizer and t.active
    start, stop = (0, len(t.blocks)) if every_block else (_stage_span(t) if t.active else (0, 0))
    model = rstate.stage_tensors(t.blocks, t.state_names, start, stop)
    missing = [k for k in model if rstate.MODEL_PREFIX + k not in stored]
    _fail_together(t, None if not missing else (
        f"{choice.folder}: no {missing[0]} (and {len(missing) - 1} more) in this checkpoint of "
        f"{choice.manifest.model!r}; this run trains {model_label(t.job.model)!r}"))
    template: dict[str, Any] = {rstate.MODEL_PREFIX + k: v for k, v in model.items()}
    optimizer = optimizer and t.active
    pnames = rstate.param_names(t.blocks, t.state_names, start, stop, t.stage.params) if optimizer else []
    if optimizer:
        wanted = {rstate.OPTIM_PREFIX + n + "/" for n in pnames}
        for key, md in stored.items():
            if key.startswith(rstate.OPTIM_PREFIX) and key.rsplit("/", 1)[0] + "/" in wanted:
                template[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    dcp = _dcp()
    t.w.waiter.call(lambda: dcp.load(template, checkpoint_id=choice.folder, process_group=t.job_group),
                    what=f"loading checkpoint {choice.folder}")
    if optimizer:
        flat = {k.removeprefix(rstate.OPTIM_PREFIX): v for k, v in template.items() if k.startswith(rstate.OPTIM_PREFIX)}
        rstate.load_optimizer_tensors(t.optimizer, pnames, flat)


def resume(t: Trainer) -> ResumeRecord | None:
    """Load the newest intact checkpoint, under whatever plan this run has (collective)."""
    choice = _agree(t, lambda: ckpt.choose(t.ckpt_root()))
    if choice is None:
        if t.w.rank == 0:  # a mistyped --run-dir would otherwise retrain from scratch without a word
            log.warning("--resume: no intact checkpoint under %s: training starts at step 0", t.ckpt_root())
        return None
    same_optimizer = choice.manifest.optimizer == t.cfg.optimizer.name
    if not same_optimizer and t.w.rank == 0:
        log.warning("checkpoint %s holds %s state, this run uses %s: the optimizer starts fresh",
                    choice.folder, choice.manifest.optimizer, t.cfg.optimizer.name)
    _load_stage(t, choice, optimizer=same_optimizer)
    record = ResumeRecord(step=choice.step, folder=choice.folder, plan_digest=choice.manifest.plan_digest,
                          same_plan=choice.manifest.plan_digest == t.digest, steps_lost=choice.steps_lost,
                          skipped=tuple((s.step, s.reason) for s in choice.skipped))
    if t.w.rank == 0:
        log.info("resuming at step %d from %s%s", record.step, record.folder,
                 "" if record.same_plan else f" (written by plan {record.plan_digest}; loaded by parameter names)")
        if record.skipped:
            log.warning("%d newer checkpoint(s) damaged or incomplete; %d steps are redone",
                        len(record.skipped), record.steps_lost)
    return record


def init_weights(t: Trainer, source: str) -> None:
    """Start every block this rank holds from the weights in ``source`` (a state-dict file or a
    checkpoint folder), strictly by name (collective; before the stage is built); the optimizer
    starts fresh."""
    if Path(source).is_dir():
        choice = _agree(t, lambda: ckpt.resolve(source))
        rstate.check_names(t.state_names, [n for _, names in choice.manifest.names for n in names], source=source)
        _load_stage(t, choice, optimizer=False, every_block=True)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            weights = rstate.read_state_file(source)
        rstate.check_names(t.state_names, weights, source=source)
        rstate.copy_into(rstate.stage_tensors(t.blocks, t.state_names, 0, len(t.blocks)), t.state_names, weights,
                         source=source)
    if t.w.rank == 0:
        log.info("weights from %s", source)
