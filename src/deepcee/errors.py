"""Domain errors. Every message names the file (when there is one), the field and the value.

The CLI turns any :class:`DeepceeError` into one line on stderr and exit code 2.
"""

from __future__ import annotations


class DeepceeError(Exception):
    """Base class for errors a user can fix by changing their input."""


class SpecError(DeepceeError):
    """A malformed value in a file or a constructor argument."""

    def __init__(self, message: str, *, file: str | None = None, field: str | None = None):
        prefix = ""
        if file:
            prefix += f"{file}: "
        if field:
            prefix += f"{field}: "
        super().__init__(prefix + message)
        self.file = file
        self.field = field


class ClusterSpecError(SpecError):
    """A cluster description is malformed or inconsistent."""


class ProfileError(SpecError):
    """A model profile is malformed."""


class PlanError(SpecError):
    """A plan file is malformed or inconsistent with its cluster or model."""


class RunFileError(SpecError):
    """A file a run wrote and deepcee reads back (result, metrics, records) is missing or malformed."""


class WorkLimitError(SpecError):
    """Every value is in range, but together they ask for more time or memory than the limits in
    :mod:`deepcee.inputs.limits` allow (refused before the work starts; the message names the limit)."""


class ScheduleError(DeepceeError):
    """A schedule is invalid (missing action, broken dependency, deadlock)."""


class InfeasiblePlanError(DeepceeError):
    """No plan satisfies the constraints (typically memory); the message names the shortfall."""


class RuntimeSetupError(DeepceeError):
    """The distributed runtime could not start or a peer misbehaved (timeouts name the peer)."""
