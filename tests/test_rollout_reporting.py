"""What an operator reads while a rollout runs badly: filters given twice, who drives a
rollout, what a list hides, failed attempts kept as events, the service log's failed
steps, progress lines, and signals on admin commands. From an on-call acceptance pass."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_harness import Cli, assert_rejected
from conftest import add_sim_targets, applied, on_virtual_time
from fleetwave.cli.output import WHEN_WIDTH, when
from fleetwave.engine.clock import WallClock
from fleetwave.engine.conductor import Conductor
from fleetwave.store import queries
from fleetwave.store.db import Store
from fleetwave.store.leases import host_lease_now
from test_cli_strategy import add, apply_wait, create, history, steps


@pytest.fixture
def ended(cli: Cli) -> int:
    """A patch rollout over five targets, two of them failing in 'finishing': ended."""
    add(cli, "ok1", "ok2", "ok3")
    add(cli, "bad1", "bad2", fail_at="finishing")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 1  # it ends failed
    return sid


def test_a_filter_given_twice_shows_steps_in_either(cli: Cli, ended: int) -> None:
    """`--state failed --state aborted` showed only the aborted ones (the last given
    won, silently: an empty table read as "nothing failed"); so did `--target`."""
    both = steps(cli, ended, "--state", "failed", "--state", "complete")
    assert sorted(both) == ["bad1", "bad2", "ok1", "ok2", "ok3"]
    assert sorted(steps(cli, ended, "--state", "failed,complete", "--target", "bad1,ok2")) == [
        "bad1",
        "ok2",
    ]
    assert sorted(steps(cli, ended, "--target", "ok1", "--target", "bad2")) == ["bad2", "ok1"]
    assert sorted(steps(cli, ended, "--state", "failed")) == ["bad1", "bad2"]
    rows = history(cli, ended, "--target", "ok1", "--target", "bad1")
    assert {r["target"] for r in rows} == {"ok1", "bad1"}
    assert len(rows) == 12  # initial -> 5 states -> an end, for each


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--state", "failed,"), ["--state: an empty value in 'failed,'"]),
        (("--state", "failed", "--state", "nope"), ["--state: 'nope' is not a state"]),
        (("--target", "ok1,ghost"), ["--target: no target named 'ghost'"]),
    ],
)
def test_a_bad_value_among_several_is_refused(
    cli: Cli, ended: int, args: tuple[str, ...], words: list[str]
) -> None:
    assert_rejected(cli("step", "list", "--strategy", str(ended), *args), *words)


def test_a_step_whose_conductor_is_gone_says_so_before_what_its_row_said(
    cli: Cli, db_path: Path
) -> None:
    """After a kill -9, most in-flight steps said "its conductor ... is gone", but one
    whose row had details (its last state's "done at attempt 2", or a retry's time now
    past) showed only those, as if it were running."""
    add(cli, "a", "b")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    said = "pre-check: timed out after 40s (attempt 1 of 3); attempt 2 from 2026-12-01 13:20:42Z"
    with sqlite3.connect(db_path) as db:
        db.execute(
            "UPDATE steps SET state='pre-check', owner='c-dead', "
            "attempt=2, not_started=0, details=? WHERE strategy_id=?",
            (said, sid),
        )
        db.execute(
            "INSERT INTO conductors (id, hostname, pid, started_at, heartbeat_at, "
            "lease_clock) VALUES ('c-dead', 'elsewhere', 1, 0, 0, ?)",
            (WallClock.lease_clock,),
        )
        db.execute(
            "UPDATE strategies SET owner='c-dead', lease_expires_at=? WHERE id=?",
            (host_lease_now() - 30, sid),
        )
    for row in steps(cli, sid).values():
        assert row["details"].startswith("its conductor c-dead is gone (its lease ran out at ")
        assert row["details"].endswith(f"'fleetwave workflow show' says which) ({said})")


FLAKY_YAML = """\
name: flaky-once
states:
  - name: install
    timeout_s: 30
    retry: {attempts: 3, backoff_s: 0.01, backoff_max_s: 0.02}
"""


def test_failed_attempts_are_kept_as_events_and_listed(cli: Cli, tmp_path: Path) -> None:
    """A timeout or a transient failure that a retry got past left nothing once the
    step went on (the row's details are overwritten): each failed attempt is an
    `attempt-failed` event, listed by `fleetwave events` with claims and takeovers."""
    wf = tmp_path / "flaky.yaml"
    wf.write_text(FLAKY_YAML, encoding="utf-8")
    assert cli("workflow", "add", str(wf)).code == 0
    add(cli, "steady")
    add(cli, "shaky", flaky_rate="1.0")  # every attempt fails for now: 3 of 3
    res = cli("strategy", "create", "--workflow", "flaky-once", "--all", "--format", "json")
    sid = int(res.json()["id"])
    assert apply_wait(cli, sid).code == 1
    res = cli("events", "--strategy", str(sid), "--format", "json")
    assert res.code == 0, res.text
    rows = res.json()
    assert [r["kind"] for r in rows] == ["strategy-claimed", "attempt-failed", "attempt-failed"]
    failed = rows[1:]
    assert {(r["target"], r["strategy"]) for r in failed} == {("shaky", sid)}
    assert [r["details"].split("; ")[0] for r in failed] == [
        "install: target busy (simulated) (attempt 1 of 3)",
        "install: target busy (simulated) (attempt 2 of 3)",
    ]
    assert all("; attempt " in r["details"] and " from " in r["details"] for r in failed)
    only = cli("events", "--strategy", str(sid), "--kind", "attempt-failed", "--last", "1")
    assert only.code == 0 and "attempt 2 of 3" in only.out and "claimed" not in only.out
    steady = cli("events", "--strategy", str(sid), "--target", "steady", "--format", "json")
    assert steady.json() == []
    assert_rejected(
        cli("events", "--strategy", str(sid), "--kind", "attempt-failed,nope"),
        "--kind: 'nope' is not a kind of event",
    )
    assert_rejected(cli("events", "--strategy", "99"), "strategy 99 not found")
    # the journal's rows name their strategy, as a step's row does
    assert {r["strategy"] for r in history(cli, sid)} == {sid}


def test_strategy_list_shows_what_did_not_complete_and_filters_by_state(
    cli: Cli, ended: int
) -> None:
    """`strategy list` said `500/500` for a rollout with 18 failed and 169 aborted steps
    (it read as all done), its JSON had no counts by state, and it had no `--state`."""
    add(cli, "spare")
    waiting = create(cli, "--targets", "spare")
    table = cli("strategy", "list")
    assert table.code == 0
    (row,) = [line for line in table.out.splitlines() if line.startswith(f"{ended} ")]
    assert "5/5 (2 failed)" in row, row
    rows = cli("strategy", "list", "--format", "json").json()
    assert [(r["id"], r["step_states"]) for r in rows] == [
        (ended, {"complete": 3, "failed": 2}),
        (waiting, {"initial": 1}),
    ]
    assert [r["done"] for r in rows] == [5, 0]
    assert [
        r["id"] for r in cli("strategy", "list", "--state", "failed", "--format", "json").json()
    ] == [ended]
    both = cli("strategy", "list", "--state", "initial,failed", "--format", "json").json()
    assert [r["id"] for r in both] == [ended, waiting]
    assert cli("strategy", "list", "--state", "applying", "--format", "json").json() == []
    assert_rejected(
        cli("strategy", "list", "--state", "runing"), "--state: 'runing' is not a strategy state"
    )


def test_the_service_log_names_each_failed_step_and_how_the_strategy_ended(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """At the default level a serve's log held nothing of a rollout's 18 failures, and
    its end read "strategy 1: failed 21 steps failed"."""
    add_sim_targets(store, 2)
    add_sim_targets(store, 1, settings={"fail_at": "finishing"}, prefix="bad")
    add_sim_targets(store, 1, prefix="off", managed=False)
    sid = applied(store)
    caplog.set_level(logging.WARNING, logger="fleetwave.engine")
    assert asyncio.run(asyncio.wait_for(Conductor(store).run(strategy_ids=[sid]), 30)) == {
        sid: "failed"
    }
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    bad, off = (queries.list_steps(store, sid, state="failed")[i]["step"] for i in (0, 1))
    why = "finishing: failed on target (fail_at=finishing)"
    assert f"strategy {sid}: step {bad} (target bad00000) failed: {why}" in said
    assert (
        f"strategy {sid}: step {off} (target off00000) failed: Target off00000 is unmanaged."
        in said
    )
    assert said[-1] == f"strategy {sid}: ended failed: 2 steps failed", said


def test_show_says_how_many_steps_are_in_flight_and_until_when(cli: Cli, db_path: Path) -> None:
    """An abort lets the steps in flight finish their state: an operator waiting on one
    (7 targets hung, up to their states' timeouts) could not tell when it would end."""
    add(cli, "a", "b", "c")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert (shown["in_flight"], shown["in_flight_until"]) == (0, None)
    soon, later = time.time() + 600, time.time() + 1800
    with sqlite3.connect(db_path) as db:
        for name, state, deadline in (("a", "pre-check", soon), ("b", "finishing", later)):
            db.execute(
                "UPDATE steps SET state=?, deadline_at=? WHERE target_id="
                "(SELECT id FROM targets WHERE name=?)",
                (state, deadline, name),
            )
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    assert (shown["in_flight"], shown["in_flight_until"]) == (2, later)
    plain = cli("strategy", "show", str(sid)).out
    (line,) = [x for x in plain.splitlines() if x.startswith("in_flight_until")]
    assert line.endswith(when(later)), line  # a time, as every time shown is


def test_show_counts_steps_whose_action_has_not_started_apart(cli: Cli, db_path: Path) -> None:
    """After a clean stop (Ctrl-C of apply --wait) `strategy show` said `in_flight 6` and
    a deadline 15 minutes ahead for steps entered but never started: at 3 a.m. that
    reads as six actions running somewhere. A retry waiting out its backoff runs
    nothing either. Neither is in flight, nor has a say in `in_flight_until`."""
    add(cli, "a", "b", "c", "d")
    sid = create(cli, "--all")
    assert cli("strategy", "apply", str(sid)).code == 0
    now = time.time()
    rows = (
        ("a", "pre-check", now + 600, 0, 1),  # running
        ("b", "finishing", now + 1800, 1, 1),  # entered while stopping
        ("c", "apply", now + 3600, 1, 2),  # a retry, waiting
        ("d", "apply", now + 900, 0, 3),  # a retry that started: running
    )
    with sqlite3.connect(db_path) as db:
        for name, state, deadline, not_started, attempt in rows:
            db.execute(
                "UPDATE steps SET state=?, deadline_at=?, not_started=?, attempt=? WHERE "
                "target_id=(SELECT id FROM targets WHERE name=?)",
                (state, deadline, not_started, attempt, name),
            )
    shown = cli("strategy", "show", str(sid), "--format", "json").json()
    got = {k: shown[k] for k in ("in_flight", "not_started", "waiting_to_retry")}
    assert got == {"in_flight": 2, "not_started": 1, "waiting_to_retry": 1}
    assert shown["in_flight_until"] == now + 900
    # the list too: a rollout retrying under backoff showed "0/4" and empty details
    (listed,) = cli("strategy", "list", "--format", "json").json()
    assert listed["waiting_to_retry"] == 1
    table = cli("strategy", "list").out
    assert "0/4 (1 waiting to retry)" in table, table


def test_a_drawn_table_never_splits_a_time_over_two_lines() -> None:
    """In a terminal, `step list` printed every time as `2026-12-01` over
    `13:19:13.403Z` (1,004 lines for 500 rows): a time is one word to the table."""
    from fleetwave.cli.output import _column_widths

    row = {
        "target": "sc-001",
        "details": "finishing: failed on target (fail_at=finishing) " * 3,
        "started_at": time.time(),
    }
    widths = _column_widths([row], ["target", "details", "started_at"], False, 80)
    assert widths is not None and widths[2] is not None
    assert widths[2] >= len(when(row["started_at"])) == 24, widths


def test_a_retry_of_the_failed_targets_is_one_command(
    cli: Cli, ended: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retrying only the targets that failed took jq or awk between `step list` and
    `strategy create --targets` (`--targets @failed.txt` and `-` were target names)."""
    retry = create(cli, "--failed-in", str(ended))
    assert sorted(steps(cli, retry)) == ["bad1", "bad2"]
    assert cli("strategy", "delete", str(retry)).code == 0
    listed = tmp_path / "failed.txt"
    listed.write_text("# the failed ones\nbad1\n\nbad2, ok1  # and one more\n", encoding="utf-8")
    from_file = create(cli, "--targets", f"@{listed}")
    assert sorted(steps(cli, from_file)) == ["bad1", "bad2", "ok1"]
    assert cli("strategy", "delete", str(from_file)).code == 0
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok2\nok3\n")))
    from_stdin = create(cli, "--targets", "-")
    assert sorted(steps(cli, from_stdin)) == ["ok2", "ok3"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--failed-in", "{sid}", "--all"), ["--failed-in: picks the targets itself"]),
        (("--failed-in", "99"), ["strategy 99 not found"]),
        (("--targets", "@{tmp}/none.txt"), ["--targets: @", "none.txt: no such file"]),
        (("--targets", "@{tmp}/empty.txt"), ["--targets: @", "empty.txt names no target"]),
        (("--targets", "@{tmp}/typo.txt"), ["--targets: no target named 'bad3'"]),
        (("--targets", "@{tmp}"), ["--targets: @", ": a directory"]),
        (("--targets", "@{tmp}/latin1.txt"), ["latin1.txt: not UTF-8 text (byte 0xe9 at line 2"]),
        (("--targets", "ok1,,ok2"), ["--targets: an empty name in 'ok1,,ok2'"]),
        (("--targets", "ok1,"), ["--targets: an empty name in 'ok1,'"]),
    ],
)
def test_a_bad_target_source_is_refused(
    cli: Cli, ended: int, tmp_path: Path, args: tuple[str, ...], words: list[str]
) -> None:
    (tmp_path / "empty.txt").write_text("# nobody\n\n", encoding="utf-8")
    (tmp_path / "typo.txt").write_text("bad1\nbad3\n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("ok1\ncaf\u00e9\n".encode("latin-1"))
    given = [a.format(sid=ended, tmp=tmp_path) for a in args]
    res = cli("strategy", "create", "--workflow", "patch", *given)
    assert_rejected(res, *words)
    assert len(cli("strategy", "list", "--format", "json").json()) == 1  # nothing written


def test_names_from_stdin_or_a_file_are_text_as_a_file_is(
    cli: Cli, ended: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte that is not UTF-8 on stdin printed a traceback; a file saved with a
    byte-order mark (Windows) named its first target with an invisible character."""
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok1\nbad1\xff\n")))
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--targets", "-"),
        "--targets: stdin: not UTF-8 text (byte 0xff at line 2, column 5)",
    )
    marked = tmp_path / "bom.txt"
    marked.write_bytes(b"\xef\xbb\xbfok1\r\nok2\r\n")
    sid = create(cli, "--targets", f"@{marked}")
    assert sorted(steps(cli, sid)) == ["ok1", "ok2"]


def test_failed_in_a_strategy_that_completed_says_there_is_nothing_to_retry(cli: Cli) -> None:
    add(cli, "fine")
    sid = create(cli, "--all")
    assert apply_wait(cli, sid).code == 0
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--failed-in", str(sid)),
        f"--failed-in: strategy {sid} has no failed or aborted step",
    )


def test_show_says_when_the_rollout_last_moved(cli: Cli, ended: int) -> None:
    """`updated_at` is the strategy's own state change: during a rollout it stayed at
    its start and read as "stalled since then"; the last transition's time is shown."""
    shown = cli("strategy", "show", str(ended), "--format", "json").json()
    assert shown["last_transition_at"] == max(r["at"] for r in history(cli, ended))
    assert shown["last_transition_at"] > shown["created_at"]
    add(cli, "later")
    fresh = create(cli, "--targets", "later")
    assert (
        cli("strategy", "show", str(fresh), "--format", "json").json()["last_transition_at"] is None
    )


# A stand-in for a slow import of the command line: the signal arrives while it runs.
_SIGNAL_WHILE_IMPORTING = """
import importlib.abc, os, signal, sys, time

SIG = getattr(signal, sys.argv[1])

class SignalOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fleetwave.cli.main":
            os.kill(os.getpid(), SIG)
            time.sleep(0.5)  # the handler runs here
        return None

if sys.argv[2] == "ignored":
    signal.signal(SIG, signal.SIG_IGN)
sys.meta_path.insert(0, SignalOnImport())
sys.argv = ["fleetwave", "workflow", "list", "--format", "json"]
from fleetwave.cli.entry import run
run()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_while_the_command_starts_ends_it_in_one_line(sig: str) -> None:
    """Found by a bug hunt: a Ctrl-C in the first 0.7 s (the imports) printed a
    traceback, and a SIGTERM ended the command without a word (exit 143)."""
    res = subprocess.run(
        [sys.executable, "-c", _SIGNAL_WHILE_IMPORTING, sig, "handled"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 130, res
    assert res.stderr == "error: interrupted while starting; nothing was done\n"
    assert res.stdout == ""


def test_a_signal_ignored_by_who_started_it_stays_ignored_while_it_starts() -> None:
    """A background job started by a script has SIGINT ignored: it is not turned into
    a stop while the command line is imported."""
    res = subprocess.run(
        [sys.executable, "-c", _SIGNAL_WHILE_IMPORTING, "SIGINT", "ignored"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res
    assert "patch" in {w["name"] for w in json.loads(res.stdout)}


def test_every_kind_of_event_written_can_be_asked_for() -> None:
    """`events --kind transition-rejected` was refused although the engine writes such
    events: the kinds `--kind` takes are every hyphenated word the store and the
    engine write as an event's kind (the words below are not kinds)."""
    import re

    src = Path(queries.__file__).parents[1]
    words: set[str] = set()
    for path in (src / "store/runtime.py", *sorted((src / "engine").glob("*.py"))):
        text = path.read_text(encoding="utf-8")
        words |= set(re.findall(r"[\"']([a-z]+(?:-[a-z]+)+)[\"']", text))
    not_kinds = {
        "wait-for-callback",  # a state's mode
        "before-commit",  # crash points of the tests
        "after-commit",
        "not-drivable-here",  # what run() says of a strategy
        "fleetwave-periodic",  # a task's name
    }
    assert words - not_kinds == set(queries.EVENT_KINDS)


def test_failed_in_a_strategy_being_deleted_is_refused(cli: Cli, ended: int, db_path: Path) -> None:
    """An interrupted delete leaves some of its steps: a retry taken from what is left
    would leave failed targets out without a word (found by a review)."""
    with sqlite3.connect(db_path) as db:
        db.execute("UPDATE strategies SET state = 'deleting' WHERE id = ?", (ended,))
    assert_rejected(
        cli("strategy", "create", "--workflow", "patch", "--failed-in", str(ended)),
        f"--failed-in: strategy {ended} is being deleted",
        f"'fleetwave strategy delete {ended}' finishes it",
    )


def test_sigterm_stops_an_admin_command_as_ctrl_c_does(tmp_path: Path) -> None:
    """The README's exit codes say 130 for Ctrl-C, SIGTERM or SIGHUP; a SIGTERM ended
    an admin command with 143 (found by a review). Nothing of it is written."""
    db = tmp_path / "big.db"
    fleetwave = Path(sys.executable).with_name("fleetwave")  # the console script
    assert subprocess.run([fleetwave, "init", "--db", db], capture_output=True).returncode == 0
    rows = tmp_path / "big.csv"
    rows.write_text("name,latency_ms\n" + "".join(f"n{i},5\n" for i in range(200_000)))
    importing = subprocess.Popen(
        [fleetwave, "target", "import", rows, "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)  # starting, or reading the file: stopped either way
    importing.send_signal(signal.SIGTERM)
    _out, err = importing.communicate(timeout=60)
    assert importing.returncode == 130, err
    assert err.startswith("error: interrupted"), err  # starting, or importing: one line
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM targets").fetchone() == (0,)


def test_an_interrupt_before_any_command_ran_is_one_line(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a Ctrl-C or SIGTERM in the moment Typer builds the command
    tree (after the imports, before a command runs) printed a traceback and died of
    the signal (-2), instead of the README's one line and 130."""
    import typer.main

    def interrupted(_app: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(typer.main, "get_command", interrupted)
    result = cli("target", "list")
    assert result.code == 130
    assert result.err == "error: interrupted\n"
    assert result.out == ""


def test_a_fleet_wide_failure_is_logged_in_a_few_lines(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a review: a warning per failed step, written on the dispatcher's loop,
    doubled the time of a rollout of 20,000 failing steps. A strategy's first 20 are
    logged one by one, the rest one line per batch with the count so far."""
    from fleetwave.engine.outcome_log import FAILURES_LOGGED_ALONE

    add_sim_targets(store, 300, settings={"fail_at": "pre-check"})
    sid = applied(store, max_parallel=100)
    caplog.set_level(logging.WARNING, logger="fleetwave.engine")
    assert asyncio.run(asyncio.wait_for(Conductor(store).run(strategy_ids=[sid]), 60)) == {
        sid: "failed"
    }
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    alone = [line for line in said if " (target t" in line]
    assert len(alone) == FAILURES_LOGGED_ALONE == 20
    summaries = [line for line in said if " in all): 'fleetwave step list" in line]
    assert 1 <= len(summaries) <= 10, said
    assert summaries[-1].endswith(
        f"(300 in all): 'fleetwave step list --strategy {sid} --state failed' says why"
    ), summaries[-1]
    assert said[-1] == f"strategy {sid}: ended failed: 300 steps failed"


def test_failures_that_come_one_at_a_time_are_summed_every_ten_seconds(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a scale pass: at one failure per commit, "one line per commit" was one
    line per failed step. Past the first 20, a line at most every 10 s, and one as the
    strategy ends, count every failure once."""
    from fleetwave.engine.clock import LoopClock

    add_sim_targets(store, 60, settings={"fail_at": "pre-check", "latency_ms": 1000})
    sid = applied(store, max_parallel=1)
    caplog.set_level(logging.WARNING, logger="fleetwave.engine")

    async def main() -> dict[int, str]:
        return await Conductor(store, clock=LoopClock()).run(strategy_ids=[sid])

    assert on_virtual_time(main()) == {sid: "failed"}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([line for line in said if " (target t" in line]) == 20
    summaries = [line for line in said if " in all): " in line]
    assert 3 <= len(summaries) <= 6, summaries  # 40 failures over about 40 s
    counts = [int(line.split(": ", 1)[1].split(" more step")[0]) for line in summaries]
    assert sum(counts) == 40 and "(60 in all)" in summaries[-1], summaries


@settings(max_examples=2000, deadline=None)
@given(
    st.one_of(
        st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False),
        # near a millisecond's and a second's edge, where rounding decides
        st.integers(1_700_000_000, 1_800_000_000).map(lambda s: s + 0.9999995),
        st.integers(1_700_000_000_000, 1_800_000_000_000).map(lambda ms: ms / 1000 + 5e-7),
    )
)
def test_a_time_is_shown_as_datetime_shows_it(ts: float) -> None:
    """Times are formatted from a per-second cache (a history of 600,000 rows spent a
    third of its time on them): to the character what the datetime module gives."""
    expected = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    assert when(ts) == expected
    assert len(expected) == WHEN_WIDTH


def test_ctrl_c_of_an_admin_command_says_so_in_one_line(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Typer turned a KeyboardInterrupt into exit 130 without a word (the README's exit
    codes say 130; an operator saw the shell prompt come back and nothing else)."""

    def interrupted(*_args: object, **_kwargs: object) -> int:
        raise KeyboardInterrupt

    add(cli, "t1")
    sid = create(cli, "--all")
    with monkeypatch.context() as m:
        m.setattr("fleetwave.store.admin.ensure_targets", interrupted)
        res = cli("target", "add", "n1")
    assert (res.code, res.err) == (130, "error: interrupted\n")
    # a command that says itself what an interrupt left says it once
    monkeypatch.setattr("fleetwave.cli.strategies.drive_strategy", interrupted)
    res = cli("strategy", "apply", str(sid), "--wait")
    assert res.code == 130
    assert "error: interrupted" not in res.err and res.err.count("\n") == 1, res.err


def test_apply_wait_to_a_log_writes_progress_lines(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under cron, systemd or CI (stderr not a terminal) `apply --wait` wrote nothing
    while it ran: Rich's live bar draws only on a terminal, so a healthy rollout read
    as a hung one. To a log it writes a line when the counts change (at most every
    PROGRESS_LINE_EVERY_S), the first at once and the last with the final state."""
    monkeypatch.setattr("fleetwave.cli.drive.PROGRESS_LINE_EVERY_S", 0.05)
    add(cli, *(f"t{i}" for i in range(8)), latency_ms=150)
    sid = create(cli, "--all", "--max-parallel", "2")
    res = cli("strategy", "apply", str(sid), "--wait")
    assert res.code == 0, res.err
    lines = [x for x in res.err.splitlines() if f" strategy {sid}: " in x]
    assert len(lines) >= 4, res.err  # 8 targets, 2 at a time, 5 states of 150 ms
    ended = [int(x.split(f"strategy {sid}: ")[1].split(" of ")[0]) for x in lines]
    assert ended == sorted(ended) and ended[0] < 8 and ended[-1] == 8, lines
    assert lines[0].endswith("; applying"), lines[0]
    assert lines[-1].endswith("8 of 8 steps ended (8 complete), 0 under way, 0 waiting; complete")
    said = [x.split(" ", 2)[2] for x in lines]
    assert all(a != b for a, b in itertools.pairwise(said)), lines  # each says something new
    # each starts with a UTC time, as log lines and tables give it
    datetime.strptime(lines[0][:24], "%Y-%m-%d %H:%M:%S.%fZ")


def test_a_callback_for_a_state_the_step_has_not_reached_says_it_is_kept(
    cli: Cli, tmp_path: Path
) -> None:
    """An operator walkthrough: a `done` callback for clean-steps sent while the step
    was still in wait-for-agent was answered "stored; the conductor answers it", then
    moved the step through clean-steps at once. Such a report is kept for the state
    (an agent's report can overtake the step's move); the answer now says so."""
    wf = tmp_path / "agent.yaml"
    wf.write_text(
        "name: agent-wf\nstates:\n  - name: prep\n  - name: wait-agent\n"
        "    mode: wait-for-callback\n    timeout_s: 60\n  - name: last\n",
        encoding="utf-8",
    )
    assert cli("workflow", "add", str(wf)).code == 0
    add(cli, "a")
    res = cli("strategy", "create", "--workflow", "agent-wf", "--all", "--format", "json")
    sid = int(res.json()["id"])
    (step,) = cli("step", "list", "--strategy", str(sid), "--format", "json").json()
    # a step not under way yet keeps nothing (its conductor ignores such a report): not
    # said to be kept
    early = cli("step", "callback", str(step["step"]), "wait-agent")
    assert early.code == 0 and "kept" not in early.out and "stored;" in early.out, early.out
    with sqlite3.connect(tmp_path / "fleet.db") as db:
        db.execute("UPDATE steps SET state='prep', fence=1 WHERE id=?", (step["step"],))
    kept = cli("step", "callback", str(step["step"]), "wait-agent")
    assert kept.code == 0, kept.err
    assert kept.out.strip() == (
        f"callback 2 for step {step['step']} (wait-agent, done) stored and kept: the step is "
        "in prep, before wait-agent; it counts once the step reaches wait-agent, and is "
        "ignored if the step ends first"
    )
    # a state that waits for no callback: the conductor ignores it, no "kept"
    plain = cli("step", "callback", str(step["step"]), "last")
    assert plain.code == 0 and "kept" not in plain.out and "stored;" in plain.out, plain.out


def test_a_failed_progress_read_does_not_fail_the_drive(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: one database error in a progress read killed the watch, and the drive
    then exited 1 (`error: database: database is locked`) after the rollout had
    completed; under cron a good rollout read as failed. The watch skips that turn."""
    from sqlalchemy.exc import OperationalError

    monkeypatch.setattr("fleetwave.cli.drive.PROGRESS_LINE_EVERY_S", 0.05)
    real, calls = queries.step_counts, [0]

    def flaky(store: Store, sid: int) -> dict[str, int]:
        calls[0] += 1
        if calls[0] == 2:
            raise OperationalError("SELECT", {}, Exception("database is locked"))
        return real(store, sid)

    monkeypatch.setattr("fleetwave.cli.drive.queries.step_counts", flaky)
    add(cli, "a", "b", "c", "d", latency_ms=100)
    sid = create(cli, "--all", "--max-parallel", "2")
    res = cli("strategy", "apply", str(sid), "--wait")
    assert calls[0] > 2, calls  # it went on reading after the failed one
    assert res.code == 0, res.err
    lines = [x for x in res.err.splitlines() if f" strategy {sid}: " in x]
    assert lines[-1].endswith("4 of 4 steps ended (4 complete), 0 under way, 0 waiting; complete")


def test_serves_report_tells_a_lease_lost_and_a_claim_back_from_the_strategys_row(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    """A review: a strategy serve lost when its lease lapsed (the engine drops it and
    keeps no word of it) was said to be "handed back" at the next stop, its claim back
    was silent, and a second loss was never said. The report tells why a strategy left
    from the strategy's row: ended, owned by another conductor, or handed back."""
    import sqlite3 as sq

    from fleetwave.cli.drive import ServeReport

    add_sim_targets(store, 3)
    sid = applied(store)

    class Held:
        id = "c-me"
        runs: dict[int, object] = {}
        finished: dict[int, str] = {}

    def owner(who: str | None, state: str = "applying") -> None:
        db = sq.connect(store.url.removeprefix("sqlite:///"))
        with db:
            db.execute("UPDATE strategies SET owner=?, state=? WHERE id=?", (who, state, sid))
        db.close()

    report = ServeReport(store, Held())  # type: ignore[arg-type]
    said: list[str] = []

    def tick(*, stopped: bool = False) -> None:
        report.tick(stopped=stopped)
        said.extend(
            x.split(f"strategy {sid}: ", 1)[1] for x in capsys.readouterr().err.splitlines()
        )

    Held.runs = {sid: object()}
    owner("c-me")
    tick()  # taken on
    Held.runs = {}
    owner("c-other")
    tick()  # lost: its lease lapsed, another took it
    Held.runs = {sid: object()}
    owner("c-me")
    tick()  # claimed back
    Held.runs = {}
    owner("c-other")
    tick()  # lost again
    tick(stopped=True)  # nothing held: nothing "handed back"
    Held.runs = {sid: object()}
    owner("c-me")
    tick()
    owner(None)
    tick(stopped=True)  # a clean stop: handed back
    Held.runs = {sid: object()}
    tick()
    Held.runs = {}
    owner(None, "complete")
    tick()
    # taken on and ended between two ticks (a small strategy, within a second): said
    # once, as it ended (the conductor's ends say it was there)
    Held.finished[sid] = "complete"
    tick()
    tick()
    start = "0 of 3 steps ended, 0 under way, 3 waiting; "
    assert said == [
        f"{start}applying (taken on)",
        f"{start}applying (lost: conductor c-other drives it now)",
        f"{start}applying (taken on)",
        f"{start}applying (lost: conductor c-other drives it now)",
        f"{start}applying (taken on)",
        f"{start}applying (handed back: the next conductor goes on with it)",
        f"{start}applying (taken on)",
        f"{start}complete (ended)",
        f"{start}complete (ended)",
    ], said
