"""``fleetwave history``, ``events`` and ``check``: what a strategy's journal and events
say happened, and whether the guarantees held."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from rich.markup import escape

from fleetwave.cli.common import DbOpt, FormatOpt, count_from_1, existing_store, whole_number
from fleetwave.cli.output import Format, console, emit_rows, first_then, print_json
from fleetwave.cli.parsing import several
from fleetwave.domain.errors import Conflict
from fleetwave.domain.models import StrategyState, plural
from fleetwave.store import queries
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check as check_invariants


def history(
    strategy: Annotated[int, typer.Option(parser=whole_number, metavar="ID", help="strategy id")],
    target: Annotated[
        list[str] | None,
        typer.Option(metavar="NAME", help="only this target; repeat it, or give a,b, for several"),
    ] = None,
    last: Annotated[
        int | None,
        typer.Option(
            parser=count_from_1, metavar="N", help="only the last N transitions (oldest first)"
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """The journal: every transition with time, conductor, from, to and details."""
    store = existing_store(db)
    names = several("--target", target)
    rows = queries.iter_history(store, strategy, names, last=last)  # refuses bad names now
    note = queries.deleted_note(store, strategy)
    emit_rows(
        _marked(
            first_then(rows, lambda: queries.iter_history(store, strategy, names, last=last)),
            note,
        ),
        ["at", "conductor", "target", "from", "to", "details"],
        fmt,
        title=note,
    )


def _marked(
    read: Callable[[], Iterator[dict[str, Any]]], note: str | None
) -> Callable[[], Iterator[dict[str, Any]]]:
    """Rows of a deleted strategy's history or events, each marked so (``--format
    json``: ``strategy_deleted``; a table says it once, in its title)."""
    if note is None:
        return read
    return lambda: ({**row, "strategy_deleted": True} for row in read())


def events(
    strategy: Annotated[int, typer.Option(parser=whole_number, metavar="ID", help="strategy id")],
    target: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME", help="only this target's; repeat it, or give a,b, for several"
        ),
    ] = None,
    kind: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KIND",
            help="only this kind (" + ", ".join(queries.EVENT_KINDS) + "); repeat it, or a,b",
        ),
    ] = None,
    last: Annotated[
        int | None,
        typer.Option(
            parser=count_from_1, metavar="N", help="only the last N events (oldest first)"
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """What happened besides transitions: claims, takeovers, failed attempts, pauses and
    aborts seen (the journal is `history`)."""
    store = existing_store(db)
    names, kinds = several("--target", target), several("--kind", kind)
    rows = queries.iter_events(store, strategy, names, kinds, last)  # refuses bad input now
    note = queries.deleted_note(store, strategy)
    emit_rows(
        _marked(
            first_then(rows, lambda: queries.iter_events(store, strategy, names, kinds, last)),
            note,
        ),
        ["at", "conductor", "target", "kind", "details"],
        fmt,
        title=note,
    )


def _undriven_notes(store: Store, only: int | None) -> list[str]:
    """Strategies that should be moving and that no conductor drives nor will claim (a
    conductor killed, none serving): not a violation, but work left waiting."""
    notes = []
    for row in queries.list_strategies(store, brief=True):
        sid = int(row["id"])
        if (only is not None and sid != only) or row["state"] not in (
            StrategyState.APPLYING,
            StrategyState.ABORT_REQUESTED,
            StrategyState.ABORTING,
        ):
            continue
        who = queries.driving(store, sid)
        if who.nobody:
            notes.append(
                f"strategy {sid} is {row['state']} and no conductor drives it: it goes on "
                f"once 'fleetwave serve' runs (or 'fleetwave strategy apply {sid} --wait')"
            )
    return notes


def check(
    strategy: Annotated[
        int | None, typer.Option(parser=whole_number, metavar="ID", help="only this strategy")
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Verify G1, G3, G7 and G8 from the journal; exit 1 listing violations."""
    store = existing_store(db)
    if strategy is not None:
        queries.strategy_exists(store, strategy)
    result = check_invariants(store, strategy)
    if strategy is not None and result.deleting:
        raise Conflict(
            f"strategy {strategy}: is being deleted (part of its journal is gone already); "
            f"'fleetwave strategy delete {strategy}' finishes it"
        )
    notes = _undriven_notes(store, strategy)
    if fmt is Format.json:
        print_json(result.to_json() | {"notes": notes})
    else:
        console.print(
            f"checked {plural(result.strategies, 'strategy', 'strategies')}, "
            f"{plural(result.steps, 'step')}, {plural(result.transitions, 'transition')}"
        )
        for sid in result.deleting:
            console.print(
                f"not checked: strategy {sid} is being deleted "
                f"('fleetwave strategy delete {sid}' finishes it)"
            )
        for note in notes:
            console.print(f"note: {note}", highlight=False)
        for v in result.violations:
            console.print(f"[red]violation[/red] {escape(v)}", markup=True)
        if result.truncated:
            console.print(f"... and {result.truncated} more violations")
        console.print(
            "[green]ok: G1 G3 G7 G8 hold[/green]" if result.ok else "[red]FAILED[/red]",
            markup=True,
        )
    if not result.ok:
        raise typer.Exit(1)
