"""Strategy commands in every state: an abort asked again or too late, ``apply --wait`` of
an ended strategy, and refusals that name what ends the strategy holding a target."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cli_harness import Cli, assert_rejected
from test_cli_strategy import add, apply_wait, create, history
from test_cli_workflow import write


def test_an_abort_asked_again_succeeds_saying_it_is_under_way(cli: Cli) -> None:
    add(cli, "a", "b", latency_ms="60000")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    first = cli("strategy", "abort", str(sid))
    assert (first.code, first.out) == (0, f"strategy {sid}: abort requested\n")
    # nothing drives it: the operator learns what finishes the abort
    assert first.err.startswith("warning: no conductor serves "), first.err
    assert f"'fleetwave strategy apply {sid} --wait'" in first.err
    again = cli("strategy", "abort", str(sid))
    assert (again.code, again.out) == (
        0,
        f"strategy {sid}: abort already requested (abort-requested)\n",
    )
    assert again.err == first.err  # still nobody to finish it: said again
    done = apply_wait(cli, sid)  # a conductor finishes the abort
    assert done.json()["state"] == "aborted", done.text
    last = cli("strategy", "abort", str(sid))
    assert (last.code, last.out) == (0, f"strategy {sid}: already aborted\n")


def test_an_abort_of_a_strategy_that_completed_is_refused(cli: Cli) -> None:
    add(cli, "a")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    assert_rejected(cli("strategy", "abort", str(sid)), f"strategy {sid}: is complete")


def test_apply_wait_of_an_ended_strategy_answers_with_its_result(cli: Cli) -> None:
    add(cli, "ok")
    sid = create(cli, "--all")
    first = apply_wait(cli, sid)
    assert first.code == 0, first.text
    rows = len(history(cli, sid))
    again = apply_wait(cli, sid)
    assert again.code == 0, again.text
    assert again.json()["state"] == "complete"
    assert again.json()["step_states"] == {"complete": 1}
    assert f"strategy {sid} had already ended (complete): nothing to drive" in again.err
    assert len(history(cli, sid)) == rows  # nothing driven, nothing written

    add(cli, "bad", fail_at="pre-check")
    failed = cli(
        "strategy", "create", "--workflow", "patch", "--targets", "bad", "--format", "json"
    ).json()["id"]
    assert apply_wait(cli, failed).code == 1
    again = apply_wait(cli, failed)
    assert again.code == 1 and again.json()["state"] == "failed", again.text
    # without --wait, applying an ended strategy stays bad input
    assert_rejected(cli("strategy", "apply", str(sid)), "complete")


def test_what_must_end_first_is_named_with_what_ends_it(cli: Cli) -> None:
    """Deleting a target or a strategy that an active strategy holds says what ends it
    (it said 'delete that first' of a running strategy, which cannot be deleted, and
    'abort it first' of one already aborting)."""
    add(cli, "a", "b", latency_ms="60000")
    never = create(cli, "--targets", "a")
    assert_rejected(
        cli("target", "delete", "a"),
        f"target a: is in active strategy {never} (initial); it was never applied: "
        f"'fleetwave strategy delete {never}' ends it",
    )
    sid = create(cli, "--targets", "b")
    assert cli("strategy", "apply", str(sid)).code == 0
    assert_rejected(
        cli("strategy", "delete", str(sid)),
        f"strategy {sid}: is applying; it can be deleted once it has ended: "
        f"'fleetwave strategy abort {sid}' ends it",
    )
    assert_rejected(
        cli("target", "delete", "b"),
        f"target b: is in active strategy {sid} (applying); the target can be deleted once",
    )
    assert cli("strategy", "abort", str(sid)).code == 0
    assert_rejected(
        cli("strategy", "delete", str(sid)),
        f"strategy {sid}: is abort-requested; it can be deleted once its abort has finished, "
        f"which a conductor does: 'fleetwave serve', or 'fleetwave strategy apply {sid} --wait'",
    )
    assert apply_wait(cli, sid).json()["state"] == "aborted"
    assert cli("strategy", "delete", str(sid)).code == 0
    assert cli("target", "delete", "b").code == 0


def test_apply_wait_of_an_ended_strategy_needs_no_workflow_code(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result of an ended strategy was refused (exit 2) when this process lacked
    its workflow's Python action: nothing is driven, so nothing needs it."""

    (tmp_path / "fw8_gone.py").write_text(
        "from fleetwave import Advance, StateAction\n\n"
        "class Apply(StateAction):\n"
        "    async def run(self, ctx):\n"
        "        return Advance()\n",
        encoding="utf-8",
    )
    with monkeypatch.context() as m:
        m.syspath_prepend(str(tmp_path))
        text = "name: gone\nstates:\n  - name: apply\n    action: python:fw8_gone:Apply\n"
        assert cli("workflow", "add", str(write(tmp_path, text))).code == 0
        add(cli, "a")
        res = cli("strategy", "create", "--workflow", "gone", "--all", "--format", "json")
        sid = res.json()["id"]
        assert cli("strategy", "abort", str(sid)).code == 0  # never applied: aborted now
    sys.modules.pop("fw8_gone", None)
    (tmp_path / "fw8_gone.py").unlink()
    again = apply_wait(cli, sid)
    assert again.code == 1, again.text
    assert again.json()["state"] == "aborted"
    assert "had already ended (aborted): nothing to drive" in again.err


def test_an_abort_of_a_strategy_never_applied_says_it_is_aborted(cli: Cli) -> None:
    """Its steps are ended in the abort's own transaction: it said "abort requested" (and
    so that a conductor would finish it) though it was aborted already."""
    add(cli, "a")
    sid = create(cli, "--all")
    res = cli("strategy", "abort", str(sid))
    assert (res.code, res.out, res.err) == (
        0,
        f"strategy {sid}: aborted (it was never applied)\n",
        "",
    )
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == "aborted"
    again = cli("strategy", "abort", str(sid))
    assert (again.code, again.out) == (0, f"strategy {sid}: already aborted\n")


def test_a_target_held_by_a_strategy_never_applied_says_how_to_free_it(cli: Cli) -> None:
    assert cli("target", "add", "a").code == 0
    first = cli("strategy", "create", "--workflow", "patch", "--all", "--format", "json")
    sid = first.json()["id"]
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--all"),
        f"already in active strategy {sid} (initial); it was never applied: "
        f"'fleetwave strategy delete {sid}' frees its targets",
    )
    assert cli("strategy", "apply", str(sid)).code == 0
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--all"),
        f"already in active strategy {sid} (applying); it frees its targets once it has ended: "
        f"'fleetwave strategy abort {sid}' ends it",
    )


def test_apply_wait_drives_a_paused_strategy_as_paused(cli: Cli, db_path: Path) -> None:
    """Found by a crash hunt: a job running 'apply --wait' again after a kill -9 (as the
    README suggests) resumed a pause an operator made meanwhile, without a word. It
    drives the strategy as it is, paused, says so, and goes on once resumed."""
    import json
    import subprocess
    import sys
    import time

    add(cli, "a", "b", "c", latency_ms="20")
    sid = create(cli, "--targets", "a,b,c")
    assert cli("strategy", "apply", str(sid)).code == 0
    assert cli("strategy", "pause", str(sid)).code == 0
    fleetwave = [sys.executable, "-m", "fleetwave.cli.main"]
    proc = subprocess.Popen(
        [*fleetwave, "strategy", "apply", str(sid), "--wait", "--db", str(db_path),
         "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        shown = cli("strategy", "show", str(sid), "--format", "json").json()
        while shown["owner"] is None:
            assert time.monotonic() < deadline and proc.poll() is None, proc.poll()
            time.sleep(0.1)
            shown = cli("strategy", "show", str(sid), "--format", "json").json()
        time.sleep(1.0)  # driven, and held: nothing starts
        shown = cli("strategy", "show", str(sid), "--format", "json").json()
        assert shown["state"] == "paused"
        listed = cli("step", "list", "--strategy", str(sid), "--format", "json").json()
        assert [s["state"] for s in listed] == ["initial"] * 3
        assert cli("strategy", "resume", str(sid)).code == 0
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert json.loads(out)["state"] == "complete"
    assert (
        f"strategy {sid} is paused: driven here, nothing new starts until 'fleetwave "
        f"strategy resume {sid}' (apply --wait does not undo a pause)"
    ) in " ".join(err.split())


def test_apply_wait_of_an_abort_says_apply_does_not_undo_it(cli: Cli) -> None:
    """As plain apply says it: an abort asked for is not undone by apply --wait, which
    drives the strategy to its end (aborted)."""
    add(cli, "a", "b", latency_ms="20")
    sid = create(cli, "--targets", "a,b")
    assert cli("strategy", "apply", str(sid)).code == 0
    assert cli("strategy", "abort", str(sid)).code == 0
    res = cli("strategy", "apply", str(sid), "--wait", "--format", "json")
    assert res.code == 1, res.text
    assert res.json()["state"] == "aborted"
    assert (
        f"strategy {sid}: its abort was requested; apply does not undo an abort: driven "
        "here to its end"
    ) in res.text
