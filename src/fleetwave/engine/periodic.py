"""The conductor's periodic pass and its lease watchdog: :class:`PeriodicMixin`.

The periodic pass (a task beside the dispatcher, once a tick) renews leases, checks
that the database file is still the one opened, notices an operator's abort, pause
or resume and lost strategies, picks up callbacks other processes stored, and claims
strategies; it never starts an action. The watchdog (a loop timer of its own) stops
acting on a strategy whose lease renewals have failed for most of its length.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fleetwave.domain.models import StrategyState
from fleetwave.engine.errors import StoreReplaced, StoreUnavailable
from fleetwave.engine.loop import wait_set
from fleetwave.engine.messages import (
    CallbackArrived,
    LeaseLost,
    Message,
    PauseChanged,
    StopRequested,
)
from fleetwave.engine.run import StrategyRun
from fleetwave.engine.store_calls import StoreCalls
from fleetwave.store import callbacks as cbs
from fleetwave.store import runtime as rt

log = logging.getLogger("fleetwave.engine")

#: a conductor renews its leases at least this often, however long they last
RENEW_MAX_S = 10.0
#: conductors sharing strategies look this often (seconds) for strategies to help, the
#: steps of peers gone and the failures all of them counted: a peer's steps are taken
#: over within this of its lease running out, a new conductor joins within it
SHARE_EVERY_S = 0.5
#: a periodic pass this late means the loop was blocked: said in a warning
STALL_WARN_S = 2.0


class PeriodicMixin(StoreCalls):
    """The periodic pass and the lease watchdog: a mixin of :class:`Conductor`, which sets
    what is declared here."""

    # the conductor's, used here (besides what StoreCalls declares)
    id: str
    runs: dict[int, StrategyRun]
    finished: dict[int, str]
    _wanted: set[int] | None
    _draining: bool
    renewed_at: float | None
    _fatal: BaseException | None
    _wake: asyncio.Event | None
    _nudge: asyncio.Event
    #: set when another conductor claimed a strategy (it may want help)
    _help_soon: asyncio.Event
    _listening: bool
    _lease_watch: asyncio.TimerHandle | None
    _db_identity: tuple[int, int] | None
    post: Callable[[Message], None]
    _first_sight: Callable[[cbs.CallbackRecord], bool]
    _refreeze_if_collected: Callable[[], None]
    _claim: Callable[[], Awaitable[None]]
    _sync_lease_clock: Callable[[], Awaitable[None]]
    _sharing: bool
    _share_pass: Callable[[], Awaitable[None]]

    async def _periodic(self) -> None:
        # A third of the lease, and at least every RENEW_MAX_S: "serving" is read as
        # renewed within SERVING_WITHIN_S, whatever the lease's length.
        renew_every = min(self.config.lease_ttl_s / 3, RENEW_MAX_S)
        loop = asyncio.get_running_loop()
        last_renew = loop.time()
        last_share = -SHARE_EVERY_S
        while True:
            slept_at = loop.time()
            # A tick, or sooner: another process's commit gave this one something to do
            # (a strategy applied or handed back, a callback stored: LISTEN/NOTIFY)
            if self._listening:
                nudge = self._nudge
                await wait_set(nudge, self.config.tick_s)
                nudge.clear()
            else:
                await asyncio.sleep(self.config.tick_s)  # (SQLite: nothing wakes it)
            blocked = loop.time() - slept_at - self.config.tick_s
            if blocked >= STALL_WARN_S:
                # Nothing else runs meanwhile, lease renewals included: said with its
                # length, so that a lapse that follows is not taken for a lost conductor.
                log.warning(
                    "the event loop was blocked for %.1fs: something in this process did "
                    "not await (an action calling time.sleep or blocking I/O, or a database "
                    "write waiting on a lock); leases are renewed from this loop and lapse "
                    "after %gs without a renewal",
                    blocked,
                    self.config.lease_ttl_s,
                )
            self._refreeze_if_collected()
            try:
                # (no file to watch when it began: nothing to compare)
                now_file = self.store.file_identity() if self._db_identity else None
            except OSError:
                now_file = self._db_identity  # cannot tell this tick: look again next
            if now_file != self._db_identity:
                raise StoreReplaced(
                    f"the database file {self.store.url} was removed or replaced while this "
                    "conductor had it open (its writes would go to the old file): stopped",
                    "move the old file's -wal and -shm files aside (SQLite would replay them "
                    "into the new one), then start it again on the database now at that path",
                )
            now_loop = asyncio.get_running_loop().time()
            if self.config.renew_leases and now_loop - last_renew >= renew_every:
                await self._sync_lease_clock()
                renewing = list(self.runs.values())
                # The lease written runs from now (it is computed once, here), however
                # long the write then takes: the watchdog measures from here too.
                await self._io(
                    rt.heartbeat,
                    self.store,
                    self.id,
                    self._NOW,
                    self._LEASE,
                )
                # The lease written runs from the attempt that went through.
                last_renew = self.renewed_at = self._attempt_at
                for run in renewing:
                    run.lease_from = max(run.lease_from, last_renew)
            states = await self._io_read(rt.strategy_states, self.store, list(self.runs))
            for sid, (state, owner) in states.items():
                held = self.runs.get(sid)  # dropped while this read was retried: skip it
                if held is None:
                    continue
                if held.shared:
                    # (a strategy another leads, this one helps drive: it follows its row)
                    if owner == self.id:
                        continue  # claimed by this one meanwhile: it leads it now
                    if state in (StrategyState.ABORT_REQUESTED, StrategyState.ABORTING):
                        if held.stopping != "abort":
                            self.post(StopRequested(sid))
                    elif state == StrategyState.PAUSED and not held.paused:
                        self.post(PauseChanged(sid, True))
                    elif state == StrategyState.APPLYING and held.paused:
                        self.post(PauseChanged(sid, False))
                    elif state not in rt.SHARED_STATES:
                        self.post(LeaseLost(sid))  # ended or deleted
                    continue
                if owner != self.id:
                    self.post(LeaseLost(sid))
                elif state == StrategyState.ABORT_REQUESTED:
                    self.post(StopRequested(sid))
                elif state == StrategyState.PAUSED and not held.paused:
                    self.post(PauseChanged(sid, True))
                elif state == StrategyState.APPLYING and held.paused:
                    self.post(PauseChanged(sid, False))  # resumed (not: aborting)
            waiting = [sid for sid, run in self.runs.items() if run.waits_for_callbacks]
            if waiting:
                await self._poll_callbacks(waiting)
            if self._sharing and (
                now_loop - last_share >= SHARE_EVERY_S or self._help_soon.is_set()
            ):
                # (its reads and the takeover's write, at most this often: a pass runs
                # on every wake-up, and conductors sharing a strategy wake each other;
                # but at once when a strategy was just claimed by its leader)
                last_share = now_loop
                self._help_soon.clear()
                await self._share_pass()
            if self._draining:
                continue  # stopping: take on nothing new
            if self._wanted is None or self._wanted - set(self.runs) - set(self.finished):
                await self._claim()

    async def _poll_callbacks(self, strategy_ids: list[int], after_id: int = 0) -> None:
        """Pick up callbacks stored by other processes (an API server, an agent endpoint)."""
        owner = self.id if self._sharing else None  # (sharing: its own steps' only)
        for record in await self._io(cbs.open_callbacks, self.store, strategy_ids, after_id, owner):
            if self._first_sight(record):
                self.post(CallbackArrived(record))

    async def _watch_callbacks(self, every_s: float) -> None:
        """SQLite, with the API in a process of its own: every ``every_s``, one read of
        the highest callback id; callbacks stored since the last look (their ids are
        higher: SQLite has one writer, so ids are committed in order) are picked up
        at once, not at the next periodic pass. (The pass still picks up all open ones:
        this only makes it sooner.)"""
        seen = await self._io(cbs.last_callback_id, self.store)
        while True:
            await asyncio.sleep(every_s)
            last = await self._io(cbs.last_callback_id, self.store)
            if last <= seen:
                continue
            waiting = [sid for sid, run in self.runs.items() if run.waits_for_callbacks]
            if waiting:
                await self._poll_callbacks(waiting, seen)
            seen = last

    def _periodic_ended(self, task: asyncio.Task[None]) -> None:
        """The periodic pass must live as long as the dispatcher: its death is fatal."""
        if task.cancelled():
            return
        exc = task.exception()
        self._fatal = exc or RuntimeError("periodic pass ended")
        if isinstance(exc, StoreReplaced):
            log.critical("%s", exc)
        elif isinstance(exc, KeyboardInterrupt | SystemExit):
            pass  # the process is interrupted (Ctrl-C in a sweep): whoever stops it says so
        elif isinstance(exc, StoreUnavailable):
            log.error("stopping during a database outage: %s", exc)
        else:
            log.critical("periodic pass died (%r): stopping this conductor", self._fatal)
        if self._wake is not None:
            self._wake.set()

    def _watch_leases(self) -> None:
        """Self-fencing, every tick: a strategy whose lease has not been renewed for most
        of its length (renewals failing: the database is locked or unreachable) is
        dropped, and its actions stopped, before another conductor may take it over.

        A timer of its own, not the periodic pass: that pass waits inside the renewal
        that keeps failing (retries, each perhaps blocking for busy_timeout), which may
        take longer than the lease. Once the database answers again, the strategy is
        claimed anew (a new fence) and the recover hooks look at what was stopped.
        """
        self._lease_watch = self._loop.call_later(self.config.tick_s, self._watch_leases)
        if not self.config.renew_leases:
            return
        lapsing = [run for run in self.runs.values() if not run.lapsed and self._lapsing(run.id)]
        if lapsing:
            self._lapse(lapsing)

    def _lapsing(self, sid: int) -> bool:
        """Whether the strategy's lease has gone unrenewed for most of its length here
        (its actions must stop, and nothing of it start, before another may take it)."""
        run = self.runs.get(sid)
        if run is None or not self.config.renew_leases:
            return False
        return run.lapsed or run.lease_from < self._loop.time() - self.config.lease_ttl_s * 0.8

    def _lapse(self, lapsing: list[StrategyRun]) -> None:
        log.error(
            "lease-lapsing: renewal overdue; %s stops acting on strategies %s",
            self.id,
            ", ".join(str(run.id) for run in lapsing),
        )
        for run in lapsing:
            # Its actions stop here and now: the dispatcher may be stuck retrying a
            # commit in the same outage, and would stop them only once it is through.
            run.lapsed = True
            for fl in run.inflight.values():
                if fl.task is not None:
                    fl.task.cancel()
            # the dispatcher drops it; it is claimed anew once the database answers
            self.post(LeaseLost(run.id, lapsed=True))
