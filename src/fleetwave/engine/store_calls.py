"""Store calls on the conductor's loop: :class:`StoreCalls` (a mixin of the conductor).

Its ``_io`` runs one store call (one transaction) and retries it: a database error
with backoff, an outage for as long as it lasts (said in the log while it does).
Arguments made with :class:`_Fresh` are worked out again at each attempt.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.exc import OperationalError

from fleetwave.engine.config import EngineConfig, EngineStats
from fleetwave.engine.errors import StoreReplaced, StoreUnavailable
from fleetwave.store import runtime as rt
from fleetwave.store.db import Store

log = logging.getLogger("fleetwave.engine")

P = ParamSpec("P")
R = TypeVar("R")

#: while the database is out, a conductor says so this often (and when it is back)
OUTAGE_LOG_EVERY_S = 30.0
#: ... once it has been out this long (a moment's lock by an operator's command is not)
OUTAGE_QUIET_S = 5.0
#: ... as an error (not a warning) once it has been out this long
OUTAGE_ERROR_S = 60.0


class _Fresh:
    """A store call's argument worked out again at each attempt (see ``Conductor._io``)."""

    __slots__ = ("value",)

    def __init__(self, value: Callable[[], Any]) -> None:
        self.value = value


#: the positions of :class:`_Fresh` arguments, by the types of a call's arguments
_FRESH_AT: dict[tuple[type, ...], list[int]] = {}


class StoreCalls:
    """Runs the conductor's store calls (``_io``): a mixin of :class:`Conductor`, which
    sets what is declared here."""

    store: Store
    config: EngineConfig
    stats: EngineStats
    _loop: asyncio.AbstractEventLoop
    _writer: rt.TransitionWriter
    #: the stop asked of ``run`` (a call riding out an outage gives up once it is set)
    _stop: asyncio.Event | None
    #: loop time the last store call's last attempt began (the one that went through)
    _attempt_at: float
    #: arguments of store calls worked out at each attempt (:class:`_Fresh`): the time,
    #: and a lease from then
    _NOW: Any
    _LEASE: Any
    _LEASE_NOW: Any

    #: read-only store calls of the periodic pass run on a thread (a server's database,
    #: on a real loop: see :meth:`_io_read`)
    _reads_on_thread: bool

    async def _io_read(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """A store call that only reads, as :meth:`_io`, but on a thread when the
        database is a server's (PostgreSQL): the loop goes on starting actions while it
        waits for the answer. The periodic pass's reads (the strategies' states, peers,
        their failures, steps held by conductors gone) took tens of milliseconds each on a
        loaded host, during which no action could start. What it read may be a moment
        old when it is used, as any read the dispatcher acts on later."""
        return await self._call(fn, args, kwargs, self._reads_on_thread)

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
        return await self._call(fn, args, kwargs, False)

    async def _call(
        self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any], thread: bool
    ) -> R:
        """:meth:`_io` (``thread``: the call itself on a thread, see :meth:`_io_read`)."""
        failures = 0
        name = ""  # said only once a call fails
        started = said = 0.0
        kinds = tuple(map(type, args))
        fresh = _FRESH_AT.get(kinds)
        if fresh is None:
            # (where a call's arguments are worked out at each attempt, by their types:
            # a store call's are the same each time it is made)
            fresh = _FRESH_AT[kinds] = [i for i, kind in enumerate(kinds) if kind is _Fresh]
        while True:
            self._attempt_at = self._loop.time()
            call_args: Any = args
            if fresh:
                call_args = list(args)
                for i in fresh:
                    call_args[i] = call_args[i].value()
            try:
                if thread:
                    result = await asyncio.to_thread(fn, *call_args, **kwargs)
                else:
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
                    if outage:
                        self.stats.store_outages += 1
                        self.stats.outage_since = now
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
            if failures:
                self.stats.outage_since = None
            if failures and self._attempt_at - started >= OUTAGE_QUIET_S:
                log.warning(
                    "store-retry: %s went through after %d failed tr%s over %.0fs",
                    name,
                    failures,
                    "y" if failures == 1 else "ies",
                    self._loop.time() - started,
                )
            return result
