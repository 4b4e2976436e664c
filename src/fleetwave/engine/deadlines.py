"""Action deadlines: :class:`DeadlinesMixin`.

One heap and one loop timer for all running attempts: an attempt still running past
its state's deadline is cancelled, and one that does not stop when cancelled is
abandoned after a grace period (its step fails). A heartbeat from the target of a step
that waits for its callback moves that deadline to a full timeout after the heartbeat
(:meth:`DeadlinesMixin._on_heartbeat`): the step's row and an event say so.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable

from fleetwave.domain.rules import failure
from fleetwave.engine.clock import Clock
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.messages import ActionFinished, Message
from fleetwave.engine.run import InFlight, StrategyRun
from fleetwave.engine.worker import log_fields, utc_text
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import CallbackRecord

log = logging.getLogger("fleetwave.engine")


class DeadlinesMixin:
    """Action deadlines: a mixin of :class:`Conductor`, which sets what is declared here."""

    # the conductor's, used here
    config: EngineConfig
    clock: Clock
    runs: dict[int, StrategyRun]
    _loop: asyncio.AbstractEventLoop
    _deadlines: list[tuple[float, int, InFlight]]
    _deadline_timer: asyncio.TimerHandle | None
    _deadline_at: float
    _deadlines_compact_at: int
    post: Callable[[Message], None]

    def pending_deadlines(self) -> int:
        """Deadline entries held (live or not yet dropped): bounded by compaction."""
        return len(self._deadlines)

    def _arm_deadline(self, when: float, attempt: int, fl: InFlight) -> None:
        fl.deadline = when
        fl.heard_at = None
        self._push_deadline(when, attempt, fl)

    def _push_deadline(self, when: float, attempt: int, fl: InFlight) -> None:
        heap = self._deadlines
        heapq.heappush(heap, (when, attempt, fl))
        if self._deadline_timer is None or when < self._deadline_at:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._deadline_at = when
            self._deadline_timer = self._loop.call_at(when, self._expire)
        elif len(heap) > self._deadlines_compact_at:
            # Most entries are of attempts that ended long before their deadline.
            live = [e for e in heap if e[2].running == abs(e[1])]  # (-: a cancel's grace)
            heapq.heapify(live)
            self._deadlines = live
            self._deadlines_compact_at = max(1024, 2 * len(live))

    def _expire(self) -> None:
        """The earliest deadline is due: cancel every attempt still running past its own;
        one that a grace period later still runs (its action swallowed the cancel) is
        abandoned: its step fails, instead of holding its slot for good."""
        due, heap = max(self._deadline_at, self._loop.time()), self._deadlines
        self._deadline_timer = None
        while heap and heap[0][0] <= due:
            when, attempt, fl = heapq.heappop(heap)
            if attempt < 0:  # the grace after a cancel
                if fl.running == -attempt and fl.timed_out == -attempt:
                    self._abandon(fl)
            elif (
                fl.running == attempt
                and when >= fl.deadline  # (else a heartbeat moved it: a later entry)
                and fl.task is not None
                and not fl.task.done()
            ):
                fl.timed_out = attempt
                fl.task.cancel()
                # from now, not from the deadline: a loop that was blocked past both
                # must not abandon an action it has not yet given a chance to stop
                grace = self._loop.time() + self.config.abandon_after_s
                heapq.heappush(heap, (grace, -attempt, fl))
        if heap:
            self._deadline_at = heap[0][0]
            self._deadline_timer = self._loop.call_at(heap[0][0], self._expire)

    def _on_heartbeat(
        self,
        run: StrategyRun,
        fl: InFlight,
        cb: CallbackRecord,
        marks: list[rt.CallbackMark],
        deadlines: list[rt.AttemptDeadline],
        events: list[rt.Event],
    ) -> None:
        """A heartbeat on the state ``fl`` is in. While the step waits for its target's
        callback, the state's deadline moves to its full timeout after the heartbeat
        (never earlier than it was): here at once, and in the dispatcher's commit on the
        step's row (a takeover goes on from it), with a ``deadline-extended`` event and
        the heartbeat marked applied. Otherwise the heartbeat is only noted."""
        sid, step_id = run.id, fl.rec.step_id
        attempt = fl.running
        if (
            fl.waiter is None
            or fl.waiter.done()
            or attempt == 0
            or fl.timed_out == attempt
            or fl.aborted
        ):
            # not waiting (a state that runs or polls, or one timed out or aborted): noted
            # (one whose report came is ignored before it gets here: see _on_callback)
            marks.append(rt.CallbackMark(cb.id, "applied", "heartbeat noted", sid))
            return
        now = self.clock.now()
        heard = now if cb.received_at is None else min(now, cb.received_at)
        timeout_s = run.defs[fl.state].timeout_s
        when = self._loop.time() - (now - heard) + timeout_s
        deadline_at = heard + timeout_s
        if when <= fl.deadline:
            marks.append(
                rt.CallbackMark(
                    cb.id,
                    "applied",
                    f"heartbeat noted: the deadline is later already "
                    f"({timeout_s:g}s after the state's start or a later heartbeat)",
                    sid,
                )
            )
            return
        fl.deadline = when
        fl.heard_at = heard
        self._push_deadline(when, attempt, fl)
        at = utc_text(deadline_at)
        marks.append(rt.CallbackMark(cb.id, "applied", f"heartbeat: deadline moved to {at}", sid))
        events.append(
            rt.Event(
                "deadline-extended",
                f"{fl.state}: deadline moved to {at}, {timeout_s:g}s after the target's "
                f"heartbeat (callback {cb.id})",
                sid,
                step_id,
            )
        )
        deadlines.append(
            rt.AttemptDeadline(step_id, sid, fl.state, fl.fence, deadline_at, None, None)
        )
        log.debug(
            "step %s in %s: deadline moved to %s by a heartbeat",
            step_id,
            fl.state,
            at,
            extra=log_fields(fl.rec, fl.state),
        )

    def _abandon(self, fl: InFlight) -> None:
        """Fail the step of an attempt whose action did not stop when cancelled at its
        deadline: reported on its worker's behalf (whatever the worker reports later is
        stale: the step has moved on)."""
        run = self.runs.get(fl.rec.strategy_id)
        if run is None or run.inflight.get(fl.rec.step_id) is not fl:
            return
        st = run.workflow.state(fl.state)
        log.error(
            "action for %s in %s did not stop when cancelled at its %gs deadline "
            "(it catches CancelledError): its step fails; the action is abandoned, and "
            "may still be running in this process",
            fl.rec.target.name,
            fl.state,
            st.timeout_s,
            extra=log_fields(fl.rec, fl.state),
        )
        fl.running = 0
        why = (
            f"timed out after {st.timeout_s:g}s (attempt {fl.attempt_no} of "
            f"{st.attempts_max}); its action did not stop when cancelled, and was abandoned"
        )
        self.post(
            ActionFinished(
                run.id,
                fl.rec.step_id,
                fl.state,
                fl.fence,
                failure(fl.state, why),
                max(fl.attempt_no, 1),
            )
        )
