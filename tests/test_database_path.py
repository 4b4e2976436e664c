"""Which database a command opens: a path with no database, an empty file or another
program's database is refused, never served or filled; a locked database is one line."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cli_harness import Cli, assert_rejected, one_line


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


def test_an_empty_file_or_another_programs_database_is_not_a_fleet(
    cli: Cli, tmp_path: Path
) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    assert_rejected(cli("target", "list", db=empty), "is an empty file, not a database")
    assert empty.stat().st_size == 0
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    assert_rejected(cli("target", "list", db=other), "SQLite database of something else")
    with sqlite3.connect(other) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"invoices"}  # nothing of ours added


def test_a_database_locked_by_another_program_is_one_line(
    cli: Cli, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command whose write waited out the busy timeout printed a traceback: one line
    now, saying what holds it up, exit 1; nothing was written."""
    monkeypatch.setattr("fleetwave.store.db.DEFAULT_BUSY_TIMEOUT_MS", 200)
    holder = sqlite3.connect(db_path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another program's write transaction
        res = cli("target", "add", "a")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert res.code == 1, res.text
    assert res.out == ""
    assert res.err.splitlines() == [
        "error: database: database is locked (another program holds its write lock: try "
        "again when it is done); its transaction was rolled back"
    ]
    assert cli("target", "list", "--format", "json").json() == []
