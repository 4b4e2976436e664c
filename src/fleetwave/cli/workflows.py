"""``fleetwave workflow``: the workflows (built-in, Python and YAML) listed and shown; a
YAML one validated, added and deleted."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import typer

from fleetwave.catalog import new_yaml_workflow, resolve_workflow, workflow_rows
from fleetwave.cli import remote
from fleetwave.cli.common import (
    DbOpt,
    FormatOpt,
    IgnoreMissingOpt,
    done,
    existing_store,
    missing,
    store_for,
    store_if_any,
)
from fleetwave.cli.output import Format, emit_one, emit_rows, err_console
from fleetwave.cli.parsing import read_text_file
from fleetwave.domain.errors import Conflict, InputError, NotFound
from fleetwave.domain.models import plural
from fleetwave.domain.registry import get_workflow
from fleetwave.domain.workflow import describe_workflow
from fleetwave.store import admin

# put under the root command by main.py, which gives it its command class (_Commands)
workflow_app = typer.Typer(help="Workflows: built-in, Python and YAML.", no_args_is_help=True)


def _workflow_dict(name: str, db: str | None) -> dict[str, object]:
    server = remote.server(db)
    if server is not None:
        return cast(dict[str, object], server.get(f"/v1/workflows/{quote(name, safe='')}"))
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
    server = remote.server(db)
    rows = server.get("/v1/workflows")["items"] if server else workflow_rows(store_if_any(db))
    broken = [row for row in rows if row.get("problem")]
    for row in rows if fmt is Format.table else ():
        # a table: the states in order, with arrows
        row["states"] = (
            "UNUSABLE HERE (see 'problem')" if row.get("problem") else " -> ".join(row["states"])
        )
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
    text = read_text_file(file)
    server = remote.server(db)
    if server is not None:
        answer = server.post_text(
            "/v1/workflows/validate", text, "application/yaml", source=str(file)
        )
        if not answer.pop("ok"):
            raise InputError(str(answer["problem"]))
    else:
        wf = new_yaml_workflow(text, str(file))
        answer = {
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
            with _naming(file):
                stored = answer["stored_version"] = admin.check_workflow_version(store, wf)
            answer["add_would"] = (
                "store" if stored is None else "nothing" if stored == wf.version else "replace"
            )
    said = (
        f"{file}: workflow {answer['name']} v{answer['version']} is valid "
        f"({plural(len(answer['states']), 'state')})"
    )
    said += {
        None: "",
        "store": "; 'workflow add' would store it",
        "nothing": f"; already stored as v{answer['stored_version']}, unchanged",
        "replace": f"; 'workflow add' would replace the stored v{answer['stored_version']}",
    }[answer["add_would"]]
    done(fmt, said, answer)


def _check_file(file: Path) -> None:
    if file.is_dir():
        raise InputError(f"FILE: {file} is a directory, not a workflow file")
    if not file.exists():
        raise InputError(f"FILE: {file} does not exist")
    if not file.is_file():
        raise InputError(f"FILE: {file} is not a regular file (a device, pipe or socket)")


@contextmanager
def _naming(file: Path) -> Iterator[None]:
    """A version the store refuses is named with its file, as the file's other errors
    are (``bad.yaml: workflow w: version 1 is already stored with other states``)."""
    try:
        yield
    except Conflict as exc:
        raise Conflict(f"{file}: {exc}") from None


@workflow_app.command("add")
def workflow_add(file: Path, fmt: FormatOpt = Format.table, db: DbOpt = None) -> None:
    """Validate a YAML workflow and store it, so strategies can use it."""
    _check_file(file)
    text = read_text_file(file)
    server = remote.server(db)
    if server is not None:
        answer = server.post_text("/v1/workflows", text, "application/yaml", source=str(file))
    else:
        wf = new_yaml_workflow(text, str(file))
        with _naming(file):
            replaced = admin.save_workflow(store_for(db), wf, text)
        stored = replaced != wf.version
        answer = {
            "name": wf.name,
            "version": wf.version,
            "stored": stored,
            "replaced_version": replaced if stored else None,
        }
    name, version, replaced = answer["name"], answer["version"], answer["replaced_version"]
    if not answer["stored"]:
        said = f"workflow {name} v{version} is already stored, unchanged"
    elif replaced is not None:
        said = (
            f"workflow {name} v{version} stored, replacing v{replaced} "
            f"(strategies created from v{replaced} keep it)"
        )
    else:
        said = f"workflow {name} v{version} stored"
    done(fmt, said, answer)


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
        missing(fmt, f"workflow {name}", {"name": name})
        return
    done(
        fmt,
        f"workflow {name} v{version} deleted (strategies created from it keep their copy)",
        {"name": name, "version": version, "deleted": True},
    )
