"""Only ``fleetwave init`` upgrades an older database: a newer fleetwave installed
next to conductors still running the older one must not change their tables under
them the first time anyone runs ``fleetwave target list``."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from cli_harness import Cli, one_line
from fleetwave.store.db import (
    HEAD_REVISION,
    MIGRATIONS_DIR,
    SchemaOutdated,
    StoreError,
    current_revision,
    known_revisions,
    open_store,
)
from fleetwave.store.queries import shown_host
from fleetwave.store.runtime import HOSTNAME

OLD = "0005"


def _database_at(path: Path, revision: str) -> None:
    """A database file as a fleetwave of that schema revision left it, with a target."""
    engine = sa.create_engine(f"sqlite:///{path}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
        conn.exec_driver_sql(
            "INSERT INTO targets (id, name, driver, settings, managed, labels, created_at) "
            "VALUES (1, 'site-1', 'sim', '{}', 1, '{}', 0)"
        )
    engine.dispose()


def _revision(path: Path) -> str | None:
    store = open_store(str(path), migrate_schema=False)
    try:
        return current_revision(store)
    finally:
        store.dispose()


def _dump(path: Path) -> list[str]:
    """The database's schema and rows, as SQL."""
    conn = sqlite3.connect(path)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def _conductor(path: Path, *, pid: int, hostname: str = HOSTNAME, age_s: float = 0.0) -> None:
    """A conductor row as a running (or crashed) conductor of the old fleetwave left it."""
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO conductors (id, hostname, pid, started_at, heartbeat_at) "
            "VALUES ('c-old', ?, ?, 0, ?)",
            (hostname, pid, time.time() - age_s),
        )
    engine.dispose()


def test_the_revisions_known_end_at_head() -> None:
    known = known_revisions()
    assert known[0] == "0001" and known[-1] == HEAD_REVISION
    assert OLD in known and known == sorted(set(known))


def test_a_command_other_than_init_refuses_an_older_schema_and_changes_nothing(
    cli: Cli, tmp_path: Path
) -> None:
    old = tmp_path / "old.db"
    _database_at(old, OLD)
    before = _dump(old)
    for args in (("target", "list"), ("strategy", "list"), ("serve",), ("group", "add", "g")):
        line = one_line(cli(*args, db=old))
        assert f"schema revision {OLD}" in line and HEAD_REVISION in line, line
        assert "fleetwave init" in line, line
    assert _revision(old) == OLD
    assert _dump(old) == before  # (opening it switched it to WAL mode: nothing else)


def test_init_upgrades_an_older_schema_and_keeps_its_rows(cli: Cli, tmp_path: Path) -> None:
    old = tmp_path / "old.db"
    _database_at(old, OLD)
    res = cli("init", db=old)
    assert res.code == 0, res.text
    assert f"upgraded from schema revision {OLD} to {HEAD_REVISION}" in res.out
    assert _revision(old) == HEAD_REVISION
    listed = cli("target", "list", "--format", "json", db=old)
    assert listed.code == 0, listed.text
    assert [t["name"] for t in listed.json()] == ["site-1"]
    again = cli("init", db=old)
    assert again.code == 0 and "database ready" in again.out, again.text


def test_init_does_not_upgrade_under_a_running_conductor(cli: Cli, tmp_path: Path) -> None:
    old = tmp_path / "old.db"
    _database_at(old, OLD)
    _conductor(old, pid=1)  # pid 1 is always there
    line = one_line(cli("init", db=old))
    assert "in use by conductor c-old" in line and "nothing was changed" in line, line
    # named as every message names a conductor (its record's PID namespace not shown)
    assert f"c-old (on {shown_host(HOSTNAME)} pid 1)" in line and ":pidns" not in line, line
    assert _revision(old) == OLD


def test_init_names_fleetwave_db_when_it_refuses_a_database_in_use(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an operator audit: the refusal said '--db:' when FLEETWAVE_DB named it."""
    old = tmp_path / "old.db"
    _database_at(old, OLD)
    _conductor(old, pid=1)
    monkeypatch.setenv("FLEETWAVE_DB", str(old))
    line = one_line(cli("init", db=None))
    assert line.startswith(f"error: FLEETWAVE_DB: {old} is in use by conductor c-old"), line
    assert _revision(old) == OLD


def test_init_upgrades_past_a_conductor_known_to_be_gone(cli: Cli, tmp_path: Path) -> None:
    """A crashed conductor on this host (its process is gone), and one silent for longer
    than a lease renewal takes, hold nothing up."""
    old = tmp_path / "old.db"
    _database_at(old, OLD)
    _conductor(old, pid=2**22 + 12345)  # above the kernel's pid_max: never a process
    assert cli("init", db=old).code == 0
    assert _revision(old) == HEAD_REVISION

    silent = tmp_path / "silent.db"
    _database_at(silent, OLD)
    _conductor(silent, pid=1, hostname="elsewhere", age_s=3600)
    assert cli("init", db=silent).code == 0
    assert _revision(silent) == HEAD_REVISION


def test_the_library_default_still_upgrades_and_upgrade_false_refuses(tmp_path: Path) -> None:
    old = tmp_path / "old.db"
    _database_at(old, OLD)
    try:
        open_store(str(old), upgrade=False)
    except SchemaOutdated as exc:
        assert exc.revision == OLD
    else:
        raise AssertionError("an older schema was opened without upgrade")
    open_store(str(old)).dispose()
    assert _revision(old) == HEAD_REVISION


def test_a_newer_schema_is_refused_by_every_command(cli: Cli, tmp_path: Path) -> None:
    new = tmp_path / "new.db"
    open_store(str(new)).dispose()
    engine = sa.create_engine(f"sqlite:///{new}")
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    engine.dispose()
    for args in (("init",), ("target", "list")):
        line = one_line(cli(*args, db=new))
        assert "9999" in line and "newer than this fleetwave" in line, line
    try:
        open_store(str(new))
    except StoreError as exc:
        assert "upgrade fleetwave" in str(exc)
    else:
        raise AssertionError("a newer schema was opened")


def test_the_refusal_names_fleetwave_db_when_that_named_the_database(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "old.db"
    _database_at(old, OLD)
    monkeypatch.setenv("FLEETWAVE_DB", str(old))
    line = one_line(cli("target", "list", db=None))
    assert line.startswith(f"error: FLEETWAVE_DB: {old} has schema revision {OLD}"), line
    assert cli("init", db=None).code == 0
    assert _revision(old) == HEAD_REVISION


def _has_open(pid: int, path: str) -> bool:
    """Whether process ``pid`` has ``path`` open (Linux's /proc)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fds / fd) == path for fd in os.listdir(fds))
    except (FileNotFoundError, ProcessLookupError):
        return False  # ended, or an fd closed while listed


def test_two_inits_at_once_upgrade_once_and_say_so(tmp_path: Path) -> None:
    """Two ``fleetwave init`` started together on an older database (two operators, or
    a deploy script on two hosts): both said "upgraded", as each had read the old
    revision before either wrote. One upgrades; the other waits for it and says the
    schema was upgraded meanwhile. Both exit 0; the rows are kept."""
    import subprocess
    import sys

    old = tmp_path / "old.db"
    _database_at(old, OLD)
    _revision(old)  # opened once: in WAL mode, as any fleetwave command leaves it
    holder = sqlite3.connect(old, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # both inits get as far as the upgrade, then wait
    cmd = [sys.executable, "-m", "fleetwave.cli.main", "init", "--db", str(old)]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    # Both must have read the old revision before the lock is let go: under load a
    # fixed two seconds was not always enough for a process to start (its imports take
    # most of a second). Each has the WAL's shared memory open once it has read.
    shm = str(old) + "-shm"
    deadline = time.monotonic() + 60
    while not all(_has_open(p.pid, shm) for p in procs):
        assert time.monotonic() < deadline, "the inits did not get to the database"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    time.sleep(0.5)  # from its read to the write it waits for
    holder.execute("ROLLBACK")
    holder.close()
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = sorted(out for out, _err in outs)
    assert f"upgraded from schema revision {OLD} to {HEAD_REVISION}" in said[1], said
    assert "database ready (upgraded meanwhile by another init)" in said[0], said
    assert _revision(old) == HEAD_REVISION
    conn = sqlite3.connect(old)
    try:
        assert conn.execute("SELECT name FROM targets").fetchall() == [("site-1",)]
    finally:
        conn.close()
