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
