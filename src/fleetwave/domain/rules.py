"""Transition rules: pure functions that decide, never do.

The dispatcher asks these what a step's next state is; ``fleetwave check`` asks
them whether a journalled move was allowed.
"""

from __future__ import annotations

from typing import NamedTuple

from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_COMPLETE,
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
)
from fleetwave.domain.workflow import NotYet, Outcome, Skip


class Decision(NamedTuple):
    """Where a step goes next, and why (made for every outcome: a light tuple)."""

    to_state: str
    details: str


def decide(states: tuple[str, ...], current: str, outcome: Outcome) -> Decision:
    """The next state of a step at ``current`` given its action's outcome."""
    if isinstance(outcome, Skip):
        return Decision(STEP_COMPLETE, f"skipped at {current}: {outcome.reason}")
    if isinstance(outcome, NotYet):  # the engine polls again; it never gets here
        return Decision(STEP_FAILED, f"{current}: the action answered 'not yet' too late")
    idx = states.index(current)
    if outcome.to is None:
        nxt = states[idx + 1] if idx + 1 < len(states) else STEP_COMPLETE
        return Decision(nxt, outcome.details)
    if outcome.to in STEP_TERMINAL:
        return Decision(outcome.to, outcome.details)
    if outcome.to not in states:
        return Decision(STEP_FAILED, f"{current}: action chose unknown state '{outcome.to}'")
    if states.index(outcome.to) <= idx:
        return Decision(
            STEP_FAILED, f"{current}: action chose '{outcome.to}', which is not a later state"
        )
    return Decision(outcome.to, outcome.details)


def one_line(text: str) -> str:
    """An action's message as a step's details or a log line keep it: its lines joined
    with "; " (a multi-line exception message broke tables and logs)."""
    if "\n" not in text and "\r" not in text:
        return text
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def failure(current: str, message: str) -> Decision:
    return Decision(STEP_FAILED, f"{current}: {one_line(message)}")


def is_allowed_move(states: tuple[str, ...], from_state: str, to_state: str) -> bool:
    """G3: moves go forward through the workflow's states, or to a terminal state."""
    if from_state in STEP_TERMINAL:
        return False
    if to_state in STEP_TERMINAL:
        return True
    if to_state not in states:
        return False
    if from_state == STEP_INITIAL:
        return to_state == states[0]
    if from_state not in states:
        return False
    return states.index(to_state) > states.index(from_state)


def is_in_flight(state: str) -> bool:
    """A step holds a parallelism slot while it is in one of the workflow's states."""
    return state != STEP_INITIAL and state not in STEP_TERMINAL


__all__ = [
    "STEP_ABORTED",
    "STEP_COMPLETE",
    "STEP_FAILED",
    "Decision",
    "decide",
    "failure",
    "is_allowed_move",
    "is_in_flight",
]
