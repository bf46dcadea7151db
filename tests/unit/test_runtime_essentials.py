"""Training essentials without processes: learning-rate schedules against torch's schedulers,
the float16 loss scale's rule, the progress line and TensorBoard scalars, the checks of
TrainConfig (autocast needs CUDA, --cuda without CUDA is an error), the held-out splits of the
shipped datasets, and the forward-only evaluation row."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepcee.errors import RuntimeSetupError, SpecError
from deepcee.runtime import dist as rdist
from deepcee.runtime.data import ByteTextDataset, PatternImageDataset
from deepcee.runtime.emulation import EmulationInfo
from deepcee.runtime.evaluation import forward_schedule
from deepcee.runtime.job import OptimizerConfig, TrainConfig
from deepcee.runtime.lr import LRSchedule
from deepcee.runtime.optstep import LossScale, owned_parameters
from deepcee.runtime.progress import RunLog, fmt_eta
from deepcee.runtime.records import StepMetrics


def _torch_lrs(kind: str, steps: int, warmup: int, floor: float, base: float = 0.1) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    tail = {"cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - warmup,
                                                                        eta_min=floor * base),
            "linear": lambda: torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=floor,
                                                                total_iters=steps - warmup),
            "constant": lambda: torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)}[kind]
    parts = [tail()]
    if warmup:
        parts.insert(0, torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, end_factor=1.0,
                                                          total_iters=warmup - 1))
    sched = torch.optim.lr_scheduler.SequentialLR(opt, parts, milestones=[warmup]) if warmup else parts[0]
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind, warmup, floor", [("cosine", 3, 0.1), ("cosine", 0, 0.0), ("linear", 4, 0.2),
                                                 ("constant", 5, 0.0), ("constant", 0, 0.0)])
def test_lr_schedule_equals_torch_schedulers(kind, warmup, floor):
    steps = 12
    s = LRSchedule(kind=kind, warmup_steps=warmup, min_lr_ratio=floor)
    ours = [0.1 * s.factor(k, steps) for k in range(steps)]
    assert ours == pytest.approx(_torch_lrs(kind, steps, warmup, floor), rel=1e-12)


def test_lr_schedule_decay_steps_fix_the_curve_whatever_the_run_length():
    s = LRSchedule(kind="cosine", warmup_steps=2, decay_steps=4, min_lr_ratio=0.1)
    assert [s.factor(k, 3) for k in range(3)] == [s.factor(k, 100) for k in range(3)]
    assert s.factor(6, 100) == s.factor(50, 100) == pytest.approx(0.1)


@pytest.mark.parametrize("kw, field", [({"kind": "step"}, "lr_schedule"), ({"warmup_steps": -1}, "warmup_steps"),
                                       ({"min_lr_ratio": 1.5}, "min_lr_ratio"), ({"decay_steps": 0}, "decay_steps")])
def test_lr_schedule_rejects_bad_values(kw, field):
    with pytest.raises(SpecError, match=field):
        LRSchedule(**kw)


def test_loss_scale_backs_off_on_overflow_and_grows_after_good_steps():
    s = LossScale(scale=8.0, growth_interval=3)
    assert s.update(True) and s.update(True) and s.scale == 8.0
    assert not s.update(False) and s.scale == 4.0 and s.good_steps == 0
    assert s.update(True) and s.update(True) and s.update(True) and s.scale == 8.0


def test_norm_owners_count_each_gradient_once():
    a, b, tied = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    assert owned_parameters([a, tied], index=1, replica=0, stage=2, cross_stage_ties=[]) == []
    assert owned_parameters([a, tied], index=0, replica=1, stage=2, cross_stage_ties=[]) == []
    assert owned_parameters([a, tied], index=0, replica=0, stage=2, cross_stage_ties=[(0, [tied])]) == [a]
    assert owned_parameters([b, tied], index=0, replica=0, stage=0, cross_stage_ties=[(0, [tied])]) == [b, tied]


def _record(step: int, loss: float, **kw) -> StepMetrics:
    return StepMetrics(step=step, loss=loss, step_s=0.5, samples_per_s=32.0,
                       emulation=EmulationInfo(mode="real", dilation=1.0, cores=1.2, emulated=()),
                       stages=(), link_bytes={}, cpu_s={}, **kw)


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        self.closed = True


def test_progress_line_every_n_steps_and_tensorboard_scalars(caplog):
    clock = iter([0.0, 10.0, 10.0, 20.0, 20.0, 20.0, 20.0]).__next__  # wall seconds, as the run log reads them
    writer = FakeWriter()
    log = RunLog(every=2, total_steps=5, global_batch=16, writer=writer, clock=clock)
    with caplog.at_level("INFO", logger="deepcee.runtime.progress"):
        assert log.step(_record(0, 2.5, lr=1e-3, grad_norm=0.8)) is None
        line = log.step(_record(1, 2.25, lr=1e-3, grad_norm=0.7, eval_loss=2.4))
        log.step(_record(2, 2.0))
        middle = log.step(_record(3, 1.9))
        last = log.step(_record(4, 1.8))  # the last step always reports
    assert line == "step 2/5  loss 2.2500  eval 2.4000  lr 1.00e-03  |g| 0.7  32.0 samples/s  ETA 15s"
    assert middle == "step 4/5  loss 1.9000  eval 2.4000  32.0 samples/s  ETA 5s"
    assert last == "step 5/5  loss 1.8000  eval 2.4000  32.0 samples/s  ETA 0s"
    assert [m for m in caplog.messages if m.startswith("step")] == [line, middle, last]
    log.close()
    assert writer.closed and ("eval_loss", 2.4, 2) in writer.scalars and ("loss", 1.8, 5) in writer.scalars
    assert fmt_eta(3725) == "1h02m" and fmt_eta(75) == "1m15s"


def test_train_config_checks_the_essentials():
    with pytest.raises(SpecError, match="autocast: bfloat16 autocast runs on CUDA only"):
        TrainConfig(steps=1, autocast="bfloat16")
    with pytest.raises(SpecError, match="clip_grad_norm: must be a finite number > 0, got nan"):
        TrainConfig(steps=1, clip_grad_norm=math.nan)
    with pytest.raises(SpecError, match="eval_every: must be an integer >= 0"):
        TrainConfig(steps=1, eval_every=-1)
    TrainConfig(steps=1, autocast="float16", use_cuda=True, mode="real")  # valid where CUDA exists
    with pytest.raises(SpecError, match="autocast keeps float32 master weights"):
        TrainConfig(steps=1, autocast="bfloat16", use_cuda=True, mode="real", dtype="float64")


def test_tensorboard_without_the_package_is_a_clear_error():
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    with pytest.raises(SpecError, match=r"tensorboard: TensorBoard logs need the tensorboard package"):
        TrainConfig(steps=1, tensorboard=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_cuda_without_a_gpu_is_an_error(tmp_path, capsys):
    with pytest.raises(RuntimeSetupError, match="--cuda: CUDA is not available on host"):
        rdist.pick_device(True, 0)
    assert rdist.pick_device(False, 0) == torch.device("cpu")
    from deepcee import cli
    from deepcee.plan import Plan, StagePlan, save_json_atomic

    plan = Plan(system="t", cluster="local-small", model="gpt-tiny", global_batch=2, microbatch_size=2,
                num_microbatches=1, schedule="gpipe",
                stages=(StagePlan(layer_start=0, layer_stop=6, devices=("cloud0:0",), shares=(2,)),))
    save_json_atomic(tmp_path / "plan.json", plan.to_dict())
    args = ["train", "--plan", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path), "--mode", "real"]
    assert cli.main([*args, "--cuda"]) == 2
    assert cli.main([*args, "--autocast", "bfloat16"]) == 2
    assert cli.main([*args, "--init-from", str(tmp_path / "none.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "--cuda: CUDA is not available on host" in err[0]
    assert "autocast: bfloat16 autocast runs on CUDA only" in err[1] and "init_from: no such file" in err[2]


def test_shipped_datasets_hold_out_data_for_evaluation():
    text = ByteTextDataset(seq_len=16)
    held = list(text.eval_batches(8))
    assert len(held) > 1 and all(b.inputs.shape == (8, 16) for b in held)
    assert [b.inputs.tolist() for b in held] == [b.inputs.tolist() for b in text.eval_batches(8)]  # the same every call
    # with the corpus replaced by its byte positions, every window says where it starts
    text.__dict__["tokens"] = np.arange(text.tokens.size)
    train_ends = [int(r[-1]) + 1 for step in range(20) for r in text.batch(step, 64).targets]
    held_starts = [int(r[0]) for b in text.eval_batches(8) for r in b.inputs]
    assert max(train_ends) <= text.split <= min(held_starts)
    img = PatternImageDataset(eval_size=32)
    assert len(list(img.eval_batches(8))) == 4
    assert not torch.equal(next(iter(img.eval_batches(8))).inputs, img.batch(0, 8).inputs)


def test_evaluation_row_is_forward_only_with_its_transfers():
    assert [str(a) for a in forward_schedule(3, 2, 1)] == ["1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1",
                                                            "1SEND_F1"]
    assert [str(a) for a in forward_schedule(3, 2, 2)] == ["2RECV_F0", "2F0", "2RECV_F1", "2F1"]


def test_optimizer_config_weight_decay_reaches_the_optimizer():
    opt = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1).build([torch.nn.Parameter(torch.zeros(2))])
    assert opt.param_groups[0]["weight_decay"] == 0.1
