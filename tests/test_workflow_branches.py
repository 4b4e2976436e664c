"""Branching in YAML workflows: a state goes to another on an outcome (``on: {failed:
rollback, done: next}``, forward or to a cleanup state), and may be skipped on a
driver's report (``skip_if``); a cycle is refused unless every state on it declares
``max_visits`` (see test_bounded_cycles.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from cli_harness import Cli, assert_rejected
from test_cli_strategy import add, apply_wait

ROLLBACK = """\
name: patch-with-rollback
states:
  - name: pre-check
    skip_if: already-done
  - name: apply
    on: {failed: rollback, done: next}
  - name: verify
  - name: finish
  - name: rollback
    cleanup: true
  - name: notify
    cleanup: true
"""


def _journal(cli: Cli, sid: int) -> dict[str, list[tuple[str, str, str]]]:
    rows = cli("history", "--strategy", str(sid), "--format", "json").json()
    out: dict[str, list[tuple[str, str, str]]] = {}
    for r in rows:
        out.setdefault(r["target"], []).append((r["from"], r["to"], r["details"]))
    return out


def _rollout(cli: Cli, tmp_path: Path, text: str) -> tuple[int, Any]:
    f = tmp_path / "wf.yaml"
    f.write_text(text)
    res = cli("workflow", "add", str(f))
    assert res.code == 0, res.text
    name = text.split("\n", 1)[0].removeprefix("name: ")
    made = cli("strategy", "create", "--workflow", name, "--all", "--format", "json")
    assert made.code == 0, made.text
    sid = int(made.json()["id"])
    return sid, apply_wait(cli, sid)


def test_a_failure_goes_to_its_cleanup_states_and_the_step_still_ends_failed(
    cli: Cli, tmp_path: Path
) -> None:
    add(cli, "good")
    add(cli, "bad", fail_at="apply")
    sid, res = _rollout(cli, tmp_path, ROLLBACK)
    assert res.code == 1, res.text  # one step failed
    moves = _journal(cli, sid)
    assert [(f, t) for f, t, _ in moves["good"]] == [
        ("initial", "pre-check"),
        ("pre-check", "apply"),
        ("apply", "verify"),
        ("verify", "finish"),
        ("finish", "complete"),  # past the cleanup states: never entered in order
    ]
    assert [(f, t) for f, t, _ in moves["bad"]] == [
        ("initial", "pre-check"),
        ("pre-check", "apply"),
        ("apply", "rollback"),
        ("rollback", "notify"),
        ("notify", "failed"),
    ]
    why = moves["bad"][2][2]
    assert why.startswith("apply: ") and why.endswith("; on failed: rollback")
    assert moves["bad"][-1][2] == "notify: cleanup done; the step ends failed"
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == "failed" and shown["step_states"] == {"complete": 1, "failed": 1}
    assert cli("check").code == 0  # each state entered once; every move forward


def test_done_can_jump_forward_and_end_the_step(cli: Cli, tmp_path: Path) -> None:
    add(cli, "a")
    sid, res = _rollout(
        cli,
        tmp_path,
        "name: short-cut\nstates:\n  - name: pre-check\n    on: {done: finish}\n"
        "  - name: apply\n  - name: finish\n    on: {done: complete}\n  - name: extra\n",
    )
    assert res.code == 0, res.text
    assert [(f, t) for f, t, _ in _journal(cli, sid)["a"]] == [
        ("initial", "pre-check"),
        ("pre-check", "finish"),
        ("finish", "complete"),
    ]
    assert cli("check").code == 0


def test_skip_if_a_drivers_report_skips_the_state_and_sends_nothing(
    cli: Cli, tmp_path: Path, db_path: Path
) -> None:
    add(cli, "fresh")
    add(cli, "current", already_done="true")
    sid, res = _rollout(cli, tmp_path, ROLLBACK)
    assert res.code == 0, res.text
    moves = _journal(cli, sid)
    assert moves["current"][1] == (
        "pre-check",
        "apply",
        "pre-check: skipped: the target reports pre-check already-done",
    )
    assert moves["fresh"][1] == ("pre-check", "apply", "")
    assert [t for _, t, _ in moves["current"]][-1] == "complete"


def test_workflow_show_says_where_each_state_branches(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "wf.yaml"
    f.write_text(ROLLBACK)
    assert cli("workflow", "add", str(f)).code == 0
    states = {
        s["state"]: s
        for s in cli("workflow", "show", "patch-with-rollback", "--format", "json").json()["states"]
    }
    assert states["apply"]["on_failed"] == "rollback" and states["apply"]["on_done"] == "verify"
    assert states["rollback"]["cleanup"] and "on_done" not in states["verify"]
    assert "skip if already-done" in states["pre-check"]["action"]


@pytest.mark.parametrize(
    ("states", "said"),
    [
        (
            "  - name: a\n    on: {failed: rollbak}\n  - name: rollback\n    cleanup: true\n",
            "states[0] (a): on: failed: 'rollbak' is not a state of this workflow",
        ),
        (
            "  - name: a\n  - name: b\n    on: {failed: a}\n",
            "workflow bad: states a, b form a cycle of branches; every state on a cycle "
            "needs max_visits (1 to 100): missing on a, b",
        ),
        (
            "  - name: a\n    on: {done: a}\n  - name: b\n",
            "state a branches to itself, a cycle; every state on a cycle needs max_visits",
        ),
        (
            "  - name: a\n  - name: c\n    cleanup: true\n",
            "states[1] (c): cleanup: no branch goes to it",
        ),
        ("  - name: a\n    cleanup: true\n", "states[0] (a): cleanup: the first state"),
        ("  - name: a\n    on: {failed: complete}\n", "'complete' is not a state"),
        ("  - name: a\n    on: {started: b}\n  - name: b\n", "not a field here"),
        ("  - name: a\n    skip_if: maybe\n", "skip_if"),
    ],
)
def test_bad_branches_are_one_error_line_and_nothing_is_stored(
    cli: Cli, tmp_path: Path, db_path: Path, states: str, said: str
) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("name: bad\nstates:\n" + states)
    assert_rejected(cli("workflow", "validate", str(f)), said)
    assert_rejected(cli("workflow", "add", str(f)), said)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT count(*) FROM workflows").fetchone()[0] == 0


def test_the_rules_route_done_and_failed_and_leave_an_abort_alone() -> None:
    from fleetwave.domain.rules import Decision, decide, failure, on_failed
    from fleetwave.domain.workflow import Advance, Skip
    from fleetwave.domain.yaml_workflow import parse_workflow_yaml

    wf = parse_workflow_yaml(ROLLBACK, strict=True)
    names, nexts = wf.state_names, wf.done_next
    assert decide(names, "finish", Advance(), nexts) == Decision("complete", "")
    assert decide(names, "rollback", Advance(), nexts).to_state == "notify"
    assert decide(names, "notify", Advance(), nexts) == Decision(
        "failed", "notify: cleanup done; the step ends failed"
    )
    assert decide(names, "apply", Skip("up to date"), nexts).to_state == "complete"
    apply = wf.state("apply")
    assert on_failed(apply, failure("apply", "boom")) == Decision(
        "rollback", "apply: boom; on failed: rollback"
    )
    aborted = Decision("aborted", "apply: not started now")
    assert on_failed(apply, aborted) is aborted
    assert on_failed(wf.state("verify"), failure("verify", "x")).to_state == "failed"
