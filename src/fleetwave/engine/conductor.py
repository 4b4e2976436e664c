"""The conductor: one dispatcher that owns all in-flight bookkeeping, and its workers.

How a step moves (DESIGN.md section 3):

1. The dispatcher admits steps into free slots (sliding window) and commits their
   entry into the first state (claim: owner, fence, lease) together with any
   other transitions in the same group commit.
2. Only after that commit (G4) does it start the state's action as a worker task.
3. The worker reports the outcome as a message (G2); it never touches the
   dispatcher's tables.
4. The dispatcher checks the message against the step's (state, fence); a stale
   message is recorded and ignored (G3). It decides the next state with the pure
   rules, commits it with compare-and-set, and dispatches the next action at once.

The periodic pass only renews leases, claims strategies whose owner is gone, and
notices operator aborts; it never starts an action.

Usage::

    conductor = Conductor(store)
    await conductor.run(strategy_ids=[sid])        # drive these until terminal
    await conductor.run(stop=event)                # serve: drive whatever is applying

This module owns :class:`Conductor`: its lifecycle (:meth:`Conductor.run`) and the
dispatcher (the message loop, admissions, group commits and what follows them). The
conductor's other parts are mixins it inherits, each in its own module, all working
on the same object (``self``; nothing in between on the hot path):

- :mod:`.worker`: the step workers (run an action, report by message);
- :mod:`.deadlines`: action deadlines, and abandoning an action that ignores its cancel;
- :mod:`.claims`: claiming strategies and adopting them from the database;
- :mod:`.settle`: steps whose transition was refused, read back and settled;
- :mod:`.periodic`: the periodic pass and the lease watchdog;
- :mod:`.outcome_log`: what the log says of failed steps and stale outcomes;
- :mod:`.gc_freeze`: moving loaded strategies out of the garbage collector's sight;
- :mod:`.gates`: phases held by time (a wait after a stage, a start time, a window,
  the deadline) or an operator's approval;
- :mod:`.store_calls`: store calls on the loop, retried, outages ridden out.

Its settings and counters are in :mod:`.config`, what it raises in :mod:`.errors`
(both re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy.exc import OperationalError

from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
    StrategyState,
    plural,
)
from fleetwave.domain.rules import Decision, details_text, next_visit
from fleetwave.domain.workflow import TargetDriver
from fleetwave.drivers import close_drivers, make_drivers
from fleetwave.engine.agent_tokens import AgentTokenIssuer
from fleetwave.engine.claims import NOT_DRIVABLE_HERE, ClaimsMixin
from fleetwave.engine.clock import Clock, ServerClock, WallClock
from fleetwave.engine.config import (
    BATCH_MAX_EMBEDDED,
    BATCH_MAX_SERVER,
    EngineConfig,
    EngineStats,
)
from fleetwave.engine.deadlines import DeadlinesMixin
from fleetwave.engine.errors import SimulatedCrash, StoreReplaced, StoreUnavailable
from fleetwave.engine.gates import GatesMixin
from fleetwave.engine.gc_freeze import GcFreezeMixin
from fleetwave.engine.loop import wait_set
from fleetwave.engine.messages import (
    ActionFinished,
    CallbackArrived,
    FailuresCounted,
    LeaseLost,
    Message,
    PauseChanged,
    PeersGone,
    RetryAnswer,
    RetryScheduled,
    StopRequested,
    StrategyClaimed,
    StrategyJoined,
)
from fleetwave.engine.meters import Meters
from fleetwave.engine.outcome_log import OutcomeLogMixin, outcomes
from fleetwave.engine.periodic import PeriodicMixin
from fleetwave.engine.run import InFlight, StrategyRun
from fleetwave.engine.settle import SettleMixin
from fleetwave.engine.sharing import SharingMixin
from fleetwave.engine.stopping import commit_stop_rule, count_failure
from fleetwave.engine.store_calls import StoreCalls, _Fresh
from fleetwave.engine.worker import WorkerMixin, resolve_future
from fleetwave.store import callbacks as cbs
from fleetwave.store import leases
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store
from fleetwave.store.notify import Listener

log = logging.getLogger("fleetwave.engine")

__all__ = [
    "NOT_DRIVABLE_HERE",
    "Conductor",
    "CrashHook",
    "EngineConfig",
    "EngineStats",
    "SimulatedCrash",
    "StoreReplaced",
    "StoreUnavailable",
]

CrashHook = Callable[[str], None]


class Conductor(
    # (a part that defines a method comes before the parts that only declare it, or
    # mypy takes the declaration for the method: its check is in that order)
    GcFreezeMixin,
    GatesMixin,
    SettleMixin,
    SharingMixin,
    ClaimsMixin,
    PeriodicMixin,
    DeadlinesMixin,
    WorkerMixin,
    OutcomeLogMixin,
    StoreCalls,
):
    #: the loop :meth:`run` runs on (set when it starts)
    _loop: asyncio.AbstractEventLoop

    def __init__(
        self,
        store: Store,
        *,
        clock: Clock | None = None,
        config: EngineConfig | None = None,
        drivers: dict[str, TargetDriver] | None = None,
        conductor_id: str | None = None,
        crash_hook: CrashHook | None = None,
    ) -> None:
        self.store = store
        if clock is None and store.hooks.now_sql() is not None:
            # conductors on many hosts: leases on the server's clock
            clock = ServerClock(lambda: rt.server_time(store))
        self.clock = clock or WallClock()
        self.config = config or EngineConfig()
        # A write waiting for another writer's lock holds this conductor's loop (SQLite
        # waits inside the call): a twentieth of the lease, so the lease watchdog still
        # stops the actions before the lease runs out (at 80 % of it, a tick and a few
        # such waits late).
        store.busy_timeout_ms = min(
            store.busy_timeout_ms, max(100, int(self.config.lease_ttl_s * 50))
        )
        self.drivers = drivers if drivers is not None else make_drivers(self.config.seed)
        #: the drivers made here are closed here when run ends (given ones: by their owner)
        self._closes_drivers = drivers is None
        self.id = conductor_id or f"c-{uuid.uuid4().hex[:12]}"
        self.stats = EngineStats()
        #: counts for /metrics, when something reads them (``serve --listen``)
        self.meters: Meters | None = None
        #: the tokens of states that wait for callbacks, issued a batch per turn
        self._agent_tokens = AgentTokenIssuer(self._io, store, self.clock.now)
        self.runs: dict[int, StrategyRun] = {}
        self.finished: dict[int, str] = {}
        self._crash_hook = crash_hook
        self._inbox: list[Message] = []
        self._wake: asyncio.Event | None = None
        #: woken by other processes' commits (PostgreSQL's LISTEN/NOTIFY; set in run)
        self._listening = False
        self._workers: set[asyncio.Task[None]] = set()
        self._writer = rt.TransitionWriter(store, self.id)
        #: most transitions per group commit (EngineConfig.batch_max, or the database's)
        self.batch_max = self.config.batch_max or (
            BATCH_MAX_EMBEDDED if store.hooks.embedded else BATCH_MAX_SERVER
        )
        self._committed_at = 0.0
        self._wanted: set[int] | None = None
        self._patient = False
        #: callbacks already posted to the dispatcher, by strategy (each is posted once,
        #: however it is heard of); dropped when the strategy ends here (a strategy lost
        #: to another conductor keeps the ids it handled, in case it comes back)
        self._callbacks_seen: dict[int, set[int]] = {}
        self._fatal: BaseException | None = None
        self._draining = False
        # Action deadlines: one heap and one loop timer for all of them (a timer per action
        # costs more than the action's own bookkeeping). Entries: (when, attempt, flight);
        # an entry whose attempt has ended is dropped when it comes up, or by compaction.
        self._deadlines: list[tuple[float, int, InFlight]] = []
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline_at = 0.0
        self._deadlines_compact_at = 1024
        self._attempts = 0
        #: claimed, not yet adopted (its StrategyClaimed message waits in the inbox)
        self._claiming: set[int] = set()
        #: strategies whose workflow this process lacks: left to other conductors
        self._not_here: set[int] = set()
        #: strategies dropped because this conductor's own lease renewals lapsed: the
        #: next claims say what became of each (claimed back, or taken over)
        self._lapsed_ids: set[int] = set()
        #: loop time each claim in progress started (its lease runs from then)
        self._claimed_at: dict[int, float] = {}
        #: steps freed in the batch being built (their end decided, not yet committed)
        self._freed: dict[int, InFlight | None] = {}
        #: outcomes of steps that had moved on, in the batch being handled
        self._stale: list[ActionFinished] = []
        #: failed steps of the batch being handled, to log (strategy, step, target, why)
        self._failed_now: list[tuple[int, int, str | None, str]] = []
        #: failed steps of each strategy so far (the first ones logged one by one)
        self._failures_logged: dict[int, int] = {}
        #: failures of each strategy not said yet, and since when (loop time)
        self._failures_unsaid: dict[int, tuple[int, float]] = {}
        #: callback waits an operator's abort ends, once no callback for their step is
        #: queued (one stored before a takeover is handed to its wait first)
        self._ending_waits: list[InFlight] = []
        self._lease_watch: asyncio.TimerHandle | None = None
        #: this conductor's gc.freeze is in force; or was lifted while other strategies
        #: go on, to be made again after the next full collection (the count of full
        #: collections when it was lifted)
        self._frozen = False
        self._refreeze_after: int | None = None
        #: the database file's identity when :meth:`run` began (see StoreReplaced)
        self._db_identity: tuple[int, int] | None = None
        #: the stop asked of :meth:`run` (a store call riding out an outage gives up)
        self._stop: asyncio.Event | None = None
        #: loop time the last store call's last attempt began (the one that went through)
        self._attempt_at = 0.0
        #: arguments of store calls worked out at each attempt: the time, and a lease
        #: from then (typed Any: they stand for a float wherever one is passed)
        self._NOW: Any = _Fresh(self.clock.now)
        self._LEASE: Any = _Fresh(self._lease_until)
        #: the lease clock's reading at each attempt (leases are compared on it)
        self._LEASE_NOW: Any = _Fresh(self.clock.lease_now)
        self._PEERS: Any = _Fresh(self._peer_view)
        #: conductors share strategies (see fleetwave.engine.sharing; set in run)
        self._sharing = False
        self._reads_on_thread = False
        #: strategies others lead that this one does not help (phases, or not drivable)
        self._not_helping: set[int] = set()
        self._serving_peers = 0
        #: loop time its leases were last written (a claim or a renewal that went
        #: through): the simulator checks nobody takes them while they last
        self.renewed_at: float | None = None

    # -- plumbing -------------------------------------------------------------------

    def post(self, msg: Message) -> None:
        """Send the dispatcher a message. Never blocks; safe from any task on the loop."""
        self._inbox.append(msg)
        if self._wake is not None:
            self._wake.set()

    def receive_callback(
        self, step_id: int, state: str, kind: str, details: str = "", visit: int | None = None
    ) -> cbs.CallbackRecord:
        """Store a target's callback and answer at once (G6): one INSERT, no step lock.
        ``visit``: the visit of ``state`` it reports on (None: the step's; see
        :func:`fleetwave.store.callbacks.insert_callbacks`).

        The dispatcher applies it (or records why it was ignored) on its next turn.
        """
        record = cbs.accept_callback(
            self.store, step_id, state, kind, details, self.clock.now(), visit=visit
        )
        self.callback_stored(record)
        return record

    def _meter_commit(
        self,
        batch: list[rt.Transition],
        result: rt.CommitResult,
        marks: list[rt.CallbackMark],
        events: int,
        began: float,
    ) -> None:
        """Count a commit for /metrics (only with meters: ``serve --listen``)."""
        assert self.meters is not None
        unwritten = {id(t) for t in (*result.rejected, *result.deferred)}
        self.meters.committed(
            {sid: run.workflow.name for sid, run in self.runs.items()},
            ((t.strategy_id, t.to_state) for t in batch if id(t) not in unwritten),
            ((m.outcome, m.reason) for m in marks),
            len(batch) + len(marks) + events,
            self._committed_at - began,
        )

    def callback_stored(self, record: cbs.CallbackRecord) -> None:
        """A callback stored by someone else in this process (the REST API, from its own
        thread and connection): applied on the dispatcher's next turn, as one it
        received, rather than found on its next pass. Never blocks; call it on the loop."""
        self._first_sight(record)
        self.post(CallbackArrived(record))

    def _first_sight(self, record: cbs.CallbackRecord) -> bool:
        """Whether this conductor has not posted this callback yet (and now has)."""
        seen = self._callbacks_seen.setdefault(record.strategy_id, set())
        if record.id in seen:
            return False
        seen.add(record.id)
        return True

    def _sink(self, step_id: int, state: str, kind: str, details: str, visit: int) -> None:
        self.receive_callback(step_id, state, kind, details, visit)

    def _crash_point(self, point: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(point)

    async def _sync_lease_clock(self) -> None:
        """Read a server's lease clock again (where leases are on one)."""
        sync = getattr(self.clock, "sync", None)
        if sync is not None:
            await self._io(sync)

    def _lease_until(self) -> float:
        """A lease from now, on the lease clock (never the wall clock: see .clock)."""
        return self.clock.lease_now() + self.config.lease_ttl_s

    # -- lifecycle --------------------------------------------------------------------

    async def run(
        self,
        *,
        strategy_ids: Iterable[int] | None = None,
        stop: asyncio.Event | None = None,
        patient: bool = False,
        on_ready: Callable[[], None] | None = None,
    ) -> dict[int, str]:
        """Drive strategies until those asked for are terminal (or ``stop`` is set).

        With ``strategy_ids`` it returns once each is terminal or owned by another
        live conductor (``"owned"``), or, if ``patient``, waits for that owner's lease
        to expire and takes over. Without, it serves until ``stop``. Returns final states.
        ``on_ready`` is called once the conductor is registered (its first claim went
        through: after an outage at start, only when the database answers).
        """
        self._wanted = set(strategy_ids) if strategy_ids is not None else None
        self._stop = stop
        share = self.config.share
        if share is None:
            share = self._wanted is None and bool(self.store.hooks.for_update)
        self._sharing = share
        try:
            self._db_identity = self.store.file_identity()
        except OSError:
            self._db_identity = None
        self._patient = patient
        # What this process shows of leases (an action reading `step list`, a test on
        # virtual time) reads them on this conductor's lease clock (its tasks inherit it).
        leases.READER.set((self.clock.lease_clock, self.clock.lease_now))
        self._wake = asyncio.Event()
        # The hot path asks for the loop on every action: asyncio.get_running_loop()
        # makes a getpid() system call each time (fork safety), so it is kept here.
        self._loop = asyncio.get_running_loop()
        # (a server's database; not on virtual time, where nothing may wait on a thread)
        self._reads_on_thread = not self.store.hooks.embedded and not getattr(
            self._loop, "virtual_time", False
        )
        self._nudge = asyncio.Event()
        self._help_soon = asyncio.Event()
        loop = self._loop

        def nudged(what: str) -> None:  # (in the listener's thread)
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                if what.startswith("led:"):
                    # a strategy claimed by its leader: one to help, maybe (now, not at
                    # the next share pass: the others would start a tick late)
                    loop.call_soon_threadsafe(self._help_soon.set)
                loop.call_soon_threadsafe(self._nudge.set)

        listener = Listener(self.store, nudged)
        self._listening = listener.available
        clean = False
        for driver in self.drivers.values():
            if hasattr(driver, "callback_sink"):
                driver.callback_sink = self._sink  # simulated agents call us back here
        try:
            # Listening before the first claim: a commit after it wakes this conductor,
            # one before it the claim finds (PostgreSQL; nothing on SQLite)
            listener.start()
            await self._sync_lease_clock()
            await self._claim(register=True)
            if on_ready is not None:
                on_ready()
            self._watch_leases()
            periodic = asyncio.create_task(self._periodic(), name="fleetwave-periodic")
            periodic.add_done_callback(self._periodic_ended)
            background = [periodic]
            watch_s = self.config.callback_watch_s
            if watch_s is not None and not self._listening:
                watching = asyncio.create_task(
                    self._watch_callbacks(watch_s), name="fleetwave-callback-watch"
                )
                watching.add_done_callback(self._periodic_ended)
                background.append(watching)
            try:
                await self._dispatch_loop(stop)
            finally:
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, return_exceptions=True)
            clean = True
        finally:
            # first: what follows may raise (a stop during an outage), or be cancelled
            self._thaw(refreeze=False)
            listener.stop()
            if self._lease_watch is not None:
                self._lease_watch.cancel()
                self._lease_watch = None
            left = await self._stop_workers()
            if left:
                # An action still runs here: handing its step's lease back would let
                # another conductor run it at the same time (G2). Its leases run out by
                # themselves instead (the next owner then takes the steps over).
                log.error(
                    "not handing leases back: %s of strategies %s still running here; "
                    "they are taken over once their leases run out",
                    plural(len(left), "action"),
                    ", ".join(map(str, sorted({fl.rec.strategy_id for fl in left}))),
                )
                clean = False
            if clean:
                held = [i for run in self.runs.values() for i in run.inflight]
                if self._sharing:  # (and the waiting steps it claimed: nobody's again)
                    held += [r.step_id for run in self.runs.values() for r in run.drain_pending()]
                await self._io(rt.release_conductor, self.store, self.id, self._NOW, held)
            self._writer.close()
            if self._closes_drivers:
                await close_drivers(self.drivers)  # their pools and sessions
        return self.finished

    async def _stop_workers(self) -> list[InFlight]:
        """Cancel every worker and wait for them (a grace period at most); the steps of
        those left behind, still running their action."""
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._deadlines.clear()
        for task in list(self._workers):
            task.cancel()
        behind: list[InFlight] = []
        if self._workers:
            # An action that swallows its cancel would hold the stop for good (a second
            # signal was needed): it is left behind after the grace period, said so.
            _, left = await asyncio.wait(list(self._workers), timeout=self.config.abandon_after_s)
            if left:
                log.error(
                    "%s did not stop when cancelled (an action catches CancelledError): "
                    "left behind",
                    plural(len(left), "worker"),
                )
                behind = [
                    fl
                    for run in self.runs.values()
                    for fl in run.inflight.values()
                    if fl.task in left
                ]
        self._workers.clear()
        return behind

    def _should_exit(self, stop: asyncio.Event | None) -> bool:
        if stop is not None and stop.is_set():
            return True
        if self._wanted is None:
            return False
        return not self.runs and not self._inbox and self._wanted <= set(self.finished)

    # -- the dispatcher ----------------------------------------------------------------

    async def _dispatch_loop(self, stop: asyncio.Event | None) -> None:
        assert self._wake is not None
        stop_task: asyncio.Task[Any] | None = None
        if stop is not None:
            stop_task = asyncio.create_task(self._relay_stop(stop))
        drain_until: float | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                if stop is not None and stop.is_set() and drain_until is None:
                    # Clean stop: start nothing new, let running actions finish and
                    # commit their outcomes for a grace period, then hand leases back.
                    drain_until = loop.time() + self.config.shutdown_grace_s
                    self._draining = True
                    for run in self.runs.values():
                        for fl in run.inflight.values():
                            # a retry waiting out its backoff is left to the next owner
                            resolve_future(fl.backoff, None)
                    log.info("stopping: draining %d running actions", len(self._workers))
                    # Said once, not retried: the drain must not wait on an outage.
                    with contextlib.suppress(OperationalError):
                        rt.mark_draining(self.store, self.id, self.clock.now())
                if drain_until is not None and (
                    (not self._workers and not self._inbox) or loop.time() >= drain_until
                ):
                    return
                if not self._inbox and not self._wake.is_set():
                    if drain_until is None and self._should_exit(stop):
                        return
                    if drain_until is None:
                        if await self._prefetch():
                            await asyncio.sleep(0)  # what came due meanwhile goes first
                            continue
                        await self._wake.wait()
                        if stop is not None and stop.is_set():
                            continue  # a clean stop that woke it is seen before the inbox
                    else:
                        await wait_set(self._wake, max(0.0, drain_until - loop.time()))
                if self._fatal is not None:
                    raise self._fatal
                self._wake.clear()
                cut = self.batch_max
                msgs, self._inbox = self._inbox[:cut], self._inbox[cut:]
                await self._handle(msgs)
                await asyncio.sleep(0)  # the store runs inline: let the started actions run
        finally:
            if stop_task is not None:
                stop_task.cancel()
                await asyncio.gather(stop_task, return_exceptions=True)

    async def _relay_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        assert self._wake is not None
        self._wake.set()

    async def _handle(self, msgs: list[Message]) -> None:
        now = self.clock.now()
        self._freed.clear()
        self._stale.clear()
        batch: list[rt.Transition] = []
        events: list[rt.Event] = []
        marks: list[rt.CallbackMark] = []
        deadlines: list[rt.AttemptDeadline] = []
        recover: list[InFlight] = []
        claimed_callbacks: list[cbs.CallbackRecord] = []
        retries: list[tuple[RetryScheduled, asyncio.Future[RetryAnswer]]] = []
        refused_retries: set[int] = set()
        held_retries: set[int] = set()
        for i, msg in enumerate(msgs):
            if type(msg) is ActionFinished:  # (nearly every message: asked first)
                self._on_finished(msg, now, batch, events, marks)
            elif isinstance(msg, RetryScheduled):
                if self._reported(msg) is None or (msg.started and self._draining):
                    # Stale: the step moved on, or is another worker's now (taken over
                    # at a new fence): this worker must not run the retry. Or a clean
                    # stop: nothing starts, the retry is left (marked) to the next owner.
                    resolve_future(msg.handled, RetryAnswer.REFUSED)
                    continue
                if msg.handled is not None:
                    retries.append((msg, msg.handled))
                if not msg.started and msg.details:
                    # the failed attempt, kept: the row's details are overwritten as the
                    # step goes on (a flaky target is found from these the next morning)
                    events.append(
                        rt.Event("attempt-failed", msg.details, msg.strategy_id, msg.step_id)
                    )
                deadlines.append(
                    rt.AttemptDeadline(
                        msg.step_id,
                        msg.strategy_id,
                        msg.state,
                        msg.fence,
                        msg.deadline_at,
                        msg.attempt,
                        msg.details,
                        0 if msg.started else 1,
                        msg.how,
                        self._reported_visit(msg),
                    )
                )
            elif isinstance(msg, CallbackArrived):
                self._on_callback(msg.record, marks, deadlines, events)
            elif isinstance(msg, StrategyClaimed):
                try:
                    recover += await self._adopt(msg.record, events, batch, now)
                finally:
                    # Claimed until adopted: a periodic pass while the adopt's store
                    # calls back off must not claim it again (a second run, a second
                    # worker per step).
                    self._claiming.discard(msg.record.id)
                mine = self.id if self._sharing else None
                opened = await self._io(cbs.open_callbacks, self.store, [msg.record.id], 0, mine)
                for record in opened:
                    if self._first_sight(record):
                        claimed_callbacks.append(record)
            elif isinstance(msg, StopRequested):
                self._request_stop(msg.strategy_id, events)
            elif isinstance(msg, StrategyJoined):
                self._join(msg.record)
            elif isinstance(msg, PeersGone):
                recover += await self._take_over_peers(msg, events, batch, now)
            elif isinstance(msg, FailuresCounted):
                run_ = self.runs.get(msg.strategy_id)
                if run_ is not None and msg.failed > run_.failed:
                    # (the others' failures: one more booked here decides the stop)
                    run_.failed = msg.failed - 1
                    self._count_failure(run_)
            elif isinstance(msg, PauseChanged):
                self._set_paused(msg.strategy_id, msg.paused, events)
            elif isinstance(msg, LeaseLost):
                self._drop_run(msg.strategy_id, lapsed=msg.lapsed, later=msgs[i + 1 :])
            else:
                self._on_finished(msg, now, batch, events, marks)  # (a subclass of it)
        if self._stale:
            self._log_stale()
        self._stop_moves_before_the_stop(batch, now)
        # No action running (a strategy just claimed, or all ended): a bigger commit
        # delays no one's dispatch, and a whole first wave starts together.
        limit = self.batch_max * (1 if self._workers else 2)
        for run in list(self.runs.values()):
            if run.paused and run.stopping is None:
                continue  # nothing starts: nothing to load or admit
            if run.more_waiting and (
                run.stopping is not None
                or run.starved
                or run.pending_count() < run.cap - len(run.inflight)
            ):
                # Free slots that what is loaded cannot fill (idle moments keep a reserve
                # loaded, so under load this is rare). Stopping ends every waiting step,
                # so it needs them all.
                await self._load_waiting(run, everything=run.stopping is not None)
            self._admit(run, now, batch, limit - len(batch))
        if batch or events or marks or deadlines:
            self._crash_point("before-commit")
            # A strategy dropped in this very batch (lease lost) writes nothing more:
            # its new owner decides what its outcomes and callbacks mean.
            runs = self.runs
            touched = {t.strategy_id for t in batch}
            touched.update(m.strategy_id for m in marks)
            touched.update(d.strategy_id for d in deadlines)
            if not touched <= runs.keys():  # (rare: everything is kept otherwise)
                batch = [t for t in batch if t.strategy_id in runs]
                marks = [m for m in marks if m.strategy_id in runs]
                deadlines = [d for d in deadlines if d.strategy_id in runs]
                touched &= runs.keys()
            fences = {sid: runs[sid].record.fence for sid in touched}
            began = time.perf_counter()
            result = await self._io(
                self._writer.commit,
                batch,
                events,
                self._NOW,
                marks,
                fences,
                deadlines,
                self._stop_rules(batch),
                self._lapsing,
            )
            self._committed_at = time.perf_counter()
            self.stats.batches += 1
            self.stats.transitions += len(batch) - len(result.rejected) - len(result.deferred)
            if self.meters is not None:
                self._meter_commit(batch, result, marks, len(events), began)
            self._crash_point("after-commit")
            # First: entries the commit turned into failed (an unmanaged target) or, after
            # that crossed the failure threshold, aborted, leave the window (_apply then
            # finds them gone and starts nothing for them).
            for t in result.replaced:
                self._replaced_at_turn(t)
            if result.deferred:
                self._wait_again(result.deferred)
            for sid, n in result.no_slot.items():
                await self._no_room(sid, n)
            late: list[rt.Event] = []
            for sid, state in result.held_back.items():
                # The operator's pause or abort was committed before this dispatcher saw
                # it: the steps it was starting wait again, until resumed (or aborted).
                if state == StrategyState.PAUSED:
                    self.post(PauseChanged(sid, True))
                else:
                    # The commit ended moves as aborted: the strategy stops now, before
                    # it could end as if nothing had been asked (the abort is on record).
                    self._request_stop(sid, late)
            if late:
                fences_late = {
                    e.strategy_id: self.runs[e.strategy_id].record.fence
                    for e in late
                    if e.strategy_id is not None and e.strategy_id in self.runs
                }
                await self._io(self._writer.commit, [], late, self._NOW, None, fences_late)
                self._wake_soon()  # its waiting steps are ended on the next turn
            # Entries written as not started (their lease lapsed while the commit was
            # retried): that strategy stops here now, before anything of it starts.
            newly = [
                self.runs[sid]
                for sid in result.not_started
                if sid in self.runs and not self.runs[sid].lapsed
            ]
            if newly:
                self._lapse(newly)
            self._apply(batch, result.rejected, marks, result.answered)
            if self._failed_now:
                self._log_failures()
            for sid in result.lost:
                self._drop_run(sid)
            refused_retries = result.retries_refused
            held_retries = result.retries_held
        for retry, handled in retries:
            if handled.done():
                continue
            if retry.step_id in held_retries:
                # Its strategy's abort was on record first (the stop was requested above,
                # so its worker ends the step as not retried).
                handled.set_result(RetryAnswer.HELD)
            elif retry.step_id in refused_retries:
                handled.set_result(RetryAnswer.REFUSED)  # not on the record: must not run
                self._retry_refused(retry)
            else:
                handled.set_result(RetryAnswer.RECORDED)  # the next attempt may run
        for fl in recover:
            if not self._draining and fl.rec.strategy_id in self.runs:
                self._release(fl)
        for run in list(self.runs.values()):
            if run.settle_due and run.unsettled and not self._draining:
                await self._settle(run)
        for record in claimed_callbacks:
            self.post(CallbackArrived(record))
        if self._ending_waits:
            self._ending_waits_end()
        await self._look_at_gates(now)  # (phases held by time or by an approval)
        await self._mark_aborting()
        await self._finish_done_runs()

    async def _mark_aborting(self) -> None:
        """abort-requested -> aborting, once the dispatcher has stopped admitting; a
        stop for failures is written in the strategy's details."""
        for run in self.runs.values():
            if run.shared:
                continue  # (its leader says so)
            if run.stopping == "abort" and run.db_state == StrategyState.ABORT_REQUESTED:
                ok = await self._io(
                    rt.set_strategy_state,
                    self.store,
                    run.id,
                    self.id,
                    run.record.fence,
                    StrategyState.ABORT_REQUESTED.value,
                    StrategyState.ABORTING.value,
                    "aborting: in-flight steps finish their current state",
                    self._NOW,
                )
                if ok:
                    run.db_state = StrategyState.ABORTING.value
            elif run.stopping == "failure" and not run.stop_said:
                # What `strategy show|list` say while in-flight steps finish: not a
                # rollout going well (its state stays applying, or paused, until the end).
                # Said once: not written only if the strategy was lost or ended meanwhile.
                run.stop_said = True
                await self._io(
                    rt.set_strategy_details,
                    self.store,
                    run.id,
                    self.id,
                    run.record.fence,
                    f"stopping: {run.stop_details}; in-flight steps finish their current state",
                    self._NOW,
                )

    def _on_callback(
        self,
        cb: cbs.CallbackRecord,
        marks: list[rt.CallbackMark],
        deadlines: list[rt.AttemptDeadline],
        events: list[rt.Event],
    ) -> None:
        """Hand a callback to the step waiting for it, keep it for later, or ignore it
        (a heartbeat: see :meth:`_on_heartbeat`).

        A callback that resolves a wait is marked ``applied`` only together with the
        transition it causes (see :meth:`_on_finished`): if this conductor dies in
        between, the callback is still open and the next owner applies it.
        """
        run = self.runs.get(cb.strategy_id)
        if run is None or (self._sharing and cb.step_id not in run.inflight):
            # Not ours (yet): its owner answers it, perhaps us once we claim the strategy.
            # (Conductors sharing the strategy: the one driving the step, which looks for
            # its own steps' callbacks; this one may drive it later.)
            seen = self._callbacks_seen.get(cb.strategy_id)
            if seen is not None:
                seen.discard(cb.id)
                if not seen and cb.strategy_id not in self._claiming:
                    del self._callbacks_seen[cb.strategy_id]
            return
        fl = run.inflight.get(cb.step_id)

        def ignore(reason: str) -> None:
            marks.append(rt.CallbackMark(cb.id, "ignored", reason, cb.strategy_id))
            log.info("callback %s for step %s ignored: %s", cb.id, cb.step_id, reason)

        states = run.workflow.state_names
        over = None if fl is None else _visit_over(cb, fl)
        if fl is None:
            # (one for a step that has ended is answered when stored: this one's step is
            # still waiting its turn, unless it ended in between)
            ignore(
                "its step is not under way: not started yet (a callback answers a state "
                "its step has entered, or will enter from one it is in), or just ended"
            )
        elif cb.state not in states:
            ignore(f"unknown state {cb.state} for workflow {run.workflow.name}")
        elif (
            cb.kind != "heartbeat"
            and cb.state != fl.state
            and run.workflow.state(cb.state).mode != "wait-for-callback"
        ):
            # Said at once: kept as early, it was answered when the step ended, as if
            # the step had never reached that state.
            ignore(f"state {cb.state} does not wait for callbacks")
        elif over is not None:
            # A state on a bounded cycle: this visit of it is over (its step may be in it
            # again, or about to be: never answered by the visit before's report).
            ignore(over)
        elif (
            _visit_ahead(cb, fl)
            or states.index(cb.state) > states.index(fl.state)
            or (
                cb.state == fl.state
                and fl.waiter is None
                and cb.kind != "heartbeat"
                and run.workflow.state(fl.state).mode == "wait-for-callback"
            )
        ):
            # Early: the target answered before the step started waiting. Keep it (once:
            # a settle or a takeover offers the step's open callbacks again).
            kept = run.early_callbacks.setdefault(cb.step_id, [])
            if all(k.id != cb.id for k in kept):
                kept.append(cb)
        elif cb.state != fl.state:
            ignore(f"late or out of order: step has moved on to {fl.state}")
        elif cb.kind == "heartbeat" and _answered(fl):
            # Its state's report came first (its step moves on once its worker reads it):
            # a heartbeat now says nothing more, and is not applied beside that report.
            ignore(f"late: state {fl.state} already had its callback")
        elif cb.kind == "heartbeat":
            self._on_heartbeat(run, fl, cb, marks, deadlines, events)
        elif fl.waiter is None:
            ignore(f"state {fl.state} does not wait for callbacks")
        elif fl.waiter.done():
            if not fl.waiter.cancelled() and fl.waiter.result().id == cb.id:
                return  # the same callback offered again (a settle, a takeover): it has it
            ignore("duplicate: this state already had its callback")
        else:
            fl.waiter.set_result(cb)

    def _drop_run(
        self, sid: int, *, lapsed: bool = False, later: list[Message] | None = None
    ) -> None:
        """Stop driving a strategy: stop its workers, forget it.

        Fenced off by another conductor, it is ``lost`` here (``apply --wait`` then
        waits for that owner's end, or takes over when its lease expires). ``lapsed``
        (this conductor's own renewals failing): nobody else may hold it, so the next
        periodic pass claims it anew, once the database answers. ``later``: the
        messages of the batch being handled that come after this drop.
        """
        run = self.runs.pop(sid, None)
        if run is None:
            return
        self._thaw(refreeze=bool(self.runs))
        self._forget_failures(sid)
        # Callbacks still queued for it stay seen (each is let go as it comes up, not
        # ours: posting it again on a claim back would apply it twice). The others were
        # handed to a wait, kept as early, or answered in a commit that may not happen:
        # still open in the database, a claim back must offer them again.
        queued = {
            m.record.id
            for m in (*(later or ()), *self._inbox)
            if isinstance(m, CallbackArrived) and m.record.strategy_id == sid
        }
        if sid in self._callbacks_seen:
            self._callbacks_seen[sid] &= queued
        for fl in run.inflight.values():
            if fl.task is not None:
                fl.task.cancel()
        if not lapsed:
            self.finished[sid] = "lost"
        if self._wake is not None:
            self._wake.set()  # the dispatcher re-checks whether anything is left to drive
        if lapsed:
            self._lapsed_ids.add(sid)
            log.error("strategy %s: stopped driving it until its lease is renewed", sid)
        else:
            log.error("strategy %s: lease lost to another conductor; stopped driving it", sid)

    def _set_paused(self, sid: int, paused: bool, events: list[rt.Event]) -> None:
        run = self.runs.get(sid)
        if run is None or run.paused == paused:
            return
        run.paused = paused
        if paused:
            events.append(rt.Event("pause-seen", "paused by operator: no new step starts", sid))
            log.info("strategy %s: paused; steps in flight go on to their end", sid)
        else:
            events.append(rt.Event("resume-seen", "resumed by operator", sid))
            log.info("strategy %s: resumed", sid)
            self._wake_soon()

    def _request_stop(self, sid: int, events: list[rt.Event]) -> None:
        run = self.runs.get(sid)
        if run is None or run.stopping == "abort":
            return
        run.stopping = "abort"
        run.stop_details = "aborted by operator"
        _stop_flights(run, self._end_wait)
        run.db_state = StrategyState.ABORT_REQUESTED.value
        events.append(rt.Event("abort-seen", "operator abort requested", sid))
        log.info("strategy %s: abort requested; in-flight steps finish their current state", sid)

    def _page(self, run: StrategyRun) -> int:
        if self._sharing and self._serving_peers:
            # (claimed: what it can start soon, no more, so that the others find some;
            # alone, it claims as many as it would load: a claim is a write transaction,
            # and when others join it hands back what is past this page)
            return self.config.waiting_page or max(2 * run.cap, 32)
        return self.config.waiting_page or max(2 * run.cap, 512)

    def _prefetch_page(self) -> int:
        return self.config.prefetch_page or self.config.waiting_page or 512

    async def _prefetch(self) -> bool:
        """Nothing to do: top up one strategy's waiting steps by a small page, if short.

        Loading a full page when slots free up would stop every running step's
        dispatch for milliseconds; the dispatcher's idle moments cost nobody.
        """
        for run in self.runs.values():
            short = self._page(run) - run.pending_count()
            if run.more_waiting and run.stopping is None and short > 0:
                # (sharing: what it claims, others cannot start; no more than its page)
                shared = self._sharing and self._serving_peers
                page = min(short, self._prefetch_page()) if shared else None
                await self._load_waiting(run, everything=False, page=page or self._prefetch_page())
                return True
        return False

    async def _load_waiting(
        self, run: StrategyRun, *, everything: bool, page: int | None = None
    ) -> None:
        """Load the next page of waiting steps (or all of them), in admission order."""
        page = page or self._page(run)
        while True:
            if self._sharing:
                # Others may start this strategy's steps too: the ones loaded here are
                # claimed (this conductor's to start), so no two start the same step.
                recs = await self._io(rt.claim_waiting_steps, self.store, run.id, self.id, page)
            else:
                recs = await self._io(
                    rt.load_waiting_steps, self.store, run.id, run.waiting_after, page
                )
            for rec in recs:
                run.add_pending(rec)
            if recs:
                run.waiting_after, run.waiting_stage = recs[-1].ordinal, recs[-1].stage
            run.more_waiting = len(recs) == page
            run.starved = False
            if not (everything and run.more_waiting):
                return

    def _reported(
        self, msg: ActionFinished | RetryScheduled
    ) -> tuple[StrategyRun, InFlight] | None:
        """The run and in-flight step a worker reports on, if the step is still at the
        state and fence the worker ran (else the report is stale)."""
        run = self.runs.get(msg.strategy_id)
        fl = run.inflight.get(msg.step_id) if run is not None else None
        if run is None or fl is None or fl.fence != msg.fence or fl.state != msg.state:
            return None
        return run, fl

    def _reported_visit(self, msg: RetryScheduled) -> int:
        """The visit of its state the step a retry is recorded for is in."""
        reported = self._reported(msg)
        return 1 if reported is None else reported[1].visit

    def _on_finished(
        self,
        msg: ActionFinished,
        now: float,
        batch: list[rt.Transition],
        events: list[rt.Event],
        marks: list[rt.CallbackMark],
    ) -> None:
        reported = self._reported(msg)
        stale = reported is None
        if msg.callback_id is not None:
            # The callback counts as applied exactly when its transition commits.
            outcome, why = ("applied", f"moved the step on from {msg.state}")
            if stale:
                outcome, why = ("ignored", "its step had moved on")
            step = None if stale else msg.step_id
            marks.append(rt.CallbackMark(msg.callback_id, outcome, why, msg.strategy_id, step))
        if stale:
            resolve_future(msg.go, False)  # its worker has nothing more to do
            self.stats.stale_outcomes += 1
            events.append(
                rt.Event(
                    "stale-outcome-ignored",
                    f"outcome for {msg.state} at fence {msg.fence} ignored: step has moved on",
                    msg.strategy_id,
                    msg.step_id,
                )
            )
            self._stale.append(msg)  # logged once for the batch (a lost strategy: many)
            return
        assert reported is not None
        run, fl = reported
        decision = msg.decision
        handed = fl.waiter
        if (
            msg.callback_id is None
            and handed is not None
            and handed.done()
            and not handed.cancelled()
        ):
            # A callback was handed to this state's wait, but the state ended (its action
            # failed, or it timed out) before the wait read it: answer it now, with why.
            cb = handed.result()
            why = decision.details or f"the step moved to {decision.to_state}"
            marks.append(
                rt.CallbackMark(
                    cb.id, "ignored", f"its step's state ended first: {why}", msg.strategy_id
                )
            )
        if run.stopping is not None and decision.to_state not in STEP_TERMINAL:
            decision = Decision(STEP_ABORTED, f"stopped after {msg.state}: {run.stop_details}")
        elif msg.attempts > 1 and decision.to_state not in (STEP_FAILED, STEP_ABORTED):
            # The journal keeps that the state needed retries (a failure's details say so
            # already): the step's attempt then counts the next state's attempts.
            took = f"{msg.state}: done at attempt {msg.attempts}"
            details = f"{decision.details} ({took})" if decision.details else took
            decision = Decision(decision.to_state, details)
        visit, visits, counted = 1, None, run.workflow.max_visits
        if counted and decision.to_state in counted:
            # a state on a bounded cycle: its next visit, or the step fails past its limit
            decision, visit = next_visit(counted, fl.visits, msg.state, decision)
            if decision.to_state in counted:
                fl.visits[decision.to_state] = visit
                visits = json.dumps(fl.visits, sort_keys=True)
        batch.append(
            self._move(
                run,
                msg.step_id,
                fl.state,
                fl.fence,
                decision.to_state,
                decision.details,
                msg.attempts,
                now,
                fl.rec.group_id,
                from_visit=fl.visit,
                visit=visit,
                visits=visits,
            )
        )
        # Book the move now, so admissions in this same batch see the freed slot.
        if decision.to_state in STEP_TERMINAL:
            # nothing more for its worker to do (kept for the batch: the end may be refused)
            self._freed[msg.step_id] = _free_slot(run, msg.step_id)
            for cb in run.early_callbacks.pop(msg.step_id, ()):
                # kept for a later state the step now never reaches: answered with it
                marks.append(
                    rt.CallbackMark(
                        cb.id,
                        "ignored",
                        f"its step ended {decision.to_state} before reaching {cb.state}",
                        msg.strategy_id,
                        msg.step_id,
                    )
                )
            if decision.to_state == STEP_FAILED:
                self._count_failure(run, fl.rec.target.name, fl.rec.stage)
        else:
            fl.state = decision.to_state
            fl.visit = visit
            fl.waiter = None  # the next state's waiter is made when its action starts

    def _stop_moves_before_the_stop(self, batch: list[rt.Transition], now: float) -> None:
        """A step moved on by an outcome that came before, in this same batch, the
        abort or the failure that stopped its strategy: its next state must not start
        either. It ends aborted after the state it finished, like the moves after it."""
        if all(run.stopping is None for run in self.runs.values()):
            return
        for i, t in enumerate(batch):
            if t.to_state in STEP_TERMINAL or t.from_state == STEP_INITIAL:
                continue
            run = self.runs.get(t.strategy_id)
            if run is None or run.stopping is None:
                continue
            self._freed[t.step_id] = _free_slot(run, t.step_id)
            details = f"stopped after {t.from_state}: {run.stop_details}"
            batch[i] = self._move(
                run,
                t.step_id,
                t.from_state,
                t.from_fence,
                STEP_ABORTED,
                details,
                t.attempt,
                now,
                t.group_id,
                from_visit=t.from_visit,
            )

    async def _no_room(self, sid: int, n: int) -> None:
        """``n`` entries of strategy ``sid`` were not written: the database's slots had no
        room for them (G7, counted there). Nothing more of it is admitted until one of its
        steps ends or a tick has passed; the slots are counted again from the steps, in
        case they drifted (a hand edit of a step)."""
        run = self.runs.get(sid)
        if run is None or run.no_room:
            return
        run.no_room = True
        log.info("strategy %s: %d steps wait: no free slot in the database", sid, n)
        await self._io(rt.recount_slots, self.store, sid, self.id, self._NOW)

        def again() -> None:
            run.no_room = False
            self._wake_soon()

        self._loop.call_later(self.config.tick_s, again)

    def _replaced_at_turn(self, t: rt.Transition) -> None:
        """A step admitted or moved on in this batch was ended in the commit instead:
        its target is unmanaged (failed), or such a failure stopped the strategy before
        its turn or its next state (aborted). Free its slot; count the failure."""
        run = self.runs.get(t.strategy_id)
        if run is None:
            return
        fl = _free_slot(run, t.step_id)
        if t.to_state == STEP_FAILED:
            if fl is not None:
                self._count_failure(run, fl.rec.target.name, fl.rec.stage)
            else:
                self._count_failure(run)
            self._log_failed(t, fl)
        self._wake_soon()  # its slot is free: fill it without waiting for another message

    def _retry_refused(self, retry: RetryScheduled) -> None:
        """A retry's record was refused: the step's row changed under this conductor
        (its fence or state; another program's write). Its worker ends without running
        the retry; the row is read back and the step taken over at a new fence, its
        recover hook looking at the attempt the row names (see :meth:`_settle`). Running
        the retry anyway left the row naming the attempt before, so a later takeover ran
        the same attempt again."""
        run = self.runs.get(retry.strategy_id)
        if run is None:
            return
        self._read_back(run, retry.step_id, _free_slot(run, retry.step_id), None)
        log.error(
            "step %s of strategy %s: the record of its retry (attempt %d of %s) was refused: "
            "its row changed under this conductor; reading it back",
            retry.step_id,
            retry.strategy_id,
            retry.attempt,
            retry.state,
        )

    def _wait_again(self, entries: list[rt.Transition]) -> None:
        """Entries the commit did not write (an end of their strategy was refused: that
        step still holds its slot and stage): they wait again, first in line, in order."""
        back: dict[int, list[rt.StepRecord]] = {}
        for t in entries:
            run = self.runs.get(t.strategy_id)
            fl = run.inflight.pop(t.step_id, None) if run is not None else None
            if run is None or fl is None:
                continue
            run.group_load[fl.rec.group_id] -= 1
            back.setdefault(run.id, []).append(fl.rec)
        for sid, recs in back.items():
            self.runs[sid].requeue_front(recs)

    def _stop_rules(self, batch: list[rt.Transition]) -> dict[int, rt.StopRule]:
        """For each strategy starting steps in this batch under a failure limit: how
        many more failures it tolerates, and what stops it past that."""
        rules: dict[int, rt.StopRule] = {}
        if not any(run.limits_failures for run in self.runs.values()):
            return rules  # (no limit anywhere: the batch need not be looked at)
        for t in batch:
            if t.from_state != STEP_INITIAL or t.strategy_id in rules:
                continue
            run = self.runs.get(t.strategy_id)
            fl = run.inflight.get(t.step_id) if run is not None else None
            if run is None or fl is None or not run.limits_failures:
                continue
            # (the steps a batch starts are of one phase: the stage that runs)
            rule = commit_stop_rule(run, fl.rec.stage)
            if rule is not None:
                if self._sharing and run.options.shareable:
                    # others' failures count too: the commit reads them (the slots row)
                    rule = dataclasses.replace(rule, limit=run.options.failure_limit)
                rules[run.id] = rule
        return rules

    def _count_failure(
        self, run: StrategyRun, who: str | None = None, phase: int | None = None
    ) -> None:
        """One more failed step (of target ``who``, in ``phase``); past the limit (the
        strategy's or its stage's; any canary's failure) the strategy stops."""
        why = count_failure(run, phase, who)
        if run.stopping is None and why is not None:
            run.stopping = "failure"
            run.stop_details = why
            _stop_flights(run, self._end_wait)
            log.warning("strategy %s: %s", run.id, run.stop_details)

    def _wake_soon(self) -> None:
        assert self._wake is not None
        self._wake.set()

    def _admit(
        self,
        run: StrategyRun,
        now: float,
        batch: list[rt.Transition],
        room: int,
    ) -> None:
        """Fill free slots (sliding window); once stopping, end every waiting step instead."""
        if run.lapsed or ((self._draining or run.paused) and run.stopping is None):
            return
        first = run.workflow.first_state
        while room > 0 and run.stopping is None:
            admitted = run.take_admissions(room)
            if not admitted:
                break
            room -= len(admitted)
            # Nothing here can stop the strategy: a target unmanaged now is failed, and
            # the threshold counted, by the commit.
            for rec in admitted:
                # A target unmanaged now is failed in the commit that would start it (as
                # of then, not as of when its page was loaded: it may be managed again).
                batch.append(self._entry(run, rec, first, "", now, claim=True))
                fl = run.inflight[rec.step_id] = InFlight(rec, first, rec.fence + 1)
                if first in run.workflow.max_visits:
                    fl.visits = {first: 1}
                run.group_load[rec.group_id] += 1
        if run.stopping is not None:
            # Ending waiting steps needs no slot, and must not wait for room in a batch.
            for rec in run.drain_pending():
                batch.append(
                    self._entry(run, rec, STEP_ABORTED, f"not started: {run.stop_details}", now)
                )
            if run.more_waiting:
                self._wake_soon()  # the ones not loaded yet are ended next round
        elif room <= 0 and run.take_admissions_possible():
            self._wake_soon()  # the batch was full, not the window: come back at once
        elif run.more_waiting and len(run.inflight) < run.cap:
            stage = run.current_stage()
            if stage is None or stage >= run.waiting_stage:
                # Free slots that nothing loaded can take (a group at its cap, or all
                # admitted): steps not loaded yet may. Load the next page first.
                run.starved = True
                self._wake_soon()

    def _entry(
        self,
        run: StrategyRun,
        rec: rt.StepRecord,
        to_state: str,
        details: str,
        now: float,
        claim: bool = False,
    ) -> rt.Transition:
        """The transition out of ``initial``; a claim bumps the fence (this owner's token).
        Into a first state that counts its visits: its first."""
        counted = to_state in run.workflow.max_visits
        return self._move(
            run,
            rec.step_id,
            STEP_INITIAL,
            rec.fence,
            to_state,
            details,
            0,
            now,
            rec.group_id,
            fence=rec.fence + 1 if claim else rec.fence,
            visits=json.dumps({to_state: 1}) if counted else None,
        )

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
    ) -> rt.Transition:
        """A transition of one of ``run``'s steps (of group ``group_id``: its entries and
        ends count in that group's slots too), with what follows from where it goes.
        ``from_visit``: the visit of ``from_state`` the step is in; ``visit``: the one of
        ``to_state`` it enters, ``visits`` (JSON) its visits then, if that state counts
        them (see :func:`fleetwave.domain.rules.next_visit`).

        Its deadline (when ``to_state`` runs out of time), and its not-started mark:
        while draining, :meth:`_apply` starts no next state, so the next owner will.
        """
        # (positional: the fields in order; keywords cost this hot path a quarter more)
        return rt.Transition(
            step_id,
            run.id,
            from_state,
            from_fence,
            to_state,
            from_fence if fence is None else fence,
            # (already clean but for a callback's or a hand edit's: checked in one place,
            # as a surrogate the database cannot store failed every commit of the batch)
            "" if type(details) is str and not details else details_text(details),
            # (written as the step's attempt when it ends: the attempts its last state
            # took; entering a state, the writer writes 1, that state's first)
            attempt,
            # not started: the conductor is draining (it enters the state, starts nothing)
            self._draining and to_state not in STEP_TERMINAL,
            self._deadline_of(run, to_state, now),
            False,
            group_id,
            from_visit,
            visit,
            visits,
        )

    @staticmethod
    def _deadline_of(run: StrategyRun, state: str, now: float) -> float | None:
        if state in STEP_TERMINAL:
            return None
        return now + run.defs[state].timeout_s

    def _apply(
        self,
        batch: list[rt.Transition],
        rejected: list[rt.Transition],
        marks: list[rt.CallbackMark] | None = None,
        answered: set[int] | None = None,
    ) -> None:
        """After the commit: start the next actions; drop steps whose CAS was rejected
        (``marks``: the batch's callback marks; a refused transition keeps its own, but
        for ``answered``: steps whose callback had been answered by another)."""
        bad = {id(t) for t in rejected}
        applied_by = (
            {m.step_id: m for m in marks or () if m.step_id is not None and m.outcome == "applied"}
            if rejected
            else {}
        )
        for t in rejected:
            self.stats.rejected += 1
            run = self.runs.get(t.strategy_id)
            if run is None:
                continue
            fl = _free_slot(run, t.step_id) or self._freed.get(t.step_id)
            if answered and t.step_id in answered:
                self._read_back(run, t.step_id, fl, t, answered=True)
            else:
                self._read_back(run, t.step_id, fl, t, applied_by.get(t.step_id))
            log.error(
                "transition %s -> %s of step %s rejected: fenced off or already entered",
                t.from_state,
                t.to_state,
                t.step_id,
            )
        runs = self.runs
        for t in batch:
            to_state = t.to_state
            if to_state in STEP_TERMINAL:
                if to_state == STEP_FAILED and id(t) not in bad:
                    self._log_failed(t)
                continue
            if bad and id(t) in bad:
                continue
            run = runs.get(t.strategy_id)
            fl = run.inflight.get(t.step_id) if run is not None else None
            if fl is None or fl.state != to_state:
                continue
            if self._draining:
                # Marked not started in this commit: the next owner starts it afresh.
                resolve_future(fl.go, False)
            else:
                self._release(fl, run)

    def _release(self, fl: InFlight, run: StrategyRun | None = None) -> None:
        """Let the step's worker run the action of the state just committed (G4).
        (``run``: the step's, when the caller has it at hand.)"""
        if run is None:
            run = self.runs[fl.rec.strategy_id]
        if run.lapsed:
            return  # its lease is lapsing: nothing starts (the next owner recovers it)
        fl.waiter = None
        if run.defs[fl.state].mode == "wait-for-callback":
            fl.waiter = asyncio.get_running_loop().create_future()
            early = run.early_callbacks.get(fl.rec.step_id)
            if early:
                # Callbacks that came before the wait began: offer them again, in order.
                run.early_callbacks[fl.rec.step_id] = [cb for cb in early if cb.state != fl.state]
                for cb in early:
                    if cb.state == fl.state:
                        self.post(CallbackArrived(cb))
        if fl.task is None:
            task = self._loop.create_task(self._step_worker(run, fl))
            fl.task = task
            self._workers.add(task)
            task.add_done_callback(self._worker_ended)
        else:
            go = fl.go
            if go is not None and not go.done():
                go.set_result(True)

    @property
    def stopping(self) -> bool:
        """A clean stop is under way (it hands its leases back)."""
        return self._draining

    def _worker_ended(self, task: asyncio.Task[None]) -> None:
        self._workers.discard(task)
        if self._draining and not self._workers and self._wake is not None:
            self._wake.set()  # a clean stop waits for the last worker: it is done

    async def _finish_done_runs(self) -> None:
        for run in list(self.runs.values()):
            if not run.is_done():
                continue
            if run.shared:
                # (helping: nothing more of it to drive here; its leader ends it)
                del self.runs[run.id]
                self._callbacks_seen.pop(run.id, None)
                self._forget_failures(run.id)
                log.info("strategy %s: none of its steps left to drive here", run.id)
                continue
            if self._sharing and await self._open_elsewhere(run):
                continue  # others still drive some of its steps
            if run.stopping == "abort":
                final, details = StrategyState.ABORTED, run.stop_details
            elif run.failed or run.stopping is not None:  # (a deadline: none failed)
                final = StrategyState.FAILED
                details = run.stop_details or f"{plural(run.failed, 'step')} failed"
            else:
                final, details = StrategyState.COMPLETE, ""
            ok = await self._io(
                rt.end_strategy,
                self.store,
                run.id,
                self.id,
                run.record.fence,
                final.value,
                details,
                self._NOW,
            )
            del self.runs[run.id]
            self._thaw(refreeze=bool(self.runs))
            self._callbacks_seen.pop(run.id, None)
            self._say_failures(run.id, 0.0)  # the ones not said yet, before how it ended
            self._forget_failures(run.id)
            self.finished[run.id] = final.value if ok else "lost"
            for driver in self.drivers.values() if ok else ():
                # optional: a driver that keeps what its targets did per strategy forgets it
                ended = getattr(driver, "strategy_ended", None)
                if ended is not None:
                    ended(run.id)
            if not ok:
                log.warning("strategy %s: lost to another conductor as it ended", run.id)
            elif final is StrategyState.COMPLETE:
                outcomes.info("strategy %s: ended complete", run.id)
            else:
                outcomes.warning("strategy %s: ended %s: %s", run.id, final.value, details)


def _answered(fl: InFlight) -> bool:
    """Whether the state ``fl`` is in was handed its report (done or failed), which its
    worker has yet to read: the step is about to move on."""
    return fl.waiter is not None and fl.waiter.done() and not fl.waiter.cancelled()


def _visit_over(cb: cbs.CallbackRecord, fl: InFlight) -> str | None:
    """Why a callback reports on a visit of its state that is over (None: it is not)."""
    if cb.state == fl.state:
        if cb.visit < fl.visit:
            return (
                f"late: for visit {cb.visit} of {cb.state}; the step is in visit {fl.visit} of it"
            )
        return None
    entered = fl.visits.get(cb.state)
    if entered is not None and cb.visit <= entered:
        return f"late: visit {cb.visit} of {cb.state} is over (the step is at {fl.state})"
    return None


def _visit_ahead(cb: cbs.CallbackRecord, fl: InFlight) -> bool:
    """Whether a callback reports on a visit of its state the step has not entered yet
    (early: kept until it does)."""
    if cb.state == fl.state:
        return cb.visit > fl.visit
    entered = fl.visits.get(cb.state)
    return entered is not None and cb.visit > entered


def _free_slot(run: StrategyRun, step_id: int) -> InFlight | None:
    """The step leaves the window (ended, or never to start): free its slot and tell its
    worker, if it has one, that there is nothing more to do. None if not in flight."""
    fl = run.inflight.pop(step_id, None)
    if fl is None:
        return None
    run.group_load[fl.rec.group_id] -= 1
    run.no_room = False  # (its slot is free in the database too, once this commits)
    resolve_future(fl.go, False)
    return fl


def _stop_flights(run: StrategyRun, end_wait: Callable[[InFlight], None]) -> None:
    """The strategy stops: its workers start no new attempt of their current state. An
    operator's abort also ends their waits on the target (a callback, the next poll):
    nothing of ours runs there meanwhile, and a wait may last hours. A callback wait
    ends through ``end_wait`` (after a callback already queued for it)."""
    abort = run.stopping == "abort"
    for fl in run.inflight.values():
        fl.stopped = True
        resolve_future(fl.backoff, None)  # a retry waiting out its backoff ends now
        if abort:
            fl.aborted = True
            if fl.waiter is not None:
                end_wait(fl)
            else:
                resolve_future(fl.waiting, None)
