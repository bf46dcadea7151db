"""Checkpoints keyed by the model's own names, and the training essentials, against one process.

Launch 1 (4 processes): gpt-tiny on a 3-stage plan A with a two-device stage, 6 steps with a
warm-up + cosine learning rate, global-norm clipping that bites, evaluation every 3 steps and
checkpoints at 3 and 6; the same for 3 steps into another folder; a user's GPT-2-style model
whose token embedding is the LM head (a tie across the first and last stage) with clipping.
Launch 2, from those checkpoints: resume under plan B (another split on other devices);
resume after the newest checkpoint was corrupted, and after one of its files went missing
(both fall back to step 3); a run that starts from exported weights.

Checked against a float64 single-process reference built from torch's own pieces
(``clip_grad_norm_``, ``LinearLR`` + ``CosineAnnealingLR`` in ``SequentialLR``): losses, learning
rates, gradient norms, held-out losses, every parameter; exports load into the plain model
with ``strict=True`` and give the reference's loss.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import shutil
import time
from pathlib import Path

import pytest
import torch
from _runtime_helpers import lm_loss, load_captures, make_plan, tied_gpt
from torch import nn

from deepcee import nets
from deepcee.runtime.data import ByteTextDataset
from deepcee.runtime.export import export_checkpoint
from deepcee.runtime.job import Job, OptimizerConfig, TrainConfig
from deepcee.runtime.launch import launch_jobs
from deepcee.runtime.lr import LRSchedule
from deepcee.runtime.state import builtin_model
from deepcee.scenarios import load_scenario

pytestmark = pytest.mark.dist

DEADLINE_S = 240
RTOL, ATOL = 1e-10, 1e-12
C0, C1, E0, E1, N0 = "cloud0:0", "cloud0:1", "edge0:0", "edge0:1", "end0:0"
PLAN_A = make_plan("gpt-tiny", [(0, 2, (C0, C1), (1, 1)), (2, 4, (E0,), (2,)), (4, 6, (N0,), (2,))], 2, "1f1b")
PLAN_B = make_plan("gpt-tiny", [(0, 3, (E0, E1), (3, 1)), (3, 6, (C0,), (4,))], 1, "gpipe")  # 1 x 4 samples
ADAM = OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.01)
SCHEDULE = LRSchedule(kind="cosine", warmup_steps=2, decay_steps=4, min_lr_ratio=0.1)  # 6 steps in all
CLIP = 0.5  # gpt-tiny's gradient norm is about 1.1 here: every step is clipped
TIED_PLAN = make_plan("user", [(0, 1, (C0, C1), (1, 1)), (1, 4, (E0,), (2,)), (4, 5, (N0,), (2,))], 2, "zb-h1")
TEXT = ByteTextDataset(seq_len=16)  # gpt-tiny takes shorter windows too: 4x less work than 64


def _config(steps: int, **kw) -> TrainConfig:
    return TrainConfig(steps=steps, dtype="float64", optimizer=ADAM, lr_schedule=SCHEDULE, clip_grad_norm=CLIP,
                       mode="real", timeout_s=40, capture=True, **kw)


def _tied() -> list[nn.Module]:
    return [b.double() for b in tied_gpt()]


_CACHE: dict = {}


def cached_reference(key: str, *args, **kw) -> dict:
    if key not in _CACHE:
        _CACHE[key] = reference(*args, **kw)
    return _CACHE[key]


def reference(model, plan, steps: int, *, loss_fn=None, dataset=TEXT, start=None, eval_every: int = 0,
              eval_batches: int = 2) -> dict:
    """One process, float64, torch's clipping and schedulers. ``start``: a state_dict to begin from."""
    if isinstance(model, str):
        root = builtin_model(model, dtype=torch.float64)
        loss_fn = nets.build(model)[1]
    else:
        root = nn.ModuleList(copy.deepcopy(model))
    if start is not None:
        root.load_state_dict(start, strict=True)
    params = list(root.parameters())  # each tied parameter once
    opt = ADAM.build(params)
    w = SCHEDULE.warmup_steps
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / w, end_factor=1.0, total_iters=w - 1),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=SCHEDULE.decay_steps,
                                                   eta_min=SCHEDULE.min_lr_ratio * ADAM.lr)], milestones=[w])

    def loss_of(batch):
        x = batch.inputs
        for b in root:
            x = b(x)
        return loss_fn(x, batch.targets)

    out = {"losses": [], "lrs": [], "norms": [], "evals": []}
    for step in range(steps):
        out["lrs"].append(opt.param_groups[0]["lr"])
        opt.zero_grad(set_to_none=True)
        loss = loss_of(dataset.batch(step, plan.global_batch))
        loss.backward()
        out["losses"].append(loss.item())
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        sched.step()
        if eval_every and (step + 1) % eval_every == 0:
            with torch.no_grad():
                held = list(itertools.islice(dataset.eval_batches(plan.global_batch), eval_batches))
                out["evals"].append((step + 1, sum(loss_of(b).item() for b in held) / len(held)))
    out["state"] = {k: v.detach().clone() for k, v in root.state_dict().items()}
    out["loss_next"] = loss_of(dataset.batch(steps, plan.global_batch)).item()
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cluster = load_scenario("local-small")
    first = [
        Job(name="straight-A", plan=PLAN_A, cluster=cluster, model="gpt-tiny", run_dir=str(root / "straight-A"),
            dataset=TEXT, config=_config(6, checkpoint_every=3, eval_every=3, eval_batches=2)),
        Job(name="first-A", plan=PLAN_A, cluster=cluster, model="gpt-tiny", run_dir=str(root / "first-A"),
            dataset=TEXT, config=_config(3, checkpoint_every=3)),
        Job(name="tied-A", plan=TIED_PLAN, cluster=cluster, model=_tied(), loss_fn=lm_loss, dataset=TEXT,
            run_dir=str(root / "tied-A"), config=_config(4, checkpoint_every=4)),
    ]
    t0 = time.monotonic()
    results = dict(zip([j.name for j in first], launch_jobs(first, world_size=4, deadline_s=DEADLINE_S), strict=True))
    # damage copies of straight-A's checkpoints (steps 3 and 6)
    ck = root / "straight-A" / "checkpoints"
    for name in ("corrupt", "missing"):
        shutil.copytree(ck, root / name / "checkpoints")
    victim = root / "corrupt" / "checkpoints" / "step-00000006" / "__2_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    (root / "missing" / "checkpoints" / "step-00000006" / "__0_0.distcp").unlink()
    exported = export_checkpoint(root / "first-A", root / "first-A.pt")
    second = [
        Job(name="resume-B", plan=PLAN_B, cluster=cluster, model="gpt-tiny", run_dir=str(root / "resume-B"),
            checkpoint_dir=str(root / "first-A" / "checkpoints"), dataset=TEXT, config=_config(6, resume=True)),
        *(Job(name=f"resume-{n}", plan=PLAN_A, cluster=cluster, model="gpt-tiny", run_dir=str(root / n),
              dataset=TEXT, config=_config(6, resume=True)) for n in ("corrupt", "missing")),
        Job(name="init-B", plan=PLAN_B, cluster=cluster, model="gpt-tiny", run_dir=str(root / "init-B"),
            dataset=TEXT, config=_config(2, init_from=str(root / "first-A.pt"))),
    ]
    results.update(zip([j.name for j in second], launch_jobs(second, world_size=4, deadline_s=DEADLINE_S),
                       strict=True))
    assert time.monotonic() - t0 < 2 * DEADLINE_S
    return root, results, {j.name: j for j in first + second}, exported, victim


def _approx(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == pytest.approx(w, rel=RTOL, abs=ATOL), f"{what} {i}: {g!r} != {w!r}"


def _params_equal_reference(run_dir, ref_state, names_of_block):
    for rank, cap in load_captures(run_dir).items():
        for key, p in cap["params"].items():
            torch.testing.assert_close(p, ref_state[names_of_block(key)], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")


def _gpt_name(key: str) -> str:
    i, rest = key.split(".", 1)
    return f"{nets.block_names('gpt-tiny')[int(i)]}.{rest}"


def test_lr_schedule_clipping_and_eval_equal_the_reference(runs):
    _, results, jobs, _, _ = runs
    res = results["straight-A"]
    ref = cached_reference("A6", "gpt-tiny", PLAN_A, 6, eval_every=3)
    _approx(res.losses, ref["losses"], "loss")
    _approx([m.lr for m in res.metrics], ref["lrs"], "lr")
    _approx([m.grad_norm for m in res.metrics], ref["norms"], "gradient norm")
    assert min(ref["norms"]) > CLIP  # clipping changed every step
    assert [s for s, _ in res.eval_losses] == [3, 6]
    _approx([v for _, v in res.eval_losses], [v for _, v in ref["evals"]], "eval loss")
    _params_equal_reference(jobs["straight-A"].run_dir, ref["state"], _gpt_name)


def test_tied_model_clipping_counts_the_tie_once(runs):
    _, results, jobs, _, _ = runs
    ref = cached_reference("tied4", _tied(), TIED_PLAN, 4, loss_fn=lm_loss)
    _approx(results["tied-A"].losses, ref["losses"], "loss")
    _approx([m.grad_norm for m in results["tied-A"].metrics], ref["norms"], "gradient norm")


def test_export_loads_into_the_plain_model_strictly_with_the_same_loss(runs):
    root, _, _, _, _ = runs
    out = export_checkpoint(root / "straight-A", root / "straight-A.pt")
    # .pt, and .safetensors beside it when that package is installed (CI installs without it)
    has_st = importlib.util.find_spec("safetensors") is not None
    assert out.step == 6 and len(out.files) == (2 if has_st else 1)
    assert out.files[0].endswith(".pt")
    ref = cached_reference("A6", "gpt-tiny", PLAN_A, 6, eval_every=3)
    for f in out.files:
        model = builtin_model("gpt-tiny", dtype=torch.float64)
        if f.endswith(".safetensors"):
            from safetensors.torch import load_file
            state = load_file(f)
        else:
            state = torch.load(f, weights_only=True)
        model.load_state_dict(state, strict=True)
        batch = TEXT.batch(6, PLAN_A.global_batch)
        loss = nets.build("gpt-tiny")[1](model(batch.inputs), batch.targets).item()
        assert loss == pytest.approx(ref["loss_next"], rel=RTOL)


def test_export_of_a_tied_user_model_has_both_names(runs):
    root, _, _, _, _ = runs
    out = export_checkpoint(root / "tied-A", root / "tied-A.pt")
    state = torch.load(out.files[0], weights_only=True)
    assert torch.equal(state["0.wte.weight"], state["4.weight"])
    plain = nn.ModuleList(_tied())
    plain.load_state_dict(state, strict=True)
    ref = cached_reference("tied4", _tied(), TIED_PLAN, 4, loss_fn=lm_loss)
    x = TEXT.batch(4, TIED_PLAN.global_batch)
    y = x.inputs
    for b in plain:
        y = b(y)
    assert lm_loss(y, x.targets).item() == pytest.approx(ref["loss_next"], rel=RTOL)
    assert out.names - out.tensors == 1 + 2  # the tied weight has 2 names, the causal mask 3 (blocks 1-3)


def test_resume_under_another_plan_continues_the_curve(runs):
    _, results, jobs, _, _ = runs
    straight, resumed = results["straight-A"], results["resume-B"]
    assert resumed.start_step == 3 and resumed.resumed.step == 3 and not resumed.resumed.same_plan
    _approx(resumed.losses, straight.losses[3:], "loss after resume under plan B")
    ref = cached_reference("A6", "gpt-tiny", PLAN_A, 6, eval_every=3)
    _params_equal_reference(jobs["resume-B"].run_dir, ref["state"], _gpt_name)
    assert {r.device for r in resumed.ranks} == {E0, E1, C0}  # other devices


@pytest.mark.parametrize("case, bad", [("corrupt", "__2_0.distcp: checksum differs"),
                                       ("missing", "__0_0.distcp: missing")])
def test_damaged_newest_checkpoint_is_named_and_skipped(runs, case, bad):
    _, results, _, _, _ = runs
    res = results[f"resume-{case}"]
    assert res.resumed.step == 3 and res.resumed.steps_lost == 3
    assert len(res.resumed.skipped) == 1 and res.resumed.skipped[0][0] == 6
    assert bad in res.resumed.skipped[0][1] and "step-00000006" in res.resumed.skipped[0][1]
    _approx(res.losses, results["straight-A"].losses[3:], f"loss after falling back ({case})")


def test_run_starts_from_exported_weights(runs):
    root, results, _, exported, _ = runs
    assert exported.step == 3
    start = torch.load(exported.files[0], weights_only=True)
    ref = reference("gpt-tiny", PLAN_B, 2, start=start)  # fresh optimizer, schedule from step 0
    _approx(results["init-B"].losses, ref["losses"], "loss from exported weights")
    after3 = reference("gpt-tiny", PLAN_A, 3)["state"]  # the weights are the first run's after 3 steps
    assert start.keys() == after3.keys()
    for k, v in after3.items():
        torch.testing.assert_close(start[k], v, rtol=RTOL, atol=ATOL)
