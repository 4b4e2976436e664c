"""What the service's log says of committed outcomes: :class:`OutcomeLogMixin`.

Failed steps on the ``fleetwave.engine.outcomes`` logger (a strategy's first ones
one line each, the ones after counted and summed), and outcomes ignored as stale
(one warning per strategy and batch).
"""

from __future__ import annotations

import asyncio
import logging

from fleetwave.domain.models import plural
from fleetwave.engine.messages import ActionFinished
from fleetwave.engine.run import InFlight, StrategyRun
from fleetwave.store import runtime as rt

log = logging.getLogger("fleetwave.engine")

#: what became of steps and strategies (failed steps, how a strategy ended): its own
#: logger, which a command that reports them itself (the demo) quiets
outcomes = logging.getLogger("fleetwave.engine.outcomes")

#: a strategy's failed steps logged one line each; the ones after are counted, and said
#: in one line at most every FAILURES_SUMMED_EVERY_S seconds (and as it ends)
FAILURES_LOGGED_ALONE = 20
FAILURES_SUMMED_EVERY_S = 10.0


class OutcomeLogMixin:
    """What the log says of outcomes: a mixin of :class:`Conductor` (it sets what is
    declared here)."""

    # the conductor's, used here
    runs: dict[int, StrategyRun]
    _loop: asyncio.AbstractEventLoop
    _freed: dict[int, InFlight | None]
    _stale: list[ActionFinished]
    _failed_now: list[tuple[int, int, str | None, str]]
    _failures_logged: dict[int, int]
    _failures_unsaid: dict[int, tuple[int, float]]

    def _log_stale(self) -> None:
        """One warning per strategy for the batch's stale outcomes (each is an event)."""
        by_strategy: dict[int, list[ActionFinished]] = {}
        for msg in self._stale:
            by_strategy.setdefault(msg.strategy_id, []).append(msg)
        for sid, msgs in by_strategy.items():
            shown = ", ".join(f"{m.step_id} ({m.state})" for m in msgs[:5])
            more = f" and {len(msgs) - 5} more" if len(msgs) > 5 else ""
            one = len(msgs) == 1
            log.warning(
                "strategy %s: %d outcome%s ignored: %s had moved on (a late report, or the "
                "strategy taken over): step%s %s%s",
                sid,
                len(msgs),
                "" if one else "s",
                "its step" if one else "their steps",
                "" if one else "s",
                shown,
                more,
                extra={"strategy": sid},
            )

    def _log_failed(self, t: rt.Transition, fl: InFlight | None = None) -> None:
        """A step's failure, to be logged after the commit (:meth:`_log_failures`)."""
        run = self.runs.get(t.strategy_id)
        if fl is None and run is not None:
            fl = run.inflight.get(t.step_id)
        fl = fl or self._freed.get(t.step_id)
        name = fl.rec.target.name if fl is not None else None
        self._failed_now.append((t.strategy_id, t.step_id, name, t.details))

    def _log_failures(self) -> None:
        """The batch's failed steps in the service's log, as on their rows (at night the
        log is often what is looked at first): each of a strategy's first ones, then
        counted and summed by :meth:`_say_failures` (a fleet-wide failure logged step by
        step took longer to write than to decide)."""
        by_strategy: dict[int, list[tuple[int, int, str | None, str]]] = {}
        for failed in self._failed_now:
            by_strategy.setdefault(failed[0], []).append(failed)
        self._failed_now = []
        now = self._loop.time()
        for sid, failures in by_strategy.items():
            logged = self._failures_logged.get(sid, 0)
            alone = max(0, min(len(failures), FAILURES_LOGGED_ALONE - logged))
            for _sid, step_id, name, why in failures[:alone]:
                who = f" (target {name})" if name is not None else ""
                outcomes.warning(
                    "strategy %s: step %s%s failed: %s",
                    sid,
                    step_id,
                    who,
                    why,
                    extra={"strategy": sid, "step": step_id, "target": name},
                )
            self._failures_logged[sid] = logged + len(failures)
            if len(failures) > alone:
                unsaid, since = self._failures_unsaid.get(sid, (0, now))
                self._failures_unsaid[sid] = (unsaid + len(failures) - alone, since)
                if now - since >= FAILURES_SUMMED_EVERY_S:
                    self._say_failures(sid, now)

    def _say_failures(self, sid: int, now: float) -> None:
        """One line for the failures of a strategy not logged yet: at most one such line
        every :data:`FAILURES_SUMMED_EVERY_S` while it runs, and one as it ends."""
        count, _since = self._failures_unsaid.get(sid, (0, now))
        if count:
            outcomes.warning(
                "strategy %s: %s failed (%d in all): 'fleetwave step list --strategy %s "
                "--state failed' says why",
                sid,
                plural(count, "more step"),
                self._failures_logged.get(sid, 0),
                sid,
                extra={"strategy": sid},
            )
        self._failures_unsaid[sid] = (0, now)

    def _forget_failures(self, sid: int) -> None:
        """A strategy no longer driven here: its failure counts go."""
        self._failures_logged.pop(sid, None)
        self._failures_unsaid.pop(sid, None)
