"""``fleetwave target``: the managed targets (subclouds, hosts, nodes): add, import,
list, show, manage, unmanage, set and delete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import typer

from fleetwave import commands
from fleetwave.cli import remote
from fleetwave.cli.common import (
    DbOpt,
    FormatOpt,
    IgnoreMissingOpt,
    delete_named,
    done,
    existing_store,
    store_for,
)
from fleetwave.cli.output import Format, emit_one, emit_rows, err_console
from fleetwave.cli.parsing import parse_pairs, target_file_text, targets_from_file
from fleetwave.domain.errors import InputError
from fleetwave.domain.models import Target, plural
from fleetwave.store import admin, queries

# put under the root command by main.py, which gives it its command class (_Commands)
target_app = typer.Typer(help="Managed targets (subclouds, hosts, nodes).", no_args_is_help=True)


@target_app.command("add")
def target_add(
    name: str,
    group: Annotated[str | None, typer.Option(metavar="NAME", help="group name")] = None,
    driver: Annotated[
        str, typer.Option(metavar="NAME", help="driver ('fleetwave driver list')")
    ] = "sim",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", metavar="KEY=VALUE", help="driver setting (repeatable)"),
    ] = None,
    label: Annotated[
        list[str] | None, typer.Option(metavar="KEY=VALUE", help="label (repeatable)")
    ] = None,
    unmanaged: Annotated[bool, typer.Option("--unmanaged", help="add as unmanaged")] = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Add one target."""
    t = Target(
        name=name,
        group=group,
        driver=driver,
        settings=parse_pairs(set_, "--set"),
        labels=parse_pairs(label, "--label", typed=False),
        managed=not unmanaged,
    )
    answer = commands.add_target(store_for(db), t)
    done(
        fmt,
        f"target {name} added" if answer["added"] else f"target {name} already exists, unchanged",
        answer,
    )


@target_app.command("import")
def target_import(file: Path, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Add targets from CSV (name,group,driver,<settings...>) or YAML, in one transaction."""
    server = remote.server(db)
    if server is not None:
        kind, text = target_file_text(file)
        answer = server.post_text(
            "/v1/targets/import", text, f"text/{kind}", source=str(file), format=kind
        )
    else:
        items = targets_from_file(file)
        kept: list[str] = []
        n = admin.ensure_targets(store_for(db), items, managed_kept=kept)
        answer = {
            "file": str(file),
            "imported": n,
            "unchanged": len(items) - n,
            "managed_kept": kept,
        }
    n, same, kept = answer["imported"], answer["unchanged"], answer["managed_kept"]
    done(
        fmt,
        f"{n} target{'' if n == 1 else 's'} imported from {file}"
        + (f"; {same} already there, unchanged" if same else ""),
        answer,
    )
    if kept and fmt is Format.table:
        # the file meant to fence them off; it does not (the flag is the operator's)
        names = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        err_console.print(
            f"warning: {plural(len(kept), 'target')} given as unmanaged, already there "
            f"managed, stay managed ({names}): whether a target is managed is the "
            "operator's; 'fleetwave target unmanage NAME' keeps a rollout off one",
            highlight=False,
        )


@target_app.command("list")
def target_list(
    group: Annotated[str | None, typer.Option(metavar="NAME", help="only this group")] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY=VALUE", help="only targets with this label (repeatable)"),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """List targets."""
    columns = ["name", "group", "driver", "managed", "settings", "labels"]
    labels = parse_pairs(label, "--label", typed=False)
    server = remote.server(db)
    if server is not None:
        pairs = [f"{k}={v}" for k, v in labels.items()]
        emit_rows(server.every("/v1/targets", group=group, label=pairs), columns, fmt)
        return
    store = existing_store(db)
    emit_rows(
        lambda: queries.iter_targets(store, group, labels, as_text=fmt is not Format.json),
        columns,
        fmt,
    )


@target_app.command("show")
def target_show(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show one target and the strategies it has been in."""
    server = remote.server(db)
    if server is not None:
        emit_one(server.get(f"/v1/targets/{quote(name, safe='')}"), fmt)
        return
    emit_one(queries.get_target(existing_store(db), name), fmt)


@target_app.command("manage")
def target_manage(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Mark a target managed: rollouts may touch it."""
    done(fmt, f"target {name} is managed", commands.set_managed(existing_store(db), name, True))


@target_app.command("unmanage")
def target_unmanage(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Mark a target unmanaged: its step fails when its turn comes, nothing touches it."""
    answer = commands.set_managed(existing_store(db), name, False)
    done(fmt, f"target {name} is unmanaged", answer)
    for w in answer["steps_to_fail"] if fmt is Format.table else ():
        # A failed step makes the strategy end failed (apply --wait exits 1, alerts fire),
        # and may stop it: said now, not found at the end.
        stops = (
            f"; strategy {w['strategy']} stops {w['stops']}: its steps not started then end aborted"
            if w["stops"]
            else ""
        )
        err_console.print(
            f"warning: target {name}: its step in strategy {w['strategy']} ({w['state']}) "
            "has not started: it fails when its turn comes (the strategy then ends "
            f"failed){stops}; "
            f"'fleetwave target manage {name}' before then lets it run",
            highlight=False,
        )


@target_app.command("set")
def target_set(
    name: str,
    group: Annotated[str | None, typer.Option(metavar="NAME", help="move it to this group")] = None,
    no_group: Annotated[bool, typer.Option("--no-group", help="take it out of its group")] = False,
    driver: Annotated[str | None, typer.Option(metavar="NAME", help="another driver")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="KEY=VALUE", help="driver setting to add or change (repeatable)"
        ),
    ] = None,
    unset: Annotated[
        list[str] | None, typer.Option(metavar="KEY", help="driver setting to remove (repeatable)")
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY=VALUE", help="label to add or change (repeatable)"),
    ] = None,
    unlabel: Annotated[
        list[str] | None, typer.Option(metavar="KEY", help="label to remove (repeatable)")
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Change a target's group, driver, settings or labels (not while in an active strategy)."""
    if group is not None and no_group:
        raise InputError("--group and --no-group: give one of them")
    if (
        group is None
        and not no_group
        and driver is None
        and not (set_ or unset or label or unlabel)
    ):
        raise InputError(
            "nothing to change: give --group, --no-group, --driver, --set, --unset, --label "
            "or --unlabel"
        )
    answer = commands.change_target(
        existing_store(db),
        name,
        group=None if no_group else (group if group is not None else admin.KEEP),
        driver=driver,
        settings=parse_pairs(set_, "--set"),
        unset=[k.strip() for k in unset or []],
        labels=parse_pairs(label, "--label", typed=False),
        unlabel=[k.strip() for k in unlabel or []],
    )
    changes = answer["changes"]
    said = "; ".join(_said_change(field, c["before"], c["after"]) for field, c in changes.items())
    done(
        fmt,
        f"target {name}: {said}" if changes else f"target {name}: unchanged (it is so already)",
        answer,
    )


def _said_change(field: str, before: Any, after: Any) -> str:
    """``group east -> west``; for settings and labels, key by key:
    ``settings: latency_ms 5 -> 10, failure_rate (unset) -> 0.1``."""
    if not isinstance(before, dict):
        return f"{field} {before or '(none)'} -> {after or '(none)'}"

    def value(d: dict[str, Any], k: str) -> str:
        if k not in d:
            return "(unset)"
        v = d[k]
        return json.dumps(v) if isinstance(v, bool) or v in ("", None) else str(v)

    keys = [*before, *(k for k in after if k not in before)]
    return f"{field}: " + ", ".join(
        f"{k} {value(before, k)} -> {value(after, k)}"
        for k in keys
        if json.dumps(before.get(k)) != json.dumps(after.get(k)) or (k in before) != (k in after)
    )


@target_app.command("delete")
def target_delete(
    name: str,
    ignore_missing: IgnoreMissingOpt = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Delete a target that is in no strategy."""
    delete_named(
        "target", name, lambda: admin.delete_target(existing_store(db), name), ignore_missing, fmt
    )
