"""The report's "final evaluation loss after the same samples": each relaxed run's evaluation or
probe of the average at the synchronous runs' final evaluation samples, labelled, against the
synchronous reference, judged within 2% only at the same samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepcee.runtime.target import EvalPoint, TargetOutcome
from deepcee.ttt_samples import PROBE, loss_at_samples, same_samples, same_samples_text


def _target(evals, probes=(), target=2.3):
    def pts(xs):
        return tuple(EvalPoint(steps=n // 32, time_s=n / 1000, samples=n, eval_loss=v) for n, v in xs)

    curve = pts(evals)
    return TargetOutcome(target_loss=target, clock="emulated", curve=curve, probes=pts(probes),
                         reached_at=next((p for p in curve if p.eval_loss <= target), None))


def _runs(**targets):
    cands = {n: SimpleNamespace(plan=SimpleNamespace(semantics="relaxed" if n.startswith("relaxed") else "exact"))
             for n in targets}
    return cands, {n: SimpleNamespace(target=t) for n, t in targets.items()}


SYNC = [(160 * k, 2.6 - 0.01 * k) for k in range(1, 9)] + [(1440, 2.29)]
"""Reaches 2.3 at its last evaluation, 1,440 samples."""


def test_a_probe_at_the_synchronous_final_samples_is_compared_and_labelled():
    cands, results = _runs(
        **{"relaxed-ma": _target([(2048, 2.25)], probes=[(160 * k, 2.7) for k in range(1, 9)] + [(1440, 2.31)]),
           "single-island": _target(SYNC), "deepcee-sync": _target(SYNC[:-1] + [(1440, 2.28)]),
           # a capped run that never reached the target: its later end does not move the count
           "ddp-all": _target([(160, 2.7), (320, 2.6), (480, 2.5)] + [(160 * k, 2.45) for k in range(4, 12)])})
    s = same_samples(cands, results)
    assert s["samples"] == 1440 and s["reference"] == "single-island" and s["reference_loss"] == 2.29
    assert {x["system"] for x in s["synchronous"]} == {"single-island", "deepcee-sync", "ddp-all"}
    (r,) = s["relaxed"]
    assert (r["kind"], r["samples"], r["loss"]) == (PROBE, 1440, 2.31)
    assert r["relative_difference"] == pytest.approx(2.31 / 2.29 - 1) and r["within_tolerance"] is True
    lines = same_samples_text({"same_samples": s})
    assert "after the same 1440 samples" in lines[0] and "single-island 2.2900 (evaluation)" in lines[0]
    assert lines[1] == "  relaxed relaxed-ma: 2.3100 (probe of the average): +0.87% vs synchronous, within 2%"


def test_an_evaluation_there_wins_and_a_worse_loss_is_not_within():
    cands, results = _runs(**{"relaxed-ma": _target([(1440, 2.40)], probes=[(1280, 2.5)]),
                              "deepcee-sync": _target(SYNC)})
    (r,) = same_samples(cands, results)["relaxed"]
    assert (r["kind"], r["within_tolerance"]) == ("evaluation", False)
    assert same_samples_text({"same_samples": same_samples(cands, results)})[1].endswith("NOT within 2%")


def test_an_earlier_figure_is_shown_with_its_samples_and_not_judged():
    cands, results = _runs(**{"relaxed-ma": _target([(1280, 2.35), (2560, 2.2)]), "deepcee-sync": _target(SYNC)})
    (r,) = same_samples(cands, results)["relaxed"]
    assert (r["samples"], r["within_tolerance"]) == (1280, None)
    assert "at 1280 samples (none at 1440)" in same_samples_text({"same_samples": same_samples(cands, results)})[1]
    assert loss_at_samples(results["relaxed-ma"].target, 100) is None


def test_no_evaluated_synchronous_run_says_so():
    cands, results = _runs(**{"relaxed-ma": _target([(1440, 2.2)])})
    assert same_samples(cands, results) is None
    assert same_samples_text({"same_samples": None}) == [
        "final evaluation loss after the same samples: no evaluated synchronous run"]
