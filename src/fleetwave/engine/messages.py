"""Messages to the dispatcher. Workers and the periodic pass only ever send these."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from fleetwave.domain.rules import Decision
from fleetwave.store.callbacks import CallbackRecord
from fleetwave.store.runtime import StepRecord, StrategyRecord


@dataclass(slots=True)
class ActionFinished:
    """A worker's report: the action for (step, state, fence) ended with this decision."""

    strategy_id: int
    step_id: int
    state: str
    fence: int
    decision: Decision
    attempts: int
    #: the stored callback whose report decided it (wait-for-callback states)
    callback_id: int | None = None
    #: what the worker waits on next: resolved False if the report is stale (the step
    #: moved on, or the strategy is no longer driven here), so the worker ends
    go: asyncio.Future[bool] | None = None


class RetryAnswer(enum.Enum):
    """How the dispatcher handled a retry's record; the worker acts on it as it says."""

    #: committed with its batch: the next attempt may run (only then, so that the row
    #: names the attempt running, which a takeover looks at, before it runs)
    RECORDED = "recorded"
    #: not written: its strategy's abort was on record first; the step ends aborted,
    #: the retry not started
    HELD = "held"
    #: not written: the step's row changed under this conductor (read back and taken
    #: over), the report is stale (the step moved on, or is another worker's now), or a
    #: clean stop leaves the retry to the next owner; the worker ends, the retry unrun
    REFUSED = "refused"


@dataclass(slots=True)
class RetryScheduled:
    """An attempt of (step, state, fence) failed and the next one is due after its
    backoff: to be recorded on the step.

    Not a transition (the step stays in its state): the record tells an operator why
    the step is waiting and which attempt comes (``attempt``, ``details``), and a
    conductor that takes the step over how much of the next attempt's time is left.
    """

    strategy_id: int
    step_id: int
    state: str
    fence: int
    #: when the next attempt runs out of time (its backoff, then the state's timeout)
    deadline_at: float
    #: the attempt about to run (2 for the first retry)
    attempt: int
    #: None: the row's details are kept (a taken-over retry's start)
    details: str | None
    #: resolved once the dispatcher has handled it (see :class:`RetryAnswer`)
    handled: asyncio.Future[RetryAnswer] | None = None
    #: False: the retry is recorded, to start after its backoff (the row is marked not
    #: started: a takeover runs it as this attempt, once due); True: it starts now (the
    #: mark cleared, the fence checked again just before). A clean stop refuses the
    #: latter: the retry is left to the next owner.
    started: bool = False
    #: its attempt row's ``how``: ``retry``, or ``resent`` (a recover hook found the
    #: target never got the state's operation: sent again after a takeover)
    how: str = "retry"


@dataclass(slots=True)
class StrategyClaimed:
    record: StrategyRecord


@dataclass(slots=True)
class StopRequested:
    """The operator asked to abort (seen by the periodic pass)."""

    strategy_id: int


@dataclass(slots=True)
class PauseChanged:
    """The operator paused the strategy (no new step starts) or resumed it."""

    strategy_id: int
    paused: bool


@dataclass(slots=True)
class LeaseLost:
    """Stop driving the strategy: another conductor owns it now, or (``lapsed``) this
    one's lease renewals have been failing for most of the lease (it claims the
    strategy anew once the database answers)."""

    strategy_id: int
    lapsed: bool = False


@dataclass(slots=True)
class CallbackArrived:
    """A stored callback from a target, for the dispatcher to apply or ignore."""

    record: CallbackRecord


@dataclass(slots=True)
class StrategyJoined:
    """A strategy another conductor leads, whose waiting steps this one may help drive
    (conductors sharing a strategy)."""

    record: StrategyRecord


@dataclass(slots=True)
class PeersGone:
    """Steps of a strategy this conductor leads, held by conductors whose lease ran out:
    to take over (their recover hook looks first)."""

    strategy_id: int
    steps: list[StepRecord]


@dataclass(slots=True)
class FailuresCounted:
    """The failed steps of a strategy as every conductor sharing it counted them (in its
    slots): more than this conductor has seen."""

    strategy_id: int
    failed: int


Message = (
    ActionFinished
    | RetryScheduled
    | StrategyClaimed
    | StrategyJoined
    | PeersGone
    | FailuresCounted
    | StopRequested
    | PauseChanged
    | LeaseLost
    | CallbackArrived
)
