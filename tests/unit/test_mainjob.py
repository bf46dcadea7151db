"""The main job's settings and its command line: bad values are one-line errors naming the flag."""

from __future__ import annotations

import pytest

from deepcee.cli import main
from deepcee.errors import SpecError
from deepcee.mainjob import MainJobConfig, resolve_mode


@pytest.mark.parametrize(("kw", "flag"), [({"mode": "wifi"}, "--links"), ({"periods": ()}, "--periods"),
                                          ({"periods": (0,)}, "--periods"), ({"baseline_cap": 0.5}, "--baseline-cap")])
def test_config_refuses_bad_settings(kw, flag):
    with pytest.raises(SpecError) as err:
        MainJobConfig(**kw)
    assert err.value.field == flag


def test_emulated_mode_is_taken_as_asked():
    assert resolve_mode("emulated") == ("emulated", "asked for (--links emulated)")


@pytest.mark.parametrize(("argv", "needle"), [(["demo", "--periods", "4,x"], "--periods"),
                                              (["demo", "--periods", "0"], "--periods"),
                                              (["demo", "--baseline-cap", "-1"], "--baseline-cap"),
                                              (["demo", "--links", "wifi"], "--links"),
                                              (["demo", "--model", "resnet-tiny"], "--model")])
def test_demo_flags_fail_in_one_line_before_any_work(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_evaluation_at_the_common_samples_names_where_an_earlier_one_was_taken():
    from deepcee.runtime.target import EvalPoint
    from deepcee.ttt import eval_at_common_text, eval_at_samples

    relaxed = [EvalPoint(steps=64 * k, time_s=float(k), samples=2048 * k, eval_loss=2.0 - 0.1 * k) for k in (1, 2, 3, 4)]
    assert eval_at_samples(relaxed, 9600) == (8192, pytest.approx(1.6))
    assert eval_at_samples(relaxed, 1000) is None
    assert eval_at_common_text({"eval_loss_at_common_samples": 1.6, "eval_samples_at_common": 8192}, 9600) == "1.6000@8192"
    assert eval_at_common_text({"eval_loss_at_common_samples": 0.45, "eval_samples_at_common": 9600}, 9600) == "0.4500"
    assert eval_at_common_text({"eval_loss_at_common_samples": None}, 9600) == "-"
