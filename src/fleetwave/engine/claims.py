"""Claiming strategies and taking them over: :class:`ClaimsMixin`.

A claim takes strategies nobody drives (or whose owner's lease ran out); adopting one
rebuilds its run from the database alone (G4): steps in flight are taken over at a
new fence (their recover hook looks first), waiting ones are loaded. A strategy this
process cannot drive is handed back (:data:`NOT_DRIVABLE_HERE`) or ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fleetwave.catalog import resolve_workflow
from fleetwave.domain.errors import NotFound
from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_FAILED,
    STEP_INITIAL,
    UNDRIVABLE,
    StrategyState,
    plural,
    unmanaged_reason,
)
from fleetwave.domain.registry import ActionNotFound, PluginError
from fleetwave.domain.rules import details_text
from fleetwave.domain.workflow import WorkflowError
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.engine.clock import Clock
from fleetwave.engine.messages import Message, StrategyClaimed
from fleetwave.engine.run import InFlight, StrategyRun, Unsettled
from fleetwave.engine.stopping import not_started_reason, stage_stop_on_takeover, stop_reason
from fleetwave.engine.store_calls import StoreCalls
from fleetwave.store import runtime as rt
from fleetwave.store.admin import options_from_json

log = logging.getLogger("fleetwave.engine")

#: what :meth:`Conductor.run` says of a strategy whose workflow this process lacks
NOT_DRIVABLE_HERE = "not-drivable-here"


class ClaimsMixin(StoreCalls):
    """Claims and adoptions: a mixin of :class:`Conductor`, which sets what is declared here."""

    # the conductor's, used here (besides what StoreCalls declares)
    id: str
    clock: Clock
    renewed_at: float | None
    runs: dict[int, StrategyRun]
    finished: dict[int, str]
    _wanted: set[int] | None
    _patient: bool
    _wake: asyncio.Event | None
    _claiming: set[int]
    _claimed_at: dict[int, float]
    _not_here: set[int]
    _lapsed_ids: set[int]
    post: Callable[[Message], None]
    _freeze: Callable[[], None]
    _prefetch_page: Callable[[], int]
    _deadline_of: Callable[[StrategyRun, str, float], float | None]
    _move: Callable[[StrategyRun, int, str, int, str, str, int, float, int | None], rt.Transition]
    _sharing: bool
    _serving_peers: int
    _PEERS: Any
    _fair_share: Callable[[StrategyRun], None]
    _promote: Callable[
        [StrategyRun, rt.StrategyRecord, list[rt.Event], list[rt.Transition], float],
        Awaitable[list[InFlight]],
    ]
    if TYPE_CHECKING:  # (called with keywords, or without an argument that has a default)

        async def _load_waiting(
            self, run: StrategyRun, *, everything: bool, page: int | None = None
        ) -> None: ...

        def _count_failure(
            self, run: StrategyRun, who: str | None = None, phase: int | None = None
        ) -> None: ...

    async def _claim(self, *, register: bool = False) -> None:
        todo: set[int] | None = None
        if self._wanted is not None:
            todo = self._wanted - set(self.runs) - set(self.finished)
            if not todo:
                if register:
                    await self._io(
                        rt.register_conductor,
                        self.store,
                        self.id,
                        self._NOW,
                        self._LEASE,  # (positional: worked out at each attempt)
                        serves_all=False,
                        lease_clock=self.clock.lease_clock,
                    )
                return
        claimed = await self._io(
            rt.claim_strategies,
            self.store,
            self.id,
            self._NOW,
            self._LEASE,
            todo,
            self._LEASE_NOW,
            register=register,
            lease_clock=self.clock.lease_clock,
            driving=set(self.runs) | self._claiming,
            serves_all=self._wanted is None,
            skip=self._not_here,
        )
        started = self._attempt_at  # its lease runs from the attempt that went through
        if claimed:
            self.renewed_at = started
        for rec in claimed:
            self._claiming.add(rec.id)
            self._claimed_at[rec.id] = started
            self.post(StrategyClaimed(rec))
            if rec.taken_from is not None:
                self.stats.takeovers += 1
        if self._lapsed_ids:
            await self._say_what_became_of_lapsed({rec.id for rec in claimed})
        if todo is None:
            return
        for sid in todo - {rec.id for rec in claimed}:
            # Not claimable: terminal, never applied, or held by another live conductor.
            state, owner = await self._io(rt.strategy_state, self.store, sid)
            if state not in rt.DRIVEN_STATES:
                self.finished[sid] = state
            elif owner is not None and owner != self.id and not self._patient:
                self.finished[sid] = "owned"
                log.info("strategy %s: driven by conductor %s; not taking it over", sid, owner)
        if self._wake is not None:
            self._wake.set()  # the dispatcher decides whether anything is left to wait for

    async def _say_what_became_of_lapsed(self, claimed: set[int]) -> None:
        """Once the database answers again after this conductor's lease lapsed: say, once
        per strategy, whether it drives it again or another conductor took it over (the
        lapse said only "until its lease is renewed")."""
        for sid in sorted(self._lapsed_ids & claimed):
            self._lapsed_ids.discard(sid)
            log.warning(
                "strategy %s: claimed back after the lapse; driving it again (the recover "
                "hooks look at what was stopped)",
                sid,
            )
        left = sorted(self._lapsed_ids - set(self.runs) - self._claiming)
        if not left:
            return
        states = await self._io(rt.strategy_states, self.store, left)
        for sid in left:
            state, owner = states.get(sid, (None, None))
            if state is None:
                log.warning("strategy %s: deleted while this conductor's lease lapsed", sid)
            elif state not in rt.DRIVEN_STATES:
                log.warning(
                    "strategy %s: %s meanwhile, under %s: taken over while this conductor's "
                    "lease lapsed; nothing more to do here",
                    sid,
                    state,
                    f"conductor {owner}" if owner else "another conductor",
                )
            elif owner is not None and owner != self.id:
                log.warning(
                    "strategy %s: taken over by conductor %s while this conductor's lease "
                    "lapsed; it drives it now, not this one",
                    sid,
                    owner,
                )
            else:
                continue  # still this conductor's, or free: claimed back on a later pass
            self._lapsed_ids.discard(sid)

    async def _adopt(
        self,
        rec: rt.StrategyRecord,
        events: list[rt.Event],
        batch: list[rt.Transition],
        now: float,
    ) -> list[InFlight]:
        """Take over a claimed strategy from the database alone (G4, recovery)."""
        if self.config.adopt_stall_s:
            await asyncio.sleep(self.config.adopt_stall_s)  # (fault injection)
        helping = self.runs.get(rec.id)
        if helping is not None and helping.shared:
            self._claimed_at.pop(rec.id, None)
            return await self._promote(helping, rec, events, batch, now)
        lease_from = self._claimed_at.pop(rec.id, self._loop.time())
        try:
            if rec.broken is not None:
                raise rt.UnreadableRow(rec.broken)
            try:
                if rec.workflow_yaml is not None:
                    # The copy taken at creation: a later edit of the stored workflow (or
                    # its deletion) does not change this strategy.
                    wf = parse_workflow_yaml(
                        rec.workflow_yaml,
                        source=f"workflow {rec.workflow} as of strategy {rec.id}",
                    )
                else:
                    wf = resolve_workflow(self.store, rec.workflow, what="workflow")
            except (NotFound, ActionNotFound, PluginError) as exc:
                # This process lacks it, or a YAML state's action (a plug-in not imported
                # here): another conductor may have it. The strategy is not at fault.
                await self._cannot_drive_here(rec, details_text(exc))
                return []
            if rec.states and list(wf.state_names) != rec.states:
                raise WorkflowError(
                    f"workflow {rec.workflow} changed since the strategy was created: "
                    f"its states were {rec.states}, now {list(wf.state_names)}"
                )
            opts = options_from_json(rec.options)
            wf = wf.with_timeouts(opts.timeouts_s)
        except Exception as exc:  # one broken strategy must not take the conductor down
            await self._fail_undrivable(rec, f"{UNDRIVABLE}: {exc}")
            return []
        run = StrategyRun(rec, wf, opts, db_state=rec.state, lease_from=lease_from)
        if self._sharing:
            self._fair_share(run)
        if rec.state == StrategyState.PAUSED:
            run.paused = True
            events.append(rt.Event("pause-seen", "paused by operator (on takeover)", rec.id))
        # (sharing: not the steps other live conductors drive: they go on with them)
        peers = self._PEERS if self._sharing else None
        lost, run.failed = await self._io(rt.load_started_steps, self.store, rec.id, peers)
        # A staged strategy is loaded whole: which stage comes next is then decided on
        # every waiting step, not on the assumption that pages come in stage order.
        first = self.config.waiting_page or max(
            run.cap, 32 if self._sharing and self._serving_peers else self._prefetch_page()
        )
        await self._load_waiting(run, everything=opts.staged, page=first)
        limit = opts.failure_limit
        if limit is not None and run.failed > limit:
            run.stopping = "failure"
            # as the conductor that saw it said it: the failure that went past the limit
            who = await self._io(rt.failure_past_limit, self.store, rec.id, limit)
            run.stop_details = stop_reason(run.options, limit + 1, who)
        if run.failed and run.stopping is None and run.limits_failures and opts.plan:
            by_phase = await self._io(rt.failed_by_stage, self.store, rec.id)
            stage_stop = stage_stop_on_takeover(run, by_phase)
            if stage_stop is not None:
                run.stopping, run.stop_details = "failure", stage_stop
        if rec.state in (StrategyState.ABORT_REQUESTED, StrategyState.ABORTING):
            # The operator's abort wins over the failure threshold, as it does when the
            # abort reaches a running conductor (found by the simulator's abort fault).
            run.stopping = "abort"
            run.stop_details = "aborted by operator"
            events.append(rt.Event("abort-seen", "operator abort requested (on takeover)", rec.id))
        taken = await self._take_over(run, lost, (rec.id, rec.fence), now)
        if taken is None:
            # Another conductor claimed it after this one did (this process stalled
            # between its claim and here for longer than the lease): its steps are that
            # conductor's. Nothing is taken over, no recover hook runs here.
            self._fenced_off_before_adopting(rec)
            return []
        out = self._hold_taken(run, lost, taken, events, batch, now)
        if rec.id in self.runs:  # (cannot be: claimed only while neither run nor claiming)
            raise AssertionError(f"strategy {rec.id} adopted twice by conductor {self.id}")
        self.runs[rec.id] = run
        self._freeze()
        if run.stopping is None and rec.state == StrategyState.APPLYING and not lost:
            log.info("strategy %s: driving its waiting steps", rec.id)
        return out

    async def _take_over(
        self,
        run: StrategyRun,
        lost: list[rt.StepRecord],
        held: tuple[int, int] | None,
        now: float,
    ) -> list[rt.StepRecord] | None:
        """Fence ``lost`` off to this conductor while it holds ``held`` (strategy, fence):
        those never started start afresh (:meth:`_afresh`). None: not held any more."""
        return await self._io(
            rt.take_over_steps,
            self.store,
            lost,
            self.id,
            self._NOW,
            held=held,
            afresh=self._afresh(run, lost, now),
        )

    def _afresh(self, run: StrategyRun, lost: list[rt.StepRecord], now: float) -> set[int]:
        """Of steps to take over, those entered and never started, which start afresh
        (their first attempt is recorded as they are taken over) unless they end at once;
        their time starts now."""
        for step in lost:
            if step.not_started and step.attempt <= 1:
                # It starts afresh here: its time starts now. (A recorded retry keeps
                # its deadline: its due time and timeout.)
                step.deadline_at = self._deadline_of(run, step.state, now)
        first = run.workflow.first_state
        return {
            s.step_id
            for s in lost
            if s.not_started
            and s.attempt <= 1
            and run.stopping is None
            and (s.target.managed or s.state != first)
        }

    def _hold_taken(
        self,
        run: StrategyRun,
        lost: list[rt.StepRecord],
        taken: list[rt.StepRecord],
        events: list[rt.Event],
        batch: list[rt.Transition],
        now: float,
    ) -> list[InFlight]:
        """Steps just taken over (``taken``, of those asked for: ``lost``) into the run:
        ended at once if they cannot go on, else in flight (their recover hook looks
        first, unless their action never started); returns those in flight."""
        if len(taken) != len(lost):
            events.append(
                rt.Event("takeover-incomplete", f"{len(lost) - len(taken)} steps moved on", run.id)
            )
            # Moved between the read and the takeover: read back, settled like a refusal.
            got = {s.step_id for s in taken}
            for step in lost:
                if step.step_id not in got:
                    run.unsettled[step.step_id] = Unsettled(
                        None, step.stage, step.group_id, held=True
                    )
                    run.group_load[step.group_id] += 1
            run.settle_due = True
        out: list[InFlight] = []

        def end(step: rt.StepRecord, to_state: str, details: str) -> None:
            moved = self._move(
                run,
                step.step_id,
                step.state,
                step.fence,
                to_state,
                details,
                step.attempt,
                now,
                step.group_id,
            )
            moved.from_visit = step.visit  # (the visit of its state it is in)
            batch.append(moved)

        # First the entered-but-unstarted steps whose target is unmanaged now: they fail,
        # as at an admission, and that may stop the strategy before any other starts.
        # Only in their first state: a step that ran a state on the target has started,
        # and goes on (an unmanage does not interrupt it, with or without a takeover).
        failed_now: set[int] = set()
        first_state = run.workflow.first_state
        for step in taken:
            if (
                step.not_started
                and step.attempt <= 1
                and step.state == first_state
                and not step.target.managed
                and run.stopping is None
            ):
                end(step, STEP_FAILED, unmanaged_reason(step.target.name))
                self._count_failure(run, step.target.name, step.stage)
                failed_now.add(step.step_id)
        for step in taken:
            if step.step_id in failed_now:
                continue
            if step.not_started and run.stopping is not None:
                # Nothing of this state (or of this attempt of it) ran, and nothing new
                # may start: end it here.
                end(step, STEP_ABORTED, not_started_reason(run, step.state, step.attempt))
                continue
            # A clean stop records the states it entered but never started: those start
            # afresh; any other may have started, so its recover hook looks first.
            fl = put_in_flight(run, step, step.state, recovering=not step.not_started)
            out.append(fl)
            log.debug(
                "step %s (%s): taken over in %s; %s",
                step.step_id,
                step.target.name,
                step.state,
                "calling its recover hook" if fl.recovering else "its action never started",
            )
        if out:
            recovering = sum(1 for fl in out if fl.recovering)
            log.log(
                # routine after a clean stop (nothing was running): not worth a warning
                logging.WARNING if recovering else logging.INFO,
                "strategy %s: took over %s in flight (%d call their recover hook, "
                "%d start afresh: their action never started)",
                run.id,
                plural(len(out), "step"),
                recovering,
                len(out) - recovering,
            )
        return out

    def _fenced_off_before_adopting(self, rec: rt.StrategyRecord) -> None:
        log.warning(
            "adopt-fenced-off: strategy %s: claimed at fence %d, but another conductor "
            "claimed it before this one could take its steps over (this process stalled "
            "for longer than the lease): left to that conductor",
            rec.id,
            rec.fence,
        )
        self.finished[rec.id] = "lost"
        if self._wake is not None:
            self._wake.set()

    async def _cannot_drive_here(self, rec: rt.StrategyRecord, reason: str) -> None:
        """Hand a claimed strategy back untouched, and claim it no more: its Python
        workflow is not registered in this process (``FLEETWAVE_PLUGINS``). One whose
        abort was requested is ended here instead (as aborted): the operator asked for
        its end, and no conductor may ever have its workflow again."""
        if rec.state in (StrategyState.ABORT_REQUESTED, StrategyState.ABORTING):
            await self._fail_undrivable(
                rec, f"aborted by operator; {UNDRIVABLE} here: {reason}", StrategyState.ABORTED
            )
            return
        self._not_here.add(rec.id)
        await self._io(rt.release_strategy, self.store, rec.id, self.id, rec.fence)
        log.error(
            "strategy %s: not driven by this conductor: %s; left %s for a conductor that has "
            "its workflow (FLEETWAVE_PLUGINS names the modules that register Python workflows)",
            rec.id,
            reason,
            rec.state,
        )
        if self._wanted is not None and rec.id in self._wanted:
            self.finished[rec.id] = NOT_DRIVABLE_HERE

    async def _fail_undrivable(
        self, rec: rt.StrategyRecord, reason: str, final: StrategyState = StrategyState.FAILED
    ) -> None:
        """End a strategy this conductor cannot drive (its workflow is gone or invalid):
        waiting steps aborted, steps in a state failed (nothing here can observe them)."""
        log.error("strategy %s: %s", rec.id, reason)
        open_steps, _ = await self._io(rt.load_open_steps, self.store, rec.id)
        batch = [
            rt.Transition(
                step_id=st.step_id,
                strategy_id=rec.id,
                from_state=st.state,
                from_fence=st.fence,
                to_state=STEP_ABORTED if st.state == STEP_INITIAL else STEP_FAILED,
                fence=st.fence,
                details=f"not started: {reason}"
                if st.state == STEP_INITIAL
                else f"{st.state}: {reason}",
                attempt=st.attempt,
                # nobody can drive them: ended whoever held them (at their fence)
                any_owner=True,
                group_id=st.group_id,
                from_visit=st.visit,
            )
            for st in open_steps
        ]
        events = [rt.Event("strategy-undrivable", reason, rec.id)]
        await self._io(self._writer.commit, batch, events, self._NOW, [], {rec.id: rec.fence})
        ok = await self._io(
            rt.end_strategy, self.store, rec.id, self.id, rec.fence, final.value, reason, self._NOW
        )
        self.finished[rec.id] = final.value if ok else "lost"


def put_in_flight(
    run: StrategyRun, step: rt.StepRecord, state: str, *, recovering: bool
) -> InFlight:
    """A step taken over (a claim, or settling a refused transition) holds a slot again;
    once the strategy stops, it starts no new attempt."""
    fl = InFlight(step, state, step.fence, recovering=recovering)
    fl.stopped = run.stopping is not None
    fl.aborted = run.stopping == "abort"
    if not recovering and step.not_started and step.attempt > 1:
        # a retry recorded and never started: due at its recorded deadline less the
        # state's timeout (each attempt has the whole timeout)
        due = (step.deadline_at or 0.0) - run.workflow.state(state).timeout_s
        fl.retry_due = due
    run.inflight[step.step_id] = fl
    run.group_load[step.group_id] += 1
    return fl
