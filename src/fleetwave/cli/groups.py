"""``fleetwave group``: target groups with their own parallelism: add, list, show, set
and delete."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

import typer

from fleetwave.cli import remote
from fleetwave.cli.common import (
    DbOpt,
    FormatOpt,
    IgnoreMissingOpt,
    delete_named,
    done,
    existing_store,
    max_parallel_as_stored,
    store_for,
    whole_number,
)
from fleetwave.cli.output import Format, emit_one, emit_rows
from fleetwave.domain.models import ApplyType, Group
from fleetwave.store import admin, queries

# put under the root command by main.py, which gives it its command class (_Commands)
group_app = typer.Typer(help="Target groups with their own parallelism.", no_args_is_help=True)


@group_app.command("add")
def group_add(
    name: str,
    max_parallel: Annotated[
        int | None,
        typer.Option(help="targets of this group in flight at once, in each strategy (default 20)"),
    ] = None,
    apply_type: Annotated[
        ApplyType, typer.Option(help="parallel, or serial (one at a time)")
    ] = ApplyType.PARALLEL,
    order: Annotated[
        int | None,
        typer.Option(
            parser=whole_number,
            metavar="N",
            help="its place when groups are stages (--stages-by-group): by N, then name",
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Add a group."""
    parallel = max_parallel_as_stored(max_parallel, apply_type, "group")
    added = admin.ensure_group(store_for(db), Group(name, parallel, apply_type, order))
    done(
        fmt,
        f"group {name} added" if added else f"group {name} already exists, unchanged",
        {"name": name, "added": added},
    )


@group_app.command("list")
def group_list(fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """List groups."""
    server = remote.server(db)
    emit_rows(
        server.get("/v1/groups")["items"] if server else queries.list_groups(existing_store(db)),
        ["name", "max_parallel", "apply_type", "order", "targets"],
        fmt,
    )


@group_app.command("show")
def group_show(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show one group: its settings, its targets and the strategies it has been in."""
    server = remote.server(db)
    if server is not None:
        emit_one(server.get(f"/v1/groups/{quote(name, safe='')}"), fmt)
        return
    emit_one(queries.get_group(existing_store(db), name), fmt)


@group_app.command("set")
def group_set(
    name: str,
    max_parallel: Annotated[
        int | None,
        typer.Option(help="targets of this group in flight at once, in each strategy"),
    ] = None,
    apply_type: Annotated[
        ApplyType | None, typer.Option(help="parallel, or serial (one at a time)")
    ] = None,
    order: Annotated[
        int | None,
        typer.Option(
            parser=whole_number,
            metavar="N",
            help="its place when groups are stages (--stages-by-group): by N, then name",
        ),
    ] = None,
    no_order: Annotated[
        bool, typer.Option("--no-order", help="no place of its own (after those with one)")
    ] = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Change a group's max parallel, apply type or stage order, for strategies created
    from now on."""
    change = admin.change_group(
        existing_store(db),
        name,
        max_parallel=max_parallel,
        apply_type=apply_type,
        stage_order=order,
        no_stage_order=no_order,
    )
    before, after = change["before"], change["after"]
    if not change["changed"]:
        text = (
            f"group {name}: unchanged (max parallel {after['max_parallel']}, {after['apply_type']})"
        )
    else:
        said = [
            f"{what} {_none(before[key])} -> {_none(after[key])}"
            for what, key in (
                ("max parallel", "max_parallel"),
                ("apply type", "apply_type"),
                ("order", "order"),
            )
            if before[key] != after[key]
        ]
        text = f"group {name}: {', '.join(said)}; strategies created from now on use it"
        kept = change["active_strategies_unchanged"]
        if kept:
            text += (
                f" (active {'strategies' if len(kept) > 1 else 'strategy'} "
                f"{', '.join(map(str, kept))} keep{'' if len(kept) > 1 else 's'} the cap "
                "taken when created)"
            )
    done(fmt, text, change)


def _none(value: object) -> object:
    return "none" if value is None else value


@group_app.command("delete")
def group_delete(
    name: str,
    ignore_missing: IgnoreMissingOpt = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Delete a group with no targets, in no strategy."""
    delete_named(
        "group", name, lambda: admin.delete_group(existing_store(db), name), ignore_missing, fmt
    )
