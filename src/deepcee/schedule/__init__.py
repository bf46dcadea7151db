"""The one action IR shared by builders, the simulator and the runtime (torch-free).

- :mod:`~deepcee.schedule.ir`: actions (``2F0``), schedules, string form.
- :mod:`~deepcee.schedule.builders`: fixed schedules by name (GPipe, 1F1B, ZB-H1, ZB-H2).
- :mod:`~deepcee.schedule.passes`: lowering, validation, in-flight counts, dry run, tables.
- :mod:`~deepcee.schedule.program`: a plan's validated, lowered action lists (the one road
  from a plan to what its devices run).
- :mod:`~deepcee.schedule.interpreter`: the one timing interpreter of lowered schedules (the
  simulator's; the dry run and the cost model run it on given costs).
- :mod:`~deepcee.schedule.compact`: the cost- and link-aware zero-bubble builder.
"""

from deepcee.schedule.builders import BUILDERS, build_schedule, split_backward
from deepcee.schedule.compact import CompactResult, build_compact, search_compact
from deepcee.schedule.ir import (
    Action,
    ActionKind,
    Schedule,
    format_schedule,
    parse_action,
    parse_schedule,
)
from deepcee.schedule.passes import (
    DryRun,
    compute_only,
    dry_run,
    format_table,
    in_flight_per_stage,
    lower,
    lower_validated,
    validate,
)
from deepcee.schedule.program import lowered_schedule, stage_in_flight

__all__ = [
    "BUILDERS",
    "Action",
    "ActionKind",
    "CompactResult",
    "DryRun",
    "Schedule",
    "build_compact",
    "build_schedule",
    "compute_only",
    "dry_run",
    "format_schedule",
    "format_table",
    "in_flight_per_stage",
    "lower",
    "lower_validated",
    "lowered_schedule",
    "parse_action",
    "parse_schedule",
    "search_compact",
    "split_backward",
    "stage_in_flight",
    "validate",
]
