"""Options and error handling shared by every command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fleetwave.cli.output import Format
from fleetwave.store.db import Store, default_db_path, is_empty, open_store

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="SQLite database file (default: $FLEETWAVE_DB or ./fleetwave.db)",
        show_default=False,
    ),
]
FormatOpt = Annotated[Format, typer.Option("--format", help="table or json")]


#: databases this command created (the file did not exist): removed again if the
#: command then fails on bad input, so that bad input writes nothing, not even a file
_created: list[tuple[Path, Store]] = []


def store_for(db: str | None) -> Store:
    target = db or default_db_path()
    path = Path(target).expanduser()
    fresh = not path.exists()
    store = open_store(target)
    if fresh:
        _created.append((path, store))
    return store


def forget_created() -> None:
    """A new command starts: what an earlier one (in this process) created is kept."""
    _created.clear()


def discard_created() -> None:
    """Bad input: remove the databases this command created (with their WAL files),
    if nothing has been written to them since (another process may have begun to)."""
    while _created:
        path, store = _created.pop()
        try:
            empty = is_empty(store)
        finally:
            store.dispose()
        if not empty:
            continue
        for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            p.unlink(missing_ok=True)
