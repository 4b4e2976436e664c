"""Steps whose row is not what the conductor believed: :class:`SettleMixin`.

A transition refused (or a retry's record refused, or a takeover that missed a step)
while the strategy is still held means someone else changed the step's row. The step
is read back and settled from its row (G4): applied again, counted as ended, waiting
again, taken over, or failed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fleetwave.domain.models import STEP_ABORTED, STEP_FAILED, STEP_INITIAL, STEP_TERMINAL
from fleetwave.engine.claims import put_in_flight
from fleetwave.engine.clock import Clock
from fleetwave.engine.messages import CallbackArrived, Message
from fleetwave.engine.run import InFlight, StrategyRun, Unsettled
from fleetwave.engine.stopping import not_started_reason
from fleetwave.engine.store_calls import StoreCalls
from fleetwave.store import callbacks as cbs
from fleetwave.store import runtime as rt

log = logging.getLogger("fleetwave.engine")


class SettleMixin(StoreCalls):
    """Settling refused transitions: a mixin of :class:`Conductor`, which sets what is
    declared here."""

    # the conductor's, used here (besides what StoreCalls declares)
    id: str
    clock: Clock
    runs: dict[int, StrategyRun]
    post: Callable[[Message], None]
    _first_sight: Callable[[cbs.CallbackRecord], bool]
    _wake_soon: Callable[[], None]
    _release: Callable[[InFlight], None]
    _drop_run: Callable[[int], None]
    _deadline_of: Callable[[StrategyRun, str, float], float | None]
    _sharing: bool
    if TYPE_CHECKING:  # (called with keywords, or without an argument that has a default)

        def _count_failure(
            self, run: StrategyRun, who: str | None = None, phase: int | None = None
        ) -> None: ...

        def _move(
            self,
            run: StrategyRun,
            step_id: int,
            from_state: str,
            from_fence: int,
            to_state: str,
            details: str,
            attempt: int,
            now: float,
            group_id: int | None,
            *,
            fence: int | None = None,
            from_visit: int = 1,
            visit: int = 1,
            visits: str | None = None,
        ) -> rt.Transition: ...

    def _read_back(
        self,
        run: StrategyRun,
        step_id: int,
        fl: InFlight | None,
        refused: rt.Transition | None,
        mark: rt.CallbackMark | None = None,
        *,
        answered: bool = False,
    ) -> None:
        """The step's row is not what this conductor believed: read it back (see
        :meth:`_settle`). ``fl``: its in-flight entry, just freed; the step keeps its slot,
        its group's and its stage until then."""
        if fl is not None:
            run.group_load[fl.rec.group_id] += 1
        run.unsettled[step_id] = Unsettled(
            refused,
            fl.rec.stage if fl is not None else None,
            fl.rec.group_id if fl is not None else None,
            held=fl is not None,
            mark=mark,
            answered=answered,
        )
        run.settle_due = True
        self._wake_soon()  # settle it without waiting for a message

    async def _settle(self, run: StrategyRun) -> None:
        """Steps whose transition was refused although this conductor still holds the
        strategy: someone else changed their row (a hand edit, a bug elsewhere). The row
        is the truth (G4):

        - still in the state the refused transition left (only its fence or owner
          changed): that transition is applied again, at a new fence (the outcome of
          the action is known: nothing runs twice);
        - ended: it counts as ended; waiting (never started): it waits again;
        - in another state: taken over (fence + 1) and its recover hook decides, as
          after a crash (one marked not started starts afresh, or ends if stopping);
        - cannot go on (a state its workflow lacks, or set back to initial after it
          started): it fails.

        Until then it holds its slot, its group's and its stage, and the strategy does
        not end; a row that keeps changing is read again once a tick.
        """
        run.settle_due = False
        ids = sorted(run.unsettled)
        now = self.clock.now()
        found, entered = await self._io(rt.load_steps, self.store, run.id, ids)
        rows = {r.step_id: r for r in found}
        events: list[rt.Event] = []
        marks: list[rt.CallbackMark] = []
        batch: list[rt.Transition] = []
        again: dict[int, rt.StepRecord] = {}  # step -> its row, for transitions applied again
        to_take: list[rt.StepRecord] = []

        def done(step_id: int) -> None:
            u = run.unsettled.pop(step_id, None)
            if u is not None and u.held:
                run.group_load[u.group_id] -= 1

        def settled(step_id: int, what: str) -> None:
            done(step_id)
            events.append(
                rt.Event("step-settled", f"transition refused; row {what}", run.id, step_id)
            )
            log.warning(
                "step %s of strategy %s: transition refused; row %s",
                step_id,
                run.id,
                what,
                extra={"strategy": run.id, "step": step_id},
            )

        def end(
            row: rt.StepRecord,
            to_state: str,
            why: str,
            what: str,
            *,
            fence: int | None = None,
            attempt: int | None = None,
            again: rt.Transition | None = None,
        ) -> None:
            attempt = row.attempt if attempt is None else attempt
            moved = self._move(
                run,
                row.step_id,
                row.state,
                row.fence,
                to_state,
                why,
                attempt,
                now,
                row.group_id,
                fence=fence,
                from_visit=row.visit,
                # a decision applied again enters the visit it decided
                visit=1 if again is None else again.visit,
                visits=None if again is None else again.visits,
            )
            # the row is the truth: written whoever owns it now (its fence is checked)
            moved.any_owner = True
            batch.append(moved)
            # Written with the transition (if that is refused too, the rejection's event
            # follows it, and the step is read again).
            events.append(
                rt.Event("step-settled", f"transition refused; row {what}", run.id, row.step_id)
            )

        for step_id in ids:
            row = rows.get(step_id)
            u = run.unsettled[step_id]
            refused = u.refused
            # A refused move to failed was counted when decided: it stands only if the row
            # confirms it (failed) or the failure is applied again; otherwise it is taken
            # back, and whatever is decided now counts.
            counted = refused is not None and refused.to_state == STEP_FAILED
            seen = entered.get(step_id, set())
            if row is None or step_id in run.inflight:
                done(step_id)  # deleted, or already back in flight
                continue
            if self._sharing and row.owner is not None and row.owner != self.id:
                # Conductors share the strategy: another took this step over (this one's
                # lease ran out) or claimed it. It is that one's now: let go of it.
                if counted and row.state != STEP_FAILED:
                    run.failed -= 1
                settled(step_id, f"held by conductor {row.owner} now: left to it")
                continue
            if (
                u.answered
                and refused is not None
                and row.state == refused.from_state != STEP_INITIAL
                and row.visit == refused.from_visit
            ):
                # Its callback was answered by another before this conductor's move was
                # written: that callback moves nothing (once at most). The step is taken
                # over where it is, its recover hook deciding (a wait waits again, offered
                # the callbacks still open).
                if counted:
                    run.failed -= 1
                to_take.append(row)
                continue
            if (
                refused is not None
                and row.state == refused.from_state != STEP_INITIAL
                and row.visit == refused.from_visit
                and (refused.to_state, refused.visit) not in seen
            ):
                # Where this conductor left it: apply the decision again, fencing off
                # whoever changed the row.
                again[step_id] = row
                to_state, why = refused.to_state, refused.details
                if run.stopping is not None and to_state not in STEP_TERMINAL:
                    to_state, why = STEP_ABORTED, f"stopped after {row.state}: {run.stop_details}"
                end(
                    row,
                    to_state,
                    why,
                    f"unchanged but for its fence; applied again: {to_state}",
                    fence=row.fence + 1,
                    attempt=refused.attempt,
                    again=refused if to_state == refused.to_state else None,
                )
                if u.mark is not None:
                    marks.append(u.mark)
                continue
            if counted and row.state != STEP_FAILED:
                run.failed -= 1
            if row.state in STEP_TERMINAL:
                if row.state == STEP_FAILED and not counted:
                    self._count_failure(run, row.target.name, row.stage)
                settled(step_id, f"ended elsewhere: {row.state}")
            elif row.state == STEP_INITIAL and not seen:
                run.requeue_front([row])
                settled(step_id, "waiting again")
            elif row.state == STEP_INITIAL:
                # Its states cannot be entered again (G1): it ends here.
                why = "set back to initial after it started"
                end(row, STEP_FAILED, why, f"{why}: failed")
            elif row.state not in run.workflow.state_names:
                why = f"{row.state}: not a state of workflow {run.workflow.name}"
                end(row, STEP_FAILED, why, f"{why}: failed")
            elif (
                refused is not None
                and row.state == refused.from_state
                and row.visit == refused.from_visit
            ):
                # Its decision's next state was entered already (the row was set back):
                # that state cannot be entered twice (G1; in that visit).
                why = f"{row.state}: set back after it had entered {refused.to_state}"
                end(row, STEP_FAILED, why, f"{why}: failed")
            elif row.not_started and run.stopping is not None:
                why = not_started_reason(run, row.state, row.attempt)
                end(row, STEP_ABORTED, why, f"{why}: aborted")
            else:
                if row.not_started and row.attempt <= 1:
                    row.deadline_at = self._deadline_of(run, row.state, now)
                to_take.append(row)
        taken = await self._io(
            rt.take_over_steps,
            self.store,
            to_take,
            self.id,
            self._NOW,
            held=(run.id, run.record.fence),
            afresh={r.step_id for r in to_take if r.not_started and r.attempt <= 1},
        )
        if taken is None:
            # Another conductor holds the strategy now: it settles these steps.
            self._drop_run(run.id)
            return
        for step in taken:
            settled(step.step_id, f"in {step.state}: taken over")
            self._back_in_flight(run, step, step.state, recovering=not step.not_started)
        if taken:
            # A callback whose move was refused is still open: offer it again.
            await self._reoffer_callbacks(run, {step.step_id for step in taken})
        if batch or events:
            result = await self._io(
                self._writer.commit,
                batch,
                events,
                self._NOW,
                marks,
                {run.id: run.record.fence},
            )
            refused_now = {id(t) for t in result.rejected}
            for step_id in result.answered:
                left = run.unsettled.get(step_id)
                if left is not None:  # (read again next tick: then taken over, as above)
                    left.answered, left.mark = True, None
            for t in batch:
                if id(t) in refused_now or run.id in result.lost:
                    continue
                self.stats.transitions += 1
                done(t.step_id)
                row = again.get(t.step_id)
                if t.to_state == STEP_FAILED and row is None:
                    self._count_failure(run)
                if row is not None and t.to_state not in STEP_TERMINAL:
                    row.fence, row.state, row.visit = t.fence, t.to_state, t.visit
                    if t.visits is not None:
                        row.visits = json.loads(t.visits)
                    self._back_in_flight(run, row, t.to_state, recovering=False)
            for sid in result.lost:
                self._drop_run(sid)
        if run.id not in self.runs:
            return
        # A row changed by someone else changed what the database counts in the
        # strategy's slots (G7) without a commit of ours: counted again from the steps.
        await self._io(rt.recount_slots, self.store, run.id, self.id, self._NOW)
        self._wake_soon()  # admit what waits again, into the slots settled steps held
        if run.unsettled and run.settle_timer is None:
            # Changed again in between: look again at the next tick, not in a tight loop.
            run.settle_timer = self._loop.call_later(self.config.tick_s, self._settle_later, run)

    async def _reoffer_callbacks(self, run: StrategyRun, step_ids: set[int]) -> None:
        for record in await self._io(cbs.open_callbacks, self.store, [run.id], 0):
            if record.step_id in step_ids:
                self._first_sight(record)
                self.post(CallbackArrived(record))

    def _back_in_flight(
        self, run: StrategyRun, step: rt.StepRecord, state: str, *, recovering: bool
    ) -> None:
        self._release(put_in_flight(run, step, state, recovering=recovering))

    def _settle_later(self, run: StrategyRun) -> None:
        run.settle_timer = None
        run.settle_due = True
        self._wake_soon()
