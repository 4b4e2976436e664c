"""Action deadlines: :class:`DeadlinesMixin`.

One heap and one loop timer for all running attempts: an attempt still running past
its state's deadline is cancelled, and one that does not stop when cancelled is
abandoned after a grace period (its step fails).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable

from fleetwave.domain.rules import failure
from fleetwave.engine.config import EngineConfig
from fleetwave.engine.messages import ActionFinished, Message
from fleetwave.engine.run import InFlight, StrategyRun

log = logging.getLogger("fleetwave.engine")


class DeadlinesMixin:
    """Action deadlines: a mixin of :class:`Conductor`, which sets what is declared here."""

    # the conductor's, used here
    config: EngineConfig
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
            _, attempt, fl = heapq.heappop(heap)
            if attempt < 0:  # the grace after a cancel
                if fl.running == -attempt and fl.timed_out == -attempt:
                    self._abandon(fl)
            elif fl.running == attempt and fl.task is not None and not fl.task.done():
                fl.timed_out = attempt
                fl.task.cancel()
                # from now, not from the deadline: a loop that was blocked past both
                # must not abandon an action it has not yet given a chance to stop
                grace = self._loop.time() + self.config.abandon_after_s
                heapq.heappush(heap, (grace, -attempt, fl))
        if heap:
            self._deadline_at = heap[0][0]
            self._deadline_timer = self._loop.call_at(heap[0][0], self._expire)

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
