"""Workflow versions: the same version again is a no-op or refused, a higher one replaces
the stored one, and a strategy keeps the version it was created from."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_harness import Cli, assert_rejected, one_line
from test_cli_strategy import add, apply_wait, history
from test_cli_workflow import GOOD, workflows, write


def _stored_states(cli: Cli) -> list[str]:
    return list(workflows(cli)["site-patch"]["states"])


def test_the_same_workflow_again_is_a_no_op_also_with_other_comments(
    cli: Cli, tmp_path: Path
) -> None:
    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0
    relaid = "# the same workflow, commented and laid out otherwise\n" + GOOD.replace(
        "timeout_s: 30", "timeout_s: 30.0   # seconds"
    )
    res = cli("workflow", "add", str(write(tmp_path, relaid, "again.yaml")))
    assert (res.code, res.out) == (0, "workflow site-patch v3 is already stored, unchanged\n")
    assert _stored_states(cli) == ["check", "apply", "verify"]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        # same version, other content: refused, naming the version to give
        (
            lambda t: t.replace("timeout_s: 7200", "timeout_s: 600"),
            ("site-patch", "version 3 is already stored", "raise version to 4"),
        ),
        (
            lambda t: t.replace("  - name: verify\n    mode: poll\n", ""),
            ("version 3 is already stored",),
        ),
        # an older version never replaces a newer one
        (
            lambda t: t.replace("version: 3", "version: 2"),
            ("version 2 is older than the stored version 3", "above 3"),
        ),
    ],
)
def test_a_workflow_that_would_change_under_the_same_or_an_older_version_is_refused(
    cli: Cli, tmp_path: Path, edit: object, words: tuple[str, ...]
) -> None:
    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0
    shown_before = cli("workflow", "show", "site-patch", "--format", "json").json()
    assert callable(edit)
    res = cli("workflow", "add", str(write(tmp_path, edit(GOOD), "changed.yaml")))
    assert_rejected(res, *words)
    assert one_line(res)
    # nothing changed
    assert cli("workflow", "show", "site-patch", "--format", "json").json() == shown_before


def test_a_higher_version_replaces_and_says_which_it_replaced(cli: Cli, tmp_path: Path) -> None:
    assert cli("workflow", "add", str(write(tmp_path, GOOD))).code == 0
    v5 = GOOD.replace("version: 3", "version: 5").replace("timeout_s: 7200", "timeout_s: 600")
    res = cli("workflow", "add", str(write(tmp_path, v5, "v5.yaml")))
    assert res.code == 0, res.text
    assert res.out == (
        "workflow site-patch v5 stored, replacing v3 (strategies created from v3 keep it)\n"
    )
    shown = cli("workflow", "show", "site-patch", "--format", "json").json()
    assert shown["version"] == 5
    assert [s["timeout_s"] for s in shown["states"]][1] == 600


def test_a_strategy_created_from_the_replaced_version_keeps_it(cli: Cli, tmp_path: Path) -> None:
    text = "name: pinned\nversion: 1\nstates:\n  - name: only\n    timeout_s: 60\n"
    assert cli("workflow", "add", str(write(tmp_path, text))).code == 0
    add(cli, "a")
    res = cli("strategy", "create", "--workflow", "pinned", "--all", "--format", "json")
    assert res.code == 0, res.text
    sid = res.json()["id"]
    v2 = text.replace("version: 1", "version: 2").replace("only", "renamed")
    assert cli("workflow", "add", str(write(tmp_path, v2, "v2.yaml"))).code == 0
    done = apply_wait(cli, sid)
    assert done.code == 0, done.text
    assert [h["to"] for h in history(cli, sid)] == ["only", "complete"]


def test_the_same_version_naming_another_python_class_of_the_same_name_is_refused(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two modules' `Apply` classes describe alike (by class name); the second was
    reported 'unchanged' and silently not stored."""
    for mod in ("fw8_moda", "fw8_modb"):
        (tmp_path / f"{mod}.py").write_text(
            "from fleetwave import Advance, StateAction\n\n"
            "class Apply(StateAction):\n"
            "    async def run(self, ctx):\n"
            "        return Advance()\n",
            encoding="utf-8",
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    text = "name: pw\nversion: 1\nstates:\n  - name: apply\n    action: python:fw8_moda:Apply\n"
    assert cli("workflow", "add", str(write(tmp_path, text))).code == 0
    same = cli("workflow", "add", str(write(tmp_path, text, "same.yaml")))
    assert "already stored, unchanged" in same.out, same.text
    other = text.replace("fw8_moda", "fw8_modb")
    assert_rejected(
        cli("workflow", "add", str(write(tmp_path, other, "other.yaml"))),
        "workflow pw: version 1 is already stored with other states or settings",
    )


def test_a_stored_workflow_can_be_deleted_and_its_strategies_run_on(
    cli: Cli, tmp_path: Path
) -> None:
    """A mistyped workflow stayed in `workflow list` for good."""
    wf = tmp_path / "wf.yaml"
    wf.write_text("name: oops\nversion: 3\nstates:\n  - name: a\n", encoding="utf-8")
    assert cli("workflow", "add", str(wf)).code == 0
    add(cli, "t1")
    res = cli("strategy", "create", "--workflow", "oops", "--all", "--format", "json")
    sid = int(res.json()["id"])
    res = cli("workflow", "delete", "oops", "--format", "json")
    assert res.json() == {"name": "oops", "version": 3, "deleted": True}
    names = [w["name"] for w in cli("workflow", "list", "--format", "json").json()]
    assert "oops" not in names
    assert "--workflow: unknown workflow 'oops'" in one_line(
        cli("strategy", "create", "--workflow", "oops", "--targets", "t1")
    )
    res = cli("strategy", "apply", str(sid), "--wait", "--format", "json")
    assert res.code == 0 and res.json()["state"] == "complete", res.text  # its own copy
    assert one_line(cli("workflow", "delete", "oops")) == (
        "error: workflow 'oops': no stored workflow of that name"
    )
    res = cli("workflow", "delete", "oops", "--ignore-missing", "--format", "json")
    assert (res.code, res.json()) == (0, {"name": "oops", "deleted": False})
    assert one_line(cli("workflow", "delete", "patch")) == (
        "error: workflow patch: built in, not stored: it cannot be deleted"
    )
