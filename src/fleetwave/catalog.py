"""Finding a workflow by name: built-ins, Python plug-ins, then YAML stored in the database."""

from __future__ import annotations

import os
from typing import Any

from fleetwave.domain.errors import InputError, NotFound
from fleetwave.domain.registry import all_workflows, get_workflow
from fleetwave.domain.workflow import WorkflowDef, WorkflowError
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.store import queries
from fleetwave.store.admin import stored_workflows
from fleetwave.store.db import Store


def new_yaml_workflow(text: str, source: str) -> WorkflowDef:
    """A YAML workflow to validate or add (``source``: its file, named by its errors),
    checked strictly; a built-in's (or a plug-in's) name is refused."""
    wf = parse_workflow_yaml(text, source=source, strict=True)
    known = get_workflow(wf.name)
    if known is not None and known.source != "yaml":
        raise InputError(f"{source}: name: '{wf.name}' is a built-in workflow; choose another name")
    return wf


def list_workflows(store: Store | None) -> list[WorkflowDef]:
    """Every workflow usable here (see :func:`workflow_catalog` for the others)."""
    return workflow_catalog(store)[0]


def workflow_catalog(store: Store | None) -> tuple[list[WorkflowDef], dict[str, str]]:
    """The workflows usable here, by name; and the stored ones this process cannot load
    (a ``python:`` action whose module is not importable here), with why. One such
    workflow must not hide all the others from ``workflow list``."""
    found = {wf.name: wf for wf in all_workflows()}
    broken: dict[str, str] = {}
    if store is not None:
        for name, text in stored_workflows(store):
            if name in found:
                continue
            try:
                found[name] = parse_workflow_yaml(text, source=f"stored workflow {name}")
            except WorkflowError as exc:
                broken[name] = str(exc)
    return sorted(found.values(), key=lambda w: w.name), dict(sorted(broken.items()))


def workflow_rows(store: Store | None) -> list[dict[str, Any]]:
    """``workflow list --format json``: each workflow's name, version, source and states,
    by name; a stored one this process cannot load has no version, no states, and a
    ``problem`` (which every row then has, None where there is none)."""
    usable, broken = workflow_catalog(store)
    rows: list[dict[str, Any]] = [
        {
            "name": wf.name,
            "version": wf.version,
            "source": wf.source,
            "states": list(wf.state_names),
        }
        for wf in usable
    ]
    for name, why in broken.items():
        rows.append({"name": name, "version": None, "source": "yaml", "states": [], "problem": why})
    if broken:
        for row in rows:
            row.setdefault("problem", None)
    rows.sort(key=lambda r: str(r["name"]))
    return rows


def resolve_workflow(store: Store | None, name: str, what: str = "--workflow") -> WorkflowDef:
    """The built-in, plugin or stored workflow called ``name``; ``what`` names the input
    in the error (an option, or the command's argument)."""
    wf = get_workflow(name)
    if wf is not None:
        return wf
    if store is not None:
        for stored_name, text in stored_workflows(store):
            if stored_name == name:
                return parse_workflow_yaml(text, source=f"stored workflow {name}")
    usable, broken = workflow_catalog(store)
    known = ", ".join(sorted([w.name for w in usable] + list(broken)))
    hint = ""
    if name.lower().endswith((".yaml", ".yml")) or "/" in name:
        # a workflow file given where its name goes
        hint = (
            f"; to use a workflow file, store it first with 'fleetwave workflow add {name}', "
            "then give its name"
        )
    elif not os.environ.get("FLEETWAVE_PLUGINS", "").strip():
        # a Python workflow is known only where its module is imported
        hint = "; a Python workflow needs its module named in FLEETWAVE_PLUGINS"
    raise NotFound(f"{what}: unknown workflow '{name}' (known: {known}){hint}")


def strategy_workflow_def(store: Store, sid: int) -> WorkflowDef:
    """The workflow strategy ``sid`` runs: its own copy (YAML, taken at creation), or
    the registered one of its name (a built-in or plug-in); raises as
    :func:`resolve_workflow` and :func:`parse_workflow_yaml` do when this process cannot
    have it."""
    name, own_copy = queries.strategy_workflow(store, sid)
    if own_copy is None:
        return resolve_workflow(store, name, what=f"strategy {sid}: workflow")
    return parse_workflow_yaml(own_copy, source=f"strategy {sid}: workflow {name}")
