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
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import logging
import math
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.exc import OperationalError

from fleetwave.catalog import resolve_workflow
from fleetwave.domain.errors import NotFound
from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_FAILED,
    STEP_INITIAL,
    STEP_TERMINAL,
    UNDRIVABLE,
    StrategyOptions,
    StrategyState,
    plural,
    unmanaged_reason,
)
from fleetwave.domain.registry import ActionNotFound, PluginError
from fleetwave.domain.rules import Decision, decide, details_text, failure
from fleetwave.domain.workflow import (
    ActionContext,
    Advance,
    NoRecoverHook,
    NotStarted,
    NotYet,
    Outcome,
    StateDef,
    StepFailed,
    TargetDriver,
    TransientError,
    WorkflowError,
)
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.drivers import make_drivers
from fleetwave.engine.clock import Clock, WallClock
from fleetwave.engine.messages import (
    ActionFinished,
    CallbackArrived,
    LeaseLost,
    Message,
    PauseChanged,
    RetryAnswer,
    RetryScheduled,
    StopRequested,
    StrategyClaimed,
)
from fleetwave.engine.run import InFlight, StrategyRun, Unsettled
from fleetwave.store import callbacks as cbs
from fleetwave.store import runtime as rt
from fleetwave.store.admin import options_from_json
from fleetwave.store.db import Store

log = logging.getLogger("fleetwave.engine")
#: what became of steps and strategies (failed steps, how a strategy ended): its own
#: logger, which a command that reports them itself (the demo) quiets
outcomes = logging.getLogger("fleetwave.engine.outcomes")

P = ParamSpec("P")
R = TypeVar("R")


#: a strategy's failed steps logged one line each; the ones after are counted, and said
#: in one line at most every FAILURES_SUMMED_EVERY_S seconds (and as it ends)
FAILURES_LOGGED_ALONE = 20
FAILURES_SUMMED_EVERY_S = 10.0

#: what :meth:`Conductor.run` says of a strategy whose workflow this process lacks
NOT_DRIVABLE_HERE = "not-drivable-here"


#: the conductors of this process whose gc.freeze is in force: a freeze is the
#: process's, so one conductor lifting it lifts it for all of them
_FREEZERS: weakref.WeakSet[Conductor] = weakref.WeakSet()


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


class SimulatedCrash(BaseException):
    """Raised by a fault plan to kill the conductor at a chosen point (tests only)."""


#: lease lengths a conductor may be given (``--lease-ttl``), seconds
#: (the watchdog stops actions at 80 % of the lease, up to a tick and a few busy
#: timeouts (a twentieth each) late: under 15 s that could be after it ran out)
LEASE_TTL_MIN_S = 15.0
LEASE_TTL_MAX_S = 3600.0
#: a conductor renews its leases at least this often, however long they last
RENEW_MAX_S = 10.0
#: a periodic pass this late means the loop was blocked: said in a warning
STALL_WARN_S = 2.0
#: while the database is out, a conductor says so this often (and when it is back)
OUTAGE_LOG_EVERY_S = 30.0
#: ... once it has been out this long (a moment's lock by an operator's command is not)
OUTAGE_QUIET_S = 5.0
#: ... as an error (not a warning) once it has been out this long
OUTAGE_ERROR_S = 60.0


class StoreReplaced(Exception):
    """The database file was removed or replaced while this conductor had it open: its
    writes would go to the old file, unseen by anyone. It stops. ``advice``: what the
    operator does next."""

    def __init__(self, message: str, advice: str) -> None:
        super().__init__(message)
        self.advice = advice


class StoreUnavailable(Exception):
    """The conductor was asked to stop while the database did not answer: it stopped
    without handing its leases back (they run out, and another conductor takes over)."""


class _Fresh:
    """A store call's argument worked out again at each attempt (see ``Conductor._io``)."""

    __slots__ = ("value",)

    def __init__(self, value: Callable[[], Any]) -> None:
        self.value = value


@dataclass
class EngineConfig:
    #: how long a strategy's lease (and its steps') lasts unless renewed: a conductor
    #: that died on another host is taken over this long after its last renewal
    lease_ttl_s: float = 30.0
    tick_s: float = 1.0
    seed: int = 0
    #: record each dispatch latency (commit done -> action started), seconds
    measure_latency: bool = False
    #: most transitions per group commit: bounds how many actions one commit releases
    #: at once, and so the dispatch latency of the last of them
    batch_max: int = 128
    #: waiting steps loaded from the database at a time when free slots need them
    #: (0: twice max parallel, at least 512): the first actions start without loading
    #: the whole strategy first. The first load takes just enough to fill the window.
    waiting_page: int = 0
    #: while the dispatcher is idle, waiting steps are topped up this many at a time
    #: (0: as ``waiting_page``), so a busy moment rarely has to stop for a page load
    prefetch_page: int = 128
    #: on a clean stop, how long running actions may take to finish and commit
    shutdown_grace_s: float = 10.0
    #: how long an action cancelled (its deadline, a stop) has to end before it is
    #: abandoned (it catches CancelledError): its step fails, or its lease is left to
    #: run out
    abandon_after_s: float = 10.0
    #: a database error that is not an outage is retried this many times before the
    #: conductor stops
    store_retries_max: int = 8
    #: an outage (locked, busy, unreachable, full, read-only) is retried for as long as
    #: it lasts (the lease watchdog stops the actions meanwhile); False: as any error
    ride_out_outages: bool = True
    #: after a takeover, the recover hook gets what is left of the state's recorded
    #: deadline plus this much (to observe the target even when the deadline has passed)
    recover_grace_s: float = 30.0
    #: after loading a strategy, move what is loaded out of the collector's sight
    #: (gc.freeze): full collections otherwise rescan every loaded step, pausing
    #: dispatch for 50-200 ms at a time, while they find almost nothing to free. Given
    #: back to the collector when a strategy ends and when the conductor stops (what
    #: a freeze holds is never freed otherwise, if it is part of a reference cycle)
    gc_freeze: bool = True
    #: False makes a stalled conductor (a long GC pause, SIGSTOP, a partition from the
    #: database): it keeps running but stops renewing its leases. For fault injection.
    renew_leases: bool = True


@dataclass
class EngineStats:
    transitions: int = 0
    batches: int = 0
    rejected: int = 0
    stale_outcomes: int = 0
    store_retries: int = 0
    dispatch_latency_s: list[float] = field(default_factory=list)


CrashHook = Callable[[str], None]


class Conductor:
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
        self.id = conductor_id or f"c-{uuid.uuid4().hex[:12]}"
        self.stats = EngineStats()
        self.runs: dict[int, StrategyRun] = {}
        self.finished: dict[int, str] = {}
        self._crash_hook = crash_hook
        self._inbox: list[Message] = []
        self._wake: asyncio.Event | None = None
        self._workers: set[asyncio.Task[None]] = set()
        self._writer = rt.TransitionWriter(store, self.id)
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

    # -- plumbing -------------------------------------------------------------------

    async def _io(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a store call (one transaction) on the loop.

        A database error rolls the transaction back, and the call is retried with
        backoff (up to 5 s). An outage (the database locked by another program, busy,
        unreachable, full, read-only) is ridden out however long it lasts: meanwhile
        the lease watchdog stops this conductor's actions, and once the database
        answers it goes on (claiming anew what it had to let go). Asked to stop during
        an outage, it gives up once the outage has lasted the shutdown grace period
        (:class:`StoreUnavailable`): its leases run out by themselves. Any
        other error is retried ``store_retries_max`` times, then propagates and this
        conductor stops (its leases expire and another takes over).

        ``self._NOW`` and ``self._LEASE`` as arguments are worked out at each attempt:
        a call that went through after an outage writes the time it went through, and
        a lease from then, not from before the outage.
        """
        failures = 0
        name = ""  # said only once a call fails
        started = said = 0.0
        fresh = [i for i, a in enumerate(args) if type(a) is _Fresh]
        while True:
            self._attempt_at = self._loop.time()
            call_args: Any = args
            if fresh:
                call_args = list(args)
                for i in fresh:
                    call_args[i] = call_args[i].value()
            try:
                result = fn(*call_args, **kwargs)
            except rt.ConductorUnknown:
                raise StoreReplaced(
                    f"the database {self.store.url} no longer knows this conductor (its "
                    "row is gone: a backup was restored into the file while it ran, or "
                    "the file was overwritten): stopped without writing to it",
                    "run 'fleetwave check' on the database as it is now, then start "
                    "the conductor again (it drives what the database says is applying)",
                ) from None
            except OperationalError as exc:
                failures += 1
                self.stats.store_retries += 1
                outage = self.config.ride_out_outages and self.store.hooks.is_outage(exc)
                if self.store.hooks.needs_new_connections(exc):
                    # A file read-only when a connection opened it (its mode or owner
                    # changed, a read-only mount): that connection stays read-only once
                    # the file is writable again, so every attempt opens new ones (it
                    # never recovered).
                    self._writer.close()
                    self.store.dispose()
                now = self._loop.time()
                if failures == 1:
                    started = now
                    said = now - OUTAGE_LOG_EVERY_S + OUTAGE_QUIET_S
                    # in an operator's words ("claim strategies"), not the function's name
                    name = getattr(fn, "__name__", "store call").replace("_", " ")
                if not outage:
                    if failures > self.config.store_retries_max:
                        raise
                    log.warning(
                        "store-retry: %s failed (%s); retry %d of %d",
                        name,
                        exc.orig,
                        failures,
                        self.config.store_retries_max,
                    )
                elif (
                    self._stop is not None
                    and self._stop.is_set()
                    and now - started >= self.config.shutdown_grace_s
                ):
                    log.error(
                        "store-retry: %s failed (%s); stopping without it: the database "
                        "has not answered for %.0fs",
                        name,
                        exc.orig,
                        now - started,
                    )
                    raise StoreUnavailable(str(exc.orig)) from exc
                elif now - said >= OUTAGE_LOG_EVERY_S:
                    # Not for a moment's contention (an operator's command holding the
                    # lock for a second or two); then every half minute: it may last hours.
                    said = now
                    log.log(
                        # an error once it is more than a moment: nothing moves meanwhile
                        logging.ERROR if now - started >= OUTAGE_ERROR_S else logging.WARNING,
                        "store-retry: %s failed (%s) %d time%s over %.0fs; retrying until "
                        "the database answers",
                        name,
                        exc.orig,
                        failures,
                        "" if failures == 1 else "s",
                        now - started,
                    )
                await asyncio.sleep(min(5.0, 0.05 * 2 ** min(failures, 7)))
                continue
            if failures and self._attempt_at - started >= OUTAGE_QUIET_S:
                log.warning(
                    "store-retry: %s went through after %d failed tr%s over %.0fs",
                    name,
                    failures,
                    "y" if failures == 1 else "ies",
                    self._loop.time() - started,
                )
            return result

    def post(self, msg: Message) -> None:
        """Send the dispatcher a message. Never blocks; safe from any task on the loop."""
        self._inbox.append(msg)
        if self._wake is not None:
            self._wake.set()

    def receive_callback(
        self, step_id: int, state: str, kind: str, details: str = ""
    ) -> cbs.CallbackRecord:
        """Store a target's callback and answer at once (G6): one INSERT, no step lock.

        The dispatcher applies it (or records why it was ignored) on its next turn.
        """
        record = cbs.accept_callback(self.store, step_id, state, kind, details, self.clock.now())
        self._first_sight(record)
        self.post(CallbackArrived(record))
        return record

    def _first_sight(self, record: cbs.CallbackRecord) -> bool:
        """Whether this conductor has not posted this callback yet (and now has)."""
        seen = self._callbacks_seen.setdefault(record.strategy_id, set())
        if record.id in seen:
            return False
        seen.add(record.id)
        return True

    def _sink(self, step_id: int, state: str, kind: str, details: str) -> None:
        self.receive_callback(step_id, state, kind, details)

    def _crash_point(self, point: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(point)

    def _lease_until(self) -> float:
        return self.clock.now() + self.config.lease_ttl_s

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
        try:
            self._db_identity = self.store.file_identity()
        except OSError:
            self._db_identity = None
        self._patient = patient
        self._wake = asyncio.Event()
        # The hot path asks for the loop on every action: asyncio.get_running_loop()
        # makes a getpid() system call each time (fork safety), so it is kept here.
        self._loop = asyncio.get_running_loop()
        clean = False
        for driver in self.drivers.values():
            if hasattr(driver, "callback_sink"):
                driver.callback_sink = self._sink  # simulated agents call us back here
        try:
            await self._claim(register=True)
            if on_ready is not None:
                on_ready()
            self._watch_leases()
            periodic = asyncio.create_task(self._periodic(), name="fleetwave-periodic")
            periodic.add_done_callback(self._periodic_ended)
            try:
                await self._dispatch_loop(stop)
            finally:
                periodic.cancel()
                await asyncio.gather(periodic, return_exceptions=True)
            clean = True
        finally:
            # first: what follows may raise (a stop during an outage), or be cancelled
            self._thaw(refreeze=False)
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
                await self._io(rt.release_conductor, self.store, self.id, self._NOW, held)
            self._writer.close()
        return self.finished

    # -- the garbage collector ------------------------------------------------------------

    def _freeze(self) -> None:
        """Move what is loaded now out of the collector's sight (``gc_freeze``)."""
        if self.config.gc_freeze:
            gc.freeze()
            self._frozen, self._refreeze_after = True, None
            _FREEZERS.add(self)

    def _thaw(self, *, refreeze: bool) -> None:
        """A strategy ended (or the conductor stops): give what the freeze holds back to
        the collector, which frees what of it is garbage now (an ended strategy's steps,
        a finished run's reference cycles: a freeze never frees them). ``refreeze``: other
        strategies go on, so freeze again once a full collection has run (until then,
        full collections rescan their steps). The freeze is the process's: the other
        conductors that froze (a simulator's, tests') freeze again then too."""
        if not self._frozen:
            if not refreeze:
                self._refreeze_after = None
            return
        gc.unfreeze()
        collections = gc.get_stats()[2]["collections"]
        self._frozen = False
        self._refreeze_after = collections if refreeze else None
        _FREEZERS.discard(self)
        for other in list(_FREEZERS):
            other._frozen, other._refreeze_after = False, collections
            _FREEZERS.discard(other)

    def _refreeze_if_collected(self) -> None:
        if (
            self._refreeze_after is not None
            and gc.get_stats()[2]["collections"] > self._refreeze_after
        ):
            self._refreeze_after = None
            if self.runs:
                self._freeze()

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

    # -- the periodic pass ---------------------------------------------------------------

    async def _periodic(self) -> None:
        # A third of the lease, and at least every RENEW_MAX_S: "serving" is read as
        # renewed within SERVING_WITHIN_S, whatever the lease's length.
        renew_every = min(self.config.lease_ttl_s / 3, RENEW_MAX_S)
        loop = asyncio.get_running_loop()
        last_renew = loop.time()
        while True:
            slept_at = loop.time()
            await asyncio.sleep(self.config.tick_s)
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
                in_flight = [i for run in self.runs.values() for i in run.inflight]
                renewing = list(self.runs.values())
                # The lease written runs from now (it is computed once, here), however
                # long the write then takes: the watchdog measures from here too.
                await self._io(
                    rt.heartbeat,
                    self.store,
                    self.id,
                    self._NOW,
                    self._LEASE,
                    in_flight,
                )
                # The lease written runs from the attempt that went through.
                last_renew = self._attempt_at
                for run in renewing:
                    run.lease_from = max(run.lease_from, last_renew)
            states = await self._io(rt.strategy_states, self.store, list(self.runs))
            for sid, (state, owner) in states.items():
                held = self.runs.get(sid)  # dropped while this read was retried: skip it
                if held is None:
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
            if self._draining:
                continue  # stopping: take on nothing new
            if self._wanted is None or self._wanted - set(self.runs) - set(self.finished):
                await self._claim()

    async def _poll_callbacks(self, strategy_ids: list[int]) -> None:
        """Pick up callbacks stored by other processes (an API server, an agent endpoint)."""
        for record in await self._io(cbs.open_callbacks, self.store, strategy_ids, 0):
            if self._first_sight(record):
                self.post(CallbackArrived(record))

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
                        serves_all=False,
                    )
                return
        claimed = await self._io(
            rt.claim_strategies,
            self.store,
            self.id,
            self._NOW,
            self._LEASE,
            todo,
            register=register,
            driving=set(self.runs) | self._claiming,
            serves_all=self._wanted is None,
            skip=self._not_here,
        )
        started = self._attempt_at  # its lease runs from the attempt that went through
        for rec in claimed:
            self._claiming.add(rec.id)
            self._claimed_at[rec.id] = started
            self.post(StrategyClaimed(rec))
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
                            _resolve(fl.backoff, None)
                    log.info("stopping: draining %d running actions", len(self._workers))
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
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(
                                self._wake.wait(), max(0.0, drain_until - loop.time())
                            )
                if self._fatal is not None:
                    raise self._fatal
                self._wake.clear()
                cut = self.config.batch_max
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
            if isinstance(msg, RetryScheduled):
                if self._reported(msg) is None or (msg.started and self._draining):
                    # Stale: the step moved on, or is another worker's now (taken over
                    # at a new fence): this worker must not run the retry. Or a clean
                    # stop: nothing starts, the retry is left (marked) to the next owner.
                    _resolve(msg.handled, RetryAnswer.REFUSED)
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
                    )
                )
            elif isinstance(msg, CallbackArrived):
                self._on_callback(msg.record, marks)
            elif isinstance(msg, StrategyClaimed):
                self._claiming.discard(msg.record.id)
                recover += await self._adopt(msg.record, events, batch, now)
                for record in await self._io(cbs.open_callbacks, self.store, [msg.record.id], 0):
                    if self._first_sight(record):
                        claimed_callbacks.append(record)
            elif isinstance(msg, StopRequested):
                self._request_stop(msg.strategy_id, events)
            elif isinstance(msg, PauseChanged):
                self._set_paused(msg.strategy_id, msg.paused, events)
            elif isinstance(msg, LeaseLost):
                self._drop_run(msg.strategy_id, lapsed=msg.lapsed, later=msgs[i + 1 :])
            else:
                self._on_finished(msg, now, batch, events, marks)
        if self._stale:
            self._log_stale()
        self._stop_moves_before_the_stop(batch, now)
        # No action running (a strategy just claimed, or all ended): a bigger commit
        # delays no one's dispatch, and a whole first wave starts together.
        limit = self.config.batch_max * (1 if self._workers else 2)
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
            batch = [t for t in batch if t.strategy_id in self.runs]
            marks = [m for m in marks if m.strategy_id in self.runs]
            deadlines = [d for d in deadlines if d.strategy_id in self.runs]
            touched = {t.strategy_id for t in batch} | {m.strategy_id for m in marks}
            touched.update(d.strategy_id for d in deadlines)
            fences = {sid: self.runs[sid].record.fence for sid in touched}
            result = await self._io(
                self._writer.commit,
                batch,
                events,
                self._NOW,
                self._LEASE,
                marks,
                fences,
                deadlines,
                self._stop_rules(batch),
                self._lapsing,
            )
            self._committed_at = time.perf_counter()
            self.stats.batches += 1
            self.stats.transitions += len(batch) - len(result.rejected) - len(result.deferred)
            self._crash_point("after-commit")
            # First: entries the commit turned into failed (an unmanaged target) or, after
            # that crossed the failure threshold, aborted, leave the window (_apply then
            # finds them gone and starts nothing for them).
            for t in result.replaced:
                self._replaced_at_turn(t)
            if result.deferred:
                self._wait_again(result.deferred)
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
                await self._io(
                    self._writer.commit, [], late, self._NOW, self._LEASE, None, fences_late
                )
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
            self._apply(batch, result.rejected, marks)
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
        await self._mark_aborting()
        await self._finish_done_runs()

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
            log.warning("step %s of strategy %s: transition refused; row %s", step_id, run.id, what)

        def end(
            row: rt.StepRecord,
            to_state: str,
            why: str,
            what: str,
            *,
            fence: int | None = None,
            attempt: int | None = None,
        ) -> None:
            attempt = row.attempt if attempt is None else attempt
            batch.append(
                self._move(
                    run, row.step_id, row.state, row.fence, to_state, why, attempt, now, fence=fence
                )
            )
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
            if (
                refused is not None
                and row.state == refused.from_state != STEP_INITIAL
                and refused.to_state not in seen
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
                )
                if u.mark is not None:
                    marks.append(u.mark)
                continue
            if counted and row.state != STEP_FAILED:
                run.failed -= 1
            if row.state in STEP_TERMINAL:
                if row.state == STEP_FAILED and not counted:
                    self._count_failure(run, row.target.name)
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
            elif refused is not None and row.state == refused.from_state:
                # Its decision's next state was entered already (the row was set back):
                # that state cannot be entered twice (G1).
                why = f"{row.state}: set back after it had entered {refused.to_state}"
                end(row, STEP_FAILED, why, f"{why}: failed")
            elif row.not_started and run.stopping is not None:
                why = _not_started(run, row.state, row.attempt)
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
            self._LEASE,
            held=(run.id, run.record.fence),
        )
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
                self._LEASE,
                marks,
                {run.id: run.record.fence},
            )
            refused_now = {id(t) for t in result.rejected}
            for t in batch:
                if id(t) in refused_now or run.id in result.lost:
                    continue
                self.stats.transitions += 1
                done(t.step_id)
                row = again.get(t.step_id)
                if t.to_state == STEP_FAILED and row is None:
                    self._count_failure(run)
                if row is not None and t.to_state not in STEP_TERMINAL:
                    row.fence, row.state = t.fence, t.to_state
                    self._back_in_flight(run, row, t.to_state, recovering=False)
            for sid in result.lost:
                self._drop_run(sid)
        if run.id not in self.runs:
            return
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
        self._release(_put_in_flight(run, step, state, recovering=recovering))

    def _settle_later(self, run: StrategyRun) -> None:
        run.settle_timer = None
        run.settle_due = True
        self._wake_soon()

    async def _mark_aborting(self) -> None:
        """abort-requested -> aborting, once the dispatcher has stopped admitting; a
        stop for failures is written in the strategy's details."""
        for run in self.runs.values():
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

    def _on_callback(self, cb: cbs.CallbackRecord, marks: list[rt.CallbackMark]) -> None:
        """Hand a callback to the step waiting for it, keep it for later, or ignore it.

        A callback that resolves a wait is marked ``applied`` only together with the
        transition it causes (see :meth:`_on_finished`): if this conductor dies in
        between, the callback is still open and the next owner applies it.
        """
        run = self.runs.get(cb.strategy_id)
        if run is None:
            # Not ours (yet): its owner answers it, perhaps us once we claim the strategy.
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
        elif states.index(cb.state) > states.index(fl.state) or (
            cb.state == fl.state
            and fl.waiter is None
            and cb.kind != "heartbeat"
            and run.workflow.state(fl.state).mode == "wait-for-callback"
        ):
            # Early: the target answered before the step started waiting. Keep it (once:
            # a settle or a takeover offers the step's open callbacks again).
            kept = run.early_callbacks.setdefault(cb.step_id, [])
            if all(k.id != cb.id for k in kept):
                kept.append(cb)
        elif cb.state != fl.state:
            ignore(f"late or out of order: step has moved on to {fl.state}")
        elif cb.kind == "heartbeat":
            marks.append(rt.CallbackMark(cb.id, "applied", "heartbeat noted", cb.strategy_id))
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

    async def _adopt(
        self,
        rec: rt.StrategyRecord,
        events: list[rt.Event],
        batch: list[rt.Transition],
        now: float,
    ) -> list[InFlight]:
        """Take over a claimed strategy from the database alone (G4, recovery)."""
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
        if rec.state == StrategyState.PAUSED:
            run.paused = True
            events.append(rt.Event("pause-seen", "paused by operator (on takeover)", rec.id))
        lost, run.failed = await self._io(rt.load_started_steps, self.store, rec.id)
        # A staged strategy is loaded whole: which stage comes next is then decided on
        # every waiting step, not on the assumption that pages come in stage order.
        first = self.config.waiting_page or max(run.cap, self._prefetch_page())
        await self._load_waiting(run, everything=opts.stages_by_group, page=first)
        limit = opts.failure_limit
        if limit is not None and run.failed > limit:
            run.stopping = "failure"
            # as the conductor that saw it said it: the failure that went past the limit
            who = await self._io(rt.failure_past_limit, self.store, rec.id, limit)
            run.stop_details = _stop_details(run.options, limit + 1, who)
        if rec.state in (StrategyState.ABORT_REQUESTED, StrategyState.ABORTING):
            # The operator's abort wins over the failure threshold, as it does when the
            # abort reaches a running conductor (found by the simulator's abort fault).
            run.stopping = "abort"
            run.stop_details = "aborted by operator"
            events.append(rt.Event("abort-seen", "operator abort requested (on takeover)", rec.id))
        for step in lost:
            if step.not_started and step.attempt <= 1:
                # It starts afresh here: its time starts now. (A recorded retry keeps
                # its deadline: its due time and timeout.)
                step.deadline_at = self._deadline_of(run, step.state, now)
        taken = await self._io(
            rt.take_over_steps, self.store, lost, self.id, self._NOW, self._LEASE
        )
        if len(taken) != len(lost):
            events.append(
                rt.Event("takeover-incomplete", f"{len(lost) - len(taken)} steps moved on", rec.id)
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
        out = []

        def end(step: rt.StepRecord, to_state: str, details: str) -> None:
            batch.append(
                self._move(
                    run, step.step_id, step.state, step.fence, to_state, details, step.attempt, now
                )
            )

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
                self._count_failure(run, step.target.name)
                failed_now.add(step.step_id)
        for step in taken:
            if step.step_id in failed_now:
                continue
            if step.not_started and run.stopping is not None:
                # Nothing of this state (or of this attempt of it) ran, and nothing new
                # may start: end it here.
                end(step, STEP_ABORTED, _not_started(run, step.state, step.attempt))
                continue
            # A clean stop records the states it entered but never started: those start
            # afresh; any other may have started, so its recover hook looks first.
            fl = _put_in_flight(run, step, step.state, recovering=not step.not_started)
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
                rec.id,
                plural(len(out), "step"),
                recovering,
                len(out) - recovering,
            )
        self.runs[rec.id] = run
        self._freeze()
        if run.stopping is None and rec.state == StrategyState.APPLYING and not lost:
            log.info("strategy %s: driving its waiting steps", rec.id)
        return out

    def _page(self, run: StrategyRun) -> int:
        return self.config.waiting_page or max(2 * run.cap, 512)

    def _prefetch_page(self) -> int:
        return self.config.prefetch_page or self.config.waiting_page or 512

    async def _prefetch(self) -> bool:
        """Nothing to do: top up one strategy's waiting steps by a small page, if short.

        Loading a full page when slots free up would stop every running step's
        dispatch for milliseconds; the dispatcher's idle moments cost nobody.
        """
        for run in self.runs.values():
            if run.more_waiting and run.stopping is None and run.pending_count() < self._page(run):
                await self._load_waiting(run, everything=False, page=self._prefetch_page())
                return True
        return False

    async def _load_waiting(
        self, run: StrategyRun, *, everything: bool, page: int | None = None
    ) -> None:
        """Load the next page of waiting steps (or all of them), in admission order."""
        page = page or self._page(run)
        while True:
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
            )
            for st in open_steps
        ]
        events = [rt.Event("strategy-undrivable", reason, rec.id)]
        await self._io(
            self._writer.commit, batch, events, self._NOW, self._LEASE, [], {rec.id: rec.fence}
        )
        ok = await self._io(
            rt.end_strategy, self.store, rec.id, self.id, rec.fence, final.value, reason, self._NOW
        )
        self.finished[rec.id] = final.value if ok else "lost"

    def _failure_details(self, run: StrategyRun, who: str | None = None) -> str:
        return _stop_details(run.options, run.failed, who)

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

    def _on_finished(
        self,
        msg: ActionFinished,
        now: float,
        batch: list[rt.Transition],
        events: list[rt.Event],
        marks: list[rt.CallbackMark],
    ) -> None:
        reported = self._reported(msg)
        if msg.callback_id is not None:
            # The callback counts as applied exactly when its transition commits.
            outcome, why = ("applied", f"moved the step on from {msg.state}")
            if reported is None:
                outcome, why = ("ignored", "its step had moved on")
            step = msg.step_id if reported is not None else None
            marks.append(rt.CallbackMark(msg.callback_id, outcome, why, msg.strategy_id, step))
        if reported is None:
            _resolve(msg.go, False)  # its worker has nothing more to do
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
                self._count_failure(run, fl.rec.target.name)
        else:
            fl.state = decision.to_state
            fl.waiter = None  # the next state's waiter is made when its action starts

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
            )

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
                run, t.step_id, t.from_state, t.from_fence, STEP_ABORTED, details, t.attempt, now
            )

    def _replaced_at_turn(self, t: rt.Transition) -> None:
        """A step admitted or moved on in this batch was ended in the commit instead:
        its target is unmanaged (failed), or such a failure stopped the strategy before
        its turn or its next state (aborted). Free its slot; count the failure."""
        run = self.runs.get(t.strategy_id)
        if run is None:
            return
        fl = _free_slot(run, t.step_id)
        if t.to_state == STEP_FAILED:
            self._count_failure(run, fl.rec.target.name if fl is not None else None)
            self._log_failed(t, fl)
        self._wake_soon()  # its slot is free: fill it without waiting for another message

    def _read_back(
        self,
        run: StrategyRun,
        step_id: int,
        fl: InFlight | None,
        refused: rt.Transition | None,
        mark: rt.CallbackMark | None = None,
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
        )
        run.settle_due = True
        self._wake_soon()  # settle it without waiting for a message

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
        for t in batch:
            if t.from_state != STEP_INITIAL or t.strategy_id in rules:
                continue
            run = self.runs.get(t.strategy_id)
            limit = run.options.failure_limit if run is not None else None
            if run is None or limit is None:
                continue
            # the commit names the target whose failure crossed the limit
            details = _stop_details(run.options, limit + 1, rt.StopRule.TARGET)
            rules[run.id] = rt.StopRule(limit - run.failed, details)
        return rules

    def _count_failure(self, run: StrategyRun, who: str | None = None) -> None:
        """One more failed step (of target ``who``); past the limit the strategy stops."""
        run.failed += 1
        limit = run.options.failure_limit
        if run.stopping is None and limit is not None and run.failed > limit:
            run.stopping = "failure"
            run.stop_details = self._failure_details(run, who)
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
                run.inflight[rec.step_id] = InFlight(rec, first, rec.fence + 1)
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
        """The transition out of ``initial``; a claim bumps the fence (this owner's token)."""
        return self._move(
            run,
            rec.step_id,
            STEP_INITIAL,
            rec.fence,
            to_state,
            details,
            0,
            now,
            fence=rec.fence + 1 if claim else rec.fence,
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
        *,
        fence: int | None = None,
    ) -> rt.Transition:
        """A transition of one of ``run``'s steps, with what follows from where it goes.

        Its deadline (when ``to_state`` runs out of time), and its not-started mark:
        while draining, :meth:`_apply` starts no next state, so the next owner will.
        """
        return rt.Transition(
            step_id=step_id,
            strategy_id=run.id,
            from_state=from_state,
            from_fence=from_fence,
            to_state=to_state,
            fence=from_fence if fence is None else fence,
            # (already clean but for a callback's or a hand edit's: checked in one place,
            # as a surrogate the database cannot store failed every commit of the batch)
            details=details_text(details),
            # (written as the step's attempt when it ends: the attempts its last state
            # took; entering a state, the writer writes 1, that state's first)
            attempt=attempt,
            not_started=self._draining and to_state not in STEP_TERMINAL,
            deadline_at=self._deadline_of(run, to_state, now),
        )

    @staticmethod
    def _deadline_of(run: StrategyRun, state: str, now: float) -> float | None:
        if state in STEP_TERMINAL:
            return None
        return now + run.workflow.state(state).timeout_s

    def _apply(
        self,
        batch: list[rt.Transition],
        rejected: list[rt.Transition],
        marks: list[rt.CallbackMark] | None = None,
    ) -> None:
        """After the commit: start the next actions; drop steps whose CAS was rejected
        (``marks``: the batch's callback marks; a refused transition keeps its own)."""
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
            self._read_back(run, t.step_id, fl, t, applied_by.get(t.step_id))
            log.error(
                "transition %s -> %s of step %s rejected: fenced off or already entered",
                t.from_state,
                t.to_state,
                t.step_id,
            )
        for t in batch:
            if t.to_state in STEP_TERMINAL:
                if t.to_state == STEP_FAILED and id(t) not in bad:
                    self._log_failed(t)
                continue
            if id(t) in bad:
                continue
            run = self.runs.get(t.strategy_id)
            fl = run.inflight.get(t.step_id) if run is not None else None
            if fl is None or fl.state != t.to_state:
                continue
            if self._draining:
                # Marked not started in this commit: the next owner starts it afresh.
                _resolve(fl.go, False)
            else:
                self._release(fl)

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
                outcomes.warning("strategy %s: step %s%s failed: %s", sid, step_id, who, why)
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
            )
        self._failures_unsaid[sid] = (0, now)

    def _forget_failures(self, sid: int) -> None:
        """A strategy no longer driven here: its failure counts go."""
        self._failures_logged.pop(sid, None)
        self._failures_unsaid.pop(sid, None)

    def _release(self, fl: InFlight) -> None:
        """Let the step's worker run the action of the state just committed (G4)."""
        run = self.runs[fl.rec.strategy_id]
        if run.lapsed:
            return  # its lease is lapsing: nothing starts (the next owner recovers it)
        fl.waiter = None
        if run.workflow.state(fl.state).mode == "wait-for-callback":
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
            _resolve(fl.go, True)

    def _worker_ended(self, task: asyncio.Task[None]) -> None:
        self._workers.discard(task)
        if self._draining and not self._workers and self._wake is not None:
            self._wake.set()  # a clean stop waits for the last worker: it is done

    # -- action deadlines ------------------------------------------------------------------

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

    async def _finish_done_runs(self) -> None:
        for run in list(self.runs.values()):
            if not run.is_done():
                continue
            if run.stopping == "abort":
                final, details = StrategyState.ABORTED, run.stop_details
            elif run.failed:
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

    # -- workers -------------------------------------------------------------------------

    async def _step_worker(self, run: StrategyRun, fl: InFlight) -> None:
        """The step's one worker: run a state's action, report, wait for the commit, repeat.

        It only reads its :class:`InFlight` after the dispatcher resolved ``go``, and
        reports by message (G2); it ends when told to (terminal, fenced off, draining).
        """
        recovering = fl.recovering
        loop = self._loop
        while True:
            if self.config.measure_latency and not recovering:
                self.stats.dispatch_latency_s.append(time.perf_counter() - self._committed_at)
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
                log.error("worker of step %s in %s: %s", fl.rec.step_id, fl.state, said)
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
        st = run.workflow.state(state)
        timeout_s = st.timeout_s
        #: the attempt the row names (a takeover goes on from there, not from 1 again)
        resume = recovering
        start_retry = False
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
                f"{_utc(self.clock.now())} (a retry taken over)"
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
        while True:
            attempts += 1
            try:
                if driver is None:
                    raise StepFailed(f"no driver named '{rec.target.driver}' on this conductor")
                ctx = ActionContext(
                    target=rec.target,
                    state=state,
                    attempt=attempts,
                    strategy_id=run.id,
                    step_id=rec.step_id,
                    driver=driver,
                    callback_expected=waiter is not None,
                    recovering=recovering,
                    polling=st.mode == "poll",
                    is_stopping=(lambda: fl.stopped) if recovering else None,
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
                decision = decide(run.workflow.state_names, state, outcome)
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
                                run.workflow.state_names, state, _callback_outcome(came, chosen)
                            )
                        except StepFailed as reported:
                            decision = failure(state, details_text(reported) or "failed")
                        break
                if isinstance(exc, _StateDeadline):
                    reason = f"timed out after {st.timeout_s:g}s"
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
                        f"{failed}; attempt {attempts + 1} from {_utc(due)}",
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
                    now_on = f"{failed}; attempt {attempts + 1} started {_utc(self.clock.now())}"
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
                )
                decision = failure(
                    state, f"{type(exc).__name__}: {said}" if said else type(exc).__name__
                )
            break
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
        timer = self._loop.call_later(delay, _resolve, early, None)
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
                _resolve(fl.waiting, None)
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
        came = await self._io(cbs.open_callback_of, self.store, fl.rec.step_id, fl.state)
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
                _resolve(ended, None)

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


def _put_in_flight(
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


def _free_slot(run: StrategyRun, step_id: int) -> InFlight | None:
    """The step leaves the window (ended, or never to start): free its slot and tell its
    worker, if it has one, that there is nothing more to do. None if not in flight."""
    fl = run.inflight.pop(step_id, None)
    if fl is None:
        return None
    run.group_load[fl.rec.group_id] -= 1
    _resolve(fl.go, False)
    return fl


def _stop_flights(run: StrategyRun, end_wait: Callable[[InFlight], None]) -> None:
    """The strategy stops: its workers start no new attempt of their current state. An
    operator's abort also ends their waits on the target (a callback, the next poll):
    nothing of ours runs there meanwhile, and a wait may last hours. A callback wait
    ends through ``end_wait`` (after a callback already queued for it)."""
    abort = run.stopping == "abort"
    for fl in run.inflight.values():
        fl.stopped = True
        _resolve(fl.backoff, None)  # a retry waiting out its backoff ends now
        if abort:
            fl.aborted = True
            if fl.waiter is not None:
                end_wait(fl)
            else:
                _resolve(fl.waiting, None)


def _not_started(run: StrategyRun, state: str, attempt: int) -> str:
    """Why a step entered but not started (its state, or a recorded retry of it: its
    ``attempt``) ends aborted once its strategy stops."""
    if attempt > 1:
        attempts_max = run.workflow.state(state).attempts_max
        return f"{state}: attempt {attempt} of {attempts_max} not started: {run.stop_details}"
    return f"stopped before {state} started: {run.stop_details}"


def _retry_not_started(
    run: StrategyRun, rec: rt.StepRecord, state: str, fence: int
) -> ActionFinished:
    """A retry recorded and taken over that the strategy's stop keeps from starting: the
    step ends aborted, the attempt its row names not started."""
    why = _not_started(run, state, rec.attempt)
    return ActionFinished(
        run.id, rec.step_id, state, fence, Decision(STEP_ABORTED, why), rec.attempt, None
    )


def _stop_details(options: StrategyOptions, failed: int, who: str | None = None) -> str:
    """Why a strategy stopped starting steps, once ``failed`` steps exceed its limit
    (``who``: the target whose failure did it, if known)."""
    if options.stop_on_failure:
        return f"stopped after {who or 'a step'} failed (stop on failure)"
    last = f" (the last: {who})" if who else ""
    many = "steps exceed" if failed != 1 else "step exceeds"
    return f"stopped: {failed} failed {many} the failure threshold of {options.failure_limit}{last}"


def _utc(at: float) -> str:
    """A time as a step's details say it: to the second, UTC."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + "Z"


def _resolve(fut: asyncio.Future[R] | None, value: R) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)


def _callback_outcome(cb: cbs.CallbackRecord, chosen: Advance) -> Outcome:
    """A wait-for-callback state's outcome: the target's report, and where the action
    chose to go once it came (a branch the action chose is kept)."""
    if cb.kind == "failed":
        raise StepFailed(f"target reported failure: {cb.details or 'no details'}")
    return Advance(to=chosen.to, details=cb.details or chosen.details)
