"""A trainer's outputs: step records gathered on rank 0, the metrics file, progress lines, the result.

Functions of a :class:`~deepcee.runtime.trainer.Trainer` (as :mod:`deepcee.runtime.persist`
holds its checkpoints): :func:`gather` brings every rank's step record to rank 0 (out of band
where [Note: metrics out of band] says so), :func:`record_step` writes one step's line,
:func:`open_outputs` / :func:`close_outputs` open and close rank 0's files (a rank that becomes
rank 0 mid-run takes over from the metrics file), :func:`finish` writes ``result.json`` and
:func:`save_capture` a test's capture of the final parameters.
"""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepcee.errors import RuntimeSetupError
from deepcee.plan import save_json_atomic
from deepcee.runtime import checkpoint as ckpt
from deepcee.runtime import strategies as rstrat
from deepcee.runtime.progress import RunLog
from deepcee.runtime.records import (
    BoundaryMetrics,
    TrainResult,
    read_step_metrics,
    step_metrics,
    train_result,
)

if TYPE_CHECKING:
    from deepcee.runtime.trainer import Trainer

STORE_POLL_S = 5e-4
"""How often rank 0 looks for the ranks' step records in the store (mode ``realnet``); a check
of a ``FileStore`` costs about 10 us."""


def gather(t: Trainer, obj: Any) -> list[Any] | None:
    """Every rank's step record on rank 0 (``None`` elsewhere). See [Note: metrics out of band]."""
    if t.cfg.mode == "realnet" or t.w.waiter.out_of_band:
        return _gather_through_store(t, obj)
    out = [None] * dist.get_world_size(group=t.job_group) if t.w.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=t.job_group)
    return out


# [Note: metrics out of band]
# The step records are bookkeeping, not training: in mode ``emulated`` their gather crosses
# unshaped loopback and costs well under a millisecond. In mode ``realnet`` the same gloo
# gather would cross the emulated WAN: a size all-gather and a gather, each waiting for its
# peer, stall every rank about 4 one-way latencies per step (measured: 86 ms of a 280 ms
# step on a 20 ms link). So in ``realnet`` the records travel through the launch's
# ``FileStore`` (the shared filesystem, outside the namespaces' links): each rank publishes
# its record and goes on, rank 0 polls until all are there. Ranks then meet only where
# training makes them (transfers, all-reduces), as on a real deployment without metrics.
# An elastic run's records go the same way (its waits watch for lost peers).
def _gather_through_store(t: Trainer, obj: Any) -> list[Any] | None:
    t.records_sent += 1
    prefix = f"{t.records_key}/records/{t.records_sent}"
    t.w.store.set(f"{prefix}/{t.w.rank}", pickle.dumps(obj))
    if t.w.rank != 0:
        return None
    # the job group is ranks 0..n-1 (the plan's active ranks or the world)
    keys = [f"{prefix}/{r}" for r in range(dist.get_world_size(group=t.job_group))]
    t_end = t.clock.wall() + t.cfg.timeout_s
    while not t.w.store.check(keys):
        t.w.waiter.check()
        if t.clock.wall() > t_end:
            missing = [k.rsplit("/", 1)[1] for k in keys if not t.w.store.check([k])]
            raise RuntimeSetupError(f"rank 0: no step record from ranks {missing} within {t.cfg.timeout_s:g} s")
        time.sleep(STORE_POLL_S)
    out = [pickle.loads(t.w.store.get(k)) for k in keys]
    for k in keys:
        t.w.store.delete_key(k)
    return out


def open_outputs(t: Trainer, step: int) -> None:
    """Rank 0's metrics file, progress lines and step records, the run going on at ``step``:
    lines of steps from ``step`` on are dropped, the records of this launch's earlier steps
    read back (a rank that becomes rank 0 mid-run takes over from the file). Elsewhere none."""
    close_outputs(t)
    if t.w.rank != 0:
        return
    path = t.run_dir / "metrics.jsonl"
    t.writer = ckpt.MetricsWriter(path, append=step > 0, start_step=step)
    t.records = [r for r in read_step_metrics(path) if t.first_step <= r.step < step] if step > t.first_step else []
    t.runlog = RunLog.for_run(t.cfg, t.run_dir, global_batch=t.plan.global_batch)


def close_outputs(t: Trainer) -> None:
    for out in (t.writer, t.runlog):
        if out is not None:
            out.close()
    t.writer = t.runlog = None


def record_step(t: Trainer, *, boundary: BoundaryMetrics | None = None, eval_loss: float | None = None) -> None:
    """Rank 0: write the record of the step trained last (once). An elastic run's rank 0 calls
    it when the step's boundary (checkpoint, evaluation, decision) failed after every member
    had applied the step's update: the step is part of the run, without the boundary's part."""
    if t.unrecorded is None:
        return
    step, gathered, step_s, carried = t.unrecorded
    t.unrecorded = None
    if t.writer is None:
        return
    ranks_now = [r for r in gathered if r is not None]
    norm = next((r.grad_norm for r in ranks_now if r.grad_norm is not None), None)
    t.records.append(step_metrics(step, ranks_now, step_s, global_batch=t.plan.global_batch, emulation=t.info,
                                  epoch=t.epoch if t.cfg.trace else None, change=carried, boundary=boundary,
                                  lr=t.optstep.lr(step), grad_norm=norm, eval_loss=eval_loss,
                                  strategy=t.plan.strategy))
    t.writer.write(t.records[-1].to_dict())
    t.runlog.step(t.records[-1])


def finish(t: Trainer) -> TrainResult | None:
    """The end of an exact run: the capture, and on rank 0 ``result.json`` (returned)."""
    save_capture(t, t.capture)
    if t.writer is None:
        return None
    close_outputs(t)
    result = train_result(
        t.records, job=t.job.name, plan=t.plan, plan_digest=t.digest, start_step=t.first_step,
        steps=t.cfg.steps, emulation=t.info, run_dir=str(t.run_dir), adapter=t.hooks.adapter_run(),
        sync=rstrat.describe_sync(t.plan, t.topo),
        ranks=t.rank_infos or (), resumed=t.resumed, target_loss=t.cfg.target_loss)
    save_json_atomic(t.run_dir / "result.json", result.to_dict())
    return result


def save_capture(t: Trainer, capture: dict[str, Any]) -> None:
    """``capture`` plus this rank's final parameters in ``<run_dir>/capture/rank<r>.pt`` (``capture`` runs)."""
    if t.cfg.capture and t.active:
        capture["params"] = t.named_tensors(lambda p: p)
        (t.run_dir / "capture").mkdir(parents=True, exist_ok=True)
        torch.save(capture, t.run_dir / "capture" / f"rank{t.w.rank}.pt")


__all__ = ["close_outputs", "finish", "gather", "open_outputs", "record_step", "save_capture"]
