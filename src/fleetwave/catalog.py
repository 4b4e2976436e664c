"""Finding a workflow by name: built-ins, Python plug-ins, then YAML stored in the database."""

from __future__ import annotations

from fleetwave.domain.errors import NotFound
from fleetwave.domain.registry import all_workflows, get_workflow
from fleetwave.domain.workflow import WorkflowDef
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.store.admin import stored_workflows
from fleetwave.store.db import Store


def list_workflows(store: Store | None) -> list[WorkflowDef]:
    found = {wf.name: wf for wf in all_workflows()}
    if store is not None:
        for name, text in stored_workflows(store):
            found.setdefault(name, parse_workflow_yaml(text, source=f"stored workflow {name}"))
    return sorted(found.values(), key=lambda w: w.name)


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
    known = ", ".join(w.name for w in list_workflows(store))
    raise NotFound(f"{what}: unknown workflow '{name}' (known: {known})")
