"""``fleetwave``: targets, groups, workflows, strategies, history, check, serve and demo.

Bad input prints one line naming the problem on stderr and exits 2; nothing is written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.markup import escape
from sqlalchemy.exc import DBAPIError, OperationalError

import fleetwave
from fleetwave.catalog import resolve_workflow, workflow_catalog
from fleetwave.cli import output
from fleetwave.cli.common import (
    DbOpt,
    FormatOpt,
    StepId,
    StrategyId,
    count_from_1,
    db_named,
    discard_created,
    existing_store,
    forget_created,
    store_for,
    store_if_any,
    whole_number,
)
from fleetwave.cli.demo import demo_command
from fleetwave.cli.drive import (
    UNREAD,
    drive_strategy,
    now_state,
    stop_on_signals,
    stopped_at_once,
    stopped_watching,
)
from fleetwave.cli.output import Format, console, emit_one, emit_rows, err_console, print_json
from fleetwave.cli.parsing import (
    check_target,
    decode_text,
    parse_pairs,
    read_text_file,
    targets_from_file,
)
from fleetwave.cli.simcmd import sim_command
from fleetwave.domain.errors import Conflict, InputError, NotFound
from fleetwave.domain.models import (
    STEP_ABORTED,
    STEP_FAILED,
    STRATEGY_TERMINAL,
    ApplyType,
    Group,
    StrategyOptions,
    StrategyState,
    Target,
    name_problem,
    plural,
    shown,
)
from fleetwave.domain.registry import get_workflow, load_plugins
from fleetwave.domain.workflow import WorkflowError, describe_workflow
from fleetwave.domain.yaml_workflow import MAX_SECONDS, parse_workflow_yaml
from fleetwave.engine import loop as event_loop
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import LEASE_TTL_MAX_S, LEASE_TTL_MIN_S, EngineConfig
from fleetwave.engine.errors import StoreReplaced, StoreUnavailable
from fleetwave.store import admin, queries
from fleetwave.store.admin import DEFAULT_MAX_PARALLEL
from fleetwave.store.callbacks import KINDS as CALLBACK_KINDS
from fleetwave.store.callbacks import accept_callback
from fleetwave.store.db import (
    HEAD_REVISION,
    SchemaOutdated,
    Store,
    StoreError,
    default_db_path,
    migrate,
    open_store,
)
from fleetwave.testing.invariants import check as check_invariants


class _Interrupted(BaseException):
    """Ctrl-C (or SIGTERM, SIGHUP) that no command handled itself: Typer would turn a
    ``KeyboardInterrupt`` into exit 130 without a word."""


class _Commands(typer.core.TyperGroup):
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted from None

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None and not isinstance(cmd, typer.core.TyperGroup) and "--help" not in rest:
            _refuse_repeats(ctx, cmd, rest)  # (asked for help: the help, whatever else)
        return name, cmd, rest


def _refuse_repeats(ctx: Any, cmd: Any, args: list[str]) -> None:
    """An option that takes one value, given twice: Click keeps the last without a word
    (``--group ga --group gb`` made a strategy of gb only; ``--max-parallel 3
    --max-parallel 9`` ran at 9). Refused, as a name given twice in --targets is."""
    takes = {
        opt: param
        for param in cmd.params
        if getattr(param, "param_type_name", "") == "option"
        for opt in [*param.opts, *param.secondary_opts]
    }
    seen: set[str] = set()
    #: a flag's forms given (--wait, --no-wait): both would keep the last silently
    forms: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            break
        opt = token.split("=", 1)[0] if token.startswith("--") else token
        if opt not in takes:
            continue
        param = takes[opt]
        first = param.opts[0]
        if param.is_flag:
            given = forms.setdefault(first, [])
            if opt not in given:
                given.append(opt)
            if len(given) > 1:
                ctx.fail(f"{' and '.join(given)}: give one of them")
            continue
        if "=" not in token:
            i += 1  # its value, whatever it looks like
        if not (param.multiple or param.count):  # one value only
            if first in seen:
                ctx.fail(f"{first}: given more than once (it takes one value)")
            seen.add(first)


app = typer.Typer(
    cls=_Commands,
    help="fleetwave: roll one operation across a fleet, exactly once per state.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
target_app = typer.Typer(
    cls=_Commands, help="Managed targets (subclouds, hosts, nodes).", no_args_is_help=True
)
group_app = typer.Typer(
    cls=_Commands, help="Target groups with their own parallelism.", no_args_is_help=True
)
workflow_app = typer.Typer(
    cls=_Commands, help="Workflows: built-in, Python and YAML.", no_args_is_help=True
)
strategy_app = typer.Typer(
    cls=_Commands, help="Rollouts of one workflow over targets.", no_args_is_help=True
)
step_app = typer.Typer(
    cls=_Commands, help="Steps: one target inside one strategy.", no_args_is_help=True
)
app.add_typer(target_app, name="target")
app.add_typer(group_app, name="group")
app.add_typer(workflow_app, name="workflow")
app.add_typer(strategy_app, name="strategy")
app.add_typer(step_app, name="step")
app.command("demo")(demo_command)
app.command("sim")(sim_command)


def _print_version(value: bool) -> None:
    if value:
        console.print(f"fleetwave {fleetwave.__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """fleetwave: roll one operation across a fleet, exactly once per state."""


@app.command()
def init(db: DbOpt = None) -> None:
    """Create the database, or upgrade an older fleetwave's to this one's schema."""
    try:
        store = store_for(db)
    except SchemaOutdated as old:
        # Upgrading under a running conductor of the older fleetwave would change its
        # tables under it: every conductor using the database stops first.
        store = open_store(db or default_db_path(), migrate_schema=False)
        running = queries.running_conductors(store)
        if running:
            names = ", ".join(queries.conductor_named(c) for c in running)
            raise InputError(
                f"{db_named(db)}: {store.url} is in use by "
                f"conductor{'s' if len(running) > 1 else ''} "
                f"{names}: stop {'them' if len(running) > 1 else 'it'}, then run "
                "'fleetwave init' again (nothing was changed)"
            ) from None
        if migrate(store) == HEAD_REVISION:
            # another 'fleetwave init' upgraded it meanwhile (this one waited for it)
            console.print(f"database ready (upgraded meanwhile by another init): {store.url}")
            return
        console.print(
            f"database upgraded from schema revision {old.revision} to {HEAD_REVISION}: {store.url}"
        )
        return
    console.print(f"database ready: {store.url}")


# -- targets ------------------------------------------------------------------------


@target_app.command("add")
def target_add(
    name: str,
    group: Annotated[str | None, typer.Option(help="group name")] = None,
    driver: Annotated[str, typer.Option(help="driver: sim")] = "sim",
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="driver setting key=value (repeatable)")
    ] = None,
    label: Annotated[list[str] | None, typer.Option(help="label k=v (repeatable)")] = None,
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
    check_target(t, f"target {name}")
    added = bool(admin.ensure_targets(store_for(db), [t]))
    _done(
        fmt,
        f"target {name} added" if added else f"target {name} already exists, unchanged",
        {"name": name, "added": added},
    )


@target_app.command("import")
def target_import(file: Path, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Add targets from CSV (name,group,driver,<settings...>) or YAML, in one transaction."""
    items = targets_from_file(file)
    kept: list[str] = []
    n = admin.ensure_targets(store_for(db), items, managed_kept=kept)
    same = len(items) - n
    _done(
        fmt,
        f"{n} target{'' if n == 1 else 's'} imported from {file}"
        + (f"; {same} already there, unchanged" if same else ""),
        {"file": str(file), "imported": n, "unchanged": same, "managed_kept": kept},
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


def _done(fmt: Format, text: str, answer: dict[str, Any]) -> None:
    """What a command that changes something did: a line, or (``--format json``) one
    JSON object a script can read."""
    if fmt is Format.json:
        print_json(answer)
    else:
        console.print(text)


@target_app.command("list")
def target_list(
    group: Annotated[str | None, typer.Option(help="only this group")] = None,
    label: Annotated[
        list[str] | None, typer.Option(help="only targets with this label k=v (repeatable)")
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """List targets."""
    store = existing_store(db)
    labels = parse_pairs(label, "--label", typed=False)
    emit_rows(
        lambda: queries.iter_targets(store, group, labels, as_text=fmt is not Format.json),
        ["name", "group", "driver", "managed", "settings", "labels"],
        fmt,
    )


@target_app.command("show")
def target_show(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show one target and the strategies it has been in."""
    emit_one(queries.get_target(existing_store(db), name), fmt)


@target_app.command("manage")
def target_manage(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Mark a target managed: rollouts may touch it."""
    admin.set_managed(existing_store(db), name, True)
    _done(fmt, f"target {name} is managed", {"name": name, "managed": True})


@target_app.command("unmanage")
def target_unmanage(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Mark a target unmanaged: its step fails when its turn comes, nothing touches it."""
    waiting = admin.set_managed(existing_store(db), name, False)
    _done(
        fmt,
        f"target {name} is unmanaged",
        {"name": name, "managed": False, "steps_to_fail": waiting},
    )
    for w in waiting if fmt is Format.table else ():
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
    group: Annotated[str | None, typer.Option(help="move it to this group")] = None,
    no_group: Annotated[bool, typer.Option("--no-group", help="take it out of its group")] = False,
    driver: Annotated[str | None, typer.Option(help="another driver")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="driver setting key=value to add or change (repeatable)"),
    ] = None,
    unset: Annotated[
        list[str] | None, typer.Option(help="driver setting to remove (repeatable)")
    ] = None,
    label: Annotated[
        list[str] | None, typer.Option(help="label k=v to add or change (repeatable)")
    ] = None,
    unlabel: Annotated[list[str] | None, typer.Option(help="label to remove (repeatable)")] = None,
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
    changes = admin.change_target(
        existing_store(db),
        name,
        group=None if no_group else (group if group is not None else admin.KEEP),
        driver=driver,
        settings=parse_pairs(set_, "--set"),
        unset=[k.strip() for k in unset or []],
        labels=parse_pairs(label, "--label", typed=False),
        unlabel=[k.strip() for k in unlabel or []],
        check=lambda t: check_target(t, f"target {name}"),
    )
    said = "; ".join(_said_change(field, c["before"], c["after"]) for field, c in changes.items())
    _done(
        fmt,
        f"target {name}: {said}" if changes else f"target {name}: unchanged (it is so already)",
        {"name": name, "changed": bool(changes), "changes": changes},
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


IgnoreMissingOpt = Annotated[
    bool,
    typer.Option(
        "--ignore-missing",
        help="one that is not there is no error (exit 0, nothing deleted): for scripts "
        "that delete what may be gone already",
    ),
]


def _never_a_name(name: str) -> None:
    """A name not found that no target or group could have (empty: an unset variable
    in a script) is bad input, also with --ignore-missing."""
    problem = name_problem(name)
    if problem:
        raise InputError(f"NAME: {problem}")


def _delete_named(
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
        _missing(fmt, f"{kind} {name}", {"name": name})
        return
    _done(fmt, f"{kind} {name} deleted", {"name": name, "deleted": True})


def _missing(fmt: Format, what: str, key: dict[str, Any]) -> None:
    """``delete --ignore-missing`` of one that is not there: said, not an error."""
    _done(fmt, f"{what}: not there, nothing deleted", {**key, "deleted": False})


@target_app.command("delete")
def target_delete(
    name: str,
    ignore_missing: IgnoreMissingOpt = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Delete a target that is in no strategy."""
    _delete_named(
        "target", name, lambda: admin.delete_target(existing_store(db), name), ignore_missing, fmt
    )


# -- groups ---------------------------------------------------------------------------


def _parallel(given: int | None, apply_type: ApplyType, what: str) -> int:
    """--max-parallel as stored: serial means one at a time, so a serial group or
    strategy given another number is refused rather than silently run one by one."""
    if apply_type is not ApplyType.SERIAL:
        return DEFAULT_MAX_PARALLEL if given is None else given
    if given is not None and given < 1:
        return given  # refused as every max parallel below 1 is, by the store
    admin.check_serial(given, what)
    return 1


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
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Add a group."""
    parallel = _parallel(max_parallel, apply_type, "group")
    added = admin.ensure_group(store_for(db), Group(name, parallel, apply_type))
    _done(
        fmt,
        f"group {name} added" if added else f"group {name} already exists, unchanged",
        {"name": name, "added": added},
    )


@group_app.command("list")
def group_list(fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """List groups."""
    emit_rows(
        queries.list_groups(existing_store(db)),
        ["name", "max_parallel", "apply_type", "targets"],
        fmt,
    )


@group_app.command("show")
def group_show(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show one group: its settings, its targets and the strategies it has been in."""
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
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Change a group's max parallel or apply type, for strategies created from now on."""
    change = admin.change_group(
        existing_store(db), name, max_parallel=max_parallel, apply_type=apply_type
    )
    before, after = change["before"], change["after"]
    if not change["changed"]:
        text = (
            f"group {name}: unchanged (max parallel {after['max_parallel']}, {after['apply_type']})"
        )
    else:
        said = [
            f"{what} {before[key]} -> {after[key]}"
            for what, key in (("max parallel", "max_parallel"), ("apply type", "apply_type"))
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
    _done(fmt, text, change)


@group_app.command("delete")
def group_delete(
    name: str,
    ignore_missing: IgnoreMissingOpt = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Delete a group with no targets, in no strategy."""
    _delete_named(
        "group", name, lambda: admin.delete_group(existing_store(db), name), ignore_missing, fmt
    )


# -- workflows --------------------------------------------------------------------------


def _workflow_dict(name: str, db: str | None) -> dict[str, object]:
    return describe_workflow(resolve_workflow(store_if_any(db), name, what="NAME"))


def _duration(seconds: float) -> str:
    """600 -> 10m, 5400 -> 1h30m, 0.25 -> 0.25s, 100000.25 -> 27h46m40.25s: read at a
    glance, to the millisecond."""
    millis = round(seconds * 1000)
    if 0 < seconds < 0.001:
        return f"{seconds:g}s"  # not "0s": a timeout under a millisecond is not none
    if millis < 60_000:
        return f"{millis / 1000:g}s"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else ""]
    if rest:
        parts.append(f"{rest / 1000:g}s")
    return "".join(parts)


_MODE_NOTE = {"wait-for-callback": "then waits for the target's callback"}


def _states_table(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The states as an operator reads them, whole, in a terminal of 80 columns."""
    rows = []
    for s in states:
        attempts = str(s["attempts"])
        if s["attempts"] > 1:
            attempts += f" (backoff {_duration(s['backoff_s'])}..{_duration(s['backoff_max_s'])})"
        # "driver:pre-check" in state pre-check: the driver operation named like the state
        action = str(s["action"])
        named_like = f"driver:{s['state']}"
        if action == named_like or action.startswith(named_like + " "):
            action = "driver" + action[len(named_like) :]
        if s["mode"] in _MODE_NOTE:
            action += f"; {_MODE_NOTE[s['mode']]}"
        elif s["mode"] == "poll":
            action += f"; polls every {_duration(s['poll_interval_s'])}"
        rows.append(
            {
                "state": s["state"],
                "action": action,
                "timeout": _duration(s["timeout_s"]),
                "attempts": attempts,
                "recover": s["recover"],
            }
        )
    return rows


@workflow_app.command("list")
def workflow_list(fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """List workflows."""
    usable, broken = workflow_catalog(store_if_any(db))
    rows: list[dict[str, Any]] = [
        {
            "name": wf.name,
            "version": wf.version,
            "source": wf.source,
            # JSON: the states as a list; a table: in order, with arrows
            "states": list(wf.state_names) if fmt is Format.json else " -> ".join(wf.state_names),
        }
        for wf in usable
    ]
    for name, why in broken.items():
        # Listed, with why it cannot be used here (the others stay usable).
        rows.append(
            {
                "name": name,
                "version": None,
                "source": "yaml",
                "states": [] if fmt is Format.json else "UNUSABLE HERE (see 'problem')",
                "problem": why,
            }
        )
    if broken:
        for row in rows:
            row.setdefault("problem", None)
    rows.sort(key=lambda r: str(r["name"]))
    columns = ["name", "version", "source", "states"] + (["problem"] if broken else [])
    emit_rows(rows, columns, fmt)
    if broken and fmt is Format.table:
        err_console.print(
            f"warning: {plural(len(broken), 'stored workflow')} cannot be used by this "
            "process (FLEETWAVE_PLUGINS names the modules of python: actions)",
            highlight=False,
        )


@workflow_app.command("show")
def workflow_show(name: str, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show a workflow's states, actions, timeouts and retries."""
    wf = _workflow_dict(name, db)
    if fmt is Format.json:
        emit_one(wf, fmt)
        return
    states = _states_table(cast(list[dict[str, Any]], wf.pop("states")))
    emit_one(wf, fmt)
    emit_rows(states, list(states[0]), fmt, title="states", whole_first=True)


@workflow_app.command("validate")
def workflow_validate(file: Path, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Check a YAML workflow file; errors name the state and field. With a database
    (--db, $FLEETWAVE_DB, or ./fleetwave.db if there), also what 'workflow add' would
    say of its version there."""
    _check_file(file)
    wf = parse_workflow_yaml(read_text_file(file), source=str(file), strict=True)
    _not_builtin(file, wf.name)
    said = f"{file}: workflow {wf.name} v{wf.version} is valid ({plural(len(wf.states), 'state')})"
    answer: dict[str, Any] = {
        "file": str(file),
        "name": wf.name,
        "version": wf.version,
        # its states' names, as every other answer has them
        "states": list(wf.state_names),
        # what 'workflow add' would do (None: no database to ask)
        "add_would": None,
        "stored_version": None,
    }
    store = store_if_any(db)
    if store is not None:
        stored = answer["stored_version"] = admin.check_workflow_version(store, wf)
        if stored is None:
            said += "; 'workflow add' would store it"
            answer["add_would"] = "store"
        elif stored == wf.version:
            said += f"; already stored as v{stored}, unchanged"
            answer["add_would"] = "nothing"
        else:
            said += f"; 'workflow add' would replace the stored v{stored}"
            answer["add_would"] = "replace"
    _done(fmt, said, answer)


def _check_file(file: Path) -> None:
    if file.is_dir():
        raise InputError(f"FILE: {file} is a directory, not a workflow file")
    if not file.exists():
        raise InputError(f"FILE: {file} does not exist")
    if not file.is_file():
        raise InputError(f"FILE: {file} is not a regular file (a device, pipe or socket)")


def _not_builtin(file: Path, name: str) -> None:
    """``workflow add`` refuses a built-in's (or a plug-in's) name; validate says so too."""
    known = get_workflow(name)
    if known is not None and known.source != "yaml":
        raise InputError(f"{file}: name: '{name}' is a built-in workflow; choose another name")


@workflow_app.command("add")
def workflow_add(file: Path, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Validate a YAML workflow and store it, so strategies can use it."""
    _check_file(file)
    text = read_text_file(file)
    wf = parse_workflow_yaml(text, source=str(file), strict=True)
    _not_builtin(file, wf.name)
    replaced = admin.save_workflow(store_for(db), wf, text)
    answer = {
        "name": wf.name,
        "version": wf.version,
        "stored": replaced != wf.version,
        "replaced_version": replaced if replaced != wf.version else None,
    }
    if replaced == wf.version:
        said = f"workflow {wf.name} v{wf.version} is already stored, unchanged"
    elif replaced is not None:
        said = (
            f"workflow {wf.name} v{wf.version} stored, replacing v{replaced} "
            f"(strategies created from v{replaced} keep it)"
        )
    else:
        said = f"workflow {wf.name} v{wf.version} stored"
    _done(fmt, said, answer)


@workflow_app.command("delete")
def workflow_delete(
    name: str,
    ignore_missing: IgnoreMissingOpt = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Remove a stored (YAML) workflow; strategies created from it keep their copy."""
    known = get_workflow(name)
    if known is not None and known.source != "yaml":
        what = "built in" if known.source == "builtin" else "defined in Python (a plug-in)"
        raise InputError(f"workflow {name}: {what}, not stored: it cannot be deleted")
    store = existing_store(db)
    try:
        version = admin.delete_workflow(store, name)
    except NotFound:
        if not ignore_missing:
            raise
        _missing(fmt, f"workflow {name}", {"name": name})
        return
    _done(
        fmt,
        f"workflow {name} v{version} deleted (strategies created from it keep their copy)",
        {"name": name, "version": version, "deleted": True},
    )


# -- strategies ---------------------------------------------------------------------------


def _timeouts(items: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    typed = parse_pairs(items, "--timeout", typed=False)  # as given, for the errors
    for key, value in parse_pairs(items, "--timeout").items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < float("inf")
        ):
            raise InputError(
                f"--timeout: {key}: expected a positive number of seconds, got {shown(typed[key])}"
            )
        if value > MAX_SECONDS:
            raise InputError(
                f"--timeout: {key}: at most {MAX_SECONDS} seconds (30 days), got {typed[key]}"
            )
        out[key] = float(value)
    return out


@strategy_app.command("create")
def strategy_create(
    workflow: Annotated[str, typer.Option(help="workflow name")],
    targets: Annotated[
        str | None,
        typer.Option(
            help="comma-separated target names; @FILE reads them from a file, - from stdin "
            "(one per line, or comma- or space-separated; # starts a comment)"
        ),
    ] = None,
    group: Annotated[str | None, typer.Option(help="every target of this group")] = None,
    all_: Annotated[bool, typer.Option("--all", help="every target")] = False,
    failed_in: Annotated[
        int | None,
        typer.Option(
            parser=whole_number,
            metavar="ID",
            help="the targets whose step in strategy ID failed or was aborted (a retry)",
        ),
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(help="only targets with this label k=v (repeatable; alone: of all)"),
    ] = None,
    max_parallel: Annotated[
        int | None, typer.Option(help="steps in flight at once (default 20)")
    ] = None,
    apply_type: Annotated[
        ApplyType, typer.Option(help="parallel, or serial (one at a time)")
    ] = ApplyType.PARALLEL,
    stop_on_failure: Annotated[
        bool, typer.Option("--stop-on-failure", help="stop at the first failure")
    ] = False,
    max_failures: Annotated[
        int | None,
        typer.Option(parser=whole_number, metavar="N", help="stop once more than N steps failed"),
    ] = None,
    stages_by_group: Annotated[
        bool,
        typer.Option("--stages-by-group", help="one stage per group, run one after another"),
    ] = False,
    timeout: Annotated[
        list[str] | None, typer.Option(help="state=seconds timeout override (repeatable)")
    ] = None,
    # The defaults, said out loud (scripts written for earlier versions say them); not
    # in --help, where their second column cut every option's name at 80 columns.
    no_stop_on_failure: Annotated[bool, typer.Option("--no-stop-on-failure", hidden=True)] = False,
    no_stages_by_group: Annotated[bool, typer.Option("--no-stages-by-group", hidden=True)] = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Create a strategy (state initial); apply it to start."""
    for flag, on, off in (
        ("stop-on-failure", stop_on_failure, no_stop_on_failure),
        ("stages-by-group", stages_by_group, no_stages_by_group),
    ):
        if on and off:
            raise InputError(f"--{flag} and --no-{flag}: give one of them")
    store = existing_store(db)
    names = _target_names(targets) if targets is not None else None
    if failed_in is not None:
        if names is not None or group is not None or all_ or label:
            raise InputError(
                "--failed-in: picks the targets itself; not with --targets, --group, --all "
                "or --label"
            )
        if queries.get_strategy(store, failed_in)["state"] == StrategyState.DELETING:
            raise InputError(
                f"--failed-in: strategy {failed_in} is being deleted, its steps partly gone "
                f"('fleetwave strategy delete {failed_in}' finishes it)"
            )
        names = [
            row["target"]
            for row in queries.iter_steps(store, failed_in, [STEP_FAILED, STEP_ABORTED])
        ]
        if not names:
            raise InputError(f"--failed-in: strategy {failed_in} has no failed or aborted step")
    wf = resolve_workflow(store, workflow)
    timeouts = _timeouts(timeout)
    unknown = [state for state in timeouts if state not in wf.state_names]
    if unknown:
        raise InputError(
            f"--timeout: {', '.join(unknown)}: workflow {wf.name} has no such state "
            f"(its states: {', '.join(wf.state_names)})"
        )
    opts = StrategyOptions(
        max_parallel=_parallel(max_parallel, apply_type, "strategy"),
        apply_type=apply_type,
        stop_on_failure=stop_on_failure,
        max_failures=max_failures,
        stages_by_group=stages_by_group,
        timeouts_s=timeouts,
    )
    sid = admin.create_strategy(
        store,
        wf,
        opts,
        target_names=names,
        group=group,
        all_targets=all_,
        labels=parse_pairs(label, "--label", typed=False),
    )
    if fmt is Format.json:
        print_json(queries.get_strategy(store, sid))
    else:
        console.print(f"strategy {sid} created ({wf.name})")


def _target_names(given: str) -> list[str]:
    """``--targets``: the names as given (a,b,c), or read from ``@FILE`` or ``-`` (stdin):
    one per line, or separated by commas or spaces; ``#`` starts a comment. (A name
    starts with a letter or digit, so neither form can be a name.) An empty name in a
    list, or one that is not text, is refused."""
    if given != "-" and not given.startswith("@"):
        names = given.split(",")
        if any(not name.strip() for name in names):
            raise InputError(f"--targets: an empty name in {shown(given)}")
    else:
        if given == "-":
            text = decode_text(sys.stdin.buffer.read(), "--targets: stdin")
            source = "stdin"
        else:
            path, source = Path(given[1:]), given
            if not path.is_file():
                what = "a directory" if path.is_dir() else "no such file"
                raise InputError(f"--targets: {given}: {what}")
            text = read_text_file(path)
        names = [
            name
            for line in text.splitlines()
            for name in line.split("#", 1)[0].replace(",", " ").split()
        ]
        if not names:
            raise InputError(f"--targets: {source} names no target")
    for name in names:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"--targets: {shown(name)} is not valid text") from None
    return names


LeaseTtlOpt = Annotated[
    float | None,
    typer.Option(
        "--lease-ttl",
        metavar="SECONDS",
        help=f"lease length (default {EngineConfig.lease_ttl_s:g}): a conductor lost on "
        "another host is taken over this long after its last renewal",
    ),
]


def _engine_config(lease_ttl: float | None) -> EngineConfig:
    if lease_ttl is None:
        return EngineConfig()
    if not LEASE_TTL_MIN_S <= lease_ttl <= LEASE_TTL_MAX_S:  # also NaN
        raise InputError(
            f"--lease-ttl: must be {LEASE_TTL_MIN_S:g} to {LEASE_TTL_MAX_S:g} seconds, "
            f"got {lease_ttl:g}"
        )
    return EngineConfig(lease_ttl_s=lease_ttl)


@strategy_app.command("apply")
def strategy_apply(
    strategy_id: StrategyId,
    wait: Annotated[bool, typer.Option(help="drive it here and wait for the end")] = False,
    lease_ttl: LeaseTtlOpt = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Start (or resume) a strategy. With --wait, drive it in the foreground."""
    if lease_ttl is not None and not wait:
        raise InputError(
            "--lease-ttl: only with --wait (the lease of the conductor that drives it here)"
        )
    config = _engine_config(lease_ttl)
    store = existing_store(db)
    if wait:
        ended = queries.get_strategy(store, strategy_id)
        if ended["state"] in STRATEGY_TERMINAL:
            # Ended already (this command run again, by a script or a retried job): its
            # result, as if this run had waited for it; nothing is driven or changed,
            # so nothing it would need to drive it is asked for (its workflow's code).
            err_console.print(
                f"strategy {strategy_id} had already ended ({ended['state']}): nothing to drive",
                highlight=False,
            )
            _ended(ended, fmt)
            return
        event_loop.loop_kind()  # a bad FLEETWAVE_LOOP is refused before anything changes
        # Driving it here needs its workflow here (a Python one, or a YAML one naming a
        # Python action: its plug-in imported).
        name, own_copy = queries.strategy_workflow(store, strategy_id)
        if own_copy is None:
            resolve_workflow(store, name, what=f"strategy {strategy_id}: workflow")
        else:
            parse_workflow_yaml(own_copy, source=f"strategy {strategy_id}: workflow {name}")
    before = (
        _apply_patiently(store, strategy_id, ended["state"])
        if wait
        else admin.apply_strategy(store, strategy_id)
    )
    if not wait:
        who = queries.driving(store, strategy_id)
        now = "applying" if before in ("initial", "paused", "applying") else before
        if now != "applying":
            now += " (apply does not undo an abort: a conductor finishes it)"
        elif before == "paused":
            now += " (resumed: it was paused)"
        if who.owner is not None:
            said = f"driven by conductor {who.owner}"
        elif who.claimer is not None:
            said = str(who.claim)
        else:
            said = "nothing drives it yet"
        if fmt is Format.json:
            # driven_by as `strategy show --format json` says it, word for word
            print_json(
                {
                    "id": strategy_id,
                    "state": now.split(" ")[0],
                    "was": before,
                    "driven_by": who.text,
                }
            )
        else:
            console.print(f"strategy {strategy_id} {now}; {said}")
        if who.nobody:
            err_console.print(
                f"warning: no conductor serves {store.url}: strategy {strategy_id} waits until "
                f"'fleetwave serve' runs (or drive it here: 'fleetwave strategy apply "
                f"{strategy_id} --wait')",
                highlight=False,
            )
        return
    try:
        result = drive_strategy(
            store, strategy_id, show_progress=fmt is Format.table, config=config
        )
    except KeyboardInterrupt:
        # Ctrl-C before the signal handlers were in place: stopped at once.
        err_console.print(stopped_at_once(store, strategy_id, config.lease_ttl_s), highlight=False)
        raise typer.Exit(130) from None
    if result.state == "interrupted":
        if not result.held:
            err_console.print(stopped_watching(store, strategy_id), highlight=False)
            raise typer.Exit(130)
        left = now_state(store, strategy_id)
        state = f"is still {left}" if left is not None else f"state could not be read ({UNREAD})"
        err_console.print(
            f"stopped: strategy {strategy_id} {state}"
            f"; leases handed back. Go on with 'fleetwave strategy apply {strategy_id} --wait' "
            "or 'fleetwave serve'",
            highlight=False,
        )
        raise typer.Exit(130)
    _ended(queries.get_strategy(store, strategy_id), fmt)


def _apply_patiently(store: Store, strategy_id: int, was: str) -> str:
    """``apply --wait``'s first write (the strategy marked applying), as patient as the
    conductor it starts: an outage (the database locked by another program past the
    time a write waits, read-only, full) is waited out and said once; Ctrl-C stops it
    with nothing changed. ``was``: its state as read before; returns the state it was in
    when applied."""
    failures = 0
    try:
        while True:
            try:
                return admin.apply_strategy(store, strategy_id)
            except OperationalError as exc:
                if not store.hooks.is_outage(exc):
                    raise
                if store.hooks.needs_new_connections(exc):
                    store.dispose()  # a connection opened read-only stays so
                failures += 1
                if failures == 1:
                    err_console.print(
                        f"waiting: the database does not answer ({exc.orig}"
                        f"{_database_hint(exc, waiting=True)}); strategy {strategy_id} is "
                        "applied and driven here once it does (Ctrl-C to stop: nothing is "
                        "changed until then)",
                        highlight=False,
                    )
                time.sleep(min(5.0, 0.05 * 2 ** min(failures, 7)))
    except KeyboardInterrupt:
        # The write may have gone through as the interrupt came (the lock released just
        # then): the database says which, if it answers.
        now = now_state(store, strategy_id)
        if now is not None and now != was:
            said = (
                f"stopped: strategy {strategy_id} is {now} (its apply went through as this "
                f"command stopped), and nothing drives it here: 'fleetwave strategy apply "
                f"{strategy_id} --wait' or 'fleetwave serve' does"
            )
        else:
            said = (
                f"stopped: strategy {strategy_id} was not applied (the database did not "
                "answer); nothing changed"
            )
        err_console.print(said, highlight=False)
        raise typer.Exit(130) from None


def _ended(summary: dict[str, Any], fmt: Format) -> None:
    """``apply --wait``'s answer: the strategy as it ended; exit 1 unless complete."""
    if fmt is Format.json:
        print_json(summary)
    else:
        emit_one(summary, fmt)
    if summary["state"] != StrategyState.COMPLETE:
        raise typer.Exit(1)


@strategy_app.command("pause")
def strategy_pause(
    strategy_id: StrategyId, fmt: FormatOpt = Format.table, db: DbOpt = None
) -> None:
    """Pause: no new step starts; steps in flight go on to their end. Undo with resume."""
    before = admin.pause_strategy(existing_store(db), strategy_id)
    _done(
        fmt,
        f"strategy {strategy_id}: already paused"
        if before == "paused"
        else (
            f"strategy {strategy_id}: paused; no new step starts, steps in flight go on to "
            f"their end ('fleetwave strategy resume {strategy_id}' to go on)"
        ),
        {"id": strategy_id, "state": "paused", "was": str(before)},
    )


@strategy_app.command("resume")
def strategy_resume(
    strategy_id: StrategyId, fmt: FormatOpt = Format.table, db: DbOpt = None
) -> None:
    """Resume a paused strategy: its waiting steps start again."""
    store = existing_store(db)
    before = admin.resume_strategy(store, strategy_id)
    _done(
        fmt,
        f"strategy {strategy_id}: not paused (applying)"
        if before == "applying"
        else f"strategy {strategy_id}: resumed",
        {"id": strategy_id, "state": "applying", "was": str(before)},
    )
    _warn_if_undriven(store, strategy_id, "strategy {sid} goes on", "drive")


@strategy_app.command("abort")
def strategy_abort(
    strategy_id: StrategyId, fmt: FormatOpt = Format.table, db: DbOpt = None
) -> None:
    """Abort: nothing new starts; running actions finish their current state, and waits
    on a target (for its callback, between polls) end at once."""
    store = existing_store(db)
    before = admin.request_abort(store, strategy_id)
    # its state now (a never-applied one is aborted by this very call), and whether
    # this call asked for the abort
    after: dict[str | None, str] = {
        None: StrategyState.ABORT_REQUESTED.value,
        StrategyState.INITIAL.value: StrategyState.ABORTED.value,
    }
    now = after.get(before, str(before))
    answer = {
        "id": strategy_id,
        "state": now,
        "asked_now": before is None or before == StrategyState.INITIAL,
    }
    if before == StrategyState.ABORTED:
        _done(fmt, f"strategy {strategy_id}: already aborted", answer)
        return
    if before == StrategyState.INITIAL:
        # never applied: its steps were ended in the same transaction, nothing to wait for
        _done(fmt, f"strategy {strategy_id}: aborted (it was never applied)", answer)
        return
    if before is None:
        _done(fmt, f"strategy {strategy_id}: abort requested", answer)
    else:
        _done(fmt, f"strategy {strategy_id}: abort already requested ({before})", answer)
    # Its abort waits for a conductor (none drives it): said each time it is asked.
    _warn_if_undriven(store, strategy_id, "the abort of strategy {sid} finishes", "finish")


def _warn_if_undriven(store: Store, sid: int, what: str, verb: str) -> None:
    """Warn on stderr when no conductor drives strategy ``sid`` nor will claim it: what
    was just asked waits until one does (``what`` says what waits; ``verb`` how the
    operator does it here)."""
    who = queries.driving(store, sid)
    if who.nobody and who.text is not None:
        err_console.print(
            f"warning: no conductor serves {store.url}: {what.format(sid=sid)} once "
            f"'fleetwave serve' runs (or {verb} it here: 'fleetwave strategy apply {sid} "
            "--wait')",
            highlight=False,
        )


@strategy_app.command("show")
def strategy_show(strategy_id: StrategyId, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show a strategy with its step counts per state."""
    emit_one(queries.get_strategy(existing_store(db), strategy_id), fmt)


@strategy_app.command("list")
def strategy_list(
    state: Annotated[
        list[str] | None,
        typer.Option(
            metavar="STATE",
            help="only strategies in this state; repeat it, or give a,b, for several",
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """List strategies."""
    table = fmt is Format.table
    states = _several("--state", state)
    known = [s.value for s in StrategyState]
    for one in states:
        if one not in known:
            raise InputError(f"--state: '{one}' is not a strategy state ({', '.join(known)})")
    rows = queries.list_strategies(existing_store(db), brief=table, states=states)
    if table:
        for row in rows:
            # at a glance: steps ended of all, how many of them did not complete, and who
            # drives it (`strategy show` says more: how to get it driven)
            counts = row["step_states"]
            bad = [f"{counts[s]} {s}" for s in ("failed", "aborted") if counts.get(s)]
            row["done"] = f"{row['done']}/{row['steps']}" + (f" ({', '.join(bad)})" if bad else "")
    emit_rows(rows, ["id", "workflow", "state", "done", "driven_by", "details"], fmt)


@strategy_app.command("delete")
def strategy_delete(
    strategy_id: StrategyId,
    ignore_missing: IgnoreMissingOpt = False,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Delete a strategy that is not running, with its steps and journal."""
    store = existing_store(db)
    try:
        admin.delete_strategy(store, strategy_id)
    except NotFound:
        if not ignore_missing:
            raise
        _missing(fmt, f"strategy {strategy_id}", {"id": strategy_id})
        return
    except KeyboardInterrupt:
        # Each chunk is its own transaction: what was removed stays removed, the rest
        # stays until the command runs again (the strategy shows `deleting`). Ctrl-C
        # may also come before the first commit (waiting for the write lock) or after
        # the last: the database says which.
        try:
            now: str | None = queries.get_strategy(store, strategy_id)["state"]
        except NotFound:
            now = None
        if now is None:
            _done(fmt, f"strategy {strategy_id} deleted", {"id": strategy_id, "deleted": True})
            return
        if now == StrategyState.DELETING:
            said = (
                f"stopped: strategy {strategy_id} is partly deleted (it shows 'deleting'); "
                f"'fleetwave strategy delete {strategy_id}' finishes it"
            )
        else:
            said = f"stopped: nothing deleted; strategy {strategy_id} is still {now}"
        err_console.print(said, highlight=False)
        raise typer.Exit(130) from None
    _done(fmt, f"strategy {strategy_id} deleted", {"id": strategy_id, "deleted": True})


# -- steps, history, check ---------------------------------------------------------------------


@step_app.command("list")
def step_list(
    strategy: Annotated[int, typer.Option(parser=whole_number, metavar="ID", help="strategy id")],
    state: Annotated[
        list[str] | None,
        typer.Option(
            metavar="STATE",
            help="only steps in this state; repeat it, or give a,b, for steps in any of them",
        ),
    ] = None,
    target: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME", help="only this target's step; repeat it, or give a,b, for several"
        ),
    ] = None,
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """List the steps of a strategy."""
    store = existing_store(db)
    states, names = _several("--state", state), _several("--target", target)
    # refuses an unknown strategy (or target) now
    rows = queries.iter_steps(store, strategy, states, target=names)
    emit_rows(
        _first_then(rows, lambda: queries.iter_steps(store, strategy, states, target=names)),
        # the step id last: what `step show` takes
        ["target", "stage", "state", "details", "started_at", "finished_at", "step"],
        fmt,
    )


@step_app.command("show")
def step_show(step_id: StepId, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Show one step with its journal and events."""
    emit_one(queries.get_step(existing_store(db), step_id), fmt)


@step_app.command("callback")
def step_callback(
    step_id: StepId,
    state: Annotated[str, typer.Argument(help="the state of the step the report is about")],
    kind: Annotated[
        str, typer.Option(help="done (the state's work finished), failed, or heartbeat")
    ] = "done",
    details: Annotated[str, typer.Option(help="what the target says (kept with it)")] = "",
    fmt: FormatOpt = Format.table,
    db: DbOpt = None,
) -> None:
    """Report for a target: the callback a wait-for-callback state waits for.

    Stored at once (one INSERT); the conductor that drives the step's strategy answers
    it (applied, or ignored and why) within a tick.
    """
    if kind not in CALLBACK_KINDS:
        raise InputError(f"--kind: must be one of {', '.join(CALLBACK_KINDS)}, got '{kind}'")
    store = existing_store(db)
    step = queries.get_step(store, step_id)
    states = queries.get_strategy(store, step["strategy"])["states"]
    if isinstance(states, list) and states and state not in states:
        raise InputError(
            f"STATE: '{state}' is not a state of strategy {step['strategy']}'s workflow "
            f"({', '.join(states)})"
        )
    record = accept_callback(store, step_id, state, kind, details, time.time())
    outcome, reason = record.outcome, record.reason  # a late one is answered at once
    answer: dict[str, Any] = {
        "id": record.id,
        "step": step_id,
        "strategy": record.strategy_id,
        "state": state,
        "kind": kind,
        "outcome": outcome,
        "reason": reason,
    }
    late = outcome is not None
    if late:
        said = f"callback {record.id} for step {step_id} stored and {outcome}: {reason}"
    else:
        said = (
            f"callback {record.id} for step {step_id} ({state}, {kind}) stored; the conductor "
            f"driving strategy {record.strategy_id} answers it ('fleetwave step show {step_id}' "
            "says how)"
        )
    _done(fmt, said, answer)
    if not late and queries.driving(store, record.strategy_id).nobody:
        err_console.print(
            f"warning: no conductor drives strategy {record.strategy_id}: the callback is "
            "answered once one does ('fleetwave serve', or 'fleetwave strategy apply "
            f"{record.strategy_id} --wait')",
            highlight=False,
        )


def _several(option: str, given: list[str] | None) -> list[str]:
    """A filter option given once or more, each perhaps ``a,b``: the values, in order,
    each once (a step in any of them is shown). An empty value is refused."""
    out: list[str] = []
    for each in given or ():
        for value in (v.strip() for v in each.split(",")):
            if not value:
                raise InputError(f"{option}: an empty value in {each!r}")
            if value not in out:
                out.append(value)
    return out


def _first_then(
    first: Iterator[dict[str, Any]], again: Callable[[], Iterator[dict[str, Any]]]
) -> Callable[[], Iterator[dict[str, Any]]]:
    """Rows for :func:`emit_rows` to read twice: the reader already made (its checks
    done before anything is printed), then fresh ones."""
    made = [first]

    def read() -> Iterator[dict[str, Any]]:
        return made.pop() if made else again()

    return read


@app.command()
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
    names = _several("--target", target)
    rows = queries.iter_history(store, strategy, names, last=last)  # refuses bad names now
    emit_rows(
        _first_then(rows, lambda: queries.iter_history(store, strategy, names, last=last)),
        ["at", "conductor", "target", "from", "to", "details"],
        fmt,
    )


@app.command()
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
    names, kinds = _several("--target", target), _several("--kind", kind)
    rows = queries.iter_events(store, strategy, names, kinds, last)  # refuses bad input now
    emit_rows(
        _first_then(rows, lambda: queries.iter_events(store, strategy, names, kinds, last)),
        ["at", "conductor", "target", "kind", "details"],
        fmt,
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


@app.command()
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


@app.command()
def serve(lease_ttl: LeaseTtlOpt = None, db: DbOpt = None) -> None:
    """Run a conductor: drive every applying strategy until interrupted (Ctrl-C)."""
    config = _engine_config(lease_ttl)
    event_loop.loop_kind()  # refuse a bad FLEETWAVE_LOOP before announcing anything
    load_plugins()  # and a plug-in that cannot be imported, before taking anything on
    # Never a new database: a mistyped --db would be served, empty, for good (a service
    # manager restarting it), while the real fleet's strategies wait for nobody.
    store = existing_store(db)
    others = [queries.conductor_named(c) for c in queries.serving_conductors(store)]
    if others:
        # Allowed (each strategy is driven by one conductor at a time, by claim and
        # fence), but on SQLite one serve per database is the setup: a second one adds
        # no throughput (one writer) and is more often a leftover than a choice.
        verb = "serves" if len(others) == 1 else "serve"
        err_console.print(
            f"warning: {plural(len(others), 'conductor')} already {verb} {store.url} "
            f"({', '.join(others)}): they share its strategies, each driven by one",
            highlight=False,
        )

    def stopped_now() -> str:
        return (
            f"stopped at once: the leases were not handed back and run out within "
            f"{config.lease_ttl_s:g} s; the next conductor takes over then"
        )

    async def _serve() -> None:
        stop = asyncio.Event()
        conductor = Conductor(store, config=config)
        stop_on_signals(stop, conductor.config.shutdown_grace_s, at_once=stopped_now)
        # Said once registered: a database locked at start is waited for (logged) first.
        await conductor.run(
            stop=stop,
            on_ready=lambda: err_console.print(
                f"conductor {conductor.id} serving {store.url}; Ctrl-C to stop"
            ),
        )
        err_console.print(f"conductor {conductor.id} stopped; leases handed back")

    try:
        event_loop.run(_serve())
    except KeyboardInterrupt:
        # The second Ctrl-C (or SIGTERM): stopped at once, nothing handed back.
        err_console.print(stopped_now(), highlight=False)
        raise typer.Exit(130) from None


LOG_LEVELS = ("debug", "info", "warning", "error")


#: the exit status when whoever read the output went away (``| head``): what a shell
#: reports for a process that SIGPIPE ended (128 + 13)
READER_GONE = 141


def main() -> None:
    _never_fail_to_print()
    level = os.environ.get("FLEETWAVE_LOG", "warning").strip().lower() or "warning"
    if level not in LOG_LEVELS:
        _fail(f"FLEETWAVE_LOG: unknown level '{level}' (choose one of {', '.join(LOG_LEVELS)})", 2)
    handler = output.ConsoleLogHandler()
    handler.setFormatter(output.utc_log_formatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if level != "debug":
        # its "Context impl SQLiteImpl" lines at every start said nothing of the rollout
        logging.getLogger("alembic").setLevel(logging.WARNING)
    forget_created()
    try:
        # Not standalone: bad usage (an unknown option or value) is reported below as
        # one line, like every other bad input, instead of in a boxed panel.
        code = app(standalone_mode=False)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could not be told
    except BrokenPipeError:
        _reader_gone()
    except SystemExit:
        if _stdout_closed_under_click():
            _reader_gone()
        raise
    except typer.TyperException as exc:  # usage: exit 2 (Click's code for bad usage)
        discard_created()
        _fail(_usage_problem(exc), exc.exit_code)
    except (typer.Abort, _Interrupted):
        # what it was writing is rolled back (an admin command writes in one transaction)
        _fail("interrupted", 130)
    except (InputError, WorkflowError, StoreError, event_loop.LoopChoiceError) as exc:
        discard_created()
        _fail(str(exc), 2)
    except StoreReplaced as exc:
        _fail(f"{exc}; {exc.advice}", 1)
    except StoreUnavailable as exc:
        # Asked to stop (Ctrl-C, SIGTERM) while the database did not answer.
        _fail(
            f"stopped without handing the leases back: the database did not answer ({exc}); "
            "they run out by themselves: go on with 'fleetwave serve' or "
            "'fleetwave strategy apply ID --wait'",
            130,
        )
    except DBAPIError as exc:
        # The database failed the command (locked by another program for longer than
        # a write waits, or an error a conductor does not ride out): one line, not a
        # traceback. The failed transaction was rolled back (an admin command's only
        # one: nothing of it was written).
        logging.getLogger("fleetwave").debug("database error", exc_info=True)
        _fail(f"database: {exc.orig}{_database_hint(exc)}; its transaction was rolled back", 1)
    sys.exit(code if isinstance(code, int) else 0)


def _database_hint(exc: DBAPIError, *, waiting: bool = False) -> str:
    text = str(exc.orig).lower()
    if "locked" in text or "busy" in text:
        if waiting:
            return ": another program holds its write lock"
        return " (another program holds its write lock: try again when it is done)"
    return ""


def _usage_problem(exc: typer.TyperException) -> str:
    """Click's message, except for a negative number where an id goes (``strategy show
    -1``): Click reads it as an unknown option, which names no real problem."""
    # Typer's choice check words it "Value error, 'x' is not one of ...": the value
    # error is the message itself
    message = exc.format_message().replace(": Value error, ", ": ")
    name = getattr(exc, "option_name", None)  # Click's NoSuchOption (Typer keeps it private)
    if isinstance(name, str) and re.fullmatch(r"-\d+", name) and "No such option" in message:
        return (
            f"{name}: ids and counts are whole numbers from 0 "
            "(a negative number is read as an option)"
        )
    typed = re.fullmatch(
        r"(Invalid value for '[^']+': )Input should be a valid (number|integer), "
        r"unable to parse string as an? (?:number|integer)",
        message,
    )
    if typed is not None:
        # Typer's number check neither says what it was given (the command line does)
        # nor says it briefly: worded as the ids' own check ("'abc' is not a whole number").
        what = "a whole number" if typed.group(2) == "integer" else "a number"
        given = _option_value(getattr(getattr(exc, "param", None), "opts", None) or [])
        message = f"{typed.group(1)}{'the value' if given is None else repr(given)} is not {what}"
    return message


def _option_value(opts: list[str]) -> str | None:
    """What the command line gave one of ``opts`` (the last time it was given)."""
    args, given = sys.argv[1:], None
    for i, arg in enumerate(args):
        for opt in opts:
            if arg == opt and i + 1 < len(args):
                given = args[i + 1]
            elif arg.startswith(opt + "="):
                given = arg[len(opt) + 1 :]
    return given


def _never_fail_to_print() -> None:
    """A terminal or pipe whose encoding cannot show a name (``PYTHONIOENCODING=ascii``,
    an old locale) gets it backslash-escaped, not a traceback: names may be in any
    script. A closed stdout or stderr (``>&-``: Python then has none) swallows what is
    printed, as before, instead of failing the command after its work is done."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (for the process)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        reconfigure = getattr(stream, "reconfigure", None)
        if encoding != "utf8" and reconfigure is not None:
            reconfigure(errors="backslashreplace")


def _stdout_closed_under_click() -> bool:
    """Click answers a closed stdout (EPIPE) by wrapping the streams and exiting 1."""
    return type(sys.stdout).__name__ == "PacifyFlushWrapper"


def _reader_gone() -> None:
    """The reader of stdout went away (``fleetwave target list | head -1``): no more
    output, no message, exit 141, as for any command ended by SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
    os.close(devnull)
    os._exit(READER_GONE)


def _fail(message: str, code: int) -> None:
    """One line on stderr, never wrapped (scripts and logs read it whole), and exit.

    No line for an empty message: ``fleetwave`` alone prints its help and exits 2.
    """
    if message:
        output.err_console.print(f"error: {message}", highlight=False)
    sys.exit(code)


if __name__ == "__main__":
    main()
