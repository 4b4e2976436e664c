"""Wake-ups between processes: PostgreSQL's ``LISTEN/NOTIFY`` on one channel.

A write that gives conductors something to do (a strategy applied, paused, resumed or
its abort requested; a strategy handed back by a conductor that stops; a callback
stored) sends a notification in its own transaction: the server delivers it when, and
only if, that transaction commits. Every conductor listens (:class:`Listener`, a
thread with its own connection) and, woken, runs its periodic pass at once instead of
at its next tick: work committed by one process is picked up by another within
milliseconds. A notification is only a hint: the pass reads the database as it does
every tick, so one lost (a listener reconnecting) delays nothing beyond that tick.

SQLite has no such thing: there, conductors find work on their tick.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy import Connection

from fleetwave.store.db import Store

log = logging.getLogger("fleetwave.engine")

#: the one channel fleetwave notifies on
CHANNEL = "fleetwave"
#: how long the listener waits for a notification before it looks whether to stop
POLL_S = 0.5
#: how long starting waits for the listener to listen (a server that does not answer:
#: the conductor goes on without, and the listener keeps trying)
START_WAIT_S = 2.0
#: how long it waits before connecting again after losing its connection
RECONNECT_S = 1.0


def notify(conn: Connection, what: str, strategy_id: int | None = None) -> None:
    """Within a write transaction: wake every listening conductor once it commits
    (PostgreSQL; nothing on SQLite). ``what``: strategy, callback, released."""
    if conn.dialect.name != "postgresql":
        return
    payload = what if strategy_id is None else f"{what}:{strategy_id}"
    conn.exec_driver_sql("SELECT pg_notify(%s, %s)", (CHANNEL, payload))


class Listener:
    """A thread listening on :data:`CHANNEL` with its own connection; ``on_notify``
    (called in that thread, with the payload) must hand over to the caller's loop."""

    def __init__(self, store: Store, on_notify: Callable[[str], None]) -> None:
        self.store = store
        self.on_notify = on_notify
        self._stop = threading.Event()
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None
        #: how many notifications it has passed on (for tests and ``conductor list``)
        self.received = 0

    @property
    def available(self) -> bool:
        return self.store.hooks.name == "postgresql"

    def start(self) -> None:
        """Start listening; returns once it listens (or after :data:`START_WAIT_S`): what
        is committed after that wakes this process, what was before its first pass finds.
        """
        if not self.available or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="fleetwave-listen", daemon=True)
        self._thread.start()
        self._listening.wait(START_WAIT_S)

    def stop(self) -> None:
        """Ask the thread to end: it does within :data:`POLL_S`, closing its connection
        (nobody waits for it: a conductor on a virtual clock cannot wait on a thread)."""
        self._stop.set()

    def join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=POLL_S * 4)
            self._thread = None

    def _run(self) -> None:
        import psycopg

        url = self.store.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False
        )
        said = False
        while not self._stop.is_set():
            try:
                with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._listening.set()
                    if said:
                        log.info("listening for wake-ups again")
                    said = False
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=POLL_S):
                            self.received += 1
                            self.on_notify(note.payload)
            except psycopg.Error as exc:
                if not said:
                    # (the periodic pass still finds the work, on its tick)
                    log.warning(
                        "not listening for wake-ups (%s); trying again every %gs",
                        type(exc).__name__,
                        RECONNECT_S,
                    )
                    said = True
                self._stop.wait(RECONNECT_S)
