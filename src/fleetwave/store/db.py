"""Opening a database: URL handling, SQLite pragmas, migrations, dialect hooks.

``open_store("fleetwave.db")`` gives a :class:`Store` on an embedded SQLite file
in WAL mode with ``synchronous=FULL``: every commit is durable against power loss.
Dialect-specific SQL lives in :class:`DialectHooks` subclasses, nowhere else.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.exc import DatabaseError
from sqlalchemy.pool import QueuePool

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
HEAD_REVISION = "0007"


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

    def placeholders(self, n: int) -> str:
        """``n`` parameter placeholders for an ``IN (...)`` list."""
        return ", ".join([self.placeholder] * n)

    def flag(self, value: bool) -> Any:
        """A boolean parameter as the hot path binds it."""
        return int(value) if self.flags_as_int else value

    def now_sql(self) -> str | None:
        """SQL for the database's clock, when leases should use it (PostgreSQL)."""
        return None


SQLITE = DialectHooks(
    name="sqlite", placeholder="?", begin_write_sql="BEGIN IMMEDIATE", flags_as_int=True
)


class Store:
    """An engine plus its dialect hooks. Query functions live in sibling modules."""

    def __init__(self, engine: Engine, hooks: DialectHooks, url: str) -> None:
        self.engine = engine
        self.hooks = hooks
        self.url = url
        #: fault injection seam: called inside every write transaction, may raise
        #: ``sqlalchemy.exc.OperationalError`` to simulate a transient database error
        self.write_fault: Callable[[], None] | None = None

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction (SQLite: BEGIN IMMEDIATE, so writers queue, never deadlock)."""
        with self.engine.connect() as conn:
            conn.info["immediate"] = True
            try:
                with conn.begin():
                    if self.write_fault is not None:
                        self.write_fault()
                    yield conn
            finally:
                conn.info.pop("immediate", None)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn

    def dispose(self) -> None:
        self.engine.dispose()


def default_db_path() -> str:
    """``$FLEETWAVE_DB``, or ``fleetwave.db`` when it is unset (or set empty)."""
    return os.environ.get("FLEETWAVE_DB") or "fleetwave.db"


def check_db_path(target: str) -> Path:
    """The database file a path names, or a StoreError saying why it cannot be one."""
    if "://" in target:
        raise StoreError(f"--db: '{target}' is a URL; this version supports SQLite file paths only")
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
        pool_size=2,
        max_overflow=4,
        connect_args={"check_same_thread": False, "timeout": 5},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=5000")  # well below the lease TTL
        cur.execute("PRAGMA cache_size=-65536")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers take the write lock up front (no lock upgrade, so no deadlock between
        # processes); readers take a snapshot and never block the writer (WAL).
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.get("immediate") else "BEGIN")

    return engine


def open_store(
    db: str | None = None, *, synchronous: str = "FULL", migrate_schema: bool = True
) -> Store:
    """Open (and create or upgrade) the database at a path or SQLAlchemy URL."""
    target = db or default_db_path()
    if synchronous.upper() not in {"FULL", "NORMAL", "OFF", "EXTRA"}:
        raise StoreError(f"synchronous: unknown SQLite level '{synchronous}'")
    path = check_db_path(target)
    engine = _sqlite_engine(str(path), synchronous.upper())
    store = Store(engine, SQLITE, target)
    try:
        if migrate_schema:
            migrate(store)
        else:
            current_revision(store)  # fail here, not in the middle of a command
    except DatabaseError as exc:
        engine.dispose()
        raise StoreError(f"--db: cannot use {target}: {exc.orig}") from None
    return store


def is_empty(store: Store) -> bool:
    """No target, group, workflow or strategy: a database as ``init`` leaves it."""
    with store.read() as conn:
        return not any(
            conn.execute(text(f"SELECT 1 FROM {table} LIMIT 1")).first()
            for table in ("targets", "groups", "workflows", "strategies")
        )


def current_revision(store: Store) -> str | None:
    with store.read() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
        return None if row is None else str(row[0])


def migrate(store: Store) -> None:
    """Bring the schema to head with Alembic (a no-op when it is already there)."""
    rev = current_revision(store)
    if rev == HEAD_REVISION:
        return
    if rev is None:
        with store.read() as conn:
            tables = inspect(conn).get_table_names()
        if tables:
            # Another program's database: adding fleetwave's tables to it would change
            # a file that is not ours, and show an empty fleet as if it were the truth.
            raise StoreError(
                f"--db: {store.url} is an SQLite database of something else "
                f"(tables: {', '.join(sorted(tables)[:5])}), not fleetwave's"
            )
    from alembic import command
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    known = {s.revision for s in ScriptDirectory.from_config(cfg).walk_revisions()}
    if rev is not None and rev not in known:
        raise StoreError(
            f"database schema revision {rev} is newer than this fleetwave; upgrade fleetwave"
        )
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
