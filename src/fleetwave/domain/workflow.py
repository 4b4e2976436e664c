"""Workflow definitions and the vocabulary an action speaks.

A workflow is an ordered list of states. Each state has an action that talks to
the target through its driver and returns an :class:`Outcome`:

* :class:`Advance` to the next state in order (or to a named later state: a branch),
* :class:`Skip` to finish the step as complete, with a reason,
* :class:`NotYet` in a ``poll`` state: the work goes on on the target, ask again
  after the state's poll interval (until its timeout),
* or raises :class:`StepFailed` (fails the step) or :class:`TransientError`
  (retried under the state's retry policy, then fails).

Anything else an action raises fails the step with ``"<state>: <message>"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal, Protocol

from fleetwave.domain.models import RESERVED_STATE_NAMES, Target


class StepFailed(Exception):
    """The action failed for good: the step ends ``failed`` with this message."""


class TransientError(Exception):
    """The action failed in a way worth retrying (target busy, connection reset)."""


class NoRecoverHook(Exception):
    """The state has no ``recover`` hook: a step lost mid-state cannot be resumed."""


class NotStarted(Exception):
    """Raised by a recover hook that found its operation never started on the target
    while the strategy is stopping (:attr:`ActionContext.stopping`): it is not started
    now (nothing new starts once an abort or a failure limit is seen), and the step
    ends ``aborted``."""


class NotOnTarget(Exception):
    """Raised by a recover hook that found the target never got its state's operation
    (lost between the entry's commit and the send, with the conductor that entered it):
    the engine records the next attempt (``attempts``, how ``resent``: "attempt 2:
    re-sent after takeover"), then runs the state's action as that attempt. A hook that
    sends the operation again itself is not on the record: raise this instead."""


class WorkflowError(ValueError):
    """A workflow definition is invalid; the message names the state and field."""


@dataclass(frozen=True)
class Advance:
    """Move on: to ``to`` if given (a later state of the workflow), else the next state."""

    to: str | None = None
    details: str = ""


@dataclass(frozen=True)
class Skip:
    """The step is done without the remaining states (for example: already patched)."""

    reason: str


@dataclass(frozen=True)
class NotYet:
    """Not finished on the target yet (a ``poll`` state): the action is called again
    after ``after_s`` seconds, or the state's ``poll_interval_s``; the state's timeout
    bounds the whole wait. ``details`` say how far it got (kept for the timeout's
    message)."""

    details: str = ""
    after_s: float | None = None


Outcome = Advance | Skip | NotYet
#: outcomes are immutable: the plain "next state" is shared
_ADVANCE = Advance()


class RemoteResult(StrEnum):
    """What a driver reports about one operation on one target."""

    DONE = "done"
    ALREADY_DONE = "already-done"
    IN_PROGRESS = "in-progress"
    NOT_STARTED = "not-started"


class TargetDriver(Protocol):
    """The seam between actions and the outside world (see ``fleetwave.drivers``).

    A driver may also define ``strategy_ended(strategy_id)``: the conductor calls it
    when it ends a strategy, so state kept per strategy can be dropped.
    """

    name: str

    async def perform(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        """Run ``operation`` on the target until it finishes; raise on failure."""
        ...

    async def observe(self, target: Target, operation: str, ctx: ActionContext) -> RemoteResult:
        """Report how far ``operation`` got on the target, without changing anything."""
        ...


@dataclass(slots=True)
class ActionContext:
    """Everything an action may use. Actions never see the store or the dispatcher."""

    target: Target
    state: str
    attempt: int
    strategy_id: int
    step_id: int
    driver: TargetDriver
    settings: dict[str, Any] = field(default_factory=dict)
    #: the state waits for the target's callback after this action returns
    callback_expected: bool = False
    #: called from a recover hook, after the conductor running this state was lost
    recovering: bool = False
    #: the state polls (``mode: poll``): the action may answer :class:`NotYet`
    polling: bool = False
    #: how many times the action answered :class:`NotYet` in this attempt (0: its
    #: first call, which starts the work; later calls look at how far it got)
    poll: int = 0
    #: set by the engine for a recover hook: whether the strategy is stopping now
    is_stopping: Callable[[], bool] | None = None
    #: a state that waits for a callback: the token its target's agent sends with it
    #: (``Authorization: Bearer ...`` on ``POST /v1/steps/{step}/callbacks``); it
    #: answers for this step and state alone. None otherwise, and in a recover hook
    #: (the agent keeps the token it was given)
    agent_token: str | None = None
    #: this attempt re-sends the state's operation after a takeover: the recover hook
    #: found the target without it (:class:`NotOnTarget`); a target that says nothing of
    #: an operation under way (a BMC's power action) may still get the lost one's
    resent: bool = False
    #: which visit of its state this is: 1, but for a state on a bounded cycle of
    #: branches (``max_visits``) entered again (a retry loop's second round is 2)
    visit: int = 1

    @property
    def stopping(self) -> bool:
        """The strategy is stopping (an operator's abort, a failure limit). A recover
        hook that finds its operation never started on the target must not start it
        then: raise :class:`NotStarted`."""
        return self.is_stopping is not None and self.is_stopping()


class StateAction:
    """One state's behaviour. Subclass and override :meth:`run` (and :meth:`recover`)."""

    async def run(self, ctx: ActionContext) -> Outcome:
        raise NotImplementedError

    async def recover(self, ctx: ActionContext) -> Outcome:
        """Called instead of re-entering the state after the conductor that ran it was lost.

        Observe the target and decide: :class:`Advance`, :class:`Skip`, or raise
        :class:`StepFailed`. The default has no hook: the step fails.
        """
        raise NoRecoverHook(ctx.state)

    def has_recover_hook(self) -> bool:
        """Whether :meth:`recover` is overridden (else a takeover fails the step)."""
        return type(self).recover is not StateAction.recover

    def describe(self) -> str:
        return type(self).__name__

    def describe_params(self) -> dict[str, Any] | None:
        """The parameters a YAML state gave the action (a driver's ``action: DRIVER.NAME``
        with ``command:`` and the like), as ``workflow show`` lists them; None: it takes
        none."""
        return None

    def describe_recover(self) -> str:
        """What a takeover does in this state, as ``workflow show`` says it: ``hook``
        (the action's own recover code), ``observe`` (look at the target) or ``none``
        (the step fails: "conductor lost during <state>")."""
        return "hook" if self.has_recover_hook() else "none"


class DriverOperation(StateAction):
    """Run the driver operation named like the state; the built-in workflows use this.

    ``skip_when_done``: a target that reports the operation already done finishes
    the step with :class:`Skip` (a pre-check on an up-to-date target). ``skip_if``: the
    driver's reports (``observe``, before anything is sent) on which this state is
    skipped: the step moves on as if it were done, saying so.
    """

    def __init__(
        self,
        operation: str,
        *,
        skip_when_done: bool = False,
        skip_if: frozenset[RemoteResult] = frozenset(),
    ) -> None:
        self.operation = operation
        self.skip_when_done = skip_when_done
        self.skip_if = skip_if

    async def run(self, ctx: ActionContext) -> Outcome:
        if self.skip_if and ctx.poll == 0:
            seen = await ctx.driver.observe(ctx.target, self.operation, ctx)
            if seen in self.skip_if:
                return Advance(
                    details=f"{ctx.state}: skipped: the target reports {self.operation} {seen}"
                )
        if ctx.polling:
            return await self._poll(ctx)
        result = await ctx.driver.perform(ctx.target, self.operation, ctx)
        return self._outcome(result, ctx)

    async def _poll(self, ctx: ActionContext) -> Outcome:
        """A ``poll`` state: start the operation without waiting for it (the driver's
        ``start``), then look at it (``observe``) each time the engine asks again."""
        start = getattr(ctx.driver, "start", None)
        if start is None:  # a driver that cannot start without waiting: wait for it
            return self._outcome(await ctx.driver.perform(ctx.target, self.operation, ctx), ctx)
        if ctx.poll == 0:
            result = await start(ctx.target, self.operation, ctx)
        else:
            result = await ctx.driver.observe(ctx.target, self.operation, ctx)
            if result is RemoteResult.NOT_STARTED:
                # Started, yet the target does not know it: it lost it, or this worker's
                # step has moved on under another conductor (this one is fenced off and
                # does not know yet). Never start it again from a look: a retry (a new
                # attempt) may, under the state's retry policy.
                raise TransientError(f"{self.operation}: the target reports it not started")
        if result in (RemoteResult.NOT_STARTED, RemoteResult.IN_PROGRESS):
            return NotYet(f"{self.operation} in progress")
        return self._outcome(result, ctx)

    async def recover(self, ctx: ActionContext) -> Outcome:
        result = await ctx.driver.observe(ctx.target, self.operation, ctx)
        if result is RemoteResult.NOT_STARTED and ctx.stopping:
            raise NotStarted(f"the target reports {self.operation} not started")
        if result is RemoteResult.NOT_STARTED:
            # Never reached the target (lost between commit and dispatch): the engine
            # sends it again as the next attempt, on the record first.
            raise NotOnTarget(f"the target reports {self.operation} not started")
        if ctx.polling and result is RemoteResult.IN_PROGRESS:
            return NotYet(f"{self.operation} in progress")
        if result is RemoteResult.IN_PROGRESS:
            # still running: the operation is idempotent, so perform it: it waits for the
            # one run
            result = await ctx.driver.perform(ctx.target, self.operation, ctx)
        return self._outcome(result, ctx)

    def _outcome(self, result: RemoteResult, ctx: ActionContext) -> Outcome:
        if result is RemoteResult.ALREADY_DONE and self.skip_when_done:
            return Skip(f"{ctx.target.name}: {self.operation} reports already done")
        if result in (RemoteResult.DONE, RemoteResult.ALREADY_DONE):
            return _ADVANCE
        raise StepFailed(f"{self.operation}: target reported {result.value}")

    def describe(self) -> str:
        suffix = " (skip when done)" if self.skip_when_done else ""
        if self.skip_if:
            suffix += f" (skip if {', '.join(sorted(self.skip_if))})"
        return f"driver:{self.operation}{suffix}"

    def describe_recover(self) -> str:
        # a subclass with a recover of its own: that code decides, not the observation
        return "observe" if type(self).recover is DriverOperation.recover else "hook"


WaitMode = Literal["run", "wait-for-callback", "poll"]


@dataclass(frozen=True)
class StateDef:
    name: str
    action: StateAction
    timeout_s: float = 600.0
    attempts_max: int = 1
    backoff_s: float = 1.0
    backoff_max_s: float = 300.0
    mode: WaitMode = "run"
    #: a ``poll`` state: seconds between two calls of its action while it answers
    #: :class:`NotYet`
    poll_interval_s: float = 10.0
    #: where the step goes when the state is done (a later state, ``complete`` or
    #: ``failed``); None: the next state in order (``on: {done: ...}``)
    on_done: str | None = None
    #: where the step goes when the state fails for good (a later state: a cleanup);
    #: None: it ends failed (``on: {failed: ...}``)
    on_failed: str | None = None
    #: entered only by a branch (``on``), never in order: the state before it goes on
    #: past it; at the end of a cleanup chain the step ends failed
    cleanup: bool = False
    #: how many times a step may enter this state (a state on a cycle of branches must
    #: say; each visit is its own journal entry); None: once
    max_visits: int | None = None

    def backoff_for(self, failed_attempt: int) -> float:
        """Delay before the attempt after ``failed_attempt`` (1-based): exponential, capped."""
        return float(min(self.backoff_max_s, self.backoff_s * (2 ** (failed_attempt - 1))))


@dataclass(frozen=True)
class WorkflowDef:
    name: str
    states: tuple[StateDef, ...]
    version: int = 1
    description: str = ""
    #: where it comes from: "builtin", "yaml" (a file or a stored workflow) or "python"
    #: (registered by code, such as a module named in FLEETWAVE_PLUGINS)
    source: str = "python"
    #: the YAML it was parsed from, if any: a strategy keeps it, so editing or deleting
    #: the stored workflow changes no strategy already created from it
    yaml_text: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_workflow(self)
        # asked for on every action: computed once (the dataclass is frozen)
        object.__setattr__(self, "_names", tuple(s.name for s in self.states))
        object.__setattr__(self, "_by_name", {s.name: s for s in self.states})
        object.__setattr__(self, "_done_next", _done_next(self.states))
        object.__setattr__(
            self,
            "_max_visits",
            {s.name: s.max_visits for s in self.states if s.max_visits is not None},
        )

    @property
    def state_names(self) -> tuple[str, ...]:
        names: tuple[str, ...] = self.__dict__["_names"]
        return names

    @property
    def done_next(self) -> dict[str, str]:
        """By state, where a step goes once it is done: its ``on: done`` branch, else
        the next state in order that is not a cleanup (after a cleanup: the next one in
        the list), else ``complete`` (after a cleanup: ``failed``)."""
        nexts: dict[str, str] = self.__dict__["_done_next"]
        return nexts

    @property
    def max_visits(self) -> dict[str, int]:
        """The states a step may enter more than once (on a bounded cycle), and how many
        times: their visits are counted (the step's row and the journal say which visit
        each entry is); every other state is entered once at most."""
        limits: dict[str, int] = self.__dict__["_max_visits"]
        return limits

    @property
    def first_state(self) -> str:
        return self.states[0].name

    def state(self, name: str) -> StateDef:
        by_name: dict[str, StateDef] = self.__dict__["_by_name"]
        return by_name[name]

    def with_timeouts(self, timeouts_s: dict[str, float]) -> WorkflowDef:
        """A copy with per-state timeouts overridden (strategy options)."""
        if not timeouts_s:
            return self
        unknown = set(timeouts_s) - set(self.state_names)
        if unknown:
            raise WorkflowError(
                f"workflow {self.name}: timeout given for unknown state(s) {sorted(unknown)}"
            )
        states = tuple(
            replace(s, timeout_s=timeouts_s.get(s.name, s.timeout_s)) for s in self.states
        )
        return WorkflowDef(
            self.name, states, self.version, self.description, self.source, self.yaml_text
        )


def describe_workflow(wf: WorkflowDef) -> dict[str, Any]:
    """What a workflow does, as ``workflow show`` prints it: two workflows that describe
    alike run alike (comments and layout of their YAML aside)."""
    return {
        "name": wf.name,
        "version": wf.version,
        "source": wf.source,
        "description": wf.description,
        "states": [
            {
                "state": s.name,
                "action": s.action.describe(),
                # (also in the action's text: a script reads it here)
                "skip_when_done": bool(getattr(s.action, "skip_when_done", False)),
                "timeout_s": s.timeout_s,
                "attempts": s.attempts_max,
                "backoff_s": s.backoff_s,
                "backoff_max_s": s.backoff_max_s,
                "mode": s.mode,
                **({"poll_interval_s": s.poll_interval_s} if s.mode == "poll" else {}),
                # after a takeover: observe the target, the action's own hook, or none
                # (the step fails)
                "recover": s.action.describe_recover(),
                # branches: where done and failed go (only when not the plain order)
                **({"on_done": s.on_done} if s.on_done is not None else {}),
                **({"on_failed": s.on_failed} if s.on_failed is not None else {}),
                **({"cleanup": True} if s.cleanup else {}),
                **({"max_visits": s.max_visits} if s.max_visits is not None else {}),
                # (two states that differ only in their command must not describe alike)
                **_params(s.action),
            }
            for s in wf.states
        ],
    }


#: where a branch may end a step instead of naming a state
BRANCH_ENDS = ("complete", "failed")


class _InOrder(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def cleanup(self) -> bool: ...


def next_in_order(states: Sequence[_InOrder], i: int) -> str:
    """Where state ``i`` goes once done without a branch: the next state in the list
    that is not a cleanup (after a cleanup: the next one), else ``complete`` (after a
    cleanup: ``failed``: the failure it cleaned up after stands)."""
    here = states[i]
    for later in states[i + 1 :]:
        if here.cleanup or not later.cleanup:
            return later.name
    return "failed" if here.cleanup else "complete"


def _done_next(states: tuple[StateDef, ...]) -> dict[str, str]:
    return {
        s.name: s.on_done if s.on_done is not None else next_in_order(states, i)
        for i, s in enumerate(states)
    }


#: the most visits a state on a cycle may declare (``max_visits``)
MAX_VISITS = 100


def _check_branches(wf: WorkflowDef) -> None:
    """Branches go to a state of the workflow (or end the step); a cleanup state is
    reached by some branch. A branch may go back (a retry loop) only on a bounded
    cycle: every state on it declares ``max_visits`` (G1 then holds per visit: the
    journal is unique on step, state and visit)."""
    names = [s.name for s in wf.states]
    reached: set[str] = set()
    for i, s in enumerate(wf.states):
        where = f"workflow {wf.name}: states[{i}] ({s.name})"
        for outcome, to in (("done", s.on_done), ("failed", s.on_failed)):
            if to is None:
                continue
            if outcome == "failed" and to == "failed":
                continue  # as without a branch
            if to in BRANCH_ENDS and outcome == "done":
                continue
            if to not in names:
                ends = " or complete/failed" if outcome == "done" else ""
                raise WorkflowError(
                    f"{where}: on: {outcome}: '{to}' is not a state of this workflow (its "
                    f"states: {', '.join(names)}){ends}"
                )
            reached.add(to)
    if wf.states[0].cleanup:
        raise WorkflowError(
            f"workflow {wf.name}: states[0] ({wf.states[0].name}): cleanup: the first state "
            "is entered in order; a cleanup state is entered only by a branch"
        )
    for i, s in enumerate(wf.states):
        if s.cleanup and s.name not in reached and not wf.states[i - 1].cleanup:
            raise WorkflowError(
                f"workflow {wf.name}: states[{i}] ({s.name}): cleanup: no branch goes "
                "to it (on: {failed: " + s.name + "})"
            )
    _check_cycles(wf)


def state_edges(states: Sequence[StateDef]) -> dict[str, list[str]]:
    """Where each state may go next (its done and failed branches, or the next state in
    order), states only (not the step's ends)."""
    names = {s.name for s in states}
    done = _done_next(tuple(states))
    edges: dict[str, list[str]] = {}
    for s in states:
        outs = [to for to in (done[s.name], s.on_failed) if to in names]
        edges[s.name] = list(dict.fromkeys(outs))
    return edges


def back_edges(states: Sequence[StateDef]) -> dict[str, frozenset[str]]:
    """By state, the states it may go back to (to an earlier state, or itself: only
    along a bounded cycle, once the workflow is valid)."""
    order = {s.name: i for i, s in enumerate(states)}
    back: dict[str, frozenset[str]] = {}
    for name, outs in state_edges(states).items():
        behind = frozenset(to for to in outs if order[to] <= order[name])
        if behind:
            back[name] = behind
    return back


def cycles(states: Sequence[StateDef]) -> list[list[str]]:
    """The cycles of branches among ``states``: each strongly connected set of states
    that a step can go round (two or more states, or one that branches to itself), its
    states in the workflow's order."""
    edges = state_edges(states)
    order = {s.name: i for i, s in enumerate(states)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm (a workflow has few states)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in edges[v]:
                found.append(sorted(group, key=order.__getitem__))

    for s in states:
        if s.name not in index:
            visit(s.name)
    return sorted(found, key=lambda g: order[g[0]])


def _check_cycles(wf: WorkflowDef) -> None:
    """Each cycle is bounded: every state on it declares ``max_visits``. A state on a
    cycle may wait for a callback: a callback reports on one visit of its state (its
    agent token's), and a late one of an earlier visit is ignored, never applied to the
    next (see ``Conductor._on_callback``)."""
    for i, s in enumerate(wf.states):
        if s.max_visits is not None and not (1 <= s.max_visits <= MAX_VISITS):
            raise WorkflowError(
                f"workflow {wf.name}: states[{i}] ({s.name}): max_visits: must be 1 to "
                f"{MAX_VISITS}, got {s.max_visits}"
            )
    by_name = {s.name: s for s in wf.states}
    for group in cycles(wf.states):
        said = (
            f"state {group[0]} branches to itself, a cycle"
            if len(group) == 1
            else f"states {', '.join(group)} form a cycle of branches"
        )
        unbounded = [n for n in group if by_name[n].max_visits is None]
        if unbounded:
            raise WorkflowError(
                f"workflow {wf.name}: {said}; every state on a cycle needs max_visits "
                f"(1 to {MAX_VISITS}): missing on "
                f"{', '.join(unbounded)}"
            )


def _params(action: StateAction) -> dict[str, Any]:
    params = action.describe_params()
    return {} if params is None else {"params": params}


def validate_workflow(wf: WorkflowDef) -> None:
    if not wf.name:
        raise WorkflowError("workflow: name: must not be empty")
    if not wf.states:
        raise WorkflowError(f"workflow {wf.name}: states: at least one state is required")
    seen: set[str] = set()
    for i, s in enumerate(wf.states):
        where = f"workflow {wf.name}: states[{i}] ({s.name or '?'})"
        if not s.name:
            raise WorkflowError(f"{where}: name: must not be empty")
        if s.name in RESERVED_STATE_NAMES:
            raise WorkflowError(f"{where}: name: '{s.name}' is reserved for the engine")
        if s.name in seen:
            raise WorkflowError(f"{where}: name: duplicate state name")
        seen.add(s.name)
        if not isinstance(s.action, StateAction):
            # a class, or a function: registered without a word, then `workflow show`
            # printed a traceback and every step failed at run time
            what = (
                f"the class {s.action.__name__}, not an instance of it (give {s.action.__name__}())"
                if isinstance(s.action, type) and issubclass(s.action, StateAction)
                else f"{type(s.action).__name__} is not a StateAction"
            )
            raise WorkflowError(f"{where}: action: {what}")
        if not (s.timeout_s > 0 and math.isfinite(s.timeout_s)):
            raise WorkflowError(
                f"{where}: timeout_s: must be a positive, finite number of seconds "
                "(every state has a deadline)"
            )
        if s.attempts_max < 1:
            raise WorkflowError(f"{where}: attempts: must be at least 1")
        if not (0 <= s.backoff_s < math.inf and 0 <= s.backoff_max_s < math.inf):
            raise WorkflowError(f"{where}: backoff_s: must be a finite number, not negative")
        if not (s.poll_interval_s > 0 and math.isfinite(s.poll_interval_s)):
            raise WorkflowError(
                f"{where}: poll_interval_s: must be a positive, finite number of seconds"
            )
    _check_branches(wf)
