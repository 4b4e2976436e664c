"""Options and error handling shared by every command."""

from __future__ import annotations

from typing import Annotated

import typer

from fleetwave.cli.output import Format
from fleetwave.store.db import Store, default_db_path, open_store

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="SQLite database file (default: $FLEETWAVE_DB or ./fleetwave.db)",
        show_default=False,
    ),
]
FormatOpt = Annotated[Format, typer.Option("--format", help="table or json")]


def store_for(db: str | None) -> Store:
    return open_store(db or default_db_path())
