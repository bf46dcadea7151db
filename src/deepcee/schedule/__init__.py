"""The one action IR shared by builders, the simulator and the runtime (torch-free).

- :mod:`~deepcee.schedule.ir`: actions (``2F0``), schedules, string form.
- :mod:`~deepcee.schedule.builders`: fixed schedules by name (GPipe, 1F1B, ZB-H1, ZB-H2).
- :mod:`~deepcee.schedule.passes`: lowering, validation, in-flight counts, dry run, tables.
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
    validate,
)

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
    "parse_action",
    "parse_schedule",
    "search_compact",
    "split_backward",
    "validate",
]
