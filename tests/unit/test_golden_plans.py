"""Behaviour is unchanged on a fixed set of planner instances (see ``golden_plans.py``).

Plans, estimates, explanations, the simulator's figures, baselines and the comparison table
must equal the record bit for bit. A change that is meant to alter plans regenerates the
record (``python tests/unit/golden_plans.py --write``) and says why in its commit message.
"""

from __future__ import annotations

import json

import pytest
from golden_plans import INSTANCES, RECORD, snapshot

_RECORD = json.loads(RECORD.read_text())


def test_record_covers_every_instance() -> None:
    assert sorted(_RECORD) == sorted(i.name for i in INSTANCES)
    assert len(INSTANCES) >= 20


@pytest.mark.parametrize("inst", INSTANCES, ids=[i.name for i in INSTANCES])
def test_instance_unchanged(inst) -> None:
    got, want = snapshot(inst), _RECORD[inst.name]
    for key in want:
        assert got[key] == want[key], f"{inst.name}: {key} changed"
    assert sorted(got) == sorted(want)
