"""The schema: migrations build exactly what the code declares, and upgrade old databases."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext

from fleetwave.domain.errors import NotFound
from fleetwave.domain.models import StrategyOptions, Target
from fleetwave.domain.registry import get_workflow
from fleetwave.store import admin
from fleetwave.store import runtime as rt
from fleetwave.store.callbacks import accept_callback
from fleetwave.store.db import (
    HEAD_REVISION,
    MIGRATIONS_DIR,
    Store,
    current_revision,
    open_store,
)
from fleetwave.store.postgres import engine_url, is_postgres_url
from fleetwave.store.schema import metadata

#: each test that takes a database (``db_url``) runs on SQLite and on PostgreSQL
pytestmark = pytest.mark.both_dialects


def _indexes(engine: sa.Engine, table: str) -> set[str]:
    return {ix["name"] for ix in sa.inspect(engine).get_indexes(table) if ix["name"]}


def test_migrated_schema_matches_the_declared_one(db_url: str) -> None:
    store = open_store(db_url)
    with store.engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diffs == []
    assert current_revision(store) == HEAD_REVISION


def _database_at(db_url: str, revision: str) -> sa.Engine:
    """A database as a fleetwave of that schema revision left it."""
    if is_postgres_url(db_url):
        engine = sa.create_engine(engine_url(db_url))
    else:
        engine = sa.create_engine(f"sqlite:///{db_url}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    return engine


def test_upgrade_from_the_first_revision_keeps_the_data(db_url: str) -> None:
    engine = _database_at(db_url, "0001")
    assert "ix_steps_strategy_state" in _indexes(engine, "steps")
    with engine.begin() as conn:  # rows as fleetwave 0001 wrote them
        conn.exec_driver_sql(
            "INSERT INTO targets (id, name, driver, settings, managed, labels, created_at) "
            "VALUES (1, 't0', 'sim', '{}', true, '{}', 0)"
        )
        conn.exec_driver_sql(
            "INSERT INTO strategies (id, workflow, workflow_version, states, state, options, "
            "group_caps, step_count, details, created_at, updated_at, fence) "
            "VALUES (1, 'patch', 1, '[]', 'initial', '{}', '{}', 1, '', 0, 0, 0)"
        )
        conn.exec_driver_sql(
            "INSERT INTO steps (strategy_id, target_id, ordinal, stage, state, details, "
            "attempt, fence) VALUES (1, 1, 0, 1, 'initial', '', 0, 0)"
        )
    engine.dispose()
    sid = 1

    upgraded = open_store(db_url)  # migrates to head
    assert current_revision(upgraded) == HEAD_REVISION
    names = _indexes(upgraded.engine, "steps")
    assert "ix_steps_strategy_ordinal" in names
    assert "ix_steps_strategy_state" not in names
    with upgraded.read() as conn:
        count = conn.execute(
            sa.text("SELECT count(*) FROM steps WHERE strategy_id = :s"), {"s": sid}
        )
        assert count.scalar_one() == 1
        row = conn.exec_driver_sql("SELECT not_started FROM steps").one()
        assert row[0] == 0  # the new column, filled for existing rows


def _patch_strategy(store: Store, target: str) -> int:
    wf = get_workflow("patch")
    assert wf is not None
    return admin.create_strategy(store, wf, StrategyOptions(), target_names=[target])


def test_a_deleted_strategys_id_is_never_given_again(db_url: str) -> None:
    store = open_store(db_url)
    admin.add_targets(store, [Target(name=f"t{i}") for i in range(5)])
    first = _patch_strategy(store, "t0")
    second = _patch_strategy(store, "t1")
    assert second == first + 1
    admin.delete_strategy(store, second)  # the newest: SQLite alone would give its id again
    third = _patch_strategy(store, "t2")
    assert third == second + 1
    admin.delete_strategy(store, third)
    admin.delete_strategy(store, first)  # no strategy left at all
    assert _patch_strategy(store, "t3") == third + 1
    store.dispose()
    reopened = open_store(db_url)  # the counter is in the database
    assert _patch_strategy(reopened, "t4") == third + 2


def _step_ids(store: Store, sid: int) -> list[int]:
    with store.read() as conn:
        rows = conn.execute(sa.text("SELECT id FROM steps WHERE strategy_id = :s"), {"s": sid})
        return sorted(int(r[0]) for r in rows)


def test_a_deleted_strategys_step_ids_are_never_given_again(db_url: str) -> None:
    """SQLite alone gave the next strategy's steps the ids of the deleted newest
    strategy's steps: a late callback for one of those moved the new step that got its
    id. Now no step has that id any more, and the callback is refused."""
    store = open_store(db_url)
    admin.add_targets(store, [Target(name=f"t{i}") for i in range(4)])
    wf = get_workflow("patch")
    assert wf is not None
    gone = admin.create_strategy(store, wf, StrategyOptions(), target_names=["t0", "t1"])
    old_steps = _step_ids(store, gone)
    admin.delete_strategy(store, gone)
    new = admin.create_strategy(store, wf, StrategyOptions(), target_names=["t2", "t3"])
    assert min(_step_ids(store, new)) > max(old_steps)
    with pytest.raises(NotFound, match=f"step {old_steps[0]} not found"):
        accept_callback(store, old_steps[0], "pre-check", "done", "late agent", 0.0)


def test_upgrading_starts_the_id_counter_above_every_strategy_id_still_mentioned(
    db_url: str,
) -> None:
    engine = _database_at(db_url, "0006")
    with engine.begin() as conn:  # rows as fleetwave 0006 wrote them
        conn.exec_driver_sql(
            "INSERT INTO targets (id, name, driver, settings, managed, labels, created_at) "
            "VALUES (1, 't0', 'sim', '{}', true, '{}', 0)"
        )
        for sid in (3, 7):
            conn.exec_driver_sql(
                "INSERT INTO strategies (id, workflow, workflow_version, states, state, "
                "options, group_caps, step_count, details, created_at, updated_at, fence) "
                f"VALUES ({sid}, 'patch', 1, '[]', 'complete', '{{}}', '{{}}', 0, '', 0, 0, 0)"
            )
        # strategy 9 was deleted by an earlier version, which left its callbacks behind:
        # a new strategy 9 would have been handed this one
        conn.exec_driver_sql(
            "INSERT INTO callbacks (strategy_id, step_id, state, kind, details, received_at) "
            "VALUES (9, 1, 'pre-check', 'done', '', 0)"
        )
    engine.dispose()
    store = open_store(db_url)  # migrates to head
    admin.delete_strategy(store, 7)
    sid = _patch_strategy(store, "t0")
    assert sid == 10
    assert min(_step_ids(store, sid)) > 1  # step 1 is named by the leftover callback
    with store.read() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM callbacks").scalar_one() == 0


def test_taking_a_step_over_clears_its_not_started_mark(db_url: str) -> None:
    """Once a new owner holds the step it may start the action: a later owner must recover."""
    store = open_store(db_url)
    admin.add_targets(store, [Target(name="t0")])
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    with store.write() as conn:
        conn.exec_driver_sql(
            "UPDATE steps SET state = 'pre-check', fence = 1, owner = 'gone', not_started = true"
        )
    (rec,), _failed = rt.load_open_steps(store, sid)
    assert rec.not_started
    (taken,) = rt.take_over_steps(store, [rec], "c-new", 1.0)
    assert taken.fence == 2
    with store.read() as conn:
        row = conn.exec_driver_sql("SELECT not_started, owner, fence FROM steps").one()
    assert tuple(row) == (0, "c-new", 2)


def test_started_steps_of_a_strategy_never_driven_need_no_scan(db_url: str) -> None:
    """No journal row yet: nothing started or failed (answered by one index probe);
    once a step has moved, the started steps and the failures are read as before."""
    store = open_store(db_url)
    admin.add_targets(store, [Target(name=f"t{i}") for i in range(3)])
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    assert rt.load_started_steps(store, sid) == ([], 0)
    waiting = rt.load_waiting_steps(store, sid, -1, 10)
    writer = rt.TransitionWriter(store, "c1")
    first, second = waiting[0], waiting[1]
    moves = [
        rt.Transition(first.step_id, sid, "initial", 0, "pre-check", 1, "", 0),
        rt.Transition(second.step_id, sid, "initial", 0, "failed", 0, "boom", 0),
    ]
    assert writer.commit(moves, [], 1.0).rejected == []
    writer.close()
    started, failed = rt.load_started_steps(store, sid)
    assert [s.step_id for s in started] == [first.step_id] and failed == 1
    store.dispose()


def test_a_list_read_slowly_holds_no_read_transaction_between_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: history streamed into a pager that waits held one read
    transaction open, so SQLite could not reset its WAL while conductors wrote (65 MB
    after 3,000 writes). Rows are read a page per transaction: between pages, a
    checkpoint can empty the WAL."""
    from fleetwave.store import queries

    monkeypatch.setattr(queries.common, "PAGE_ROWS", 2)
    store = open_store(str(tmp_path / "f.db"))
    admin.add_targets(store, [Target(name=f"t{i}") for i in range(3)])
    sid = _patch_strategy(store, "t0")
    with store.write() as conn:
        for i, to in enumerate(["pre-check", "updating-patches", "creating-remote-patch-strategy"]):
            conn.exec_driver_sql(
                "INSERT INTO journal (strategy_id, step_id, at, conductor, from_state, "
                "to_state, fence, details) SELECT ?, id, ?, 'c', 'x', ?, 1, '' FROM steps "
                "WHERE strategy_id = ?",
                (sid, float(i), to, sid),
            )
    for reader, left in (
        (queries.iter_history(store, sid), 2),  # 3 journal rows of the one step
        (queries.iter_steps(store, sid), 0),
        (queries.iter_targets(store), 2),
    ):
        next(reader)  # the reader pauses after its first row (a pager waiting)
        with store.write() as conn:
            conn.exec_driver_sql("UPDATE targets SET labels = labels")
        with store.engine.connect() as conn:
            busy, _, _ = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
        assert busy == 0  # no snapshot held: the WAL could be reset
        assert len(list(reader)) == left  # and the rest is read on, whole


def test_strategy_list_reads_a_fixed_number_of_statements_however_many_strategies(
    db_url: str,
) -> None:
    """``strategy list`` ran two queries per driven strategy (its owner, the serving
    conductors): a database with many applied strategies listed slowly. It reads the
    conductors once; who drives each is the same as ``strategy show`` says."""
    from fleetwave.store import queries

    store = open_store(db_url)
    wf = get_workflow("patch")
    assert wf is not None
    statements: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: statements.append(str(a[2])))

    def listed(n: int) -> int:
        admin.add_targets(store, [Target(name=f"t{n}-{i}") for i in range(3)])
        for i in range(3):
            sid = admin.create_strategy(store, wf, StrategyOptions(), target_names=[f"t{n}-{i}"])
            admin.apply_strategy(store, sid)
        statements.clear()
        rows = queries.list_strategies(store)
        selects = sum(1 for sql in statements if sql.lstrip().upper().startswith("SELECT"))
        assert len(rows) == 3 * n
        for row in rows:
            assert row["driven_by"] == queries.driving(store, row["id"]).text
            assert row["driven_by"].startswith("nobody: no conductor serves")
        brief = queries.list_strategies(store, brief=True)
        assert {row["driven_by"] for row in brief} == {"NOBODY (see strategy show)"}
        return selects

    few = listed(1)
    for n in range(2, 8):
        many = listed(n)
    assert many == few <= 4, (few, many)
    store.dispose()


def test_a_killed_conductor_not_yet_reaped_is_gone() -> None:
    """A conductor killed whose parent has not reaped it (a zombie: a container's
    first process that is no init) answers signals, so it counted as alive and its
    strategies waited for its lease to run out (helper-35's drill: 14 s, 28 s)."""
    import os
    import subprocess
    import time

    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert not rt.conductor_gone(rt.HOSTNAME, proc.pid, None)
        proc.kill()
        deadline = time.monotonic() + 10
        while not rt.conductor_gone(rt.HOSTNAME, proc.pid, None):  # a zombie now
            assert time.monotonic() < deadline, "a killed, unreaped process counted alive"
            time.sleep(0.05)
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            assert b") Z " in f.read()  # still there, unreaped: the case itself
    finally:
        proc.kill()
        proc.wait()
    assert rt.conductor_gone(rt.HOSTNAME, proc.pid, None)
    assert not rt.conductor_gone(rt.HOSTNAME, os.getpid(), None)


# -- fencing, pinned (a mutation audit found each check could go unnoticed) ------------


def _claimed(db_url: str, cid: str = "c1") -> tuple[Store, int, rt.StrategyRecord]:
    store = open_store(db_url)
    admin.add_targets(store, [Target(name="t0")])
    wf = get_workflow("patch")
    assert wf is not None
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.apply_strategy(store, sid)
    (rec,) = rt.claim_strategies(store, cid, 1.0, 100.0, register=True)
    return store, sid, rec


def _entry(store: Store, sid: int) -> rt.Transition:
    (waiting,) = rt.load_waiting_steps(store, sid, -1, 10)
    return rt.Transition(waiting.step_id, sid, "initial", 0, "pre-check", 1, "", 1)


def _journal_rows(store: Store) -> int:
    with store.read() as conn:
        return int(conn.exec_driver_sql("SELECT count(*) FROM journal").scalar_one())


@pytest.mark.parametrize("by", ["another conductor", "itself at a new fence"])
def test_a_commit_at_a_fence_no_longer_held_writes_nothing(db_url: str, by: str) -> None:
    """G2/G3: once the strategy was claimed again (by another conductor after this one's
    lease ran out, or by this one anew after its renewals lapsed), a commit made at the
    old fence is refused whole: the strategy is reported lost, nothing is written."""
    store, sid, rec = _claimed(db_url)
    if by == "another conductor":
        (again,) = rt.claim_strategies(store, "c2", 200.0, 300.0, register=True)
    else:
        (again,) = rt.claim_strategies(store, "c1", 200.0, 300.0, driving=set())
    assert again.fence == rec.fence + 1
    writer = rt.TransitionWriter(store, "c1")
    entry = _entry(store, sid)
    result = writer.commit([entry], [], 201.0, fences={sid: rec.fence})
    writer.close()
    assert result.lost == {sid}
    assert _journal_rows(store) == 0
    with store.read() as conn:
        assert conn.exec_driver_sql("SELECT state, owner FROM steps").one() == ("initial", None)
    store.dispose()


def test_a_takeover_by_a_conductor_fenced_off_takes_nothing(db_url: str) -> None:
    """G2: `held` is checked in the takeover's transaction: a conductor whose strategy
    was claimed by another since takes none of its steps."""
    store, sid, rec = _claimed(db_url)
    with store.write() as conn:
        conn.exec_driver_sql("UPDATE steps SET state = 'pre-check', fence = 1, owner = 'gone'")
    (step,), _failed = rt.load_open_steps(store, sid)
    rt.claim_strategies(store, "c2", 200.0, 300.0, register=True)  # fence + 1
    assert rt.take_over_steps(store, [step], "c1", 201.0, held=(sid, rec.fence)) is None
    with store.read() as conn:
        assert conn.exec_driver_sql("SELECT owner, fence FROM steps").one() == ("gone", 1)
    store.dispose()


def test_a_takeover_from_a_stale_copy_of_a_step_takes_nothing(db_url: str) -> None:
    """G2, one executor: two conductors read the same step at fence 1; the first takes it
    (fence 2), the second's copy is stale and must not take it from the first."""
    store, sid, _rec = _claimed(db_url)
    with store.write() as conn:
        conn.exec_driver_sql("UPDATE steps SET state = 'pre-check', fence = 1, owner = 'gone'")
    (first_copy,), _ = rt.load_open_steps(store, sid)
    (second_copy,), _ = rt.load_open_steps(store, sid)
    (taken,) = rt.take_over_steps(store, [first_copy], "c1", 2.0)
    assert taken.fence == 2
    assert rt.take_over_steps(store, [second_copy], "c2", 2.0) == []
    with store.read() as conn:
        assert conn.exec_driver_sql("SELECT owner, fence FROM steps").one() == ("c1", 2)
    store.dispose()


def test_ending_a_strategy_at_a_fence_no_longer_held_is_refused(db_url: str) -> None:
    """The conductor's own new claim (after its renewals lapsed) drives it now: the old
    run's end must not end the strategy under it."""
    store, sid, rec = _claimed(db_url)
    (again,) = rt.claim_strategies(store, "c1", 200.0, 300.0, driving=set())
    assert not rt.end_strategy(store, sid, "c1", rec.fence, "complete", "", 201.0)
    with store.read() as conn:
        assert conn.exec_driver_sql("SELECT state, owner FROM strategies").one() == (
            "applying",
            "c1",
        )
    assert rt.end_strategy(store, sid, "c1", again.fence, "complete", "", 202.0)
    store.dispose()


@pytest.mark.parametrize(("asked", "event"), [("abort-requested", True), ("applying", False)])
def test_an_abort_that_came_after_every_step_had_ended_is_on_the_record(
    db_url: str, asked: str, event: bool
) -> None:
    """The operator was told "abort requested"; the strategy then ended complete (its
    steps all had), with nothing to say why the abort did nothing (bug hunt)."""
    store, sid, rec = _claimed(db_url)
    with store.write() as conn:
        conn.execute(sa.text("UPDATE strategies SET state = :s"), {"s": asked})
    assert rt.end_strategy(store, sid, "c1", rec.fence, "complete", "", 201.0)
    with store.read() as conn:
        rows = conn.execute(sa.text("SELECT kind, details FROM events WHERE kind LIKE 'abort%'"))
        got = rows.all()
    assert got == (
        [
            (
                "abort-too-late",
                "an abort was requested after every step had ended: the strategy ended "
                "complete, as its steps had",
            )
        ]
        if event
        else []
    )
    store.dispose()


def _other_writer(db: Path, then: str, *args: str) -> subprocess.Popen[str]:
    """Another process on ``db`` taking turns across processes, as ``serve``'s do: once
    it has said it is ready, a line on its stdin makes it run ``then`` (Python, with
    ``store`` and ``sys`` at hand; ``args`` from ``sys.argv[2]`` on)."""
    script = (
        "import sys\n"
        "from fleetwave.store.db import open_store\n"
        "store = open_store(sys.argv[1])\n"
        "store.turns_across_processes = True\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n" + then
    )
    other = subprocess.Popen(
        [sys.executable, "-c", script, str(db), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert other.stdout is not None
    assert other.stdout.readline().strip() == "ready"
    return other


def test_writers_of_every_process_take_turns_on_the_file_beside_the_database(
    tmp_path: Path,
) -> None:
    """A write in another process waits while this one holds the writers' turn (and
    goes through once it is let go), rather than finding SQLite's lock free or busy."""
    db = tmp_path / "fleet.db"
    store = open_store(str(db))
    store.turns_across_processes = True
    other = _other_writer(
        db,
        "import time\n"
        "from sqlalchemy import text\n"
        "t0 = time.monotonic()\n"
        "with store.write() as conn:\n"
        "    conn.execute(text('PRAGMA user_version'))\n"
        "print(f'{time.monotonic() - t0:.3f}', flush=True)\n",
    )
    assert other.stdin is not None and other.stdout is not None
    with store.writer_turn():
        other.stdin.write("go\n")
        other.stdin.flush()
        time.sleep(0.5)
        assert other.poll() is None  # still waiting for its turn
    waited = float(other.stdout.readline())
    assert other.wait(timeout=30) == 0
    assert waited >= 0.4
    assert (tmp_path / "fleet.db-writers").exists()


def test_a_writer_waiting_for_its_turn_gets_it_before_the_holder_takes_another(
    tmp_path: Path,
) -> None:
    """The holder of the writers' turn, back for another at once (as the engine's group
    commits are), waits behind a process already waiting: that one's write goes in
    after the one under way, not after however many the holder takes meanwhile."""
    db = tmp_path / "fleet.db"
    order = tmp_path / "order"
    store = open_store(str(db))
    store.turns_across_processes = True
    other = _other_writer(
        db,
        "with store.writer_turn():\n"
        "    with open(sys.argv[2], 'a') as f:\n"
        "        f.write('other\\n')\n",
        str(order),
    )
    assert other.stdin is not None and other.stdout is not None
    with store.writer_turn():
        other.stdin.write("go\n")
        other.stdin.flush()
        time.sleep(1.0)  # (the other is waiting for the turn by now)
        assert other.poll() is None
    for _ in range(20):  # turns back to back: the other's comes after the first
        with store.writer_turn(), open(order, "a") as f:
            f.write("holder\n")
    assert other.wait(timeout=30) == 0
    assert order.read_text().splitlines()[0] == "other"
    store.dispose()
