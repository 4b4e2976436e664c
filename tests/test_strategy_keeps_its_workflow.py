"""A strategy keeps the workflow it was created with: a YAML copy of its own, and a
built-in or Python workflow whose states changed fails that strategy alone."""

from __future__ import annotations

import asyncio

from sqlalchemy import delete

from conftest import add_sim_targets
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import get_workflow, register_workflow
from fleetwave.domain.workflow import (
    DriverOperation,
    StateDef,
    WorkflowDef,
)
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.engine.claims import NOT_DRIVABLE_HERE
from fleetwave.engine.conductor import Conductor
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.store.schema import workflows
from fleetwave.testing.invariants import check


def test_a_strategy_keeps_the_yaml_workflow_it_was_created_with(store: Store) -> None:
    """Editing, then deleting, the stored workflow changes nothing for the strategy."""
    text = "name: pinned\nstates:\n  - name: only\n    timeout_s: 60\n"
    admin.save_workflow(store, parse_workflow_yaml(text), text)
    add_sim_targets(store, 2)
    sid = admin.create_strategy(
        store, parse_workflow_yaml(text), StrategyOptions(), all_targets=True
    )
    edited = text.replace("only", "something-else") + "version: 2\n"
    admin.save_workflow(store, parse_workflow_yaml(edited), edited)
    with store.write() as conn:
        conn.execute(delete(workflows).where(workflows.c.name == "pinned"))
    admin.apply_strategy(store, sid)
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid]))[sid] == "complete"
    assert {s["state"] for s in queries.list_steps(store, sid)} == {"complete"}
    assert check(store, sid).ok


def test_a_strategy_whose_workflow_changed_fails_alone_one_not_here_is_left(
    store: Store,
) -> None:
    """A Python workflow re-registered with other states fails its strategy; one never
    registered in this process (a plug-in not imported here) is left, still applying,
    to a conductor that has it."""
    one = (StateDef("a", DriverOperation("a")),)
    register_workflow(WorkflowDef("shifty", one), replace=True)
    add_sim_targets(store, 2, prefix="x")
    add_sim_targets(store, 2, prefix="y")
    add_sim_targets(store, 1, prefix="z")
    changed = admin.create_strategy(
        store, WorkflowDef("shifty", one), StrategyOptions(), target_names=["x00000", "x00001"]
    )
    register_workflow(WorkflowDef("shifty", (StateDef("b", DriverOperation("b")),)), replace=True)
    gone = admin.create_strategy(
        store, WorkflowDef("never-registered", one), StrategyOptions(), target_names=["y00000"]
    )
    wf = get_workflow("patch")
    assert wf is not None
    healthy = admin.create_strategy(store, wf, StrategyOptions(), target_names=["z00000"])
    for sid in (changed, gone, healthy):
        admin.apply_strategy(store, sid)
    result = asyncio.run(Conductor(store).run(strategy_ids=[changed, gone, healthy]))
    assert result == {changed: "failed", gone: NOT_DRIVABLE_HERE, healthy: "complete"}
    assert (
        "workflow shifty changed since the strategy was created: its states were ['a'], now ['b']"
        in queries.get_strategy(store, changed)["details"]
    )
    assert queries.get_strategy(store, gone)["state"] == "applying"
    assert check(store).ok
