"""Admin commands racing each other from several processes: what a command read before
its write lock must still hold when it commits, and a command that fails on bad input
removes only a database file nobody else uses. From a race hunt (session 17)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from cli_harness import Cli
from conftest import add_sim_targets
from fleetwave.catalog import resolve_workflow
from fleetwave.cli.common import discard_created, forget_created, store_for
from fleetwave.domain.errors import Conflict
from fleetwave.domain.models import StrategyOptions, StrategyState
from fleetwave.domain.yaml_workflow import parse_workflow_yaml
from fleetwave.store import admin, prune, queries
from fleetwave.store.db import Store
from fleetwave.store.schema import steps, strategies
from test_cli_workflow import GOOD

GOOD_V4 = GOOD.replace("version: 3", "version: 4").replace(
    "  - name: verify\n", "  - name: drain\n  - name: verify\n"
)


def _stored(store: Store, text: str) -> None:
    admin.save_workflow(store, parse_workflow_yaml(text, source="test"), text)


def test_a_workflow_replaced_while_a_strategy_is_created_refuses_it(store: Store) -> None:
    """The strategy was made from the copy read before the write lock (v3), after v4 was
    committed; both commands said they succeeded."""
    add_sim_targets(store, 3)
    _stored(store, GOOD)
    read = resolve_workflow(store, "site-patch")  # as strategy create reads it
    _stored(store, GOOD_V4)  # another operator, in between
    with pytest.raises(Conflict, match=r"replaced \(version 3 by 4\) while the strategy"):
        admin.create_strategy(
            store, read, StrategyOptions(), all_targets=True, workflow_from_store=True
        )
    assert queries.list_strategies(store) == []
    sid = admin.create_strategy(
        store, resolve_workflow(store, "site-patch"), StrategyOptions(), all_targets=True
    )
    assert queries.get_strategy(store, sid)["workflow_version"] == 4


def test_a_workflow_deleted_while_a_strategy_is_created_refuses_it(store: Store) -> None:
    add_sim_targets(store, 3)
    _stored(store, GOOD)
    read = resolve_workflow(store, "site-patch")
    admin.delete_workflow(store, "site-patch")
    with pytest.raises(Conflict, match="'site-patch' was deleted while the strategy"):
        admin.create_strategy(
            store, read, StrategyOptions(), all_targets=True, workflow_from_store=True
        )
    assert queries.list_strategies(store) == []


def test_failed_in_reads_every_failed_step_and_refuses_a_strategy_being_deleted(
    store: Store,
) -> None:
    """All of them, past a page of 5,000 (read a page at a time, a delete of the strategy
    running meanwhile left a new strategy with part of the targets: they are read in one
    transaction now); a strategy whose delete is under way is refused."""
    add_sim_targets(store, 12_000)
    wf = resolve_workflow(store, "patch")
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    assert admin.request_abort(store, sid) == StrategyState.INITIAL  # never applied
    names = queries.ended_badly_in(store, sid)
    assert len(names) == 12_000 and names[0] == "t00000"
    with store.write() as conn:  # a delete under way
        conn.execute(
            update(strategies)
            .where(strategies.c.id == sid)
            .values(state=StrategyState.DELETING.value)
        )
    with pytest.raises(Exception, match=f"--failed-in: strategy {sid} is being deleted"):
        queries.ended_badly_in(store, sid)


def test_failed_in_of_a_strategy_pruned_before_the_write_lock_is_refused(
    store: Store,
) -> None:
    """A deleted strategy keeps its steps as they ended (``--failed-in`` reads them);
    one pruned between the read and the write lock is refused."""
    add_sim_targets(store, 4)
    wf = resolve_workflow(store, "patch")
    sid = admin.create_strategy(store, wf, StrategyOptions(), all_targets=True)
    admin.request_abort(store, sid)
    admin.delete_strategy(store, sid)
    names = queries.ended_badly_in(store, sid)  # read as strategy create reads them
    assert len(names) == 4
    prune.prune(store, time.time() + 60)  # another operator, in between
    with pytest.raises(Conflict, match=f"--failed-in: strategy {sid} was deleted while"):
        admin.create_strategy(store, wf, StrategyOptions(), target_names=names, failed_in=sid)
    with store.read() as conn:
        assert conn.execute(select(func.count()).select_from(steps)).scalar_one() == 0


def test_failed_in_as_an_operator_runs_it(cli: Cli) -> None:
    for name in ("a", "b", "c"):
        assert cli("target", "add", name, "--set", "fail_at=pre-check").code == 0
    first = cli("strategy", "create", "--workflow", "patch", "--all", "--format", "json")
    sid = first.json()["id"]
    assert cli("strategy", "apply", str(sid), "--wait").code == 1
    again = cli("strategy", "create", "--workflow", "patch", "--failed-in", str(sid))
    assert again.code == 0, again.text
    assert cli("strategy", "show", "2", "--format", "json").json()["steps"] == 3
    missing = cli("strategy", "create", "--workflow", "patch", "--failed-in", "99")
    assert (missing.code, missing.err) == (2, "error: --failed-in: strategy 99 not found\n")


def test_a_failed_command_keeps_a_new_database_another_process_has_open(
    tmp_path: Path,
) -> None:
    """A command that fails on bad input removes the database file it created; when a
    'target import' on the same fresh path had opened it meanwhile, what the import then
    committed went into the removed file, and was lost after it said it succeeded."""
    path = tmp_path / "fresh.db"
    forget_created()
    store = store_for(str(path))  # created by this command, which then fails
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            f"c = sqlite3.connect({str(path)!r})\n"
            "c.execute('SELECT count(*) FROM targets').fetchone()\n"
            "print('open', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        assert store is not None
        discard_created()
        assert path.exists()  # kept: another process has it open
    finally:
        holder.communicate("", timeout=30)
    # alone, the same failure removes what it created
    other = tmp_path / "other.db"
    store_for(str(other))
    discard_created()
    assert not other.exists()
    assert not other.with_name("other.db-wal").exists()


def test_a_failed_command_keeps_a_new_database_an_init_announced(tmp_path: Path) -> None:
    """'fleetwave init' on the same fresh path in the meantime said "database ready"
    (it writes no row): the failing command's clean-up removed it all the same."""
    path = tmp_path / "fresh.db"
    forget_created()
    store_for(str(path))  # created by this command, which then fails
    done = subprocess.run(
        [sys.executable, "-m", "fleetwave.cli.main", "init", "--db", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith("database ready"), done
    discard_created()
    assert path.exists()


def test_strategy_create_refuses_a_workflow_replaced_meanwhile(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command as an operator runs it: another 'workflow add' commits v4 right after
    this create read v3."""
    import fleetwave.cli.strategies as strategies_cli
    from fleetwave.store.db import open_store

    assert cli("target", "add", "a").code == 0
    wf_file = db_path.parent / "wf.yaml"
    wf_file.write_text(GOOD, encoding="utf-8")
    assert cli("workflow", "add", str(wf_file)).code == 0
    real = strategies_cli.resolve_workflow

    def read_then_replaced(store: Store, name: str, what: str = "--workflow") -> object:
        read = real(store, name, what)
        other = open_store(str(db_path))  # the other operator's command
        try:
            _stored(other, GOOD_V4)
        finally:
            other.dispose()
        return read

    monkeypatch.setattr(strategies_cli, "resolve_workflow", read_then_replaced)
    res = cli("strategy", "create", "--workflow", "site-patch", "--all")
    assert res.code == 2, res.text
    assert "workflow 'site-patch' was replaced (version 3 by 4)" in res.err
    assert cli("strategy", "list", "--format", "json").json() == []


def test_init_on_a_database_it_cannot_write_just_now_still_says_ready(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark is best effort: a database locked by a long writer (or read-only) is left
    unmarked, and init does not fail where it found the database ready."""
    from contextlib import contextmanager

    from sqlalchemy.exc import OperationalError

    from fleetwave.store.db import mark_initialised

    @contextmanager
    def locked() -> object:
        raise OperationalError("PRAGMA user_version", None, Exception("database is locked"))
        yield  # pragma: no cover

    monkeypatch.setattr(store, "write", locked)
    mark_initialised(store)  # no error
    with store.read() as conn:
        assert conn.exec_driver_sql("PRAGMA user_version").scalar() == 0
    monkeypatch.undo()
    mark_initialised(store)
    with store.read() as conn:
        assert conn.exec_driver_sql("PRAGMA user_version").scalar() == 1


@pytest.mark.parametrize("stays_open", [True, False])
def test_a_failed_command_keeps_a_new_database_written_while_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stays_open: bool
) -> None:
    """Another process opens the new file and commits the moment the clean-up has read
    it (found by a review: the lock was dropped by then, and the file removed): kept,
    whether that process stays connected or has closed again."""
    import sqlite3

    path = tmp_path / "fresh.db"
    forget_created()
    store_for(str(path))  # created by this command, which then fails
    real_connect = sqlite3.connect
    writers: list[subprocess.Popen[str]] = []
    keep = "sys.stdin.read()" if stays_open else "c.close()"

    class ReadThenWritten:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def execute(self, *args: object) -> sqlite3.Cursor:
            return self.conn.execute(*args)  # type: ignore[arg-type]

        def close(self) -> None:
            writer = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    f"import sqlite3, sys\nc = sqlite3.connect({str(path)!r}, timeout=5)\n"
                    'c.execute("INSERT INTO groups (name, max_parallel, apply_type) '
                    "VALUES ('g', 1, 'parallel')\")\n"
                    f"c.commit()\nprint('committed', flush=True)\n{keep}\n",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            writers.append(writer)
            assert writer.stdout is not None and writer.stdout.readline() == "committed\n"
            self.conn.close()

    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: ReadThenWritten(real_connect(*a, **k)))
    try:
        discard_created()
    finally:
        monkeypatch.undo()
        for writer in writers:
            writer.communicate("", timeout=30)
    assert len(writers) == 1
    assert path.exists()
    with real_connect(path) as conn:
        assert conn.execute("SELECT name FROM groups").fetchall() == [("g",)]
