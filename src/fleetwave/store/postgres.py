"""PostgreSQL as the store: URLs, the engine, and its dialect hooks (psycopg 3).

``open_store("postgresql://user@host/db")`` (see :func:`fleetwave.store.db.open_store`)
comes here. A URL may be written ``postgresql://``, ``postgres://`` or
``postgresql+psycopg://``; a password comes from the URL, ``PGPASSWORD`` or
``~/.pgpass`` (libpq reads the last two itself), and is never shown: every message
names the database by :func:`shown_url`, and :func:`redact` removes a password from
any text before it is printed.

Transactions are the same as on SQLite: a write transaction first takes one lock per
database (a transaction-scoped advisory lock), so writers queue one at a time as SQLite's
``BEGIN IMMEDIATE`` makes them, and every read-then-write of the store stays as safe as
it is there; a read transaction sees one snapshot (``REPEATABLE READ``), as an SQLite
read does in WAL mode. The connection is in autocommit mode and the transactions are
begun explicitly, as on SQLite, so the hot path's raw DBAPI connection begins its own
with :attr:`DialectHooks.begin_write_sql`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.pool import QueuePool

from fleetwave.store.db import (
    DEFAULT_BUSY_TIMEOUT_MS,
    POOL_OVERFLOW,
    POOL_SIZE,
    DialectHooks,
    StoreError,
)
from fleetwave.store.leases import SERVER_NOW_SQL

#: the URL schemes taken for PostgreSQL (SQLAlchemy's driver is psycopg 3 for each)
SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")
#: the advisory lock a write transaction takes (per database): "fleetwave" in ASCII
WRITE_LOCK_KEY = 0x666C656574776176
#: how long connecting to the server may take before it is an error
CONNECT_TIMEOUT_S = 10


def is_postgres_url(target: str) -> bool:
    return target.split("://", 1)[0].lower() in SCHEMES and "://" in target


def engine_url(target: str) -> URL:
    """The SQLAlchemy URL (driver psycopg) of a user's ``postgresql://`` URL."""
    try:
        url = make_url(target)
    except ArgumentError:
        raise StoreError(f"--db: '{shown_url(target)}' is not a valid URL") from None
    if not url.database:
        raise StoreError(
            f"--db: {shown_url(target)} names no database (postgresql://user@host/dbname)"
        )
    return url.set(drivername="postgresql+psycopg")


#: ``scheme://user:password@``: the password in a URL
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*):([^@\s]*)@", re.IGNORECASE)
#: ``password=...`` in a libpq connection string or a URL's query
_KEYWORD_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('[^']*'|[^\s&']+)", re.IGNORECASE)


def shown_url(target: str) -> str:
    """A URL as messages name it: as given, its password (if any) masked."""
    return redact(target)


#: passwords this process was given (a URL's, ``PGPASSWORD``): never printed
_secrets: set[str] = set()


def remember_secret(secret: str | None) -> None:
    # (a password of one or two characters would mask letters all over a message)
    if secret and len(secret) >= 3:
        _secrets.add(secret)


def redact(text: str) -> str:
    """``text`` without any password: a URL's (``user:***@``), a connection string's
    (``password=***``), and any password this process was given, wherever it appears."""
    text = _URL_PASSWORD.sub(r"\1:***@", text)
    text = _KEYWORD_PASSWORD.sub(r"\1***", text)
    for secret in sorted(_secrets | _env_secret(), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _env_secret() -> set[str]:
    pw = os.environ.get("PGPASSWORD") or ""
    return {pw} if len(pw) >= 3 else set()


def one_line(message: str) -> str:
    """A driver's message (libpq's run over several lines, with tabs) as one line."""
    return "; ".join(line.strip() for line in message.strip().splitlines() if line.strip())


#: SQLSTATE classes and codes of an outage: the server or the connection is away for a
#: while (connection exception, operator intervention such as a shutdown or a restart,
#: insufficient resources such as too many connections or a full disk, system I/O
#: error), a transaction the server gave up for another (serialization failure,
#: deadlock) or a lock that was not had in time, or a read-only server (a standby)
_OUTAGE_CLASSES = ("08", "57P", "53", "58")
_OUTAGE_CODES = frozenset({"40001", "40P01", "55P03", "25006"})
#: errors after which a connection is of no further use
_BROKEN_CLASSES = ("08", "57P")


@dataclass(frozen=True)
class PostgresHooks(DialectHooks):
    """PostgreSQL's differences (psycopg 3)."""

    def now_sql(self) -> str | None:
        return SERVER_NOW_SQL

    def is_outage(self, exc: BaseException) -> bool:
        orig = getattr(exc, "orig", None) or exc
        if getattr(exc, "connection_invalidated", False):
            return True
        code = getattr(orig, "sqlstate", None)
        if isinstance(code, str):
            return code in _OUTAGE_CODES or code.startswith(_OUTAGE_CLASSES)
        # no SQLSTATE: the client's own error (connection refused, lost, timed out)
        import psycopg

        return isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)

    def needs_new_connections(self, exc: BaseException) -> bool:
        orig = getattr(exc, "orig", None) or exc
        if getattr(exc, "connection_invalidated", False):
            return True
        code = getattr(orig, "sqlstate", None)
        if isinstance(code, str):
            return code.startswith(_BROKEN_CLASSES)
        import psycopg

        return isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)

    def set_busy_timeout(self, dbapi_conn: Any, ms: int) -> None:
        # (the write lock's wait, and any row lock's: refused after, as an outage)
        import psycopg

        try:
            dbapi_conn.execute(f"SET lock_timeout = {int(ms)}")
        except psycopg.Error as exc:
            # on the driver's connection, outside SQLAlchemy: its error made SQLAlchemy's,
            # as a store call's caller expects (a connection the server ended, mostly)
            raise DBAPIError.instance(
                "SET lock_timeout", None, exc, psycopg.Error, connection_invalidated=True
            ) from exc


POSTGRESQL = PostgresHooks(
    name="postgresql",
    placeholder="%s",
    # one round trip: psycopg sends statements without parameters as one query
    begin_write_sql=f"BEGIN; SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})",
    embedded=False,
    for_update=" FOR UPDATE",
)
#: how a read transaction begins: one snapshot for all of it, as an SQLite read has
BEGIN_READ_SQL = "BEGIN ISOLATION LEVEL REPEATABLE READ"


def postgres_engine(url: URL) -> Engine:
    """An engine on the database at ``url`` (its password remembered, never shown)."""
    remember_secret(url.password if isinstance(url.password, str) else None)
    engine = create_engine(
        url,
        poolclass=QueuePool,
        pool_size=POOL_SIZE,
        max_overflow=POOL_OVERFLOW,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S, "application_name": "fleetwave"},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.autocommit = True  # we issue BEGIN ourselves (below), as on SQLite
        dbapi_conn.execute(f"SET lock_timeout = {DEFAULT_BUSY_TIMEOUT_MS}")

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # (without parameters, psycopg sends both statements of a write's begin as one
        # query; through SQLAlchemy, so that an error is SQLAlchemy's, as every other)
        conn.exec_driver_sql(
            POSTGRESQL.begin_write_sql if conn.info.get("immediate") else BEGIN_READ_SQL,
            execution_options={"no_parameters": True},
        )

    return engine
