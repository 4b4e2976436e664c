"""The CLI as scripts and pipelines use it: piped tables, a reader that goes away, a
stdout that cannot show every name. From a scripting audit (session 12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_harness import Cli

FLEETWAVE = [sys.executable, "-m", "fleetwave.cli.main"]


def _run(
    db: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FLEETWAVE, *args, "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_piped_tables_are_one_line_per_row_whatever_the_width(
    cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Piped, a drawn table wrapped a long settings cell over two lines (grep saw half a
    row) and changed its shape with $COLUMNS: now plain columns, a line per row."""
    monkeypatch.setenv("COLUMNS", "40")
    assert (
        cli("target", "add", "t05", "--set", "flaky_rate=0.05", "--set", "latency_ms=250").code == 0
    )
    assert cli("target", "add", "t06").code == 0
    lines = cli("target", "list").out.splitlines()
    assert lines[0].split() == ["name", "group", "driver", "managed", "settings", "labels"]
    assert set(lines[1]) <= {"-", " "}
    assert len(lines) == 4  # header, rule, two rows
    assert lines[2].split()[0] == "t05" and '"latency_ms": 250}' in lines[2]
    assert not any(c in "".join(lines) for c in "┃│┏━")
    shown = cli("target", "show", "t05").out.splitlines()
    assert shown[0].split() == ["name", "t05"]
    settings = next(line for line in shown if line.startswith("settings"))
    assert settings.split(None, 1)[1] == '{"flaky_rate": 0.05, "latency_ms": 250}'


def test_a_reader_that_goes_away_ends_the_command_with_141_and_no_message(
    tmp_path: Path,
) -> None:
    """`fleetwave target list | head -1` exited 1 (Click's answer to EPIPE), which the
    exit-code table says means "no" or "the database failed"; racy too (0 when the
    output fit in the pipe). Now 141, as for any command SIGPIPE ends, and silent."""
    db = tmp_path / "f.db"
    rows = "name,driver\n" + "".join(f"t{i:05d},sim\n" for i in range(3000))
    (tmp_path / "t.csv").write_text(rows, encoding="utf-8")
    assert _run(db, "target", "import", str(tmp_path / "t.csv")).returncode == 0
    for fmt in ("json", "table"):
        proc = subprocess.Popen(
            [*FLEETWAVE, "target", "list", "--format", fmt, "--db", str(db)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()  # as `head -1` does
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 141, err
        assert err == b"", err


def test_a_stdout_that_cannot_show_a_name_gets_it_escaped_not_a_traceback(
    tmp_path: Path,
) -> None:
    db = tmp_path / "f.db"
    assert _run(db, "target", "add", "ñandú").returncode == 0
    for args in (("target", "list"), ("target", "show", "ñandú")):
        res = _run(db, *args, env={"PYTHONIOENCODING": "ascii"})
        assert res.returncode == 0, res.stderr
        assert "Traceback" not in res.stderr
        assert "\\xf1and\\xfa" in res.stdout
    listed = _run(db, "target", "list", "--format", "json", env={"PYTHONIOENCODING": "ascii"})
    assert json.loads(listed.stdout)[0]["name"] == "ñandú"
    # the columns after an escaped name stay in line (they were set by the name's width)
    assert _run(db, "target", "add", "b").returncode == 0
    lines = _run(db, "target", "list", env={"PYTHONIOENCODING": "ascii"}).stdout.splitlines()
    driver_at = {line.index("sim") for line in lines[2:]}
    assert len(driver_at) == 1 and lines[0].index("driver") in driver_at, lines


def test_output_printed_by_rich_also_ends_with_141_when_the_reader_goes_away() -> None:
    """Rich answered a closed pipe itself, with exit 1 (the sim's lines, messages)."""
    proc = subprocess.Popen(
        [*FLEETWAVE, "sim", "--runs", "20", "--targets", "40"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == b"", err


def test_a_closed_stdout_does_not_fail_a_command_that_did_its_work(tmp_path: Path) -> None:
    """`fleetwave target add x >&-` (cron, some daemons): Python has no stdout then."""
    db = tmp_path / "f.db"
    for args in (
        ("target", "add", "x"),
        ("target", "list"),
        ("target", "list", "--format", "json"),
    ):
        res = subprocess.run(
            [*FLEETWAVE, *args, "--db", str(db)],
            capture_output=False,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            preexec_fn=lambda: os.close(1),
        )
        assert res.returncode == 0, res.stderr
        assert res.stderr == "", res.stderr
    assert json.loads(_run(db, "target", "list", "--format", "json").stdout)[0]["name"] == "x"


def test_commands_that_change_something_answer_in_json(cli: Cli, tmp_path: Path) -> None:
    """A script had to parse sentences to tell 'added' from 'already there', or an abort
    asked now from one asked before."""

    def answer(*args: str) -> object:
        res = cli(*args, "--format", "json")
        assert res.code == 0, res.text
        return res.json()

    assert answer("group", "add", "east") == {"name": "east", "added": True}
    assert answer("group", "add", "east") == {"name": "east", "added": False}
    assert answer("target", "add", "a", "--group", "east") == {"name": "a", "added": True}
    assert answer("target", "add", "a", "--group", "east") == {"name": "a", "added": False}
    f = tmp_path / "fleet.csv"
    f.write_text("name,group\na,east\nb,east\n", encoding="utf-8")
    assert answer("target", "import", str(f)) == {
        "file": str(f),
        "imported": 1,
        "unchanged": 1,
        "managed_kept": [],
    }
    sid = int(cli("strategy", "create", "--workflow", "patch", "--all").out.split()[1])
    assert answer("strategy", "abort", str(sid)) == {
        "id": sid,
        "state": "aborted",
        "asked_now": True,
    }  # never applied: aborted at once
    assert answer("strategy", "abort", str(sid)) == {
        "id": sid,
        "state": "aborted",
        "asked_now": False,
    }
    assert cli("strategy", "delete", str(sid)).code == 0
    sid = int(cli("strategy", "create", "--workflow", "patch", "--all").out.split()[1])
    assert cli("strategy", "apply", str(sid)).code == 0
    assert answer("strategy", "pause", str(sid)) == {
        "id": sid,
        "state": "paused",
        "was": "applying",
    }
    assert answer("strategy", "pause", str(sid)) == {"id": sid, "state": "paused", "was": "paused"}
    assert answer("strategy", "resume", str(sid)) == {
        "id": sid,
        "state": "applying",
        "was": "paused",
    }
    assert answer("strategy", "abort", str(sid)) == {
        "id": sid,
        "state": "abort-requested",
        "asked_now": True,
    }
    assert answer("strategy", "abort", str(sid)) == {
        "id": sid,
        "state": "abort-requested",
        "asked_now": False,
    }
    # (its step is not started, but its strategy is being aborted: it will not fail)
    assert answer("target", "unmanage", "b") == {"name": "b", "managed": False, "steps_to_fail": []}
    assert answer("target", "manage", "b") == {"name": "b", "managed": True}
    assert cli("strategy", "delete", str(sid)).code == 2  # still aborting: refused
    assert answer("group", "add", "west") == {"name": "west", "added": True}
    assert answer("target", "add", "c") == {"name": "c", "added": True}
    assert answer("target", "delete", "c") == {"name": "c", "deleted": True}
    assert cli("target", "add", "d").code == 0
    other = int(cli("strategy", "create", "--workflow", "patch", "--targets", "d").out.split()[1])
    assert answer("strategy", "delete", str(other)) == {"id": other, "deleted": True}


def test_the_demo_piped_prints_plain_tables_and_says_what_fails_on_purpose(
    tmp_path: Path,
) -> None:
    """Piped, the demo's tables were drawn boxes (every other table prints plain
    columns); and a newcomer's first run showed failures with nothing saying they were
    the simulator's, on purpose (an acceptance pass)."""
    db = tmp_path / "demo.db"
    res = _run(db, "demo", "--targets", "20", "--latency-ms", "0")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert not any(c in res.stdout for c in "┏┃━"), res.stdout
    (purpose,) = [line for line in lines if line.startswith("on purpose: ")]
    assert "subcloud00011 unmanaged" in purpose and "unexpected remote state" in purpose
    assert purpose.endswith(": the failures below are the simulator's"), purpose
    assert "final state                        steps" in lines, lines
    assert lines[-1].startswith("inspect it: ") and f"--db {db}" in lines[-1], lines[-1]
