"""The final evaluation loss after the same number of samples: relaxed runs against synchronous
training, with the relaxed runs' probes of the average (used by :mod:`deepcee.ttt`). Torch-free.

[Note: same-samples comparison]
"The final evaluation loss after the same number of samples" compares each relaxed run with
synchronous training at N = the synchronous runs' final evaluation sample count (the smallest
among the exact runs that reached the target, else among all exact runs; exact plans all
compute the single-process result, so each evaluated there). A model-averaging run evaluates
only right after an average, so at N it often has no evaluation; its *probe of the average*
there ([Note: probe evaluations] in :mod:`deepcee.runtime.strategies`) is the model it would
hold had it averaged at N. The report takes the relaxed run's evaluation at N, else its probe
at N, else the later of the two before N (then says at which samples, and judges nothing),
labels which it is, and compares it with the synchronous reference (the best single island,
else deepcee's synchronous plan): the relative difference, and whether it is within
``SAME_SAMPLES_TOLERANCE`` (2%, issue 15) either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EVALUATION, PROBE = "evaluation", "probe of the average"
"""What a loss at some samples is: an evaluation of the model held, or a probe of the average."""
SAME_SAMPLES_TOLERANCE = 0.02
"""Relaxed vs synchronous loss at the same samples: within 2% (issue 15)."""


def eval_at_samples(curve: Any, samples: int) -> tuple[int, float] | None:
    """The last evaluation at or before ``samples`` samples: its samples and loss (``None``:
    none yet). A relaxed run evaluates only after an average, so its last evaluation can come
    well before ``samples``: reports name where it was taken."""
    pts = [p for p in curve if p.samples <= samples]
    return (pts[-1].samples, pts[-1].eval_loss) if pts else None


def loss_at_samples(target: Any, samples: int) -> tuple[str, int, float] | None:
    """A run's held-out loss at ``samples`` ([Note: same-samples comparison]): ``(kind, samples
    it was taken at, loss)`` of its evaluation there, else its probe of the average there, else
    the later of its last evaluation and last probe before (``None``: neither yet)."""
    points = [(EVALUATION, p) for p in target.curve if p.samples <= samples]
    points += [(PROBE, p) for p in getattr(target, "probes", ()) if p.samples <= samples]
    if not points:
        return None
    kind, p = max(points, key=lambda e: (e[1].samples, e[0] == EVALUATION))
    return kind, p.samples, p.eval_loss


def same_samples(cands: Mapping[str, Any], results: Mapping[str, Any]) -> dict[str, Any] | None:
    """Each relaxed run against synchronous training at the synchronous runs' final evaluation
    samples ([Note: same-samples comparison]); ``None`` without an evaluated exact run."""
    exact = [n for n, c in cands.items() if c.plan.semantics == "exact" and results[n].target is not None
             and results[n].target.curve]
    pool = [n for n in exact if results[n].target.reached] or exact
    if not pool:
        return None
    n_samples = min(results[n].target.curve[-1].samples for n in pool)
    sync = [{"system": n, "eval_loss": p.eval_loss} for n in exact for p in results[n].target.curve
            if p.samples == n_samples]
    ref = next((x for name in ("single-island", "deepcee-sync") for x in sync if x["system"] == name), sync[0])
    relaxed = []
    for name, c in cands.items():
        if c.plan.semantics != "relaxed" or results[name].target is None:
            continue
        got = loss_at_samples(results[name].target, n_samples)
        kind, at, loss = got if got is not None else (None, None, None)
        rel = None if loss is None else loss / ref["eval_loss"] - 1.0
        relaxed.append({"system": name, "kind": kind, "samples": at, "loss": loss, "relative_difference": rel,
                        # judged only at the same samples: an earlier figure is shown, not judged
                        "within_tolerance": None if rel is None or at != n_samples else
                        abs(rel) <= SAME_SAMPLES_TOLERANCE})
    return {"samples": n_samples, "tolerance": SAME_SAMPLES_TOLERANCE, "synchronous": sync,
            "reference": ref["system"], "reference_loss": ref["eval_loss"], "relaxed": relaxed}


def same_samples_text(doc: Mapping[str, Any]) -> list[str]:
    """The report's same-samples lines ([Note: same-samples comparison])."""
    s = doc.get("same_samples")
    if not s:
        return ["final evaluation loss after the same samples: no evaluated synchronous run"]
    lines = [f"final evaluation loss after the same {s['samples']} samples (the synchronous runs' final evaluation): "
             f"synchronous {s['reference']} {s['reference_loss']:.4f} (evaluation)"]
    for r in s["relaxed"]:
        if r["loss"] is None:
            lines.append(f"  relaxed {r['system']}: no evaluation or probe by {s['samples']} samples")
            continue
        at = "" if r["samples"] == s["samples"] else f" at {r['samples']} samples (none at {s['samples']})"
        verdict = "not judged (not at the same samples)" if r["within_tolerance"] is None else \
            f"{'within' if r['within_tolerance'] else 'NOT within'} {s['tolerance']:.0%}"
        lines.append(f"  relaxed {r['system']}: {r['loss']:.4f} ({r['kind']}){at}: {r['relative_difference']:+.2%} "
                     f"vs synchronous, {verdict}")
    return lines


def eval_at_common_text(row: Mapping[str, Any], common: int) -> str:
    """A row's loss at the common samples; ``loss@N`` where it was taken earlier, at N; a
    trailing ``p``: a probe of the average, not an evaluation (reports before probes: evaluations)."""
    if "loss_at_common_samples" in row:
        loss, at, kind = row["loss_at_common_samples"], row.get("samples_at_common"), row.get("kind_at_common")
    else:
        loss, at, kind = row.get("eval_loss_at_common_samples"), row.get("eval_samples_at_common"), EVALUATION
    if loss is None:
        return "-"
    text = f"{loss:.4f}" if at in (None, common) else f"{loss:.4f}@{at}"
    return text + ("p" if kind == PROBE else "")


__all__ = ["EVALUATION", "PROBE", "SAME_SAMPLES_TOLERANCE", "eval_at_common_text", "eval_at_samples", "loss_at_samples",
           "same_samples", "same_samples_text"]
