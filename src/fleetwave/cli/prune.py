"""``fleetwave prune``: drop the history of strategies that ended long enough ago."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from fleetwave.cli.common import DbOpt, FormatOpt, existing_store
from fleetwave.cli.output import Format, console, print_json
from fleetwave.domain.models import plural
from fleetwave.domain.rollout import parse_duration
from fleetwave.store import prune as pruning

#: the longest ``--before``: a century (a typo of a day count is still refused)
PRUNE_BEFORE_MAX_DAYS = 36500


def prune(
    before: Annotated[
        str,
        typer.Option(
            metavar="AGE",
            help="drop the history of strategies deleted or ended more than this long ago "
            "(90d, 12h, 30m)",
        ),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="say what would be dropped; drop nothing")
    ] = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Drop old history: strategies deleted or ended before --before, with their steps,
    journal, attempts, events and callbacks (the one way history leaves the database)."""
    age_s = parse_duration(before, "--before", max_days=PRUNE_BEFORE_MAX_DAYS)
    store = existing_store(db)
    cutoff = time.time() - age_s
    got = pruning.prune(store, cutoff, dry_run=dry_run)
    when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(cutoff))
    if fmt is Format.json:
        print_json(
            {
                "dry_run": dry_run,
                "before": cutoff,
                "strategies": got.strategies,
                "rows": got.rows,
            }
        )
        return
    if not got.strategies:
        console.print(
            f"nothing to prune: no strategy deleted or ended before {when}", highlight=False
        )
        return
    ids = ", ".join(map(str, got.strategies[:10])) + (" ..." if len(got.strategies) > 10 else "")
    rows = ", ".join(plural(n, kind[:-1], kind) for kind, n in got.rows.items())
    verb = "would drop" if dry_run else "dropped"
    console.print(
        f"{verb} {plural(len(got.strategies), 'strategy', 'strategies')} ({ids}) that ended "
        f"before {when}: {rows}" + (" (dry run: nothing dropped)" if dry_run else ""),
        highlight=False,
    )
