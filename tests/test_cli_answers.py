"""What a command answers where it could act quietly: ``serve`` on a mistyped database
path, a workflow stored again under the same version, a serial group given a max
parallel, an abort asked twice, ``apply --wait`` of an ended strategy, tables and
messages at 80 columns, Ctrl-C of the demo, a delete and a sweep."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from cli_harness import Cli, as_terminal, assert_rejected, one_line
from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave.domain.models import StrategyOptions
from fleetwave.domain.registry import register_workflow
from fleetwave.domain.workflow import (
    ActionContext,
    Advance,
    Outcome,
    StateAction,
    StateDef,
    TransientError,
    WorkflowDef,
)
from fleetwave.engine.clock import LoopClock
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from fleetwave.store.leases import host_lease_now
from fleetwave.store.schema import conductors, steps, strategies
from test_cli_strategy import add, apply_wait, create, history
from test_cli_workflow import GOOD, workflows, write

# -- serve never makes a database ------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_conductor_in_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A serve that got as far as starting a conductor fails the test (instead of
    serving until the test run is killed)."""

    def started(*_a: object, **_k: object) -> None:
        raise AssertionError("serve started a conductor")

    monkeypatch.setattr("fleetwave.cli.main.Conductor", started)


def test_serve_on_a_path_with_no_database_refuses_and_creates_nothing(
    cli: Cli, tmp_path: Path
) -> None:
    typo = tmp_path / "fleet.bd"
    line = one_line(cli("serve", db=typo))
    assert f"--db: no database at {typo}" in line and "fleetwave init" in line, line
    assert not typo.exists()


def test_serve_from_fleetwave_db_that_names_nothing_says_so(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    typo = tmp_path / "nowhere.db"
    monkeypatch.setenv("FLEETWAVE_DB", str(typo))
    line = one_line(cli("serve", db=None))
    assert line.startswith(f"error: FLEETWAVE_DB: no database at {typo}"), line
    assert not typo.exists()


# -- a name and version mean one workflow ----------------------------------------------


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


# -- serial means one at a time ---------------------------------------------------------


def _groups(cli: Cli) -> dict[str, dict[str, object]]:
    res = cli("group", "list", "--format", "json")
    assert res.code == 0, res.text
    return {g["name"]: g for g in res.json()}


def test_a_serial_group_given_a_max_parallel_above_one_is_refused(cli: Cli) -> None:
    line = one_line(cli("group", "add", "west", "--apply-type", "serial", "--max-parallel", "7"))
    assert "--max-parallel: a serial group runs one target at a time, got 7" in line, line
    assert "west" not in _groups(cli)
    assert cli("group", "add", "west", "--apply-type", "serial", "--max-parallel", "1").code == 0
    assert cli("group", "add", "east", "--apply-type", "serial").code == 0
    listed = _groups(cli)
    assert [listed[g]["max_parallel"] for g in ("west", "east")] == [1, 1]
    # a max parallel below one is refused as for any group
    assert_rejected(
        cli("group", "add", "x", "--apply-type", "serial", "--max-parallel", "0"),
        "--max-parallel: must be at least 1, got 0",
    )


def test_a_serial_strategy_given_a_max_parallel_above_one_is_refused(cli: Cli) -> None:
    add(cli, "a", "b")
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all", "--apply-type", "serial",
        "--max-parallel", "5",
    )  # fmt: skip
    assert "--max-parallel: a serial strategy runs one target at a time, got 5" in one_line(res)
    listed = cli("strategy", "list", "--format", "json")
    assert listed.json() == []  # nothing created
    sid = create(cli, "--all", "--apply-type", "serial")
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["options"]["max_parallel"] == 1, shown


# -- an abort asked twice ----------------------------------------------------------------


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


# -- apply --wait again after the end ----------------------------------------------------


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


# -- ids and counts, help at 80 columns --------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("strategy", "show", "-1"), "-1: ids and counts are whole numbers from 0"),
        (("step", "show", "-7"), "-7: ids and counts are whole numbers from 0"),
        (("history", "--strategy", "-5"), "--strategy: -5 is negative"),
        (("history", "--strategy", "x1"), "'x1' is not a whole number"),
        (("check", "--strategy", "1.5"), "'1.5' is not a whole number"),
        (
            ("strategy", "create", "--workflow", "patch", "--all", "--max-failures", "-3"),
            "--max-failures: -3 is negative",
        ),
        (
            ("strategy", "show", "9223372036854775808"),
            "9223372036854775808 is above the largest the database holds",
        ),
        (("strategy", "show", "9" * 5000), "a number of 5000 digits is above the largest"),
        (("strategy", "show", "+-1"), "'+-1' is not a whole number"),
        (("strategy", "show", "١٢"), "'١٢' is not a whole number"),  # Arabic-Indic digits
        (("strategy", "show", "²"), "'²' is not a whole number"),
    ],
)
def test_a_number_that_is_no_id_or_count_is_named(
    cli: Cli, args: tuple[str, ...], said: str
) -> None:
    assert said in one_line(cli(*args))


def _commands() -> list[tuple[list[str], list[str]]]:
    """Every command's words and its long options, from the application itself."""
    import typer.main

    from fleetwave.cli.main import app

    found: list[tuple[list[str], list[str]]] = []

    def walk(command: object, path: list[str]) -> None:
        subs = getattr(command, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
            return
        params = getattr(command, "params", [])
        shown = [p for p in params if not getattr(p, "hidden", False)]
        found.append((path, [o for p in shown for o in p.opts if o.startswith("--")]))

    walk(typer.main.get_command(app), [])
    return found


def test_every_help_names_every_option_whole_at_80_columns(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    commands = _commands()
    assert len(commands) >= 25 and ["strategy", "create"] in [c for c, _ in commands]
    for words, options in commands:
        res = cli(*words, "--help", db=None)
        assert res.code == 0, (words, res.text)
        lines = res.out.splitlines()
        assert max(len(line) for line in lines) <= 80, words
        assert "…" not in res.out, (words, res.out)
        for option in options:
            assert any(f" {option} " in line for line in lines), (words, option, res.out)
        # a flag shows no type (`--all <bool>` read as if it took a value: a walkthrough),
        # and a repeatable option what one value looks like, not `<list[str]>`
        assert "<bool>" not in res.out and "<list[" not in res.out, (words, res.out)
        if "--db" in options:
            assert any(" --db " in x and " PATH " in x for x in lines), (words, res.out)
    # the flag that would have shown `<bool>` shows nothing in the type column
    (row,) = [
        x for x in cli("strategy", "create", "--help", db=None).out.splitlines() if " --all " in x
    ]
    assert row.split("--all")[1].split()[:2] == ["every", "target"], row


# -- the demo cut short ------------------------------------------------------------------


def test_ctrl_c_on_the_demo_is_no_success(tmp_path: Path) -> None:
    """The demo stopped by Ctrl-C exits 130 (it exited 0, its summary calling the
    strategy 'interrupted', a state that does not exist), says how to go on, and its
    summary gives the strategy's real state."""
    import json
    import signal
    import subprocess
    import sys
    import time

    fleetwave = [sys.executable, "-m", "fleetwave.cli.main"]
    db = str(tmp_path / "demo.db")
    proc = subprocess.Popen(
        # 8 s a state: 40 s to the end, so a loaded machine cannot see it end before the
        # Ctrl-C; the clean stop waits for the states in flight (up to 8 s)
        [*fleetwave, "demo", "--targets", "5", "--latency-ms", "8000", "--db", db,
         "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    owner = None
    while owner is None and time.monotonic() < deadline and proc.poll() is None:
        shown = subprocess.run(
            [*fleetwave, "strategy", "show", "1", "--db", db, "--format", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        owner = json.loads(shown.stdout)["owner"] if shown.returncode == 0 else None
        time.sleep(0.1)
    assert owner is not None, ("the demo should be driving its strategy", proc.poll())
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    summary = json.loads(out)
    assert (summary["interrupted"], summary["strategy_state"]) == (True, "applying")
    assert summary["complete"] < 5
    assert "stopped: strategy 1 is still applying; leases handed back." in err
    assert f"fleetwave strategy apply 1 --wait --db {db}" in err


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


# -- a step waiting to retry says so ------------------------------------------------------


def test_a_step_waiting_to_retry_shows_why_and_which_attempt_comes(store: Store) -> None:
    """Between two attempts the step's row says what failed and which attempt comes
    (it showed attempt 0 and no details until the state ended); the state's recorded
    deadline is the next attempt's."""

    seen: list[dict[str, object]] = []

    class Busy(StateAction):
        """Busy twice, then done; each attempt after the first first reads the row."""

        async def run(self, ctx: ActionContext) -> Outcome:
            if ctx.attempt > 1:
                seen.append(dict(queries.list_steps(store, ctx.strategy_id)[0]))
            if ctx.attempt < 3:
                raise TransientError(f"target busy ({ctx.attempt})")
            return Advance()

    wf = register_workflow(
        WorkflowDef(
            "busy-then-done",
            (StateDef("install", Busy(), timeout_s=600, attempts_max=3, backoff_s=40),),
        ),
        replace=True,
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)

    async def main() -> dict[int, str]:
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(main())[sid] == "complete"
    from datetime import datetime

    assert [(s["state"], s["attempt"]) for s in seen] == [("install", 2), ("install", 3)]
    first, second = (str(s["details"]) for s in seen)
    # read while the attempt runs: started, not "from" a time now past (an on-call
    # operator took that for a retry still to come)
    assert first.startswith("install: target busy (1) (attempt 1 of 3); attempt 2 started ")
    assert second.startswith("install: target busy (2) (attempt 2 of 3); attempt 3 started ")
    due = [datetime.strptime(d[-20:], "%Y-%m-%d %H:%M:%SZ") for d in (first, second)]
    assert (due[1] - due[0]).total_seconds() == 80  # 40 s backoff, then 80 s
    done = queries.list_steps(store, sid)[0]
    assert (done["state"], done["attempt"]) == ("complete", 3)
    assert done["details"] == "install: done at attempt 3"
    # the failed attempts are kept as events (the row's details are overwritten)
    kept = [
        e for e in queries.get_step(store, done["step"])["events"] if e["kind"] == "attempt-failed"
    ]
    assert [str(e["details"]).split("; ")[0] for e in kept] == [
        "install: target busy (1) (attempt 1 of 3)",
        "install: target busy (2) (attempt 2 of 3)",
    ]
    assert str(kept[0]["details"]).endswith(first[-20:].replace("started", "from"))


def test_a_state_entered_after_retries_counts_its_own_attempts(store: Store) -> None:
    """The step's attempt is its current state's: entering the next state after the
    first took three attempts shows attempt 1 (it showed 3); the journal keeps that
    the first state needed three."""

    seen: list[tuple[str, int]] = []

    class BusyTwice(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            if ctx.attempt < 3:
                raise TransientError("target busy")
            return Advance()

    class Look(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            row = queries.list_steps(store, ctx.strategy_id)[0]
            seen.append((str(row["state"]), int(row["attempt"])))
            return Advance()

    wf = register_workflow(
        WorkflowDef(
            "busy-then-look",
            (
                StateDef("install", BusyTwice(), attempts_max=3, backoff_s=5),
                StateDef("verify", Look()),
            ),
        ),
        replace=True,
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)

    async def main() -> dict[int, str]:
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(main())[sid] == "complete"
    assert seen == [("verify", 1)]
    moves = [(h["from"], h["to"], h["details"]) for h in queries.history(store, sid)]
    assert moves == [
        ("initial", "install", ""),
        ("install", "verify", "install: done at attempt 3"),
        ("verify", "complete", ""),
    ]
    assert queries.list_steps(store, sid)[0]["attempt"] == 1  # verify's one attempt


# -- tables at 80 columns keep every name whole ---------------------------------------------


def test_tables_at_80_columns_cut_or_split_no_name(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Target names, conductor ids and state names came out as 'subcloud599…' and
    'updating-pa…' at 80 columns; every one is now whole on one line, in a boxed table
    that fits or in plain columns."""
    names = [f"subcloud-east-rack{i:02d}-node{i:03d}" for i in range(3)]
    add(cli, *names)
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    conductor = history(cli, sid)[0]["conductor"]
    monkeypatch.setenv("COLUMNS", "80")
    step = cli("step", "list", "--strategy", str(sid), "--format", "json").json()[0]["step"]
    for args in (
        ("history", "--strategy", str(sid)),
        ("step", "list", "--strategy", str(sid)),
        ("step", "show", str(step)),
        ("strategy", "list"),
        ("strategy", "show", str(sid)),
        ("target", "list"),
        ("workflow", "show", "patch"),
    ):
        res = cli(*args)
        assert res.code == 0, (args, res.text)
        assert "…" not in res.out, (args, res.out)
        words = {w for line in res.out.splitlines() for w in line.replace("│", " ").split()}
        if args[0] in ("history", "step"):
            assert set(names) & words, (args, res.out)
        if args[0] == "history" or args[:2] == ("step", "show"):
            assert "applying-remote-patch-strategy" in words, (args, res.out)
        if args[0] == "history":
            assert conductor in words and set(names) <= words, (args, res.out)
        boxed = [line for line in res.out.splitlines() if line[:1] in "┏┃┡│└┌"]
        assert all(len(line) <= 80 for line in boxed), (args, res.out)


def test_a_message_is_one_line_however_narrow_the_output(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages went through Rich's wrapping at the output's width (80 when piped): a
    grep for one saw half of it."""
    add(cli, "a", latency_ms="60000")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    monkeypatch.setenv("COLUMNS", "40")
    res = cli("strategy", "pause", str(sid))
    assert res.code == 0, res.text
    assert res.out.count("\n") == 1 and len(res.out) > 60, res.out
    assert "('fleetwave strategy resume 1' to go on)" in res.out
    warned = cli("strategy", "abort", str(sid))
    assert warned.err.count("\n") == 1 and warned.err.startswith("warning: "), warned.err


def test_log_lines_and_tables_give_one_time_for_one_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A log line was in local time and the history row of the same event in UTC,
    neither marked; both are now UTC, marked Z, whatever TZ says."""
    import logging
    import time

    from fleetwave.cli.output import utc_log_formatter, when

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        at = 1_764_522_336.195  # 2025-11-30 17:05:36.195 UTC
        record = logging.makeLogRecord(
            {"created": at, "msecs": 195.0, "msg": "x", "levelname": "WARNING", "name": "n"}
        )
        line = utc_log_formatter().format(record)
        assert when(at) == "2025-11-30 17:05:36.195Z"
        assert line == "2025-11-30 17:05:36.195Z WARNING n: x"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("strategy", "list", "--format", "yaml"),
            "error: --format: 'yaml' is not one of 'table', 'json'.",
        ),
        (
            ("group", "add", "g", "--apply-type", "bogus"),
            "error: --apply-type: 'bogus' is not one of 'parallel', 'serial'.",
        ),
        (
            ("strategy", "create", "--workflow", "patch", "--all", "--timeout", "bogus=3"),
            "error: --timeout: bogus: workflow patch has no such state (its states: "
            "pre-check, updating-patches, creating-remote-patch-strategy, "
            "applying-remote-patch-strategy, finishing)",
        ),
        (
            ("sim", "--runs", "2", "--keep-db", "kept.db"),
            "error: --keep-db: keeps the database of a single run, got --runs 2",
        ),
        (("sim", "--keep-db", ""), "error: --keep-db: must not be empty"),
        (("sim", "--keep-db", "."), "error: --keep-db: '.' is a directory"),
    ],
)
def test_bad_values_are_named_plainly(cli: Cli, args: tuple[str, ...], said: str) -> None:
    add(cli, "a")
    res = cli(*args, db=None) if args[0] == "sim" else cli(*args)
    assert one_line(res).startswith(said), res.err


def test_strategy_list_shows_progress_and_who_drives_each(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout nobody drives listed exactly like a healthy one (its owner column named
    a dead conductor); the list now says how far each got and who drives it."""
    as_terminal(monkeypatch)
    add(cli, "a", "b", latency_ms="60000")
    add(cli, "c")
    waiting = create(cli, "--targets", "a,b")
    done = create(cli, "--targets", "c")
    assert apply_wait(cli, done).code == 0
    assert cli("strategy", "apply", str(waiting)).code == 0  # nobody serves this database
    listed = {s["id"]: s for s in cli("strategy", "list", "--format", "json").json()}
    assert (listed[waiting]["done"], listed[waiting]["steps"]) == (0, 2)
    assert listed[waiting]["driven_by"].startswith("nobody: no conductor serves")
    assert (listed[done]["done"], listed[done]["driven_by"]) == (1, None)
    table = cli("strategy", "list")
    rows = {
        int(line.split("│")[1]): [c.strip() for c in line.split("│")[2:-1]]
        for line in table.out.splitlines()
        if line.startswith("│") and line.split("│")[1].strip().isdigit()
    }
    assert rows[waiting][:4] == ["patch", "applying", "0/2", "NOBODY (see strategy show)"]
    assert rows[done][:4] == ["patch", "complete", "1/1", ""]


def test_ctrl_c_on_strategy_delete_says_how_to_finish(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fleetwave.cli import strategies as cli_strategies

    add(cli, "a", "b", "c")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    real = admin.delete_strategy

    def interrupted(store: Store, strategy_id: int) -> None:
        writes = {"n": 0}

        def ctrl_c() -> None:
            writes["n"] += 1
            if writes["n"] == 3:  # marked deleting, one chunk removed, then Ctrl-C
                raise KeyboardInterrupt

        store.write_fault = ctrl_c
        real(store, strategy_id, chunk=1)

    monkeypatch.setattr(cli_strategies.admin, "delete_strategy", interrupted)
    res = cli("strategy", "delete", str(sid))
    assert res.code == 130, res.text
    assert res.err == (
        f"stopped: strategy {sid} is partly deleted (it shows 'deleting'); "
        f"'fleetwave strategy delete {sid}' finishes it\n"
    )
    monkeypatch.setattr(cli_strategies.admin, "delete_strategy", real)
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["state"] == "deleting"
    assert cli("strategy", "delete", str(sid)).code == 0
    assert cli("strategy", "list", "--format", "json").json() == []


def test_several_serving_conductors_are_all_named(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apply` named one of two serving conductors as the one that claims the strategy
    (the other did); a second `serve` started without a word."""
    from test_cli_strategy import ON, _conductor_row

    add(cli, "a", latency_ms="60000")
    sid = create(cli, "--all")
    _conductor_row(db_path, "c-one", serves_all=True)
    _conductor_row(db_path, "c-two", serves_all=True)
    res = cli("strategy", "apply", str(sid))
    assert res.out == (
        f"strategy {sid} applying; conductors c-one {ON}, c-two {ON} serve this database; "
        "one of them claims it\n"
    ), res.text
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert shown["driven_by"].startswith(f"nobody yet: conductors c-one {ON}, c-two {ON} serve")

    def stand_in(*_a: object, **_k: object) -> None:
        raise SystemExit(3)  # serve got as far as starting its conductor

    monkeypatch.setattr("fleetwave.cli.main.Conductor", stand_in)
    serve = cli("serve")
    assert serve.code == 3
    assert serve.err.startswith(
        f"warning: 2 conductors already serve {db_path} (c-one {ON}, c-two {ON}): "
        "they share its "
        "strategies, each driven by one"
    ), serve.err


def test_ctrl_c_on_a_sim_sweep_keeps_the_runs_done(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON output of an interrupted sweep was empty: the runs finished are printed,
    with a line saying where it stopped (exit 130)."""
    from fleetwave.cli import simcmd

    real = simcmd.run_simulation
    calls = {"n": 0}

    def two_then_ctrl_c(config: object, interrupt: object = None) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(config)  # type: ignore[arg-type]

    monkeypatch.setattr(simcmd, "run_simulation", two_then_ctrl_c)
    res = cli("sim", "--targets", "20", "--runs", "10", "--format", "json", db=None)
    assert res.code == 130, res.text
    assert [r["seed"] for r in res.json()] == [1, 2]
    assert res.err.startswith("interrupted after 2 finished runs of 10"), res.err
    assert (
        "seed 3 was cut short. Go on with: fleetwave sim --seed 3 --runs 8 --targets 20 "
        "--workflow patch --faults all --format json" in res.text
    ), res.err


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


@pytest.mark.parametrize(
    ("when", "code", "said", "state"),
    [
        # waiting for the write lock: nothing happened yet
        ("before", 130, "stopped: nothing deleted; strategy 1 is still complete", "complete"),
        # the last chunk committed: it is gone, as asked
        ("after", 0, "strategy 1 deleted", None),
    ],
)
def test_ctrl_c_on_strategy_delete_says_what_the_database_holds(
    cli: Cli, monkeypatch: pytest.MonkeyPatch, when: str, code: int, said: str, state: str | None
) -> None:
    from fleetwave.cli import strategies as cli_strategies

    add(cli, "a")
    sid = create(cli, "--all")
    assert sid == 1 and apply_wait(cli, sid).code == 0
    real = admin.delete_strategy

    def interrupted(store: Store, strategy_id: int) -> None:
        if when == "after":
            real(store, strategy_id)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_strategies.admin, "delete_strategy", interrupted)
    res = cli("strategy", "delete", str(sid))
    assert res.code == code, res.text
    assert said in res.text
    listed = cli("strategy", "list", "--format", "json").json()
    assert [s["state"] for s in listed] == ([] if state is None else [state])


def test_apply_wait_of_an_ended_strategy_needs_no_workflow_code(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result of an ended strategy was refused (exit 2) when this process lacked
    its workflow's Python action: nothing is driven, so nothing needs it."""
    import sys

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


def test_the_default_flags_said_out_loud_are_still_accepted(cli: Cli) -> None:
    add(cli, "a", "b")
    res = cli(
        "strategy", "create", "--workflow", "patch", "--targets", "a",
        "--no-stop-on-failure", "--no-stages-by-group", "--format", "json",
    )  # fmt: skip
    assert res.code == 0, res.text
    shown = cli("strategy", "show", str(res.json()["id"]), "--format", "json").json()
    assert (shown["options"]["stop_on_failure"], shown["options"]["stages_by_group"]) == (
        False,
        False,
    )
    assert_rejected(
        cli(
            "strategy",
            "create",
            "--workflow",
            "patch",
            "--targets",
            "b",
            "--stages-by-group",
            "--no-stages-by-group",
        ),
        "--stages-by-group and --no-stages-by-group: give one of them",
    )


def test_a_message_with_brackets_is_shown_as_it_is(cli: Cli) -> None:
    """A target's message in brackets ('[/tmp/sock]') was read as Rich markup: `step
    list` and `step show` crashed with a MarkupError, '[bold]' vanished."""
    add(cli, "a", remote_state="[/tmp/sock][bold]")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1  # the step fails: an unexpected remote state
    said = "pre-check: target reports unexpected remote state '[/tmp/sock][bold]'"
    for args in (
        ("step", "list", "--strategy", str(sid)),
        (
            "step",
            "show",
            str(cli("step", "list", "--strategy", str(sid), "--format", "json").json()[0]["step"]),
        ),
        ("history", "--strategy", str(sid)),
    ):
        res = cli(*args)
        assert res.code == 0, (args, res.text)
        assert said in res.out, (args, res.out)


def test_a_retry_starts_only_once_the_row_names_it(store: Store) -> None:
    """Found by review: a retry started after its backoff even when the dispatcher had
    not recorded it on the step's row yet (its commit retried through a database
    outage), so a takeover then would look at the attempt before, and give the state
    one attempt too many. It waits for the record now."""

    seen: list[tuple[int, int, float]] = []

    class BusyOnce(StateAction):
        async def run(self, ctx: ActionContext) -> Outcome:
            now = asyncio.get_running_loop().time()
            seen.append((ctx.attempt, int(queries.get_step(store, ctx.step_id)["attempt"]), now))
            if ctx.attempt == 1:
                await asyncio.sleep(2)
                raise TransientError("busy")
            return Advance()

    wf = register_workflow(
        WorkflowDef("busy-once", (StateDef("a", BusyOnce(), attempts_max=3, backoff_s=1),)),
        replace=True,
    )
    add_sim_targets(store, 1)
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)

    def locked() -> None:
        raise OperationalError("BEGIN", None, Exception("database is locked (injected)"))

    async def main() -> dict[int, str]:
        loop = asyncio.get_running_loop()
        loop.call_later(1, setattr, store, "write_fault", locked)  # out from 1 s to 12 s
        loop.call_later(12, setattr, store, "write_fault", None)
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(main())[sid] == "complete"
    (first, second) = seen
    assert first[:2] == (1, 1)
    assert second[:2] == (2, 2) and second[2] >= 12  # after the record went through


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


@pytest.mark.parametrize(
    "args",
    [
        ("target", "add", "a", "--set", "latency_ms=5", "--set", "latency_ms=6"),
        ("target", "add", "a", "--label", "k=1", "--label", "k=2"),
    ],
)
def test_a_key_given_twice_is_refused(cli: Cli, args: tuple[str, ...]) -> None:
    """``--set``, ``--label`` and ``--timeout`` kept the last value of a key given twice,
    silently (``--targets`` refuses a repeat)."""
    line = one_line(cli(*args))
    assert line.endswith("given more than once"), line
    assert cli("target", "list", "--format", "json").json() == []


def test_a_timeout_given_twice_is_refused(cli: Cli) -> None:
    add(cli, "a")
    res = cli(
        "strategy", "create", "--workflow", "patch", "--all",
        "--timeout", "pre-check=5", "--timeout", "pre-check=6",
    )  # fmt: skip
    assert one_line(res) == "error: --timeout: 'pre-check' given more than once"


def test_step_list_says_what_an_in_flight_step_without_details_is_doing(
    store: Store,
) -> None:
    """A step whose conductor was interrupted showed its state and empty details: not
    whether anything ran it, nor what happens next."""
    add_sim_targets(store, 2, settings={"latency_ms": 60_000})
    sid = applied(store, "patch", max_parallel=2)
    c = Conductor(store, config=EngineConfig(tick_s=0.05))

    def details() -> set[str]:
        return {s["details"] for s in queries.list_steps(store, sid)}

    async def killed_mid_action() -> set[str]:
        task = asyncio.create_task(c.run(strategy_ids=[sid]))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if all(s["state"] == "pre-check" for s in queries.list_steps(store, sid)):
                break
        running = details()
        task.cancel()  # killed: its leases are left to run out
        await asyncio.gather(task, return_exceptions=True)
        return running

    assert asyncio.run(killed_mid_action()) == {f"running on conductor {c.id}"}
    # step show says the same as step list
    first = queries.list_steps(store, sid)[0]
    assert queries.get_step(store, first["step"])["details"] == first["details"]
    with store.write() as conn:  # its conductor is known gone before its lease runs out
        conn.execute(update(conductors).values(stopped_at=1.0))
    (gone_early,) = details()
    assert gone_early.startswith(f"its conductor {c.id} is gone (its process ended); "), gone_early
    with store.write() as conn:
        conn.execute(update(conductors).values(stopped_at=None))
    with store.write() as conn:  # its lease (its strategy's) ran out meanwhile
        conn.execute(update(strategies).values(lease_expires_at=host_lease_now() - 600))
    (gone,) = details()
    assert gone.startswith(f"its conductor {c.id} is gone (its lease ran out at 20"), gone
    assert gone.endswith(
        "the step is taken over when a conductor drives the strategy again (serve, or "
        "strategy apply --wait), and its state's recover setting decides what became of the "
        "action (look at the target, or fail the step: 'fleetwave workflow show' says which)"
    ), gone
    with store.write() as conn:  # handed back (a clean stop) while the action ran
        conn.execute(update(steps).values(owner=None))
    assert details() == {
        "interrupted (its conductor stopped); the step is taken over when a conductor "
        "drives the strategy again (serve, or strategy apply --wait), and its state's "
        "recover setting decides what became of the action (look at the target, or fail "
        "the step: 'fleetwave workflow show' says which)"
    }
    with store.write() as conn:  # entered while its conductor was stopping
        conn.execute(update(steps).values(not_started=True))
    assert details() == {
        "entered, its action not started: it starts when a conductor drives the "
        "strategy again (serve, or strategy apply --wait)"
    }
    with store.write() as conn:  # entered while its live conductor is stopping
        conn.execute(update(steps).values(owner=c.id))
        conn.execute(update(strategies).values(lease_expires_at=host_lease_now() + 600))
    assert details() == {
        f"entered while conductor {c.id} was stopping; its action starts when a "
        "conductor drives the strategy again (serve, or strategy apply --wait)"
    }
    with store.write() as conn:
        conn.execute(update(steps).values(owner=None))
    with store.write() as conn:  # ... with the details of the move into it
        conn.execute(update(steps).values(details="pre-check: done at attempt 2"))
    assert details() == {
        "entered, its action not started: it starts when a conductor drives the "
        "strategy again (serve, or strategy apply --wait) (pre-check: done at attempt 2)"
    }
