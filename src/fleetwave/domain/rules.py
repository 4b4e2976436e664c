"""Transition rules: pure functions that decide, never do.

The dispatcher asks these what a step's next state is; ``fleetwave check`` asks
them whether a journalled move was allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_COMPLETE,
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
)
from fleetwave.domain.workflow import Advance, NotYet, Outcome, Skip, StateDef


class Decision(NamedTuple):
    """Where a step goes next, and why (made for every outcome: a light tuple)."""

    to_state: str
    details: str


def decide(
    states: tuple[str, ...],
    current: str,
    outcome: Outcome,
    done_next: Mapping[str, str] | None = None,
) -> Decision:
    """The next state of a step at ``current`` given its action's outcome;
    ``done_next``: where each state goes once done (a workflow's branches:
    :attr:`WorkflowDef.done_next`), else the next state in order."""
    if type(outcome) is Advance and outcome.to is None:  # the usual answer: asked first
        idx = states.index(current)
        nxt = states[idx + 1] if idx + 1 < len(states) else STEP_COMPLETE
        if done_next is not None:
            nxt = done_next[current]
        details = outcome.details
        if nxt == STEP_FAILED and type(details) is str and not details:
            # the end of a cleanup (after a failure): the failure stands
            return Decision(nxt, f"{current}: cleanup done; the step ends failed")
        # (any text but "" goes through details_text: so does anything not a str, whose
        # comparison with "" may even raise)
        return Decision(nxt, "" if type(details) is str and not details else details_text(details))
    if isinstance(outcome, Skip):
        return Decision(STEP_COMPLETE, f"skipped at {current}: {details_text(outcome.reason)}")
    if isinstance(outcome, NotYet):  # the engine polls again; it never gets here
        return Decision(STEP_FAILED, f"{current}: the action answered 'not yet' too late")
    idx = states.index(current)
    if outcome.to is None:
        nxt = states[idx + 1] if idx + 1 < len(states) else STEP_COMPLETE
        if done_next is not None:
            nxt = done_next[current]
        return Decision(nxt, details_text(outcome.details))
    if outcome.to in STEP_TERMINAL:
        return Decision(outcome.to, details_text(outcome.details))
    if outcome.to not in states:
        return Decision(STEP_FAILED, f"{current}: action chose unknown state '{outcome.to}'")
    if states.index(outcome.to) <= idx:
        return Decision(
            STEP_FAILED, f"{current}: action chose '{outcome.to}', which is not a later state"
        )
    return Decision(outcome.to, details_text(outcome.details))


def one_line(text: str) -> str:
    """An action's message as a step's details or a log line keep it: its lines joined
    with "; " (a multi-line exception message broke tables and logs)."""
    if "\n" not in text and "\r" not in text:
        return text
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


#: characters of an action's message a step's details keep (a 2 MB message made every
#: row of `step list` 2 MB wide, and every log line of it)
MAX_DETAILS = 4000
#: cut only above this: room for what the engine puts around a message it was given
#: ("<state>: ...", "(attempt 2 of 3)"), which is not cut a second time
_CUT_ABOVE = MAX_DETAILS + 256


def details_text(value: object) -> str:
    """What an action said, as a step's details, the journal and the log keep it: text
    (``str()`` of anything; its type's name when even that fails), on one line, every
    character printable (a control character, or a byte that was not UTF-8 and was
    decoded with surrogateescape, is written as an escape: ``\\x1b``, ``\\xe9``), at
    most :data:`MAX_DETAILS` characters. Never raises: an action's odd message or
    return value fails its step, never the conductor's commit (it failed them all)."""
    if type(value) is str:
        text = value
    elif value is None:
        return ""
    else:
        read: object
        try:
            read = str(value)
        except Exception:
            read = None
        # (a __str__ that raises, or returns something else)
        text = read if isinstance(read, str) else f"{type(value).__name__} (unreadable message)"
    if len(text) <= _CUT_ABOVE and text.isprintable():
        return text  # nearly always: one check
    text = one_line(text)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else _escaped(c) for c in text)
    if len(text) > _CUT_ABOVE:
        text = f"{text[:MAX_DETAILS]}... ({len(text) - MAX_DETAILS} more characters)"
    return text


def _escaped(c: str) -> str:
    code = ord(c)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, kept by surrogateescape
        return f"\\x{code - 0xDC00:02x}"
    if c in "\t\n\r":
        return " "
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def failure(current: str, message: object) -> Decision:
    return Decision(STEP_FAILED, f"{current}: {details_text(message)}")


def on_failed(state: StateDef, decision: Decision) -> Decision:
    """A state's failure, sent on to its cleanup state when it has one (``on: {failed:
    rollback}``): the step goes there instead of ending failed; the failure's details
    are kept in that move (the journal), with where it went."""
    if decision.to_state != STEP_FAILED or state.on_failed in (None, STEP_FAILED):
        return decision
    assert state.on_failed is not None
    return Decision(state.on_failed, f"{decision.details}; on failed: {state.on_failed}")


def next_visit(
    max_visits: Mapping[str, int],
    visits: Mapping[str, int],
    current: str,
    decision: Decision,
) -> tuple[Decision, int]:
    """Which visit of its state ``decision`` enters (1: a state entered once at most, or
    a step's end), given the visits so far of the states that count them; one past the
    state's ``max_visits`` fails the step instead, naming the state and its limit."""
    to = decision.to_state
    limit = max_visits.get(to)
    if limit is None:
        return decision, 1
    visit = visits.get(to, 0) + 1
    if visit <= limit:
        return decision, visit
    why = f"{current}: {to} would be entered a {_nth(visit)} time: its max_visits is {limit}"
    if decision.details:
        why += f" ({decision.details})"
    return Decision(STEP_FAILED, details_text(why)), 1


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def is_allowed_move(
    states: tuple[str, ...],
    from_state: str,
    to_state: str,
    back: Mapping[str, frozenset[str]] | None = None,
) -> bool:
    """G3: moves go forward through the workflow's states, or to a terminal state; or
    back along a branch of a bounded cycle (``back``: by state, where it may go back)."""
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
    if states.index(to_state) > states.index(from_state):
        return True
    return back is not None and to_state in back.get(from_state, ())


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
    "next_visit",
]
