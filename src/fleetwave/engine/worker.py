"""The step workers: :class:`WorkerMixin`.

A step's worker runs its state's action (or recover hook) with retries and backoff,
polls, waits for the target's callback, and reports the outcome to the dispatcher by
message (G2); it never touches the dispatcher's tables. :func:`resolve_future` is how the
dispatcher answers the futures a worker waits on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from fleetwave.domain.models import STEP_ABORTED
from fleetwave.domain.rules import Decision, decide, details_text, failure, on_failed
from fleetwave.domain.workflow import (
    ActionContext,
    Advance,
    NoRecoverHook,
    NotOnTarget,
    NotStarted,
    NotYet,
    Outcome,
    StateDef,
    StepFailed,
    TargetDriver,
    TransientError,
)
from fleetwave.engine.agent_tokens import AgentTokenIssuer
from fleetwave.engine.clock import Clock
from fleetwave.engine.errors import SimulatedCrash
from fleetwave.engine.messages import (
    ActionFinished,
    CallbackArrived,
    Message,
    RetryAnswer,
    RetryScheduled,
)
from fleetwave.engine.meters import Meters
from fleetwave.engine.run import InFlight, StrategyRun
from fleetwave.engine.stopping import not_started_reason
from fleetwave.engine.store_calls import StoreCalls
from fleetwave.store import callbacks as cbs
from fleetwave.store import runtime as rt

log = logging.getLogger("fleetwave.engine")

R = TypeVar("R")


class _StateDeadline(TimeoutError):
    """The state's deadline ran out (the action was cancelled for it); an action's own
    TimeoutError (its client gave up) is not this."""


class _RetryRefused(Exception):
    """The record of a retry was refused (the step's row changed): its worker ends."""


class _HandedOver(Exception):
    """A clean stop came while the step waited out a retry's backoff: the retry is
    left, as recorded on the step's row, to the next owner; its worker ends."""


class _WaitEnded(Exception):
    """An operator's abort ended a wait on the target (its callback, the next poll)."""


class WorkerMixin(StoreCalls):
    """The step workers: a mixin of :class:`Conductor`, which sets what is declared here."""

    # the conductor's, used here (besides what StoreCalls declares)
    clock: Clock
    drivers: dict[str, TargetDriver]
    _draining: bool
    _committed_at: float
    _attempts: int
    _inbox: list[Message]
    _ending_waits: list[InFlight]
    post: Callable[[Message], None]
    _first_sight: Callable[[cbs.CallbackRecord], bool]
    meters: Meters | None
    _agent_tokens: AgentTokenIssuer
    _wake_soon: Callable[[], None]
    _arm_deadline: Callable[[float, int, InFlight], None]

    async def _step_worker(self, run: StrategyRun, fl: InFlight) -> None:
        """The step's one worker: run a state's action, report, wait for the commit, repeat.

        It only reads its :class:`InFlight` after the dispatcher resolved ``go``, and
        reports by message (G2); it ends when told to (terminal, fenced off, draining).
        """
        recovering = fl.recovering
        loop = self._loop
        measure = self.config.measure_latency
        meters = self.meters
        while True:
            if measure and not recovering:
                self.stats.dispatch_latency_s.append(time.perf_counter() - self._committed_at)
            if meters is not None and not recovering:
                meters.dispatch_s.observe(time.perf_counter() - self._committed_at)
            try:
                msg = await self._run_state(run, fl, recovering)
            except _RetryRefused:
                return  # the dispatcher reads the step's row back and takes it over
            except _HandedOver:
                return  # a clean stop: the next owner runs the recorded retry
            except Exception as exc:
                # _run_state never raises but for the above; if it did (a bug of ours, or
                # an action's exception odd in a way not foreseen), the worker would end
                # and leave its step holding a slot with nobody to report on it (an
                # exception whose str() raised did: the strategy never ended). The step
                # fails instead.
                said = details_text(exc) or type(exc).__name__
                log.error(
                    "worker of step %s in %s: %s",
                    fl.rec.step_id,
                    fl.state,
                    said,
                    extra=log_fields(fl.rec, fl.state),
                )
                log.debug("traceback of the worker of step %s", fl.rec.step_id, exc_info=True)
                decision = failure(fl.state, f"internal error ({type(exc).__name__}): {said}")
                msg = ActionFinished(run.id, fl.rec.step_id, fl.state, fl.fence, decision, 1, None)
            recovering = False
            go = fl.go = msg.go = loop.create_future()
            self.post(msg)
            if not await go:
                return

    async def _run_state(self, run: StrategyRun, fl: InFlight, recovering: bool) -> ActionFinished:
        """Run one state's action (or its recover hook), with retries; never raises."""
        rec, state, fence, waiter = fl.rec, fl.state, fl.fence, fl.waiter
        st = run.defs[state]
        timeout_s = st.timeout_s
        #: the attempt the row names (a takeover goes on from there, not from 1 again)
        resume = recovering
        start_retry = False
        #: the attempt running re-sends after a takeover (see ActionContext.resent)
        resending = False
        if fl.retry_due is not None:
            # A retry recorded and never started (its row says so), taken over: it runs
            # as that attempt once due (a takeover does not cut its backoff short, or a
            # restarted conductor would hit every backed-off target at once), never
            # through a recover hook (which would see the attempt before it, and take
            # its failure for this one's). Its wait is bounded by the state's longest
            # backoff (the due time is derived from the recorded deadline).
            due, fl.retry_due = fl.retry_due, None
            resume = start_retry = True
            wait = min(due - self.clock.now(), st.backoff_max_s)
            if wait > 0:
                await self._wait_backoff(fl, wait)
            if self._draining:
                raise _HandedOver
            if fl.stopped:
                return _retry_not_started(run, rec, state, fence)
        if recovering and rec.deadline_at is not None:
            # The state's time kept running while its conductor was lost.
            left = max(0.0, rec.deadline_at - self.clock.now())
            timeout_s = min(st.timeout_s, left + self.config.recover_grace_s)
        driver = self.drivers.get(rec.target.driver)
        loop = self._loop
        # After a takeover the recover hook looks at the attempt that was running (the
        # row's attempt): the state's attempts go on from there, not from 1 again.
        attempts = min(max(rec.attempt, 1), st.attempts_max) - 1 if resume else 0
        if start_retry:
            # its start on the record (the mark cleared, the fence checked) before it runs
            deadline = rec.deadline_at or self.clock.now() + st.timeout_s
            # the row's "attempt N from T" (what failed before it) would read as still to
            # come; what failed is kept in its attempt-failed event
            now_on = (
                f"{state}: attempt {rec.attempt} of {st.attempts_max} started "
                f"{utc_text(self.clock.now())} (a retry taken over)"
            )
            started = RetryScheduled(
                run.id, rec.step_id, state, fence, deadline, rec.attempt, now_on
            )
            answer = await self._record(started, started=True)
            if answer is RetryAnswer.HELD:
                # an abort was on record before it could start
                return _retry_not_started(run, rec, state, fence)
            if answer is RetryAnswer.REFUSED:
                raise _HandedOver if self._draining else _RetryRefused
        callback_id: int | None = None
        #: the action's outcome once it waits for the target's callback
        chosen: Advance | None = None
        decision: Decision
        #: a poll state's last "not yet" (its details): said when the state times out
        last_poll: str | None = None
        agent_token = None
        if waiter is not None and not recovering and driver is not None:
            agent_token = await self._agent_tokens.issue(
                run.id, rec.step_id, state, timeout_s, fl.visit
            )
        while True:
            attempts += 1
            try:
                if driver is None:
                    raise StepFailed(f"no driver named '{rec.target.driver}' on this conductor")
                # (positional, in the fields' order: keywords cost the hot path more)
                ctx = ActionContext(
                    rec.target,
                    state,
                    attempts,
                    run.id,
                    rec.step_id,
                    driver,
                    {},  # settings
                    waiter is not None,  # callback_expected
                    recovering,
                    st.mode == "poll",  # polling
                    0,  # poll
                    (lambda: fl.stopped) if recovering else None,  # is_stopping
                    agent_token,
                    resending,
                    fl.visit,
                )
                self._attempts += 1
                attempt = fl.running = self._attempts
                fl.attempt_no = attempts
                self._arm_deadline(loop.time() + timeout_s, attempt, fl)
                try:
                    outcome: Outcome
                    if recovering:
                        outcome = await st.action.recover(ctx)
                    else:
                        outcome = await st.action.run(ctx)
                    while isinstance(outcome, NotYet):
                        last_poll = outcome.details
                        if not await self._poll_again(st, ctx, outcome, fl):
                            raise _WaitEnded(
                                "aborted by operator while polling the target (last "
                                f"answer: {last_poll or 'not yet'}); what it was doing "
                                "may still be running there"
                            )
                        ctx = replace(ctx, poll=ctx.poll + 1, recovering=False)
                        outcome = await st.action.run(ctx)
                    if waiter is not None and isinstance(outcome, Advance):
                        chosen = outcome
                        answered = await self._callback(fl, waiter)
                        if answered is None:
                            raise _WaitEnded(
                                "aborted by operator while waiting for the target's "
                                "callback; what the target was started on may still be "
                                "running there"
                            )
                        callback_id = answered.id
                        outcome = _callback_outcome(answered, outcome)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    assert task is not None
                    if fl.timed_out == attempt:
                        fl.timed_out = 0
                        if task.uncancel() == 0:
                            raise _StateDeadline from None
                        raise  # also stopped by the conductor (lease lost): that wins
                    if task.cancelling() == 0:
                        # Nobody cancelled this worker: the action let a CancelledError
                        # escape (a library's inner task). Failing the step beats losing it.
                        raise StepFailed("action raised CancelledError") from None
                    raise  # the conductor is stopping this worker
                finally:
                    fl.running = 0
                    if fl.timed_out == attempt:
                        # The action swallowed the deadline's cancel and returned: its
                        # outcome stands (as with asyncio.timeout); take the cancel back.
                        fl.timed_out = 0
                        task = asyncio.current_task()
                        assert task is not None
                        task.uncancel()
                if (
                    type(outcome) is Advance
                    and outcome.to is None
                    and type(outcome.details) is str
                    and not outcome.details
                ):
                    decision = run.advance[state]  # (decide's answer, made once)
                else:
                    decision = decide(
                        run.workflow.state_names, state, outcome, run.workflow.done_next
                    )
            except _WaitEnded as exc:
                decision = Decision(STEP_ABORTED, f"{state}: {exc}")
            except NotStarted as exc:
                # a recover hook found the attempt never began: nothing starts now
                why = details_text(exc) or "the target reports it not started"
                decision = Decision(
                    STEP_ABORTED, f"{state}: {why}; not started now: {run.stop_details}"
                )
            except NoRecoverHook:
                decision = failure(state, f"conductor lost during {state}")
            except NotOnTarget as exc:
                # The recover hook found the target never got the state's operation: it
                # is sent again as the next attempt, on the record first (G1 at the
                # target: its attempts row is unique), then run as any attempt.
                recovering = False
                resending = True
                attempts = max(attempts, rec.attempt)
                why = details_text(exc) or "the target did not have it"
                resent = RetryScheduled(
                    run.id,
                    rec.step_id,
                    state,
                    fence,
                    rec.deadline_at or self.clock.now() + timeout_s,
                    attempts + 1,
                    f"{state}: attempt {attempts + 1} re-sent after takeover "
                    f"{utc_text(self.clock.now())} ({why})",
                    how="resent",
                )
                answer = await self._record(resent, started=True)
                if answer is RetryAnswer.HELD:
                    return _retry_not_started(run, rec, state, fence)
                if answer is RetryAnswer.REFUSED:
                    raise (_HandedOver if self._draining else _RetryRefused) from None
                continue
            except StepFailed as exc:
                decision = failure(state, details_text(exc) or "failed")
            except (TransientError, TimeoutError) as exc:
                if isinstance(exc, _StateDeadline) and chosen is not None and waiter is not None:
                    # The target's report may have come just before the deadline: handed
                    # in the same instant, or stored by another process and not picked up
                    # yet (that is done once a second). It was in time: it counts.
                    came = await self._callback_in_time(fl, waiter)
                    if came is not None:
                        callback_id = came.id
                        try:
                            decision = decide(
                                run.workflow.state_names,
                                state,
                                _callback_outcome(came, chosen),
                                run.workflow.done_next,
                            )
                        except StepFailed as reported:
                            decision = failure(state, details_text(reported) or "failed")
                        break
                if isinstance(exc, _StateDeadline):
                    reason = f"timed out after {st.timeout_s:g}s"
                    if fl.heard_at is not None:
                        reason = (
                            f"timed out {st.timeout_s:g}s after the target's last heartbeat "
                            f"({utc_text(fl.heard_at)})"
                        )
                    if last_poll is not None:
                        reason += f" polling (last answer: {last_poll or 'not yet'})"
                    if timeout_s < st.timeout_s:
                        reason = (
                            f"timed out: the state's {st.timeout_s:g}s deadline, recorded "
                            f"when it was entered, ran out across a conductor takeover "
                            f"(the recover hook had {timeout_s:.0f}s)"
                        )
                    if waiter is not None:
                        reason += " waiting for the target's callback"
                else:
                    # a TransientError, or the action's own TimeoutError (its client gave
                    # up: not the state's deadline): retried like a transient error
                    reason = details_text(exc) or type(exc).__name__
                # After a takeover too: the recover hook said how the attempt that was
                # running ended (failed for now, or out of time), so the next one is a
                # retry like any other, of the action (idempotent on the target side).
                retry = attempts < st.attempts_max and waiter is None
                if retry and not fl.stopped:
                    backoff = st.backoff_for(attempts)
                    # Each attempt has the state's whole timeout (after a takeover, only the
                    # first one had what was left of the recorded deadline).
                    timeout_s = st.timeout_s
                    # On the step's row: why it waits and which attempt comes; and, as
                    # the state's recorded deadline was its first attempt's, the next
                    # one's, so a takeover gives the recover hook what is left of it.
                    due = self.clock.now() + backoff
                    failed = f"{state}: {reason} (attempt {attempts} of {st.attempts_max})"
                    record = RetryScheduled(
                        run.id,
                        rec.step_id,
                        state,
                        fence,
                        due + timeout_s,
                        attempts + 1,
                        # a time, not "in 5s": the row is read while the attempt runs
                        f"{failed}; attempt {attempts + 1} from {utc_text(due)}",
                    )
                    handled = record.handled = loop.create_future()
                    self.post(record)
                    await self._wait_backoff(fl, backoff)
                    if await handled is not RetryAnswer.RECORDED:  # (normally is)
                        raise _RetryRefused from None
                    if self._draining:
                        raise _HandedOver from None  # left, marked, to the next owner
                    # The backoff may have lasted minutes: the strategy's lease and the
                    # step's row are checked again, in a commit, just before the attempt
                    # starts, which also clears the row's not-started mark. A conductor
                    # that stalled meanwhile and was taken over starts nothing; nor does
                    # one stopping cleanly.
                    # the row says the attempt runs (its due time, past now, read as if
                    # it were still to come)
                    now_on = (
                        f"{failed}; attempt {attempts + 1} started {utc_text(self.clock.now())}"
                    )
                    answer = (
                        None
                        if fl.stopped
                        else await self._record(replace(record, details=now_on), started=True)
                    )
                    if answer is RetryAnswer.REFUSED:
                        raise (_HandedOver if self._draining else _RetryRefused) from None
                    if answer is RetryAnswer.RECORDED and not fl.stopped:
                        recovering = False
                        continue
                    # held (an abort was on record first), or stopping: not retried
                if retry:
                    # The strategy stopped (abort, failure limit): no new attempt starts.
                    decision = Decision(
                        STEP_ABORTED,
                        f"{state}: {reason} (attempt {attempts} of {st.attempts_max}); "
                        "not retried: the strategy is stopping",
                    )
                else:
                    why = f"{reason} (attempt {attempts} of {st.attempts_max}"
                    if attempts < st.attempts_max and waiter is not None:
                        # Not retried: a callback wait is not started again (the target's
                        # agent was started once).
                        why += "; a wait for a callback is not retried"
                    decision = failure(state, why + ")")
            except Exception as exc:  # an action bug must fail the step, never strand it
                # One line per step (a bug in an action may fail thousands of them); the
                # traceback at debug level.
                said = details_text(exc)
                log.error(
                    "action for %s in %s raised %s: %s",
                    rec.target.name,
                    state,
                    type(exc).__name__,
                    said,
                    extra=log_fields(rec, state),
                )
                log.debug("traceback of the action for %s", rec.target.name, exc_info=True)
                decision = failure(state, said or type(exc).__name__)
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit, SimulatedCrash):
                raise  # the conductor stops this worker, or the process is going down
            except BaseException as exc:
                # Not an Exception, yet raised by the action (a library's own interrupt or
                # timeout class): the step fails; letting it end the worker would leave
                # the step holding its slot with nobody to report on it.
                said = details_text(exc)
                log.error(
                    "action for %s in %s raised %s (a BaseException): %s",
                    rec.target.name,
                    state,
                    type(exc).__name__,
                    said,
                    extra=log_fields(rec, state),
                )
                decision = failure(
                    state, f"{type(exc).__name__}: {said}" if said else type(exc).__name__
                )
            break
        decision = on_failed(st, decision)  # a cleanup state, if it has one
        return ActionFinished(run.id, rec.step_id, state, fence, decision, attempts, callback_id)

    async def _record(self, record: RetryScheduled, *, started: bool) -> RetryAnswer:
        """Commit a retry's record (again), as ``started`` or not; how it went."""
        done: asyncio.Future[RetryAnswer] = self._loop.create_future()
        self.post(replace(record, handled=done, started=started))
        return await done

    async def _wait_backoff(self, fl: InFlight, delay: float) -> None:
        """A retry's backoff; over at once when the strategy stops meanwhile (nothing
        runs on the target during it: the step ends now, not when the retry was due)."""
        if fl.stopped or self._draining:
            return
        fl.backoff = self._loop.create_future()
        try:
            await self._sleep(delay, fl.backoff)
        finally:
            fl.backoff = None

    async def _sleep(self, delay: float, early: asyncio.Future[None]) -> None:
        """``delay`` seconds, or until ``early`` is resolved (by a stop or an abort)."""
        timer = self._loop.call_later(delay, resolve_future, early, None)
        try:
            await early
        finally:
            timer.cancel()

    def _end_wait(self, fl: InFlight) -> None:
        """End ``fl``'s callback wait (an operator's abort) on the dispatcher's next turn,
        or once the callbacks queued for its step have been handed out: a callback stored
        before a takeover, offered to the wait just after it began, still counts."""
        self._ending_waits.append(fl)
        self._wake_soon()

    def _ending_waits_end(self) -> None:
        queued = {m.record.step_id for m in self._inbox if isinstance(m, CallbackArrived)}
        keep: list[InFlight] = []
        for fl in self._ending_waits:
            if fl.rec.step_id in queued:
                keep.append(fl)  # the inbox is not empty: the next turn comes at once
            else:
                resolve_future(fl.waiting, None)
        self._ending_waits = keep

    async def _poll_again(
        self, st: StateDef, ctx: ActionContext, answer: NotYet, fl: InFlight
    ) -> bool:
        """A poll state's action answered "not yet": wait before asking again. False:
        an operator's abort came first (nothing of ours runs on the target meanwhile)."""
        if not ctx.polling:
            raise StepFailed(
                f"the action answered 'not yet', but the state does not poll (mode: {st.mode})"
            )
        delay = st.poll_interval_s if answer.after_s is None else answer.after_s
        if not (0 <= delay < math.inf):
            raise StepFailed(f"the action asked to be called again after {delay!r} s")
        if fl.aborted:
            return False
        fl.waiting = self._loop.create_future()
        try:
            await self._sleep(delay, fl.waiting)
        finally:
            fl.waiting = None
        return not fl.aborted

    async def _callback_in_time(
        self, fl: InFlight, waiter: asyncio.Future[cbs.CallbackRecord]
    ) -> cbs.CallbackRecord | None:
        """A report on the state that came before its deadline ran out, if any: handed to
        the wait in the same instant, or stored and not picked up yet (then it is marked
        seen, so the next pick-up does not offer it again)."""
        if waiter.done() and not waiter.cancelled():
            return waiter.result()
        if fl.stopped or fl.aborted:
            return None
        came = await self._io(cbs.open_callback_of, self.store, fl.rec.step_id, fl.state, fl.visit)
        if came is not None:
            self._first_sight(came)
        return came

    async def _callback(
        self, fl: InFlight, waiter: asyncio.Future[cbs.CallbackRecord]
    ) -> cbs.CallbackRecord | None:
        """The target's callback for a wait-for-callback state; None when an operator's
        abort came first. The waiter itself is never cancelled here: the dispatcher may
        still hand it a callback, which it then answers as ignored."""
        if not waiter.done():
            ended = fl.waiting = self._loop.create_future()

            def answered(_: object) -> None:
                resolve_future(ended, None)

            waiter.add_done_callback(answered)
            if fl.aborted:
                self._end_wait(fl)  # after a callback already on its way, if any
            try:
                await ended
            finally:
                waiter.remove_done_callback(answered)
                fl.waiting = None
            if not waiter.done():
                return None
        return waiter.result()


def _retry_not_started(
    run: StrategyRun, rec: rt.StepRecord, state: str, fence: int
) -> ActionFinished:
    """A retry recorded and taken over that the strategy's stop keeps from starting: the
    step ends aborted, the attempt its row names not started."""
    why = not_started_reason(run, state, rec.attempt)
    return ActionFinished(
        run.id, rec.step_id, state, fence, Decision(STEP_ABORTED, why), rec.attempt, None
    )


def log_fields(rec: rt.StepRecord, state: str) -> dict[str, object]:
    """A step's ids for a log line's fields (``serve --log-format json``)."""
    return {
        "strategy": rec.strategy_id,
        "step": rec.step_id,
        "target": rec.target.name,
        "state": state,
    }


def utc_text(at: float) -> str:
    """A time as a step's details say it: to the second, UTC."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + "Z"


def resolve_future(fut: asyncio.Future[R] | None, value: R) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)


def _callback_outcome(cb: cbs.CallbackRecord, chosen: Advance) -> Outcome:
    """A wait-for-callback state's outcome: the target's report, and where the action
    chose to go once it came (a branch the action chose is kept)."""
    if cb.kind == "failed":
        raise StepFailed(f"target reported failure: {cb.details or 'no details'}")
    return Advance(to=chosen.to, details=cb.details or chosen.details)
