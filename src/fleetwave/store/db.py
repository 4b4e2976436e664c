"""Opening a database: URL handling, SQLite pragmas, migrations, dialect hooks.

``open_store("fleetwave.db")`` gives a :class:`Store` on an embedded SQLite file
in WAL mode with ``synchronous=FULL``: every commit is durable against power loss
(the two busiest writers sync outside the write lock: :meth:`Store.write_then_sync`).
``open_store("postgresql://user@host/db")`` gives one on a PostgreSQL database (driver
psycopg 3; see :mod:`fleetwave.store.postgres`). Dialect-specific SQL lives in
:class:`DialectHooks` instances, nowhere else.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.exc import DatabaseError, DBAPIError, OperationalError
from sqlalchemy.pool import QueuePool

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
#: how long a write waits for another writer's lock (an operator's command, another
#: conductor) before it fails, unless a conductor asks for less
DEFAULT_BUSY_TIMEOUT_MS = 5000
#: connections an engine keeps open once it has needed them, and how many more it may
#: open at once (closed when handed back). The API's process calls the store from 8
#: threads and its intake writer at once: with fewer kept, each request beyond them
#: opened a connection (its pragmas, a cold page cache) and closed it again.
POOL_SIZE = 10
POOL_OVERFLOW = 10
HEAD_REVISION = "0017"
#: SQLite: beside the database file, the file whose lock writers of every fleetwave
#: process take turns on (see :meth:`Store.writer_turn`)
WRITERS_SUFFIX = "-writers"
#: ... and the file whose lock a writer holds while it waits for that one's
GATE_SUFFIX = "-writers-gate"
#: ... polled this often at first while another process holds it, then less often
TURN_POLL_MIN_S = 0.0001
TURN_POLL_MAX_S = 0.001
#: a connection's record says so while its commits do not sync (Store.relax_sync)
SYNC_RELAXED = "fleetwave_sync_relaxed"


class StoreError(Exception):
    """An operator-facing problem with the database (bad path, newer schema)."""


@dataclass(frozen=True)
class DialectHooks:
    name: str
    placeholder: str
    #: how the hot path opens a write transaction on a raw DBAPI connection
    begin_write_sql: str
    #: bind booleans as integers: SQLite's driver binds 0 or 1 directly, while a bool
    #: (like None) goes through an adapter lookup; a boolean column elsewhere needs bool
    flags_as_int: bool = False
    #: a file on this host (SQLite), rather than a server's database (PostgreSQL): its
    #: identity can be watched, and a command that created it can remove it again
    embedded: bool = True
    #: appended to a SELECT of rows the transaction goes on to update (PostgreSQL's
    #: row lock; SQLite has one writer at a time, and no such clause)
    for_update: str = ""

    def placeholders(self, n: int) -> str:
        """``n`` parameter placeholders for an ``IN (...)`` list."""
        return ", ".join([self.placeholder] * n)

    def flag(self, value: bool) -> Any:
        """A boolean parameter as the hot path binds it."""
        return int(value) if self.flags_as_int else value

    def now_sql(self) -> str | None:
        """SQL for the database's clock, when leases should use it (PostgreSQL)."""
        return None

    def is_outage(self, exc: BaseException) -> bool:
        """Whether a database error is an outage that passes by itself or by an
        operator's hand (locked, busy, I/O, disk full, file unreachable, read-only),
        not a fault in what was asked (a missing table, a bad statement)."""
        orig = getattr(exc, "orig", None) or exc
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int):
            return (code & 0xFF) in _SQLITE_OUTAGES
        text = str(orig).lower()
        return any(word in text for word in _OUTAGE_WORDS)

    def needs_new_connections(self, exc: BaseException) -> bool:
        """Whether a failed write says its connection cannot write, for good: SQLite
        opens a file it may not write read-only, and such a connection stays so after
        the file is made writable again (the connections are opened anew)."""
        orig = getattr(exc, "orig", None) or exc
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF == 8  # SQLITE_READONLY
        return "readonly" in str(orig).lower()

    def set_busy_timeout(self, dbapi_conn: Any, ms: int) -> None:
        """How long a write waits for another writer's lock before it fails."""
        dbapi_conn.execute(f"PRAGMA busy_timeout={int(ms)}")


#: SQLite's primary result codes of an outage: BUSY, LOCKED, NOMEM, READONLY, IOERR,
#: FULL, CANTOPEN, PROTOCOL
_SQLITE_OUTAGES = frozenset({5, 6, 7, 8, 10, 13, 14, 15})
#: the same, by message, for an error that carries no code (a driver's wrapper)
_OUTAGE_WORDS = (
    "locked",
    "busy",
    "disk i/o",
    "is full",
    "unable to open",
    "readonly",
    "out of memory",
)


SQLITE = DialectHooks(
    name="sqlite", placeholder="?", begin_write_sql="BEGIN IMMEDIATE", flags_as_int=True
)


def hooks_of(conn: Connection) -> DialectHooks:
    """The dialect hooks of the database ``conn`` is on (for code given a connection,
    not its store)."""
    if conn.dialect.name == "postgresql":
        from fleetwave.store.postgres import POSTGRESQL

        return POSTGRESQL
    return SQLITE


class Store:
    """An engine plus its dialect hooks. Query functions live in sibling modules."""

    def __init__(self, engine: Engine, hooks: DialectHooks, url: str) -> None:
        self.engine = engine
        self.hooks = hooks
        self.url = url
        #: SQLite: the database file's absolute path (``~`` expanded), where its WAL
        #: and the writers' lock files are found; a server's database: its URL
        self.path = os.path.abspath(os.path.expanduser(url)) if hooks.embedded else url
        #: fault injection seam: called inside every write transaction, may raise
        #: ``sqlalchemy.exc.OperationalError`` to simulate a transient database error
        self.write_fault: Callable[[], None] | None = None
        #: how long a write waits for another writer's lock before it fails; a
        #: conductor shortens it to a twentieth of its lease (its loop waits meanwhile)
        self.busy_timeout_ms = DEFAULT_BUSY_TIMEOUT_MS
        #: SQLite: this process's writers' turns (see :meth:`writer_turn`)
        self._writers = threading.RLock()
        #: ... how deep the thread holding them is (the file lock: at the outermost)
        self._turn_depth = 0
        #: ... and every process's, on the file beside the database: set where several
        #: processes write at a high rate (``serve``: the engine's and the API's); a
        #: process without it waits in SQLite's busy handler, as before
        self.turns_across_processes = False
        #: ... the writers' lock file, opened when first needed (-1: it cannot be)
        self._turn_fd: int | None = None
        self._gate_fd = -1
        self._turn_closer: weakref.finalize[Any, Any] | None = None
        #: SQLite: the connections' synchronous level (None: a server's database)
        self.synchronous: str | None = None
        #: ... the (device, inode) of the WAL file whose directory entry was synced
        self._wal_known: tuple[int, int] | None = None

    def wait_for_locks(self, dbapi_conn: Any, info: dict[Any, Any]) -> None:
        """Give a connection this store's busy timeout, if it has another one."""
        if info.get("busy_timeout_ms") != self.busy_timeout_ms:
            self.hooks.set_busy_timeout(dbapi_conn, self.busy_timeout_ms)
            info["busy_timeout_ms"] = self.busy_timeout_ms

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction (SQLite: BEGIN IMMEDIATE, so writers queue, never deadlock)."""
        with self._write(relaxed=False) as conn:
            yield conn

    @contextmanager
    def _write(self, *, relaxed: bool) -> Iterator[Connection]:
        """:meth:`write`; ``relaxed``: its commit does not sync (:meth:`relax_sync`)."""
        with self.writer_turn(), self.engine.connect() as conn:
            # (on the driver's connection: through SQLAlchemy it would begin a transaction)
            raw, info = conn.connection.driver_connection, conn.connection.info
            self.wait_for_locks(raw, info)
            if relaxed:
                self.relax_sync(raw, info)
            conn.info["immediate"] = True
            try:
                with conn.begin():
                    if self.write_fault is not None:
                        self.write_fault()
                    yield conn
            finally:
                conn.info.pop("immediate", None)

    @property
    def syncs_outside_lock(self) -> bool:
        """Whether :meth:`write_then_sync` (and the engine's group commit) commit
        without a sync under the write lock and sync the WAL after it: SQLite at
        ``synchronous=FULL`` or ``EXTRA`` (a store opened with less asks for less)."""
        return self.hooks.embedded and self.synchronous in ("FULL", "EXTRA")

    def relax_sync(self, dbapi_conn: Any, info: dict[Any, Any]) -> None:
        """Before write transactions whose commits :meth:`sync_wal` will make durable:
        the connection's commits do not sync (``synchronous=NORMAL``: SQLite's WAL
        stays consistent, only not yet durable), until it is handed back to the pool,
        which restores its level (``info``: its record's)."""
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")
        info[SYNC_RELAXED] = True

    @contextmanager
    def write_then_sync(self) -> Iterator[Connection]:
        """A write transaction, as :meth:`write`, that is durable when the block has
        ended, but whose sync is not made under the write lock: SQLite commits it to
        the WAL without syncing (the lock is let go at once), then syncs the WAL
        file. A group commit's sync took about 2 ms here, half of the time the lock
        was held; every other writer (the engine's commits, the API's callbacks)
        waited for it. Whoever syncs the WAL makes every commit before it durable, so
        a commit is never durable without the ones it read (the WAL is in commit
        order). The caller acts on the commit (answers, starts actions) only once
        this returns. Elsewhere (a server's database, a store opened with less than
        ``FULL``): :meth:`write`."""
        relaxed = self.syncs_outside_lock
        with self._write(relaxed=relaxed) as conn:
            yield conn
        if relaxed:
            self.sync_wal()

    def sync_wal(self) -> None:
        """Make every commit in this SQLite database's WAL durable: sync the WAL file
        (and, the first time for each WAL file, its directory, as SQLite does when it
        makes one). No WAL file: its last checkpoint copied it into the database file
        and synced that; nothing is left to sync."""
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            _datasync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if self._wal_known != (st.st_dev, st.st_ino):
            folder = os.open(os.path.dirname(self.path), os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
            self._wal_known = (st.st_dev, st.st_ino)

    @contextmanager
    def writer_turn(self) -> Iterator[None]:
        """SQLite: writers take turns on locks of fleetwave's own before SQLite's: this
        process's (the engine's commits on its loop, the API's on its writer thread),
        then, with :attr:`turns_across_processes`, every such process's (a file lock
        beside the database: ``serve``'s engine and its API's own process). SQLite's
        busy handler sleeps up to 100 ms between tries, and a writer waiting there lost
        to back-to-back group commits for a second at a time; these hand over at once.
        Waited for no longer than the busy timeout (then SQLite's wait, and its error,
        as before); re-entrant, as SQLite's wait was."""
        if not self.hooks.embedded:
            yield
            return
        timeout_s = self.busy_timeout_ms / 1000
        until = time.monotonic() + timeout_s
        took = self._writers.acquire(timeout=timeout_s)
        locked = False
        try:
            if took:
                self._turn_depth += 1
                if self._turn_depth == 1 and self.turns_across_processes:
                    locked = self._lock_file(until)
            yield
        finally:
            if took:
                self._turn_depth -= 1
                if locked:
                    self._unlock_file()
                self._writers.release()

    def _lock_file(self, until: float) -> bool:
        """Take the writers' file lock (False: not by ``until``, or no such file here).

        Through a gate: a second file lock, held only while waiting for the first. A
        writer that waits holds the gate, so the holder of the turn, back for its next
        one at once (the engine's group commits, back to back), waits at the gate
        behind it: each waiting process gets the turn after the one under way, not
        after however many the holder takes before a poll finds the lock free."""
        fds = self._turn_fds()
        if fds is None:
            return False
        gate, turn = fds
        if not _flock_by(gate, until):
            return False
        try:
            return _flock_by(turn, until)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)

    def _turn_fds(self) -> tuple[int, int] | None:
        """The gate's and the turn's lock files, opened once (None: they cannot be made
        here, a read-only directory: SQLite's own wait, as before)."""
        if self._turn_fd is None:
            fds: list[int] = []
            try:
                for suffix in (GATE_SUFFIX, WRITERS_SUFFIX):
                    fds.append(os.open(self.path + suffix, os.O_RDWR | os.O_CREAT, 0o666))
            except OSError:
                for fd in fds:
                    os.close(fd)
                self._turn_fd = -1
            else:
                self._gate_fd, self._turn_fd = fds
                self._turn_closer = weakref.finalize(self, _close_all, fds)
        if self._turn_fd < 0:
            return None
        return self._gate_fd, self._turn_fd

    def _unlock_file(self) -> None:
        assert self._turn_fd is not None
        fcntl.flock(self._turn_fd, fcntl.LOCK_UN)

    def file_identity(self) -> tuple[int, int] | None:
        """The database file's (device, inode), to notice it removed or replaced while
        open (a connection would go on writing to the old file); None if there is no
        file at its path (and always None for a server's database). Any other error (a
        network file system's hiccup) is raised: it says nothing about the file."""
        if not self.hooks.embedded:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn

    def dispose(self) -> None:
        self.engine.dispose()
        if self._turn_closer is not None and self._turn_depth == 0:
            self._turn_closer()  # (opened again when next needed)
            self._turn_closer = self._turn_fd = None


def default_db_path() -> str:
    """``$FLEETWAVE_DB``, or ``fleetwave.db`` when it is unset (or set empty)."""
    return os.environ.get("FLEETWAVE_DB") or "fleetwave.db"


def check_db_path(target: str) -> Path:
    """The database file a path names, or a StoreError saying why it cannot be one."""
    if "://" in target:
        from fleetwave.store.postgres import redact

        raise StoreError(
            f"--db: '{redact(target)}' is a URL fleetwave does not take: give an SQLite "
            "file path, or a postgresql:// URL"
        )
    path = Path(target).expanduser()
    parent = path.resolve().parent
    if not parent.is_dir():
        raise StoreError(f"--db: directory {parent} does not exist")
    if path.is_dir():
        raise StoreError(f"--db: {target} is a directory, not a database file")
    return path


def _sqlite_engine(path: str, synchronous: str) -> Engine:
    engine = create_engine(
        f"sqlite+pysqlite:///{path}",
        poolclass=QueuePool,
        pool_size=POOL_SIZE,
        max_overflow=POOL_OVERFLOW,
        connect_args={"check_same_thread": False, "timeout": 5},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={DEFAULT_BUSY_TIMEOUT_MS}")  # see Store.write
        cur.execute("PRAGMA cache_size=-65536")
        cur.close()

    @event.listens_for(engine, "checkin")
    def _on_checkin(dbapi_conn: Any, rec: Any) -> None:
        # A connection relaxed for commits synced outside the lock (Store.relax_sync)
        # syncs its commits again before anyone else has it.
        if rec.info.pop(SYNC_RELAXED, False) and dbapi_conn is not None:
            try:
                dbapi_conn.execute(f"PRAGMA synchronous={synchronous}")
            except Exception:  # (a connection that is gone: it is not used again)
                rec.invalidate()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the write lock up front (no lock upgrade, so no deadlock between
        # processes); readers take a snapshot and never block the writer (WAL).
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.get("immediate") else "BEGIN")

    return engine


def open_store(
    db: str | None = None,
    *,
    synchronous: str = "FULL",
    migrate_schema: bool = True,
    upgrade: bool = True,
    create_schema: bool = True,
) -> Store:
    """Open the database at a path, creating its schema when the file is new.

    ``upgrade``: bring an older schema to this fleetwave's (the library's default;
    ``fleetwave init``). With ``upgrade=False`` an older schema is refused with
    :class:`SchemaOutdated` instead: every other command, so that upgrading
    fleetwave's package changes no database behind the conductors still using it.
    ``migrate_schema=False`` only checks that the file is a database at all.
    ``create_schema=False`` refuses a database without fleetwave's schema
    (:class:`NoSchema`) rather than creating it there.
    """
    target = db or default_db_path()
    if synchronous.upper() not in {"FULL", "NORMAL", "OFF", "EXTRA"}:
        raise StoreError(f"synchronous: unknown SQLite level '{synchronous}'")
    if is_url(target):
        from fleetwave.store import postgres

        if not postgres.is_postgres_url(target):
            check_db_path(target)  # (says why)
        engine = postgres.postgres_engine(postgres.engine_url(target))
        store = Store(engine, postgres.POSTGRESQL, postgres.shown_url(target))
    else:
        path = check_db_path(target)
        engine = _sqlite_engine(str(path), synchronous.upper())
        store = Store(engine, SQLITE, target)
        store.synchronous = synchronous.upper()
    try:
        if migrate_schema:
            migrate(store, upgrade=upgrade, create=create_schema)
        else:
            current_revision(store)  # fail here, not in the middle of a command
    except DBAPIError as exc:
        engine.dispose()
        if isinstance(exc, DatabaseError) or not store.hooks.embedded:
            raise StoreError(f"--db: cannot use {store.url}: {_said(store, exc)}") from None
        raise
    except StoreError:
        engine.dispose()
        raise
    return store


def is_url(target: str) -> bool:
    """Whether ``--db`` names a server's database (a URL), not a file."""
    return "://" in target


def _said(store: Store, exc: DBAPIError) -> str:
    """A driver's error as one line, without a password."""
    if store.hooks.embedded:
        return str(exc.orig)
    from fleetwave.store.postgres import one_line, redact

    return redact(one_line(str(exc.orig)))


#: ``PRAGMA user_version`` of a database ``fleetwave init`` has run on (0 otherwise): a
#: command that fails on bad input removes the new file it created only while this is
#: 0, so an ``init`` racing it on the same fresh path keeps the database it announced
INITIALISED = 1


def mark_initialised(store: Store) -> None:
    """Record that ``fleetwave init`` ran on this database (see :data:`INITIALISED`).

    Best effort: a database that cannot be written just now (read-only, locked by a long
    writer) is left unmarked rather than failing an ``init`` that found it ready (only
    a fresh file another command created and is about to remove needs the mark)."""
    if not store.hooks.embedded:
        return  # (a server's database is never removed by a command: no mark needed)
    with store.read() as conn:
        if conn.exec_driver_sql("PRAGMA user_version").scalar() == INITIALISED:
            return
    if not is_empty(store):
        return  # (a database with rows is never removed: no mark needed, none written)
    try:
        with store.write() as conn:
            conn.exec_driver_sql(f"PRAGMA user_version = {INITIALISED}")
    except OperationalError:
        pass


#: what a database as ``init`` leaves it has none of
WRITTEN_BY_COMMANDS = ("targets", "groups", "workflows", "strategies")


def is_empty(store: Store) -> bool:
    """No target, group, workflow or strategy: a database as ``init`` leaves it."""
    with store.read() as conn:
        return not any(
            conn.execute(text(f"SELECT 1 FROM {table} LIMIT 1")).first()
            for table in WRITTEN_BY_COMMANDS
        )


def current_revision(store: Store) -> str | None:
    with store.read() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
        return None if row is None else str(row[0])


class SchemaOutdated(StoreError):
    """The database's schema is older than this fleetwave's: ``fleetwave init`` upgrades it."""

    def __init__(self, url: str, revision: str) -> None:
        self.revision = revision
        super().__init__(
            f"--db: {url} has schema revision {revision}, this fleetwave needs "
            f"{HEAD_REVISION}: run 'fleetwave init' on it to upgrade it (stop the "
            "conductors using it first)"
        )


def known_revisions() -> list[str]:
    """Every schema revision this fleetwave knows, oldest first ("0001", ...)."""
    return sorted(p.name[:4] for p in (MIGRATIONS_DIR / "versions").glob("[0-9]*_*.py"))


class NoSchema(StoreError):
    """The database has no fleetwave schema, and was not to be given one."""

    def __init__(self, url: str) -> None:
        self.what = f"no fleetwave schema in {url}"
        super().__init__(f"--db: {self.what}")


def migrate(store: Store, *, upgrade: bool = True, create: bool = True) -> str | None:
    """Bring the schema to head with Alembic; returns the revision it had (None: new).

    A no-op when it is already there. ``upgrade=False`` only creates the schema of a
    new database, and refuses an older one (:class:`SchemaOutdated`); ``create=False``
    refuses a database without one (:class:`NoSchema`).
    """
    rev = current_revision(store)
    if rev == HEAD_REVISION:
        return rev
    if rev is None and not create:
        raise NoSchema(store.url)
    if rev is None:
        with store.read() as conn:
            tables = inspect(conn).get_table_names()
        if tables:
            # Another program's database: adding fleetwave's tables to it would change
            # a file that is not ours, and show an empty fleet as if it were the truth.
            kind = "an SQLite database" if store.hooks.embedded else "a database"
            raise StoreError(
                f"--db: {store.url} is {kind} of something else "
                f"(tables: {', '.join(sorted(tables)[:5])}), not fleetwave's"
            )
    elif rev not in known_revisions():
        raise StoreError(
            f"--db: {store.url} has schema revision {rev}, newer than this fleetwave "
            f"({HEAD_REVISION}): upgrade fleetwave"
        )
    elif not upgrade:
        raise SchemaOutdated(store.url, rev)
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with store.engine.connect() as conn:
        # The write lock first (BEGIN IMMEDIATE; PostgreSQL: the store's write lock),
        # then the revision again: a second 'fleetwave init' started at the same time
        # waits for the first, then finds the schema upgraded and changes nothing (it
        # reports the revision it found then).
        conn.info["immediate"] = True
        try:
            with conn.begin():
                if rev is not None:
                    found = conn.execute(text("SELECT version_num FROM alembic_version")).first()
                    if found is not None and str(found[0]) == HEAD_REVISION:
                        return HEAD_REVISION
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
        finally:
            conn.info.pop("immediate", None)
    return rev


def _flock_by(fd: int, until: float) -> bool:
    """Take ``fd``'s exclusive file lock, polling (False: not by ``until``)."""
    pause = TURN_POLL_MIN_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= until:
                return False
            time.sleep(pause)
            pause = min(TURN_POLL_MAX_S, pause * 2)
        except OSError:
            return False


_datasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
