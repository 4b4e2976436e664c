"""fleetwave: roll one operation across a fleet, exactly once per state.

The public API for writing workflows in Python lives here; see README.md.
"""

from fleetwave.domain.models import Target
from fleetwave.domain.registry import register_action, register_workflow
from fleetwave.domain.workflow import (
    ActionContext,
    Advance,
    NotStarted,
    NotYet,
    Outcome,
    RemoteResult,
    Skip,
    StateAction,
    StateDef,
    StepFailed,
    TransientError,
    WorkflowDef,
)

__all__ = [
    "ActionContext",
    "Advance",
    "NotStarted",
    "NotYet",
    "Outcome",
    "RemoteResult",
    "Skip",
    "StateAction",
    "StateDef",
    "StepFailed",
    "Target",
    "TransientError",
    "WorkflowDef",
    "register_action",
    "register_workflow",
]
__version__ = "0.1.0"
