"""Checkpoint integrity without processes: the manifest is the commit point, damaged or missing
files are named and passed over for the newest intact checkpoint, old per-stage checkpoints
get a one-line error naming the file, pruning keeps the newest; the run-folder lock; state
names of user models, built-in nets and wrapped modules; weights by name, strictly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict

import pytest
import torch
from torch import nn

from deepcee.errors import RuntimeSetupError
from deepcee.runtime import checkpoint as ckpt
from deepcee.runtime import runlock
from deepcee.runtime import state as rstate
from deepcee.runtime.checkpoint import MetricsWriter


def _write(root, step: int, files: dict[str, bytes], *, commit: bool = True) -> None:
    folder = ckpt.step_dir(root, step)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    if commit:
        ckpt.commit(folder, ckpt.Manifest(step=step, plan_digest="p", model="m", dtype="float32", optimizer="adamw",
                                          files=ckpt.checksum_folder(folder)))


def test_newest_intact_checkpoint_wins_and_damage_is_named(tmp_path):
    for step in (2, 4, 6):
        _write(tmp_path, step, {".metadata": b"m" * 10, "__0_0.distcp": bytes(range(100))})
    _write(tmp_path, 8, {".metadata": b"x"}, commit=False)  # an interrupted write
    assert ckpt.choose(tmp_path).step == 6 and ckpt.choose(tmp_path).skipped[0].committed is False
    bad = ckpt.step_dir(tmp_path, 6) / "__0_0.distcp"
    bad.write_bytes(bytes(range(1, 101)))  # same size, other bytes
    (ckpt.step_dir(tmp_path, 4) / "__0_0.distcp").write_bytes(b"short")
    choice = ckpt.choose(tmp_path)
    assert choice.step == 2 and choice.steps_lost == 6  # step 8 was never committed but was reached
    reasons = [s.reason for s in choice.skipped]
    assert "step-00000008/manifest.json: missing (the write of this checkpoint did not finish)" in reasons[0]
    assert f"{bad}: checksum differs from the manifest (the file is corrupt)" == reasons[1]
    assert "__0_0.distcp: 5 bytes, the manifest says 100 (truncated or replaced)" in reasons[2]
    (ckpt.step_dir(tmp_path, 2) / ".metadata").unlink()
    with pytest.raises(RuntimeSetupError, match=r"no intact checkpoint to resume from; newest: .*step-00000006"):
        ckpt.choose(tmp_path)


def test_nothing_committed_starts_from_scratch_and_no_folder_is_no_checkpoint(tmp_path):
    assert ckpt.choose(tmp_path / "none") is None
    _write(tmp_path, 3, {"__0_0.distcp": b"x"}, commit=False)
    assert ckpt.choose(tmp_path) is None


def test_old_per_stage_checkpoints_get_one_line_naming_the_file(tmp_path):
    (tmp_path / "latest.json").write_text('{"format": "deepcee.checkpoint", "schema_version": 1, "step": 2}')
    (ckpt.step_dir(tmp_path, 2)).mkdir()
    (ckpt.step_dir(tmp_path, 2) / "stage0.pt").write_bytes(b"old")
    with pytest.raises(RuntimeSetupError) as err:
        ckpt.choose(tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'latest.json'}: checkpoint in the old per-stage format") and "\n" not in msg
    with pytest.raises(RuntimeSetupError, match="old per-stage format"):
        ckpt.resolve(tmp_path)


def test_a_foreign_manifest_is_named(tmp_path):
    folder = ckpt.step_dir(tmp_path, 1)
    folder.mkdir()
    (folder / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(RuntimeSetupError, match=r"manifest.json: not a deepcee.checkpoint schema 2 manifest"):
        ckpt.verify(folder)


def test_prune_keeps_the_newest_and_drops_interrupted_writes(tmp_path):
    for step in (1, 2, 3):
        _write(tmp_path, step, {"a": b"1"})
    _write(tmp_path, 4, {"a": b"1"}, commit=False)
    _write(tmp_path, 5, {"a": b"1"})
    ckpt.prune(tmp_path, keep=2, newest=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000005"]


def test_resumed_metrics_drop_the_steps_that_are_redone(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl")
    for step in range(5):
        w.write({"step": step})
    w.close()
    w = MetricsWriter(tmp_path / "m.jsonl", append=True, start_step=3)
    w.write({"step": 3})
    w.close()
    assert [r["step"] for r in ckpt.read_metrics(tmp_path / "m.jsonl")] == [0, 1, 2, 3]


# -- the run-folder lock ---------------------------------------------------------------------

HOLD = """
import sys, time
from deepcee.runtime import runlock
lock = runlock.acquire(sys.argv[1], job="holder-job")
print("locked", flush=True)
time.sleep(60)
"""


def test_second_run_fails_at_once_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(RuntimeSetupError) as err:
            runlock.acquire(tmp_path, job="second")
        assert time.monotonic() - t0 < 1.0
        msg = str(err.value)
        assert f"run folder {tmp_path} is in use by job holder-job, pid {holder.pid} on host" in msg
        with pytest.raises(RuntimeSetupError, match="in use by job holder-job"):
            runlock.check_free(tmp_path, job="second")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        with runlock.acquire(tmp_path, job="third") as lock:  # the dead run's lock is taken over
            assert '"job": "third"' in lock.path.read_text()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_launch_refuses_a_locked_run_folder_before_starting_processes(tmp_path):
    from deepcee.plan import Plan, StagePlan
    from deepcee.runtime.launch import run_training
    from deepcee.scenarios import load_scenario

    plan = Plan(system="t", cluster="local-small", model="gpt-tiny", global_batch=2, microbatch_size=2,
                num_microbatches=1, schedule="gpipe",
                stages=(StagePlan(layer_start=0, layer_stop=6, devices=("cloud0:0",), shares=(2,)),))
    with runlock.acquire(tmp_path, job="other"):
        t0 = time.monotonic()
        with pytest.raises(RuntimeSetupError, match=f"run folder {tmp_path} is in use by job other, pid {os.getpid()}"):
            run_training(plan, load_scenario("local-small"), steps=1, run_dir=tmp_path, mode="real")
        assert time.monotonic() - t0 < 2.0


# -- names -------------------------------------------------------------------------------------


class Wrap(nn.Module):
    """What a splitter puts around part of a model: its own attribute names, the model's tensors."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_state_names_of_sequential_list_builtin_and_wrapped_models():
    seq = nn.Sequential(OrderedDict(embed=nn.Linear(2, 3), act=nn.Tanh(), out=nn.Linear(3, 1)))
    assert rstate.state_names(seq).all_names == ("embed.weight", "embed.bias", "out.weight", "out.bias")
    lst = [nn.Linear(2, 3), nn.Linear(3, 1)]
    assert rstate.state_names(lst).block(1) == {"weight": "1.weight", "bias": "1.bias"}
    names = rstate.state_names("gpt-tiny")
    assert names.all_names == tuple(rstate.builtin_model("gpt-tiny").state_dict())
    assert names.block(0)["tok.weight"] == "embed.tok.weight"
    # a root whose parts the blocks wrap: the root's names, found by identity
    root = nn.Module()
    root.encoder, root.head = nn.Linear(2, 3), nn.Linear(3, 2)
    root.head.weight = nn.Parameter(torch.zeros(2, 3))
    wrapped = [Wrap(root.encoder), Wrap(root.head)]
    n = rstate.state_names(root, wrapped)
    assert n.block(0) == {"inner.weight": "encoder.weight", "inner.bias": "encoder.bias"}
    assert n.all_names == tuple(root.state_dict())


def test_tied_tensors_are_one_entry_with_every_name():
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    n = rstate.state_names(nn.ModuleList([emb, head]))
    assert dict(n.aliases)["0.weight"] == ("0.weight", "1.weight")
    assert n.block(1) == {"weight": "0.weight"} and n.owner_blocks()["0.weight"] == (0, 1)


def test_weights_load_by_name_strictly(tmp_path):
    model = [nn.Linear(2, 3), nn.Linear(3, 1)]
    names = rstate.state_names(model)
    good = {k: torch.full_like(v, 2.0) for k, v in nn.ModuleList(model).state_dict().items()}
    torch.save({"model": good}, tmp_path / "w.pt")
    weights = rstate.read_state_file(tmp_path / "w.pt")
    rstate.check_names(names, weights, source="w.pt")
    rstate.copy_into(rstate.stage_tensors(model, names, 0, 2), names, weights, source="w.pt")
    assert torch.equal(model[1].weight, torch.full((1, 3), 2.0))
    with pytest.raises(RuntimeSetupError, match=r"w.pt: weights do not match the model: missing 1 names \(1.bias\); "
                                                r"1 names the model does not have \(extra\)"):
        rstate.check_names(names, {**{k: v for k, v in good.items() if k != "1.bias"}, "extra": good["0.bias"]},
                           source="w.pt")
    with pytest.raises(RuntimeSetupError, match=r"w.pt: 0.weight has shape \(2, 2\), the model \(3, 2\)"):
        rstate.copy_into(rstate.stage_tensors(model, names, 0, 1), names, {**good, "0.weight": torch.zeros(2, 2)},
                         source="w.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(RuntimeSetupError, match="bad.pt: cannot read weights"):
        rstate.read_state_file(tmp_path / "bad.pt")


def test_optimizer_state_round_trips_by_name():
    model = [nn.Linear(2, 3), nn.Linear(3, 1)]
    params = [p for b in model for p in b.parameters()]
    opt = torch.optim.AdamW(params, lr=0.1)
    sum(b(torch.ones(1, 2 if i == 0 else 3)).sum() for i, b in enumerate(model)).backward()
    opt.step()
    names = rstate.state_names(model)
    pnames = rstate.param_names(model, names, 0, 2, params)
    flat = rstate.optimizer_tensors(opt, pnames)
    assert set(flat) == {f"{n}/{k}" for n in pnames for k in ("step", "exp_avg", "exp_avg_sq")}
    fresh = torch.optim.AdamW(params, lr=0.1)
    assert rstate.load_optimizer_tensors(fresh, pnames, flat) == 4
    for k, v in rstate.optimizer_tensors(fresh, pnames).items():
        assert torch.equal(v, flat[k])
