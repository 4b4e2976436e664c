"""Options of one value given twice are refused; an unmanage warns about the steps it will
fail; a target whose step has ended may change; quoted numbers in files are refused; a
stored workflow can be deleted while its strategies run on; ``apply --wait`` of a
paused or aborting strategy says what it does. From an operator's acceptance pass."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cli_harness import Cli, one_line
from test_cli_strategy import add, create


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["target", "add", "m", "--group", "ga", "--group", "gb"], "--group"),
        (
            [
                "strategy",
                "create",
                "--workflow",
                "patch",
                "--max-parallel",
                "3",
                "--max-parallel=9",
            ],
            "--max-parallel",
        ),
        (["target", "list", "--group", "a", "--group", "b"], "--group"),
        (["strategy", "create", "--workflow", "patch", "--workflow", "sw-deploy"], "--workflow"),
        (["step", "list", "--strategy", "1", "--strategy", "2"], "--strategy"),
        (["target", "list", "--format", "json", "--format", "table"], "--format"),
        (["strategy", "apply", "1", "--wait", "--no-wait"], "--wait and --no-wait"),
    ],
)
def test_an_option_of_one_value_given_twice_is_refused(
    cli: Cli, args: list[str], option: str
) -> None:
    """Click kept the last value without a word: a strategy of the second group only,
    or at the second max-parallel."""
    add(cli, "a1")
    assert cli("group", "add", "ga").code == 0
    said = "give one of them" if " and " in option else "given more than once (it takes one value)"
    assert one_line(cli(*args)) == f"error: {option}: {said}"
    targets = cli("target", "list", "--format", "json").json()
    assert [t["name"] for t in targets] == ["a1"]  # nothing written
    assert cli("strategy", "list", "--format", "json").json() == []


def test_help_asked_for_among_repeated_options_is_the_help(cli: Cli) -> None:
    res = cli("target", "list", "--group", "a", "--group", "b", "--help", db=None)
    assert res.code == 0 and "Usage:" in res.out, res.text


def test_options_that_take_several_values_or_none_may_be_repeated(cli: Cli) -> None:
    add(cli, "a1", "a2")
    sid = create(cli, "--all")
    res = cli("step", "list", "--strategy", str(sid), "--target", "a1", "--target", "a2")
    assert res.code == 0 and "a1" in res.out and "a2" in res.out, res.text
    # a flag given twice says the same thing twice; a value that looks like an option is
    # that option's value, not the option again
    res = cli("strategy", "create", "--workflow", "patch", "--targets", "a1", "--stop-on-failure")
    assert res.code == 2 and "already in active strategy" in res.text  # (a1 is held)
    res = cli("strategy", "delete", str(sid))
    assert res.code == 0, res.text
    res = cli(
        "strategy",
        "create",
        "--workflow",
        "patch",
        "--all",
        "--stop-on-failure",
        "--stop-on-failure",
    )
    assert res.code == 0, res.text
    res = cli("target", "add", "x", "--label", "--group", "--group", "ga")
    assert res.code == 2 and "given more than once" not in res.text, res.text


def _one_step_ended(cli: Cli, db_path: Path, stop: bool = False) -> int:
    """An applying strategy over a, b and c (max parallel 1) whose step of a has ended
    complete, of b is in flight, of c not started (the rows as a conductor leaves them)."""
    add(cli, "a", "b", "c")
    sid = create(cli, "--all", "--max-parallel", "1", *(["--stop-on-failure"] if stop else []))
    assert cli("strategy", "apply", str(sid)).code == 0
    with sqlite3.connect(db_path) as conn:
        for name, state in (("a", "complete"), ("b", "updating-patches")):
            conn.execute(
                "UPDATE steps SET state = ? WHERE strategy_id = ? AND target_id = "
                "(SELECT id FROM targets WHERE name = ?)",
                (state, sid, name),
            )
    return sid


def test_unmanaging_a_target_whose_step_is_still_to_come_warns(cli: Cli, db_path: Path) -> None:
    """It fails when its turn comes, and the strategy then ends failed (or stops): the
    command said only "target w2 is unmanaged"."""
    sid = _one_step_ended(cli, db_path, stop=True)
    res = cli("target", "unmanage", "c")
    assert res.code == 0
    assert res.out == "target c is unmanaged\n"
    assert res.err == (
        f"warning: target c: its step in strategy {sid} (applying) has not started: it fails "
        "when its turn comes (the strategy then ends failed); strategy "
        f"{sid} stops on failure: its steps not started then end aborted; 'fleetwave target "
        "manage c' before then lets it run\n"
    )
    res = cli("target", "unmanage", "c", "--format", "json")
    assert res.json() == {
        "name": "c",
        "managed": False,
        "steps_to_fail": [{"strategy": sid, "state": "applying", "stops": "on failure"}],
    }
    # in flight or ended: the step goes on, or is over; nothing to warn of
    for name in ("a", "b"):
        res = cli("target", "unmanage", name)
        assert (res.code, res.err) == (0, ""), res.text
    assert cli("target", "manage", "c").err == ""


def test_a_target_whose_step_has_ended_may_change_but_not_be_deleted(
    cli: Cli, db_path: Path
) -> None:
    """Its step is done: the refusal asked for the rollout to be aborted."""
    sid = _one_step_ended(cli, db_path)
    res = cli("target", "set", "a", "--set", "latency_ms=5", "--format", "json")
    assert res.code == 0, res.text
    after = cli("target", "show", "a", "--format", "json").json()
    assert after["settings"] == {"latency_ms": 5}
    assert one_line(cli("target", "delete", "a")) == (
        f"error: target a: its step in active strategy {sid} (applying) has ended "
        "(complete), and the strategy keeps its history: the target can be deleted with "
        f"the strategy's history once the strategy has ended (2 of 3 steps still to go; "
        f"'fleetwave strategy delete {sid}' then)"
    )
    # in flight: unmanaging it would not keep the rollout off it, so it is not offered
    line = one_line(cli("target", "set", "b", "--set", "latency_ms=5"))
    assert f"active strategy {sid} (applying)" in line and "unmanage" not in line
    line = one_line(cli("target", "set", "c", "--set", "latency_ms=5"))
    assert line.endswith(
        "'fleetwave target unmanage c' keeps the rollout off it meanwhile (its step fails "
        "when its turn comes)"
    )
    assert "abort" in one_line(cli("target", "delete", "b"))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('    timeout_s: "300"\n', "timeout_s: expected a number, got the text '300' (unquote it)"),
        ("    retry: {attempts: '2'}\n", "attempts: expected a number, got the text '2'"),
        ('    retry: {backoff_s: "1.5"}\n', "backoff_s: expected a number, got the text '1.5'"),
    ],
)
def test_a_quoted_number_in_a_workflow_is_refused(
    cli: Cli, tmp_path: Path, text: str, problem: str
) -> None:
    """'1:30' was refused where a number goes, yet "300" (quoted) was read as 300."""
    wf = tmp_path / "wf.yaml"
    wf.write_text("name: q\nstates:\n  - name: a\n" + text, encoding="utf-8")
    line = one_line(cli("workflow", "validate", str(wf), db=None))
    assert f"states[0] (a): {'' if 'timeout' in problem else 'retry: '}{problem}" in line, line
    wf.write_text('name: q\nversion: "2"\nstates:\n  - name: a\n', encoding="utf-8")
    assert "version: expected a number, got the text '2'" in one_line(
        cli("workflow", "add", str(wf))
    )


def test_a_quoted_number_in_a_target_file_is_refused(cli: Cli, tmp_path: Path) -> None:
    """Stored as text, the same target given as --set latency_ms=5 read as another
    definition of it ("already exists with another definition")."""
    rows = tmp_path / "t.yaml"
    rows.write_text(
        "targets:\n  - {name: y1, settings: {latency_ms: 5}}\n"
        '  - {name: y2, settings: {failure_rate: "0.5"}}\n',
        encoding="utf-8",
    )
    line = one_line(cli("target", "import", str(rows)))
    assert line.endswith(
        "targets[1] (y2): sim setting failure_rate: the text '0.5' where a number goes (unquote it)"
    ), line
    assert cli("target", "list", "--format", "json").json() == []
    # typed where numbers are typed: --set, a CSV column, an unquoted YAML number
    assert cli("target", "add", "y1", "--set", "latency_ms=5").code == 0
    rows.write_text("targets:\n  - {name: y1, settings: {latency_ms: 5}}\n", encoding="utf-8")
    res = cli("target", "import", str(rows))
    assert res.code == 0 and "1 already there, unchanged" in res.text, res.text


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


def test_an_import_that_would_fence_off_a_managed_target_says_it_does_not(
    cli: Cli, tmp_path: Path
) -> None:
    """managed=false for a target already there was ignored, and the import said
    "unchanged": an inventory meant to fence a target off did not, without a word."""
    first = tmp_path / "a.csv"
    first.write_text("name,latency_ms\nm1,5\nm2,5\n", encoding="utf-8")
    assert cli("target", "import", str(first)).code == 0
    again = tmp_path / "b.csv"
    again.write_text("name,latency_ms,managed\nm1,5,false\nm2,5,true\nm3,5,false\n")
    res = cli("target", "import", str(again))
    assert res.code == 0
    assert res.out == f"1 target imported from {again}; 2 already there, unchanged\n"
    assert res.err == (
        "warning: 1 target given as unmanaged, already there managed, stay managed (m1): "
        "whether a target is managed is the operator's; 'fleetwave target unmanage NAME' "
        "keeps a rollout off one\n"
    )
    res = cli("target", "import", str(again), "--format", "json")
    assert res.json()["managed_kept"] == ["m1"]
    shown = {t["name"]: t["managed"] for t in cli("target", "list", "--format", "json").json()}
    assert shown == {"m1": True, "m2": True, "m3": False}


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
