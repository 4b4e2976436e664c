"""``fleetwave conductor``: the conductors a database knows (the processes that drive
strategies: ``serve``, ``strategy apply --wait``, the demo)."""

from __future__ import annotations

import typer

from fleetwave.cli.common import DbOpt, FormatOpt, existing_store
from fleetwave.cli.output import Format, emit_rows
from fleetwave.store import queries

# put under the root command by main.py, which gives it its command class (_Commands)
conductor_app = typer.Typer(help="The conductors that drive strategies.", no_args_is_help=True)


@conductor_app.command("list")
def conductor_list(fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """List conductors, newest first: host, pid, state (active, draining, stopped, gone),
    strategies and steps they hold, started, last renewal."""
    emit_rows(
        queries.list_conductors(existing_store(db)),
        [
            "id",
            "host",
            "pid",
            "state",
            "strategies",
            "steps",
            "started_at",
            "heartbeat_at",
        ],
        fmt,
    )
