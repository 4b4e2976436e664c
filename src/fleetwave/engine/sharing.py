"""Conductors sharing a strategy: :class:`SharingMixin`.

On PostgreSQL every conductor that serves all strategies drives every applying one
together with the others. One conductor leads a strategy (it holds the strategy's
lease, as ever): it alone decides for the strategy as a whole (a stop, its end, its
stages and gates). Any other live conductor may *help*: it claims waiting steps nobody
has claimed (``FOR UPDATE SKIP LOCKED``), starts them under the strategy's caps as the
database counts them (G7), and drives each to its end as their owner. A step is only
ever written by its owner, at its fence (G3); a helper's steps are held under its own
conductor lease, renewed with its heartbeat.

- A helper follows the strategy's row: paused, it starts nothing; aborted, it stops its
  steps as a leader does; past the failure threshold (the failed steps every conductor
  counts in the slots), it stops too. It helps only strategies without phases (stages,
  batches, canaries, gates, windows, deadline): their leader drives those alone.
- The leader takes over the steps of a helper whose lease ran out (their recover hook
  looks first), and hands back the waiting steps it had claimed; it ends the strategy
  only once no step is open anywhere.
- A helper whose strategy's leader is gone claims the strategy (its lease ran out) and
  leads it from then on, keeping the steps it drives (promotion).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fleetwave.catalog import resolve_workflow
from fleetwave.domain.errors import NotFound
from fleetwave.domain.registry import ActionNotFound, PluginError
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.engine.clock import Clock
from fleetwave.engine.messages import FailuresCounted, Message, PeersGone, StrategyJoined
from fleetwave.engine.run import InFlight, StrategyRun
from fleetwave.engine.store_calls import StoreCalls
from fleetwave.store import runtime as rt
from fleetwave.store.admin import options_from_json

log = logging.getLogger("fleetwave.engine")

#: a strategy led here whose own steps have all ended is looked at this often for steps
#: still open elsewhere (seconds: a timer wakes the dispatcher, see _look_again)
PEERS_LOOK_S = 0.1


class SharingMixin(StoreCalls):
    """Helping others' strategies, and leading one others help: a mixin of
    :class:`Conductor`, which sets what is declared here."""

    id: str
    clock: Clock
    runs: dict[int, StrategyRun]
    _sharing: bool
    _draining: bool
    _claiming: set[int]
    _not_here: set[int]
    _not_helping: set[int]
    #: other live conductors serving every strategy (as last counted)
    _serving_peers: int
    _loop: asyncio.AbstractEventLoop
    #: who asks, and the lease clock's reading, at each attempt of a store call
    _PEERS: Any
    post: Callable[[Message], None]
    _wake_soon: Callable[[], None]
    _page: Callable[[StrategyRun], int]
    _take_over: Callable[
        [StrategyRun, list[rt.StepRecord], tuple[int, int] | None, float],
        Coroutine[Any, Any, list[rt.StepRecord] | None],
    ]
    _hold_taken: Callable[
        [
            StrategyRun,
            list[rt.StepRecord],
            list[rt.StepRecord],
            list[rt.Event],
            list[rt.Transition],
            float,
        ],
        list[InFlight],
    ]

    def _peer_view(self) -> rt.PeerView:
        return rt.PeerView(self.id, self.clock.lease_clock, self.clock.lease_now())

    def _fair_share(self, run: StrategyRun) -> None:
        """This conductor's part of the strategy's max parallel: an equal part for each
        conductor serving (the leader takes no more, so the others find free slots)."""
        if run.options.shareable:
            n = 1 + self._serving_peers
            run.share_cap = max(1, -(-run.options.effective_parallel // n))

    async def _share_pass(self) -> None:
        """(The periodic pass, when sharing.) Failures counted by all; the steps of gone
        helpers taken over; strategies to help joined."""
        peers = await self._io_read(rt.serving_peers, self.store, self._PEERS)
        if peers != self._serving_peers:
            more = peers > self._serving_peers
            self._serving_peers = peers
            for run in self.runs.values():
                self._fair_share(run)
                if more:
                    await self._give_back_claims(run)
            self._wake_soon()  # (a larger part may start more now)
        counted = [sid for sid, run in self.runs.items() if run.limits_failures]
        if counted:
            failed = await self._io_read(rt.failed_counts, self.store, counted)
            for sid, n in failed.items():
                counting = self.runs.get(sid)
                if counting is not None and n > counting.failed and counting.stopping is None:
                    self.post(FailuresCounted(sid, n))
        for sid, run in list(self.runs.items()):
            if run.shared:
                continue
            # (looked for first by a read: the takeover's write, rarely needed, is made on
            # the loop, and checks again what it takes)
            gone: list[rt.StepRecord] = []
            if await self._io_read(rt.gone_holders, self.store, sid, self._PEERS) and (
                sid in self.runs
            ):
                gone = await self._io(rt.take_from_gone_peers, self.store, sid, self._PEERS)
            if gone:
                self.post(PeersGone(sid, gone))
        # Steps it holds of strategies it no longer drives (lost while it led one): let
        # go of, for their leader to take over (nobody else would: it is alive).
        held = await self._io_read(rt.strategies_held, self.store, self.id)
        driving = set(self.runs) | self._claiming
        let_go = 0
        if held - driving:
            let_go = await self._io(rt.let_go_of_undriven, self.store, self.id, driving)
        if let_go:
            log.warning(
                "let go of %d steps of strategies this conductor no longer drives: their "
                "leaders take them over",
                let_go,
            )
        if self._draining:
            return
        skip = set(self.runs) | self._claiming | self._not_here | self._not_helping
        for rec in await self._io_read(rt.strategies_to_help, self.store, self._PEERS, skip):
            self.post(StrategyJoined(rec))

    async def _give_back_claims(self, run: StrategyRun) -> None:
        """More conductors share the strategy now: the waiting steps this one claimed
        past what its smaller part can start soon are handed back, for them to claim."""
        if run.stopping is not None or not run.options.shareable:
            return
        keep = self._page(run)
        if run.pending_count() <= keep:
            return
        recs = sorted(run.drain_pending(), key=lambda r: r.ordinal)
        for rec in recs[:keep]:
            run.add_pending(rec)
        back = [r.step_id for r in recs[keep:]]
        await self._io(rt.release_waiting_steps, self.store, self.id, back)
        run.more_waiting = True

    def _join(self, rec: rt.StrategyRecord) -> None:
        """Help drive a strategy another conductor leads (its waiting steps are claimed
        as slots free up)."""
        if rec.id in self.runs or rec.id in self._claiming or self._draining:
            return
        try:
            if rec.broken is not None:
                raise rt.UnreadableRow(rec.broken)
            if rec.workflow_yaml is not None:
                wf = parse_workflow_yaml(
                    rec.workflow_yaml, source=f"workflow {rec.workflow} as of strategy {rec.id}"
                )
            else:
                wf = resolve_workflow(self.store, rec.workflow, what="workflow")
            if rec.states and list(wf.state_names) != rec.states:
                raise ValueError("its workflow changed since it was created")
            opts = options_from_json(rec.options)
        except (NotFound, ActionNotFound, PluginError, ValueError) as exc:
            # Not drivable here (its leader says what is wrong, if anything is).
            self._not_helping.add(rec.id)
            log.info("strategy %s: not helping its leader here: %s", rec.id, exc)
            return
        if not opts.shareable:
            self._not_helping.add(rec.id)  # (its leader drives it alone)
            return
        rec.fence = rt.SHARED
        run = StrategyRun(
            rec,
            wf.with_timeouts(opts.timeouts_s),
            opts,
            db_state=rec.state,
            lease_from=self._loop.time(),
        )
        run.shared = True
        run.more_waiting = True
        self._fair_share(run)
        self.runs[rec.id] = run
        log.info(
            "strategy %s: driving some of its steps beside its leader, conductor %s",
            rec.id,
            rec.owner,
        )
        self._wake_soon()

    async def _take_over_peers(
        self,
        msg: PeersGone,
        events: list[rt.Event],
        batch: list[rt.Transition],
        now: float,
    ) -> list[InFlight]:
        """The steps of conductors gone while they drove steps of a strategy led here."""
        run = self.runs.get(msg.strategy_id)
        if run is None or run.shared:
            return []
        lost = [s for s in msg.steps if s.step_id not in run.inflight]
        taken = await self._take_over(run, lost, (run.id, run.record.fence), now)
        if taken is None or run.id not in self.runs:
            return []  # (lost meanwhile: the periodic pass says so)
        owners = sorted({s.owner or "?" for s in lost})
        log.warning(
            "strategy %s: taking over %d steps of conductor(s) %s (their lease ran out)",
            run.id,
            len(lost),
            ", ".join(owners),
        )
        return self._hold_taken(run, lost, taken, events, batch, now)

    async def _promote(
        self,
        run: StrategyRun,
        rec: rt.StrategyRecord,
        events: list[rt.Event],
        batch: list[rt.Transition],
        now: float,
    ) -> list[InFlight]:
        """This conductor claimed a strategy it helped (its leader's lease ran out): it
        leads it from now on, with the steps it drives; the gone leader's are taken over."""
        run.record = rec
        run.shared = False
        run.db_state = rec.state
        run.more_waiting = True
        run.lease_from = self._loop.time()
        lost, failed = await self._io(rt.load_started_steps, self.store, rec.id, self._PEERS)
        run.failed = max(run.failed, failed)
        lost = [s for s in lost if s.step_id not in run.inflight and s.owner != self.id]
        taken = await self._take_over(run, lost, (rec.id, rec.fence), now)
        log.warning(
            "strategy %s: leading it now (its leader's lease ran out); taking over %d of its steps",
            rec.id,
            len(lost),
        )
        if taken is None:
            return []
        return self._hold_taken(run, lost, taken, events, batch, now)

    def _look_again(self, run: StrategyRun) -> None:
        """While steps of a strategy led here are open elsewhere only: the dispatcher is
        woken every :data:`PEERS_LOOK_S` to look again, so the strategy ends within that
        of its last step, not at a periodic pass."""

        if run.looking_again:
            return  # (one timer a run)
        run.looking_again = True

        def again() -> None:
            if run.peers_open and self.runs.get(run.id) is run:
                self._wake_soon()
                self._loop.call_later(PEERS_LOOK_S, again)
            else:
                run.looking_again = False

        self._loop.call_later(PEERS_LOOK_S, again)

    async def _open_elsewhere(self, run: StrategyRun) -> bool:
        """(A strategy led here, its own steps all ended.) Whether steps are still open
        elsewhere: held by helpers, or waiting unclaimed (handed back): then it does not
        end yet. Its failed count becomes every conductor's."""
        now = self._loop.time()
        if run.peers_open and now - run.peers_looked_at < PEERS_LOOK_S:
            return True
        run.peers_looked_at = now
        held, unclaimed = await self._io(rt.open_elsewhere, self.store, run.id, self.id)
        if held or unclaimed:
            run.peers_open = True
            # Looked at again this often until they have ended (nothing else may wake
            # this dispatcher: its own steps have all ended)
            self._look_again(run)
            if unclaimed and not run.more_waiting:
                run.more_waiting = True
                self._wake_soon()
            return True
        run.peers_open = False
        failed = await self._io(rt.failed_counts, self.store, [run.id])
        run.failed = max(run.failed, failed.get(run.id, 0))
        return False
