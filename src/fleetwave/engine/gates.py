"""Gates before a phase: a wait after a stage (``--stage-wait``), an operator's
approval (``--stage-approval``), a start time, windows and a deadline
(``--start-after``, ``--window``, ``--deadline``). The dispatcher's part of the
conductor (a mixin).

:meth:`StrategyRun.take_admissions` admits nothing from a phase of a gated strategy
until its gate was found open, and names the phase (``gate_due``). After each turn's
admissions the dispatcher looks at those gates here: it reads what they depend on
(when the earlier stages ended, the approvals recorded), asks the pure
:func:`~fleetwave.domain.rollout.phase_gate`, and then opens the phase, or says on the
strategy's row what it waits for and sets a timer to look again (when the wait is over;
for an approval, every tick, until ``strategy approve`` records it). An open gate that
closes (its window ends, the deadline comes) is looked at again then. Past the
deadline nothing more starts; once the steps in flight have ended, the strategy stops
(its waiting steps end aborted, and it ends failed).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fleetwave.domain.rollout import deadline_passed, phase_gate
from fleetwave.engine.run import StrategyRun
from fleetwave.store import runtime as rt

if TYPE_CHECKING:
    from fleetwave.engine.clock import Clock
    from fleetwave.engine.config import EngineConfig
    from fleetwave.store.db import Store

log = logging.getLogger("fleetwave.engine")

#: the shortest a gate's timer waits: a time named by one clock and reached on another
#: (a conductor whose clock runs slow, or ahead) is looked at again a little later, not
#: at once forever (found by the simulator: a loop of zero-length timers on its skewed
#: clocks)
MIN_DELAY_S = 0.05


class GatesMixin:
    if TYPE_CHECKING:
        store: Store
        id: str
        clock: Clock
        config: EngineConfig
        runs: dict[int, StrategyRun]
        _loop: asyncio.AbstractEventLoop
        _draining: bool
        _NOW: Any

        async def _io(self, fn: Any, *args: Any, **kwargs: Any) -> Any: ...
        def _wake_soon(self) -> None: ...

    async def _look_at_gates(self, now: float) -> None:
        """Open the phases whose gates allow it now; say what the others wait for."""
        for run in list(self.runs.values()):
            phase = run.gate_due
            if phase is None:
                continue
            run.gate_due = None
            if run.stopping is not None or run.paused or run.lapsed or self._draining:
                continue  # nothing starts anyway; looked at again once something would
            deadline = run.options.deadline
            if deadline is not None and now >= deadline:
                # Nothing more starts; once the steps in flight have gone on to their
                # end, the waiting ones end aborted and the strategy failed.
                self._cancel_gate_timer(run)
                if not run.inflight and not run.unsettled:
                    run.stopping, run.stop_details = "failure", deadline_passed(deadline)
                    log.warning(
                        "strategy %s: %s", run.id, run.stop_details, extra={"strategy": run.id}
                    )
                    self._wake_soon()
                continue
            ended_at, approved = await self._io(rt.gate_facts, self.store, run.id, phase)
            if run.id not in self.runs:
                continue  # dropped meanwhile (its lease lost)
            gate = phase_gate(
                run.options,
                phase,
                ended_at=ended_at,
                approved_through=approved,
                now=now,
                strategy_id=run.id,
            )
            if gate.open:
                run.gate_phase = phase
                self._cancel_gate_timer(run)
                if gate.closes is not None:
                    # its window ends (or the deadline comes): looked at again then
                    run.gate_timer = self._loop.call_later(
                        max(MIN_DELAY_S, gate.closes - now), self._gate_closed, run
                    )
                if run.record.details.startswith("waiting "):
                    # what it waited for is over: said no more
                    await self._io(
                        rt.set_strategy_details,
                        self.store,
                        run.id,
                        self.id,
                        run.record.fence,
                        "",
                        self._NOW,
                    )
                    run.record.details = ""
                self._wake_soon()
                continue
            if gate.why != run.record.details:
                if gate.approval is not None:
                    said = await self._io(
                        rt.hold_for_approval,
                        self.store,
                        run.id,
                        self.id,
                        run.record.fence,
                        gate.why,
                        self._NOW,
                    )
                    if said:
                        log.info("strategy %s: %s", run.id, gate.why, extra={"strategy": run.id})
                else:
                    await self._io(
                        rt.set_strategy_details,
                        self.store,
                        run.id,
                        self.id,
                        run.record.fence,
                        gate.why,
                        self._NOW,
                    )
                run.record.details = gate.why
            # look again when the wait is over; an approval, every tick
            delay = self.config.tick_s if gate.until is None else gate.until - now
            delay = max(MIN_DELAY_S, delay)
            self._cancel_gate_timer(run)
            run.gate_timer = self._loop.call_later(delay, self._gate_again, run, phase)

    def _gate_closed(self, run: StrategyRun) -> None:
        run.gate_timer = None
        if self.runs.get(run.id) is run:
            run.gate_phase = 0  # the next admission asks again
            self._wake_soon()

    def _gate_again(self, run: StrategyRun, phase: int) -> None:
        run.gate_timer = None
        if self.runs.get(run.id) is run:
            run.gate_due = phase
            self._wake_soon()

    @staticmethod
    def _cancel_gate_timer(run: StrategyRun) -> None:
        if run.gate_timer is not None:
            run.gate_timer.cancel()
            run.gate_timer = None
