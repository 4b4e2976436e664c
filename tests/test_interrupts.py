"""Ctrl-C, SIGTERM and SIGHUP: a command stops in one line, rolls back what it was
writing, and says how to go on; a conductor hands its leases back."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_harness import Cli
from fleetwave.store import admin
from fleetwave.store.db import Store
from test_cli_strategy import add, apply_wait, create


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


FLEETWAVE = [sys.executable, "-m", "fleetwave.cli.main"]


def test_ctrl_c_on_apply_wait_stops_cleanly_and_hands_leases_back(tmp_path: Path) -> None:
    db = str(tmp_path / "f.db")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*FLEETWAVE, *args, "--db", db], capture_output=True, text=True, timeout=60
        )

    assert run("init").returncode == 0
    for i in range(4):
        assert run("target", "add", f"s{i}", "--set", "latency_ms=2000").returncode == 0
    assert run("strategy", "create", "--workflow", "patch", "--all").returncode == 0
    proc = subprocess.Popen(
        [*FLEETWAVE, "strategy", "apply", "1", "--wait", "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shown = json.loads(run("strategy", "show", "1", "--format", "json").stdout)
        if shown["owner"] is not None:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "stopping: running actions finish" in err
    assert "stopped: strategy 1 is still applying; leases handed back" in err
    shown = json.loads(run("strategy", "show", "1", "--format", "json").stdout)
    assert (shown["state"], shown["owner"]) == ("applying", None)
    assert run("check").returncode == 0


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
