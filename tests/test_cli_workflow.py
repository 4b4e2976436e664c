"""The command line for workflows: list, show, validate and add (YAML).

Every test runs ``fleetwave.cli.main.main`` (the console script's entry point, which turns
bad input into ``error: ...`` and exit code 2) against a real SQLite file in ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli_harness import PATCH_STATES, Cli, assert_rejected
from fleetwave import ActionContext, Outcome, Skip, StateAction
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import DriverOperation, StateDef, WorkflowDef


def workflows(cli: Cli) -> dict[str, dict[str, Any]]:
    res = cli("workflow", "list", "--format", "json")
    assert res.code == 0, res.text
    return {w["name"]: w for w in res.json()}


def write(tmp_path: Path, text: str, name: str = "wf.yaml") -> Path:
    f = tmp_path / name
    f.write_text(text, encoding="utf-8")
    return f


class AlwaysDone(StateAction):
    """A Python action for ``action: python:test_cli_workflow:AlwaysDone``."""

    async def run(self, ctx: ActionContext) -> Outcome:
        return Skip(f"{ctx.target.name}: custom action says nothing to do")


GOOD = """\
name: site-patch
version: 3
description: patch with a short check
states:
  - name: check
    action: pre-check
    timeout_s: 30
    skip_when_done: true
    retry: {attempts: 2, backoff_s: 0.01, backoff_max_s: 0.02}
  - name: apply
    timeout_s: 7200
    recover: none
  - name: verify
    mode: poll
"""


# -- list / show ---------------------------------------------------------------------------


def test_workflow_list_has_the_builtins(cli: Cli) -> None:
    got = workflows(cli)
    for name in ("patch", "sw-deploy", "firmware", "kube-upgrade"):
        assert name in got
        assert got[name]["source"] == "builtin"
    assert got["patch"]["states"] == PATCH_STATES  # JSON: a list
    assert got["kube-upgrade"]["states"][0] == "pre-check"
    assert " -> ".join(PATCH_STATES) in cli("workflow", "list").out  # a table: arrows


def test_workflow_list_table_names_them(cli: Cli) -> None:
    res = cli("workflow", "list")
    assert res.code == 0
    for name in ("patch", "sw-deploy", "firmware", "kube-upgrade"):
        assert name in res.out


def test_workflow_show_patch_lists_its_states_in_order(cli: Cli) -> None:
    res = cli("workflow", "show", "patch", "--format", "json")
    assert res.code == 0, res.text
    wf = res.json()
    assert wf["name"] == "patch"
    assert wf["source"] == "builtin"
    assert wf["version"] == 1
    assert [s["state"] for s in wf["states"]] == PATCH_STATES
    first = wf["states"][0]
    assert first["action"] == "driver:pre-check (skip when done)"
    assert first["timeout_s"] == 600.0
    assert first["attempts"] == 3
    assert all(s["timeout_s"] > 0 for s in wf["states"])
    assert all(s["mode"] == "run" for s in wf["states"])
    # what a takeover does (built-ins observe the target), how long retries back off
    assert all(s["recover"] == "observe" for s in wf["states"])
    assert all(s["backoff_max_s"] >= s["backoff_s"] for s in wf["states"])


def test_workflow_show_says_which_states_have_no_recover_hook(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "wf.yaml"
    f.write_text(
        "name: two\nstates:\n"
        "  - name: first\n    action: driver:op\n"
        "  - name: second\n    action: driver:op\n    recover: none\n"
    )
    assert cli("workflow", "add", str(f)).code == 0
    wf = cli("workflow", "show", "two", "--format", "json").json()
    assert [s["recover"] for s in wf["states"]] == ["observe", "none"]
    assert wf["source"] == "yaml"


class Observed(StateAction):
    async def run(self, ctx: ActionContext) -> Outcome:
        return Skip("nothing to do")

    async def recover(self, ctx: ActionContext) -> Outcome:
        return Skip("looked: nothing to do")


def test_workflow_show_names_how_each_state_recovers(cli: Cli) -> None:
    """observe (a driver operation looks at the target), hook (the action's own code),
    none (the step fails after a takeover)."""
    register_workflow(
        WorkflowDef(
            "three-ways",
            (
                StateDef("looks", DriverOperation("op")),
                StateDef("own-code", Observed()),
                StateDef("fails", AlwaysDone()),
            ),
        ),
        replace=True,
    )
    wf = cli("workflow", "show", "three-ways", "--format", "json").json()
    assert [s["recover"] for s in wf["states"]] == ["observe", "hook", "none"]


def test_workflow_show_as_a_table_reads_at_a_glance(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = cli("workflow", "show", "patch")
    assert res.code == 0, res.text
    out = res.text
    for state in PATCH_STATES:
        assert state in out  # whole names, never cut short
    assert "…" not in out
    assert "2h" in out and "10m" in out  # timeouts as durations, not seconds
    assert "3 (backoff 10s..5m)" in out
    assert "driver (skip when done)" in out  # the operation named like its state
    clean = cli("workflow", "show", "clean").text
    assert "driver; then waits for the target's callback" in clean  # its mode, in words
    monkeypatch.setenv("COLUMNS", "80")  # a pipe, or a small terminal: whole state names
    narrow = cli("workflow", "show", "patch").text
    assert "…" not in narrow
    assert "creating-remote-patch-strategy" in narrow and "observe" in narrow


def test_a_workflow_registered_by_code_is_not_called_builtin(cli: Cli) -> None:
    register_workflow(
        WorkflowDef("by-code", (StateDef("only", DriverOperation("op")),)), replace=True
    )
    assert workflows(cli)["by-code"]["source"] == "python"


def test_workflow_show_table(cli: Cli) -> None:
    res = cli("workflow", "show", "sw-deploy")
    assert res.code == 0
    for state in ("pre-check", "install-license", "apply-remote-strategy", "finish"):
        assert state in res.out


def test_workflow_show_unknown_is_rejected(cli: Cli) -> None:
    assert_rejected(cli("workflow", "show", "nosuch"), "nosuch", "patch")


# -- validate ------------------------------------------------------------------------------


def test_validate_good_file(cli: Cli, tmp_path: Path) -> None:
    f = write(tmp_path, GOOD)
    res = cli("workflow", "validate", str(f), db=None)
    assert res.code == 0, res.text
    assert "workflow site-patch v3 is valid (3 states)" in res.text


def test_validate_minimal_file(cli: Cli, tmp_path: Path) -> None:
    f = write(tmp_path, "name: tiny\nstates:\n  - name: only\n")
    res = cli("workflow", "validate", str(f), db=None)
    assert res.code == 0, res.text
    assert "tiny v1 is valid (1 state)" in res.text


BAD = {
    # YAML 1.2: 'yes' is text; pydantic took it (and "false", quoted, and 1) as a bool
    **{
        f"skip_when_done {given}": (
            f"name: w\nstates:\n  - name: a\n    skip_when_done: {given}\n",
            ["states[0]", "(a)", f"skip_when_done: must be true or false, got {said}"],
        )
        for given, said in (("yes", "'yes'"), ('"false"', "'false'"), ("1", "1"))
    },
    "negative timeout": (
        "name: w\nstates:\n  - name: a\n  - name: b\n    timeout_s: -5\n",
        ["states[1]", "(b)", "timeout_s"],
    ),
    "zero timeout": (
        "name: w\nstates:\n  - name: a\n    timeout_s: 0\n",
        ["states[0]", "timeout_s"],
    ),
    "text timeout": (
        "name: w\nstates:\n  - name: a\n  - name: b\n  - name: c\n    timeout_s: soon\n",
        ["states[2]", "(c)", "timeout_s"],
    ),
    "unknown top-level field": (
        "name: w\nowner: me\nstates:\n  - name: a\n",
        ["owner"],
    ),
    "duplicate state": (
        "name: w\nstates:\n  - name: a\n  - name: b\n  - name: a\n",
        ["states[2]", "(a)", "duplicate"],
    ),
    "reserved complete": (
        "name: w\nstates:\n  - name: a\n  - name: complete\n",
        ["states[1]", "complete", "reserved"],
    ),
    "reserved initial": (
        "name: w\nstates:\n  - name: initial\n",
        ["states[0]", "initial", "reserved"],
    ),
    "reserved failed": (
        "name: w\nstates:\n  - name: a\n  - name: failed\n",
        ["states[1]", "failed", "reserved"],
    ),
    "retry attempts 0": (
        "name: w\nstates:\n  - name: a\n    retry: {attempts: 0}\n",
        ["states[0]", "retry", "attempts"],
    ),
    "negative backoff": (
        "name: w\nstates:\n  - name: a\n  - name: b\n    retry: {backoff_s: -1}\n",
        ["states[1]", "retry", "backoff_s"],
    ),
    "bad mode": (
        "name: w\nstates:\n  - name: a\n    mode: sometimes\n",
        ["states[0]", "mode: must be one of 'run', 'wait-for-callback' or 'poll', got 'sometimes'"],
    ),
    "bad recover": (
        "name: w\nstates:\n  - name: a\n    recover: maybe\n",
        ["states[0]", "recover: must be one of 'observe' or 'none', got 'maybe'"],
    ),
    # pydantic's own words were "Extra inputs are not permitted", with no field named
    "unknown state field": (
        "name: w\nstates:\n  - name: a\n    colour: red\n",
        ["states[0] (a): colour: not a field here (the fields are: name, action, timeout_s,"],
    ),
    "unknown retry field": (
        "name: w\nstates:\n  - name: a\n    retry: {tries: 2}\n",
        ["retry: tries: not a field here (the fields are: attempts, backoff_s, backoff_max_s)"],
    ),
    "unknown workflow field": (
        "name: w\ncolour: 1\nstates:\n  - name: a\n",
        ["colour: not a field here (the fields are: name, version, description, states)"],
    ),
    "retry not a mapping": (
        "name: w\nstates:\n  - name: a\n    retry: 3\n",
        ["retry: expected a mapping (of attempts, backoff_s, backoff_max_s), got 3"],
    ),
    "a state not a mapping": (
        "name: w\nstates: [5]\n",
        ["states[0]", "expected a mapping (of name, action, timeout_s,", "got 5"],
    ),
    "states a mapping": ("name: w\nstates: {a: 1}\n", ["states: expected a list of states"]),
    "state name a list": (
        "name: w\nstates:\n  - name: [a]\n",
        ["states[0] (?): name: expected text, got a list"],
    ),
    "name a number": ("name: 5\nstates:\n  - name: a\n", ["name: expected text, got 5"]),
    "flag not a boolean": (
        "name: w\nstates:\n  - name: a\n    skip_when_done: maybe\n",
        ["skip_when_done: must be true or false, got 'maybe'"],
    ),
    "state without a name": (
        "name: w\nstates:\n  - action: x\n",
        ["states[0]", "name: missing (it is required)"],
    ),
    "unregistered python action": (
        "name: w\nstates:\n  - name: a\n  - name: b\n    action: python:nosuch\n",
        ["states[1]", "(b)", "action", "nosuch"],
    ),
    "empty state name": (
        "name: w\nstates:\n  - name: ''\n",
        ["states[0]", "name"],
    ),
    "state not a mapping": (
        "name: w\nstates:\n  - just-a-name\n",
        ["states[0]"],
    ),
    "no states": ("name: w\nstates: []\n", ["states: a workflow needs at least one state"]),
    "missing states": ("name: w\n", ["states"]),
    "bad workflow name": ("name: 'has space'\nstates:\n  - name: a\n", ["name"]),
    "version 0": ("name: w\nversion: 0\nstates:\n  - name: a\n", ["version"]),
    "not a mapping": ("- name: a\n", ["expected a mapping"]),
    "not yaml": ("name: [w\n", ["not valid YAML"]),
    # pydantic's own words were "Input should be a valid number, unable to parse ..."
    "timeout as a clock time": (
        "name: w\nstates:\n  - name: a\n    timeout_s: '1:30'\n",
        ["states[0]", "timeout_s: expected a number, got '1:30'"],
    ),
    "timeout as a list": (
        "name: w\nstates:\n  - name: a\n    timeout_s: [1]\n",
        ["timeout_s: expected a number, got a list"],
    ),
    "timeout zero": (
        "name: w\nstates:\n  - name: a\n    timeout_s: 0\n",
        ["timeout_s: must be more than 0, got 0"],
    ),
    "timeout beyond floats": (
        "name: w\nstates:\n  - name: a\n    timeout_s: 1e400\n",
        ["timeout_s: must be a finite number, got inf"],
    ),
    "attempts as text": (
        "name: w\nstates:\n  - name: a\n    retry: {attempts: few}\n",
        ["retry: attempts: expected a whole number, got 'few'"],
    ),
}


@pytest.mark.parametrize(("text", "words"), list(BAD.values()), ids=list(BAD))
def test_validate_bad_file_names_the_state_and_field(
    cli: Cli, tmp_path: Path, text: str, words: list[str]
) -> None:
    f = write(tmp_path, text)
    res = cli("workflow", "validate", str(f), db=None)
    assert_rejected(res, str(f), *words)
    assert "is valid" not in res.text


def test_validate_missing_file(cli: Cli, tmp_path: Path) -> None:
    assert_rejected(
        cli("workflow", "validate", str(tmp_path / "nope.yaml"), db=None), "does not exist"
    )


# -- add -----------------------------------------------------------------------------------


def test_workflow_add_stores_it_for_list_and_show(cli: Cli, tmp_path: Path) -> None:
    f = write(tmp_path, GOOD)
    res = cli("workflow", "add", str(f))
    assert res.code == 0, res.text
    assert "workflow site-patch v3 stored" in res.text

    listed = workflows(cli)
    assert listed["site-patch"]["source"] == "yaml"
    assert listed["site-patch"]["version"] == 3
    assert listed["site-patch"]["states"] == ["check", "apply", "verify"]
    assert "patch" in listed  # built-ins are still there

    shown = cli("workflow", "show", "site-patch", "--format", "json")
    assert shown.code == 0, shown.text
    wf = shown.json()
    assert wf["description"] == "patch with a short check"
    assert wf["states"] == [
        {
            "state": "check",
            "action": "driver:pre-check (skip when done)",
            "skip_when_done": True,
            "timeout_s": 30.0,
            "attempts": 2,
            "backoff_s": 0.01,
            "backoff_max_s": 0.02,
            "mode": "run",
            "recover": "observe",
        },
        {
            "state": "apply",
            "action": "driver:apply (no recover)",
            "skip_when_done": False,
            "timeout_s": 7200.0,
            "attempts": 1,
            "backoff_s": 1.0,
            "backoff_max_s": 300.0,
            "mode": "run",
            "recover": "none",
        },
        {
            "state": "verify",
            "action": "driver:verify",
            "skip_when_done": False,
            "timeout_s": 600.0,
            "attempts": 1,
            "backoff_s": 1.0,
            "backoff_max_s": 300.0,
            "mode": "poll",
            "poll_interval_s": 10.0,
            "recover": "observe",
        },
    ]


def test_workflow_add_is_per_database(cli: Cli, tmp_path: Path) -> None:
    f = write(tmp_path, GOOD)
    assert cli("workflow", "add", str(f)).code == 0
    other = tmp_path / "other.db"
    assert cli("init", db=other).code == 0
    res = cli("workflow", "list", "--format", "json", db=other)
    assert res.code == 0
    assert "site-patch" not in {w["name"] for w in res.json()}


def test_workflow_add_again_replaces_the_stored_version(cli: Cli, tmp_path: Path) -> None:
    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0
    v4 = GOOD.replace("version: 3", "version: 4").replace("  - name: verify\n    mode: poll\n", "")
    res = cli("workflow", "add", str(write(tmp_path, v4, "v4.yaml")))
    assert res.code == 0, res.text
    listed = workflows(cli)
    assert listed["site-patch"]["version"] == 4
    assert listed["site-patch"]["states"] == ["check", "apply"]
    assert sum(1 for name in listed if name == "site-patch") == 1


def test_workflow_add_with_a_builtin_name_is_rejected(cli: Cli, tmp_path: Path) -> None:
    before = workflows(cli)
    f = write(tmp_path, "name: patch\nstates:\n  - name: a\n")
    assert_rejected(cli("workflow", "add", str(f)), "patch", "built-in")
    assert workflows(cli) == before
    shown = cli("workflow", "show", "patch", "--format", "json").json()
    assert [s["state"] for s in shown["states"]] == PATCH_STATES


@pytest.mark.parametrize(("text", "words"), [BAD["negative timeout"], BAD["duplicate state"]])
def test_workflow_add_of_a_bad_file_stores_nothing(
    cli: Cli, tmp_path: Path, text: str, words: list[str]
) -> None:
    before = workflows(cli)
    assert_rejected(cli("workflow", "add", str(write(tmp_path, text))), *words)
    assert workflows(cli) == before
    assert_rejected(cli("workflow", "show", "w"), "unknown workflow 'w'")


def test_workflow_add_missing_file(cli: Cli, tmp_path: Path) -> None:
    assert_rejected(cli("workflow", "add", str(tmp_path / "nope.yaml")), "does not exist")


def _run_with(cli: Cli, workflow: str, *target_names: str) -> tuple[int, int]:
    """Create a strategy of ``workflow`` over targets and apply --wait; (id, exit code)."""
    res = cli(
        "strategy",
        "create",
        "--workflow",
        workflow,
        "--targets",
        ",".join(target_names),
        "--format",
        "json",
    )
    assert res.code == 0, res.text
    sid = res.json()["id"]
    applied = cli("strategy", "apply", str(sid), "--wait", "--format", "json")
    return sid, applied.code


def test_stored_workflow_runs_in_a_strategy(cli: Cli, tmp_path: Path) -> None:
    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0
    assert cli("target", "add", "ok").code == 0
    assert cli("target", "add", "done", "--set", "already_done=true").code == 0
    assert cli("target", "add", "bad", "--set", "fail_at=apply").code == 0

    res = cli("strategy", "create", "--workflow", "site-patch", "--all", "--format", "json")
    assert res.code == 0, res.text
    created = res.json()
    assert created["workflow"] == "site-patch"
    assert created["states"] == ["check", "apply", "verify"]
    sid = created["id"]

    applied = cli("strategy", "apply", str(sid), "--wait", "--format", "json")
    assert applied.code == 1  # one step failed
    assert applied.json()["state"] == "failed"

    steps = {
        s["target"]: s
        for s in cli("step", "list", "--strategy", str(sid), "--format", "json").json()
    }
    assert steps["ok"]["state"] == "complete"
    assert steps["done"]["state"] == "complete"
    assert "skipped at check" in steps["done"]["details"]
    assert steps["bad"]["state"] == "failed"
    assert steps["bad"]["details"].startswith("apply: ")
    assert "fail_at=apply" in steps["bad"]["details"]

    hist = cli("history", "--strategy", str(sid), "--target", "ok", "--format", "json").json()
    assert [(h["from"], h["to"]) for h in hist] == [
        ("initial", "check"),
        ("check", "apply"),
        ("apply", "verify"),
        ("verify", "complete"),
    ]
    check = cli("check", "--strategy", str(sid), "--format", "json")
    assert check.code == 0
    assert check.json()["ok"] is True


def test_stored_workflow_run_completes_with_exit_0(cli: Cli, tmp_path: Path) -> None:
    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0
    for name in ("a", "b", "c"):
        assert cli("target", "add", name).code == 0
    sid, code = _run_with(cli, "site-patch", "a", "b", "c")
    assert code == 0
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == "complete"
    assert shown["step_states"] == {"complete": 3}


def test_stored_workflow_with_a_python_action(cli: Cli, tmp_path: Path) -> None:
    f = write(
        tmp_path,
        "name: custom\nstates:\n"
        "  - name: ask\n    action: python:test_cli_workflow:AlwaysDone\n"
        "  - name: never\n",
    )
    assert cli("workflow", "validate", str(f), db=None).code == 0
    assert cli("workflow", "add", str(f)).code == 0
    shown = cli("workflow", "show", "custom", "--format", "json").json()
    assert shown["states"][0]["action"] == "AlwaysDone"
    assert cli("target", "add", "t1").code == 0
    sid, code = _run_with(cli, "custom", "t1")
    assert code == 0
    [step] = cli("step", "list", "--strategy", str(sid), "--format", "json").json()
    assert step["state"] == "complete"
    assert "t1: custom action says nothing to do" in step["details"]
    hist = cli("history", "--strategy", str(sid), "--format", "json").json()
    assert [h["to"] for h in hist] == ["ask", "complete"]  # 'never' was never entered


def test_validate_says_what_add_would_refuse_and_errors_are_one_line(
    cli: Cli, tmp_path: Path
) -> None:
    """Found by an acceptance pass: validate passed a file that add then refused (a
    built-in's name), printed a YAML syntax error over five lines, and called a
    directory missing."""
    builtin = write(tmp_path, GOOD.replace("name: site-patch", "name: patch"), "p.yaml")
    for cmd, db in (("validate", None), ("add", tmp_path / "fleet.db")):
        res = cli("workflow", cmd, str(builtin), db=db)
        assert res.code == 2
        assert (
            res.err.strip() == f"error: {builtin}: name: 'patch' is a built-in workflow; "
            "choose another name"
        )
    broken = write(tmp_path, "name: x\nstates: [\n", "broken.yaml")
    res = cli("workflow", "validate", str(broken), db=None)
    assert res.code == 2
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: {broken}: not valid YAML at line 3, column 1: "
    ), lines
    res = cli("workflow", "validate", str(tmp_path), db=None)
    assert res.code == 2
    assert res.err.strip() == f"error: FILE: {tmp_path} is a directory, not a workflow file"


class OwnRecover(DriverOperation):
    async def recover(self, ctx: ActionContext) -> Outcome:
        return Skip("looked for myself")


def test_workflow_show_says_hook_for_a_driver_operation_with_its_own_recover(
    cli: Cli, tmp_path: Path
) -> None:
    """Found by a review: a state named like the start of its operation ('drain' running
    'drain-node') was shown as 'driver-node'; a DriverOperation subclass with a recover of
    its own was shown as 'observe'."""
    register_workflow(
        WorkflowDef(
            "review-show",
            (
                StateDef("drain", DriverOperation("drain-node")),
                StateDef("own", OwnRecover("own")),
            ),
        ),
        replace=True,
    )
    out = cli("workflow", "show", "review-show").text
    assert "driver:drain-node" in out and "driver-node" not in out.replace("driver:drain-node", "")
    wf = cli("workflow", "show", "review-show", "--format", "json").json()
    assert [s["recover"] for s in wf["states"]] == ["observe", "hook"]


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (600, "10m"),
        (5400, "1h30m"),
        (0.25, "0.25s"),
        (90, "1m30s"),
        (100000.25, "27h46m40.25s"),  # was 100000s
        (1234567.5, "342h56m7.5s"),  # was 1.23457e+06s
        (59.9999999, "1m"),  # was 60s
        (0.0001, "0.0001s"),  # was 0s
        (0, "0s"),
    ],
)
def test_durations_read_at_a_glance(seconds: float, shown: str) -> None:
    from fleetwave.cli.workflows import _duration

    assert _duration(seconds) == shown


@pytest.mark.parametrize("field", ["timeout_s", "backoff_s"])
def test_a_python_workflow_with_an_infinite_time_is_refused(field: str) -> None:
    """Every state has a deadline; a YAML file cannot say inf, a Python workflow could."""
    import math

    from fleetwave.domain.workflow import WorkflowError

    with pytest.raises(WorkflowError, match=f"states\\[0\\] \\(wait\\): {field}: must be"):
        WorkflowDef("forever", (StateDef("wait", DriverOperation("wait"), **{field: math.inf}),))


def test_numbers_are_read_as_yaml_1_2_not_as_octal_or_sexagesimal(cli: Cli, tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML's default) read ``timeout_s: 0600`` as octal 384 s and
    ``1:30`` as 90, silently; and ``- name: yes`` as a boolean. A new workflow is read
    as YAML 1.2 reads it: decimal numbers, true/false the only booleans."""
    wf = write(
        tmp_path,
        "name: octal\nstates:\n  - name: yes\n    timeout_s: 0600\n"
        "    retry: {attempts: 3, backoff_s: 030}\n",
    )
    assert cli("workflow", "add", str(wf)).code == 0
    shown = cli("workflow", "show", "octal", "--format", "json").json()
    state = shown["states"][0]
    assert (state["state"], state["timeout_s"], state["backoff_s"]) == ("yes", 600, 30), state
    sexa = write(tmp_path, "name: sexa\nstates:\n  - name: a\n    timeout_s: 1:30\n", "s.yaml")
    assert_rejected(cli("workflow", "validate", str(sexa), db=None), "states[0] (a): timeout_s")


def test_yaml_nested_hundreds_deep_is_one_line_not_a_traceback(cli: Cli, tmp_path: Path) -> None:
    deep = write(tmp_path, "name: x\nstates: " + "[" * 500 + "]" * 500 + "\n")
    assert_rejected(cli("workflow", "validate", str(deep), db=None), "nested too deeply")
    targets = write(
        tmp_path, "- name: d\n  labels: {a: " + "[" * 5000 + "]" * 5000 + "}\n", "t.yaml"
    )
    assert_rejected(cli("target", "import", str(targets)), "nested too deeply")
    assert cli("target", "list", "--format", "json").json() == []


def test_a_stored_workflow_this_process_cannot_load_does_not_hide_the_others(
    cli: Cli, tmp_path: Path, db_path: Path
) -> None:
    """A stored workflow whose python: action's module is not importable here (added
    with a plug-in on the path) made ``workflow list`` fail as a whole: no workflow
    could be listed, not even the built-ins. It is listed, with why."""
    import sqlite3
    import time

    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0
    conn = sqlite3.connect(db_path)
    with conn:
        conn.execute(
            "INSERT INTO workflows (name, version, source_yaml, created_at) VALUES (?, 1, ?, ?)",
            (
                "pywf",
                "name: pywf\nstates:\n  - name: s1\n    action: python:no_such_mod_x:Slow\n",
                time.time(),
            ),
        )
    conn.close()
    listed = workflows(cli)
    assert "patch" in listed and listed["site-patch"]["problem"] is None
    assert listed["pywf"]["states"] == [] and listed["pywf"]["version"] is None
    assert "no_such_mod_x" in listed["pywf"]["problem"], listed["pywf"]
    table = cli("workflow", "list")
    assert table.code == 0, table.text
    assert "UNUSABLE HERE" in table.out and "1 stored workflow cannot be used" in table.err
    res = cli("strategy", "create", "--workflow", "nosuch", "--all")
    assert "pywf" in res.text  # still known by name


def test_a_workflow_name_is_at_most_64_characters_and_says_what_is_allowed(
    cli: Cli, tmp_path: Path
) -> None:
    """A 5,000-character name was stored, and then padded every 'workflow list' row and
    filled every 'unknown workflow' error; a bad name's error quoted a regex."""
    long = write(tmp_path, "name: " + "w" * 65 + "\nstates:\n  - name: a\n")
    assert_rejected(cli("workflow", "add", str(long)), "name: at most 64 characters, got 65")
    bad = write(tmp_path, 'name: "bad name"\nstates:\n  - name: a\n', "bad.yaml")
    assert_rejected(
        cli("workflow", "add", str(bad)),
        "name: 'bad name' is not allowed; use letters, digits and _ . -",
    )
    assert "w" * 65 not in workflows(cli)  # nothing stored
    ok = write(tmp_path, "name: " + "w" * 64 + "\nstates:\n  - name: a\n", "ok.yaml")
    assert cli("workflow", "add", str(ok)).code == 0


@pytest.mark.parametrize(
    ("state", "said"),
    [
        (
            "mode: wait-for-callback\n    retry: {attempts: 3}",
            "states[0] (a): retry: attempts: a wait-for-callback state is not retried",
        ),
        (
            "mode: poll\n    timeout_s: 60\n    poll_interval_s: 90",
            "states[0] (a): poll_interval_s: 90s is not shorter than the state's timeout_s (60s)",
        ),
    ],
)
def test_settings_that_would_do_nothing_are_refused(
    cli: Cli, tmp_path: Path, state: str, said: str
) -> None:
    """A callback wait with retries (never retried, yet 'workflow show' showed them), or
    a poll interval past the timeout (never a second look), passed validation."""
    f = write(tmp_path, f"name: nothing\nstates:\n  - name: a\n    {state}\n")
    assert_rejected(cli("workflow", "validate", str(f), db=None), said)
    assert_rejected(cli("workflow", "add", str(f)), said)
    assert "nothing" not in workflows(cli)


def test_strategy_show_names_the_workflow_version_it_runs(cli: Cli, tmp_path: Path) -> None:
    """After v4 of a stored workflow replaced v3, which version a strategy runs showed
    only through its list of states."""
    assert cli("target", "add", "a").code == 0
    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0
    made = cli("strategy", "create", "--workflow", "site-patch", "--all", "--format", "json")
    sid = made.json()["id"]
    v4 = GOOD.replace("version: 3", "version: 4")
    assert cli("workflow", "add", str(write(tmp_path, v4, "v4.yaml"))).code == 0
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert (shown["workflow"], shown["workflow_version"]) == ("site-patch", 3)
    listed = cli("strategy", "list", "--format", "json").json()
    assert [s["workflow_version"] for s in listed] == [3]


@pytest.mark.parametrize(
    ("state", "said"),
    [
        (
            "retry: {attempts: 2.0}",
            "states[0] (a): retry: attempts: expected a whole number, got 2.0",
        ),
        ("action: ''", "states[0] (a): action: empty; leave it out to run the operation"),
        ("action: do it", "states[0] (a): action: 'do it' is not an operation name (one word"),
    ],
)
def test_loose_values_are_refused_in_a_new_workflow(
    cli: Cli, tmp_path: Path, state: str, said: str
) -> None:
    """pydantic's lax mode took them: 2.0 as 2, an empty action ran the operation named
    as the state, and an action with spaces could never name an operation."""
    f = write(tmp_path, f"name: loose\nstates:\n  - name: a\n    {state}\n")
    assert_rejected(cli("workflow", "validate", str(f), db=None), said)
    assert_rejected(cli("workflow", "add", str(f)), said)
    assert "loose" not in workflows(cli)


def test_validate_with_a_database_says_what_add_would_say_of_the_version(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate said "is valid" of a version that add then refused (older than the
    stored one, or the same version with other states): it looked at no database."""
    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0  # v3
    older = write(tmp_path, GOOD.replace("version: 3", "version: 2"), "v2.yaml")
    changed = write(tmp_path, GOOD.replace("timeout_s: 30", "timeout_s: 31"), "v3b.yaml")
    newer = write(tmp_path, GOOD.replace("version: 3", "version: 4"), "v4.yaml")
    said = "version 2 is older than the stored version 3"
    assert_rejected(cli("workflow", "validate", str(older)), said)
    assert_rejected(cli("workflow", "add", str(older)), said)
    said = "version 3 is already stored with other states or settings"
    assert_rejected(cli("workflow", "validate", str(changed)), said)
    # named with its file, as every other error of a workflow file is (a walkthrough)
    res = cli("workflow", "add", str(changed))
    assert res.err.startswith(f"error: {changed}: workflow site-patch: version 3 is"), res.err
    res = cli("workflow", "validate", str(tmp_path / "wf.yaml"))
    assert res.code == 0 and res.out.strip().endswith("already stored as v3, unchanged")
    res = cli("workflow", "validate", str(newer))
    assert res.code == 0 and res.out.strip().endswith("'workflow add' would replace the stored v3")
    # nothing was written by validate: v3 is still the stored one
    assert cli("workflow", "show", "site-patch", "--format", "json").json()["version"] == 3
    # no database given and none in the working directory: the file alone
    monkeypatch.chdir(tmp_path / "..")
    monkeypatch.delenv("FLEETWAVE_DB", raising=False)
    res = cli("workflow", "validate", str(older), db=None)
    assert res.code == 0 and res.out.strip().endswith("is valid (3 states)"), res.text
    # a database named that is not there is an error, as for every other command
    assert_rejected(cli("workflow", "validate", str(older), db=tmp_path / "nope.db"), "no database")


def test_validate_and_add_answer_in_json_for_scripts(cli: Cli, tmp_path: Path) -> None:
    f = write(tmp_path, GOOD)
    res = cli("workflow", "validate", str(f), "--format", "json")
    assert res.code == 0, res.text
    assert res.json() == {
        "file": str(f),
        "name": "site-patch",
        "version": 3,
        "states": ["check", "apply", "verify"],  # names, as a strategy's (it was a count)
        "add_would": "store",
        "stored_version": None,
    }
    res = cli("workflow", "add", str(f), "--format", "json")
    assert res.json() == {
        "name": "site-patch",
        "version": 3,
        "stored": True,
        "replaced_version": None,
    }
    again = cli("workflow", "add", str(f), "--format", "json")
    assert again.json() == {
        "name": "site-patch",
        "version": 3,
        "stored": False,
        "replaced_version": None,
    }
    assert cli("workflow", "validate", str(f), "--format", "json").json()["add_would"] == "nothing"
    v4 = write(tmp_path, GOOD.replace("version: 3", "version: 4"), "v4.yaml")
    res = cli("workflow", "validate", str(v4), "--format", "json")
    assert (res.json()["add_would"], res.json()["stored_version"]) == ("replace", 3)
    res = cli("workflow", "add", str(v4), "--format", "json")
    assert (res.json()["stored"], res.json()["replaced_version"]) == (True, 3)
    # a bad file: the same one error line and exit 2, no JSON on stdout
    bad = write(tmp_path, GOOD.replace("version: 3", "version: zero"), "bad.yaml")
    assert_rejected(cli("workflow", "validate", str(bad), "--format", "json"), "version")
