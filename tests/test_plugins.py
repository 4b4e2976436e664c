"""Plug-in workflows and actions: one that cannot be imported is one line and ``serve``
refuses to start; a strategy whose workflow a process lacks is left to one that has it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cli_harness import Cli, assert_rejected
from conftest import add_sim_targets, on_virtual_time
from fleetwave import ActionContext, Advance, Outcome, StateAction
from fleetwave.domain import registry
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import DriverOperation, StateDef, WorkflowDef
from fleetwave.engine.claims import NOT_DRIVABLE_HERE
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.testing.invariants import check


def _wf(name: str) -> WorkflowDef:
    wf = registry.get_workflow(name)
    assert wf is not None
    return wf


def test_a_plugin_that_raises_is_one_line(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "raising_plugin.py").write_text("raise RuntimeError('boom in plugin')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FLEETWAVE_PLUGINS", "raising_plugin")
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_load_error", None)
    for args in (("workflow", "list"), ("serve",), ("workflow", "show", "patch")):
        assert_rejected(
            cli(*args),
            "FLEETWAVE_PLUGINS: cannot import 'raising_plugin': RuntimeError: boom in plugin",
        )


def test_serve_with_a_plugin_that_is_missing_refuses_to_start(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLEETWAVE_PLUGINS", "no_such_module_here")
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_load_error", None)
    db = tmp_path / "new.db"
    assert_rejected(cli("serve", db=db), "FLEETWAVE_PLUGINS: cannot import 'no_such_module_here'")
    assert not db.exists()  # nothing written, not even a database


def test_apply_wait_without_the_strategys_plugin_refuses_and_changes_nothing(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_workflow(
        WorkflowDef("drain-x", (StateDef("drain", DriverOperation("drain")),)), replace=True
    )
    assert cli("target", "add", "a").code == 0
    sid = cli("strategy", "create", "--workflow", "drain-x", "--all", "--format", "json").json()[
        "id"
    ]
    monkeypatch.delitem(registry._workflows, "drain-x")  # another process: no plug-in
    res = cli("strategy", "apply", str(sid), "--wait")
    assert_rejected(res, f"strategy {sid}: workflow: unknown workflow 'drain-x'")
    assert cli("strategy", "show", str(sid), "--format", "json").json()["state"] == "initial"


def test_a_conductor_lacking_a_workflow_leaves_that_strategy_to_others(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not failed (the strategy is not at fault): handed back, still applying, and
    not claimed again by this conductor; the other strategies are driven."""
    register_workflow(
        WorkflowDef("drain-y", (StateDef("drain", DriverOperation("drain")),)), replace=True
    )
    add_sim_targets(store, 2)
    missing = admin.create_strategy(
        store, _wf("drain-y"), StrategyOptions(), target_names=["t00000"]
    )
    there = admin.create_strategy(store, _wf("patch"), StrategyOptions(), target_names=["t00001"])
    admin.apply_strategy(store, missing)
    admin.apply_strategy(store, there)
    monkeypatch.delitem(registry._workflows, "drain-y")
    c = Conductor(store)
    result = asyncio.run(c.run(strategy_ids=[missing, there]))
    assert result == {missing: NOT_DRIVABLE_HERE, there: "complete"}
    shown = queries.get_strategy(store, missing)
    assert (shown["state"], shown["owner"], shown["step_states"]) == (
        "applying",
        None,
        {"initial": 1},
    )


def test_an_abort_of_a_strategy_no_conductor_can_drive_ends_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left applying by conductors lacking its workflow, it would hold its targets for
    good: once the operator aborts it, the next conductor ends it (aborted)."""
    register_workflow(
        WorkflowDef("drain-z", (StateDef("drain", DriverOperation("drain")),)), replace=True
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, _wf("drain-z"), StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    monkeypatch.delitem(registry._workflows, "drain-z")
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid])) == {sid: NOT_DRIVABLE_HERE}
    admin.request_abort(store, sid)
    assert asyncio.run(Conductor(store).run(strategy_ids=[sid])) == {sid: "aborted"}
    (step,) = queries.list_steps(store, sid)
    assert step["state"] == "aborted"
    assert step["details"].startswith("not started: aborted by operator; cannot drive it here")
    assert check(store, sid).ok
    admin.create_strategy(store, _wf("patch"), StrategyOptions(), all_targets=True)  # freed


def test_apply_wait_refuses_a_yaml_strategy_naming_an_action_this_process_lacks(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fleetwave.domain.workflow import Advance

    class Probe(StateAction):
        async def run(self, ctx: object) -> Advance:  # type: ignore[override]
            return Advance()

    monkeypatch.setitem(registry._actions, "probe-act", Probe)
    wf = tmp_path / "w.yaml"
    wf.write_text("name: uses-probe\nstates:\n  - {name: a, action: 'python:probe-act'}\n")
    assert cli("workflow", "add", str(wf)).code == 0
    assert cli("target", "add", "t1").code == 0
    made = cli("strategy", "create", "--workflow", "uses-probe", "--all", "--format", "json")
    sid = made.json()["id"]
    monkeypatch.delitem(registry._actions, "probe-act")  # another process: no plug-in
    monkeypatch.delenv("FLEETWAVE_PLUGINS", raising=False)
    assert_rejected(
        cli("strategy", "apply", str(sid), "--wait"),
        "action python:probe-act: no action registered under that name",
        # where to look, when no plug-in module is named (found by an acceptance pass)
        "once the module is named in FLEETWAVE_PLUGINS",
    )
    assert cli("strategy", "show", str(sid), "--format", "json").json()["state"] == "initial"


def test_a_yaml_action_registered_by_a_plugin_is_found(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`action: python:NAME` of an action a FLEETWAVE_PLUGINS module registers with
    @register_action was refused ("no action registered under that name"): the lookup
    did not load the plug-ins first (an acceptance pass)."""
    (tmp_path / "verify_plugin.py").write_text(
        "from fleetwave import Advance, StateAction\n"
        "from fleetwave.domain.registry import register_action\n"
        "@register_action('acc-verify')\n"
        "class Verify(StateAction):\n"
        "    async def run(self, ctx):\n"
        "        return Advance()\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FLEETWAVE_PLUGINS", "verify_plugin")
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_load_error", None)
    wf = tmp_path / "uses.yaml"
    wf.write_text(
        "name: uses-plugin\nstates:\n  - name: check\n    action: python:acc-verify\n",
        encoding="utf-8",
    )
    res = cli("workflow", "validate", str(wf))
    assert res.code == 0, res.text


def test_a_yaml_workflow_naming_a_plugin_action_is_left_by_a_conductor_without_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README: a conductor lacking a strategy's plug-in "hands it back untouched, still
    applying ... a missing plug-in never fails a rollout. (YAML workflows need no
    plug-in: each strategy keeps a copy.)" A YAML workflow whose state names a plug-in
    action (``action: python:NAME``, registered by @register_action) does need it:
    parse_workflow_yaml raises WorkflowError in _adopt, which is caught by the generic
    ``except Exception`` and the strategy is failed by _fail_undrivable (conductor.py
    _adopt), instead of going through _cannot_drive_here. apply --wait's pre-check
    (cli/main.py strategy_apply) skips strategies with their own copy, too."""
    from fleetwave.domain import registry
    from fleetwave.domain.models import StrategyOptions
    from fleetwave.domain.yaml_workflow import parse_workflow_yaml
    from fleetwave.engine.claims import NOT_DRIVABLE_HERE

    @registry.register_action("rv2-verify")
    class Verify(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            return Advance()

    add_sim_targets(store, 2)
    text = "name: rv2-site\nstates:\n  - name: verify\n    action: python:rv2-verify\n"
    wf = parse_workflow_yaml(text, source="test")
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    # this conductor's process lacks the plug-in that registers the action
    monkeypatch.delitem(registry._actions, "rv2-verify")
    c = Conductor(store, clock=LoopClock())
    result = on_virtual_time(asyncio.wait_for(c.run(strategy_ids=[sid]), 1_000))
    assert queries.get_strategy(store, sid)["state"] == "applying"
    assert result[sid] == NOT_DRIVABLE_HERE
