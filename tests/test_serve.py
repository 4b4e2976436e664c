"""``fleetwave serve`` drives applied strategies; ``apply --wait`` elsewhere waits for
the end (and takes over only if the owner dies)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from fleetwave.store.db import open_store
from fleetwave.store.queries import shown_host
from fleetwave.store.runtime import HOSTNAME
from fleetwave.store.schema import conductors, steps
from fleetwave.testing.invariants import check

FLEETWAVE = [sys.executable, "-m", "fleetwave.cli.main"]


def _cli(db: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FLEETWAVE, *args, "--db", db], capture_output=True, text=True, timeout=120
    )


def test_serve_drives_apply_and_a_second_process_only_watches(tmp_path: Path) -> None:
    db = str(tmp_path / "serve.db")
    assert _cli(db, "init").returncode == 0
    # Two stages with an approval between them: the rollout cannot end before the second
    # process has registered (the test approves stage b only then). With a rollout that
    # merely took long enough, a loaded machine sometimes ended it before that process
    # asked, and it never registered.
    for group in ("a", "b"):
        assert _cli(db, "group", "add", group).returncode == 0
    csv = tmp_path / "fleet.csv"
    csv.write_text(
        "name,group,latency_ms\n"
        + "".join(f"s{i:03d},{'a' if i < 30 else 'b'},100\n" for i in range(60)),
        encoding="utf-8",
    )
    assert _cli(db, "target", "import", str(csv)).returncode == 0
    created = _cli(
        db,
        "strategy",
        "create",
        "--workflow",
        "patch",
        "--all",
        "--max-parallel",
        "10",
        "--stage",
        "a",
        "--stage",
        "b",
        "--stage-approval",
        "--format",
        "json",
    )
    sid = json.loads(created.stdout)["id"]

    serve = subprocess.Popen(
        [*FLEETWAVE, "serve", "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    second: subprocess.Popen[str] | None = None
    try:
        applied = _cli(db, "strategy", "apply", str(sid))
        assert applied.returncode == 0, applied.stderr
        assert "applying" in applied.stdout
        # (polled in the file, not with a process per look)
        _wait_for(
            "serve to claim the applied strategy",
            lambda: _read(db, "SELECT owner FROM strategies WHERE id = ?", sid) is not None,
            timeout_s=60,
        )
        shown = _cli(db, "strategy", "show", str(sid), "--format", "json")
        owner = json.loads(shown.stdout)["owner"]
        assert owner is not None, "serve should claim the applied strategy"
        # named with where it runs: the serve's host and process
        host = shown_host(HOSTNAME)
        assert (
            json.loads(shown.stdout)["driven_by"]
            == f"conductor {owner} (on {host} pid {serve.pid})"
        )
        # A second process asks to drive it too: it must only wait on the live owner.
        second = subprocess.Popen(
            [*FLEETWAVE, "strategy", "apply", str(sid), "--wait", "--format", "json", "--db", db],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert second is not None
        pid = second.pid
        _wait_for("the second process to register", lambda: _registered(db, pid), 60)
        _wait_for(
            "stage a to end",
            lambda: (
                _read(db, "SELECT state FROM strategies WHERE id = ?", sid) == "waiting-approval"
            ),
            timeout_s=60,
        )
        assert second.poll() is None, "the second process ended before the rollout did"
        approved = _cli(db, "strategy", "approve", str(sid))
        assert approved.returncode == 0, approved.stderr
        out, err2 = second.communicate(timeout=120)
        assert second.returncode == 0, err2
        assert json.loads(out)["state"] == "complete"
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.communicate()
        serve.send_signal(signal.SIGTERM)
        _out, err = serve.communicate(timeout=30)
    assert serve.returncode == 0, err
    assert "leases handed back" in err
    # its log says what it drove (it said nothing between "serving" and "stopped"): a
    # line when it took the strategy on, and one when the strategy ended
    said = [x for x in err.splitlines() if f" strategy {sid}: " in x]
    assert len(said) >= 2, err
    assert said[0].endswith("; applying (taken on)") and " of 60 steps ended" in said[0], said
    assert said[-1].endswith(
        "60 of 60 steps ended (60 complete), 0 under way, 0 waiting; complete (ended)"
    ), said

    store = open_store(db)
    with store.read() as conn:
        drivers = {r[0] for r in conn.execute(select(steps.c.owner)) if r[0]}
        live = conn.execute(select(conductors.c.id, conductors.c.stopped_at)).all()
        serves_all = dict(conn.execute(select(conductors.c.id, conductors.c.serves_all)).all())
    # Both processes registered as conductors, but the journal shows one drove it.
    hist = json.loads(_cli(db, "history", "--strategy", str(sid), "--format", "json").stdout)
    assert {h["conductor"] for h in hist} == {owner}
    assert drivers == set()
    assert all(stopped is not None for _, stopped in live)
    # serve drives every strategy; apply --wait only its own (so it does not count as
    # serving the database when another strategy is applied)
    assert serves_all == {owner: True} | {c: False for c in serves_all if c != owner}
    assert len(serves_all) == 2
    assert check(store, sid).ok
    store.dispose()


def _freeze_between_transactions(proc: subprocess.Popen[str], db: str) -> None:
    """SIGSTOP ``proc`` while it holds no write lock on ``db``. Stopped inside a commit
    (a few percent of the time, at this rate of commits), it would hold SQLite's write
    lock for as long as it is frozen: nothing could write, the next conductor included
    (an outage it rides out), which is SQLite's limit, not this test's scenario."""
    import sqlite3

    for _ in range(50):
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.05)  # stopped by now
        probe = sqlite3.connect(db, timeout=0.2, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:
            proc.send_signal(signal.SIGCONT)  # caught mid-commit: let it finish, again
            time.sleep(0.02)
        finally:
            probe.close()
    raise AssertionError("could not stop the conductor between two of its commits")


def _owner(db: str, sid: int) -> str | None:
    shown = _cli(db, "strategy", "show", str(sid), "--format", "json")
    return json.loads(shown.stdout)["owner"]  # type: ignore[no-any-return]


def _read(db: str, sql: str, *params: object) -> Any:
    """One value read straight from the SQLite file: a poll that costs no process (a
    ``strategy show`` per look took a second or more on a loaded machine, so a freeze
    meant for mid-rollout came near its end)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        row = conn.execute(sql, params).fetchone()
        return None if row is None else row[0]
    finally:
        conn.close()


def _registered(db: str, pid: int) -> bool:
    """Whether a conductor of process ``pid`` has registered in the database."""
    store = open_store(db)
    try:
        with store.read() as conn:
            row = conn.exec_driver_sql(
                f"SELECT 1 FROM conductors WHERE pid = {int(pid)} AND stopped_at IS NULL"
            ).first()
        return row is not None
    finally:
        store.dispose()


def _slow_strategy(db: str) -> int:
    """A new database with one target whose operations take a minute, and a ``patch``
    strategy over it (not applied): its id."""
    assert _cli(db, "init").returncode == 0
    assert _cli(db, "target", "add", "slow", "--set", "latency_ms=60000").returncode == 0
    created = _cli(db, "strategy", "create", "--workflow", "patch", "--all", "--format", "json")
    return int(json.loads(created.stdout)["id"])


def _once_claimed(
    db: str, sid: int, args: list[str], act: Callable[[subprocess.Popen[str]], None]
) -> tuple[int, str]:
    """Run ``fleetwave ARGS --db DB``; once it has claimed strategy ``sid``, ``act`` on
    it; then wait for it to end (30 s at most). Its exit code and stderr."""
    proc = subprocess.Popen(
        [*FLEETWAVE, *args, "--db", db], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(f"{args[0]} to claim strategy {sid}", lambda: _owner(db, sid) is not None)
        act(proc)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def _wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_frozen_conductor_is_taken_over_and_fenced_off_when_it_wakes(
    tmp_path: Path, short_lease: float
) -> None:
    """The seeds' zombie, with real processes: a ``serve`` frozen (SIGSTOP, as a long
    pause) past its lease is taken over by another ``serve``; woken up, it writes
    nothing more for the strategy, and no state of any step is entered twice."""
    db = str(tmp_path / "frozen.db")
    assert _cli(db, "init").returncode == 0
    csv = tmp_path / "fleet.csv"
    csv.write_text(
        "name,latency_ms\n" + "".join(f"s{i:03d},300\n" for i in range(60)), encoding="utf-8"
    )
    assert _cli(db, "target", "import", str(csv)).returncode == 0
    created = _cli(
        db, "strategy", "create", "--workflow", "patch", "--all", "--max-parallel", "10",
        "--format", "json",
    )  # fmt: skip
    sid = json.loads(created.stdout)["id"]

    def serve() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*FLEETWAVE, "serve", "--lease-ttl", f"{short_lease:g}", "--db", db],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first = serve()
    second: subprocess.Popen[str] | None = None
    try:
        assert _cli(db, "strategy", "apply", str(sid)).returncode == 0
        owner_now = lambda: _read(db, "SELECT owner FROM strategies WHERE id = ?", sid)  # noqa: E731
        _wait_for("the first serve to claim it", lambda: owner_now() is not None)
        a = _owner(db, sid)
        assert a == owner_now()
        steps_done = lambda: _read(  # noqa: E731
            db, "SELECT count(*) FROM steps WHERE strategy_id = ? AND state = 'complete'", sid
        )
        _wait_for("a few steps to complete", lambda: steps_done() >= 5)
        _freeze_between_transactions(first, db)
        frozen_at = time.monotonic()
        second = serve()
        seen: list[str | None] = []

        def taken_over() -> bool:
            # the owner as seen taking over: read again later it may be None already (the
            # strategy complete), when the freeze came late on a loaded machine
            seen.append(owner_now())
            return seen[-1] not in (None, a)

        _wait_for("the second serve to take it over", taken_over)
        b = seen[-1]
        # Not before the lease ran out: the frozen process is still there (it renewed
        # a third of a lease before it froze, at most).
        assert time.monotonic() - frozen_at >= short_lease * 0.6
        first.send_signal(signal.SIGCONT)
        _wait_for(
            "the strategy to complete",
            lambda: (
                json.loads(_cli(db, "strategy", "show", str(sid), "--format", "json").stdout)[
                    "state"
                ]
                == "complete"
            ),
            timeout_s=90,
        )
    finally:
        first.send_signal(signal.SIGCONT)
        errs = []
        for proc in (first, second):
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                errs.append(proc.communicate(timeout=30)[1])
    assert first.returncode == 0 and second is not None and second.returncode == 0, errs
    # The woken conductor learnt it had lost the strategy (renewals overdue, or fenced
    # off by the new owner) and stopped acting on it.
    assert "lease-lapsing" in errs[0] or "lease lost to another conductor" in errs[0], errs[0]
    if "until its lease is renewed" in errs[0]:
        # and, once it could look, what became of it (it said only "until renewed")
        assert (
            f"strategy {sid}: taken over by conductor {b} while this conductor's lease lapsed"
            in errs[0]
            or f"strategy {sid}: complete meanwhile, under another conductor" in errs[0]
        ), errs[0]

    hist = json.loads(_cli(db, "history", "--strategy", str(sid), "--format", "json").stdout)
    assert {h["conductor"] for h in hist} == {a, b}
    by_step: dict[str, list[str]] = {}
    for h in hist:  # in the order written
        by_step.setdefault(h["target"], []).append(h["conductor"])
    for target, writers in by_step.items():
        # once the new owner wrote for a step, the old one never did again
        assert a not in writers[writers.index(b) :] if b in writers else True, (target, writers)
    # (transitions: the attempts a takeover made, listed between them, enter nothing)
    entered = [(h["target"], h["to"]) for h in hist if "attempt" not in h]
    assert len(entered) == len(set(entered))  # no state entered twice (G1)
    assert {t for t, to in entered if to == "complete"} == {f"s{i:03d}" for i in range(60)}
    checked = _cli(db, "check", "--strategy", str(sid))
    assert checked.returncode == 0, checked.stdout


def test_a_serve_whose_database_file_is_replaced_stops_and_says_so(tmp_path: Path) -> None:
    """A backup restored over the database (or the file removed and made again) while
    `serve` ran: the conductor went on writing into the old file, which nobody reads,
    and drove nothing of the new one. It stops within a tick, saying why (exit 1)."""
    db = str(tmp_path / "live.db")
    sid = _slow_strategy(db)
    backup = tmp_path / "backup.db"
    shutil.copyfile(db, backup)
    assert _cli(db, "strategy", "apply", str(sid)).returncode == 0
    # the backup, restored over the live file
    code, err = _once_claimed(db, sid, ["serve"], lambda _p: os.replace(backup, db))
    assert code == 1, err
    assert err.strip().splitlines()[-1] == (
        f"error: the database file {db} was removed or replaced while this conductor had it "
        "open (its writes would go to the old file): stopped; move the old file's -wal and "
        "-shm files aside (SQLite would replay them into the new one), then start it again "
        "on the database now at that path"
    )


def test_serve_says_serving_only_once_registered(tmp_path: Path) -> None:
    """Started while another program held the database's write lock, ``serve`` said
    "serving" at once, though it had not registered (nor claimed anything) until the
    lock went. It says it once the database answers."""
    import sqlite3

    db = str(tmp_path / "locked.db")
    assert _cli(db, "init").returncode == 0
    err_file = tmp_path / "serve.err"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another program's write transaction
    with err_file.open("w") as err:
        serve = subprocess.Popen(
            [*FLEETWAVE, "serve", "--db", db], stdout=subprocess.DEVNULL, stderr=err, text=True
        )
    try:
        time.sleep(4.0)  # the conductor's register waits for the lock meanwhile
        assert serve.poll() is None, err_file.read_text()
        assert "serving" not in err_file.read_text()
        with sqlite3.connect(db) as reader:  # nobody registered meanwhile
            assert reader.execute("SELECT count(*) FROM conductors").fetchone()[0] == 0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    try:
        _wait_for("serve to say it serves", lambda: "serving" in err_file.read_text(), 30)
        store = open_store(db)
        with store.read() as conn:
            registered = conn.execute(select(conductors.c.id)).scalars().all()
        store.dispose()
        assert len(registered) == 1
        assert f"conductor {registered[0]} serving" in err_file.read_text()
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=30) == 0, err_file.read_text()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_a_serve_whose_database_is_restored_from_a_backup_in_place_stops(tmp_path: Path) -> None:
    """A backup restored *into* the live database (SQLite's online restore: same file,
    same inode, so the file check does not see it) while ``serve`` ran: the conductor
    went on driving as if nothing had happened, from leases and fences of a database
    that no longer had them. Its next renewal finds its own row gone: it stops, writing
    nothing, and says what to do (exit 1)."""
    import sqlite3

    db = str(tmp_path / "live.db")
    sid = _slow_strategy(db)
    assert _cli(db, "strategy", "apply", str(sid)).returncode == 0
    backup = tmp_path / "backup.db"
    with sqlite3.connect(db) as src, sqlite3.connect(backup) as dst:
        src.backup(dst)  # taken before the conductor started: it has no row there
    inode = os.stat(db).st_ino

    def restore(_proc: subprocess.Popen[str]) -> None:
        with sqlite3.connect(backup) as src, sqlite3.connect(db) as dst:
            src.backup(dst)  # restored in place, through SQLite's locks
        assert os.stat(db).st_ino == inode

    code, err = _once_claimed(db, sid, ["serve", "--lease-ttl", "15"], restore)
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: the database {db} no longer knows this conductor"), err
    assert "run 'fleetwave check'" in last, last
    # It wrote nothing into the restored database: the strategy is as the backup has it.
    shown = json.loads(_cli(db, "strategy", "show", str(sid), "--format", "json").stdout)
    assert shown["owner"] is None and shown["state"] == "applying", shown
    store = open_store(db)
    with store.read() as conn:
        assert conn.execute(select(conductors.c.id)).all() == []
    store.dispose()


def test_a_second_ctrl_c_of_apply_wait_says_how_to_go_on(tmp_path: Path) -> None:
    """The second Ctrl-C stops ``apply --wait`` at once: it exited 130 without a word,
    where the first one's clean stop says what is left and how to go on."""
    db = str(tmp_path / "twice.db")
    sid = _slow_strategy(db)

    def ctrl_c_twice(proc: subprocess.Popen[str]) -> None:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)

    code, err = _once_claimed(db, sid, ["strategy", "apply", str(sid), "--wait"], ctrl_c_twice)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == (
        f"stopped at once: strategy {sid} is still applying; its leases were not handed "
        f"back and run out within 30 s. Go on with 'fleetwave strategy apply {sid} --wait' "
        "or 'fleetwave serve' (they take over then)"
    ), err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_serve_at_once_and_says_so(tmp_path: Path, sig: int) -> None:
    """serve stopped silently on the second signal: exit 130 for Ctrl-C and 143 (killed
    by SIGTERM) for a service manager's second SIGTERM. Now both say what is left, 130."""
    db = str(tmp_path / "serve2.db")
    sid = _slow_strategy(db)
    assert _cli(db, "strategy", "apply", str(sid)).returncode == 0

    def twice(proc: subprocess.Popen[str]) -> None:
        proc.send_signal(sig)
        time.sleep(0.5)
        proc.send_signal(sig)

    code, err = _once_claimed(db, sid, ["serve", "--lease-ttl", "15"], twice)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == (
        "stopped at once: the leases were not handed back and run out within 15 s; the "
        "next conductor takes over then"
    ), err


def test_ctrl_c_of_an_apply_wait_that_only_watches_says_who_drives_on(tmp_path: Path) -> None:
    """It said the stop of a conductor it was not (running actions finish, leases handed
    back) while serve drove the strategy on."""
    db = str(tmp_path / "watch.db")
    sid = _slow_strategy(db)
    serve = subprocess.Popen(
        [*FLEETWAVE, "serve", "--db", db], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert _cli(db, "strategy", "apply", str(sid)).returncode == 0
        _wait_for("serve to claim it", lambda: _owner(db, sid) is not None)
        owner = _owner(db, sid)
        watcher = subprocess.Popen(
            [*FLEETWAVE, "strategy", "apply", str(sid), "--wait", "--db", db],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # it has started and is watching (registered: on a loaded machine its imports
        # alone took more than the 2 s this test once slept, and Ctrl-C came first)
        _wait_for("the watcher to register", lambda: _registered(db, watcher.pid))
        watcher.send_signal(signal.SIGINT)
        _out, err = watcher.communicate(timeout=30)
        assert watcher.returncode == 130, err
        lines = err.strip().splitlines()
        assert (
            f"stopping: this command does not drive strategy {sid}; conductor {owner} drives it on"
            in lines
        ), err
        assert lines[-1] == (
            f"stopped: strategy {sid} is still applying; conductor {owner} drives it on"
        ), err
        assert _owner(db, sid) == owner  # serve drives on
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=30)


def test_serve_started_with_sighup_ignored_keeps_serving_on_sighup(tmp_path: Path) -> None:
    """Under nohup (SIGHUP ignored from the start) a SIGHUP stopped serve: the handler
    for a closed terminal replaced the ignore its operator asked for."""
    db = str(tmp_path / "nohup.db")
    sid = _slow_strategy(db)
    assert _cli(db, "strategy", "apply", str(sid)).returncode == 0
    proc = subprocess.Popen(
        [*FLEETWAVE, "serve", "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # as nohup does
    )
    try:
        _wait_for("serve to claim it", lambda: _owner(db, sid) is not None)
        proc.send_signal(signal.SIGHUP)
        time.sleep(2)
        assert proc.poll() is None, proc.communicate()
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def _apply_wait_json(db: str, sid: int) -> subprocess.Popen[str]:
    """`strategy apply SID --wait --format json` started in the background."""
    return subprocess.Popen(
        [*FLEETWAVE, "strategy", "apply", str(sid), "--wait", "--format", "json", "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _locked(db: str) -> sqlite3.Connection:
    """Another program holding the database's write lock (until rolled back)."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_apply_wait_waits_out_a_database_locked_at_its_start(tmp_path: Path) -> None:
    """`apply --wait` gave up after 5 s (exit 1) on a database locked by another program
    when it started, while the conductor it starts rides such an outage out: its first
    write (the strategy marked applying) now waits too, and says so once."""
    db = str(tmp_path / "locked.db")
    assert _cli(db, "init").returncode == 0
    assert _cli(db, "target", "add", "a", "--set", "latency_ms=10").returncode == 0
    created = _cli(db, "strategy", "create", "--workflow", "patch", "--all", "--format", "json")
    sid = int(json.loads(created.stdout)["id"])
    lock = _locked(db)
    proc = _apply_wait_json(db, sid)
    try:
        assert proc.stderr is not None
        said = proc.stderr.readline()  # once a write has waited its 5 s
        assert said.startswith(
            "waiting: the database does not answer (database is locked: another program "
            f"holds its write lock); strategy {sid} is applied and driven here once it does"
        ), said
        assert proc.poll() is None  # still waiting, not failed
        lock.rollback()
        out, err = proc.communicate(timeout=60)
    finally:
        lock.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out)["state"] == "complete"


def test_ctrl_c_of_apply_wait_waiting_for_a_locked_database_changes_nothing(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "locked2.db")
    sid = _slow_strategy(db)
    lock = _locked(db)
    proc = subprocess.Popen(
        [*FLEETWAVE, "strategy", "apply", str(sid), "--wait", "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().startswith("waiting: the database does not answer")
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    finally:
        lock.rollback()
        lock.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        f"stopped: strategy {sid} was not applied (the database did not answer); nothing changed"
    ), err
    shown = _cli(db, "strategy", "show", str(sid), "--format", "json")
    assert json.loads(shown.stdout)["state"] == "initial"


def test_a_callback_sent_with_the_cli_moves_a_waiting_step_on(tmp_path: Path) -> None:
    """A wait-for-callback state could only be answered by the simulator's own agents
    (in the conductor's process): nothing outside could report (an acceptance pass).
    `fleetwave step callback` stores the report; the conductor driving the strategy in
    another process answers it."""
    db = str(tmp_path / "cb.db")
    wf = tmp_path / "agent.yaml"
    wf.write_text(
        "name: agent-wf\nstates:\n  - name: prep\n  - name: wait-agent\n"
        "    mode: wait-for-callback\n    timeout_s: 60\n",
        encoding="utf-8",
    )
    assert _cli(db, "init").returncode == 0
    assert _cli(db, "workflow", "add", str(wf)).returncode == 0
    # the simulated agent never reports: only the CLI does
    added = _cli(
        db, "target", "add", "a", "--set", "callback_lost_rate=1", "--set", "latency_ms=10"
    )
    assert added.returncode == 0
    created = _cli(db, "strategy", "create", "--workflow", "agent-wf", "--all", "--format", "json")
    sid = int(json.loads(created.stdout)["id"])
    early = _cli(db, "step", "callback", "1", "nope")
    assert early.returncode == 2, early.stderr
    assert early.stderr.strip() == (
        f"error: STATE: 'nope' is not a state of strategy {sid}'s workflow (prep, wait-agent)"
    )
    bad = _cli(db, "step", "callback", "1", "wait-agent", "--kind", "maybe")
    assert (
        bad.stderr.strip() == "error: --kind: must be one of done, failed, heartbeat, got 'maybe'"
    )
    assert (
        _cli(db, "step", "callback", "9", "wait-agent").stderr.strip() == "error: step 9 not found"
    )
    driver = _apply_wait_json(db, sid)
    try:

        def waiting() -> bool:
            shown = _cli(db, "step", "show", "1", "--format", "json")
            return bool(json.loads(shown.stdout)["state"] == "wait-agent")

        _wait_for("the step to wait for its callback", waiting)
        sent = _cli(db, "step", "callback", "1", "wait-agent", "--details", "agent up")
        assert sent.returncode == 0, sent.stderr
        assert sent.stdout.startswith("callback 1 for step 1 (wait-agent, done) stored")
        assert "warning" not in sent.stderr  # a conductor drives it
        out, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, err
    assert json.loads(out)["state"] == "complete"
    shown = json.loads(_cli(db, "step", "show", "1", "--format", "json").stdout)
    ((cb),) = shown["callbacks"]
    assert (cb["details"], cb["outcome"]) == ("agent up", "applied"), cb
    late = _cli(db, "step", "callback", "1", "wait-agent", "--format", "json")
    assert late.returncode == 0, late.stderr
    assert json.loads(late.stdout) == {
        "id": 2,
        "step": 1,
        "strategy": sid,
        "state": "wait-agent",
        "kind": "done",
        "visit": 1,
        "outcome": "ignored",
        "reason": "late: step already complete",
    }


def test_serve_says_what_it_hands_back_at_a_clean_stop(tmp_path: Path) -> None:
    """serve's log said nothing of the strategies it drove: at a clean stop it now says
    which it handed back, with where each stood (and that the next conductor goes on)."""
    db = str(tmp_path / "back.db")
    sid = _slow_strategy(db)
    assert _cli(db, "strategy", "apply", str(sid)).returncode == 0

    def ctrl_c(proc: subprocess.Popen[str]) -> None:
        time.sleep(1.5)  # its first line (taken on) is said within a second
        proc.send_signal(signal.SIGINT)

    code, err = _once_claimed(db, sid, ["serve"], ctrl_c)
    assert code == 0, err
    said = [x for x in err.splitlines() if f" strategy {sid}: " in x]
    assert len(said) == 2, err
    assert said[0].endswith("0 of 1 step ended, 1 under way, 0 waiting; applying (taken on)"), said
    assert said[1].endswith(
        "0 of 1 step ended, 1 under way, 0 waiting; applying "
        "(handed back: the next conductor goes on with it)"
    ), said
    assert err.strip().splitlines()[-1].endswith("stopped; leases handed back"), err
