"""fleetwave on a PostgreSQL server, from the command line: a whole rollout through a
``postgresql://`` URL, and each kind of bad URL as one ``error:`` line without the
password. Also a conductor whose connections the server drops mid-rollout rides it out.

The server is the throw-away one ``scripts/test.sh`` starts (``pg_url``: a new empty
database per test); without one these tests skip, or fail in CI.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError, ProgrammingError

from cli_harness import Cli, one_line
from conftest import add_sim_targets, applied
from fleetwave.engine.conductor import Conductor
from fleetwave.engine.config import EngineConfig
from fleetwave.store.db import HEAD_REVISION, current_revision, open_store
from fleetwave.store.postgres import WRITE_LOCK_KEY, redact
from fleetwave.testing.invariants import check

#: the role scripts/pg.sh makes that must give a password (the superuser need not)
PW_ROLE, PW = "fleetwave_pw", "fw-secret-pw"


def _with(url: str, **parts: str | None) -> str:
    """``url`` with some of its parts replaced (username, password, database, ...)."""
    return make_url(url).set(**parts).render_as_string(hide_password=False)  # type: ignore[arg-type]


def _revision(url: str) -> str | None:
    store = open_store(url, migrate_schema=False)
    try:
        return current_revision(store)
    finally:
        store.dispose()


def test_a_rollout_from_the_command_line(cli: Cli, pg_url: str, tmp_path: Path) -> None:
    """init, targets added and imported, a strategy applied and driven to its end, its
    steps and history read, check: all through the URL, as through a file."""
    url = pg_url.replace("postgresql://", "postgres://", 1)  # (the short form is taken too)
    res = cli("init", db=url)
    assert res.code == 0, res.text
    assert "database ready" in res.out
    assert _revision(pg_url) == HEAD_REVISION
    assert cli("init", db=url).code == 0  # again: nothing to do
    assert cli("target", "add", "a0", db=url).code == 0
    assert cli("group", "add", "g1", "--max-parallel", "1", db=url).code == 0
    sheet = tmp_path / "fleet.csv"
    sheet.write_text("name,group,driver\n" + "".join(f"b{i},g1,sim\n" for i in range(4)))
    res = cli("target", "import", str(sheet), db=url)
    assert res.code == 0, res.text
    res = cli("target", "list", "--format", "json", db=url)
    assert sorted(t["name"] for t in res.json()) == ["a0", "b0", "b1", "b2", "b3"]
    res = cli("strategy", "create", "--workflow", "patch", "--all", "--max-parallel", "2", db=url)
    assert res.code == 0, res.text
    res = cli("strategy", "apply", "1", "--wait", db=url)
    assert res.code == 0, res.text
    res = cli("step", "list", "--strategy", "1", "--format", "json", db=url)
    assert [s["state"] for s in res.json()] == ["complete"] * 5
    res = cli("history", "--strategy", "1", "--format", "json", db=url)
    assert len(res.json()) == 5 * 6  # five states and the end, for each of 5 steps
    res = cli("check", db=url)
    assert res.code == 0, res.text
    assert "checked 1 strategy, 5 steps, 30 transitions" in res.out


def test_fleetwave_db_names_the_server(
    cli: Cli, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETWAVE_DB", pg_url)
    assert cli("init", db=None).code == 0
    assert cli("target", "add", "t0", db=None).code == 0
    res = cli("target", "list", "--format", "json", db=None)
    assert [t["name"] for t in res.json()] == ["t0"]


def test_a_database_without_the_schema_is_refused_except_by_init_and_add(
    cli: Cli, pg_url: str
) -> None:
    for args in (("target", "list"), ("strategy", "list"), ("check",), ("serve",)):
        line = one_line(cli(*args, db=pg_url))
        assert line.startswith(f"error: --db: no fleetwave schema in {pg_url}"), line
        assert "fleetwave init" in line
    assert _revision(pg_url) is None  # nothing was written
    assert cli("target", "add", "t0", db=pg_url).code == 0  # as on a new file: made
    assert _revision(pg_url) == HEAD_REVISION


def test_a_schema_newer_than_this_fleetwave_is_refused(cli: Cli, pg_url: str) -> None:
    assert cli("init", db=pg_url).code == 0
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0999'")
    for args in (("target", "list"), ("init",)):
        line = one_line(cli(*args, db=pg_url))
        assert "schema revision 0999, newer than this fleetwave" in line, line


@pytest.mark.parametrize("how", ["in the URL", "PGPASSWORD"])
def test_a_wrong_password_is_one_line_without_the_password(
    cli: Cli, pg_url: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    wrong = "wr0ng-Passw0rd-9431"
    if how == "in the URL":
        url = _with(pg_url, username=PW_ROLE, password=wrong)
    else:
        url = _with(pg_url, username=PW_ROLE)
        monkeypatch.setenv("PGPASSWORD", wrong)
    for args in (("init",), ("target", "list")):
        res = cli(*args, db=url)
        line = one_line(res)
        assert "password authentication failed" in line, line
        assert wrong not in res.err + res.out
    if how == "in the URL":
        assert f"{PW_ROLE}:***@" in line  # the URL, shown masked


def test_a_password_from_the_url_pgpassword_or_a_pgpass_file_lets_it_in(
    cli: Cli, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = cli("init", db=_with(pg_url, username=PW_ROLE, password=PW))
    assert res.code == 0, res.text
    assert PW not in res.out + res.err  # "database ready: ..." names the URL masked
    url = _with(pg_url, username=PW_ROLE)
    monkeypatch.setenv("PGPASSWORD", PW)
    assert cli("target", "add", "t0", db=url).code == 0
    monkeypatch.delenv("PGPASSWORD")
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"*:*:*:{PW_ROLE}:{PW}\n")
    pgpass.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(pgpass))  # libpq's ~/.pgpass, elsewhere
    res = cli("target", "list", "--format", "json", db=url)
    assert [t["name"] for t in res.json()] == ["t0"]


def test_a_server_that_is_not_there_is_one_line(cli: Cli, tmp_path: Path) -> None:
    for url in (
        f"postgresql://someone:s3cret-pw-77@/fleet?host={tmp_path}",  # no socket there
        "postgresql://someone:s3cret-pw-77@127.0.0.1:1/fleet",  # nothing listens
    ):
        res = cli("target", "list", db=url)
        line = one_line(res)
        assert line.startswith("error: --db: cannot use postgresql://someone:***@"), line
        assert "s3cret-pw-77" not in res.err


def test_a_database_that_is_not_there_is_one_line(cli: Cli, pg_url: str) -> None:
    line = one_line(cli("init", db=_with(pg_url, database="no_such_db")))
    assert 'database "no_such_db" does not exist' in line


def test_a_url_of_another_database_kind_is_refused(cli: Cli) -> None:
    line = one_line(cli("target", "list", db="mysql://u:hunter2-pw@h/x"))
    assert "is a URL fleetwave does not take" in line and "hunter2-pw" not in line


def test_a_conductor_rides_out_a_database_that_goes_away(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The database ends every connection and refuses new ones for 6 s (an operator's
    hand, a restart), mid-rollout: the conductor retries, reconnects once it is back and
    says in the log that it went through after so many tries (as after an SQLite
    outage), and the rollout completes with nothing entered twice (check)."""
    store = open_store(pg_url)
    # about 3.6 s of work (3 rounds of 6 states at 200 ms): the outage starts once the
    # rollout is under way, long before its end. (At 20 ms a state, and the outage 0.3 s
    # after the start, a loaded machine's rollout had sometimes ended before it.)
    add_sim_targets(store, 30, {"latency_ms": 200})
    sid = applied(store, max_parallel=10)
    dbname = make_url(pg_url).database
    admin_url = _with(pg_url, database="postgres")
    dropped: list[int] = []

    def under_way() -> bool:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM journal").fetchone()
        return row is not None and row[0] > 0

    def go_away() -> None:
        deadline = time.monotonic() + 60
        while not under_way() and time.monotonic() < deadline:
            time.sleep(0.02)
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS false')
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (dbname,),
            ).fetchall()
            dropped.append(len(rows))
            time.sleep(6.0)
            conn.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS true')

    outage = threading.Thread(target=go_away)
    outage.start()
    try:
        with caplog.at_level(logging.WARNING, logger="fleetwave"):
            conductor = Conductor(store, config=EngineConfig())
            result = asyncio.run(conductor.run(strategy_ids=[sid]))
    finally:
        outage.join()
    assert dropped and dropped[0] > 0
    assert result[sid] == "complete"
    said = [r.getMessage() for r in caplog.records if "store-retry" in r.getMessage()]
    assert any("went through after" in m and "failed tries" in m for m in said), said
    assert conductor.stats.store_retries > 0
    report = check(store)
    assert report.ok, report
    store.dispose()


def test_which_postgresql_errors_are_outages(pg_url: str) -> None:
    """Real errors from the server: a lock not had in time and a deadlock are outages
    (a conductor retries them, its connections kept); a missing table is not."""
    store = open_store(pg_url)
    hooks = store.hooks
    with psycopg.connect(pg_url) as other:  # (a transaction, holding the write lock)
        other.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK_KEY,))
        store.busy_timeout_ms = 200
        with pytest.raises(OperationalError) as locked, store.write():
            pass
    assert "lock timeout" in str(locked.value)
    assert hooks.is_outage(locked.value) and not hooks.needs_new_connections(locked.value)

    with psycopg.connect(pg_url, autocommit=True) as setup:
        setup.execute("CREATE TABLE pair (i int PRIMARY KEY)")
        setup.execute("INSERT INTO pair VALUES (1), (2)")
    first, second = psycopg.connect(pg_url), psycopg.connect(pg_url)
    errors: list[BaseException] = []

    def lock(conn: psycopg.Connection[Any], row: int) -> None:
        try:
            conn.execute("UPDATE pair SET i = i WHERE i = %s", (row,))
        except psycopg.Error as exc:
            errors.append(exc)
            conn.rollback()

    try:
        for conn in (first, second):
            conn.execute("SET deadlock_timeout = '100ms'")
        lock(first, 1)
        lock(second, 2)
        crossing = threading.Thread(target=lock, args=(first, 2))
        crossing.start()
        lock(second, 1)  # one of the two is chosen to fail
        second.rollback()  # (the other one then gets its row)
        crossing.join()
    finally:
        first.close()
        second.close()
    (deadlock,) = errors
    assert isinstance(deadlock, psycopg.errors.DeadlockDetected)
    assert hooks.is_outage(deadlock) and not hooks.needs_new_connections(deadlock)

    with pytest.raises(ProgrammingError) as bad, store.read() as conn:
        conn.exec_driver_sql("SELECT * FROM no_such_table")
    assert not hooks.is_outage(bad.value)
    store.dispose()


def test_now_sql_reads_the_database_clock(pg_url: str) -> None:
    store = open_store(pg_url)
    with store.read() as conn:
        first = float(conn.exec_driver_sql(f"SELECT {store.hooks.now_sql()}").scalar_one())
        second = float(conn.exec_driver_sql(f"SELECT {store.hooks.now_sql()}").scalar_one())
    store.dispose()
    assert abs(first - time.time()) < 5
    assert second > first  # the clock, not the transaction's start


def test_a_password_is_masked_wherever_a_message_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PGPASSWORD", "env-pw-5521")
    said = redact(
        "connect to postgresql://fleet:url-pw-123@db/fleet failed (host=db password=kw-pw-9 "
        "user=fleet); PGPASSWORD env-pw-5521 was refused"
    )
    for secret in ("url-pw-123", "kw-pw-9", "env-pw-5521"):
        assert secret not in said
    assert "postgresql://fleet:***@db/fleet" in said and "password=***" in said
