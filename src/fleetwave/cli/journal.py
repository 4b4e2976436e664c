"""``fleetwave history``, ``events`` and ``check``: what a strategy's journal and events
say happened, and whether the guarantees held."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from rich.markup import escape

from fleetwave import commands
from fleetwave.cli import remote
from fleetwave.cli.common import DbOpt, FormatOpt, count_from_1, existing_store, whole_number
from fleetwave.cli.output import Format, console, emit_rows, first_then, print_json
from fleetwave.cli.parsing import several
from fleetwave.domain.models import plural
from fleetwave.store import queries


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
    """The journal: every transition with time, conductor, from, to (with which visit
    of it: 1 but for a state on a bounded cycle of branches) and details."""
    columns = ["at", "conductor", "target", "from", "to", "visit", "details"]
    names = several("--target", target)
    server = remote.server(db)
    if server is not None:
        path = f"/v1/strategies/{strategy}/history"
        emit_rows(_last(server.every(path, target=names), last), columns, fmt)
        return
    store = existing_store(db)
    rows = queries.iter_history(store, strategy, names, last=last)  # refuses bad names now
    note = queries.deleted_note(store, strategy)
    emit_rows(
        _marked(
            first_then(rows, lambda: queries.iter_history(store, strategy, names, last=last)),
            note,
        ),
        columns,
        fmt,
        title=note,
    )


def _last(rows: list[dict[str, Any]], last: int | None) -> list[dict[str, Any]]:
    """``--last N`` of a list read whole (through a server, which pages from the start)."""
    return rows if last is None else rows[-last:]


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
    columns = ["at", "conductor", "target", "kind", "details"]
    names, kinds = several("--target", target), several("--kind", kind)
    server = remote.server(db)
    if server is not None:
        path = f"/v1/strategies/{strategy}/events"
        emit_rows(_last(server.every(path, target=names, kind=kinds), last), columns, fmt)
        return
    store = existing_store(db)
    rows = queries.iter_events(store, strategy, names, kinds, last)  # refuses bad input now
    note = queries.deleted_note(store, strategy)
    emit_rows(
        _marked(
            first_then(rows, lambda: queries.iter_events(store, strategy, names, kinds, last)),
            note,
        ),
        columns,
        fmt,
        title=note,
    )


def check(
    strategy: Annotated[
        int | None, typer.Option(parser=whole_number, metavar="ID", help="only this strategy")
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Verify G1, G3, G7 and G8 from the journal; exit 1 listing violations."""
    server = remote.server(db)
    if server is not None:
        answer = server.get("/v1/check", strategy=strategy)
    else:
        answer = commands.check(existing_store(db), strategy)[1]
    notes, ok = answer["notes"], bool(answer["ok"])
    if fmt is Format.json:
        print_json(answer)
    else:
        console.print(
            f"checked {plural(answer['strategies'], 'strategy', 'strategies')}, "
            f"{plural(answer['steps'], 'step')}, {plural(answer['transitions'], 'transition')}"
        )
        for sid in answer["not_checked_being_deleted"]:
            console.print(
                f"not checked: strategy {sid} is being deleted "
                f"('fleetwave strategy delete {sid}' finishes it)"
            )
        for note in notes:
            console.print(f"note: {note}", highlight=False)
        for v in answer["violations"]:
            console.print(f"[red]violation[/red] {escape(v)}", markup=True)
        if answer["violations_not_shown"]:
            console.print(f"... and {answer['violations_not_shown']} more violations")
        console.print(
            "[green]ok: G1 G3 G7 G8 hold[/green]" if ok else "[red]FAILED[/red]",
            markup=True,
        )
    if not ok:
        raise typer.Exit(1)
