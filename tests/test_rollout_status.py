"""Who drives a rollout and how far it is: ``strategy list`` and ``show``, progress lines,
``serve``'s report of strategies taken on, lost and claimed back."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import time
from datetime import datetime
from pathlib import Path

import pytest
from rich.progress import Progress
from sqlalchemy.exc import OperationalError

from cli_harness import Cli, as_terminal, assert_rejected
from conftest import add_sim_targets, applied
from fleetwave.cli.drive import _watch
from fleetwave.cli.output import when
from fleetwave.domain.models import StrategyOptions
from fleetwave.store import admin, queries
from fleetwave.store.db import Store
from test_cli_strategy import add, apply_wait, create, history
from test_plugins import _wf


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


def test_the_progress_line_counts_aborted_steps(store: Store) -> None:
    add_sim_targets(store, 3)
    sid = admin.create_strategy(store, _wf("patch"), StrategyOptions(), all_targets=True)
    admin.request_abort(store, sid)  # initial: every step aborted at once
    progress = Progress()
    done = asyncio.Event()
    done.set()
    asyncio.run(_watch(store, sid, 3, progress, done))
    (task,) = progress.tasks
    assert task.description == f"strategy {sid} (0 failed, 3 aborted)"
    assert task.completed == 3


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


def test_a_failed_progress_read_does_not_fail_the_drive(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: one database error in a progress read killed the watch, and the drive
    then exited 1 (`error: database: database is locked`) after the rollout had
    completed; under cron a good rollout read as failed. The watch skips that turn."""

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
