"""Options and error handling shared by every command, and what the commands of
several groups do alike: say what they did (``done``), delete by name, take
``--max-parallel`` and ``--lease-ttl``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy.exc import DBAPIError

from fleetwave.cli import remote
from fleetwave.cli.output import Format, console, print_json
from fleetwave.commands import max_parallel_as_stored as max_parallel_as_stored
from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.models import name_problem
from fleetwave.domain.rollout import parse_amount
from fleetwave.engine.config import LEASE_TTL_MAX_S, LEASE_TTL_MIN_S, EngineConfig
from fleetwave.store.db import (
    WRITTEN_BY_COMMANDS,
    NoSchema,
    Store,
    StoreError,
    check_db_path,
    default_db_path,
    is_url,
    open_store,
)

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        metavar="PATH",
        help="SQLite database file, or postgresql://user@host/dbname "
        "(default: $FLEETWAVE_DB or ./fleetwave.db)",
        show_default=False,
    ),
]
FormatOpt = Annotated[Format, typer.Option("--format", help="table or json")]
IgnoreMissingOpt = Annotated[
    bool,
    typer.Option(
        "--ignore-missing",
        help="one that is not there is no error (exit 0, nothing deleted): for scripts "
        "that delete what may be gone already",
    ),
]

#: the largest integer the database holds (SQLite's INTEGER, PostgreSQL's bigint): a
#: larger id or count is refused as bad input, not a traceback
SQL_INT_MAX = 2**63 - 1
#: the most targets a demo or a simulation makes
MAX_SIM_TARGETS = 1_000_000


def whole_number(value: str | int) -> int:
    """An id or a count as typed: a whole number the database can hold (0 to 2**63 - 1);
    anything else is bad usage naming the value (exit 2)."""
    if isinstance(value, int):
        number = value
    else:
        text = value.strip()
        digits = text[1:] if text[:1] in ("+", "-") else text
        # ASCII digits only (str.isdigit also takes other scripts' digits and '²')
        if not (digits.isascii() and digits.isdigit()):
            raise typer.BadParameter(f"'{value}' is not a whole number")
        if len(digits.lstrip("0")) > len(str(SQL_INT_MAX)):  # int() refuses 4,300 digits
            if text.startswith("-"):
                raise typer.BadParameter(f"{text[:24]}... is negative")
            raise typer.BadParameter(
                f"a number of {len(digits.lstrip('0'))} digits is above the largest the "
                f"database holds ({SQL_INT_MAX})"
            )
        number = int(text)
    if number < 0:
        raise typer.BadParameter(f"{number} is negative")
    if number > SQL_INT_MAX:
        raise typer.BadParameter(
            f"{number} is above the largest the database holds ({SQL_INT_MAX})"
        )
    return number


def count_or_percent(value: str) -> str:
    """A count (as :func:`whole_number`) or a percent up to 100 ("5%", "12.5%"), as
    text: a limit or a size (``--max-failures``, ``--canary``)."""
    text = value.strip()
    if not text.endswith("%"):
        return str(whole_number(text))
    try:
        parse_amount(text, "-")
    except InputError as exc:
        raise typer.BadParameter(str(exc).removeprefix("-: ")) from None
    return text


def count_from_1(value: str | int) -> int:
    """A count that must be at least 1 (``--last N``): one wording for 0 and -3."""
    text = str(value).strip()
    if text.startswith("-") and text[1:].isascii() and text[1:].isdigit():
        raise typer.BadParameter(f"must be at least 1, got {text}")
    number = whole_number(value)
    if number < 1:
        raise typer.BadParameter(f"must be at least 1, got {number}")
    return number


StrategyId = Annotated[int, typer.Argument(parser=whole_number, metavar="ID", help="strategy id")]
StepId = Annotated[int, typer.Argument(parser=whole_number, metavar="ID", help="step id")]


#: databases this command created (the file did not exist): removed again if the
#: command then fails on bad input, so that bad input writes nothing, not even a file
_created: list[tuple[Path, Store]] = []


def store_for(db: str | None, *, create: bool = True, upgrade: bool = False) -> Store:
    """The command's database, created (at this fleetwave's schema) if ``create`` and
    none is there. An older schema is refused (``SchemaOutdated``) unless ``upgrade``:
    only ``init`` upgrades one, so that installing a newer fleetwave changes no
    database behind the conductors still using it.

    Commands that read, or change what is already there, pass ``create=False``: a
    mistyped ``--db`` or ``FLEETWAVE_DB`` then gets an error, instead of a new empty
    database that shows an empty fleet (and no strategies) as if that were the truth.
    """
    if remote.given() is not None:
        from typer._click.globals import get_current_context  # (Typer's own Click)

        ctx = get_current_context(silent=True)
        what = ctx.command_path if ctx is not None else "this command"
        raise InputError(
            f"--url: '{what}' works on a database, not through a server (reads, strategy "
            "create, pause, resume, abort and approve, workflow validate and add, and "
            "target import do)"
        )
    if db is not None and not db.strip():
        raise InputError("--db: must not be empty")
    target = db or default_db_path()
    if is_url(target):
        return _server_store(db, target, create=create, upgrade=upgrade)
    path = check_db_path(target)
    fresh = not path.exists()
    if fresh and not create:
        raise InputError(f"{db_named(db)}: no database at {target}{_hint(db)}")
    if not create and path.is_file() and path.stat().st_size == 0:
        # An empty file (a typo'd `touch`, a failed copy): opening it would make it a
        # new, empty database, shown as if it were the fleet.
        raise InputError(f"{db_named(db)}: {target} is an empty file, not a database{_hint(db)}")
    try:
        store = open_store(target, upgrade=upgrade)
    except StoreError as exc:
        if db_named(db) != "--db" and str(exc).startswith("--db: "):
            # the store names its path as --db: here FLEETWAVE_DB gave it
            exc.args = (f"{db_named(db)}: {str(exc)[len('--db: ') :]}",)
        raise
    if fresh:
        _created.append((path, store))
    return store


def _server_store(db: str | None, target: str, *, create: bool, upgrade: bool) -> Store:
    """A server's database (a postgresql:// URL), as :func:`store_for` opens a file:
    "no database" is one without fleetwave's schema (the database itself is made by
    the server's administrator, not by fleetwave)."""
    try:
        return open_store(target, upgrade=upgrade, create_schema=create)
    except NoSchema as exc:
        raise InputError(f"{db_named(db)}: {exc.what}{_hint(db)}") from None
    except StoreError as exc:
        if db_named(db) != "--db" and str(exc).startswith("--db: "):
            exc.args = (f"{db_named(db)}: {str(exc)[len('--db: ') :]}",)
        raise


def existing_store(db: str | None) -> Store:
    """The command's database, which must exist (see :func:`store_for`)."""
    return store_for(db, create=False)


def store_if_any(db: str | None) -> Store | None:
    """The database, if the default path has none: None (built-in and plug-in workflows
    need no database to be listed). A path given (--db, FLEETWAVE_DB) must exist."""
    if db is not None or os.environ.get("FLEETWAVE_DB"):
        return existing_store(db)
    return store_for(db) if check_db_path(default_db_path()).exists() else None


def db_named(db: str | None) -> str:
    """The input that named the database path."""
    return "FLEETWAVE_DB" if db is None and os.environ.get("FLEETWAVE_DB") else "--db"


def _hint(db: str | None) -> str:
    if db is None and not os.environ.get("FLEETWAVE_DB"):
        return (
            " (the default when neither --db nor FLEETWAVE_DB is given; "
            "create one with 'fleetwave init')"
        )
    return " (create one with 'fleetwave init', or point it at an existing one)"


def forget_created() -> None:
    """A new command starts: what an earlier one (in this process) created is kept."""
    _created.clear()


def discard_created() -> None:
    """Bad input: remove the databases this command created (with their WAL files),
    if nothing has been written to them since and no other process has them open.

    Another command may have begun to use the new file meanwhile (a ``target import``
    started a moment before, on the same fresh path): removing it then lost what that
    command went on to commit into the unlinked file, after it said it succeeded."""
    while _created:
        path, store = _created.pop()
        store.dispose()  # (no connection of this process open while it looks)
        _remove_if_unused(path)


#: the byte of a WAL database's shared-memory file that every connection to it holds a
#: shared lock on while open (SQLite's unix VFS: its "dead man switch")
_SHM_DMS_BYTE = 128


def _remove_if_unused(path: Path) -> None:
    """Remove the new database at ``path`` (with its WAL files) unless another process
    has written to it or has it open.

    POSIX record locks belong to the process, and closing any descriptor of a file drops
    all of them: so the database is read (a separate connection, closed) before the lock
    is taken, and no SQLite connection of this process is open while it is held. Every
    connection to a WAL database holds a shared lock on the dead-man-switch byte of its
    shared-memory file: an exclusive lock on it is refused while another process has
    the database open. Under it, the files are checked unchanged since the read, and
    removed. (A process that has opened the file but not read it yet holds no lock: that
    instant is not covered.)"""
    import fcntl
    import sqlite3

    real = path.resolve()
    wal, shm = (real.with_name(real.name + suffix) for suffix in ("-wal", "-shm"))
    # before the read: a commit by another process after this changes it
    seen = _identity(real, wal) if real.exists() else None
    try:
        conn = sqlite3.connect(f"{real.as_uri()}?mode=ro", uri=True)
        try:
            if conn.execute("PRAGMA user_version").fetchone() != (0,):
                return  # an init ran on it meanwhile: announced as ready
            if any(
                conn.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone()
                for table in WRITTEN_BY_COMMANDS
            ):
                return
        finally:
            conn.close()
        fd = os.open(shm, os.O_RDWR)
    except FileNotFoundError:
        fd = None  # no connection open anywhere (the last to close removed it)
    except (OSError, sqlite3.Error):
        return  # gone, or not a database as this command left it: nothing to remove
    if seen is None:
        return
    try:
        if fd is not None:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _SHM_DMS_BYTE)
            except OSError:
                return  # another process has it open
        if _identity(real, wal) != seen:
            return  # written since it was read
        for p in (real, wal, shm):
            p.unlink(missing_ok=True)
    finally:
        if fd is not None:
            os.close(fd)  # (the lock with it: this process has no connection to it now)


def _identity(db: Path, wal: Path) -> tuple[tuple[int, int, int] | None, ...]:
    """Inode, size and modification time of the database file and its WAL (None for one
    not there, or a WAL with nothing in it: a reader may create it): any commit changes
    one of them."""

    def of(p: Path) -> tuple[int, int, int] | None:
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        if p == wal and st.st_size == 0:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    return (of(db), of(wal))


def done(fmt: Format, text: str, answer: dict[str, Any]) -> None:
    """What a command that changes something did: a line, or (``--format json``) one
    JSON object a script can read."""
    if fmt is Format.json:
        print_json(answer)
    else:
        console.print(text)


def _never_a_name(name: str) -> None:
    """A name not found that no target or group could have (empty: an unset variable
    in a script) is bad input, also with --ignore-missing."""
    problem = name_problem(name)
    if problem:
        raise InputError(f"NAME: {problem}")


def delete_named(
    kind: str, name: str, delete: Callable[[], None], ignore_missing: bool, fmt: Format
) -> None:
    """`target|group delete NAME`: ``delete`` it, and say so; one not there is refused
    (exit 2) unless ``ignore_missing``, and a name nothing could have always is."""
    try:
        delete()
    except NotFound:
        _never_a_name(name)
        if not ignore_missing:
            raise
        missing(fmt, f"{kind} {name}", {"name": name})
        return
    done(fmt, f"{kind} {name} deleted", {"name": name, "deleted": True})


def missing(fmt: Format, what: str, key: dict[str, Any]) -> None:
    """``delete --ignore-missing`` of one that is not there: said, not an error."""
    done(fmt, f"{what}: not there, nothing deleted", {**key, "deleted": False})


LeaseTtlOpt = Annotated[
    float | None,
    typer.Option(
        "--lease-ttl",
        metavar="SECONDS",
        help=f"lease length (default {EngineConfig.lease_ttl_s:g}): a conductor lost on "
        "another host is taken over this long after its last renewal",
    ),
]


#: For the test suite only: a lower ``--lease-ttl`` minimum (seconds, 5 to 15), so that
#: its takeover tests with real processes wait out a few seconds, not 15. Never for an
#: operator: under 15 s the watchdog may stop actions after the lease ran out
#: (engine/config.py). Unset, empty or out of range: the minimum stays 15 s.
TEST_LEASE_TTL_MIN_ENV = "FLEETWAVE_TEST_LEASE_TTL_MIN_S"


def lease_ttl_min() -> float:
    raw = os.environ.get(TEST_LEASE_TTL_MIN_ENV, "")
    try:
        lowered = float(raw)
    except ValueError:
        return LEASE_TTL_MIN_S
    return lowered if 5.0 <= lowered <= LEASE_TTL_MIN_S else LEASE_TTL_MIN_S


def engine_config(lease_ttl: float | None) -> EngineConfig:
    if lease_ttl is None:
        return EngineConfig()
    least = lease_ttl_min()
    if not least <= lease_ttl <= LEASE_TTL_MAX_S:  # also NaN
        raise InputError(
            f"--lease-ttl: must be {least:g} to {LEASE_TTL_MAX_S:g} seconds, got {lease_ttl:g}"
        )
    return EngineConfig(lease_ttl_s=lease_ttl)


def database_hint(exc: DBAPIError, *, waiting: bool = False) -> str:
    text = str(exc.orig).lower()
    # (SQLite: "database is locked"; PostgreSQL: "canceling statement due to lock timeout")
    if "locked" in text or "busy" in text or "lock timeout" in text:
        if waiting:
            return ": another program holds its write lock"
        return " (another program holds its write lock: try again when it is done)"
    return ""
