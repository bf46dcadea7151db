"""The one action IR shared by builders, the simulator and the runtime (torch-free)."""

from deepcee.schedule.ir import Action, ActionKind, format_schedule, parse_action, parse_schedule

__all__ = ["Action", "ActionKind", "format_schedule", "parse_action", "parse_schedule"]
